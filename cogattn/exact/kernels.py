"""cogattn's fused Triton kernels: exact key-pooled sums, every row's log-sum-exp and entropy, and the mass each
key receives, from q and k in the model's dtype, without forming P.

* :func:`sweep` (``_sweep_kernel``, grid (query block, head)): one pass over the keys per query block. The keys
  are visited in an order where each key group is one run (:func:`key_order`: frames and blocks are runs already;
  a 3-D tile's keys, or any other grouping, are read through a permutation, as Sparse VideoGen 2 permutes them),
  so a key tile meets one or a few groups and each group's sum is a masked row sum in registers, written once
  when its run ends: no indicator matrix, no atomics, any number of groups. Without the rows' lse the kernel
  tracks it online (a running maximum and sum, rescaling the open group's sum as flash attention rescales its
  output) and writes each group's own log-sum-exp, which :func:`sweep` turns into ``exp(lse_g − lse_i)``; given
  the lse (the output call's), it sums ``exp(s − lse_i)`` directly. ``entropy`` comes with it:
  ``H_i = lse_i − Σ_j P_ij s_ij``.
* :func:`received` (``_received_kernel``, grid (key block, head)): ``Σ_i exp(s_ij − lse_i)`` over the query
  blocks, each program its keys' columns: deterministic.

Scores are products of the model-dtype q and k (exact in fp32 on tensor cores for fp16/bf16) accumulated in
fp32; float32 inputs multiply as three TF32 products on a GPU (3×TF32, about float32's rounding) and in IEEE fp32
under the interpreter. Both read q and k through their strides and a head index (no copy of a
transposed or head-selected view). Runs wherever Triton does: compiled on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (how the tests check it). :func:`available` says whether it can run for a device.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from dataclasses import dataclass

import torch

__all__ = ["KeyOrder", "Sweep", "available", "key_order", "received", "serves", "sweep", "takes_head_dim"]

BLOCK_M, BLOCK_N = 64, 64  # query rows and keys a program holds under the interpreter (a 64×64 score tile)
# On a GPU each kernel's launch config is tuned once per shape (Triton's autotuner: a few ms per config, kept for the
# process, and on disk where this Triton can) among these (query rows, keys, warps, stages).
# The last number: the largest head dim a config keeps in registers (sm_90; tests/test_kernels.py compiles each).
CONFIGS = [(64, 64, 4, 3, 256), (128, 64, 8, 3, 64), (64, 128, 4, 3, 256), (64, 64, 4, 2, 256)]

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device`` (CUDA with Triton, or any device under the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or interpreted()


def serves(device: torch.device, head_dim: int) -> bool:
    """Whether ``auto`` takes the kernels (``planner.choose_method``, ``tile_kernel.planned``): CUDA with Triton and a head dim they take (the
    interpreter on a CPU is far slower than SDPA: there ``auto`` means ``sdpa``)."""
    return device.type == "cuda" and available(device) and takes_head_dim(head_dim)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` when they were defined (Triton reads it
    as it decorates a kernel, when this module is first imported: a process's first plan; set later, it changes
    nothing). The
    interpreter has no fp16/bf16 matmul, so inputs are upcast (exactly) and multiplied in IEEE fp32, the products
    tensor cores form with fp32 accumulation."""
    return triton is not None and type(_sweep_kernel).__name__ == "InterpretedFunction"


def interpreter_set_late() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now but the kernels were defined without it (compiled for a GPU)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1" and not interpreted()


if triton is not None:
    LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the kernels work in base 2 (exp2, as flash attention)
    LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

    @triton.jit
    def _tokens(X, head, sx_h, sx_s, offs, ok, D: tl.constexpr, UPCAST: tl.constexpr):
        """Rows ``offs`` ``(n, D)`` of head ``head`` of ``X`` (0 where not ``ok``)."""
        x = tl.load(
            X + head * sx_h + offs[:, None].to(tl.int64) * sx_s + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0
        )
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _dot(q, k, FP32: tl.constexpr, UPCAST: tl.constexpr):
        """``q @ kᵀ`` in float32: exact products of fp16/bf16 on tensor cores; float32 as three TF32 products on a GPU
        (about float32's rounding), IEEE under the interpreter."""
        if UPCAST:
            return tl.dot(q, tl.trans(k), input_precision="ieee")
        elif FP32:
            return tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            return tl.dot(q, tl.trans(k))

    @triton.jit
    def _sweep_kernel(
        Q, K, HIDX, KIDX, GID, LSE_IN, OUT, LSE_OUT, ENT,
        S, NK, scale,
        sq_h, sq_s, sk_h, sk_s, so_h, so_s, sl_h,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        GIVEN_LSE: tl.constexpr, PERMUTED: tl.constexpr, GROUPS: tl.constexpr, ENTROPY: tl.constexpr,
        FP32: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        head = tl.load(HIDX + h).to(tl.int64)
        offs_m = pid_m * BM + tl.arange(0, BM)
        row_ok = offs_m < S
        q = _tokens(Q, head, sq_h, sq_s, offs_m, row_ok, D, UPCAST)  # once: every key tile meets these rows
        out_rows = OUT + h.to(tl.int64) * so_h + offs_m.to(tl.int64) * so_s
        scale2 = scale * LOG2E  # scores in base 2: exp(x) = exp2(x·log2 e)
        if GIVEN_LSE:
            lse2 = tl.load(LSE_IN + h * sl_h + offs_m, mask=row_ok, other=0.0) * LOG2E
        m = tl.full((BM,), -float("inf"), tl.float32)  # online: the running maximum and sum (base 2)
        l = tl.zeros((BM,), tl.float32)  # noqa: E741
        e = tl.zeros((BM,), tl.float32)  # Σ p·s, on the scale of ``l``
        cur = tl.zeros((BM,), tl.float32)  # the open group's sum, on the same scale
        cur_g = tl.zeros((), tl.int32) - 1  # the open group (−1: none yet)
        for n0 in range(0, NK, BN):
            offs_n = n0 + tl.arange(0, BN)
            col_ok = offs_n < NK
            if PERMUTED:  # a grouping whose groups are not runs of keys: read the keys in group order
                keys = tl.load(KIDX + offs_n, mask=col_ok, other=0)
            else:
                keys = offs_n
            k = _tokens(K, head, sk_h, sk_s, keys, col_ok, D, UPCAST)
            s = tl.where(col_ok[None, :], _dot(q, k, FP32, UPCAST) * scale2, -float("inf"))
            if GIVEN_LSE:
                p = tl.exp2(s - lse2[:, None])
            else:
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                l = l * alpha + tl.sum(p, 1)  # noqa: E741
                cur = cur * alpha
                if ENTROPY:
                    e = e * alpha
                m = m_new
            if ENTROPY:
                e += tl.sum(p * tl.where(col_ok[None, :], s, 0.0), 1)
            if GROUPS:
                gid = tl.load(GID + offs_n, mask=col_ok, other=-1)
                g_first = tl.load(GID + n0)
                g_last = tl.load(GID + tl.minimum(n0 + BN, NK) - 1)
                for g in range(g_first, g_last + 1):  # the groups this key tile meets, in order
                    part = tl.sum(tl.where(gid[None, :] == g, p, 0.0), 1)
                    open_g = tl.zeros((BM,), tl.int32) + cur_g  # per row: a scalar mask is not every backend's
                    closes = open_g < g  # the open group's run has ended: write it, once
                    if GIVEN_LSE:
                        done = cur
                    else:  # its log-sum-exp, in nats: exact whatever the maximum does next
                        done = (tl.log2(cur) + m) * LN2
                    tl.store(out_rows + open_g, done, mask=row_ok & closes & (open_g >= 0))
                    cur = tl.where(closes, part, cur + part)
                    cur_g = tl.maximum(cur_g, g)
        if GROUPS:
            if GIVEN_LSE:
                done = cur
            else:
                done = (tl.log2(cur) + m) * LN2
            open_g = tl.zeros((BM,), tl.int32) + cur_g
            tl.store(out_rows + open_g, done, mask=row_ok & (open_g >= 0))
        if not GIVEN_LSE:
            lse2 = m + tl.log2(l)
            tl.store(LSE_OUT + h * sl_h + offs_m, lse2 * LN2, mask=row_ok)
            if ENTROPY:  # H = lse − Σ P s, in nats
                tl.store(ENT + h * sl_h + offs_m, (lse2 - e / l) * LN2, mask=row_ok)
        elif ENTROPY:
            tl.store(ENT + h * sl_h + offs_m, (lse2 - e) * LN2, mask=row_ok)

    @triton.jit
    def _received_kernel(
        Q, K, HIDX, LSE, OUT,
        NQ, NK, scale,
        sq_h, sq_s, sk_h, sk_s, sl_h, so_h,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        head = tl.load(HIDX + h).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        col_ok = offs_n < NK
        k = _tokens(K, head, sk_h, sk_s, offs_n, col_ok, D, UPCAST)  # once: every query tile meets these keys
        scale2 = scale * LOG2E
        acc = tl.zeros((BN,), tl.float32)
        for m0 in range(0, NQ, BM):
            offs_m = m0 + tl.arange(0, BM)
            row_ok = offs_m < NQ
            q = _tokens(Q, head, sq_h, sq_s, offs_m, row_ok, D, UPCAST)
            lse2 = tl.load(LSE + h * sl_h + offs_m, mask=row_ok, other=float("inf")) * LOG2E  # past NQ: exp2(−inf)
            p = tl.exp2(_dot(q, k, FP32, UPCAST) * scale2 - lse2[:, None])
            acc += tl.sum(tl.where(col_ok[None, :], p, 0.0), 0)
        tl.store(OUT + h * so_h + offs_n, acc, mask=col_ok)


def _tuned(kernel, key: list[str], head_dim: int, configs: list[tuple] = CONFIGS):
    """``kernel`` under Triton's autotuner over the ``configs`` for ``head_dim`` (kept on disk where it can)."""
    configs = [
        triton.Config({"BM": m, "BN": n}, num_warps=w, num_stages=st) for m, n, w, st, d in configs if head_dim <= d
    ]
    disk = "cache_results" in inspect.signature(triton.autotune).parameters
    return triton.autotune(configs, key=key, **({"cache_results": True} if disk else {}))(kernel)


if triton is not None:  # every run of either kernel writes all it writes (no accumulation): safe to time again
    _sweep_keys = ["S", "NK", "D", "GIVEN_LSE", "PERMUTED", "GROUPS", "ENTROPY"]
    _sweep_tuned = {d: _tuned(_sweep_kernel, _sweep_keys, d) for d in (64, 256)}  # by the largest head dim
    _received_tuned = {d: _tuned(_received_kernel, ["NQ", "NK", "D"], d) for d in (64, 256)}


def _launch(kernel, tuned, rows: int, H: int, *args, **constants) -> None:
    """``kernel`` over (blocks of ``rows``, ``H``): the fixed 64 × 64 tiles under the interpreter, else tuned."""
    if interpreted():
        kernel[(triton.cdiv(rows, BLOCK_M), H)](*args, BM=BLOCK_M, BN=BLOCK_N, **constants)
    else:
        block = "BN" if kernel is _received_kernel else "BM"
        tuned = tuned[64 if constants["D"] <= 64 else 256]
        tuned[lambda meta: (triton.cdiv(rows, meta[block]), H)](*args, **constants)


@dataclass(frozen=True)
class KeyOrder:
    """The order :func:`sweep` visits the kept keys in, so each group is one run: ``perm`` (int32 key index at
    each position, `None` where the keys' own order already is) and ``gid`` (int32 group at each position,
    nondecreasing; ``num_groups`` for a key in no group, a column :func:`sweep` drops)."""

    perm: torch.Tensor | None
    gid: torch.Tensor
    num_groups: int


def key_order(groups, keys: int, device) -> KeyOrder:
    """The :class:`KeyOrder` of a ``KeyGroups`` (`None`: no groups, the lse and entropy alone) over the first
    ``keys`` keys: a stable sort of the keys by group, made once per (groups, keys, device) and kept on ``groups``."""
    if groups is None:
        return KeyOrder(None, torch.zeros(keys, dtype=torch.int32, device=device), 0)
    cache = groups.__dict__.setdefault("_kernel_orders", {})  # a frozen dataclass's own dict, as cached_property uses
    found = cache.get((keys, str(device)))
    if found is None:
        gid = torch.full((keys,), groups.num_groups, dtype=torch.int64)
        kept = groups.keys.cpu() < keys
        gid[groups.keys.cpu()[kept]] = groups.groups.cpu()[kept]
        gid, perm = torch.sort(gid, stable=True)
        identity = bool(torch.equal(perm, torch.arange(keys)))
        perm = None if identity else perm.to(device=device, dtype=torch.int32)
        found = cache[(keys, str(device))] = KeyOrder(perm, gid.to(device=device, dtype=torch.int32), groups.num_groups)
    return found


@dataclass
class Sweep:
    """What :func:`sweep` returns for the selected heads: ``sums`` ``(h, S, C)`` (`None` without groups), ``lse``
    ``(h, S)`` and ``entropy`` ``(h, S)`` (`None` unless asked), all float32."""

    sums: torch.Tensor | None
    lse: torch.Tensor
    entropy: torch.Tensor | None


def _head_index(x: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0] if heads is None else len(heads)
    idx = torch.arange(n, device=x.device) if heads is None else heads.to(x.device)
    return idx.to(torch.int32)


def takes_head_dim(D: int) -> bool:
    """Whether the kernels' tiles take head dim ``D``: a power of two from 16 to 256 (their configs are sized up
    to 256; a 64-row tile of a larger one would not fit in registers)."""
    return 16 <= D <= 256 and not D & (D - 1)


def _checked(x: torch.Tensor) -> torch.Tensor:
    D = x.shape[-1]
    if not takes_head_dim(D):
        raise ValueError(f"head dim {D} is not a power of two from 16 to 256, which the kernel's tiles need.")
    return x if x.stride(-1) == 1 else x.contiguous()  # rows of D contiguous values; any head and row strides


def sweep(
    q: torch.Tensor,
    k: torch.Tensor,
    order: KeyOrder,
    heads: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    entropy: bool = False,
    scale: float | None = None,
    keys: int | None = None,
) -> Sweep:
    """Exact key-group sums of the attention probabilities, and each row's lse (and entropy), in one pass.

    Args:
        q (`torch.Tensor`): queries ``(H, S, D)`` in the model's dtype (fp32, fp16 or bf16; D a power of two, 16 to 256),
            any head and row strides.
        k (`torch.Tensor`): keys ``(H, S_k, D)``, the same dtype.
        order (`KeyOrder`): the groups, from :func:`key_order` over the kept keys.
        heads (`torch.Tensor | None`): the selected heads (indices of q's and k's first axis), `None` for all.
        lse (`torch.Tensor | None`): float32 ``(h, S)`` of the selected heads when known (the output call's): the
            sums are then ``Σ exp(s − lse)``; `None`: the kernel finds it online and returns it.
        entropy (`bool`): also every row's entropy in nats.
        scale (`float | None`): softmax scale, defaults to ``1/sqrt(D)``.
        keys (`int | None`): the first ``keys`` keys are kept (a key mask's), the rest have probability 0.
    """
    if triton is None:
        raise RuntimeError("cogattn's fused kernels need Triton: pip install triton")
    q, k = _checked(q), _checked(k)
    S, D = q.shape[1:]
    NK = k.shape[1] if keys is None else int(keys)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    hidx = _head_index(q, heads)
    H = len(hidx)
    C = order.num_groups
    grouped = C > 0
    given = lse is not None
    fill = 0.0 if given else -math.inf  # a group no key of which is kept: probability 0
    out = torch.full((H, S, C + 1) if grouped else (1, 1, 1), fill, device=q.device, dtype=torch.float32)
    lse_out = lse.float().contiguous() if given else torch.empty(H, S, device=q.device, dtype=torch.float32)
    ent = torch.empty(H, S, device=q.device, dtype=torch.float32) if entropy else lse_out
    upcast = interpreted()
    with _on(q.device):
        _launch(
            _sweep_kernel, _sweep_tuned, S, H,
            q, k, hidx, order.gid if order.perm is None else order.perm, order.gid, lse_out, out, lse_out, ent,
            S, NK, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), lse_out.stride(0),
            D=D, GIVEN_LSE=given, PERMUTED=order.perm is not None, GROUPS=grouped,
            ENTROPY=entropy, FP32=q.dtype == torch.float32, UPCAST=upcast,
        )  # fmt: skip
    sums = None
    if grouped:
        sums = out[..., :C]
        if not given:  # each group's lse: its probability is exp(lse_g − lse_i)
            sums = sums.sub_(lse_out[..., None]).exp_()
    return Sweep(sums, lse_out, ent if entropy else None)


def received(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    heads: torch.Tensor | None = None,
    scale: float | None = None,
    queries: int | None = None,
    keys: int | None = None,
) -> torch.Tensor:
    """``Σ_i P[i, j]`` over the first ``queries`` query rows (all: `None`) for each of the first ``keys`` keys,
    ``(h, keys)`` float32, given the rows' lse ``(h, S)`` of the selected ``heads``; q and k as for :func:`sweep`."""
    if triton is None:
        raise RuntimeError("cogattn's fused kernels need Triton: pip install triton")
    q, k = _checked(q), _checked(k)
    S, D = q.shape[1:]
    NQ = S if queries is None else int(queries)
    NK = k.shape[1] if keys is None else int(keys)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    hidx = _head_index(q, heads)
    lse = lse.float().contiguous()
    out = torch.empty(len(hidx), NK, device=q.device, dtype=torch.float32)
    upcast = interpreted()
    with _on(q.device):
        _launch(
            _received_kernel, _received_tuned, NK, len(hidx),
            q, k, hidx, lse, out, NQ, NK, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            out.stride(0), D=D, FP32=q.dtype == torch.float32, UPCAST=upcast,
        )  # fmt: skip
    return out


def _on(device: torch.device):
    """Launch on the tensors' device, not the current one (a model on cuda:1 must not run on cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
