"""The conversation the window shows: its messages and the reply in progress, in one place.

One owner, explicit updates: the window changes the conversation through the methods below,
in the order things happen, and everything else follows the changes it announces. Listeners
are called at once, in the order they subscribed, with a `Change` that says what happened;
the chat view draws it, the store (app.window.controller) writes it. Nobody keeps a copy to diff.

A reply goes through these states:

    IDLE ──ask──> SENT ──PrefillDone──> STREAMING ──Finished──> FINISHED, or FAILED after Failed
     └──ask while no model is loaded──> WAITING ──the model is ready──> SENT

and back to IDLE when it is abandoned (new chat, another conversation opened, the window
closed): its remaining events are not the conversation's any more.

Qt-free (an import contract keeps it so): it is plain data, testable without a display.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.events import ENGINE_STOPPED, Event, Failed, Finished, PrefillDone, Token, token_runs
from engine.settings import GenerationSettings, Message
from ui.confidence import plain_confidences
from ui.reply_stats import finished_stats


class ReplyState(Enum):
    IDLE = "idle"  # no reply asked for yet
    WAITING = "waiting for the model"  # asked while the first model loads
    SENT = "sent"  # the request is with the engine; its prompt is being processed
    STREAMING = "streaming"  # tokens are arriving
    FINISHED = "finished"  # the last reply ended
    FAILED = "failed"  # the last reply ended with an error


REPLYING = (ReplyState.SENT, ReplyState.STREAMING)


@dataclass(frozen=True, slots=True)
class Entry:
    """One message of the conversation.

    `model` and `settings`: what a message was sent with or a reply made with (when known);
    `stats`: a reply's numbers (ui.reply_stats); `complete` is False for a reply cut off by
    its engine stopping (or, when loaded from the store, by the app closing mid-reply).
    """

    role: str
    text: str
    model: str | None = None
    settings: GenerationSettings | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)
    complete: bool = True
    # each token's probability and runners-up (ui.confidence); empty when not recorded.
    # An annotation of the text, not part of what the message is: left out of equality.
    confidence: list[list[Any]] = field(default_factory=list, compare=False)

    @property
    def message(self) -> Message:
        return Message(self.role, self.text)


@dataclass
class Reply:
    """The reply in progress: what it was asked with and what its events said so far."""

    settings: GenerationSettings
    model: str | None
    parts: list[str] = field(default_factory=list)
    prefill: PrefillDone | None = None
    failure: Failed | None = None
    # each token's probability and runners-up so far (ui.confidence), as the stats keep them
    confidence: list[list[Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


# -- changes, in the order listeners receive them ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Reset:
    """Everything was replaced (a conversation loaded, or cleared for a new chat)."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class Added:
    """A user message was appended."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Truncated:
    """Only the first `len(entries)` messages remain (the last reply is regenerated)."""

    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class ReplyStarted:
    reply: Reply


@dataclass(frozen=True, slots=True)
class ReplyEvent:
    """An engine event of the reply in progress other than a Token (see ReplyTokens), after
    the reply took it in."""

    event: Event
    reply: Reply


@dataclass(frozen=True, slots=True)
class ReplyTokens:
    """Tokens of the reply in progress, delivered together, after the reply took them in.

    One change per run of tokens the engine's events arrived with (tens a second, not one
    per token): the chat view draws their text once and the store saves it once.
    """

    tokens: tuple[Token, ...]
    reply: Reply
    confidences: tuple[list[Any], ...]  # the tokens' (ui.confidence), as the reply keeps

    @property
    def text(self) -> str:
        return "".join(token.text for token in self.tokens)


@dataclass(frozen=True, slots=True)
class ReplyEnded:
    """The reply became the conversation's last message (after its Finished's ReplyEvent)."""

    entry: Entry
    reply: Reply


@dataclass(frozen=True, slots=True)
class ReplyAbandoned:
    """The reply in progress is not the conversation's any more; it was not added."""

    reply: Reply


Change = (
    Reset
    | Added
    | Truncated
    | ReplyStarted
    | ReplyEvent
    | ReplyTokens
    | ReplyEnded
    | ReplyAbandoned
)
Listener = Callable[[Change], None]


class Conversation:
    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._listeners: list[Listener] = []
        self.state = ReplyState.IDLE
        self.reply: Reply | None = None  # in progress, or the last one (see `state`)
        self.waiting: GenerationSettings | None = None  # asked for while no model is loaded
        self.system_prompt = ""

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _announce(self, change: Change) -> None:
        for listener in self._listeners:
            listener(change)

    # -- reading --------------------------------------------------------------------------

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(self._entries)

    def messages(self) -> list[Message]:
        """The user and assistant messages so far (without the system prompt)."""
        return [entry.message for entry in self._entries]

    @property
    def replying(self) -> bool:
        """A reply was asked of the engine and has not ended."""
        return self.state in REPLYING

    def has_user_message(self) -> bool:
        return any(entry.role == "user" for entry in self._entries)

    # -- messages -------------------------------------------------------------------------

    def load(self, entries: Sequence[Entry], system_prompt: str = "") -> None:
        """Show another conversation (or none): the reply in progress is abandoned."""
        self.abandon_reply()
        self._entries = list(entries)
        self.system_prompt = system_prompt
        self.state, self.reply = ReplyState.IDLE, None
        self._announce(Reset(self.entries))

    def clear(self) -> None:
        self.load([], self.system_prompt)

    def add_user(self, text: str, settings: GenerationSettings, model: str | None) -> None:
        entry = Entry("user", text, model, settings)
        self._entries.append(entry)
        self._announce(Added(entry))

    def drop_last_reply(self) -> None:
        """Remove the replies after the last user message, to answer it again."""
        kept = len(self._entries)
        while kept and self._entries[kept - 1].role == "assistant":
            kept -= 1
        if kept < len(self._entries):
            del self._entries[kept:]
            self._announce(Truncated(self.entries))

    # -- the reply ------------------------------------------------------------------------

    def wait_for_model(self, settings: GenerationSettings) -> None:
        """The reply is asked for before any model has loaded: it starts once one has."""
        self.waiting, self.state = settings, ReplyState.WAITING

    def stop_waiting(self) -> GenerationSettings | None:
        """The settings the waiting reply was asked with (None: nothing waits); now IDLE."""
        settings, self.waiting = self.waiting, None
        if self.state is ReplyState.WAITING:
            self.state = ReplyState.IDLE
        return settings

    def start_reply(self, settings: GenerationSettings, model: str | None) -> None:
        """The request went to the engine: its events now belong to this reply."""
        self.waiting = None
        self.reply, self.state = Reply(settings, model), ReplyState.SENT
        self._announce(ReplyStarted(self.reply))

    def apply(self, event: Event) -> None:
        """Take in an event of the reply in progress (ignored when no reply is)."""
        self.apply_many((event,))

    def apply_many(self, events: Sequence[Event]) -> None:
        """Take in a batch of events in order: each run of Tokens is one ReplyTokens change.

        Events after the reply ended (or when no reply is in progress) are ignored.
        """
        for item in token_runs(events):
            if isinstance(item, list):
                self._apply_tokens(item)
            else:
                self._apply_other(item)

    def _apply_tokens(self, tokens: list[Token]) -> None:
        reply = self.reply
        if not tokens or reply is None or not self.replying:
            return
        reply.parts.extend(token.text for token in tokens)
        confidences = plain_confidences(tokens)
        reply.confidence.extend(confidences)
        self._announce(ReplyTokens(tuple(tokens), reply, tuple(confidences)))

    def _apply_other(self, event: Event) -> None:
        reply = self.reply
        if reply is None or not self.replying:
            return
        if isinstance(event, PrefillDone):
            reply.prefill, self.state = event, ReplyState.STREAMING
        elif isinstance(event, Failed):
            reply.failure = event
        self._announce(ReplyEvent(event, reply))
        if isinstance(event, Finished):
            self._end_reply(reply, event)

    def _end_reply(self, reply: Reply, finished: Finished) -> None:
        cut_off = reply.failure is not None and reply.failure.error_type == ENGINE_STOPPED
        stats = finished_stats(finished)
        entry = Entry("assistant", finished.text, reply.model, reply.settings, stats, not cut_off,
                      list(reply.confidence))  # fmt: skip
        self._entries.append(entry)
        self.state = ReplyState.FAILED if reply.failure else ReplyState.FINISHED
        self._announce(ReplyEnded(entry, reply))

    def abandon_reply(self) -> None:
        """Stop following the reply in progress (and forget one waiting for the model)."""
        self.stop_waiting()
        if self.reply is not None and self.replying:
            reply, self.state = self.reply, ReplyState.IDLE
            self._announce(ReplyAbandoned(reply))
