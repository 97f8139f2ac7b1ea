"""What the internals panels draw, gathered from engine events without drawing anything.

`InternalsState.ingest` runs in the GUI thread for every event, possibly thousands per second,
so it only appends to preallocated numpy buffers and bumps revision counters; the panels
compare those counters on a timer and redraw what changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from engine.events import (
    Candidate,
    Event,
    Failed,
    Finished,
    ModelInfo,
    Peaks,
    PrefillDone,
    PromptCells,
    Roofline,
    StepRows,
    Token,
    token_runs,
)
from engine.kv_formula import formula_bytes
from ui.panels.state.arrays import GrowableArray
from ui.panels.state.attention import ATTENTION_CELLS, AttentionRows, HeadStats
from ui.panels.state.placement import PlacementTrace
from ui.panels.state.prepared import PreparedStats
from ui.panels.state.pulled import PulledRows, head_row_stats
from ui.panels.state.roofline import RooflineTrace
from ui.panels.state.timing import ReplyTiming
from ui.panels.state.tokens import TokenTrail

# Revision keys: each panel follows one of them.
TIMING = "timing"
KV = "kv"
ATTENTION = "attention"
NEXT_TOKEN = "next_token"
ROOFLINE = "roofline"
MODEL = "model"
TOKENS = "tokens"
PLACEMENT = "placement"
KEYS = (TIMING, KV, ATTENTION, NEXT_TOKEN, ROOFLINE, MODEL, TOKENS, PLACEMENT)


def _nothing() -> None:
    pass


def _no_fetch(_step: int) -> None:
    pass


class InternalsState:
    """Everything the panels draw, updated from events in O(1)-ish time per event."""

    def __init__(
        self, max_attention_rows: int = 256, max_attention_cells: int | None = ATTENTION_CELLS
    ) -> None:
        self.max_attention_rows = max_attention_rows
        self.max_attention_cells = max_attention_cells  # per head: see AttentionRows
        self.revisions: dict[str, int] = dict.fromkeys(KEYS, 0)
        self.info: ModelInfo | None = None
        self.watched_layers: tuple[int, ...] = ()
        # A teacher is stepping (paused, Next token, Play slowly) or chose a token: the panels
        # say what the selected step did, in one sentence each.
        self.explaining = False
        self._next_curve_label: str | None = None
        # Row statistics the receiving thread worked out before ingest (app.client.engine_client).
        self.prepared = PreparedStats()
        self.placement = PlacementTrace()
        # Called when a panel's own choice changed (RedrawTracker.mark): whoever redraws the
        # panels (ui.panels.docks.InternalsView) wakes its timer.
        self.panel_changed: Callable[[], None] = _nothing
        # Asks the engine for a step's attention rows (EngineClient.fetch): a chosen step whose
        # rows did not cross with the latest ones. They arrive as a StepRows event.
        self.fetch_rows: Callable[[int], None] = _no_fetch
        # Asks for the prompt's rows of the layers whose matrix crossed pooled
        # (EngineClient.fetch_prompt): a hovered or selected prompt row, a grid its cells do
        # not pool to. They arrive as a StepRows event with `prompt`.
        self.fetch_prompt: Callable[[], None] = _nothing
        self.prompt_rows_asked = False  # this reply's, asked for already
        self.pulled = PulledRows()
        self.clear()

    # -- lifecycle -------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget the conversation (a new chat); the model and watched layers stay."""
        self.replies: list[ReplyTiming] = []
        self._open = False  # between a reply's first event and its Finished
        self.previous: ReplyTiming | None = None
        self.kv_tokens = GrowableArray(np.int64)
        self.kv_bytes = GrowableArray(np.int64)
        self.kv_layers: GrowableArray | None = None
        self.attention: dict[int, AttentionRows] = {}
        self.head_stats: dict[int, HeadStats] = {}
        self.token_texts: list[str] = []
        self.text_offset = 0  # context position of token_texts[0]
        self.prompt_tokens = 0
        self.top_k: list[tuple[Candidate, ...]] = []
        self.chosen: list[int] = []
        self.last_error: str | None = None
        self.roofline = RooflineTrace()
        self._clear_steps()
        self.pulled.clear()
        for key in self.revisions:
            self._bump(key)

    def _clear_steps(self) -> None:
        # The latest reply, step by step: its tokens, each step's measured latency, the cache's
        # bytes after it and its roofline (None for step 0, made by the prefill's pass).
        self.trail = TokenTrail()
        self.step_seconds: list[float] = []
        self.step_kv_bytes: list[int] = []
        self.step_rooflines: list[Roofline | None] = []
        self.prefill_kv_bytes = 0
        self.selected: int | None = None  # a chosen context position; None follows the latest

    def set_model(self, info: ModelInfo) -> None:
        self.info = info
        self.placement.set_model(info)
        self.clear()

    def set_watched_layers(self, layers: Sequence[int]) -> None:
        self.watched_layers = tuple(layers)
        self._bump(ATTENTION)

    def set_next_reply_label(self, label: str) -> None:
        """The legend label of the next reply's step-latency curve (e.g. "with KV cache")."""
        self._next_curve_label = label

    @property
    def reply(self) -> ReplyTiming | None:
        return self.replies[-1] if self.replies else None

    def revision(self, key: str) -> int:
        return self.revisions[key]

    def _bump(self, key: str) -> None:
        self.revisions[key] += 1

    # -- events ----------------------------------------------------------------------------

    def ingest(self, event: Event) -> None:
        if isinstance(event, Token):
            self._on_token(event)
        elif isinstance(event, PrefillDone):
            self._on_prefill(event)
        elif isinstance(event, StepRows):
            self._on_rows(event)
        elif isinstance(event, PromptCells):
            self._on_prompt_cells(event)
        elif isinstance(event, Finished):
            self._on_finished(event)
        elif isinstance(event, Failed):
            # A generation can fail before its PrefillDone: then no reply is open to blame.
            self.last_error = event.message
            if self._open and self.reply is not None:
                self.reply.error = event.message
            self._bump(TIMING)

    def ingest_many(self, events: Iterable[Event]) -> None:
        """`ingest` each event in order, the per-head statistics of consecutive tokens without
        rows summed once per layer for the run (a delivered batch is mostly such a run)."""
        for item in token_runs(events, lambda token: not token.attention):
            if not isinstance(item, list):
                self.ingest(item)
                continue
            for token in item:
                self._on_token(token, with_stats=False)
            self._add_token_stats(item)

    def _add_token_stats(self, tokens: Sequence[Token]) -> None:
        """The engine's per-head statistics of `tokens`, [2, heads] a layer each: one
        [2, heads, n] block per layer."""
        blocks: dict[int, list[np.ndarray]] = {}
        for token in tokens:
            for layer, statistics in token.head_stats.items():
                blocks.setdefault(layer, []).append(statistics)
        for layer, arrays in blocks.items():
            block = np.stack(arrays, axis=2)
            self._stats(layer, block.shape[1]).add_stats(head_row_stats(block))

    def _begin_reply(self) -> ReplyTiming:
        if self.replies:
            self.previous = self.replies[-1]
        turn = f"turn {len(self.replies) + 1}"
        reply = ReplyTiming(turn=turn, curve_label=self._next_curve_label or "")
        self._next_curve_label = None
        self.replies.append(reply)
        self._open = True
        # Fresh buffers: the plots may still hold views of the previous reply's.
        self.kv_tokens = GrowableArray(np.int64)
        self.kv_bytes = GrowableArray(np.int64)
        self.kv_layers = None
        self.attention = {}
        self.top_k = []
        self.chosen = []
        self.last_error = None
        self.roofline.start_reply()
        self._clear_steps()
        self.pulled.clear()
        self.prompt_rows_asked = False
        self.placement.start_reply()
        self._bump(PLACEMENT)
        return reply

    def _on_prefill(self, event: PrefillDone) -> None:
        reply = self._begin_reply()
        reply.add_prefill(event)
        if event.roofline is not None:
            self.roofline.add_prefill(reply.turn, event.roofline)
        self.prompt_tokens = event.prompt_tokens
        self.trail.start(event)
        self.prefill_kv_bytes = event.kv_bytes
        self.token_texts = list(event.token_texts)
        self.text_offset = event.prompt_tokens - len(event.token_texts)
        # The cache held the reused tokens before prefill: the curve starts there, then jumps.
        self._add_kv_point(
            event.reused_tokens,
            self._reused_bytes(event),
            event.kv_bytes_per_layer,
            scale=event.reused_tokens / max(event.prompt_tokens, 1),
        )
        self._add_kv_point(event.prompt_tokens, event.kv_bytes, event.kv_bytes_per_layer)
        prepared = self.prepared.take(event) or {}
        skips = {
            layer: self._attention_rows(layer, block.shape[0]).append_block(block)
            for layer, block in event.attention.items()
        }
        for layer, statistics in event.head_stats.items():  # worked out by the engine
            stats = self._stats(layer, statistics.shape[1])
            stats.add_stats(head_row_stats(statistics).tail(skips.get(layer, 0)))
        for layer, block in event.attention.items():
            if layer in event.head_stats:
                continue
            skip, stats = skips[layer], self._stats(layer, block.shape[0])
            if layer in prepared:
                stats.add_stats(prepared[layer].tail(skip))
                continue
            fresh = block[:, skip:, :]
            keys = block.shape[2]
            stats.add(fresh, np.arange(keys - fresh.shape[1], keys))
        for key in (TIMING, KV, ATTENTION, NEXT_TOKEN, ROOFLINE, TOKENS):
            self._bump(key)

    def _on_token(self, event: Token, with_stats: bool = True) -> None:
        """One token; `with_stats=False` leaves its per-head statistics to the caller
        (`_add_token_stats`)."""
        reply = self.reply if self._open and self.reply else self._begin_reply()
        reply.add_token(event)
        if event.roofline is not None:  # None for token 0: the prefill pass made its logits
            self.roofline.add_decode(event.roofline, event.transfer)
            self._bump(ROOFLINE)
        # Token i was sampled after the cache held the prompt and the i tokens before it.
        self._add_kv_point(
            self.prompt_tokens + event.index, event.kv_bytes, event.kv_bytes_per_layer
        )
        self.token_texts.append(event.piece)
        self.trail.add(event)
        self.step_seconds.append(event.seconds)
        self.step_kv_bytes.append(event.kv_bytes)
        self.step_rooflines.append(event.roofline)
        self._bump(TOKENS)
        if self.selected is None:  # the panels' sentences follow the latest step
            self._bump(ROOFLINE)
        prepared = self.prepared.take(event) or {}
        repeated = set()  # the same position again: its statistics are in already
        for layer, row in event.attention.items():
            if not self._attention_rows(layer, row.shape[0]).append_row(row):
                repeated.add(layer)
        for layer, statistics in event.head_stats.items():  # worked out by the engine
            if with_stats and layer not in repeated:
                self._stats(layer, statistics.shape[1]).add_stats(head_row_stats(statistics))
        for layer, row in event.attention.items():
            if layer in repeated or layer in event.head_stats:
                continue
            stats = self._stats(layer, row.shape[0])
            if layer in prepared:
                stats.add_stats(prepared[layer])
            else:
                stats.add(row[:, None, :], np.array([row.shape[1] - 1]))
        if self.placement.add(event):
            self._bump(PLACEMENT)
        self.top_k.append(event.top_k)
        self.chosen.append(event.token_id)
        self._bump(TIMING)
        self._bump(KV)
        self._bump(NEXT_TOKEN)
        if event.attention or event.head_stats:
            self._bump(ATTENTION)

    def _on_rows(self, event: StepRows) -> None:
        """A step's rows from the engine: the latest, for the panels that draw them, those of
        a step the user chose (or word that they aged out of the engine's ring), or the
        prompt's matrix of a layer a panel began to draw after the prompt was processed."""
        if event.prompt:
            self._on_prompt_rows(event)
        elif event.latest:
            for layer, row in event.attention.items():
                self._attention_rows(layer, row.shape[0]).append_row(row)
        else:
            self.pulled.add(event, self.prompt_tokens + event.step - 1)
        self._bump(ATTENTION)
        if not event.latest:
            self.panel_changed()

    def _on_prompt_rows(self, event: StepRows) -> None:
        """The prompt's rows go first in a layer's buffer, or in place of the placeholders its
        pooled cells left there; a layer that holds its rows already (its prompt came with the
        PrefillDone, or an earlier switch brought it) keeps them."""
        if self.reply is None:
            return  # a new chat: nothing to add them to
        if event.aged_out:  # placeholders stay: their hover and step line say so
            for rows in self.attention.values():
                rows.prompt_gone = rows.placeholders > 0
        for layer, block in event.attention.items():
            existing = self.attention.get(layer)
            if existing is None or not existing.rows:
                self._attention_rows(layer, block.shape[0]).append_block(block)
            elif existing.heads == block.shape[0]:
                existing.fill_prompt(block)

    def _on_prompt_cells(self, event: PromptCells) -> None:
        """A prompt's matrices pooled by the engine, just after its PrefillDone: placeholders
        for their rows, which follow (at a hold, the reply's end, or when asked)."""
        for layer, pooled in event.attention.items():
            if not self._attention_rows(layer, pooled.heads).append_pooled(pooled):
                self._ask_prompt_rows()  # this buffer cannot hold them: the rows themselves
        self._bump(ATTENTION)

    def want_prompt_rows(self) -> None:
        """Ask for the prompt's rows that crossed pooled, while some are awaited."""
        if self.prompt_rows_awaited:
            self._ask_prompt_rows()

    def _ask_prompt_rows(self) -> None:
        """Ask the engine for the prompt's rows, once a reply."""
        if not self.prompt_rows_asked:
            self.prompt_rows_asked = True
            self.fetch_prompt()

    @property
    def prompt_rows_awaited(self) -> bool:
        """Whether a layer's buffer holds placeholders for prompt rows not here yet."""
        return any(rows.placeholders and not rows.prompt_gone for rows in self.attention.values())

    def _on_finished(self, event: Finished) -> None:
        if self._open and self.reply is not None:
            self.reply.finished = event
        self._open = False
        self._bump(TIMING)
        # Drawn at once: the panels' final numbers as the chat says the reply is done, not
        # the governed timer's next tick (up to 500 ms) later
        self.panel_changed()

    # -- helpers ---------------------------------------------------------------------------

    def _reused_bytes(self, event: PrefillDone) -> int:
        if not event.reused_tokens:
            return 0
        if self.info is not None:
            return formula_bytes(self.info, event.reused_tokens)
        return round(event.kv_bytes * event.reused_tokens / max(event.prompt_tokens, 1))

    def _add_kv_point(
        self, tokens: int, total: int, per_layer: Sequence[int], scale: float = 1.0
    ) -> None:
        # A token's own bytes go in as they are; only the prefill's reused share is scaled.
        values = per_layer if scale == 1.0 else np.round(np.asarray(per_layer, np.float64) * scale)
        if len(per_layer) and self.kv_layers is None:
            self.kv_layers = GrowableArray(np.int64, width=len(per_layer))
            for _ in range(len(self.kv_tokens)):  # keep one row per point
                self.kv_layers.append(0)
        if len(self.kv_tokens) and self.kv_tokens.last() == tokens:
            # Same cache length as the previous point (the first token after prefill).
            self.kv_bytes.set_last(total)
            if self.kv_layers is not None and len(per_layer) == self.kv_layers.width:
                self.kv_layers.set_last(values)
            return
        self.kv_tokens.append(tokens)
        self.kv_bytes.append(total)
        if self.kv_layers is not None:
            fits = len(per_layer) == self.kv_layers.width
            self.kv_layers.append(values if fits else 0)

    def _attention_rows(self, layer: int, heads: int) -> AttentionRows:
        rows = self.attention.get(layer)
        if rows is None or rows.heads != heads:
            rows = AttentionRows(
                heads, max_rows=self.max_attention_rows, max_cells=self.max_attention_cells
            )
            self.attention[layer] = rows
        return rows

    def settle(self, deadline: float | None = None) -> bool:
        """Sum the attention rows whose statistics wait (HeadStats.settle) until
        time.perf_counter() passes `deadline`; True once none wait."""
        for stats in [s for s in self.head_stats.values() if s.pending]:
            if not stats.settle(deadline):
                return False
            if deadline is not None and time.perf_counter() > deadline:
                break
        return not self.stats_pending

    @property
    def stats_pending(self) -> bool:
        return any(stats.pending for stats in self.head_stats.values())

    def _stats(self, layer: int, heads: int) -> HeadStats:
        stats = self.head_stats.get(layer)
        if stats is None or stats.heads != heads:
            stats = HeadStats(heads)
            self.head_stats[layer] = stats
        return stats

    def token_text(self, position: int) -> str:
        """The text of the token at a context position ("?" when it is not known)."""
        index = position - self.text_offset
        if 0 <= index < len(self.token_texts):
            return self.token_texts[index]
        return "?"

    @property
    def peaks(self) -> Peaks | None:
        """The machine's measured peaks, from the engine that loaded the model."""
        return self.info.peaks if self.info is not None else None

    @property
    def cache_tokens(self) -> int:
        return int(self.kv_tokens.last()) if len(self.kv_tokens) else 0

    @property
    def steps(self) -> int:
        return len(self.top_k)

    # -- the selected step ---------------------------------------------------------------------

    def select(self, position: int | None) -> None:
        """Show the step of the token at context `position` in every panel (None: follow the
        latest). A token of the prompt selects the prefill that processed it."""
        if position is not None and not 0 <= position < len(self.trail.ids):
            return
        self.selected = position
        self._pull_selected()
        for key in self.revisions:
            self._bump(key)
        self.panel_changed()

    def row_at(self, layer: int, query: int) -> np.ndarray | None:
        """Layer `layer`'s attention row of the query at context position `query`: kept with
        the latest rows, or pulled for a chosen step (None: neither)."""
        rows = self.attention.get(layer)
        if rows is not None and rows.waits_for(query):
            self.want_prompt_rows()
            return None
        row = rows.row_at(query) if rows is not None else None
        return row if row is not None else self.pulled.row_at(layer, query)

    def _pull_selected(self) -> None:
        """Ask the engine for the chosen step's rows unless they are here or on their way."""
        step = self.selected_step
        if step is None or not self.watched_layers:
            return
        query = self.prompt_tokens + step - 1
        known = query in self.pulled.asked or query in self.pulled.aged_out
        if known or any(self.row_at(layer, query) is not None for layer in self.watched_layers):
            return
        self.pulled.asked.add(query)
        self.fetch_rows(step)

    def set_explaining(self, on: bool) -> None:
        if on != self.explaining:
            self.explaining = on
            for key in self.revisions:
                self._bump(key)
            self.panel_changed()

    @property
    def showing_step(self) -> bool:
        """Whether the panels show the selected step's sentence and marker."""
        return self.explaining or self.selected is not None

    @property
    def selected_position(self) -> int | None:
        """The chosen position, else the latest token's (None before any prompt)."""
        if self.selected is not None:
            return self.selected
        return len(self.trail.ids) - 1 if self.trail.ids else None

    def step_at(self, position: int | None) -> int | None:
        """The reply's step that made the token at `position` (None for a prompt token)."""
        if position is None or position < self.prompt_tokens:
            return None
        step = position - self.prompt_tokens
        return step if step < len(self.step_seconds) else None

    @property
    def selected_step(self) -> int | None:
        return self.step_at(self.selected_position)

    def step_added_bytes(self, step: int) -> int:
        """What decode step `step` added to the KV cache, from the measured sizes."""
        before = self.step_kv_bytes[step - 1] if step > 0 else self.prefill_kv_bytes
        return self.step_kv_bytes[step] - before
