"""The tokens the model sees: the templated prompt, then the reply, as the chips show them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.events import PrefillDone, Token


@dataclass
class TokenTrail:
    """One reply's context as token ids and chip labels, by context position.

    Labels are the engine's (a token's text, or its bytes such as "<0xE2>" where the text is
    not whole characters); an engine that sends none leaves its texts, or "#id".
    """

    ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    special: frozenset[int] = frozenset()
    prompt_tokens: int = 0
    reused_tokens: int = 0
    processed_tokens: int = 0

    def start(self, event: PrefillDone) -> None:
        self.ids = list(event.prompt_token_ids)
        labels = event.prompt_labels or event.token_texts
        if len(labels) == len(self.ids):
            self.labels = list(labels)
        else:
            self.labels = [f"#{i}" for i in self.ids]
        self.special = frozenset(event.special_ids)
        self.prompt_tokens = event.prompt_tokens
        self.reused_tokens = event.reused_tokens
        self.processed_tokens = event.processed_tokens

    def add(self, event: Token) -> None:
        self.ids.append(event.token_id)
        self.labels.append(event.label or event.piece)

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_tokens

    def is_special(self, position: int) -> bool:
        return self.ids[position] in self.special

    def counts_line(self) -> str:
        """The counts above the chips, e.g. "prompt 24 tokens (20 reused, 4 new) · reply 3"."""
        return (
            f"prompt {self.prompt_tokens:,} tokens ({self.reused_tokens:,} reused,"
            f" {self.processed_tokens:,} new) · reply {self.generated:,} tokens"
        )
