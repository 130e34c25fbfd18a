"""Preview images of a prompt's maps, for a quick look at what ``cogattn-dump`` wrote."""

from __future__ import annotations

from pathlib import Path

from .. import plot
from ..analysis import aggregate
from ..run import load
from ..words import text_tokens

__all__ = ["write_previews"]

_SPECIAL = {"</s>", "<pad>", "<unk>", "<s>"}


def _words(run, tokenizer, prompt: str | None, limit: int = 4) -> list[int]:
    """The first ``limit`` text tokens that are neither special nor padding (their indices), among the
    ``prompt_len`` of ``video_to_text`` (Wan: its cross-attention's 512, of the cleaned prompt)."""
    T = run.layout.prompt_len
    if tokenizer is None or prompt is None:
        return list(range(min(limit, T)))
    tokens = text_tokens(tokenizer, prompt, T, clean=run.layout.text_len == 0)
    return [i for i, t in enumerate(tokens) if t not in _SPECIAL and t.strip("▁")][:limit] or [0]


def _image_tokens(run, limit: int = 4) -> list[int]:
    """The ``limit`` image tokens the video attends to most (mean over video queries, steps, layers and
    heads), in order of index: the image tokens have no words to pick them by."""
    mass = aggregate(run, "video_to_image").flatten(1).mean(1)  # (I,)
    return sorted(mass.topk(min(limit, len(mass))).indices.tolist())


def write_previews(run_path, folder, video, tokenizer=None, prompt: str | None = None, dpi: int = 90) -> list[Path]:
    """Write preview PNGs: one per recorded map kind (averaged over the recorded steps, layers and heads),
    ``entropy`` and ``received`` over the video, the ``block`` map, and the head atlas of the head table's
    kinds (at the last step). ``video_to_image`` (Wan 2.1 image-to-video) shows the 4 image tokens the
    video attends to most.

    Args:
        run_path: a run folder written by ``cogattn.record(..., save_dir=...)``.
        folder: where the PNGs go (created).
        video: the decoded frames of the generation (list of PIL images or a tensor).
        tokenizer, prompt: to label text tokens with their words.
        dpi (`int`, defaults to 90): resolution of the images.

    Returns:
        `list[Path]`: the files written.
    """
    run = load(run_path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {k for k, _, _ in run.keys()}
    text = dict(tokenizer=tokenizer, prompt=prompt)
    figures = {}
    if "frame" in kinds:
        figures["frame"] = plot.frame_heatmap(run, num_pixel_frames=len(video))
    for kind in ("video_to_text", "text_to_video"):
        if kind in kinds:
            figures[kind] = plot.word_heatmap(run, _words(run, tokenizer, prompt), video, kind=kind, **text)
    if "video_to_image" in kinds:
        figures["video_to_image"] = plot.word_heatmap(run, _image_tokens(run), video, kind="video_to_image")
    if "query" in kinds:
        figures["query"] = plot.query_map(run, 0, video, **text)
    for kind in ("entropy", "received"):
        if kind in kinds:
            figures[kind] = plot.token_stat(run, kind, video, **text)
    if "block" in kinds:
        figures["block"] = plot.block_map(run, scale="log")
    if kinds & {"frame", "query_frame", "entropy", "received"}:
        figures["heads"] = plot.head_atlas(run)
    paths = []
    for name, fig in figures.items():
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
