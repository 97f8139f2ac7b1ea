"""What serving costs: the same model, prompt and greedy settings replied to directly by the
session (as `glassbox chat` does) and through `glassbox serve`'s HTTP API with a streaming
client, interleaved; the first streamed chunk against the engine's TTFT; the process's memory
over a burst of requests.

    python -m app.bench.serve_speed --tokens 32 --repeats 5   (JSON on stdout)
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
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
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

PROMPT = "Write a short story about a lighthouse keeper."


def direct(session: ChatSession, tokens: int) -> Finished:
    settings = GenerationSettings(max_new_tokens=tokens, greedy=True, ignore_eos=True)
    *_, finished = session.generate([Message("user", PROMPT)], settings, ProbeSettings.off())
    assert isinstance(finished, Finished)
    return finished


def served(base_url: str, model: str, tokens: int) -> dict[str, float]:
    """One streamed reply: the client's time to its first text chunk and its chunk rate."""
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
    with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=600) as answer:
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


def burst(base_url: str, model: str, requests: int) -> None:
    for i in range(requests):
        body = {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}]}
        answer = httpx.post(base_url + "/chat/completions", json=body | {"max_tokens": 2})
        answer.raise_for_status()


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
    for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
        runs["direct"].append(direct(session, args.tokens).decode_tokens_per_s)
        runs["served"].append(served(base, engine.model_id, args.tokens))
    process = psutil.Process()
    rss = [process.memory_info().rss / 1e6]
    for _ in range(args.bursts):  # bursts of short replies: memory after each, in MB
        burst(base, engine.model_id, args.burst)
        rss.append(process.memory_info().rss / 1e6)
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
                "burst": args.burst,
                "rss_mb_before_and_after_each_burst": rss,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
