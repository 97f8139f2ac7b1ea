"""What serving costs: the same model, prompt and greedy settings replied to directly by the
session (as `glassbox chat` does) and through `glassbox serve`'s HTTP API with a streaming
client, interleaved; the first streamed chunk against the engine's TTFT; the serving process's
memory over bursts of concurrent requests.

    python -m app.bench.serve_speed --tokens 32 --repeats 5 --burst 20 --bursts 30   (JSON)

The bursts' clients run in a process of their own, so the memory measured is the server's
alone (a client's own allocations, e.g. an HTTP client's TLS context per request, would
otherwise be counted with it). After the last burst glibc's `malloc_trim` returns the heap's
free pages to the system, telling memory still held by objects from memory merely kept by the
allocator.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from statistics import median
from typing import Any

import httpx
import psutil
import uvicorn

from app.api.serve import uvicorn_config
from app.api.server import Limits, create_app
from app.api.session_engine import SessionEngine
from engine.events import Finished
from engine.generate.session import ChatSession
from engine.load.loader import load_model
from engine.model.gguf_shape import release_freed_memory
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

PROMPT = "Write a short story about a lighthouse keeper."


def direct(session: ChatSession, tokens: int) -> Finished:
    settings = GenerationSettings(max_new_tokens=tokens, greedy=True, ignore_eos=True)
    *_, finished = session.generate([Message("user", PROMPT)], settings, ProbeSettings.off())
    assert isinstance(finished, Finished)
    return finished


def served(client: httpx.Client, base_url: str, model: str, tokens: int) -> dict[str, float]:
    """One streamed reply: the client's time from sending to its first text chunk (on a kept
    connection: the client's own set-up is not the server's) and its chunk rate."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    times, usage = [], {}
    with client.stream("POST", base_url + "/chat/completions", json=body) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter() - started)
    timings = usage["timings"]
    return {
        "first_chunk_s": times[0],
        "engine_ttft_s": timings["ttft_s"],
        "engine_decode_tokens_per_s": timings["decode_tokens_per_s"],
        "client_chunks_per_s": (len(times) - 1) / (times[-1] - times[0]),
    }


def burst(client: httpx.Client, base_url: str, model: str, requests: int) -> list[int]:
    """`requests` short chat requests at once, a thread each; their status codes."""

    def ask(i: int) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}]}
        return client.post(
            base_url + "/chat/completions", json=body | {"max_tokens": 2}
        ).status_code

    with ThreadPoolExecutor(max_workers=requests) as pool:
        return list(pool.map(ask, range(requests)))


def bursts_client(base_url: str, model: str, requests: int, channel: Connection) -> None:
    """The clients' process: a burst each time the parent says go; its statuses sent back."""
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=requests)) as client:
        while channel.recv():
            channel.send(burst(client, base_url, model, requests))


def memory_over_bursts(base_url: str, model: str, requests: int, bursts: int) -> dict[str, Any]:
    """This (the server's) process's RSS in MB before and after each burst of concurrent
    requests sent from another process, then after malloc_trim."""
    process = psutil.Process()
    parent, child = multiprocessing.Pipe()
    spawn = multiprocessing.get_context("spawn")
    clients = spawn.Process(target=bursts_client, args=(base_url, model, requests, child))
    clients.start()
    rss, statuses = [process.memory_info().rss / 1e6], []
    try:
        for _ in range(bursts):
            parent.send(True)
            statuses.extend(parent.recv())
            rss.append(process.memory_info().rss / 1e6)
    finally:
        parent.send(False)
        clients.join()
    return {
        "rss_mb_before_and_after_each_burst": rss,
        "rss_mb_after_malloc_trim": _trimmed_rss(process),
        "statuses": {str(code): statuses.count(code) for code in sorted(set(statuses))},
    }


def _trimmed_rss(process: psutil.Process) -> float | None:
    """RSS once glibc has returned its free heap pages (None without glibc)."""
    if not release_freed_memory():
        return None
    return float(process.memory_info().rss / 1e6)


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--model", default="bundled")
    options.add_argument("--tokens", type=int, default=64)
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--burst", type=int, default=20, help="requests per burst")
    options.add_argument("--bursts", type=int, default=3)
    args = options.parse_args(argv)
    session = ChatSession(load_model(LoadRequest(spec=args.model, device="cpu")))
    engine = SessionEngine(session)
    app = create_app(engine, Limits(max_queue=args.burst))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, Limits(), "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}/v1"
    direct(session, 4)  # warm-up
    runs: dict[str, list[Any]] = {"direct": [], "served": []}
    with httpx.Client(timeout=600) as client:
        client.get(base + "/models").raise_for_status()  # the connection, opened once
        for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
            runs["direct"].append(direct(session, args.tokens).decode_tokens_per_s)
            runs["served"].append(served(client, base, engine.model_id, args.tokens))
    memory = memory_over_bursts(base, engine.model_id, args.burst, args.bursts)
    server.should_exit = True
    thread.join()
    served_rates = [r["engine_decode_tokens_per_s"] for r in runs["served"]]
    print(
        json.dumps(
            {
                "model": engine.model_id,
                "tokens": args.tokens,
                "direct_decode_tokens_per_s": runs["direct"],
                "served_decode_tokens_per_s": served_rates,
                "served_over_direct_median": median(served_rates) / median(runs["direct"]),
                "served_runs": runs["served"],
                "first_chunk_after_ttft_s": [
                    r["first_chunk_s"] - r["engine_ttft_s"] for r in runs["served"]
                ],
                "burst": args.burst,
                **memory,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
