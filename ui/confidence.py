"""How sure the model was of each token it wrote, from the Token events' candidates alone.

A token's confidence is the probability the model gave it (the softmax of the logits that
chose it, the Next token panel's `prob`), with the runners-up of that step. It is read from
the top-k every Token event carries already: no extra forward. A token the sampler drew from
outside the top-k has no probability here (None): it was below the k-th candidate's.

A reply's confidences are kept in its stats (the store's JSON column, `CONFIDENCE_KEY`) as
[[text, probability or null, [[runner-up text, probability], ...]], ...], so they survive a
reload and go into every export. Qt-free (an import contract keeps it so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.events import Token

CONFIDENCE_KEY = "token_confidence"
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


def with_confidence(stats: dict[str, Any], plain: Sequence[Any]) -> dict[str, Any]:
    """`stats` with the reply's token confidences, when it has any."""
    return {**stats, CONFIDENCE_KEY: list(plain)} if plain else stats


def confidences(stats: Mapping[str, Any]) -> tuple[TokenConfidence, ...]:
    """A stored reply's token confidences (none for a reply stored without them)."""
    kept = stats.get(CONFIDENCE_KEY) or ()
    return tuple(
        TokenConfidence(
            str(text),
            None if prob is None else float(prob),
            tuple((str(t), float(p)) for t, p in runners),
        )
        for text, prob, runners in kept
    )


def tint(prob: float | None) -> tuple[int, int, int, int]:
    """An RGBA background for a token: clear when sure, more red the less sure (alpha)."""
    doubt = 1.0 if prob is None else 1.0 - max(0.0, min(1.0, prob))
    return (230, 60, 40, round(150 * doubt))


def describe(confidence: TokenConfidence) -> str:
    """The hover text: the token's probability and its runners-up."""
    prob = "below the top candidates" if confidence.prob is None else f"{confidence.prob:.1%}"
    lines = [f"{confidence.text!r}: {prob}"]
    lines += [f"  {text!r}: {p:.1%}" for text, p in confidence.runners_up]
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
