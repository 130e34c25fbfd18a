"""Start-up: ``import cogattn`` and ``cogattn view`` against ``import torch`` and ``import torch, diffusers``.

Each command runs in a fresh interpreter, timed from its start to its exit (the imports) or to the viewer's first
line on stdout, its first HTTP answer (``cogattn view RUN --port P``, polled every 10 ms until the page
answers) and the page's first two requests of the run's data (``/api/runs``, ``/api/summary``); the commands take turns, ``--repeat`` rounds, and the table gives each one's median, least and most.
The run the viewer opens is a recording of the tiny CogVideoX pipeline made first (or ``--run``). The targets:
the viewer answers within max(3 s, 1.2× ``import torch``), and ``import cogattn`` within 1 s of ``import torch,
diffusers``, with no diffusers transformer module imported.

    python benchmarks/bench_startup.py                 # 5 rounds, the tiny run under ./runs/bench_startup
    python benchmarks/bench_startup.py --repeat 9 --run runs/tiny
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from report import write_table

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = {
    "python -c pass": "pass",
    "import torch": "import torch",
    "import torch, diffusers": "import torch, diffusers",
    "import cogattn": "import cogattn",
}
VIEW = (  # what `cogattn view` is timed to: its first line, its page, then the two answers the page asks for first
    "cogattn view: first line",
    "cogattn view: the page",
    "cogattn view: /api/runs",
    "cogattn view: /api/summary",
)
# what `import cogattn` and opening a run leave imported: model code is for recording only
LEFT = (
    "import sys, cogattn; cogattn.load(sys.argv[1]); "
    "print(sum(m.startswith('diffusers.models.transformers') for m in sys.modules), "
    "sum(m.count('.') == 2 and m.startswith('cogattn.models.') and m.rpartition('.')[2][0] != '_' and "
    "m.rpartition('.')[2] not in ('spec', 'tiny_text', 'prompt_text') for m in sys.modules))"
)


def tiny_run(folder: Path) -> Path:
    """A recording of the tiny CogVideoX pipeline (``frame`` and ``video_to_text``, 2 steps) in ``folder``."""
    import torch

    import cogattn
    from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

    pipe = tiny_pipeline()
    emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=torch.Generator().manual_seed(0))
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), save_dir=folder):
        pipe(prompt_embeds=emb, negative_prompt_embeds=-emb, num_frames=9, height=48, width=80,
             num_inference_steps=2, max_sequence_length=TINY_TEXT_LEN, output_type="latent")  # fmt: skip
    return folder


def time_import(code: str) -> float:
    """Seconds from starting ``python -c code`` to its exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_view(run: Path, timeout: float = 600.0) -> tuple[float, float, float, float]:
    """Seconds from starting ``cogattn view run`` to its first line on stdout, to its first HTTP answer (the page),
    and to the answers the page asks for next: the list of runs, then the run's summary (its data, read from the
    run)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cogattn", "view", str(run), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    first_line: list[float] = []
    reader = threading.Thread(target=lambda: (proc.stdout.readline(), first_line.append(time.perf_counter() - t0)))
    reader.start()
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"cogattn view exited with {proc.returncode} before answering")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                    answer.read()
                answered = time.perf_counter() - t0
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=timeout) as answer:
                    answer.read()
                listed = time.perf_counter() - t0
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/summary", timeout=timeout) as answer:
                    answer.read()
                summarised = time.perf_counter() - t0
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.01)
        else:
            raise RuntimeError(f"cogattn view did not answer within {timeout:.0f} s")
    finally:
        proc.terminate()
        proc.wait()
        reader.join()
    return first_line[0], answered, listed, summarised


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every command (default 5)")
    ap.add_argument("--run", help="a run folder for the viewer (default: a tiny recording made first)")
    ap.add_argument("--dir", default="runs/bench_startup", help="where the tiny run is made (deleted after)")
    ap.add_argument("--out", default="benchmarks/results/startup_cpu.md")
    args = ap.parse_args()
    made = args.run is None
    run = Path(args.run) if args.run else tiny_run(Path(args.dir) / "run")
    try:
        names = [*IMPORTS, *VIEW]
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.repeat):  # in turns, so that a busy moment of the machine falls on every command
            for name, code in IMPORTS.items():
                times[name].append(time_import(code))
            for name, seconds in zip(VIEW, time_view(run)):
                times[name].append(seconds)
            print(f"round {round_ + 1}/{args.repeat}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()))
        left = subprocess.run(
            [sys.executable, "-c", LEFT, str(run)], cwd=ROOT, check=True, capture_output=True, text=True
        )
        model_code, families = (int(n) for n in left.stdout.split())
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    view_target = max(3.0, 1.2 * median["import torch"])
    import_target = median["import torch, diffusers"] + 1.0
    import diffusers
    import torch

    lines = [
        f"Fresh interpreters, {args.repeat} rounds taking turns; CPU ({platform.machine()}, {os.cpu_count()} cores), "
        f"Python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}; the "
        "viewer on a tiny CogVideoX run. Time from start to exit, or to the viewer's first line, its first HTTP answer "
        "(the page), and the first two answers the page asks for.",
        "",
        "| command | median (s) | least (s) | most (s) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in times.items():
        lines.append(f"| {name} | {median[name]:.2f} | {min(t):.2f} | {max(t):.2f} |")
    page, view, imported = median[VIEW[1]], median[VIEW[3]], median["import cogattn"]
    lines += [
        "",
        f"- `cogattn view` answers its page in {page:.2f} s and the run's data (`/api/summary`, read from the run "
        f"after `/api/runs`) in {view:.2f} s; target max(3 s, 1.2× `import torch`) = {view_target:.2f} s: "
        f"{'met' if view <= view_target else 'not met'}.",
        f"- `import cogattn` takes {imported:.2f} s; target `import torch, diffusers` + 1 s = {import_target:.2f} s: "
        f"{'met' if imported <= import_target else 'not met'}.",
        f"- `import cogattn` and `cogattn.load(run)` leave {model_code} diffusers transformer modules and {families} "
        "cogattn family modules imported (target: 0 and 0).",
    ]
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
