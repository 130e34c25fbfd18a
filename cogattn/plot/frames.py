"""Frame-level figures: the frame-to-frame heatmap (per-head small multiples) and a grid of any 2-D
view of a kind over layers × steps."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..analysis.layouts import for_layers, layers_view
from ..analysis.maps import aggregate, choose, expert_steps, skipped_pairs
from ..exact.reducers import REDUCERS
from ..runs.run import MapSource
from .style import (
    CMAP,
    MAP_GID,
    add_colorbars,
    color_norms,
    describe,
    frame_label,
    frame_unit,
    head_labels,
    heads_text,
    new_figure,
    pixel_ranges,
    set_title,
    single_head,
)

__all__ = ["frame_heatmap", "layer_step_grid"]


# -- frame to frame --------------------------------------------------------------------------------
def frame_heatmap(
    source: MapSource,
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "mean",
    batch: int | str | None = None,
    num_pixel_frames: int | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    annotate: bool | None = None,
    fig: Figure | None = None,
) -> Figure:
    """Frame-to-frame attention (kind ``frame``): how much of each query group's attention goes to each
    key group, where group 0 is the text and group f + 1 is latent frame f; without text in the sequence
    (Wan, whose text is in a separate cross-attention) group f is latent frame f.

    Ticks name each group: ``text`` (when the sequence has it), then ``f<k>`` with the pixel frames latent
    frame k covers. With ``heads="all"`` (or a list), one panel per head (small multiples).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``frame``.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): steps, averaged: all of one
            expert's (Wan 2.2 A14B: ``"transformer"`` or ``"transformer_2"`` takes its steps).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers, averaged.
        heads (`"mean" | "all" | int | Sequence[int]`, defaults to ``"mean"``): heads; ``"all"`` or a
            list draws one panel per head.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        num_pixel_frames (`int | None`, defaults to `None`): frames of the decoded video, to name the pixel
            frames of each latent frame (CogVideoX 1.0 infers it; 1.5 needs it).
        scale (`str`, defaults to ``"linear"``): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits shared by
            all panels, per panel, or fixed ``(vmin, vmax)``.
        annotate (`bool | None`, defaults to `None`): write each value in its cell; `None`: when G ≤ 8
            and at most 8 panels.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    source = for_layers(source, "frame", layers)  # layers of another layout: theirs (Motif-Video's decoder)
    layout = source.layout
    m = aggregate(source, "frame", steps=steps, layers=layers, heads=heads, batch=batch)
    maps = m[None] if m.ndim == 2 else m
    labels = head_labels(source, heads, maps.shape[0])
    ranges = pixel_ranges(layout, num_pixel_frames)
    ticks = _group_ticks(layout, [frame_label(f, ranges) for f in range(layout.frames)])
    G = layout.num_groups
    n = maps.shape[0]
    many = n > 8  # e.g. 48 heads of CogVideoX-5b: smaller panels, 8 to a row, no numbers
    ncols = 8 if many else min(n, 4)
    nrows = math.ceil(n / ncols)
    side = 0.2 * G + 1.0 if many else max(3.0, 0.42 * G + 1.4)
    fig = new_figure(fig, (side * ncols + 1.2, side * nrows + 0.7))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    arrays = [maps[i].numpy() for i in range(n)]
    norms = color_norms(arrays, scale, limits)
    annotate = G <= 8 and not many if annotate is None else annotate
    images = []
    unit = ("text or " if layout.text_groups else "") + frame_unit(layout)
    for i, ax in enumerate(axes):
        if i >= n:
            ax.set_visible(False)
            continue
        im = ax.imshow(arrays[i], cmap=CMAP, norm=norms[i], interpolation="nearest", gid=MAP_GID)
        images.append(im)
        ax.set_xticks(range(G), ticks, fontsize=7, rotation=90 if G > 8 else 0)
        ax.set_yticks(range(G), ticks, fontsize=7)
        ax.set_xlabel(f"key: {unit}", fontsize=8)
        ax.set_ylabel(f"query: {unit}", fontsize=8)
        if heads != "mean":  # one mean panel: the title above says it
            ax.set_title(labels[i], fontsize=9)
        if annotate:
            for (r, c), v in np.ndenumerate(arrays[i]):
                light = norms[i](v) < 0.5  # white text on the dark end of the colour map
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if light else "k")
    add_colorbars(fig, images, [a for a in axes[:n]], "frame", limits)
    set_title(fig, "frame → frame attention", describe(source, "frame", steps, layers, heads, batch))
    return fig


def _group_ticks(layout, frames: list[str]) -> list[str]:
    """The names of the frame groups: ``"text"`` first when the sequence starts with the text, then ``frames``."""
    return ["text"] * layout.text_groups + frames


# -- grid over layers × steps ----------------------------------------------------------------------
def layer_step_grid(
    source: MapSource,
    kind: str = "frame",
    *,
    index: tuple = (),
    steps: str | Sequence[int] = "all",
    layers: str | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    fig: Figure | None = None,
) -> Figure:
    """A grid of any 2-D view of a kind: one row per layer, one column per step.

    ``index`` cuts the kind's per-item map (after the head axis is chosen) down to two dimensions
    (one dimension is drawn as a strip), e.g. ``kind="video_to_text", index=(3, 1)`` shows text token
    3 over the patch grid of latent frame 1.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        kind (`str`, defaults to ``"frame"``): any recorded kind.
        index (`tuple`, defaults to ``()``): ints and slices applied to the map ``(dims of the kind)``.
        steps, layers (`"all" | Sequence[int]`, defaults to ``"all"``): the columns and rows (pick a few
            for a real model: 50 steps × 30 layers is 1,500 panels); an expert's name takes its steps.
        heads (`"mean" | int`, defaults to ``"mean"``): one head, or the mean.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        scale (`str`, defaults to ``"linear"``): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    single_head(heads, "layer_step_grid")
    step_list = choose(source, kind, "step", steps)
    layer_list = choose(source, kind, "layer", layers)
    index = index if isinstance(index, tuple) else (index,)
    dims = list(REDUCERS[kind].dims)
    kept = [d for i, d in enumerate(dims) if i >= len(index) or not isinstance(index[i], int)]
    source = layers_view(source, layer_list, f"layer_step_grid of {kind!r}")  # one layout: its ticks
    arrays, gaps = [], skipped_pairs(source, kind, step_list, layer_list)
    for layer in layer_list:
        for s in step_list:
            if (s, layer) in gaps:  # a cache skipped it: an empty panel, filled in below
                arrays.append(None)
                continue
            m = aggregate(source, kind, steps=s, layers=layer, heads=heads, batch=batch)
            try:
                a = m[index]
            except IndexError as e:
                raise ValueError(
                    f"index={index!r} does not fit the {kind} map of shape {tuple(m.shape)} ({dims}): {e}"
                ) from None
            if a.ndim not in (1, 2):
                raise ValueError(
                    f"index={index!r} leaves the {kind} map {a.ndim}-D {tuple(a.shape)}; index its dimensions "
                    f"{dims} down to 2 (or 1)."
                )
            arrays.append((a[None] if a.ndim == 1 else a).numpy())
    if all(a is None for a in arrays):
        source.get(kind, step_list[0], layer_list[0])  # raises, saying what skipped them
    blank = next(a for a in arrays if a is not None)
    arrays = [np.full_like(blank, np.nan) if a is None else a for a in arrays]
    if arrays[0].shape[0] == 1 and len(kept) == 1:
        kept = ["", kept[0]]
    nrows, ncols = len(layer_list), len(step_list)
    h, w = arrays[0].shape
    pw = 2.2
    ph = max(0.6, min(2.6, (pw - 0.35) * h / w)) + 0.3  # the panel's drawn width is pw less its tick labels
    fig = new_figure(fig, (pw * ncols + 1.4, ph * nrows + 0.8))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    norms = color_norms(arrays, scale, limits)
    images = []
    group_ticks = _group_ticks(source.layout, [f"f{f}" for f in range(source.layout.frames)])
    several = len(expert_steps(source)) > 1  # Wan 2.2 A14B: each column names its transformer
    experts = {s: name for name, group in expert_steps(source, step_list).items() for s in group}
    for r, layer in enumerate(layer_list):
        for c, s in enumerate(step_list):
            ax = axes[r, c]
            k = r * ncols + c
            aspect = "auto" if h == 1 else "equal"
            images.append(
                ax.imshow(arrays[k], cmap=CMAP, norm=norms[k], interpolation="nearest", aspect=aspect, gid=MAP_GID)
            )
            if (s, layer) in gaps:
                by = source.skipped.by or "the model"
                ax.text(0.5, 0.5, f"skipped\n({by})", ha="center", va="center", fontsize=7, transform=ax.transAxes)
            if kind == "frame" and not index:
                ax.set_xticks(range(len(group_ticks)), group_ticks if r == nrows - 1 else [], fontsize=6)
                ax.set_yticks(range(len(group_ticks)), group_ticks if c == 0 else [], fontsize=6)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
                ax.tick_params(labelsize=6, labelbottom=r == nrows - 1, labelleft=c == 0)
                if h == 1:
                    ax.set_yticks([])
            if r == 0:
                t = source.timesteps[s] if s < len(source.timesteps) else None
                expert = f"\n{experts[s]}" if several else ""
                ax.set_title(f"step {s}" + ("" if t is None else f" (t={t:g})") + expert, fontsize=8)
            if c == 0:
                ax.set_ylabel(f"layer {layer}\n{kept[0]}", fontsize=8)
            if r == nrows - 1:
                ax.set_xlabel(kept[1], fontsize=8)
    add_colorbars(fig, images, list(axes.ravel()), kind, limits)
    head = heads_text(source, heads)
    set_title(fig, f"{kind}{'' if not index else ' ' + repr(index)} over layers × steps", head)
    return fig
