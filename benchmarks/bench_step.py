"""One denoising step of CogVideoX-2b / -5b at real shape: stock vs capture, time and peak memory.

A transformer built from the released config (random weights) runs one step at 49 frames × 480×720
(S = 17,776) with the guidance batch of 2, several ways in one process: stock; capture of ``frame`` +
``video_to_text`` with the default ``layer_output="stock"``, with ``layer_output="lse"`` and with
``layer_output="joint"`` (and, where Triton runs, ``method="triton"`` with ``layer_output="lse"``); each kind
alone (all built layers, the conditional batch item, ``heads="mean"``).
It prints the step time (the least of ``--repeats`` steps, each under a new recording), its ratio to stock, the
first of those steps apart (the one that carries Triton's compilation), and the peak memory over the stock step's
peak.

    python benchmarks/bench_step.py                       # CPU: float32, one block per model
    python benchmarks/bench_step.py --device cuda --dtype bfloat16 --layers all   # the full models on a GPU
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import CogVideoXPipeline, CogVideoXTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations

import cogattn
from cogattn.exact import kernels

CONFIGS = {
    "CogVideoX-2b": dict(num_layers=30, num_attention_heads=30),
    "CogVideoX-5b": dict(num_layers=42, num_attention_heads=48, use_rotary_positional_embeddings=True),
}
BOTH = ("frame", "video_to_text")
CASES = {  # name: (kinds, layer_output, method)
    "stock": (None, "stock", "auto"),
    "frame + video_to_text": (BOTH, "stock", "auto"),
    "frame + video_to_text, layer_output=lse": (BOTH, "lse", "auto"),
    "frame + video_to_text, layer_output=joint": (BOTH, "joint", "auto"),
    "frame + video_to_text, layer_output=lse, triton": (BOTH, "lse", "triton"),
    "frame": (("frame",), "stock", "auto"),
    "video_to_text": (("video_to_text",), "stock", "auto"),
}
GiB = 2**30


def build(name: str, layers: str, dtype, device):
    cfg = dict(CONFIGS[name])
    if layers != "all":
        cfg["num_layers"] = int(layers)
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(**cfg).to(device=device, dtype=dtype).eval()
    rope = None
    if model.config.use_rotary_positional_embeddings:
        fake = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
        rope = CogVideoXPipeline._prepare_rotary_positional_embeddings(fake, 480, 720, 13, device)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 13, 16, 60, 90, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(2, 226, 4096, generator=g).to(device, dtype),
        timestep=torch.tensor([500, 500], device=device),
        image_rotary_emb=rope,
    )
    return model, inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="CogVideoX-2b,CogVideoX-5b")
    ap.add_argument("--layers", default="1", help="'all' or how many blocks to build")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed runs per case (the minimum is kept, the first shown apart)"
    )
    ap.add_argument("--out", default=None, help="default: benchmarks/results/step_<device>.md")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    peak = PeakMemory(args.device)
    rows = []
    for name in args.models.split(","):
        model, inputs = build(name, args.layers, dtype, args.device)
        with torch.no_grad():
            if args.device == "cuda":
                model(**inputs)  # warm up kernels and the allocator
            stock_time = stock_peak = None
            for case, (kinds, output, method) in CASES.items():
                if method == "triton" and not kernels.available(torch.device(args.device)):
                    continue
                times, peaks = [], []
                for _ in range(args.repeats):
                    rec = None
                    if kinds is not None:  # batch [uncond, cond]: capture the conditional item
                        rec = cogattn.record(
                            model,
                            kinds=kinds,
                            batch=[1],
                            heads="mean",
                            memory_budget=args.budget,
                            layer_output=output,
                            method=method,
                        )
                    peak.start()
                    t0 = time.perf_counter()
                    model(**inputs)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    peaks.append(peak.stop())
                    if rec is not None:
                        rec.close()
                        del rec
                t, p = min(times), max(peaks)
                if kinds is None:
                    stock_time, stock_peak = t, p
                rows.append((name, model.config.num_layers, case, t, t / stock_time, times[0], p, p - stock_peak))
                print(
                    f"{name} ({model.config.num_layers} layers) {case:>40}: {t:8.2f} s  {t / stock_time:5.2f}× "
                    f"stock  (first {times[0]:.2f} s)  peak {p / GiB:6.2f} GiB ({(p - stock_peak) / GiB:+.2f})",
                    flush=True,
                )
        del model, inputs

    dev = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    )
    lines = [
        f"One denoising step, 49 frames × 480×720 (S = 17,776), guidance batch 2, random weights, {args.dtype} on "
        f'{dev}, torch {torch.__version__}. Capture: the conditional item (`batch=[1]`), `heads="mean"`, every '
        f'built layer, `memory_budget="{args.budget}"`. Step time: the least of {args.repeats} step(s) per case, each '
        "under a new recording (so each pays what a recording does at its first capture, such as its spot check); "
        "first call: the first of them, which alone carries the process's one-time costs (the Triton kernel's "
        "compilation).",
        "",
        "| model (layers built) | run | step time (s) | × stock | first call (s) | peak memory (GiB) | over stock (GiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, n, case, t, ratio, first, p, extra in rows:
        lines.append(
            f"| {name} ({n}) | {case} | {t:.2f} | {ratio:.2f} | {first:.2f} | {p / GiB:.2f} | {extra / GiB:+.2f} |"
        )
    lines += ["", f"Command: `python {' '.join(sys.argv)}`"]
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out or f"benchmarks/results/step_{args.device}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")


if __name__ == "__main__":
    main()
