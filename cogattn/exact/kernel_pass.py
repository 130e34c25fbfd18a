"""The ``triton`` method: one layer call's key-pooled kinds and row statistics from cogattn's kernels
(:mod:`cogattn.exact.kernels`), per head chunk, folded into the reducers.

Per chunk of the selected heads: one :func:`~cogattn.exact.kernels.sweep` per distinct key grouping (``frame`` and
``query_frame`` share one), the first also giving every row's lse (unless the output call gave it) and ``entropy``;
a sweep of no groups when only the lse and ``entropy`` are wanted; then single-key columns (``video_to_text``) from
that lse, ``exp(q·kᵀ·scale − lse)``, at ``S·C·D``; then ``received`` from :func:`~cogattn.exact.kernels.received`.
q and k stay in the model's dtype and are read through their strides: no float32 copy of a head chunk.
"""

from __future__ import annotations

import warnings

import torch

from . import kernels, passes

__all__ = ["KernelChoice", "kernel_pass"]


class KernelChoice:
    """``method="auto"``'s kernel path, owned by a recording: ``chosen`` maps each shape ``(device, dtype, S, heads,
    D)`` to ``"triton"``, or to ``"sdpa"`` where the kernel failed to build or run there (warned once; that shape
    then takes the SDPA pass), or to ``"rows"`` where a spot check of the kernel failed (the shape is on row tiles:
    ``checks.ROWS_ONLY``; the recording's capture sets it)."""

    def __init__(self):
        self.chosen: dict[tuple, str] = {}

    def run(self, fn, shape: tuple, outs: list[torch.Tensor], probe=None) -> bool:
        """Run the kernel pass ``fn`` unless ``shape`` fell back before; ``False`` (``outs`` zeroed again, the
        ``probe``'s pooled values dropped) where it fails or failed, for the caller's SDPA pass."""
        if self.chosen.get(shape) == "sdpa":
            return False
        try:
            fn()
        except Exception as err:  # a Triton that cannot build or launch the kernel here: the checked fallback
            warnings.warn(
                f"cogattn's Triton kernel failed on {shape[0]} ({type(err).__name__}: {err}); this shape takes the "
                "SDPA pass (method 'sdpa').",
                stacklevel=4,
            )
            self.chosen[shape] = "sdpa"
            for out in outs:
                out.zero_()
            if probe is not None:  # the pass's values; the row tiles' probabilities stay (``RowProbe``)
                probe.values = {"probs": probe.values["probs"]} if "probs" in probe.values else {}
            return False
        self.chosen[shape] = "triton"
        return True


def kernel_pass(
    q: passes.HeadView,
    k: passes.HeadView,
    multi,
    single,
    plan,
    scale: float,
    given_lse: torch.Tensor | None = None,
    probe=None,
    stats=(),
    keys: int | None = None,
) -> None:
    """Fold the reducers of ``multi`` (multi-key groups), ``single`` (single-key columns) and ``stats``
    (``entropy``, ``received``) for the heads of ``q`` and ``k`` (the engine's head views), in chunks of
    ``plan.pooled_heads``; ``given_lse`` ``(h, S)``: the output call's lse of the selected heads; with ``keys`` < S
    only the first ``keys`` keys are kept (the rest have probability 0)."""
    H, S, _ = q.shape
    K = S if keys is None else int(keys)
    entropy = [(r, o) for r, o in stats if r.stat == "entropy"]
    received = [(r, o) for r, o in stats if r.stat == "received"]
    groupings = _distinct([r.key_groups for r, _ in multi])
    owners = [_same(r.key_groups, groupings) for r, _ in multi]  # each reducer's grouping, matched once a call
    if not groupings and (entropy or (given_lse is None and (single or received))):
        groupings = [None]  # a sweep for the lse (and entropy) alone
    for h0 in range(0, H, plan.pooled_heads):
        h1 = min(H, h0 + plan.pooled_heads)
        heads = torch.arange(h0, h1, device=q.device) if q.heads is None else q.heads[h0:h1]
        lse = None if given_lse is None else given_lse[h0:h1].float()
        from_output = lse is not None
        sums = {}
        for i, groups in enumerate(groupings):
            # the first sweep finds the lse in float32 when entropy is asked: a 16-bit output call's is less precise
            online = i == 0 and (lse is None or bool(entropy))
            swept = kernels.sweep(
                q.x,
                k.x,
                kernels.key_order(groups, K, q.device),
                heads,
                None if online else lse,
                online and bool(entropy),
                scale,
                K,
            )
            if online:
                lse, from_output = swept.lse, False
                for red, o in entropy:
                    passes.fold(red, o, h0, 0, swept.entropy[..., None], probe)
            sums[id(groups)] = swept.sums
        for (red, o), owner in zip(multi, owners):
            passes.fold(red, o, h0, 0, sums[id(owner)], probe)
        del sums
        if probe is not None:
            probe.lse_from_output = from_output
        for red, o in single:
            passes.single_keys(red, o, q, k, h0, h1, lse, K, plan.pooled_rows, scale, probe)
        if received:
            limit = received[0][0].query_limit
            mass = kernels.received(q.x, k.x, lse, heads, scale, queries=limit, keys=K)
            mass = torch.nn.functional.pad(mass, (0, S - K)) if K < S else mass
            for red, o in received:
                if probe is not None:  # no per-query value: the check takes the lse this pass used
                    probe.take(red, h0, 0, lse[..., None])
                red.fold_received(o, h0, mass)


def _distinct(groupings: list) -> list:
    """The groupings with equal ones (the same keys in the same groups) given once."""
    kept = []
    for g in groupings:
        if _same(g, kept) is None:
            kept.append(g)
    return kept


def _same(groups, kept: list):
    """The grouping of ``kept`` equal to ``groups``, or `None`."""
    for g in kept:
        if g is groups or (
            g is not None
            and g.num_groups == groups.num_groups
            and torch.equal(g.keys.cpu(), groups.keys.cpu())
            and torch.equal(g.groups.cpu(), groups.groups.cpu())
        ):
            return g
    return None
