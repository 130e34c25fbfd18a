"""Motif-Video (text-to-video and image-to-video): the map processors, the family's facts and its tiny pipelines
(built in ``tiny.py``; docs/design.md, "The model seam").

Motif-Video runs dual-stream blocks (``transformer_blocks``: the video and the text projected apart, one joint
attention), then single-stream blocks (``single_transformer_blocks``: one projection of ``[video, text]``); the
last ``num_decoder_layers`` single-stream blocks are its decoder. Each block's joint attention is a layer, in
execution order (the dual-stream blocks' first, the decoder's last), named by its path
(``"single_transformer_blocks.3.attn"``).
The joint sequence is the video, then the text (``text_position="end"``): in image-to-video the image's SigLIP
tokens lead it (``layout.image_len``), then the prompt's ``max_sequence_length`` tokens under a boolean key mask
``(B, 1, 1, S)`` that keeps each item's valid text, padded at the end (its first ``V + I + T_valid`` keys, as
HunyuanVideo's) or at the start (a Gemma tokenizer's default: ``processor.key_mask``'s ``GroupMask``).

A block with ``enable_text_cross_attention`` (the config's ``enable_text_cross_attention_dual`` for the dual-stream
blocks, ``_single`` for the single-stream encoder blocks) adds a text cross-attention (``cross_attn``) whose queries
are the joint attention's video output, RoPE'd, and whose keys are the prompt's T tokens under the text's key mask:
it is that layer's ``video_to_text`` (a layer whose block has none stores none). Its text axis is the layout's, the
joint attention's (``layout.context_len = I + T``), so that one prompt start names the words of every kind: the
image's I columns, which the cross-attention never reads, hold exactly 0 (the capture masks them out).

The decoder blocks attend over ``[decoder video | encoder video]``: the grid twice, 2V tokens (the second V, the
encoder's output, without RoPE), no text. Their layers have a layout of their own (:func:`decoder_layout`,
``Recording.layout_of``): the grid with 2F latent frames, the decoder's F first (``TokenLayout.grids`` = 2), so that
every grid kind is exact over both copies (``frame`` is 2F × 2F: its top-right quarter is the decoder's attention
to the encoder's frames); they hold no text kind.

Guidance is the pipeline's ``guider``: two transformer calls per step, the conditional first. The processors are
diffusers' ``MotifVideoAttnProcessor2_0`` and ``MotifVideoCrossAttnProcessor2_0`` line for line, plus the lines
that hand q, k, the key counts and the text's key mask to the recording.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...layout import TokenLayout
from ...recorder.processor import MapSink, context_bias, key_mask
from ..spec import ModelSpec, Site, Unavailable, call_argument

# Attention shapes of the released checkpoint, for plans made offline. The blocks are diffusers' model page's
# (docs/source/en/api/models/motif_video_transformer3d.md: 12 dual-stream, 16 single-stream and 8 decoder blocks);
# the heads are inferred: 1536 channels give its 2B parameters, and the default RoPE axes (16, 56, 56) make heads
# of 128. The text cross-attention is the report's "Shared Cross-Attention", taken to be the single-stream blocks'.
KNOWN: dict[str, dict] = {
    "Motif-Technologies/Motif-Video-2B": {
        "_class_name": "MotifVideoTransformer3DModel",
        "in_channels": 33,
        "out_channels": 16,
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "num_layers": 12,
        "num_single_layers": 24,
        "num_decoder_layers": 8,
        "patch_size": 2,
        "patch_size_t": 1,
        "rope_axes_dim": [16, 56, 56],
        "enable_text_cross_attention_dual": False,
        "enable_text_cross_attention_single": True,
    },
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_motif_video import (
        MotifVideoAttnProcessor2_0,
        MotifVideoCrossAttnProcessor2_0,
        MotifVideoTransformer3DModel,
    )
except ImportError:
    needs = "Motif-Video needs a diffusers with MotifVideoTransformer3DModel (0.42 has it)"
    raise Unavailable("motif_video", needs, KNOWN) from None
from .tiny import tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "KNOWN",
    "MotifVideoAttnMapProcessor",
    "MotifVideoCrossAttnMapProcessor",
    "TEXT_LEN",
    "decoder_layout",
    "layout_for_video",
    "read_call",
    "tiny_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 512  # the pipelines' max_sequence_length


class MotifVideoAttnMapProcessor:
    """Drop-in for ``MotifVideoAttnProcessor2_0`` (the joint attention of the dual- and single-stream encoder
    blocks) that also feeds q, k and each item's kept key count to a recording. The output call is the stock one.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Concatenate hidden states with encoder hidden states for joint attention if needed
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # Project QKV
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        # Normalize QK
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Apply RoPE
        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                split_idx = -encoder_hidden_states.shape[1]
                query = torch.cat(
                    [
                        apply_rotary_emb(query[:, :split_idx, :, :], image_rotary_emb, sequence_dim=1),
                        query[:, split_idx:, :, :],
                    ],
                    dim=1,
                )
                key = torch.cat(
                    [
                        apply_rotary_emb(key[:, :split_idx, :, :], image_rotary_emb, sequence_dim=1),
                        key[:, split_idx:, :, :],
                    ],
                    dim=1,
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # Add encoder conditioning QKV projections and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states)
            encoder_key = attn.add_k_proj(encoder_hidden_states)
            encoder_value = attn.add_v_proj(encoder_hidden_states)

            encoder_query = encoder_query.unflatten(2, (attn.heads, -1))
            encoder_key = encoder_key.unflatten(2, (attn.heads, -1))
            encoder_value = encoder_value.unflatten(2, (attn.heads, -1))

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # (B, H, S, D), as the recording takes them; padded text keys are masked
            counts, mask = key_mask(attention_mask, query.shape[1], query.shape[2])  # text padded at either end
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, query.transpose(1, 2), key.transpose(1, 2), None, None, counts, mask=mask, value=v)

        # Compute attention with backend dispatch
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # Apply output projections and split encoder states
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )

            if attn.to_out is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if attn.to_add_out is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

            return hidden_states, encoder_hidden_states

        if attn.to_out is not None:
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class MotifVideoCrossAttnMapProcessor:
    """Drop-in for ``MotifVideoCrossAttnProcessor2_0`` (a block's text cross-attention) that also feeds its video
    queries, the prompt's keys and the text's key mask to a recording: the layer's ``video_to_text``.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        image_embed_seq_len: int = 0,
    ) -> torch.Tensor:
        txt_kv = encoder_hidden_states[:, image_embed_seq_len:, :]

        text_mask = None
        if attention_mask is not None:
            text_mask = attention_mask[:, :, :, image_embed_seq_len - encoder_hidden_states.shape[1] :]

        query = attn.to_q(hidden_states)
        key = attn.to_k(txt_kv)
        value = attn.to_v(txt_kv)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # (B, H, V, D) video queries over the layout's text: the image's I keys, which the
            # attention never reads (masked out: exactly 0), then the prompt's T under the text's key mask
            keys, keep = key, text_mask
            if image_embed_seq_len:
                keys = torch.cat([key.new_zeros(key.shape[0], image_embed_seq_len, *key.shape[2:]), key], dim=1)
                keep = torch.ones_like(key[:, None, None, :, 0, 0], dtype=torch.bool) if keep is None else keep
                keep = F.pad(keep.bool(), (image_embed_seq_len, 0), value=False)
            bias = context_bias(keep, query.shape[0], keys.shape[1])
            self.sink.capture_context(layer, query.transpose(1, 2), keys.transpose(1, 2), "text", bias)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=text_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def _cross_attention(config) -> bool:
    """Whether any block of a transformer with ``config`` has the text cross-attention."""
    return bool(config.get("enable_text_cross_attention_dual") or config.get("enable_text_cross_attention_single"))


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``MotifVideoTransformer3DModel`` call: latents
    ``(B, C, F, H, W)``, the text after the video (its padded length: the mask sets each item's own), led by the
    image's tokens where the call carries them (``image_embeds``, image-to-video); where the config gives blocks the
    cross-attention, its ``video_to_text`` has the same text axis (``context_len``; the image's columns 0)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    image = call_argument(args, kwargs, 4, "image_embeds")
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    _, _, frames, height, width = hidden.shape
    images = 0 if image is None else int(image.shape[1])
    layout = TokenLayout(
        text_len=images + int(text.shape[1]),
        frames=frames // p_t,
        height=height // p,
        width=width // p,
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=images + int(text.shape[1]) if _cross_attention(config) else 0,
        image_len=images,
        text_position="end",
    )
    return layout, hidden.shape[0], t, hidden.device


def decoder_layout(layout: TokenLayout) -> TokenLayout:
    """A decoder layer's layout, from the generation's: ``[decoder video | encoder video]``, the grid with twice its
    latent frames (``grids=2``), no text."""
    return replace(layout, text_len=0, context_len=0, image_len=0, frames=2 * layout.frames, grids=2)


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a text-to-video pipeline call (``(num_frames − 1) // 4 + 1`` latent frames, 8× spatial; an
    image-to-video call adds its image's SigLIP tokens before the text, which a plan does not count); ``text_len`` is
    the call's ``max_sequence_length`` (512 by default)."""
    p_t = int(config.get("patch_size_t", 1))
    text_len = text_len or TEXT_LEN
    context = text_len if _cross_attention(config) else 0
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        text_len,
        int(config["patch_size"]),
        p_t if p_t > 1 else None,
        context_len=context,
        text_position="end",
    )


SPEC = ModelSpec(
    "motif_video",
    (MotifVideoTransformer3DModel,),
    (
        Site("transformer_blocks", "attn", context="cross_attn", context_key="enable_text_cross_attention_dual"),
        Site(
            "single_transformer_blocks",
            "attn",
            context="cross_attn",
            count_key="num_single_layers",
            count_less="num_decoder_layers",
            context_key="enable_text_cross_attention_single",
        ),
        Site(
            "single_transformer_blocks",
            "attn",
            count_key="num_decoder_layers",
            last_of="num_single_layers",
            layout=decoder_layout,
        ),
    ),
    {
        MotifVideoAttnProcessor2_0: MotifVideoAttnMapProcessor,
        MotifVideoCrossAttnProcessor2_0: MotifVideoCrossAttnMapProcessor,
    },
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "video_to_image": "Motif-Video has no image attention; in image-to-video the image's SigLIP tokens lead the "
        "joint attention's text (its first layout.image_len text tokens); the cross-attention's keys are the prompt's.",
    },
    guidance_calls=2,  # the guider's branches, which recorder/guiders.Branches tells
    output_call=False,
    title="Motif-Video",
    frame_counts="9, 13, ..., 121",
    pipelines={"text-to-video": "MotifVideoPipeline", "image-to-video": "MotifVideoImage2VideoPipeline"},
)
