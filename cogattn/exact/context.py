"""Kinds of a separate attention beside the self-attention: a cross-attention's (Wan's ``attn2``: video queries
attending to the text or image context) and an audio stream's (LTX-2: :mod:`cogattn.exact.reducers.audio`).

A cross-attention's softmax runs over its context keys alone (512 text tokens, 257 image tokens; both in one
softmax where the image tokens join the text's, each kind taking its own columns), so its probabilities are
small rows: :func:`context_pass` forms them exactly, in float32, in tiles of
heads × query rows that fit the memory budget (:func:`cogattn.exact.memory.context_tile`), and folds them into the result; the full
``(B, H, S, T)`` tensor is never held (docs/design.md, "The model seam").
"""

from __future__ import annotations

import math

import torch

from .memory import context_tile, one_refusal
from .passes import full_fp32_matmul
from .reducers import CONTEXT_REDUCERS, ContextReducer

__all__ = [
    "context_pass",
    "context_reducers",
    "plan_context_tiles",
]


@torch.no_grad()
def context_pass(
    query: torch.Tensor,
    key: torch.Tensor,
    items,
    reducers: list[ContextReducer],
    heads: torch.Tensor | None,
    tile: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Exact cross-attention probabilities ``softmax(q kᵀ / √D + bias)`` of the batch ``items``, folded into each
    reducer.

    Args:
        query (`torch.Tensor`): the queries ``(B, H, V, D)`` (the grid's video queries; an audio kind's own).
        key (`torch.Tensor`): the keys ``(B, H, C, D)``.
        items: batch items of ``query`` to compute.
        reducers (`list[ContextReducer]`): the kinds of this context.
        heads (`torch.Tensor | None`): the selected heads, `None` for all.
        tile (`tuple[int, int]`): heads and query rows per tile, within the memory budget
            (:func:`cogattn.exact.memory.context_tile`, planned in :attr:`cogattn.exact.planner.CapturePlan.context_tiles`).
        bias (`torch.Tensor | None`): float32 ``(B, C)`` added to each item's scores of its keys (a key mask:
            LTX-Video's padded text, 0 or −10000), as the attention adds it.

    Returns:
        `list[torch.Tensor]`: one float32 result per reducer (``(len(items), H_out, C, F, Hp, Wp)`` for ``video_to_text``).
    """
    _, H, V, D = query.shape
    n_heads = H if heads is None else len(heads)
    scale = 1.0 / math.sqrt(D)
    hc, rc = tile
    outs = [torch.zeros(r.shape(len(items)), dtype=torch.float32, device=query.device) for r in reducers]
    with full_fp32_matmul():
        for i, b in enumerate(items):
            for h0 in range(0, n_heads, hc):
                idx = torch.arange(h0, min(h0 + hc, n_heads)) if heads is None else heads[h0 : h0 + hc]
                idx = idx.to(query.device)
                k = key[b].index_select(0, idx).float()
                for r0 in range(0, V, rc):
                    q = query[b, :, r0 : r0 + rc].index_select(0, idx).float()
                    probs = torch.matmul(q, k.transpose(1, 2)).mul_(scale)  # softmax in place: one tile
                    if bias is not None:
                        probs.add_(bias[b])
                    probs.sub_(probs.amax(-1, keepdim=True)).exp_()
                    probs.div_(probs.sum(-1, keepdim=True))
                    for red, out in zip(reducers, outs):
                        red.fold_rows(out[i], h0, r0, probs)
                    del q, probs  # freed before the next tile is made: one tile held, as planned, not two
                del k
    return outs


def context_reducers(options, res, sources: dict[str, str], shapes: dict, sizes: dict):
    """The reducers of the kinds ``options`` asks of attentions other than the self-attention (``sources``: kind →
    source), and source → the selected heads of each (``shapes``: source → ``(heads, head dim)`` where its heads are
    not the self-attention's; ``"all"`` and ``"mean"`` take all of its own). Raises `ValueError` for a kind whose
    attention this generation lacks, or a listed head a source does not have."""
    context, heads_of = [], {}
    for k in [k for k in options.kinds if k in sources]:
        src = sources[k]
        heads_of[src] = res.heads  # the self-attention's heads, already checked, unless the source has its own
        if src in shapes:
            count = shapes[src][0]
            heads_of[src] = tuple(range(count)) if isinstance(options.heads, str) else res.heads
            if max(heads_of[src]) >= count:
                raise ValueError(f"heads={list(res.heads)}; the {src} attention has {count} heads, 0..{count - 1}.")
        red = CONTEXT_REDUCERS[k](res.layout, len(heads_of[src]), res.mean_heads, **sizes)
        if red.context_len == 0:
            why = " (Wan 2.1 image-to-video has one; Wan 2.2 puts the image in the latents)" * (k == "video_to_image")
            raise ValueError(
                f"kind {k!r} needs the cross-attention to {src} tokens, which this generation does not have{why}."
            )
        context.append(red)
    return context, heads_of


def plan_context_tiles(context: list, heads_of: dict, shapes: dict, head_dim: int, budget: int, device):
    """``(source → (heads, query rows) per tile, peak bytes)`` of the ``context`` reducers' passes within ``budget``
    (:func:`cogattn.exact.memory.context_tile`; ``shapes``: a source's own ``(heads, head dim)``); a budget too small
    for some is refused once, with the least budget that holds them all."""

    def tile(r):
        dim = shapes.get(r.source, (0, head_dim))[1]
        return context_tile(len(heads_of[r.source]), r.query_len, r.context_len, dim, budget, device)

    tiles, peak = {}, 0
    for r, (h, rows, held) in zip(context, one_refusal(*[lambda r=r: tile(r) for r in context])):
        tiles[r.source], peak = (h, rows), max(peak, held)
    return tiles, peak
