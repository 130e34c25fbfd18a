"""``scripts/dump_maps.py``: generate a video with a CogVideoX pipeline and save its attention maps.

With no arguments it runs the embedded tiny random pipeline (no download) and writes
``runs/tiny/maps.safetensors``; ``--model`` takes a hub id or a local folder of a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from . import KINDS, __version__
from .recording import record

__all__ = ["main", "load_pipeline"]

TINY = "tiny"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pipeline(model: str, task: str = "text-to-video", dtype: torch.dtype = torch.bfloat16):
    """A CogVideoX pipeline from a hub id or a local folder, or the tiny random one for ``model="tiny"``."""
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

    if model == TINY:
        from .testing import tiny_pipeline

        return tiny_pipeline(task, dtype=dtype)
    cls = CogVideoXImageToVideoPipeline if task == "image-to-video" else CogVideoXPipeline
    return cls.from_pretrained(model, torch_dtype=dtype)


def _parse(argv):
    ap = argparse.ArgumentParser(prog="dump_maps", description=__doc__)
    ap.add_argument("--model", default=TINY, help="hub id, local folder, or 'tiny' (default)")
    ap.add_argument("--prompt", default="a red fox running in the snow")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: 4 tiny, 50 real)")
    ap.add_argument("--frames", type=int, default=None, help="pixel frames (default: 9 tiny, 49 real)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--guidance", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=list(_DTYPES), default=None, help="default: float32 tiny, bfloat16 real")
    ap.add_argument("--kinds", default="frame,video_to_text,text_to_video", help=f"comma list of {list(KINDS)}")
    ap.add_argument("--layers", default="all", help="'all' or comma list of block indices")
    ap.add_argument("--batch", default="cond", help="all, cond, uncond, or comma list")
    ap.add_argument("--heads", default="mean", help="all, mean, or comma list")
    ap.add_argument("--memory-budget", default="1GiB")
    ap.add_argument("--out", default=None, help="output folder (default: runs/<model name>)")
    return ap.parse_args(argv)


def _indices(text: str):
    return text if not text[:1].isdigit() else [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tiny = args.model == TINY
    dtype = _DTYPES[args.dtype or ("float32" if tiny else "bfloat16")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join("runs", os.path.basename(args.model.rstrip("/")) or "model")
    if os.path.isdir(out) and os.listdir(out):
        print(f"dump_maps: output folder {out!r} is not empty; choose another --out.", file=sys.stderr)
        return 2
    pipe = load_pipeline(args.model, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=False)
    call = dict(
        prompt=args.prompt, num_inference_steps=args.steps or (4 if tiny else 50), guidance_scale=args.guidance,
        num_frames=args.frames or (9 if tiny else 49), generator=torch.Generator(device).manual_seed(args.seed),
        output_type="pt",
    )  # fmt: skip
    call.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v})
    if tiny:
        from .testing import TINY_TEXT_LEN

        call["max_sequence_length"] = TINY_TEXT_LEN
    t0 = time.perf_counter()
    with record(pipe, kinds=args.kinds.split(","), layers=_indices(args.layers), batch=_indices(args.batch),
                heads=_indices(args.heads), memory_budget=args.memory_budget) as rec:  # fmt: skip
        frames = pipe(**call).frames
    elapsed = time.perf_counter() - t0

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {f"{kind}/step{step}/layer{layer}": rec.get(kind, step, layer) for kind, step, layer in rec.keys()}
    meta = {"cogattn": __version__, "model": args.model, "prompt": args.prompt, "seed": str(args.seed),
            "timesteps": json.dumps(rec.timesteps), "layout": json.dumps(rec.layout.__dict__)}  # fmt: skip
    path = os.path.join(out, "maps.safetensors")
    save_file(tensors, path, metadata=meta)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    print(f"video {tuple(frames.shape)} in {elapsed:.1f} s; latent grid (F, Hp, Wp) = {rec.layout.grid}, "
          f"{rec.layout.text_len} text tokens")  # fmt: skip
    print(f"{len(tensors)} records, {nbytes / 2**20:.2f} MiB -> {path}")
    for kind in rec.selection.kinds:
        step, layer = max(s for k, s, _ in rec.keys() if k == kind), 0
        print(f"  {kind:>14} step {step} layer {layer}: shape {tuple(rec.get(kind, step, layer).shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
