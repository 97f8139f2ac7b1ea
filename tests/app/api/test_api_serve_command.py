"""`glassbox serve`'s options: loopback by default, any other address only with a key."""

from __future__ import annotations

import pytest
import uvicorn

from app.api.serve import bound_listener, is_loopback, serve_limits
from app.cli import main
from app.options import parser


def serve_args(*argv: str):
    return parser().parse_args(["serve", *argv])


def test_defaults_bind_loopback_without_a_key(monkeypatch):
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)
    args = serve_args()
    assert args.host == "127.0.0.1"
    limits = serve_limits(args)
    assert limits.api_key is None and limits.max_queue >= 1 and limits.max_tokens >= 1


def test_another_address_without_a_key_refuses_to_start(monkeypatch, capsys):
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # before any model loads
    assert "API key" in capsys.readouterr().err


def test_a_key_from_the_environment_or_the_option(monkeypatch):
    monkeypatch.setenv("GLASSBOX_API_KEY", "from-the-environment")
    assert serve_limits(serve_args("--host", "0.0.0.0")).api_key == "from-the-environment"
    assert serve_limits(serve_args("--api-key", "given-on-the-line")).api_key == (
        "given-on-the-line"
    )
    with pytest.raises(ValueError, match="too short"):
        serve_limits(serve_args("--api-key", "short"))


@pytest.mark.parametrize("flag", ["--max-queue", "--max-tokens", "--max-body-bytes"])
def test_limits_must_be_positive(flag):
    with pytest.raises(ValueError, match="at least 1"):
        serve_limits(serve_args(flag, "0"))


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    assert not is_loopback("example.com")


def test_a_port_in_use_refuses_before_the_model_loads(monkeypatch, capsys):
    taken = bound_listener("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    monkeypatch.setattr("engine.load.loader.load_model", lambda *a, **k: pytest.fail("loaded"))
    with taken:
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_ctrl_c_stops_the_server_quietly(monkeypatch, capsys, tokenizer):
    """uvicorn raises Ctrl+C again once it has shut down: the command ends with status 0."""
    from tests.models import make_tiny

    def interrupted(self, sockets=None):
        assert sockets and sockets[0].getsockname()[1] > 0  # served on the bound socket
        raise KeyboardInterrupt

    monkeypatch.setattr(
        "engine.load.loader.load_model", lambda *a, **k: make_tiny(tokenizer, "llama")
    )
    monkeypatch.setattr(uvicorn.Server, "run", interrupted)
    with bound_listener("127.0.0.1", 0) as free:  # a port free a moment ago
        port = free.getsockname()[1]
    assert main(["serve", "--port", str(port)]) == 0
    assert "stopped" in capsys.readouterr().err
