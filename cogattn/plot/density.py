"""How dense attention is: the share of its keys a video query needs to reach each mass p (kind ``top_p``, the
head table's ``keys_p*`` columns), one curve per head, layer or step: a head low on the curve is one a sparse
kernel can serve with few keys."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..analysis.head_stats import expert_steps_of
from .heads import _items, _table_and_steps, draw_curves, title_curves
from .style import new_figure

__all__ = ["DENSITY_GID", "density_curves"]

DENSITY_GID = "density-curve"  # gid of every curve of density_curves (tests find them by it)


def density_curves(
    source_or_table,
    by: str = "head",
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    item: int | str | None = "cond",
    scale: str = "linear",
    fig: Figure | None = None,
) -> Figure:
    """The share of keys needed against the mass p: for each recorded p of ``top_p``, the mean over video
    queries of the fewest keys whose largest probabilities reach p, as a share of the keys (the head table's
    ``keys_p*`` columns, :func:`cogattn.analysis.head_stats.head_table`), one curve per head (averaged over layers),
    layer (over heads) or step (over both).

    Args:
        source_or_table: a `Recording` or `Run` that recorded ``top_p``, or a head table.
        by (`str`, defaults to ``"head"``): ``"head"``, ``"layer"`` or ``"step"``: one curve each.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): averaged (per head or layer: one
            expert's, e.g. ``"transformer_2"``: its steps).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged.
        item (`int | "cond" | "uncond" | None`, defaults to ``"cond"``): batch slot, or the first conditional /
            unconditional item; `None` averages the items.
        scale (`str`, defaults to ``"linear"``): the share axis, or ``"log"`` (sparse heads need a sliver).
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure; every curve has gid ``"density-curve"``, x the masses p, y the shares.

    Raises:
        ValueError: ``by`` or ``scale`` is invalid, or ``top_p`` was not recorded at the chosen steps and layers.
    """
    if by not in ("head", "layer", "step"):
        raise ValueError(f"by={by!r}; choose 'head', 'layer' or 'step'.")
    if scale not in ("linear", "log"):
        raise ValueError(f"scale={scale!r}; choose 'linear' or 'log'.")
    averaged = None if by == "step" else f"density_curves(by={by!r}, steps={steps!r})"
    table, source, step_list, experts = _table_and_steps(source_or_table, steps, layers, None, averaged)
    table, item = _items(table, item, source)
    columns = sorted((c for c in table.columns if c.startswith("keys_p")), key=lambda c: float(c[6:]))
    curves = table.groupby(by, sort=True)[columns].mean()
    if not columns or curves.isna().all().all():
        raise ValueError(
            "the table has no keys_p* numbers at the chosen steps and layers: record kind 'top_p' there, e.g. "
            "record(pipe, kinds=('top_p',), top_p=(0.5, 0.9, 0.99))."
        )
    ps = np.array([float(c[6:]) for c in columns])
    expert_of = {s: e for e, group in expert_steps_of(table).items() for s in group} if experts else {}
    fig = new_figure(fig, (6.4, 4.0))
    ax = fig.subplots()
    draw_curves(ax, ps, curves.index.tolist(), curves.to_numpy(dtype=float), by, expert_of, DENSITY_GID)
    ax.set_yscale(scale)
    if scale == "linear":
        ax.set_ylim(0, None)
    ax.set_xticks(ps, [f"{p:g}" for p in ps], fontsize=7)
    ax.set_xlabel("mass p reached (share of each row's attention)", fontsize=8)
    ax.set_ylabel("keys needed, share of the row's keys", fontsize=8)
    title_curves(fig, ax, "keys a video query needs to reach mass p", table, by, source, step_list, experts, item)
    return fig
