"""Per-token statistics and the block map: how spread each token's attention is (``entropy``) and how
much attention each token receives (``received``, attention sinks), drawn on the decoded video, and the
block-to-block map (``block``) with a block-sparse mask's kept blocks outlined and its recall."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from ..analysis.layouts import for_layers
from ..analysis.maps import aggregate, choose
from ..analysis.masks import mask_recall
from ..exact.patterns import Pattern, parse
from ..items import pick_item
from ..runs.run import MapSource
from .overlays import token_figure
from .style import (
    CMAP,
    MAP_GID,
    add_colorbars,
    color_norms,
    describe,
    new_figure,
    set_title,
    single_head,
    token_name,
    warn_nonfinite,
)
from .video import patch_pixels

__all__ = ["MASK_GID", "SINK_GID", "block_map", "mask_outline", "token_stat"]

SINK_GID = "sink-token"  # gid of the markers on the top sink tokens
MASK_GID = "mask-outline"  # gid of the outline of a mask's kept blocks


# -- per-token statistics on the video -------------------------------------------------------------
def token_stat(
    source: MapSource,
    kind: str = "entropy",
    video=None,
    *,
    tokenizer=None,
    prompt: str | None = None,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    sinks: int = 5,
    num_pixel_frames: int | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    alpha: float = 0.6,
    interpolation: str = "nearest",
    fig: Figure | None = None,
) -> Figure:
    """Each token's ``entropy`` (how spread its attention is, as a query) or ``received`` attention (how
    much every query gives it, as a key): one panel per latent frame over the decoded video, and the
    text tokens as a strip below, their mean in the title (no strip for Wan, whose self-attention
    sequence is the video alone).

    On the video, each panel is the middle pixel frame of a latent frame, with that frame's values
    upsampled from patches to pixels (as :func:`query_map`). For ``received`` the ``sinks`` tokens that
    receive the most are marked (cyan circles, gid ``"sink-token"``, rank next to them) and named in the
    title: a token that receives many times its share of S is an attention sink.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``kind``.
        kind (`str`, defaults to ``"entropy"``): ``"entropy"`` (nats; ln S for a uniform row) or
            ``"received"`` (Σ over queries; the mean over keys is 1).
        video (defaults to `None`): the decoded video, or `None` for panels on the patch grid alone.
        tokenizer (defaults to `None`): to name the text tokens: the pipeline (``pipe``), as for
            :func:`cogattn.plot.word_heatmap`.
        prompt (`str | None`, defaults to `None`): the prompt; `None` takes ``info["prompt"]``.
        steps, layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged; the steps all of one
            expert's (Wan 2.2 A14B: ``steps="transformer"`` or ``"transformer_2"`` takes its steps).
        heads (`"mean" | int`, defaults to ``"mean"``): one head, or the mean.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        sinks (`int`, defaults to 5): how many top receivers to mark for ``received`` (0: none).
        num_pixel_frames (`int | None`, defaults to `None`): frames of the decoded video when no video is
            given.
        scale (`str`, defaults to ``"linear"``): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits (text and video
            panels share them unless ``"per-map"``).
        alpha (`float`, defaults to 0.6): opacity over the video.
        interpolation (`str`, defaults to ``"nearest"``): patch-to-pixel upsampling, or ``"bilinear"``.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    if kind not in ("entropy", "received"):
        raise ValueError(f"kind={kind!r}; token_stat draws 'entropy' or 'received'.")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r}; pass how many top receivers to mark (0 for none).")
    single_head(heads, "token_stat")
    source = for_layers(source, kind, layers)  # layers of another layout: theirs
    layout = source.layout
    values = aggregate(source, kind, steps=steps, layers=layers, heads=heads, batch=batch)  # (S,)
    T = layout.text_len
    style = dict(fig=fig, num_pixel_frames=num_pixel_frames, scale=scale, limits=limits, alpha=alpha)
    style["interpolation"] = interpolation
    text = dict(tokenizer=tokenizer, prompt=prompt, batch=batch)
    labels = ("video tokens", "text tokens")
    fig, axes, text_ax, pixels, panels, (h, w) = token_figure(source, values, video, kind, labels, text, style)
    top = []
    if kind == "received" and sinks:
        finite = torch.isfinite(values)  # a damaged run's NaN or inf is no sink (color_norms warns of it)
        ranked = values.masked_fill(~finite, -math.inf)
        top = torch.topk(ranked, min(sinks, int(finite.sum()))).indices.tolist()
        for rank, token in enumerate(top, 1):
            point = layout.coordinates(token)
            if point is None:  # the text strip holds the text alone: a history token is named, not marked
                if text_ax is None or not layout.text_start <= token < layout.text_start + layout.text_len:
                    continue
                where, (x, y) = text_ax, (token - layout.text_start, 0)
            else:
                f, y, x = point
                column = [c for c, (_, pf) in enumerate(panels) if pf == f]
                if not column:
                    continue
                where = axes[column[0]]
                if pixels is not None:  # patch centre in pixels
                    sy, sx = patch_pixels(layout, (h, w))
                    x, y = (x + 0.5) * sx, (y + 0.5) * sy
            where.plot([x], [y], marker="o", mfc="none", color="cyan", markersize=10, mew=1.5, gid=SINK_GID)
            where.annotate(str(rank), (x, y), xytext=(5, 5), textcoords="offset points", color="cyan", fontsize=7)
    S = layout.seq_len
    if kind == "entropy":
        what = f"attention entropy of each query token (uniform over S = {S} keys: ln S = {math.log(S):.2f} nats)"
    else:
        what = f"attention each key token receives (Σ over the {S} queries; 1 on average)"
    if T:
        what += (
            f"\ntext tokens' mean {values[layout.text_tokens].mean().item():.3g} · video tokens' mean "
            f"{values[layout.video_tokens].mean().item():.3g}"
        )
    if top:
        named = [f"#{k} {token_name(layout, t)}: {values[t].item():.3g}" for k, t in enumerate(top, 1)]
        what += "\ntop sinks (marked): " + ", ".join(named)
    set_title(fig, what, describe(source, kind, steps, layers, heads, batch))
    return fig


# -- block map -------------------------------------------------------------------------------------
def mask_outline(kept) -> np.ndarray:
    """Segments ``(K, 2, 2)`` of the boundary of a mask's kept cells, in image coordinates (cell ``[m, n]``
    spans ``n ± 0.5``, ``m ± 0.5``): every cell edge with a kept cell on one side only (the grid's border
    counts as not kept).

    Args:
        kept (array-like): ``(N, N)`` booleans, `True` where the mask keeps the block.
    """
    kept = np.asarray(kept, dtype=bool)
    padded = np.pad(kept, 1)
    rows, cols = np.nonzero(padded[1:-1, 1:] != padded[1:-1, :-1])  # vertical edges left of column c
    vertical = [((c - 0.5, r - 0.5), (c - 0.5, r + 0.5)) for r, c in zip(rows.tolist(), cols.tolist())]
    rows, cols = np.nonzero(padded[1:, 1:-1] != padded[:-1, 1:-1])  # horizontal edges above row r
    horizontal = [((c - 0.5, r - 0.5), (c + 0.5, r - 0.5)) for r, c in zip(rows.tolist(), cols.tolist())]
    return np.array(vertical + horizontal, dtype=float).reshape(-1, 2, 2)


def _recall(source: MapSource, mask, step_list: list[int], layer_list: list[int], heads, batch) -> float:
    """The mask's recall for the figure's selection: the mean of :func:`cogattn.analysis.masks.mask_recall`'s rows
    of batch slot ``batch`` and the chosen head (all heads for ``"mean"``)."""

    table = mask_recall(source, mask, steps=step_list, layers=layer_list)
    batch = pick_item(source, batch)
    table = table[table["item"] == batch]
    if isinstance(heads, int):
        table = table[table["head"] == heads]
    if table.empty:
        raise ValueError(f"mask_recall returned no row for batch slot {batch} and heads={heads!r}.")
    return float(table["recall"].mean())


def _group_starts(layout, block_size: int) -> tuple[list[float], list[str]]:
    """Where the text (when the sequence has it, first or last), the history tokens off the grid and each latent
    frame start, in block coordinates, in the sequence's order, and their names."""
    groups = [(layout.text_start, "text")] * bool(layout.text_len)
    groups += [(layout.video_start, "history")] * bool(layout.history_len)
    groups += [(layout.grid_tokens.start + f * layout.frame_tokens, f"f{f}") for f in range(layout.frames)]
    groups.sort()
    return [token / block_size - 0.5 for token, _ in groups], [name for _, name in groups]


def block_map(
    source: MapSource,
    mask=None,
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    fig: Figure | None = None,
) -> Figure:
    """The block-to-block map (kind ``block``): how much of each query block's attention goes to each key
    block, with a block-sparse mask's kept blocks outlined and the attention mass it keeps (its recall,
    from :func:`cogattn.analysis.masks.mask_recall`) in the title.

    Blocks are runs of ``source.block_size`` tokens from token 0 in the model's order (text first, when
    the sequence has it: Wan's is the video alone), so a frame's tokens need not start a block: ticks
    mark where the text and each latent frame start.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``block``.
        mask (`torch.Tensor | str | Pattern | None`, defaults to `None`): an ``(N, N)`` bool tensor, `True` where the
            mask keeps a block, e.g. ``cogattn.analysis.masks.same_frame_mask(source.layout, source.block_size)``, or a
            token pattern (``"spatial"``, ``"sta:3,3,3"``: its block mask); `None`: no outline.
        steps, layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged; the steps all of one
            expert's (Wan 2.2 A14B: ``steps="transformer"`` or ``"transformer_2"`` takes its steps).
        heads (`"mean" | int`, defaults to ``"mean"``): one head, or the mean.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        scale (`str`, defaults to ``"linear"``): ``"log"`` shows the small blocks far from the diagonal.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    single_head(heads, "block_map")
    source = for_layers(source, "block", layers)  # layers of another layout: theirs
    layout = source.layout
    size = source.block_size
    m = aggregate(source, "block", steps=steps, layers=layers, heads=heads, batch=batch).numpy()  # (N, N)
    N = m.shape[0]
    side = min(9.0, max(3.5, 0.12 * N + 2.0))
    fig = new_figure(fig, (side + 1.4, side + 0.9))
    ax = fig.subplots()
    if np.isnan(m).all():  # color_norms takes a map of NaN alone for a skipped one: this one is damaged
        warn_nonfinite([m], gaps=False)
    norm = color_norms([m], scale, limits)[0]
    im = ax.imshow(m, cmap=CMAP, norm=norm, interpolation="nearest", gid=MAP_GID)
    starts, labels = _group_starts(layout, size)
    for axis, rotate in ((ax.xaxis, len(starts) > 8), (ax.yaxis, False)):
        axis.set_ticks(starts, labels, fontsize=7, rotation=90 if rotate else 0)
    ax.tick_params(length=6)
    starts_of = "text and frames" if layout.text_groups else "frames"
    ax.set_xlabel(f"key block ({size} tokens each; ticks: where {starts_of} start)", fontsize=8)
    ax.set_ylabel("query block", fontsize=8)
    what = f"block → block attention ({N} × {N} blocks)"
    if isinstance(mask, (str, Pattern)) or callable(mask):  # a token pattern: its block mask, as mask_recall takes it
        mask = parse(mask, tuple(getattr(source, "tile_shape", None) or (4, 4, 4))).block_mask(layout, size)
    if isinstance(mask, torch.Tensor) and mask.ndim != 2:
        raise ValueError(
            f"block_map outlines one (N, N) mask; got {tuple(mask.shape)}: choose one batch item and head of a mask "
            "made per item and head, e.g. mask[0, 0]."
        )
    if mask is not None:
        recall = _recall(
            source,
            mask,
            choose(source, "block", "step", steps),
            choose(source, "block", "layer", layers),
            heads,
            batch,
        )  # checks the mask first: an (N, N) bool tensor
        kept = mask.cpu().numpy()
        ax.add_collection(LineCollection(mask_outline(kept), colors="cyan", linewidths=1.2, gid=MASK_GID))
        what += f"\nmask keeps {kept.mean():.1%} of the blocks · recall {recall:.4f} of the attention mass"
    add_colorbars(fig, [im], [ax], "block", limits)
    set_title(fig, what, describe(source, "block", steps, layers, heads, batch))
    return fig
