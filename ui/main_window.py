"""The main window: the chat in the middle, dock widgets around it, actions and a status bar.

The window talks to the model only through a backend object (app.client.engine_client.EngineClient
in the program) whose signals arrive in the GUI thread; it never runs model work.
The conversation is a ui.conversation.Conversation the window owns and changes in the order
things happen; the chat view draws its changes and the store (app.window.controller) writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QRect, QSettings, Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import QDockWidget, QMainWindow, QWidget

from engine.events import Event, Finished, ModelInfo, PrefillDone, Token
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings, SettingsError
from ui import layout
from ui import window_chrome as chrome
from ui.backend import Backend
from ui.chat_view import ChatView
from ui.conversation import Conversation, Entry, ReplyState
from ui.input_box import EMPTY_MESSAGE, InputBox
from ui.model_picker import ModelPicker
from ui.pacing import PaceControls
from ui.reply_stats import finished_stats, prefill_line, speed_line, stats_line
from ui.settings_panel import SettingsPanel
from ui.status_lines import dropped_line, human_count, model_line

__all__ = ["WAITING", "Backend", "MainWindow", "dropped_line", "human_count", "model_line"]

STATUS_MS = 6000
WAITING = "Waiting for the model: your message is answered as soon as it has loaded."
STATE_VERSION = 4  # bump when the set of docks changes: older layouts are then ignored


class MainWindow(QMainWindow):
    """The chat and its actions. `conversation_model` holds the conversation (the chat view
    draws it, the store writes it).

    Signals, all in the GUI thread: `events_received(list)` per batch of engine events, the
    reply's and any other, once the conversation took them in (the internals panels,
    benchmarks and tests listen here); `conversation_changed()` after the user's message, the
    reply or the chat changed; `chat_reset()`; `model_changed(ModelInfo)`."""

    events_received = Signal(object)
    conversation_changed = Signal()
    # Another conversation begins (New chat, or a stored one opened): the replies shown so far
    # belong to the old one.
    chat_reset = Signal()
    model_changed = Signal(object)

    def __init__(
        self,
        backend: Backend,
        settings: QSettings | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Glassbox")
        self.resize(layout.first_start_geometry(layout.available_geometry(self)).size())
        self.backend = backend
        self._qsettings = settings if settings is not None else QSettings()
        self.conversation_model = Conversation()
        self._probes = ProbeSettings()
        self._loading = 0
        self._info: ModelInfo | None = backend.info
        self._last_request = LoadRequest()
        self._picker: ModelPicker | None = None
        self._proposal: LoadRequest | None = None  # the failing load's placement that fits
        self._closed = False
        self._last_step: int | None = None  # the latest token's step in the reply under way

        self.chat = ChatView(self.conversation_model)
        self.input = InputBox()
        self.settings_panel = SettingsPanel()
        self._make_actions()
        self._build_central()
        self._build_settings_dock()
        self._build_menus_and_toolbar()
        self._build_status_bar()
        self._connect_backend()
        self.restore_layout()
        self._update_actions()
        self.input.setFocus()

    # -- construction ----------------------------------------------------------------------------

    def _make_actions(self) -> None:
        self.send_action = chrome.action(
            self, "Send", "Ctrl+Return", self.input.submit, "Send the message"
        )
        self.stop_action = chrome.action(self, "Stop", "Esc", self.stop, "Stop the reply")
        self.regenerate_action = chrome.action(
            self, "Regenerate", "Ctrl+R", self.regenerate, "Answer the last message again"
        )
        self.new_chat_action = chrome.action(
            self, "New chat", QKeySequence.StandardKey.New, self.new_chat, "Start an empty chat"
        )
        open_key = QKeySequence.StandardKey.Open
        self.load_action = chrome.action(
            self, "Load model…", open_key, self.open_model_picker, "Load a model"
        )
        self.quit_action = chrome.action(
            self, "Quit", QKeySequence.StandardKey.Quit, self.close, "Quit"
        )
        self.pace = PaceControls(self, lambda action, rate: self.backend.pace(action, rate))

    def _build_central(self) -> None:
        self.setCentralWidget(chrome.central(self.chat, self.input, self.send_action,
                                             self.stop_action))  # fmt: skip
        self.input.submitted.connect(self.send)
        self.input.refused.connect(self.show_status)

    def _build_settings_dock(self) -> None:
        self.settings_dock = QDockWidget("Settings", self)
        self.settings_dock.setObjectName("settings_dock")
        self.settings_dock.setWidget(self.settings_panel)
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.settings_dock)

    def _build_menus_and_toolbar(self) -> None:
        file_actions = (self.load_action, None, self.quit_action)
        chat_actions = (self.send_action, self.stop_action, self.regenerate_action,
                        self.new_chat_action)  # fmt: skip
        tools = (self.new_chat_action, self.regenerate_action, self.stop_action, self.load_action)
        self.chat_menu, self.view_menu, self.chat_toolbar = chrome.menus_and_toolbar(
            self, file_actions, chat_actions, tools, self.settings_dock, self.pace, self.stop_action
        )
        # each token of a reply tinted by the probability the model gave it (ui.confidence)
        self.confidence_action = QAction("Token &confidence in the chat", self, checkable=True)
        self.confidence_action.toggled.connect(self.chat.show_confidence)
        self.view_menu.addAction(self.confidence_action)

    def _build_status_bar(self) -> None:
        bar = chrome.StatusBar(self.statusBar())
        self.load_progress, self.model_label = bar.load_progress, bar.model_label
        self.context_label, self.speed_label = bar.context_label, bar.speed_label

    def _connect_backend(self) -> None:
        self.backend.events.connect(self._on_events)
        self.backend.loaded.connect(self._on_loaded)
        self.backend.load_progress.connect(self._on_load_progress)
        self.backend.load_failed.connect(self._on_load_failed)
        self.backend.load_proposed.connect(self._on_load_proposed)
        self.backend.busy_changed.connect(self._on_busy_changed)
        self.backend.decode_step.connect(self._on_decode_step)
        self.backend.held_changed.connect(lambda held: self.pace.set_held(held, self._last_step))
        if self._info is not None:
            self._show_model(self._info)

    # -- docks and layout ------------------------------------------------------------------------

    def add_dock(
        self,
        dock: QDockWidget,
        area: Qt.DockWidgetArea = Qt.DockWidgetArea.RightDockWidgetArea,
    ) -> None:
        """Add a panel; where the user last left it (saved on close) wins over `area`."""
        if not dock.objectName():
            dock.setObjectName(dock.windowTitle().lower().replace(" ", "_") + "_dock")
        if not self.restoreDockWidget(dock):  # not in the saved layout: a first appearance
            self.addDockWidget(area, dock)
            dock.show()
        self.view_menu.addAction(dock.toggleViewAction())

    def restore_layout(self, screen: QRect | None = None) -> bool:
        """The layout saved on close, if it still fits `screen` (an available geometry; by
        default the window's screen's). False: it did not, and the current layout stays."""
        self._fitted_screen = screen  # saved layouts are kept per size of this screen
        available = screen if screen is not None else layout.available_geometry(self)
        screens = layout.screens_available() if screen is None else ()
        return layout.restore(self, self._qsettings, STATE_VERSION, available, screens)

    def save_layout(self) -> None:
        screen = self._fitted_screen
        available = screen if screen is not None else layout.available_geometry(self)
        layout.save(self, self._qsettings, STATE_VERSION, available)

    # -- conversation ----------------------------------------------------------------------------

    def conversation(self) -> list[Message]:
        """The user and assistant messages so far (without the system prompt)."""
        return self.conversation_model.messages()

    def prompt_messages(self) -> list[Message]:
        """What a request sends: the system prompt first when there is one, then the chat."""
        system = self.conversation_model.system_prompt
        head = [Message("system", system)] if system else []
        return head + self.conversation()

    def set_conversation(
        self, entries: Sequence[Entry], system_prompt: str = "", keep_cache: bool = False
    ) -> None:
        """Show a stored conversation; its system prompt goes to the settings panel.
        `keep_cache`: the next reply reuses the prefix it shares with the cache (an API client)."""
        self._abandon_reply()
        if system_prompt:  # one without keeps the prompt the panel shows
            self.settings_panel.set_system_prompt(system_prompt)
        self.conversation_model.load(entries, self.settings_panel.system_prompt())
        if not keep_cache:
            self.backend.reset()
        self.chat_reset.emit()
        self.conversation_changed.emit()
        self._update_actions()

    def probe_settings(self) -> ProbeSettings:
        return self._probes

    def set_probe_settings(self, probes: ProbeSettings) -> None:
        """What the next replies record (the internals panels choose)."""
        self._probes = probes

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    # -- actions ---------------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        """Add a user message and start the reply; False (with a status message) if refused."""
        reason = self._send_refusal() or (None if text.strip() else EMPTY_MESSAGE)
        if reason:
            self.show_status(reason)
            return False
        settings = self._generation_settings()
        if settings is None:
            return False
        self.conversation_model.system_prompt = self.settings_panel.system_prompt()
        self.conversation_model.add_user(text, settings, self._model_name())
        self.conversation_changed.emit()
        return self._reply_when_ready(settings)

    def regenerate(self) -> bool:
        """Drop the last reply (if any) and answer the last user message again."""
        reason = self._send_refusal()
        if reason:
            self.show_status(reason)
            return False
        if not self.conversation_model.has_user_message():
            self.show_status("Nothing to regenerate: send a message first.")
            return False
        settings = self._generation_settings()
        if settings is None:
            return False
        self.conversation_model.system_prompt = self.settings_panel.system_prompt()
        self.conversation_model.drop_last_reply()
        self.conversation_changed.emit()
        return self._reply_when_ready(settings)

    def answer(self, settings: GenerationSettings, probes: ProbeSettings) -> bool:
        """Reply to the conversation as it stands, as asked from outside the window (the API):
        its own settings, and probes that record at least what the panels watch."""
        reason = self._send_refusal() or (None if self._info else "No model is loaded.")
        if reason:
            self.show_status(reason)
            return False
        return self._start_reply(settings, probes)

    def stop(self) -> None:
        if self.conversation_model.stop_waiting() is not None:
            self.show_status("Stopped: the message waits unanswered.")
            self._update_actions()
        if self.replying:
            self.backend.stop()
            self.show_status("Stopping…")

    def new_chat(self) -> None:
        """Empty the chat and forget the session's KV cache."""
        self._abandon_reply()
        self.conversation_model.clear()
        self.backend.reset()
        self.chat_reset.emit()
        self.conversation_changed.emit()
        self._update_actions()
        self.show_status("New chat.")
        self.input.setFocus()

    @property
    def picker(self) -> ModelPicker | None:
        """The model picker while it is open."""
        return self._picker

    def open_model_picker(self) -> ModelPicker:
        if self._picker is None:
            self._picker = ModelPicker(self._last_request, self)
            self._picker.load_requested.connect(self.load_model)
            self._picker.finished.connect(self._forget_picker)
        self._picker.open()
        return self._picker

    def load_model(self, request: LoadRequest) -> None:
        """Load in the model thread; the current model stays until the new one is ready."""
        self._last_request = request
        self._loading += 1
        self.load_progress.setValue(0)
        self.load_progress.setVisible(True)
        self.show_status(f"Loading {request.spec}…", 0)
        self.backend.load(request)
        self._update_actions()

    def show_status(self, text: str, timeout_ms: int = STATUS_MS) -> None:
        self.statusBar().showMessage(text, timeout_ms)

    # -- replies ---------------------------------------------------------------------------------

    def _send_refusal(self) -> str | None:
        if self.conversation_model.state is ReplyState.WAITING:
            return WAITING
        if self._info is None:
            return None if self._loading else "No model is loaded."
        if self.replying:
            return "A reply is still streaming: press Esc to stop it."
        if self.backend.busy:
            return "The model is busy (loading): wait a moment."
        return None

    def _generation_settings(self) -> GenerationSettings | None:
        try:
            return self.settings_panel.settings()
        except SettingsError as error:
            self.show_status(str(error))
            return None

    def _model_name(self) -> str | None:
        return self._info.name if self._info is not None else None

    def _reply_when_ready(self, settings: GenerationSettings) -> bool:
        """Start the reply, or, while the first model loads, once it has loaded."""
        if self._info is not None:
            return self._start_reply(settings)
        self.conversation_model.wait_for_model(settings)
        self.chat.add_note(WAITING)
        self.show_status(WAITING, 0)
        self._update_actions()
        return True

    def _start_waiting_reply(self) -> None:
        if self._info is not None and not self.backend.busy:
            settings = self.conversation_model.stop_waiting()
            if settings is not None:
                self._start_reply(settings)

    def _on_busy_changed(self, busy: bool) -> None:
        self._update_actions()
        if not busy:
            self._start_waiting_reply()

    def _start_reply(
        self, settings: GenerationSettings, probes: ProbeSettings | None = None
    ) -> bool:
        if not self.backend.generate(self.prompt_messages(), settings, probes or self._probes):
            self.show_status("The model is busy: try again in a moment.")
            return False
        self.conversation_model.start_reply(settings, self._model_name())
        self._last_step = None
        self.pace.reply_started(settings.pause_after_prefill)
        self._update_actions()
        return True

    def _abandon_reply(self) -> None:
        """Stop showing the reply in progress; its remaining events only reach the panels."""
        if self.replying:
            self.backend.stop()
        self.conversation_model.abandon_reply()

    def _on_events(self, batch: list[Event]) -> None:
        """A batch as the backend delivered it. Its tokens reach the conversation (and so the
        chat view and the store) as one change per run of tokens, not one per token: per-token
        work was a large part of the GUI thread's cost while a reply streamed. Events that
        arrive once no reply is in progress (an abandoned reply's last) are for the panels only.
        """
        last_token = next((e for e in reversed(batch) if isinstance(e, Token)), None)
        if last_token is not None:  # the step the toolbar's state names
            self._last_step = last_token.index
        if self.replying:
            self.conversation_model.apply_many(batch)
            for event in batch:
                if isinstance(event, PrefillDone):
                    self._on_prefill(event)
                elif isinstance(event, Finished):
                    self._after_reply(event)
            reply = self.conversation_model.reply
            if last_token is not None and reply is not None and reply.prefill is not None:
                self._show_context(reply.prefill.prompt_tokens + last_token.index + 1)
        self.events_received.emit(batch)

    def _on_prefill(self, event: PrefillDone) -> None:
        self.show_status(prefill_line(event))
        self._show_context(event.prompt_tokens)
        if event.dropped_messages:
            self.show_status(dropped_line(event.dropped_messages, self._context_limit), 15000)

    def _show_context(self, tokens: int) -> None:
        """The tokens the conversation holds now (the prompt, then the reply so far) against
        the model's context window."""
        limit = self._context_limit
        self.context_label.setText(f"context {tokens:,} / {limit:,}" if limit else "")

    @property
    def _context_limit(self) -> int:
        """The loaded model's context window in tokens (0 before a model)."""
        return self._info.max_context if self._info else 0

    @property
    def replying(self) -> bool:
        """A reply to this window's conversation is streaming."""
        return self.conversation_model.replying

    def _after_reply(self, finished: Finished) -> None:
        """The reply is in the conversation (and drawn): say how it went."""
        reply = self.conversation_model.reply
        prefill = reply.prefill if reply is not None else None
        if prefill is not None and prefill.dropped_messages:
            # Noted once the reply has ended: a note while it streams would split its block.
            self.chat.add_note(dropped_line(prefill.dropped_messages, self._context_limit))
        stats = finished_stats(finished)
        if finished.generated_tokens:
            self.speed_label.setText(speed_line(stats))
        failure = reply.failure if reply is not None else None
        if failure is not None:
            self.chat.add_note(failure.message, error=True)
            self.show_status(failure.message, 15000)
        elif finished.reason == "cancelled":
            self.show_status("Stopped.")
        else:
            self.show_status(f"Done: {stats_line(stats)}")
        self.conversation_changed.emit()
        self._update_actions()

    # -- model loading ---------------------------------------------------------------------------

    def _on_load_progress(self, stage: str, fraction: float) -> None:
        self.load_progress.setValue(round(max(0.0, min(fraction, 1.0)) * 100))
        self.show_status(stage, 0)
        if self._picker is not None:
            self._picker.set_progress(stage, fraction)

    def _on_loaded(self, info: ModelInfo) -> None:
        self._loading = max(self._loading - 1, 0)
        self._info = info
        self._show_model(info)
        self.load_progress.setVisible(self._loading > 0)
        self.show_status(f"Loaded {info.name}.")
        if self._picker is not None:
            self._picker.set_loaded(info)
        self.model_changed.emit(info)
        self._update_actions()

    def _on_decode_step(self, state: str) -> None:
        if state == "compiled":
            self.show_status("Decode step compiled: replies decode faster from now on.")
        else:
            self.show_status(f"The decode step stays uncompiled ({state.removeprefix('eager: ')}).")

    def _on_load_failed(self, message: str) -> None:
        self._loading = max(self._loading - 1, 0)
        self.load_progress.setVisible(self._loading > 0)
        kept = f" Still using {self._info.name}." if self._info is not None else ""
        if self._info is None and self.conversation_model.stop_waiting() is not None:
            kept += " The message waiting for it was not answered."
        self.show_status(f"Could not load the model: {message}{kept}", 20000)
        proposal, self._proposal = self._proposal, None
        if self._picker is None:
            self.chat.add_note(f"Could not load the model: {message}{kept}", error=True)
        if proposal is not None:  # offered where placements are chosen, one click away
            self.open_model_picker()
        if self._picker is not None:
            self._picker.set_failed(message, proposal)
        self._update_actions()

    def _on_load_proposed(self, request: LoadRequest) -> None:
        self._proposal = request

    def _show_model(self, info: ModelInfo) -> None:
        self.model_label.setText(model_line(info))
        self.setWindowTitle(f"Glassbox — {info.name}")

    def _forget_picker(self) -> None:
        if self._picker is not None:
            self._picker.deleteLater()
            self._picker = None

    # -- state -----------------------------------------------------------------------------------

    def _update_actions(self, *_: object) -> None:
        reason = self._send_refusal()
        self.input.set_sending_enabled(reason is None, reason or "")
        self.send_action.setEnabled(reason is None)
        waiting = self.conversation_model.state is ReplyState.WAITING
        self.stop_action.setEnabled(self.replying or waiting)
        has_user = self.conversation_model.has_user_message()
        self.regenerate_action.setEnabled(reason is None and has_user)
        self.pace.set_replying(self.replying)

    def closeEvent(self, event: QCloseEvent) -> None:
        """Cancel any reply and stop the model thread before the window goes."""
        if not self._closed:
            self._closed = True
            self.save_layout()
            self.conversation_model.abandon_reply()  # the store keeps what streamed
            self.backend.shutdown()
        event.accept()
