"""`glassbox serve`: load the model named by the model options, then answer OpenAI-style
requests on http://HOST:PORT/v1 until Ctrl+C.

Safe by default: it binds 127.0.0.1; any other address only with an API key (`--api-key` or
$GLASSBOX_API_KEY), without which it refuses to start.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import socket
import sys

import uvicorn
from fastapi import FastAPI

from app.api.server import Limits, create_app
from app.options import KEY_VARIABLE, LOOPBACK, load_request


def serve_limits(args: argparse.Namespace) -> Limits:
    """The limits the options name; ValueError says what is wrong, before the model loads."""
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_VARIABLE) or None
    refusal = listen_refusal(args.host, key, "--api-key")
    if refusal:
        raise ValueError(refusal)
    if not 0 < args.port < 65536:
        raise ValueError(f"port {args.port} is outside 1..65535")
    for name in ("max_tokens", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    return Limits(
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
    )


def listen_refusal(host: str, key: str | None, key_option: str) -> str | None:
    """Why listening on `host` with `key` is refused (None: it is not). `key_option` names
    where a key is set (the command's option, the window's field)."""
    if not is_loopback(host) and not key:
        return (
            f"listening on {host} lets other machines in: set an API key with {key_option}"
            f" or ${KEY_VARIABLE} (or listen on {LOOPBACK})"
        )
    if key is not None and len(key) < 8:
        return "the API key is too short: use at least 8 characters"
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    try:
        limits = serve_limits(args)
    except ValueError as error:
        print(f"glassbox serve: {error}", file=sys.stderr)
        return 2
    from app.api.session_engine import SessionEngine
    from engine.generate.session import ChatSession
    from engine.load.loader import ModelLoadError, load_model

    try:  # before the model loads: a port in use is said at once, and stays ours
        listener = bound_listener(args.host, args.port)
    except OSError as error:
        print(f"glassbox serve: {cannot_listen(args.host, args.port, error)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with listener:
        try:
            loaded = load_model(load_request(args), progress=_progress)
        except ModelLoadError as error:
            print(f"glassbox serve: {error}", file=sys.stderr)
            return 1
        engine = SessionEngine(ChatSession(loaded))
        app = create_app(engine, limits)
        print(
            f"Serving {engine.model_id} at http://{args.host}:{args.port}/v1"
            + (" (API key required)" if limits.api_key else ""),
            file=sys.stderr,
            flush=True,
        )
        server = uvicorn.Server(uvicorn_config(app, args.host, args.port, limits))
        # uvicorn shuts down on Ctrl+C, then raises it again for the caller: the way to stop
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[listener])
    print("glassbox serve: stopped", file=sys.stderr)
    return 0


def bound_listener(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to listen on (port 0: any free one); OSError
    where the port is in use or the address is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn binds: a port served a moment ago is free again at once
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


def cannot_listen(host: str, port: int, error: OSError) -> str:
    return f"cannot listen on {host}:{port}: {error.strerror or error}"


def uvicorn_config(
    app: FastAPI, host: str, port: int, limits: Limits, log_level: str = "info"
) -> uvicorn.Config:
    """Bounded connections and header sizes: the queue refuses with 429 well before uvicorn
    refuses a connection with 503 (what is left is for listings and clients being refused)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        limit_concurrency=limits.max_queue + 64,
        h11_max_incomplete_event_size=64 * 1024,
        timeout_keep_alive=5,
        log_level=log_level,
        server_header=False,
    )


def _progress(stage: str, fraction: float) -> None:
    print(f"[{fraction:4.0%}] {stage}", file=sys.stderr, flush=True)
