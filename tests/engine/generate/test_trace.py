"""The trace is the events as the one serializer writes them, under the trace's documented keys."""

from __future__ import annotations

import json

from engine.events import Peaks, Token
from engine.generate.session import ChatSession
from engine.generate.trace import MODEL_FIELDS, PREFILL_FIELDS, STEP_FIELDS, TraceRecorder
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
