"""Correspondence read from ``frame_max`` records: a video point's track over the latent frames (DiffTrack's
matching) and the motion field between two frames (DiTFlow's attention motion flow). Numbers only; no plots.

A match is the argmax of one attention map: for a query token, the key of a latent frame with the highest
probability, which ``frame_max`` keeps for every query and frame. So every function here reads one map:
one step, one layer, and one head, or the head-mean row where the run was recorded with ``heads="mean"``
(``frame_max`` of the head-mean row, whose argmax is that of the mean attention). Matches of several maps
do not combine into the match of their mean (the argmax of a mean of probabilities needs the whole rows,
which ``frame_max`` does not keep): call once per map and compare or vote over the results.

    from cogattn.analysis.tracks import track, motion_field

    t = track(run, (0, 12, 20), step=10, layer=16, head=3)  # t.positions (F, 2), t.confidence (F,)
    flow = motion_field(run, 0, 4, step=10, layer=16, head=3)  # (Hp, Wp, 2): (dy, dx) of each patch, NaN: no match
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from ..exact.reducers.ranked import FrameMax
from ..items import pick_item
from ..runs.run import MapSource
from .layouts import for_layers
from .maps import head_positions

__all__ = ["Track", "frame_matches", "motion_field", "track"]


class Track(NamedTuple):
    """A video point's matches, one per latent frame.

    Attributes:
        positions (`torch.Tensor`): ``(F, 2)`` int64, the (patch row, patch column) of the highest-attention
            key in each latent frame (the first on a tie); −1 where no key of the frame has attention.
        confidence (`torch.Tensor`): ``(F,)`` float32, the attention probability of that key (0 where none):
            the matched probability itself, not a normalised score.
    """

    positions: torch.Tensor
    confidence: torch.Tensor


def frame_matches(
    source: MapSource, step: int, layer: int, head: int | str = "mean", batch: int | str | None = None
) -> FrameMax:
    """The ``frame_max`` of one map: ``values`` and key ``indices`` ``(S, G)`` of one batch item and one head.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``frame_max``.
        step (`int`), layer (`int`): the map's denoising step and layer.
        head (`int | "mean"`, defaults to ``"mean"``): a recorded model head, or ``"mean"`` for a run recorded
            with ``heads="mean"`` (its head-mean row).
        batch (`int | "cond" | "uncond"`, *optional*): the batch slot (:func:`cogattn.items.pick_item`).

    Raises:
        ValueError: ``head="mean"`` on a run that recorded heads one by one (the argmax of the mean row is
            not made from the heads' argmaxes), or a head that is neither.
        NotRecordedError: ``frame_max``, the step, the layer or the head was not recorded.
    """
    if not isinstance(head, str) and hasattr(head, "__index__") and not isinstance(head, bool):
        head = operator.index(head)  # a NumPy integer too
    if isinstance(head, bool) or not (isinstance(head, int) or head == "mean"):
        raise ValueError(
            f"head={head!r}; pass one recorded head index, or 'mean' for a run recorded with heads='mean'."
        )
    if head == "mean" and source.head_ids is not None:
        raise ValueError(
            "head='mean', but this frame_max was recorded per head: the argmax of the head-mean row is not made "
            "from each head's argmax. Pass one head, or record frame_max with heads='mean'."
        )
    item = pick_item(source, batch)
    got = source.get("frame_max", step, layer)
    slot = 0 if head == "mean" else head_positions(source.head_ids, got.values.shape[1], head)[0]
    if not 0 <= item < got.values.shape[0]:
        raise ValueError(f"batch={item} is out of range: {got.values.shape[0]} batch item(s) were recorded.")
    return FrameMax(got.values[item, slot], got.indices[item, slot])


def _grid_matches(source: MapSource, matches: FrameMax, query: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, col) of each frame's match of ``query`` and its probability: ``(F, 2)``, ``(F,)``."""
    lay = source.layout
    frames = slice(lay.text_groups, lay.text_groups + lay.frames)  # the video's groups: not the text's
    values, tokens = matches.values[query, frames], matches.indices[query, frames]
    within = (tokens - lay.grid_tokens.start) % lay.frame_tokens  # a key's place inside its frame
    positions = torch.stack([within // lay.width, within % lay.width], -1)
    return torch.where((tokens >= 0)[:, None], positions, -1), torch.where(tokens >= 0, values, 0.0)


def _index(x) -> int | None:
    """``x`` as an int where it is one (a NumPy or torch integer too; not a bool), else `None`."""
    try:
        return None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        return None


def _point(source: MapSource, point) -> int:
    lay, given = source.layout, point
    point = [_index(x) for x in point] if isinstance(point, (tuple, list)) else None
    if point is None or len(point) != 3 or None in point:
        raise ValueError(f"point={given!r}; pass a video point (frame, row, col) on the latent grid {lay.grid}.")
    if not all(0 <= x < n for x, n in zip(point, lay.grid)):
        raise ValueError(f"point={tuple(point)} is outside the latent grid (frames, rows, cols) = {lay.grid}.")
    return lay.token_index(*point)


def track(
    source: MapSource,
    point: tuple[int, int, int],
    step: int,
    layer: int,
    head: int | str = "mean",
    batch: int | str | None = None,
) -> Track:
    """The track of a video point: for every latent frame, the (row, col) of the key the point's query attends
    most in that frame, and that key's probability (DiffTrack's matching: an argmax over each frame's keys).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``frame_max``.
        point (`tuple[int, int, int]`): (latent frame, patch row, patch column) of the query.
        step, layer, head, batch: one map, as in :func:`frame_matches`.

    Returns:
        `Track`: ``positions`` ``(F, 2)`` and ``confidence`` ``(F,)``; the point's own frame is matched too.
    """
    source = for_layers(source, "frame_max", layer)  # a layer of another layout: its own
    query = _point(source, point)
    return Track(*_grid_matches(source, frame_matches(source, step, layer, head, batch), query))


def motion_field(
    source: MapSource,
    frame_a: int,
    frame_b: int,
    step: int,
    layer: int,
    head: int | str = "mean",
    batch: int | str | None = None,
) -> torch.Tensor:
    """DiTFlow's attention motion flow from latent frame ``frame_a`` to ``frame_b``: for every patch (y, x) of
    frame a, the displacement ``(dy, dx)`` to the key of frame b its query attends most (argmax matching).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``frame_max``.
        frame_a (`int`), frame_b (`int`): latent frames, the queries' and the keys'.
        step, layer, head, batch: one map, as in :func:`frame_matches`.

    Returns:
        `torch.Tensor`: ``(Hp, Wp, 2)`` float32, ``[y, x] = (row − y, col − x)`` of the match (whole patches, exact);
        NaN where frame b has no key with attention for that patch (no match: a mask that hides frame b from it,
        SkyReels-V2's block-causal one), never 0, which is a match that did not move.
    """
    source = for_layers(source, "frame_max", layer)  # a layer of another layout: its own
    lay = source.layout
    for name, f in (("frame_a", frame_a), ("frame_b", frame_b)):
        if (i := _index(f)) is None or not 0 <= i < lay.frames:
            raise ValueError(f"{name}={f!r}; pass a latent frame index in 0..{lay.frames - 1}.")
    frame_a, frame_b = int(frame_a), int(frame_b)
    matches = frame_matches(source, step, layer, head, batch)
    queries = lay.grid_tokens.start + frame_a * lay.frame_tokens + torch.arange(lay.frame_tokens)
    tokens = matches.indices[queries, lay.text_groups + frame_b]
    within = tokens - lay.grid_tokens.start - frame_b * lay.frame_tokens
    here = torch.arange(lay.frame_tokens)
    flow = torch.stack([within // lay.width - here // lay.width, within % lay.width - here % lay.width], -1).float()
    return torch.where((tokens >= 0)[:, None], flow, torch.nan).view(lay.height, lay.width, 2)
