"""`glassbox serve`'s options: loopback by default, any other address only with a key."""

from __future__ import annotations

import pytest

from app.api.serve import is_loopback, serve_limits
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
