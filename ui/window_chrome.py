"""The main window's frame around the chat: the central area with its buttons, the menus and
toolbar, and the status bar's permanent widgets (ui.main_window builds them here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QStatusBar,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ui.pacing import PaceControls


def central(chat: QWidget, text_input: QWidget, send: QAction, stop: QAction) -> QWidget:
    """The chat above the input box, Send and Stop beside it."""
    send_button = QToolButton()
    send_button.setDefaultAction(send)
    stop_button = QToolButton()
    stop_button.setDefaultAction(stop)
    buttons = QVBoxLayout()
    buttons.addWidget(send_button)
    buttons.addWidget(stop_button)
    buttons.addStretch(1)
    row = QHBoxLayout()
    row.addWidget(text_input, 1)
    row.addLayout(buttons)
    widget = QWidget()
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(6, 6, 6, 6)
    layout.addWidget(chat, 1)
    layout.addLayout(row)
    return widget


def action(
    window: QMainWindow,
    text: str,
    shortcut: str | QKeySequence | QKeySequence.StandardKey | None,
    slot: Callable[[], object],
    tip: str,
) -> QAction:
    """A window's action with its shortcut in its tooltip, working wherever the focus is."""
    made = QAction(text, window)
    if shortcut is not None:
        made.setShortcut(QKeySequence(shortcut))
    made.setToolTip(f"{tip} ({made.shortcut().toString()})" if shortcut else tip)
    made.setStatusTip(tip)
    made.triggered.connect(slot)
    window.addAction(made)
    return made


def menus_and_toolbar(
    window: QMainWindow,
    file_actions: Sequence[QAction | None],
    chat_actions: Sequence[QAction],
    tools: Sequence[QAction],
    settings_dock: QDockWidget,
    pace: PaceControls,
    stop: QAction,
) -> tuple[QMenu, QMenu, QToolBar]:
    """File, Chat, View and Step menus and the Chat toolbar; returns the Chat and View menus
    (the docks add their toggles to the View menu) and the toolbar. None in `file_actions`: a
    separator."""
    file_menu = window.menuBar().addMenu("&File")
    for action in file_actions:
        if action is None:
            file_menu.addSeparator()
        else:
            file_menu.addAction(action)
    chat_menu = window.menuBar().addMenu("&Chat")
    for action in chat_actions:
        chat_menu.addAction(action)
    view_menu = window.menuBar().addMenu("&View")
    view_menu.addAction(settings_dock.toggleViewAction())
    toolbar = window.addToolBar("Chat")
    toolbar.setObjectName("chat_toolbar")
    for action in tools:
        toolbar.addAction(action)
    pace.add_to(toolbar)
    step_menu = window.menuBar().addMenu("&Step")
    for action in pace.actions:
        step_menu.addAction(action)
    step_menu.addAction(stop)
    view_menu.addAction(toolbar.toggleViewAction())
    return chat_menu, view_menu, toolbar


class SteadyLabel(QLabel):
    """A status bar label whose text changes while a reply streams. A QLabel's new text asks
    its parents to lay out again, and in the status bar that relays the whole main window, its
    docks included, once per delivery of events. This label keeps a fixed size, the widest
    text it has held, so a new text only repaints it; it grows when a text needs more room and
    gives its room back when emptied."""

    def setText(self, text: str) -> None:
        super().setText(text)
        needed = self.sizeHint()
        if not text:
            needed.setWidth(0)
        elif needed.width() <= self.minimumWidth():
            needed.setWidth(self.minimumWidth())
        if needed != self.minimumSize() or needed != self.maximumSize():
            self.setFixedSize(needed)


class StatusBar:
    """The status bar's permanent widgets: a load's progress, the model, context, speed."""

    def __init__(self, bar: QStatusBar) -> None:
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 100)
        self.load_progress.setMaximumWidth(160)
        self.load_progress.setVisible(False)
        self.model_label = QLabel("No model loaded")
        self.context_label = SteadyLabel()
        self.context_label.setToolTip(
            "Context used: the prompt and the reply so far, in tokens / the model's maximum"
        )
        self.speed_label = SteadyLabel()
        for widget in (self.load_progress, self.model_label, self.context_label,
                       self.speed_label):  # fmt: skip
            bar.addPermanentWidget(widget)
