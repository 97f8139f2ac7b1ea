"""A chat session: prefill the prompt, decode token by token, and report it all as events.

    session = ChatSession(load_model(LoadRequest()))
    for event in session.generate(messages, GenerationSettings(greedy=True)):
        ...  # PrefillDone, Token..., (Failed), Finished

The session keeps the KV cache and the token ids it holds between turns: a prompt that extends
them is prefilled from where the cache ends; an edited history is cropped back to the longest
common prefix (or rebuilt). Cancel is a flag checked between steps.

The loop in `_reply`, in the style of gpt-fast: `prefill` runs the prompt's uncached part,
then per token the sampler picks from the last pass's logits and `decode_one_token` runs that
token; each pass is a `Forward` (logits, attention probe, positions run and cached), timed on
its own and placed on the roofline (engine/measure/roofline.py) against the machine's peaks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple, cast

import torch

from engine import token_labels
from engine.events import (
    Attention,
    Event,
    Failed,
    FinishReason,
    LayerLens,
    Peaks,
    PrefillDone,
    Roofline,
    Tally,
    Token,
    Transfer,
    frozen_array,
)
from engine.generate import context
from engine.generate.context import ContextFull
from engine.generate.head_stats import prefill_statistics
from engine.generate.pacing import PacedGeneration
from engine.generate.sampling import Sampler
from engine.generate.view_batch import Step, ViewBatch, Weigh
from engine.load.loader import LoadedModel
from engine.measure.device import EventStopwatch, HostStopwatch, Stopwatch, marker, stopwatch
from engine.measure.peaks import peaks_or_none
from engine.measure.roofline import ForwardCost, Meter
from engine.model.attention_probe import AttentionProbe
from engine.model.decoder import Cache, decoder_for
from engine.model.lens import LENS_TOP, LayerLensProbe
from engine.model.step_ring import PROMPT, StepRing
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.text import chat_format
from engine.text.detokenize import TextStream
from engine.text.prompt import encoder

log = logging.getLogger(__name__)


class ChatSession(PacedGeneration):
    def __init__(self, loaded: LoadedModel, peaks: Peaks | None = None) -> None:
        """`peaks`: the machine's ceilings for the roofline; measured (or read from the cache)
        for the model's device and compute dtype when not given."""
        super().__init__()
        self.model = loaded.model
        self.compiling = loaded.compiling  # the compiled decode step on its way, if any
        # What a placed model's hooks move per pass (None: all in place, nothing to measure)
        self.transfers = loaded.transfers
        self.decoder = decoder_for(loaded.model)  # transformers or Glassbox's own GGUF model
        self.tokenizer = loaded.tokenizer
        self.device = self.decoder.device
        peaks = peaks or peaks_or_none(self.device, loaded.info.dtype)
        cost = ForwardCost.of(loaded.model, loaded.info)
        self.info = replace(
            loaded.info,
            peaks=peaks,
            weight_bytes=cost.weight_bytes,
            embedding_row_bytes=cost.row_bytes,
        )
        self.meter = Meter(cost, peaks)
        self._special_ids = token_labels.special_ids(self.tokenizer)
        self._pieces: dict[int, str] = {}  # token id -> its text (_piece)
        self._cache: Cache | None = None
        self._cached_ids: list[int] = []
        self.eos_ids = self._eos_ids()
        # The latest reply's steps' attention rows, for the window to pull (ProbeSettings)
        self.steps = StepRing(ProbeSettings().ring_bytes)
        # Each layer's guess at the next token, kept for recent steps while watched
        self.lens_probe = LayerLensProbe(loaded.model)
        self._batch: ViewBatch | None = None  # the reply's tokens waiting for the view's work
        # Glassbox's own model weighs a watched layer's queries of several steps at once
        self._weigh: Weigh | None = getattr(self.decoder, "weigh", None)
        # Launch each next step before this token goes out, where the device runs it meanwhile
        # (a GPU; a placed model times each step's transfers alone): host and device overlap
        self.runs_ahead = self.device.type == "cuda" and self.transfers is None
        self._chosen_host = torch.zeros(1, dtype=torch.long, pin_memory=self.runs_ahead)
        # While the compiled step builds in a process beside this one (CPU), a thread fewer
        self._building: threading.Event | None = getattr(self.compiling, "building", None)
        self._threads_before_build = 0  # the count to go back to once the build ends (0: none)

    # -- public API -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the KV cache (a new chat, or after an error)."""
        self._cache, self._cached_ids = None, []

    @property
    def cached_tokens(self) -> int:
        return len(self._cached_ids)

    def watch_lens(self, on: bool) -> None:
        """Keep each step's per-layer residuals (from the next pass on) for `layer_lens`;
        off, no pass records anything. Any thread may call it."""
        self.lens_probe.watching = on

    def layer_lens(self, step: int, top: int = LENS_TOP) -> LayerLens | None:
        """The logit lens of step `step` of the latest reply, computed now from its kept
        residuals (None where it was not kept: unwatched then, or dropped from the ring).
        Any thread may call it, also while a reply runs."""
        return self.lens_probe.lens(step, self._piece, top)

    def count_tokens(self, messages: Sequence[Message], completion: bool = False) -> int:
        return len(encoder(completion)(self.tokenizer, messages))

    def _generate(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> Iterator[Event]:
        tally = Tally(started=time.perf_counter())
        stream: TextStream | None = None
        try:
            try:
                fitted = self._fit(messages, settings)
            except ContextFull as error:
                tally.tokenize_s = time.perf_counter() - tally.started
                yield Failed(str(error), "ContextFull")
                yield tally.finished("context_full", "")
                return
            prompt = fitted.prompt_ids
            tally.tokenize_s = time.perf_counter() - tally.started
            tally.prompt_tokens = len(prompt)
            room = self.info.max_context - len(prompt) if self.info.max_context else None
            stream = TextStream(
                self.tokenizer, prompt, self._stop_strings(settings), settings.text_per_token
            )
            yield from self._reply(prompt, settings, probes, tally, stream, room, fitted.dropped)
        except torch.OutOfMemoryError:
            self._recover()
            yield from self._abandon(tally)
            yield Failed(
                "The device ran out of memory. The reply was cut here and the cache freed;"
                " try a shorter conversation, fewer watched layers or a smaller model.",
                "OutOfMemoryError",
            )
            yield tally.finished("error", stream.text if stream else "")
        except Exception as error:  # the app must survive anything the model throws
            log.exception("generation failed")
            self._recover()
            yield from self._abandon(tally)
            yield Failed(f"Generation failed: {error}", type(error).__name__)
            yield tally.finished("error", stream.text if stream else "")

    def _abandon(self, tally: Tally) -> Iterator[Token]:
        """Tokens still waiting for their batch when the reply failed, as they streamed."""
        if self._batch is not None:
            for token in self._batch.abandon():
                _count(tally, token.index, token.seconds)
                yield token

    # -- the generation loop ----------------------------------------------------------------

    def _fit(self, messages: Sequence[Message], settings: GenerationSettings) -> context.Fitted:
        """Apply the context policy, keeping room for a reply of up to 1/4 of the window."""
        limit = self.info.max_context
        reserve = min(settings.max_new_tokens, limit // 4) if limit else 0
        encode = partial(encoder(settings.completion), self.tokenizer)
        # GenerationSettings has checked the policy's value; its field is typed as a plain str.
        policy = cast(context.Policy, settings.context_policy)
        return context.fit(messages, encode, limit, reserve, policy)

    def _reply(
        self,
        prompt: list[int],
        settings: GenerationSettings,
        probes: ProbeSettings,
        tally: Tally,
        stream: TextStream,
        room: int | None,
        dropped: int,
    ) -> Iterator[Event]:
        """Prefill, then sample and decode one token at a time until a stop reason."""
        budget = settings.max_new_tokens if room is None else min(settings.max_new_tokens, room)
        sampler = Sampler(settings, self.device)
        clock = stopwatch(self.device)
        # prompt + tokens so far: `history` [T] is a view of a buffer with room for the whole
        # reply, each token written in place on the device (no copy of the history a step)
        written = torch.empty(len(prompt) + budget, dtype=torch.long, device=self.device)
        written[: len(prompt)] = torch.tensor(prompt)
        history = written[: len(prompt)]
        self.lens_probe.ring.start_reply()  # a step number names a step of the latest reply

        self.steps.start_reply(probes.ring_bytes)
        clock.start()
        forward = self.prefill(prompt, settings.use_cache, probes)
        tally.prefill_s, tally.reused_tokens = clock.stop(), forward.cached
        if forward.probe is not None and not probes.token_rows:  # a window pulls its rows
            self.steps.put(0, PROMPT, dict(forward.probe.weights))
        yield self._prefill_event(prompt, forward, tally, probes, dropped)
        if settings.pause_after_prefill:
            self.pacer.pause()

        clock = self._step_clock()
        reason: FinishReason | None = None
        token_id, chosen = -1, history[-1]
        batch = self._batch = self._view_batch(settings, probes)
        ahead: Launched | None = None  # the next step, launched before this token went out
        for index in range(budget):
            if batch.steps and not self.pacer.at_full_speed:  # a teacher steps: show it all
                yield from self._finish(batch, tally)
            # Each step waits for the pacer first (at full speed it answers at once), outside
            # every clock: a paused or slowed reply has the timings of an unpaused one.
            tally.paused_s += self.pacer.wait(self._cancel)
            if self._cancel.is_set():  # Stop while held: no further step
                reason = "cancelled"
                break
            self._share_cores()
            transfer = None
            clock.start()
            if ahead is not None:  # launched while the last token went out
                forward, probs, chosen, history = ahead
            else:
                if index > 0:  # the last token through the model (token 0: the prefill's)
                    self._begin_transfer()
                    use_cache = settings.use_cache
                    self._feed(token_id, use_cache)
                    history, forward = self._launch(chosen, written, history, probes, use_cache)
                    transfer = self._transfer()
                probs, chosen = sampler.draw(forward.logits, history)
            per_layer = self._cache.layer_bytes() if self._cache is not None else ()
            ahead = None
            if self._may_run_ahead(settings) and index + 1 < budget:
                token_id, ahead = self._run_ahead(chosen, written, history, sampler, probes)
            else:
                token_id = int(chosen)  # the one host sync a step waits on (on a GPU)
            self.lens_probe.keep(index, forward.residuals, token_id)
            reason = self._stop_reason(token_id, index, budget, settings)
            # A teacher stepping or slowing a reply sees each token's text with its step, not
            # held until the next token completes the word
            stream.per_token = settings.text_per_token or not self.pacer.at_full_speed
            token = self._token_event(index, token_id, stream, reason, probes, per_layer)
            # token 0's latency starts with the prefill
            step_s = clock.stop() + (tally.prefill_s if index == 0 else 0.0)
            batch.add(self._step(replace(token, seconds=step_s, transfer=transfer), forward, probs))
            ends = reason is not None or stream.stopped
            if batch.due(step_s, at_once=index == 0 or ends):
                yield from self._finish(batch, tally)
            reason = self._after_token(reason, stream)
            if reason is not None:
                break
        if ahead is not None:  # the reply ended with its next step run: the cache forgets it
            self._unfeed()
        yield from self._finish(batch, tally)  # what a Stop left waiting
        yield tally.finished(reason or "length", stream.text)

    def _step_clock(self) -> Stopwatch | EventStopwatch:
        """The decode steps' (and their batches') clock. Running ahead, the host's: waiting for
        the device would undo the overlap. A step's time is then the loop's own from its token's
        turn to its read: the device's work that overlapped the last token's turn is not
        counted twice."""
        return HostStopwatch() if self.runs_ahead else stopwatch(self.device)

    def _share_cores(self) -> None:
        """While the compiled step builds in its own process beside this one, decode with a
        thread fewer, and with the count of before once it ends. torch's threads wait for each
        other at every op: one of them preempted by the build holds every op up for a time
        slice, which costs far more than the core the build takes (docs/benchmarks.md). Set
        here, in the decoding thread: the count is each thread's own."""
        if self._building is None:
            return
        if self._building.is_set():
            if not self._threads_before_build:
                self._threads_before_build = torch.get_num_threads()
            fewer = max(1, self._threads_before_build - 1)
            if torch.get_num_threads() > fewer:
                torch.set_num_threads(fewer)
        elif self._threads_before_build:
            torch.set_num_threads(self._threads_before_build)
            self._threads_before_build = 0

    def _may_run_ahead(self, settings: GenerationSettings) -> bool:
        """Whether the next step may be launched before this token goes out: a device that
        runs it meanwhile (`runs_ahead`), a cache that can forget it, and no teacher stepping."""
        return self.runs_ahead and settings.use_cache and self.pacer.at_full_speed

    def _launch(
        self,
        chosen: torch.Tensor,
        written: torch.Tensor,
        history: torch.Tensor,
        probes: ProbeSettings,
        use_cache: bool,
    ) -> tuple[torch.Tensor, Forward]:
        """The step for `chosen` (still on the device): the history [T + 1] with it written
        after `history` (a view of `written`), and its pass through the model."""
        written[len(history)] = chosen
        history = written[: len(history) + 1]
        return history, self.decode_one_token(history, use_cache, probes)

    def _run_ahead(
        self,
        chosen: torch.Tensor,
        written: torch.Tensor,
        history: torch.Tensor,
        sampler: Sampler,
        probes: ProbeSettings,
    ) -> tuple[int, Launched]:
        """Launch the next step (and its sampling) on the token the device just chose, then
        read that token: the device runs the next step while the host streams this one. The
        token's copy is queued before the next step, so reading it waits for no more.
        (Running ahead needs the cache: `_may_run_ahead`.)"""
        copied = self._chosen_host.copy_(chosen.reshape(1), non_blocking=True)
        chosen_ready = marker(self.device)
        history, forward = self._launch(chosen, written, history, probes, use_cache=True)
        launched = Launched(forward, *sampler.draw(forward.logits, history), history)
        chosen_ready()
        token_id = int(copied[0])
        self._feed(token_id, use_cache=True)
        return token_id, launched

    def _feed(self, token_id: int, use_cache: bool) -> None:
        """Note `token_id` as run through the model into the cache."""
        if use_cache:
            self._cached_ids.append(token_id)

    def _unfeed(self) -> None:
        """Forget the last token run into the cache (a step run ahead that the reply ended
        before): its position is overwritten by the next one written there."""
        self._cached_ids.pop()
        if self._cache is not None:
            self._cache.truncate(len(self._cached_ids))

    def _view_batch(self, settings: GenerationSettings, probes: ProbeSettings) -> ViewBatch:
        return ViewBatch(
            top_k=probes.top_k,
            watched=bool(probes.attention_layers),
            token_rows=probes.token_rows,
            ring=self.steps,
            piece=self._piece,
            greedy=settings.greedy,
            weigh=self._weigh_cached if self._weigh is not None else None,
        )

    def _weigh_cached(self, layer: int, queries: torch.Tensor, start: int) -> torch.Tensor:
        """[heads, n, keys]: `layer`'s weights of queries [1, heads, n, d] at start.. over the
        keys the session's cache holds for them."""
        assert self._weigh is not None and self._cache is not None  # as the batch was made
        return self._weigh(layer, queries, start, self._cache)

    def _step(self, token: Token, forward: Forward, probs: torch.Tensor | None) -> Step:
        """A decoded step as its batch keeps it until the view's work for it is done."""
        rows = _last_rows(forward.probe)  # the query that made this token, per watched layer
        probe = forward.probe
        later = dict(probe.queries) if probe is not None and probe.queries else {}
        roofline = partial(self._roofline, forward) if token.index > 0 else _not_placed
        return Step(token, forward.logits, probs, rows, roofline, later, forward.cached)

    def _finish(self, batch: ViewBatch, tally: Tally) -> Iterator[Token]:
        """The batch's Tokens, its candidates and statistics worked out together, its time
        shared among them; each counted as it goes out."""
        clock = self._step_clock()
        clock.start()
        for token in batch.finish(clock.stop):
            _count(tally, token.index, token.seconds)
            yield token

    def prefill(self, prompt: list[int], use_cache: bool, probes: ProbeSettings) -> Forward:
        """One pass over the prompt's uncached part (all of it without a cache)."""
        if use_cache:
            reused = self._reuse_cache(prompt)
        else:  # teaching mode: no cache at all, every step re-reads the whole sequence
            self.reset()
            reused = 0
        ids = torch.tensor([prompt[reused:]], device=self.device)  # [1, n]
        probe = self._probe(probes, rows=probes.prompt_rows(len(prompt) - reused, len(prompt)))
        with self.lens_probe.capture():
            logits = self.decoder.forward(ids, self._cache, probe)  # [vocab]
        self._cached_ids = list(prompt) if use_cache else []
        new = len(prompt) - reused
        residuals = self.lens_probe.residuals.take()
        return Forward(logits, probe, new, cached=reused, with_cache=use_cache, residuals=residuals)

    def decode_one_token(
        self, history: torch.Tensor, use_cache: bool, probes: ProbeSettings
    ) -> Forward:
        """One pass for the last token of `history` [T] (without a cache: all T again)."""
        ids = history[None, -1:] if use_cache else history[None, :]  # [1, 1] or [1, T]
        probe = self._probe(probes, rows=1, later=use_cache)
        with self.lens_probe.capture():
            logits = self.decoder.forward(ids, self._cache, probe)  # [vocab]
        new, residuals = ids.shape[1], self.lens_probe.residuals.take()
        return Forward(logits, probe, new, len(history) - new, use_cache, residuals)

    def _stop_reason(
        self, token_id: int, index: int, budget: int, settings: GenerationSettings
    ) -> FinishReason | None:
        """Why the reply ends with this token, as far as is known before its text streams."""
        if token_id in self.eos_ids and not settings.ignore_eos:
            return "eos"
        if self._cancel.is_set():
            return "cancelled"
        if index + 1 == budget:
            return "length"
        return None

    def _after_token(self, reason: FinishReason | None, stream: TextStream) -> FinishReason | None:
        """The reason, once the token's text has streamed (a stop string) and its event was
        handled (Stop may have been pressed meanwhile)."""
        if reason == "eos":
            return reason
        if stream.stopped:
            return "stop_string"
        if self._cancel.is_set():
            return "cancelled"
        return reason

    def _begin_transfer(self) -> None:
        if self.transfers is not None:
            self.transfers.begin()

    def _transfer(self) -> Transfer | None:
        """The weights the last pass moved in, against the placement's prediction."""
        if self.transfers is None or self.info.placement is None:
            return None
        moved, seconds = self.transfers.take()
        placement = self.info.placement
        predicted = self.transfers.predicted_s()  # the fast model's, from what was missing
        if predicted is None:  # accelerate's hooks move the same bytes every pass
            return Transfer(
                moved, seconds, placement.predicted_transfer_s, placement.predicted_step_s
            )
        return Transfer(moved, seconds, predicted, placement.compute_s + predicted)

    def _roofline(self, forward: Forward, seconds: float) -> Roofline:
        return self.meter.measure(forward.new, forward.cached, seconds, forward.with_cache)

    def _reuse_cache(self, prompt: list[int]) -> int:
        """Make the cache hold a prefix of `prompt`; return how many tokens it holds."""
        common = 0
        for cached, new in zip(self._cached_ids, prompt, strict=False):
            if cached != new:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # the last prompt token must run for logits
        if self._cache is None or common == 0:
            self._cache, self._cached_ids = self.decoder.new_cache(), []
            return 0
        if common < len(self._cached_ids) and not self._cache.truncate(common):
            self._cache, self._cached_ids = self.decoder.new_cache(), []
            return 0
        self._cached_ids = self._cached_ids[:common]
        return common

    def _probe(
        self, probes: ProbeSettings, rows: int, later: bool = False
    ) -> AttentionProbe | None:
        """The pass's probe; `later`: a model that can may leave its queries to the batch."""
        if not probes.attention_layers:
            return None
        queries: dict[int, torch.Tensor] | None = {} if later and self._weigh else None
        return AttentionProbe(frozenset(probes.attention_layers), max(rows, 1), queries=queries)

    # -- events -----------------------------------------------------------------------------

    def _prefill_event(
        self,
        prompt: list[int],
        forward: Forward,
        tally: Tally,
        probes: ProbeSettings,
        dropped: int,
    ) -> PrefillDone:
        per_layer = self._cache.layer_bytes() if self._cache is not None else ()
        pieces = [self._piece(i) for i in prompt]
        return PrefillDone(
            prompt_tokens=len(prompt),
            reused_tokens=forward.cached,
            processed_tokens=forward.new,
            tokenize_s=tally.tokenize_s,
            seconds=tally.prefill_s,
            kv_bytes=sum(per_layer),
            kv_bytes_per_layer=per_layer if probes.kv_per_layer else (),
            prompt_token_ids=tuple(prompt),
            token_texts=tuple(pieces) if probes.attention_layers else (),
            attention=_attention(forward.probe, probes.prompt_layers),
            head_stats=prefill_statistics(forward.probe.weights) if forward.probe else {},
            dropped_messages=dropped,
            roofline=self._roofline(forward, tally.prefill_s),
            prompt_labels=tuple(
                token_labels.label(self.tokenizer, i, piece) or piece
                for i, piece in zip(prompt, pieces, strict=True)
            ),
            special_ids=tuple(sorted(self._special_ids.intersection(prompt))),
        )

    def _token_event(
        self,
        index: int,
        token_id: int,
        stream: TextStream,
        reason: FinishReason | None,
        probes: ProbeSettings,
        per_layer: tuple[int, ...],
    ) -> Token:
        """The token as streamed (`per_layer`: the cache's bytes as its step left it); its
        timing and the view's data are filled in by its batch."""
        piece = self._piece(token_id)
        return Token(
            index=index,
            token_id=token_id,
            text=stream.push(token_id, last=reason is not None),
            piece=piece,
            seconds=0.0,
            kv_bytes=sum(per_layer),
            kv_bytes_per_layer=per_layer if probes.kv_per_layer else (),
            label=token_labels.label(self.tokenizer, token_id, piece),
        )

    def _piece(self, token_id: int) -> str:
        """The token's own text, decoded once per session (a tokenizer call costs more than
        a step's sampling on a small model, and the candidates name ten a step)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            # One list of ids decodes to one string (the stub also allows a batch's list).
            piece = cast(str, self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False))
            self._pieces[token_id] = piece
        return piece

    def _eos_ids(self) -> frozenset[int]:
        """The model's EOS, and the end-of-turn token its chat template writes (a chat model
        ends its reply there, and may never write an EOS at all)."""
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        return ids | chat_format.end_of_turn_ids(self.tokenizer)

    def _stop_strings(self, settings: GenerationSettings) -> tuple[str, ...]:
        """The settings' stop strings; a chat without a template also stops where the model
        starts the user's next line of the plain transcript."""
        if settings.completion or self.tokenizer.chat_template:
            return settings.stop_strings
        return settings.stop_strings + chat_format.PLAIN_STOP_STRINGS

    def _recover(self) -> None:
        self.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class Launched(NamedTuple):
    """A step launched ahead: its pass, its distribution, its chosen token (on the device) and
    the history it ran on."""

    forward: Forward
    probs: torch.Tensor | None  # None when greedy
    chosen: torch.Tensor
    history: torch.Tensor


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward pass: the last position's logits, and what the probes and roofline need."""

    logits: torch.Tensor  # [vocab] float32
    probe: AttentionProbe | None  # the attention it recorded
    new: int  # positions run now
    cached: int  # positions read from the cache (0 without one)
    with_cache: bool
    # each layer's output at the last position [layers, dim], while the lens is watched
    residuals: torch.Tensor | None = None


def _count(tally: Tally, index: int, step_s: float) -> None:
    """Token 0 closes the time to first token; every later one is a decode step."""
    if index == 0:
        tally.ttft_s = tally.tokenize_s + step_s
    else:
        tally.decode_s += step_s
    tally.generated = index + 1


def _not_placed(_seconds: float) -> None:
    """Token 0's roofline: its logits came from the prefill, placed with the PrefillDone."""
    return None


def _last_rows(probe: AttentionProbe | None) -> dict[int, torch.Tensor]:
    """layer -> [heads, keys]: the last query's row of each watched layer, on its device."""
    if probe is None:
        return {}
    # A prompt's block is cloned from: a view would keep all of its rows alive in the ring.
    return {
        layer: w[:, -1].clone() if w.shape[1] > 1 else w[:, -1]
        for layer, w in sorted(probe.weights.items())
    }


def _attention(probe: AttentionProbe | None, layers: Sequence[int] | None) -> Attention:
    """The probe's blocks on the host: those of `layers` (None: every one it watched)."""
    if probe is None:
        return {}
    return {
        layer: frozen_array(w.cpu().numpy())
        for layer, w in sorted(probe.weights.items())
        if layers is None or layer in layers
    }
