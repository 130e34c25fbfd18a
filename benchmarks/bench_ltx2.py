"""One LTX-2 (19B) block under IC-LoRA's attention bias: exact capture of the video self-attention of the pipelines'
default shape (121 frames at 512×768: 16 latent frames × 16 × 24 latent pixels, 6,144 grid tokens) with one reference
latent frame appended after the grid (384 tokens: S = 6,528) under ``video_self_attention_mask``, against the stock
attention modules of the same block, on the CPU.

Builds an ``LTX2VideoTransformer3DModel`` of one block from the released Lightricks/LTX-2 config (video 32 heads × 128,
audio 32 heads × 64, patch size 1, random weights; ``--heads`` fewer video heads: the cost is per head) and calls it
directly, float32 on the CPU, on random packed latents: the grid, then ``--refs`` reference latent frames of the grid's
size with RoPE coordinates of their own (as ``LTX2InContextPipeline`` appends them), 126 audio bins, and ``--text``
text tokens for each stream. ``video_self_attention_mask`` holds strength ``--strength`` between the reference and
the generated tokens (1 elsewhere): the transformer adds −10000·(1 − strength) to those scores, made per head by
``prepare_attention_mask``, so the stock call holds a float (B, H, S, S) mask.

It times the stock video self-attention module (``attn1``: the per-head mask, projections, RMS norms, RoPE, SDPA
under the mask, output projection) and the video's text cross-attention (``attn2``), then, under ``cogattn.record``
with ``entropy``, ``received`` (every video token, the references first) and ``video_to_text``, what capture adds
inside the processors (``capture``, which takes the bias as a ``QueryKeyBias`` and adds its rows in row tiles, and
``capture_context``) and its peak extra memory (Linux ``VmHWM``, reset at each capture), once per budget of
``--budgets``; the block's output must stay bit-identical. The planned peak is the mask-aware tile plan the capture
used (``passes.mask_cost`` counted), next to the plan made without the mask (``rec.plan.tiles``). Then the recorded
``entropy`` and ``received`` are checked against the float64 softmax(q·kᵀ/√D + bias) of every row, from the module's
own q and k and the bias made here from the strengths.

    python benchmarks/bench_ltx2.py                                  # the default shape (about 40 s on 2 cores)
    python benchmarks/bench_ltx2.py --heads 32 --out /tmp/ltx2_32.md # every video head (about 4.5 minutes)
    python benchmarks/bench_ltx2.py --frames 3 --height 8 --width 12 --out /tmp/ltx2_quick.md   # quick look
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from diffusers import LTX2VideoTransformer3DModel
from peak_memory import PeakMemory  # first: it re-executes the script with mmapped large allocations
from report import write_table

import cogattn
from cogattn.models.ltx2 import KNOWN

MiB = 2**20
RELEASED = KNOWN["Lightricks/LTX-2"]  # the released attention shapes (cogattn.models.ltx2)
FPS = 24.0


def block(heads: int) -> LTX2VideoTransformer3DModel:
    """Lightricks/LTX-2's transformer config, one block, ``heads`` video heads of 128 (the audio stream's 32 × 64)."""
    dim = RELEASED["attention_head_dim"]
    return LTX2VideoTransformer3DModel(
        in_channels=RELEASED["in_channels"],
        out_channels=RELEASED["in_channels"],
        patch_size=RELEASED["patch_size"],
        patch_size_t=RELEASED["patch_size_t"],
        num_attention_heads=heads,
        attention_head_dim=dim,
        cross_attention_dim=heads * dim,  # 4,096 = 32 × 128 released
        audio_num_attention_heads=RELEASED["audio_num_attention_heads"],
        audio_attention_head_dim=RELEASED["audio_attention_head_dim"],
        vae_scale_factors=tuple(RELEASED["vae_scale_factors"]),
        num_layers=1,
    ).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=16, help="latent frames (121 video frames)")
    ap.add_argument("--height", type=int, default=16, help="latent rows (512 px)")
    ap.add_argument("--width", type=int, default=24, help="latent columns (768 px)")
    ap.add_argument("--refs", type=int, default=1, help="reference latent frames after the grid (height × width each)")
    ap.add_argument("--strength", type=float, default=0.9998, help="between references and generated tokens")
    ap.add_argument("--heads", type=int, default=4, help="video heads of 128 (the model has 32)")
    ap.add_argument("--text", type=int, default=1024, help="text tokens of each stream (max_sequence_length)")
    ap.add_argument("--budgets", nargs="+", default=["1GiB", "16MiB"], help="a capture for each memory_budget")
    ap.add_argument("--out", default="benchmarks/results/ltx2_cpu.md")
    args = ap.parse_args()

    torch.manual_seed(0)
    transformer = block(args.heads)
    F, H, W = args.frames, args.height, args.width
    grid, refs = F * H * W, args.refs * H * W
    S = grid + refs
    pixel_frames = 8 * (F - 1) + 1
    audio = round(pixel_frames / FPS * 25)  # latent audio bins, 25 a second
    config = transformer.config
    g = torch.Generator().manual_seed(0)

    # the reference tokens' coordinates: a video of their own from frame 0, as LTX2InContextPipeline makes them
    rope = transformer.rope
    coords = torch.cat(
        [
            rope.prepare_video_coords(1, F, H, W, "cpu", fps=FPS),
            rope.prepare_video_coords(1, args.refs, H, W, "cpu", fps=FPS),
        ],
        dim=2,
    )
    strength = torch.ones(1, S, S)
    strength[:, :grid, grid:] = strength[:, grid:, :grid] = args.strength
    bias = (1 - strength) * -10000.0  # what the transformer adds, in its dtype

    def call(frames, height, width, extra, bins, text):
        tokens = frames * height * width
        inputs = dict(
            hidden_states=torch.randn(1, tokens + extra, config.in_channels, generator=g),
            audio_hidden_states=torch.randn(1, bins, config.audio_in_channels, generator=g),
            encoder_hidden_states=torch.randn(1, text, config.caption_channels, generator=g),
            audio_encoder_hidden_states=torch.randn(1, text, config.caption_channels, generator=g),
            timestep=torch.tensor([500.0]),
            num_frames=frames,
            height=height,
            width=width,
            fps=FPS,
            audio_num_frames=bins,
            return_dict=False,
        )
        if extra:
            inputs.update(video_coords=coords, video_self_attention_mask=strength)
        return inputs

    times: dict[str, list[float]] = {"attn1": [], "attn2": []}
    for name, v in times.items():
        module = getattr(transformer.transformer_blocks[0], name)
        module.register_forward_pre_hook(lambda m, a, v=v: v.append(-time.perf_counter()))
        module.register_forward_hook(lambda m, a, o, v=v: v.__setitem__(-1, v[-1] + time.perf_counter()))
    with torch.no_grad():
        transformer(**call(1, 2, 2, 0, 5, 4))  # warm up kernels on a small call
        inputs = call(F, H, W, refs, audio, args.text)
        t0 = time.perf_counter()
        reference = transformer(**inputs)
        t_call = time.perf_counter() - t0
    t_self, t_cross = times["attn1"][-1], times["attn2"][-1]
    mask_mib = args.heads * S * S * 4 / MiB
    print(
        f"S = {S:,} ({grid:,} + {refs:,}): stock call {t_call:.1f} s, attn1 {t_self:.1f} s (its mask "
        f"{mask_mib:,.0f} MiB), attn2 {t_cross:.1f} s",
        flush=True,
    )

    memory = PeakMemory("cpu")
    rows, checks, identical = [], [], True
    for i, budget_arg in enumerate(args.budgets):
        rec = cogattn.record(
            transformer, kinds=("entropy", "received", "video_to_text"), memory_budget=budget_arg, batch=[0]
        )
        spent = {"capture": [0.0, 0], "capture_context": [0.0, 0]}
        seen = {}
        for name in spent:
            real = getattr(rec, name)
            if name == "capture":  # keep the module's own q and k (in the capture's order: the references first)

                def real(layer, q, k, *a, real=real, seen=seen, **kw):
                    seen.update(q=q, k=k)
                    real(layer, q, k, *a, **kw)

            setattr(rec, name, memory.measured(real, spent[name]))
        with rec, torch.no_grad():
            t0 = time.perf_counter()
            out = transformer(**inputs)
            t_rec = time.perf_counter() - t0
        identical &= all(torch.equal(a, b) for a, b in zip(out, reference))
        budget = rec.options.memory_budget
        (used,) = [t for key, t in rec._capture.tiles.items() if key[-1] != (0, 0)]  # the mask-aware plan
        unmasked = rec.plan.tiles
        print(
            f"memory_budget {budget_arg}: call {t_rec:.1f} s; tiles under the mask: {used.row_heads} head × "
            f"{used.row_rows} rows, {used.peak_bytes / MiB:.1f} MiB planned (without the mask: {unmasked.row_heads} "
            f"× {unmasked.row_rows} rows, {unmasked.peak_bytes / MiB:.1f} MiB)",
            flush=True,
        )
        for name, what, stock in (
            ("capture", "self (`entropy` + `received`)", t_self),
            ("capture_context", "cross (`video_to_text`)", t_cross),
        ):
            dt, peak = spent[name]
            planned = used.peak_bytes if name == "capture" else rec.plan.context_bytes
            method = f"{used.method}, {used.row_rows} rows" if name == "capture" else "cross rows"
            kinds = ("entropy", "received") if name == "capture" else ("video_to_text",)
            result = sum(rec.get(kind, step=0, layer=0).numel() * 4 for kind in kinds)  # float32, kept in memory
            rows.append((budget_arg, budget, what, method, stock, dt, peak, result, planned))
            print(
                f"  {what}: capture {dt:.1f} s ({dt / t_self:.2f}× stock attn1), peak +{peak / MiB:.1f} MiB", flush=True
            )
        if i == 0:
            checks = check(rec, seen, bias, grid, args.heads)

    lines = [
        f"One LTX-2 (19B) block ({args.heads} video heads × 128, audio 32 × 64, patch size 1, random weights), S = "
        f"{S:,} video tokens: the grid {F}×{H}×{W} ({pixel_frames} frames at {32 * H}×{32 * W}, {grid:,} tokens) and "
        f"{args.refs} IC-LoRA reference latent frame{'s' * (args.refs != 1)} after it ({refs:,} tokens), under "
        f"`video_self_attention_mask` = {args.strength} between references and generated tokens (a bias of "
        f"{float(bias.min()):.2f}), {audio} audio bins, {args.text} text tokens per stream, float32, CPU "
        f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch "
        f"{torch.__version__}; heads = mean.",
        "",
        f"Stock: the block's attention modules (`attn1`: the per-head float mask ({args.heads} × S × S, "
        f"{mask_mib:,.0f} MiB), projections, RMS norms, RoPE, SDPA under the mask, output projection; `attn2`: the "
        "text cross-attention). Capture: what cogattn adds in the processor (the bias's rows added in row tiles), as "
        "a multiple of the stock `attn1` measured in the same run, and its peak extra memory (VmHWM above the "
        "resident size at the capture's start), of which its result; planned: the tile plan the capture used, the "
        "bias's rows counted (`passes.mask_cost`); within the budget: the peak less the result (`memory_budget` "
        "bounds the transient working memory, results excluded) at most the budget. The block's output with capture "
        "on equals the stock output bit for bit: "
        f"{'yes' if identical else 'NO'}. {checks}",
        "",
        "| memory_budget | attention (kind) | method | stock module (s) | capture (s) | × stock `attn1` | peak extra "
        "memory (MiB) | result (MiB) | planned (MiB) | within the budget |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for budget_arg, budget, what, method, stock, dt, peak, result, planned in rows:
        lines.append(
            f"| {budget_arg} | {what} | {method} | {stock:.2f} | {dt:.2f} | {dt / t_self:.2f} | {peak / MiB:.1f} | "
            f"{result / MiB:.1f} | {planned / MiB:.1f} | {'yes' if peak - result <= budget else 'NO'} |"
        )
    write_table(lines, args.out)


def check(rec, seen: dict, bias: torch.Tensor, grid: int, heads: int) -> str:
    """The recorded ``entropy`` and ``received`` against the float64 softmax(q·kᵀ/√D + bias) of every row, from the
    module's q and k (the capture's order: the references first) and the bias made from the strengths."""
    q, k = seen["q"][0].double(), seen["k"][0].double()  # (H, S, D)
    S, D = q.shape[1], q.shape[2]
    order = torch.cat([torch.arange(grid, S), torch.arange(grid)])  # the references first, as capture's order
    b = bias[0][order][:, order].double()
    entropy, received = torch.zeros(heads, S, dtype=torch.float64), torch.zeros(heads, S, dtype=torch.float64)
    for r0 in range(0, S, 512):
        scores = q[:, r0 : r0 + 512] @ k.transpose(-1, -2) * D**-0.5 + b[r0 : r0 + 512]
        P = scores.softmax(-1)
        entropy[:, r0 : r0 + 512] = -(P * P.clamp_min(1e-300).log()).sum(-1)
        received += P.sum(1)
    got_e = rec.get("entropy", step=0, layer=0)[0, 0].double()
    got_r = rec.get("received", step=0, layer=0)[0, 0].double()
    err_e = (got_e - entropy.mean(0)).abs().max().item()
    err_r = ((got_r - received.mean(0)).abs() / received.mean(0).clamp_min(1)).max().item()
    ok = err_e < 1e-4 and err_r < 1e-4
    print(f"float64 reference: entropy max error {err_e:.1e} nats, received max relative error {err_r:.1e}")
    return (
        f"The recorded `entropy` and `received` against the float64 softmax(q·kᵀ/√D + bias) of all {S:,} rows from "
        f"the module's own q and k: largest errors {err_e:.1e} nats and {err_r:.1e} (relative to max(1, Σ_i P)): "
        f"{'within 1e-4' if ok else 'NOT within 1e-4'}."
    )


if __name__ == "__main__":
    main()
