"""The exact computations the engine tiles: a softmax over a row tile (with each row's entropy when
asked), sums over runs of keys, and the fused attention passes with other value matrices.

Each function computes, for one chunk of heads, quantities the naive ``softmax(q @ k.T * scale)`` in
float32 defines, without forming P where it is a fused pass: the multi-key group sums from indicator
values (:func:`indicator_sums`), every row's entropy from the
keys as values (:func:`entropy_pass`), and the mass every key receives from a pass with queries and keys
swapped (:func:`received_pass`). Why each is exact is in docs/design.md.
"""

from __future__ import annotations

import contextlib

import torch

from . import attention
from .reducers import Reducer

__all__ = [
    "HeadView",
    "all_rows",
    "tiled",
    "fold",
    "query_rows",
    "single_key_columns",
    "single_keys",
    "TileBuffer",
    "entropy_pass",
    "full_fp32_matmul",
    "mean_row_pass",
    "box_sums",
    "indicator_sums",
    "key_passes",
    "key_ranges",
    "received_pass",
    "run_sums",
    "softmax_",
    "softmax_entropy",
]


@contextlib.contextmanager
def full_fp32_matmul():
    """Maps are exact float32: no TF32 in capture's matmuls, whatever the script set for the model.

    Saved, set and restored through one API: the backends' ``fp32_precision`` where it exists (torch ≥
    2.9; mixing it with the legacy calls is an error in torch), else the legacy calls."""
    if hasattr(torch.backends, "fp32_precision"):
        backends = [b for b in (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None)) if b]
        saved = [b.fp32_precision for b in backends]
        for b in backends:
            b.fp32_precision = "ieee"
        try:
            yield
        finally:
            for b, value in zip(backends, saved):
                b.fp32_precision = value
        return
    precision, tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Float32 softmax over the last dim, in place (a tile is the largest buffer; do not copy it)."""
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


def softmax_entropy(scores: torch.Tensor, q_rows: torch.Tensor, k: torch.Tensor, scale: float, bias=None):
    """:func:`softmax_` of ``scores`` ``(h, r, S)`` and each row's entropy ``(h, r)``, from the rows' lse
    (``max + ln Σ exp``) and ``P K``: ``H_i = lse_i − scale·q_i·(P K)_i`` (as :func:`entropy_pass`), for the
    tile's float32 query rows ``q_rows`` ``(h, r, D)`` and keys ``k`` ``(h, S, D)``. One more matmul of
    the tile's size and no logarithm per entry. ``bias`` ``(1, r, S)``: what the scores were given beyond
    ``scale·q·k`` (an additive mask), whose ``Σ_j P_ij·bias_ij`` the entropy then also subtracts."""
    top = scores.amax(-1, keepdim=True)
    scores.sub_(top).exp_()
    total = scores.sum(-1, keepdim=True)
    probs = scores.div_(total)
    lse = (top + total.log())[..., 0]
    pk = torch.matmul(probs, k)  # (h, r, D)
    dot = torch.matmul(q_rows.unsqueeze(-2), pk.unsqueeze(-1))[..., 0, 0]  # (h, r): q_i·(P K)_i
    entropy = lse - scale * dot
    if bias is not None:  # a batched row-by-row product, no (h, r, S) temporary; P = 0 where the bias is −inf
        entropy -= torch.matmul(probs.unsqueeze(-2), bias.nan_to_num(neginf=0.0).unsqueeze(-1))[..., 0, 0]
    return probs, entropy


def run_sums(probs: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """Sums of ``probs`` ``(h, r, S)`` over runs of consecutive keys, ``(h, r, len(runs))``: a reshape and a
    sum when the runs but the last have one length and start at 0, as blocks do; else a sum per run."""
    lengths = {b - a for a, b in runs[:-1]}
    in_order = all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # the reshape reads them in sequence order
    if len(lengths) == 1 and runs[0][0] == 0 and in_order:
        n, size = len(runs) - 1, lengths.pop()
        head = probs[..., : n * size].unflatten(-1, (n, size)).sum(-1)
        return torch.cat([head, probs[..., n * size : runs[-1][1]].sum(-1, keepdim=True)], -1)
    return torch.stack([probs[..., a:b].sum(-1) for a, b in runs], -1)


def box_sums(probs: torch.Tensor, boxes: tuple) -> torch.Tensor:
    """Sums of ``probs`` ``(h, r, S)`` over the text, then over the 3-D tiles of the video grid in (t, y, x) order,
    ``(h, r, 1 + N)`` (no text column without text); ``boxes`` is ``KeyGroups.boxes``. A tile's keys are a box
    of the grid: the rows' video part, viewed as ``(F, Hp, Wp)``, is summed along t, then y, then x, in runs of
    the tile's size (the edge run shorter): no ``(S, N)`` indicator. The outer axes go first: their sums add
    whole contiguous runs of keys, and the sum along x, a reduction of runs of w neighbours, then reads a
    t·h-th of the row (3.5× faster on a CPU than x first, at (1, 8, 8))."""
    text, v0, (F, Hp, Wp), shape = boxes
    video = probs[..., v0 : v0 + F * Hp * Wp].unflatten(-1, (F, Hp, Wp))
    for axis, size in zip((-3, -2, -1), shape):
        n = video.shape[axis]
        if size == 1:
            continue
        whole = n - n % size
        parts = [video.narrow(axis, 0, whole).unflatten(axis, (whole // size, size)).sum(axis)]
        if whole < n:
            parts.append(video.narrow(axis, whole, n - whole).sum(axis, keepdim=True))
        video = torch.cat(parts, axis) if len(parts) > 1 else parts[0]
    video = video.flatten(-3)
    if text.stop == text.start:
        return video
    return torch.cat([probs[..., text].sum(-1, keepdim=True), video], -1)


def entropy_pass(qf: torch.Tensor, kf: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's entropy ``(h, S)`` and lse ``(1, h, S)`` from one fused pass with the keys as values, for
    float32 ``(1, h, S, D)`` q and k: ``H_i = lse_i − scale·q_i·(P K)_i``, since ``ln P[i, j] = scale·q_i·k_j −
    lse_i`` summed against ``P[i, j]`` is ``scale·q_i·(P K)_i − lse_i``."""
    out, lse = attention.sdpa_with_lse(qf, kf, kf, scale)
    dot = torch.matmul(qf[0].unsqueeze(-2), out[0].unsqueeze(-1))[..., 0, 0]  # (h, S): q_i·(P K)_i
    return lse[0] - scale * dot, lse


def received_pass(qf: torch.Tensor, kf: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """``Σ_i P[i, j]`` for every key, ``(h, S_k)``, from float32 queries ``(h, S_q, D)``, keys ``(h, S_k, D)``
    and the queries' lse ``(h, S_q)`` (the sum over those queries): one fused pass with the keys as queries, each widened by ``1``, and the queries as keys,
    each widened by ``−lse_i``, so that its scores are ``scale·q_i·k_j − lse_i = ln P[i, j]`` and its
    log-sum-exp over ``i`` is ``ln Σ_i P[i, j]`` (width rounded up to a multiple of 8 with zeros; zero values)."""
    h, S, D = qf.shape
    keys = kf.shape[1]
    width = -(-(D + 1) // 8) * 8
    keys_as_q = kf.new_zeros(1, h, keys, width)
    keys_as_q[0, :, :, :D] = kf * scale
    keys_as_q[0, :, :, D] = 1.0
    queries_as_k = qf.new_zeros(1, h, S, width)
    queries_as_k[0, :, :, :D] = qf
    queries_as_k[0, :, :, D] = -lse
    zeros = qf.new_zeros(1, 1, S, width).expand(1, h, S, width)  # shared over heads, not over rows (slow on CPU)
    _, out_lse = attention.sdpa_with_lse(keys_as_q, queries_as_k, zeros, 1.0)
    return out_lse[0].exp()


def key_ranges(groups, keys: int, width: int) -> list[tuple[int, int, torch.Tensor]] | None:
    """Runs ``[a, b)`` of the first ``keys`` keys, each meeting at most ``width`` of the multi-key columns (the
    ``KeyGroups`` ``groups`` side by side, as :func:`cogattn.exact.engine.multi_key_indicator` lays them out), with
    those columns; `None` where one call on every key serves them all, or where more than ``width`` columns meet
    at one key. A column meets a run where its first key is before the run's end and its last is in or after it.
    Groups that are local in key order (frames, blocks, 3-D tiles: a tile's keys lie within its frames) so cost
    :func:`indicator_sums` one pass over the keys, however many groups there are."""
    if sum(g.num_groups for g in groups) <= width:
        return None
    first, last = [], []
    for g in groups:
        pos, col = g.keys.cpu(), g.groups.cpu()
        pos, col = pos[pos < keys], col[pos < keys]
        first.append(torch.full((g.num_groups,), keys).scatter_reduce(0, col, pos, "amin"))
        last.append(torch.full((g.num_groups,), -1).scatter_reduce(0, col, pos, "amax"))
    first, last = torch.cat(first), torch.cat(last)
    ranges, a = [], 0
    while a < keys:
        starts = first[last >= a].sort().values  # the columns met from key a on, by their first key
        b = int(starts[width]) if len(starts) > width else keys
        if b <= a:
            return None
        ranges.append((a, b, ((first < b) & (last >= a)).nonzero().flatten()))
        a = b
    return ranges


def key_passes(groups, width: int) -> int:
    """The fused passes over every key that :func:`indicator_sums` makes for ``groups`` (``KeyGroups``, side by
    side): one where they are local in key order (:func:`key_ranges`), else one per ``width`` columns."""
    if not groups:
        return 0
    keys = max(int(g.keys.max()) + 1 for g in groups)
    return 1 if key_ranges(groups, keys, width) is not None else -(-sum(g.num_groups for g in groups) // width)


def indicator_sums(
    qf: torch.Tensor, kf: torch.Tensor, indicator: torch.Tensor, n_calls: int, scale: float, ranges=None
):
    """The multi-key sums ``(h, S, n_calls·D)`` and the rows' lse ``(1, h, S)`` from fused SDPA calls on the
    indicator values (``D`` columns a call), for float32 ``(1, h, S, D)`` q and k. With ``ranges``
    (:func:`key_ranges`), one call per run of keys on the columns it meets: ``Σ_{j∈run} P[i, j]·V[j] =
    out_run·exp(lse_run − lse_i)``, the runs' lse summed in float64 (so a run's sums carry its float32 lse's
    rounding, ``|lse_i|``·ulp, the error units of the spot checks); else ``n_calls`` calls on every key."""
    _, h, S, D = qf.shape
    K = indicator.shape[0]  # the keys: S, or those a key mask keeps
    if ranges is not None:  # flash attention's running max over the runs: sums rescaled only when it rises
        sums, top, total = torch.zeros(h, S, n_calls * D, dtype=qf.dtype, device=qf.device), None, None
        for a, b, cols in ranges:
            cols = cols.to(qf.device)
            v = torch.zeros(b - a, D, dtype=qf.dtype, device=qf.device)
            v[:, : len(cols)] = indicator[a:b, cols]
            out, part = attention.sdpa_with_lse(qf, kf[:, :, a:b], v.expand(1, h, b - a, D), scale)
            part = part[0].double()  # (h, S)
            if top is None:
                top, total = part, torch.zeros_like(part)
            elif bool((part > top).any()):
                higher = torch.maximum(top, part)
                factor = torch.exp(top - higher)
                sums.mul_(factor.float()[..., None])
                total, top = total * factor, higher
            weight = torch.exp(part - top)
            total += weight
            scaled = out[0, ..., : len(cols)].mul_(weight.float()[..., None])  # in the kernel's output: no copy
            sums.index_add_(-1, cols, scaled)
            del out, scaled
        sums.div_(total.float()[..., None])
        return sums, (top + total.log()).float()[None]
    sums = torch.empty(h, S, n_calls * D, dtype=qf.dtype, device=qf.device) if n_calls > 1 else None
    for c in range(n_calls):
        v = indicator[:, c * D : (c + 1) * D].contiguous().expand(1, h, K, D)  # shared over heads
        out, lse = attention.sdpa_with_lse(qf, kf, v, scale)
        if sums is None:
            sums = out[0]
        else:
            sums[..., c * D : (c + 1) * D] = out[0]
        del out
    return sums, lse


class TileBuffer:
    """One float32 buffer for every row tile of a pass: the tiles are the largest allocations, and
    allocating each anew costs page faults on a CPU."""

    def __init__(self, numel: int, device):
        self.buffer = torch.empty(numel, dtype=torch.float32, device=device)

    def take(self, h: int, r: int, S: int) -> torch.Tensor:
        return self.buffer[: h * r * S].view(h, r, S)


def apply_mask_(scores: torch.Tensor, mask, rows, h0: int, h1: int) -> torch.Tensor | None:
    """Apply one item's ``mask`` to the tile ``scores`` ``(h, r, S)`` of query ``rows`` and heads ``h0:h1``, in
    place: a boolean one (:func:`mask_rows`) sets masked scores to −inf, an additive one
    (``cogattn.recorder.processor.QueryKeyBias``) adds its float32 rows, which it returns (`None` for a boolean
    one); inverted or gathered per tile, so the model's ``(S, S)`` mask is never copied whole."""
    if getattr(mask, "additive", False):
        bias = mask.rows(rows, h0, h1)
        scores.add_(bias)
        return bias
    scores.masked_fill_(mask_rows(mask, rows, h0, h1).logical_not(), -torch.inf)
    return None


GROUP_MASK_COST = (2, 0)  # a GroupMask's rows of a tile and their inverse, per head (ModelSpec.group_masked)


def mask_cost(mask) -> tuple[int, int]:
    """What :func:`apply_mask_` holds per score of a row tile for ``mask``, in bytes: ``(per head, shared by the
    heads)``. A boolean ``(S, S)`` mask: its rows and their inverse, shared; a ``GroupMask``: the same per head; an
    additive ``QueryKeyBias``: its ``row_bytes``, shared."""
    if mask is None:
        return 0, 0
    if getattr(mask, "additive", False):
        return 0, mask.row_bytes
    return (0, 2) if isinstance(mask, torch.Tensor) else GROUP_MASK_COST


def mask_rows(mask, rows, h0: int, h1: int) -> torch.Tensor:
    """The query ``rows`` of one item's ``mask`` for heads ``h0:h1`` of the selection: ``(r, S)`` of an ``(S, S)``
    tensor (the same for every head), ``(h, r, S)`` of a per-head mask over token groups
    (``cogattn.recorder.processor.GroupMask``, its heads already selected)."""
    return mask[rows] if isinstance(mask, torch.Tensor) else mask.rows(rows, h0, h1)


def mean_row_pass(q, k, row_kinds, plan, scale: float, keys: int | None = None, mask=None) -> None:
    """Head-mean rows of every query, ``(1, r, S)`` per row tile, summed over head chunks in float32 and
    divided by the heads, folded into kinds of the head-mean row (``topk`` with ``heads="mean"``); ``q`` and
    ``k`` are the engine's head views, ``plan`` its tile plan; keys from ``keys`` on, and where the boolean
    ``mask`` (:func:`mask_rows`) is `False`, are masked; an additive ``mask`` is added (:func:`apply_mask_`)."""
    H, S, _ = q.shape
    keys = S if keys is None else keys
    mask = None if mask is None else mask.to(q.device)
    kt = k.chunk(0, H).transpose(1, 2)  # converted once (when it must be): the loop revisits every head per row tile
    tile = TileBuffer(plan.row_heads * min(plan.row_rows, S) * S, q.device)
    totals = TileBuffer(min(plan.row_rows, S) * S, q.device)  # one buffer: no second one while the first lives
    for r0 in range(0, S, plan.row_rows):
        r1 = min(S, r0 + plan.row_rows)
        total = totals.take(1, r1 - r0, S).zero_()
        for h0 in range(0, H, plan.row_heads):
            h1 = min(H, h0 + plan.row_heads)
            out = tile.take(h1 - h0, r1 - r0, S)
            scores = torch.matmul(q.chunk(h0, h1, slice(r0, r1)), kt[h0:h1], out=out)
            scores.mul_(scale)
            if keys < S:
                scores[..., keys:] = -torch.inf
            if mask is not None:
                apply_mask_(scores, mask, slice(r0, r1), h0, h1)
            probs = softmax_(scores)
            for head in probs:  # no temporary
                total[0] += head
            del scores
        total.div_(H)
        for red, out in row_kinds:
            red.fold_rows(out, 0, r0, total)


class HeadView:
    """Selected heads of a ``(H, S, D)`` tensor, gathered chunk by chunk."""

    def __init__(self, x: torch.Tensor, heads: torch.Tensor | None):
        self.x, self.heads = x, None if heads is None else heads.to(x.device)
        self.shape = (x.shape[0] if heads is None else len(heads), *x.shape[1:])
        self.device = x.device

    def chunk(self, h0: int, h1: int, rows=slice(None), dtype=torch.float32) -> torch.Tensor:
        """Heads ``h0:h1`` (of the selection), query rows ``rows``, contiguous, in ``dtype`` (`None`: the
        input's): one copy at most."""
        x = self.x[:, rows]  # rows first: a head subset then copies only these rows
        x = x[h0:h1] if self.heads is None else x.index_select(0, self.heads[h0:h1])
        return x.to(dtype or x.dtype, memory_format=torch.contiguous_format)


def query_rows(qf: torch.Tensor | None, q: HeadView, h0: int, h1: int):
    """Float32 query rows ``(h, r, D)`` of heads ``h0:h1`` by row range: views of ``qf`` when the pass made
    it, else copies of just those rows."""
    if qf is not None:
        return lambda r0, r1: qf[0, :, r0:r1]
    return lambda r0, r1: q.chunk(h0, h1, slice(r0, r1))


def single_key_columns(
    q_rows,
    k_sel: torch.Tensor,
    lse: torch.Tensor,
    red: Reducer,
    out: torch.Tensor,
    h0: int,
    rows_per_tile: int,
    scale: float,
    probe=None,
    valid: torch.Tensor | None = None,
) -> None:
    """Columns ``P[:, j] = exp(q·k_jᵀ·scale − lse)`` for the reducer's single keys ``k_sel`` ``(h, C, D)``,
    in tiles of query rows (``q_rows(r0, r1)`` gives float32 ``(h, r, D)``), folded into ``out``; ``valid``
    ``(C,)`` is 0 for masked keys, whose columns are then 0."""
    S = lse.shape[-1]
    kt = k_sel.transpose(1, 2)  # (h, D, C)
    for r0 in range(0, S, rows_per_tile):
        r1 = min(S, r0 + rows_per_tile)
        s = torch.matmul(q_rows(r0, r1), kt).mul_(scale).sub_(lse[:, r0:r1, None]).exp_()
        fold(red, out, h0, r0, s if valid is None else s.mul_(valid), probe)
        del s


def single_keys(red: Reducer, out, q: HeadView, k: HeadView, h0: int, h1: int, lse, keys: int, rows: int, scale: float,
                probe=None, qf=None, kf=None) -> None:  # fmt: skip
    """:func:`single_key_columns` of ``red``'s single keys for heads ``h0:h1`` of the head views ``q`` and ``k``, given
    the rows' lse ``(h, S)``: of the first ``keys`` keys (a masked key's column is 0), in tiles of ``rows`` rows; from
    a pass's float32 chunks ``qf`` and ``kf`` ``(1, h, S, D)`` where it made them, else copies of just those rows."""
    S = q.shape[1]
    chosen = red.key_groups.keys.to(q.device)
    valid = None if keys == S else (chosen < keys).float()  # masked keys' columns are 0
    chosen = chosen if keys == S else chosen.clamp(max=keys - 1)
    k_sel = kf[0][:, chosen] if kf is not None else k.chunk(h0, h1, chosen)  # float32 (h, C, D)
    single_key_columns(query_rows(qf, q, h0, h1), k_sel, lse, red, out, h0, rows, scale, probe, valid)


def fold(red: Reducer, out: torch.Tensor, h0: int, r0: int, values: torch.Tensor, probe) -> None:
    """``red.fold_pooled``, after the probe (when checking) keeps the values of its rows."""
    if probe is not None:
        probe.take(red, h0, r0, values)
    red.fold_pooled(out, h0, r0, values)


def all_rows(reducer: Reducer, S: int) -> bool:
    """Whether a reducer asks for every query row in order (then one pass over all rows serves it)."""
    rows = reducer.rows
    return rows is not None and len(rows) == S and bool(torch.equal(rows.cpu(), torch.arange(S)))


def tiled(reducers: list[Reducer], S: int, method: str) -> list[Reducer]:
    """The reducers the pass over every row folds (its row tiles the kernels' where ``TilePlan.kernel_tiles``): the
    row kinds of every row, not of the head-mean row or of chosen rows; with ``method`` ``"rows"`` the others too."""
    pooled = [r for r in reducers if r.key_groups is not None or r.stat is not None] if method == "rows" else []
    return [r for r in reducers if r in pooled or (r.rows is not None and all_rows(r, S) and not r.mean_rows)]
