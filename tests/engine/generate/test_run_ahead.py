"""Each next step launched before the token that feeds it goes out (ChatSession.runs_ahead,
on by default on a GPU): a reply run ahead streams exactly the reply run step by step (tokens,
text, cache bytes, candidates, attention), and where it ends early (end of turn, Stop) the
step run ahead is forgotten: the cache holds what the step-by-step reply's does. On the CPU
the launched step runs at once; on a GPU (the `[cuda]` twin, `make gpu-check`) it overlaps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.events import Finished, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel, describe_fast
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.step import static as static_decode
from tests.engine.generate.test_generation import count_calls
from tests.engine.measure.test_accelerator import DEVICES
from tests.engine.model.test_fast import hf_model
from tests.engine.step.test_static import build
from tests.gguf_files import Q4_1, Q8_0, write_gguf
from tests.models import make_tiny

TURNS = [[Message("user", "Why is the sky blue?")]]
TURNS.append([*TURNS[0], Message("assistant", "Light scatters."), Message("user", "And red?")])
VIEW = ProbeSettings(attention_layers=(0, 1), top_k=5)
GREEDY = GenerationSettings(greedy=True, max_new_tokens=24, ignore_eos=True)
SAMPLED = GenerationSettings(max_new_tokens=24, ignore_eos=True, seed=5, top_k=20)
STATIC_DEVICES = [d for d in DEVICES if d != "mps"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", hf_model("llama"), Q4_1, Q8_0)


def fast_static(path, tokenizer, device: str) -> LoadedModel:
    """The tiny GGUF's fast model with the static step (on a GPU, its recorded graphs)."""
    model = build(path, device)
    step = static_decode.StaticDecode(
        model, static_decode.choose_backend(torch.device(device))[0], "test", first=16, ahead=64
    )
    model.static_step = step
    step.plan(0)
    assert step.recorder.idle(timeout=600)
    return LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"))


@pytest.fixture(scope="module", params=["exact", *(f"static-{d}" for d in STATIC_DEVICES)])
def loaded(request, tokenizer, tiny_gguf):
    if request.param == "exact":
        return make_tiny(tokenizer, "llama")
    return fast_static(tiny_gguf, tokenizer, request.param.removeprefix("static-"))


def replies(session: ChatSession, ahead: bool, settings: GenerationSettings,
            probes: ProbeSettings) -> list[list[Any]]:  # fmt: skip
    """Both turns' events (the second reusing the first's cache), run ahead or not, and
    the session's cached ids and the cache's bytes after each."""
    session.reset()
    session.runs_ahead = ahead
    turns = []
    for messages in TURNS:
        events = list(session.generate(messages, settings, probes))
        assert session._cache is not None
        turns.append([*events, (list(session._cached_ids), session._cache.layer_bytes())])
    return turns


def first(events: list[Any], kind: type) -> Any:
    return next(e for e in events if isinstance(e, kind))


def assert_same_tokens(ahead: list[Any], step_by_step: list[Any]) -> None:
    got = [e for e in ahead if isinstance(e, Token)]
    want = [e for e in step_by_step if isinstance(e, Token)]
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert "".join(t.text for t in got) == "".join(t.text for t in want)
    for a, b in zip(got, want, strict=True):
        assert a.kv_bytes == b.kv_bytes and a.seconds > 0
        assert [c.token_id for c in a.top_k] == [c.token_id for c in b.top_k]
        np.testing.assert_allclose([c.prob for c in a.top_k], [c.prob for c in b.top_k])
        assert a.attention.keys() == b.attention.keys()
        for layer in a.attention:
            np.testing.assert_allclose(a.attention[layer], b.attention[layer], atol=1e-6)


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("probes", [ProbeSettings.off(), VIEW], ids=["plain", "view"])
def test_a_reply_run_ahead_is_the_reply_run_step_by_step(loaded, settings, probes):
    session = ChatSession(loaded)
    want = replies(session, False, settings, probes)
    got = replies(session, True, settings, probes)
    for turn_got, turn_want in zip(got, want, strict=True):
        assert_same_tokens(turn_got, turn_want)
        assert turn_got[-1] == turn_want[-1]  # the cache holds the same ids after each turn
        reused = first(turn_got, PrefillDone).reused_tokens
        assert reused == first(turn_want, PrefillDone).reused_tokens
    assert first(got[1], PrefillDone).reused_tokens > 0  # the second turn continued the first


def test_a_reply_ending_at_its_end_of_turn_forgets_the_step_run_ahead(loaded):
    """The end of turn is known only once its token is read, after the next step was launched:
    that step is undone, and the next turn reuses the cache as after a step-by-step reply."""
    session = ChatSession(loaded)
    plain = replies(session, False, GREEDY, VIEW)[0]
    ending = [e for e in plain if isinstance(e, Token)][6].token_id
    session.eos_ids = frozenset({ending})
    settings = GenerationSettings(greedy=True, max_new_tokens=24)
    want = replies(session, False, settings, VIEW)
    got = replies(session, True, settings, VIEW)
    finished = first(got[0], Finished)
    assert finished.reason == "eos" and finished.generated_tokens <= 7
    for turn_got, turn_want in zip(got, want, strict=True):
        assert_same_tokens(turn_got, turn_want)
        assert turn_got[-1] == turn_want[-1]


def test_a_reply_ending_at_a_stop_string_forgets_the_step_run_ahead(loaded):
    session = ChatSession(loaded)
    plain = replies(session, False, GREEDY, ProbeSettings.off())[0]
    text = "".join(e.text for e in plain if isinstance(e, Token))
    start = next(i for i in range(len(text) // 3, len(text)) if text[i : i + 3].strip())
    stop = text[start : start + 3]  # somewhere inside the reply
    settings = replace(GREEDY, stop_strings=(stop,))
    want = replies(session, False, settings, ProbeSettings.off())
    got = replies(session, True, settings, ProbeSettings.off())
    assert first(got[0], Finished).reason == "stop_string"
    for turn_got, turn_want in zip(got, want, strict=True):
        assert_same_tokens(turn_got, turn_want)
        assert turn_got[-1] == turn_want[-1]


def test_stop_forgets_the_step_run_ahead(loaded):
    session = ChatSession(loaded)
    settings = GenerationSettings(greedy=True, max_new_tokens=40, ignore_eos=True)
    left = []
    for ahead in (False, True):
        session.reset()
        session.runs_ahead = ahead
        for event in session.generate(TURNS[0], settings, ProbeSettings.off()):
            if isinstance(event, Token) and event.index == 4:
                session.cancel()
            finished = event
        assert isinstance(finished, Finished) and finished.reason == "cancelled"
        assert finished.generated_tokens == 5
        assert session.cached_tokens == finished.prompt_tokens + 4  # tokens 0-3 were fed
        assert session._cache is not None
        left.append((list(session._cached_ids), session._cache.layer_bytes()))
    assert left[1] == left[0]


def test_a_paced_reply_runs_no_step_ahead(loaded):
    """A teacher stepping sees each step run when they ask for it, not before."""
    session = ChatSession(loaded)
    session.runs_ahead = True
    session.pacer.play(1000.0)  # paced: not at full speed
    steps = count_calls(session, "decode_one_token")
    settings = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
    for event in session.generate(TURNS[0], settings, ProbeSettings.off()):
        if isinstance(event, Token):
            assert steps[0] == event.index  # token 0 from the prefill, token k from step k


def test_a_reply_run_ahead_times_each_step_once(loaded):
    """A step's time runs from its token's turn to its read: the batch's view work is shared
    among its tokens once, and the phases add up to no more than the reply's wall time."""
    import time

    session = ChatSession(loaded)
    session.runs_ahead = True
    started = time.perf_counter()
    events = list(session.generate(TURNS[0], GREEDY, VIEW))
    wall = time.perf_counter() - started
    finished = first(events, Finished)
    tokens = [e for e in events if isinstance(e, Token)]
    assert all(t.seconds > 0 for t in tokens)
    assert finished.decode_s == pytest.approx(sum(t.seconds for t in tokens[1:]))
    assert finished.tokenize_s + finished.prefill_s + finished.decode_s <= wall
