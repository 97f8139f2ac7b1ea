"""What the Layers panel draws: the logit lens of the step it shows, asked of the engine.

The engine keeps each step's per-layer residuals only while the panel is on screen, and works
a step's lens out only when asked (engine/model/lens.py): `LensBook` remembers the lenses that
came back for the latest reply, which step the panel wants (the selected one, else the latest)
and whether an ask is on its way, so at most one is.
"""

from __future__ import annotations

from engine.events import LayerLens
from engine.token_labels import quoted


class LensBook:
    """The lenses received for the latest reply, by step, and the one ask in flight."""

    def __init__(self) -> None:
        self.lenses: dict[int, LayerLens] = {}
        self.missing: set[int] = set()  # steps the engine had not kept
        self.pending: tuple[int, int] | None = None  # (ask id, step)
        self.reply = 0  # the reply these belong to (InternalsState's count of replies)
        self.revision = 0

    def follow(self, reply: int) -> None:
        """A new reply: its step numbers name other steps."""
        if reply != self.reply:
            self.reply = reply
            self.lenses, self.missing, self.pending = {}, set(), None
            self.revision += 1

    def needs_ask(self, step: int | None) -> bool:
        if step is None or self.pending is not None:
            return False
        return step not in self.lenses and step not in self.missing

    def asked(self, ask: int, step: int) -> None:
        self.pending = (ask, step)

    def answered(self, ask: int, lens: LayerLens | None) -> bool:
        """Take the engine's answer; False for an answer nobody waits for (an older reply's)."""
        if self.pending is None or self.pending[0] != ask:
            return False
        step = self.pending[1]
        self.pending = None
        if lens is None or lens.step != step:
            self.missing.add(step)
        else:
            self.lenses[step] = lens
        self.revision += 1
        return True

    def latest(self, upto: int) -> int | None:
        """The last step at or before `upto` whose lens came (None: none yet)."""
        return max((step for step in self.lenses if step <= upto), default=None)

    def forget_missing(self) -> None:
        """The panel was shown again: steps from now on are kept, ask again."""
        if self.missing:
            self.missing.clear()
            self.revision += 1


def lead_layer(lens: LayerLens) -> int:
    """The first layer (0-based) from which the last layer's first guess stays first."""
    final = lens.token_ids[-1][0]
    lead = lens.layers - 1
    for layer in range(lens.layers - 1, -1, -1):
        if lens.token_ids[layer][0] != final:
            break
        lead = layer
    return lead


def lens_sentence(lens: LayerLens) -> str:
    """The lens in one sentence with its real numbers, layers counted from 1."""
    layers, final = lens.layers, lens.texts[-1][0]
    lead = lead_layer(lens)
    prob = lens.probs[-1][0]
    if lead == 0:
        sentence = f"{quoted(final)} ({prob:.0%}) is the first guess at every layer of {layers}."
    else:
        earlier = lead // 2
        guess, share = lens.texts[earlier][0], lens.probs[earlier][0]
        sentence = (
            f"{quoted(final)} ({prob:.0%} at the end) leads from layer {lead + 1} of {layers}"
            f" on; at layer {earlier + 1} the best guess was {quoted(guess)} ({share:.0%})."
        )
    if lens.token_id != lens.token_ids[-1][0]:
        rank, chosen = lens.chosen_ranks[-1], lens.chosen_probs[-1]
        chose = quoted(lens.token_text)
        sentence += f" The sampler chose {chose}, rank {rank + 1} ({chosen:.1%})."
    return sentence


EMPTY_TEXT = (
    "<b>Layers</b><br>Where in the stack the next token forms: the residual stream after each"
    " layer, put through the model's final norm and output head (a logit lens), gives that"
    " layer's best guesses. The grid will show them layer by layer, the last layer at the"
    " top (the Next token panel's distribution), and the chosen token's rank at each.<br><br>"
    "<i>Send a message while this panel is open, then click any token of the reply to see"
    " the step that chose it.</i>"
)
