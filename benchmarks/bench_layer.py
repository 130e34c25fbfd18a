"""One CogVideoX attention layer at real shape: stock time vs exact capture of each kind, per path.

Builds the attention of a CogVideoX-2b block (30 heads × 64, sincos positions, so no RoPE) with random
weights and random inputs at 49 frames × 480×720 (S = 226 + 13·30·45 = 17,776), float32 on the CPU,
then times the stock layer (projections + fused SDPA + output projection) and, on the same q and k,
cogattn's capture of each kind with the ``sdpa`` and ``rows`` paths. Peak extra memory is the rise of
the process's peak resident memory during a capture (Linux ``VmHWM``, reset before each capture; big
allocations are made with mmap so freed memory really leaves).

    python benchmarks/bench_layer.py                 # real CogVideoX-2b shape (a few minutes on 2 cores)
    python benchmarks/bench_layer.py --frames 2 --height 10 --width 15   # quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
    # A fixed mmap threshold sends every large tensor straight back to the OS on free, so the peak
    # resident memory measured below is the live peak, not glibc's cached heap.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

from cogattn.engine import capture, plan_tiles
from cogattn.layout import TokenLayout
from cogattn.reducers import REDUCERS
from cogattn.selection import parse_bytes

MiB = 2**20


def rss_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def build_layer(heads: int, head_dim: int) -> Attention:
    dim = heads * head_dim
    attn = Attention(query_dim=dim, dim_head=head_dim, heads=heads, qk_norm="layer_norm", eps=1e-6, bias=True,
                     out_bias=True, processor=CogVideoXAttnProcessor2_0())  # fmt: skip
    return attn.eval()


def project_qk(attn: Attention, text: torch.Tensor, video: torch.Tensor):
    """q, k exactly as the stock processor forms them (no RoPE for the 2b config)."""
    x = torch.cat([text, video], dim=1)
    B, S, _ = x.shape
    q = attn.norm_q(attn.to_q(x).view(B, S, attn.heads, -1).transpose(1, 2))
    k = attn.norm_k(attn.to_k(x).view(B, S, attn.heads, -1).transpose(1, 2))
    return q, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=30)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--text", type=int, default=226)
    ap.add_argument("--frames", type=int, default=13)
    ap.add_argument("--height", type=int, default=30)
    ap.add_argument("--width", type=int, default=45)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default="benchmarks/results/layer_cpu.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    layout = TokenLayout(args.text, args.frames, args.height, args.width)
    S, H, D = layout.seq_len, args.heads, args.head_dim
    budget = parse_bytes(args.budget)
    attn = build_layer(H, D)
    text = torch.randn(1, args.text, H * D)
    video = torch.randn(1, layout.video_len, H * D)
    queries = torch.linspace(layout.text_len, S - 1, args.queries).long()

    with torch.no_grad():
        attn(video[:, :64], encoder_hidden_states=text[:, :8])  # warm up kernels
        stock = []
        for _ in range(2):
            t0 = time.perf_counter()
            attn(video, encoder_hidden_states=text)
            stock.append(time.perf_counter() - t0)
        t_stock = min(stock)
        q, k = project_qk(attn, text, video)
        q, k = q[0], k[0]
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q[None], k[None], q[None])
        t_sdpa = time.perf_counter() - t0

    cases = [
        (("frame",), "sdpa"), (("frame",), "rows"),
        (("video_to_text",), "sdpa"), (("video_to_text",), "rows"),
        (("frame", "video_to_text"), "sdpa"),
        (("text_to_video",), "rows"), (("query",), "rows"),
    ]  # fmt: skip
    rows = []
    for kinds, path in cases:
        reducers = [REDUCERS[kd](layout, H, True, queries) for kd in kinds]
        plan = plan_tiles(reducers, S, H, D, budget, path, "cpu")
        outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
        base = rss_reset()
        t0 = time.perf_counter()
        capture(q, k, reducers, outs, plan)
        dt = time.perf_counter() - t0
        peak = _status("VmHWM") - base
        result = sum(r.nbytes(1) for r in reducers)
        rows.append((" + ".join(kinds), path, dt, dt / t_stock, peak, plan.peak_bytes, result))
        print(f"{rows[-1][0]:>22} {path:>5}: {dt:7.2f} s  {dt / t_stock:5.2f}× stock  peak +{peak / MiB:7.1f} MiB",
              flush=True)  # fmt: skip
        del outs

    naive = H * S * S * 4
    lines = [
        f"One CogVideoX attention layer, {H} heads × {D}, S = {S:,} ({layout.text_len} text + "
        f"{layout.frames}×{layout.height}×{layout.width} video tokens), float32, CPU "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, memory_budget = {args.budget}, heads = mean.",
        "",
        f"Stock layer (projections + fused SDPA + output projection): **{t_stock:.2f} s** "
        f"(its SDPA call alone: {t_sdpa:.2f} s).",
        f"Naive full P = softmax(QKᵀ) for this layer: {naive / 1e9:.1f} GB ({naive / 2**30:.1f} GiB) in float32, "
        "before any softmax temporaries (not run).",
        "",
        "| kind | path | capture time (s) | × stock layer | peak extra memory (MiB) | planned working set (MiB) | result (MiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, path, dt, ratio, peak, planned, result in rows:
        lines.append(f"| {name} | {path} | {dt:.2f} | {ratio:.2f} | {peak / MiB:.0f} | {planned / MiB:.0f} | "
                     f"{result / MiB:.2f} |")  # fmt: skip
    lines += ["", f"Command: `python {' '.join(sys.argv)}`"]
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(table + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
