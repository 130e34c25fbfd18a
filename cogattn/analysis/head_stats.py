"""The head table: one row of numbers per (step, layer, head, batch item) that says what a head attends
to: the text, its own latent frame, other frames by temporal distance, how spread its rows are, and
which key tokens soak up the attention (sinks); and a label made from them by a rule you can replace.

```python
from cogattn.analysis.head_stats import head_table, temporal_decay
table = head_table(rec)                    # a pandas DataFrame, one row per (step, layer, head, item)
table.groupby("label").size()
temporal_decay(table, by="layer")          # mass against |Δ latent frame|, averaged per layer
temporal_decay(table[table.expert == "transformer_2"], by="layer")  # Wan 2.2 A14B: one expert's steps
```

The numbers come from the kinds ``frame`` (or ``query_frame``), ``entropy`` and ``received``, and the keys a
head needs for each mass p (``keys_p0.5``, ``keys_p0.9``, ...) from ``top_p``; a kind that was not recorded
leaves its columns NaN (``top_p``'s are there only when it was recorded). No plotting here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import NotRecordedError
from ..layout import TokenLayout
from ..runs.run import MapSource
from .density import kept_keys, top_p_values
from .layouts import layers_view, of_generation
from .maps import check_one_expert, expert_steps, pick, recorded, recorded_kinds, steps_of_expert

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["LABELS", "LabelRule", "head_table", "keys_column", "label_row", "temporal_decay"]

TABLE_KINDS = ("frame", "query_frame", "entropy", "received")
LABELS = ("text", "spatial", "temporal", "global", "unknown")  # every label LabelRule gives


@dataclass(frozen=True)
class LabelRule:
    """What a head mostly attends to, from one row of the head table; the first test that holds wins.

    1. ``"text"``: ``text_mass >= text_min``;
    2. ``"spatial"``: ``same_frame_mass >= spatial_min`` (its own latent frame);
    3. ``"temporal"``: ``dt_1 + … + dt_near_frames >= temporal_min``: the mass on other frames is
       concentrated on the nearby ones (by default the adjacent frames), where a head spread evenly over
       a long video puts little;
    4. ``"global"``: none of these (attention spread over the text and the whole video).

    A row whose ``text_mass`` or ``same_frame_mass`` is NaN (``frame`` not recorded) is ``"unknown"``.
    A model without text keys in its self-attention (Wan) has ``text_mass`` NaN and the frame numbers
    known: `head_table` and the head atlas label its rows with a text mass of 0 (there are no text keys
    to attend to), so its heads are ``"spatial"``, ``"temporal"`` or ``"global"`` (over the video).
    Replace the thresholds (``head_table(rec, rule=LabelRule(text_min=0.3))``), or pass any object with
    a ``label(row) -> str`` method.

    Args:
        text_min (`float`, defaults to 0.5): least text mass of a text head.
        spatial_min (`float`, defaults to 0.5): least own-frame mass of a spatial head.
        temporal_min (`float`, defaults to 0.5): least mass on frames at distance 1 … ``near_frames``.
        near_frames (`int`, defaults to 1): the largest latent-frame distance that counts as nearby.
    """

    text_min: float = 0.5
    spatial_min: float = 0.5
    temporal_min: float = 0.5
    near_frames: int = 1

    def __post_init__(self):
        if not isinstance(self.near_frames, int) or self.near_frames < 1:
            raise ValueError(f"near_frames={self.near_frames!r}; use an int >= 1 (latent-frame distance).")

    def label(self, row: Mapping) -> str:
        """The label of one head-table row (a pandas Series or a dict with the table's column names)."""
        text, same = float(row["text_mass"]), float(row["same_frame_mass"])
        if math.isnan(text) or math.isnan(same):
            return "unknown"
        if text >= self.text_min:
            return "text"
        if same >= self.spatial_min:
            return "spatial"
        near = [float(row[f"dt_{d}"]) for d in range(1, self.near_frames + 1) if f"dt_{d}" in row]
        if any(math.isnan(v) for v in near):
            return "unknown"
        return "temporal" if sum(near) >= self.temporal_min else "global"


def head_table(
    source: MapSource,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    rule: LabelRule | None = None,
    *,
    sink_fraction: float = 0.01,
) -> pd.DataFrame:
    """One row per (step, layer, head, batch item) recorded: where that head's video queries attend.

    ``expert`` names the transformer that ran the step (``"transformer"``; Wan 2.2 A14B's low-noise steps
    ``"transformer_2"``): its ``layer`` is a block of that transformer. Every number is about the video
    query tokens (the F·Hp·Wp queries of the latent frames), each row of P summing to 1:

    * ``text_mass``: mean over video queries of the mass on the T text keys; NaN for a model whose
      self-attention has no text keys (Wan, ``layout.text_len == 0``: its text is in a separate
      cross-attention, see ``video_to_text``);
    * ``same_frame_mass``: mean mass on the keys of the query's own latent frame;
    * ``dt_0 … dt_{F-1}``: mean mass on video keys whose latent frame is at distance d from the
      query's (``dt_0`` is ``same_frame_mass``; ``text_mass + Σ dt_d = 1``, or ``Σ dt_d = 1`` without
      text keys);
    * ``entropy_mean``, ``entropy_std``: mean and (population) standard deviation over video queries
      of the row entropy, in nats (``ln S`` is a uniform row);
    * ``sink_share``: share of all received mass (S in total) on the top ``sink_fraction`` of key
      tokens (``⌊sink_fraction·S⌋``, at least 1), over every query, text included;
      ``sink_tokens``: those key token indices, largest first, space separated;
    * ``keys_p{p}`` for each recorded mass p of ``top_p`` (``keys_p0.5``, ``keys_p0.9``, ...: `keys_column`): mean
      over video queries of the fewest keys whose largest probabilities reach p, as a share of the keys the
      row attends over (S, or an item's kept keys where a mask leaves out its padded text: HunyuanVideo,
      Mochi); with ``heads="mean"`` of the heads' mean count. Only where ``top_p`` was recorded;
      ``table.attrs["top_p"]`` lists the p;
    * ``label``: ``rule.label(row)`` (see `LabelRule`; without text keys, of the row with a text mass of
      0: `label_row`).

    The frame numbers come from ``frame`` or else ``query_frame``, the entropy from ``entropy``, the
    sinks from ``received``; where a kind was not recorded (at all, or at that step and layer), its
    columns are NaN (``sink_tokens`` empty). With ``heads="mean"`` recorded, ``head`` is ``"mean"``.

    Args:
        source (`MapSource`): a `Recording` or a `Run`.
        steps (`"all" | int | Sequence[int] | str`, defaults to ``"all"``): steps recorded for any of the
            kinds; an expert's name (``"transformer_2"``) takes the steps it ran.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers, likewise.
        rule (`LabelRule | None`, defaults to `None`): the labelling rule; `None` is ``LabelRule()``.
        sink_fraction (`float`, defaults to 0.01): share of the key tokens that count as sinks.

    Returns:
        `pandas.DataFrame`: columns ``step, timestep, expert, layer, head, item, text_mass, same_frame_mass,
        dt_0 … dt_{F-1}, entropy_mean, entropy_std, sink_share, keys_p* (with top_p), sink_tokens, label``, rows sorted by
        step, layer, head slot and item. ``timestep`` is the step's timestep, NaN where unknown.

    Raises:
        NotRecordedError: none of the kinds, or a chosen step or layer, was recorded.
        ValueError: a malformed selector (or no expert's name), or a source without a layout.
    """
    import pandas as pd  # slow to import: only where a table is made

    if not 0 < sink_fraction <= 1:
        raise ValueError(f"sink_fraction={sink_fraction!r}; use a share of the key tokens in (0, 1].")
    rule = LabelRule() if rule is None else rule
    if not callable(getattr(rule, "label", None)):
        raise TypeError(f"rule={rule!r} has no label(row) method; pass a LabelRule or an object with one.")
    held = recorded_kinds(source)
    kinds = [k for k in (*TABLE_KINDS, "top_p") if k in held]
    if not kinds:
        raise NotRecordedError(
            f"the head table needs at least one of the kinds {[*TABLE_KINDS, 'top_p']}; this source holds {held}. "
            "Record them, e.g. record(pipe, kinds=('frame', 'entropy', 'received'), heads='all')."
        )
    step_list = _union_choice(source, kinds, "step", steps)
    layer_list = _union_choice(source, kinds, "layer", layers)
    layer_list = of_generation(source, layer_list) if layers == "all" else layer_list  # not another layout's
    source = layers_view(source, layer_list, f"a head table at layers={layers!r}")  # their layout
    layout = _layout(source)
    keys = set(source.keys())
    timesteps = list(source.timesteps or [])
    experts = {s: name for name, group in expert_steps(source, step_list).items() for s in group}
    density = (top_p_values(source), lambda num_items: kept_keys(source, num_items))
    frames = []
    for step in step_list:
        ts = timesteps[step] if step < len(timesteps) and timesteps[step] is not None else math.nan
        where = (step, float(ts), experts[step])
        for layer in layer_list:
            present = {k: source.get(k, step, layer) for k in kinds if (k, step, layer) in keys}
            if present:
                frames.append(_record_rows(layout, source.head_ids, where, layer, present, sink_fraction, density))
    if not frames:
        raise NotRecordedError(
            f"none of {kinds} was recorded at a chosen (step, layer): steps {step_list} × layers {layer_list}; "
            "choose steps and layers recorded together."
        )
    table = pd.concat(frames, ignore_index=True)
    table["label"] = [label_row(rule, row) for row in table.to_dict("records")]
    table.attrs["batch_roles"] = list(getattr(source, "batch_roles", None) or ())  # which items are conditional
    table.attrs["batch_items"] = list(getattr(source, "batch_items", None) or ())  # what titles number them by
    table.attrs["top_p"] = list(density[0] or ())
    return table


def keys_column(p: float) -> str:
    """The head table's column of mass ``p`` of ``top_p``: ``keys_p0.5``, ``keys_p0.99``, ``keys_p1``."""
    return f"keys_p{float(p):g}"


def label_row(rule, row: Mapping) -> str:
    """``rule.label(row)``, where a row without text keys (``text_mass`` NaN, ``same_frame_mass`` known:
    Wan, whose text is in a separate cross-attention) is labelled with a text mass of 0."""
    text, same = float(row.get("text_mass", math.nan)), float(row.get("same_frame_mass", math.nan))
    return rule.label({**row, "text_mass": 0.0} if math.isnan(text) and not math.isnan(same) else row)


def temporal_decay(table: pd.DataFrame, by: str = "head") -> pd.DataFrame:
    """Mass against latent-frame distance, averaged per head, layer or step: the ``dt_*`` columns of a
    head table averaged over every other column (steps, layers, items, and heads unless ``by="head"``).

    Per head or layer the steps averaged must be one expert's (Wan 2.2 A14B: pass
    ``table[table.expert == "transformer"]``, or ``"transformer_2"``); per step nothing is mixed.

    Args:
        table (`pandas.DataFrame`): a `head_table`.
        by (`str`, defaults to ``"head"``): ``"head"``, ``"layer"`` or ``"step"``.

    Returns:
        `pandas.DataFrame`: indexed by ``by``, one column ``dt_d`` per distance d.

    Raises:
        ValueError: ``by`` is none of these, ``table`` is no head table, or (per head or layer) its steps
            span two experts.
    """
    if by not in ("head", "layer", "step"):
        raise ValueError(f"by={by!r}; choose 'head', 'layer' or 'step'.")
    dt = [c for c in table.columns if c.startswith("dt_")]
    if not dt or by not in table.columns:
        raise ValueError(f"table has columns {list(table.columns)}; pass a head_table (it has {by!r} and dt_*).")
    if by != "step":
        groups = expert_steps_of(table)
        fix = " or ".join(f"table[table.expert == {name!r}]" for name in groups)
        check_one_expert(groups, f"temporal_decay(table, by={by!r})", f"Pass {fix}, or by='step'.")
    return table.groupby(by, sort=True)[dt].mean()


def expert_steps_of(table: pd.DataFrame) -> dict[str, list[int]]:
    """A head table's steps by expert, ``{expert: steps}`` in the order of their first step (a table
    without an ``expert`` column, written before it had one: ``"transformer"``)."""
    if "step" not in table.columns:
        return {}
    pairs = table[["step", "expert"]] if "expert" in table.columns else table[["step"]].assign(expert="transformer")
    groups: dict[str, list[int]] = {}
    for step, expert in pairs.drop_duplicates().sort_values("step").itertuples(index=False):
        groups.setdefault(str(expert), []).append(int(step))
    return groups


# -- one record's rows ------------------------------------------------------------------------------
def _record_rows(
    layout: TokenLayout,
    head_ids,
    where: tuple[int, float, str],
    layer: int,
    present: dict[str, torch.Tensor],
    sink_fraction: float,
    density: tuple = (None, None),
) -> pd.DataFrame:
    """The rows of one (step, layer): every head slot × batch item, from the records ``present``;
    ``where`` is the step, its timestep and its expert; ``density`` the source's ``top_p`` masses (`None`:
    not recorded) and its ``kept_keys``."""
    import pandas as pd  # slow to import: only where a table is made

    step, timestep, expert = where
    B, H = next(iter(present.values())).shape[:2]
    for kind, t in present.items():
        if tuple(t.shape[:2]) != (B, H):
            raise ValueError(
                f"records of step {step}, layer {layer} disagree on (batch, heads): {kind!r} is "
                f"{tuple(t.shape[:2])}, another is {(B, H)}; the source is inconsistent."
            )
    F = layout.frames
    nan = torch.full((B, H), math.nan, dtype=torch.float64)
    video = None  # (B, H, F, G): mean key-group mass of the queries of each latent frame
    if "frame" in present:
        video = present["frame"].double()[:, :, layout.text_groups :, :]
    elif "query_frame" in present:
        qf = present["query_frame"].double()[:, :, layout.grid_tokens, :]
        video = qf.reshape(B, H, F, layout.frame_tokens, -1).mean(3)
    if video is not None:
        text_mass, dt = _frame_numbers(layout, video)
    else:
        text_mass, dt = nan, nan[..., None].expand(B, H, F)
    columns = {"text_mass": text_mass, "same_frame_mass": dt[..., 0]}
    columns.update({f"dt_{d}": dt[..., d] for d in range(F)})
    if "entropy" in present:
        e = present["entropy"].double()[:, :, layout.grid_tokens]
        columns["entropy_mean"], columns["entropy_std"] = e.mean(-1), e.std(-1, unbiased=False)
    else:
        columns["entropy_mean"] = columns["entropy_std"] = nan
    sink_tokens = [[""] * H for _ in range(B)]
    if "received" in present:
        r = present["received"].double()
        k = max(1, math.floor(sink_fraction * r.shape[-1] + 1e-9))
        top = r.topk(k, dim=-1)
        columns["sink_share"] = top.values.sum(-1) / r.sum(-1)
        indices = top.indices.tolist()  # once: indexing a tensor per element costs a Python call each
        finite = torch.isfinite(r).all(-1).tolist()  # a damaged record's NaN or inf names no sink
        sink_tokens = [[" ".join(map(str, indices[b][h])) if finite[b][h] else "" for h in range(H)] for b in range(B)]
    else:
        columns["sink_share"] = nan
    ps, kept = density
    top_p = present["top_p"].double()[:, :, layout.grid_tokens] if "top_p" in present and ps else None
    if top_p is not None and top_p.shape[-1] != len(ps):
        raise ValueError(
            f"the top_p record of step {step}, layer {layer} holds {top_p.shape[-1]} masses, but the source names "
            f"{list(ps)}; the source is inconsistent."
        )
    for j, p in enumerate(ps or ()):  # the share of its keys a video query needs for mass p
        columns[keys_column(p)] = nan if top_p is None else top_p[..., j].mean(-1) / kept(B)[:, None]
    heads = ["mean"] * H if head_ids is None else [int(head_ids[h]) for h in range(H)]
    index = {
        "step": [step] * (H * B),
        "timestep": [timestep] * (H * B),
        "expert": [expert] * (H * B),
        "layer": [layer] * (H * B),
        "head": [heads[h] for h in range(H) for _ in range(B)],
        "item": [b for _ in range(H) for b in range(B)],
    }
    # rows in (head slot, item) order: a (B, H) tensor read as (H, B)
    data = {name: v.transpose(0, 1).reshape(-1).tolist() for name, v in columns.items()}
    data["sink_tokens"] = [sink_tokens[b][h] for h in range(H) for b in range(B)]
    return pd.DataFrame({**index, **data})


def _frame_numbers(layout: TokenLayout, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``text_mass`` (B, H) and ``dt`` (B, H, F) from the frame map's video query rows ``video`` (B, H, F, G).

    Query groups are weighted by their token counts (all equal to Hp·Wp, so this is their plain mean).
    Without a text group (Wan) ``text_mass`` is NaN and the key groups are the F latent frames."""
    F, first = layout.frames, layout.text_groups
    sizes = torch.tensor(layout.group_sizes()[first:], dtype=torch.float64)
    weight = sizes / sizes.sum()  # (F,)
    text_mass = (video[..., 0] * weight).sum(-1) if first else torch.full(video.shape[:2], math.nan).double()
    f = torch.arange(F)
    distance = (f[:, None] - f[None, :]).abs()  # (F query frames, F key frames)
    onehot = torch.nn.functional.one_hot(distance, F).double()  # (F, F, F distances)
    dt = torch.einsum("bhqk,q,qkd->bhd", video[..., first:], weight, onehot)
    return text_mass, dt


# -- selections -------------------------------------------------------------------------------------
def _layout(source: MapSource) -> TokenLayout:
    layout = source.layout
    if layout is None:
        raise ValueError("this source has no token layout (it saw no generation); record a generation first.")
    return layout


def _union_choice(source: MapSource, kinds: list[str], what: str, value) -> list[int]:
    """``analysis.choose`` over several kinds: ``"all"`` is every step (layer) any of them recorded, an
    expert's name every step it ran; a chosen one must be recorded for at least one of them."""
    have = sorted({v for k in kinds for v in recorded(source, k, what)})
    if what == "step" and isinstance(value, str) and value != "all":
        return steps_of_expert(source, have, value, str(kinds))
    return pick(have, what, value, str(kinds))
