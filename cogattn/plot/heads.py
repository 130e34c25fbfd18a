"""Figures of what each head does, from :func:`cogattn.analysis.head_stats.head_table`: an atlas of layers × heads
coloured by each head's label or by any number of the table, and the decay of attention mass with
latent-frame distance. An average over steps keeps to one expert (Wan 2.2 A14B: ``steps="transformer"``
or ``"transformer_2"``); the title names it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..analysis.head_stats import TABLE_KINDS, LabelRule, expert_steps_of, head_table, label_row, temporal_decay
from ..analysis.maps import check_one_expert
from ..items import item_label, pick_item, table_source
from ..runs.run import MapSource
from .style import CMAP, MAP_GID, color_norms, frame_unit, new_figure, set_title, span_text

__all__ = ["CURVE_GID", "LABEL_COLORS", "decay_curves", "head_atlas"]

# One colour per label of cogattn.analysis.head_stats.LabelRule, in its order (colour-blind-safe Okabe–Ito hues).
LABEL_COLORS = {
    "text": "#0072B2",
    "spatial": "#E69F00",
    "temporal": "#009E73",
    "global": "#CC79A7",
    "unknown": "#BBBBBB",
}
# Colours of other labels (a pattern's name from cogattn.analysis.pattern_heads), given in sorted order of the labels shown.
EXTRA_LABEL_COLORS = ("#56B4E9", "#D55E00", "#F0E442", "#882255", "#44AA99")
CURVE_GID = "decay-curve"  # gid of every curve of decay_curves (tests find them by it)
_COLUMN_TEXT = {
    "text_mass": "mass on the text keys",
    "same_frame_mass": "mass on the query's own frame",
    "entropy_mean": "mean row entropy (nats)",
    "entropy_std": "std of row entropy over queries (nats)",
    "sink_share": "share of received mass on the top sink tokens",
}


# -- the table -------------------------------------------------------------------------------------
def _is_table(obj) -> bool:
    import pandas as pd

    return isinstance(obj, pd.DataFrame)


def _check_table(table, needs: Sequence[str]) -> None:
    missing = [c for c in needs if c not in table.columns]
    if missing:
        raise ValueError(
            f"the table has no column(s) {missing}; pass a source or a cogattn.analysis.head_stats.head_table (its columns are "
            f"step, layer, head, item, text_mass, same_frame_mass, dt_*, entropy_*, sink_*, label)."
        )


def _select(table, what: str, value) -> list:
    """Rows of ``table`` whose ``what`` is ``value``: ``"all"``, one value or a list (steps: or an expert's
    name); the values kept."""
    have = sorted(table[what].unique().tolist(), key=str)
    if isinstance(value, str) and value == "all":
        return have
    if what == "step" and isinstance(value, str):
        groups = expert_steps_of(table)
        if value not in groups:
            names = ", ".join(repr(e) for e in groups)
            raise ValueError(f"steps={value!r}; use 'last', 'mean', an expert of the table ({names}), or steps.")
        return groups[value]
    wanted = [int(value)] if isinstance(value, (int, np.integer)) else list(value)
    if not wanted:
        raise ValueError(f"{what}s is empty; the table holds {what}s {have}.")
    for v in wanted:
        if v not in have:
            raise ValueError(f"{what} {v!r} is not in the table; it holds {what}s {have}.")
    return wanted


def _last_step(source: MapSource) -> int:

    steps = [s for kind, s, _ in source.keys() if kind in TABLE_KINDS]
    if not steps:
        head_table(source, steps="all")  # raises the table's own error: which kinds to record
    return max(steps)


def _table_and_steps(source_or_table, steps, layers, rule, averaged: str | None):
    """``(table, source or None, steps kept, experts named)``: the head table of the chosen steps and
    layers; ``experts named`` is the kept steps' experts when the source has several, else empty.
    ``averaged`` (what the figure averages over the steps, for the message) refuses steps of two experts."""

    if _is_table(source_or_table):
        table, source = source_or_table, None
        _check_table(table, ("step", "layer", "head", "item"))
        several = len(expert_steps_of(table)) > 1
        table = table[table["layer"].isin(_select(table, "layer", layers))]
        if isinstance(steps, str) and steps == "last":
            steps = int(table["step"].max())
        step_list = _select(table, "step", "all" if steps == "mean" else steps)
        table = table[table["step"].isin(step_list)]
    else:
        source = source_or_table
        if isinstance(steps, str) and steps == "last":
            steps = _last_step(source)
        table = head_table(source, steps="all" if steps == "mean" else steps, layers=layers, rule=rule)
        step_list = sorted(table["step"].unique().tolist())
        several = len(set(getattr(source, "experts", None) or ())) > 1
    groups = expert_steps_of(table)
    if averaged is not None and len(step_list) > 1:
        check_one_expert(groups, averaged)
    return table, source, step_list, list(groups) if several else []


def _items(table, item, source):
    """The rows of batch slot ``item`` (``"cond"``: the first conditional item, else slot 0; ``"uncond"``: the
    first unconditional one), every row for `None`; and the slot chosen."""
    if item is None:
        return table, None
    have = sorted(table["item"].unique().tolist())
    if isinstance(item, str) and source is None and item == "cond":  # a table alone: what head_table kept
        roles = table.attrs.get("batch_roles") or []
        item = next((i for i in have if i >= len(roles) or roles[i] != "uncond"), have[0])
    elif isinstance(item, str):
        item = pick_item(source if source is not None else table_source(table.attrs), None if item == "cond" else item)
    if item not in have:
        raise ValueError(f"item={item!r} is not in the table; it holds the batch slots {have}.")
    return table[table["item"] == item], item


def _detail(source, step_list: list[int], experts: list[str], layers: list[int] | None, item, each=False, attrs=None):
    steps = span_text("step", step_list, source.timesteps if source is not None else None)
    parts = [steps.removeprefix("mean over ") if each else steps]  # each: one curve per step, none averaged
    if experts:
        parts.append(" and ".join(experts))
    if layers is not None:
        parts.append(span_text("layer", layers))
    parts.append(
        "mean over batch items"
        if item is None
        else item_label(source if source is not None else table_source(attrs or {}), item)
    )
    return " · ".join(parts)


# -- atlas -----------------------------------------------------------------------------------------
def head_atlas(
    source_or_table,
    color: str = "label",
    *,
    steps: str | int | Sequence[int] = "last",
    layers: str | int | Sequence[int] = "all",
    item: int | str | None = "cond",
    rule=None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    annotate: bool | None = None,
    fig: Figure | None = None,
) -> Figure:
    """A layers × heads grid of cells, one per head, coloured by its label or by a number of the head
    table: what every head of the model does at a glance.

    With ``color="label"`` each cell has its label's colour (``LABEL_COLORS``; other labels, such as the pattern
    names of :func:`cogattn.analysis.pattern_heads.pattern_table`, ``EXTRA_LABEL_COLORS``; legend below); with a
    numeric column (``"text_mass"``, ``"same_frame_mass"``, ``"dt_1"``, ``"entropy_mean"``,
    ``"sink_share"``, ...) a colour scale and bar. Over several steps the numbers are averaged, and a
    label is the rule's label of the averaged numbers. ``plot.animate(plot.head_atlas, rec, "atlas.gif")``
    shows the heads change over the steps (``values=`` picks steps where ``frame`` was not recorded).

    Args:
        source_or_table: a `Recording` or `Run` (its head table is made with
            :func:`cogattn.analysis.head_stats.head_table`), or a head table.
        color (`str`, defaults to ``"label"``): ``"label"`` or a numeric column of the head table.
        steps (`"last" | "mean" | int | Sequence[int] | str`, defaults to ``"last"``): one step (the last
            recorded by default), or the mean over every step (``"mean"``), over a list, or over one
            expert's steps (its name, e.g. ``"transformer_2"``); steps of two experts are refused.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): the rows.
        item (`int | "cond" | "uncond" | None`, defaults to ``"cond"``): batch slot, or the first conditional /
            unconditional item (the first conditional item, else slot 0, where the source does not say);
            `None` averages the items.
        rule (defaults to `None`): the labelling rule (:class:`cogattn.analysis.head_stats.LabelRule`), for a source and
            for labels of averaged numbers; `None` is the table's own (``attrs["label_rule"]``: a
            :func:`cogattn.analysis.pattern_heads.pattern_table`'s ``ErrorLabelRule``), else ``LabelRule()``.
        scale (`str`, defaults to ``"linear"``): colour scale of a numeric column, or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits of a numeric
            column (``animate`` passes the range over all its frames).
        annotate (`bool | None`, defaults to `None`): write each value (a label's first letters) in its cell;
            `None`: when the grid has at most 16 × 16 cells.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    table, source, step_list, experts = _table_and_steps(
        source_or_table, steps, layers, rule, f"head_atlas(steps={steps!r})"
    )
    table, item = _items(table, item, source)
    numeric = color != "label"
    if numeric:
        _check_table(table, (color,))
        if table[color].dtype.kind not in "fiu":
            raise ValueError(f"color={color!r} is not a numeric column; use 'label' or one of {_numeric(table)}.")
        known = "same_frame_mass" in table.columns and table["same_frame_mass"].notna().any()
        if color == "text_mass" and known and table[color].isna().all():
            raise ValueError(
                "column 'text_mass' is NaN for every head: this model's self-attention has no text keys (Wan; its "
                "text is in a separate cross-attention, kind 'video_to_text'). Colour by 'same_frame_mass' or 'dt_1'."
            )
        if table[color].isna().all():
            raise ValueError(
                f"column {color!r} is NaN for every head: its kind was not recorded (entropy_* needs 'entropy', "
                "sink_share 'received', the mass columns 'frame' or 'query_frame')."
            )
    layer_list = sorted(table["layer"].unique().tolist())
    head_list = sorted(table["head"].unique().tolist(), key=lambda h: (isinstance(h, str), h))
    # one row per (layer, head): the mean of its numbers over the steps (and items) kept
    numbers = _numeric(table)
    mean = table.groupby(["layer", "head"], sort=False)[numbers].mean()
    grid = np.full((len(layer_list), len(head_list)), np.nan)
    labels = np.full(grid.shape, "", dtype=object)
    relabel = len(step_list) > 1 or item is None
    if not numeric and relabel:
        rule = table.attrs.get("label_rule", LabelRule()) if rule is None else rule  # a pattern table's own rule
    for (layer, head), row in mean.iterrows():
        r, c = layer_list.index(layer), head_list.index(head)
        if numeric:
            grid[r, c] = row[color]
        elif relabel:
            labels[r, c] = label_row(rule, row.to_dict())
        else:
            labels[r, c] = table[(table["layer"] == layer) & (table["head"] == head)]["label"].iloc[0]
    nrows, ncols = grid.shape
    fig = new_figure(fig, (min(16.0, max(3.6, 0.32 * ncols + 2.4)), min(16.0, max(2.8, 0.32 * nrows + 1.8))))
    ax = fig.subplots()
    if numeric:
        norm = color_norms([grid[~np.isnan(grid)]], scale, limits)[0]
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=CMAP, norm=norm, interpolation="nearest", gid=MAP_GID)
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=CMAP), ax=ax, shrink=0.8)
        bar.set_label(_COLUMN_TEXT.get(color, _dt_text(color)), fontsize=8)
        bar.ax.tick_params(labelsize=7)
    else:
        extra = sorted(set(labels.ravel()) - set(LABEL_COLORS) - {""})
        if len(extra) > len(EXTRA_LABEL_COLORS):
            raise ValueError(
                f"labels {extra} have no colour: beyond {list(LABEL_COLORS)} the atlas colours "
                f"{len(EXTRA_LABEL_COLORS)} labels; choose fewer patterns, or colour by a numeric column."
            )
        colors = {**LABEL_COLORS, **dict(zip(extra, EXTRA_LABEL_COLORS))}
        names = list(colors)
        codes = np.array([[names.index(v) if v else np.nan for v in row] for row in labels], dtype=float)
        cmap = ListedColormap([colors[n] for n in names])
        norm = Normalize(-0.5, len(names) - 0.5)  # code k is the centre of colour k
        im = ax.imshow(np.ma.masked_invalid(codes), cmap=cmap, norm=norm, interpolation="nearest", gid=MAP_GID)
        shown = [n for n in names if n in set(labels.ravel())]
        fig.legend(
            handles=[Patch(facecolor=colors[n], label=n) for n in shown],
            loc="outside lower center",
            ncol=len(shown),
            fontsize=7,
            frameon=False,
        )
    annotate = nrows <= 16 and ncols <= 16 if annotate is None else annotate
    if annotate:
        for r in range(nrows):
            for c in range(ncols):
                text = (f"{grid[r, c]:.2f}" if not np.isnan(grid[r, c]) else "") if numeric else labels[r, c][:4]
                light = numeric and not np.isnan(grid[r, c]) and im.norm(grid[r, c]) < 0.5
                ax.text(c, r, text, ha="center", va="center", fontsize=6, color="w" if light else "k")
    ax.set_xticks(range(ncols), [str(h) for h in head_list], fontsize=7, rotation=90 if ncols > 24 else 0)
    ax.set_yticks(range(nrows), [str(v) for v in layer_list], fontsize=7)
    ax.set_xlabel("head", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    what = "head atlas: " + ("label of each head" if not numeric else _COLUMN_TEXT.get(color, _dt_text(color)))
    set_title(fig, what, _detail(source, step_list, experts, None, item, attrs=table.attrs))
    return fig


def _numeric(table) -> list[str]:
    skip = {"step", "timestep", "layer", "head", "item"}
    return [c for c in table.columns if c not in skip and table[c].dtype.kind in "fiu"]


def _dt_text(column: str) -> str:
    if column.startswith("dt_"):
        return f"mass at frame distance |Δf| = {column[3:]}"
    if column.startswith(("error_", "recall_")):  # a pattern table's columns
        name = column.split("_", 1)[1]
        return (
            f"output error of pattern {name!r} (mean squared)" if column[0] == "e" else f"mass pattern {name!r} keeps"
        )
    return column


# -- decay with frame distance ---------------------------------------------------------------------
def decay_curves(
    source_or_table,
    by: str = "head",
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    item: int | str | None = "cond",
    per_frame: bool = False,
    scale: str = "linear",
    fig: Figure | None = None,
) -> Figure:
    """Attention mass against latent-frame distance |Δf|: one curve per head (averaged over layers) or
    per layer (averaged over heads), from :func:`cogattn.analysis.head_stats.temporal_decay`.

    The value at d is the mean mass a video query puts on the keys of all frames at distance d from its
    own (``dt_d`` of the head table; d = 0 is its own frame). There are fewer frames at larger d (one
    pair of frames at d = F − 1), so even uniform attention falls off; ``per_frame=True`` divides by the
    mean number of key frames at distance d, under which uniform attention over the video is flat.

    Args:
        source_or_table: a `Recording` or `Run`, or a head table (:func:`cogattn.analysis.head_stats.head_table`).
        by (`str`, defaults to ``"head"``): ``"head"``, ``"layer"`` or ``"step"``: one curve each.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): averaged (per head or layer:
            one expert's, e.g. ``"transformer_2"``: its steps).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged.
        item (`int | "cond" | "uncond" | None`, defaults to ``"cond"``): batch slot, or the first conditional /
            unconditional item (the first conditional item, else slot 0, where the source does not say);
            `None` averages the items.
        per_frame (`bool`, defaults to `False`): mass per key frame at each distance.
        scale (`str`, defaults to ``"linear"``): the mass axis, or ``"log"``.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """

    if by not in ("head", "layer", "step"):
        raise ValueError(f"by={by!r}; choose 'head', 'layer' or 'step'.")
    if scale not in ("linear", "log"):
        raise ValueError(f"scale={scale!r}; choose 'linear' or 'log'.")
    averaged = None if by == "step" else f"decay_curves(by={by!r}, steps={steps!r})"
    table, source, step_list, experts = _table_and_steps(source_or_table, steps, layers, None, averaged)
    table, item = _items(table, item, source)
    curves = temporal_decay(table, by=by)  # index: by; columns dt_0 .. dt_{F-1}
    expert_of = {s: e for e, group in expert_steps_of(table).items() for s in group} if experts else {}
    F = curves.shape[1]
    if curves.isna().all().all():
        raise ValueError("the dt_* columns are NaN: record kind 'frame' or 'query_frame' for frame distances.")
    d = np.arange(F)
    values = curves.to_numpy(dtype=float)
    if per_frame:
        values = values / _frames_at_distance(F)
    fig = new_figure(fig, (6.4, 4.0))
    ax = fig.subplots()
    draw_curves(ax, d, curves.index.tolist(), values, by, expert_of, CURVE_GID)
    ax.set_yscale(scale)
    ax.set_xticks(d)
    unit = frame_unit(source.layout) if source is not None and source.layout is not None else "latent frame"
    ax.set_xlabel(f"{unit} distance |Δf| between query and key", fontsize=8)
    ax.set_ylabel("mass per key frame" if per_frame else "attention mass", fontsize=8)
    title_curves(fig, ax, f"attention mass against {unit} distance", table, by, source, step_list, experts, item)
    return fig


def title_curves(fig, ax, what: str, table, by: str, source, step_list, experts, item) -> None:
    """A grid on ``ax`` and the title of a figure of curves per ``by``: what they show, what each averages,
    and the steps, layers and batch item behind them."""
    ax.grid(alpha=0.3)
    layer_list = sorted(table["layer"].unique().tolist())
    averaged = {"head": "mean over layers", "layer": "mean over heads", "step": "mean over layers and heads"}[by]
    set_title(
        fig,
        f"{what}, one curve per {by} ({averaged})",
        _detail(source, step_list, experts, layer_list if by != "layer" else None, item, by == "step", table.attrs),
    )


def draw_curves(ax, x, keys: list, values, by: str, expert_of: dict, gid: str) -> None:
    """One line of ``values[k]`` against ``x`` per key (a head, layer or step, named by ``by``; a step's expert
    from ``expert_of``), coloured along viridis: a legend for up to 12 lines, else a colour bar over the keys."""
    numbers = [k for k in keys if not isinstance(k, str)]
    legend = len(keys) <= 12 or not numbers
    cmap = ListedColormap(colormaps["viridis"](np.linspace(0, 0.9, max(2, len(keys)) if legend else 256)))
    norm = None if legend else Normalize(min(numbers), max(numbers))
    for k, (key, row) in enumerate(zip(keys, values)):
        name = f"{by} {key}" if key != "mean" else "mean over heads"
        name += f" · {expert_of[key]}" if by == "step" and key in expert_of else ""
        # under a colour bar a curve takes the bar's colour at its key (keys need not be evenly spaced);
        # "mean" has no place on the bar: black
        color = cmap(k) if legend else "black" if isinstance(key, str) else cmap(norm(key))
        ax.plot(x, row, marker="o", markersize=3, color=color, label=name, gid=gid)
    if legend:
        ax.legend(fontsize=7, ncol=2 if len(keys) > 6 else 1)
    else:
        ax.figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8).set_label(by, fontsize=8)


def _frames_at_distance(F: int) -> np.ndarray:
    """Mean over query frames of the number of key frames at distance d: 1 at d = 0, 2(F − d)/F after."""
    f = np.arange(F)
    distance = np.abs(f[:, None] - f[None, :])
    return np.array([(distance == d).sum() / F for d in range(F)], dtype=float)
