"""What a capture will cost, before anything runs: records, bytes on disk, peak extra memory.

``estimate`` needs only the transformer's config (read from a local folder, the hub cache, or the
table of the released shapes in :mod:`cogattn.models`), never its weights, so ``dump_maps.py
--dry-run`` can answer on a laptop for a model it has not downloaded. It plans with the same
:func:`cogattn.exact.planner.plan_capture` a recording runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from .exact.layer_plans import layer_plans
from .exact.layer_plans import records as layer_records
from .exact.planner import CapturePlan, ModelShape, TilePlan, plan_capture
from .layout import TokenLayout
from .models import spec_for_config, transformer_config
from .models.call_sizes import check_sizes
from .options import CaptureOptions
from .recorder.mesh import CHECKED_FAMILIES, exchange_bytes

__all__ = ["Estimate", "Parallel", "estimate"]


@dataclass(frozen=True)
class Parallel:
    """A rank's share of a capture under context parallelism (docs/many-gpus.md).

    Args:
        ring, ulysses (`int`): the mesh's degrees.
        heads (`int`): the most selected heads one rank computes (rank 0 every one for ``topk``/``frame_max`` with
            ``heads="mean"``, whose row is the head mean).
        exchange_bytes (`int`): what a rank holds of the exchanged q and k (v too for ``pattern_error``; the buffers
            they cross in) for a call.
        moved_bytes (`int`): what a rank sends in the all-to-alls of one captured call.
        calls (`int`): captured calls per generation.
    """

    ring: int
    ulysses: int
    heads: int
    exchange_bytes: int
    moved_bytes: int
    calls: int

    def lines(self) -> list[str]:
        n, mib = self.ring * self.ulysses, 2**20
        return [
            f"context parallel: ring {self.ring} × ulysses {self.ulysses} ({n} ranks): at most {self.heads} heads a "
            f"rank; the exchange holds {self.exchange_bytes / mib:.1f} MiB a rank and sends "
            f"{self.moved_bytes / mib:.1f} MiB a captured call ({self.calls:,} a generation); rank 0 alone holds and "
            "writes the records"
        ]


@dataclass(frozen=True)
class Estimate:
    """The cost of a capture over ``num_prompts`` pipeline calls.

    Args:
        plan (`CapturePlan`): the plan each generation runs.
        records (`list[tuple[str, tuple[int, ...], int, int]]`): per kind: shape, bytes per record file,
            number of records over all prompts.
        parallel (`Parallel | None`): each rank's share under context parallelism.
        others (`tuple[CapturePlan, ...]`): the plans of the selected layers over another sequence, each its layout's
            (Motif-Video's decoder layers: the grid twice).
    """

    plan: CapturePlan
    records: list[tuple[str, tuple[int, ...], int, int]]
    parallel: Parallel | None = None
    others: tuple[CapturePlan, ...] = ()

    @property
    def layout(self) -> TokenLayout:
        return self.plan.layout

    @property
    def tiles(self) -> TilePlan:
        return self.plan.tiles

    @property
    def num_records(self) -> int:
        return sum(n for *_, n in self.records)

    @property
    def record_bytes(self) -> int:
        """Bytes of all record files (what lands in ``records/``)."""
        return sum(b * n for _, _, b, n in self.records)

    @property
    def peak_extra_memory(self) -> int:
        """Predicted peak memory capture adds to a generation (:attr:`CapturePlan.peak_extra_memory`, the largest of
        its layouts' plans; under context parallelism a rank's, its exchange of q and k included)."""
        exchange = self.parallel.exchange_bytes if self.parallel is not None else 0
        return max(p.peak_extra_memory for p in (self.plan, *self.others)) + exchange

    def table(self) -> str:
        lay = self.layout
        grid = f"{lay.frames}×{lay.height}×{lay.width}"
        grid = f"{lay.history_len} history + {grid}" if lay.history_len else grid  # FramePack's, Helios's history
        video = f"{grid} video tokens, S = {lay.seq_len:,}"
        if lay.text_position == "end":  # HunyuanVideo: one joint sequence, the text after the video
            layout = f"layout: {grid} video + {lay.text_len} text tokens, S = {lay.seq_len:,}"
            if lay.text_parts:  # HunyuanVideo 1.5: the parts packed per item, each item's valid tokens first
                parts = ", ".join(f"{n} {name}" for name, n in lay.text_parts)
                crop = f"; the template's {lay.prompt_crop} tokens cropped before the prompt" if lay.prompt_crop else ""
                layout += f"\n  text: {parts}, packed per item (its valid tokens of each, then the padding){crop}"
        elif lay.text_len or not lay.context_len:  # CogVideoX: one joint sequence
            layout = f"layout: {lay.text_len} text + {video}"
        else:  # Wan: the video alone, and the context of the cross-attention
            image = f" + {lay.image_len} image" if lay.image_len else ""
            layout = f"layout: {video}; cross-attention to {lay.context_len} text{image} tokens"
            if lay.image_joins_text:  # no image projections of its own: one softmax over both
                layout = f"layout: {video}; cross-attention to {lay.image_len} image + {lay.context_len} text tokens"
                layout += " in one softmax"
        if lay.audio is not None:  # LTX-2: a sequence of its own beside the video
            layout += f"; audio: {lay.audio.tokens} bins ({lay.audio.rate:g} a second)"
        for other in self.others:  # Motif-Video's decoder layers: the grid twice
            own = other.layout
            layout += (
                f"\n  and layers over {own.frames} latent frames ({own.grids} copies of the grid), S = {own.seq_len:,}"
            )
        lines = [
            layout,
            f"{'kind':>14}  {'shape':<28} {'bytes/record':>14} {'records':>8} {'bytes':>16}",
        ]
        for kind, shape, b, n in self.records:
            lines.append(f"{kind:>14}  {str(shape):<28} {b:>14,} {n:>8,} {b * n:>16,}")
        peak = self.peak_extra_memory
        lines += [
            f"{'total':>14}  {'':<28} {'':>14} {self.num_records:>8,} {self.record_bytes:>16,}  "
            f"({self.record_bytes / 2**30:.2f} GiB)",
            f"predicted peak extra memory: {peak:,} bytes ({peak / 2**20:.1f} MiB; method {self.tiles.method})",
        ]
        if self.parallel is not None:
            lines += self.parallel.lines()
        waiting = self.plan.waiting_bytes
        if waiting:
            lines.append(
                f"  {'of which' if self.plan.device_type == 'cpu' else 'and in host memory'} {waiting:,} bytes "
                f"({waiting / 2**20:.1f} MiB) of results wait in host memory for each step's second call"
            )
        return "\n".join(lines)


def estimate(
    model,
    options: CaptureOptions | None = None,
    *,
    num_frames: int,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float = 6.0,
    true_cfg_scale: float = 1.0,
    text_len: int | None = None,
    num_prompts: int = 1,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    parallel: dict | None = None,
    **kwargs,
) -> Estimate:
    """Predict records, bytes and peak extra memory of ``record(...)`` over ``num_prompts`` pipeline calls.

    Takes the arguments of a pipeline call and the capture options of :func:`cogattn.record`; raises the
    same `ValueError` a recording would for options that do not fit the model or the call.

    ```python
    cogattn.estimate("THUDM/CogVideoX-5b", num_frames=49, height=480, width=720, num_inference_steps=50,
                     kinds=("frame", "video_to_text"), batch="cond", dtype="bfloat16").table()
    ```

    Args:
        model: a pipeline, a transformer, ``"tiny"``, a local checkpoint folder or a hub id.
        options (`CaptureOptions | None`): capture options; keyword arguments (fields of
            :class:`cogattn.CaptureOptions`) are applied on top. ``batch`` defaults to ``"auto"`` as in
            ``record``, which under guidance is the conditional half.
        num_frames, height, width, num_inference_steps, guidance_scale: as in the pipeline call.
        true_cfg_scale (`float`, defaults to 1.0): HunyuanVideo's classifier-free guidance (its
            ``guidance_scale`` is distilled into the model: one call per step); above 1 the run records two
            calls per step, as with a negative prompt.
        text_len (`int | None`): text tokens (``max_sequence_length``); defaults to the model's.
        num_prompts (`int`, defaults to 1): pipeline calls (one prompt each).
        dtype (`torch.dtype | str`, defaults to float32): the model's dtype (a non-float32 model's q and k
            are copied to float32 tile by tile).
        device (`str`, defaults to ``"cpu"``): where capture runs (``"cuda"`` or ``"cpu"``).
        parallel (`dict | None`): ``{"ring": R, "ulysses": U}``: the run splits each generation over diffusers'
            context parallelism; the table adds each rank's share (heads, the exchange's memory and traffic).
    """
    options = CaptureOptions.build(options, **kwargs)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cfg = transformer_config(model)
    spec = spec_for_config(cfg)
    spec.check_kinds(options.kinds)
    spec.check_options(options, cfg)
    check_sizes(spec, cfg, num_frames=num_frames, height=height, width=width, num_inference_steps=num_inference_steps)
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts: {num_prompts!r} must be a whole number of at least 1.")
    (num_heads, head_dim), num_layers = spec.attention_shape(cfg), spec.num_layers(cfg)
    model = ModelShape(num_layers, num_heads, head_dim, dtype, spec.shapes(cfg))
    options.check_model(
        num_layers, {k: model.heads_of(spec.source(k)) for k in options.kinds}, spec.layer_names_for_config(cfg)
    )
    layout = spec.layout_for_video(cfg, num_frames, height, width, text_len)
    scale = {"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale}[spec.guidance_argument]
    # the family's own reading of a running call with that scale (MiniMax-H3: never; Cosmos 3: any but 1)
    guidance = spec.guidance_on(
        SimpleNamespace(guidance_scale=scale, _guidance_scale=scale, do_classifier_free_guidance=scale > 1)
    )
    guidance = scale > 1 if guidance is None else guidance
    # a call made in windows (Helios's chunks) runs the loop once per window, its steps numbered on
    num_steps = spec.call_steps(num_frames, num_inference_steps) if spec.call_steps else num_inference_steps
    planned = dict(
        batch_size=2 if guidance else 1,
        guidance=guidance,
        num_steps=num_steps,
        device=device,
        sources=spec.context_kinds,
        calls_per_step=spec.guidance_calls if guidance else 1,
        check_host=False,  # the run's host is not this one: the table reports them
        mask_cost=spec.mask_cost(cfg),
    )
    plan = plan_capture(options, model, layout, **planned)
    # the layers over another sequence (Motif-Video's decoder layers) are planned on their own layout
    others = layer_plans(plan, partial(_plan, model, planned), spec.layer_layouts(cfg, layout), spec.context_kinds)
    records = [
        (k, shape, b, _count(spec, cfg, options, plan, k, n, num_steps) * num_prompts)
        for k, shape, b, n in layer_records(plan, others, num_layers, num_steps)
    ]
    share = None
    if parallel is not None:  # each rank plans its tiles within the budget less its exchange of q and k
        share = _parallel(parallel, spec, options, plan, model, num_steps)
        options = dataclasses.replace(options, memory_budget=options.memory_budget - share.exchange_bytes)
        plan = plan_capture(options, model, layout, **planned)
    wanted = {id(p): p for n, p in others.items() if p is not None and options.wants_layer(n)}
    return Estimate(plan, records, share, tuple(wanted.values()))


def _plan(model: ModelShape, planned: dict, options: CaptureOptions, layout: TokenLayout) -> CapturePlan:
    return plan_capture(options, model, layout, **planned)


def _count(spec, config: dict, options: CaptureOptions, plan: CapturePlan, kind: str, n: int, num_steps: int) -> int:
    """Records of ``kind`` per generation: ``n`` (one per captured layer of its layout and step), or for a kind of
    another attention one per captured layer that has it (Latte's text cross-attention: its spatial layers) and step."""
    if (source := spec.source(kind)) == "self":
        return n
    layers = [i for i in spec.source_layers(config, source) if options.wants_layer(i)]
    return len(layers) * plan.steps_captured(num_steps)


def _parallel(parallel: dict, spec, options: CaptureOptions, plan: CapturePlan, model, num_steps: int) -> Parallel:
    """Each rank's share of ``plan`` under the mesh ``parallel``, refused as a recording refuses it."""
    unknown = set(parallel) - {"ring", "ulysses"}
    ring, ulysses = int(parallel.get("ring", 1)), int(parallel.get("ulysses", 1))
    if unknown or ring < 1 or ulysses < 1 or ring * ulysses < 2:
        raise ValueError(
            f"parallel={parallel!r}: give ring and ulysses degrees of at least 1, their product 2 or more."
        )
    if spec.family not in CHECKED_FAMILIES:
        raise ValueError(
            f"cogattn does not record {spec.family} under context parallelism yet (checked: "
            f"{', '.join(CHECKED_FAMILIES)}; docs/many-gpus.md says why)."
        )
    if options.layer_output != "stock":
        raise ValueError(f"layer_output={options.layer_output!r} is refused under context parallelism: use 'stock'.")
    n, lay, res = ring * ulysses, plan.layout, plan.resolved
    if lay.seq_len % n:
        raise ValueError(f"a sequence of {lay.seq_len:,} tokens does not split evenly over {n} ranks.")
    heads, D = -(-len(res.heads) // n), model.head_dim
    elem = torch.empty((), dtype=model.dtype).element_size()
    halves = max(1, len({r for r in res.roles if r})) if spec.guidance_calls == 2 else 1  # Wan: a call per half
    items = -(-len(res.batch) // halves)  # the selected items of one call
    exchange = exchange_bytes(len(res.heads), items, lay.seq_len, D, elem, n, plan.reducers)
    if exchange >= options.memory_budget:
        raise ValueError(
            f"memory_budget={options.memory_budget:,} bytes holds less than a rank's exchange of q and k under "
            f"context parallelism ({exchange:,} bytes): raise it above that."
        )
    # to the other ranks, their heads' part, once for the kinds of the head-mean row (every head, padded for all)
    groups, tensors = {r.mean_rows for r in plan.reducers}, 3 if any(r.needs_value for r in plan.reducers) else 2
    moved = (
        tensors * items * (n - 1) * (lay.seq_len // n) * D * elem * sum(len(res.heads) if w else heads for w in groups)
    )
    heads = len(res.heads) if True in groups else heads  # rank 0 computes every head of those
    calls = plan.layers_captured * plan.steps_captured(num_steps) * halves
    return Parallel(ring, ulysses, heads, exchange, moved, calls)
