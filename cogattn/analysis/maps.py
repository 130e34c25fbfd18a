"""The numbers behind the plots: maps averaged over steps and layers with heads chosen or averaged, what
a source recorded, and which recorded row holds a query token. No plotting here (no matplotlib).

A *source* is any :class:`cogattn.runs.run.MapSource`: an in-memory :class:`cogattn.Recording` or a run
folder opened with :func:`cogattn.load`.

The head table (:mod:`cogattn.analysis.head_stats`) and block-sparse mask recall (:mod:`cogattn.analysis.masks`) build on
these and live in their own modules.

```python
from cogattn.analysis import aggregate
aggregate(rec, "frame")                              # (G, G): mean over recorded steps, layers, heads
aggregate(rec, "video_to_text", steps=0, heads="all")  # (H, T, F, Hp, Wp)
aggregate(rec, "frame", steps="transformer_2")       # Wan 2.2 A14B: the mean over one expert's steps
```

Wan 2.2 A14B runs two transformers (experts): ``transformer`` for the high-noise steps, ``transformer_2``
for the rest, each with its own weights, so layer L of one is not layer L of the other. An average over
steps keeps to one expert: a steps selector may name one (``steps="transformer_2"``), and steps that span
both are refused with the steps of each (:func:`expert_steps`, :func:`check_one_expert`).

Under classifier-free guidance the recorded batch may hold the unconditional items (the negative prompt's)
beside the conditional ones (``batch="all"``). Every reader here shows the first conditional item unless told
otherwise (``batch=None``, :func:`cogattn.items.pick_item`), and :func:`cogattn.items.item_label` names the
item a figure shows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ..errors import NotRecordedError
from ..exact.reducers import REDUCERS
from ..items import as_index, pick_item
from ..runs.run import MapSource, Run
from .layouts import check_one_layout, of_generation

__all__ = [
    "aggregate",
    "check_one_expert",
    "choose",
    "expert_steps",
    "head_positions",
    "locate_query",
    "pick",
    "recorded",
    "recorded_kinds",
    "skipped_pairs",
    "steps_of_expert",
]


def recorded_kinds(source: MapSource) -> list[str]:
    """The kinds ``source`` holds at least one record of, sorted.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
    """
    keys = source.keys()
    return sorted({k[0] for k in keys})


def recorded(source: MapSource, kind: str, what: str) -> list[int]:
    """Steps or layers recorded for ``kind``.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        kind (`str`): one of ``cogattn.KINDS``.
        what (`str`): ``"step"`` or ``"layer"``.

    Returns:
        `list[int]`: sorted, each once.

    Raises:
        ValueError: ``kind`` is no kind, or ``what`` is neither ``"step"`` nor ``"layer"``.
        NotRecordedError: the source holds no record of ``kind``.
    """
    if kind not in REDUCERS:
        raise ValueError(f"unknown kind {kind!r}; the kinds are {list(REDUCERS)}.")
    if what not in ("step", "layer"):
        raise ValueError(f"what={what!r}; choose 'step' or 'layer'.")
    held = source.keys()
    keys = [k for k in held if k[0] == kind]
    if not keys:
        raise NotRecordedError(
            f"kind {kind!r} was not recorded; this source holds {recorded_kinds(source)}. Add it to record(kinds=...)."
        )
    return sorted({k[1] if what == "step" else k[2] for k in keys})


def choose(source: MapSource, kind: str, what: str, value: str | int | Sequence[int]) -> list[int]:
    """Resolve a steps or layers selector against what was recorded for ``kind``.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        kind (`str`): one of ``cogattn.KINDS``.
        what (`str`): ``"step"`` or ``"layer"``.
        value (`"all" | int | Sequence[int] | str`): ``"all"`` (every recorded one; layers: those of the generation's
            layout, :mod:`cogattn.analysis.layouts`), an index, or a list; for steps also an expert's name
            (``"transformer_2"``: every recorded step it ran).

    Returns:
        `list[int]`: the chosen steps or layers, in the order given.

    Raises:
        ValueError: ``value`` is malformed or empty, or names no expert of the source.
        NotRecordedError: the kind, or one of the chosen steps or layers, was not recorded.
    """
    have = recorded(source, kind, what)
    if what == "step" and isinstance(value, str) and value != "all":
        return steps_of_expert(source, have, value, repr(kind))
    if what == "layer" and value == "all":  # the generation's layers, not those of another layout (Motif's decoder)
        have = of_generation(source, have)
    return pick(have, what, value, repr(kind))


def _expert_names(source: MapSource) -> list[str]:
    """Per step, the transformer that ran it (``source.experts``; empty for a source that does not say)."""
    return list(getattr(source, "experts", None) or [])


def expert_steps(source: MapSource, steps: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Which transformer ran which steps: ``{expert: its steps}``, experts in the order they first ran.

    Wan 2.2 A14B gives ``{"transformer": [0, 1, ...], "transformer_2": [..., 49]}``; CogVideoX and
    Wan 2.1 one expert, ``"transformer"``.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        steps (`Sequence[int] | None`, defaults to `None`): the steps to sort out; `None` is every step
            recorded for any kind.
    """
    names = _expert_names(source)
    groups: dict[str, list[int]] = {}
    for s in sorted({k[1] for k in source.keys()}) if steps is None else steps:
        groups.setdefault(names[s] if s < len(names) else "transformer", []).append(s)
    return groups


def recorded_maps(source: MapSource, kind: str, steps="all", layers="all"):
    """``(step, timestep, expert, layer)`` of each record of ``kind`` at the chosen steps and layers (selectors as
    :func:`choose` takes them), in step then layer order, with the pairs a cache skipped left out; a timestep
    the source does not know is NaN. Returns ``(maps, steps, layers)``, the lists chosen."""
    step_list, layer_list = choose(source, kind, "step", steps), choose(source, kind, "layer", layers)
    experts = {s: name for name, group in expert_steps(source, step_list).items() for s in group}
    timesteps, keys = list(source.timesteps or []), set(source.keys())
    maps = [
        (step, float(timesteps[step]) if step < len(timesteps) and timesteps[step] is not None else float("nan"),
         experts[step], layer)
        for step in step_list
        for layer in layer_list
        if (kind, step, layer) in keys
    ]  # fmt: skip
    return maps, step_list, layer_list


def steps_of_expert(source: MapSource, have: list[int], name: str, of: str) -> list[int]:
    """The steps among ``have`` that the expert ``name`` ran (a steps selector naming an expert).

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        have (`list[int]`): the recorded steps to choose from, sorted.
        name (`str`): an expert of the source, e.g. ``"transformer_2"``.
        of (`str`): what recorded ``have``, for the errors.

    Raises:
        ValueError: ``name`` is no expert of the source.
        NotRecordedError: the expert ran none of ``have``.
    """
    groups = expert_steps(source, have)
    known = list(dict.fromkeys(_expert_names(source) + list(groups)))
    if name not in known:
        experts = ", ".join(repr(e) for e in known)
        raise ValueError(f"steps={name!r}; use 'all', an expert of this source ({experts}), an index, or a list.")
    if name not in groups:
        raise NotRecordedError(f"expert {name!r} ran no recorded step of {of}; recorded steps are {have}.")
    return groups[name]


def check_one_expert(groups: dict[str, list[int]], what: str, fix: str | None = None) -> None:
    """Refuse an average over steps that span several experts.

    Args:
        groups (`dict[str, list[int]]`): the steps averaged by expert (:func:`expert_steps`).
        what (`str`): what would be averaged, for the message.
        fix (`str | None`, defaults to `None`): what to pass instead; `None`: a steps selector naming one expert.

    Raises:
        ValueError: ``groups`` holds more than one expert.
    """
    if len(groups) < 2:
        return
    spans = "; ".join(f"{name} ran steps {steps}" for name, steps in groups.items())
    names = " or ".join(f"steps={name!r}" for name in groups)
    raise ValueError(
        f"{what} would mix the steps of {len(groups)} experts ({spans}), and layer L of one is not layer L "
        f"of the other (each has its own weights). {fix or f'Pass {names} (or a list of steps of one expert).'}"
    )


def pick(have: list[int], what: str, value: str | int | Sequence[int], of: str) -> list[int]:
    """``value`` (``"all"``, an index or a list) made concrete against the recorded steps or layers ``have``
    (sorted); ``of`` names what recorded them in the errors. Raises as :func:`choose`."""
    if isinstance(value, str):
        if value != "all":
            raise ValueError(f"{what}s={value!r}; use 'all', an index, or a list of indices.")
        return have
    value = as_index(value)
    try:
        wanted = [value] if isinstance(value, int) else list(value)
    except TypeError:  # a float, None: no index and no list of them
        raise ValueError(f"{what}s={value!r}; use 'all', an index, or a list of indices.") from None
    wanted = [as_index(v) for v in wanted]
    if not wanted:
        raise ValueError(f"{what}s is empty; recorded {what}s of {of} are {have}.")
    for v in wanted:
        if v not in have:
            raise NotRecordedError(f"{what} {v!r} of {of} was not recorded; recorded {what}s are {have}.")
    return wanted


def head_positions(head_ids: Sequence[int] | None, num_slots: int, heads: str | int | Sequence[int]) -> list[int]:
    """Positions in a result's head axis of the model heads ``heads``.

    Args:
        head_ids (`Sequence[int] | None`): the source's ``head_ids``: the model head of each slot, or
            `None` when heads were averaged at record time.
        num_slots (`int`): length of the result's head axis.
        heads (`"mean" | "all" | int | Sequence[int]`): the selection; ``"mean"`` and ``"all"`` take every slot.

    Returns:
        `list[int]`: slot positions, one per chosen head.

    Raises:
        ValueError: ``heads`` is malformed.
        NotRecordedError: a chosen head was not recorded (or only their mean was).
    """
    heads = as_index(heads) if isinstance(heads, (str, int)) or hasattr(heads, "__index__") else heads
    if heads in ("all", "mean"):
        return list(range(num_slots))
    if isinstance(heads, str) or (not isinstance(heads, int) and not heads):
        raise ValueError(f"heads={heads!r}; use 'mean', 'all', a head index, or a list of head indices.")
    if head_ids is None:
        raise NotRecordedError(
            f"heads={heads!r}, but this source was recorded with heads='mean' and holds only the mean over "
            "heads; use heads='mean', or record with heads='all' (or a list) for single heads."
        )
    ids = list(head_ids)
    if len(ids) != num_slots:  # heads="all" of an attention with heads of its own (LTX-2's audio): all of them
        ids = list(range(num_slots))
    positions = []
    for h in [heads] if isinstance(heads, int) else [as_index(h) for h in heads]:
        if h not in ids:
            raise NotRecordedError(f"head {h!r} was not recorded; recorded heads are {ids}.")
        positions.append(ids.index(h))
    return positions


def skipped_pairs(source: MapSource, kind: str, steps: Sequence[int], layers: Sequence[int]) -> set[tuple[int, int]]:
    """The ``(step, layer)`` among ``steps`` × ``layers`` that hold no ``kind`` record because a cache skipped
    that attention (``source.skipped``): averages leave them out, and figures say how many."""
    skips = getattr(source, "skipped", None)
    gone = {(s, layer) for s, layer, _ in skips.calls} if skips else set()
    held, steps, layers = (set(source.keys()) if gone else set()), set(steps), set(layers)
    return {(s, n) for s, n in gone if s in steps and n in layers and (kind, s, n) not in held}  # ~ the skipped calls


def aggregate(
    source: MapSource,
    kind: str,
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "mean",
    batch: int | str | None = None,
    row: int | slice | None = None,
) -> torch.Tensor:
    """One batch item's map, averaged over the chosen steps and layers, with heads chosen or averaged.

    Head selection reads like indexing: an int drops the head axis, a list or ``"all"`` keeps it, and
    ``"mean"`` averages it away. So ``aggregate(rec, "frame")`` is ``(G, G)`` and
    ``aggregate(rec, "frame", heads="all")`` is ``(H, G, G)``.

    Wan 2.2 A14B: the steps averaged must all be one expert's (``steps="transformer"`` or
    ``"transformer_2"``; see :func:`expert_steps`), since layer L of one is not layer L of the other. To
    pool both on purpose, weigh each expert's mean by its number of steps.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        kind (`str`): any kind but ``"topk"`` and ``"frame_max"`` (values and key indices do not average: read
            them with ``source.get``; matches with :mod:`cogattn.analysis.tracks`). ``top_p`` averages to a mean count of
            keys, which is meaningful.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): steps to average (``"all"``:
            every recorded step of the kind), all of one expert's; an expert's name takes its steps. The
            ``(step, layer)`` a cache skipped are left out of the mean (:func:`skipped_pairs`).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers to average.
        heads (`"mean" | "all" | int | Sequence[int]`, defaults to ``"mean"``): model head indices.
        batch (`int | "cond" | "uncond"`, *optional*): slot of the recorded batch axis, or the first
            conditional / unconditional item; by default the first conditional item under guidance (the
            prompt's, not the negative prompt's), else slot 0 (:func:`cogattn.items.pick_item`).
        row (`int | slice`, *optional*): one row of the kind's first axis after the heads (a text token of
            ``video_to_text``, a query token of ``full``, a query of ``query``), dropped from the result, or
            a slice of rows, kept as an axis. From a run on disk only those rows are read (memory-mapped
            slices), so one token of a 100 GB record costs its own size.

    Returns:
        `torch.Tensor`: float32, the kind's shape without ``B`` (and without ``H`` unless kept, without the
        row axis when ``row`` is given).

    Raises:
        ValueError: a malformed selector, steps of two experts (Wan 2.2 A14B), or ``batch`` or ``row`` out of
            range.
        TypeError: ``row`` is neither an integer nor a slice.
        NotRecordedError: the kind, a step, a layer or a head was not recorded.
    """
    if kind in ("topk", "frame_max"):
        raise ValueError(
            f"{kind} records are values and key indices, which do not average; read them with source.get"
            + (" (matches and tracks: cogattn.analysis.tracks)." if kind == "frame_max" else ".")
        )
    step_list = choose(source, kind, "step", steps)
    check_one_expert(expert_steps(source, step_list), f"the mean of {kind!r} over steps={steps!r}")
    layer_list = choose(source, kind, "layer", layers)
    check_one_layout(source, layer_list, f"the mean of {kind!r} over layers={layers!r}")
    batch = pick_item(source, batch)
    gaps = skipped_pairs(source, kind, step_list, layer_list)
    pairs = [(s, layer) for s in step_list for layer in layer_list if (s, layer) not in gaps]
    if not pairs:  # every chosen map was skipped: say by what
        source.get(kind, step_list[0], layer_list[0])
    total = None
    for s, layer in pairs:
        t = _item(source, kind, s, layer, batch, row).double()
        total = t if total is None else total + t
    mean = (total / len(pairs)).float()
    ids = source.head_ids_of(kind) if hasattr(source, "head_ids_of") else source.head_ids  # LTX-2 audio: its own
    positions = head_positions(ids, mean.shape[0], heads)
    heads = as_index(heads) if not isinstance(heads, (str, list, tuple)) else heads  # an int drops the axis
    if heads == "mean":
        return mean.mean(0)
    if isinstance(heads, int):
        return mean[positions[0]]
    return mean[positions]


def _item(source: MapSource, kind: str, step: int, layer: int, batch: int, row: int | slice | None) -> torch.Tensor:
    """Batch item ``batch`` of one record, ``(H, ...)``, or its ``row`` alone ``(H, ...)``: from a run on
    disk, only what is asked for is read."""
    if row is not None and not isinstance(row, slice):
        if isinstance(row, bool):
            raise TypeError(f"row={row!r}: pass a row index or a slice of rows.")
        row = operator.index(row)  # a numpy or tensor integer too; anything else is a TypeError
    if row is None or not isinstance(source, Run):
        t = source.get(kind, step, layer)
        shape = tuple(t.shape)
    else:
        shape = source.record_info(kind, step, layer).shape
    if not 0 <= batch < shape[0]:
        raise ValueError(f"batch={batch} is out of range: {shape[0]} batch item(s) were recorded.")
    if isinstance(row, int) and not (len(shape) > 2 and 0 <= row < shape[2]):
        rows = shape[2] if len(shape) > 2 else 0
        raise ValueError(f"row={row} is out of range: {kind!r} has {rows} rows (its axis after the heads).")
    if row is None:
        return t[batch]
    if isinstance(source, Run):
        return source.get(kind, step, layer, index=(batch, slice(None), row))
    return t[batch, :, row]


def locate_query(source: MapSource, query: int | tuple[int, int, int]) -> tuple[str, int, int]:
    """Where the attention row of one query token is kept: ``(kind, row, token)``.

    ``aggregate(source, kind, ...)[row]`` is then its row over all ``S`` keys. A recorded query is a row of
    kind ``query``; any other video point is a row of kind ``full`` when that was recorded.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        query (`int | tuple[int, int, int]`): a position among the recorded queries (``source.queries``),
            or a video coordinate (latent frame, patch row, patch column).

    Returns:
        `tuple[str, int, int]`: the kind (``"query"`` or ``"full"``), the row in its map, and the query's
        token index in the joint sequence.

    Raises:
        TypeError: ``query`` is neither a position nor a coordinate.
        ValueError: the coordinate is outside the latent grid.
        NotRecordedError: the query's row was not recorded.
    """
    layout = source.layout
    held = list(source.queries)
    tokens = [q if isinstance(q, int) else layout.token_index(*q) for q in held]
    kinds = recorded_kinds(source)
    has_query = "query" in kinds
    if isinstance(query, int) and not isinstance(query, bool):
        if not has_query:
            raise NotRecordedError(
                f"query={query} is a position among the recorded queries, but kind 'query' was not recorded; "
                f"this source holds {kinds}. Pass a (frame, row, col) coordinate (with kind 'full' recorded)."
            )
        if not 0 <= query < len(held):
            raise NotRecordedError(
                f"query={query} is a position among the recorded queries {held}; pass one of "
                f"0..{len(held) - 1}, or a (frame, row, col) coordinate."
            )
        return "query", query, tokens[query]
    if isinstance(query, (tuple, list)) and len(query) == 3:
        token = layout.token_index(*query)
        if has_query and token in tokens:
            return "query", tokens.index(token), token
        if "full" in kinds:  # a full map holds every query's row
            return "full", token, token
        raise NotRecordedError(
            f"query {tuple(query)} was not recorded; recorded queries are {held}. Record it with "
            f"queries=[{tuple(query)}, ...] (or record kind 'full')."
        )
    raise TypeError(f"query must be a position among the recorded queries or (frame, row, col), got {query!r}.")
