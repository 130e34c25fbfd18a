"""Decay of attention over time and space, from the ``offset`` kind: the mass a video query puts on keys at
each latent-frame distance |Δt| and at each spatial distance, per step, layer, head and item, and Radial
Attention's exponential fit of each curve (its rate and R²). Numbers only; the figures are in
:mod:`cogattn.plot.decay`.

```python
from cogattn.analysis.decay import decay_table, mean_decay
table = decay_table(rec)                  # one row per (step, layer, head, item), like head_stats.head_table
mean_decay(table, by="layer")             # curves averaged per layer, each fitted again
```

Distances, from the offset ``(Δt, Δy, Δx)`` of a key from its query:

* temporal: ``|Δt|`` in latent frames, columns ``dt_0 … dt_{F-1}`` (the head table's ``dt_d``: the same
  quantity, here summed from the offset map);
* spatial: the Euclidean distance ``sqrt(Δy² + Δx²)`` in patches, rounded to the nearest integer (bin d holds
  distances in [d − ½, d + ½); no distance falls on a half), over every frame, columns ``ds_0 … ds_{D}``
  (D the farthest bin of the grid).

The fit (Radial Attention's "attention decays exponentially with distance", in its plain form): a least-squares
line through ``(d, ln m(d))`` over the distances d whose value m(d) is positive, so ``m(d) ≈ a·exp(−λ d)``;
columns ``t_rate`` / ``s_rate`` (λ, per latent frame / per patch), ``t_scale`` / ``s_scale`` (a) and ``t_r2`` /
``s_r2`` (R² of the line, on ``ln m``). Fewer than two positive points, or all of them equal, give NaN R² (and NaN
rate with fewer than two). With ``per_key=True`` each m(d) is the mean probability of one key at distance d
(the mass divided by the mean number of keys a video query has at that distance), under which uniform
attention is flat; by default m(d) is the mass itself, which falls with distance in time (fewer frames lie
far apart) and rises with distance in space at first (rings hold more patches) even for uniform attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import NotRecordedError
from ..layout import TokenLayout
from ..runs.run import MapSource
from .head_stats import expert_steps_of
from .layouts import layers_view
from .maps import check_one_expert, recorded_maps

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["offset_curves", "decay_table", "fit_decay", "keys_at_distance", "mean_decay", "spatial_bins"]

KIND = "offset"


def spatial_bins(layout: TokenLayout) -> torch.Tensor:
    """The spatial-distance bin of every ``(Δy, Δx)`` of the offset map, ``(2Hp − 1, 2Wp − 1)`` int64:
    ``round(sqrt(Δy² + Δx²))`` in patches."""
    _, Hp, Wp = layout.grid
    dy = torch.arange(-(Hp - 1), Hp, dtype=torch.float64)
    dx = torch.arange(-(Wp - 1), Wp, dtype=torch.float64)
    return torch.sqrt(dy[:, None] ** 2 + dx[None, :] ** 2).round().long()


def offset_curves(offset: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Mass against temporal and spatial distance from offset maps ``(..., 2F − 1, 2Hp − 1, 2Wp − 1)``:
    ``(..., F)`` over ``|Δt|`` = 0 … F − 1 and ``(..., D + 1)`` over the spatial bins (:func:`spatial_bins`),
    float64."""
    F = layout.frames
    x = offset.double()
    by_dt = x.sum((-2, -1))  # (..., 2F - 1), Δt = -(F-1) .. F-1
    temporal = by_dt[..., F - 1 :].clone()
    temporal[..., 1:] += by_dt[..., : F - 1].flip(-1)
    bins = spatial_bins(layout)
    spatial = torch.zeros(*x.shape[:-3], int(bins.max()) + 1, dtype=torch.float64)
    spatial.index_add_(-1, bins.flatten(), x.sum(-3).flatten(-2))
    return temporal, spatial


def keys_at_distance(layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean number of video keys a video query has at each temporal distance and each spatial bin, ``(F,)`` and
    ``(D + 1,)``: the pairs at offset ``(Δt, Δy, Δx)`` are ``(F − |Δt|)(Hp − |Δy|)(Wp − |Δx|)``, over V queries."""
    F, Hp, Wp = layout.grid
    counts = [n - torch.arange(-(n - 1), n, dtype=torch.float64).abs() for n in (F, Hp, Wp)]
    pairs = counts[0][:, None, None] * counts[1][None, :, None] * counts[2][None, None, :]
    return offset_curves(pairs / (F * Hp * Wp), layout)


def fit_decay(distance, values) -> tuple[float, float, float]:
    """Least-squares fit of ``ln values`` against ``distance`` over the positive values: ``values ≈ a·exp(−λ d)``.

    Args:
        distance (array-like): the distances d.
        values (array-like): m(d), the same length.

    Returns:
        `tuple[float, float, float]`: ``(a, λ, R²)``; R² is of the line on ``ln m``. NaN where fewer than two
        values are positive or one is not finite (a damaged record); R² NaN and λ 0 where the positive values are
        equal within float32's rounding (uniform attention: nothing to explain).
    """
    d, m = np.asarray(distance, dtype=float), np.asarray(values, dtype=float)
    if not np.isfinite(m).all():  # a damaged record's NaN or inf: a fit of the other points would look plausible
        return math.nan, math.nan, math.nan
    keep = m > 0
    d, y = d[keep], np.log(m[keep])
    if len(d) < 2:
        return math.nan, math.nan, math.nan
    dc = d - d.mean()
    slope = float((dc * (y - y.mean())).sum() / (dc * dc).sum())
    intercept = float(y.mean() - slope * d.mean())
    total = float(((y - y.mean()) ** 2).sum())
    if total <= len(y) * 1e-12:  # ln m equal within float32's rounding (uniform attention): flat, nothing to explain
        return math.exp(float(y.mean())), 0.0, math.nan
    residual = float(((y - (intercept + slope * d)) ** 2).sum())
    return math.exp(intercept), -slope, 1.0 - residual / total


def _fits(frame: pd.DataFrame, prefix: str, columns: list[str]) -> dict[str, list[float]]:
    d = [int(c.split("_")[1]) for c in columns]
    fits = [fit_decay(d, row) for row in frame[columns].to_numpy(dtype=float)]
    return {
        f"{prefix}_scale": [f[0] for f in fits],
        f"{prefix}_rate": [f[1] for f in fits],
        f"{prefix}_r2": [f[2] for f in fits],
    }


def _with_fits(frame: pd.DataFrame) -> pd.DataFrame:
    dt = [c for c in frame.columns if c.startswith("dt_")]
    ds = [c for c in frame.columns if c.startswith("ds_")]
    return frame.assign(**_fits(frame, "t", dt), **_fits(frame, "s", ds))


def decay_table(
    source: MapSource,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    *,
    per_key: bool = False,
) -> pd.DataFrame:
    """One row per (step, layer, head, batch item) with an ``offset`` record: where that head's video queries
    put their mass by distance, and the exponential fit of each curve (the module's docstring defines them).

    Args:
        source (`MapSource`): a `Recording` or a `Run` that recorded ``offset``.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): recorded steps; an expert's name
            (``"transformer_2"``) takes the steps it ran.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): recorded layers.
        per_key (`bool`, defaults to `False`): the mean probability of one key at each distance instead of
            the mass (:func:`keys_at_distance`).

    Returns:
        `pandas.DataFrame`: columns ``step, timestep, expert, layer, head, item, text_mass`` (the mean mass on
        the text keys, ``1 − Σ offset``; NaN without text in the sequence), ``dt_0 … dt_{F-1}``, ``ds_0 … ds_D``,
        ``t_scale, t_rate, t_r2, s_scale, s_rate, s_r2``; rows sorted by step, layer, head slot and item, as
        :func:`cogattn.analysis.head_stats.head_table`'s (``head`` is ``"mean"`` with ``heads="mean"`` recorded).

    Raises:
        NotRecordedError: ``offset``, or a chosen step or layer, was not recorded.
        ValueError: a malformed selector, or a source without a layout.
    """
    import pandas as pd  # slow to import: only where a table is made

    if source.layout is None:
        raise ValueError("this source has no token layout (it saw no generation); record a generation first.")
    maps, step_list, layer_list = recorded_maps(source, KIND, steps, layers)
    layout = layers_view(source, layer_list, f"a decay table at layers={layers!r}").layout  # their layout
    t_keys, s_keys = keys_at_distance(layout) if per_key else (None, None)
    frames = []
    for step, ts, expert, layer in maps:
        offset = source.get(KIND, step, layer)  # (B, H, 2F-1, 2Hp-1, 2Wp-1)
        B, H = offset.shape[:2]
        temporal, spatial = offset_curves(offset, layout)
        text = 1.0 - offset.double().sum((-3, -2, -1)) if layout.text_len else torch.full((B, H), math.nan)
        if per_key:  # a bin no key pair falls in (none on these grids) would be NaN, never a division by 0
            temporal, spatial = temporal / t_keys, spatial / s_keys.where(s_keys > 0, math.nan)
        heads = ["mean"] * H if source.head_ids is None else [int(source.head_ids[h]) for h in range(H)]
        rows = {  # (head slot, item) order: a (B, H, ...) tensor read as (H, B, ...)
            "step": step,
            "timestep": ts,
            "expert": expert,
            "layer": layer,
            "head": [heads[h] for h in range(H) for _ in range(B)],
            "item": [b for _ in range(H) for b in range(B)],
            "text_mass": text.double().transpose(0, 1).reshape(-1).tolist(),
        }
        for name, curve in (("dt", temporal), ("ds", spatial)):
            flat = curve.transpose(0, 1).reshape(H * B, -1)
            rows.update({f"{name}_{d}": flat[:, d].tolist() for d in range(flat.shape[1])})
        frames.append(pd.DataFrame(rows))
    if not frames:
        raise NotRecordedError(
            f"no 'offset' record at a chosen (step, layer): steps {step_list} × layers {layer_list} were skipped."
        )
    table = _with_fits(pd.concat(frames, ignore_index=True))
    table.attrs["batch_roles"] = list(getattr(source, "batch_roles", None) or ())
    table.attrs["batch_items"] = list(getattr(source, "batch_items", None) or ())  # what titles number them by
    table.attrs["per_key"] = per_key
    layout = getattr(source, "layout", None)  # Δt in temporal patches where time is patched (CogVideoX 1.5)
    table.attrs["frame_unit"] = "temporal patch" if layout is not None and layout.patch_size_t else "latent frame"
    return table


def mean_decay(table: pd.DataFrame, by: str = "head") -> pd.DataFrame:
    """The ``dt_*`` and ``ds_*`` curves of a :func:`decay_table` averaged per head, layer or step (over every
    other column), each averaged curve fitted again (a fit of the mean curve, not a mean of the fits).

    Per head or layer the steps averaged must be one expert's (Wan 2.2 A14B: pass
    ``table[table.expert == "transformer"]``, or ``"transformer_2"``); per step nothing is mixed.

    Args:
        table (`pandas.DataFrame`): a :func:`decay_table` (one item of it, to read one item).
        by (`str`, defaults to ``"head"``): ``"head"``, ``"layer"`` or ``"step"``.

    Returns:
        `pandas.DataFrame`: indexed by ``by``: ``dt_*``, ``ds_*``, and the fit columns.

    Raises:
        ValueError: ``by`` is none of these, ``table`` is no decay table, or (per head or layer) its steps span
            two experts.
    """
    if by not in ("head", "layer", "step"):
        raise ValueError(f"by={by!r}; choose 'head', 'layer' or 'step'.")
    curves = [c for c in table.columns if c.startswith(("dt_", "ds_"))]
    if not any(c.startswith("ds_") for c in curves) or by not in table.columns:
        raise ValueError(f"table has columns {list(table.columns)}; pass a decay_table (it has {by!r}, dt_* and ds_*).")
    if by != "step":
        groups = expert_steps_of(table)
        fix = " or ".join(f"table[table.expert == {name!r}]" for name in groups)
        check_one_expert(groups, f"mean_decay(table, by={by!r})", f"Pass {fix}, or by='step'.")
    damaged = table[curves].isna().groupby(table[by], sort=True).any()  # a damaged row's NaN kept, not left out
    return _with_fits(table.groupby(by, sort=True)[curves].mean().mask(damaged))
