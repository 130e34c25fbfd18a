"""Audio ↔ video figures (LTX-2): the cross-modal maps ``frame_audio`` and ``audio_frame`` as latent frames ×
audio bins, the bins in seconds, each frame's own bins outlined (the bins whose time its span holds)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..analysis.maps import aggregate
from ..runs.run import MapSource
from .style import CMAP, MAP_GID, add_colorbars, color_norms, describe, frame_label, head_labels, new_figure, set_title

__all__ = ["audio_sync"]

_WHAT = {
    "frame_audio": "video → audio: each latent frame's video queries over the audio bins (rows sum to 1)",
    "audio_frame": "audio → video: each audio bin's query over the latent frames (columns sum to 1)",
}


def audio_sync(
    source: MapSource,
    kind: str = "frame_audio",
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "mean",
    batch: int | str | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    fig: Figure | None = None,
) -> Figure:
    """The audio-video cross-attention per latent frame and audio bin: rows are the video's latent frames (with the
    pixel frames each covers), columns the audio bins, ticked in seconds (25 bins a second: bin i covers
    ``[max(0, i − ¾), i + ¼) / 25`` s). ``frame_audio`` is the video's queries over the audio keys, ``audio_frame``
    (drawn transposed, so both read the same way) the audio's queries over the video keys. A dashed box marks each
    frame's own bins (:meth:`cogattn.audio.AudioAxis.frame_of_bin`): attention that keeps to it is in sync.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``kind``.
        kind (`str`, defaults to ``"frame_audio"``): ``"frame_audio"`` or ``"audio_frame"``.
        steps, layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged.
        heads (`"mean" | "all" | int | Sequence[int]`, defaults to ``"mean"``): ``"all"`` or a list draws one
            panel per head (the audio heads).
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the first
            conditional item under guidance (:func:`cogattn.items.pick_item`).
        scale (`str`, defaults to ``"linear"``): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    if kind not in _WHAT:
        raise ValueError(f"kind={kind!r}; audio_sync draws 'frame_audio' or 'audio_frame'.")
    layout = source.layout
    m = aggregate(source, kind, steps=steps, layers=layers, heads=heads, batch=batch)
    maps = m[None] if m.ndim == 2 else m
    maps = maps.transpose(1, 2) if kind == "audio_frame" else maps  # (n, F, A) either way
    n, F, A = maps.shape
    axis = layout.audio
    labels = head_labels(source, heads, n)
    labels = labels if len(labels) == n else [f"head {h}" for h in range(n)]  # heads="all": the audio heads
    ranges = layout.pixel_frames(layout.default_pixel_frames) if layout.default_pixel_frames else None
    rows = [frame_label(f, ranges, " ") for f in range(F)]
    ncols = min(n, 2)
    nrows = math.ceil(n / ncols)
    width, height = min(12.0, 2.0 + 0.08 * A), 1.2 + 0.32 * F
    fig = new_figure(fig, (max(width * ncols + 1.0, 7.0), height * nrows + 0.8))  # wide enough for the title
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    arrays = [maps[i].numpy() for i in range(n)]
    norms = color_norms(arrays, scale, limits)
    start = axis.seconds()[:, 0].numpy()
    ticks = np.unique(np.linspace(0, A - 1, min(A, 8)).round().astype(int))
    owner = axis.frame_of_bin(layout).numpy()
    images = []
    for i, ax in enumerate(axes):
        if i >= n:
            ax.set_visible(False)
            continue
        images.append(
            ax.imshow(arrays[i], cmap=CMAP, norm=norms[i], interpolation="nearest", aspect="auto", gid=MAP_GID)
        )
        for f in range(F):  # the frame's own bins: a dashed box
            own = np.flatnonzero(owner == f)
            if own.size:
                x0, x1 = own[0] - 0.5, own[-1] + 0.5
                ax.plot([x0, x1, x1, x0, x0], [f - 0.5, f - 0.5, f + 0.5, f + 0.5, f - 0.5], "w--", lw=0.6)
        ax.set_xticks(ticks, [f"{start[t]:.2f}" for t in ticks], fontsize=7)
        ax.set_yticks(range(F), rows, fontsize=7)
        ax.set_xlabel(f"audio bin: start in seconds ({axis.rate:g} bins a second)", fontsize=8)
        ax.set_ylabel("video: latent frame", fontsize=8)
        if heads != "mean":
            ax.set_title(labels[i], fontsize=9)
    add_colorbars(fig, images, list(axes[:n]), kind, limits)
    set_title(fig, _WHAT[kind], describe(source, kind, steps, layers, heads, batch))
    return fig
