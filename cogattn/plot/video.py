"""The decoded video: videos as arrays, patch-grid maps upsampled to its pixels (each pixel frame
showing the latent frame that covers it, from :meth:`cogattn.TokenLayout.latent_of_pixel`), and
rendered frames written to GIF or MP4.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..layout import TokenLayout

__all__ = ["patch_pixels", "upsample_to_video", "video_array", "write_animation"]


def patch_pixels(layout: TokenLayout, size: tuple[int, int]) -> tuple[float, float]:
    """Pixels of a video of ``size`` ``(H, W)`` per patch row and per patch column. A grid padded to whole patches
    (Cosmos 3's transformer pads 45 latent rows to 23 patches of 32 pixels for 720 rows) has patches of ⌈H / Hp⌉
    pixels, the last cut by the video's edge; where no whole number of pixels fits so, the grid is stretched."""
    steps = []
    for pixels, patches in zip(size, (layout.height, layout.width)):
        step = -(-int(pixels) // patches)
        steps.append(float(step) if (patches - 1) * step < pixels else pixels / patches)
    return steps[0], steps[1]


def video_array(video) -> np.ndarray:
    """A decoded video as a float ``(N, H, W, 3)`` array in [0, 1].

    Args:
        video: the pipeline's ``.frames`` for one video in any output type: a tensor or array
            ``(N, 3, H, W)`` / ``(N, H, W, 3)`` (a leading batch of 1 is dropped), float in [0, 1] or
            uint8, or a list of PIL images.

    Returns:
        `np.ndarray`: float32 ``(N, H, W, 3)``.
    """
    if isinstance(video, (list, tuple)):
        if len(video) == 1 and isinstance(video[0], (list, tuple)):
            video = video[0]
        arr = np.stack([np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in video])
    elif isinstance(video, torch.Tensor):  # uint8 kept as it is, for the test below; bf16 has no numpy dtype
        video = video.detach().cpu()
        arr = video.numpy() if video.dtype == torch.uint8 else video.float().numpy()
    else:
        arr = np.asarray(video)
    if arr.ndim == 5:
        if arr.shape[0] != 1:
            raise ValueError(f"video has a batch of {arr.shape[0]}; pass one video, e.g. frames[0].")
        arr = arr[0]
    if arr.ndim != 4 or 3 not in (arr.shape[1], arr.shape[-1]):
        raise ValueError(f"video of shape {arr.shape}: expected (N, 3, H, W) or (N, H, W, 3).")
    if arr.shape[-1] != 3:
        arr = arr.transpose(0, 2, 3, 1)
    arr = arr.astype(np.float32) / (255.0 if arr.dtype == np.uint8 else 1.0)
    return np.clip(arr, 0.0, 1.0)


def upsample_to_video(
    maps: torch.Tensor,
    layout: TokenLayout,
    num_pixel_frames: int,
    size: tuple[int, int],
    mode: str = "nearest",
    temporal_compression: int | None = None,
) -> torch.Tensor:
    """Patch-grid maps placed on the decoded video: one map per pixel frame, upsampled to pixels.

    Pixel frame ``n`` gets the map of the latent frame (temporal patch) covering it (see
    :meth:`cogattn.TokenLayout.pixel_frames`), resized from ``(Hp, Wp)`` patches to ``(H, W)`` pixels;
    one patch is ``H / Hp`` pixels high (16 for CogVideoX: 2 latent pixels of 8; a grid padded to whole patches,
    Cosmos 3's, is cut at the video's edge: :func:`patch_pixels`). A layout of ``grids`` copies of
    the grid (Motif-Video's decoder layers) gives the video once per copy: copy ``c``'s pixel frame ``n`` is map
    ``c·N + n``.

    Args:
        maps (`torch.Tensor`): ``(F, Hp, Wp)``, e.g. ``aggregate(rec, "video_to_text")[token]``
            (:func:`cogattn.analysis.aggregate`).
        layout (`TokenLayout`): the recorded layout.
        num_pixel_frames (`int`): frames N of the decoded video.
        size (`tuple[int, int]`): ``(H, W)`` of the decoded video.
        mode (`str`, defaults to ``"nearest"``): ``"nearest"`` (every pixel of a patch shows the patch's
            value) or ``"bilinear"`` (smooth).
        temporal_compression (`int | None`): the VAE's temporal compression; defaults to the layout's.

    Returns:
        `torch.Tensor`: ``(grids·N, H, W)`` float32 (``(N, H, W)`` for one copy of the grid).
    """
    if tuple(maps.shape) != layout.grid:
        raise ValueError(f"maps of shape {tuple(maps.shape)}; expected the latent grid (F, Hp, Wp) = {layout.grid}.")
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"mode={mode!r}; choose 'nearest' or 'bilinear'.")
    extra = {} if mode == "nearest" else {"align_corners": False}
    (sy, sx), (H, W) = patch_pixels(layout, size), size
    whole = [round(s * n) if s % 1 == 0 else p for s, n, p in zip((sy, sx), (layout.height, layout.width), (H, W))]
    up = F.interpolate(maps.float()[None], size=whole, mode=mode, **extra)[0][:, :H, :W]  # a padded grid's: cut
    owner = layout.latent_of_pixel(num_pixel_frames, temporal_compression)  # latent frames of one copy
    copy = layout.one_grid.frames
    return up[[c * copy + f for c in range(layout.grids) for f in owner]]


def _ffmpeg() -> str | None:
    """The ffmpeg executable: on PATH, else the one imageio-ffmpeg ships, else `None`."""
    exe = shutil.which("ffmpeg")
    if exe is None:
        try:
            import imageio_ffmpeg

            exe = imageio_ffmpeg.get_ffmpeg_exe()
        except (ImportError, RuntimeError):
            return None
    return exe


def write_animation(frames: Sequence[np.ndarray], path: str | os.PathLike, fps: float = 2.0) -> Path:
    """Write RGB ``uint8`` frames ``(H, W, 3)`` to ``path``: ``.gif`` with pillow, ``.mp4`` with ffmpeg.

    Args:
        frames (`Sequence[np.ndarray]`): rendered frames, all the same size.
        path (`str | os.PathLike`): ending in ``.gif`` or ``.mp4``.
        fps (`float`, defaults to 2.0): frames per second. A GIF stores each frame's time in whole
            centiseconds (pillow cuts 125 ms to 12), so fps=8 plays at 8.33 there; an MP4 keeps ``fps``.

    Returns:
        `Path`: the file written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise ValueError(f"cannot write {str(path)!r}: animations are written as .gif or .mp4.")
    if not frames:
        raise ValueError("no frames to write.")
    if len({f.shape for f in frames}) != 1:
        raise ValueError(f"frames differ in size: {sorted({f.shape for f in frames})}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".gif":
        from PIL import Image

        images = [Image.fromarray(np.ascontiguousarray(f, dtype=np.uint8)) for f in frames]
        # One palette for all frames, from a sample of them, keeps colours from flickering between frames.
        sample = np.concatenate([np.asarray(im) for im in images[:: max(1, len(images) // 8)]], axis=0)
        palette = Image.fromarray(sample).quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        images = [im.quantize(palette=palette, dither=Image.Dither.NONE) for im in images]
        images[0].save(
            path,
            save_all=True,
            append_images=images[1:],
            duration=round(1000 / fps),
            loop=0,
            optimize=False,
            disposal=1,
        )
        return path
    exe = _ffmpeg()
    if exe is None:
        raise RuntimeError(
            f"writing {str(path)!r} needs ffmpeg: install it on PATH or `pip install imageio-ffmpeg`, or write a .gif."
        )
    h, w, _ = frames[0].shape
    # yuv420p (what players expect) needs even sizes, hence the pad.
    cmd = [
        exe,
        "-y",
        "-loglevel",
        "error",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "-s",
        f"{w}x{h}",
        "-r",
        str(fps),
        "-i",
        "-",
        "-vf",
        "pad=ceil(iw/2)*2:ceil(ih/2)*2",
        "-c:v",
        "libx264",
        "-pix_fmt",
        "yuv420p",
        str(path),
    ]
    data = b"".join(np.ascontiguousarray(f, dtype=np.uint8).tobytes() for f in frames)
    subprocess.run(cmd, input=data, check=True)
    return path
