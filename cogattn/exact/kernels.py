"""A fused Triton kernel for key-pooled attention sums, given each row's log-sum-exp.

For every query i and key group g it accumulates ``Σ_{j∈g} exp(q_i·k_j·scale − lse_i)`` tile by tile:
one Q·Kᵀ product and one exponential per score, nothing written but the ``(H, S, C)`` sums — about
half the work of the attention pass the model already does (no running max, no rescaling, no
values). Products run on tensor cores for fp16/bf16 inputs (exact products, fp32 accumulation) and in
IEEE fp32 for fp32 inputs.

Runs wherever Triton does: compiled on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how the
tests check it). :func:`available` says whether it can run for a device.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

__all__ = ["MAX_COLUMNS", "available", "pooled_sums"]

# Indicator columns one launch sums (a pass over QKᵀ each): a 64-key tile of 512 columns with its pipeline
# stages needs 320 KiB of shared memory, past an H100's or H200's 227 KiB; 128 columns need a quarter of that.
MAX_COLUMNS = 128

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device`` (CUDA with Triton, or any device under the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _pooled_kernel(
        Q,
        K,
        LSE,
        IND,
        OUT,
        S,
        NK,
        scale,
        sq_h,
        sq_s,
        sk_h,
        sk_s,
        sl_h,
        si_s,
        so_h,
        so_s,
        D: tl.constexpr,
        C: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_c = tl.arange(0, C)
        row_ok = offs_m < S
        q = tl.load(Q + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        lse = tl.load(LSE + h * sl_h + offs_m, mask=row_ok, other=0.0)
        acc = tl.zeros((BLOCK_M, C), dtype=tl.float32)
        for n0 in range(0, NK, BLOCK_N):  # the kept keys only: a masked key is never exponentiated
            offs_n = n0 + tl.arange(0, BLOCK_N)
            col_ok = offs_n < NK
            k = tl.load(K + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            p = tl.exp(s * scale - lse[:, None])
            p = tl.where(col_ok[None, :], p, 0.0)
            ind = tl.load(IND + offs_n[:, None] * si_s + offs_c[None, :], mask=col_ok[:, None], other=0.0)
            acc += tl.dot(p, ind, input_precision="ieee")
        tl.store(OUT + h * so_h + offs_m[:, None] * so_s + offs_c[None, :], acc, mask=row_ok[:, None])


def pooled_sums(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, indicator: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Key-group sums of attention probabilities without forming them.

    Args:
        q (`torch.Tensor`): queries ``(H, S, D)``, fp32, fp16 or bf16 (D a power of two ≥ 16).
        k (`torch.Tensor`): keys ``(H, K, D)``, same dtype (K < S: the keys a key mask keeps).
        lse (`torch.Tensor`): float32 log-sum-exp of every row, ``(H, S)``.
        indicator (`torch.Tensor`): ``(K, C)``, ``1`` where key j is in group c.
        scale (`float | None`): softmax scale, defaults to ``1/sqrt(D)``.

    Returns:
        `torch.Tensor`: ``(H, S, C)`` float32, ``Σ_j P[i, j]·indicator[j, c]``.
    """
    if triton is None:
        raise RuntimeError("the fused pooled-sum kernel needs Triton: pip install triton")
    H, S, D = q.shape
    K = k.shape[1]
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} is not a power of two ≥ 16, which the kernel's tiles need.")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    C = indicator.shape[1]
    # tl.dot needs power-of-two tiles of at least 16; past MAX_COLUMNS, one launch a slice of that many columns
    Cp = max(16, 1 << (C - 1).bit_length()) if C <= MAX_COLUMNS else MAX_COLUMNS
    launches = -(-C // Cp)
    ind = torch.zeros(K, launches * Cp, device=q.device, dtype=torch.float32)
    ind[:, :C] = indicator
    q, k = q.contiguous(), k.contiguous()
    lse = lse.float().contiguous()
    out = torch.empty(H, S, launches * Cp, device=q.device, dtype=torch.float32)
    block_m, block_n = 64, 64
    # Triton's interpreter has no bf16/fp16 matmul: there, upcast (exact) and multiply in IEEE fp32, the
    # same products the tensor cores form with fp32 accumulation.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(S, block_m), H)
    # launched on the tensors' device, not the current one (a model on cuda:1 must not run on cuda:0)
    on_device = torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        for c in range(0, launches * Cp, Cp):  # each writes its columns of out in place
            cols = slice(c, c + Cp)
            _launch(grid, q, k, lse, ind[:, cols], out[..., cols], S, K, scale, D, Cp, block_m, block_n, interpreted)
    return out[..., :C]


def _launch(grid, q, k, lse, ind, out, S, K, scale, D, Cp, block_m, block_n, interpreted) -> None:
    _pooled_kernel[grid](
        q,
        k,
        lse,
        ind,
        out,
        S,
        K,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        lse.stride(0),
        ind.stride(0),
        out.stride(0),
        out.stride(1),
        D=D,
        C=Cp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or interpreted,
        UPCAST=interpreted,
    )
