"""Animations of a plot over steps, layers or frames (GIF with pillow, MP4 with ffmpeg), and sliders
over step, layer, head and frame in a notebook."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..analysis.head_stats import TABLE_KINDS
from ..analysis.maps import recorded, recorded_kinds
from ..runs.run import MapSource
from ..runs.skips import Skipped
from .frames import frame_heatmap
from .heads import head_atlas
from .overlays import query_map, word_heatmap
from .stats import block_map, token_stat
from .style import MAP_GID
from .video import video_array, write_animation

__all__ = ["animate", "explore"]


# -- animations ------------------------------------------------------------------------------------
_PLOT_KIND = {  # the kind each draws (its steps and layers are the ones animate goes over)
    frame_heatmap: "frame",
    word_heatmap: "video_to_text",
    query_map: "query",
    head_atlas: "frame",
    token_stat: "entropy",
    block_map: "block",
}


def _plot_kind(plot: Callable, source: MapSource) -> str:
    """The kind whose steps and layers an animation of ``plot`` goes over (the head atlas: the first of the
    head table's kinds recorded)."""
    if plot is head_atlas:
        held = recorded_kinds(source)
        return next((k for k in TABLE_KINDS if k in held), "frame")
    return _PLOT_KIND[plot]


def _render(fig: Figure) -> np.ndarray:
    """The figure drawn to an RGB ``uint8`` array ``(H, W, 3)`` at its own dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # a canvas of its own: no global backend is touched
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def animate(
    plot: Callable[..., Figure],
    source: MapSource,
    path: str | os.PathLike,
    *,
    over: str = "step",
    values: Sequence[int] | None = None,
    fps: float = 2.0,
    dpi: int = 80,
    **kwargs,
) -> Path:
    """Redraw a plot for each step, layer or frame and write the frames as a GIF (pillow) or MP4 (ffmpeg).

    With the default ``limits="shared"``, colour limits are shared by all frames of the animation, so
    a colour means the same value throughout.

    Args:
        plot (`Callable`): :func:`frame_heatmap`, :func:`word_heatmap` or :func:`query_map`.
        source (`MapSource`): a `Recording` or a `Run`.
        path (`str | os.PathLike`): ``.gif`` or ``.mp4``.
        over (`str`, defaults to ``"step"``): ``"step"``, ``"layer"``, or ``"frame"`` (pixel frames of
            ``video``, for :func:`word_heatmap`).
        values (`Sequence[int] | None`, defaults to `None`): the steps/layers/frames, in order; `None`: all
            recorded (all frames of the video).
        fps (`float`, defaults to 2.0): frames per second; a GIF's is rounded to whole centiseconds a
            frame (fps=8 plays at 8.33; :func:`cogattn.plot.video.write_animation`).
        dpi (`int`, defaults to 80): resolution of the rendered frames.
        **kwargs: passed to ``plot`` (e.g. ``tokens=``, ``video=``, ``tokenizer=``, ``heads=``); a ``kind=``
            (``word_heatmap``'s ``"text_to_video"`` or ``"video_to_image"``, ``token_stat``'s
            ``"received"``) is also the kind whose steps and layers are gone over.

    Returns:
        `Path`: the file written.
    """
    if plot not in _PLOT_KIND:
        raise ValueError(f"animate draws {[p.__name__ for p in _PLOT_KIND]}; got {plot!r}.")
    if over not in ("step", "layer", "frame"):
        raise ValueError(f"over={over!r}; choose 'step', 'layer' or 'frame'.")
    kind = kwargs.get("kind", _plot_kind(plot, source))
    if over == "frame":
        if plot is not word_heatmap:
            raise ValueError("over='frame' animates word_heatmap over the frames of the video.")
        if values is None:
            video = kwargs.get("video")
            values = range(len(video_array(video))) if video is not None else range(source.layout.frames)
    elif values is None:
        if plot is query_map and kind == "query" and "query" not in recorded_kinds(source):
            kind = "full"
        values = recorded(source, kind, over)
    key = {"step": "steps", "layer": "layers", "frame": "frames"}[over]
    limits = kwargs.pop("limits", "shared")

    def draw(v, limits) -> Figure | Skipped:
        try:
            return plot(source, **{**kwargs, key: [v] if over == "frame" else v, "limits": limits})
        except Skipped as gap:  # a cache skipped every map of this frame: a frame that says so
            return gap

    if limits == "shared":  # a first pass finds the range over all frames: a colour means one value throughout
        figures = [fig for fig in (draw(v, "shared") for v in values) if isinstance(fig, Figure)]
        clims = [im.get_clim() for fig in figures for ax in fig.axes for im in ax.images if im.get_gid() == MAP_GID]
        if not clims:
            raise Skipped(f"a cache skipped every frame of the animation ({over}s {list(values)}).")
        limits = (min(lo for lo, _ in clims), max(hi for _, hi in clims))
    drawn = [draw(v, limits) for v in values]
    size = next((fig.get_size_inches() for fig in drawn if isinstance(fig, Figure)), (6.0, 4.0))
    frames = []
    for v, fig in zip(values, drawn):
        if isinstance(fig, Skipped):
            fig, text = Figure(figsize=size), f"{over} {v}: skipped\n{fig}"
            fig.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9)
        fig.set_dpi(dpi)
        frames.append(_render(fig))
    return write_animation(frames, path, fps)


# -- interactive -----------------------------------------------------------------------------------
def explore(source: MapSource, video=None, *, view: str = "word", static: bool | None = None, **kwargs):
    """Sliders over step, layer, head (and frame, for word maps) when ipywidgets is installed; a static
    figure otherwise.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        video (defaults to `None`): the decoded video (word and query views draw on it).
        view (`str`, defaults to ``"word"``): ``"frame"`` (:func:`frame_heatmap`), ``"word"``
            (:func:`word_heatmap`, pass ``tokens=``) or ``"query"`` (:func:`query_map`).
        static (`bool | None`, defaults to `None`): force the static figure (`True`) or the widgets
            (`False`); `None`: widgets when ipywidgets imports.
        **kwargs: passed to the plot function.

    Returns:
        `ipywidgets.interactive | Figure`: the widget, or the figure of the last step (mean over
        layers and heads) when static.
    """
    plots = {"frame": frame_heatmap, "word": word_heatmap, "query": query_map}
    if view not in plots:
        raise ValueError(f"view={view!r}; choose one of {list(plots)}.")
    plot = plots[view]
    if view != "frame":
        kwargs["video"] = video
    kind = kwargs.get("kind", _plot_kind(plot, source))
    if view == "query" and "query" not in recorded_kinds(source):
        kind = "full"
    steps, layers = recorded(source, kind, "step"), recorded(source, kind, "layer")
    if static is None:
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            static = True
    if static:
        return plot(source, **{"steps": steps[-1], **kwargs})
    import ipywidgets as widgets

    head_options = ["mean", *(source.head_ids or ())]
    controls = {
        "step": widgets.SelectionSlider(options=steps, value=steps[-1], description="step"),
        "layer": widgets.SelectionSlider(options=["mean", *layers], value="mean", description="layer"),
        "head": widgets.SelectionSlider(options=head_options, value="mean", description="head"),
    }
    if view == "word":
        n = len(video_array(video)) if video is not None else source.layout.frames
        controls["frame"] = widgets.IntSlider(min=0, max=n - 1, value=n // 2, description="frame")

    def show(step, layer, head, frame=None):
        extra = {} if frame is None else {"frames": [frame]}
        return plot(
            source, **{**kwargs, "steps": step, "layers": "all" if layer == "mean" else layer, "heads": head, **extra}
        )

    return widgets.interactive(show, **controls)
