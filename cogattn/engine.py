"""Exact attention-probability tiles within a memory budget, folded into reducers.

These paths compute the same numbers:

* ``rows``: a tile of ``r`` query rows × all ``S`` keys × ``h`` heads is formed with one matmul and an
  in-place float32 softmax. Serves every kind; key-pooled sums come from ``tile @ indicator``.
* ``sdpa``: key-pooled sums without forming P. ``Σ_{j∈group} P[i, j] = (P·V)[i, group]`` with the
  indicator ``V[j, g] = 1`` for key ``j`` in group ``g``, so one fused SDPA call on ``V`` (padded to
  the head dimension) gives multi-key groups; the same call returns the log-sum-exp of every row, from
  which single-key columns are ``exp(q·kᵀ·scale − lse)`` at a cost of ``S·C·D``.
* ``triton``: as ``sdpa``, but multi-key groups come from a fused Triton kernel that, given the lse
  (from the output kernel with ``output="lse"``, else one lse-only pass), accumulates
  ``exp(q·kᵀ·scale − lse)·V`` tile by tile in the model's dtype with float32 accumulation
  (:mod:`cogattn.kernels`). On CUDA with Triton, ``auto`` plans ``timed``: the first capture of each
  shape runs both this and the ``sdpa`` pass, keeps the faster (:func:`chosen_paths`), and falls back
  to ``sdpa`` if the kernel fails to build.
* ``joint`` (with ``output="joint"``): the output call itself, on values widened with the indicator
  (:func:`attention_joint`), brings the multi-key sums and the lse; nothing runs but the single-key
  columns.

The planner picks head and row chunk sizes so that the transient float32 working set stays within the
budget; the reducers' results are not counted (they are what the user asked for).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch

from . import kernels
from .reducers import Reducer

__all__ = [
    "TilePlan", "plan_tiles", "capture", "attention_with_lse", "attention_joint", "check_output", "joint_width", "joint_extra_bytes",
    "multi_key_indicator", "sdpa_supported", "chosen_paths",
    "PATHS", "OUTPUTS",
]  # fmt: skip

PATHS = ("auto", "rows", "sdpa", "triton")
OUTPUTS = ("stock", "lse", "joint")  # how captured layers compute their output (see recording.record)
_F32 = 4
_MAX_ROWS = 1024  # larger row tiles stop paying off and only add latency
_RESERVE = 16 * 2**20  # at most this much of the budget is kept back as headroom


@dataclass(frozen=True)
class TilePlan:
    """Chunk sizes for one layer call.

    Args:
        path (`str`): how key-pooled kinds are computed: ``"rows"``, ``"sdpa"``, ``"triton"``, ``"joint"``
            (the output call brings them), or ``"timed"`` (``sdpa`` or ``triton``, whichever the first
            capture of a shape measures faster).
        row_heads (`int`): heads per row tile.
        row_rows (`int`): query rows per row tile.
        sdpa_heads (`int`): heads per SDPA call (0 when the SDPA path is not used).
        sdpa_rows (`int`): query rows per single-key-column tile on the SDPA path.
        peak_bytes (`int`): predicted peak transient bytes.
    """

    path: str
    row_heads: int
    row_rows: int
    sdpa_heads: int
    sdpa_rows: int
    peak_bytes: int


def sdpa_supported(device: torch.device) -> bool:
    """Whether a fused SDPA kernel that also returns the log-sum-exp exists for ``device``."""
    return device.type in ("cpu", "cuda")


def _can_time_triton(device: torch.device) -> bool:
    """Whether ``auto`` times the Triton kernel against the SDPA pass (CUDA with Triton; the interpreter on
    the CPU is far slower than SDPA, so there ``auto`` means ``sdpa``)."""
    return device.type == "cuda" and kernels.available(device)


def _auto_path(device: torch.device, wants_all_rows: bool) -> str:
    if wants_all_rows or not sdpa_supported(device):
        return "rows"
    return "timed" if _can_time_triton(device) else "sdpa"


_CHOSEN: dict[tuple, str] = {}  # shape of a timed capture -> "sdpa" or "triton"


def chosen_paths() -> dict[tuple, str]:
    """What ``auto`` chose on CUDA so far: ``(device, dtype, S, heads, D, key groups, lse given)`` →
    ``"sdpa"`` or ``"triton"``, timed at the first capture of that shape in this process."""
    return dict(_CHOSEN)


def _sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Fused attention ``(1, h, S, D)`` returning ``(out, lse)`` with ``lse`` of shape ``(1, h, S)`` in float32."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
    elif q.device.type == "cuda":
        # Memory-efficient kernel: supports float32 and returns lse padded to a multiple of 32 rows.
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)[
            :2
        ]
    else:
        raise RuntimeError(f"no fused attention kernel with log-sum-exp for device {q.device}")
    return out, lse[..., : q.shape[2]]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The layer's attention output and the float32 log-sum-exp of every row, ``(B, H, S)``, from the
    flash kernel ``F.scaled_dot_product_attention`` usually dispatches to (no mask, no dropout): on the
    CPU it is the kernel SDPA uses (bit-identical output, tested); on CUDA, for fp16/bf16, SDPA may pick
    another backend (cuDNN on Hopper), so the output can differ in the last bits. Returns
    ``(F.scaled_dot_product_attention(q, k, v), None)`` where no such kernel applies."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
        return out, lse
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[:2]
            return out, lse
        except RuntimeError:  # no flash kernel on this GPU: stay on the stock call
            pass
    return torch.nn.functional.scaled_dot_product_attention(q, k, v), None


def check_output(output: str, path: str) -> None:
    """Raise `ValueError` for an unknown ``output`` or one that cannot go with ``path``."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}; choose one of {list(OUTPUTS)}.")
    if output == "joint" and path != "auto":
        raise ValueError(f"output='joint' computes key-pooled kinds in the output call; path={path!r} cannot apply. "
                         "Leave path='auto'.")  # fmt: skip


def joint_width(head_dim: int, num_cols: int) -> int:
    """Head dim of the joint call: ``D`` value columns plus ``num_cols`` indicator columns, rounded up to a
    multiple of 8 (the fused kernels' alignment)."""
    return -(-(head_dim + num_cols) // 8) * 8


_JOINT_MAX_WIDTH = 256  # the widest head dim the CUDA flash kernel takes


def attention_joint(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indicator: torch.Tensor):
    """The attention output, every row's log-sum-exp and key-pooled sums, from one fused attention call.

    The values are widened with the indicator columns, ``[v | indicator | 0]``, and q and k are padded
    with zeros to the same width (the fused kernels need one head dim; zeros leave every score as it
    is), with the softmax scale of the unpadded head dim. Column ``D + c`` of that call's output is then
    ``Σ_j P[i, j]·indicator[j, c]``.

    Args:
        q, k, v (`torch.Tensor`): ``(B, H, S, D)`` in the model's dtype.
        indicator (`torch.Tensor`): ``(S, C)``, 1 where key j is in group c.

    Returns:
        `tuple`: ``out`` ``(B, H, S, D)``, ``lse`` ``(B, H, S)`` float32, ``sums`` ``(B, H, S, C)`` in the
        model's dtype; copies, so the wide buffers are freed on return (:func:`joint_extra_bytes`).
    """
    B, H, S, D = q.shape
    C = indicator.shape[1]
    W = joint_width(D, C)
    scale = 1.0 / math.sqrt(D)
    pad = (0, W - D)
    qp, kp = torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad)
    vp = q.new_zeros(B, H, S, W)
    vp[..., :D] = v
    vp[..., D : D + C] = indicator.to(q.dtype)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qp, kp, vp, 0.0, False, scale=scale)[:2]
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and W <= _JOINT_MAX_WIDTH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = _sdpa_with_lse(qp, kp, vp, scale)
    del qp, kp, vp
    return out[..., :D].contiguous(), lse, out[..., D : D + C].contiguous()


def joint_extra_bytes(batch: int, heads: int, seq_len: int, head_dim: int, num_cols: int, elem_size: int) -> int:
    """Peak bytes :func:`attention_joint` holds beyond the stock call's output, for ``batch`` items: the
    padded q, k, the widened values and the wide output, less the output the stock call would allocate."""
    return batch * heads * seq_len * elem_size * (4 * joint_width(head_dim, num_cols) - head_dim)


def _row_tile_bytes(h: int, r: int, S: int, D: int, C: int, copies: bool) -> int:
    # float32 K of the head chunk (when the input must be copied), the q rows, the scores (the softmax
    # runs in place), the pooled sums
    return _F32 * (h * S * D * copies + h * r * D + h * r * S + h * r * C)


def _sdpa_bytes(h: int, r: int, S: int, D: int, n_multi: int, n_single: int, copies: bool, joint: bool = False) -> int:
    if joint:  # sums and lse came with the output: a float32 chunk of the sums, then the single-key tiles
        held = h * S + h * D * n_single  # lse, the single keys' k
        return _F32 * (held + max(h * S * n_multi, h * r * (n_single + D * copies)))
    # Held throughout: float32 q and k (when copied), the padded indicator (plus a per-call slice when
    # there are several calls), lse. Then first the outputs (gathered in a buffer when there are several
    # calls), freed before the single-key tiles of r rows.
    calls = max(1, math.ceil(n_multi / D))
    held = 2 * h * S * D * copies + S * D * (calls + (calls > 1)) + h * S
    outputs = h * S * D * (calls + 1 if calls > 1 else 1)
    single = h * r * n_single + h * D * n_single
    return _F32 * (held + max(outputs, single))


def _largest(fits, upper: int) -> int:
    """Largest n in [1, upper] with fits(n) (fits is monotone), or 0."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_tiles(
    reducers: list[Reducer],
    seq_len: int,
    num_heads: int,
    head_dim: int,
    budget: int,
    path: str,
    device,
    copies_inputs: bool = True,
) -> TilePlan:
    """Choose chunk sizes for ``reducers`` within ``budget`` bytes; raises `ValueError` when nothing fits.

    Args:
        reducers (`list[Reducer]`): what one layer call computes.
        seq_len, num_heads, head_dim (`int`): S, the selected heads H, D.
        budget (`int`): bytes of transient working memory allowed.
        path (`str`): one of `PATHS`, or ``"joint"`` when the output call brings the key-pooled sums and the
            lse (``output="joint"``).
        device: where the capture runs (``"auto"`` needs to know whether a fused kernel exists).
        copies_inputs (`bool`, defaults to `True`): whether q and k must be copied to float32 per head chunk
            (not for contiguous float32 inputs with every head selected).
    """
    S, H, D = seq_len, num_heads, head_dim
    # Headroom for what the model below leaves out (softmax row statistics, fold temporaries, kernel
    # workspaces): measured at 1 GiB these add up to a few MiB.
    budget, asked = budget - min(budget // 32, _RESERVE), budget
    pooled = [r for r in reducers if r.key_groups is not None]
    if not pooled:
        path = "rows"  # every kind is served by row tiles
    elif path == "auto":
        wants_all_rows = any(_all_rows(r, S) for r in reducers)
        path = _auto_path(torch.device(device), wants_all_rows)
    elif path == "joint" and not sdpa_supported(torch.device(device)):
        raise ValueError(f"output='joint' needs a fused attention kernel with log-sum-exp; device is {device}.")
    elif path == "triton" and not kernels.available(torch.device(device)):
        raise ValueError(
            f"path='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); device is {device}, Triton "
            f"{'is' if kernels.triton is not None else 'is not'} installed. Use path='auto'."
        )
    row_cols = sum(r.key_groups.num_groups for r in pooled) if path == "rows" else 0
    row_sets = [len(r.rows) for r in reducers if r.rows is not None] + ([S] if pooled and path == "rows" else [])
    n_single = sum(r.key_groups.num_groups for r in pooled if r.key_groups.single_keys)
    n_multi = sum(r.key_groups.num_groups for r in pooled if not r.key_groups.single_keys)

    def row_bytes(h: int, r: int) -> int:
        return _row_tile_bytes(h, r, S, D, row_cols, copies_inputs)

    def sdpa_bytes(h: int, r: int) -> int:
        return _sdpa_bytes(h, r, S, D, n_multi, n_single, copies_inputs, joint=path == "joint")

    row_heads = row_rows = 0
    if row_sets:
        most_rows = min(max(row_sets), _MAX_ROWS)
        # Prefer all heads per tile (one pass folds the head mean) with a reasonable row count.
        for h in range(H, 0, -1):
            row_rows = _largest(lambda r: row_bytes(h, r) <= budget, most_rows)
            if row_rows >= min(64, most_rows) or h == 1:
                row_heads = h
                break
        if row_rows == 0:
            raise _too_small(asked, row_bytes(1, 1), S, D)
    sdpa_heads = sdpa_rows = 0
    if pooled and path in ("sdpa", "triton", "timed", "joint"):  # the Triton pass holds less than the SDPA pass
        sdpa_heads = _largest(lambda h: sdpa_bytes(h, 1) <= budget, H)
        if sdpa_heads == 0:
            raise _too_small(asked, sdpa_bytes(1, 1), S, D)
        sdpa_rows = _largest(lambda r: sdpa_bytes(sdpa_heads, r) <= budget, S) if n_single else S
    peak = max(row_bytes(row_heads, row_rows) if row_sets else 0, sdpa_bytes(sdpa_heads, sdpa_rows) if sdpa_heads else 0)
    return TilePlan(path, row_heads, row_rows, sdpa_heads, sdpa_rows, peak)


def _too_small(budget: int, need: int, S: int, D: int) -> ValueError:
    # a budget whose part left after the reserve holds `need`
    enough = need + _RESERVE if need + _RESERVE > 32 * _RESERVE else -(-need * 32 // 31) + 1
    return ValueError(
        f"memory_budget={budget} bytes is too small for one tile at sequence length S={S}, head dim {D}: "
        f"the smallest tile needs {need} bytes. Raise memory_budget to at least {enough} (e.g. '1GiB')."
    )


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
) -> None:
    """Fold exact float32 attention probabilities of one batch item into ``outs``.

    Args:
        q (`torch.Tensor`): queries ``(H, S, D)``, any float dtype.
        k (`torch.Tensor`): keys ``(H, S, D)``.
        reducers (`list[Reducer]`): what to compute.
        outs (`list[torch.Tensor]`): one float32 result per reducer for this batch item, ``(H_out, ...)``, zeroed.
        plan (`TilePlan`): chunk sizes from :func:`plan_tiles`.
        heads (`torch.Tensor | None`): indices of the selected heads, `None` for all; chunks are
            gathered one at a time so no copy of all selected heads is made.
        lse (`torch.Tensor | None`): the rows' log-sum-exp ``(H, S)`` (all heads) when the output path
            provides it; single-key columns then need no attention pass of their own.
        sums (`torch.Tensor | None`): with ``lse``, the multi-key groups' sums ``(H, S, C)`` (all heads, the
            groups of the key-pooled reducers side by side, any dtype) when the output call computed them
            (``plan.path == "joint"``); nothing then needs an attention pass.
        scale (`float | None`): softmax scale, defaults to ``1/sqrt(D)`` as in SDPA.
    """
    S, D = q.shape[1:]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k = _HeadView(q, heads), _HeadView(k, heads)
    pooled = [(r, o) for r, o in zip(reducers, outs) if r.key_groups is not None]
    row_kinds = [(r, o) for r, o in zip(reducers, outs) if r.rows is not None]

    all_rows = [(r, o) for r, o in row_kinds if _all_rows(r, S)]
    if all_rows or (pooled and plan.path == "rows"):
        _row_pass(q, k, None, all_rows, pooled if plan.path == "rows" else [], plan, scale)
    for red, out in row_kinds:
        if not _all_rows(red, S):
            _row_pass(q, k, red.rows, [(red, out)], [], plan, scale)
    if pooled and plan.path in ("sdpa", "triton", "timed", "joint"):
        if plan.path == "joint" and (lse is None or (sums is None and any(not r.key_groups.single_keys for r, _ in pooled))):
            raise ValueError("plan.path='joint' needs the lse and the key-pooled sums of the output call")
        if lse is not None and heads is not None:
            lse = lse.index_select(0, heads.to(lse.device))
        given = None if sums is None else _HeadView(sums, heads)
        path = _timed_choice(q, k, pooled, plan, scale, lse) if plan.path == "timed" else plan.path
        _sdpa_pass(q, k, pooled, plan, scale, lse, fused=path == "triton", given_sums=given)


def _timed_choice(q, k, pooled, plan: TilePlan, scale: float, lse) -> str:
    """``sdpa`` or ``triton`` for this shape: on first sight, time both on the multi-key groups (into
    scratch results) and keep the faster; the kernel failing to build or run means ``sdpa``."""
    multi = [r for r, _ in pooled if not r.key_groups.single_keys]
    key = (str(q.device), q.x.dtype, q.shape[1], q.shape[0], q.shape[2],
           tuple(r.key_groups.num_groups for r in multi), lse is not None)  # fmt: skip
    D = q.shape[2]
    if not multi or D < 16 or D & (D - 1):
        return "sdpa"  # single-key columns are the same work on both; the kernel needs D a power of two
    if key not in _CHOSEN:

        def run(fused: bool) -> float:
            scratch = [(r, torch.zeros(r.shape(1)[1:], device=q.device)) for r in multi]
            _synchronize(q.device)
            t0 = time.perf_counter()
            _sdpa_pass(q, k, scratch, plan, scale, lse, fused=fused)
            _synchronize(q.device)
            return time.perf_counter() - t0

        try:
            run(True)  # compiles the kernel
            t_triton = run(True)
        except Exception as err:  # noqa: BLE001 - any build or launch failure: stay on the SDPA pass
            warnings.warn(f"the Triton pooled-sum kernel failed ({type(err).__name__}: {err}); using path 'sdpa'.")
            _CHOSEN[key] = "sdpa"
        else:
            _CHOSEN[key] = "triton" if t_triton < run(False) else "sdpa"
    return _CHOSEN[key]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_rows(reducer: Reducer, S: int) -> bool:
    """Whether a reducer asks for every query row in order (then one pass over all rows serves it)."""
    rows = reducer.rows
    return rows is not None and len(rows) == S and bool(torch.equal(rows.cpu(), torch.arange(S)))


class _HeadView:
    """Selected heads of a ``(H, S, D)`` tensor, gathered chunk by chunk in float32."""

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


def multi_key_indicator(reducers: list[Reducer], S: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Indicator ``(S, ΣC)`` of the reducers' multi-key groups side by side, in reducer order (the columns
    the SDPA pass, the Triton kernel and the joint output call compute)."""
    groups = [r.key_groups for r in reducers if r.key_groups is not None and not r.key_groups.single_keys]
    if not groups:
        return torch.zeros(S, 0, dtype=dtype, device=device)
    return torch.cat([g.indicator(S, dtype, device) for g in groups], dim=1)


def _row_pass(q, k, rows, row_kinds, pooled, plan: TilePlan, scale: float) -> None:
    """Row tiles over ``rows`` (all S when `None`), folded into row kinds and, via the indicator, pooled kinds."""
    H, S, D = q.shape
    n_rows = S if rows is None else len(rows)
    # Single-key groups are a gather of columns; multi-key groups a product with their indicator.
    gathers = [r.key_groups.keys.to(q.device) if r.key_groups.single_keys else None for r, _ in pooled]
    indicators = [None if g is not None else r.key_groups.indicator(S, device=q.device) for (r, _), g in
                  zip(pooled, gathers)]  # fmt: skip
    for h0 in range(0, H, plan.row_heads):
        h1 = min(H, h0 + plan.row_heads)
        kt = k.chunk(h0, h1).transpose(1, 2)  # (h, D, S), a transposed view: bmm reads it without a copy
        for r0 in range(0, n_rows, plan.row_rows):
            r1 = min(n_rows, r0 + plan.row_rows)
            idx = slice(r0, r1) if rows is None else rows[r0:r1].to(q.device)
            scores = torch.matmul(q.chunk(h0, h1, idx), kt).mul_(scale)  # (h, r, S)
            probs = _softmax_(scores)
            for red, out in row_kinds:
                red.fold_rows(out, h0, r0, probs)
            for (red, out), keys, ind in zip(pooled, gathers, indicators):
                sums = probs.index_select(-1, keys) if keys is not None else torch.matmul(probs, ind)
                red.fold_pooled(out, h0, r0, sums)
            del scores, probs  # free this tile before the next one is allocated


def _lse_only(qm, km, qf, kf, scale: float) -> torch.Tensor:
    """Log-sum-exp of every row ``(1, h, S)``: from the flash kernel in the model's dtype where there is
    one (fp32 accumulation), else from the float32 SDPA pass."""
    if qm.dtype != torch.float32 or qm.device.type == "cpu":
        _, lse = attention_with_lse(qm, km, torch.zeros(1, 1, 1, qm.shape[-1], dtype=qm.dtype,
                                                         device=qm.device).expand_as(qm))  # fmt: skip
        if lse is not None:
            return lse
    return _sdpa_with_lse(qf, kf, torch.zeros(1, 1, 1, qf.shape[-1], device=qf.device).expand_as(qf), scale)[1]


def _softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Float32 softmax over the last dim, in place (a tile is the largest buffer; do not copy it)."""
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


def _sdpa_pass(q, k, pooled, plan: TilePlan, scale: float, given_lse: torch.Tensor | None = None,
               fused: bool = False, given_sums: _HeadView | None = None) -> None:  # fmt: skip
    """Key-pooled sums through fused SDPA on indicator values (or the Triton kernel when ``fused``, or
    ``given_sums`` when the output call computed them), plus single-key columns from the lse
    (``given_lse`` ``(H, S)`` when the output path computed it: no attention pass for single keys)."""
    H, S, D = q.shape
    multi = [(r, o) for r, o in pooled if not r.key_groups.single_keys]
    single = [(r, o) for r, o in pooled if r.key_groups.single_keys]
    offsets = [0]
    for r, _ in multi:
        offsets.append(offsets[-1] + r.key_groups.num_groups)
    n_cols = 0 if given_sums is not None else offsets[-1]  # with no multi-key groups: a pass for the lse alone
    # Values must have the head dimension for the fused kernels: pad, and use ceil(C / D) calls.
    n_calls = max(1, math.ceil(n_cols / D))
    passes = (multi and given_sums is None) or given_lse is None  # an attention pass runs per head chunk
    if passes:
        v_all = torch.zeros(S, n_calls * D, device=q.device)  # zero values cost the same as any
        if n_cols:
            v_all[:, :n_cols] = multi_key_indicator([r for r, _ in multi], S, q.device)
    for h0 in range(0, H, plan.sdpa_heads):
        h1 = min(H, h0 + plan.sdpa_heads)
        # float32 q and k of the chunk for the attention pass; without one, single keys copy only their rows
        qf, kf = (q.chunk(h0, h1)[None], k.chunk(h0, h1)[None]) if passes else (None, None)
        # The output kernel's lse when given (the same numbers), else the indicator pass's own.
        lse = None if given_lse is None else given_lse[None, h0:h1].float()
        if multi and given_sums is not None:
            sums = given_sums.chunk(h0, h1)  # float32
            for (red, o), c0, c1 in zip(multi, offsets, offsets[1:]):
                red.fold_pooled(o, h0, 0, sums[..., c0:c1])
            del sums
        elif multi and fused:
            qm, km = q.chunk(h0, h1, dtype=None), k.chunk(h0, h1, dtype=None)  # the model's dtype
            if lse is None:
                lse = _lse_only(qm[None], km[None], qf, kf, scale)
            sums = kernels.pooled_sums(qm, km, lse[0], v_all[:, :n_cols], scale)
            del qm, km
            for (red, o), c0, c1 in zip(multi, offsets, offsets[1:]):
                red.fold_pooled(o, h0, 0, sums[..., c0:c1])
            del sums
        elif multi or lse is None:
            sums = torch.empty(h1 - h0, S, n_calls * D, device=q.device) if n_calls > 1 else None
            for c in range(n_calls):
                v = v_all[:, c * D : (c + 1) * D].contiguous().expand(1, h1 - h0, S, D)  # shared over heads
                out, pass_lse = _sdpa_with_lse(qf, kf, v, scale)
                if sums is None:
                    sums = out[0]
                else:
                    sums[..., c * D : (c + 1) * D] = out[0]
                del out
            lse = pass_lse if lse is None else lse
            for (red, o), c0, c1 in zip(multi, offsets, offsets[1:]):
                red.fold_pooled(o, h0, 0, sums[..., c0:c1])
            del sums, pass_lse
        for red, o in single:
            keys = red.key_groups.keys.to(q.device)
            k_sel = (kf[0][:, keys] if passes else k.chunk(h0, h1, keys)).transpose(1, 2)  # (h, D, C)
            for r0 in range(0, S, plan.sdpa_rows):
                r1 = min(S, r0 + plan.sdpa_rows)
                q_rows = qf[0, :, r0:r1] if passes else q.chunk(h0, h1, slice(r0, r1))
                s = torch.matmul(q_rows, k_sel).mul_(scale)
                red.fold_pooled(o, h0, r0, s.sub_(lse[0, :, r0:r1, None]).exp_())
                del s
        del qf, kf, lse
