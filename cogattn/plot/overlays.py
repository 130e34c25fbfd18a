"""Maps on the decoded video: where the video attends to each word (and the reverse), and where one
video point attends, with each pixel frame showing the latent frame that covers it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..analysis.layouts import for_layers
from ..analysis.maps import aggregate, locate_query, recorded_kinds
from ..analysis.words import cleans_prompt, item_spans, pad_name, text_tokens, word_positions
from ..layout import TokenLayout
from ..runs.run import MapSource
from .style import (
    CMAP,
    MAP_GID,
    POINT_GID,
    add_colorbars,
    color_norms,
    describe,
    frame_label,
    hide_ticks,
    new_figure,
    patch_ticks,
    pixel_ranges,
    set_title,
    single_head,
    token_name,
)
from .video import patch_pixels, upsample_to_video, video_array

__all__ = ["query_map", "word_heatmap"]


def _text_ticks(
    source: MapSource, tokenizer, prompt: str | None, limit: int = 40, batch=None
) -> tuple[list[int], list[str]]:
    """Tick positions and labels of the text keys of batch slot ``batch``. Past ``limit`` tokens (226 in
    CogVideoX, mostly padding) only the prompt's own tokens are named, plus every tenth of the axis by index."""
    T = source.layout.text_len
    spans = item_spans(source, batch)  # the item's image, glyph and prompt tokens (HunyuanVideo: image first)
    named_tokens = tokenizer is not None and prompt is not None
    family = getattr(source, "family", None)  # a bare tokenizer is refused where the family templates the prompt
    names = text_tokens(tokenizer, prompt, T, spans=spans, family=family) if named_tokens else None
    if T <= limit:
        return list(range(T)), names or [str(t) for t in range(T)]
    pad = pad_name(tokenizer, family=family) if names else None  # the pipeline's tokenizer's, as text_tokens names it
    named = [i for i, n in enumerate(names) if n != pad][:limit] if names else []
    keep = sorted(set(named) | set(range(0, T, max(1, T // 10))))
    return keep, [names[i] if i in named else str(i) for i in keep]


def _resolve_tokens(source: MapSource, kind: str, tokens, tokenizer, prompt, batch=None) -> list[tuple[list[int], str]]:
    """``[(positions, label), ...]`` for token indices and words of ``kind``'s token axis: the prompt's
    ``layout.prompt_len`` text tokens (in the sequence, or Wan's cross-attention) as batch slot ``batch``
    holds them (its own spans where the model packs each item's text), or for ``video_to_image`` the
    ``layout.image_len`` image tokens (indices only)."""
    layout = source.layout
    image = kind == "video_to_image"
    T = layout.image_len if image else layout.prompt_len
    what = "image token" if image else "text token"
    items = [tokens] if isinstance(tokens, (int, str)) else list(tokens)
    if not items:
        raise ValueError(f"tokens is empty; pass {what} indices{'' if image else ' or words of the prompt'}.")
    spans = None if image else item_spans(source, batch)
    family = getattr(source, "family", None)  # a bare tokenizer is refused where the family templates the prompt
    names = clean = None
    if not image and tokenizer is not None and prompt is not None:
        clean = cleans_prompt(family)  # a bare tokenizer's prompt cleaned where the family's pipeline does (Wan's)
        clean = layout.text_len == 0 if clean is None else clean  # a source of no known family: Wan's cross-attention
        names = text_tokens(tokenizer, prompt, T, clean=clean, spans=spans, family=family)
    out = []
    for item in items:
        if isinstance(item, str):
            if image:
                raise ValueError(f"token {item!r} is a word, but image tokens have none; pass indices 0..{T - 1}.")
            if tokenizer is None or prompt is None:
                raise ValueError(
                    f"token {item!r} is a word: pass tokenizer=pipe (the pipeline) and prompt= (the generation's "
                    f"prompt), or token indices 0..{T - 1}."
                )
            pos = word_positions(item, tokenizer, prompt, T, clean=clean, spans=spans, family=family)
            where = f"token {pos[0]}" if len(pos) == 1 else f"tokens {', '.join(map(str, pos))}"
            out.append((pos, f'"{item}" ({where})'))
        elif isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < T:
                count = f"I = {T} image tokens" if image else f"T = {T} tokens"
                raise ValueError(f"{what} index {item} is out of range; this layout has {count} (0..{T - 1}).")
            label = f"image token {item}" if image else f"token {item}"
            out.append(([item], f'"{names[item]}" (token {item})' if names else label))
        else:
            raise TypeError(f"tokens must hold token indices or words, got {item!r}.")
    return out


# -- word maps on the video ------------------------------------------------------------------------
def _video_panels(layout: TokenLayout, video, frames, num_pixel_frames: int | None):
    """``(pixel video or None, [(panel frame, latent frame)], pixel ranges or None)``. Over a video, a layout of
    ``grids`` copies of the grid (Motif-Video's decoder layers) shows the chosen pixel frames once per copy."""
    frames = [frames] if isinstance(frames, int) else frames
    if video is not None:
        pixels = video_array(video)
        ranges = layout.pixel_frames(len(pixels))  # once per copy of the grid
        owner = layout.latent_of_pixel(len(pixels))  # the latent frame of one copy
        if frames is None:
            frames = [r[len(r) // 2] for r in ranges[: layout.one_grid.frames]]  # the middle one of each latent frame
        elif frames == "all":
            frames = list(range(len(pixels)))
        for n in frames:
            if not 0 <= n < len(pixels):
                raise ValueError(
                    f"pixel frame {n} is out of range; the video has {len(pixels)} frames (0..{len(pixels) - 1})."
                )
        copy = layout.one_grid.frames
        return pixels, [(n, c * copy + owner[n]) for c in range(layout.grids) for n in frames], ranges
    ranges = pixel_ranges(layout, num_pixel_frames)
    frames = list(range(layout.frames)) if frames in (None, "all") else list(frames)
    for f in frames:
        if not 0 <= f < layout.frames:
            raise ValueError(
                f"latent frame {f} is out of range; the layout has F = {layout.frames} (0..{layout.frames - 1})."
            )
    return None, [(f, f) for f in frames], ranges


def _on_video(maps, layout: TokenLayout, pixels, panels, mode: str) -> list[np.ndarray]:
    """Each panel's map ``(H, W)`` on its pixel frame: the frame of :func:`upsample_to_video` of the panel's copy."""
    up = upsample_to_video(maps, layout, len(pixels), pixels.shape[1:3], mode)
    copy = layout.one_grid.frames
    return [up[f // copy * len(pixels) + n].numpy() for n, f in panels]


def _draw_panel(ax, heat: np.ndarray, norm, pixels, n: int, alpha: float):
    """The heat map over pixel frame ``n`` of the video (same extent), or alone on the patch grid."""
    if pixels is None:
        return ax.imshow(heat, cmap=CMAP, norm=norm, interpolation="nearest", gid=MAP_GID)
    H, W = pixels.shape[1:3]
    ax.imshow(pixels[n], extent=(0, W, H, 0), interpolation="nearest")
    im = ax.imshow(heat, cmap=CMAP, norm=norm, alpha=alpha, extent=(0, W, H, 0), interpolation="nearest", gid=MAP_GID)
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    return im


def token_figure(source: MapSource, values, video, kind: str, labels: tuple[str, str], text: dict, style: dict):
    """One value per token ``values`` ``(S,)`` drawn on the video: a panel per latent frame (its middle pixel
    frame, the values upsampled from patches to pixels; or the patch grid alone) and the text tokens as a
    strip below, with colour bars. ``labels``: the video and text axes' names; ``text``: ``tokenizer`` and
    ``prompt`` for the strip's ticks; ``style``: ``fig``, ``num_pixel_frames``, ``scale``, ``limits``,
    ``alpha``, ``interpolation``.

    Returns:
        `tuple`: ``(fig, axes, text_ax or None, pixels or None, panels [(pixel frame, latent frame)],
        (panel height, width))``, for the caller's marks and title.
    """
    layout = source.layout
    T = layout.text_len
    grid = values[layout.grid_tokens].reshape(layout.grid)  # a history token (FramePack's, Helios's) has no place
    pixels, panels, ranges = _video_panels(layout, video, None, style["num_pixel_frames"])
    if pixels is None:
        arrays = [grid[f].numpy() for _, f in panels]
    else:
        arrays = _on_video(grid, layout, pixels, panels, style["interpolation"])
    if T:
        arrays.append(values[layout.text_tokens].numpy()[None])
    limits = style["limits"]
    norms = color_norms(arrays, style["scale"], limits)
    ncols = len(panels)
    h, w = pixels.shape[1:3] if pixels is not None else (layout.height, layout.width)
    pw = min(2.0, 16 / ncols)  # a long video still fits a page: at most 16 inches of panels
    per_map = 0.8 if limits == "per-map" else 0.0  # room for a colour bar per panel
    fig = new_figure(style["fig"], ((pw + per_map) * ncols + 1.6, pw * h / w + (2.2 if T else 1.2)))
    gs = fig.add_gridspec(2 if T else 1, ncols, height_ratios=[pw * h / w, 0.6] if T else None)
    axes = [fig.add_subplot(gs[0, c]) for c in range(ncols)]
    images = []
    for c, (n, f) in enumerate(panels):
        ax = axes[c]
        images.append(_draw_panel(ax, arrays[c], norms[c], pixels, n, style["alpha"]))
        if pixels is None:
            ax.set_title(frame_label(f, ranges, " · "), fontsize=8)
            ax.set_xlabel("patch column", fontsize=7)
            patch_ticks(ax, layout)
        else:
            ax.set_title(f"px {n} · f{f}", fontsize=8)
            hide_ticks(ax)
    axes[0].set_ylabel("patch row" if pixels is None else labels[0], fontsize=8)
    text_ax = None
    if T:
        text_ax = fig.add_subplot(gs[1, :])
        images.append(
            text_ax.imshow(arrays[-1], cmap=CMAP, norm=norms[-1], aspect="auto", interpolation="nearest", gid=MAP_GID)
        )
        prompt = text["prompt"] if text["prompt"] is not None else source.info.get("prompt")
        ticks, names = _text_ticks(source, text["tokenizer"], prompt, batch=text.get("batch"))
        text_ax.set_xticks(ticks, names, fontsize=6, rotation=90 if len(ticks) > 16 else 0)
        text_ax.set_yticks([])
        text_ax.set_xlabel(labels[1])
    add_colorbars(fig, images, axes + ([text_ax] if T else []), kind, limits)
    return fig, axes, text_ax, pixels, panels, (h, w)


def word_heatmap(
    source: MapSource,
    tokens: int | str | Sequence[int | str],
    video=None,
    *,
    kind: str = "video_to_text",
    tokenizer=None,
    prompt: str | None = None,
    frames: int | Sequence[int] | str | None = None,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    num_pixel_frames: int | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    alpha: float = 0.6,
    interpolation: str = "nearest",
    fig: Figure | None = None,
) -> Figure:
    """Where the video attends to each word (``video_to_text``), or where each word attends in the
    video (``text_to_video``): one row per word, one column per frame, over the decoded video. With
    ``kind="video_to_image"`` (Wan 2.1 image-to-video) the rows are image tokens of the conditioning
    image's cross-attention instead: where the video attends to each.

    A word of several tokens shows the sum of its tokens for ``video_to_text`` (the attention mass on
    the word) and their mean for ``text_to_video`` (each token's row is its own distribution). The text
    axis has ``layout.prompt_len`` tokens: CogVideoX's T in the sequence, or Wan's 512 of its text
    cross-attention (there each video query's row over them sums to 1; Wan has no ``text_to_video``,
    its text never queries). On the video, pixel frame n shows the map of the latent frame covering it
    (:meth:`cogattn.TokenLayout.pixel_frames`), upsampled from patches to pixels.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``kind``.
        tokens (`int | str | Sequence[int | str]`): text-token indices, or words of the prompt; for
            ``video_to_image`` image-token indices (Wan 2.1: 0 is CLIP's class token, 1 … 256 its 16 × 16
            patches of the image in row order).
        video (defaults to `None`): the decoded video of the generation (``pipe(...).frames[0]``, any
            output type), or `None` for maps on the patch grid alone.
        kind (`str`, defaults to ``"video_to_text"``): or ``"text_to_video"``, ``"video_to_image"``.
        tokenizer (defaults to `None`): to find words and name tokens: the pipeline (``pipe``: its family's
            template and crop), a ``words.PromptFormat``, or a tokenizer alone (the bare prompt: the T5 families;
            refused where the family's pipeline makes its text its own way, ``cogattn.analysis.words``).
        prompt (`str | None`, defaults to `None`): the prompt; `None` takes ``info["prompt"]`` of the
            recording or run.
        frames (`int | Sequence[int] | "all" | None`, defaults to `None`): pixel frames to show (latent
            frames without a video); `None`: the middle pixel frame of every latent frame. A layer over two copies of
            the grid (Motif-Video's decoder) shows each pixel frame once per copy.
        steps, layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged.
        heads (`"mean" | int`, defaults to ``"mean"``): one head, or the mean.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        num_pixel_frames (`int | None`, defaults to `None`): frames of the decoded video when no video is
            given (names the pixel frames of each latent frame).
        scale (`str`, defaults to ``"linear"``): ``"linear"`` or ``"log"``.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits.
        alpha (`float`, defaults to 0.6): opacity of the map over the video.
        interpolation (`str`, defaults to ``"nearest"``): patch-to-pixel upsampling, or ``"bilinear"``.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    if kind not in ("video_to_text", "text_to_video", "video_to_image"):
        raise ValueError(
            f"kind={kind!r}; word maps come from 'video_to_text' or 'text_to_video' (image tokens: 'video_to_image')."
        )
    single_head(heads, "word_heatmap")
    layout = source.layout
    prompt = prompt if prompt is not None else source.info.get("prompt")
    if kind == "text_to_video" and layout is not None and layout.text_len == 0:
        raise ValueError(
            "kind='text_to_video' needs text queries in the self-attention; this model's text is in a separate "
            "cross-attention (Wan), where only the video queries: use kind='video_to_text'."
        )
    chosen = _resolve_tokens(source, kind, tokens, tokenizer, prompt, batch)
    m = aggregate(source, kind, steps=steps, layers=layers, heads=heads, batch=batch)  # (T, F, Hp, Wp)
    per_word = [m[pos].mean(0) if kind == "text_to_video" else m[pos].sum(0) for pos, _ in chosen]
    pixels, panels, ranges = _video_panels(layout, video, frames, num_pixel_frames)
    arrays = []
    for word_map in per_word:
        if pixels is None:
            arrays += [word_map[f].numpy() for _, f in panels]
        else:
            arrays += _on_video(word_map, layout, pixels, panels, interpolation)
    norms = color_norms(arrays, scale, limits)
    nrows, ncols = len(chosen), len(panels)
    h, w = pixels.shape[1:3] if pixels is not None else (layout.height, layout.width)
    pw = min(2.0, 16 / ncols)  # a long video still fits a page: at most 16 inches of panels
    per_map = 0.8 if limits == "per-map" else 0.0  # room for a colour bar beside every panel
    fig = new_figure(fig, ((pw + per_map) * ncols + 1.4, ((pw - 0.25) * h / w + 0.3) * nrows + 0.8))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    images = []
    for r, (_, label) in enumerate(chosen):
        for c, (n, f) in enumerate(panels):
            ax = axes[r, c]
            k = r * ncols + c
            images.append(_draw_panel(ax, arrays[k], norms[k], pixels, n, alpha))
            if pixels is None:
                ax.set_xlabel("patch column", fontsize=7)
                patch_ticks(ax, layout)
                title = frame_label(f, ranges, " · ")
            else:
                hide_ticks(ax)
                title = f"px {n} · f{f}"
            if r == 0:
                ax.set_title(title, fontsize=8)
            if c == 0:
                ax.set_ylabel(label + ("\npatch row" if pixels is None else ""), fontsize=8)
    add_colorbars(fig, images, list(axes.ravel()), kind, limits)
    what = {
        "video_to_text": "video → text: where the video attends to each word",
        "text_to_video": "text → video: where each word attends in the video",
        "video_to_image": "video → image: where the video attends to each image token",
    }[kind]
    set_title(fig, what, describe(source, kind, steps, layers, heads, batch))
    return fig


# -- query maps ------------------------------------------------------------------------------------
def query_map(
    source: MapSource,
    query: int | tuple[int, int, int] = 0,
    video=None,
    *,
    tokenizer=None,
    prompt: str | None = None,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int = "mean",
    batch: int | str | None = None,
    num_pixel_frames: int | None = None,
    scale: str = "linear",
    limits: str | tuple[float, float] = "shared",
    alpha: float = 0.6,
    interpolation: str = "nearest",
    fig: Figure | None = None,
) -> Figure:
    """Where one video point attends: a strip over every latent frame (the point marked with a cross in
    its own frame) and, below, its attention to each text token (none for Wan, whose self-attention has
    no text keys: its text attention is ``video_to_text``).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``query`` (or ``full``).
        query (`int | tuple[int, int, int]`, defaults to 0): a position among the recorded queries, or a
            video point as a tuple (latent frame, patch row, patch column), as in ``queries=[(f, y, x)]``;
            a list is refused (``queries=`` reads a list of ints as token indices).
        video (defaults to `None`): the decoded video, or `None` for maps on the patch grid alone.
        tokenizer (defaults to `None`): to name the text tokens: the pipeline (``pipe``), as for
            :func:`word_heatmap`.
        prompt (`str | None`, defaults to `None`): the prompt; `None` takes ``info["prompt"]``.
        steps, layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): averaged.
        heads (`"mean" | int`, defaults to ``"mean"``): one head, or the mean.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis; by default the
            first conditional item under guidance, else slot 0 (:func:`cogattn.items.pick_item`).
        num_pixel_frames (`int | None`, defaults to `None`): frames of the decoded video when no video is
            given.
        scale (`str`, defaults to ``"linear"``): ``"log"`` shows the long tail.
        limits (`"shared" | "per-map" | tuple`, defaults to ``"shared"``): colour limits (text and video
            panels share them unless ``"per-map"``).
        alpha (`float`, defaults to 0.6): opacity over the video.
        interpolation (`str`, defaults to ``"nearest"``): patch-to-pixel upsampling, or ``"bilinear"``.
        fig (`Figure | None`, defaults to `None`): draw into this (empty) figure.

    Returns:
        `Figure`: the figure.
    """
    single_head(heads, "query_map")
    if isinstance(query, list):  # `queries=[2, 1, 4]` is three tokens: one meaning for a list everywhere
        point = f"; pass {tuple(query)} for the video point" if len(query) == 3 else ""
        raise ValueError(
            f"query={query!r} is a list, which `queries=` reads as token indices; query_map draws one query: "
            f"a position among the recorded queries (an int) or a video point (frame, row, col) as a tuple{point}."
        )
    rows = "query" if "query" in recorded_kinds(source) else "full"  # which layers "all" takes: the rows' kind
    source = for_layers(source, rows, layers)  # layers of another layout: theirs, before the point is read on it
    layout = source.layout
    kind, index, token = locate_query(source, query)
    row = aggregate(
        source, kind, steps=steps, layers=layers, heads=heads, batch=batch, row=index
    )  # (S,): that row read
    point = layout.coordinates(token)
    style = dict(fig=fig, num_pixel_frames=num_pixel_frames, scale=scale, limits=limits, alpha=alpha)
    style["interpolation"] = interpolation
    text = dict(tokenizer=tokenizer, prompt=prompt, batch=batch)
    fig, axes, _, pixels, panels, (h, w) = token_figure(
        source, row, video, kind, ("video keys", "text keys"), text, style
    )
    for ax, (_, f) in zip(axes, panels):
        if point is not None and f == point[0]:
            _, y, x = point
            if pixels is not None:  # patch centre in pixels
                sy, sx = patch_pixels(layout, (h, w))
                x, y = (x + 0.5) * sx, (y + 0.5) * sy
            ax.plot([x], [y], marker="x", color="cyan", markersize=9, mew=2, gid=POINT_GID)
    who = token_name(layout, token) if point is None else f"video point (frame, row, col) = {point}"
    set_title(fig, f"where {who} attends", describe(source, kind, steps, layers, heads, batch))
    return fig
