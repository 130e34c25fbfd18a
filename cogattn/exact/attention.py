"""Fused attention calls that also return what capture needs: each row's log-sum-exp, or key-pooled sums.

The stock output path never comes here. These are the kernels behind the engine's ``sdpa`` method (an
attention pass on indicator values) and behind the opt-in ``layer_output="lse"`` and ``"joint"``
modes (the layer's own output call made to bring the lse, or the lse and the sums, along).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attention_joint",
    "attention_joint_for",
    "attention_with_lse",
    "fused_lse_supported",
    "joint_extra_bytes",
    "joint_width",
    "lse_only",
    "sdpa_with_lse",
]

_JOINT_MAX_WIDTH = 256  # the widest head dim the CUDA flash kernel takes


def fused_lse_supported(device: torch.device) -> bool:
    """Whether a fused SDPA kernel that also returns the log-sum-exp exists for ``device``."""
    return torch.device(device).type in ("cpu", "cuda")


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Fused attention ``(B, h, S, D)`` returning ``(out, lse)``, ``lse`` ``(B, h, S)`` in float32, for any
    float dtype (float32 included): the CPU flash kernel, or CUDA's memory-efficient kernel."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
    elif q.device.type == "cuda":
        # The memory-efficient kernel takes float32 and pads the lse to a multiple of 32 rows.
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
        out, lse = res[:2]
    else:
        raise RuntimeError(f"no fused attention kernel with log-sum-exp for device {q.device}")
    return out, lse[..., : q.shape[2]]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """The layer's attention output and the float32 log-sum-exp of every row, ``(B, H, S)``, from the
    flash kernel ``F.scaled_dot_product_attention`` usually dispatches to (no mask, no dropout).

    On the CPU it is the kernel SDPA uses (bit-identical output, tested); on CUDA, for fp16/bf16, SDPA
    may pick another backend (cuDNN on Hopper), so the output can differ in the last bits. Returns
    ``(F.scaled_dot_product_attention(q, k, v), None)`` where no such kernel applies. ``scale`` defaults
    to ``1/sqrt(D)``, as in SDPA."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
        return out, lse
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return res[0], res[1]
        except RuntimeError:  # no flash kernel on this GPU: stay on the stock call
            pass
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale), None


def lse_only(qm: torch.Tensor, km: torch.Tensor, scale: float) -> torch.Tensor:
    """Log-sum-exp of every row of ``(1, h, S, D)`` queries over ``(1, h, K, D)`` keys, float32 ``(1, h, S)``: on CUDA from the
    flash kernel in a 16-bit model's dtype (exact products, fp32 accumulation), else from a float32 pass
    (the CPU's 16-bit flash kernel is off by a few 1e-5)."""
    if qm.dtype != torch.float32 and qm.device.type == "cuda":
        # zero values shared over heads; not over rows too, which the CPU flash kernel runs 2.6× slower
        zeros = torch.zeros(1, 1, *km.shape[2:], dtype=qm.dtype, device=qm.device).expand_as(km)  # a value per key
        _, lse = attention_with_lse(qm, km, zeros, scale)
        if lse is not None:
            return lse
    qf, kf = qm.float(), km.float()
    return sdpa_with_lse(
        qf, kf, torch.zeros(1, 1, *kf.shape[2:], dtype=kf.dtype, device=qf.device).expand_as(kf), scale
    )[1]


def joint_width(head_dim: int, num_cols: int) -> int:
    """Head dim of the joint call: ``D`` value columns plus ``num_cols`` indicator columns, rounded up to a
    multiple of 8 (the fused kernels' alignment)."""
    return -(-(head_dim + num_cols) // 8) * 8


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
    else:
        out = None
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and W <= _JOINT_MAX_WIDTH:
            try:
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                    qp, kp, vp, 0.0, False, False, scale=scale
                )[:2]
            except RuntimeError:  # no flash kernel here (pre-Ampere fp16, builds without it)
                out = None
        if out is None:
            out, lse = sdpa_with_lse(qp, kp, vp, scale)
    del qp, kp, vp
    return out[..., :D].contiguous(), lse, out[..., D : D + C].contiguous()


def joint_extra_bytes(batch: int, heads: int, seq_len: int, head_dim: int, num_cols: int, elem_size: int) -> int:
    """Peak bytes :func:`attention_joint` holds beyond the stock call's output, for ``batch`` items: the
    padded q, k, the widened values and the wide output, less the output the stock call would allocate."""
    return batch * heads * seq_len * elem_size * (4 * joint_width(head_dim, num_cols) - head_dim)


def attention_joint_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indicator: torch.Tensor, items):
    """:func:`attention_joint` for the batch ``items`` that are captured, the stock SDPA call for the others.

    Returns ``(out, lse, sums)`` for the whole batch ``(B, H, S, ·)``; lse and sums are zero where not captured."""
    B = q.shape[0]
    items = list(items)
    if sorted(items) == list(range(B)):  # every item: lse and sums are indexed by item, in any order
        return attention_joint(q, k, v, indicator)
    pick = _batch_index(items)
    out, lse_c, sums_c = attention_joint(q[pick], k[pick], v[pick], indicator)
    rest = _batch_index([b for b in range(B) if b not in items])
    full = torch.empty_like(q)
    full[rest] = torch.nn.functional.scaled_dot_product_attention(
        q[rest], k[rest], v[rest], dropout_p=0.0, is_causal=False
    )
    full[pick] = out
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    lse[pick] = lse_c
    sums = q.new_zeros(*q.shape[:3], indicator.shape[1])
    sums[pick] = sums_c
    return full, lse, sums


def _batch_index(items: list[int]):
    """An index for batch ``items``: a slice (a view) when they are consecutive, else a tensor."""
    if items == list(range(items[0], items[-1] + 1)):
        return slice(items[0], items[-1] + 1)
    return torch.tensor(items)
