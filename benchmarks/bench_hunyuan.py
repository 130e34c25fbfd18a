"""One HunyuanVideo block at real shape: exact capture of 118,800 + 256 tokens, and of 180,000 + 256, in a
memory budget of 1 GiB, against the stock attention of the same heads; or (``--model 1.5``) one HunyuanVideo 1.5
block at its 720p shape, 121 frames at 720×1280: 31 × 45 × 80 = 111,600 video tokens + the packed context of 1,985.

Builds a ``HunyuanVideoTransformer3DModel`` of one dual-stream block from the released config (heads of
128, 3D RoPE (16, 56, 56), patch 2, random weights) with as many of its 24 heads as the time allows
(``--heads``; the cost is per head), and calls it on random latents: 129 frames at 720×1280 (33 latent
frames × 45 × 80 patches: S = 118,800 video tokens + 256 text tokens, of which ``--valid`` are kept by
the key mask, as a prompt shorter than 256 tokens leaves them), float32 on the CPU (or ``--device cuda``).
It times the stock attention module (projections, RoPE, masked SDPA, output projections) and, under
``cogattn.record`` with ``--kinds`` (``frame`` and ``video_to_text`` unless told), what capture adds (the
processor's ``capture`` call) and its peak extra memory (Linux ``VmHWM``, reset at each capture; on CUDA the
allocator's peak); the block's output must stay bit-identical. Each case runs ``--repeats`` times, stock then
captured under a new recording: the least times are kept, and the first capture is shown apart (it carries any
compilation of the Triton kernel at this shape). The second case, more frames
(``--frames-b``: 50 latent frames, S = 180,000 + 256; 0 leaves it out), measures the same.

HunyuanVideo 1.5 (``--model 1.5``; 16 heads of 128, patch 1, the released 480p/720p config) packs each item's
context as [valid image, valid glyph, valid prompt tokens, padding] and masks pairs ``keep ⊗ keep`` through an
S × S bool mask (12.9 GB at 720p, and SDPA turns it into float scores' size): a GPU case (text-to-video: the 729
image tokens are padding, no quoted words, ``--valid`` of the 1,000 prompt tokens kept).

    python benchmarks/bench_hunyuan.py                      # real shapes (about 10 minutes on 2 cores)
    python benchmarks/bench_hunyuan.py --kinds tile,top_p --frames-b 0 --out benchmarks/results/hunyuan_sparse_cpu.md
    python benchmarks/bench_hunyuan.py --frames 3 --frames-b 4 --height 6 --width 8   # quick look
    python benchmarks/bench_hunyuan.py --model 1.5 --device cuda --heads 16 --frames-b 0  # needs about 80 GB
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

import cogattn

MiB = 2**20
TEXT = 256  # LLaMA tokens of every HunyuanVideo call (padded)
IMAGE, GLYPH, PROMPT = 729, 256, 1000  # HunyuanVideo 1.5's context: SigLIP, ByT5 and Qwen2.5-VL tokens (padded)


def block(heads: int) -> HunyuanVideoTransformer3DModel:
    """hunyuanvideo-community/HunyuanVideo's transformer/config.json, one dual-stream block of ``heads``."""
    return HunyuanVideoTransformer3DModel(
        in_channels=16,
        out_channels=16,
        num_attention_heads=heads,
        attention_head_dim=128,
        num_layers=1,
        num_single_layers=0,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=4096,
        pooled_projection_dim=768,
        rope_axes_dim=(16, 56, 56),
    ).eval()


def block15(heads: int) -> HunyuanVideo15Transformer3DModel:
    """hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v's transformer config, one block of ``heads``."""
    return HunyuanVideo15Transformer3DModel(
        num_attention_heads=heads,
        attention_head_dim=128,
        num_layers=1,
        num_refiner_layers=2,
        patch_size=1,
        patch_size_t=1,
        rope_axes_dim=(16, 56, 56),
        task_type="t2v",
    ).eval()


def inputs(version: str, frames: int, height: int, width: int, valid: int, g: torch.Generator) -> tuple[dict, int]:
    """A transformer call of ``version`` ("1" or "1.5") on ``frames`` × ``height`` × ``width`` patches, and its
    context length."""
    if version == "1":
        return dict(
            hidden_states=torch.randn(1, 16, frames, 2 * height, 2 * width, generator=g),
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, TEXT, 4096, generator=g),
            encoder_attention_mask=(torch.arange(TEXT) < valid).long()[None],
            pooled_projections=torch.randn(1, 768, generator=g),
            guidance=torch.tensor([6000.0]),
            return_dict=False,
        ), TEXT
    return dict(
        hidden_states=torch.randn(1, 65, frames, height, width, generator=g),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, PROMPT, 3584, generator=g),
        encoder_attention_mask=(torch.arange(PROMPT) < valid).long()[None],
        encoder_hidden_states_2=torch.randn(1, GLYPH, 1472, generator=g),
        encoder_attention_mask_2=torch.zeros(1, GLYPH, dtype=torch.long),  # no quoted words
        image_embeds=torch.zeros(1, IMAGE, 1152),  # text-to-video: the image tokens are padding
        return_dict=False,
    ), IMAGE + GLYPH + PROMPT


def timed(module, times: list) -> None:
    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    module.register_forward_pre_hook(lambda m, a: times.append(-now()))
    module.register_forward_hook(lambda m, a, o: times.__setitem__(-1, times[-1] + now()))


def case(
    transformer, frames: int, height: int, width: int, valid: int, memory: PeakMemory, repeats: int = 1, **options
) -> dict:
    """Stock, then captured with ``options`` (``cogattn.record``'s), ``repeats`` times: the least times, the first
    capture's, and the peak and plan of a call on ``frames`` × ``height`` × ``width`` patches."""
    version = "1.5" if isinstance(transformer, HunyuanVideo15Transformer3DModel) else "1"
    call, text = inputs(version, frames, height, width, valid, torch.Generator().manual_seed(0))
    device, dtype = transformer.device, transformer.dtype
    call = {
        name: value.to(device, dtype if value.is_floating_point() else value.dtype) if torch.is_tensor(value) else value
        for name, value in call.items()
    }
    times: list = []
    timed(transformer.transformer_blocks[0].attn, times)
    stock, captures, peak, identical = [], [], 0, True
    for _ in range(repeats):
        with torch.no_grad():
            reference = transformer(**call)[0]
        stock.append(times[-1])
        print(f"S = {frames * height * width:,} + {text}: stock attention {stock[-1]:.1f} s", flush=True)
        rec = cogattn.record(transformer, batch=[0], **options)
        spent = [0.0, 0]
        rec.capture = memory.measured(rec.capture, spent)
        with rec, torch.no_grad():
            out = transformer(**call)[0]
        captures.append(spent[0])
        peak, identical = max(peak, spent[1]), identical and torch.equal(out, reference)
        print(f"  capture {spent[0]:.1f} s ({spent[0] / stock[-1]:.2f}×), peak +{spent[1] / MiB:.0f} MiB", flush=True)
    transformer.transformer_blocks[0].attn._forward_hooks.clear()
    transformer.transformer_blocks[0].attn._forward_pre_hooks.clear()
    full = (frames * height * width + text) ** 2 * transformer.config.num_attention_heads * 4
    return dict(
        S=frames * height * width + text,
        grid=(frames, height, width),
        stock=min(stock),
        capture=min(captures),
        first=captures[0],
        peak=peak,
        planned=rec.plan.peak_extra_memory,
        results=rec.plan.result_bytes,
        method="/".join(sorted(set(rec.chosen_methods.values()))) or rec.plan.tiles.method,
        identical=identical,
        full=full,
        checks=all(c.passed for c in rec.checks) if rec.checks else None,  # row tiles are not spot-checked
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1", choices=["1", "1.5"], help="HunyuanVideo (1) or HunyuanVideo 1.5")
    ap.add_argument("--frames", type=int, default=None, help="latent frames of the first case (1: 33, 1.5: 31)")
    ap.add_argument("--frames-b", type=int, default=50, help="latent frames of the second case (197 video frames)")
    ap.add_argument("--height", type=int, default=45, help="patch rows (720 px)")
    ap.add_argument("--width", type=int, default=80, help="patch columns (1280 px)")
    ap.add_argument("--heads", type=int, default=2, help="heads of 128 in the first case (1 has 24, 1.5 has 16)")
    ap.add_argument("--heads-b", type=int, default=1, help="heads of 128 in the second case")
    ap.add_argument("--valid", type=int, default=200, help="prompt tokens the key mask keeps (of 256; 1.5: of 1,000)")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--kinds", default="frame,video_to_text", help="comma-separated kinds to record")
    ap.add_argument("--tile-shape", default="1,8,8", help="tile_shape of the tile kind: t,h,w")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (peaks from the allocator)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the block's dtype")
    ap.add_argument("--repeats", type=int, default=1, help="calls per case (the least times kept, the first apart)")
    ap.add_argument("--out", default=None, help="defaults to benchmarks/results/hunyuan[15]_cpu.md (_cuda.md)")
    args = ap.parse_args()

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    where = "cuda" if device.type == "cuda" else "cpu"
    name = "hunyuan15" if args.model == "1.5" else "hunyuan"
    args.out = args.out or f"benchmarks/results/{name}_{where}.md"
    args.frames = args.frames or (31 if args.model == "1.5" else 33)
    build = block15 if args.model == "1.5" else block
    memory = PeakMemory(where)
    kinds = tuple(args.kinds.split(","))
    options = dict(kinds=kinds, memory_budget=args.budget)
    if "tile" in kinds:
        options["tile_shape"] = tuple(int(n) for n in args.tile_shape.split(","))
    budget = cogattn.CaptureOptions(**options).memory_budget
    repeated = dict(options, repeats=args.repeats)
    with torch.no_grad():  # warm up kernels on a small call
        case(build(1).to(device, dtype), 1, 2, 2, 4, memory, **options)
    results = [
        (heads, case(build(heads).to(device, dtype), frames, args.height, args.width, args.valid, memory, **repeated))
        for heads, frames in ((args.heads, args.frames), (args.heads_b, args.frames_b))
        if heads and frames
    ]
    tiles = f" (tile_shape = {options['tile_shape']})" if "tile" in kinds else ""
    if device.type == "cuda":
        machine = f"CUDA ({torch.cuda.get_device_name(device)}, TF32 off)"
    else:
        machine = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    if args.model == "1.5":
        what = "HunyuanVideo 1.5 dual-stream block (heads of 128, patch 1"
        text = (
            f"text-to-video: of the packed context's {IMAGE + GLYPH + PROMPT:,} tokens the S × S mask keeps "
            f"{args.valid} prompt tokens (the {IMAGE} image and {GLYPH} glyph tokens are padding)."
        )
    else:
        what = "HunyuanVideo dual-stream block (heads of 128, patch 2"
        text = f"{args.valid} of the 256 text tokens kept by the key mask."
    lines = [
        f"One {what}, 3D RoPE (16, 56, 56), random weights), {args.dtype}, {machine}, "
        f"torch {torch.__version__}; kinds {' + '.join(f'`{k}`' for k in kinds)}"
        f"{tiles}, "
        f"memory_budget = {args.budget} ({budget:,} bytes), heads = mean; {text}",
        "",
        "Stock: the block's attention module (projections, RoPE, the masked SDPA, output projections). Capture: "
        "what cogattn adds in the processor, measured in the same run, and its peak extra memory (VmHWM above the "
        "resident size at the capture's start; on CUDA the allocator's peak), of which the layer's float32 results "
        "are the part the budget leaves out (it bounds the tiles). `method`: what served the pooled kinds (under "
        "`auto`, the pass the first capture measured faster). `identical`: the block's output with capture on "
        f"equals the stock output bit for bit. Times: the least of {args.repeats} call(s), each captured under a "
        "new recording (so each pays what a recording does at its first capture, such as its spot check); first "
        "call: the first capture, which alone carries any compilation of the Triton kernel at this shape.",
        "",
        "| S (video + text) | latent grid | heads | stock attention (s) | capture (s) | × stock | first call (s) | "
        "method | peak extra memory (MiB) | of it results (MiB) | planned peak (MiB) | tiles within the budget | "
        "full P of these heads (GiB) | spot check | identical |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | --- |",
    ]
    for heads, r in results:
        check = {True: "passed", False: "NO", None: "— (rows)"}[r["checks"]]
        lines.append(
            f"| {r['S']:,} | {'×'.join(map(str, r['grid']))} | {heads} | {r['stock']:.1f} | {r['capture']:.1f} | "
            f"{r['capture'] / r['stock']:.2f} | {r['first']:.1f} | {r['method']} | {r['peak'] / MiB:.0f} | "
            f"{r['results'] / MiB:.0f} | "
            f"{r['planned'] / MiB:.0f} | {'yes' if r['peak'] - r['results'] <= budget else 'NO'} | {r['full'] / 2**30:.0f} | {check} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    write_table(lines, args.out)


if __name__ == "__main__":
    main()
