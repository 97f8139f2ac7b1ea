"""A session that yields real engine events without a model, for benchmarks and tests.

`SyntheticSession` honours the `ChatSession` contract: PrefillDone, then one Token per piece,
then exactly one Finished (Failed before it on error); `cancel()` from any thread ends the reply
within one step. Its events have a real model's shapes: attention rows for the watched layers
as long as the context (a causal matrix at prefill), KV bytes from the cache formula, top-k
candidates. Its times are fixed (`step_s` per token), so a reply's numbers are known exactly,
and its Finished is tallied from the events it yielded, as the real session's is.

The GUI benchmark streams thousands of tokens of a prose passage through it as fast as the
window takes them; tests give it a short reply and pace it with `delay` or a `gate`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import cycle, islice
from typing import Any

import numpy as np

from app.bench.synthetic_rows import DeviceRows, ReplyNoise, statistics, unnormalised
from engine.events import (
    Attention,
    Candidate,
    Event,
    FinishReason,
    HeadStatistics,
    ModelInfo,
    PrefillDone,
    Tally,
    Token,
    frozen_array,
)
from engine.generate.pacing import PacedGeneration
from engine.kv_formula import formula_bytes
from engine.model.step_ring import ATTENTION, PROMPT, StepRing
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

# The bundled SmolLM2-135M's shapes. Its context holds 8,192 tokens; the synthetic one may run
# past that, so that one long reply can load a window with as many tokens as asked.
BUNDLED_SHAPES = ModelInfo(
    name="SmolLM2-135M shapes (synthetic)",
    source="bundled",
    architecture="LlamaForCausalLM",
    device="cpu",
    dtype="float32",
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    parameters=134_515_008,
    max_context=32_768,
    vocab_size=49152,
    bytes_per_value=4,
)

TOKENIZE_S = 0.001
STEP_S = 0.04  # what each decode step reports: the bundled model's ~25 tokens/s on a laptop
BROKEN = "the synthetic model broke"  # the error `raise_after` raises
CATCH_UP_S = 0.02  # how far a paced session may fall behind its schedule and make it up

# Prose with paragraphs, as a reply reads: a chat lays out blocks of realistic length.
PASSAGE = (
    "A transformer reads the whole prompt in one parallel pass, then writes its reply one"
    " token at a time. Each new token looks back at every earlier one through attention,"
    " and the keys and values it needs are kept in a cache, so a step costs one token's"
    " work and not the whole sequence again.\n\nThe cache grows by the same number of bytes"
    " at every step: two tensors per layer, one row per key and value head. Grouped-query"
    " attention lets several query heads share one of those rows, which is why this model"
    " keeps three instead of nine.\n\n"
)


def model_info(**changes: Any) -> ModelInfo:
    """The bundled model's shapes, with `changes` (any ModelInfo field) applied."""
    return replace(BUNDLED_SHAPES, **changes)


def passage_pieces(passage: str = PASSAGE) -> tuple[str, ...]:
    """The passage as word-sized pieces with their leading spaces, newlines kept."""
    pieces: list[str] = []
    for line in passage.split("\n"):
        words = line.split(" ")
        pieces.extend([words[0], *(" " + w for w in words[1:])] if line else [])
        pieces.append("\n")
    return tuple(p for p in pieces if p)


class SyntheticSession(PacedGeneration):
    """Replies with `pieces` (then "eos"), or with the passage repeated until the token limit.

    Pacing: `delay` seconds before each token, or one token per `gate` release; neither means
    as fast as the consumer takes them. `raise_after=n` raises after n tokens, as a model that
    breaks mid-reply. `calls`, `probes`, `resets` and `started` let tests see what the session
    was asked.
    """

    def __init__(
        self,
        info: ModelInfo | None = None,
        pieces: Sequence[str] | None = None,
        *,
        delay: float = 0.0,
        gate: threading.Semaphore | None = None,
        raise_after: int | None = None,
        step_s: float = STEP_S,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.info = info or BUNDLED_SHAPES
        self.pieces = tuple(pieces) if pieces is not None else None
        self.delay = delay
        self.gate = gate
        self.raise_after = raise_after
        self.step_s = step_s
        self.calls: list[tuple[Message, ...]] = []
        self.resets = 0
        self.started = threading.Event()
        self.token_texts: list[str] = []  # the last reply's Token.text, in order
        self.probes = ProbeSettings()  # the last reply's, as the session was asked
        self.last_kv_bytes = 0
        self._rng = np.random.default_rng(seed)
        vocabulary = sorted(set(self.pieces if self.pieces is not None else passage_pieces()))
        self._ids = {piece: 1000 + i for i, piece in enumerate(vocabulary)}
        self._candidates = {p: self._top_k(p) for p in vocabulary}
        self._noise: dict[int, np.ndarray] = {}  # [heads, keys] a layer's (synthetic_rows.py)
        self._reply_noise: ReplyNoise | None = None  # the watched layers' for this reply
        self.steps = StepRing(ProbeSettings().ring_bytes)  # as ChatSession's
        self._next_at = 0.0  # when the next paced token is due (perf_counter)

    def reset(self) -> None:
        self.resets += 1

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Words plus 3 per message, as a chat template adds a few tokens around each."""
        return sum(len(m.content.split()) + 3 for m in messages)

    def _generate(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> Iterator[Event]:
        self.calls.append(tuple(messages))
        self.probes = probes
        self.started.set()
        tally = Tally(started=time.perf_counter())
        prompt = self.count_tokens(messages)
        layers = tuple(probes.attention_layers)
        self.token_texts = []
        self.steps.start_reply(probes.ring_bytes)
        self._reply_noise = None
        prefill = self._prefill(prompt, layers, probes)
        tally.add(prefill)
        yield prefill
        if settings.pause_after_prefill:
            self.pacer.pause()
        reason: FinishReason = "eos"
        self._next_at = time.perf_counter()  # the schedule starts with the first step
        for index, piece in enumerate(self._reply_pieces(settings.max_new_tokens)):
            tally.paused_s += self.pacer.wait(self._cancel)
            if self._wait():
                reason = "cancelled"
                break
            if self.raise_after is not None and index >= self.raise_after:
                raise RuntimeError(BROKEN)
            event = self._token(index, piece, prompt, layers, probes)
            tally.add(event)
            self.token_texts.append(event.text)
            self.last_kv_bytes = event.kv_bytes
            yield event
        else:
            if self.pieces is None or settings.max_new_tokens < len(self.pieces):
                reason = "length"
        yield tally.finished(reason, "".join(self.token_texts))

    def _reply_pieces(self, limit: int) -> Iterator[str]:
        pieces = self.pieces if self.pieces is not None else cycle(passage_pieces())
        return islice(pieces, limit)

    def _wait(self) -> bool:
        """Wait for the next step; True if cancelled meanwhile."""
        if self.gate is not None:
            while not self.gate.acquire(timeout=0.01):
                if self._cancel.is_set():
                    return True
        elif self.delay:  # on a schedule: `delay` apart on average, whatever a token took
            # A wait wakes a little late (the timer's slack, the interpreter's lock, a pull of
            # rows): up to CATCH_UP_S behind, the next steps come at once, so that the rate is
            # the one asked for; later than that, the schedule starts again from now.
            now = time.perf_counter()
            behind = max(self.delay, CATCH_UP_S)
            self._next_at = max(self._next_at + self.delay, now - behind)
            if self._next_at > now:
                self._cancel.wait(self._next_at - now)
        return self._cancel.is_set()

    # -- events -----------------------------------------------------------------------------

    def _kv(self, tokens: int, probes: ProbeSettings) -> tuple[int, tuple[int, ...]]:
        total = formula_bytes(self.info, tokens)
        per_layer = (total // self.info.layers,) * self.info.layers
        return total, per_layer if probes.kv_per_layer else ()

    def _prefill(self, prompt: int, layers: tuple[int, ...], probes: ProbeSettings) -> PrefillDone:
        rows = probes.prompt_rows(prompt, prompt)
        queries = np.arange(prompt - rows, prompt)[:, None]
        visible = np.arange(prompt)[None, :] <= queries  # the causal mask
        attention = {}
        for layer in layers:
            weights = self._weights(layer, prompt)[:, None, :] * visible
            attention[layer] = frozen_array(weights / weights.sum(axis=2, keepdims=True))
        self.steps.put(0, ATTENTION, {layer: block[:, -1] for layer, block in attention.items()})
        if not probes.token_rows:  # as ChatSession: a window pulls its rows
            self.steps.put(0, PROMPT, attention)
        kv_bytes, per_layer = self._kv(prompt, probes)
        return PrefillDone(
            prompt_tokens=prompt,
            reused_tokens=0,
            processed_tokens=prompt,
            tokenize_s=TOKENIZE_S,
            seconds=self.step_s,
            kv_bytes=kv_bytes,
            kv_bytes_per_layer=per_layer,
            prompt_token_ids=tuple(range(prompt)),
            token_texts=tuple(f"p{i}" for i in range(prompt)),
            attention={
                layer: block
                for layer, block in attention.items()
                if probes.prompt_layers is None or layer in probes.prompt_layers
            },
            head_stats={layer: statistics(block) for layer, block in attention.items()},
        )

    def _token(
        self, index: int, piece: str, prompt: int, layers: tuple[int, ...], probes: ProbeSettings
    ) -> Token:
        keys = prompt + index  # the query producing token i sees the prompt and i - 1 tokens
        attention: Attention = {}
        stats: HeadStatistics = {}
        if index > 0:
            rows: dict[int, DeviceRows] = {}
            if layers:
                rows, stats = self._noise_of_reply(layers, keys).step(keys)
            self.steps.put(index, ATTENTION, rows)  # kept as a GPU engine keeps its rows
            if probes.token_rows:
                attention = {layer: frozen_array(np.asarray(row)) for layer, row in rows.items()}
        kv_bytes, per_layer = self._kv(prompt + index + 1, probes)
        return Token(
            index=index,
            token_id=self._id(piece),
            text=piece,
            piece=piece,
            # The first token's time is the prefill's and its sampling step's.
            seconds=self.step_s * (2 if index == 0 else 1),
            kv_bytes=kv_bytes,
            kv_bytes_per_layer=per_layer,
            attention=attention,
            top_k=self._candidates_of(piece)[: probes.top_k],
            head_stats=stats,
        )

    def _weights(self, layer: int, keys: int) -> np.ndarray:
        """[heads, keys] a row of `layer` before normalising (synthetic_rows.py)."""
        return unnormalised(self._layer_noise((layer,), keys)[layer], keys)

    def _layer_noise(self, layers: tuple[int, ...], keys: int) -> dict[int, np.ndarray]:
        """Each layer's noise, at least `keys` keys of it (lengthened, its keys kept)."""
        for layer in layers:
            noise = self._noise.get(layer)
            have = 0 if noise is None else noise.shape[1]
            if have < keys:
                shape = (self.info.heads, keys - have)
                fresh = self._rng.random(shape, dtype=np.float32) ** 4
                self._noise[layer] = fresh if noise is None else np.concatenate([noise, fresh], 1)
        return self._noise

    def _noise_of_reply(self, layers: tuple[int, ...], keys: int) -> ReplyNoise:
        """The reply's watched layers' noise and running sums, remade longer as it grows."""
        reply = self._reply_noise
        if reply is None or reply.keys <= keys:
            longest = max(keys, 1024) * 2
            reply = self._reply_noise = ReplyNoise(
                self._layer_noise(layers, longest), layers, longest
            )
        return reply

    def _id(self, piece: str) -> int:
        """Pieces get ids as they are first seen (tests may change `pieces` between replies)."""
        return self._ids.setdefault(piece, 1000 + len(self._ids))

    def _candidates_of(self, piece: str) -> tuple[Candidate, ...]:
        if piece not in self._candidates:
            self._candidates[piece] = self._top_k(piece)
        return self._candidates[piece]

    def _top_k(self, chosen: str) -> tuple[Candidate, ...]:
        self._id(chosen)
        others = [p for p in self._ids if p != chosen]
        picks = self._rng.choice(len(others), size=min(9, len(others)), replace=False)
        probs = np.sort(self._rng.dirichlet(np.ones(len(picks) + 1)))[::-1]
        texts = [chosen, *(others[i] for i in picks)]
        return tuple(
            Candidate(self._id(t), t, float(p), 1.0 if rank == 0 else 0.0)  # greedy
            for rank, (t, p) in enumerate(zip(texts, probs, strict=True))
        )


# The synthetic engine in an engine process (EngineSpec names them; the child imports this
# module alone, Qt-free, as the real engine's child imports no Qt).
SYNTHETIC_LOADER = "app.bench.synthetic:synthetic_loader"
SYNTHETIC_SESSION = "app.bench.synthetic:synthetic_session"


@dataclass
class SyntheticLoaded:
    info: ModelInfo
    delay: float = 0.0


def synthetic_loader(
    request: LoadRequest, progress: Callable[[str, float], None]
) -> SyntheticLoaded:
    """For the engine process (imported there by name): request.extra["delay"] paces tokens."""
    progress("Ready", 1.0)
    return SyntheticLoaded(BUNDLED_SHAPES, float(request.extra.get("delay", 0.0)))


def synthetic_session(loaded: SyntheticLoaded) -> SyntheticSession:
    return SyntheticSession(loaded.info, delay=loaded.delay)
