"""Spot checks: every capture verifies its fast method against exact float32 rows, wherever it runs.

The fast methods (the fused SDPA pass, the Triton kernel, the output call's lse and sums) run kernels
no test here sees on a user's GPU. Every recording checks the first capture of each (device, dtype,
method, shape, kind) itself, and again a small share of later ones: a :class:`RowProbe` keeps what the
method produced for a few query rows (2 text and 6 video tokens, all selected heads), and
:class:`Verifier` recomputes those rows exactly: float32 ``softmax(q·kᵀ·scale)`` from the same q and k,
pooled with each kind's own key groups. Each kind is held to its bound (:func:`bound`). A disagreement
is warned about once, the layer call's maps are recomputed with row tiles (nothing wrong is stored),
and that shape stays on row tiles. The opt-in ``layer_output`` modes are checked the same way against the
stock SDPA call, and fall back to it.

Which shapes failed is process-wide by design (:data:`ROWS_ONLY`, :data:`STOCK_OUTPUT`): the kernels are
the process's, so a later recording never returns to a method that failed. Which were checked is each
recording's own, so every run holds its own evidence.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from . import kernels, passes
from .reducers import REDUCERS, Reducer

__all__ = [
    "OUTPUT_MAPS_TOLERANCE",
    "OUTPUT_RTOL",
    "output_identical",
    "RECHECK_RATE",
    "TOLERANCE",
    "RowProbe",
    "bound",
    "error_units",
    "made_from_output",
    "output_kinds",
    "SpotCheck",
    "Verifier",
    "probe_rows",
]

# Largest allowed |fast − exact|, in the units of :func:`error_units` (1 for a probability or a pooled sum
# of a row that is not peaked). Every method computes them in float32 from q and k converted exactly
# to float32: within 1e-5 (on GPUs, float32 fused kernels may run with 3×TF32, about 1e-6 relative). Maps
# made from an opt-in output call in a 16-bit model carry that kernel's precision: the joint call's sums
# are rounded to the model's dtype per query row, and the flash kernel's lse is off by a few 1e-5
# (measured by the self-test): half an ulp at 1.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}
OUTPUT_MAPS_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}
# Largest allowed |opt-in output − stock output|, relative to the stock output's largest entry: a few
# roundings in the model's dtype.
OUTPUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}
RECHECK_RATE = 0.01  # after a recording's first check of a shape and kind, the share of captures checked again
ROWS_ONLY: set[tuple] = set()  # (device, dtype, S, heads, D) whose fast method failed: row tiles from now on
STOCK_OUTPUT: set[tuple] = set()  # (device, dtype, mode, shape) whose opt-in output failed: the stock call


def output_identical(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer's output under ``layer_output=mode`` is promised bit-identical to the stock call's: the
    stock call everywhere, the opt-in calls on a CPU in float32. On a CPU with AMX or AVX-512 BF16 the opt-in calls'
    16-bit products are summed in other blocks than the stock call's (q and k padded, values widened), and on CUDA
    they are other kernels: their last bits may differ, within :data:`OUTPUT_RTOL`."""
    return mode == "stock" or (device.type == "cpu" and dtype == torch.float32)


def bound(dtype: torch.dtype, made_from_output: bool) -> float:
    """The documented bound of every kind (docs/kinds.md, "Kinds and exactness"; docs/design.md, "Spot checks"), in the
    kind's units (:func:`error_units`): :data:`TOLERANCE`, or with ``made_from_output`` (the kind was made from what a
    model-dtype output call brought, its lse or sums) :data:`OUTPUT_MAPS_TOLERANCE`, half an ulp at 1 in a
    16-bit model."""
    return (OUTPUT_MAPS_TOLERANCE if made_from_output else TOLERANCE).get(dtype, 1e-5)


MULTI_KEY_KINDS = tuple(k for k, cls in REDUCERS.items() if cls.multi_key)  # frame, block, tile, query_frame


def output_kinds(layer_output: str) -> tuple[str, ...]:
    """The kinds that may be made from what an opt-in output call brought, held to
    :data:`OUTPUT_MAPS_TOLERANCE` in a 16-bit model: single keys (``video_to_text``) and ``received`` from
    its lse (when no float32 pass gave one), the multi-key groups from the joint call's sums or, with the
    Triton kernel, from the output call's lse."""
    return () if layer_output == "stock" else ("video_to_text", "received", *MULTI_KEY_KINDS)


def made_from_output(kind: str, layer_output: str, kinds, method: str) -> bool:
    """Whether ``kind``, captured with ``kinds`` by the concrete ``method`` under ``layer_output``, is made
    from what the output call brought (as :func:`cogattn.exact.engine.pooled_pass` chooses: a float32 pass's lse,
    of ``entropy`` or of the indicator columns, is preferred to the output call's)."""
    if kind not in output_kinds(layer_output) or method == "rows":
        return False
    float32_lse = "entropy" in kinds or (method == "sdpa" and any(k in MULTI_KEY_KINDS for k in kinds))
    if kind in MULTI_KEY_KINDS:
        return method == "joint" or (method == "triton" and "entropy" not in kinds)
    return not float32_lse


def error_units(kind: str, probs: torch.Tensor, lse: torch.Tensor, values: torch.Tensor | None = None):
    """What an error of ``kind`` is divided by before it is compared with :func:`bound`, from float
    probabilities ``probs`` ``(..., R, S)`` and the rows' lse ``(..., R)``. A float32 rounding of a score
    is of the size of ``|lse_i|``, so the units grow with it where the quantity is large:

    * ``entropy``: ``max(1, |lse_i|)`` per row ``(..., R)`` (``lse − scale·q·(PK)`` cancels two numbers of
      that size);
    * ``received``: ``max(1, Σ_i P[i, j]·max(1, |lse_i|))`` per key ``(..., S)``;
    * a probability or pooled sum ``x`` of row i (``values`` ``(..., R, C)``): ``max(1, x·|lse_i|)``, so
      1e-5 absolute unless the row is peaked; without ``values``, `None` (absolute).
    """
    per_row = lse.abs().clamp(min=1)
    if kind == "entropy":
        return per_row
    if kind == "received":
        return (probs * per_row[..., None]).sum(-2).clamp(min=1)
    return None if values is None else (values.abs() * per_row[..., None]).clamp(min=1)


def probe_rows(layout: TokenLayout, count: int = 8) -> torch.Tensor:
    """Query tokens a check recomputes: the first and last text token and video tokens spread over the
    video (``count`` in all, fewer when the sequence is shorter), sorted."""
    T, V, t0, v0 = layout.text_len, layout.video_len, layout.text_start, layout.video_start
    text = [t0, t0 + T - 1] if T > 1 else [t0] if T else []
    video = (
        torch.linspace(v0, v0 + V - 1, max(1, count - len(text)), dtype=torch.float64).round().long().tolist()
        if V
        else []
    )
    return torch.tensor(sorted(set(text + video)), dtype=torch.long)


class RowProbe:
    """The key-pooled values a method produced for ``rows``, per kind: ``(H, len(rows), C)`` float32. For
    ``received``, which has no per-query value, the rows' lse its pass used ``(H, len(rows), 1)``, and
    ``lse_from_output`` says whether that was the output call's (else a float32 pass's). Where the kernels wrote
    the row tiles (``TilePlan.kernel_tiles``), ``"probs"``: the rows' probabilities ``(H, len(rows), S)``."""

    def __init__(self, rows: torch.Tensor, num_heads: int):
        self.rows, self.num_heads = rows, num_heads
        self.values: dict[str, torch.Tensor] = {}
        self.lse_from_output = False

    def take(self, red: Reducer | str, h0: int, r0: int, values: torch.Tensor) -> None:
        """Keep what of ``values`` ``(h, r, C)`` (heads ``h0:``, query rows ``r0:``) falls on the probe's rows, under
        the reducer's kind (or the name ``red``)."""
        h, r, C = values.shape
        inside = (self.rows >= r0) & (self.rows < r0 + r)
        if not inside.any():
            return
        nan = torch.full((self.num_heads, len(self.rows), C), float("nan"), dtype=torch.float32)
        buf = self.values.setdefault(red if isinstance(red, str) else red.kind, nan)
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
        self.seen: set[tuple] = set()  # (device, dtype, method, shape, kind) this recording checked
        self._rng = random.Random(seed)

    def due(self, key: tuple, kinds: tuple[str, ...] = ("",)) -> bool:
        """Whether the capture (or output call) of ``key`` serving ``kinds`` is checked now: when this
        recording has not yet checked ``key`` for one of the kinds, else at :data:`RECHECK_RATE` of the
        calls. Keys name the device, dtype, method (or output mode) and shape; the row-tile method is the
        exact one the checks compare with, and is not checked."""
        if not self.enabled:
            return False
        new = {(*key, kind) for kind in kinds} - self.seen
        if new:
            self.seen |= new
            return True
        return self._rng.random() < RECHECK_RATE

    def check_maps(self, probes, q, k, heads, reducers, step, layer, method, scale, key_counts=None) -> SpotCheck:
        """Compare the probes (``(batch item, RowProbe)`` pairs) with exact float32 rows of ``q`` and ``k``
        ``(B, H, S, D)`` (``heads``: the selected heads, `None` for all, in order; ``key_counts``: per batch
        item, the keys a key mask keeps, the first ones); record and return the check.

        Each kind is held to its :func:`bound`, in its units (:func:`error_units`): what a 16-bit output
        call's lse or sums made (single keys and ``received`` from its lse, multi-key groups from the joint
        call's sums or from its lse in the Triton kernel) to :data:`OUTPUT_MAPS_TOLERANCE`, the rest to
        :data:`TOLERANCE`. ``received`` has no per-query value: its swapped pass runs on the probe rows with the lse the capture used for them, against the
        column sums of those rows, so the check covers that lse too. The check keeps the worst error
        relative to its bound."""
        worst = (0.0, 0.0, TOLERANCE.get(q.dtype, 1e-5))  # (error / bound, error, bound)
        kernel_tiles, kernel_pass = method.startswith("triton tiles"), method.split(",")[0] == "triton"
        for b, probe in probes:
            qb = q[b] if heads is None else q[b].index_select(0, heads.to(q.device))
            kb = k[b] if heads is None else k[b].index_select(0, heads.to(k.device))
            q_rows = qb[:, probe.rows.to(q.device)]
            logits = (q_rows.float() @ kb.float().transpose(1, 2)) * scale
            kept = kb.shape[1] if key_counts is None else int(key_counts[b])
            logits[..., kept:] = -math.inf  # masked keys: probability 0
            lse, probs = torch.logsumexp(logits, -1), torch.softmax(logits, -1)
            compared = [("probs", probe.values["probs"], probs, False)] if "probs" in probe.values else []
            for red in reducers:
                if red.key_groups is None and red.stat is None:
                    continue  # row kinds: the rows' probabilities, compared above where the kernels wrote them
                got = probe.values.get(red.kind)
                if red.stat == "received" and kernel_tiles:  # a column sum of the kernels' tiles: of the rows'
                    got = probe.values.get("probs")
                    got = None if got is None else got.sum(1)
                    exact, from_output = probs.sum(1), False
                elif red.stat == "received":
                    exact, from_output = probs.sum(1), probe.lse_from_output
                    if got is not None and kernel_pass:  # the kernel the capture ran, q and k in the model's dtype
                        got = kernels.received(q_rows, kb, got[..., 0].to(q.device), None, scale, keys=kept)
                    elif got is not None:
                        got = passes.received_pass(
                            q_rows.float(), kb[:, :kept].float(), got[..., 0].to(q.device), scale
                        )
                    got = None if got is None else torch.nn.functional.pad(got, (0, kb.shape[1] - kept))
                else:
                    exact = red.from_rows(probs)
                    single = red.key_groups is not None and red.key_groups.single_keys
                    by_output = method.startswith("joint") or (method.startswith("triton") and probe.lse_from_output)
                    from_output = (single and probe.lse_from_output) or (not single and by_output)
                compared.append((red.stat or red.kind, got, exact, from_output))
            for kind, got, exact, from_output in compared:
                tol = bound(q.dtype, from_output)
                units = error_units("full" if kind == "probs" else kind, probs, lse, exact)
                if got is None:
                    error = float("nan")  # a gap fails
                else:
                    diff = (got.cpu() - exact.cpu()).abs()
                    if units is not None:
                        diff = diff / units.cpu().reshape(*units.shape, *[1] * (diff.dim() - units.dim()))
                    error = diff.max().item()
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
