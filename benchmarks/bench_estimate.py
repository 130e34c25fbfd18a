"""Predicted vs measured: peak extra memory of capture, and bytes written, for several plans.

A CogVideoX-2b transformer with one block (random weights) runs one forward pass at 480×720 and 5
latent frames (S = 226 + 5·30·45 = 6,976), under ``cogattn.record`` with ``save_dir=`` a temporary run
folder. For each plan the script compares ``cogattn.estimate(...)`` with

* the measured peak extra memory of each layer capture (and, with ``layer_output="joint"``, of the widened
  output call beyond the output the stock call allocates too): on CPU the rise of the process's peak
  resident memory (Linux ``VmHWM``, reset before the capture; large allocations are mmapped so freed
  memory leaves at once), on CUDA ``torch.cuda.max_memory_allocated`` over the capture;
* the bytes of the record files written.

    python benchmarks/bench_estimate.py
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations

import cogattn
from cogattn.costs import estimate

MiB = 2**20

PLANS = [
    dict(kinds=("frame",), method="sdpa"),
    dict(kinds=("frame",), method="rows"),
    dict(kinds=("video_to_text",), method="sdpa"),
    dict(kinds=("frame", "video_to_text"), method="sdpa", heads=[0, 5, 7, 11]),
    dict(kinds=("text_to_video",)),
    dict(kinds=("query",), queries=list(range(300, 6900, 103))),
    dict(kinds=("full",), heads="mean"),
    dict(kinds=("frame", "video_to_text"), method="sdpa", dtype=torch.bfloat16),
    dict(kinds=("frame", "text_to_video"), method="rows", dtype=torch.bfloat16, heads="all"),
    dict(kinds=("frame", "video_to_text"), layer_output="joint", dtype=torch.bfloat16),
    dict(kinds=("entropy",), method="sdpa"),
    dict(kinds=("received",), method="sdpa"),
    dict(kinds=("query_frame",), method="sdpa", heads="all"),
    dict(kinds=("block",), method="rows"),
    dict(kinds=("entropy", "received", "query_frame", "block"), method="rows", dtype=torch.bfloat16),
    dict(kinds=("entropy", "received", "query_frame", "block"), method="sdpa"),
    dict(kinds=("topk",), heads="mean"),
    dict(kinds=("topk",), heads=[0, 1, 2], storage_dtype="bfloat16"),
    dict(kinds=("tile",), method="sdpa", tile_shape=(1, 2, 2)),  # 1,726 groups: the fold's runs and indicator
    dict(kinds=("block",), method="sdpa", block_size=4),  # 1,744 groups
]


def measure_captures(rec, device: str) -> list[int]:
    """Wrap ``rec.capture`` to record the peak extra memory of every layer capture."""
    peaks, inner, memory = [], rec.capture, PeakMemory(device)

    def measured(*args, **kwargs):  # every argument a family's processor passes (value= too)
        memory.start()
        inner(*args, **kwargs)
        peaks.append(memory.stop())

    rec.capture = measured
    joint = rec._capture.attention  # Recording.attention is a property that reads the capture side's

    def measured_joint(layer, query, key, value):  # layer_output="joint": the widened call, beyond the stock output
        memory.start()
        result = joint(layer, query, key, value)
        if result is not None:
            peaks.append(memory.stop() - result[0].nbytes)
        return result

    rec._capture.attention = measured_joint
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=5, help="latent frames")
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--out", default="benchmarks/results/estimate_cpu.md")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    # One-time costs of the process are paid first: the first torch.topk call makes its threads' buffers
    # resident (about 10 MiB on this machine), once per process, not per capture.
    torch.rand(2, 300, 7000).topk(32, dim=-1)
    rows = []
    models = {}
    for plan in PLANS:
        plan = dict(plan)
        dtype = plan.pop("dtype", torch.float32)
        if dtype not in models:
            models[dtype] = CogVideoXTransformer3DModel(num_layers=1).to(device, dtype).eval()  # CogVideoX-2b shape
        model = models[dtype]
        opts = {"batch": "all", "heads": "mean", "memory_budget": args.budget, **plan}
        pred = estimate(
            model,
            num_frames=(args.frames - 1) * 4 + 1,
            height=480,
            width=720,
            num_inference_steps=1,
            guidance_scale=1.0,
            text_len=226,
            dtype=dtype,
            device=device,
            **opts,
        )
        latents = torch.randn(1, args.frames, 16, 60, 90, device=device, dtype=dtype)
        text = torch.randn(1, 226, 4096, device=device, dtype=dtype)
        with tempfile.TemporaryDirectory(dir=".") as tmp, torch.no_grad():
            rec = cogattn.record(model, save_dir=Path(tmp) / "run", **opts)
            peaks = measure_captures(rec, device)
            with rec:
                model(hidden_states=latents, encoder_hidden_states=text, timestep=torch.tensor([500], device=device))
            written = sum(r.nbytes for r in cogattn.load(Path(tmp) / "run").records())
        name = " + ".join(opts["kinds"])
        heads = f"heads {opts['heads']}" if isinstance(opts["heads"], str) else f"{len(opts['heads'])} heads"
        sizes = "".join(f", {k} {opts[k]}" for k in ("tile_shape", "block_size") if k in opts)
        label = f"{name} ({pred.tiles.method}, {heads}, {str(dtype)[6:]}{sizes})"
        rows.append((label, pred.peak_extra_memory, max(peaks), pred.record_bytes, written))
        print(
            f"{label:>60}: memory predicted {pred.peak_extra_memory / MiB:8.1f} MiB, measured "
            f"{max(peaks) / MiB:8.1f} MiB; bytes predicted {pred.record_bytes:,} written {written:,}",
            flush=True,
        )

    S = 226 + args.frames * 30 * 45
    lines = [
        f"One CogVideoX-2b block (30 heads × 64, random weights), one forward pass at S = {S:,} "
        f"({args.frames} latent frames × 30×45 + 226 text), batch 1, memory_budget = {args.budget}, {device} "
        f"({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}.",
        "",
        "| plan | predicted peak extra (MiB) | measured (MiB) | measured / predicted | predicted bytes | written bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, pm, mm, pb, wb in rows:
        lines.append(f"| {label} | {pm / MiB:.1f} | {mm / MiB:.1f} | {mm / pm:.2f} | {pb:,} | {wb:,} |")
    lines += ["", f"Command: `python {' '.join(sys.argv)}`"]
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
