"""One CogVideoX attention layer at real shape: stock time vs exact capture of each kind, per method.

Builds the attention of a CogVideoX-2b block (30 heads × 64, sincos positions, so no RoPE) with random
weights and random inputs at 49 frames × 480×720 (S = 226 + 13·30·45 = 17,776), float32 on the CPU (or ``--device cuda``),
then times the stock layer (projections + fused SDPA + output projection) and, on the same q and k,
cogattn's capture of each kind with the ``sdpa`` and ``rows`` methods, and ``layer_output="joint"``, where
the cost is the joint output call's time over the stock SDPA call's plus the capture that remains. Peak extra memory is the rise of
the process's peak resident memory during a capture (Linux ``VmHWM``, reset before each capture; big
allocations are made with mmap so freed memory really leaves). Each capture runs ``--repeats`` times: the least
time is kept and the first shown apart (on CUDA it carries the Triton kernel's compilation).

    python benchmarks/bench_layer.py                 # real CogVideoX-2b shape (a few minutes on 2 cores)
    python benchmarks/bench_layer.py --frames 2 --height 10 --width 15   # quick look
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

from cogattn.exact import tile_kernel
from cogattn.exact.attention import attention_joint, attention_with_lse, sdpa_with_lse
from cogattn.exact.checks import RowProbe, Verifier, probe_rows
from cogattn.exact.engine import capture, multi_key_indicator
from cogattn.exact.planner import choose_method, plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.options import parse_bytes

MiB = 2**20


def build_layer(heads: int, head_dim: int) -> Attention:
    dim = heads * head_dim
    attn = Attention(
        query_dim=dim,
        dim_head=head_dim,
        heads=heads,
        qk_norm="layer_norm",
        eps=1e-6,
        bias=True,
        out_bias=True,
        processor=CogVideoXAttnProcessor2_0(),
    )
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
    ap.add_argument("--repeats", type=int, default=1, help="captures per case (the least time kept, the first apart)")
    ap.add_argument(
        "--cases",
        choices=("maps", "stats", "offset", "patterns", "ranked", "sparse"),
        default="maps",
        help="the map kinds, the statistics kinds, offset, the pattern kinds, top_p and frame_max (ranked), or "
        "the sparse-attention kinds side by side (tile, frame_max, offset, top_p, pattern_recall, pattern_error)",
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (times synchronised, peaks from the allocator)")
    ap.add_argument("--out", default=None, help="defaults to benchmarks/results/layer_cpu.md (stats_cpu.md)")
    args = ap.parse_args()
    device = torch.device(args.device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    args.out = args.out or f"benchmarks/results/{dict(maps='layer').get(args.cases, args.cases)}_{kind}.md"

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    torch.manual_seed(0)
    layout = TokenLayout(args.text, args.frames, args.height, args.width)
    S, H, D = layout.seq_len, args.heads, args.head_dim
    budget = parse_bytes(args.budget)
    attn = build_layer(H, D).to(device)
    text = torch.randn(1, args.text, H * D, device=device)
    video = torch.randn(1, layout.video_len, H * D, device=device)
    queries = torch.linspace(layout.text_len, S - 1, args.queries).long().to(device)

    with torch.no_grad():
        attn(video[:, :64], encoder_hidden_states=text[:, :8])  # warm up kernels
        stock = []
        for _ in range(2):
            t0 = now()
            attn(video, encoder_hidden_states=text)
            stock.append(now() - t0)
        t_stock = min(stock)
        q, k = project_qk(attn, text, video)
        v = torch.randn_like(q)
        t_sdpa, lse = float("inf"), None
        for _ in range(2):
            t0 = now()
            # the output kernel with its log-sum-exp (what layer_output="lse" uses; the same kernel as SDPA on CPU)
            _, lse = attention_with_lse(q, k, v)
            t_sdpa = min(t_sdpa, now() - t0)
        if lse is None:  # CUDA float32: the stock call has no log-sum-exp; the memory-efficient kernel's
            _, lse = sdpa_with_lse(q, k, v, D**-0.5)
    memory = PeakMemory(kind)

    def joint(kinds):
        """layer_output="joint": the widened output call over the stock one, then the capture that remains."""
        reducers = [REDUCERS[kd](layout, H, True, queries) for kd in kinds]
        indicator = multi_key_indicator(reducers, S)
        plan = plan_tiles(reducers, S, H, D, budget, "joint", kind, not qb[0].is_contiguous())
        outs = [torch.zeros(r.shape(1)[1:], device=device) for r in reducers]
        with torch.no_grad():
            memory.start()
            torch.nn.functional.scaled_dot_product_attention(qb, kb, v)
            stock_peak = memory.stop()
            times = []
            for _ in range(max(2, args.repeats)):  # at least two, as this table's joint rows always took
                memory.start()
                t0 = now()
                _, j_lse, sums = attention_joint(qb, kb, v, indicator)
                t_call = now() - t0
                outs = [o.zero_() for o in outs]
                t0 = now()
                capture(qb[0], kb[0], reducers, outs, plan, lse=j_lse[0], sums=sums[0])
                times.append(t_call - t_sdpa + now() - t0)
                peak = memory.stop() - stock_peak
                del j_lse, sums
        return reducers, plan, times, peak

    qb, kb = q, k  # (1, H, S, D), for the joint output call
    q, k, lse = q[0], k[0], lse[0]

    cases = [
        (("frame",), "sdpa"),
        (("frame",), "rows"),
        (("video_to_text",), "sdpa"),
        (("video_to_text",), "rows"),
        (("frame", "video_to_text"), "sdpa"),
        (("text_to_video",), "rows"),
        (("query",), "rows"),
        (("video_to_text",), "sdpa+lse"),
        (("frame", "video_to_text"), "sdpa, checked"),
    ]
    cases += [(("frame",), "joint"), (("frame", "video_to_text"), "joint")]
    four = ("entropy", "received", "query_frame", "block")
    stats = [
        (("frame",), "sdpa"),  # the baseline pass the issue compares with
        (("entropy",), "sdpa"),
        (("entropy",), "rows"),
        (("query_frame",), "sdpa"),
        (("query_frame",), "rows"),
        (("received",), "sdpa"),
        (("received",), "sdpa+lse"),
        (("received",), "rows"),
        (("block",), "rows"),
        (("block",), "sdpa"),
        (four, "rows"),
        (four, "sdpa"),
        (("topk",), "rows"),
    ]
    if args.cases == "stats":
        cases = stats
    if args.cases == "ranked":  # beside the row pass alone (frame by rows) and topk, which take the same rows
        cases = [(("frame",), "rows"), (("topk",), "rows"), (("frame_max",), "rows"), (("top_p",), "rows")]
    if args.cases == "offset":  # beside the row pass alone (frame by rows), which it shares
        cases = [(("frame",), "rows"), (("offset",), "rows")]
    if args.cases == "patterns":  # one pattern ("spatial"), then four; beside the row pass alone
        cases = [(("frame",), "rows"), (("pattern_recall",), "rows"), (("pattern_error",), "rows")]
        cases += [(("pattern_error",), "rows, 4 patterns")]
    if args.cases == "sparse":  # the sparse-attention and correspondence kinds, beside frame by the fused pass
        fused = ["sdpa", "triton"] if device.type == "cuda" else ["sdpa"]
        # the row kinds by torch's tiles (rows) and, on CUDA, by the kernels' (triton: what auto takes there)
        tiles = ["rows", "triton"] if device.type == "cuda" else ["rows"]
        cases = [((kd,), m) for kd in ("frame", "tile") for m in [*fused, "rows"]]
        cases += [
            ((kd,), m) for kd in ("frame_max", "offset", "top_p", "pattern_recall", "pattern_error") for m in tiles
        ]
        cases += [(("pattern_error",), m + ", 4 patterns") for m in tiles]
    rows = []
    for kinds, method in cases:
        if method == "joint":
            reducers, plan, times, peak = joint(kinds)
            dt, result = min(times), sum(r.nbytes(1) for r in reducers)
            rows.append((" + ".join(kinds), method, dt, dt / t_stock, times[0], peak, plan.peak_bytes, result))
            print(
                f"{rows[-1][0]:>22} {method:>5}: {dt:7.2f} s  {dt / t_stock:5.2f}× stock  (first {times[0]:.2f} s)  "
                f"peak +{peak / MiB:7.1f} MiB",
                flush=True,
            )
            continue
        four = ("spatial", "temporal", "window:1", "sta:3,3,3") if method.endswith("4 patterns") else ("spatial",)
        sizes = dict(patterns=four * kinds[0].startswith("pattern"), tile_shape=(1, 8, 8))
        reducers = [REDUCERS[kd](layout, H, True, queries, **sizes) for kd in kinds]
        auto = choose_method("auto", reducers, S, kind, D)
        given = lse if method.endswith("+lse") else None
        copies = not q.is_contiguous()  # as the recording decides: contiguous float32 q, k are not copied
        plan = plan_tiles(reducers, S, H, D, budget, method.split("+")[0].split(",")[0], kind, copies)
        outs = [torch.zeros(r.shape(1)[1:], device=device) for r in reducers]
        checked = method.endswith("checked")  # a spot check as a recording makes at a shape's first capture
        value = v[0] if "pattern_error" in kinds else None
        times, peak = [], 0
        for _ in range(args.repeats):
            outs = [o.zero_() for o in outs]
            probe = RowProbe(probe_rows(layout), H) if checked else None
            memory.start()
            t0 = now()
            capture(q, k, reducers, outs, plan, lse=given, probe=probe, value=value)
            if checked:
                check = Verifier(True).check_maps([(0, probe)], qb, kb, None, reducers, 0, 0, "sdpa", D**-0.5)
                assert check.passed, check
            times.append(now() - t0)
            peak = max(peak, memory.stop())
        # (auto): what method="auto" does for these kinds, its method and whether the kernels write its row tiles
        chosen = (auto, tile_kernel.planned("auto", kind, D)) == (plan.method, plan.kernel_tiles)
        dt, result, name = min(times), sum(r.nbytes(1) for r in reducers), method + " (auto)" * chosen
        rows.append((" + ".join(kinds), name, dt, dt / t_stock, times[0], peak, plan.peak_bytes, result))
        print(
            f"{rows[-1][0]:>22} {method:>5}: {dt:7.2f} s  {dt / t_stock:5.2f}× stock  (first {times[0]:.2f} s)  "
            f"peak +{peak / MiB:7.1f} MiB",
            flush=True,
        )
        del outs

    naive = H * S * S * 4
    where = (
        f"CUDA ({torch.cuda.get_device_name(device)}, TF32 off)"
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    lines = [
        f"One CogVideoX attention layer, {H} heads × {D}, S = {S:,} ({layout.text_len} text + "
        f"{layout.frames}×{layout.height}×{layout.width} video tokens), float32, {where}, "
        f"torch {torch.__version__}, memory_budget = {args.budget}, heads = mean.",
        "",
        f"Stock layer (projections + fused SDPA + output projection): **{t_stock:.2f} s** "
        f"(its SDPA call alone: {t_sdpa:.2f} s). Method `sdpa+lse`: the output kernel's log-sum-exp reused "
        '(`layer_output="lse"`). Method `joint` (`layer_output="joint"`): the widened output call\'s time over the '
        "stock SDPA call's, plus the capture that remains; its peak is over the stock call's. `sdpa, checked`: "
        "with the spot check a recording makes at the first capture of a shape (8 rows recomputed exactly). "
        '`(auto)`: the method `method="auto"` chooses for these kinds. `block_size` = 128, `topk` = 32. Capture '
        f"time: the least of {args.repeats} capture(s) per case ({max(args.repeats, 2)} for `joint`); first "
        "call: the first of them (on CUDA it carries the Triton kernel's compilation).",
        f"Naive full P = softmax(QKᵀ) for this layer: {naive / 1e9:.1f} GB ({naive / 2**30:.1f} GiB) in float32, "
        "before any softmax temporaries (not run).",
        "",
        "| kind | method | capture time (s) | × stock layer | first call (s) | peak extra memory (MiB) | "
        "planned working set (MiB) | result (MiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, method, dt, ratio, first, peak, planned, result in rows:
        lines.append(
            f"| {name} | {method} | {dt:.2f} | {ratio:.2f} | {first:.2f} | {peak / MiB:.0f} | {planned / MiB:.0f} | "
            f"{result / MiB:.2f} |"
        )
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
