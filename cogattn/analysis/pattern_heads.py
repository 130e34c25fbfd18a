"""Heads labelled by output error: for every step, layer, head and batch item, the output error each token
pattern causes (the ``pattern_error`` kind) and the label Sparse VideoGen gives the head, the pattern with
the lowest error; and how often those labels change from one step to the next. Numbers only; the head atlas
(:func:`cogattn.plot.head_atlas`) draws the labels.

```python
from cogattn.analysis.pattern_heads import label_changes, pattern_table
with cogattn.record(pipe, kinds=("pattern_error",), patterns=("spatial", "temporal"), heads="all") as rec:
    pipe(prompt=...)
table = pattern_table(rec)          # one row per (step, layer, head, item): error_<pattern>, label
label_changes(table)                # per head: label changes between consecutive steps, the usual label
```

Beside the mass-based label of :mod:`cogattn.analysis.head_stats` (where a head's attention *goes*), this one says which
pattern *costs least* when the head runs sparse: a head can put most of its mass in its own frame and still
be served better by the temporal pattern, when the mass it would drop changes the output more.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import NotRecordedError, StoreError
from ..items import pick_item
from ..runs.run import MapSource
from .maps import head_positions, recorded_kinds, recorded_maps

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ErrorLabelRule", "label_changes", "pattern_names", "pattern_table"]

ERROR, RECALL = "pattern_error", "pattern_recall"


@dataclass(frozen=True)
class ErrorLabelRule:
    """Sparse VideoGen's label of a head: the pattern whose ``pattern_error`` is the lowest, from one row of
    :func:`pattern_table` (its ``error_<name>`` columns, in the run's pattern order).

    Ties: with the default ``margin=0`` the first of the tied patterns in the run's ``patterns`` order wins (as
    an argmin does). With ``margin > 0`` a head is labelled only where its lowest error is at most
    ``(1 − margin)`` times the second lowest, else ``"unknown"``: a head the patterns serve about equally well
    keeps no label. NaN errors are left out; a row whose errors are all NaN is ``"unknown"``.

    Args:
        margin (`float`, defaults to 0.0): the least relative lead of the best pattern over the next, in [0, 1).
    """

    margin: float = 0.0

    def __post_init__(self):
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin={self.margin!r}; use a relative lead in [0, 1) (0: the plain argmin).")

    def label(self, row: Mapping) -> str:
        """The label of one row (a pandas Series or a dict with the table's ``error_<name>`` columns)."""
        errors = [(k[len("error_") :], float(v)) for k, v in row.items() if str(k).startswith("error_")]
        errors = [(name, e) for name, e in errors if not math.isnan(e)]
        if not errors:
            return "unknown"
        best = min(range(len(errors)), key=lambda m: errors[m][1])  # the first of equal minima
        others = [e for m, (_, e) in enumerate(errors) if m != best]
        if self.margin and others and errors[best][1] > (1 - self.margin) * min(others):
            return "unknown"
        return errors[best][0]


def pattern_names(source: MapSource) -> list[str]:
    """The names of the patterns ``pattern_recall`` and ``pattern_error`` measured, in the order of their last
    axis: a recording's ``patterns`` option, or the ``selection.patterns`` run.json keeps.

    Raises:
        StoreError: run.json keeps no list of pattern names.
    """
    options = getattr(source, "options", None)
    if options is not None:  # a Recording: what its run.json says
        names = options.selection_meta().get("patterns")
    else:
        names = ((getattr(source, "meta", None) or {}).get("selection") or {}).get("patterns")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise StoreError(f"run.json's selection.patterns is {str(names)[:60]}; it should list the patterns' names.")
    return names


def pattern_table(
    source: MapSource,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "all",
    batch: int | str | None = "all",
    *,
    rule: ErrorLabelRule | None = None,
) -> pd.DataFrame:
    """One row per (step, layer, head, batch item) with a ``pattern_error`` record: the output error of every
    pattern, the mass it keeps where ``pattern_recall`` was recorded too, and the head's label.

    ``expert`` names the transformer that ran the step (Wan 2.2 A14B's low-noise steps ``"transformer_2"``),
    as in :func:`cogattn.analysis.head_stats.head_table`, whose conventions the table follows: rows sorted by step,
    layer, head slot and item; a (step, layer) a cache skipped has no rows; ``head`` is ``"mean"`` for a run
    recorded with ``heads="mean"``.

    Args:
        source (`MapSource`): a `Recording` or a `Run` that recorded ``pattern_error``.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): recorded steps; an expert's name
            (``"transformer_2"``) takes the steps it ran.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): recorded layers.
        heads (`"all" | "mean" | int | Sequence[int]`, defaults to ``"all"``): model heads; ``"mean"`` is one
            row ``"mean"`` per item, the mean error over the recorded heads (what ``heads="mean"`` records).
        batch (`"all" | int | "cond" | "uncond" | None`, defaults to ``"all"``): every recorded item, or one
            as :func:`cogattn.items.pick_item` reads it (`None`: the first conditional item).
        rule (`ErrorLabelRule | None`, defaults to `None`): the labelling rule; `None` is ``ErrorLabelRule()``.

    Returns:
        `pandas.DataFrame`: columns ``step, timestep, expert, layer, head, item``, ``error_<name>`` per pattern
        (the mean squared output error over video queries and head dimensions), ``recall_<name>`` per pattern
        where ``pattern_recall`` was recorded (NaN at a (step, layer) it missed), and ``label``. Its
        ``attrs`` keep ``batch_roles``, ``batch_items`` and ``label_rule`` (the head atlas relabels averaged rows with it).

    Raises:
        NotRecordedError: ``pattern_error``, or a chosen step, layer or head, was not recorded.
        ValueError: a malformed selector, ``batch`` out of range, or patterns that share a name.
    """
    import pandas as pd  # slow to import: only where a table is made

    rule = ErrorLabelRule() if rule is None else rule
    if not callable(getattr(rule, "label", None)):
        raise TypeError(f"rule={rule!r} has no label(row) method; pass an ErrorLabelRule or an object with one.")
    held = recorded_kinds(source)
    if ERROR not in held:
        raise NotRecordedError(
            f"the pattern table needs kind {ERROR!r} (the output error of each pattern); this source holds {held}. "
            "Record it, e.g. record(pipe, kinds=('pattern_error',), patterns=('spatial', 'temporal'), heads='all')."
        )
    names = pattern_names(source)
    if len(set(names)) < len(names):
        raise ValueError(
            f"the patterns {names} share a name; give each Pattern its own name to tell its columns apart."
        )
    maps, step_list, layer_list = recorded_maps(source, ERROR, steps, layers)
    keys = set(source.keys())
    frames = []
    for step, ts, expert, layer in maps:
        values = {"error": source.get(ERROR, step, layer)}
        if (RECALL, step, layer) in keys:
            values["recall"] = source.get(RECALL, step, layer)
        frames.append(_record_rows(source, names, (step, ts, expert, layer), values, heads, batch, RECALL in held))
    if not frames:
        raise NotRecordedError(
            f"no {ERROR!r} record at a chosen (step, layer): steps {step_list} × layers {layer_list} were skipped."
        )
    table = pd.concat(frames, ignore_index=True)
    table["label"] = [rule.label(row) for row in table.to_dict("records")]
    table.attrs["batch_roles"] = list(getattr(source, "batch_roles", None) or ())
    table.attrs["batch_items"] = list(getattr(source, "batch_items", None) or ())  # what titles number them by
    table.attrs["label_rule"] = rule
    return table


def label_changes(table: pd.DataFrame) -> pd.DataFrame:
    """How often each head's label changes across steps: one row per (expert, layer, head, item) of a
    :func:`pattern_table` (or any table with ``step`` and ``label`` columns, such as a head table).

    Steps are compared in order as recorded: a step a cache skipped is not there, so its neighbours count as
    consecutive. Wan 2.2 A14B's two experts are kept apart (layer L of one is not layer L of the other).

    Args:
        table (`pandas.DataFrame`): a :func:`pattern_table`, or a selection of its rows.

    Returns:
        `pandas.DataFrame`: columns ``expert, layer, head, item`` (those the table has), ``steps`` (how many
        steps the head has a label at), ``changes`` (consecutive steps whose labels differ), ``distinct`` (how
        many labels it had), ``most_common`` (the label of most steps; on a tie the one seen first) and
        ``share`` (its share of the steps).

    Raises:
        ValueError: ``table`` has no ``step``, ``layer``, ``head`` or ``label`` column, or no rows.
    """
    import pandas as pd  # slow to import: only where a table is made

    missing = [c for c in ("step", "layer", "head", "label") if c not in table.columns]
    if missing or table.empty:
        have = "no rows" if not missing else f"no column(s) {missing}"
        raise ValueError(f"the table has {have}; pass a cogattn.analysis.pattern_heads.pattern_table with rows.")
    keys = [c for c in ("expert", "layer", "head", "item") if c in table.columns]
    rows = []
    for key, group in table.sort_values("step", kind="stable").groupby(keys, sort=True):
        labels = group["label"].tolist()
        most, count = Counter(labels).most_common(1)[0]  # a tie: the label counted first, i.e. seen first
        rows.append(
            {
                **dict(zip(keys, key)),
                "steps": len(labels),
                "changes": sum(a != b for a, b in zip(labels, labels[1:])),
                "distinct": len(set(labels)),
                "most_common": most,
                "share": count / len(labels),
            }
        )
    return pd.DataFrame(rows)


# -- one record's rows ------------------------------------------------------------------------------
def _record_rows(source, names, where, values: dict[str, torch.Tensor], heads, batch, has_recall) -> pd.DataFrame:
    """The rows of one (step, layer): the chosen head slots × items of ``values`` (``(B, H, M)`` each);
    ``where`` is the step, its timestep, its expert and the layer."""
    import pandas as pd  # slow to import: only where a table is made

    step, timestep, expert, layer = where
    error = values["error"]
    B, H, M = error.shape
    if M != len(names):
        raise StoreError(
            f"{ERROR!r} of step {step}, layer {layer} has {M} patterns, but the run names {len(names)}: {names}."
        )
    items = list(range(B)) if isinstance(batch, str) and batch == "all" else [pick_item(source, batch)]
    if not 0 <= items[0] < B:
        raise ValueError(f"batch={batch!r} is out of range: {B} batch item(s) were recorded.")
    positions = head_positions(source.head_ids, H, heads)
    mean = heads == "mean" or source.head_ids is None
    labels = ["mean"] if mean else [int(source.head_ids[p]) for p in positions]
    columns = {}
    for what, t in values.items():
        t = t.double().cpu()[items][:, positions]  # (b, h, M)
        t = t.mean(1, keepdim=True) if mean else t
        flat = t.transpose(0, 1).reshape(-1, M)  # rows in (head slot, item) order
        columns.update({f"{what}_{n}": flat[:, m].tolist() for m, n in enumerate(names)})
    n = len(labels) * len(items)
    if has_recall and "recall" not in values:  # recorded elsewhere, not at this (step, layer)
        columns.update({f"recall_{name}": [math.nan] * n for name in names})
    index = {
        "step": [step] * n,
        "timestep": [timestep] * n,
        "expert": [expert] * n,
        "layer": [layer] * n,
        "head": [h for h in labels for _ in items],
        "item": [b for _ in labels for b in items],
    }
    return pd.DataFrame({**index, **columns})
