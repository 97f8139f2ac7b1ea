"""`glassbox chat`: the same engine in the terminal, interactive or one-shot, text or JSON lines.

Conversations go to the window's store (see app.storage.chat_log) unless `--no-store` is given.
Ctrl+C during a reply stops it as the window's Stop does; a second Ctrl+C interrupts at once.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import FrameType

from app.options import generation_settings, load_request, print_json
from app.storage.chat_log import ChatLog, open_store
from engine.events import Event, Failed, Finished, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.generate.trace import TraceRecorder
from engine.load.loader import ModelLoadError, load_model
from engine.placement.dispatch import summary
from engine.serialize import event_to_dict, plain
from engine.settings import (
    GenerationSettings,
    Message,
    ProbeSettings,
    SettingsError,
    parse_layers,
)
from engine.text import chat_format
from ui.reply_stats import finished_stats, stats_line

COMMANDS = "/new starts over, /quit leaves"
COMMAND = re.compile(r"/[A-Za-z]+")  # what a command looks like, known or not


def run_chat(args: argparse.Namespace) -> int:
    try:
        settings = generation_settings(args)
    except SettingsError as error:
        print(f"glassbox chat: {error}", file=sys.stderr)
        return 2
    if args.complete and args.system:  # a system turn belongs to the chat template
        print("glassbox chat: --system has no place in --complete mode", file=sys.stderr)
        return 2
    if args.prompt is not None and not args.prompt.strip():  # say so before a long load
        print("glassbox chat: the message is empty", file=sys.stderr)
        return 2
    progress = None if args.json else _progress
    request = load_request(args)
    if args.prompt is not None:
        # One reply, then exit: a kept compiled step loads in milliseconds, but building one
        # takes minutes, long after the reply; a conversation starts that build.
        request = replace(request, build_compiled=False)
    try:
        loaded = load_model(request, progress=progress)
    except ModelLoadError as error:
        print(f"glassbox chat: {error}", file=sys.stderr)
        return 1
    session = ChatSession(loaded)
    if not (args.json or args.complete):  # which turns the model sees, before its first reply
        forced = request.chat_template != "auto"
        print(f"[{chat_format.label(session.info.chat_format, forced)}]", file=sys.stderr)
    if session.info.placement is not None and not args.json:  # where the layers went
        print(f"[placement: {summary(session.info.placement)}]", file=sys.stderr)
    if args.json:  # which model, precision and peaks the following events come from
        print_json({"event": "model", **plain(session.info)})
    try:
        layers = parse_layers(args.watch_layers, loaded.info.layers) if args.trace else ()
    except SettingsError as error:
        print(f"glassbox chat: {error}", file=sys.stderr)
        return 2
    # --json and --trace carry each step's next-token candidates; plain text shows none
    probes = ProbeSettings.for_chat(layers, candidates=args.trace or args.json)
    session.watch_lens(bool(args.trace))  # --trace records each step's logit lens
    history = [Message("system", args.system)] if args.system else []
    store = None if args.no_store else open_store()
    chat_log = ChatLog(store, session.info.name, args.system, settings)
    try:
        if args.prompt is not None:
            return _turn(session, history, args.prompt, settings, probes, args, chat_log)
        return _interactive(session, history, settings, probes, args, chat_log)
    finally:
        chat_log.close()


def _interactive(
    session: ChatSession,
    history: list[Message],
    settings: GenerationSettings,
    probes: ProbeSettings,
    args: argparse.Namespace,
    chat_log: ChatLog,
) -> int:
    if not args.json:
        mode = " Completion mode: what you type is continued as written." if args.complete else ""
        print(f"{session.info.name} on {session.info.device}. {COMMANDS}.{mode}")
    while True:
        try:
            line = input("" if args.json else "\ntext> " if args.complete else "\nyou> ")
        except (EOFError, KeyboardInterrupt):
            return 0
        command = line.strip()
        if command == "/quit":
            return 0
        if command == "/new":
            history[:] = [m for m in history if m.role == "system"]
            session.reset()
            chat_log.new_conversation()
            continue
        if COMMAND.fullmatch(command):  # a mistyped command is not a message ("/etc/x" is)
            print(f"glassbox chat: no command {command}: {COMMANDS}", file=sys.stderr)
            continue
        _turn(session, history, line, settings, probes, args, chat_log)


def _turn(
    session: ChatSession,
    history: list[Message],
    text: str,
    settings: GenerationSettings,
    probes: ProbeSettings,
    args: argparse.Namespace,
    chat_log: ChatLog,
) -> int:
    """Answer one user message; append both to `history`. Returns an exit status."""
    if not text.strip():
        print("glassbox chat: the message is empty", file=sys.stderr)
        return 2
    messages = [*history, Message("user", text)]
    chat_log.user(text)
    trace = TraceRecorder(session.info) if args.trace else None
    if not args.json and args.prompt is None:
        print("model> " if args.complete else "assistant> ", end="", flush=True)
    replies: list[Finished] = []

    def consume(event: Event) -> None:
        if trace:
            trace.add(event)
            if isinstance(event, Token):  # each layer's guess, worked out between steps
                trace.add_lens(session.layer_lens(event.index))
        _show(event, args.json)
        chat_log.record(event)  # after showing: what is saved was seen
        if isinstance(event, Finished):
            replies.append(event)

    try:
        if args.step:
            stepped = replace(settings, pause_after_prefill=True)
            _run_stepped(session, lambda: session.generate(messages, stepped, probes), consume)
        else:
            with _ctrl_c_cancels(session):
                for event in session.generate(messages, settings, probes):
                    consume(event)
    except KeyboardInterrupt:  # a second Ctrl+C: cut where it was, maybe inside a forward pass
        session.cancel()
        session.reset()  # so the KV cache may be half-written: the next turn rebuilds it
        chat_log.interrupted()
    finished = replies[-1] if replies else None
    if trace:
        args.trace.write_text(json.dumps(trace.to_dict()))
    if finished is None or finished.reason in ("error", "context_full"):
        return 1
    history[:] = [*messages, Message("assistant", finished.text)]
    return 130 if finished.reason == "cancelled" else 0


STEP_KEYS = "[Enter: next token · c: continue · s: stop] "


def _run_stepped(
    session: ChatSession, generate: Callable[[], Iterator[Event]], consume: Callable[[Event], None]
) -> None:
    """A reply held after its prompt, advanced from the keyboard: the reply runs in a thread
    and this one reads a key each time the pacer says it holds it (EOF continues, Ctrl+C
    stops). Both wait on events: a held reply holds no CPU here either."""
    done, held = threading.Event(), threading.Event()
    session.pacer.on_hold = lambda holding: held.set() if holding else None

    def run() -> None:
        try:
            for event in generate():
                consume(event)
        finally:
            done.set()
            held.set()  # wakes the key loop to see the reply is over

    reply = threading.Thread(target=run, name="stepped-reply", daemon=True)
    reply.start()
    try:
        while held.wait() and not done.is_set():
            held.clear()  # before the key lets a step through: its hold sets it again
            if not _answer_key(session):
                break
    finally:
        reply.join()
        session.pacer.on_hold = None


def _answer_key(session: ChatSession) -> bool:
    """Read one key and act on it; False once the reply no longer waits for keys."""
    print(STEP_KEYS, end="", file=sys.stderr, flush=True)
    try:
        key = input().strip().lower()
    except EOFError:
        key = "c"
    except KeyboardInterrupt:
        key = "s"
    if key == "c":
        session.pacer.resume()
        return False
    if key in ("s", "q"):
        session.cancel()
        return False
    session.pacer.step()
    return True


@contextmanager
def _ctrl_c_cancels(session: ChatSession) -> Iterator[None]:
    """Ctrl+C asks the session to stop after the current step, so the reply ends with
    Finished("cancelled") and the KV cache stays in step with its tokens; a second Ctrl+C
    raises KeyboardInterrupt as usual."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return

    def cancel(_signum: int, _frame: FrameType | None) -> None:
        session.cancel()
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, cancel)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _show(event: Event, as_json: bool) -> None:
    if as_json:
        print_json(event_to_dict(event))
    elif isinstance(event, Token):
        print(event.text, end="", flush=True)
    elif isinstance(event, Failed):
        print(f"\n[{event.message}]", file=sys.stderr)
    elif isinstance(event, Finished):
        print(f"\n[{stats_line(finished_stats(event))}]", file=sys.stderr)
    elif isinstance(event, PrefillDone):
        pass


def _progress(stage: str, fraction: float) -> None:
    print(f"[{fraction:4.0%}] {stage}", file=sys.stderr, flush=True)
