"""Planning a capture before it runs: which method serves the key-pooled kinds, how large the tiles are,
and what the records will cost.

:func:`plan_capture` is the one planner: ``Recording`` calls it at the first transformer call of a
generation, and ``cogattn.estimate`` calls it from a model config alone, so an estimate is the plan of
the run it predicts. It resolves the options against the call, builds the reducers, chooses the
method (:func:`choose_method`) and sizes the tiles within the memory budget (:func:`size_tiles`), which bound
the transient float32 working set (the results, what the user asked for, are reported with the plan).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

import torch

from ..layout import TokenLayout
from ..options import STORAGE_DTYPES, CaptureOptions, Resolved
from ..runs.record_file import record_file_bytes
from . import kernels, memory, passes, tile_kernel
from .attention import fused_lse_supported, joint_extra_bytes
from .context import context_reducers, plan_context_tiles
from .memory import CPU_ROW_TILE, TooSmall, usable
from .reducers import REDUCERS, Reducer

__all__ = [
    "CapturePlan",
    "ModelShape",
    "TilePlan",
    "choose_method",
    "fused_passes",
    "plan_capture",
    "plan_tiles",
    "size_tiles",
]

_MAX_ROWS = 1024  # larger row tiles stop paying off and only add latency
POOLED_METHODS = ("sdpa", "triton", "joint")  # methods that serve key-pooled kinds without row tiles
# ``auto`` takes row tiles when the SDPA passes are this many or more: on a CPU one row pass with every fold costs
# about two (docs/benchmarks.md); on a GPU (without Triton) the fused kernels keep P out of memory: an estimate.
ROWS_BEAT_PASSES = {"cpu": 2, "cuda": 6}


@dataclass(frozen=True)
class TilePlan:
    """Chunk sizes for one layer call.

    Args:
        method (`str`): how key-pooled kinds are computed: ``"rows"``, ``"sdpa"``, ``"triton"`` (cogattn's
            kernels), or ``"joint"`` (the output call brings them).
        row_heads (`int`): heads per row tile.
        row_rows (`int`): query rows per row tile.
        pooled_heads (`int`): heads per chunk of the pooled pass (0 when no pooled pass runs).
        pooled_rows (`int`): query rows per single-key-column tile of the pooled pass.
        peak_bytes (`int`): predicted peak transient bytes.
        kernel_tiles (`bool`): whether tiles of every row are formed by cogattn's kernels (``tile_kernel.planned``).
    """

    method: str
    row_heads: int
    row_rows: int
    pooled_heads: int
    pooled_rows: int
    peak_bytes: int
    kernel_tiles: bool = False


def pooled_kinds(reducers: list[Reducer]) -> list[Reducer]:
    """The reducers a method serves: key-pooled kinds and row statistics (the others need rows)."""
    return [r for r in reducers if r.key_groups is not None or r.stat is not None]


def fused_passes(reducers: list[Reducer], head_dim: int, lse_given: bool = False) -> int:
    """Fused attention passes per head chunk the ``sdpa`` method runs for ``reducers``: for the multi-key columns
    one (groups local in key order) or ``⌈C / D⌉``, one for ``entropy``, one for ``received``, and one for the lse when single keys or
    ``received`` need it and neither another pass nor the output call (``lse_given``) gives it."""
    pooled = pooled_kinds(reducers)
    multi = [r.key_groups for r in pooled if r.key_groups is not None and not r.key_groups.single_keys]
    entropy = any(r.stat == "entropy" for r in pooled)
    received = any(r.stat == "received" for r in pooled)
    single = any(r.key_groups is not None and r.key_groups.single_keys for r in pooled)
    calls = passes.key_passes(multi, head_dim)  # one for groups local in key order (frames, blocks, tiles)
    lse_pass = (single or received) and not (calls or entropy or lse_given)
    return calls + entropy + received + lse_pass


def choose_method(
    method: str, reducers: list[Reducer], seq_len: int, device, head_dim: int = 64, lse_given: bool = False
) -> str:
    """The method that serves the key-pooled kinds and statistics of ``reducers``: ``method`` as asked (one
    of ``CaptureOptions.method``, or ``"joint"`` for ``layer_output="joint"``), with ``"auto"`` made
    concrete: row tiles when they are formed anyway (``full``, ``topk``) or when there is no fused kernel; else
    cogattn's Triton kernels where they serve (``kernels.serves``: CUDA); else row tiles when the SDPA passes
    would be :data:`ROWS_BEAT_PASSES` or more, or the SDPA passes. `ValueError` where ``method`` cannot run
    (``triton`` where the kernels cannot, whatever the kinds: its row tiles are the kernels' too)."""
    device = torch.device(device)
    if method == "triton" and not kernels.available(device):
        late = " TRITON_INTERPRET=1 was set after cogattn's kernels were defined (this process's first recording or "
        late += "estimate): set it before, or in the shell."
        raise ValueError(
            f"method='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); device is {device}, Triton "
            f"{'is' if kernels.triton is not None else 'is not'} installed. Use method='auto'."
            + late
            * kernels.interpreter_set_late()
        )
    if method == "triton" and not kernels.takes_head_dim(head_dim):
        raise ValueError(
            f"method='triton' needs a head dim that is a power of two from 16 to 256, not {head_dim}. Use method='auto'."
        )
    if not pooled_kinds(reducers):
        return "rows"  # every kind is served by row tiles (the kernels' under ``triton``: ``tile_kernel.planned``)
    if method == "auto":
        formed = bool(passes.tiled(reducers, seq_len, ""))  # head-mean rows serve no other kind
        if formed or not fused_lse_supported(device):
            return "rows"  # each head's rows are formed anyway (``full``, ``topk``), or there is no fused kernel
        if kernels.serves(device, head_dim):
            return "triton"
        if fused_passes(reducers, head_dim, lse_given) >= ROWS_BEAT_PASSES.get(device.type, 6):
            return "rows"
        return "sdpa"
    if method == "joint" and not fused_lse_supported(device):
        raise ValueError(f"layer_output='joint' needs a fused attention kernel with log-sum-exp; device is {device}.")
    if method == "sdpa" and not fused_lse_supported(device):
        raise ValueError(f"method='sdpa' needs a fused attention kernel with log-sum-exp; device is {device}.")
    return method


def size_tiles(
    method: str,
    reducers: list[Reducer],
    S: int,
    H: int,
    D: int,
    budget: int,
    copies_inputs: bool = True,
    tile_cap: int | None = None,
    mask_cost: tuple[int, int] = (0, 0),
) -> TilePlan:
    """Chunk sizes for ``reducers`` on ``method`` (from :func:`choose_method`) within ``budget`` bytes;
    raises `ValueError` when no tile fits.

    Args:
        method (`str`): the concrete method.
        reducers (`list[Reducer]`): what one layer call computes.
        S, H, D (`int`): sequence length, selected heads, head dim.
        budget (`int`): bytes of transient working memory allowed.
        copies_inputs (`bool`, defaults to `True`): whether q and k must be copied to float32 per head
            chunk (not for contiguous float32 inputs with every head selected).
        tile_cap (`int | None`): largest row tile of scores in bytes, one head at a time (the CPU's
            :data:`CPU_ROW_TILE`); `None` makes tiles as large as the budget allows (GPUs).
        mask_cost (`tuple[int, int]`): what a call's mask holds per row tile (``passes.mask_cost``): bytes per
            score of each head, and per score shared by the heads.
    """
    budget, asked = usable(budget), budget  # less the headroom (cogattn.exact.memory)
    pooled = pooled_kinds(reducers)
    groups = [r.key_groups for r in pooled if r.key_groups is not None]
    stats = {r.stat for r in pooled if r.stat is not None}
    in_rows = method == "rows"
    # pooled sums per row (with entropy: P K, D more); with received, a column sum per head
    row_cols = sum(g.num_groups for g in groups) + D * ("entropy" in stats) if in_rows else 0
    # tiles: the partial sums of passes.box_sums
    row_cols += sum(memory.box_columns(g.boxes[2], g.boxes[3]) for g in groups if g.boxes) if in_rows else 0
    row_cols += sum(r.row_columns(S, tile_cap is not None) for r in reducers)  # held per row while a tile folds
    received = "received" in stats and in_rows
    mean_row = any(r.mean_rows for r in reducers)  # topk of the head-mean row: a sum of the heads' rows
    row_sets = [len(r.rows) for r in reducers if r.rows is not None] + ([S] if pooled and in_rows else [])
    n_single = sum(g.num_groups for g in groups if g.single_keys)
    n_multi = sum(g.num_groups for g in groups if not g.single_keys)

    def row_bytes(h: int, r: int) -> int:
        return memory.row_tile_bytes(h, r, S, D, row_cols, copies_inputs, received, mean_row * H, mask_cost)

    threads = torch.get_num_threads() if tile_cap is not None and method != "triton" else 0  # CPU flash calls

    def pooled_bytes(h: int, r: int) -> int:
        return memory.pooled_bytes(h, r, S, D, n_multi, n_single, copies_inputs, method == "joint", stats, threads)

    row_heads = row_rows = 0
    if row_sets:
        most_rows = min(max(row_sets), _MAX_ROWS)
        if tile_cap is not None:
            # Cache-sized tiles: one head's K stays in cache across its row tiles, and each tile is
            # written and read back from cache, not memory (3× faster than 1 GiB tiles on a CPU).
            row_heads = 1
            row_rows = _largest(lambda r: row_bytes(1, r) <= budget and 4 * r * S <= tile_cap, most_rows)
            row_rows = row_rows or _largest(lambda r: row_bytes(1, r) <= budget, 1)
        else:
            # All heads per tile (one pass folds the head mean) with a reasonable row count.
            for h in range(H, 0, -1):
                row_rows = _largest(lambda r, h=h: row_bytes(h, r) <= budget, most_rows)
                if row_rows >= min(64, most_rows) or h == 1:
                    row_heads = h
                    break
    pooled_pass = bool(pooled) and method in POOLED_METHODS  # the Triton pass holds less than the SDPA pass
    pooled_heads = pooled_rows = 0
    if pooled_pass:
        pooled_heads = _largest(lambda h: pooled_bytes(h, 1) <= budget, H)
    if (row_sets and row_rows == 0) or (pooled_pass and pooled_heads == 0):
        # one refusal, naming the budget that holds the smallest tile of each pass
        raise TooSmall(asked, max(row_bytes(1, 1) * bool(row_sets), pooled_bytes(1, 1) * pooled_pass), S, D)
    if pooled_heads:
        pooled_rows = _largest(lambda r: pooled_bytes(pooled_heads, r) <= budget, S) if n_single else S
    peak = max(
        row_bytes(row_heads, row_rows) if row_sets else 0,
        pooled_bytes(pooled_heads, pooled_rows) if pooled_heads else 0,
    )
    return TilePlan(method, row_heads, row_rows, pooled_heads, pooled_rows, peak)


def plan_tiles(
    reducers: list[Reducer],
    S: int,
    H: int,
    D: int,
    budget: int,
    method: str,
    device,
    copies_inputs: bool = True,
    lse_given: bool = False,
    mask_cost: tuple[int, int] = (0, 0),
) -> TilePlan:
    """:func:`choose_method`, then :func:`size_tiles` (``lse_given``: the output call gives every row's lse;
    ``mask_cost``: what a call's mask holds per row tile, ``passes.mask_cost``)."""
    cap = CPU_ROW_TILE if torch.device(device).type == "cpu" else None
    chosen = choose_method(method, reducers, S, device, D, lse_given)
    plan = size_tiles(chosen, reducers, S, H, D, budget, copies_inputs, cap, mask_cost)
    return replace(plan, kernel_tiles=tile_kernel.planned(method, device, D))


def _largest(fits, upper: int) -> int:
    """Largest n in [1, upper] with fits(n) (fits is monotone), or 0."""
    return bisect.bisect_right(range(1, upper + 1), False, key=lambda n: not fits(n))


# -- the whole capture ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CapturePlan:
    """One generation's capture, planned: the selection made concrete, the reducers, the tiles, the records.

    Args:
        options (`CaptureOptions`): what was asked.
        resolved (`Resolved`): batch items, heads and query tokens of this call.
        reducers (`list[Reducer]`): one per self-attention kind, in ``options.kinds`` order.
        tiles (`TilePlan`): the tiles for the model's dtype and head selection.
        num_layers (`int`): blocks of the model.
        joint_bytes (`int`): with ``layer_output="joint"``, what the widened output call holds beyond
            the stock call (:func:`cogattn.exact.attention.joint_extra_bytes`); 0 otherwise.
        context (`list[Reducer]`): one per cross-attention kind (Wan's ``video_to_text``, ``video_to_image``).
        context_bytes (`int`): peak bytes of a cross-attention tile (:func:`cogattn.exact.memory.context_tile`).
        context_tiles (`dict[str, tuple[int, int]]`): heads and query rows per tile of each other attention, by
            source (``"text"``, ``"image"``, ``"audio"``, ...).
        waiting_bytes (`int`): results that wait in host memory for the step's last call (Wan under
            guidance, a selection spanning both halves): the earlier calls' items of every captured layer
            (:mod:`cogattn.exact.memory` says how they are bounded).
        tile_budget (`int`): what the tiles may take: ``memory_budget``, less ``waiting_bytes`` on a CPU.
        device_type (`str`): where capture runs (``"cpu"``: the waiting results are in the same memory).
    """

    options: CaptureOptions
    resolved: Resolved
    reducers: list[Reducer]
    tiles: TilePlan
    num_layers: int
    joint_bytes: int = 0
    context: tuple[Reducer, ...] = ()
    context_bytes: int = 0
    context_tiles: dict[str, tuple[int, int]] = field(default_factory=dict)
    waiting_bytes: int = 0
    tile_budget: int = 0
    device_type: str = "cpu"
    context_heads: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a source's own heads (LTX-2's audio)

    @property
    def layout(self) -> TokenLayout:
        return self.resolved.layout

    @property
    def layers_captured(self) -> int:
        return self.num_layers if self.options.layers == "all" else len(self.options.layers)

    def steps_captured(self, num_steps: int | None) -> int:
        """Captured steps of a generation of ``num_steps`` (1 when unknown, as with a bare transformer)."""
        if self.options.steps == "all":
            return num_steps or 1
        return len([s for s in self.options.steps if num_steps is None or s < num_steps])

    def records(self, num_steps: int | None) -> list[tuple[str, tuple[int, ...], int, int]]:
        """Per kind: ``(kind, shape, bytes of one record file in the dtype it is stored in, records per generation)``."""
        storage = STORAGE_DTYPES[self.options.storage_dtype]
        count = self.layers_captured * self.steps_captured(num_steps)
        out = []
        for r in [*self.reducers, *self.context]:
            shape = r.shape(len(self.resolved.batch))
            dtype = r.stored_dtype(storage, r.mean_heads)
            out.append((r.kind, shape, record_file_bytes(shape, dtype), count))
        return out

    @property
    def result_bytes(self) -> int:
        """The float32 results of one layer call, held while it runs."""
        return sum(r.nbytes(len(self.resolved.batch)) for r in [*self.reducers, *self.context])

    @property
    def peak_extra_memory(self) -> int:
        """Predicted peak memory capture adds to a generation on its device: the tile working set (or, with
        ``layer_output="joint"``, the widened output call when it is larger) and one layer's results, and on
        a CPU the results waiting for a step's last call (on an accelerator those are host memory)."""
        transient = max(self.tiles.peak_bytes, self.joint_bytes, self.context_bytes)
        return transient + self.result_bytes + self.waiting_bytes * (self.device_type == "cpu")


@dataclass(frozen=True)
class ModelShape:
    """The model facts a plan needs: its blocks, its attention heads and head dim, its dtype, and source →
    ``(heads, head dim)`` of the attentions whose heads differ (``ModelSpec.shapes``: LTX-2's audio stream)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    sources: dict = field(default_factory=dict)

    def heads_of(self, source: str) -> int:
        """The heads of ``source``'s attention (a cross-attention to the text: the self-attention's; LTX-2's audio)."""
        return self.sources.get(source, (self.num_heads,))[0]


def plan_capture(
    options: CaptureOptions,
    model: ModelShape,
    layout: TokenLayout,
    *,
    batch_size: int,
    guidance: bool | None,
    num_steps: int | None,
    device,
    sources: dict[str, str] | None = None,
    calls_per_step: int = 1,
    check_host: bool = True,
    mask_cost: tuple[int, int] = (0, 0),
) -> CapturePlan:
    """Plan a capture for a call of ``batch_size`` items on ``layout``; raises `ValueError` for what does not fit.

    Args:
        options (`CaptureOptions`): the options (already checked against the model).
        model (`ModelShape`): the model's attention and dtype.
        layout (`TokenLayout`): the call's token layout.
        batch_size (`int`): the transformer batch; ``guidance``: whether classifier-free guidance is on
            (`None` when unknown, as with a bare transformer); ``num_steps``: steps of the generation.
        device: where capture runs.
        sources (`dict[str, str] | None`): kinds made by a cross-attention → ``"text"`` or ``"image"``
            (:attr:`cogattn.models.ModelSpec.context_kinds`); the rest come from the self-attention.
        calls_per_step (`int`, defaults to 1): transformer calls that share the ``batch_size`` items of a
            step, the last call holding the first ``batch_size / calls_per_step`` (Wan under guidance: 2,
            the conditional call first); the results of the earlier calls wait for the last.
        check_host (`bool`, defaults to `True`): on an accelerator, refuse waiting results larger than the
            host memory available now (`estimate` plans for another machine and only reports them).
        mask_cost (`tuple[int, int]`): bytes per score a query-key mask adds to a row tile (``passes.mask_cost``),
            where the layers run under one: row tiles serve every kind then, as the recording runs them.
    """
    num_heads, head_dim, dtype = model.num_heads, model.head_dim, model.dtype
    res = options.resolve(layout, batch_size, guidance, num_steps, num_heads)
    sizes = {name: getattr(options, name) for name in ("block_size", "topk", "tile_shape", "patterns", "top_p")}
    sources = sources or {}
    own = [k for k in options.kinds if k not in sources]
    reducers = [REDUCERS[k](layout, len(res.heads), res.mean_heads, res.queries, **sizes) for k in own]
    context, heads_of = context_reducers(options, res, sources, model.sources, sizes)
    copies = dtype != torch.float32 or res.heads != tuple(range(num_heads))
    method = "joint" if options.layer_output == "joint" else options.method
    if any(mask_cost):  # the fused passes take no mask (capture.py does the same): row tiles, where the method runs
        method = choose_method(method, [], layout.seq_len, device, head_dim)  # "rows" (no pooled kinds) or refused
    lse = options.layer_output == "lse"
    layers = model.num_layers if options.layers == "all" else len(options.layers)
    waiting = memory.waiting_bytes([*reducers, *context], res.batch, batch_size, calls_per_step, layers)
    on_host = torch.device(device).type == "cpu"
    if check_host and not on_host:
        memory.check_host(waiting, options.batch)
    budget = options.memory_budget - waiting * on_host  # on a CPU the waiting results and the tiles share it

    def tiles_within(budget: int):
        none = TilePlan("none", 0, 0, 0, 0, 0)  # cross-attention kinds only: no self-attention pass
        S, H = layout.seq_len, len(res.heads)
        shape = (S, H, head_dim, budget, method, device, copies, lse, mask_cost)
        tiles, (context_tiles, context_bytes) = memory.one_refusal(  # one refusal, naming a budget for every pass
            lambda: plan_tiles(reducers, *shape) if reducers else none,
            lambda: plan_context_tiles(context, heads_of, model.sources, head_dim, budget, device),
        )
        return tiles, context_tiles, context_bytes

    try:
        tiles, context_tiles, context_bytes = tiles_within(budget)
    except ValueError as err:
        if not (waiting and on_host):
            raise
        tiles_within(options.memory_budget)  # too small without the waiting results too: that refusal
        raise memory.waiting_refusal(options.memory_budget, waiting, options.batch) from err
    by_kernel = bool(reducers) and not any(mask_cost) and tile_kernel.planned(options.method, device, head_dim)
    tiles, joint_bytes = replace(tiles, kernel_tiles=by_kernel), 0
    n_cols = sum(r.key_groups.num_groups for r in reducers if r.key_groups is not None and not r.key_groups.single_keys)
    if options.layer_output == "joint" and n_cols:
        elem = torch.empty((), dtype=dtype).element_size()
        joint_bytes = joint_extra_bytes(len(res.batch), num_heads, layout.seq_len, head_dim, n_cols, elem)
    return CapturePlan(
        options,
        res,
        reducers,
        tiles,
        model.num_layers,
        joint_bytes,
        tuple(context),
        context_bytes,
        context_tiles,
        waiting,
        budget,
        torch.device(device).type,
        heads_of,
    )
