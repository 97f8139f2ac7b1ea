"""How sure the model was of each token it wrote, from the Token events' candidates alone.

A token's confidence is the probability the model gave it (the softmax of the logits that
chose it, the Next token panel's `prob`), with the runners-up of that step. It is read from
the top-k every Token event carries already: no extra forward. A token the sampler drew from
outside the top-k has no probability here (None): it was below the k-th candidate's.

A reply's confidences are kept as [[text, probability or null, [[runner-up text,
probability], ...]], ...]: in the conversation's Entry, in the store's `confidence` column of
the message (so they survive a reload) and in every export. Qt-free (an import contract keeps
it so).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.events import Token
from engine.token_labels import quoted

RUNNERS_UP = 3


@dataclass(frozen=True, slots=True)
class TokenConfidence:
    text: str  # the token's own piece
    prob: float | None  # None: not among the step's candidates
    runners_up: tuple[tuple[str, float], ...]  # the step's best other candidates

    def as_plain(self) -> list[Any]:
        return [self.text, self.prob, [[text, prob] for text, prob in self.runners_up]]


def of_token(token: Token) -> TokenConfidence | None:
    """The token's probability and runners-up, or None for a Token without candidates."""
    if not token.top_k:
        return None
    prob = next((c.prob for c in token.top_k if c.token_id == token.token_id), None)
    others = [(c.text, c.prob) for c in token.top_k if c.token_id != token.token_id]
    return TokenConfidence(token.piece, prob, tuple(others[:RUNNERS_UP]))


def plain_confidences(tokens: Iterable[Token]) -> list[list[Any]]:
    """The confidences of a run of tokens as the stats keep them (tokens without
    candidates are left out: a reply with none keeps none)."""
    return [c.as_plain() for t in tokens if (c := of_token(t)) is not None]


def confidences(plain: Sequence[Any]) -> tuple[TokenConfidence, ...]:
    """A reply's token confidences from their plain form (none for a reply kept without)."""
    return tuple(
        TokenConfidence(
            str(text),
            None if prob is None else float(prob),
            tuple((str(t), float(p)) for t, p in runners),
        )
        for text, prob, runners in plain
    )


def tint(prob: float | None) -> tuple[int, int, int, int]:
    """An RGBA background for a token: clear when sure, more red the less sure (alpha)."""
    doubt = 1.0 if prob is None else 1.0 - max(0.0, min(1.0, prob))
    return (230, 60, 40, round(150 * doubt))


def describe(confidence: TokenConfidence) -> str:
    """The hover text: the token's probability and its runners-up."""
    prob = "below the top candidates" if confidence.prob is None else f"{confidence.prob:.1%}"
    lines = [f"{quoted(confidence.text)}: {prob}"]
    lines += [f"  {quoted(text)}: {p:.1%}" for text, p in confidence.runners_up]
    return "\n".join(lines)


def markdown_table(items: Sequence[TokenConfidence]) -> str:
    """The confidences as a collapsed Markdown table, for an export."""
    rows = [
        "<details><summary>Token confidence</summary>",
        "",
        "| token | probability | runners-up |",
        "|---|---|---|",
    ]
    for item in items:
        prob = "–" if item.prob is None else f"{item.prob:.1%}"
        runners = ", ".join(f"`{t!r}` {p:.1%}" for t, p in item.runners_up)
        token = repr(item.text).replace("|", "\\|")
        rows.append(f"| `{token}` | {prob} | {runners.replace('|', chr(92) + '|')} |")
    return "\n".join([*rows, "", "</details>"])
