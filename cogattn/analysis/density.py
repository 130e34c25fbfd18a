"""How many keys attention needs: the ``top_p`` kind's counts as shares of the keys (NABLA's and XAttention's
criterion at the token level), beside NABLA's CDF selection on a pooled ``block`` or ``tile`` map, its recall
and its density.

```python
from cogattn.analysis.density import top_p_density
top_p_density(rec, 0.9, kind="tile")  # per (step, layer, head, item): recall, density, token_density
```

The head table's ``keys_p*`` columns (:func:`cogattn.analysis.head_stats.head_table`) hold the token-level shares per
head over the video queries, and :func:`cogattn.plot.density_curves` draws them against p.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import NotRecordedError
from ..exact.reducers.ranked import check_top_p
from ..runs.run import MapSource
from .layouts import layers_view
from .maps import choose, head_positions, recorded_kinds
from .masks import mask_density, mask_recall, top_p_mask

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["kept_keys", "top_p_density", "top_p_values"]


def top_p_values(source: MapSource) -> tuple[float, ...] | None:
    """The masses p of a source's ``top_p`` records, in the order of their last axis; `None` where ``top_p``
    was not recorded.

    Raises:
        ValueError: ``top_p`` was recorded but the source does not say for which p.
    """
    if "top_p" not in recorded_kinds(source):
        return None
    selection = (getattr(source, "meta", None) or {}).get("selection") or {}  # a Run keeps them in run.json
    for value in (getattr(source, "top_p", None), getattr(getattr(source, "options", None), "top_p", None)):
        if value is not None:
            return check_top_p(value)
    if selection.get("top_p") is None:
        raise ValueError("this source holds top_p records but not their masses p (run.json's selection.top_p).")
    return check_top_p(selection["top_p"])


def kept_keys(source: MapSource, num_items: int) -> torch.Tensor:
    """Keys each batch slot's rows attend over, ``(num_items,)`` float64: S, less the padded text a key mask
    leaves out (HunyuanVideo, Mochi: ``S − T + text_lengths[b]``; a layout without text, Motif-Video's decoder: S)."""
    layout = source.layout
    lengths = list(getattr(source, "text_lengths", None) or ())
    text = [min(lengths[b], layout.text_len) if b < len(lengths) else layout.text_len for b in range(num_items)]
    return torch.tensor([layout.seq_len - layout.text_len + t for t in text], dtype=torch.float64)


NUMBERS = ["recall", "density", "token_density"]  # a density table's columns that a mean over heads averages


def top_p_density(
    source: MapSource,
    p: float,
    kind: str = "block",
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "all",
) -> pd.DataFrame:
    """A pooled map's CDF mask (:func:`cogattn.analysis.masks.top_p_mask`) against the token-level truth, per (step,
    layer, head, batch item): what a block-sparse kernel selecting groups by mass p keeps and computes, and
    how many keys the token rows themselves need for p.

    * ``recall``: the share of all attention mass the mask keeps (:func:`cogattn.analysis.masks.mask_recall`);
    * ``density``: the share of (query, key) token pairs it computes (:func:`cogattn.analysis.masks.mask_density`);
    * ``token_density``: from ``top_p``, the mean over the query rows the model forms of (keys needed for p /
      keys the row attends over): the density of an exact token-level selection of recall at least p. NaN
      where ``top_p`` was not recorded at that step and layer.

    All three are over every query token, text included, as ``mask_recall`` is.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding ``kind`` (and ``top_p`` for ``token_density``).
        p (`float`): the mass, in (0, 1]; one of the recorded ``top_p`` masses where ``top_p`` was recorded.
        kind (`"block" | "tile"`, defaults to ``"block"``): the pooled map the mask selects on.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): steps of ``kind``.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers of ``kind``.
        heads (`"all" | "mean" | int | Sequence[int]`, defaults to ``"all"``): the model heads kept, in the order
            given, or ``"mean"``: one row per item, the mean of its heads' rows (a ``heads="mean"`` source holds
            that row alone, whose ``head`` is ``"mean"``).

    Returns:
        `pandas.DataFrame`: columns ``step, expert, layer, head, item, p, recall, density, token_density``.

    Raises:
        ValueError: ``kind`` or ``p`` is invalid, or ``p`` is not among the recorded ``top_p`` masses.
        NotRecordedError: ``kind``, or a chosen step, layer or head, was not recorded.
    """
    import pandas as pd  # slow to import: only where a table is made

    if kind not in ("block", "tile"):
        raise ValueError(f"kind={kind!r}; top_p_density selects on a 'block' or a 'tile' map.")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"p={p!r}; use a mass in (0, 1], e.g. 0.9.")
    ps = top_p_values(source)
    column = None if ps is None else next((j for j, q in enumerate(ps) if abs(q - p) < 1e-9), None)
    if ps is not None and column is None:
        raise ValueError(f"p={p!r}; the top_p records hold p in {list(ps)}: choose one, or record top_p with {p}.")
    step_list, layer_list = choose(source, kind, "step", steps), choose(source, kind, "layer", layers)
    source = layers_view(source, layer_list, f"a density table at layers={layers!r}")  # their layout (kept_keys)
    keys = set(source.keys())
    parts = []
    for step in step_list:
        for layer in [la for la in layer_list if (kind, step, la) in keys]:
            mask = top_p_mask(source.get(kind, step, layer), p)  # (B, H, N, N)
            rows = mask_recall(source, mask, steps=[step], layers=[layer], kind=kind)  # (head slot, item) order
            B, H = mask.shape[:2]
            rows["density"] = mask_density(source, mask, kind).T.reshape(-1).tolist()
            token = torch.full((B, H), float("nan"), dtype=torch.float64)
            if column is not None and ("top_p", step, layer) in keys:
                counts = source.get("top_p", step, layer)[..., column].double()  # (B, H, S)
                formed = (counts > 0).sum(-1)  # rows the model never forms hold 0; a formed row needs a key
                token = (counts / kept_keys(source, B)[:, None, None]).sum(-1) / formed.clamp(min=1)
            rows["token_density"] = token.T.reshape(-1).tolist()
            if heads == "mean" and source.head_ids is not None:  # each item's row: the mean of its heads' rows
                mean = rows.groupby(["step", "expert", "layer", "item"], sort=False, as_index=False, dropna=False)
                parts.append(mean[NUMBERS].mean().assign(head="mean")[list(rows.columns)])
                continue
            slots = head_positions(source.head_ids, H, heads)  # in the order asked
            chosen = ["mean" if source.head_ids is None else int(source.head_ids[s]) for s in slots]
            parts.append(pd.concat([rows[rows["head"] == h] for h in chosen]))
    if not parts:
        raise NotRecordedError(
            f"{kind!r} was not recorded at any chosen (step, layer): steps {step_list} × layers {layer_list}."
        )
    table = pd.concat(parts, ignore_index=True)
    table.insert(5, "p", float(p))
    return table
