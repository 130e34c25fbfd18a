"""Attention by relative position (kind ``offset``): the offset map as one (Δy × Δx) panel per latent-frame
offset Δt, and the decay of the mass with temporal and spatial distance beside Radial Attention's exponential
fit (the numbers of :mod:`cogattn.analysis.decay`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..analysis.decay import decay_table, mean_decay
from ..analysis.layouts import for_layers
from ..analysis.maps import aggregate
from ..items import item_label, pick_item, table_source
from ..runs.run import MapSource
from .style import CMAP, MAP_GID, add_colorbars, color_norms, describe, frame_unit, new_figure, set_title, single_head

__all__ = ["FIT_GID", "distance_decay", "offset_map"]

FIT_GID = "decay-fit"  # gid of every fitted line of distance_decay
POINTS_GID = "decay-points"  # gid of every measured curve of distance_decay


def offset_map(
    source: MapSource,
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    scale: str = "log",
    limits: str | tuple[float, float] = "shared",
    fig: Figure | None = None,
) -> Figure:
    """The ``offset`` map: one panel per latent-frame offset Δt = f_key − f_query, each the mass on keys at
    (Δy, Δx) patches from the query, averaged over video queries (and the chosen steps and layers).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``offset``.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): steps, averaged (one expert's).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers, averaged.
        heads (`"mean" | int`, defaults to ``"mean"``): the head mean, or one head.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis (the first conditional
            item by default, :func:`cogattn.items.pick_item`).
        scale (`str`, defaults to ``"log"``): ``"log"`` (the mass falls by decades away from the query) or
            ``"linear"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits over every panel,
            per panel, or fixed ``(vmin, vmax)``.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure; each panel's image is the ``(2Hp − 1, 2Wp − 1)`` slice of its Δt.
    """
    single_head(heads, "offset_map")
    source = for_layers(source, "offset", layers)  # layers of another layout: theirs
    layout = source.layout
    F, Hp, Wp = layout.grid
    m = aggregate(source, "offset", steps=steps, layers=layers, heads=heads, batch=batch).numpy()
    arrays = [m[i] for i in range(2 * F - 1)]
    ncols = min(len(arrays), 5)
    nrows = math.ceil(len(arrays) / ncols)
    side = max(2.2, min(3.2, 0.05 * (2 * Wp - 1) + 1.4))
    fig = new_figure(fig, (side * ncols + 1.2, side * (2 * Hp - 1) / (2 * Wp - 1) * nrows + 1.2))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    norms = color_norms(arrays, scale, limits)
    extent = (-(Wp - 1) - 0.5, Wp - 1 + 0.5, Hp - 1 + 0.5, -(Hp - 1) - 0.5)  # axes in patches, 0 at the query
    unit = frame_unit(layout)
    images = []
    for i, ax in enumerate(axes):
        if i >= len(arrays):
            ax.set_visible(False)
            continue
        im = ax.imshow(arrays[i], cmap=CMAP, norm=norms[i], interpolation="nearest", extent=extent, gid=MAP_GID)
        images.append(im)
        units = unit + ("es" if unit.endswith("ch") else "s")  # latent frames, temporal patches
        ax.set_title(f"Δt = {i - (F - 1):+d} {units}" if i != F - 1 else f"Δt = 0 (same {unit})", fontsize=8)
        ax.set_xlabel("Δx (patch columns)", fontsize=7)
        ax.set_ylabel("Δy (patch rows)", fontsize=7)
        ax.tick_params(labelsize=6)
    add_colorbars(fig, images, list(axes[: len(arrays)]), "offset", limits)
    set_title(
        fig,
        "attention by offset from the query (key − query), one panel per latent-frame offset",
        describe(source, "offset", steps, layers, heads, batch),
    )
    return fig


def distance_decay(
    source_or_table,
    by: str = "head",
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    batch: int | str | None = None,
    per_key: bool = False,
    fig: Figure | None = None,
) -> Figure:
    """Attention against temporal distance |Δt| (latent frames) and spatial distance (patches, rounded
    Euclidean), one curve per head, layer or step (:func:`cogattn.analysis.decay.mean_decay`), each with its fitted
    ``a·exp(−λ d)`` dashed and λ, R² in the legend; the mass axis is logarithmic, where the fit is a line.

    Args:
        source_or_table: a `Recording` or `Run` that recorded ``offset``, or a :func:`cogattn.analysis.decay.decay_table`.
        by (`str`, defaults to ``"head"``): ``"head"``, ``"layer"`` or ``"step"``: one curve each, averaged over
            the rest (per head or layer: one expert's steps).
        steps, layers: with a source, the steps and layers of its table (:func:`cogattn.analysis.decay.decay_table`).
        batch (`int | "cond" | "uncond"`, *optional*): the batch slot drawn (the table's ``item``): by default
            the first conditional item (:func:`cogattn.items.pick_item`, from the table's ``batch_roles``).
        per_key (`bool`, defaults to `False`): with a source, the mean probability of one key at each distance.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: two panels, temporal then spatial; every measured curve has gid ``"decay-points"``, every
        fit ``"decay-fit"``.
    """
    if isinstance(source_or_table, pd.DataFrame):
        table = source_or_table
    else:
        table = decay_table(source_or_table, steps, layers, per_key=per_key)
    item = pick_item(table_source(table.attrs), batch)
    if "item" not in table.columns or item not in set(table["item"]):
        raise ValueError(f"batch={batch!r} is slot {item}; the table holds items {sorted(set(table.get('item', [])))}.")
    per_key = bool(table.attrs.get("per_key", per_key))
    curves = mean_decay(table[table["item"] == item], by=by)
    fig = new_figure(fig, (9.6, 4.0))
    axes = fig.subplots(1, 2)
    colours = ListedColormap(colormaps["viridis"](np.linspace(0, 0.9, max(2, len(curves)))))
    frames = table.attrs.get("frame_unit", "latent frame")
    frames += "es" if frames.endswith("ch") else "s"
    for ax, prefix, name, unit in (
        (axes[0], "t", "dt", f"temporal distance |Δt| ({frames})"),
        (axes[1], "s", "ds", "spatial distance (patches, Euclidean, rounded)"),
    ):
        columns = [c for c in curves.columns if c.startswith(f"{name}_")]
        d = np.array([int(c.split("_")[1]) for c in columns])
        for k, (key, row) in enumerate(curves.iterrows()):
            values = row[columns].to_numpy(dtype=float)
            scale, rate = row[f"{prefix}_scale"], row[f"{prefix}_rate"]
            label = f"{by} {key} (λ = {rate:.3g}, R² = {row[f'{prefix}_r2']:.2f})"
            shown = np.where(values > 0, values, np.nan)  # a log axis has no 0
            ax.plot(d, shown, marker="o", markersize=3, color=colours(k), label=label, gid=POINTS_GID)
            if np.isfinite(rate):
                ax.plot(d, scale * np.exp(-rate * d), linestyle="--", color=colours(k), gid=FIT_GID)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(unit, fontsize=8)
        ax.set_ylabel("probability per key" if per_key else "attention mass (mean over video queries)", fontsize=8)
        ax.grid(alpha=0.3)
        if len(curves) <= 8:
            ax.legend(fontsize=6)
    averaged = {
        "head": "mean over steps and layers",
        "layer": "mean over steps and heads",
        "step": "mean over layers and heads",
    }
    set_title(
        fig,
        f"attention against distance, fit a·exp(−λ d) dashed, one curve per {by} ({averaged[by]})",
        f"steps {sorted(set(table['step']))} · layers {sorted(set(table['layer']))} · "
        + item_label(table_source(table.attrs), item),
    )
    return fig
