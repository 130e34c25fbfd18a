"""``cogattn view`` on a run of CogVideoX-5b's size: opening it and answering the page, in time and memory.

Builds a run with CogVideoX-5b's token layout (226 text tokens, 13 latent frames of 30 × 45 patches:
S = 17,776) holding ``frame``, ``video_to_text`` and ``full`` (the mean over heads) for 42 layers × 2
steps: 84 ``full`` records of 1.26 GB each, 107.5 GB in all with the other kinds. Every record of a kind
is a hard link to one file written once, so the run takes 1.3 GB of disk while the reader sees 107.5 GB in
252 files. A second run
holds one step and one layer of the same records (1.3 GB). For each, the script times the viewer's
answers (:class:`cogattn.view.data.RunView`, what the server calls) and their peak resident memory above
what the process held before (Linux ``VmHWM``), then reads one ``full`` record whole, as a point's row
cost before rows were read alone. The files are in the page cache (written just before): the times are
those of a warm disk.

    python benchmarks/bench_view.py                      # under ./runs/bench_view (deleted after)
    python benchmarks/bench_view.py --dir /mnt/scratch   # another disk
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

import cogattn
from cogattn.analysis import aggregate
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline
from cogattn.runs.folder import MANIFEST, META
from cogattn.runs.store import RunWriter
from cogattn.view.data import RunView
from cogattn.view.report import export

LAYOUT = {"text_len": 226, "frames": 13, "height": 30, "width": 45, "patch_size": 2, "temporal_compression": 4}
GB = 1e9


def template(folder: Path) -> dict:
    """A real ``run.json`` (a recording of the tiny pipeline), to take the big run's metadata from."""
    pipe = tiny_pipeline()
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=torch.Generator().manual_seed(0))
    with cogattn.record(pipe, kinds=("frame", "video_to_text", "full"), save_dir=folder):
        pipe(prompt_embeds=emb, negative_prompt_embeds=-emb, num_frames=9, height=48, width=80,
             num_inference_steps=1, max_sequence_length=TINY_TEXT_LEN, output_type="latent")  # fmt: skip
    meta = json.loads((folder / META).read_text())
    shutil.rmtree(folder)
    return meta


def build(folder: Path, meta: dict, steps: int, layers: int) -> int:
    """A run of ``steps`` × ``layers`` records per kind, one file per kind linked under every name."""
    lay = {**meta["layout"], **LAYOUT}
    S, G = lay["text_len"] + lay["frames"] * lay["height"] * lay["width"], 1 + lay["frames"]
    meta = {**meta, "layout": lay, "steps": steps, "timesteps": [999.0 - 20 * s for s in range(steps)], "checks": []}
    meta["model"] = {**meta["model"], "layer_names": [f"transformer_blocks.{i}.attn1" for i in range(layers)]}
    meta.pop("format", None)
    writer = RunWriter.create(folder, True, "float32", meta)
    grid = (lay["frames"], lay["height"], lay["width"])
    shapes = {"frame": (1, 1, G, G), "video_to_text": (1, 1, lay["text_len"], *grid), "full": (1, 1, S, S)}
    for kind, shape in shapes.items():
        writer.put(kind, 0, 0, 999.0, torch.rand(shape).div_(shape[-1]))
    writer.close(meta)
    written = (folder / MANIFEST).read_text().splitlines()
    lines = []
    for raw in written:
        line = json.loads(raw)
        for s in range(steps):
            for n in range(layers):
                name = line["file"].replace("step0000_layer000", f"step{s:04d}_layer{n:03d}")
                if (s, n) != (0, 0):
                    os.link(folder / line["file"], folder / name)
                lines.append(json.dumps({**line, "step": s, "layer": n, "timestep": 999.0 - 20 * s, "file": name}))
    (folder / MANIFEST).write_text("\n".join(lines) + "\n")
    return sum(json.loads(x)["bytes"] for x in lines)


def measure(what, memory: PeakMemory) -> tuple[float, int]:
    memory.start()
    t0 = time.perf_counter()
    answer = what()
    seconds, peak = time.perf_counter() - t0, memory.stop()
    if isinstance(answer, dict) and "error" in answer:  # a refusal is fast, and measures nothing
        raise RuntimeError(f"the viewer refused: {answer['error']}")
    return seconds, peak


def answers(folder: Path, report: Path, memory: PeakMemory) -> list[tuple[str, float, int]]:
    """``(answer, seconds, peak bytes)`` of the viewer's answers on the run in ``folder``, in order."""
    token = 226 + 6 * 30 * 45 + 15 * 45 + 22  # frame 6, row 15, column 22
    view = None

    def open_view():
        nonlocal view
        view = RunView(folder)
        return view.summary()

    calls = [
        ("open the run and answer the summary", open_view),
        ("`frame`, mean of layers", lambda: view.map("frame", 0, "mean")),
        ("a word's `video_to_text`, mean of layers", lambda: view.map("video_to_text", 0, "mean", "mean", 5)),
        ("a point's row of `full`, one layer", lambda: view.point(0, 0, "mean", 6, 15, 22)),
        ("a point's row of `full`, mean of layers", lambda: view.point(0, "mean", "mean", 6, 15, 22)),
        ("`--export` one HTML file", lambda: export(folder, report)),
        (
            "a point's row of `full` from the whole record, one layer",
            lambda: aggregate(view.run, "full", steps=0, layers=0)[token],
        ),
    ]
    return [(what, *measure(call, memory)) for what, call in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="runs/bench_view")
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/view_cpu.md")
    args = ap.parse_args()
    base = Path(args.dir)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    meta = template(base / "template")
    memory = PeakMemory()
    rows = []
    try:
        for name, steps, layers in (("1 record a kind", 1, 1), (f"{args.steps} steps × {args.layers} layers", args.steps, args.layers)):  # fmt: skip
            folder = base / name.replace(" ", "_")
            size = build(folder, meta, steps, layers)
            rows += [(name, size, *row) for row in answers(folder, base / "report.html", memory)]
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    whole = {r[0]: r for r in rows if "whole record" in r[2]}
    lines = [
        f"A run with CogVideoX-5b's token layout (S = 17,776; 13 latent frames of 30 × 45 patches) holding `frame`, "
        f"`video_to_text` and `full` (mean over heads, float32); records of a kind are hard links to one file. "
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}, warm page cache.",
        "",
        "| run | records (GB) | answer | time (s) | peak memory (MB) | vs the whole record |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, size, what, seconds, peak in rows:
        ref = whole[name][4]
        lines.append(f"| {name} | {size / GB:,.1f} | {what} | {seconds:.3f} | {peak / 1e6:,.1f} | {peak / ref:.4f}× |")
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
