"""The largest logits, found in two short passes on the CPU.

torch's CPU argmax walks a vocabulary's logits one entry at a time (twice a greedy step).
Viewed as rows of 128, the row maxima are one vectorised pass; the first row holding the
maximum, then the first maximum in that row, is the same index, found in a fraction of the time.
Likewise torch's CPU topk over the whole vector (slow, for the 50 a sampled step keeps, the 10
candidates the view shows, the 64 logits the fast head recomputes): the k largest values all lie
in the k rows with the largest maxima, so a topk over those rows finds them.
Where the GGML kernels are loaded, `top_k_rows` is their C++ op of the same two passes (one
call, where the torch ops are five, each tens of microseconds between two decode steps), and
`argmax` their `first_largest` (one call, where the torch way is four).
Elsewhere (a GPU, a length that is not a multiple of 128) torch's own argmax and topk run.
"""

from __future__ import annotations

import torch

from engine.weights import ggml_kernel

WIDTH = 128


def _rows(values: torch.Tensor) -> torch.Tensor | None:
    """values [V] on the CPU as [V / WIDTH, WIDTH] rows; None where torch's own op should run."""
    if values.device.type != "cpu" or values.dim() != 1 or values.shape[0] % WIDTH:
        return None
    return values.view(-1, WIDTH)


def argmax(values: torch.Tensor) -> torch.Tensor:
    """The index of the first largest entry of values [V], a 0-d tensor (as Tensor.argmax)."""
    on_cpu = values.device.type == "cpu" and values.dim() == 1 and values.numel() > 0
    if on_cpu and values.dtype == torch.float32 and ggml_kernel.ensure() is None:
        first: torch.Tensor = torch.ops.glassbox.first_largest(values)  # NaN first, as torch
        return first
    rows = _rows(values)
    if rows is None:
        return values.argmax()
    row = rows.amax(1).argmax()  # the first row holding the maximum
    return row * WIDTH + rows[row].argmax()


def top_k_support(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices, ascending, of the entries at least the k-th largest of values [V]
    (1 <= k <= V): k of them, more where entries tie with it. As
    `(values >= values.topk(k).values[-1]).nonzero()[:, 0]`, without a pass of topk or nonzero
    over every entry (the two cost several times what this way does).

    Most steps have no tie at the k-th largest: then the k + 1 largest (`top_k_rows`, one
    call where the GGML kernels load) say so, and the k are the support. Else the rows'
    maxima find every entry that reaches it."""
    rows = _rows(values)
    if rows is None or k > rows.shape[0]:
        return (values >= values.topk(k).values[-1]).nonzero()[:, 0]
    if k < rows.shape[0]:
        top = top_k_rows(values[None], k + 1)[0]  # largest first
        edge = values[top[k - 1 :]]
        if bool(edge[1] < edge[0]):  # nothing past the k largest reaches the k-th (nor a NaN)
            return top[:k].sort().values
    maxima = rows.amax(1)
    # Each of the k largest entries lies in a row whose maximum is at least that entry, so the
    # k rows with the largest maxima hold k entries at least as large as any elsewhere.
    threshold = rows[maxima.topk(k).indices].flatten().topk(k).values[-1]
    candidates = (maxima >= threshold).nonzero()[:, 0]  # every row holding one (ties too)
    hits = (rows[candidates] >= threshold).nonzero()  # [n, (row, column)], in order
    return candidates[hits[:, 0]] * WIDTH + hits[:, 1]


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of values [V], largest first: torch.topk's
    values exactly (an index among equal values may differ, as torch promises no order among
    ties). One row's `top_k_rows`."""
    indices = top_k_rows(values[None], k)[0]
    return values[indices], indices


def top_k_rows(values: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k]: the indices of each row's k largest of values [n, V], largest first, all rows in
    one pass each way. Each row's choice among equal values is its own, whatever rows come with
    it (torch's topk takes each row alone): the logit lens's last layer is then exactly the
    decode step's own logits."""
    size = values.shape[1]
    if values.device.type != "cpu" or size % WIDTH or k > size // WIDTH:
        return values.topk(k, dim=-1).indices
    if values.dtype in (torch.float32, torch.bfloat16) and ggml_kernel.ensure() is None:
        top: torch.Tensor = torch.ops.glassbox.top_k_rows(values, k)  # ties: the lower index
        return top
    return top_k_rows_torch(values, k)


def top_k_rows_torch(values: torch.Tensor, k: int) -> torch.Tensor:
    """top_k_rows in torch's ops (values [n, V], V a multiple of WIDTH, k <= V / WIDTH)."""
    n = values.shape[0]
    # Every row of WIDTH holding one of a row's k largest has a maximum at least that entry:
    # k such rows at most, each among the k rows with the largest maxima.
    rows = values.view(n, -1, WIDTH)  # [n, V / WIDTH, WIDTH]
    best = rows.amax(2).topk(k, dim=1).indices  # [n, k]: the rows holding them
    held = rows.gather(1, best[..., None].expand(n, k, WIDTH)).view(n, k * WIDTH)
    top = held.topk(k, dim=1).indices  # [n, k] among k · WIDTH entries a row
    return best.gather(1, top // WIDTH) * WIDTH + top % WIDTH


def top_k_softmax(rows: list[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows [V] float32 (a batch of steps' logits): each row's k largest, largest first,
    as top_k_rows names them ([n, k] int64), and their softmax probabilities over the row
    ([n, k] float32). Where the GGML kernels load, one C++ call per batch: no stacked copy of
    the rows, no softmax written over every entry (cold in memory between two decode steps)."""
    first = rows[0]
    size = first.shape[-1]
    usable = first.device.type == "cpu" and first.dtype == torch.float32 and first.dim() == 1
    if usable and not size % WIDTH and k <= size // WIDTH and ggml_kernel.ensure() is None:
        indices, probs = torch.ops.glassbox.top_k_softmax(rows, k)
        return indices, probs
    logits = torch.stack(rows)  # [n, V]
    indices = top_k_rows(logits, k)
    return indices, torch.softmax(logits, dim=-1).gather(1, indices)
