"""The window serves the API: requests through the official `openai` client become
conversations of their own in the sidebar, stream into the chat and fill the panels; Serve off
frees the port; an unsafe address or a port in use is refused with a message.

The blocking client runs in a thread while the test's event loop runs the window."""

from __future__ import annotations

import socket
import threading

import httpx
import numpy as np
import openai
import pytest

from engine.events import Finished, Token
from tests.ui.fakes import FakeBackend
from ui.conversation_list import CLIENT_ROLE
from ui.serve_settings import ServeOptions

WAIT_MS = 60000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def serve(qtbot, parts, options: ServeOptions) -> None:
    parts.window.settings_panel.serve.set_options(options)
    parts.serve.action.setChecked(True)


def in_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = call()
        except Exception as error:  # reported by the test, not lost in the thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_an_api_request_streams_into_a_conversation_of_its_own(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    port = free_port()
    serve(qtbot, parts, ServeOptions("127.0.0.1", port, ""))
    assert parts.serve.serving, parts.window.settings_panel.serve.status.text()
    qtbot.waitUntil(lambda: parts.serve.server.started, timeout=WAIT_MS)
    events: list = []
    parts.window.events_received.connect(events.extend)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    def ask() -> list:
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello from a script"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        return list(stream)

    thread, result = in_thread(ask)
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
    assert "error" not in result, result.get("error")
    chunks = result["value"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage

    # the sidebar: a conversation of its own, marked as the API's, with the client's name
    sidebar = parts.controller.sidebar.list
    titles = [sidebar.item(row).text() for row in range(sidebar.count())]
    agent = f"OpenAI/Python {openai.__version__}"
    assert titles[0] == f"API · {agent} · Hello from a script", titles
    assert not sidebar.item(0).icon().isNull()  # the API's mark, its client in the tooltip
    assert sidebar.item(0).data(CLIENT_ROLE) == agent and agent in sidebar.item(0).toolTip()
    # the chat shows it as a typed message's reply; the store keeps it
    entries = parts.window.conversation_model.entries
    assert [(e.role, e.text) for e in entries] == [
        ("user", "Hello from a script"),
        ("assistant", streamed),
    ]
    stored = parts.controller.store.messages(parts.controller.conversation_id)
    assert [(m.role, m.text) for m in stored] == [(e.role, e.text) for e in entries]
    # the panels took the same reply's events: one token per token the client was charged
    tokens = [e for e in events if isinstance(e, Token)]
    assert len(tokens) == usage.completion_tokens == 10
    assert any(isinstance(e, Finished) for e in events)
    parts.internals.redraw(force=True)
    _x, kv = parts.internals.kv_cache.curve.getData()
    assert kv[-1] == tokens[-1].kv_bytes
    _x, steps = parts.internals.timing.step_curve.getData()
    np.testing.assert_array_equal(steps, [t.seconds for t in tokens[1:]])

    parts.serve.action.setChecked(False)  # off: the thread is joined and the port is free
    assert not parts.serve.serving
    assert port_is_free(port)


def test_a_request_that_extends_the_last_reuses_its_kv_cache(qtbot, build, tiny_loader):
    """An agent resends its conversation grown by a turn: the window's engine prefills only
    the new part, as `glassbox serve` does (each request still opens its own conversation)."""
    parts = build(tiny_loader)
    port = free_port()
    serve(qtbot, parts, ServeOptions("127.0.0.1", port, ""))
    qtbot.waitUntil(lambda: parts.serve.server.started, timeout=WAIT_MS)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    model = parts.window.info.name
    first_turn = [{"role": "user", "content": "Hello from an agent"}]

    def ask(messages):
        thread, result = in_thread(
            lambda: client.chat.completions.create(
                model=model, messages=messages, max_tokens=4, temperature=0
            )
        )
        qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
        assert "error" not in result, result.get("error")
        return result["value"]

    first = ask(first_turn)
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    second = ask([*first_turn, reply, {"role": "user", "content": "And then?"}])
    # the first prompt is a prefix of the second: all of it came from the cache
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert len(api_titles(parts)) == 2  # two conversations in the sidebar all the same


def test_a_non_loopback_host_without_a_key_is_refused(qtbot, build, tiny_loader, monkeypatch):
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)
    parts = build(tiny_loader)
    serve(qtbot, parts, ServeOptions("0.0.0.0", free_port(), ""))
    assert not parts.serve.serving
    assert not parts.serve.action.isChecked()
    status = parts.window.settings_panel.serve.status.text()
    assert "Not serving: listening on 0.0.0.0 lets other machines in" in status
    assert "API key" in status


def test_a_port_in_use_is_refused_and_the_window_goes_on(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve(qtbot, parts, ServeOptions("127.0.0.1", port, ""))
        assert not parts.serve.serving and not parts.serve.action.isChecked()
        status = parts.window.settings_panel.serve.status.text()
        assert f"cannot listen on 127.0.0.1:{port}" in status
    serve(qtbot, parts, ServeOptions("127.0.0.1", free_port(), ""))  # another port serves
    assert parts.serve.serving


def test_a_key_set_in_the_window_is_asked_of_every_client(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    port = free_port()
    serve(qtbot, parts, ServeOptions("127.0.0.1", port, "a-long-secret"))
    assert "(API key required)" in parts.window.settings_panel.serve.status.text()
    qtbot.waitUntil(lambda: parts.serve.server.started, timeout=WAIT_MS)
    base = f"http://127.0.0.1:{port}/v1"

    def models(key: str):
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0).models.list()

    thread, refused = in_thread(lambda: models("wrong-key"))
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
    assert isinstance(refused.get("error"), openai.AuthenticationError)
    thread, listed = in_thread(lambda: models("a-long-secret"))
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
    assert [m.id for m in listed["value"].data] == [parts.window.info.name]
    # the settings are remembered for the next window
    assert parts.serve.qsettings.value("serve/port") in (port, str(port))


@pytest.fixture(autouse=True)
def _quiet_keys(monkeypatch):
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)


@pytest.fixture
def stepped(build):
    """The window on a synthetic engine that holds each reply after its prefill."""
    backend = FakeBackend(pieces=tuple(f" w{i}" for i in range(40)))
    parts = build(backend.load, backend.make_session)
    parts.backend = backend
    parts.window.settings_panel.set_pause_after_prefill(True)
    return parts


def serving(qtbot, parts) -> str:
    port = free_port()
    serve(qtbot, parts, ServeOptions("127.0.0.1", port, ""))
    qtbot.waitUntil(lambda: parts.serve.server.started, timeout=WAIT_MS)
    return f"http://127.0.0.1:{port}/v1"


def test_stepping_holds_an_api_reply_and_its_client_waits(qtbot, stepped):
    parts, window = stepped, stepped.window
    client = openai.OpenAI(base_url=serving(qtbot, parts), api_key="x", max_retries=0)
    model = window.info.name
    thread, result = in_thread(
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "step me"}], max_tokens=3
        )
    )
    qtbot.waitUntil(lambda: window.pace.held, timeout=WAIT_MS)
    assert thread.is_alive() and parts.internals.state.trail.generated == 0
    window.pace.next_action.trigger()  # one token, then held again: the client still waits
    qtbot.waitUntil(
        lambda: parts.internals.state.trail.generated == 1 and window.pace.held, timeout=WAIT_MS
    )
    assert thread.is_alive()
    window.pace.resume_action.trigger()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
    reply = result["value"]
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].message.content == window.conversation_model.entries[-1].text


def test_a_client_that_goes_away_stops_its_reply_in_the_window(qtbot, stepped):
    parts, window = stepped, stepped.window
    base = serving(qtbot, parts)
    finished: list = []
    window.events_received.connect(
        lambda batch: finished.extend(e for e in batch if isinstance(e, Finished))
    )
    # Every hold the engine reports: the hold after the prefill may be over (the reply
    # cancelled once the client left) before a poll of the window's state would see it.
    holds: list[bool] = []
    parts.worker.held_changed.connect(holds.append)
    body = {
        "model": window.info.name,
        "messages": [{"role": "user", "content": "go away"}],
        "max_tokens": 30,
        "stream": True,
    }

    def ask_and_leave() -> None:
        with httpx.stream("POST", base + "/chat/completions", json=body, timeout=60) as reply:
            next(reply.iter_lines())  # the reply began (held after its prefill); then gone

    thread, result = in_thread(ask_and_leave)
    qtbot.waitUntil(lambda: not thread.is_alive() and True in holds, timeout=WAIT_MS)
    assert "error" not in result, result.get("error")
    qtbot.waitUntil(lambda: bool(finished), timeout=WAIT_MS)  # stopped while held
    assert finished[-1].reason == "cancelled" and finished[-1].generated_tokens == 0
    qtbot.waitUntil(lambda: not window.replying and not parts.worker.busy, timeout=WAIT_MS)
    assert parts.serve.server.bridge.active is None


def api_titles(parts) -> list[str]:
    sidebar = parts.controller.sidebar.list
    titles = [sidebar.item(row).text() for row in range(sidebar.count())]
    return [title for title in titles if title.startswith("API · ")]


def test_a_typed_message_and_api_requests_share_one_queue(qtbot, stepped):
    """A request waits for the typed message's reply; one whose client leaves while it waits
    never starts; the next runs once the window is free."""
    parts, window = stepped, stepped.window
    base = serving(qtbot, parts)
    assert window.send("typed first")
    qtbot.waitUntil(lambda: window.pace.held, timeout=WAIT_MS)

    def ask_and_leave() -> None:
        body = {"model": window.info.name, "messages": [{"role": "user", "content": "leaving"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/chat/completions", json=body, timeout=1.0)

    leaving, left = in_thread(ask_and_leave)
    qtbot.waitUntil(lambda: not leaving.is_alive(), timeout=WAIT_MS)
    assert "error" not in left, left.get("error")
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    thread, result = in_thread(
        lambda: client.completions.create(model=window.info.name, prompt="waits", max_tokens=2)
    )
    bridge = parts.serve.server.bridge

    def waiting() -> list[str]:
        return [request.ask.messages[-1].content for request in bridge.waiting]

    # The server hears of the client that left on its own time: wait for it, not a count.
    qtbot.waitUntil(lambda: waiting() == ["waits"], timeout=WAIT_MS)  # the one that left is gone
    assert api_titles(parts) == [] and window.conversation_model.entries[0].text == "typed first"
    window.pace.resume_action.trigger()  # the typed reply ends; the waiting request starts
    qtbot.waitUntil(lambda: bool(api_titles(parts)) and window.pace.held, timeout=WAIT_MS)
    assert thread.is_alive()
    window.pace.resume_action.trigger()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=WAIT_MS)
    assert result["value"].usage.completion_tokens == 2
    assert len(api_titles(parts)) == 1 and api_titles(parts)[0].endswith("· waits")


def test_quitting_while_serving_joins_the_server(qtbot, stepped):
    parts = stepped
    serving(qtbot, parts)
    server = parts.serve.server
    parts.window.close()
    parts.shutdown()
    assert not server.thread.is_alive() and not parts.serve.serving
