"""Capture under context parallelism: each rank's cost against the single-process capture of the same work.

Builds a one-block ``WanTransformer3DModel`` from the Wan 2.1-1.3B config (12 heads × 128, random weights) and calls
it on random latents at a reduced size (default 8 latent frames × 24 × 32 patches: S = 6,144 video tokens) and 512
text tokens, float32. Each case runs in forked processes of one thread each: once without context parallelism, then
under Ulysses 2, ring 2 and 2 × 2 with gloo (diffusers' CP on a CPU needs the tests' two shims,
``tests/cp_shims.py``). Every rank records ``frame`` + ``video_to_text`` of every head and reports what capture added
inside the processors (``capture`` + ``capture_context``: wall and CPU time), of which the exchange of q and k and the
gathering of the results to rank 0 (``Mesh.exchange``, ``Mesh.combine``), and its peak extra memory (Linux
``VmHWM``). The goal: each rank's capture within 1.2× of 1/(R·U) of the single process's, plus the exchange.

On a machine with fewer cores than ranks the ranks share them: their wall times then include waiting for each other
at the exchange, and the CPU time is the fair per-rank figure.

    python benchmarks/bench_cp.py                      # about 90 s on 2 cores
    python benchmarks/bench_cp.py --frames 2 --height 8 --width 8   # quick look
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import tempfile
import time

import torch
from bench_wan import WAN_1_3B
from diffusers import WanTransformer3DModel
from peak_memory import PeakMemory  # it re-executes the script with mmapped large allocations
from report import write_table

import cogattn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from cp_shims import enable, shims  # the tests' shims: diffusers' CP on a CPU

MiB = 2**20
_FORK = multiprocessing.get_context("fork")


def _rank(rank, world, ring, ulysses, init, transformer, inputs, budget, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        shims()
        enable(transformer, ring, ulysses)
    memory = PeakMemory("cpu")
    rec = cogattn.record(transformer, kinds=("frame", "video_to_text"), heads="all", batch=[0], memory_budget=budget)
    spent = {"capture": [0.0, 0], "capture_context": [0.0, 0]}
    cpu = [0.0]
    comm = [0.0]
    for name in spent:
        inner = memory.measured(getattr(rec, name), spent[name])

        def timed(*args, inner=inner, **kwargs):
            t0 = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                cpu[0] += time.process_time() - t0

        setattr(rec, name, timed)
    with torch.no_grad(), rec:
        mesh_calls = _time_mesh(rec, comm)
        transformer(**inputs, return_dict=False)
    mesh_calls()
    wall = sum(v[0] for v in spent.values())
    peak = max(v[1] for v in spent.values())
    results.put((rank, wall, cpu[0], comm[0], peak, len(rec.keys())))
    if world > 1:
        dist.destroy_process_group()


def _time_mesh(rec, comm):
    """Time the mesh's exchange and combine once the recording has found its mesh (at the first call)."""
    from cogattn.recorder import mesh as mesh_module

    originals = {n: getattr(mesh_module.Mesh, n) for n in ("exchange", "combine", "gather_tokens")}

    def wrap(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                comm[0] += time.perf_counter() - t0

        return timed

    for name, fn in originals.items():
        setattr(mesh_module.Mesh, name, wrap(fn))

    def restore():
        for name, fn in originals.items():
            setattr(mesh_module.Mesh, name, fn)

    return restore


def run_case(ring, ulysses, transformer, inputs, budget):
    world = ring * ulysses
    results = _FORK.Queue()
    init = tempfile.mktemp()
    procs = [
        _FORK.Process(target=_rank, args=(r, world, ring, ulysses, init, transformer, inputs, budget, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=8, help="latent frames")
    ap.add_argument("--height", type=int, default=24, help="patch rows")
    ap.add_argument("--width", type=int, default=32, help="patch columns")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default="benchmarks/results/cp_cpu.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**WAN_1_3B).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 16, args.frames, 2 * args.height, 2 * args.width),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 512, WAN_1_3B["text_dim"]),
    )
    S = args.frames * args.height * args.width
    cases = [(1, 1), (1, 2), (2, 1), (2, 2)]
    rows, single = [], None
    for ring, ulysses in cases:
        got = run_case(ring, ulysses, transformer, inputs, args.budget)
        n = ring * ulysses
        if n == 1:
            single = got[0]
        for rank, wall, cpu, comm, peak, records in got:
            target = single[2] / n
            name = "none" if n == 1 else f"ring {ring} × ulysses {ulysses}"
            rows.append((name, rank, wall, cpu, comm, cpu / target, peak, records))
            print(
                f"{name:>20} rank {rank}: capture {wall:6.2f} s wall, {cpu:6.2f} s CPU ({cpu / target:4.2f}× 1/{n} of "
                f"one process), exchange and gather {comm:5.2f} s, peak +{peak / MiB:6.1f} MiB, {records} records",
                flush=True,
            )
    lines = [
        f"One Wan 2.1-1.3B block, {WAN_1_3B['num_attention_heads']} heads × {WAN_1_3B['attention_head_dim']}, "
        f"S = {S:,} video tokens ({args.frames}×{args.height}×{args.width}) + 512 text tokens, float32, CPU "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, one thread a rank), torch "
        f"{torch.__version__}, gloo; `frame` + `video_to_text`, every head, memory_budget = {args.budget}.",
        "",
        "Capture: what cogattn adds inside the processors on each rank (wall and CPU time), of which the exchange of q"
        " and k and the gathering of the results to rank 0 (wall). `× 1/n`: the rank's CPU time against 1/(R·U) of "
        "the single process's (the goal: ≤ 1.2, plus the exchange). Records: what the rank holds (rank 0 all).",
        "",
        "| mesh | rank | capture wall (s) | capture CPU (s) | exchange + gather (s) | × 1/n of one process | "
        "peak extra memory (MiB) | records |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rank, wall, cpu, comm, ratio, peak, records in rows:
        lines.append(
            f"| {name} | {rank} | {wall:.2f} | {cpu:.2f} | {comm:.2f} | {ratio:.2f} | {peak / MiB:.0f} | {records} |"
        )
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
