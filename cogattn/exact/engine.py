"""Exact attention probabilities of one layer call, folded into reducers, within the planned tiles.

:func:`capture` runs the passes a :class:`~cogattn.exact.planner.TilePlan` calls for; every pass computes
the same numbers as the naive ``softmax(q @ k.T * scale)`` in float32:

* :func:`row_pass`: tiles of ``r`` query rows × all ``S`` keys × ``h`` heads, one matmul and an
  in-place float32 softmax, or written once by cogattn's kernels from every row's lse
  (:mod:`cogattn.exact.tile_kernel`, ``TilePlan.kernel_tiles``). Serves every kind; key-pooled sums are a
  gather, sums over runs of keys (frames, blocks) or ``tile @ indicator``; ``entropy`` comes with the softmax,
  ``received`` is a sum over the tile's rows.
* :func:`pooled_pass`, per head chunk, for the key-pooled kinds and the statistics without forming P
  (the passes are in :mod:`cogattn.exact.passes`): ``entropy`` from one fused pass with the keys as values;
  multi-key groups from indicator values (``Σ_{j∈group} P[i, j] = (P·V)[i, group]`` for the indicator
  ``V``: one fused SDPA call on ``V``, which also returns every row's log-sum-exp), or as the output call
  gave them (``layer_output="joint"``); then single-key columns from :func:`single_key_columns`,
  ``exp(q·kᵀ·scale − lse)``, at a cost of ``S·C·D``; then ``received`` from one fused pass with queries and
  keys swapped.
* :func:`~cogattn.exact.kernel_pass.kernel_pass` (``method="triton"``, what ``auto`` takes on CUDA): the same
  kinds from cogattn's Triton kernels, q and k in the model's dtype, no indicator and no float32 copies.

Why each is exact is in docs/design.md. The matmuls run in full float32 (no TF32) whatever the
script set for the model (:func:`full_fp32_matmul`).
"""

from __future__ import annotations

import math

import torch

from . import passes, tile_kernel
from .checks import RowProbe
from .kernel_pass import KernelChoice, kernel_pass
from .passes import all_rows, full_fp32_matmul, tiled
from .planner import TilePlan
from .reducers import Reducer

__all__ = [
    "KernelChoice",
    "capture",
    "capture_items",
    "multi_key_indicator",
    "pooled_pass",
    "row_pass",
]


@torch.no_grad()
def capture(
    q: torch.Tensor,
    k: torch.Tensor,
    reducers: list[Reducer],
    outs: list[torch.Tensor],
    plan: TilePlan,
    heads: torch.Tensor | None = None,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    choice: KernelChoice | None = None,
    probe=None,
    keys: int | None = None,
    queries: int | None = None,
    mask: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> str:
    """Fold exact float32 attention probabilities of one batch item into ``outs``; returns the method that
    served the key-pooled kinds (``"sdpa"`` where ``auto``'s kernel fell back).

    Args:
        q (`torch.Tensor`): queries ``(H, S, D)``, any float dtype.
        k (`torch.Tensor`): keys ``(H, S, D)``.
        reducers (`list[Reducer]`): what to compute.
        outs (`list[torch.Tensor]`): one float32 result per reducer for this batch item, ``(H_out, ...)``, zeroed.
        plan (`TilePlan`): chunk sizes from :func:`cogattn.exact.planner.size_tiles`.
        heads (`torch.Tensor | None`): indices of the selected heads, `None` for all; chunks are
            gathered one at a time so no copy of all selected heads is made.
        scale (`float | None`): softmax scale, defaults to ``1/sqrt(D)`` as in SDPA.
        lse (`torch.Tensor | None`): the rows' log-sum-exp ``(H, S)`` (all heads) when the output call
            provides it; single-key columns then need no attention pass of their own.
        sums (`torch.Tensor | None`): with ``lse``, the multi-key groups' sums ``(H, S, C)`` (all heads, the
            groups of the key-pooled reducers side by side, any dtype) when the output call computed them
            (``plan.method == "joint"``); nothing then needs an attention pass.
        choice (`KernelChoice | None`): under ``method="auto"``, the shapes whose kernel failed and fell back to the
            SDPA pass (warned once); `None`: a ``"triton"`` asked for raises instead.
        probe (`cogattn.exact.checks.RowProbe | None`): keeps the key-pooled values of a few query rows as the
            method produced them, for a spot check.
        keys (`int | None`): with a key mask that keeps the first ``keys`` keys of this item (padded text at
            the end of the sequence), their number: the other keys have probability exactly 0 (row tiles
            mask their scores; the fused passes run on the kept keys alone). `None`: every key.
        queries (`int | None`): where the model forms only the first ``queries`` query rows (Mochi drops
            its padded text), their number: the other rows hold 0 in every kind with a query axis, add
            nothing to ``received``, and group means (``frame``, ``block``) are over the formed rows.
        mask (`torch.Tensor | None`): any other mask of this item (SkyReels-V2's block-causal one): boolean
            ``(S, S)``, `True` where a query attends a key, or one per head over token groups
            (``cogattn.recorder.processor.GroupMask``, Kandinsky 5's NABLA); every kind then comes from row tiles
            with the masked scores at −inf (probability exactly 0), which needs ``plan.method == "rows"``; or an
            additive one (``cogattn.recorder.processor.QueryKeyBias``, LTX-2's IC-LoRA), added to the scaled scores
            in the same row tiles.
        value (`torch.Tensor | None`): the values ``(H, S, D)`` of this item, for the reducers that need them
            (``needs_value``: ``pattern_error``), which fold row tiles with them.
    """
    S, D = q.shape[1:]
    if mask is not None and plan.method != "rows":
        raise ValueError(f"a query-key mask is applied by row tiles only (method 'rows'), not {plan.method!r}")
    keys = S if keys is None else int(keys)
    valued = [r for r in reducers if r.needs_value]
    if valued and value is None and valued[0].value is None:
        raise ValueError(f"kind {valued[0].kind!r} folds the attention's values: pass value=(H, S, D) of this item.")
    if valued and value is not None and valued[0].value is None:  # this item's values, for its whole capture
        for red in valued:
            red.value = passes.HeadView(value, heads)
        try:
            return capture(q, k, reducers, outs, plan, heads, scale, lse, sums, choice, probe, keys, queries, mask)
        finally:
            for red in valued:
                red.release()
    if queries is not None and queries < S:
        for red in reducers:
            red.query_limit = int(queries)
        try:
            return capture(q, k, reducers, outs, plan, heads, scale, lse, sums, choice, probe, keys, mask=mask)
        finally:
            for red, out in zip(reducers, outs):
                red.clear_unformed(out, red.query_limit)
                red.query_limit = None
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k = passes.HeadView(q, heads), passes.HeadView(k, heads)
    if mask is not None and not isinstance(mask, torch.Tensor):  # a mask per head: of the selected heads
        mask = mask.select_heads(heads)
    pooled = [(r, o) for r, o in zip(reducers, outs) if r.key_groups is not None or r.stat is not None]
    row_kinds = [(r, o) for r, o in zip(reducers, outs) if r.rows is not None]

    formed = tiled(reducers, S, "")  # the row kinds of every row (not of the head-mean row, nor chosen rows)
    every_row = [(r, o) for r, o in row_kinds if r in formed]
    if every_row or (pooled and plan.method == "rows"):
        row_pass(q, k, None, every_row, pooled if plan.method == "rows" else [], plan, scale, probe, keys, mask)
    mean_rows = [(r, o) for r, o in row_kinds if r.mean_rows]
    if mean_rows:
        passes.mean_row_pass(q, k, mean_rows, plan, scale, keys, mask)
        row_kinds = [(r, o) for r, o in row_kinds if not r.mean_rows]
    for red, out in row_kinds:
        if not all_rows(red, S):
            row_pass(q, k, red.rows, [(red, out)], [], plan, scale, kept=keys, mask=mask)
    if pooled and plan.method != "rows":
        stats = [(r, o) for r, o in pooled if r.stat is not None]
        multi = [(r, o) for r, o in pooled if r.key_groups is not None and not r.key_groups.single_keys]
        single = [(r, o) for r, o in pooled if r.key_groups is not None and r.key_groups.single_keys]
        if plan.method == "joint" and (lse is None or (multi and sums is None)):
            raise ValueError("method 'joint' needs the lse and the key-pooled sums of the output call")
        if lse is not None and heads is not None:
            lse = lse.index_select(0, heads.to(lse.device))
        given = None if sums is None else passes.HeadView(sums, heads)
        if plan.method == "triton":
            run = lambda: kernel_pass(q, k, multi, single, plan, scale, lse, probe, stats, keys)  # noqa: E731
            if choice is None:
                run()
                return "triton"
            if choice.run(run, (str(q.device), q.x.dtype, S, q.shape[0], D), [o for _, o in pooled], probe):
                return "triton"
        pooled_pass(q, k, multi, single, plan, scale, lse, given, probe, stats, keys)
        return "sdpa" if plan.method == "triton" else plan.method
    return plan.method


def capture_items(
    query: torch.Tensor,
    key: torch.Tensor,
    items,
    reducers: list[Reducer],
    plan: TilePlan,
    heads: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    choice: KernelChoice | None = None,
    probe_rows: torch.Tensor | None = None,
    key_counts=None,
    query_counts=None,
    mask: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
):
    """:func:`capture` for the batch ``items`` of ``query`` and ``key`` ``(B, H, S, D)`` (and of the output
    call's ``lse`` ``(B, H, S)`` and ``sums`` ``(B, H, S, C)`` when given), in full float32 matmuls; with
    ``key_counts`` (per batch item of the call), each item's keys past its count are masked, and with
    ``query_counts`` its query rows past its count are never formed; ``mask`` ``(B or 1, S, S)``: any other
    mask, boolean, `True` where a query attends a key (row tiles apply it), a ``GroupMask`` per head, or an
    additive ``QueryKeyBias`` (row tiles add it);
    ``value`` ``(B, H, S, D)``: the values, for the reducers that need them.

    Returns:
        `tuple`: the results, one float32 ``(len(items), H_out, ...)`` tensor per reducer; the method that
        served the key-pooled kinds; and with ``probe_rows``, ``[(item, RowProbe)]`` for a spot check.
    """
    num_heads = query.shape[1] if heads is None else len(heads)
    outs = [torch.zeros(r.shape(len(items)), dtype=torch.float32, device=query.device) for r in reducers]
    probes, method = [], plan.method
    with full_fp32_matmul():
        for i, b in enumerate(items):
            probe = None if probe_rows is None else RowProbe(probe_rows, num_heads)
            method = capture(
                query[b],
                key[b],
                reducers,
                [o[i] for o in outs],
                plan,
                heads,
                lse=None if lse is None else lse[b],
                sums=None if sums is None else sums[b],
                choice=choice,
                probe=probe,
                keys=None if key_counts is None else int(key_counts[b]),
                queries=None if query_counts is None else int(query_counts[b]),
                mask=None if mask is None else mask[b if mask.shape[0] > 1 else 0],
                value=None if value is None else value[b],
            )
            if probe is not None:
                probes.append((b, probe))
    return outs, method, probes


def row_pass(
    q: passes.HeadView,
    k: passes.HeadView,
    rows,
    row_kinds,
    pooled,
    plan: TilePlan,
    scale: float,
    probe=None,
    kept=None,
    mask=None,
) -> None:
    """Row tiles over ``rows`` (all S when `None`), folded into row kinds and, when every row is formed,
    into key-pooled kinds (a gather of single keys, sums over runs of keys, else a product with the
    indicator) and the row statistics; scores of keys from ``kept`` on, and where the boolean ``mask``
    (``passes.mask_rows``) is `False`, are masked (−inf: probability 0); an additive ``mask``
    (``QueryKeyBias``) is added to the scaled scores, as the model adds it (``passes.apply_mask_``)."""
    H, S, D = q.shape
    kept = S if kept is None else kept
    mask = None if mask is None else mask.to(q.device)
    n_rows = S if rows is None else len(rows)
    groups = [r.key_groups for r, _ in pooled]
    gathers = [g.keys.to(q.device) if g is not None and g.single_keys else None for g in groups]
    runs = [g.runs if g is not None and gather is None else None for g, gather in zip(groups, gathers)]
    indicators = [
        g.indicator(S, device=q.device) if g is not None and gather is None and run is None and not g.boxes else None
        for g, gather, run in zip(groups, gathers, runs)
    ]
    wants_entropy = any(r.stat == "entropy" for r, _ in pooled)
    for red, _ in row_kinds:  # the rows a reducer recomputes, masked as the tiles are (Reducer.scores)
        red.scores = exact_scores(q, k, kept, mask, scale)
    tile = passes.TileBuffer(plan.row_heads * min(plan.row_rows, n_rows) * S, q.device)
    # every row without a mask: the kernels' tiles where the plan says so and this shape's check agrees
    by_kernel = plan.kernel_tiles and rows is None and mask is None and tile_kernel.agrees(q, k, kept, scale)
    try:
        for h0 in range(0, H, plan.row_heads):
            h1 = min(H, h0 + plan.row_heads)
            chunk = tile_kernel.chunk(q, k, h0, h1, kept, scale, wants_entropy) if by_kernel else None
            kt = None  # (h, D, S), a transposed view: bmm reads it without a copy
            for r0 in range(0, n_rows, plan.row_rows):
                r1 = min(n_rows, r0 + plan.row_rows)
                buffer = tile.take(h1 - h0, r1 - r0, S)
                probs = None if chunk is None else tile_kernel.tile(chunk, q, k, r0, r1, kept, scale, buffer)
                if probs is not None:
                    entropy = None if chunk.entropy is None else chunk.entropy[:, r0:r1]
                else:  # torch's tile (a kernel that failed here was warned about: torch's from now on)
                    chunk, kt = None, k.chunk(h0, h1).transpose(1, 2) if kt is None else kt
                    probs, entropy = _torch_tile(q, kt, buffer, h0, h1, r0, r1, rows, kept, mask, scale, wants_entropy)
                if probe is not None and by_kernel:  # the kernels' rows, for the spot check
                    probe.take("probs", h0, r0, probs)
                for red, out in row_kinds:
                    red.fold_rows(out, h0, r0, probs)
                _fold_pooled(pooled, gathers, runs, indicators, probs, entropy, h0, r0, probe)
                del probs  # free this tile before the next one is allocated
    finally:  # the reducers hold no q or k after the pass
        for red, _ in row_kinds:
            red.scores = None


def _fold_pooled(pooled, gathers, runs, indicators, probs, entropy, h0: int, r0: int, probe) -> None:
    """Fold a row tile's probabilities ``(h, r, S)`` (heads from ``h0``, rows from ``r0``) into the key-pooled kinds
    and the row statistics: a gather of single keys, sums over runs of keys, else a product with the indicator."""
    for (red, out), keys, run, ind in zip(pooled, gathers, runs, indicators):
        if red.stat == "received":  # over the formed rows (a query limit leaves the others out)
            formed = probs if red.query_limit is None else probs[:, : max(0, red.query_limit - r0)]
            red.fold_received(out, h0, formed.sum(1))
            continue
        if red.stat == "entropy":
            sums = entropy[..., None]
        elif keys is not None:
            sums = probs.index_select(-1, keys)
        elif run is not None:
            sums = passes.run_sums(probs, run)
        else:
            sums = torch.matmul(probs, ind) if ind is not None else passes.box_sums(probs, red.key_groups.boxes)
        passes.fold(red, out, h0, r0, sums, probe)


def _torch_tile(q, kt, out, h0: int, h1: int, r0: int, r1: int, rows, kept: int, mask, scale: float, entropy: bool):
    """One row tile's probabilities ``(h, r, S)`` in ``out`` (and its rows' entropy when asked, else `None`) by a
    float32 matmul and softmax: keys from ``kept`` on and where a boolean ``mask`` is `False` at −inf, an additive
    one added."""
    idx = slice(r0, r1) if rows is None else rows[r0:r1].to(q.device)
    q_rows, scores, bias = _scores(q, kt, out, h0, h1, idx, kept, mask, scale)
    if entropy:
        return passes.softmax_entropy(scores, q_rows, kt.transpose(1, 2), scale, bias)
    return passes.softmax_(scores), None


def _scores(q, kt, out, h0: int, h1: int, idx, kept: int, mask, scale: float):
    """The float32 scaled scores ``(h, r, S)`` of query rows ``idx`` of heads ``h0:h1`` against the keys ``kt``
    ``(h, D, S)``, written into ``out`` (a new tensor with `None`), keys from ``kept`` on and where a boolean
    ``mask`` is `False` at −inf, an additive one added: ``(q rows, scores, the bias added or None)``."""
    q_rows = q.chunk(h0, h1, idx)
    scores = torch.matmul(q_rows, kt, out=out).mul_(scale)  # (h, r, S)
    if kept < kt.shape[-1]:
        scores[..., kept:] = -math.inf
    bias = None if mask is None else passes.apply_mask_(scores, mask, idx, h0, h1)
    return q_rows, scores, bias


def exact_scores(q, k, kept: int, mask, scale: float):
    """A function ``(h0, h1, rows, out=None) → (h, r, S)`` float32 scores of query ``rows`` (an index tensor) of
    heads ``h0:h1`` (written into ``out`` where given), masked as the row tiles mask them: what a reducer recomputes for the few rows whose float32
    probabilities lost what it needs (``Reducer.scores``)."""

    def scores(h0: int, h1: int, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        kt = k.chunk(h0, h1).transpose(1, 2)
        return _scores(q, kt, out, h0, h1, rows.to(q.device), kept, mask, scale)[1]

    return scores


def multi_key_indicator(reducers: list[Reducer], S: int, device=None, dtype=torch.float32, out=None) -> torch.Tensor:
    """Indicator ``(S, ΣC)`` of the reducers' multi-key groups side by side, in reducer order (the columns
    the SDPA pass, the Triton kernel and the joint output call compute); written into the first ``ΣC`` columns and
    ``S`` rows of ``out`` where given (zeros: the engine's padded indicator), with no copy of its own."""
    groups = [r.key_groups for r in reducers if r.key_groups is not None and not r.key_groups.single_keys]
    width = sum(g.num_groups for g in groups)
    out = torch.zeros(S, width, dtype=dtype, device=device) if out is None else out
    offset = 0
    for g in groups:  # each group's ones in place: no per-reducer (S, C) indicator, no concatenated copy
        kept = g.keys < out.shape[0]
        keys, cols = g.keys[kept].to(out.device), g.groups[kept].to(out.device) + offset
        out[keys, cols] = 1
        offset += g.num_groups
    return out


def pooled_pass(
    q: passes.HeadView,
    k: passes.HeadView,
    multi,
    single,
    plan: TilePlan,
    scale: float,
    given_lse: torch.Tensor | None = None,
    given_sums: passes.HeadView | None = None,
    probe=None,
    stats=(),
    keys: int | None = None,
) -> None:
    """Key-pooled kinds and row statistics per head chunk: ``entropy`` (:func:`entropy_pass`), the multi-key
    groups' sums (:func:`indicator_sums`, or ``given_sums`` from the output call), single-key columns (:func:`single_key_columns`), then ``received``
    (:func:`received_pass`), the last two from the rows' lse (``given_lse`` ``(H, S)``, or a pass's). With
    ``keys`` < S the attention passes run on the first ``keys`` keys alone (the rest are masked: 0)."""
    H, S, D = q.shape
    K = S if keys is None else keys
    kept = slice(None) if K == S else slice(0, K)
    offsets = [0]
    for r, _ in multi:
        offsets.append(offsets[-1] + r.key_groups.num_groups)
    entropy = [(r, o) for r, o in stats if r.stat == "entropy"]
    received = [(r, o) for r, o in stats if r.stat == "received"]
    n_cols = 0 if given_sums is not None else offsets[-1]  # with no multi-key groups: a pass for the lse alone
    n_calls = max(1, math.ceil(n_cols / D))  # the fused kernels need values of the head dim: ceil(C / D) calls
    needs_qk = (multi and given_sums is None) or given_lse is None or bool(stats)  # attention passes run
    indicator = ranges = None
    if needs_qk:
        indicator = torch.zeros(K, n_calls * D, dtype=torch.float32, device=q.device)  # zero values cost as any
        if n_cols:
            multi_key_indicator([r for r, _ in multi], S, out=indicator)  # the first K keys' rows
            ranges = passes.key_ranges([r.key_groups for r, _ in multi], K, D)  # local groups: runs of keys
    for h0 in range(0, H, plan.pooled_heads):
        h1 = min(H, h0 + plan.pooled_heads)
        # float32 q and k of the chunk for an attention pass; without one, single keys copy only their rows
        qf, kf = (q.chunk(h0, h1)[None], k.chunk(h0, h1, kept)[None]) if needs_qk else (None, None)
        lse = None if given_lse is None else given_lse[None, h0:h1].float()  # the output kernel's, when given
        lse_from_output = given_lse is not None
        if entropy:
            values, pass_lse = passes.entropy_pass(qf, kf, scale)
            for red, o in entropy:
                passes.fold(red, o, h0, 0, values[..., None], probe)
            lse, lse_from_output = pass_lse, False  # a float32 pass's lse: more precise than a 16-bit output call's
            del values
        sums = None
        if multi and given_sums is not None:
            sums = given_sums.chunk(h0, h1)
        elif multi or (lse is None and (single or received)):
            sums, pass_lse = passes.indicator_sums(qf, kf, indicator, n_calls, scale, ranges)
            lse, lse_from_output = pass_lse, False  # a float32 pass's, as above
        if multi:
            for (red, o), c0, c1 in zip(multi, offsets, offsets[1:]):
                passes.fold(red, o, h0, 0, sums[..., c0:c1], probe)
        del sums
        if probe is not None:
            probe.lse_from_output = lse_from_output
        for red, o in single:
            passes.single_keys(red, o, q, k, h0, h1, lse[0], K, plan.pooled_rows, scale, probe, qf, kf)
        if received:
            formed = slice(None) if received[0][0].query_limit is None else slice(0, received[0][0].query_limit)
            sums = passes.received_pass(qf[0][:, formed], kf[0], lse[0][:, formed], scale)
            if K < S:
                sums = torch.nn.functional.pad(sums, (0, S - K))
            for red, o in received:
                if probe is not None:  # no per-query value: the check takes the lse this pass used
                    probe.take(red, h0, 0, lse[0][..., None])
                red.fold_received(o, h0, sums)
            del sums
        del qf, kf, lse
