"""A teacher's pace on the toolbar: Pause, Next token, Play slowly (at a rate), Resume.

The controls send the engine's pacer what to do (MainWindow's backend `pace`); Stop stays the
window's own action and works at any point. The line beside them says what the engine does:
"held after step N" only once the engine reported that it waits (app.server.wire.Held, after that
step's token), "pausing" or "stepping" while a paused reply still runs to its next hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QDoubleSpinBox, QLabel, QToolBar, QWidget

Mode = Literal["run", "paused", "slow"]
# Function keys: the message box keeps every letter, arrow and Ctrl+arrow for itself. A
# debugger's keys: F5 runs on, F10 steps.
SHORTCUTS = {"pause": "F6", "step": "F10", "play": "F8", "resume": "F5"}
STATE_STYLE = {
    "run": "",
    "paused": "QLabel { background: #fff4c2; color: #202020; padding: 2px 6px; }",
    "slow": "QLabel { background: #d7f0dd; color: #202020; padding: 2px 6px; }",
}


class PaceControls(QObject):
    """The toolbar's stepping actions and the line saying what the reply is doing.

    `send(action, rate)` reaches the engine's pacer; `mode_changed(str)` says "run", "paused"
    or "slow" whenever that changes (the internals panels explain steps when it is not "run").
    """

    mode_changed = Signal(str)

    def __init__(self, window: QWidget, send: Callable[[str, float], None]) -> None:
        super().__init__(window)
        self._window, self._send = window, send
        self.mode: Mode = "run"
        self._replying = False
        self.held = False  # the engine said it holds the reply (set_held)
        self._held_after: int | None = None  # the step whose token came before the hold
        self._stepping = False  # Next token pressed; the engine has not held again yet
        self.pause_action = self._action("Pause", "pause", self.pause, "Hold the reply")
        self.next_action = self._action(
            "Next token", "step", self.next_token, "Let one token through, then hold"
        )
        self.play_action = self._action(
            "Play slowly", "play", self.play, "Go on at the rate beside it"
        )
        self.resume_action = self._action("Resume", "resume", self.resume, "Full speed again")
        self.rate = QDoubleSpinBox()
        self.rate.setRange(0.1, 50.0)
        self.rate.setDecimals(1)
        self.rate.setSingleStep(0.5)
        self.rate.setValue(2.0)
        self.rate.setSuffix(" tokens/s")
        self.rate.setToolTip("The pace of Play slowly")
        self.rate.valueChanged.connect(self._on_rate)
        self.state_label = QLabel()
        self._show()

    def _action(self, text: str, key: str, slot: Callable[[], None], tip: str) -> QAction:
        action = QAction(text, self._window)
        action.setShortcut(QKeySequence(SHORTCUTS[key]))
        action.setToolTip(f"{tip} ({SHORTCUTS[key]})")
        action.setStatusTip(tip)
        action.triggered.connect(slot)
        self._window.addAction(action)  # the shortcut works wherever the focus is
        return action

    def add_to(self, toolbar: QToolBar) -> None:
        toolbar.addSeparator()
        for action in (self.pause_action, self.next_action, self.play_action):
            toolbar.addAction(action)
        toolbar.addWidget(self.rate)
        toolbar.addAction(self.resume_action)
        toolbar.addWidget(self.state_label)

    @property
    def actions(self) -> tuple[QAction, ...]:
        return (self.pause_action, self.next_action, self.play_action, self.resume_action)

    # -- controls --------------------------------------------------------------------------

    def pause(self) -> None:
        self._send("pause", 0.0)
        self._set("paused")

    def next_token(self) -> None:
        self._send("step", 0.0)
        self._stepping = self._replying
        self._set("paused")

    def play(self) -> None:
        self._send("play", self.rate.value())
        self._set("slow")

    def resume(self) -> None:
        self._send("resume", 0.0)
        self._set("run")

    # -- the window's side -----------------------------------------------------------------

    def reply_started(self, pause_after_prefill: bool) -> None:
        """A reply began; the engine holds it after its prefill when the setting says so."""
        self.held, self._held_after, self._stepping = False, None, False
        if pause_after_prefill:
            self._set("paused")

    def set_replying(self, replying: bool) -> None:
        self._replying = replying
        if not replying:
            self.held = False
        self._show()

    def set_held(self, held: bool, after_step: int | None) -> None:
        """The engine holds the reply (after decode step `after_step`; None: after its prefill)
        or lets it go on."""
        self.held, self._held_after = held, after_step
        if held:
            self._stepping = False
        self._show()

    def _on_rate(self, _rate: float) -> None:
        if self.mode == "slow":
            self.play()

    def _set(self, mode: Mode) -> None:
        changed = mode != self.mode
        self.mode = mode
        self._show()
        if changed:
            self.mode_changed.emit(mode)

    def _show(self) -> None:
        """The buttons a mode allows, and the mode in words, for the back of the room."""
        self.next_action.setEnabled(self._replying)
        self.pause_action.setEnabled(self.mode != "paused")
        self.resume_action.setEnabled(self.mode != "run")
        texts = {
            "run": "full speed",
            "paused": self._paused_text(),
            "slow": f"▶ playing {self.rate.value():g} tokens a second",
        }
        self.state_label.setText(texts[self.mode])
        self.state_label.setStyleSheet(STATE_STYLE[self.mode])

    def _paused_text(self) -> str:
        if not self._replying:
            return "‖ paused"
        if not self.held:  # asked to hold, but the engine still runs to the next hold
            if self._stepping:
                return "▶ Next token: one step running, then paused"
            return "‖ paused at the next step (the engine finishes this one)"
        after = "the prefill" if self._held_after is None else f"step {self._held_after}"
        return f"‖ paused after {after}: Next token (F10) steps"
