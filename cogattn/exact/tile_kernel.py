"""Row tiles formed by cogattn's kernels: every row's lse from a :func:`~cogattn.exact.kernels.sweep` of no groups
(with ``entropy`` in the same pass), then each tile's probabilities written once, ``P = exp(q·kᵀ·scale − lse)``,
by ``_probs_kernel`` (grid (row block, key block, head)) from q and k in the model's dtype: no float32 copy of q or
k, no float32 matmul and no softmax passes over the tile (on a GPU a 16-bit model's scores are exact products on
tensor cores, accumulated in fp32, as in the other kernels).

The row pass (:func:`cogattn.exact.engine.row_pass`) takes them for tiles of every row without a query-key mask
where the plan says so (``TilePlan.kernel_tiles``: ``method`` ``auto`` on CUDA with Triton, or ``triton``). Each
shape is checked once a process before its first tile is folded (:func:`agrees`): a few rows of the kernel's P
against float32 ``softmax(q·kᵀ·scale)``, held to the kinds' bound; a kernel that fails to build or disagrees is
warned about once and that shape's tiles are formed by torch from then on (:data:`TORCH_TILES`), as is a launch
that raises later (that tile and the rest by torch).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import checks, kernels, passes

__all__ = ["CHECKED", "CONFIGS", "TORCH_TILES", "Chunk", "agrees", "chunk", "planned", "probs", "tile"]

# (query rows, keys, warps, stages, largest head dim) as ``kernels.CONFIGS``: a 64 × 128 tile's store needs 8 warps
CONFIGS = [(64, 64, 4, 3, 256), (128, 64, 8, 3, 256), (64, 128, 8, 3, 256), (64, 64, 4, 2, 256)]
TORCH_TILES: set[tuple] = set()  # (device, dtype, S, D, kept keys) whose kernel tiles failed: torch tiles from now on
CHECKED: dict[tuple, float] = {}  # the same shapes' checked error, in units of the bound's (≤ 1: agreed)

if kernels.triton is not None:
    import triton
    import triton.language as tl

    from .kernels import LOG2E, _dot, _tokens

    @triton.jit
    def _probs_kernel(
        Q, K, HIDX, LSE, OUT,
        R, NK, S, scale,
        sq_h, sq_s, sk_h, sk_s, sl_h, so_h, so_r,
        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        h = tl.program_id(2)
        head = tl.load(HIDX + h).to(tl.int64)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        row_ok = offs_m < R
        col_ok = offs_n < NK  # a kept key
        q = _tokens(Q, head, sq_h, sq_s, offs_m, row_ok, D, UPCAST)
        k = _tokens(K, head, sk_h, sk_s, offs_n, col_ok, D, UPCAST)
        lse2 = tl.load(LSE + h * sl_h + offs_m, mask=row_ok, other=0.0) * LOG2E
        x = _dot(q, k, FP32, UPCAST) * (scale * LOG2E) - lse2[:, None]
        # a GPU's exp2 (ex2.approx.ftz) flushes a result below 2^-126 to 0, which top_p at p = 1 and frame_max count:
        # such a P is formed 2^64 times larger and scaled back by a multiplication, which keeps it subnormal
        low = x < -126.0
        p = tl.exp2(tl.where(low, x + 64.0, x)) * tl.where(low, 5.421010862427522e-20, 1.0)  # 2^-64
        p = tl.where(col_ok[None, :], p, 0.0)  # the keys past the kept ones: probability 0
        out = OUT + h.to(tl.int64) * so_h + offs_m[:, None].to(tl.int64) * so_r + offs_n[None, :]
        tl.store(out, p, mask=row_ok[:, None] & (offs_n < S)[None, :])

    _probs_tuned = {d: kernels._tuned(_probs_kernel, ["R", "S", "D"], d, CONFIGS) for d in (64, 256)}


def planned(method: str, device, head_dim: int) -> bool:
    """Whether row tiles of every row are formed by the kernels (``TilePlan.kernel_tiles``): under ``method`` ``auto``
    where the kernels serve (``kernels.serves``: CUDA with Triton), or ``triton`` asked where they run (the
    interpreter too), whatever ``layer_output`` is; ``rows`` and ``sdpa`` asked form them with torch, the checked
    fallback. ``method`` is the one asked (``CaptureOptions.method``), not the one chosen for the pooled kinds."""
    device = torch.device(device)
    if method == "auto":
        return kernels.serves(device, head_dim)
    return method == "triton" and kernels.available(device) and kernels.takes_head_dim(head_dim)


@dataclass
class Chunk:
    """A head chunk's kernel tiles: the heads (int32 indices of q's and k's first axis), every row's lse ``(h, S)``
    over the kept keys and, when asked, every row's entropy ``(h, S)``."""

    heads: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None


def chunk(q, k, h0: int, h1: int, kept: int, scale: float, entropy: bool) -> Chunk | None:
    """The :class:`Chunk` of heads ``h0:h1`` of the engine's head views ``q`` and ``k``: one sweep of the kernel
    without groups; `None` where this shape takes torch's tiles, or the sweep fails (warned once, then torch's)."""
    if _shape(q, k, kept) in TORCH_TILES:
        return None
    heads = (torch.arange(h0, h1, device=q.device) if q.heads is None else q.heads[h0:h1]).to(torch.int32)
    try:
        swept = kernels.sweep(q.x, k.x, kernels.key_order(None, kept, q.device), heads, None, entropy, scale, kept)
    except Exception as err:  # a Triton that cannot build or launch the kernel here: torch tiles
        return _failed(_shape(q, k, kept), err)
    return Chunk(heads, swept.lse, swept.entropy)


def tile(c: Chunk, q, k, r0: int, r1: int, kept: int, scale: float, out: torch.Tensor) -> torch.Tensor | None:
    """:func:`probs` of rows ``r0:r1`` of the chunk ``c``; `None` where the launch fails (warned once; the shape
    takes torch's tiles from then on)."""
    try:
        return probs(q, k, c.heads, r0, r1, c.lse, kept, scale, out)
    except Exception as err:
        return _failed(_shape(q, k, kept), err)


def probs(q, k, heads, r0: int, r1: int, lse: torch.Tensor, kept: int, scale: float, out: torch.Tensor):
    """The probabilities of query rows ``r0:r1`` against every key, ``(h, r, S)`` float32, written into ``out``
    (a row tile's buffer) for the ``heads`` (int32 indices of the first axis of the head views' tensors ``q.x`` and
    ``k.x``), from their rows' float32 lse ``(h, S)``; the keys from ``kept`` on hold 0."""
    S, D = k.shape[1], q.shape[2]  # every key's column
    H, R = len(heads), r1 - r0
    qx, kx = kernels._checked(q.x[:, r0:r1]), kernels._checked(k.x)
    lse = lse[:, r0:r1]  # a view: the kernel reads its rows through the head stride
    out = out.view(H, R, S)
    args = (qx, kx, heads, lse, out, R, kept, S, scale)
    strides = (qx.stride(0), qx.stride(1), kx.stride(0), kx.stride(1), lse.stride(0), out.stride(0), out.stride(1))
    constants = dict(D=D, FP32=q.x.dtype == torch.float32, UPCAST=kernels.interpreted())
    with kernels._on(q.device):
        if kernels.interpreted():
            grid = (triton.cdiv(R, kernels.BLOCK_M), triton.cdiv(S, kernels.BLOCK_N), H)
            _probs_kernel[grid](*args, *strides, BM=kernels.BLOCK_M, BN=kernels.BLOCK_N, **constants)
        else:
            tuned = _probs_tuned[64 if D <= 64 else 256]
            tuned[lambda meta: (triton.cdiv(R, meta["BM"]), triton.cdiv(S, meta["BN"]), H)](
                *args, *strides, **constants
            )
    return out


def agrees(q, k, kept: int, scale: float) -> bool:
    """Whether kernel tiles serve this shape: checked once a process (:data:`CHECKED`) on 8 query rows spread over
    the sequence, of the first selected head, against float32 ``softmax(q·kᵀ·scale)`` under the kinds' bound
    (``checks.bound``, in ``checks.error_units``), their probabilities and their entropy (the sweep's, which the
    ``entropy`` kind takes from the chunk); a kernel that raises or disagrees is warned about and its shape put in
    :data:`TORCH_TILES`. The recording's spot checks then hold the tiles of its captures to the same bounds."""
    S = q.shape[1]
    shape = _shape(q, k, kept)
    if shape in TORCH_TILES:
        return False
    if shape in CHECKED:
        return True
    rows = torch.linspace(0, S - 1, min(8, S), dtype=torch.float64, device=q.device).round().long().unique()
    few = passes.HeadView(q.x[:, rows], q.heads)  # a copy of those rows
    c = chunk(few, k, 0, 1, kept, scale, True)
    buffer = torch.empty(len(rows) * S, dtype=torch.float32, device=q.device)
    got = None if c is None else tile(c, few, k, 0, len(rows), kept, scale, buffer)
    if got is None:  # it failed: warned, and torch's tiles from now on
        return False
    head = slice(0, 1) if q.heads is None else q.heads[:1]
    scores = q.x[head][:, rows].float() @ k.x[head][:, :kept].float().transpose(1, 2) * scale
    ref, lse = torch.nn.functional.pad(torch.softmax(scores, -1), (0, S - kept)), torch.logsumexp(scores, -1)
    log_p = torch.log_softmax(scores.double(), -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    units = checks.error_units("full", ref, lse, ref), checks.error_units("entropy", ref, lse)
    errors = ((got - ref).abs() / units[0]).max().double(), ((c.entropy.double() - entropy).abs() / units[1]).max()
    error = torch.stack(errors).max().item() / checks.bound(q.x.dtype, False)  # NaN where either is
    CHECKED[shape] = error
    if not error <= 1:  # NaN too
        _failed(shape, f"its probabilities or entropy were off by {error:.3g} times the bound")
    return error <= 1


def _shape(q, k, kept: int) -> tuple:
    """What :data:`CHECKED` and :data:`TORCH_TILES` are keyed by: (device, dtype, S (the keys), D, kept keys)."""
    return (str(q.device), q.x.dtype, k.shape[1], q.shape[2], kept)


def _failed(shape: tuple, why) -> None:
    if isinstance(why, BaseException):
        why = f"it failed ({type(why).__name__}: {why})"
    warnings.warn(
        f"cogattn's Triton row tiles on {shape[0]} are not used for this shape: {why}; its row tiles are formed by "
        "torch (float32 matmul and softmax).",
        stacklevel=5,
    )
    TORCH_TILES.add(shape)
