"""The events a generation yields: the one contract between the engine and everyone else.

Every event is a frozen dataclass of plain data (ints, floats, str, tuples, read-only numpy
arrays), never a live tensor, so it can cross threads, be stored and be written as JSON.
A generation always ends with exactly one `Finished`; an error yields `Failed` just before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["eos", "stop_string", "length", "cancelled", "error", "context_full"]
Bound = Literal["compute", "memory"]

# layer index -> attention weights; prefill: [heads, queries, keys], decode: [heads, keys].
Attention = dict[int, np.ndarray]
# layer index -> per-head statistics of its attention rows, HEAD_STATS in order on the first
# axis; prefill: [2, heads, queries], decode: [2, heads] (the row of the query that made the
# token). "max_weight": a row's largest weight; "entropy": -sum w log w over the keys the query
# sees, divided by log(max(keys seen, 2)), its most (uniform). Computed where the model runs
# (engine/generate/head_stats.py), so the window's overview needs no rows.
HeadStatistics = dict[int, np.ndarray]
HEAD_STATS = ("max_weight", "entropy")


def frozen_array(values: np.ndarray) -> np.ndarray:
    """A float32 C-contiguous copy that nobody can write to (events are immutable)."""
    array = np.ascontiguousarray(values, dtype=np.float32).copy()
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True)
class Peaks:
    """The machine's measured ceilings for one device and compute dtype
    (engine/measure/peaks.py)."""

    peak_flops_per_s: float  # a large matmul in `dtype`
    peak_bytes_per_s: float  # a large memory copy: bytes read + bytes written per second
    dtype: str
    device: str
    method: str  # how they were measured, in words

    @property
    def ridge(self) -> float:
        """FLOP per byte where the bandwidth slope meets the compute ceiling."""
        if self.peak_bytes_per_s <= 0:
            return float("inf")
        return self.peak_flops_per_s / self.peak_bytes_per_s


@dataclass(frozen=True, slots=True)
class Roofline:
    """One forward pass on the machine's roofline, counted from the model's shapes
    (engine/measure/roofline.py) and timed by the pass's own measured seconds."""

    flops: int
    bytes: int  # weights as stored + KV cache read + KV cache written
    intensity: float  # FLOP per byte
    flops_per_s: float
    bytes_per_s: float
    bound: Bound  # intensity against the ridge point of ModelInfo.peaks


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the model's weights live, decided at load (engine/placement/).

    Places are "cuda:N", "cpu" (RAM) or "disk" (files accelerate's hooks read before each use).
    `moved_bytes` are the weights brought to the executing device on every forward pass.
    At load a probe pass (one token, metered as decode is) measured how fast its hooks read
    them in (`read_bytes_per_s`, 0: nothing moves) and what the rest of the pass took
    (`compute_s`), so `moved_bytes / read_bytes_per_s` predicts a pass's transfer and
    `compute_s` plus that its whole time.
    """

    layer_places: tuple[str, ...]  # per decoder layer
    layer_bytes: tuple[int, ...]
    place_bytes: tuple[tuple[str, int], ...]  # every weight, summed per place
    moved_bytes: int
    read_bytes_per_s: float
    execution_device: str
    note: str = ""  # how the map was chosen, in words
    compute_s: float = 0.0
    # Glassbox's own model: "disk" is the mapped GGUF (or pack) file, read through the OS's
    # page cache only where it lacks pages (engine/placement/mapped.py); moved_bytes is then
    # what a step reads at most, when none of it is cached.
    mapped: bool = False

    @property
    def predicted_transfer_s(self) -> float:
        if self.moved_bytes == 0 or self.read_bytes_per_s <= 0:
            return 0.0
        return self.moved_bytes / self.read_bytes_per_s

    @property
    def predicted_step_s(self) -> float:
        return self.compute_s + self.predicted_transfer_s


@dataclass(frozen=True, slots=True)
class Transfer:
    """The weights one forward pass brought in: counted as the hooks read them, timed around
    the hooks' weight loading (CUDA events on a GPU); `predicted_s` is the load's estimate of
    that time, `predicted_step_s` of the whole pass (Placement.predicted_step_s)."""

    bytes: int
    seconds: float
    predicted_s: float
    predicted_step_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the loaded model is, with the numbers the KV-cache formula needs."""

    name: str
    source: str  # "bundled", "hub", "folder" or "gguf"
    architecture: str
    device: str
    dtype: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    parameters: int
    max_context: int
    vocab_size: int
    bytes_per_value: int
    # Layers whose cache keeps only the last `sliding_window` tokens (e.g. Gemma 3 local layers).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    # "exact": dequantised weights in transformers; "fast": the GGUF's quantised weights.
    precision: str = "exact"
    # The chat template prompts are rendered with: "own" (the model's), "plain" (none: a
    # user:/assistant: transcript) or the name of engine/text/chat_format.py's template chosen for a
    # GGUF without one ("gemma", "chatml", "llama3"); chat_format.label(...) says it in words.
    chat_format: str = "own"
    # The measured ceilings the roofline of each pass is drawn against (None: not measured).
    peaks: Peaks | None = None
    # What every forward pass reads of the weights as stored, and the embedding bytes looked up
    # per new position (engine/measure/roofline.py): a pass's Roofline.bytes less these is KV cache.
    # 0 where the engine did not count them.
    weight_bytes: int = 0
    embedding_row_bytes: int = 0
    # Where the layers live, when the load asked for a placement (None: all on `device`).
    placement: Placement | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One of the top-k next tokens of a step.

    `prob` is the softmax of the model's logits; `sampled_prob` is the probability the sampler
    actually drew from, after repetition penalty, temperature, top-k and top-p (0 if filtered).
    """

    token_id: int
    text: str
    prob: float
    sampled_prob: float


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """The prompt has been processed in one parallel pass.

    `reused_tokens` came from the cache kept since the previous turn; only
    `processed_tokens` (= prompt_tokens - reused_tokens) went through the model now.
    """

    prompt_tokens: int
    reused_tokens: int
    processed_tokens: int
    tokenize_s: float
    seconds: float
    kv_bytes: int
    kv_bytes_per_layer: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    # The text of each prompt token, for axis labels and hover.
    token_texts: tuple[str, ...]
    # layer -> [heads, processed query rows, keys]; empty when attention is not watched.
    attention: Attention = field(default_factory=dict)
    # The oldest messages left out so the conversation fits the context window.
    dropped_messages: int = 0
    # The prefill's forward pass on the roofline (None where it was not counted).
    roofline: Roofline | None = None
    # Every prompt token as a chip shows it: its text, or its bytes ("<0xE2>") where the text
    # is not whole characters (engine/token_labels.py); () where the engine did not say.
    prompt_labels: tuple[str, ...] = ()
    # The tokenizer's special tokens among the prompt's (BOS, the chat template's markers).
    special_ids: tuple[int, ...] = ()
    # layer -> [2, heads, queries]: the statistics of `attention`'s rows (the same rows), for
    # every watched layer even where the rows themselves did not cross (see HeadStatistics).
    head_stats: HeadStatistics = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.processed_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token.

    `text` is what the stream releases now (possibly "" while a multi-byte character or a word
    piece is incomplete); joined over a reply it equals the decoded reply. `piece` is this
    token's own text. `seconds` is the step's latency: for index 0 the time since the prompt was
    tokenized (prefill + sampling), for later tokens one decode step.
    """

    index: int
    token_id: int
    text: str
    piece: str
    seconds: float
    kv_bytes: int
    kv_bytes_per_layer: tuple[int, ...]
    # layer -> [heads, keys]: the attention of the query that produced this token (the previous
    # token) over the whole context. Empty for index 0: its query is PrefillDone's last row.
    # Empty too where the generation keeps rows in its ring instead (ProbeSettings.token_rows
    # False, the window's way): they come as StepRows when a panel draws or asks for them.
    attention: Attention = field(default_factory=dict)
    top_k: tuple[Candidate, ...] = ()
    # The decode step's forward pass that produced this token's logits, on the roofline
    # (None for index 0, whose logits came from the prefill, and where it was not counted).
    roofline: Roofline | None = None
    # The token's bytes ("<0xE2>") where `piece` is not whole characters; "" where it is.
    label: str = ""
    # The weights that step's pass moved in from RAM or disk (None: a model wholly in place).
    transfer: Transfer | None = None
    # layer -> [2, heads]: the statistics of this step's attention row per watched layer (see
    # HeadStatistics), whether or not the row itself is in `attention`. Empty for index 0.
    head_stats: HeadStatistics = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepRows:
    """One step's attention rows, from the engine's ring of recent steps
    (engine/model/step_ring.py) rather than with its token.

    `step` is the Token index whose query the rows are (step 0: the prompt's last row).
    `latest`: sent because a visible panel draws these layers (at most at its frame rate);
    otherwise asked for (a selected or stepped-to token). `aged_out`: the step has left the
    ring (or never had rows): `attention` is empty. `prompt`: the prompt's matrix
    [heads, rows, keys] of layers a panel began to draw after the PrefillDone crossed without
    them (step 0), as the PrefillDone would have carried it.
    """

    step: int
    attention: Attention
    latest: bool = False
    aged_out: bool = False
    prompt: bool = False


@dataclass(frozen=True, slots=True)
class PooledBlock:
    """One layer's prompt matrix [heads, queries, keys] as the attention mosaic draws it
    (engine/attention_pooling.py): its first `rows` query rows max-pooled over runs of
    `row_factor` rows and `key_factor` keys, each row's keys past its own position counted as
    zeros, and its last query rows as they are (`tail`), so a decoded row that joins their run,
    or rewrites the last, is pooled with them."""

    cells: np.ndarray  # [heads, rows / row_factor, ceil(keys / key_factor)] float32
    row_factor: int
    key_factor: int
    tail: np.ndarray  # [heads, queries - rows, keys] float32

    @property
    def rows(self) -> int:
        return int(self.cells.shape[1]) * self.row_factor

    @property
    def queries(self) -> int:
        return self.rows + int(self.tail.shape[1])

    @property
    def keys(self) -> int:
        return int(self.tail.shape[2])

    @property
    def heads(self) -> int:
        return int(self.cells.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.cells.nbytes + self.tail.nbytes)


@dataclass(frozen=True, slots=True)
class PromptCells:
    """The prompt's matrices of the layers a panel draws, pooled at that panel's grid, sent
    just after a PrefillDone that crossed without them: a few hundred KB where the rows are
    MBs. The rows follow when the reply ends or is held, or when the window asks
    (app/server/view_rows.py), as StepRows(0, ..., prompt=True)."""

    attention: dict[int, PooledBlock]


@dataclass(frozen=True, slots=True)
class LayerLens:
    """A logit lens of one step (engine/model/lens.py): each layer's guess at the next token.

    Row i is the residual stream after layer i at the step's last position, put through the
    model's final norm and output head: its `top` token ids, their texts and probabilities
    (highest first). The last row is the step's own next-token distribution. `chosen_ranks`
    and `chosen_probs` say, per layer, where the token the step chose stood (rank 0: first).
    Sent on request, for the step a panel shows; never per token.
    """

    step: int  # the reply's token index this pass's logits chose
    token_id: int
    token_text: str
    token_ids: tuple[tuple[int, ...], ...]  # [layers][top]
    texts: tuple[tuple[str, ...], ...]  # [layers][top]
    probs: tuple[tuple[float, ...], ...]  # [layers][top]
    chosen_ranks: tuple[int, ...]  # [layers]
    chosen_probs: tuple[float, ...]  # [layers]
    # How long working it out took the engine (every layer through the head): while a reply
    # runs, the time it waits between two steps for this lens, which is what following it costs
    seconds: float

    @property
    def layers(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Failed:
    """Something went wrong; `Finished(reason="error")` follows with what was generated.

    `error_type` names the error; ENGINE_STOPPED says the engine process died under the reply.
    """

    message: str
    error_type: str


ENGINE_STOPPED = "EngineStopped"  # Failed.error_type of a reply cut off with its engine


@dataclass(frozen=True, slots=True)
class Finished:
    """The reply is over; the numbers the status bar, the store and the CLI report."""

    reason: FinishReason
    text: str
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    tokenize_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    total_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from prefill; decode produced the remaining ones.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        processed = self.prompt_tokens - self.reused_tokens
        return processed / self.prefill_s if self.prefill_s > 0 else 0.0


@dataclass
class Tally:
    """What a reply has done so far, so its Finished can be built at any point: by the session
    as it generates, and by the window for a reply cut off with its engine."""

    started: float
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    paused_s: float = 0.0  # held by the pacer: in no figure, total_s included

    def add(self, event: PrefillDone | Token) -> None:
        """Take in an event as the engine reported it: the first token's time completes the
        TTFT (tokenize + prefill + its sampling); every later token's is a decode step."""
        if isinstance(event, PrefillDone):
            self.prompt_tokens, self.reused_tokens = event.prompt_tokens, event.reused_tokens
            self.tokenize_s, self.prefill_s = event.tokenize_s, event.seconds
        else:
            self.generated += 1
            if event.index == 0:
                self.ttft_s = self.tokenize_s + event.seconds
            else:
                self.decode_s += event.seconds

    def finished(self, reason: FinishReason, text: str) -> Finished:
        return Finished(
            reason=reason, text=text, prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens, generated_tokens=self.generated,
            tokenize_s=self.tokenize_s, prefill_s=self.prefill_s, ttft_s=self.ttft_s,
            decode_s=self.decode_s, total_s=time.perf_counter() - self.started - self.paused_s,
        )  # fmt: skip


Event = PrefillDone | PromptCells | Token | StepRows | Failed | Finished


def token_runs(
    events: Iterable[Event], joins: Callable[[Token], bool] = lambda _token: True
) -> Iterator[list[Token] | Event]:
    """`events` in order, each longest run of tokens that `joins` accepts as one list (a
    delivered batch is mostly one run, which a listener takes in one step)."""
    run: list[Token] = []
    for event in events:
        if isinstance(event, Token) and joins(event):
            run.append(event)
            continue
        if run:
            yield run
            run = []
        yield event
    if run:
        yield run
