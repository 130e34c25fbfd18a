"""``scripts/dump_maps.py``: attention maps for many prompts, resumable, sharded over processes.

    python scripts/dump_maps.py                                  # configs/tiny.yaml: the tiny random pipeline
    python scripts/dump_maps.py configs/cogvideox-5b.yaml --set steps=20 --set out=runs/5b
    python scripts/dump_maps.py configs/cogvideox-5b.yaml --dry-run   # the plan, without loading weights
    accelerate launch scripts/dump_maps.py configs/cogvideox-5b.yaml  # prompts split over GPUs

Each prompt gets ``<out>/<index>-<hash>/`` with ``maps/`` (a run: ``cogattn.load`` reads it), the video,
``previews/*.png`` and ``prompt.json``, written last; a rerun skips prompts whose ``prompt.json`` says
complete and redoes the others. A prompt that fails does not stop the rest; failures are listed at the
end and the exit code is 1. Bad input exits with code 2 before anything is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from .config import ConfigError, DumpConfig, Prompt, load_config, read_prompts
from .estimate import estimate

__all__ = ["main", "load_pipeline", "DEFAULT_CONFIG"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pipeline(cfg: DumpConfig, device: str):
    """The pipeline of ``cfg``: from the hub or a folder (weights in ``cfg.dtype``), or the tiny random one."""
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

    dtype = _DTYPES[cfg.dtype]
    if cfg.model == "tiny":
        from .testing import tiny_pipeline

        pipe = tiny_pipeline(cfg.task, cfg.tiny_version, dtype=dtype)
    else:
        cls = CogVideoXImageToVideoPipeline if cfg.task == "image-to-video" else CogVideoXPipeline
        pipe = cls.from_pretrained(cfg.model, torch_dtype=dtype)
    if cfg.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif cfg.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)
    if cfg.vae_tiling:
        pipe.vae.enable_tiling()
    pipe.set_progress_bar_config(leave=False, desc="steps", disable=None)  # no bar when not a terminal
    return pipe


def _parse(argv):
    ap = argparse.ArgumentParser(prog="dump_maps", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (value parsed as YAML); repeatable")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading weights")
    return ap.parse_args(argv)


def _validate(cfg: DumpConfig, prompts: list[Prompt]):
    """Every check that needs no weights: the selection against the model config and the call, the
    output folder, the free disk space, the video writer."""
    if cfg.offload != "none" and cfg.device == "cpu":
        raise ConfigError(f"offload: {cfg.offload!r} needs a GPU device, but device is 'cpu'.")
    if cfg.video_format == "mp4" and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ConfigError("video_format: 'mp4' needs imageio-ffmpeg (pip install 'cogattn[video]'); or use 'gif'.")
    out = Path(cfg.out)
    key = cfg.output_key()
    for folder in (out / p.key() for p in prompts):
        meta = _prompt_meta(folder)
        if meta.get("complete") and meta.get("config_key") != key:
            raise ConfigError(
                f"{str(folder)!r} was made with other settings (config key {meta.get('config_key')} ≠ {key}); "
                "write to another out, or delete it to redo it."
            )
    plan = estimate(
        cfg.model, num_frames=cfg.num_frames, height=cfg.height, width=cfg.width, num_inference_steps=cfg.steps,
        guidance_scale=cfg.guidance, text_len=cfg.max_sequence_length, num_prompts=len(prompts), dtype=cfg.dtype,
        device="cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu", **cfg.capture_options(),
    )  # fmt: skip
    todo = sum(1 for p in prompts if not _prompt_meta(out / p.key()).get("complete"))
    need = plan.record_bytes * todo // max(1, len(prompts))
    existing = next(p for p in [out, *out.absolute().parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if need > free:
        raise ConfigError(f"the remaining prompts will write {need:,} bytes of maps but {str(existing)!r} has "
                          f"{free:,} bytes free; select less, use storage_dtype float16, or write elsewhere.")  # fmt: skip
    return plan


def _prompt_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "prompt.json").read_text())
    except (OSError, ValueError):
        return {}


def _complete(folder: Path) -> bool:
    return _prompt_meta(folder).get("complete") is True


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _save_video(frames, path_stem: Path, cfg: DumpConfig) -> Path:
    from diffusers.utils import export_to_gif, export_to_video

    fmt = cfg.video_format
    if fmt == "auto":
        try:
            import imageio_ffmpeg  # noqa: F401

            fmt = "mp4"
        except ImportError:
            fmt = "gif"
    path = path_stem.with_suffix("." + fmt)
    if fmt == "mp4":
        export_to_video(frames, str(path), fps=cfg.fps)
    else:
        export_to_gif(frames, str(path), fps=cfg.fps)
    return path


def run_prompt(pipe, cfg: DumpConfig, prompt: Prompt, folder: Path, process: int) -> None:
    """Generate one video with capture into ``folder`` (a fresh or incomplete one is (re)made)."""
    from .recording import record

    if folder.exists():
        shutil.rmtree(folder)  # an incomplete earlier attempt
    folder.mkdir(parents=True)
    seed = cfg.seed if prompt.seed is None else prompt.seed
    meta = {"complete": False, "config_key": cfg.output_key(), "index": prompt.index, "prompt": prompt.prompt, "negative_prompt": prompt.negative_prompt,
            "seed": seed, "image": prompt.image, "model": cfg.model, "process": process, "config": cfg.to_dict()}  # fmt: skip
    _write_json(folder / "prompt.json", meta)
    device = pipe._execution_device
    call = dict(prompt=prompt.prompt, negative_prompt=prompt.negative_prompt, num_frames=cfg.num_frames,
                height=cfg.height, width=cfg.width, num_inference_steps=cfg.steps, guidance_scale=cfg.guidance,
                max_sequence_length=cfg.max_sequence_length, output_type="pil",
                generator=torch.Generator(device).manual_seed(seed))  # fmt: skip
    if cfg.task == "image-to-video":
        from diffusers.utils import load_image

        call["image"] = load_image(prompt.image_path)
    t0 = time.perf_counter()
    info = {k: meta[k] for k in ("index", "prompt", "negative_prompt", "seed", "image", "model")}
    with record(pipe, **cfg.capture_options(), out=folder / "maps", info=info):
        frames = pipe(**call).frames[0]
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    meta["video"] = _save_video(frames, folder / "video", cfg).name
    if cfg.previews:
        from .previews import write_previews

        written = write_previews(folder / "maps", folder / "previews", frames, pipe.tokenizer, prompt.prompt)
        meta["previews"] = [p.name for p in written]
    meta["complete"] = True
    _write_json(folder / "prompt.json", meta)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
        prompts = read_prompts(cfg)
        plan = _validate(cfg, prompts)
    except (ConfigError, ValueError, TypeError) as err:
        print(f"dump_maps: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"model {cfg.model} ({cfg.task}), {len(prompts)} prompts, {cfg.steps} steps, "
              f"{cfg.num_frames} frames at {cfg.height}×{cfg.width}")  # fmt: skip
        print(plan.table())
        return 0

    from accelerate import PartialState
    from tqdm.auto import tqdm

    # On a machine without GPUs (or device: cpu) the processes of `accelerate launch` share prompts over gloo.
    state = PartialState(cpu=cfg.device == "cpu" or not torch.cuda.is_available())
    device = str(state.device) if cfg.device == "auto" else cfg.device
    out = Path(cfg.out)
    with state.split_between_processes(prompts) as mine:
        todo = [p for p in mine if not _complete(out / p.key())]
        skipped = len(mine) - len(todo)
        if skipped:
            print(f"[process {state.process_index}] {skipped} prompts already complete, skipped", flush=True)
        failures = []
        if todo:
            pipe = load_pipeline(cfg, device)
            bar = tqdm(todo, desc=f"prompts [process {state.process_index}]", position=0, disable=None)
            for prompt in bar:
                try:
                    run_prompt(pipe, cfg, prompt, out / prompt.key(), state.process_index)
                except Exception as err:  # noqa: BLE001 - one prompt's failure must not stop the others
                    failures.append((prompt, err))
                    print(f"prompt {prompt.index} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                    if os.environ.get("COGATTN_DEBUG"):
                        traceback.print_exc()
    done = len(todo) - len(failures)
    print(f"[process {state.process_index}] {done} prompts written, {skipped} skipped, {len(failures)} failed "
          f"-> {out}", flush=True)  # fmt: skip
    for prompt, err in failures:
        print(f"  failed: prompt {prompt.index} ({prompt.prompt[:40]!r}): {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
