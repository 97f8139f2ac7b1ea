"""The trace is the events as the one serializer writes them, under the trace's documented keys."""

from __future__ import annotations

import json

from engine.events import Peaks, Token
from engine.generate.session import ChatSession
from engine.generate.trace import (
    LENS_FIELDS,
    MODEL_FIELDS,
    PREFILL_FIELDS,
    STEP_FIELDS,
    TraceRecorder,
)
from engine.serialize import event_to_dict, plain
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.models import make_tiny

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")


def test_the_trace_holds_each_event_as_serialized(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    trace = TraceRecorder(session.info)
    settings = GenerationSettings(greedy=True, max_new_tokens=3, ignore_eos=True)
    events = list(session.generate([Message("user", "Hi")], settings, ProbeSettings((0, 2), 5)))
    for event in events:
        trace.add(event)
    data = json.loads(json.dumps(trace.to_dict()))  # all of it is plain JSON

    assert data["model"] == {name: plain(session.info)[name] for name in MODEL_FIELDS}
    assert data["model"]["peaks"]["peak_flops_per_s"] == FIXED.peak_flops_per_s
    prefill = event_to_dict(events[0])
    assert data["prefill"] == {"tokens": prefill["prompt_tokens"],
                               **{name: prefill[name] for name in PREFILL_FIELDS}}  # fmt: skip
    tokens = [e for e in events if isinstance(e, Token)]
    assert len(data["steps"]) == len(tokens) == 3
    for step, token in zip(data["steps"], tokens, strict=True):
        written = event_to_dict(token)
        assert step == {"text": token.piece, **{name: written[name] for name in STEP_FIELDS}}
    assert data["finish_reason"] == "length" and data["error"] is None


def test_the_trace_records_each_watched_steps_logit_lens(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    trace = TraceRecorder(session.info)
    settings = GenerationSettings(greedy=True, max_new_tokens=3, ignore_eos=True)
    session.watch_lens(True)
    for event in session.generate([Message("user", "Hi")], settings, ProbeSettings((), 5)):
        trace.add(event)
        if isinstance(event, Token):
            trace.add_lens(session.layer_lens(event.index))
    data = json.loads(json.dumps(trace.to_dict()))
    for index, step in enumerate(data["steps"]):
        lens = session.layer_lens(index)
        assert step["lens"] == {name: plain(lens)[name] for name in LENS_FIELDS}
        assert len(step["lens"]["probs"]) == session.info.layers
        # the last layer's guesses are the step's own top-k
        top = [c["token_id"] for c in step["top_k"]]
        assert step["lens"]["token_ids"][-1][: len(top)] == top
    unwatched = TraceRecorder(session.info)
    session.watch_lens(False)
    for event in session.generate([Message("user", "Hi")], settings, ProbeSettings((), 5)):
        unwatched.add(event)
        if isinstance(event, Token):
            unwatched.add_lens(session.layer_lens(event.index))
    assert all("lens" not in step for step in unwatched.to_dict()["steps"])  # as before
