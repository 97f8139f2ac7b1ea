"""One conversation written into the store as it happens: the rules the window and the terminal
chat share.

A conversation is created with its first user message and titled from it. Each user message is
committed before its reply starts. A reply is begun in the store once its prompt has been
processed (PrefillDone), saved about once a second while it streams (marked incomplete; see
`ReplySaver`) and completed with its stats when it ends. A reply cut off with its engine stays
incomplete with what streamed, as one cut off by a crash or a kill: a crash loses at most the
last second of a reply and never a finished message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.storage.store import DEFAULT_TITLE, ConversationStore, JsonArray, ReplySaver
from engine.events import ENGINE_STOPPED, Event, Failed, Finished, PrefillDone, Token
from engine.settings import GenerationSettings
from ui.confidence import plain_confidences
from ui.reply_stats import finished_stats

TITLE_CHARS = 48
Settings = GenerationSettings | Mapping[str, Any] | None


def title_from(first_message: str) -> str:
    """A conversation's title: its first message on one line, cut to TITLE_CHARS."""
    return " ".join(first_message.split())[:TITLE_CHARS] or DEFAULT_TITLE


class ConversationRecorder:
    """Writes one conversation at a time; store errors propagate to the caller.

    `keep_unanswered`: a reply that ended before reaching the model (its prompt refused, or
    stopped at once) is stored as a complete message, as the window shows one; the terminal
    leaves such a turn out of its history and of the store.
    """

    def __init__(self, store: ConversationStore, *, keep_unanswered: bool = False) -> None:
        self.store = store
        self.keep_unanswered = keep_unanswered
        self.conversation_id: int | None = None
        self._saver: ReplySaver | None = None
        self._cut_off = False  # the streaming reply's engine stopped under it
        # the streaming reply's token confidences (ui.confidence), encoded as they come
        self._confidence = JsonArray()

    @property
    def recording_reply(self) -> bool:
        return self._saver is not None

    def open(self, conversation_id: int | None) -> None:
        """Go on with a stored conversation (None: the next user message starts a new one)."""
        self.interrupted()
        self.conversation_id = conversation_id

    def add_user(
        self, text: str, *, model: str | None, system_prompt: str, settings: Settings
    ) -> None:
        """Commit a user message, creating the conversation with the first one."""
        if self.conversation_id is None:
            self.conversation_id = self.store.create_conversation(
                title_from(text), model=model, system_prompt=system_prompt, settings=settings
            )
        self.store.add_message(self.conversation_id, "user", text, model=model, settings=settings)

    def truncate(self, kept: int) -> None:
        """Keep only the first `kept` messages (a regenerated reply replaces the last one)."""
        if self.conversation_id is not None:
            self.store.truncate(self.conversation_id, kept)

    def record(self, event: Event, *, model: str | None, settings: Settings) -> None:
        """Follow a reply: begun at prefill, saved as it streams, completed when it ends."""
        if self.conversation_id is None:
            return
        if isinstance(event, PrefillDone):
            reply = self.store.begin_reply(self.conversation_id, model, settings)
            self._saver, self._cut_off = ReplySaver(self.store, reply), False
            self._confidence = JsonArray()
        elif isinstance(event, Token):
            self.record_tokens((event,))
        elif isinstance(event, Failed) and event.error_type == ENGINE_STOPPED:
            self._cut_off = True
        elif isinstance(event, Finished):
            self._finish(event, model, settings)

    def record_text(self, text: str) -> None:
        """The streaming reply's next text (one token's, or several delivered together)."""
        if self._saver is not None:
            self._saver.append(text)

    def record_tokens(
        self, tokens: Sequence[Token], confidences: Sequence[list[Any]] | None = None
    ) -> None:
        """The streaming reply's next tokens: their text, and how sure the model was of each
        (`confidences`, where the caller worked them out already; else from the tokens)."""
        self.record_text("".join(token.text for token in tokens))
        if self._saver is not None:
            self._confidence.extend(
                plain_confidences(tokens) if confidences is None else confidences
            )

    def interrupted(self) -> None:
        """Save what streamed so far now; the reply stays incomplete (quit, switch, Ctrl+C)."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.flush()

    def _finish(self, finished: Finished, model: str | None, settings: Settings) -> None:
        saver, self._saver = self._saver, None
        if saver is None:
            if self.keep_unanswered and self.conversation_id is not None:
                self.store.add_message(
                    self.conversation_id, "assistant", finished.text, model=model,
                    settings=settings, stats=finished_stats(finished),
                )  # fmt: skip
        elif self._cut_off:  # kept as on a crash: the text so far, incomplete
            saver.set_text(finished.text)
            saver.flush()
        else:
            saver.finish(finished_stats(finished), finished.text, self._confidence)
