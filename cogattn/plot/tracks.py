"""Correspondence on the video (kind ``frame_max``, the numbers of :mod:`cogattn.analysis.tracks`): a video point's
track drawn on the decoded frames, and the motion field between two latent frames as arrows or as the colours
of a direction wheel.

Positions are drawn at patch centres: on the patch grid patch (row, col) is at ``(x, y) = (col, row)``; over a
video of ``H × W`` pixels at ``((col + 0.5)·W/Wp, (row + 0.5)·H/Hp)``, and a displacement of ``(dy, dx)``
patches is ``(dy·H/Hp, dx·W/Wp)`` pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import patheffects
from matplotlib.colors import Normalize, hsv_to_rgb
from matplotlib.figure import Figure

from ..analysis.layouts import for_layers
from ..analysis.tracks import motion_field, track
from ..items import item_label
from ..runs.run import MapSource
from .overlays import _video_panels
from .style import (
    POINT_GID,
    frame_label,
    frame_unit,
    heads_text,
    hide_ticks,
    new_figure,
    patch_ticks,
    set_title,
    span_text,
)
from .video import patch_pixels

__all__ = [
    "ARROW_GID",
    "MATCH_GID",
    "NO_MATCH_GID",
    "PATH_GID",
    "STILL_GID",
    "WHEEL_GID",
    "WHEEL_LEGEND_GID",
    "flow_colors",
    "motion_figure",
    "track_figure",
]

MATCH_GID = "track-match"  # each panel's matched point (a one-point scatter)
PATH_GID = "track-path"  # the whole track, dashed, in every panel
ARROW_GID = "motion-arrows"  # the quiver of motion_figure(style="arrows")
STILL_GID = "motion-still"  # dots at the patches whose match did not move
NO_MATCH_GID = "motion-no-match"  # crosses at the patches without a match in the other frame (NaN in the field)
WHEEL_GID = "motion-wheel"  # the colour image of motion_figure(style="wheel")
WHEEL_LEGEND_GID = "motion-wheel-legend"
MATCH_COLOR = "#ffd400"


def _detail(source: MapSource, step: int, layer: int, head, batch) -> str:
    """The second title line: the one map drawn (step, layer, head) and the batch item."""
    step_text = span_text("step", [step], source.timesteps)
    return f"{step_text} · layer {layer} · {heads_text(source, head)} · {item_label(source, batch)}"


def _to_axes(layout, pixels) -> tuple[float, float, float]:
    """``(pixels per patch row, per patch column, centre offset)``: patch (y, x) is drawn at
    ``((x + offset)·sx, (y + offset)·sy)``; on the patch grid (``pixels`` `None`) at ``(x, y)``."""
    if pixels is None:
        return 1.0, 1.0, 0.0
    return (*patch_pixels(layout, pixels.shape[1:3]), 0.5)


def _background(ax, layout, pixels, n: int) -> None:
    """Pixel frame ``n`` of the video, or an empty patch grid with a tick per patch and patch borders."""
    if pixels is None:
        ax.imshow(np.full((layout.height, layout.width), 0.9), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        patch_ticks(ax, layout)
        ax.set_xticks(np.arange(layout.width + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(layout.height + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
        return
    H, W = pixels.shape[1:3]
    ax.imshow(pixels[n], extent=(0, W, H, 0), interpolation="nearest")
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    hide_ticks(ax)


def track_figure(
    source: MapSource,
    point: tuple[int, int, int],
    video=None,
    *,
    step: int,
    layer: int,
    head: int | str = "mean",
    batch: int | str | None = None,
    frames: int | Sequence[int] | str | None = None,
    num_pixel_frames: int | None = None,
    fig: Figure | None = None,
) -> Figure:
    """A video point's track (:func:`cogattn.analysis.tracks.track`) on the decoded frames: in each panel the key its
    query attends most in that panel's latent frame, a yellow dot whose size and opacity grow with the
    key's probability (printed beside it), the whole track dashed, and the query point a cyan cross in
    its own frame.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``frame_max``.
        point (`tuple[int, int, int]`): the query, (latent frame, patch row, patch column).
        video (defaults to `None`): the decoded video (``pipe(...).frames[0]``, any output type), or `None`
            to draw on the patch grid.
        step (`int`), layer (`int`): the map's denoising step and layer.
        head (`int | "mean"`, defaults to ``"mean"``): a recorded head, or ``"mean"`` for a run recorded with
            ``heads="mean"`` (:func:`cogattn.analysis.tracks.frame_matches`).
        batch (`int | "cond" | "uncond"`, *optional*): the batch slot (:func:`cogattn.items.pick_item`).
        frames (`int | Sequence[int] | "all" | None`, defaults to `None`): pixel frames to show (latent frames
            without a video), each with the match of the latent frame covering it (once per copy of the grid, for a
            layer over two: Motif-Video's decoder); `None`: one panel per latent frame (its middle pixel frame).
        num_pixel_frames (`int | None`, defaults to `None`): without a video, the decoded video's frame count,
            to name the pixel frames of each latent frame.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: one panel per frame shown; each match has gid ``"track-match"``, the query ``"query-point"``.
    """
    t = track(source, point, step, layer, head, batch)  # refuses a bad point, head or map before drawing
    layout = for_layers(source, "frame_max", layer).layout  # a layer of another layout: its own
    pixels, panels, ranges = _video_panels(layout, video, frames, num_pixel_frames)
    sy, sx, off = _to_axes(layout, pixels)
    rows, cols = t.positions[:, 0].numpy(), t.positions[:, 1].numpy()
    conf = t.confidence.numpy().astype(float)
    top = conf.max() if conf.max() > 0 else 1.0
    found = rows >= 0
    X, Y = (cols + off) * sx, (rows + off) * sy

    ncols = min(len(panels), 6)
    nrows = -(-len(panels) // ncols)
    h, w = pixels.shape[1:3] if pixels is not None else (layout.height, layout.width)
    pw = min(2.4, 14 / ncols)
    fig = new_figure(fig, (max(pw * ncols + 0.6, 8.0), (pw * h / w + 0.45) * nrows + 1.1))  # room for the title
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    outline = [patheffects.withStroke(linewidth=2, foreground="black")]
    for ax, (n, f) in zip(axes, panels):
        _background(ax, layout, pixels, n)
        title = frame_label(f, ranges, " · ")
        ax.set_title(title if pixels is None else f"{title} (shows px {n})", fontsize=8)
        ax.plot(X[found], Y[found], linestyle="--", color=MATCH_COLOR, alpha=0.6, linewidth=1, gid=PATH_GID)
        if found[f]:
            rel = conf[f] / top
            ax.scatter(
                [X[f]], [Y[f]], s=25 + 125 * rel, alpha=0.3 + 0.7 * rel, color=MATCH_COLOR, edgecolors="black", zorder=3,
                gid=MATCH_GID,
            )  # fmt: skip
            label = ax.annotate(
                f"{conf[f]:.2g}", (X[f], Y[f]), xytext=(5, 5), textcoords="offset points", fontsize=7, color="white"
            )
            label.set_path_effects(outline)
        else:
            ax.text(0.5, 0.5, "no match", transform=ax.transAxes, ha="center", fontsize=8)
        if f == point[0]:
            qx, qy = (point[2] + off) * sx, (point[1] + off) * sy
            ax.plot([qx], [qy], marker="x", color="cyan", markersize=9, mew=2, zorder=4, gid=POINT_GID)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if pixels is None:
        axes[0].set_ylabel("patch row", fontsize=7)
        for ax in axes[: len(panels)]:
            ax.set_xlabel("patch column", fontsize=7)
    set_title(
        fig,
        f"track of video point (frame, row, col) = {tuple(point)}: its highest-attention key in each "
        f"{frame_unit(layout)}\n(dot size and opacity grow with that key's probability, printed beside it)",
        _detail(source, step, layer, head, batch),
    )
    return fig


def flow_colors(flow, max_magnitude: float | None = None) -> np.ndarray:
    """Displacements as colours of a direction wheel: hue is the direction as seen on screen, counter-clockwise
    from right (→ hue 0, red; ↑ 1/4, chartreuse; ← 1/2, cyan; ↓ 3/4, violet), value the magnitude over
    ``max_magnitude`` (no motion is black), saturation 1; a patch without a match (NaN) is grey.

    Args:
        flow: ``(..., 2)`` displacements ``(dy, dx)``, rows growing downwards (:func:`cogattn.analysis.tracks.motion_field`;
            NaN: no match).
        max_magnitude (`float | None`, defaults to `None`): the magnitude of full brightness; `None` takes the
            field's largest (all black when nothing moves).

    Returns:
        `np.ndarray`: ``(..., 3)`` RGB in [0, 1].
    """
    f = np.asarray(flow, dtype=np.float64)
    if f.shape[-1:] != (2,):
        raise ValueError(f"flow of shape {f.shape}; expected (..., 2) displacements (dy, dx).")
    if max_magnitude is not None and not (np.isfinite(max_magnitude) and max_magnitude > 0):
        raise ValueError(f"max_magnitude={max_magnitude!r}; pass a positive number, or None for the field's largest.")
    matched = ~np.isnan(f).any(-1)
    dy, dx = np.where(matched, f[..., 0], 0.0), np.where(matched, f[..., 1], 0.0)
    magnitude = np.hypot(dy, dx)
    top = float(magnitude.max(initial=0.0)) if max_magnitude is None else float(max_magnitude)
    hue = (np.arctan2(-dy, dx) / (2 * np.pi)) % 1.0  # −dy: rows grow downwards, so "up" is +90°
    value = np.clip(magnitude / top, 0.0, 1.0) if top > 0 else np.zeros_like(magnitude)
    rgb = hsv_to_rgb(np.stack([hue, np.ones_like(hue), value], -1))
    return np.where(matched[..., None], rgb, 0.5)


def _wheel_legend(ax, top: float) -> None:
    """A disc of :func:`flow_colors`: the colour of each direction, brightest at the rim (``top`` patches)."""
    yy, xx = np.mgrid[-1:1:101j, -1:1:101j]
    disc = np.concatenate([flow_colors(np.stack([yy, xx], -1), 1.0), (np.hypot(yy, xx) <= 1)[..., None]], -1)
    ax.imshow(disc, extent=(-1, 1, 1, -1), interpolation="bilinear", gid=WHEEL_LEGEND_GID)
    ax.set_xticks([-1, 0, 1], ["←", "0", "→"], fontsize=7)
    ax.set_yticks([-1, 0, 1], ["↑", "0", "↓"], fontsize=7)
    ax.set_title(f"direction\nrim: {top:.3g} patches", fontsize=7)


def motion_figure(
    source: MapSource,
    f0: int,
    f1: int,
    video=None,
    *,
    step: int,
    layer: int,
    head: int | str = "mean",
    batch: int | str | None = None,
    style: str = "arrows",
    num_pixel_frames: int | None = None,
    alpha: float = 0.7,
    fig: Figure | None = None,
) -> Figure:
    """The motion field from latent frame ``f0`` to ``f1`` (:func:`cogattn.analysis.tracks.motion_field`: each patch's
    displacement to the key of ``f1`` its query attends most) over frame ``f0``: as arrows, or as colours of a
    direction wheel (:func:`flow_colors`) with the wheel beside it.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``frame_max``.
        f0 (`int`), f1 (`int`): latent frames, the queries' and the keys'.
        video (defaults to `None`): the decoded video; the middle pixel frame of ``f0`` is drawn under the
            field, which is scaled from patches to pixels. `None`: on the patch grid.
        step, layer, head, batch: one map, as in :func:`track_figure`.
        style (`str`, defaults to ``"arrows"``): ``"arrows"`` (a quiver from each patch centre to its match,
            coloured by length; a dot where the match did not move) or ``"wheel"`` (hue the direction, value
            the length). Either way a grey cross marks a patch without a match in ``f1`` (a mask hides ``f1`` from
            it: SkyReels-V2's block-causal one), and "no match" is written where no patch has one.
        num_pixel_frames (`int | None`, defaults to `None`): without a video, the decoded video's frame count,
            to name the pixel frames of ``f0``.
        alpha (`float`, defaults to 0.7): opacity of the wheel's colours over the video.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the quiver has gid ``"motion-arrows"`` (its U, V in the axes' units: patches on the grid,
        pixels over a video; the matched patches in row order), the wheel's image ``"motion-wheel"``, the crosses
        ``"motion-no-match"``.
    """
    if style not in ("arrows", "wheel"):
        raise ValueError(f"style={style!r}; choose 'arrows' or 'wheel'.")
    flow = motion_field(source, f0, f1, step, layer, head, batch).numpy()  # (Hp, Wp, 2): refuses bad frames first
    layout = for_layers(source, "frame_max", layer).layout  # a layer of another layout: its own
    pixels, panels, ranges = _video_panels(layout, video, None, num_pixel_frames)
    n = next(n for n, f in panels if f == f0)
    sy, sx, off = _to_axes(layout, pixels)
    h, w = pixels.shape[1:3] if pixels is not None else (layout.height, layout.width)
    pw = 5.0
    fig = new_figure(fig, (pw + 1.8, pw * h / w + 1.3))
    if style == "wheel":  # the wheel's legend beside the panel
        ax, side = fig.subplots(1, 2, width_ratios=[pw, 1.2])
    else:
        ax = fig.subplots()
    _background(ax, layout, pixels, n)
    matched = ~np.isnan(flow).any(-1)  # NaN: frame f1 has no key with attention for that patch
    magnitude = np.hypot(flow[..., 0], flow[..., 1])
    top = float(magnitude[matched].max(initial=0.0))
    yy, xx = np.mgrid[: layout.height, : layout.width]
    X, Y = (xx + off) * sx, (yy + off) * sy
    if style == "arrows":  # arrows at the matched patches alone, in row order
        U, V = flow[..., 1] * sx, flow[..., 0] * sy
        q = ax.quiver(
            *(a[matched] for a in (X, Y, U, V, magnitude)), cmap="viridis", norm=Normalize(0, max(top, 1.0)),
            angles="xy", scale_units="xy", scale=1, width=0.006, gid=ARROW_GID,
        )  # fmt: skip
        still = matched & (magnitude == 0)
        ax.plot(X[still], Y[still], linestyle="none", marker=".", color="white", mec="black", gid=STILL_GID)
        bar = fig.colorbar(q, ax=ax, shrink=0.8)
        bar.set_label("displacement (patches)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    else:
        colours = flow_colors(flow)
        extent = (-0.5, layout.width - 0.5, layout.height - 0.5, -0.5) if pixels is None else (0, w, h, 0)
        ax.imshow(
            colours, extent=extent, interpolation="nearest", alpha=None if pixels is None else alpha, gid=WHEEL_GID
        )
        _wheel_legend(side, top)
    lost = ~matched
    ax.plot(X[lost], Y[lost], linestyle="none", marker="x", color="0.5", mew=1.5, zorder=4, gid=NO_MATCH_GID)
    if not matched.any():
        ax.text(0.5, 0.5, "no match", transform=ax.transAxes, ha="center", fontsize=8)
    unit = frame_unit(layout)
    title = frame_label(f0, ranges, " · ")
    ax.set_title(f"{title}{'' if pixels is None else f' (shows px {n})'} → f{f1}", fontsize=8)
    if pixels is None:
        ax.set_xlabel("patch column", fontsize=7)
        ax.set_ylabel("patch row", fontsize=7)
    how = "arrows" if style == "arrows" else "colours (hue: direction, brightness: length)"
    set_title(
        fig,
        f"motion from {unit} {f0} to {f1}, as {how}\neach patch to its highest-attention key in {unit} {f1}"
        + (" (×: no match)" if lost.any() else ""),
        _detail(source, step, layer, head, batch),
    )
    return fig
