"""Two test-only shims under which diffusers' context parallelism runs on a CPU with gloo; they touch diffusers, not
cogattn: ``enable_parallelism`` takes ``rank % torch.accelerator.device_count()`` (0 on a CPU build: 1 while it
runs), and the native backend refuses ``return_lse=True``, which the ring needs (answered with the CPU flash kernel,
which returns it). ``tests/test_context_parallel.py`` and ``benchmarks/bench_cp.py`` use them."""

from __future__ import annotations

import torch

__all__ = ["enable", "shims"]


def shims():
    """The two test-only shims of diffusers' CP on a CPU (the module's docstring)."""
    import diffusers.models.attention_dispatch as dispatch

    real = dispatch._native_attention_forward_op

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):  # fmt: skip
        if not return_lse:
            return real(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
                        _save_ctx=_save_ctx, _parallel_config=_parallel_config)  # fmt: skip
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    dispatch._native_attention_forward_op = forward_op


def enable(transformer, ring: int, ulysses: int) -> None:
    """``transformer.enable_parallelism`` with a ring × Ulysses mesh, under the first shim."""
    from diffusers import ContextParallelConfig

    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))
    finally:
        torch.accelerator.device_count = count
