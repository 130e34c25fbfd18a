"""The same checks for every registered model family (a family gets them by registering and adding its
tiny call to ``CASES``).

The reference is taken from each attention's own inputs, not from cogattn's code: during a stock run
(diffusers' own processors) a spy catches every ``scaled_dot_product_attention`` call inside the family's
capture sites, with its q, k, v and mask, and the reference is proved first: the naive float64
``softmax(q kᵀ / √D)`` (masked keys: −inf) times v reproduces that call's output. Then a recording of the
same seeded call must leave the video bit-identical and hold every kind the family makes, by every method
and output mode it offers, within 1e-5 of the reference (entropy 1e-4), with padded keys at exactly 0.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import PIL.Image
import pytest
import torch
from reference import AttentionSpy, assert_topk, spy_probs

import cogattn
from cogattn.exact.layer_plans import kinds_at
from cogattn.models import FAMILIES, cogvideox
from cogattn.reference import kind_error, naive_audio, naive_context, naive_kind

SIZES = dict(
    block_size=7,
    topk=4,
    top_p=(0.5, 0.9, 0.99, 1.0),
    patterns=("spatial", "temporal", "window:1", "radial", "sta:1,1,3"),
)
QUERIES = [0, (1, 1, 2)]  # a token index and a video point, on every tiny grid


@dataclass(frozen=True)
class Case:
    """How a family's tiny pipeline is called in these tests: ``call(pipe, generator, guided)`` → the
    call's arguments for a batch of two videos; ``skip``: kinds the tiny call does not make; ``released``:
    ``(checkpoint, pipeline call, S)`` for ``estimate`` at a released shape (none for a pipeline case)."""

    make: callable
    call: callable
    text_len: int
    skip: tuple[str, ...] = ()
    released: tuple = field(default_factory=tuple)
    family: str = ""  # a pipeline of another family's transformer (Lucy-Edit: Wan's): that family
    videos: int = 2  # videos of the call (Lucy-Edit edits one)
    query_mask: bool = False  # its attention masks query-key pairs: row tiles serve every kind, unchecked
    extras_last: bool = False  # video tokens after the grid (LTX-2's keyframes, references): the layout leads with them
    latent: str = "latent"  # its pipeline's output_type of the latents
    join: callable = None  # a layer's spied calls → the one S × S call they make together (Cosmos 3's two calls)
    join_context: bool = False  # join takes the cross-attention's calls too (Latte's per-frame text calls)


def _cogvideox_call(pipe, g, guided):
    emb = torch.randn(2, cogvideox.TINY_TEXT_LEN, 16, generator=g)
    return dict(
        prompt_embeds=emb,
        negative_prompt_embeds=-emb,
        guidance_scale=6.0 if guided else 1.0,
        num_frames=9,
        height=48,
        width=80,
        max_sequence_length=cogvideox.TINY_TEXT_LEN,
    )


def _consisid_call(pipe, g, guided):
    """One image per video (its pipeline needs OpenCV: the test extra installs it)."""
    return {**_cogvideox_call(pipe, g, guided), "image": torch.rand(2, 3, 48, 80, generator=g)}


def _wan_call(pipe, g, guided):
    emb = torch.randn(2, 512, 16, generator=g)
    return dict(
        prompt_embeds=emb,
        negative_prompt_embeds=-emb,
        guidance_scale=5.0 if guided else 1.0,
        num_frames=9,
        height=32,
        width=48,
    )


def _anyflow_call(pipe, g, guided):
    """Wan's call; the negative embeddings under guidance alone (AnyFlowPipeline joins any it is given to the batch)."""
    call = _wan_call(pipe, g, guided)
    return call if guided else {k: v for k, v in call.items() if k != "negative_prompt_embeds"}


def _lucy_edit_pipeline():
    """Lucy-Edit: Wan's transformer taking the video to edit as 16 more input channels, and its pipeline."""
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "LucyEditPipeline"):
        pytest.skip("this diffusers has no LucyEditPipeline")
    base = FAMILY["wan"].tiny_pipeline(num_heads=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = {**base.transformer.config, "in_channels": 32}
        transformer = diffusers.WanTransformer3DModel.from_config(config).eval()
    parts = {k: base.components[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}
    pipe = diffusers.LucyEditPipeline(transformer=transformer, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _with_transformer(base, pipeline: str, in_channels: int | None = None):
    """A pipeline class of a covered family built from the tiny pipeline ``base``'s components, its transformer
    remade with ``in_channels`` (the pipelines that concatenate a video's or an image's latents on channels)."""
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, pipeline):
        pytest.skip(f"this diffusers has no {pipeline}")
    cls = getattr(diffusers, pipeline)
    transformer = base.transformer
    if in_channels is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = {**transformer.config, "in_channels": in_channels}
            transformer = type(transformer).from_config(config).eval()
    names = [n for n in inspect.signature(cls.__init__).parameters if n in base.components and n != "transformer"]
    pipe = cls(transformer=transformer, **{n: base.components[n] for n in names})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(g, count=9, height=32, width=48):
    """``count`` random PIL frames: a video to edit or to follow."""
    shape = (height, width, 3)
    return [
        PIL.Image.fromarray(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).numpy()) for _ in range(count)
    ]


def _cogvideox_v2v_call(pipe, g, guided):
    """One video of 9 frames to remake (``strength`` 0.8 runs the last of the 2 steps)."""
    call = _cogvideox_call(pipe, g, guided)
    call.update(prompt_embeds=call["prompt_embeds"][:1], negative_prompt_embeds=call["negative_prompt_embeds"][:1])
    del call["num_frames"]  # the video's
    return {**call, "video": _frames(g, 9, call["height"], call["width"])}


def _cogvideox_control_call(pipe, g, guided):
    """One video following a control video of 9 frames (its latents enter on channels; the pipeline takes as
    many control videos as videos)."""
    call = _cogvideox_call(pipe, g, guided)
    call.update(prompt_embeds=call["prompt_embeds"][:1], negative_prompt_embeds=call["negative_prompt_embeds"][:1])
    del call["num_frames"]  # the control video's
    return {**call, "control_video": _frames(g, 9, call["height"], call["width"])}


def _wan_v2v_call(pipe, g, guided):
    """One video of 9 frames to remake (``strength`` 0.8 runs the last of the 2 steps)."""
    call = _one_video_call(pipe, g, guided)
    del call["num_frames"]  # the video's
    return {**call, "video": _frames(g)}


def _hunyuan_skyreels_i2v_call(pipe, g, guided):
    """HunyuanVideo's text-to-video call (ragged text, true guidance) with an image per video, whose latent
    enters on channels; no image tokens in the text."""
    return {**_hunyuan_video_call(pipe, g, guided), "image": _frames(g, 2)}


def _one_video_call(pipe, g, guided):
    """Wan's call for one video (VACE and Lucy-Edit generate one at a time)."""
    call = _wan_call(pipe, g, guided)
    call.update(prompt_embeds=call["prompt_embeds"][:1], negative_prompt_embeds=call["negative_prompt_embeds"][:1])
    return call


def _vace_call(pipe, g, guided):
    """One video from a prompt (diffusers 0.35's VACE pipeline takes a prompt string only); a blank control video."""
    call = _one_video_call(pipe, g, guided)
    del call["prompt_embeds"], call["negative_prompt_embeds"]
    return {**call, "prompt": "a red fox running in the snow", "negative_prompt": "blue sky"}


def _lucy_edit_call(pipe, g, guided):
    """A video to edit: 9 frames of 32×48."""
    frames = [torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(9)]
    return {**_one_video_call(pipe, g, guided), "video": [PIL.Image.fromarray(f) for f in frames]}


def _chronoedit_call(pipe, g, guided):
    """An image to edit: 5 frames (the pipeline's count without temporal reasoning), 2 latent frames."""
    pixels = torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy()
    return {**_wan_call(pipe, g, guided), "image": PIL.Image.fromarray(pixels), "num_frames": 5}


def _sana_video_call(pipe, g, guided):
    """LTX-Video's text under its key mask (the prompts keep 6 and 3 of 6 tokens, the negatives 2 and 5: the padding's
    bias −10000 in the cross-attention) at 9 frames of 32×64, 3 latent frames of 2×4 patches, named ``frames`` as its
    pipelines name them; image-to-video: one image for both videos (its pipeline encodes one per call)."""
    call = {k: v for k, v in _ltx_video_call(pipe, g, guided).items() if k not in ("num_frames", "image")}
    call.update(frames=9, height=32, width=64, negative_prompt=None, use_resolution_binning=False)
    if "image" in inspect.signature(pipe.__call__).parameters:
        call["image"] = _frames(g, 1, 32, 64)[0]
    return call


def _diffusion_forcing_pipeline():
    return cogattn.models.skyreels_v2.tiny_diffusion_forcing_pipeline(num_heads=3)


def _diffusion_forcing_call(pipe, g, guided):
    """Two causal blocks of 2 latent frames (13 frames), one step apart (``ar_step=1``): a block-causal mask
    and a timestep per frame, the last block's at 999 for two steps."""
    more = dict(num_frames=13, causal_block_size=2, base_num_frames=13, ar_step=1)
    return {**_wan_call(pipe, g, guided), "prompt": None, **more}


def _minimax_h3_call(pipe, g, guided):
    """One request (the pipeline packs one): 5 text tokens, 5 frames of 96×128, 2 latent frames of 3×4 patches after
    the text and 16 audio tokens; guidance-distilled, one call a step whether ``guided`` or not."""
    return cogattn.models.minimax_h3.tiny_call(pipe, "text-to-video", g, guided)


def _mochi_call(pipe, g, guided):
    """Ragged text dropped per item: the prompts keep 6 and 3 of 6 tokens, the negatives 2 and 5; 13 frames
    are 3 latent frames (the VAE compresses time by 6)."""
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    extra = dict(negative_prompt_attention_mask=torch.tensor([[1] * 2 + [0] * 4, [1] * 5 + [0]]))
    return dict(
        prompt_embeds=torch.randn(2, 6, 16, generator=g),
        prompt_attention_mask=mask,
        negative_prompt_embeds=torch.randn(2, 6, 16, generator=g),
        guidance_scale=4.5 if guided else 1.0,
        num_frames=13,
        height=32,
        width=48,
        max_sequence_length=6,
        **extra,
    )


def _motif_video_call(pipe, g, guided):
    """Two videos of 8 text tokens under the joint attention's key mask (its cross-attention's too): the prompts keep
    6 and 3, the negatives 2 and 5 (the guider's: two calls per step); 9 frames of 32×48, 3 latent frames of 2×3."""
    keep = torch.arange(8)
    pipe.guider.guidance_scale = 5.0 if guided else 1.0
    return dict(
        prompt_embeds=torch.randn(2, 8, 16, generator=g),
        prompt_attention_mask=torch.stack([keep < 6, keep < 3]).long(),
        negative_prompt_embeds=torch.randn(2, 8, 16, generator=g),
        negative_prompt_attention_mask=torch.stack([keep < 2, keep < 5]).long(),
        max_sequence_length=8,
        num_frames=9,
        height=32,
        width=48,
    )


def _hunyuan_video_call(pipe, g, guided):
    """Ragged text: the items keep 6 and 3 of 6 text tokens; under true guidance the negatives 2 and 5."""
    extra = {}
    if guided:
        extra = dict(
            negative_prompt_embeds=torch.randn(2, 6, 16, generator=g),
            negative_pooled_prompt_embeds=torch.randn(2, 8, generator=g),
            negative_prompt_attention_mask=torch.tensor([[1] * 2 + [0] * 4, [1] * 5 + [0]]),
            true_cfg_scale=4.0,
        )
    return dict(
        prompt_embeds=torch.randn(2, 6, 16, generator=g),
        pooled_prompt_embeds=torch.randn(2, 8, generator=g),
        prompt_attention_mask=torch.tensor([[1] * 6, [1] * 3 + [0] * 3]),
        num_frames=9,
        height=32,
        width=48,
        **extra,
    )


def _hunyuan_video15_call(pipe, g, guided):
    """Context packed per item: the prompts keep 6 and 3 of 8 Qwen tokens and 13 and 0 of 16 ByT5 tokens; under
    guidance (the guider's: two calls per step) the negatives 2 and 5, and 0 and 4; text-to-video's image tokens
    are all padding. Image-to-video: an image per video, its 16 SigLIP tokens leading every item's context."""
    from cogattn.models.hunyuan_video15 import tiny

    def masks(length, *kept):
        return torch.tensor([[1] * k + [0] * (length - k) for k in kept])

    call = dict(
        prompt_embeds=torch.randn(2, tiny.MLLM_LEN, 16, generator=g),
        prompt_embeds_mask=masks(tiny.MLLM_LEN, 6, 3),
        prompt_embeds_2=torch.randn(2, tiny.GLYPH_LEN, tiny.GLYPH_DIM, generator=g),
        prompt_embeds_mask_2=masks(tiny.GLYPH_LEN, 13, 0),
        num_frames=9,
    )
    if guided:
        call.update(
            negative_prompt_embeds=torch.randn(2, tiny.MLLM_LEN, 16, generator=g),
            negative_prompt_embeds_mask=masks(tiny.MLLM_LEN, 2, 5),
            negative_prompt_embeds_2=torch.randn(2, tiny.GLYPH_LEN, tiny.GLYPH_DIM, generator=g),
            negative_prompt_embeds_mask_2=masks(tiny.GLYPH_LEN, 0, 4),
        )
    pipe.guider.guidance_scale = 6.0 if guided else 1.0
    # its latents: diffusers' HunyuanVideo 1.5 VAE decodes one video at a time (its causal mask does not
    # broadcast over a batch of two in 0.42)
    call["output_type"] = "latent"
    if "image_encoder" in pipe.components:
        pixels = torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy()
        return {**call, "image": PIL.Image.fromarray(pixels)}
    return {**call, "height": 32, "width": 48}


def _ltx_video_call(pipe, g, guided):
    """Text of 6 tokens in the cross-attention, under its key mask: the prompts keep 6 and 3, the negatives 2 and
    5 (the padding's bias −10000); 17 frames of 64×96 are 3 × 2 × 3 latent pixels (the VAE's 8 frames, 32 pixels)."""
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    call = dict(
        prompt_embeds=torch.randn(2, 6, 16, generator=g),
        prompt_attention_mask=mask,
        negative_prompt_embeds=torch.randn(2, 6, 16, generator=g),
        negative_prompt_attention_mask=torch.tensor([[1] * 2 + [0] * 4, [1] * 5 + [0]]),
        guidance_scale=3.0 if guided else 1.0,
        num_frames=17,
        height=64,
        width=96,
        max_sequence_length=6,
    )
    if "image" in inspect.signature(pipe.__call__).parameters:  # image-to-video: an image per video
        call["image"] = _frames(g, 2, 64, 96)
    return call


def _ltx_condition_call(pipe, g, guided):
    """LTXConditionPipeline: one video conditioned on an image at frame 0 (its grid from video_coords)."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    call = _ltx_video_call(pipe, g, guided)
    call.pop("image", None)
    for name in ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"):
        call[name] = call[name][:1]
    return {**call, "conditions": [LTXVideoCondition(image=_frames(g, 1, 64, 96)[0], frame_index=0)]}


def _ltx2_call(pipe, g, guided):
    """Two videos of 8 text tokens (Gemma's hidden states, left-padded: the prompts keep their last 5 and 8, the
    negatives 3 and 6; the connectors' registers fill the padding, so every key is kept), 17 frames of 64×128 (3 × 2
    × 4 latent pixels) and 18 audio bins, classifier-free guidance alone (one transformer call per step)."""
    from cogattn.models.ltx2.tiny import tiny_call

    call = tiny_call(pipe, "text-to-video", g, guided)
    emb = torch.randn(2, *call["prompt_embeds"].shape[1:], generator=g)
    position = torch.arange(emb.shape[1])

    def keep(*counts):
        return torch.stack([(position >= emb.shape[1] - n).long() for n in counts])

    call.update(prompt_embeds=emb, prompt_attention_mask=keep(5, 8), negative_prompt_embeds=-emb)
    call.update(negative_prompt_attention_mask=keep(3, 6))
    if "image" in inspect.signature(pipe.__call__).parameters:  # image-to-video: an image per video
        call.update(image=_frames(g, 2, 64, 128), image_crf=0)
    return call


def _ltx2_condition_call(pipe, g, guided):
    """LTX2ConditionPipeline: one video conditioned on an image at frame 0 (its latents are the grid's first frame;
    a condition placed later is appended after the grid: the ltx2_keyframe case)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    call = _ltx2_call(pipe, g, guided)
    for name in ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"):
        call[name] = call[name][:1]
    return {**call, "conditions": [LTX2VideoCondition(frames=_frames(g, 1, 64, 128)[0], index=0, crf=0)]}


def _ltx2_keyframe_call(pipe, g, guided):
    """LTX2ConditionPipeline: one video conditioned on an image at frame 0 and a keyframe at latent frame 2, whose
    latents (1 × 2 × 4 tokens) the pipeline appends after the grid, with their own RoPE coordinates."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    call = _ltx2_condition_call(pipe, g, guided)
    keyframe = LTX2VideoCondition(frames=_frames(g, 1, 64, 128)[0], index=2, strength=0.9, crf=0)
    return {**call, "conditions": [*call["conditions"], keyframe]}


def _ltx2_in_context_call(pipe, g, guided, strength=1.0):
    """LTX2InContextPipeline: one video, a keyframe at latent frame 2 (8 tokens after the grid), then an IC-LoRA
    reference video of 9 frames (2 × 2 × 4 tokens after the keyframe's); with ``strength`` < 1 the pipeline passes
    ``video_self_attention_mask``, which the model adds as a bias: −10000·(1 − strength) between the generated and
    the reference tokens (−2 at 0.9998: their probabilities are not 0), −10000 between the keyframe's and the
    reference's."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

    call = _ltx2_keyframe_call(pipe, g, guided)
    call["conditions"] = call["conditions"][1:]
    reference = LTX2ReferenceCondition(frames=_frames(g, 9, 64, 128), strength=0.8)
    return {**call, "reference_conditions": [reference], "conditioning_attention_strength": strength}


def _allegro_call(pipe, g, guided):
    """LTX-Video's text (the cross-attention's key mask: the prompts keep 6 and 3 of 6 tokens) at 12 frames of 32×48:
    3 latent frames of 2×3 patches (the VAE packs 4 frames from frame 0)."""
    call = _ltx_video_call(pipe, g, guided)
    return {**call, "prompt": None, "negative_prompt": None, "num_frames": 12, "height": 32, "width": 48}


def _cosmos_call(pipe, g, guided):
    """Two videos of 8 text tokens (no mask: the padding is attended), 3 latent frames of 2×3 patches: 9 frames
    through Predict2's Wan VAE, 17 through Predict1's Cosmos tokenizer (8 per latent frame); video-to-world: an
    image per video."""
    emb = torch.randn(2, 8, 16, generator=g)
    i2v = "image" in inspect.signature(pipe.__call__).parameters
    predict1 = FAMILY["cosmos"].layout_for_video(pipe.transformer.config, 1, 16, 16, 1).temporal_compression == 8
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=7.0 if guided else 1.0)
    call.update(num_frames=17 if predict1 else 9, height=32, width=48)
    return {**call, "image": _frames(g, 2)} if i2v else call


def _cosmos25_call(pipe, g, guided):
    """Two videos of 8 text embeddings of the tiny Qwen2.5-VL's width (every layer's, joined), 9 frames of 32×48: 3
    latent frames of 2×3 patches; Transfer2.5's controlled by 9 random frames, in one chunk. Predict2.5's makes the
    video from the text alone (its image path needs torchvision)."""
    return _cosmos_tiny().tiny_call_25(pipe, g, guided, videos=2)


def _cosmos25_v2w_call(pipe, g, guided):
    """Predict2.5 video-to-world: one video continuing the last 5 frames (2 latent frames, held at timestep 0.0001,
    the others at the step's sigma) of a random clip of 9 frames in [-1, 1], given as a tensor (its pipeline takes
    one video per call)."""
    call = _cosmos_tiny().tiny_call_25(pipe, g, guided, videos=1)
    return {**call, "video": torch.rand(1, 3, 9, 32, 48, generator=g) * 2 - 1, "num_latent_conditional_frames": 2}


def _cosmos25_pipeline(transfer: bool):
    """The tiny Transfer2.5 or Predict2.5 pipeline, where this diffusers has it."""
    diffusers = pytest.importorskip("diffusers")
    name = "Cosmos2_5_TransferPipeline" if transfer else "Cosmos2_5_PredictBasePipeline"
    if not hasattr(diffusers, name):
        pytest.skip(f"this diffusers has no {name}")
    return _cosmos_tiny().tiny_pipeline_25(transfer, num_heads=3)


def _cosmos_tiny():
    return pytest.importorskip("cogattn.models.cosmos.tiny")


def _cosmos3_call(pipe, g, guided):
    """One video of 9 frames of 32×48 (3×2×3 patches) from a prompt, the negative prompt of as many tokens (27 in the
    tiny chat template with the system turn)."""
    return FAMILY["cosmos3"].tiny_call(pipe, "text-to-video", g, guided)


def _cosmos3_join(found):
    """Cosmos 3's two calls of a layer as one: the text's causal call ``(1, H, T, D)`` over ``Hkv`` key heads, and the
    video's call over every key; each key/value head repeated for its query heads, the text rows masked causally."""
    (q_text, k_text, v_text, _, out_text), (q_video, k, v, _, out_video) = found
    T = q_text.shape[2]
    assert torch.equal(k[:, :, :T], k_text) and torch.equal(v[:, :, :T], v_text)  # one set of text keys
    k, v = (x.repeat_interleave(q_text.shape[1] // k.shape[1], dim=1) for x in (k, v))
    S = k.shape[2]
    mask = torch.ones(S, S, dtype=torch.bool).tril() | (torch.arange(S) >= T)[:, None]
    return [(torch.cat([q_text, q_video], 2), k, v, mask[None, None], torch.cat([out_text, out_video], 2))]


def _latte_call(pipe, g, guided):
    """Two videos of 8 text tokens (the negatives their opposite), 3 frames of 32×48: 3 latent frames of 2×3 patches
    (the tiny transformer's video_length; Latte's VAE compresses no time)."""
    emb = torch.randn(2, 8, 16, generator=g)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, negative_prompt=None, video_length=3)
    return dict(call, guidance_scale=7.5 if guided else 1.0, height=32, width=48)


def _latte_join(found):
    """Latte's factorised calls of a layer as one call per video over its 3·2·3 tokens in raster order (token
    6f + p): a spatial call (an item per frame f, its 6 positions) or a temporal one (an item per position p, its 3
    frames) under the mask of the pairs it forms (one frame, or one position); the text's per-frame call as its
    video's queries and the text's keys and values, which every frame of a video shares."""
    frames, positions = 3, 6
    S = frames * positions
    per_frame = [range(f * positions, (f + 1) * positions) for f in range(frames)]
    per_position = [range(p, S, positions) for p in range(positions)]
    joined = []
    for q, k, v, mask, out in found:
        assert mask is None
        if k.shape[2] != q.shape[2]:  # the text (8 keys): one set per video
            kf, vf = k.unflatten(0, (-1, frames)), v.unflatten(0, (-1, frames))
            assert torch.equal(kf, kf[:, :1].expand_as(kf)) and torch.equal(vf, vf[:, :1].expand_as(vf))
            joined.append((_latte_tokens(q, per_frame, S), kf[:, 0], vf[:, 0], None, _latte_tokens(out, per_frame, S)))
            continue
        spatial = q.shape[2] == positions
        group = torch.arange(S) // positions if spatial else torch.arange(S) % positions
        keep = (group[:, None] == group[None, :])[None, None]
        q, k, v, out = (_latte_tokens(x, per_frame if spatial else per_position, S) for x in (q, k, v, out))
        joined.append((q, k, v, keep, out))
    return joined


def _latte_tokens(x, items, S):
    """A call's ``x`` ``(B·n, H, L, D)`` (item ``b·n + i`` holding the tokens ``items[i]``) as ``(B, H, S, D)``."""
    n = len(items)
    full = x.new_zeros(x.shape[0] // n, x.shape[1], S, x.shape[3])
    for i, tokens in enumerate(items):
        full[:, :, list(tokens)] = x[i::n]
    return full


def _easyanimate_call(pipe, g, guided):
    """Text of 7 tokens whose masks say 5 and 3 are the prompt's: only the text encoder reads them, the
    transformer gets no mask and attends the padding as any other token (no key is masked)."""
    emb = torch.randn(2, 7, 16, generator=g)
    mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 3 + [0] * 4])
    return dict(
        prompt_embeds=emb,
        prompt_attention_mask=mask,
        negative_prompt_embeds=-emb,
        negative_prompt_attention_mask=mask,
        guidance_scale=5.0 if guided else 1.0,
        num_frames=9,
        height=32,
        width=48,
    )


def _wan_animate_call(pipe, g, guided):
    """A character image, and pose (32×48) and face (16×16) videos of one 9-frame segment (the tiny
    pipeline's ``num_frames``): 3 latent frames after the reference frame."""

    def frames(height, width, count=9):
        shape = (height, width, 3)
        return [
            PIL.Image.fromarray(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).numpy())
            for _ in range(count)
        ]

    image = frames(32, 48, 1)[0]
    return {**_wan_call(pipe, g, guided), "image": image, "pose_video": frames(32, 48), "face_video": frames(16, 16)}


def _hunyuan_video_framepack_call(pipe, g, guided):
    """HunyuanVideo's call (ragged text, true guidance) with an image per video: 9 frames of 32×48 are one
    section, a window of 9×2×3 patches after 18 history tokens, then 16 image tokens and the text."""
    pixels = [torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(2)]
    return {**_hunyuan_video_call(pipe, g, guided), "image": [PIL.Image.fromarray(p) for p in pixels]}


def _hunyuan_video_i2v_call(pipe, g, guided):
    """An image per video, and text of the length the pipeline's own encoding gives with
    max_sequence_length=8 and the released checkpoints' image tokens (144 with token_replace, 288 with
    latent_concat, then 4): the items keep every image token and 4 and 1 of the 4 others, the negatives
    under true guidance 2 and 3."""
    images = FAMILY["hunyuan_video"].layout_for_video(pipe.transformer.config, 9, 32, 48, 8).image_len

    def mask(*kept):
        return torch.tensor([[1] * images + [1] * k + [0] * (4 - k) for k in kept])

    extra = {}
    if guided:
        extra = dict(
            negative_prompt_embeds=torch.randn(2, images + 4, 16, generator=g),
            negative_pooled_prompt_embeds=torch.randn(2, 8, generator=g),
            negative_prompt_attention_mask=mask(2, 3),
            true_cfg_scale=4.0,
        )
    pixels = [torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(2)]
    return dict(
        image=[PIL.Image.fromarray(p) for p in pixels],
        prompt_embeds=torch.randn(2, images + 4, 16, generator=g),
        pooled_prompt_embeds=torch.randn(2, 8, generator=g),
        prompt_attention_mask=mask(4, 1),
        num_frames=9,
        height=32,
        width=48,
        **extra,
    )


def _helios_call(pipe, g, guided):
    """Wan's text (512 tokens) at 66 frames of 32×48: two chunks of 9 latent frames (9×2×3 patches each), each after
    18 history tokens (short 12, mid 2, long 4), the history's keys scaled per head."""
    return {**_wan_call(pipe, g, guided), "num_frames": 66}


def _helios_i2v_call(pipe, g, guided):
    """Helios's call with an image per video: its latent leads the short history."""
    return {**_helios_call(pipe, g, guided), "image": _frames(g, 2)}


def _helios_v2v_call(pipe, g, guided):
    """Helios's call for one video continuing a video of 33 frames: its latents are the history."""
    call = _one_video_call(pipe, g, guided)
    return {**call, "num_frames": 66, "video": _frames(g, 33)}


def _kandinsky5_call(pipe, g, guided):
    """Two videos of 6 Qwen text tokens each (the cross-attention attends all of them: no mask), the negatives as
    many (a step's two calls share the text's length), a CLIP embedding each; image-to-video: an image per video and
    17 frames (5 latent frames: the pipeline renormalises the first 4 by the next)."""
    from cogattn.models.kandinsky5 import tiny

    T, lengths = tiny.TINY_TEXT_LEN, torch.tensor([0, 6, 12], dtype=torch.int32)
    call = dict(
        prompt_embeds_qwen=torch.randn(2, T, 16, generator=g),
        prompt_embeds_clip=torch.randn(2, tiny.CLIP_DIM, generator=g),
        prompt_cu_seqlens=lengths,
        negative_prompt_embeds_qwen=torch.randn(2, T, 16, generator=g),
        negative_prompt_embeds_clip=torch.randn(2, tiny.CLIP_DIM, generator=g),
        negative_prompt_cu_seqlens=lengths,
        guidance_scale=5.0 if guided else 1.0,
        num_frames=9,
        height=32,
        width=48,
    )
    if "image" in inspect.signature(pipe.__call__).parameters:
        call.update(image=_frames(g, 2), num_frames=17)  # an image per video
    return call


def _kandinsky6_call(pipe, g, guided):
    """Two videos of prompts keeping 8 and 5 of 8 Qwen tokens after the template's crop, the negatives 4 and 8 (the
    text's padding mask in both calls of a step), 9 frames of 32×48 (3 latent frames of 2×3 patches) and 17 audio bins."""
    from cogattn.models.kandinsky6 import tiny

    call = tiny.tiny_call(pipe, "text-to-video", g, guided)
    call.update(prompt=list(tiny.PROMPTS), negative_prompt=list(tiny.NEGATIVE_PROMPTS))
    return call


def _kandinsky6_i2v_call(pipe, g, guided):
    """Kandinsky 6's call with an image per video, whose latent frame the pipeline appends after the video's."""
    return {**_kandinsky6_call(pipe, g, guided), "image": _frames(g, 2)}


# kinds that place every video token on the latent grid, refused where tokens follow it (LTX-2's keyframes, references)
_OFF_GRID = ("video_to_image", "frame", "query_frame", "tile", "frame_max", "offset", "pattern_recall", "pattern_error")
_OFF_GRID += ("audio_frame",)

CASES = {
    "cogvideox": Case(
        lambda: cogvideox.tiny_pipeline(num_heads=3),
        _cogvideox_call,
        cogvideox.TINY_TEXT_LEN,
        released=("THUDM/CogVideoX-5b", dict(num_frames=49, height=480, width=720), 226 + 13 * 30 * 45),
    ),
    "cogvideox_v2v": Case(
        lambda: _with_transformer(cogvideox.tiny_pipeline(num_heads=3), "CogVideoXVideoToVideoPipeline"),
        _cogvideox_v2v_call,
        cogvideox.TINY_TEXT_LEN,
        family="cogvideox",
        videos=1,
    ),
    "cogvideox_fun_control": Case(
        lambda: _with_transformer(cogvideox.tiny_pipeline(num_heads=3), "CogVideoXFunControlPipeline", 8),
        _cogvideox_control_call,
        cogvideox.TINY_TEXT_LEN,
        family="cogvideox",
        videos=1,
    ),
    "consisid": Case(
        lambda: FAMILY["consisid"].tiny_pipeline(num_heads=3),
        _consisid_call,
        cogvideox.TINY_TEXT_LEN,
        released=("BestWishYsh/ConsisID-preview", dict(num_frames=49, height=480, width=720), 226 + 13 * 30 * 45),
    ),
    "wan": Case(
        lambda: FAMILY["wan"].tiny_pipeline(num_heads=3),
        _wan_call,
        512,
        skip=("video_to_image",),  # text-to-video: no image context
        released=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dict(num_frames=81, height=480, width=832), 21 * 30 * 52),
    ),
    "lucy_edit": Case(_lucy_edit_pipeline, _lucy_edit_call, 512, skip=("video_to_image",), family="wan", videos=1),
    "wan_v2v": Case(
        lambda: _with_transformer(FAMILY["wan"].tiny_pipeline(num_heads=3), "WanVideoToVideoPipeline"),
        _wan_v2v_call,
        512,
        skip=("video_to_image",),  # no image context
        family="wan",
        videos=1,
    ),
    "wan_vace": Case(
        lambda: FAMILY["wan_vace"].tiny_pipeline(num_heads=3),
        _vace_call,
        512,
        skip=("video_to_image",),  # no image context
        videos=1,
        released=("Wan-AI/Wan2.1-VACE-14B-diffusers", dict(num_frames=81, height=480, width=832), 21 * 30 * 52),
    ),
    "sana_video": Case(  # its cross-attention alone: the self-attention is linear (no softmax)
        lambda: FAMILY["sana_video"].tiny_pipeline(num_heads=3),
        _sana_video_call,
        6,
        released=(
            "Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
            dict(num_frames=81, height=480, width=832),
            21 * 30 * 52,
        ),
    ),
    "sana_video_i2v": Case(
        lambda: FAMILY["sana_video"].tiny_pipeline("image-to-video", num_heads=3),
        _sana_video_call,
        6,
        family="sana_video",
    ),
    "skyreels_v2": Case(
        lambda: FAMILY["skyreels_v2"].tiny_pipeline(num_heads=3),
        _wan_call,
        512,
        skip=("video_to_image",),  # text-to-video: no image context
        released=(
            "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
            dict(num_frames=97, height=544, width=960),
            25 * 34 * 60,
        ),
    ),
    "skyreels_v2_diffusion_forcing": Case(
        _diffusion_forcing_pipeline,
        _diffusion_forcing_call,
        512,
        skip=("video_to_image",),  # text-to-video: no image context
        family="skyreels_v2",
        query_mask=True,
        released=(
            "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
            dict(num_frames=97, height=544, width=960),
            25 * 34 * 60,
        ),
    ),
    "chronoedit": Case(
        lambda: FAMILY["chronoedit"].tiny_pipeline(num_heads=3),
        _chronoedit_call,
        512,
        released=("nvidia/ChronoEdit-14B-Diffusers", dict(num_frames=5, height=720, width=1280), 2 * 45 * 80),
    ),
    "wan_animate": Case(
        lambda: FAMILY["wan_animate"].tiny_pipeline(num_heads=3),
        _wan_animate_call,
        512,
        # a 77-frame segment: 20 latent frames after the reference frame
        released=("Wan-AI/Wan2.2-Animate-14B-Diffusers", dict(num_frames=77, height=720, width=1280), 21 * 45 * 80),
    ),
    "minimax_h3": Case(
        lambda: FAMILY["minimax_h3"].tiny_pipeline(num_heads=3),
        _minimax_h3_call,
        5,
        videos=1,
        # 42 latent frames of 24×42 patches at 768×1344, after 128 prompt and 2·235 audio tokens
        released=("MiniMaxAI/MiniMax-H3", dict(num_frames=141, height=768, width=1344), 42 * 24 * 42 + 128 + 470),
    ),
    "mochi": Case(
        lambda: FAMILY["mochi"].tiny_pipeline(num_heads=3),
        _mochi_call,
        6,
        released=("genmo/mochi-1-preview", dict(num_frames=163, height=480, width=848), 28 * 30 * 53 + 256),
    ),
    "motif_video": Case(
        lambda: FAMILY["motif_video"].tiny_pipeline(num_heads=3),
        _motif_video_call,
        8,
        # 31·46·80 video tokens at 1280×736, then 512 text tokens
        released=(
            "Motif-Technologies/Motif-Video-2B",
            dict(num_frames=121, height=736, width=1280),
            31 * 46 * 80 + 512,
        ),
    ),
    "hunyuan_video": Case(
        lambda: FAMILY["hunyuan_video"].tiny_pipeline(num_heads=3),
        _hunyuan_video_call,
        6,
        released=(
            "hunyuanvideo-community/HunyuanVideo",
            dict(num_frames=129, height=720, width=1280),
            33 * 45 * 80 + 256,
        ),
    ),
    "hunyuan_video_i2v": Case(  # token_replace: 144 image tokens lead the text
        lambda: FAMILY["hunyuan_video"].tiny_pipeline("image-to-video", num_heads=3),
        _hunyuan_video_i2v_call,
        8,  # max_sequence_length
        released=(
            "hunyuanvideo-community/HunyuanVideo-I2V",
            dict(num_frames=129, height=720, width=1280),
            33 * 45 * 80 + 144 + 252,
        ),
        family="hunyuan_video",
    ),
    "hunyuan_video_i2v_latent_concat": Case(  # 288 image tokens lead the text
        lambda: FAMILY["hunyuan_video"].tiny_pipeline(
            "image-to-video", image_condition_type="latent_concat", num_heads=3
        ),
        _hunyuan_video_i2v_call,
        8,
        released=(
            "hunyuanvideo-community/HunyuanVideo-I2V-33ch",
            dict(num_frames=129, height=720, width=1280),
            33 * 45 * 80 + 288 + 252,
        ),
        family="hunyuan_video",
    ),
    "hunyuan_skyreels_i2v": Case(  # the image's latent on channels: 2 × 4 input channels
        lambda: _with_transformer(
            FAMILY["hunyuan_video"].tiny_pipeline(num_heads=3), "HunyuanSkyreelsImageToVideoPipeline", 8
        ),
        _hunyuan_skyreels_i2v_call,
        6,
        family="hunyuan_video",
    ),
    "hunyuan_video_framepack": Case(
        lambda: FAMILY["hunyuan_video_framepack"].tiny_pipeline(num_heads=3),
        _hunyuan_video_framepack_call,
        6,
        # one section at 832×480: 3,926 history + 9·52·30 window tokens, 729 image + 256 text tokens
        released=("lllyasviel/FramePackI2V_HY", dict(num_frames=33, height=832, width=480), 3926 + 14040 + 729 + 256),
    ),
    "hunyuan_video15": Case(
        lambda: FAMILY["hunyuan_video15"].tiny_pipeline(num_heads=3),
        _hunyuan_video15_call,
        40,  # 16 image + 16 ByT5 + 8 Qwen tokens, packed per item
        released=(
            "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
            dict(num_frames=121, height=480, width=848),
            31 * 30 * 53 + 1985,
        ),
    ),
    "hunyuan_video15_i2v": Case(
        lambda: FAMILY["hunyuan_video15"].tiny_pipeline("image-to-video", num_heads=3),
        _hunyuan_video15_call,
        40,
        family="hunyuan_video15",
        released=(
            "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
            dict(num_frames=121, height=480, width=848),
            31 * 30 * 53 + 1985,
        ),
    ),
    "ltx_video": Case(
        lambda: FAMILY["ltx_video"].tiny_pipeline(num_heads=3),
        _ltx_video_call,
        6,
        skip=("video_to_image",),
        released=("Lightricks/LTX-Video-0.9.7-dev", dict(num_frames=161, height=512, width=768), 21 * 16 * 24),
    ),
    "ltx_video_i2v": Case(
        lambda: FAMILY["ltx_video"].tiny_pipeline("image-to-video", num_heads=3),
        _ltx_video_call,
        6,
        skip=("video_to_image",),
        family="ltx_video",
    ),
    "ltx_condition": Case(
        lambda: _with_transformer(FAMILY["ltx_video"].tiny_pipeline(num_heads=3), "LTXConditionPipeline"),
        _ltx_condition_call,
        6,
        skip=("video_to_image",),
        family="ltx_video",
        videos=1,
    ),
    "ltx2": Case(
        lambda: FAMILY["ltx2"].tiny_pipeline(num_heads=3, head_dim=12),
        _ltx2_call,
        8,
        skip=("video_to_image",),
        released=("Lightricks/LTX-2", dict(num_frames=121, height=512, width=768), 16 * 16 * 24),
    ),
    "ltx2_i2v": Case(
        lambda: FAMILY["ltx2"].tiny_pipeline("image-to-video", num_heads=3, head_dim=12),
        _ltx2_call,
        8,
        skip=("video_to_image",),
        family="ltx2",
    ),
    "ltx2_condition": Case(
        lambda: _with_transformer(FAMILY["ltx2"].tiny_pipeline(num_heads=3, head_dim=12), "LTX2ConditionPipeline"),
        _ltx2_condition_call,
        8,
        skip=("video_to_image",),
        family="ltx2",
        videos=1,
    ),
    "ltx2_keyframe": Case(
        lambda: _with_transformer(FAMILY["ltx2"].tiny_pipeline(num_heads=3, head_dim=12), "LTX2ConditionPipeline"),
        _ltx2_keyframe_call,
        8,
        skip=_OFF_GRID,
        family="ltx2",
        videos=1,
        extras_last=True,
    ),
    "ltx2_in_context": Case(
        lambda: _with_transformer(FAMILY["ltx2"].tiny_pipeline(num_heads=3, head_dim=12), "LTX2InContextPipeline"),
        _ltx2_in_context_call,
        8,
        skip=_OFF_GRID,
        family="ltx2",
        videos=1,
        extras_last=True,
    ),
    "ltx2_in_context_bias": Case(
        lambda: _with_transformer(FAMILY["ltx2"].tiny_pipeline(num_heads=3, head_dim=12), "LTX2InContextPipeline"),
        lambda pipe, g, guided: _ltx2_in_context_call(pipe, g, guided, strength=0.9998),  # a bias of −2: no mask
        8,
        skip=_OFF_GRID,
        family="ltx2",
        videos=1,
        query_mask=True,
        extras_last=True,
    ),
    "allegro": Case(
        lambda: FAMILY["allegro"].tiny_pipeline(num_heads=3),
        _allegro_call,
        6,
        skip=("video_to_image",),
        released=("rhymes-ai/Allegro", dict(num_frames=88, height=720, width=1280), 22 * 45 * 80),
    ),
    "anyflow": Case(
        lambda: FAMILY["anyflow"].tiny_pipeline(num_heads=3),
        _anyflow_call,
        512,
        skip=("video_to_image",),  # AnyFlowPipeline passes no image
        released=("nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers", dict(num_frames=81, height=480, width=832), 21 * 30 * 52),
    ),
    "cosmos": Case(  # Predict2 video-to-world
        lambda: FAMILY["cosmos"].tiny_pipeline(num_heads=3),
        _cosmos_call,
        8,
        skip=("video_to_image",),
        released=("nvidia/Cosmos-Predict2-2B-Video2World", dict(num_frames=93, height=704, width=1280), 24 * 44 * 80),
    ),
    "cosmos_t2v": Case(  # Predict1 text-to-world
        lambda: FAMILY["cosmos"].tiny_pipeline("text-to-video", num_heads=3),
        _cosmos_call,
        8,
        skip=("video_to_image",),
        family="cosmos",
        released=(
            "nvidia/Cosmos-1.0-Diffusion-7B-Text2World",
            dict(num_frames=121, height=704, width=1280),
            16 * 44 * 80,
        ),
    ),
    "cosmos_v2w": Case(  # Predict1 video-to-world: the text-to-world transformer taking the condition mask too
        lambda: _with_transformer(
            FAMILY["cosmos"].tiny_pipeline("text-to-video", num_heads=3), "CosmosVideoToWorldPipeline", 17
        ),
        _cosmos_call,
        8,
        skip=("video_to_image",),
        family="cosmos",
    ),
    "kandinsky5": Case(
        lambda: FAMILY["kandinsky5"].tiny_pipeline(num_heads=3),
        _kandinsky5_call,
        6,
        skip=("video_to_image",),
        released=(  # 121 frames of 512×768: 31 latent frames of 32×48 patches
            "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
            dict(num_frames=121, height=512, width=768),
            31 * 32 * 48,
        ),
    ),
    "kandinsky5_i2v": Case(
        lambda: FAMILY["kandinsky5"].tiny_pipeline("image-to-video", num_heads=3),
        _kandinsky5_call,
        6,
        skip=("video_to_image",),
        family="kandinsky5",
        released=(
            "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers",
            dict(num_frames=121, height=512, width=768),
            31 * 32 * 48,
        ),
    ),
    "kandinsky6": Case(  # video and audio: 3 video heads, 2 audio heads
        lambda: FAMILY["kandinsky6"].tiny_pipeline(num_heads=3),
        _kandinsky6_call,
        8,
        skip=("video_to_image",),
        released=(  # 121 frames of 512×768: 31 latent frames of 32×48 patches
            "kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers",
            dict(num_frames=121, height=512, width=768),
            31 * 32 * 48,
        ),
    ),
    "kandinsky6_i2v": Case(  # the image's latent frame after the video's: its tokens off the grid
        lambda: FAMILY["kandinsky6"].tiny_pipeline("image-to-video", num_heads=3),
        _kandinsky6_i2v_call,
        8,
        skip=_OFF_GRID,
        family="kandinsky6",
        extras_last=True,
    ),
    "cosmos25_transfer": Case(  # Transfer2.5: the cross-attention's text and image branches, and a control net
        lambda: _cosmos25_pipeline(True),
        _cosmos25_call,
        8,
        family="cosmos",
        released=("nvidia/Cosmos-Transfer2.5-2B", dict(num_frames=93, height=704, width=1280), 24 * 44 * 80),
    ),
    "cosmos25_predict": Case(  # Predict2.5 text-to-world: Predict2's attention, Qwen2.5-VL's text
        lambda: _cosmos25_pipeline(False),
        _cosmos25_call,
        8,
        skip=("video_to_image",),
        family="cosmos",
        released=("nvidia/Cosmos-Predict2.5-2B", dict(num_frames=93, height=704, width=1280), 24 * 44 * 80),
    ),
    "cosmos25_v2w": Case(  # Predict2.5 video-to-world: conditioning latent frames at their own timestep
        lambda: _cosmos25_pipeline(False),
        _cosmos25_v2w_call,
        8,
        skip=("video_to_image",),
        family="cosmos",
        videos=1,
    ),
    "cosmos3": Case(
        lambda: FAMILY["cosmos3"].tiny_pipeline(),
        _cosmos3_call,
        27,
        videos=1,
        query_mask=True,
        join=_cosmos3_join,
        released=("nvidia/Cosmos3-Nano", dict(num_frames=189, height=720, width=1280), 256 + 48 * 23 * 40),
    ),
    "latte": Case(
        lambda: FAMILY["latte"].tiny_pipeline(num_heads=3),
        _latte_call,
        8,
        skip=("video_to_image",),
        query_mask=True,
        join=_latte_join,
        join_context=True,
        latent="latents",  # LattePipeline's before diffusers 0.33 (0.32's); later ones take it too, deprecated
        released=("maxin-cn/Latte-1", dict(num_frames=16, height=512, width=512), 16 * 32 * 32),
    ),
    "easyanimate": Case(
        lambda: FAMILY["easyanimate"].tiny_pipeline(num_heads=3),
        _easyanimate_call,
        7,
        released=("alibaba-pai/EasyAnimateV5.1-12b-zh", dict(num_frames=49, height=512, width=512), 256 + 13 * 32 * 32),
    ),
    "helios": Case(
        lambda: FAMILY["helios"].tiny_pipeline(num_heads=3),
        _helios_call,
        512,
        # a chunk at 384×640: 9·24·40 window tokens after 1,920 + 240 + 240 history tokens
        released=("BestWishYsh/Helios-Base", dict(num_frames=129, height=384, width=640), 8640 + 2400),
    ),
    "helios_i2v": Case(
        lambda: FAMILY["helios"].tiny_pipeline("image-to-video", num_heads=3),
        _helios_i2v_call,
        512,
        family="helios",
    ),
    "helios_v2v": Case(
        lambda: FAMILY["helios"].tiny_pipeline(num_heads=3),
        _helios_v2v_call,
        512,
        family="helios",
        videos=1,
    ),
}
FAMILY = {spec.family: spec for spec in FAMILIES}
MODES = [("rows", "stock"), ("sdpa", "stock"), ("sdpa", "lse"), ("auto", "joint")]
# Pipelines whose attention runs another case's processor class (and kind of key mask): their own calls and layouts
# under row tiles; the other methods and the opt-in output call are that class's, which that case runs
ROWS_ONLY = {
    "cogvideox_v2v": "cogvideox",
    "cogvideox_fun_control": "cogvideox",
    "consisid": "cogvideox",
    "wan_v2v": "wan",
    "sana_video_i2v": "sana_video",
    "hunyuan_skyreels_i2v": "hunyuan_video",
    "lucy_edit": "wan",
    "wan_vace": "wan",
    "chronoedit": "wan",
    "wan_animate": "wan",
    "skyreels_v2_diffusion_forcing": "skyreels_v2",
    "hunyuan_video_i2v_latent_concat": "hunyuan_video_i2v",
    "hunyuan_video15_i2v": "hunyuan_video15",
    "ltx_video_i2v": "ltx_video",
    "ltx_condition": "ltx_video",
    "ltx2_i2v": "ltx2",
    "ltx2_condition": "ltx2",
    "ltx2_in_context": "ltx2_keyframe",
    "cosmos_t2v": "cosmos",
    "cosmos_v2w": "cosmos",
    "helios_i2v": "helios",
    "helios_v2v": "helios",
    "kandinsky5_i2v": "kandinsky5",
    "kandinsky6_i2v": "kandinsky6",
    "cosmos25_predict": "cosmos",
    "cosmos25_v2w": "cosmos",
}


def _spec(name):
    """The family spec of case ``name``, `None` where this diffusers lacks it."""
    return FAMILY.get(CASES[name].family or name)


def test_every_registered_family_has_a_case():
    assert set(FAMILY) <= set(CASES), f"add a Case for {set(FAMILY) - set(CASES)} to tests/test_families.py"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipes():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = CASES[family].make()
        return cache[family]

    return get


@pytest.fixture(scope="module")
def references(pipes):
    """:func:`stock_reference` of each case's guided call, once for the methods that compare with it."""
    cache = {}

    def get(family):
        if family not in cache:
            with pytest.MonkeyPatch.context() as monkeypatch:
                cache[family] = stock_reference(pipes(family), family, True, monkeypatch)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def same_reference():
    """``naive_kind`` (and ``top_p``'s sort) of the references' probabilities computed once per call for the module:
    the four output modes of a family compare with the same numbers (the call and its tensors are the key; they are
    kept alive with it)."""
    import cogattn.reference

    memo = {}

    def once(real):
        def call(P, *args, **kwargs):
            def key(x):
                return id(x) if torch.is_tensor(x) else tuple(x) if isinstance(x, list) else x

            at = (real.__name__, id(P), tuple(map(key, args)), tuple((n, key(x)) for n, x in kwargs.items()))
            if at not in memo:
                memo[at] = (P, kwargs, real(P, *args, **kwargs))
            return memo[at][2]

        return call

    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("naive_kind", "_sorted_mass"):
            monkeypatch.setattr(cogattn.reference, name, once(getattr(cogattn.reference, name)))
        monkeypatch.setitem(globals(), "naive_kind", cogattn.reference.naive_kind)
        yield
    memo.clear()


def generate(pipe, family, guided, seed=0, output_type="pt"):
    """The case's call; ``output_type="latent"`` where the test looks at no video (no VAE decode)."""
    g = torch.Generator().manual_seed(seed)
    output_type = CASES[family].latent if output_type == "latent" else output_type
    call = {"output_type": output_type, **CASES[family].call(pipe, g, guided)}  # a case may keep its latents
    out = pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(seed + 1))
    if not hasattr(out, "frames"):  # Cosmos 3's output names it `video`
        out.frames = out.video
    return out


def stock_reference(pipe, family, guided, monkeypatch, run=None):
    """The stock video and, per step and layer, the reference probabilities over the results' batch
    ``[uncond..., cond...]``, each proved against the output of the attention call it came from:
    ``ref[(step, layer, "self")]`` is one ``(1, H, S_b, S_b)`` per batch item (S_b < S where the model
    drops an item's padded text, as Mochi does, attending over each item alone), ``ref[(step, layer,
    "context")]`` the cross-attention's calls in order (``(B, H, V, C)`` each), and ``ref[("mask", ...)]``
    the ``(B, S)`` keys each item keeps, ``ref[("value", ...)]`` each item's values ``(1, H, S_b, D)``. ``run``: the pipeline call, when not the case's."""
    spec = _spec(family)
    spy = AttentionSpy(pipe, spec, monkeypatch)
    try:
        video = (run or (lambda: generate(pipe, family, guided)))().frames
    finally:
        spy.remove()
        monkeypatch.undo()
    calls = spec.guidance_calls if guided else 1
    ref = {}
    for n, seen in enumerate(spy.calls):
        step, call = divmod(n, calls)
        for (layer, role), found in seen.items():
            joins = CASES[family].join and (role == "self" or CASES[family].join_context)
            found = CASES[family].join(found) if joins else found
            probs, keeps, values = [], [], []
            for q, k, v, mask, out in [item for found_call in found for item in _per_item(*found_call)]:
                P = spy_probs(q, k, mask)
                err = (P @ v.double() - out.double()).abs().max().item()
                assert err < 1e-5, (family, n, layer, role, err)  # the reference is the model's attention
                probs.append(P)
                values.append(v)
                if mask is None or (mask.dtype != torch.bool and mask.shape[-2] > 1):  # none, or a bias: every key
                    keeps.append(torch.ones(q.shape[0], k.shape[2], dtype=torch.bool))
                else:  # (B, S) keys each item keeps, or (B, S, S) under a query-key mask
                    keeps.append(mask[:, 0, 0] if mask.shape[-2] == 1 else mask[:, 0].expand(q.shape[0], -1, -1))
            if role == "self":  # one P per item: a batched call's items, or a call per item
                probs = [P[b : b + 1] for P in probs for b in range(P.shape[0])]
                keeps = [keep[b] for keep in keeps for b in range(keep.shape[0])]
                values = [v[b : b + 1] for v in values for b in range(v.shape[0])]
            key = (step, layer, role)
            # the results' batch is [uncond..., cond...]: a step's later (unconditional) call goes first
            if key not in ref:
                ref[key], ref[("mask", *key)], ref[("value", *key)] = probs, keeps, values
            elif role == "self":
                ref[key], ref[("mask", *key)] = probs + ref[key], keeps + ref[("mask", *key)]
                ref[("value", *key)] = values + ref[("value", *key)]
            else:
                ref[key] = [torch.cat([p, r]) for p, r in zip(probs, ref[key])]
    assert ref, "the spy saw no attention call: nothing would be compared"
    return video, ref


def _per_item(q, k, v, mask, out):
    """A spied call whose query-key mask is ``keep ⊗ keep``, ``keep`` a prefix of each item's tokens (HunyuanVideo
    1.5's: a padded token neither attends nor is attended), as one unmasked call per item over its kept tokens,
    as Mochi's processor makes them; any other call as it is."""
    if mask is None or mask.shape[-2] == 1 or mask.dtype != torch.bool:  # a bias (IC-LoRA's) too
        return [(q, k, v, mask, out)]
    keep = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # (B, S): the tokens that attend themselves
    counts = keep.sum(-1)
    prefix = torch.arange(keep.shape[-1]) < counts[:, None]
    if not (torch.equal(keep, prefix) and torch.equal(mask[:, 0], keep[:, :, None] & keep[:, None, :])):
        return [(q, k, v, mask, out)]
    return [
        (q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None, out[b : b + 1, :, :n])
        for b, n in enumerate(counts.tolist())
    ]


def _item_kind(P, kind, lay, tokens, shape, v=None):
    """The reference of ``kind`` for one item's ``P`` ``(1, H, S_b, S_b)`` (and values ``v`` ``(1, H, S_b, D)``),
    in the recorded ``shape`` of one item: an item attending over fewer tokens (its padded text dropped) has the
    layout's text shortened by as many, and zeros where its rows and columns would be."""
    T = lay.text_len - (lay.seq_len - P.shape[-1])
    text_at_end = lay.text_position == "end"
    want = naive_kind(P, kind, T, lay.grid, tokens, text_at_end=text_at_end, v=v, **SIZES)[0]
    full = torch.zeros(shape, dtype=want.dtype)
    full[tuple(slice(0, n) for n in want.shape)] = want
    return full


def _ranked_error(result, items, kind, lay):
    """``kind_error`` of ``top_p`` or ``frame_max`` over the rows each item forms (``P`` ``(1, H, S_b, S_b)``);
    the rows it never forms must hold 0."""
    err = 0.0
    for b, P in enumerate(items):
        n, T = P.shape[-1], lay.text_len - (lay.seq_len - P.shape[-1])
        got = type(result)(*(x[b : b + 1, :, :n] for x in result)) if kind == "frame_max" else result[b : b + 1, :, :n]
        err = max(err, kind_error(got, P, kind, T, lay.grid, text_at_end=lay.text_position == "end", **SIZES))
        rest = (result.values if kind == "frame_max" else result)[b, :, n:]
        err = max(err, rest.abs().max().item() if rest.numel() else 0.0)
    return err


def _padded(P, S):
    """``P`` ``(1, H, S_b, S_b)`` with zero rows and columns up to S."""
    return torch.nn.functional.pad(P, (0, S - P.shape[-1], 0, S - P.shape[-2]))


def _context_probs(contexts, source, lay):
    """The probabilities of the cross-attention call of ``source`` (``"text"`` or ``"image"``) among a layer's
    ``contexts`` ``(B, H, V, C)``, told by their keys (Wan 2.1 image-to-video calls its image branch first, Cosmos
    Transfer2.5 its text branch first)."""
    length = lay.image_len if source == "image" else lay.context_len
    found = [P for P in contexts if P.shape[-1] == length]
    assert len(found) == 1, (source, length, [P.shape for P in contexts])
    return found[0]


def _lead_extras(family, lay, x, dims=(2,)):
    """``x`` with the video tokens after the grid moved first along ``dims`` (the layout's order) where the case's
    model appends them (``Case.extras_last``); as it is otherwise."""
    if not CASES[family].extras_last or not lay.history_len:
        return x
    grid = lay.video_len - lay.history_len
    order = torch.cat([torch.arange(grid, lay.video_len), torch.arange(grid)])
    for dim in dims:
        x = x.index_select(dim, order)
    return x


def _grid_queries(family, lay, P):
    """A cross-attention's ``P`` ``(B, H, V, C)`` of the grid's video queries alone where the case's model appends
    tokens after the grid (their rows are no part of a kind)."""
    if CASES[family].extras_last and P.shape[2] == lay.video_len:
        return P[:, :, : lay.video_len - lay.history_len]
    return P


def _kinds(family):
    return tuple(k for k in _spec(family).kinds() if k not in CASES[family].skip)


def _a_kind(family):
    """One kind the family makes, for a test that needs any: ``entropy``, or the first where it records no
    self-attention (SANA-Video's is linear: its cross-attention alone)."""
    return "entropy" if "entropy" in _kinds(family) else _kinds(family)[0]


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("method, output", MODES)
def test_every_kind_matches_the_reference_of_the_attentions_own_inputs(
    pipes, references, same_reference, family, method, output
):
    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    if family in ROWS_ONLY and method != "rows":
        pytest.skip(f"{family}: the processors and the key masks of {ROWS_ONLY[family]}, whose case runs every method")
    spec, pipe = _spec(family), pipes(family)
    if output != "stock" and not spec.output_call:
        with pytest.raises(ValueError, match="key mask"):
            cogattn.Recording(pipe, kinds=(_a_kind(family),), layer_output=output)
        return
    video, ref = references(family)
    kinds = _kinds(family)
    queries = QUERIES if "query" in kinds else None  # refused where no self-attention is recorded (SANA-Video)
    options = dict(kinds=kinds, batch="all", heads="all", queries=queries, method=method, layer_output=output)
    sizes = {n: x for n, x in SIZES.items() if n != "patterns" or "pattern_recall" in kinds}  # none where refused
    with cogattn.record(pipe, **options, **sizes) as rec:
        got = generate(pipe, family, True).frames
    assert torch.equal(got, video), "capture changed the video"
    # tokens after the grid keep the stock output call (its lse would be in the model's order): "joint" has no sums
    unchecked = CASES[family].query_mask or (CASES[family].extras_last and output == "joint")
    unchecked = unchecked or not spec.kinds("self")  # a cross-attention alone: one exact pass, no method to check
    assert all(c.passed for c in rec.checks) and (method == "rows" or unchecked or rec.checks), rec.checks
    assert len(rec.timesteps) == len({key[0] for key in ref if key[0] not in ("mask", "value")})  # every step recorded
    for step in range(len(rec.timesteps)):
        for layer in range(len(rec.layer_names)):
            lay = rec.layout_of(layer)  # a layer of its own layout (Motif-Video's decoder): its kinds, over its tokens
            tokens = [lay.token_index(*x) if isinstance(x, tuple) else x for x in QUERIES]
            held = kinds if lay == rec.layout else kinds_at(rec.options, rec.layout, lay, spec.context_kinds)
            for kind in set(kinds) - set(held):
                with pytest.raises(cogattn.NotRecordedError):
                    rec.get(kind, step, layer)
            items, values = ref.get((step, layer, "self"), []), ref.get(("value", step, layer, "self"), [])
            items = [_lead_extras(family, lay, P, (2, 3)) for P in items]
            values = [_lead_extras(family, lay, v) for v in values]
            for kind in held:
                if spec.source(kind) == "text" and (step, layer, "context") not in ref:  # no text attention there
                    with pytest.raises(cogattn.NotRecordedError):  # (Latte's temporal layers)
                        rec.get(kind, step, layer)
                    continue
                result = rec.get(kind, step, layer)
                source = spec.source(kind)
                if kind == "topk":
                    assert_topk(result, torch.cat([_padded(P, lay.seq_len) for P in items]), 1e-5)
                    continue
                if kind in ("top_p", "frame_max"):  # counts within p ± 1e-6; each group's largest key
                    assert _ranked_error(result, items, kind, lay) <= 1e-5, (family, kind, step, layer)
                    continue
                if source == "self":
                    want = torch.stack(
                        [_item_kind(P, kind, lay, tokens, result.shape[1:], v) for P, v in zip(items, values)]
                    )
                elif (step, layer, source) in ref:  # an attention of its own (LTX-2's audio stream), one call a step
                    want = naive_audio(
                        _grid_queries(family, lay, torch.cat(ref[(step, layer, source)])), kind, lay.grid
                    )
                else:
                    P = _grid_queries(family, lay, _context_probs(ref[(step, layer, "context")], source, lay))
                    want = naive_context(P, lay.grid)
                assert result.shape == want.shape, (kind, result.shape, want.shape)
                err = (result.double() - want).abs()
                if kind == "received":  # a sum over the queries: within 1e-5 of max(1, its mass) (docs/kinds.md's
                    err = err / want.clamp(min=1)  # bound, without its max(1, |lse|) factor)
                err = err.max().item()
                assert err <= (1e-4 if kind == "entropy" else 1e-5), (family, kind, step, layer, err)


@pytest.mark.parametrize("family", list(CASES))
def test_masked_keys_take_exactly_zero_and_unguided_calls_are_recorded(pipes, family, monkeypatch):
    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    pipe = pipes(family)
    video, ref = stock_reference(pipe, family, False, monkeypatch)
    own = _spec(family).kinds("self")  # none for a cross-attention alone (SANA-Video: tests/test_sana_video.py)
    kinds = ("full", "received", *{"frame"} & set(_kinds(family))) if own else (_a_kind(family),)
    with cogattn.record(pipe, kinds=kinds, batch="all", heads="all") as rec:
        got = generate(pipe, family, False).frames
    assert torch.equal(got, video)
    assert rec.batch_items == tuple(range(CASES[family].videos))  # no guidance: the videos, one call per step
    if not own:
        return
    masked = 0
    for key, keeps in ref.items():
        if key[0] != "mask" or key[3] != "self":
            continue
        _, step, layer, _ = key
        full, received = rec.get("full", step, layer), rec.get("received", step, layer)
        if keeps[0].dim() == 2:  # a query-key mask, (S, S) per item: each query's masked keys
            dropped = ~torch.stack(keeps)
            assert bool((full.masked_select(dropped[:, None]) == 0).all()), "a masked key got attention"
            masked += int(dropped.sum())
            continue
        dropped = torch.ones(len(keeps), rec.layout_of(layer).seq_len, dtype=torch.bool)  # (B, S): keys none attends
        for b, keep in enumerate(keeps):
            dropped[b, : len(keep)] = ~keep
        assert bool((full.masked_select(dropped[:, None, None, :]) == 0).all()), "a masked key got attention"
        assert bool((received.masked_select(dropped[:, None, :]) == 0).all())
        masked += int(dropped.sum())
    assert masked or _spec(family).output_call, "the tiny call of a family with a key mask should pad some text"
    # the recording says each video's valid text, where a mask keeps fewer than T tokens
    V, keeps = rec.layout.video_len, ref[("mask", 0, 0, "self")]
    valid = tuple(int(keep.sum()) - V for keep in keeps)
    key_mask = masked and not CASES[family].query_mask
    assert rec.text_lengths == (valid if key_mask else None), (rec.text_lengths, valid)


@pytest.mark.parametrize("family", list(CASES))
def test_refusals_and_estimates(pipes, family):
    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    spec, pipe, case = _spec(family), pipes(family), CASES[family]
    for kind in spec.refused:
        patterns = {"patterns": ("spatial",)} if kind.startswith("pattern_") else {}  # refused without them first
        patterns.update({"queries": [0]} if kind == "query" else {})  # refused without them first (SANA-Video's)
        with pytest.raises(ValueError, match=f"kind '{kind}' does not exist for {spec.family}"):
            cogattn.Recording(pipe, kinds=(kind,), **patterns)
    with pytest.raises(ValueError, match="name no layer"):
        cogattn.Recording(pipe, kinds=(_a_kind(family),), layers=["no_such_blocks.0.attn"])
    if spec.guidance_argument == "true_cfg_scale":  # HunyuanVideo: the conditional half exists under true CFG
        with (
            pytest.raises(ValueError, match="true_cfg_scale <= 1"),
            cogattn.record(pipe, kinds=("entropy",), batch="cond"),
        ):
            generate(pipe, family, False, output_type="latent")
    # the estimate of a released checkpoint: its sequence, from the released config alone
    if case.released:
        name, call, seq_len = case.released
        est = cogattn.estimate(name, **call, num_inference_steps=50, kinds=(_a_kind(family),), dtype="bfloat16")
        assert est.layout.seq_len == seq_len and f"S = {seq_len:,}" in est.table()
    if case.extras_last:  # the estimate plans the grid; tokens after it come with a call (tests/test_ltx2.py)
        return
    # the estimate of the tiny pipeline's call: the shapes a recording makes
    kinds = tuple(k for k in ("frame", "entropy", "video_to_text") if k in _kinds(family))
    g = torch.Generator().manual_seed(0)
    frames = case.call(pipe, g, False)
    video = next((frames[k] for k in ("video", "control_video") if frames.get(k) is not None), None)  # its frames
    count = frames.get("frames") or frames.get("video_length")  # SANA's and Latte's name of the count
    est = cogattn.estimate(
        pipe,
        num_frames=frames["num_frames"] if "num_frames" in frames else count or len(video),
        height=frames["height"] if "height" in frames else frames["image"].height,  # an image's pipelines: its size
        width=frames["width"] if "width" in frames else frames["image"].width,
        num_inference_steps=2,
        guidance_scale=1.0,
        text_len=case.text_len,
        kinds=kinds,
        batch=[0],  # the estimate plans a video per call; the tiny call makes two
    )
    with cogattn.record(pipe, kinds=kinds, batch=[0]) as rec:
        generate(pipe, family, False, output_type="latent")
    # the layout, but for the image tokens: the tiny CLIP makes 17 where the released ViT-H/14 makes 257; and
    # HunyuanVideo 1.5's parts and crop, its pipeline's instance sizes, which a plan of another length leaves out
    named = {"image_len": est.layout.image_len}
    if not est.layout.text_parts:
        named.update(text_parts=(), prompt_crop=0)
    assert est.layout == dataclasses.replace(rec.layout, **named)
    recorded = {(k, tuple(rec.get(k, 0, n).shape)) for k, step, n in rec.keys() if step == 0}  # every layout's
    assert recorded == {(k, tuple(shape)) for k, shape, _, _ in est.records}
    # the plan: the same tiles (row tiles under a family's mask over token groups: Latte, Cosmos 3), where the
    # layouts are the same
    assert rec.plan.tiles.method == est.plan.tiles.method
    if est.layout == rec.layout:
        assert rec.plan.peak_extra_memory == est.plan.peak_extra_memory


@pytest.mark.parametrize("family", list(CASES))
def test_layer_names_select_layers(pipes, family):
    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    pipe = pipes(family)
    names = _spec(family).layer_names(pipe.transformer)
    with cogattn.record(pipe, kinds=(_a_kind(family),), layers=[names[-1], 0]) as rec:
        generate(pipe, family, False, output_type="latent")
    assert rec.layer_names == names and sorted({layer for _, _, layer in rec.keys()}) == [0, len(names) - 1]


# a family with a cross-attention, one with per-item key counts, one with its text last, one with history tokens
# made in chunks; every family's quick rows run in .ci/run's plain-install stage (python -m cogattn.selftest --quick
# --strict)
@pytest.mark.parametrize("family", ["wan", "mochi", "hunyuan_video", "helios"])
def test_the_selftest_checks_the_family_and_catches_a_wrong_map(family, monkeypatch):
    """``python -m cogattn.selftest`` records every kind of the family's tiny pipelines with every method
    against the reference of the q and k (and key counts) its processors handed over; a self-attention map
    off by 1e-3 fails it. (CogVideoX's rows are ``tests/test_selftest.py``'s.)"""
    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    from cogattn import selftest
    from cogattn.exact import engine

    # every method for a family with per-item key counts; the others under row tiles (each family's every method
    # is test_every_kind_matches_the_reference_of_the_attentions_own_inputs's; Wan's cross-attention rows under a
    # wrong context pass, tests/test_wan.py's)
    every = family == "mochi"
    rows = selftest.family_rows(_spec(family), torch.device("cpu"), torch.float32, quick=not every)
    checked = [r for r in rows if r.passed is not None]
    assert len(checked) >= (2 if every else 1) and all(r.passed and r.bit_identical for r in checked), rows
    real = engine.capture_items

    def wrong(*args, **kwargs):
        outs, method, probes = real(*args, **kwargs)
        return [o + 1e-3 for o in outs], method, probes

    monkeypatch.setattr(engine, "capture_items", wrong)
    rows = selftest.family_rows(_spec(family), torch.device("cpu"), torch.float32, quick=True)
    assert not any(r.passed for r in rows if r.passed is not None)


def test_a_video_that_changes_part_way_keeps_the_steps_before_and_warns(monkeypatch):
    """ChronoEdit with temporal reasoning drops its reasoning frames after the first steps: the recording
    keeps the steps of the first video, exact, warns, records nothing of the other video, and the output
    stays the stock one."""
    if "chronoedit" not in FAMILY:
        pytest.skip("this diffusers lacks ChronoEdit")
    from diffusers import UniPCMultistepScheduler  # temporal reasoning steps a multistep scheduler

    pipe = FAMILY["chronoedit"].tiny_pipeline()
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)

    def run():
        call = CASES["chronoedit"].call(pipe, torch.Generator().manual_seed(0), True)
        call.update(num_frames=13, enable_temporal_reasoning=True, num_temporal_reasoning_steps=1)
        return pipe(**call, num_inference_steps=3, output_type="pt", generator=torch.Generator().manual_seed(1))

    video, ref = stock_reference(pipe, "chronoedit", True, monkeypatch, run=run)
    with pytest.warns(UserWarning, match="went on with another video after 1 steps of a 2×\\(4, 2, 3\\)"):
        with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
            got = run().frames
    assert torch.equal(got, video) and len(rec.timesteps) == 1 and rec.status == "finished"
    assert {step for _, step, _ in rec.keys()} == {0}
    for layer in range(len(rec.layer_names)):
        want = torch.cat(ref[(0, layer, "self")])
        got = rec.get("full", 0, layer).double()
        assert (got - want).abs().max() <= 1e-5
    with pytest.warns(UserWarning, match="went on with another video"):  # closed by hand: finished too, not short
        by_hand = cogattn.record(pipe, kinds=("frame",))
        run()
        by_hand.close()
    assert by_hand.status == "finished" and len(by_hand.timesteps) == 1
