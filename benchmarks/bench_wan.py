"""One Wan 2.1-1.3B block at real shape: the stock self-attention time vs exact capture of Wan kinds.

Builds a one-block ``WanTransformer3DModel`` from the Wan 2.1-1.3B config (1,536 wide, 12 heads × 128,
random weights) and calls it on random latents of 81 frames at 480×832 (21 latent frames × 30 × 52
patches: S = 32,760 video tokens) and 512 text tokens, float32 on the CPU: once stock, timing the
self-attention module (``attn1``: projections, RoPE, SDPA, output projection) and the cross-attention
(``attn2``); once under ``cogattn.record`` with each case's kinds, timing what capture adds inside the
processors (the self-attention kinds in ``capture``, the cross-attention kinds in ``capture_context``)
and its peak extra memory (Linux ``VmHWM``, reset at each capture). The block's outputs of both calls
must be bit-identical.

    python benchmarks/bench_wan.py                    # real shape (about 10 minutes on 2 cores)
    python benchmarks/bench_wan.py --frames 3 --height 6 --width 8   # quick look
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from diffusers import WanTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

import cogattn

MiB = 2**20
WAN_1_3B = dict(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json, one block
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)


def timed_modules(transformer) -> dict[str, list[float]]:
    """Wall time of every call of the block's attn1 and attn2, by name."""
    times: dict[str, list[float]] = {"attn1": [], "attn2": []}
    block = transformer.blocks[0]
    for name in times:
        module = getattr(block, name)
        module.register_forward_pre_hook(lambda m, a, n=name: times[n].append(-time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o, n=name: times[n].__setitem__(-1, times[n][-1] + time.perf_counter())
        )
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=21, help="latent frames")
    ap.add_argument("--height", type=int, default=30, help="patch rows")
    ap.add_argument("--width", type=int, default=52, help="patch columns")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default="benchmarks/results/wan_cpu.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**WAN_1_3B).eval()
    latents = torch.randn(1, 16, args.frames, 2 * args.height, 2 * args.width)
    text = torch.randn(1, 512, WAN_1_3B["text_dim"])
    t = torch.tensor([500.0])
    times = timed_modules(transformer)
    S = args.frames * args.height * args.width
    H, D = WAN_1_3B["num_attention_heads"], WAN_1_3B["attention_head_dim"]

    def forward():
        with torch.no_grad():
            return transformer(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with torch.no_grad():  # warm up kernels on a small call
        transformer(hidden_states=latents[:, :, :1, :4, :4], timestep=t, encoder_hidden_states=text, return_dict=False)
    for v in times.values():
        v.clear()
    reference = forward()
    t_self, t_cross = times["attn1"][-1], times["attn2"][-1]
    print(f"stock: attn1 {t_self:.2f} s, attn2 {t_cross:.2f} s", flush=True)

    memory = PeakMemory("cpu")
    cases = [
        (("frame",), "auto"),
        (("video_to_text",), "auto"),
        (("frame",), "rows"),
    ]
    rows = []
    for kinds, method in cases:
        rec = cogattn.record(transformer, kinds=kinds, method=method, memory_budget=args.budget, batch=[0])
        spent = {"capture": [0.0, 0], "capture_context": [0.0, 0]}
        for name in spent:
            setattr(rec, name, memory.measured(getattr(rec, name), spent[name]))
        with rec:
            out = forward()
        identical = torch.equal(out, reference)
        plan = rec.plan
        for name, what in (("capture", "self"), ("capture_context", "cross")):
            dt, peak = spent[name]
            if dt == 0:
                continue
            planned = plan.tiles.peak_bytes if what == "self" else plan.context_bytes
            used = plan.tiles.method if what == "self" else "cross rows"
            rows.append((" + ".join(kinds), what, used, dt, dt / t_self, peak, planned, plan.result_bytes, identical))
            print(
                f"{rows[-1][0]:>22} {what:>5} {used:>10}: {dt:7.2f} s  {dt / t_self:5.2f}× stock self-attention  "
                f"peak +{peak / MiB:7.1f} MiB  identical output: {identical}",
                flush=True,
            )

    lines = [
        f"One Wan 2.1-1.3B block, {H} heads × {D}, S = {S:,} video tokens ({args.frames}×{args.height}×"
        f"{args.width}) + 512 text tokens in the cross-attention, float32, CPU "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, memory_budget = {args.budget}, heads = mean, random weights.",
        "",
        f"Stock self-attention module (`attn1`: projections, RoPE, SDPA, output projection): **{t_self:.2f} s**; "
        f"stock cross-attention module (`attn2`): {t_cross:.2f} s. Capture time is what cogattn adds inside the "
        "processors (the self-attention kinds' capture, or the cross-attention's), as a multiple of the stock "
        "self-attention module's time, measured in the same run. `identical`: the block's output with capture "
        "on equals the stock output bit for bit.",
        "",
        "| kinds | attention | method | capture time (s) | × stock self-attention | peak extra memory (MiB) | "
        "planned working set (MiB) | results (MiB) | identical |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, what, used, dt, ratio, peak, planned, result, identical in rows:
        lines.append(
            f"| {name} | {what} | {used} | {dt:.2f} | {ratio:.2f} | {peak / MiB:.0f} | {planned / MiB:.0f} | "
            f"{result / MiB:.2f} | {'yes' if identical else 'NO'} |"
        )
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
