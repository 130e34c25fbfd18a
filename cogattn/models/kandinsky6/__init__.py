"""Kandinsky 6 (``Kandinsky6TI2VAPipeline``: text- and image-to-video with sound): the map processor, the family's
facts and its tiny pipeline (built in ``tiny.py``; docs/design.md, "The model seam").

The transformer first runs its text blocks, a self-attention over the Qwen2.5-VL text per branch (the video's and the
audio's, no capture site), then its fused blocks (``visual_transformer_blocks``), each six ``Kandinsky6Attention``
modules run by ``Kandinsky6AttnProcessor``: the video's self-attention (``video_dec_block.self_attention``, 3-D RoPE)
and cross-attention to its text branch (``video_dec_block.cross_attention``, under the text's padding mask), which a
recording captures as Kandinsky 5's (the self-attention kinds with no text in the sequence, and ``video_to_text``), and
the audio stream's four, each an LTX-2 audio kind: ``audio`` (``audio_dec_block.self_attention``, 1-D RoPE),
``audio_to_text`` (``audio_dec_block.cross_attention``, to the audio's text branch, of the video's length, under the
same mask), ``frame_audio`` (``va_cross_attention``: video queries over audio keys, the video heads) and
``audio_frame`` (``av_cross_attention``: audio queries over video keys, the audio heads). A block's layer is named
by its video self-attention. :class:`Kandinsky6AttnMapProcessor` is the stock processor line for line, plus the
lines that hand q, k and the text's key mask to the recording, each attention under its source.

The latents are channels-last, ``(B, F, H, W, C)``, in patches (1, 2, 2), flattened in the video's raster order. The
text is padded to ``max_sequence_length`` (1024) after the template's crop of 129 tokens, its padding masked (the
pipeline passes no mask where no prompt of the call is padded). The audio is one token per MMAudio latent bin, 1024
samples at 44.1 kHz (43.07 a second; each bin two mel frames, no causal offset: ``AudioAxis`` with ``compression``
1 gives its seconds), as many as cover the video's frames at the call's ``frame_rate`` (read from the running
pipeline call; 24 without one). Image-to-video appends the image's latent frame after the video's (token type 1,
temporal position 0): its tokens are the layout's ``history_len``, off the grid, leading the video in what capture
is handed (as LTX-2's keyframes); the kinds that place every video token on the grid refuse such a call.

Kandinsky 6 SR (``Kandinsky6SRTransformer3DModel``) is not recorded: :data:`SR_REFUSAL` says why.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys

import torch

from ...audio import AudioAxis
from ...layout import TokenLayout
from ...recorder.processor import MapSink, context_bias
from ..prompt_text import PromptText, in_template, kept, tokenize
from ..spec import ModelSpec, Site, Unavailable, call_argument, text_never_queries

# Attention shapes of the released checkpoints (their transformer/config.json, as diffusers' Kandinsky 6 docs list
# them and its conversion carries over: Pro, 32 video heads and 16 audio heads of 128), for plans made offline.
_PRO = {
    "_class_name": "Kandinsky6Transformer3DModel",
    "in_visual_dim": 16,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
    "time_dim": 1024,
    "patch_size": [1, 2, 2],
    "model_dim": 4096,
    "ff_dim": 16384,
    "num_text_blocks": 4,
    "num_visual_blocks": 60,
    "axes_dims": [32, 48, 48],
    "visual_cond": True,
    "in_audio_dim": 40,
    "model_dim_a": 2048,
    "time_dim_a": 1024,
    "ff_dim_a": 7168,
    "axes_dims_a": [32, 48, 48],
    "text_token_padding": True,
    "ca_rope": True,
    "cross_gates": True,
    "fix_modulation": True,
    "visual_token_type_num_embeddings": 2,
}
KNOWN: dict[str, dict] = {f"kandinskylab/Kandinsky-6.0-Pro-{stage}-5s-Diffusers": _PRO for stage in ("sft", "distill")}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_kandinsky6 import (
        Kandinsky6AttnProcessor,
        Kandinsky6Transformer3DModel,
        apply_rotary,
    )
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as _pipeline
except ImportError:
    needs = "Kandinsky 6 needs diffusers >= 0.42 (Kandinsky6Transformer3DModel)"
    raise Unavailable("kandinsky6", needs, KNOWN) from None
try:  # the SR transformer, refused by name
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel as _SR
except ImportError:
    _SR = None
from .tiny import TINY_TEXT_LEN, tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "KNOWN",
    "SOURCES",
    "SR_REFUSAL",
    "Kandinsky6AttnMapProcessor",
    "TEXT_LEN",
    "TINY_TEXT_LEN",
    "audio_axis",
    "audio_shapes",
    "head_shape",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 1024  # the pipeline's max_sequence_length: Qwen tokens after the template's crop
FPS = 24.0  # the pipeline's default frame_rate
AUDIO_RATE = 44100 / 1024  # MMAudio's latent bins a second (44.1 kHz, hop 2 × 512): the pipeline's defaults
VAE_SPATIAL, VAE_TEMPORAL = 8, 4  # HunyuanVideo's VAE
SR_REFUSAL = (
    "Kandinsky 6 SR (Kandinsky6SRTransformer3DModel) is not recorded: it refines tiles of the latent video, not the "
    "video's grid, under NABLA block-sparse flex attention that diffusers runs compiled at video sizes, and cogattn "
    "runs a transformer uncompiled; record the Kandinsky6TI2VAPipeline that makes the video."
)

# block attribute → the source of its maps: the video's self-attention and text cross-attention, the audio stream's four
SOURCES = {
    "video_dec_block.self_attention": "self",
    "video_dec_block.cross_attention": "text",
    "audio_dec_block.self_attention": "audio",
    "audio_dec_block.cross_attention": "audio_text",
    "va_cross_attention": "a2v",
    "av_cross_attention": "v2a",
}
# the audio stream's attentions: source, block attribute, what it is, its kind (a layer is named by the video's)
_AUDIO = (
    ("audio", "audio_dec_block.self_attention", "audio self-attention", "audio"),
    ("audio_text", "audio_dec_block.cross_attention", "audio cross-attention to its text branch", "audio_to_text"),
    ("a2v", "va_cross_attention", "cross-attention of the video queries to the audio", "frame_audio"),
    ("v2a", "av_cross_attention", "cross-attention of the audio queries to the video", "audio_frame"),
)


def _leading_extras(sink: MapSink, length: int, device) -> torch.Tensor | None:
    """The capture's order of a video sequence of ``length``: the reference frame's tokens after the grid (the
    layout's ``history_len``) first, then the grid's; `None` where there are none."""
    extras = sink.layout.history_len
    if not extras:
        return None
    grid = length - extras
    return torch.cat([torch.arange(grid, length, device=device), torch.arange(grid, device=device)])


def _key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A text padding mask as the attention takes it, ``(B, T)`` (the native backend's ``(B, 1, 1, T)``)."""
    return mask[:, None, None] if mask is not None and mask.dim() == 2 else mask


def _capture(sink: MapSink, source: str, layer: int, q, key, value, fused, mask) -> None:
    """Hand a captured call's ``q`` ``(B, H, S, D)`` and ``key``, ``value`` ``(B, S, H, D)`` to ``sink`` by
    ``source``, with the lse and sums of the opt-in output call (``fused``) and the text's key ``mask``: the video
    self-attention's to ``capture``, the others to ``capture_context``. The reference frame's tokens lead the video in
    what capture is handed: the model's output is the stock call's, in the model's order."""
    key = key.transpose(1, 2)
    if source == "self":
        order = _leading_extras(sink, q.shape[2], q.device)
        v = value.transpose(1, 2) if sink.wants_value else None
        if order is not None:
            q, key = q.index_select(2, order), key.index_select(2, order)
            v = None if v is None else v.index_select(2, order)
        lse, sums = (None, None) if fused is None else fused[1:]
        sink.capture(layer, q, key, lse, sums, value=v)
        return
    if source in ("text", "a2v") and (order := _leading_extras(sink, q.shape[2], q.device)) is not None:
        q = q.index_select(2, order)  # video queries: the grid's are the kinds' rows
    if source == "v2a" and (order := _leading_extras(sink, key.shape[2], key.device)) is not None:
        key = key.index_select(2, order)
    sink.capture_context(layer, q, key, source, context_bias(_key_mask(mask), q.shape[0], key.shape[2]))


class Kandinsky6AttnMapProcessor:
    """Drop-in for ``Kandinsky6AttnProcessor`` (each of a fused block's six attentions) that also feeds q, k to a
    recording.

    Args:
        sink (`MapSink`): where maps go.
        source (`str | None`): which attention the module is (a value of :data:`SOURCES`); `None`: read from the
            call (the video's self-attention without a context, else its text cross-attention).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink, source: str | None = None):
        if source is not None and source not in SOURCES.values():
            raise ValueError(f"source={source!r}; a Kandinsky 6 attention is one of {sorted(set(SOURCES.values()))}.")
        self.sink, self.source = sink, source

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        rotary_emb_kv: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        source = self.source or ("self" if encoder_hidden_states is None else "text")
        query = attn.to_query(hidden_states)
        if encoder_hidden_states is None:
            key = attn.to_key(hidden_states)
            value = attn.to_value(hidden_states)
        else:
            key = attn.to_key(encoder_hidden_states)
            value = attn.to_value(encoder_hidden_states)

        query = query.reshape(*query.shape[:-1], attn.num_heads, -1)
        key = key.reshape(*key.shape[:-1], attn.num_heads, -1)
        value = value.reshape(*value.shape[:-1], attn.num_heads, -1)
        query = attn.query_norm(query)
        key = attn.key_norm(key)

        if rotary_emb is not None:
            query = apply_rotary(query, rotary_emb).to(dtype=query.dtype)
        if rotary_emb_kv is not None:
            key = apply_rotary(key, rotary_emb_kv).to(dtype=key.dtype)

        layer = self.sink.layer_to_capture(attn)
        q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them
        fused = None  # the opt-in output call: the video self-attention over the grid alone (no mask)
        if layer is not None and source == "self" and attn_mask is None and not self.sink.layout.history_len:
            fused = self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        if fused is None:
            output = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attn_mask,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        else:
            output = fused[0].transpose(1, 2).to(query.dtype)
        if layer is not None:
            _capture(self.sink, source, layer, q, key, value, fused, attn_mask)

        return attn.out_layer(output.flatten(-2, -1))


def _running_call() -> dict | None:
    """The locals of the running ``Kandinsky6TI2VAPipeline.__call__`` (on the stack at each of its transformer
    calls), `None` outside one (a bare transformer)."""
    code = inspect.unwrap(_pipeline.Kandinsky6TI2VAPipeline.__call__).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return None if frame is None else frame.f_locals


def audio_axis(tokens: int) -> AudioAxis:
    """The audio axis of a call of ``tokens`` latent bins: the running pipeline call's ``frame_rate`` and its audio
    VAE's bins a second (``audio_sample_rate / audio_latent_hop_length``), the pipeline's defaults without one."""
    call = _running_call()
    pipeline = None if call is None else call.get("self")
    fps = FPS if call is None else float(call.get("frame_rate", FPS))
    rate = AUDIO_RATE if pipeline is None else pipeline.audio_sample_rate / pipeline.audio_latent_hop_length
    return AudioAxis(int(tokens), float(rate), 1, fps)


def _reference_frames(types: torch.Tensor | None, frames: int) -> int:
    """The latent frames after the video's that a call appends (image-to-video's image: token type 1), read from its
    ``visual_token_type_ids`` ``(B, F)``; raises `ValueError` where the typed frames are not the last ones."""
    if types is None:
        return 0
    typed = types != 0
    count = int(typed[0].sum())
    last = torch.arange(frames, device=types.device) >= frames - count
    if types.shape[-1] != frames or count == frames or not torch.equal(typed, last.expand_as(typed)):
        raise ValueError(
            f"this Kandinsky 6 call's visual_token_type_ids {types.tolist()} are not the video's frames (type 0) then "
            "the same reference frames in every item, as the pipeline appends an image's; cogattn records those."
        )
    return count


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``Kandinsky6Transformer3DModel`` call: channels-last latents
    ``(B, F, H, W, C)`` in patches of ``patch_size``, the frames of a token type other than 0 after the video's (the
    image's reference frame) as tokens off the grid, the text ``encoder_hidden_states`` ``(B, T, C)`` (both branches
    read it), and the audio axis of ``audio_hidden_states`` ``(B, A, C)`` (`None` without: a video-only call)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 1, "encoder_hidden_states")
    t = call_argument(args, kwargs, 3, "timestep")
    audio = call_argument(args, kwargs, 4, "audio_hidden_states")
    types = call_argument(args, kwargs, 7, "visual_token_type_ids")
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p_t, p_h, p_w = (int(p) for p in config["patch_size"])
    _, frames, height, width, _ = hidden.shape
    grid = (frames // p_t, height // p_h, width // p_w)
    tail = _reference_frames(types, grid[0])
    layout = TokenLayout(
        text_len=0,
        frames=grid[0] - tail,
        height=grid[1],
        width=grid[2],
        patch_size=p_h,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=int(text.shape[1]),
        temporal_compression=VAE_TEMPORAL,
        history_len=tail * grid[1] * grid[2],
        audio=None if audio is None else audio_axis(audio.shape[1]),
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Kandinsky 6 pipeline call at its default 24 frames a second: ``(num_frames − 1) // 4 + 1``
    latent frames of ``height / 16`` × ``width / 16`` patches, ``text_len`` (1024) text tokens in the cross-attentions,
    and the ⌈frames / 24 · 43.07⌉ audio bins the pipeline makes (image-to-video's reference frame comes with a call)."""
    p_t, p, _ = (int(x) for x in config.get("patch_size", (1, 2, 2)))
    layout = TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        p_t if p_t > 1 else None,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        temporal_compression=VAE_TEMPORAL,
    )
    pixels = VAE_TEMPORAL * (layout.frames * (p_t or 1) - 1) + 1  # the frames the pipeline times the audio by
    return dataclasses.replace(layout, audio=AudioAxis(math.ceil(pixels / FPS * AUDIO_RATE), AUDIO_RATE, 1, FPS))


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The ``length`` text tokens the transformer reads for ``prompt`` (``ModelSpec.prompt_text``), as the pipeline's
    ``_get_prompt_embeds`` makes them: the prompt in its chat template, padded and cut to ``length`` tokens after the
    template's first 129 (``_QWEN_CROP_START``), which are cropped: the prompt's tokens, ``<|im_end|>``, padding.
    ``template`` is unused (the call takes none)."""
    tokenizer = getattr(pipeline.tokenizer, "tokenizer", pipeline.tokenizer)  # a Qwen2_5_VLProcessor's own tokenizer
    module = inspect.getmodule(type(pipeline))
    crop = int(getattr(module, "_QWEN_CROP_START", _pipeline._QWEN_CROP_START))
    text = in_template(prompt, getattr(module, "_PROMPT_TEMPLATE", _pipeline._PROMPT_TEMPLATE).format)
    return kept(tokenize(tokenizer, text.text, crop + length, offsets), text, list(range(crop, crop + length)))


def head_shape(config: dict) -> tuple[int, int]:
    """``(heads, head dim)`` of the video's attentions: heads of ``sum(axes_dims)`` channels over ``model_dim``."""
    head_dim = sum(int(a) for a in config["axes_dims"])
    return int(config["model_dim"]) // head_dim, head_dim


def audio_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The audio stream's attentions' ``(heads, head dim)``: the audio heads (``model_dim_a`` over
    ``sum(axes_dims_a)``, each the video's where left out), but the video queries' cross-attention to the audio
    (``va_cross_attention``, ``frame_audio``), which has the video's."""
    dims = config.get("axes_dims_a") or config["axes_dims"]
    head_dim = sum(int(a) for a in dims)
    audio = (int(config.get("model_dim_a") or config["model_dim"]) // head_dim, head_dim)
    return {"audio": audio, "audio_text": audio, "a2v": head_shape(config), "v2a": audio}


class _Spec(ModelSpec):
    """Kandinsky 6's spec, which names the SR transformer's refusal (:data:`SR_REFUSAL`) where it is asked for."""

    def matches(self, module) -> bool:
        if _SR is not None and isinstance(module, _SR):
            raise TypeError(SR_REFUSAL)
        return super().matches(module)

    def matches_config(self, config: dict) -> bool:
        if config.get("_class_name") == "Kandinsky6SRTransformer3DModel":
            raise ValueError(SR_REFUSAL)
        return super().matches_config(config)


SPEC = _Spec(
    "kandinsky6",
    (Kandinsky6Transformer3DModel,),
    (
        Site(
            "visual_transformer_blocks",
            "video_dec_block.self_attention",
            context="video_dec_block.cross_attention",
            count_key="num_visual_blocks",
            others=tuple((source, attr) for source, attr, *_ in _AUDIO),
        ),
    ),
    {Kandinsky6AttnProcessor: Kandinsky6AttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video",),  # image-to-video's image is off the grid, which the self-test's every kind is not
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text", **{kind: source for source, _, _, kind in _AUDIO}},
    refused={
        "text_to_video": text_never_queries("Kandinsky 6"),
        "video_to_image": "Kandinsky 6 has no image attention: an image to animate is a latent frame after the "
        "video's, its tokens in the video's self-attention (off the grid).",
    },
    guidance_calls=2,  # the conditional call, then the negative prompt's
    title="Kandinsky 6",
    frame_counts="5, 9, ..., 121",
    pipelines={"text-to-video": "Kandinsky6TI2VAPipeline", "image-to-video": "Kandinsky6TI2VAPipeline"},
    prompt_text=prompt_text,
    uncaptured={
        attr: f"{what}, no layer of its own: its maps are kind {kind!r} of the block's layer, "
        "visual_transformer_blocks.<i>.video_dec_block.self_attention"
        for _, attr, what, kind in _AUDIO
    },
    head_shape=head_shape,
    source_shapes=audio_shapes,
)
