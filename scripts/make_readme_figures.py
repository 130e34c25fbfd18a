"""Regenerate every figure in docs/figures/ (the README's pictures) from one seeded generation.

    python scripts/make_readme_figures.py                                   # tiny random CogVideoX, CPU, seconds
    python scripts/make_readme_figures.py --model THUDM/CogVideoX-2b --out figures/2b   # the same from a checkpoint

The tiny default has random weights: its video is noise and its maps carry no meaning, but every
figure is made by the same code, from the same kinds of records, as with a real model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import cogattn  # noqa: E402
from cogattn import plot  # noqa: E402
from cogattn.analysis.masks import same_frame_mask  # noqa: E402

PNG_META = {"Software": None}  # no matplotlib version in the files: regenerating changes only what changed


def generate(model: str, prompt: str, seed: int):
    """One generation with the maps every figure needs: ``(recording, video (N, 3, H, W), pipeline, query)``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model == "tiny":
        from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

        pipe = tiny_pipeline()
        call = dict(num_frames=9, height=48, width=80, num_inference_steps=4, max_sequence_length=TINY_TEXT_LEN)
        steps, layers, heads = "all", "all", "all"
        # Every statistics kind (all small here). S = 53 tokens: the default block_size of 128 would make
        # one block; 8 makes 7, the 8 text tokens exactly block 0 and each 15-token latent frame 2 to 3
        # blocks, so the block map and a same-frame mask have some structure to show.
        stats = ("entropy", "received", "query_frame", "block", "topk", "offset", "top_p", "frame_max")
        block_size = 8
    else:
        from diffusers import CogVideoXPipeline

        pipe = CogVideoXPipeline.from_pretrained(model, torch_dtype=torch.bfloat16).to(device)
        pipe.vae.enable_tiling()
        v15 = pipe.transformer.config.patch_size_t is not None
        frames, height, width = (81, 768, 1360) if v15 else (49, 480, 720)
        call = dict(num_frames=frames, height=height, width=width, num_inference_steps=50)
        n = pipe.transformer.config.num_layers
        # Text maps are T × F × Hp × Wp per head: a few steps, layers and heads keep them to about a GB.
        steps, layers, heads = [0, 25, 49], [0, n // 2, n - 1], [0, 1, 2, 3]
        # The statistics the figures draw, S or ⌈S / 128⌉² floats per head: a few MB a record at most (the
        # head atlas then shows these 3 layers × 4 heads). Not topk or query_frame (S × k and S × G floats
        # per head), which no figure here needs; top_p and frame_max are S × 4 and S × 2G floats per head.
        stats, block_size = ("entropy", "received", "block", "offset", "top_p", "frame_max"), 128
    config = pipe.transformer.config
    layout = cogattn.TokenLayout.for_video(
        call["num_frames"],
        call["height"],
        call["width"],
        text_len=config.max_text_seq_length,
        patch_size=config.patch_size,
        patch_size_t=config.patch_size_t,
    )
    query = tuple(g // 2 for g in layout.grid)  # the centre of the middle frame
    with cogattn.record(
        pipe,
        kinds=("frame", "video_to_text", "text_to_video", "query", *stats),
        steps=steps,
        layers=layers,
        batch="cond",
        heads=heads,
        queries=[query],
        block_size=block_size,
        info={"prompt": prompt, "seed": seed},
    ) as rec:
        video = pipe(
            prompt=prompt, generator=torch.Generator(device).manual_seed(seed), output_type="pt", **call
        ).frames[0]
    return rec, video.float().cpu(), pipe, query


def small_png(path: Path) -> None:
    """Rewrite a PNG with a 256-colour palette: a third of the bytes, no visible change at this size."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (default), a hub id, or a local folder")
    ap.add_argument("--prompt", default="a red fox running in the snow")
    ap.add_argument("--words", default="fox,snow", help="comma list of prompt words to map")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rec, video, pipe, query = generate(args.model, args.prompt, args.seed)
    words = args.words.split(",")
    last = max(s for kind, s, _ in rec.keys() if kind == "frame")
    recorded = sorted({layer for kind, s, layer in rec.keys() if kind == "frame_max" and s == last})
    mid = recorded[len(recorded) // 2]  # a track is one map: one step, layer and head
    figures = {
        "frame_heatmap.png": plot.frame_heatmap(rec),
        "frame_heads.png": plot.frame_heatmap(rec, heads="all", steps=last, scale="log"),
        "layer_step_grid.png": plot.layer_step_grid(rec, "frame"),
        "video_to_text.png": plot.word_heatmap(rec, words, video, tokenizer=pipe.tokenizer),
        "text_to_video.png": plot.word_heatmap(
            rec, words, video, kind="text_to_video", tokenizer=pipe.tokenizer, scale="log", limits="per-map"
        ),
        "query_map.png": plot.query_map(rec, query, video, tokenizer=pipe.tokenizer, scale="log"),
        "head_atlas.png": plot.head_atlas(rec),
        "decay_curves.png": plot.decay_curves(rec),
        "token_stat.png": plot.token_stat(rec, "received", video, tokenizer=pipe.tokenizer),
        "block_map.png": plot.block_map(rec, same_frame_mask(rec.layout, rec.block_size)),
        "offset_map.png": plot.offset_map(rec),
        "distance_decay.png": plot.distance_decay(rec, by="layer"),
        "density_curves.png": plot.density_curves(rec, by="layer"),
        "track.png": plot.track_figure(rec, query, video, step=last, layer=mid, head=0),
        "motion.png": plot.motion_figure(rec, 0, 1, video, step=last, layer=mid, head=0),
    }
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=args.dpi, metadata=PNG_META)
        small_png(out / name)
    plot.animate(
        plot.word_heatmap,
        rec,
        out / "video_to_text_steps.gif",
        over="step",
        dpi=args.dpi * 4 // 5,
        tokens=words[0],
        video=video,
        tokenizer=pipe.tokenizer,
    )
    for path in sorted(out.iterdir()):
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}  {path.stat().st_size / 1024:.0f} KB")
    print(f"{len(figures) + 1} figures in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
