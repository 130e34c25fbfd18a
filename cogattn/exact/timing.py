"""``method="auto"`` on CUDA with Triton: which of the SDPA pass and the Triton kernel serves the key-pooled kinds,
measured at the first capture of each shape (:class:`TimedChoice`)."""

from __future__ import annotations

import time
import warnings

import torch

from . import passes
from .planner import TilePlan

__all__ = ["TIMED_ROWS", "TimedChoice"]

TIMED_ROWS = 16_384  # query rows the timed passes take at least (all their heads'): enough blocks to fill a GPU


class TimedChoice:
    """Which of the ``sdpa`` and ``triton`` passes is faster for each shape, measured at its first capture.

    ``chosen`` maps ``(device, dtype, S, heads, D, key groups, lse given)`` to ``"sdpa"`` or ``"triton"``;
    a recording owns one, so its choices last as long as it does."""

    def __init__(self):
        self.chosen: dict[tuple, str] = {}

    def choose(self, q: passes.HeadView, k: passes.HeadView, multi, plan: TilePlan, scale: float, lse, run_pass) -> str:
        """Time both passes of ``run_pass`` (:func:`cogattn.exact.engine.pooled_pass`) on the multi-key groups (into
        scratch results) on first sight of a shape and keep the faster; the kernel failing to build or run means
        ``sdpa``. They are timed on the first heads of the pass's first chunk that hold :data:`TIMED_ROWS` query
        rows (one head at a real shape): the cost is per head, and three whole passes would make a long layer's
        first capture four times as long."""
        D = q.shape[2]
        if not multi or D < 16 or D & (D - 1):
            return "sdpa"  # single-key columns are the same work on both; the kernel needs D a power of two
        key = (
            str(q.device),
            q.x.dtype,
            q.shape[1],
            q.shape[0],
            D,
            tuple(r.key_groups.num_groups for r, _ in multi),
            lse is not None,
        )
        if key not in self.chosen:
            n = max(1, min(q.shape[0], plan.pooled_heads, -(-TIMED_ROWS // q.shape[1])))
            first = torch.arange(n) if q.heads is None else q.heads[:n]  # the pass's first chunk of the selection
            qn, kn = passes.HeadView(q.x, first), passes.HeadView(k.x, first)
            lse_n = None if lse is None else lse[:n]

            def run(fused: bool) -> float:
                scratch = [(r, torch.zeros(r.shape(1)[1:], device=q.device)) for r, _ in multi]
                synchronize(q.device)
                t0 = time.perf_counter()
                run_pass(qn, kn, scratch, [], plan, scale, lse_n, fused=fused)
                synchronize(q.device)
                return time.perf_counter() - t0

            try:
                run(True)  # compiles the kernel
                t_triton = run(True)
            except Exception as err:
                warnings.warn(
                    f"the Triton pooled-sum kernel failed ({type(err).__name__}: {err}); using method 'sdpa'.",
                    stacklevel=2,
                )
                self.chosen[key] = "sdpa"
            else:
                self.chosen[key] = "triton" if t_triton < run(False) else "sdpa"
        return self.chosen[key]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so a timer reads what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
