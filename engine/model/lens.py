"""A logit lens: what each layer of a pass would have said the next token is.

The residual stream after layer i, at the pass's last position, goes through the model's own
final norm and output head (nostalgebraist's logit lens): softmax(head(norm(h_i))). After the
last layer that is exactly the model's next-token distribution; before it, the guess of a
stream that was never trained to be read there (see docs/lens.md for where that misleads).

Cost is paid only when looked at. While a lens is watched, `Residuals` records each layer's
output at the last position (a [dim] vector a layer: the bundled model's 30 x 576 floats a
step), the reply's `StepRing` (engine/model/step_ring.py) keeps recent steps under a byte cap, and
`LensHead` runs the head over a step's [layers, dim] in one batched product when a panel asks for
it. Unwatched, nothing is installed and a pass runs as it always did (the fast steps return
their layers' outputs either way, one [layers, dim] copy a step, which nothing keeps then).

Two kinds of model:
- transformers: forward hooks on the decoder layers; the head is the model's final norm and
  lm_head (with Gemma's final logit soft-capping where the config has one).
- Glassbox's GGUF models (engine/model/llama.py): every step that runs a pass (the eager
  layers, the CPU's compiled step, the GPU's static step) has each layer's output at hand and
  gives it to the model's `keep_residuals` while the capture sets it, so a watched pass runs
  the same step as an unwatched one. The head is the model's `norm` and `output` Head: the
  bulk int4 product ranks every token and the Head's exact rows replace the likeliest, as for
  the next-token probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from engine.events import LayerLens
from engine.model.llama import GGUFLlama, final_norm_rows
from engine.model.step_ring import RESIDUALS, StepRing

RING_BYTES = 32 * 2**20  # residuals kept for past steps, at most
LENS_TOP = 10  # candidates a layer's guess carries


def _layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's hidden states [batch, n, dim] (some layers return a tuple)."""
    return cast(torch.Tensor, output[0] if isinstance(output, tuple) else output)


def transformers_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(decoder layers, final norm, output head) of a transformers causal LM."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    if inner is None:
        raise ValueError(f"{type(model).__name__}: no decoder to read a logit lens from")
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    norm = getattr(inner, "norm", None) or getattr(inner, "ln_f", None)
    head = getattr(model, "lm_head", None)
    if layers is None or norm is None or head is None:
        raise ValueError(f"{type(model).__name__}: its layers, final norm or head not found")
    return cast(nn.ModuleList, layers), cast(nn.Module, norm), cast(nn.Module, head)


class Residuals:
    """Each decoder layer's output at the last position of one pass, while `capture` runs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: dict[int, torch.Tensor] = {}  # by layer, from a transformers model's hooks
        self.stacked: torch.Tensor | None = None  # [layers, dim], from a GGUF model's step

    @contextmanager
    def capture(self) -> Iterator[None]:
        self.layers, self.stacked = {}, None
        if isinstance(self.model, GGUFLlama):
            self.model.keep_residuals = self._keep_stacked
            try:
                yield
            finally:
                self.model.keep_residuals = None
            return
        handles = [
            layer.register_forward_hook(self._hook(i))
            for i, layer in enumerate(transformers_parts(self.model)[0])
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def take(self) -> torch.Tensor | None:
        """The pass's residuals [layers, dim] float32, on the model's device (None: none ran)."""
        stacked, self.stacked = self.stacked, None
        if stacked is not None:
            return stacked.detach().float()
        if not self.layers:
            return None
        rows = [self.layers[i] for i in sorted(self.layers)]
        self.layers = {}
        return torch.stack(rows).float()

    def _keep(self, layer: int, x: torch.Tensor) -> None:
        self.layers[layer] = x.detach()

    def _keep_stacked(self, residuals: torch.Tensor) -> None:
        self.stacked = residuals

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._keep(layer, _layer_output(output)[0, -1])

        return hook


class LensHead:
    """The model's final norm and output head, applied to every layer's residual at once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = getattr(model, "config", None)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @torch.inference_mode()
    def logits(self, residuals: torch.Tensor) -> torch.Tensor:
        """residuals [layers, dim] -> logits [layers, vocab] float32."""
        model = self.model
        if isinstance(model, GGUFLlama):
            # Row by row as the model norms its one last position, so the last layer's logits
            # are the pass's own; then one batched product through the Head.
            eps = model.shape.eps
            normed = final_norm_rows(residuals, model.norm, eps)
            return model.output.forward(normed)
        _, norm, head = transformers_parts(model)
        weight = next(head.parameters())
        logits: torch.Tensor = head(norm(residuals.to(weight.dtype)[None]))[0].float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def layer_lens(
    step: int,
    logits: torch.Tensor,
    token_id: int,
    piece: Callable[[int], str],
    top: int,
    started: float,
) -> LayerLens:
    """Each layer's `top` guesses from its logits [layers, vocab], and where the token the
    step chose stood in each layer's distribution (rank 0: its first guess). `started`: when
    the lens's work began (perf_counter), the head's product included, for its `seconds`."""
    probs = torch.softmax(logits.float(), dim=-1)  # [layers, vocab]
    best = probs.topk(top, dim=-1)
    chosen = probs[:, token_id]  # [layers]
    ranks = (probs > chosen[:, None]).sum(-1)
    ids = best.indices.cpu().tolist()
    texts = {i: piece(i) for row in ids for i in set(row)}
    return LayerLens(
        step=step,
        token_id=token_id,
        token_text=piece(token_id),
        token_ids=tuple(tuple(row) for row in ids),
        texts=tuple(tuple(texts[i] for i in row) for row in ids),
        probs=tuple(tuple(row) for row in best.values.cpu().tolist()),
        chosen_ranks=tuple(ranks.cpu().tolist()),
        chosen_probs=tuple(chosen.cpu().tolist()),
        seconds=time.perf_counter() - started,
    )


class LayerLensProbe:
    """The session's lens: watched or not, the ring of kept steps, and a step's lens on ask."""

    def __init__(self, model: nn.Module, max_bytes: int = RING_BYTES) -> None:
        self.residuals = Residuals(model)
        self.head = LensHead(model)
        self.ring = StepRing(max_bytes)  # its steps' (residuals [layers, dim], token id)
        self.watching = False  # set from any thread; read once per pass

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Record the pass's residuals if the lens is watched; otherwise nothing at all."""
        if not self.watching:
            yield
            return
        with self.residuals.capture():
            yield

    def keep(self, step: int, residuals: torch.Tensor | None, token_id: int) -> None:
        if residuals is not None:
            self.ring.put(step, RESIDUALS, (residuals, token_id))

    def lens(self, step: int, piece: Callable[[int], str], top: int = LENS_TOP) -> LayerLens | None:
        """The step's lens from its kept residuals; None where the step was not kept."""
        kept = self.ring.get(step, RESIDUALS)
        if kept is None:
            return None
        residuals, token_id = kept
        started = time.perf_counter()
        return layer_lens(step, self.head.logits(residuals), token_id, piece, top, started)
