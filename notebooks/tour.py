# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of cogattn: exact attention maps from CogVideoX
#
# This notebook generates one video, records exact attention maps while it is generated, and draws
# them: frame-to-frame attention, where the video attends to each word (and the reverse), where one
# video point attends, grids over layers × steps, an animation, which heads are temporal and how much
# of the attention a same-frame block-sparse mask would keep, a sparse-pattern study and a point's track,
# interactive sliders, and the same on Wan.
#
# It runs end to end on the embedded **tiny random CogVideoX** (no download, CPU, well under two
# minutes). Its weights are random, so the video is noise and the maps carry no meaning; the shapes,
# the token layout and the pipeline are those of the real models. To run it on a real checkpoint,
# change `MODEL` below to a hub id (`"THUDM/CogVideoX-2b"`, `"THUDM/CogVideoX-5b"`,
# `"THUDM/CogVideoX1.5-5B"`) or a local folder; a GPU is then strongly recommended.

# %%
import tempfile
from pathlib import Path

import torch
from IPython.display import Image, display

import cogattn
from cogattn import models, plot
from cogattn.analysis import aggregate
from cogattn.analysis.density import top_p_density
from cogattn.analysis.head_stats import head_table
from cogattn.analysis.masks import mask_recall, oracle_curve, same_frame_mask, temporal_window_mask
from cogattn.analysis.pattern_heads import label_changes, pattern_table
from cogattn.analysis.tracks import track
from cogattn.analysis.words import PromptFormat, word_positions

# %%
MODEL = "tiny"  # or "THUDM/CogVideoX-2b", "THUDM/CogVideoX1.5-5B", or a local folder of a checkpoint
PROMPT = "a red fox running in the snow"
SEED = 0
OUT = None  # a folder to stream the maps to disk (then plotted from `cogattn.load(OUT)`); None keeps them in memory

# %%
TINY = MODEL == "tiny"
device = "cuda" if torch.cuda.is_available() else "cpu"
if TINY:
    from cogattn.models.cogvideox import tiny_pipeline

    pipe = tiny_pipeline().to(device)
else:
    from diffusers import CogVideoXPipeline

    pipe = CogVideoXPipeline.from_pretrained(MODEL, torch_dtype=torch.bfloat16).to(device)
config = pipe.transformer.config
version_15 = config.patch_size_t is not None

# %% [markdown]
# ## What to record
#
# The tiny model records every step, layer and head. A real model's text maps are large
# (`video_to_text` is T × F × Hp × Wp per head: 226 × 17,550 floats for CogVideoX-2b), so there we
# take a few steps and layers and the mean over heads; `heads="all"` gives per-head panels at
# heads × the memory.

# %%
if TINY:
    from cogattn.models.cogvideox import TINY_TEXT_LEN

    call = dict(num_frames=9, height=48, width=80, num_inference_steps=4, max_sequence_length=TINY_TEXT_LEN)
    steps, layers, heads = "all", "all", "all"
else:
    frames, height, width = (81, 768, 1360) if version_15 else (49, 480, 720)
    call = dict(num_frames=frames, height=height, width=width, num_inference_steps=50)
    steps = [0, 10, 25, 49]
    layers = list(range(0, config.num_layers, max(1, config.num_layers // 4)))
    heads = "mean"
    pipe.vae.enable_tiling()  # decoding a real video at full size needs tens of GB otherwise

# The latent grid of this call, to choose a video point to follow: the centre of the middle frame.
layout = cogattn.TokenLayout.for_video(
    call["num_frames"],
    call["height"],
    call["width"],
    text_len=config.max_text_seq_length,
    patch_size=config.patch_size,
    patch_size_t=config.patch_size_t,
)
F, Hp, Wp = layout.grid
QUERY = (F // 2, Hp // 2, Wp // 2)
print(f"latent grid (F, Hp, Wp) = {(F, Hp, Wp)}; following the video point {QUERY}")

# %%
with cogattn.record(
    pipe,
    kinds=("frame", "video_to_text", "text_to_video", "query"),
    steps=steps,
    layers=layers,
    batch="cond",
    heads=heads,
    queries=[QUERY],
    info={"prompt": PROMPT, "seed": SEED},
    save_dir=OUT,
    overwrite=True,
) as rec:
    video = pipe(prompt=PROMPT, generator=torch.Generator(device).manual_seed(SEED), output_type="pt", **call).frames[0]

source = rec if OUT is None else cogattn.load(OUT)  # every plot takes either
print(source)
print("video (frames, channels, height, width):", tuple(video.shape), "· layout:", source.layout)

# %% [markdown]
# ## Frame to frame
#
# Row g, column h: the share of attention that queries in group g give to keys in group h (group
# `text`, then latent frame `f<k>`; the ticks name the pixel frames each latent frame covers: latent
# frame 0 is pixel frame 0, each later one the next 4; with CogVideoX 1.5 a temporal patch covers
# two latent frames). Rows sum to 1. Averaged over the recorded steps and layers.

# %%
plot.frame_heatmap(source)

# %% [markdown]
# One panel per head (small multiples), here at the last recorded step, on a log colour scale:

# %%
last_step = max(s for kind, s, _ in source.keys() if kind == "frame")
plot.frame_heatmap(source, heads="all", steps=last_step, scale="log")

# %% [markdown]
# ## Any 2-D view over layers × steps
#
# `index` cuts a map down to two dimensions: here the frame map itself, then text token 2 (`fox`)
# over the patch grid of the middle latent frame.

# %%
plot.layer_step_grid(source, "frame")

# %%
fox = word_positions("fox", pipe.tokenizer, PROMPT, source.layout.text_len)
plot.layer_step_grid(source, "video_to_text", index=(fox[0], F // 2))

# %% [markdown]
# ## Words on the video
#
# `video_to_text`: where the video attends to each word, upsampled from patches (16 × 16 pixels) to
# pixels and laid over the decoded frame (pixel frame n shows the map of the latent frame that covers
# it). Words are found with the pipeline's tokenizer; a word of several sentencepiece tokens sums
# them.

# %%
plot.word_heatmap(source, ["fox", "snow"], video, tokenizer=pipe)

# %% [markdown]
# The reverse direction, `text_to_video`: where each word attends in the video. Attention is
# heavy-tailed; a log scale with limits per map shows the structure of each one.

# %%
plot.word_heatmap(source, ["fox", "snow"], video, kind="text_to_video", tokenizer=pipe, scale="log", limits="per-map")

# %% [markdown]
# ## Where one video point attends
#
# The point (latent frame, patch row, patch column) is marked with a cross; the strip shows its
# attention over every frame, the bar below its attention to each text token.

# %%
plot.query_map(source, QUERY, video, tokenizer=pipe, scale="log")

# %% [markdown]
# ## The numbers behind a plot
#
# `cogattn.analysis.aggregate` averages over steps and/or layers and picks heads; indexing rules: an
# int drops the head axis, a list or `"all"` keeps it, `"mean"` averages it. The layout names the pixel
# frames of each latent frame.

# %%
m = aggregate(source, "video_to_text", steps="all", layers="all", heads="mean")
print("video_to_text, mean over steps and layers:", tuple(m.shape), "(T, F, Hp, Wp)")
print("attention mass on 'fox', per latent frame:", m[fox].sum(0).mean((-1, -2)).tolist())
print("pixel frames of each latent frame:", source.layout.pixel_frames(video.shape[0]))

# %% [markdown]
# ## An animation over denoising steps
#
# `animate` redraws a plot for each step (or layer, or frame) with one colour scale for all frames
# and writes a GIF (or an MP4 where ffmpeg exists).

# %%
gif = plot.animate(
    plot.word_heatmap,
    source,
    Path(tempfile.gettempdir()) / "cogattn_fox_steps.gif",
    over="step",
    tokens="fox",
    video=video,
    tokenizer=pipe,
)
display(Image(filename=str(gif)))

# %% [markdown]
# ## Which heads are temporal, and how much would a same-frame mask keep?
#
# Four small statistics of every head answer this: `frame` (where each latent frame's queries put
# their mass), `entropy` (how spread each query's row is), `received` (how much attention each key
# token gets: sinks) and `block` (the mass each block of `block_size` query tokens gives each block of
# keys, the unit of block-sparse attention kernels). Each is S or (S / block_size)² floats per head, so this
# records every layer and head; on a real model at three steps, about 0.6 GB for CogVideoX-2b and
# 1.3 GB for CogVideoX-5b. The video itself is not needed again, so the generation stops at the latents.

# %%
# The tiny model has S = 53 tokens: the default block_size (128, the usual kernel block) would make one
# block; 8 makes 7, the text exactly block 0.
block_size = 8 if TINY else 128
with cogattn.record(
    pipe,
    kinds=("frame", "entropy", "received", "block"),
    steps="all" if TINY else [0, 25, 49],
    layers="all",
    batch="cond",
    heads="all",
    block_size=block_size,
) as stats:
    pipe(prompt=PROMPT, generator=torch.Generator(device).manual_seed(SEED), output_type="latent", **call)

# %% [markdown]
# `head_table` gives one row per (step, layer, head, batch item): `text_mass`, the mass a video query
# puts on the text; `dt_d`, on the frames at latent-frame distance d from its own (`same_frame_mass` is
# `dt_0`; with `text_mass` they sum to 1); the mean and spread of the row entropy (nats); the share of
# all attention that the top 1% of key tokens receive (`sink_share`) and which they are; and a label
# from `cogattn.analysis.head_stats.LabelRule`: `text`, `spatial` (own frame ≥ 0.5), `temporal` (adjacent frames
# ≥ 0.5) or `global`. Pass `rule=LabelRule(...)` to change the thresholds. The tiny model's random
# heads attend almost uniformly: all `global`.

# %%
table = head_table(stats)
table.round(3)

# %%
print("heads by label, over the recorded steps and layers:")
print(table["label"].value_counts().to_string())
table.groupby(["layer", "label"]).size().unstack(fill_value=0)  # labels per layer

# %% [markdown]
# The head atlas: one cell per (layer, head), coloured by its label at the last recorded step
# (`color="dt_1"`, `"entropy_mean"` or any other column for a number instead). Then the mass against
# latent-frame distance, one curve per head averaged over layers and steps: a temporal head's curve
# peaks at |Δf| = 1 and falls off.

# %%
plot.head_atlas(stats)

# %%
plot.decay_curves(stats)

# %% [markdown]
# A block-sparse kernel computes only the (query block, key block) pairs its mask keeps. `mask_recall`
# gives, exactly, the share of all attention mass a mask keeps, per step, layer and head;
# `oracle_curve` the most that any mask keeping k key blocks per query block could keep (each query
# block's k largest blocks), a bound to hold a fixed pattern of the same density to.

# %%
same = same_frame_mask(stats.layout, block_size)
near = temporal_window_mask(stats.layout, block_size, 1)
for name, mask in [("same frame", same), ("frames at most 1 apart", near)]:
    recall = mask_recall(stats, mask)["recall"]
    print(
        f"{name}: keeps {mask.float().mean().item():.1%} of the {mask.numel()} block pairs, recall "
        f"{recall.mean():.3f} (min {recall.min():.3f}, max {recall.max():.3f} over steps, layers and heads)"
    )
k = round(same.sum().item() / len(same))  # the same-frame mask's key blocks per query block, on average
best = oracle_curve(stats, ks=[k])["recall"]
print(
    f"the best masks with {k} key blocks per query block ({k / len(same):.1%} of the pairs): recall "
    f"{best.mean():.3f} (min {best.min():.3f})"
)

# %% [markdown]
# The heads a same-frame mask would hurt most: lowest recall, mean over the recorded steps.

# %%
mask_recall(stats, same).groupby(["layer", "head"])["recall"].mean().sort_values().head(10)

# %% [markdown]
# The block map, mean over steps, layers and heads, with the same-frame mask's kept blocks outlined
# and its recall in the title (a log scale shows the small blocks as well as the large).

# %%
plot.block_map(stats, same, scale="log")

# %% [markdown]
# ## A sparse-pattern study, and a point's track
#
# What sparse-attention papers measure before writing a kernel, exactly over every query: how much of each
# row a token pattern keeps (`pattern_recall`) and the output error it would cause (`pattern_error`,
# Sparse VideoGen's criterion for naming a head spatial or temporal), how many keys each row needs for a mass
# p (`top_p`: NABLA's and XAttention's criterion), the map over 3-D tiles (`tile`: the unit of Sliding
# Tile Attention and VSA), the mass by offset in time and space (`offset`: Radial Attention's decay); and
# what tracking papers read out of attention: every query's highest-attention key in each latent frame
# (`frame_max`: DiffTrack's matching, DiTFlow's motion). A real model records a few steps and layers here,
# and four heads (`frame_max` and `top_p` are S × G and S × 3 floats per head).

# %%
with cogattn.record(
    pipe,
    kinds=("pattern_recall", "pattern_error", "top_p", "tile", "offset", "frame_max"),
    steps="all" if TINY else [0, 25, 49],
    layers="all" if TINY else layers[:3],
    batch="cond",
    heads="all" if TINY else [0, 1, 2, 3],
    patterns=("spatial", "temporal", "window:1"),
    top_p=(0.5, 0.9, 0.99),
    tile_shape=(1, 2, 3) if TINY else (1, 8, 8),
) as sparse:
    sparse_video = pipe(
        prompt=PROMPT, generator=torch.Generator(device).manual_seed(SEED), output_type="pt", **call
    ).frames[0]

# %% [markdown]
# Each head labelled by the pattern of lowest output error, at every step, and how often that label changes
# between steps (Sparse VideoGen's users report it does). The tiny model's near-uniform heads favour the
# pattern that keeps the most keys.

# %%
labels = pattern_table(sparse)
print(labels[["step", "layer", "head", "error_spatial", "error_temporal", "error_window:1", "label"]].round(4))
label_changes(labels)

# %%
plot.head_atlas(labels)

# %% [markdown]
# Density: the keys a video query needs for each mass p, as a share of the row, per layer; and what NABLA's
# selection on the tile map (each query tile keeps the fewest key tiles reaching p) keeps and computes,
# against the density the token rows themselves need.

# %%
plot.density_curves(sparse, by="layer")

# %%
top_p_density(sparse, 0.9, kind="tile").groupby("layer")[["recall", "density", "token_density"]].mean()

# %% [markdown]
# Decay over time and space from `offset`, with Radial Attention's exponential fit per layer.

# %%
plot.distance_decay(sparse, by="layer")

# %% [markdown]
# The track of the video point followed above, read from `frame_max` at the last recorded step of the
# middle recorded layer (a track is one map: one step, layer and head), then the motion field from latent
# frame 0 to 1 (DiTFlow's attention motion flow) as arrows and as a colour wheel.

# %%
last_step = max(s for kind, s, _ in sparse.keys() if kind == "frame_max")
track_layers = sorted({layer for kind, s, layer in sparse.keys() if kind == "frame_max" and s == last_step})
mid = track_layers[len(track_layers) // 2]
point = track(sparse, QUERY, step=last_step, layer=mid, head=0)
print("matched (row, col) per latent frame:", point.positions.tolist())
print("their probabilities:", [round(c, 4) for c in point.confidence.tolist()])
plot.track_figure(sparse, QUERY, sparse_video, step=last_step, layer=mid, head=0)

# %%
plot.motion_figure(sparse, 0, 1, sparse_video, step=last_step, layer=mid, head=0)

# %%
plot.motion_figure(sparse, 0, 1, sparse_video, step=last_step, layer=mid, head=0, style="wheel")

# %% [markdown]
# ## Wan
#
# The same API records Wan 2.1 / 2.2 (diffusers ≥ 0.35). Its blocks have a self-attention over the
# video alone and a cross-attention to the 512 text tokens: `frame` has no text group there, and
# `video_to_text` is the cross-attention's own probabilities. Under guidance Wan calls the transformer
# twice per step; the recording numbers both calls as one step. Here a tiny random Wan 2.2-style
# pipeline with two experts (`transformer` for the high-noise steps, `transformer_2` for the rest);
# for a real one, `WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")`.

# %%
wan = models.wan.tiny_pipeline(experts=2)
wan_prompt = "a red fox running in the snow"
with cogattn.record(wan, kinds=("frame", "video_to_text", "entropy"), batch="cond") as wan_rec:
    wan_video = wan(
        prompt=wan_prompt,
        num_frames=9,
        height=32,
        width=48,
        num_inference_steps=4,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]
print(wan_rec.layout)
print("expert of each step:", wan_rec.experts)

# %% [markdown]
# Frame-to-frame attention of the video-only self-attention (no text row or column) over the steps of
# the high-noise expert, and where the video attends to two words of the prompt in the cross-attention
# over the low-noise expert's steps. An average over steps keeps to one expert (`steps="transformer"`
# or `"transformer_2"`): layer L of one is not layer L of the other, and `steps="all"` is refused here.

# %%
plot.frame_heatmap(wan_rec, steps="transformer", layers="all")

# %%
plot.word_heatmap(wan_rec, ["fox", "snow"], wan_video, tokenizer=wan, prompt=wan_prompt, steps="transformer_2")

# %% [markdown]
# ## HunyuanVideo
#
# HunyuanVideo (diffusers ≥ 0.33) runs 20 dual-stream blocks and then 40 single-stream ones; cogattn
# numbers their attentions in that order and names each (`rec.layer_names`; `layers=` takes the names).
# Its joint sequence is the video *then* the text, padded to 256 tokens with a key mask: padded text
# keys get exactly 0 attention, and `frame`'s group 0 is the text wherever it sits. Here the tiny
# random HunyuanVideo, two prompts of different lengths in one batch (the tiny tokenizer's words need
# the plain prompt template, which the word maps then take too: `PromptFormat(pipe, template)`); for a real
# one, `HunyuanVideoPipeline.from_pretrained("hunyuanvideo-community/HunyuanVideo")` and `tokenizer=pipe`.

# %%
hunyuan = models.hunyuan_video.tiny_pipeline()
prompts = ["a red fox running in the snow", "a cat"]
template = {"template": "{}", "crop_start": 0}
with cogattn.record(hunyuan, kinds=("frame", "video_to_text", "received"), batch="all") as hv_rec:
    hv_video = hunyuan(
        prompt=prompts,
        prompt_template=template,
        max_sequence_length=12,
        num_frames=9,
        height=32,
        width=48,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
print(hv_rec.layout)
print(hv_rec.layer_names)
received = aggregate(hv_rec, "received", batch=1)
print("attention the second prompt's padded text keys receive:", received[hv_rec.layout.text_tokens][3:].tolist())

# %%
plot.word_heatmap(hv_rec, ["fox", "snow"], hv_video[0], tokenizer=PromptFormat(hunyuan, template), prompt=prompts[0])

# %% [markdown]
# ## Explore
#
# With ipywidgets installed: sliders over step, layer (or their mean), head (or the mean) and frame.
# Without it, the same call returns a static figure of the last step.

# %%
plot.explore(source, video, view="word", tokens=["fox", "snow"], tokenizer=pipe)
