"""Latte (text-to-video): the map processor, the family's facts and its tiny pipeline (docs/design.md, "The model
seam").

Latte factorises attention over the video. Each of its ``num_layers`` steps runs a spatial block
(``transformer_blocks.i``: a self-attention within each frame, ``(B·F, Hp·Wp, ·)``, then a cross-attention from
the frame to the T5 text) and a temporal block (``temporal_transformer_blocks.i``: a self-attention across the
frames at each patch position, ``(B·Hp·Wp, F, ·)``). The layers interleave the two lists as they run: the spatial
self-attention of block i is layer 2i, the temporal one layer 2i + 1 (``ModelSpec.interleaved``), and the text
kinds are layer 2i's. Every attention runs diffusers' ``AttnProcessor2_0``; :class:`LatteAttnMapProcessor` is
that processor line for line, plus the lines that hand the recording q and k regathered into the video's raster
order ``(B, H, F·Hp·Wp, D)`` with a query-key mask keeping the pairs the model forms (same frame, or same
position), so a map is the ``(S, S)`` attention over every video token, exactly 0 outside the frame or the
position. Capture applies that mask in row tiles: its cost is S² per head where the model's is F·(Hp·Wp)² (or
Hp·Wp·F²).

The pipeline makes one call per step, ``[uncond..., cond...]`` under guidance. Its VAE is an image VAE (8 pixels
per latent pixel, no temporal compression): ``video_length`` frames are as many latent frames, and the transformer
takes exactly its config's ``video_length`` (its temporal position table's length) or 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.transformers.latte_transformer_3d import LatteTransformer3DModel
from diffusers.utils import deprecate

from ..layout import VAE_SPATIAL, TokenLayout
from ..recorder.processor import GroupMask, MapSink, context_bias
from .prompt_text import plain_text
from .spec import ModelSpec, Site, StepTime, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast, tiny_text_encoder, tiny_tokenizer

__all__ = [
    "SPEC",
    "KNOWN",
    "LatteAttnMapProcessor",
    "TEXT_LEN",
    "call_rules",
    "factor_mask",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
    "video_order",
]

TEXT_LEN = 120  # T5 tokens at most (the pipeline's max_length); one prompt is cropped to its own tokens

# Attention shapes of the released checkpoint (its transformer/config.json, as diffusers' Latte pipeline test builds
# it at that size), for plans made offline.
KNOWN: dict[str, dict] = {
    "maxin-cn/Latte-1": {
        "_class_name": "LatteTransformer3DModel",
        "num_attention_heads": 16,
        "attention_head_dim": 72,
        "in_channels": 4,
        "out_channels": 8,
        "num_layers": 28,
        "cross_attention_dim": 1152,
        "caption_channels": 4096,
        "sample_size": 64,
        "patch_size": 2,
        "video_length": 16,
        "norm_type": "ada_norm_single",
    },
}


def video_order(x: torch.Tensor, frames: int, positions: int, spatial: bool) -> torch.Tensor:
    """A factorised call's ``x`` in the video's raster order (token ``f·Hp·Wp + y·Wp + x``): ``(B·F, H, Hp·Wp, D)``
    of a spatial call, or ``(B·Hp·Wp, H, F, D)`` of a temporal one, as ``(B, H, F·Hp·Wp, D)``."""
    if spatial:
        return x.unflatten(0, (-1, frames)).transpose(1, 2).flatten(2, 3)
    return x.unflatten(0, (-1, positions)).permute(0, 2, 3, 1, 4).flatten(2, 3)


def factor_mask(frames: int, positions: int, heads: int, spatial: bool, device) -> GroupMask:
    """The query-key mask of a factorised call over the ``F·Hp·Wp`` video tokens: query and key in one frame
    (spatial) or at one position (temporal); one group per frame or position, ``(1, H, N, N)`` (a view of one
    ``(N, N)`` identity: no copy per head)."""
    tokens = torch.arange(frames * positions, device=device)
    group, n = (tokens // positions, frames) if spatial else (tokens % positions, positions)
    return GroupMask(torch.eye(n, dtype=torch.bool, device=device).expand(1, heads, n, n), group)


class LatteAttnMapProcessor:
    """Drop-in for ``AttnProcessor2_0`` in Latte's attentions (spatial, temporal and text) that also feeds q, k to a
    recording, regathered into the video's order under the mask of the pairs the model forms.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and the role
            (self- or cross-attention) of each module. One instance serves every module.
    """

    def __init__(self, sink: MapSink):
        self.sink = sink
        self._masks: dict[tuple, GroupMask] = {}  # (F, Hp·Wp, H, spatial, device) → its mask, made once

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecation_message = "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error in the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via `cross_attention_kwargs`."
            deprecate("scale", "1.0.0", deprecation_message)

        cross = encoder_hidden_states is not None
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim

        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # scaled_dot_product_attention expects attention_mask shape to be
            # (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        # TODO: add support for attn.scale when we move to Torch 2.1
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        layer = self.sink.layer_to_capture(attn)
        if layer is not None:
            self._capture(layer, query, key, value, attention_mask, cross)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states

    def _capture(self, layer: int, query, key, value, attention_mask, cross: bool) -> None:
        """Hand the recording a call's q and k ``(B·F, H, Hp·Wp, D)`` (spatial, layer 2i, and its text attention) or
        ``(B·Hp·Wp, H, F, D)`` (temporal, layer 2i + 1) as ``(B, H, S, D)`` over the video's tokens."""
        lay = self.sink.layout
        frames, positions = lay.frames, lay.height * lay.width
        spatial = layer % 2 == 0
        if cross:  # the text repeated per frame: each frame's keys are its video's, the first frame's kept
            bias = context_bias(attention_mask, query.shape[0], key.shape[2])
            bias = None if bias is None else bias.unflatten(0, (-1, frames))[:, 0]
            q = video_order(query, frames, positions, True)
            self.sink.capture_context(layer, q, key.unflatten(0, (-1, frames))[:, 0], "text", bias)
            return
        if attention_mask is not None:  # Latte's forward passes none to its self-attentions
            raise ValueError("cogattn captures Latte's self-attentions without a mask; this call passes one.")
        at = (frames, positions, query.shape[1], spatial, query.device)
        if at not in self._masks:
            self._masks[at] = factor_mask(*at)
        q, k = (video_order(x, frames, positions, spatial) for x in (query, key))
        v = video_order(value, frames, positions, spatial) if self.sink.wants_value else None
        self.sink.capture(layer, q, k, None, None, mask=self._masks[at], value=v)


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``LatteTransformer3DModel`` call: latents ``(B, C, F, H,
    W)``, the text ``(B, T, C)`` as the cross-attention's context."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    p = int(config["patch_size"])
    fields = dict(context_len=int(text.shape[-2]), temporal_compression=1)
    return TokenLayout.of_video_latents(hidden.shape, (1, p, p), **fields), hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Latte pipeline call: ``num_frames`` (its ``video_length``) latent frames, 8 × 8 pixels per
    latent pixel, 2 × 2 per patch, and ``text_len`` T5 tokens (at most 120) in the cross-attention."""
    p = int(config.get("patch_size", 2))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        temporal_compression=1,
    )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The transformer's text of ``prompt`` (``ModelSpec.prompt_text``): the tokenizer on the prompt as Latte's
    pipeline prepares it (its caption cleaning, the call's default ``clean_caption=True``), its first ``length``
    tokens: a single prompt's own tokens (the pipeline crops the padding), or the 120 of a batch of prompts."""
    return plain_text(
        pipeline.tokenizer, prompt, length, offsets, lambda p: pipeline._text_preprocessing(p, clean_caption=True)[0]
    )


def call_rules(cfg, config: dict) -> None:
    """The batch tool's Latte rule (``ModelSpec.call_rules``): ``num_frames`` (the call's ``video_length``) is the
    transformer's ``video_length`` or 1, the frames its temporal position table holds."""
    frames = int(config.get("video_length", 16))
    if cfg.num_frames not in (1, frames):
        raise ValueError(
            f"num_frames: {cfg.num_frames!r}; Latte's transformer takes {frames} frames (its config's video_length) "
            f"or 1: use {frames}."
        )


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
TINY_FRAMES = 3  # the tiny transformer's video_length: its calls take 3 frames (or 1)


def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 8, dtype=torch.float32, seed=0):
    """A random ``LatteTransformer3DModel`` at toy size (the released one's kind of blocks), text width 16, 4 latent
    channels (8 out: the learned variance the pipeline drops), patch 2, ``video_length`` 3."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LatteTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=4,
            out_channels=8,
            num_layers=num_layers,
            cross_attention_dim=num_heads * head_dim,
            attention_bias=True,
            sample_size=8,
            patch_size=2,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            caption_channels=TEXT_DIM,
            video_length=TINY_FRAMES,
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``LattePipeline`` at toy size (no download), its VAE compressing as the released one (8 pixels):
    ``video_length=3, height=32, width=48`` gives 3 latent frames of 2×3 patches."""
    from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; Latte is text-to-video.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
        )
    pipe = LattePipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=cast(vae, dtype),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
        scheduler=DDIMScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 6 random text embeddings (the negative's their opposite), 3 frames
    of 32×48 (3×2×3 patches)."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, 6, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt=None, negative_prompt=None, prompt_embeds=emb, negative_prompt_embeds=-emb)
    return dict(call, guidance_scale=7.5 if guided else 1.0, video_length=TINY_FRAMES, height=32, width=48)


SPEC = ModelSpec(
    "latte",
    (LatteTransformer3DModel,),
    (Site("transformer_blocks", "attn1", context="attn2"), Site("temporal_transformer_blocks", "attn1")),
    {AttnProcessor2_0: LatteAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "text_to_video": text_never_queries("Latte"),
        "video_to_image": "Latte has no image attention; its transformer sees the video and the text.",
    },
    output_call=False,  # the model's calls are per frame or per position: capture's exact pass is the masked one
    frame_counts="the transformer's video_length (Latte-1: 16)",
    call_rules=call_rules,
    empty_negative=True,  # under guidance its pipeline preprocesses the negative prompt unguarded
    prompt_text=prompt_text,
    interleaved=True,
    group_masked=lambda config: True,  # the frame or the position
)
