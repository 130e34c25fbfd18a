"""The naive reference every map is checked against: ``softmax(q @ k.T * scale)`` in float64, every kind
taken from it by plain indexing (the definitions in docs/design.md).

It forms the full S × S probabilities, so it is for small sequences only: the tests, and
``python -m cogattn.selftest``. It shares no code with the engine or the reducers.
"""

from __future__ import annotations

import math

import torch

__all__ = ["naive_kind", "naive_probs", "select"]


def naive_probs(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``(..., S, S)`` float64 ``softmax(q kᵀ · scale)``, ``scale`` defaulting to ``1/sqrt(D)``."""
    q, k = q.double(), k.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)


def naive_kind(P: torch.Tensor, kind: str, T: int, grid: tuple[int, int, int], queries=None) -> torch.Tensor:
    """One kind from full probabilities ``P`` ``(B, H, S, S)``: ``T`` text tokens, the latent ``grid``
    ``(F, Hp, Wp)``, and the ``query`` kind's token indices ``queries``."""
    B, H, S, _ = P.shape
    F, Hp, Wp = grid
    if kind == "full":
        return P
    if kind == "query":
        return P[:, :, list(queries)]
    if kind == "video_to_text":
        return P[:, :, T:, :T].permute(0, 1, 3, 2).reshape(B, H, T, F, Hp, Wp)
    if kind == "text_to_video":
        return P[:, :, :T, T:].reshape(B, H, T, F, Hp, Wp)
    if kind == "frame":
        bounds = [0, T] + [T + (f + 1) * Hp * Wp for f in range(F)]
        G = F + 1
        out = torch.empty(B, H, G, G, dtype=P.dtype)
        for g in range(G):
            for h in range(G):
                block = P[:, :, bounds[g] : bounds[g + 1], bounds[h] : bounds[h + 1]]
                out[:, :, g, h] = block.sum(-1).mean(-1)
        return out
    raise ValueError(kind)


def select(x: torch.Tensor, batch, heads) -> torch.Tensor:
    """Apply a batch list and heads (``"all"``, ``"mean"`` or a list) to a ``(B, H, ...)`` reference."""
    x = x[list(batch)]
    if heads == "mean":
        return x.mean(1, keepdim=True)
    if heads == "all":
        return x
    return x[:, list(heads)]
