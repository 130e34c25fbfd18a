"""Preview images of a prompt's maps, for a quick look at what ``cogattn-dump`` wrote."""

from __future__ import annotations

import re
from pathlib import Path

from .. import plot
from ..analysis.layouts import of_generation
from ..analysis.maps import aggregate, expert_steps, recorded
from ..analysis.words import cleans_prompt, item_spans, word_positions
from ..runs.run import load

__all__ = ["write_previews"]


def _words(run, tokenizer, prompt: str | None, limit: int = 4) -> list[int]:
    """The first ``limit`` text tokens of the prompt's words (their indices), found by
    ``words.word_positions`` among the ``prompt_len`` of ``video_to_text``: past the template's tokens where
    ``tokenizer`` is the pipeline or a ``words.PromptFormat``, at the shown item's own spans (HunyuanVideo 1.5:
    after its glyph tokens); Wan: its cross-attention's 512, of the cleaned prompt."""
    lay = run.layout
    spans = item_spans(run)  # the item the previews show: the first conditional one
    T = lay.prompt_len
    if tokenizer is None or prompt is None:
        return list(range(min(limit, T)))
    found: set[int] = set()
    clean = cleans_prompt(getattr(run, "family", None))  # a tokenizer alone: cleaned where the family's pipeline does
    clean = lay.text_len == 0 if clean is None else clean
    for word in dict.fromkeys(re.findall(r"\w+", prompt)):
        try:
            found.update(word_positions(word, tokenizer, prompt, T, clean=clean, spans=spans))
        except ValueError:  # cut off at T tokens, or changed by the pipeline's cleaning
            continue
    return sorted(found)[:limit] or [0]


def _image_tokens(run, steps, limit: int = 4) -> list[int]:
    """The ``limit`` image tokens the video attends to most (mean over video queries, ``steps``, layers
    and heads), in order of index: the image tokens have no words to pick them by."""
    mass = aggregate(run, "video_to_image", steps=steps).flatten(1).mean(1)  # (I,)
    return sorted(mass.topk(min(limit, len(mass))).indices.tolist())


def _per_expert(run, kind: str) -> dict[str, list[int]]:
    """``{file name: steps}`` of a kind's previews: ``kind`` over every recorded step, or under two experts
    (Wan 2.2 A14B) one ``kind_<expert>`` per expert over its steps: an average never mixes them."""
    groups = expert_steps(run, recorded(run, kind, "step"))
    if len(groups) == 1:
        return {kind: next(iter(groups.values()))}
    return {f"{kind}_{expert}": steps for expert, steps in groups.items()}


def _correspondence(run, video) -> dict:
    """``frame_max``'s previews, each of one map: the last recorded step (of each expert), the middle layer
    recorded at it, and the head-mean row, or the first recorded head of a run recorded per head. ``track``:
    the point at the centre of latent frame 0; ``motion``: latent frame 0 → 1 (none for a one-frame video). The layers
    are the generation's layout's (not Motif-Video's decoder layers, over two copies of the grid)."""
    lay = run.layout
    head = "mean" if run.head_ids is None else run.head_ids[0]
    point = (0, lay.height // 2, lay.width // 2)
    figures = {}
    for name, steps in _per_expert(run, "frame_max").items():
        suffix, step = name[len("frame_max") :], steps[-1]
        layers = of_generation(run, sorted({n for kind, s, n in run.keys() if kind == "frame_max" and s == step}))
        one = dict(step=step, layer=layers[len(layers) // 2], head=head)
        figures[f"track{suffix}"] = plot.track_figure(run, point, video, **one)
        if lay.frames > 1:
            figures[f"motion{suffix}"] = plot.motion_figure(run, 0, 1, video, **one)
    return figures


def write_previews(run_path, folder, video, tokenizer=None, prompt: str | None = None, dpi: int = 90) -> list[Path]:
    """Write preview PNGs: one per recorded map kind (averaged over the recorded steps, layers and heads),
    ``entropy`` and ``received`` over the video, the ``block`` map, and the head atlas of the head table's
    kinds (at the last step). ``video_to_image`` (Wan 2.1 image-to-video) shows the 4 image tokens the
    video attends to most. ``frame_max`` gives ``track.png`` (the track of the centre of latent frame 0,
    :func:`cogattn.plot.track_figure`) and ``motion.png`` (the motion field from latent frame 0 to 1,
    :func:`cogattn.plot.motion_figure`), each of one map: the last recorded step, the middle recorded layer,
    the head mean (or the first recorded head). A video made in windows (Helios's chunks) has the previews of its
    first window: that window's steps, over its frames. Under Wan 2.2 A14B's two experts each average is one expert's:
    ``frame_transformer.png`` and ``frame_transformer_2.png``, ``track_transformer.png``, and so on.

    Args:
        run_path: a run folder written by ``cogattn.record(..., save_dir=...)``.
        folder: where the PNGs go (created).
        video: the decoded frames of the generation (list of PIL images or a tensor).
        tokenizer, prompt: to label text tokens with their words: the pipeline (its template and crop), a
            ``words.PromptFormat`` (a call's own ``prompt_template``), or its tokenizer (the bare prompt: the T5
            families; refused for a family whose pipeline templates its prompt).
        dpi (`int`, defaults to 90): resolution of the images.

    Returns:
        `list[Path]`: the files written.
    """
    run = load(run_path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {k for k, _, _ in run.keys()}
    first = None  # a video made in windows (Helios's chunks): previews of the first window, over its frames
    if any(run.windows):
        first = {step for step, window in enumerate(run.windows) if window == 0}
        video = video[: run.layout.decoded_frames()[0]]
    text = dict(tokenizer=tokenizer, prompt=prompt)
    draw = {
        "frame": lambda s: plot.frame_heatmap(run, steps=s, num_pixel_frames=len(video)),
        "video_to_text": lambda s: plot.word_heatmap(run, _words(run, tokenizer, prompt), video, steps=s, **text),
        "text_to_video": lambda s: plot.word_heatmap(
            run, _words(run, tokenizer, prompt), video, kind="text_to_video", steps=s, **text
        ),
        "video_to_image": lambda s: plot.word_heatmap(
            run, _image_tokens(run, s), video, kind="video_to_image", steps=s
        ),
        "query": lambda s: plot.query_map(run, 0, video, steps=s, **text),
        "entropy": lambda s: plot.token_stat(run, "entropy", video, steps=s, **text),
        "received": lambda s: plot.token_stat(run, "received", video, steps=s, **text),
        "block": lambda s: plot.block_map(run, steps=s, scale="log"),
    }
    figures = {}
    for kind, figure in draw.items():
        if kind in kinds:
            groups = _per_expert(run, kind).items()
            groups = [(name, [s for s in steps if first is None or s in first]) for name, steps in groups]
            figures.update({name: figure(steps) for name, steps in groups if steps})
    if "frame_max" in kinds:
        figures.update(_correspondence(run, video))
    if kinds & {"frame", "query_frame", "entropy", "received"}:  # one step: no average over steps
        figures["heads"] = plot.head_atlas(run)
    paths = []
    for name, fig in figures.items():
        path = folder / f"{name}.png"
        try:
            fig.savefig(path, dpi=dpi)
        except OSError as err:  # a full disk's error names no file
            raise OSError(err.errno, f"writing {path} failed: {err.strerror or err}") from err
        paths.append(path)
    return paths
