"""Cosmos world models (Predict1, 2, 2.5 and Transfer2.5): the map processors and the family's facts (docs/design.md,
"The model seam"); the tiny pipelines are ``tiny.py``'s.

Each of Cosmos' blocks has a self-attention over the video alone (``attn1``: RMS norms per head, 3-D RoPE) and a
cross-attention from the video to 512 text tokens (``attn2``, the padding attended: the pipelines pass no mask), run
by ``CosmosAttnProcessor2_0``; :class:`CosmosAttnMapProcessor` is that processor line for line (diffusers 0.35's
calls torch's SDPA, later ones the attention dispatcher: each version's call is made), plus the lines that hand q
and k to the recording: the self-attention kinds and ``video_to_text``. Under guidance the pipelines call the
transformer twice per step, the conditional call first; video-to-world gives a timestep per latent frame.

Predict1 decodes with Cosmos' own tokenizer (8 frames and 8 × 8 pixels per latent pixel), Predict2, 2.5 and
Transfer2.5 with Wan 2.1's VAE (4 frames): a config tells them apart by Predict1's learnable positional embedding.
Predict2.5 and Transfer2.5 read Qwen2.5-VL (every layer's hidden states, joined, projected by ``crossattn_proj``).
A transformer with ``img_context_dim_in`` (Transfer2.5's) runs ``CosmosAttnProcessor2_5``
(:class:`CosmosAttnMapProcessor2_5`): the text branch and a second branch over ``img_context_num_tokens`` image
tokens with its own projections, norms and softmax, added to the text branch's output as Wan 2.1 image-to-video's
is: ``video_to_text`` and ``video_to_image``. Its pipeline gives a zero image context (each query attends the image
tokens evenly). Its control net (``CosmosControlNetModel``) runs Cosmos blocks of its own over the control video
before each transformer call, adding their outputs after blocks 0, n, 2n, ... (``controlnet_block_every_n``): a
separate model, whose attention is not captured (its processors stay stock). A control video longer than
``num_frames_per_chunk`` is made in chunks, each a denoising loop (``ModelSpec.window``): their steps numbered on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layout import VAE_SPATIAL, TokenLayout
from ...recorder.processor import MapSink, context_bias
from .._call_frame import window_reader
from ..spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_COSMOS = {"_class_name": "CosmosTransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_P1 = {**_COSMOS, "text_embed_dim": 1024, "extra_pos_embed_type": "learnable", "concat_padding_mask": True}
_P2 = {**_COSMOS, "text_embed_dim": 1024, "extra_pos_embed_type": None, "concat_padding_mask": True}
# Predict2.5 and Transfer2.5 (diffusers' scripts/convert_cosmos_to_diffusers.py): Qwen2.5-VL's 28 × 3584 hidden states
_P25 = {**_P2, "use_crossattn_projection": True, "crossattn_proj_in_channels": 100352}
KNOWN: dict[str, dict] = {
    **{  # Predict1: 7B and 14B, text- (16 latent channels) and video-to-world (17: the conditioning mask's)
        f"nvidia/Cosmos-1.0-Diffusion-{size}-{task}": {
            **_P1,
            "in_channels": ch,
            "num_attention_heads": h,
            "num_layers": n,
        }
        for size, h, n in (("7B", 32, 28), ("14B", 40, 36))
        for task, ch in (("Text2World", 16), ("Video2World", 17))
    },
    "nvidia/Cosmos-Predict2-2B-Video2World": {**_P2, "in_channels": 17, "num_attention_heads": 16, "num_layers": 28},
    "nvidia/Cosmos-Predict2-14B-Video2World": {**_P2, "in_channels": 17, "num_attention_heads": 40, "num_layers": 36},
    "nvidia/Cosmos-Predict2.5-2B": {**_P25, "in_channels": 17, "num_attention_heads": 16, "num_layers": 28},
    "nvidia/Cosmos-Predict2.5-14B": {**_P25, "in_channels": 17, "num_attention_heads": 40, "num_layers": 36},
    "nvidia/Cosmos-Transfer2.5-2B": {
        **_P25,
        "in_channels": 17,
        "num_attention_heads": 16,
        "num_layers": 28,
        "controlnet_block_every_n": 7,
        "img_context_dim_in": 1152,
        "img_context_num_tokens": 256,
        "img_context_dim_out": 2048,
    },
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers import transformer_cosmos
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0, CosmosTransformer3DModel

    from .text import prompt_text
    from .tiny import TRANSFER25, tiny_call, tiny_pipeline, tiny_transformer
except ImportError as missing:
    needs = "Cosmos needs diffusers >= 0.35 (CosmosAttnProcessor2_0, Cosmos2VideoToWorldPipeline)"
    raise Unavailable("cosmos", needs, KNOWN) from missing

# diffusers 0.35's processor calls torch's SDPA on (B, H, S, D); later ones the attention dispatcher on (B, S, H, D)
_DISPATCH = hasattr(transformer_cosmos, "dispatch_attention_fn")
# the image-context cross-attention of the Cosmos 2.5 transformers (the diffusers that has their pipelines)
CosmosAttnProcessor2_5 = getattr(transformer_cosmos, "CosmosAttnProcessor2_5", None)

__all__ = [
    "SPEC",
    "KNOWN",
    "CosmosAttnMapProcessor",
    "CosmosAttnMapProcessor2_5",
    "TEXT_LEN",
    "image_len",
    "layout_for_video",
    "read_call",
    "temporal_compression",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 512  # T5 (Predict1, Predict2) or Qwen2.5-VL (Predict2.5, Transfer2.5) tokens of the pipelines' calls


class CosmosAttnMapProcessor:
    """Drop-in for ``CosmosAttnProcessor2_0`` (self- and cross-attention) that also feeds q, k to a recording.

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
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        # 1. QKV projections
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        # 2. QK normalization
        query = attn.norm_q(query)
        key = attn.norm_k(key)

        # 3. Apply RoPE
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            key = apply_rotary_emb(key, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)

        # 4. Prepare for GQA
        if torch.onnx.is_in_onnx_export():
            query_idx = torch.tensor(query.size(3), device=query.device)
            key_idx = torch.tensor(key.size(3), device=key.device)
            value_idx = torch.tensor(value.size(3), device=value.device)
        else:
            query_idx = query.size(3)
            key_idx = key.size(3)
            value_idx = value.size(3)
        key = key.repeat_interleave(query_idx // key_idx, dim=3)
        value = value.repeat_interleave(query_idx // value_idx, dim=3)

        # 5. Attention
        layer = self.sink.layer_to_capture(attn)
        if layer is not None and not cross and attention_mask is not None:  # Cosmos' blocks never pass one
            raise ValueError("cogattn captures Cosmos' self-attention without a mask; this call passes one.")
        fused = None if layer is None or cross else self.sink.attention(layer, query, key, value)
        if fused is None and _DISPATCH:
            hidden_states = dispatch_attention_fn(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
            )
            lse = sums = None
        elif fused is None:  # diffusers 0.35's line, then its transpose
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            ).transpose(1, 2)
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None and cross:
            bias = context_bias(attention_mask, query.shape[0], key.shape[2])  # none from Cosmos' pipelines
            self.sink.capture_context(layer, query, key, "text", bias)
        elif layer is not None:
            self.sink.capture(layer, query, key, lse, sums, value=value if self.sink.wants_value else None)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        return hidden_states


class CosmosAttnMapProcessor2_5:
    """Drop-in for ``CosmosAttnProcessor2_5`` (the cross-attention of a transformer with an image context,
    Transfer2.5's) that also feeds q, k of its two branches to a recording: the text branch's to
    ``video_to_text``, the image branch's (its own projections, norms and softmax) to ``video_to_image``.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``. One instance serves every module.
    """

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: tuple[torch.Tensor, torch.Tensor],
        attention_mask: tuple[torch.Tensor, torch.Tensor],
        image_rotary_emb=None,
    ) -> torch.Tensor:
        if not isinstance(encoder_hidden_states, tuple):
            raise ValueError("Expected encoder_hidden_states as (text_context, img_context) tuple.")

        text_context, img_context = encoder_hidden_states if encoder_hidden_states else (None, None)
        text_mask, img_mask = attention_mask if attention_mask else (None, None)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and text_context is None:  # Cosmos' blocks always give the text
            raise ValueError("cogattn captures Cosmos' cross-attention to a text context; this call gives none.")
        if text_context is None:
            text_context = hidden_states

        query = attn.to_q(hidden_states)
        key = attn.to_k(text_context)
        value = attn.to_v(text_context)

        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            key = apply_rotary_emb(key, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)

        if torch.onnx.is_in_onnx_export():
            query_idx = torch.tensor(query.size(3), device=query.device)
            key_idx = torch.tensor(key.size(3), device=key.device)
            value_idx = torch.tensor(value.size(3), device=value.device)
        else:
            query_idx = query.size(3)
            key_idx = key.size(3)
            value_idx = value.size(3)
        key = key.repeat_interleave(query_idx // key_idx, dim=3)
        value = value.repeat_interleave(query_idx // value_idx, dim=3)

        attn_out = dispatch_attention_fn(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=text_mask,
            dropout_p=0.0,
            is_causal=False,
        )
        if layer is not None:
            bias = context_bias(text_mask, query.shape[0], key.shape[2])  # none from Cosmos' pipelines
            self.sink.capture_context(layer, query, key, "text", bias)
        attn_out = attn_out.flatten(2, 3).type_as(query)

        if img_context is not None:
            q_img = attn.q_img(hidden_states)
            k_img = attn.k_img(img_context)
            v_img = attn.v_img(img_context)

            batch_size = hidden_states.shape[0]
            dim_head = attn.out_dim // attn.heads

            q_img = q_img.view(batch_size, -1, attn.heads, dim_head).transpose(1, 2)
            k_img = k_img.view(batch_size, -1, attn.heads, dim_head).transpose(1, 2)
            v_img = v_img.view(batch_size, -1, attn.heads, dim_head).transpose(1, 2)

            q_img = attn.q_img_norm(q_img)
            k_img = attn.k_img_norm(k_img)

            q_img_idx = q_img.size(3)
            k_img_idx = k_img.size(3)
            v_img_idx = v_img.size(3)
            k_img = k_img.repeat_interleave(q_img_idx // k_img_idx, dim=3)
            v_img = v_img.repeat_interleave(q_img_idx // v_img_idx, dim=3)

            img_out = dispatch_attention_fn(
                q_img.transpose(1, 2),
                k_img.transpose(1, 2),
                v_img.transpose(1, 2),
                attn_mask=img_mask,
                dropout_p=0.0,
                is_causal=False,
            )
            if layer is not None:
                bias = context_bias(img_mask, q_img.shape[0], k_img.shape[2])
                self.sink.capture_context(layer, q_img, k_img, "image", bias)
            img_out = img_out.flatten(2, 3).type_as(q_img)
            hidden_states = attn_out + img_out
        else:
            hidden_states = attn_out

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def temporal_compression(config: dict) -> int:
    """Pixel frames per latent frame after the first of the VAE a transformer with ``config`` is released with:
    Predict1's Cosmos tokenizer 8 (its transformer alone learns a positional embedding), Predict2's Wan VAE 4."""
    return 8 if config.get("extra_pos_embed_type") == "learnable" else 4


def image_len(config: dict) -> int:
    """The image tokens of the cross-attention's second branch in a transformer with ``config``: its
    ``img_context_num_tokens`` where it has ``img_context_dim_in`` (Transfer2.5: 256), else 0."""
    return int(config.get("img_context_num_tokens", 256)) if config.get("img_context_dim_in") else 0


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``CosmosTransformer3DModel`` call: latents ``(B, C, F, H,
    W)``, the text as the cross-attention's context, and from a ``(text, image)`` pair (Transfer2.5) the image
    tokens of its second branch."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    text, image = text if isinstance(text, tuple) else (text, None)
    # video-to-world gives a timestep per latent frame, its conditioning frames' small: the step's is the largest
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    layout = TokenLayout.of_video_latents(
        hidden.shape,
        config["patch_size"],
        context_len=int(text.shape[1]),
        image_len=0 if image is None or not config.get("img_context_dim_in") else int(image.shape[1]),
        temporal_compression=temporal_compression(config),
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Cosmos pipeline call: ``(num_frames − 1) // c + 1`` latent frames (``c``:
    :func:`temporal_compression`), 8 × 8 pixels per latent pixel, 2 × 2 per patch, ``text_len`` (512) T5 or
    Qwen2.5-VL tokens in the cross-attention and :func:`image_len` image tokens in its second branch."""
    p_t, p_h, _ = (int(p) for p in config.get("patch_size", (1, 2, 2)))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p_h,
        p_t if p_t > 1 else None,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        image_len=image_len(config),
        temporal_compression=temporal_compression(config),
    )


def batch_refusal(config: dict) -> str:
    """Why the batch tool plans (``--dry-run``) but does not run a Cosmos checkpoint (``ModelSpec.batch_refusal``):
    Predict2.5's and Transfer2.5's alone (Qwen2.5-VL's text, projected: ``use_crossattn_projection``)."""
    if not config.get("use_crossattn_projection"):
        return ""
    return (
        "the batch tool plans Cosmos Predict2.5 and Transfer2.5 checkpoints (--dry-run) but does not run them yet: "
        "their diffusers weights are on revisions of the hub repositories and Transfer2.5 needs a control video; "
        "record a Cosmos2_5_PredictBasePipeline or Cosmos2_5_TransferPipeline call from Python with cogattn.record."
    )


def call_rules(cfg, config: dict) -> None:
    """The batch tool's Cosmos rules (``ModelSpec.call_rules``): Predict1 text-to-world checkpoints for
    text-to-video, Predict2 video-to-world checkpoints for image-to-video; Predict2.5 and Transfer2.5 (planned
    only: :func:`batch_refusal`) for either, their pipeline making both."""
    if config.get("use_crossattn_projection"):  # Predict2.5, Transfer2.5
        return
    predict1, conditioned = temporal_compression(config) == 8, int(config.get("in_channels", 16)) == 17
    want = "text-to-video" if predict1 and not conditioned else "image-to-video" if not predict1 else None
    if want is None:
        raise ValueError(
            f"model: {cfg.model} is a Cosmos Predict1 video-to-world checkpoint; the batch tool runs Predict1 "
            "text-to-world and Predict2 video-to-world checkpoints: record a CosmosVideoToWorldPipeline from Python."
        )
    if cfg.task != want:
        raise ValueError(f"task: {cfg.task!r}, but {cfg.model} is a {want} checkpoint; set task: {want}.")


SPEC = ModelSpec(
    "cosmos",
    (CosmosTransformer3DModel,),
    (Site("transformer_blocks", "attn1", context="attn2"),),
    {
        CosmosAttnProcessor2_0: CosmosAttnMapProcessor,
        **({CosmosAttnProcessor2_5: CosmosAttnMapProcessor2_5} if CosmosAttnProcessor2_5 else {}),
    },
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("image-to-video", "text-to-video", *(("video-to-video",) if TRANSFER25 else ())),
    window=window_reader("chunk_idx", "num_chunks"),  # Transfer2.5's chunks of a long control video
    known=KNOWN,
    text_len=TEXT_LEN,
    # video_to_image: Transfer2.5's image branch; Predict1, 2 and 2.5 have none (their layout's image_len is 0)
    context_kinds={"video_to_text": "text", "video_to_image": "image"},
    refused={"text_to_video": text_never_queries("Cosmos")},
    guidance_calls=2,
    title="Cosmos",
    frame_counts="9, 17, ..., 121 (Predict1: 8k + 1); 5, 9, ..., 93 (Predict2, 2.5, Transfer2.5: 4k + 1)",
    pipelines={"text-to-video": "CosmosTextToWorldPipeline", "image-to-video": "Cosmos2VideoToWorldPipeline"},
    call_rules=call_rules,
    batch_refusal=batch_refusal,
    prompt_text=prompt_text,  # 2.5: Qwen2.5-VL's chat template around the prompt
)
