"""`glassbox bench --stepping`: how fast a teacher's Next token shows, and what a held reply
costs the machine.

The window is built as `glassbox` builds it (engine process first, then the window, the
model loaded) in its first start's docked layout on a 1600x1000 screen, offscreen. A reply is
sent with Pause after prefill; once the engine says it is held, Next token is pressed
`presses` times, each press timed until the step's token is delivered and every panel on
screen has drawn it (no panel left with something to draw, no frame half drawn). The window's
own part of a press is that time less the engine's step, as the step's Token measured it.
Then, held, the CPU both processes use over `paused_s` is read from /proc: a held engine waits
on a condition and the window's panel timer sleeps, so both should be near zero. Last, a second
reply runs to its end and `selections` of its steps, spread over it, are selected as a click
on a token of the chat selects them, each timed until its rows (pulled from the engine's ring
of recent steps) are in and every panel on screen has drawn it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.loop import run_for, run_until
from app.bench.measures import cpu_seconds_of
from app.server.engine_process import EngineProcess

if TYPE_CHECKING:
    from app.window.assembly import Parts
    from engine.settings import LoadRequest

QUESTION = "Why is the sky blue? Answer in two sentences."
SCREEN = (1600, 1000)


def measure_stepping(
    request: LoadRequest,
    engine: EngineProcess,
    presses: int = 12,
    paused_s: float = 30.0,
    selections: int = 8,
) -> dict[str, Any]:
    # The window's conversations and layout go to a folder of the bench's own, removed after.
    with tempfile.TemporaryDirectory(prefix="glassbox-stepping-") as folder:
        parts = _open(engine, Path(folder))
        try:
            return _measure(parts, engine, request, presses, paused_s, selections)
        finally:
            parts.shutdown()  # the engine process too: nothing is left running


def _measure(
    parts: Parts,
    engine: EngineProcess,
    request: LoadRequest,
    presses: int,
    paused_s: float,
    selections: int,
) -> dict[str, Any]:
    window, worker = parts.window, parts.worker
    window.load_model(request)
    run_until(lambda: worker.info is not None and not worker.busy, 600)
    window.settings_panel.set_pause_after_prefill(True)
    if not window.send(QUESTION):
        raise RuntimeError("the window did not send the question")
    run_until(lambda: window.pace.held, 120)
    run_for(0.5)
    pressed, steps = zip(*(_press(parts) for _ in range(presses)), strict=True)
    held = _held_cpu(parts, engine, paused_s)
    window.stop_action.trigger()
    run_until(lambda: not window.replying, 60)
    selected, fetched, aged_out = _select_steps(parts, selections)
    visible = [type(panel).__name__ for panel in _shown(parts)]
    own = [total - step for total, step in zip(pressed, steps, strict=True)]
    return {
        "model": worker.info.name if worker.info else "?",
        "presses": presses,
        "next_token_ms": _spread(list(pressed)),
        "engine_step_ms": _spread(list(steps)),
        "window_share_ms": _spread(own),
        "visible_panels": visible,
        # a past step of a finished reply selected: until its rows are in and drawn
        "select_step_ms": _spread(selected) if selected else None,
        "selected_fetched": fetched,  # of those, steps whose rows came from the engine's ring
        "selected_aged_out": aged_out,  # steps the ring no longer held (said so, not timed)
        "runs": {
            "next_token_ms": _rounded(pressed),
            "engine_step_ms": _rounded(steps),
            "select_step_ms": _rounded(selected),
        },
        "held": held,
    }


def _open(engine: EngineProcess, folder: Path) -> Parts:
    from PySide6.QtCore import QRect, QSettings

    from app.window.gui import open_window

    remembered = QSettings(str(folder / "layout.ini"), QSettings.Format.IniFormat)
    return open_window(
        engine,
        database=folder / "chats.sqlite3",
        settings=remembered,
        screen=QRect(0, 0, *SCREEN),
    )


def _shown(parts: Parts) -> list[Any]:
    from ui.panels.docks import shown

    return [panel for panel in parts.internals.panels if shown(panel)]


def _press(parts: Parts) -> tuple[float, float]:
    """One Next token: milliseconds until its token is drawn in every panel on screen (to the
    wait's 10 ms poll), and the engine's own step as its Token measured it."""
    internals, pace = parts.internals, parts.window.pace
    state = internals.state
    target = state.trail.generated + 1

    def drawn() -> bool:
        if state.trail.generated < target or internals.frame_in_progress:
            return False
        return not any(panel.needs_redraw() for panel in _shown(parts))

    started = time.perf_counter()
    pace.next_action.trigger()
    done = run_until(drawn, 60)
    run_until(lambda: pace.held, 60)
    run_for(0.3)
    index = target - 1  # the token this press let through
    # Token 0's logits came from the prefill, before the press: its seconds are the prefill's
    step_s = state.step_seconds[index] if index > 0 else 0.0
    return (done - started) * 1000, step_s * 1000


def _select_steps(parts: Parts, count: int) -> tuple[list[float], int, int]:
    """A reply run to its end, then `count` of its steps selected in turn as a click on a chat
    token selects them: milliseconds each took until its rows were in and drawn on screen, how
    many of them were fetched from the engine's ring (the others' rows were in the window), and
    how many had left the ring (those are not timed)."""
    window, state = parts.window, parts.internals.state
    window.settings_panel.set_pause_after_prefill(False)
    window.pace.resume_action.trigger()  # the pacer stays paused across replies until Resume
    if not window.send(QUESTION + " Then say why sunsets are red, in detail."):
        raise RuntimeError("the window did not send the second question")
    run_until(lambda: window.replying, 60)
    run_until(lambda: not window.replying, 600)
    run_for(0.5)
    generated = state.trail.generated
    times, fetched, aged_out = [], 0, 0
    for step in sorted({1 + i * (generated - 2) // max(count - 1, 1) for i in range(count)}):
        query = state.prompt_tokens + step - 1  # the row of the query that chose it
        started = time.perf_counter()
        state.select(state.prompt_tokens + step)  # what clicking the step's token does
        asked = query in state.pulled.asked  # its rows are not in the window: fetched

        def shown(query: int = query) -> bool:
            if query in state.pulled.aged_out:
                return True
            # as InternalsState asks for a step: its rows are here for a layer a panel draws
            rows = any(state.row_at(layer, query) is not None for layer in state.watched_layers)
            busy = parts.internals.frame_in_progress
            return rows and not busy and not any(p.needs_redraw() for p in _shown(parts))

        done = run_until(shown, 30)
        if query in state.pulled.aged_out:
            aged_out += 1
        else:
            times.append((done - started) * 1000)
            fetched += asked
        run_for(0.2)
    state.select(None)
    return times, fetched, aged_out


def _held_cpu(parts: Parts, engine: EngineProcess, seconds: float) -> dict[str, Any]:
    """CPU of the window's process and the engine's while the reply is held."""
    run_for(1.0)
    window_cpu, engine_cpu = cpu_seconds_of(os.getpid()) or 0.0, cpu_seconds_of(engine.pid) or 0.0
    started = time.perf_counter()
    run_for(seconds)
    wall = time.perf_counter() - started
    window_used = (cpu_seconds_of(os.getpid()) or 0.0) - window_cpu
    engine_used = (cpu_seconds_of(engine.pid) or 0.0) - engine_cpu
    return {
        "seconds": round(wall, 1),
        "window_cpu_per_s": round(window_used / wall, 4),
        "engine_cpu_per_s": round(engine_used / wall, 4),
        "panel_timer_asleep": parts.internals.asleep,
        "still_held": parts.window.pace.held,
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
        "min": round(min(values), 1),
    }


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(value, 1) for value in values]
