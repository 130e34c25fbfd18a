"""Allegro (text-to-video): the map processor, the family's facts and its tiny pipeline (docs/design.md, "The model
seam").

Allegro's 32 blocks have a self-attention over the video alone (``attn1``, 3-D RoPE) and a cross-attention from the
video to the T5 text (``attn2``, 512 tokens) under a key mask: the transformer turns the pipeline's 0/1 text mask
into a bias, 0 on the prompt's tokens and −10000 on the padding, as LTX-Video's; a recording adds it as the model
does (a padded token's probability is 0). Both run ``AllegroAttnProcessor2_0`` (the same since diffusers 0.32);
:class:`AllegroAttnMapProcessor` is that processor line for line, plus the lines that hand q and k (and the
cross-attention's bias) to the recording. The pipeline makes one call per step, ``[uncond..., cond...]`` under
guidance, as CogVideoX.

Allegro's VAE is not causal: it packs every 4 frames from frame 0 into one latent frame and decodes 4 per latent
frame, the pipeline cropping the last to ``num_frames`` (88 frames are 22 latent frames; ``causal_vae=False`` in
the layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AllegroAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb_allegro
from diffusers.models.transformers.transformer_allegro import AllegroTransformer3DModel

from ..layout import VAE_SPATIAL, VAE_TEMPORAL, TokenLayout
from ..recorder.processor import MapSink, context_bias
from .prompt_text import plain_text
from .spec import ModelSpec, Site, StepTime, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast, masked_text, tiny_text_encoder, tiny_tokenizer

__all__ = [
    "SPEC",
    "KNOWN",
    "AllegroAttnMapProcessor",
    "TEXT_LEN",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_pipeline",
]

TEXT_LEN = 512  # T5 tokens of the pipeline's calls (max_sequence_length)

# Attention shapes of the released checkpoint (its transformer/config.json), for plans made offline.
KNOWN: dict[str, dict] = {
    "rhymes-ai/Allegro": {
        "_class_name": "AllegroTransformer3DModel",
        "patch_size": 2,
        "patch_size_t": 1,
        "num_attention_heads": 24,
        "attention_head_dim": 96,
        "in_channels": 4,
        "num_layers": 32,
        "cross_attention_dim": 2304,
        "caption_channels": 4096,
        "sample_frames": 22,
        "sample_height": 90,
        "sample_width": 160,
    },
}


class AllegroAttnMapProcessor:
    """Drop-in for ``AllegroAttnProcessor2_0`` (self- and cross-attention) that also feeds q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and the role
            (self- or cross-attention) of each module. One instance serves every module.
    """

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
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

        # Apply RoPE if needed
        if image_rotary_emb is not None and not attn.is_cross_attention:
            query = apply_rotary_emb_allegro(query, image_rotary_emb[0], image_rotary_emb[1])
            key = apply_rotary_emb_allegro(key, image_rotary_emb[0], image_rotary_emb[1])

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        layer = self.sink.layer_to_capture(attn)
        if layer is not None and not cross and attention_mask is not None:  # Allegro's pipeline passes none
            raise ValueError("cogattn captures Allegro's self-attention without a video mask; this call passes one.")
        fused = None if layer is None or cross else self.sink.attention(layer, query, key, value)
        if fused is None:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
        if layer is not None and cross:
            bias = context_bias(attention_mask, batch_size, key.shape[2])
            self.sink.capture_context(layer, query, key, "text", bias)
        elif layer is not None:
            self.sink.capture(layer, query, key, lse, sums, value=value if self.sink.wants_value else None)

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


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``AllegroTransformer3DModel`` call: latents ``(B, C, F, H,
    W)``, the text ``(B, 1, T, C)`` (or ``(B, T, C)``) as the cross-attention's context."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 1, "encoder_hidden_states")
    t = call_argument(args, kwargs, 2, "timestep")
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    fields = dict(context_len=int(text.shape[-2]), causal_vae=False)  # the pipeline gives (B, 1, T, C)
    return TokenLayout.of_video_latents(hidden.shape, (p_t, p, p), **fields), hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of an Allegro pipeline call: ``⌈num_frames / 4⌉`` latent frames for 4k frames (``(num_frames −
    1) / 4 + 1`` for 4k + 1), 8 × 8 pixels per latent pixel, 2 × 2 per patch, and ``text_len`` (512) T5 tokens in the
    cross-attention."""
    p, p_t = int(config.get("patch_size", 2)), int(config.get("patch_size_t", 1))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        p_t if p_t > 1 else None,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        temporal_compression=VAE_TEMPORAL,
        causal_vae=False,
    )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The transformer's text of ``prompt`` (``ModelSpec.prompt_text``): the tokenizer on the prompt as Allegro's
    pipeline prepares it, lower-cased and stripped (or, with beautifulsoup4 and ftfy installed, its caption
    cleaning: the call's default ``clean_caption=True``)."""
    return plain_text(
        pipeline.tokenizer, prompt, length, offsets, lambda p: pipeline._text_preprocessing(p, clean_caption=True)[0]
    )


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 12, dtype=torch.float32, seed=0):
    """A random ``AllegroTransformer3DModel`` at toy size, text width 16 (4 latent channels, patch 2); ``head_dim``
    rounded up to a multiple of 6 (its RoPE splits a head in three even parts: the self-test's 16 is 18)."""
    head_dim = -(-head_dim // 6) * 6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AllegroTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=4,
            out_channels=4,
            num_layers=num_layers,
            cross_attention_dim=num_heads * head_dim,
            sample_width=8,
            sample_height=8,
            sample_frames=8,
            caption_channels=TEXT_DIM,
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``AllegroPipeline`` at toy size (no download), its VAE compressing as the released one (8 pixels, 4
    frames from frame 0): ``num_frames=12, height=32, width=48`` gives 3 latent frames of 2×3 patches."""
    from diffusers import AllegroPipeline, AutoencoderKLAllegro, DDIMScheduler

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; Allegro is text-to-video.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLAllegro(
            down_block_types=("AllegroDownBlock3D",) * 4,
            up_block_types=("AllegroUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        )
    vae.enable_tiling()  # Allegro's VAE decodes in tiles only
    pipe = AllegroPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=cast(vae, dtype),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
        scheduler=DDIMScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 6 text tokens, 4 of them the prompt's (the negative's 2), 12 frames
    of 32×48 (3×2×3 patches)."""
    call = dict(prompt=None, negative_prompt=None, **masked_text(pipe, generator))
    call.update(guidance_scale=7.5 if guided else 1.0, num_frames=12, height=32, width=48)
    return call


SPEC = ModelSpec(
    "allegro",
    (AllegroTransformer3DModel,),
    (Site("transformer_blocks", "attn1", context="attn2"),),
    {AllegroAttnProcessor2_0: AllegroAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "text_to_video": text_never_queries("Allegro"),
        "video_to_image": "Allegro has no image attention; its transformer sees the video and the text.",
    },
    frame_counts="4k or 4k + 1: 8, 12, ..., 88",
    empty_negative=True,  # its pipeline preprocesses the negative prompt unguarded
    prompt_text=prompt_text,
)
