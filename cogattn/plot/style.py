"""What every cogattn figure shares: colour scales for heavy-tailed attention, colour bars with units,
titles that say which steps, layers and heads a map averages, and the names of frames, patches and tokens."""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from ..analysis.maps import choose, skipped_pairs
from ..exact.reducers import REDUCERS
from ..items import item_label
from ..layout import TokenLayout
from ..runs.run import MapSource

__all__ = [
    "CMAP",
    "MAP_GID",
    "POINT_GID",
    "MapFigure",
    "add_colorbars",
    "color_norms",
    "describe",
    "frame_label",
    "frame_unit",
    "head_labels",
    "heads_text",
    "hide_ticks",
    "new_figure",
    "patch_ticks",
    "pixel_ranges",
    "set_title",
    "single_head",
    "span_text",
    "token_name",
    "warn_nonfinite",
]

MAP_GID = "attention"  # gid of every image that shows attention (tests and animate() find them by it)
POINT_GID = "query-point"
CMAP = "magma"


# -- colour scales ---------------------------------------------------------------------------------
def color_norms(arrays: list[np.ndarray], scale: str, limits) -> list[Normalize]:
    """One norm per array: shared limits over all of them, per-map limits, or fixed ``(vmin, vmax)``.

    A log scale starts at the smallest positive value, since attention is heavy-tailed: a few keys
    take most of the mass and a linear scale shows the rest as one colour. Limits are over finite values
    (:func:`warn_nonfinite` warns of others), a constant map's widened by 10% (matplotlib's rule), and
    shared limits are one norm object that every panel draws with.

    Args:
        arrays (`list[np.ndarray]`): the maps of a figure's panels.
        scale (`str`): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple[float, float]`): limits over all maps, per map, or fixed.
    """
    if scale not in ("linear", "log"):
        raise ValueError(f"scale={scale!r}; choose 'linear' or 'log'.")
    is_pair = isinstance(limits, (tuple, list)) and len(limits) == 2
    if not is_pair and limits not in ("shared", "per-map"):
        raise ValueError(f"limits={limits!r}; choose 'shared', 'per-map', or a (vmin, vmax) pair.")
    if is_pair:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in limits):
            raise TypeError(f"limits={limits!r}: (vmin, vmax) must be two finite numbers.")
        if limits[0] >= limits[1]:
            raise ValueError(f"limits={tuple(limits)!r}: vmin must be below vmax.")
        if scale == "log" and limits[0] <= 0:
            raise ValueError(f"limits={tuple(limits)!r}: a log scale needs a positive vmin, e.g. (1e-4, {limits[1]}).")

    def bounds(group: list[np.ndarray]) -> tuple[float, float]:
        if is_pair:
            return float(limits[0]), float(limits[1])
        values = np.concatenate([np.ravel(a) for a in group])
        values = values[np.isfinite(values)]  # a gap's panel is NaN; a damaged run's ±inf would take the scale
        if not values.size:
            return (1e-12, 1.0) if scale == "log" else (0.0, 1.0)
        if scale == "log":
            values = values[values > 0]
            if not values.size:
                return 1e-12, 1.0
        lo, hi = float(values.min()), float(values.max())
        if hi - lo <= 1e-15 * max(abs(lo), abs(hi)):  # constant: widen here (a colour bar widens its norm alone)
            lo, hi = lo - (0.1 * abs(lo) or 0.1), hi + (0.1 * abs(hi) or 0.1)
        return lo, hi

    if not is_pair:
        warn_nonfinite(arrays)
    cls = LogNorm if scale == "log" else Normalize
    if limits == "per-map":
        return [cls(*bounds([a])) for a in arrays]
    shared = cls(*bounds(arrays))  # one object: a change to one panel's norm is a change to all
    return [shared] * len(arrays)


def warn_nonfinite(arrays: list[np.ndarray], gaps: bool = True) -> bool:
    """Warn, once, when maps hold ±inf, or NaN beside finite values (a skipped map's panel is NaN throughout):
    a damaged run. Such cells are drawn in the colour map's "bad" colour and left out of the colour limits.

    Args:
        arrays (`list[np.ndarray]`): the maps of a figure's panels.
        gaps (`bool`, defaults to `True`): whether a map of NaN alone is a skipped map, not damage.

    Returns:
        `bool`: whether it warned.
    """
    for a in arrays:
        a = np.asarray(a, dtype=float)
        finite = np.isfinite(a)
        if np.isinf(a).any() or (not finite.all() and (finite.any() or not gaps)):
            warnings.warn(
                "the map holds non-finite values (NaN or ±inf): the run is damaged; those cells are drawn blank "
                "and left out of the colour limits.",
                RuntimeWarning,
                stacklevel=3,
            )
            return True
    return False


def add_colorbars(fig: Figure, images: list, axes: list, kind: str, limits) -> None:
    """One colour bar for shared limits, one per map otherwise; labelled with the map's unit.

    The bar is drawn from the norm and colour map alone: an overlay's transparency would wash it out.

    Args:
        fig (`Figure`): the figure.
        images (`list`): the images that show attention, one per panel.
        axes (`list`): the panels' axes, in the same order.
        kind (`str`): the kind drawn; its reducer's ``unit`` labels the bar.
        limits (`"shared" | "per-map" | tuple[float, float]`): as given to :func:`color_norms`.
    """
    if limits == "per-map":
        bars = [
            fig.colorbar(ScalarMappable(norm=im.norm, cmap=im.cmap), ax=ax, shrink=0.8) for im, ax in zip(images, axes)
        ]
    else:
        bars = [fig.colorbar(ScalarMappable(norm=images[0].norm, cmap=images[0].cmap), ax=axes, shrink=0.8)]
    for bar in bars:
        bar.set_label(REDUCERS[kind].unit, fontsize=7 if len(bars) > 1 else 8)
        bar.ax.tick_params(labelsize=6 if len(bars) > 1 else 7, which="both")
        if isinstance(bar.norm, LogNorm):  # plain numbers read better than 3×10⁻² on a small bar
            decades = np.log10(bar.norm.vmax / bar.norm.vmin)
            subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
            bar.ax.yaxis.set_major_locator(LogLocator(subs=subs, numticks=8) if decades >= 1 else MaxNLocator(5))
            bar.ax.yaxis.set_minor_locator(NullLocator())
            bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.2g}"))


# -- figures, titles and labels --------------------------------------------------------------------
class MapFigure(Figure):
    """A matplotlib ``Figure`` that shows itself as a PNG in any notebook: without pyplot, a bare Figure
    only prints its repr unless ``%matplotlib inline`` registered a display formatter."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def new_figure(fig: Figure | None, size: tuple[float, float]) -> Figure:
    """A new constrained-layout figure of ``size`` inches, or the caller's ``fig`` (no pyplot involved).

    Args:
        fig (`Figure | None`): the caller's (empty) figure, or `None` for a new :class:`MapFigure`.
        size (`tuple[float, float]`): width and height in inches of a new figure.
    """
    if fig is None:
        return MapFigure(figsize=size, layout="constrained")
    if fig.get_layout_engine() is None:
        fig.set_layout_engine("constrained")
    return fig


def span_text(name: str, values: list[int], timesteps: Sequence[float | None] | None = None) -> str:
    """``"step 2 (t=499)"`` for one value, ``"mean over layers 0–29"`` for several.

    Args:
        name (`str`): ``"step"`` or ``"layer"``.
        values (`list[int]`): the steps or layers.
        timesteps (`Sequence[float | None] | None`, defaults to `None`): the source's timesteps, to name a
            single step's timestep.
    """
    if len(values) == 1:
        v = values[0]
        t = timesteps[v] if name == "step" and timesteps is not None and v < len(timesteps) else None
        return f"{name} {v}" + ("" if t is None else f" (t={t:g})")
    if values == list(range(values[0], values[-1] + 1)):
        return f"mean over {name}s {values[0]}–{values[-1]}"
    return f"mean over {name}s {values}"


def describe(source: MapSource, kind: str, steps, layers, heads, batch=None) -> str:
    """The second title line: which steps, layers and heads a figure averages or shows, and which batch item
    where the recorded batch has several or is a guidance batch (:func:`cogattn.items.item_label`).

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        kind (`str`): the kind drawn.
        steps, layers (`"all" | int | Sequence[int]`): the selectors passed to the figure.
        heads (`"mean" | "all" | int | Sequence[int]`): the head selection passed to the figure.
        batch (`int | "cond" | "uncond" | None`, defaults to `None`): the figure's batch selection.
    """
    s = choose(source, kind, "step", steps)
    layer_list = choose(source, kind, "layer", layers)
    text = f"{span_text('step', s, source.timesteps)} · {span_text('layer', layer_list)} · {heads_text(source, heads)}"
    if gaps := skipped_pairs(source, kind, s, layer_list):
        text += f" · {len(gaps)} of {len(s) * len(layer_list)} skipped by {source.skipped.by or 'the model'}"
    roles = getattr(source, "batch_roles", None) or ()
    if batch is not None or len(roles) > 1 or any(roles):
        text += f" · {item_label(source, batch)}"
    return text


def _every_head(head_ids: tuple[int, ...]) -> bool:
    # ``heads="all"`` records heads 0..H-1 in order; a source does not say H, so 0..k-1 reads the same.
    return tuple(head_ids) == tuple(range(len(head_ids)))


def heads_text(source: MapSource, heads) -> str:
    """``"mean over heads"`` (naming the heads when a subset was recorded), ``"head 3"``, ``"heads all"``.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        heads (`"mean" | "all" | int | Sequence[int]`): the head selection of the figure.
    """
    held = source.head_ids
    if heads == "mean" or held is None:  # the mean of the recorded heads, which may be a subset
        return "mean over heads" + ("" if held is None or _every_head(held) else f" {', '.join(map(str, held))}")
    if isinstance(heads, int):
        return f"head {heads}"
    return "heads " + ("all" if heads == "all" else ", ".join(map(str, heads)))


def head_labels(source: MapSource, heads, n: int) -> list[str]:
    """Panel titles of ``n`` head panels for a ``heads`` selection.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        heads (`"mean" | "all" | int | Sequence[int]`): the head selection of the figure.
        n (`int`): number of panels.
    """
    held = source.head_ids
    if heads == "mean" or held is None:
        return [heads_text(source, "mean")] * n
    if heads == "all":
        return [f"head {h}" for h in held]
    return [f"head {h}" for h in ([heads] if isinstance(heads, int) else heads)]


def set_title(fig: Figure, what: str, detail: str) -> None:
    """The figure's two-line title: what it shows, then :func:`describe`'s line."""
    fig.suptitle(f"{what}\n{detail}", fontsize=9)


def patch_ticks(ax, layout: TokenLayout) -> None:
    """One tick per patch row and column on a map drawn on the patch grid."""
    ax.set_xticks(range(layout.width))
    ax.set_yticks(range(layout.height))
    ax.tick_params(labelsize=6)


def hide_ticks(ax) -> None:
    """No ticks: a map drawn over a video frame."""
    ax.set_xticks([])
    ax.set_yticks([])


# -- frames ----------------------------------------------------------------------------------------
def frame_unit(layout: TokenLayout) -> str:
    """What one frame of the layout is: ``"latent frame"``, or ``"temporal patch"`` for CogVideoX 1.5."""
    return "temporal patch" if layout.patch_size_t else "latent frame"


def pixel_ranges(layout: TokenLayout, num_pixel_frames: int | None) -> list[range] | None:
    """Pixel frames of each latent frame, or `None` when unknown.

    Args:
        layout (`TokenLayout`): the recorded layout.
        num_pixel_frames (`int | None`): frames of the decoded video; `None` takes
            ``layout.default_pixel_frames`` (known for CogVideoX 1.0 only).
    """
    n = layout.default_pixel_frames if num_pixel_frames is None else num_pixel_frames
    return None if n is None else layout.pixel_frames(n)


def _px_text(r: range) -> str:
    return f"px {r.start}" if len(r) == 1 else f"px {r.start}–{r.stop - 1}"


def frame_label(f: int, ranges: list[range] | None, sep: str = "\n") -> str:
    """``"f1\\npx 1–4"``: latent frame ``f`` and the pixel frames it covers, when ``ranges`` are known.

    Args:
        f (`int`): the latent frame.
        ranges (`list[range] | None`): :func:`pixel_ranges` of the layout.
        sep (`str`, defaults to a newline): between the two parts.
    """
    return f"f{f}" if ranges is None else f"f{f}{sep}{_px_text(ranges[f])}"


def token_name(layout: TokenLayout, token: int) -> str:
    """``"text 3"`` (the text's own index, as its strip counts), ``"history 4"`` (a video token off the grid) or
    ``"f1 (0, 2)"``: latent frame, then (patch row, patch column)."""
    point = layout.coordinates(token)
    if point is not None:
        return f"f{point[0]} {point[1:]}"
    if layout.text_start <= token < layout.text_start + layout.text_len:
        return f"text {token - layout.text_start}"
    return f"history {token - layout.video_start}"


def single_head(heads, what: str):
    """Refuse a head selection that keeps the head axis where a figure draws one map per panel.

    Args:
        heads: the head selection passed to the figure.
        what (`str`): the figure's name, for the message.

    Returns:
        ``heads``, when it is ``"mean"`` or one index.
    """
    if heads == "all" or not isinstance(heads, (int, str)):
        raise ValueError(f"{what} shows one head at a time; heads={heads!r}. Use 'mean' or one head index.")
    return heads
