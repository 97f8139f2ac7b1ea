"""What an engine server runs: its loader and session factory by importable name, and how it
shares the machine. Qt-free and light: the window's process imports it before the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """What the child runs, as importable names ("module:attribute"), so that a test can run
    its own fake session in the child just as the app runs the real one."""

    loader: str = "app.server.jobs:default_loader"
    session_factory: str = "app.server.jobs:default_session_factory"
    preload: tuple[str, ...] = (
        "engine.load.loader",
        "engine.generate.session",
    )  # imported at start
    # torch's intra-op threads while decoding; None: every core on a machine of one or two,
    # all cores but one, left to the window, on larger ones. On two cores, leaving a core to
    # the window costs half the compute, while sharing one costs only what the window's bursts
    # hold an OpenMP thread up at its barriers, so two decoding threads beat one there. With
    # more cores, the core left costs less.
    threads: int | None = None
    # ... and while a prompt is processed; None: every core. The window has little to draw
    # until the first token, and prefill, all large matrix products, gains most from them.
    prefill_threads: int | None = None
    # Shares the machine with a window (see give_way_to_the_window). False: the terminal
    # chat's engine, as the window benchmark's reference runs it: every core throughout.
    beside_window: bool = True
