"""Spot checks: every capture verifies its fast method against exact float32 rows, wherever it runs.

The fast methods (the fused SDPA pass, the Triton kernel, the output call's lse and sums) run kernels
no test here sees on a user's GPU. At the first capture of each (device, dtype, method, shape) in a
process, and again with a small probability after, a :class:`RowProbe` keeps what the method produced
for a few query rows (2 text and 6 video tokens, all selected heads), and :class:`Verifier` recomputes
those rows exactly: float32 ``softmax(q·kᵀ·scale)`` from the same q and k, pooled with each kind's own
key groups. A disagreement beyond :data:`TOLERANCE` is warned about once, the layer call's maps are
recomputed with row tiles (nothing wrong is stored), and that shape stays on row tiles. The opt-in
``layer_output`` modes are checked the same way against the stock SDPA call, and fall back to it.

Which shapes were checked, and which failed, is process-wide by design (:data:`SEEN`, :data:`ROWS_ONLY`,
:data:`STOCK_OUTPUT`): the kernels are the process's, so a later recording never returns to a method that
failed.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import passes
from .layout import TokenLayout
from .reducers import Reducer

__all__ = [
    "OUTPUT_MAPS_TOLERANCE",
    "OUTPUT_RTOL",
    "RECHECK_RATE",
    "TOLERANCE",
    "RowProbe",
    "SpotCheck",
    "Verifier",
    "probe_rows",
]

# Largest allowed |fast − exact| for a probability or a pooled sum (each ≤ 1), or relative to an entropy. Every method computes
# them in float32 from q and k converted exactly to float32: within 1e-5 (on GPUs, float32 fused kernels
# may run with 3×TF32, about 1e-6 relative). Maps made from an opt-in output call in a 16-bit model
# carry that kernel's precision: the joint call's sums are rounded to the model's dtype per query row,
# and the flash kernel's lse is off by a few 1e-5 (measured by the self-test): half an ulp at 1.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
OUTPUT_MAPS_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}
# Largest allowed |opt-in output − stock output|, relative to the stock output's largest entry: a few
# roundings in the model's dtype.
OUTPUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}
RECHECK_RATE = 0.01  # after the first check of a shape, the share of captures checked again
SEEN: set[tuple] = set()  # (device, dtype, method, shape) checked in this process
ROWS_ONLY: set[tuple] = set()  # (device, dtype, S, heads, D) whose fast method failed: row tiles from now on
STOCK_OUTPUT: set[tuple] = set()  # (device, dtype, mode, shape) whose opt-in output failed: the stock call


def probe_rows(layout: TokenLayout, count: int = 8) -> torch.Tensor:
    """Query tokens a check recomputes: the first and last text token and video tokens spread over the
    video (``count`` in all, fewer when the sequence is shorter), sorted."""
    T, S = layout.text_len, layout.seq_len
    text = [0, T - 1] if T > 1 else [0]
    video = torch.linspace(T, S - 1, max(1, count - len(text))).round().long().tolist() if S > T else []
    return torch.tensor(sorted(set(text + video)), dtype=torch.long)


class RowProbe:
    """The key-pooled values a method produced for ``rows``, per kind: ``(H, len(rows), C)`` float32."""

    def __init__(self, rows: torch.Tensor, num_heads: int):
        self.rows, self.num_heads = rows, num_heads
        self.values: dict[str, torch.Tensor] = {}

    def take(self, red: Reducer, h0: int, r0: int, values: torch.Tensor) -> None:
        """Keep what of ``values`` ``(h, r, C)`` (heads ``h0:``, query rows ``r0:``) falls on the probe's rows."""
        h, r, C = values.shape
        inside = (self.rows >= r0) & (self.rows < r0 + r)
        if not inside.any():
            return
        buf = self.values.setdefault(red.kind, torch.full((self.num_heads, len(self.rows), C), float("nan")))
        idx = (self.rows[inside] - r0).to(values.device)
        buf[h0 : h0 + h, inside] = values[:, idx].float().cpu()


@dataclass(frozen=True)
class SpotCheck:
    """One check: where, which method, how many rows, the largest error against exact rows, the tolerance."""

    step: int | None
    layer: int
    what: str  # the method ("sdpa", "triton", "joint", ...), or "layer_output=lse"/"=joint" for output checks
    device: str
    dtype: str
    rows: int
    max_error: float
    tolerance: float
    passed: bool

    def asdict(self) -> dict:
        return asdict(self)


class Verifier:
    """A recording's spot checks: when to check, and the checks made (the shapes sent back to row tiles or
    the stock output call are the process's: :data:`ROWS_ONLY`, :data:`STOCK_OUTPUT`).

    Args:
        enabled (`bool`): ``CaptureOptions.verify``; `False` checks nothing.
        seed (`int`, defaults to 0): seed of the re-check draws (reproducible runs).
    """

    def __init__(self, enabled: bool, seed: int = 0):
        self.enabled = enabled
        self.checks: list[SpotCheck] = []
        self.rows_only, self.stock_output = ROWS_ONLY, STOCK_OUTPUT
        self._rng = random.Random(seed)

    def due(self, key: tuple) -> bool:
        """Whether the capture (or output call) of ``key`` is checked now: the first time this process sees
        the key, then at :data:`RECHECK_RATE` of the calls. Keys name the device, dtype, method (or output
        mode) and shape; the row-tile method is the exact one the checks compare with, and is not checked."""
        if not self.enabled:
            return False
        if key not in SEEN:
            SEEN.add(key)
            return True
        return self._rng.random() < RECHECK_RATE

    def check_maps(self, probes, q, k, heads, reducers, step, layer, method, scale) -> SpotCheck:
        """Compare the probes (``(batch item, RowProbe)`` pairs) with exact float32 rows of ``q`` and ``k``
        ``(B, H, S, D)`` (``heads``: the selected heads, `None` for all, in order); record and return the check.

        Each kind is held to its own tolerance: :data:`TOLERANCE` for what float32 passes made,
        :data:`OUTPUT_MAPS_TOLERANCE` for what a 16-bit output call's lse or sums made (single keys with
        its lse, multi-key groups from the joint call); an entropy's error counts per unit of
        ``max(1, |lse|)`` (``lse − scale·q·(PK)`` cancels two numbers of that size). ``received`` has no
        per-query value: its swapped pass runs on the probe rows with their exact lse, against the
        column sums of those rows. The check keeps the worst error relative to its tolerance."""
        from_output = method.startswith("joint") or "output call" in method
        strict = TOLERANCE.get(q.dtype, 1e-5)
        loose = OUTPUT_MAPS_TOLERANCE.get(q.dtype, 1e-5) if from_output else strict
        worst = (0.0, 0.0, strict)  # (error / tolerance, error, tolerance)
        for b, probe in probes:
            qb = q[b] if heads is None else q[b].index_select(0, heads.to(q.device))
            kb = k[b] if heads is None else k[b].index_select(0, heads.to(k.device))
            q_rows = qb[:, probe.rows.to(q.device)].float()
            logits = (q_rows @ kb.float().transpose(1, 2)) * scale
            lse, probs = torch.logsumexp(logits, -1), torch.softmax(logits, -1)
            for red in reducers:
                if red.stat == "received":
                    got = passes.received_pass(q_rows, kb.float(), lse, scale)
                    error, tol = (got - probs.sum(1)).abs().max().item(), strict
                elif red.key_groups is None and red.stat != "entropy":
                    continue  # row kinds are exact rows
                else:
                    exact, got = red.from_rows(probs).cpu(), probe.values.get(red.kind)
                    if got is None:
                        error, tol = float("nan"), strict  # a gap fails
                    elif red.stat == "entropy":
                        error, tol = (
                            ((got - exact).abs() / lse.cpu().abs().clamp(min=1)[..., None]).max().item(),
                            strict,
                        )
                    else:
                        single = red.key_groups.single_keys
                        tol = loose if (single or method.startswith("joint")) else strict
                        error = (got - exact).abs().max().item()
                if error != error or error / tol > worst[0]:
                    worst = (float("inf") if error != error else error / tol, error, tol)
        _, error, tolerance = worst
        rows = len(probes[0][1].rows) * len(probes) if probes else 0
        check = SpotCheck(
            step, layer, method, str(q.device), _name(q.dtype), rows, error, tolerance, error <= tolerance
        )
        self.checks.append(check)
        return check

    def maps_failed(self, check: SpotCheck, shape: tuple) -> None:
        """Warn about a failed map check and send ``shape`` (device, dtype, S, heads, D) to row tiles."""
        warn_failed(
            check, shape[2:], "this layer call's maps are recomputed with row tiles, as every later one of this shape"
        )
        self.rows_only.add(shape)

    def output_failed(self, check: SpotCheck, shape: tuple) -> None:
        """Warn about a failed output check and send ``shape`` (device, dtype, mode, q's shape) to the stock call."""
        warn_failed(check, shape[3], "this and every later call of this shape take the stock output call")
        self.stock_output.add(shape)

    def check_output(self, out, q, k, v, rows, step, layer, mode) -> SpotCheck:
        """Compare an opt-in output call's ``out`` ``(B, H, S, D)`` with the stock SDPA call on ``rows``."""
        rows = rows.to(q.device)
        stock = F.scaled_dot_product_attention(q[:, :, rows], k, v, dropout_p=0.0, is_causal=False).float()
        tolerance = OUTPUT_RTOL.get(q.dtype, 1e-5) * max(stock.abs().max().item(), 1e-6)
        error = (out[:, :, rows].float() - stock).abs().max().item()
        what = f"layer_output={mode}"
        check = SpotCheck(
            step, layer, what, str(q.device), _name(q.dtype), len(rows), error, tolerance, error <= tolerance
        )
        self.checks.append(check)
        return check


def warn_failed(check: SpotCheck, shape: tuple, instead: str) -> None:
    """The one warning of a failed check: what, where, how wrong, and what is used instead."""
    warnings.warn(
        f"spot check failed: {check.what} on {check.device} ({check.dtype}, shape {shape}) is off by "
        f"{check.max_error:.3g} against exact rows (tolerance {check.tolerance:.3g}) at step {check.step}, "
        f"layer {check.layer}; {instead}. Please report it with the output of `python -m cogattn.selftest`.",
        stacklevel=5,
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
