"""One LTX-Video 0.9.7 (13B) block at its largest shape: exact capture of 257 frames at 704×1216 (33 latent frames
× 22 × 38 latent pixels: S = 27,588 video tokens) and of the cross-attention to 128 T5 tokens under its key mask, in
a memory budget of 1 GiB, against the stock attention modules of the same block.

Builds an ``LTXVideoTransformer3DModel`` of one block from the released config (32 heads × 128, cross-attention
4,096 wide, patch size 1, random weights; ``--heads`` fewer: the cost is per head) and calls it on random packed
latents and text (``--valid`` of the 128 tokens kept by the mask), float32 on the CPU. It times the stock
self-attention module (``attn1``: projections, RMS norms, RoPE, SDPA, output projection) and cross-attention module
(``attn2``), then, under ``cogattn.record`` with ``frame`` and ``video_to_text``, what capture adds inside the
processors (``capture`` and ``capture_context``) and its peak extra memory (Linux ``VmHWM``, reset at each
capture); the block's output must stay bit-identical.

    python benchmarks/bench_ltx.py                                   # the largest shape (a few minutes on 2 cores)
    python benchmarks/bench_ltx.py --frames 3 --height 4 --width 6   # quick look
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from diffusers import LTXVideoTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

import cogattn

MiB = 2**20
TEXT = 128  # T5 tokens of every LTX-Video call (max_sequence_length)


def block(heads: int) -> LTXVideoTransformer3DModel:
    """Lightricks/LTX-Video-0.9.7-dev's transformer/config.json, one block of ``heads`` heads of 128."""
    return LTXVideoTransformer3DModel(
        in_channels=128,
        out_channels=128,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=heads,
        attention_head_dim=128,
        cross_attention_dim=heads * 128,
        num_layers=1,
        caption_channels=4096,
    ).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=33, help="latent frames (257 video frames)")
    ap.add_argument("--height", type=int, default=22, help="latent rows (704 px)")
    ap.add_argument("--width", type=int, default=38, help="latent columns (1216 px)")
    ap.add_argument("--heads", type=int, default=32, help="heads of 128 (the model has 32)")
    ap.add_argument("--valid", type=int, default=100, help="text tokens the key mask keeps, of 128")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default="benchmarks/results/ltx_cpu.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    transformer = block(args.heads)
    F, H, W = args.frames, args.height, args.width
    S = F * H * W
    g = torch.Generator().manual_seed(0)

    def call(frames, height, width):
        return dict(
            hidden_states=torch.randn(1, frames * height * width, 128, generator=g),
            encoder_hidden_states=torch.randn(1, TEXT, 4096, generator=g),
            timestep=torch.tensor([500.0]),
            encoder_attention_mask=(torch.arange(TEXT) < args.valid).long()[None],
            num_frames=frames,
            height=height,
            width=width,
            rope_interpolation_scale=(8 / 25, 32, 32),
            return_dict=False,
        )

    times: dict[str, list[float]] = {"attn1": [], "attn2": []}
    for name, v in times.items():
        module = getattr(transformer.transformer_blocks[0], name)
        module.register_forward_pre_hook(lambda m, a, v=v: v.append(-time.perf_counter()))
        module.register_forward_hook(lambda m, a, o, v=v: v.__setitem__(-1, v[-1] + time.perf_counter()))
    with torch.no_grad():
        transformer(**call(1, 2, 2))  # warm up kernels on a small call
        inputs = call(F, H, W)
        reference = transformer(**inputs)[0]
    t_self, t_cross = times["attn1"][-1], times["attn2"][-1]
    print(f"S = {S:,}: stock attn1 {t_self:.1f} s, attn2 {t_cross:.1f} s", flush=True)

    memory = PeakMemory("cpu")
    rec = cogattn.record(transformer, kinds=("frame", "video_to_text"), memory_budget=args.budget, batch=[0])
    spent = {"capture": [0.0, 0], "capture_context": [0.0, 0]}
    for name in spent:
        setattr(rec, name, memory.measured(getattr(rec, name), spent[name]))
    with rec, torch.no_grad():
        out = transformer(**inputs)[0]
    identical = torch.equal(out, reference)
    budget = rec.options.memory_budget
    rows = []
    for name, what, stock in (
        ("capture", "self (`frame`)", t_self),
        ("capture_context", "cross (`video_to_text`)", t_cross),
    ):
        dt, peak = spent[name]
        planned = rec.plan.tiles.peak_bytes if name == "capture" else rec.plan.context_bytes
        method = rec.plan.tiles.method if name == "capture" else "cross rows"
        rows.append((what, method, stock, dt, peak, planned))
        print(f"  {what}: capture {dt:.1f} s ({dt / t_self:.2f}× stock attn1), peak +{peak / MiB:.0f} MiB", flush=True)

    lines = [
        f"One LTX-Video 0.9.7 (13B) block ({args.heads} heads × 128, patch size 1, random weights), S = {S:,} video "
        f"tokens ({F}×{H}×{W}: {8 * (F - 1) + 1} frames at {32 * H}×{32 * W}) and {TEXT} T5 tokens in the cross-attention ({args.valid} "
        f"kept by the key mask), float32, CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads), torch {torch.__version__}; memory_budget = {args.budget} "
        f"({budget:,} bytes), heads = mean.",
        "",
        "Stock: the block's attention modules (`attn1`: projections, RMS norms, RoPE, SDPA, output projection; "
        "`attn2`: the same without RoPE, under the key mask). Capture: what cogattn adds in the processor, as a "
        "multiple of the stock `attn1` measured in the same run, and its peak extra memory (VmHWM above the "
        f"resident size at the capture's start). The block's output with capture on equals the stock output bit for "
        f"bit: {'yes' if identical else 'NO'}.",
        "",
        "| attention (kind) | method | stock module (s) | capture (s) | × stock `attn1` | peak extra memory (MiB) | "
        "planned (MiB) | within the budget |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for what, method, stock, dt, peak, planned in rows:
        lines.append(
            f"| {what} | {method} | {stock:.1f} | {dt:.1f} | {dt / t_self:.2f} | {peak / MiB:.0f} | "
            f"{planned / MiB:.0f} | {'yes' if peak <= budget else 'NO'} |"
        )
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
