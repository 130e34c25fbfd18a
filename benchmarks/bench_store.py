"""Streaming records to disk vs keeping them in memory, and the writer vs a plain sequential write.

Runs one generation three ways, side by side: no capture, in-memory capture, and capture streamed
to a run folder; the plan (``full`` maps of every layer, mean over heads, both CFG halves, 30 steps)
writes over 1 GB at a rate the disk keeps up with. Then writes the same number of bytes as one plain sequential file on the same disk and
compares throughputs.

    python benchmarks/bench_store.py                      # writes under ./runs/bench_store (deleted after)
    python benchmarks/bench_store.py --dir /mnt/scratch   # another disk
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

import cogattn
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline
from cogattn.runs.store import RunWriter, prepare_folder

MB = 1e6


def generate(pipe, steps: int, height: int, width: int):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=g)
    return pipe(
        prompt_embeds=emb,
        negative_prompt_embeds=-emb,
        num_frames=9,
        height=height,
        width=width,
        num_inference_steps=steps,
        max_sequence_length=TINY_TEXT_LEN,
        output_type="latent",
        generator=g,
    ).frames


def plain_write(path: Path, tensors: list[torch.Tensor]) -> float:
    """Seconds to write the tensors' bytes sequentially into one new file and sync them to the disk."""
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
    os.sync()
    return time.perf_counter() - t0


def writer_write(path: Path, tensors: list[torch.Tensor]) -> float:
    """Seconds for cogattn's writer to commit the tensors as records and sync them to the disk."""
    writer = RunWriter(prepare_folder(path, False))
    os.sync()
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        writer.put("full", i, 0, None, t)
    writer.close({})
    os.sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="runs/bench_store")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--height", type=int, default=192)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--out", default="benchmarks/results/store_cpu.md")
    args = ap.parse_args()

    base = Path(args.dir)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    pipe = tiny_pipeline(num_layers=args.layers, num_heads=args.heads, head_dim=args.head_dim)
    sel = dict(kinds=("full",), heads="mean", batch="all")
    generate(pipe, 1, args.height, args.width)  # warm up

    times = {}
    os.sync()  # each timing starts with no dirty pages of an earlier one being written back
    t0 = time.perf_counter()
    generate(pipe, args.steps, args.height, args.width)
    times["no capture"] = time.perf_counter() - t0

    os.sync()
    with cogattn.record(pipe, **sel) as mem:
        t0 = time.perf_counter()
        generate(pipe, args.steps, args.height, args.width)
        times["in-memory capture"] = time.perf_counter() - t0
    tensors = [mem.get(*k) for k in mem.keys()]
    del mem

    rec = cogattn.record(pipe, **sel, save_dir=base / "run")
    os.sync()
    with rec:
        t0 = time.perf_counter()
        generate(pipe, args.steps, args.height, args.width)
    times["capture streamed to disk"] = time.perf_counter() - t0  # includes draining the queue on exit
    blocked = rec._store.blocked_seconds
    run = cogattn.load(base / "run")
    written = sum(r.nbytes for r in run.records())
    # The writer alone vs a plain write of the same bytes, alternated so both see the same disk state.
    # Nothing is deleted until the end: on a disk mounted with `discard`, deleting 1 GB slows the next write.
    t_writer, t_plain = [], []
    for i in range(3):
        t_writer.append(writer_write(base / f"writer{i}", tensors))
        t_plain.append(plain_write(base / f"plain{i}.bin", tensors))
    shutil.rmtree(base)
    data = sum(t.numel() * 4 for t in tensors)
    writer_tp, plain_tp = data / sorted(t_writer)[1], data / sorted(t_plain)[1]
    ref = times["in-memory capture"]
    lines = [
        f"Tiny random CogVideoX pipeline scaled up ({args.layers} layers × {args.heads} heads, "
        f"{args.height}×{args.width} px, 9 frames, S = {run.layout.seq_len}), {args.steps} steps with guidance, "
        f"capturing `full` (mean over heads) for every layer, both CFG halves; float32 on CPU "
        f"({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}.",
        f"Records: {len(run)}, {written / MB:,.0f} MB written to `{args.dir}`; generation waited "
        f"{blocked:.2f} s in total for the writer's queue.",
        "",
        "| generation | time (s) | vs in-memory capture |",
        "| --- | ---: | ---: |",
        *[f"| {k} | {v:.2f} | {v / ref:.3f}× |" for k, v in times.items()],
        "",
        f"Writing the same {len(tensors)} tensors ({data / MB:,.0f} MB) with nothing else running, until synced to "
        "the disk (`os.sync()`), median of 3 alternating runs:",
        "",
        "| writer | MB/s | vs plain write |",
        "| --- | ---: | ---: |",
        f"| cogattn writer (one safetensors file per record, rename, manifest line) | {writer_tp / MB:,.0f} | "
        f"{writer_tp / plain_tp:.2f}× |",
        f"| plain sequential write of the same bytes to one file, same disk | {plain_tp / MB:,.0f} | 1.00× |",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
    ]
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(table + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
