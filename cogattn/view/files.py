"""What the viewer reads from a run's folder besides the records, trusting none of it.

A run folder may come from anyone (the browser's same-origin rule is the model: nothing outside it is read or
served). :class:`PromptFiles` reads what the batch tool writes beside a run: ``prompt.json`` (the token
labels, the video's name), the video and ``previews/frame.png``, and follows a path only where it resolves,
symlinks included, inside the prompt's folder (:func:`inside`, checked again as a file is served). A video
that is refused or does not decode costs the video alone, and :meth:`PromptFiles.video_note` says why.
:func:`info`, :func:`prompt_of` and :func:`finite` make run.json's values safe to send to a page.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..layout import TokenLayout
from ..runs.folder import parse_json
from ..runs.run import Run

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["VIDEOS", "PromptFiles", "finite", "info", "inside", "prompt_of"]

VIDEOS = (".gif", ".mp4")  # what the batch tool writes and the page shows
# a GIF's frames are decoded one at a time, each through those before it: at most this many pixels a frame and frames
MAX_FRAME_PIXELS, MAX_FRAMES = 4096 * 4096, 4096


def inside(folder: Path, name, source: str, field: str) -> Path:
    """``folder / name`` where it resolves inside ``folder`` (symlinks followed), for a ``name`` read from
    ``source``'s ``field``; else `ValueError`, one line naming the file and the field."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}'s {field!r} is {str(name)[:60]!r}, not a file name")
    path, root = folder / name, folder.resolve()
    real = path.resolve()
    if not real.is_relative_to(root):
        raise ValueError(
            f"{source}'s {field!r} names {name!r}, which resolves to {str(real)!r}, outside the folder "
            f"{str(root)!r}; only files inside it are read"
        )
    return path


def finite(obj):
    """``obj`` (JSON-ready) with every NaN and infinity as `None`: a browser's JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def info(run: Run) -> dict:
    """The run's ``info`` (prompt, seed, ...), or ``{}`` where run.json holds something else there."""
    try:
        return run.info
    except (TypeError, ValueError):
        return {}


def prompt_of(run: Run) -> str | None:
    """The run's prompt as the page shows it: text, whatever run.json holds."""
    prompt = info(run).get("prompt")
    return None if prompt is None else str(prompt)


class PromptFiles:
    """The batch tool's files beside a run: ``prompt.json``, the video, the frame preview; none for a run
    recorded from Python (no ``prompt.json`` beside its ``maps/`` folder).

    Args:
        run_path (`Path`): the run folder.
        layout (`TokenLayout | None`): the run's layout (which video lengths its maps can be laid over).
    """

    def __init__(self, run_path: Path, layout: TokenLayout | None):
        parent = run_path.parent
        batch = run_path.name == "maps" and (parent / "prompt.json").exists()
        self.layout = layout
        self.folder = parent if batch else run_path  # what the page reads from: the prompt's folder, or the run
        self.prompt, self.video, self.thumbnail = {}, None, None
        self._count: int | None = None
        self._why: str | None = None
        if not batch:
            return
        try:  # the batch tool's facts about the prompt; a damaged file costs the labels and the video only
            file = inside(parent, "prompt.json", "the prompt folder", "prompt.json")
            prompt = parse_json(file.read_text()) if file.is_file() else {}  # a pipe would block the page
            self.prompt = prompt if isinstance(prompt, dict) else {}
        except (OSError, ValueError):
            pass
        if (video := self.prompt.get("video")) is not None:
            try:
                self.video = inside(parent, video, "prompt.json", "video")
                if self.video.suffix not in VIDEOS or not self.video.is_file():
                    self._why = f"prompt.json's 'video' {video!r} is not a GIF or MP4 file in {str(parent)!r}"
                    self.video = None
            except ValueError as err:  # a path out of the folder: the rest of the run still opens
                self._why = str(err)
        try:
            preview = inside(parent, "previews/frame.png", "the prompt folder", "previews/frame.png")
            self.thumbnail = preview if preview.is_file() else None
        except ValueError:
            pass

    def file(self, what: str) -> Path | None:
        """The file the page asks for by name (``"video"``, ``"thumbnail"``), checked again as it is served
        (a link made after the run was opened), or `None`."""
        path = {"video": self.video, "thumbnail": self.thumbnail}.get(what)
        if path is None:
            return None
        try:
            found = inside(self.folder, str(path.relative_to(self.folder)), "the prompt folder", what)
        except ValueError:
            return None
        return found if found.is_file() else None  # a pipe put there since would block the server

    def frame_count(self) -> int:
        """Frames of the video the page can overlay (0 without one, for an MP4 this Python cannot decode,
        or for frames the layout does not make: :meth:`video_note` says why). A video that cannot be
        decoded at all is dropped (:attr:`video` becomes `None`): it costs the video panel, not the run."""
        if self._count is None:
            self._count = 0
            if self.video is not None:
                try:
                    self._count, self._why = _count(self.video)
                except Exception as err:  # a damaged file: pillow and imageio raise many kinds
                    self._why = f"{self.video.name} (prompt.json's 'video') cannot be decoded ({_line(err)})"
                    self.video = None
            lay = self.layout
            if self._count and lay is not None:
                try:
                    lay.pixel_frames(self._count)
                except ValueError as err:  # the video does not match the run's layout: shown, not overlaid
                    self._count, self._why = 0, f"the maps are not laid over the video: {_line(err)}"
        return self._count

    def video_note(self) -> str | None:
        """Why the video's frames cannot be overlaid with the maps, when they cannot."""
        self.frame_count()
        return self._why

    def frame_png(self, i: int) -> bytes | None:
        """Frame ``i`` of the video as a PNG file, decoded when asked for (the server holds no video)."""
        if not 0 <= i < self.frame_count() or (video := self.file("video")) is None:
            return None
        out = io.BytesIO()
        _frame(video, i).save(out, format="PNG")
        return out.getvalue()


def _count(path: Path) -> tuple[int, str | None]:
    """Frames of the batch tool's video, a GIF's with pillow, an MP4's with imageio (optional), and why
    there are none to overlay when there are none."""
    if path.suffix == ".gif":
        from PIL import Image  # slow to import: only where a video is read

        with Image.open(path) as gif:
            (width, height), frames = gif.size, gif.n_frames
        note = _too_large("GIF", frames, width, height)
        return (0, note) if note else (frames, None)
    try:
        import imageio.v3 as iio

        frames = 0
        for frame in iio.imiter(path):  # streamed: the ffmpeg plugin does not know the count
            frames += 1
            if note := _too_large("MP4", frames, frame.shape[1], frame.shape[0]):  # decoded no further
                return 0, note
        return frames, None
    except Exception as err:  # the 'video' extra missing, or no plugin for MP4: the video shows, not overlaid
        why = f"{type(err).__name__}: {err}".splitlines()[0][:160]
        return 0, f"the maps are laid over an MP4's frames with imageio (pip install 'cogattn[video]'): {why}"


def _too_large(what: str, frames: int, width: int, height: int) -> str | None:
    """Why a video of ``frames`` of ``width`` × ``height`` pixels is not overlaid (`None`: it is small enough)."""
    if width * height <= MAX_FRAME_PIXELS and frames <= MAX_FRAMES:
        return None
    return (
        f"the {what}'s {frames} frames of {width} × {height} pixels are more than the page overlays ({MAX_FRAMES} "
        f"frames of at most {MAX_FRAME_PIXELS:,} pixels)"
    )


def _frame(path: Path, i: int) -> Image.Image:
    """Frame ``i`` of the video, alone."""
    from PIL import Image  # slow to import: only where a video is read

    if path.suffix == ".gif":
        with Image.open(path) as gif:
            gif.seek(i)
            return gif.convert("RGB")
    import imageio.v3 as iio

    return Image.fromarray(iio.imread(path, index=i))


def _line(err: BaseException) -> str:
    """An error as one short line."""
    text = str(err).splitlines()[0][:160] if str(err) else ""
    return f"{type(err).__name__}: {text}"
