"""Build the whole window: chat, internals docks, conversation sidebar, store, on an engine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QRect, QSettings, Qt
from PySide6.QtWidgets import QDockWidget

from app import paths
from app.client.engine_client import EngineClient
from app.storage.store import CANNOT_OPEN, IN_MEMORY, ConversationStore
from app.window.controller import ConversationController
from app.window.serving import ServeSwitch
from engine.events import ModelInfo
from ui import layout
from ui.conversation_list import ConversationList
from ui.main_window import MainWindow
from ui.panels.docks import InternalsView, build_docks
from ui.panels.timing import cache_label


@dataclass
class Parts:
    window: MainWindow
    worker: EngineClient
    internals: InternalsView
    controller: ConversationController
    serve: ServeSwitch

    def shutdown(self) -> None:
        self.serve.stop()  # the API's requests end and its thread is joined first
        self.worker.shutdown()
        self.controller.close()


def default_watched_layers(info: ModelInfo) -> tuple[int, ...]:
    """First, two inner and last layer: enough for the overview, cheap at every step."""
    last = info.layers - 1
    return tuple(sorted({0, last // 3, 2 * last // 3, last}))


def assemble(
    worker: EngineClient,
    database: Path | None = None,
    settings: QSettings | None = None,
    screen: QRect | None = None,
) -> Parts:
    """The window on `worker`'s engine. `screen`: the available geometry to fit (by default
    that of the screen it opens on)."""
    settings = settings if settings is not None else QSettings()  # the window's and the server's
    window = MainWindow(worker, settings)
    internals = build_docks(window)
    for dock in internals.docks.values():
        window.view_menu.addAction(dock.toggleViewAction())
    sidebar = ConversationList()
    conversations = QDockWidget("Conversations")
    conversations.setObjectName("conversations_dock")
    conversations.setWidget(sidebar)
    window.add_dock(conversations, Qt.DockWidgetArea.LeftDockWidgetArea)
    _fit_to_screen(window, internals, conversations, screen)

    store, problem = open_store(database)
    if problem is not None:
        window.chat.add_note(problem, error=True)
    controller = ConversationController(window, store, sidebar)
    _connect_internals(window, internals)
    _connect_rows(window, worker, internals)
    worker.set_preparer(internals.state.prepared.prepare)  # attention statistics, off the GUI
    # Events come as often as the panels draw, at least as often as the chat draws text; the
    # chat draws streamed text as often as the panels draw, within its own bounds.
    internals.frame_interval_changed.connect(worker.set_drain_interval)
    internals.frame_interval_changed.connect(window.chat.set_stream_interval)
    worker.set_drain_interval(internals.busy_interval)
    worker.share_turns(internals.turns)  # a delivery and a frame never in one turn (ui.turns)
    window.chat.set_stream_interval(internals.busy_interval)
    _connect_engine_notes(window, worker)
    _connect_lens(internals, worker)
    controller.reopen_last()
    serve = ServeSwitch(window, worker, controller, settings)
    return Parts(window, worker, internals, controller, serve)


def open_store(database: Path | None = None) -> tuple[ConversationStore, str | None]:
    """The conversation store (by default the user's), and a line for the chat where it could
    not be used as it was: a damaged file set aside, or, where the file cannot be opened at
    all or belongs to a newer Glassbox, a store in memory that the window keeps until it
    closes (the file, if any, left as it is)."""
    try:
        store = ConversationStore(database or paths.database_path())
    except CANNOT_OPEN as error:
        note = (
            f"The conversation database cannot be used ({error}). Conversations are kept"
            " only until this window closes."
        )
        return ConversationStore(IN_MEMORY), note
    if store.recovered_from is None:
        return store, None
    return store, (
        f"The conversation database was damaged ({store.recovery_reason}). It was kept"
        f" aside as {store.recovered_from} and a new one started."
    )


def _fit_to_screen(
    window: MainWindow, internals: InternalsView, sidebar: QDockWidget, screen: QRect | None
) -> None:
    """The default layout for this screen, then the remembered one if it still fits there."""
    available = screen if screen is not None else layout.available_geometry(window)
    for name, dock in internals.docks.items():
        layout.scroll_when_small(dock, layout.panel_minimum(name))
    layout.scroll_when_small(window.settings_dock, horizontal=False)
    central = window.centralWidget()
    if central is not None:  # the chat, set when the window was built
        central.setMinimumWidth(layout.CHAT_MIN_WIDTH)
    layout.arrange(window, internals.docks, [window.settings_dock, sidebar], available)
    window.restore_layout(screen)  # now that every dock exists, the saved layout can place them
    layout.KeepFrameOnScreen(window, screen)  # the title bar is known once it is shown
    layout.WholeTabNames(window)


def _connect_engine_notes(window: MainWindow, worker: EngineClient) -> None:
    """The engine died: one line in the chat (a reply it cut off says so itself)."""

    def stopped(line: str) -> None:
        if not window.replying:
            window.chat.add_note(line, error=True)
        window.show_status(line, 20000)

    worker.engine_stopped.connect(stopped)


def _connect_rows(window: MainWindow, worker: EngineClient, internals: InternalsView) -> None:
    """The view pulls what it draws (docs/view-contract.md): tokens carry per-head statistics,
    not rows; the latest rows come for the layers a panel on screen draws, at its frame rate;
    a chosen step's rows are fetched from the engine's ring."""
    window.set_probe_settings(replace(window.probe_settings(), token_rows=False))
    internals.state.fetch_rows = worker.fetch
    internals.state.fetch_prompt = worker.fetch_prompt
    internals.rows_wanted.connect(worker.watch)
    worker.watch(*internals.rows_wanted_now)


def _connect_lens(internals: InternalsView, worker: EngineClient) -> None:
    """The Layers panel asks the engine for the step it shows, and has it keep steps only
    while the panel is on screen."""
    panel = internals.layers
    panel.lens_wanted.connect(lambda step: panel.asked(worker.ask_lens(step), step))
    panel.watch_changed.connect(worker.watch_lens)
    worker.lens_ready.connect(panel.set_lens)


def _connect_internals(window: MainWindow, internals: InternalsView) -> None:
    # The engine sends only the prompt's rows the view keeps. The view drops older rows past
    # max_attention_rows (fewer at long contexts: max_attention_cells); the 512 the engine
    # sends by default doubled what crossed from it for a long prompt and delayed the first
    # token's showing well past a short prompt's.
    state = internals.state
    window.set_probe_settings(
        replace(
            window.probe_settings(),
            prefill_rows=state.max_attention_rows,
            prefill_cells=state.max_attention_cells,
        )
    )

    def on_model(info: ModelInfo) -> None:
        layers = default_watched_layers(info)
        internals.set_model(info)
        internals.set_watched_layers(layers)
        window.set_probe_settings(replace(window.probe_settings(), attention_layers=layers))

    def watch(layers: tuple[int, ...]) -> None:
        window.set_probe_settings(replace(window.probe_settings(), attention_layers=layers))
        internals.set_watched_layers(layers)

    def label_next_reply() -> None:
        use_cache = window.settings_panel.settings().use_cache
        internals.set_next_reply_label(cache_label(use_cache))

    window.model_changed.connect(on_model)
    window.events_received.connect(internals.ingest_many)
    window.chat_reset.connect(internals.clear)
    window.pace.mode_changed.connect(lambda mode: internals.set_explaining(mode != "run"))
    window.conversation_changed.connect(label_next_reply)
    window.settings_panel.changed.connect(label_next_reply)
    internals.watched_layers_requested.connect(watch)
    # A token of the reply clicked in the chat selects its step, as a chip of the Tokens panel
    window.chat.token_clicked.connect(lambda step: state.select(state.prompt_tokens + step))
    internals.compare_with_previous(True)
    label_next_reply()
    if window.info is not None:
        on_model(window.info)
