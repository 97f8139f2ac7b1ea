"""What the internals panels draw, gathered from engine events without drawing anything.

`InternalsState.ingest` runs in the GUI thread for every event, possibly thousands per second,
so it only appends to preallocated numpy buffers and bumps revision counters; the panels
compare those counters on a timer and redraw what changed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.events import Candidate, Event, Failed, Finished, ModelInfo, PrefillDone, Token
from engine.kv_cache import formula_bytes

# Revision keys: each panel follows one of them.
TIMING = "timing"
KV = "kv"
ATTENTION = "attention"
NEXT_TOKEN = "next_token"
MODEL = "model"


class GrowableArray:
    """A numpy array with amortized O(1) appends: it doubles its capacity when full.

    `width=None` holds scalars (shape [n]); an int holds rows of that width (shape [n, width]).
    """

    def __init__(
        self, dtype: type | np.dtype = np.float64, width: int | None = None, capacity: int = 256
    ) -> None:
        self._width = width
        shape = (capacity,) if width is None else (capacity, width)
        self._data = np.zeros(shape, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._data.shape[0]

    @property
    def width(self) -> int | None:
        return self._width

    def append(self, value: float | Sequence[float] | np.ndarray) -> None:
        if self._size == self._data.shape[0]:
            self._grow()
        self._data[self._size] = value
        self._size += 1

    def view(self) -> np.ndarray:
        """The filled part, without copying (valid until the next append grows the buffer)."""
        return self._data[: self._size]

    def last(self) -> np.ndarray | float:
        if not self._size:
            raise IndexError("empty buffer")
        return self._data[self._size - 1]

    def set_last(self, value: float | Sequence[float] | np.ndarray) -> None:
        if not self._size:
            raise IndexError("empty buffer")
        self._data[self._size - 1] = value

    def _grow(self) -> None:
        bigger = np.zeros((self._data.shape[0] * 2, *self._data.shape[1:]), self._data.dtype)
        bigger[: self._size] = self._data[: self._size]
        self._data = bigger


_serials = itertools.count()


class AttentionRows:
    """One layer's attention as a [heads, rows, keys] matrix that grows row by row.

    Row r holds the weights of the query at context position `positions[r]` over keys
    0..keys-1; keys after a row's own position are zero (the causal mask). Each row is kept as
    the read-only [heads, keys] array its event carries, so appending copies nothing and a
    longer context never reallocates what is stored (a dense buffer had to copy every row each
    time the keys outgrew it: hundreds of milliseconds per event at 10,000 keys). Past
    `max_rows` the oldest half is dropped. `matrix` and `padded` build dense copies.
    """

    def __init__(self, heads: int, max_rows: int = 256, capacity: int = 64) -> None:
        # `capacity` is accepted for callers of the dense buffer this replaced; rows need none.
        self.serial = next(_serials)  # tells one reply's buffer from the next
        self.heads = heads
        self.max_rows = max_rows
        self._rows: list[np.ndarray] = []  # [heads, n] each, n = its query position + 1 or more
        self._positions: list[int] = []
        self.keys = 0
        self.dropped = 0  # rows dropped from the top since the reply began

    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def positions(self) -> np.ndarray:
        return np.array(self._positions, dtype=np.int64)

    def matrix(self, first_row: int = 0) -> np.ndarray:
        """A dense copy [heads, rows - first_row, keys] of the filled part."""
        return self.padded(first_row, self.keys)

    def padded(self, first_row: int, keys: int, end_row: int | None = None) -> np.ndarray:
        """Rows `first_row` to `end_row` as a dense [heads, n, keys] copy, zeros past each row."""
        rows = self._rows[first_row:end_row]
        out = np.zeros((self.heads, len(rows), keys), dtype=np.float32)
        for index, row in enumerate(rows):
            width = min(row.shape[1], keys)
            out[:, index, :width] = row[:, :width]
        return out

    def append_block(self, block: np.ndarray) -> int:
        """Append a prefill matrix [heads, queries, keys]; the queries are the last positions.

        Returns how many leading rows rewrote a position already present (0 or 1); the rest
        are new.
        """
        _heads, queries, keys = block.shape
        first = keys - queries
        skip = 0
        if queries and self._positions and self._positions[-1] == first:
            self._append(block[:, 0, : first + 1], first)
            skip = 1
        count = min(queries - skip, self.max_rows)
        if count <= 0:
            return skip
        self._drop(max(self.rows + count - self.max_rows, 0))
        for query in range(queries - count, queries):
            position = first + query
            self._rows.append(block[:, query, : position + 1])  # views: no copy
            self._positions.append(position)
        self.dropped += queries - skip - count  # block rows that never fit
        self.keys = max(self.keys, keys)
        return skip

    def append_row(self, row: np.ndarray) -> bool:
        """Append one decode row [heads, keys]; its query sits at position keys - 1.

        Returns False when the position was already present and the row was overwritten (the
        first token's row can repeat the last prompt row).
        """
        return self._append(row, row.shape[1] - 1)

    def value(self, row: int, key: int, head: int) -> float:
        if 0 <= row < self.rows and 0 <= key < self.keys and 0 <= head < self.heads:
            weights = self._rows[row]
            return float(weights[head, key]) if key < weights.shape[1] else 0.0
        return math.nan

    def _append(self, row: np.ndarray, position: int) -> bool:
        if self._positions and self._positions[-1] == position:
            self._rows[-1] = row
            new = False
        else:
            if self.rows >= self.max_rows:
                self._drop(max(self.rows // 2, 1))
            self._rows.append(row)
            self._positions.append(position)
            new = True
        self.keys = max(self.keys, row.shape[1])
        return new

    def _drop(self, drop: int) -> None:
        """Forget the `drop` oldest rows (at least half: the view redraws less often)."""
        if drop <= 0:
            return
        drop = min(self.rows, max(drop, self.rows // 2))
        del self._rows[:drop]
        del self._positions[:drop]
        self.dropped += drop


@dataclass
class HeadStats:
    """Running sums per head over every attention row seen, for the layer x head overview."""

    heads: int
    rows: int = 0
    max_weight: np.ndarray = field(init=False)
    entropy: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.max_weight = np.zeros(self.heads)
        self.entropy = np.zeros(self.heads)
        self._logs = np.empty(0, dtype=np.float32)  # scratch for add()

    def add(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Add [heads, n, keys] rows whose queries sit at `positions`."""
        if rows.shape[1] == 0:
            return
        weights = np.asarray(rows, dtype=np.float32)
        self.max_weight += weights.max(axis=2).sum(axis=1, dtype=np.float64)
        # -sum w log w, with 0 log 0 = 0: a zero weight times log(tiny) is exactly zero, so no
        # masked log (twice the cost) is needed. The logs go to a kept buffer (a new one per
        # row, at 10,000 keys, is fresh memory every time) and a batched matmul multiplies and
        # sums each row in one pass (half the time of einsum).
        logs = self._scratch(weights.shape)
        np.maximum(weights, np.finfo(np.float32).tiny, out=logs)
        np.log(logs, out=logs)
        products = weights[:, :, None, :] @ logs[:, :, :, None]  # [heads, n, 1, 1]
        entropy = -products[:, :, 0, 0].astype(np.float64)  # [heads, n]
        # Normalize by the most a row could have (uniform over its visible keys).
        visible = np.log(np.maximum(positions + 1, 2).astype(np.float64))
        self.entropy += (entropy / visible).sum(axis=1)
        self.rows += rows.shape[1]

    def _scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        size = math.prod(shape)
        if self._logs.size < size:
            self._logs = np.empty(max(size, 2 * self._logs.size), dtype=np.float32)
        return self._logs[:size].reshape(shape)

    def mean(self, measure: str) -> np.ndarray:
        values = self.entropy if measure == "entropy" else self.max_weight
        return values / self.rows if self.rows else np.zeros(self.heads)


@dataclass
class Reply:
    """Timing of one reply, from its PrefillDone to its Finished."""

    turn: str
    curve_label: str
    prompt_tokens: int = 0
    reused_tokens: int = 0
    processed_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    first_token_s: float | None = None  # Token 0's seconds: prefill + sampling
    decode_s: float = 0.0  # running sum of the later steps
    steps: GrowableArray = field(default_factory=lambda: GrowableArray(np.int64))
    step_seconds: GrowableArray = field(default_factory=lambda: GrowableArray(np.float64))
    finished: Finished | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.finished is not None and self.finished.ttft_s > 0:
            return self.finished.ttft_s
        if self.first_token_s is None:
            return None
        return self.tokenize_s + self.first_token_s

    @property
    def first_token_extra_s(self) -> float:
        """Sampling and overhead of the first token beyond the prefill pass."""
        if self.first_token_s is None:
            return 0.0
        return max(self.first_token_s - self.prefill_s, 0.0)

    @property
    def decode_tokens_per_s(self) -> float:
        if self.finished is not None:
            return self.finished.decode_tokens_per_s
        steps = len(self.step_seconds)
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0


class InternalsState:
    """Everything the four panels draw, updated from events in O(1)-ish time per event."""

    def __init__(self, max_attention_rows: int = 256) -> None:
        self.max_attention_rows = max_attention_rows
        self.revisions: dict[str, int] = dict.fromkeys(
            (TIMING, KV, ATTENTION, NEXT_TOKEN, MODEL), 0
        )
        self.info: ModelInfo | None = None
        self.watched_layers: tuple[int, ...] = ()
        self._next_turn: str | None = None
        self._next_curve_label: str | None = None
        self.clear()

    # -- lifecycle -------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget the conversation (a new chat); the model and watched layers stay."""
        self.replies: list[Reply] = []
        self._open = False  # between a reply's first event and its Finished
        self.previous: Reply | None = None
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
        for key in self.revisions:
            self._bump(key)

    def set_model(self, info: ModelInfo) -> None:
        self.info = info
        self.clear()

    def set_watched_layers(self, layers: Sequence[int]) -> None:
        self.watched_layers = tuple(layers)
        self._bump(ATTENTION)

    def start_reply(self, turn: str) -> None:
        """Name the next reply's turn; its PrefillDone begins it."""
        self._next_turn = turn

    def set_next_reply_label(self, label: str) -> None:
        """The legend label of the next reply's step-latency curve (e.g. "with KV cache")."""
        self._next_curve_label = label

    @property
    def reply(self) -> Reply | None:
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
        elif isinstance(event, Finished):
            self._on_finished(event)
        elif isinstance(event, Failed):
            # A generation can fail before its PrefillDone: then no reply is open to blame.
            self.last_error = event.message
            if self._open and self.reply is not None:
                self.reply.error = event.message
            self._bump(TIMING)

    def _begin_reply(self) -> Reply:
        if self.replies:
            self.previous = self.replies[-1]
        turn = self._next_turn or f"turn {len(self.replies) + 1}"
        reply = Reply(turn=turn, curve_label=self._next_curve_label or "")
        self._next_turn = self._next_curve_label = None
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
        return reply

    def _on_prefill(self, event: PrefillDone) -> None:
        reply = self._begin_reply()
        reply.prompt_tokens = event.prompt_tokens
        reply.reused_tokens = event.reused_tokens
        reply.processed_tokens = event.processed_tokens
        reply.tokenize_s = event.tokenize_s
        reply.prefill_s = event.seconds
        reply.prefill_tokens_per_s = event.tokens_per_s
        self.prompt_tokens = event.prompt_tokens
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
        for layer, block in event.attention.items():
            rows = self._attention_rows(layer, block.shape[0])
            skip = rows.append_block(block)
            fresh = block[:, skip:, :]
            keys = block.shape[2]
            positions = np.arange(keys - fresh.shape[1], keys)
            self._stats(layer, block.shape[0]).add(fresh, positions)
        for key in (TIMING, KV, ATTENTION, NEXT_TOKEN):
            self._bump(key)

    def _on_token(self, event: Token) -> None:
        reply = self.reply if self._open and self.reply else self._begin_reply()
        if event.index == 0:
            reply.first_token_s = event.seconds
        else:
            reply.steps.append(event.index)
            reply.step_seconds.append(event.seconds)
            reply.decode_s += event.seconds
        # Token i was sampled after the cache held the prompt and the i tokens before it.
        self._add_kv_point(
            self.prompt_tokens + event.index, event.kv_bytes, event.kv_bytes_per_layer
        )
        self.token_texts.append(event.piece)
        for layer, row in event.attention.items():
            rows = self._attention_rows(layer, row.shape[0])
            if rows.append_row(row):
                self._stats(layer, row.shape[0]).add(row[:, None, :], rows.positions[-1:])
        self.top_k.append(event.top_k)
        self.chosen.append(event.token_id)
        self._bump(TIMING)
        self._bump(KV)
        self._bump(NEXT_TOKEN)
        if event.attention:
            self._bump(ATTENTION)

    def _on_finished(self, event: Finished) -> None:
        if self._open and self.reply is not None:
            self.reply.finished = event
        self._open = False
        self._bump(TIMING)

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
        values = np.asarray(per_layer, dtype=np.float64) * scale
        if len(per_layer) and self.kv_layers is None:
            self.kv_layers = GrowableArray(np.int64, width=len(per_layer))
            for _ in range(len(self.kv_tokens)):  # keep one row per point
                self.kv_layers.append(0)
        if len(self.kv_tokens) and self.kv_tokens.last() == tokens:
            # Same cache length as the previous point (the first token after prefill).
            self.kv_bytes.set_last(total)
            if self.kv_layers is not None and len(per_layer) == self.kv_layers.width:
                self.kv_layers.set_last(np.round(values))
            return
        self.kv_tokens.append(tokens)
        self.kv_bytes.append(total)
        if self.kv_layers is not None:
            fits = len(per_layer) == self.kv_layers.width
            self.kv_layers.append(np.round(values) if fits else 0)

    def _attention_rows(self, layer: int, heads: int) -> AttentionRows:
        rows = self.attention.get(layer)
        if rows is None or rows.heads != heads:
            rows = AttentionRows(heads, max_rows=self.max_attention_rows)
            self.attention[layer] = rows
        return rows

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
    def cache_tokens(self) -> int:
        return int(self.kv_tokens.last()) if len(self.kv_tokens) else 0

    @property
    def steps(self) -> int:
        return len(self.top_k)


class RedrawTracker:
    """Remembers which state revisions a panel last drew, plus its own pending UI changes."""

    def __init__(self, state: InternalsState, *keys: str) -> None:
        self._state = state
        self._keys = (MODEL, *keys)
        self._drawn: tuple[int, ...] | None = None
        self._dirty = True

    def mark(self) -> None:
        """Something on the panel itself changed (a selection): redraw on the next tick."""
        self._dirty = True

    @property
    def stale(self) -> bool:
        return self._dirty or self._current() != self._drawn

    @property
    def model_changed(self) -> bool:
        return self._drawn is None or self._drawn[0] != self._state.revision(MODEL)

    def drawn(self, revisions: tuple[int, ...]) -> None:
        self._drawn = revisions
        self._dirty = False

    def snapshot(self) -> tuple[int, ...]:
        return self._current()

    def _current(self) -> tuple[int, ...]:
        return tuple(self._state.revision(key) for key in self._keys)
