"""``cogattn-dump``: attention maps for many prompts, resumable, sharded over processes.

    cogattn-dump                                         # the shipped tiny.yaml: the tiny random pipeline
    cogattn-dump configs/cogvideox-5b.yaml --set num_inference_steps=20 --set save_dir=runs/5b
    cogattn-dump configs/cogvideox-5b.yaml --set capture.steps=[0,5] --dry-run   # the plan, no weights loaded
    cogattn-dump configs/tiny-wan.yaml                   # the tiny random Wan pipeline (configs/wan*.yaml: Wan)
    cogattn-dump configs/tiny-hunyuan-video.yaml         # the tiny random HunyuanVideo (configs/hunyuan-video.yaml)
    accelerate launch -m cogattn.dump configs/cogvideox-5b.yaml                  # prompts split over GPUs

Also ``python scripts/dump_maps.py`` from a checkout and ``python -m cogattn.dump``. Each prompt gets
``<save_dir>/<index>-<hash>/`` with ``maps/`` (a run: ``cogattn.load`` reads it), the video,
``previews/*.png`` and ``prompt.json``, written last; a rerun skips prompts whose ``prompt.json`` says
complete and redoes the others. A prompt that fails does not stop the rest; failures are listed at the
end and the exit code is 1. The last line says how to look at the maps (``cogattn view <save_dir>``); under
``accelerate launch`` each process's lines start with ``[process N]``. Bad input exits with code 2 and one line
on stderr before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import shutil
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from ..costs import Estimate, estimate
from ..runs.store import disk_bytes
from .config import ConfigError, DumpConfig, default_config, load_config
from .generate import NotPrepared, is_complete, load_pipeline, prompt_meta, run_prompt
from .parallel import check_parallel, meshes
from .prompts import Prompt, read_prompts

__all__ = ["disk_need", "main", "plan"]

PROG = "dump_maps"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=None, help="YAML config (default: the shipped tiny.yaml)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, capture.KEY for a capture option (value parsed as YAML); repeatable",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading weights")
    return ap.parse_args(argv)


def plan(cfg: DumpConfig, prompts: list[Prompt]) -> Estimate:
    """Every check that needs no weights, and the estimate of the whole run.

    Checks the device and video writer, that complete prompt folders under ``save_dir`` were made with
    these settings, the capture options against the model and the call (by ``cogattn.estimate``, from
    ``cfg.capture``: the options a run records with). The disk the maps take is `disk_need`'s, which a run
    checks against the free space before it loads anything and a dry run reports.

    Returns:
        `Estimate`: records, bytes and peak extra memory over all prompts; raises `ConfigError` or the
        `ValueError` of ``cogattn.estimate``.
    """
    if cfg.offload != "none" and cfg.device == "cpu":
        raise ConfigError(f"offload: {cfg.offload!r} needs a GPU device, but device is 'cpu'; set offload: none.")
    if cfg.device.startswith("cuda"):
        index = int(cfg.device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            have = f"{torch.cuda.device_count()} CUDA devices" if torch.cuda.is_available() else "no CUDA device"
            raise ConfigError(f"device: {cfg.device!r}, but this machine has {have}; use device: auto or cpu.")
    out = Path(cfg.save_dir).expanduser()
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"save_dir: {str(existing)!r} is a file, not a folder.")
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"save_dir: {str(existing)!r} is not writable; choose another save_dir.")
    if cfg.video_format == "mp4" and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ConfigError("video_format: 'mp4' needs imageio-ffmpeg (pip install 'cogattn[video]'); or use 'gif'.")
    key = cfg.output_key()
    for folder in (out / p.key() for p in prompts):
        meta = prompt_meta(folder)
        if meta.get("complete") and meta.get("config_key") not in (key, cfg.output_key(legacy=True)):
            raise ConfigError(
                f"{str(folder)!r} was made with other settings (config key {meta.get('config_key')} ≠ {key}); "
                "write to another save_dir, or delete it to redo it."
            )
    check_parallel(cfg)
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    model = SimpleNamespace(config=cfg.model_config())  # as a transformer: the config the checks read
    call = cfg.call_arguments()
    text_len = call.pop("max_sequence_length")
    call.pop("guidance_scale_2", None)  # guidance (the batch) is the family's guidance_argument's alone
    return estimate(
        model, cfg.capture, **call, text_len=text_len, num_prompts=len(prompts), dtype=cfg.dtype, device=device,
        parallel=cfg.parallel,
    )  # fmt: skip


def disk_need(cfg: DumpConfig, prompts: list[Prompt], result: Estimate) -> tuple[int, int, Path]:
    """The disk the prompts not yet complete will take for their maps, and what is free where they go.

    Returns:
        `tuple[int, int, Path]`: bytes needed (whole filesystem blocks, as a recording counts them), bytes
        free, and the nearest existing folder of ``save_dir``, whose filesystem was asked.
    """
    out = Path(cfg.save_dir).expanduser()
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    todo = sum(1 for p in prompts if not is_complete(out / p.key()))
    per_prompt = [(b, n // max(1, len(prompts))) for _, _, b, n in result.records]
    return disk_bytes(existing, per_prompt) * todo, shutil.disk_usage(existing).free, existing


def _disk_line(need: int, free: int, existing: Path) -> str:
    return (
        f"the remaining prompts will take {need:,} bytes of disk for their maps but {str(existing)!r} has "
        f"{free:,} bytes free; select less, use capture.storage_dtype float16, or write elsewhere."
    )


def _run(cfg: DumpConfig, prompts: list[Prompt]) -> int:
    """Generate the prompts not yet complete (this process's share under ``accelerate launch``)."""
    from accelerate import PartialState
    from tqdm.auto import tqdm

    # On a machine without GPUs (or device: cpu) the processes of `accelerate launch` share prompts over gloo.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = str(state.device) if cfg.device == "auto" else cfg.device
    out = Path(cfg.save_dir)
    failures = []
    process = f"[process {state.process_index}] " if state.num_processes > 1 else ""  # whose line, where several
    mesh = None if cfg.parallel is None else meshes(cfg, state.num_processes, state.process_index, device)
    with state.split_between_processes(prompts) if mesh is None else _whole(mesh.share(prompts)) as mine:
        todo = [p for p in mine if not is_complete(out / p.key())]
        todo = todo if mesh is None else mesh.agree(todo)  # one order for a mesh: its first process's
        skipped = len(mine) - len(todo)
        if skipped:
            print(f"{process}{skipped} prompts already complete, skipped", flush=True)
        finished_elsewhere, done = 0, 0  # by another process (finished, or being written) while this one worked
        if todo:
            try:
                pipe = load_pipeline(cfg, device)
            except OSError as err:  # not in the cache with the Hub out of reach, a folder without its files
                raise LoadError(f"could not load {cfg.model}: {' '.join(str(err).split())[:300]}") from None
            if mesh is not None:
                mesh.enable(pipe, cfg.spec().experts)
            for prompt in tqdm(todo, desc=f"{process}prompts", position=0, disable=None):
                try:
                    writes, agree = (True, None) if mesh is None else (mesh.writer, mesh.agree)  # its first writes
                    folder = out / prompt.key()
                    written = run_prompt(pipe, cfg, prompt, folder, state.process_index, writes, mesh is None, agree)
                    done, finished_elsewhere = done + bool(written), finished_elsewhere + (not written)
                    if written is None:
                        print(f"{process}prompt {prompt.index} is being written by another process; left to it")
                except Exception as err:  # one prompt's failure must not stop the others
                    failures.append((prompt, err))
                    print(
                        f"{process}prompt {prompt.index} failed: {type(err).__name__}: {err}",
                        file=sys.stderr,
                        flush=True,
                    )
                    if os.environ.get("COGATTN_DEBUG"):
                        traceback.print_exc()
                    if mesh is not None and not isinstance(err, NotPrepared):  # failed while generating together
                        print(
                            f"{process}stopping: after a failure inside a generation the mesh's processes would no "
                            "longer run the same prompt (run the command again to resume)",
                            file=sys.stderr,
                            flush=True,
                        )
                        break
    skipped += finished_elsewhere
    print(f"{process}{done} prompts written, {skipped} skipped, {len(failures)} failed -> {out}", flush=True)
    for prompt, err in failures:
        print(
            f"{process}  failed: prompt {prompt.index} ({prompt.prompt[:40]!r}): {type(err).__name__}: {err}",
            file=sys.stderr,
        )
    if state.is_main_process and any(is_complete(out / p.key()) for p in prompts):  # the last line: where to look
        print(f"see the maps in the browser: cogattn view {shlex.quote(str(out))}", flush=True)
    return 1 if failures else 0


class LoadError(RuntimeError):
    """The pipeline could not be loaded (a checkpoint not in the cache, the Hub out of reach): one line, exit 1."""


@contextlib.contextmanager
def _whole(prompts: list):
    """The prompts of a mesh, every one for each of its processes (``split_between_processes``' shape)."""
    yield prompts


def main(argv: list[str] | None = None) -> int:
    """Run the tool with command-line arguments ``argv`` (``sys.argv[1:]`` when `None`).

    Returns:
        `int`: the exit code: 0 done, 1 some prompts failed or the pipeline could not be loaded (one line), 2 bad
        input (one line on stderr, nothing written).
    """
    args = _parse(argv)
    try:
        config = Path(args.config) if args.config else default_config()
        cfg = load_config(config, args.overrides)
        prompts = read_prompts(cfg)
        result = plan(cfg, prompts)
        need, free, existing = disk_need(cfg, prompts, result)
        if need > free and not args.dry_run:  # a dry run plans for another machine as well: it reports
            raise ConfigError(_disk_line(need, free, existing))
        if not args.dry_run and cfg.tiny_spec() is None and (refusal := cfg.spec().refusal(cfg.model_config())):
            raise ConfigError(refusal)
        if not args.dry_run and cfg.offload != "none" and cfg.device == "auto" and not torch.cuda.is_available():
            raise ConfigError(f"offload: {cfg.offload!r} needs a GPU, but device 'auto' finds none; set offload: none.")
    except (ConfigError, ValueError, TypeError) as err:
        print(f"{PROG}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted before anything was written.", file=sys.stderr)
        return 130
    if args.dry_run:
        print(f"config {config}")
        print(
            f"model {cfg.model} ({cfg.task}), {len(prompts)} prompts, {cfg.num_inference_steps} steps, "
            f"{cfg.num_frames} frames at {cfg.height}×{cfg.width} -> {cfg.save_dir}"
        )
        print(result.table())
        if need > free:
            print(f"a run here would be refused: {_disk_line(need, free, existing)}")
        return 0
    try:
        return _run(cfg, prompts)
    except ConfigError as err:  # found once the pipeline is loaded (guidance_scale_2 with one expert)
        print(f"{PROG}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except LoadError as err:
        print(
            f"{PROG}: {err}. Without a network, download the checkpoint where there is one and set model: to its "
            "folder (or keep it in the Hugging Face cache: HF_HUB_OFFLINE=1 reads the cache alone).",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        out = Path(cfg.save_dir)
        done = sum(1 for p in prompts if is_complete(out / p.key()))
        print(
            f"\n{PROG}: interrupted; {done} of {len(prompts)} prompts are complete in {str(out)!r} and kept; "
            "run the same command again to resume (complete prompts are skipped).",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
