"""The viewer's sparse-attention and correspondence panels, read with the library's own functions.

Each answer is a JSON-ready dict, or ``error`` saying why, as :class:`cogattn.view.data.RunView`'s are:

* :func:`tile`: the ``tile`` map at a step, layer and head, with a token pattern's tile mask
  (:meth:`cogattn.exact.patterns.Pattern.tile_mask`) and the recall :func:`cogattn.analysis.masks.mask_recall` gives it;
* :func:`density`: from ``top_p``, the share of the S keys a video query needs to reach each mass p (the mean
  count over the video queries, divided by S);
* :func:`decay`: from ``offset``, the mass against |Δt| and against spatial distance and Radial Attention's
  exponential fit of each (:func:`cogattn.analysis.decay.decay_table`, :func:`cogattn.analysis.decay.mean_decay`);
* :func:`track`: from ``frame_max``, a video point's matched (row, col) and its probability in every latent
  frame (:func:`cogattn.analysis.tracks.track`), with the pixel frame of the video to draw each one over.

run.json's options (``top_p``'s masses, the patterns, ``tile_shape``) and the records are values of a run folder
anyone may have written: each is checked before it is used (:func:`options`), a pattern is one of the names
the run lists, and a record whose shape or key tokens do not fit the layout is an error in its panel.
"""

from __future__ import annotations

import functools
import math

import torch

from ..analysis.decay import decay_table, mean_decay
from ..analysis.maps import aggregate
from ..analysis.masks import mask_recall
from ..analysis.tracks import frame_matches
from ..analysis.tracks import track as match_track
from ..errors import NotRecordedError, StoreError
from ..exact.patterns import DEFAULT_PATTERNS, parse
from ..exact.reducers.ranked import check_top_p
from ..items import pick_item
from ..layout import TokenLayout

__all__ = ["decay", "density", "options", "tile", "tile_labels", "track"]

_ERRORS = (NotRecordedError, StoreError, ValueError)
_MISFIT = "the run's files do not agree"


def options(run) -> dict:
    """The options the panels need, from run.json's selection, each `None` where run.json holds something
    else: ``tile_shape``, ``top_p`` (the masses p), and ``patterns`` (the names that outline a tile mask: the
    run's ``patterns`` where it lists them, else :data:`cogattn.exact.patterns.DEFAULT_PATTERNS`; a name the
    library does not parse, such as a callable's, is left out)."""
    sel = run.meta.get("selection")
    if not isinstance(sel, dict):
        return {"tile_shape": None, "top_p": None, "patterns": []}
    try:
        shape = run.tile_shape
    except StoreError:
        shape = None
    try:
        ps = list(check_top_p(sel.get("top_p", (0.5, 0.9, 0.95, 0.99))))
    except ValueError:
        ps = None
    names = sel.get("patterns")
    names = names if isinstance(names, list) and names else list(DEFAULT_PATTERNS)
    patterns = []
    for name in names:
        if isinstance(name, str) and len(name) <= 40 and name not in patterns:
            try:
                parse(name, shape or (4, 4, 4))
                patterns.append(name)
            except (ValueError, TypeError):
                pass
    return {"tile_shape": None if shape is None else list(shape), "top_p": ps, "patterns": patterns}


def tile_labels(layout: TokenLayout, tile_shape: tuple[int, int, int]) -> list[str]:
    """A name for each group of the ``tile`` map: ``"text"``, then ``"t{t} y{y} x{x}"`` (the tile's place
    along latent frames, patch rows and patch columns) in the map's (t, y, x) row-major order."""
    nt, nh, nw = layout.tile_counts(tile_shape)
    tiles = [f"t{k // (nh * nw)} y{k // nw % nh} x{k % nw}" for k in range(nt * nh * nw)]
    return ["text"] * layout.text_groups + tiles


@functools.lru_cache(maxsize=16)
def _tile_mask(layout: TokenLayout, tile_shape: tuple[int, int, int], name: str) -> torch.Tensor:
    """A pattern's ``(N, N)`` tile mask, made once per layout (it folds every token pair)."""
    return parse(name, tile_shape).tile_mask(layout, tile_shape)


def tile(view, step: int, layer: int | str, head: int | str, pattern: str = "none", item=None) -> dict:
    """The ``tile`` map with ``pattern``'s tile mask (one of :func:`options`' ``patterns``, or ``"none"``) and
    its recall, :func:`cogattn.analysis.masks.mask_recall` on ``kind="tile"`` (of batch slot ``item``, the head or
    every head's mean, the layer or the mean of the layers held at the step)."""
    run = view.run
    allowed = options(run)["patterns"]
    if pattern != "none" and pattern not in allowed:
        return {"error": f"pattern={str(pattern)[:60]!r}; choose 'none' or one of this run's patterns {allowed}."}
    payload = view.map("tile", step, layer, head, item=item)
    if "error" in payload:
        return payload
    lay = run.layout
    try:
        if lay is None:
            raise StoreError("run.json has no layout, so the tile map's groups are not known")
        shape = run.tile_shape
        groups = lay.text_groups + math.prod(lay.tile_counts(shape))  # counted before any label is made
        if payload["shape"] != [groups] * 2:
            raise StoreError(
                f"the tile record holds a {payload['shape']} map, but tile_shape {list(shape)} on the grid "
                f"{lay.grid} gives {groups} groups: the run's files do not agree"
            )
        payload = {**payload, "labels": tile_labels(lay, shape), "tile_shape": list(shape)}
        if pattern == "none":
            return payload
        keep = _tile_mask(lay, shape, pattern)
        layers = view.layers_at("tile", step, layer)
        layers = [layers] if isinstance(layers, int) else layers
        table = mask_recall(run, keep, steps=[int(step)], layers=layers, kind="tile")
    except _ERRORS as err:
        return {"error": str(err)}
    table = table[table["item"] == pick_item(run, item)]
    if head != "mean":
        table = table[table["head"] == int(head)]
    recall = float(table["recall"].mean())
    return {**payload, "pattern": pattern, "mask": keep.flatten().int().tolist(), "recall": recall}


def density(view, step: int, layer: int | str, head: int | str, item=None) -> dict:
    """The density curve of ``top_p``: for each mass p of the run's ``top_p``, the mean over the video queries
    of the fewest keys whose largest probabilities reach p (``counts``), and that count as a share of the S
    keys (``share``); of one head or the heads' mean, one layer or the mean of the layers held at the step."""
    run, lay = view.run, view.run.layout
    ps = options(run)["top_p"]
    heads = head if head == "mean" else int(head)
    try:
        if lay is None:
            raise StoreError("run.json has no layout, so the video's queries are not known")
        if ps is None:
            raise StoreError("run.json's selection.top_p is not a list of masses in (0, 1]: the curve has no x axis")
        layers = view.layers_at("top_p", step, layer)
        m = aggregate(run, "top_p", steps=int(step), layers=layers, heads=heads, batch=item)
    except _ERRORS as err:
        return {"error": str(err)}
    if tuple(m.shape) != (lay.seq_len, len(ps)):
        return {
            "error": f"the top_p record holds {list(m.shape)} per head, but the layout's {lay.seq_len} tokens and "
            f"run.json's top_p {ps} give [{lay.seq_len}, {len(ps)}]: the run's files do not agree"
        }
    counts = m[lay.grid_tokens].double().mean(0)
    return {"p": ps, "counts": counts.tolist(), "share": (counts / lay.seq_len).tolist(), "keys": lay.seq_len}


def decay(view, step: int, layer: int | str, head: int | str, item=None) -> dict:
    """The offset decay: mass against |Δt| (``dt``, in latent frames) and against the rounded spatial distance
    (``ds``, in patches), the exponential fit of each (``t_fit``, ``s_fit``: ``rate``, ``scale``, ``r2``) and its
    values at those distances (``t_fitted``, ``s_fitted``),
    of one head or the heads' mean and one layer or the layers' mean: :func:`cogattn.analysis.decay.mean_decay` by step
    over those rows of :func:`cogattn.analysis.decay.decay_table` (a mean curve, fitted again)."""
    run, lay = view.run, view.run.layout
    try:
        if lay is None:
            raise StoreError("run.json has no layout, so the offsets' distances are not known")
        layers = view.layers_at("offset", step, layer)
        layers = [layers] if isinstance(layers, int) else layers
        want = [2 * lay.frames - 1, 2 * lay.height - 1, 2 * lay.width - 1]
        for n in layers if isinstance(layers, list) else []:  # "all": none held, decay_table says why
            got = list(run.record_info("offset", int(step), n).shape)
            if got[2:] != want:
                raise StoreError(
                    f"the offset record of step {step}, layer {n} has shape {got}, not [B, H, *{want}] on the "
                    f"grid {lay.grid}: the run's files do not agree"
                )
        table = decay_table(run, steps=[int(step)], layers=layers)
    except _ERRORS as err:
        return {"error": str(err)}
    table = table[table["item"] == pick_item(run, item)]
    if head != "mean":
        table = table[table["head"].map(lambda h: h == int(head))]
    if table.empty:
        return {"error": f"head {head} was not recorded in offset (heads: {run.head_ids or 'their mean'})"}
    row = mean_decay(table, by="step").iloc[0]
    curve = lambda p: [float(row[c]) for c in row.index if c.startswith(f"{p}_") and c[3:].isdigit()]  # noqa: E731
    fit = lambda p: {k: float(row[f"{p}_{k}"]) for k in ("rate", "scale", "r2")}  # noqa: E731
    out = {"dt": curve("dt"), "ds": curve("ds"), "t_fit": fit("t"), "s_fit": fit("s")}
    for axis, p in (("dt", "t"), ("ds", "s")):  # the fit at each distance, for the page to draw beside the curve
        a, rate = out[f"{p}_fit"]["scale"], out[f"{p}_fit"]["rate"]
        out[f"{p}_fitted"] = [a * math.exp(min(-rate * d, 700.0)) for d in range(len(out[axis]))]  # no overflow
    return {**out, "text_mass": float(table["text_mass"].mean())}


def track(view, step: int, layer: int | str, head: int | str, frame: int, row: int, col: int, item=None) -> dict:
    """A video point's track from ``frame_max``: :func:`cogattn.analysis.tracks.track` of one map (one layer; one head,
    or the head-mean row of a run recorded with ``heads="mean"``), and ``under``: for each latent frame, the
    pixel frame of the video drawn under it (the middle of the frames it decodes to; `None` without a video).
    A mean of layers or of recorded heads is a ``hint`` to choose one (argmaxes do not average), not an error."""
    run, lay = view.run, view.run.layout
    if lay is None:
        return {"error": "run.json has no layout, so a video point cannot be located."}
    if layer == "mean":
        return {"hint": "A track is the argmax of one map, and argmaxes of layers do not average: choose a layer."}
    if head == "mean" and run.head_ids is not None:
        return {
            "hint": "A track is the argmax of one head's row, and frame_max was recorded per head: choose a head "
            "(or record frame_max with heads='mean')."
        }
    point = (int(frame), int(row), int(col))
    heads = head if head == "mean" else int(head)
    try:
        view.layers_at("frame_max", step, layer)  # a layer a cache skipped: its error says so
        got = frame_matches(run, int(step), int(layer), heads, item)
        shape, want = list(got.indices.shape), [lay.seq_len, lay.num_groups]
        if shape != want or list(got.values.shape) != want:
            raise StoreError(f"the frame_max record holds {shape} per head and item, not {want}: {_MISFIT}")
        video = got.indices[lay.grid_tokens, lay.text_groups :]  # (V, F): each frame's match must lie in that frame
        first = lay.grid_tokens.start + torch.arange(lay.frames) * lay.frame_tokens
        if not ((video == -1) | ((video >= first) & (video < first + lay.frame_tokens))).all():
            raise StoreError(f"the frame_max record names key tokens outside the frames they match in: {_MISFIT}")
        t = match_track(run, point, int(step), int(layer), heads, item)
    except _ERRORS as err:
        return {"error": str(err)}
    pixels = view.files.frame_count()
    of_pixel = lay.latent_of_pixel(pixels) if pixels else []
    under = []
    for f in range(lay.frames):
        mine = [i for i, latent in enumerate(of_pixel) if latent == f]
        under.append(mine[len(mine) // 2] if mine else None)
    return {
        "point": list(point),
        "positions": t.positions.tolist(),
        "confidence": t.confidence.double().tolist(),
        "grid": [lay.frames, lay.height, lay.width],
        "under": under,
    }
