"""LTX-2: the family's facts, its call reading and its tiny pipelines (docs/design.md, "The model seam").

Each LTX-2 block runs six attentions (``cogattn.models.ltx2.attention``): the video's self-attention (``attn1``) and
cross-attention to its text (``attn2``), which a recording captures as LTX-Video's (the self-attention kinds with no
text in the sequence, and ``video_to_text`` with the text's key bias added as the model adds it), and the audio
stream's four, each its own kind: ``audio`` (its self-attention), ``audio_to_text`` (its text cross-attention, under
the same bias), ``frame_audio`` (video queries over audio keys, per latent frame) and ``audio_frame`` (audio queries
over video keys, per latent frame), all with the audio heads; a block's layer is named by its ``attn1``. The audio
axis is ``TokenLayout.audio`` (one token per latent bin, 25 a second). The per-head output gates act after P·V, so
the maps are the softmax's.

The video sequence is the packed latents, one token per latent pixel (patch size 1), its grid from the call's
``num_frames``, ``height`` and ``width`` (latent sizes); the VAE compresses 32 × 32 pixels and 8 frames after the
first (``vae_scale_factors`` of the transformer's config). The text is the connectors' output: each prompt's valid
tokens first, then learnable registers, every key kept. A step makes one guidance call (``[uncond..., cond...]``
under guidance), then, with the pipeline's defaults, a spatio-temporal guidance call and a modality-isolation call
for the conditional items: those perturb the model and are left out (:func:`extra_call`). Video tokens after the
grid (``LTX2ConditionPipeline``'s keyframes, ``LTX2InContextPipeline``'s IC-LoRA references) are the layout's
``history_len``, leading the video in what capture is handed; the kinds that place every video token on the grid
refuse them. IC-LoRA's ``video_self_attention_mask`` is added as the model adds it (``QueryKeyBias``).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from ...audio import AudioAxis
from ...layout import TokenLayout
from .._checkpoint import pipeline_name
from ..prompt_text import PromptText, kept, tokenize
from ..spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries

# Attention shapes of the released checkpoints (diffusers' defaults, the 19B model), for plans made offline.
_LTX2 = {
    "_class_name": "LTX2VideoTransformer3DModel",
    "patch_size": 1,
    "patch_size_t": 1,
    "in_channels": 128,
    "num_layers": 48,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "vae_scale_factors": [8, 32, 32],
}
KNOWN: dict[str, dict] = {"Lightricks/LTX-2": _LTX2}

try:
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel

    from .attention import PROCESSORS
    from .tiny import tiny_call, tiny_pipeline, tiny_transformer
except ImportError as missing:
    needs = "LTX-2 needs a diffusers with LTX2VideoTransformer3DModel and LTX2PerturbedAttnProcessor (0.42 has them)"
    raise Unavailable("ltx2", needs, KNOWN) from missing

__all__ = ["SPEC", "KNOWN", "PYTHON_ONLY", "TEXT_LEN", "call_rules", "extra_call", "layout_for_video", "read_call"]

TEXT_LEN = 1024  # text tokens of the pipelines' calls (max_sequence_length)
FPS = 24.0  # the pipelines' default frame_rate


def _vae_factors(config) -> tuple[int, int]:
    """``(temporal, spatial)`` compression of the VAE the transformer's positions assume (``vae_scale_factors``)."""
    factors = config.get("vae_scale_factors") or (8, 32, 32)
    return int(factors[0]), int(factors[1])


def audio_axis(config, tokens: int, fps: float) -> AudioAxis:
    """The audio axis of ``tokens`` latent bins of a transformer with ``config`` in a call at ``fps``: bins per second
    and mel frames per bin from its audio sampling rate, hop and scale factor (25 and 4 in every release)."""
    factor = int(config.get("audio_scale_factor", 4))
    rate = config.get("audio_sampling_rate", 16000) / config.get("audio_hop_length", 160) / factor
    return AudioAxis(int(tokens), float(rate), factor, float(fps))


def _audio_of_call(config, args: tuple, kwargs: dict) -> AudioAxis:
    """The call's audio axis: ``audio_hidden_states`` ``(B, A, C)`` and ``fps``; its ``audio_coords``, where given,
    must be the axis' seconds (a shifted window's are not)."""
    audio = call_argument(args, kwargs, 1, "audio_hidden_states")
    if audio is None:
        raise ValueError("cogattn reads LTX-2's audio bins from the call's audio_hidden_states (B, A, C); pass them.")
    fps = call_argument(args, kwargs, 13, "fps")
    axis = audio_axis(config, audio.shape[1], _playback_fps(FPS if fps is None else float(fps)))
    coords = call_argument(args, kwargs, 16, "audio_coords")
    if coords is not None and not torch.allclose(coords[0, 0].double().cpu(), axis.seconds(), atol=1e-5):
        raise ValueError(
            "this LTX-2 call's audio_coords are not the audio bins' seconds from 0 (25 a second, each shifted one mel "
            "frame); cogattn records calls whose audio starts at 0, as the pipelines make them."
        )
    return axis


def _playback_fps(fps: float) -> float:
    """The video's playback frame rate: the running pipeline call's ``frame_rate`` where the transformer's ``fps`` is
    its ``conditioning_frame_rate`` (``frame_rate / motion_speed``: slow motion's positions; the audio's seconds and
    the frames heard with it follow ``frame_rate``), else ``fps`` (a bare transformer call)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__call__" and {"frame_rate", "conditioning_frame_rate"} <= frame.f_locals.keys():
            local = frame.f_locals
            if isinstance(local["conditioning_frame_rate"], (int, float)) and math.isclose(
                local["conditioning_frame_rate"], fps, rel_tol=1e-6
            ):
                return float(local["frame_rate"])
            return fps
        frame = frame.f_back
    return fps


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``LTX2VideoTransformer3DModel`` call: packed video latents
    ``(B, S, C)``, the grid from ``num_frames``, ``height`` and ``width`` (latent sizes), the text of the video's
    cross-attention ``encoder_hidden_states`` ``(B, T, C)``, the audio axis from ``audio_hidden_states`` ``(B, A, C)``
    and ``fps``; image-to-video's timestep per token: its largest. Video tokens after the grid (``LTX2ConditionPipeline``'s
    keyframes, ``LTX2InContextPipeline``'s references) are the layout's ``history_len``: capture's order leads with
    them (:mod:`cogattn.models.ltx2.attention`)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    t = call_argument(args, kwargs, 4, "timestep")
    frames, height, width = (
        call_argument(args, kwargs, i, n) for i, n in ((10, "num_frames"), (11, "height"), (12, "width"))
    )
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    if None in (frames, height, width):
        raise ValueError(
            "cogattn reads LTX-2's grid from the call's num_frames, height and width, as its pipelines pass."
        )
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    grid = (int(frames) // p_t, int(height) // p, int(width) // p)
    extras = hidden.shape[1] - grid[0] * grid[1] * grid[2]  # keyframe and reference tokens after the grid
    if extras < 0:
        raise ValueError(
            f"this LTX-2 call has {hidden.shape[1]} video tokens, fewer than its grid {grid} holds "
            f"({grid[0] * grid[1] * grid[2]}); cogattn reads the grid from num_frames, height and width."
        )
    layout = TokenLayout(
        text_len=0,
        frames=grid[0],
        height=grid[1],
        width=grid[2],
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=int(text.shape[1]),
        temporal_compression=_vae_factors(config)[0],
        audio=_audio_of_call(config, args, kwargs),
        history_len=extras,
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of an LTX-2 pipeline call at its default 24 frames a second: ``(num_frames − 1) // 8 + 1`` latent
    frames of ``height / 32`` × ``width / 32`` latent pixels, ``text_len`` (1024) text tokens in the cross-attentions,
    and ``round(num_frames / 24 · 25)`` audio bins (the pipeline's count)."""
    p, p_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
    temporal, spatial = _vae_factors(config)
    rate = audio_axis(config, 1, FPS).rate
    audio = audio_axis(config, round(int(num_frames) / FPS * rate), FPS)
    layout = TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        p_t if p_t > 1 else None,
        spatial_compression=spatial,
        context_len=text_len or TEXT_LEN,
        temporal_compression=temporal,
    )
    return dataclasses.replace(layout, audio=audio)


def extra_call(args: tuple, kwargs: dict) -> str | None:
    """What perturbs the model in an LTX-2 transformer call, `None` for a call of the model itself: the pipelines'
    spatio-temporal guidance call (``spatio_temporal_guidance_blocks``: those blocks' self-attentions replaced by
    their values) and modality-isolation call (``isolate_modalities``: no audio ↔ video attention)."""
    if kwargs.get("spatio_temporal_guidance_blocks"):
        return "spatio-temporal guidance"
    if kwargs.get("isolate_modalities"):
        return "modality isolation"
    return None


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The transformer's text of ``prompt`` (``ModelSpec.prompt_text``): Gemma's tokenizer on the stripped prompt,
    left-padded to ``length`` as the pipeline pads it; where the connectors have learnable registers (every release)
    they move the valid tokens first and fill the rest with registers, which keep the padding's label."""
    tokenizer, prompt = pipeline.tokenizer, prompt.strip()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        if tokenizer.pad_token is None:  # as the pipeline's _get_gemma_prompt_embeds sets it
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenize(tokenizer, prompt, length, offsets)
    finally:
        tokenizer.padding_side = side
    valid = [i for i, m in enumerate(enc["attention_mask"]) if m]
    keep = None
    if getattr(pipeline.connectors.video_connector, "learnable_registers", None) is not None:
        keep = valid + [i for i in range(len(enc["input_ids"])) if i not in set(valid)]
    return kept(enc, PromptText([], prompt, (0, len(prompt))), keep)


# the audio stream's attentions: source, block attribute, what it is, its kind (a layer is named by its attn1)
_AUDIO = (
    ("audio", "audio_attn1", "audio self-attention", "audio"),
    ("audio_text", "audio_attn2", "audio cross-attention to the text", "audio_to_text"),
    ("a2v", "audio_to_video_attn", "cross-attention of the video queries to the audio", "frame_audio"),
    ("v2a", "video_to_audio_attn", "cross-attention of the audio queries to the video", "audio_frame"),
)


def _audio_shapes(config) -> dict[str, tuple[int, int]]:
    """The audio attentions' ``(heads, head dim)``: the audio stream's (the cross-modal ones' too)."""
    shape = int(config["audio_num_attention_heads"]), int(config["audio_attention_head_dim"])
    return dict.fromkeys((source for source, *_ in _AUDIO), shape)


# pipelines whose calls take conditions a config cannot give (keyframes, IC-LoRA's reference videos and adapter)
PYTHON_ONLY = ("LTX2ConditionPipeline", "LTX2InContextPipeline")


def call_rules(cfg, config: dict) -> None:
    """The batch tool's LTX-2 rule (``ModelSpec.call_rules``): a checkpoint whose ``model_index.json`` names a pipeline
    of :data:`PYTHON_ONLY` is refused; the batch tool runs ``LTX2Pipeline`` and ``LTX2ImageToVideoPipeline`` and
    passes no keyframe or reference conditions from a config."""
    name = pipeline_name(cfg.model)
    if name in PYTHON_ONLY:
        raise ValueError(
            f"model: {cfg.model} is a {name} checkpoint; the batch tool runs LTX2Pipeline and "
            f"LTX2ImageToVideoPipeline and passes no keyframe or reference conditions from a config: record {name} "
            "from Python with cogattn.record."
        )


def _guidance(pipeline) -> bool | None:
    """Whether the running call batches ``[uncond..., cond...]``: either stream's guidance scale above 1."""
    try:
        return bool(pipeline.do_classifier_free_guidance)
    except AttributeError:  # set by the pipeline's call; not there before it
        return None


SPEC = ModelSpec(
    "ltx2",
    (LTX2VideoTransformer3DModel,),
    (Site("transformer_blocks", "attn1", context="attn2", others=tuple((s, attr) for s, attr, *_ in _AUDIO)),),
    {stock: ours for stock, ours in PROCESSORS.items()},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text", **{kind: source for source, _, _, kind in _AUDIO}},
    refused={
        "text_to_video": text_never_queries("LTX-2"),
        "video_to_image": "LTX-2 has no image attention: an image to animate is the video's first latent frame.",
    },
    guidance=_guidance,
    title="LTX-2",
    frame_counts="9, 17, ..., 121, ..., 257",
    pipelines={"text-to-video": "LTX2Pipeline", "image-to-video": "LTX2ImageToVideoPipeline"},
    extra_call=extra_call,
    prompt_text=prompt_text,
    call_rules=call_rules,
    uncaptured={
        attr: f"{what}, no layer of its own: its maps are kind {kind!r} of the block's layer, transformer_blocks.<i>.attn1"
        for _, attr, what, kind in _AUDIO
    },
    source_shapes=_audio_shapes,
)
