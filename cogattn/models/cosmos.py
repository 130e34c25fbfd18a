"""Cosmos world models (Predict1, Predict2, Predict2.5 and Transfer2.5): the map processors, the family's facts and its
tiny pipelines (docs/design.md, "The model seam").

Each of Cosmos' blocks has a self-attention over the video alone (``attn1``: RMS norms per head, 3-D RoPE) and a
cross-attention from the video to the T5 text (``attn2``, 512 tokens, the padding attended as any token: the
pipelines pass no mask), both run by ``CosmosAttnProcessor2_0``; :class:`CosmosAttnMapProcessor` is that processor
line for line (diffusers 0.35's calls torch's SDPA, later ones the attention dispatcher: each version's call is
made), plus the lines that hand q and k to the recording. The self-attention feeds the self-attention
kinds, the cross-attention ``video_to_text``. The pipelines call the transformer twice per step under guidance, the
conditional call first, as Wan's; video-to-world gives a timestep per latent frame (its conditioning frames' small).

Predict1 (``CosmosTextToWorldPipeline``, ``CosmosVideoToWorldPipeline``) decodes with Cosmos' own tokenizer, 8
frames and 8 × 8 pixels per latent pixel; Predict2 (``Cosmos2VideoToWorldPipeline``) with Wan 2.1's VAE, 4 frames.
A transformer config tells them apart by its learnable positional embedding (Predict1's alone).

Predict2.5 (``Cosmos2_5_PredictBasePipeline``) and Transfer2.5 (``Cosmos2_5_TransferPipeline``) decode with Wan 2.1's
VAE too and read 512 tokens of Qwen2.5-VL (every layer's hidden states, normalized and joined, projected by the
transformer's ``crossattn_proj``), the padding attended. A transformer with ``img_context_dim_in`` (Transfer2.5's)
runs its cross-attentions with ``CosmosAttnProcessor2_5`` (:class:`CosmosAttnMapProcessor2_5`): the text branch and a
second branch over ``img_context_num_tokens`` image tokens with its own projections, norms and softmax, added to the
text branch's output, as Wan 2.1 image-to-video's image branch is: the text branch feeds ``video_to_text``, the image
branch ``video_to_image``. Transfer2.5's pipeline gives that branch a zero image context (every image key the same:
each query attends the image tokens evenly). Its control net (``CosmosControlNetModel``) runs Cosmos blocks of its own
over the control video before each transformer call, adding their outputs after the transformer's blocks 0, n, 2n,
... (``controlnet_block_every_n``): a separate model, whose attention is not captured (its processors stay stock).
The 2.5 pipelines' tiny versions are in ``_cosmos25_tiny.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import VAE_SPATIAL, TokenLayout
from ..recorder.processor import MapSink, context_bias
from .spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast, tiny_text_encoder, tiny_tokenizer

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_COSMOS = {"_class_name": "CosmosTransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_P1 = {**_COSMOS, "text_embed_dim": 1024, "extra_pos_embed_type": "learnable", "concat_padding_mask": True}
_P2 = {**_COSMOS, "text_embed_dim": 1024, "extra_pos_embed_type": None, "concat_padding_mask": True}
# Predict2.5 and Transfer2.5 (diffusers' scripts/convert_cosmos_to_diffusers.py): Qwen2.5-VL's 28 × 3584 hidden states
_P25 = {**_P2, "use_crossattn_projection": True, "crossattn_proj_in_channels": 100352}
KNOWN: dict[str, dict] = {
    "nvidia/Cosmos-1.0-Diffusion-7B-Text2World": {
        **_P1,
        "in_channels": 16,
        "num_attention_heads": 32,
        "num_layers": 28,
    },
    "nvidia/Cosmos-1.0-Diffusion-14B-Text2World": {
        **_P1,
        "in_channels": 16,
        "num_attention_heads": 40,
        "num_layers": 36,
    },
    "nvidia/Cosmos-1.0-Diffusion-7B-Video2World": {
        **_P1,
        "in_channels": 17,
        "num_attention_heads": 32,
        "num_layers": 28,
    },
    "nvidia/Cosmos-1.0-Diffusion-14B-Video2World": {
        **_P1,
        "in_channels": 17,
        "num_attention_heads": 40,
        "num_layers": 36,
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
    import diffusers
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers import transformer_cosmos
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0, CosmosTransformer3DModel

    from . import _cosmos25_tiny
except ImportError as missing:
    needs = "Cosmos needs diffusers >= 0.35 (CosmosAttnProcessor2_0, Cosmos2VideoToWorldPipeline)"
    raise Unavailable("cosmos", needs, ("CosmosTransformer3DModel",), (), KNOWN) from missing

# diffusers 0.35's processor calls torch's SDPA on (B, H, S, D); later ones the attention dispatcher on (B, S, H, D)
_DISPATCH = hasattr(transformer_cosmos, "dispatch_attention_fn")
# the image-context cross-attention of the Cosmos 2.5 transformers (the diffusers that has their pipelines)
CosmosAttnProcessor2_5 = getattr(transformer_cosmos, "CosmosAttnProcessor2_5", None)
TRANSFER25 = CosmosAttnProcessor2_5 is not None and hasattr(diffusers, "Cosmos2_5_TransferPipeline")

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


# -- the tiny pipelines (tests, notebook, batch tool) ------------------------------------------------
class _PassingGuardrail(torch.nn.Module):
    """The tiny pipelines' stand-in for ``cosmos_guardrail.CosmosSafetyChecker`` (a download of its own): it
    passes every prompt and video. A real Cosmos pipeline loads NVIDIA's guardrail, as its license asks."""

    def __init__(self):
        super().__init__()
        self.register_buffer("_where", torch.zeros(()), persistent=False)  # the pipeline asks its parts' device

    device = property(lambda self: self._where.device)
    dtype = property(lambda self: self._where.dtype)

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames):
        return frames


def tiny_transformer(
    image_to_video: bool = True,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``CosmosTransformer3DModel`` at toy size, text width 16: Predict2's video-to-world (16 latent
    channels and the conditioning mask's), or with ``image_to_video=False`` Predict1's text-to-world (a learnable
    positional embedding). No padding-mask channel: its resizing needs torchvision, which a plain install lacks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CosmosTransformer3DModel(
            in_channels=17 if image_to_video else 16,
            out_channels=16,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            adaln_lora_dim=4,
            max_size=(8, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0) if image_to_video else (2.0, 1.0, 1.0),
            concat_padding_mask=False,
            extra_pos_embed_type=None if image_to_video else "learnable",
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "image-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random Cosmos pipeline at toy size (no download; its guardrail passes everything).

    ``"image-to-video"``: ``Cosmos2VideoToWorldPipeline`` (Predict2) with Wan 2.1's VAE at toy size (8 pixels, 4
    frames): ``num_frames=9, height=32, width=48`` gives 3 latent frames of 2×3 patches; pass ``image=`` a PIL image.
    ``"text-to-video"``: ``CosmosTextToWorldPipeline`` (Predict1) with a toy Cosmos tokenizer (8 pixels, 8 frames):
    ``num_frames=17`` gives 3 latent frames. ``"video-to-video"``: ``Cosmos2_5_TransferPipeline`` (Transfer2.5: a
    control video's frames drive it through a control net; its cross-attention has an image branch), built by
    ``_cosmos25_tiny.tiny_pipeline``, as Predict2.5's ``Cosmos2_5_PredictBasePipeline``.

    Args:
        task (`str`, defaults to ``"image-to-video"``): or ``"text-to-video"``, ``"video-to-video"``.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim`` of the transformer.
    """
    from diffusers import EDMEulerScheduler, FlowMatchEulerDiscreteScheduler

    if task not in ("text-to-video", "image-to-video", "video-to-video"):
        raise ValueError(
            f"task={task!r}; choose 'image-to-video' (Predict2), 'text-to-video' (Predict1) or 'video-to-video' "
            "(Transfer2.5)."
        )
    if task == "video-to-video" and not TRANSFER25:
        raise ValueError(
            "task='video-to-video' is Cosmos Transfer2.5's; this diffusers lacks Cosmos2_5_TransferPipeline."
        )
    if task == "video-to-video":
        return _cosmos25_tiny.tiny_pipeline(dtype=dtype, seed=seed, **size)
    i2v = task == "image-to-video"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if i2v:
            from diffusers import AutoencoderKLWan

            vae = AutoencoderKLWan(
                base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
            )
        else:
            from diffusers import AutoencoderKLCosmos

            vae = AutoencoderKLCosmos(
                latent_channels=16,
                encoder_block_out_channels=(8, 8, 8, 8),
                decode_block_out_channels=(8, 8, 8, 8),
                attention_resolutions=(),
                resolution=64,
                num_layers=1,
                patch_size=4,
                spatial_compression_ratio=8,
                temporal_compression_ratio=8,
            )
    parts = dict(
        text_encoder=tiny_text_encoder(seed, dtype),
        tokenizer=tiny_tokenizer(),
        transformer=tiny_transformer(i2v, dtype=dtype, seed=seed, **size),
        vae=cast(vae, dtype),
        safety_checker=_PassingGuardrail(),
    )
    if i2v:
        from diffusers import Cosmos2VideoToWorldPipeline as cls

        parts["scheduler"] = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
    else:
        from diffusers import CosmosTextToWorldPipeline as cls

        parts["scheduler"] = EDMEulerScheduler(
            sigma_min=0.002, sigma_max=80, sigma_data=0.5, sigma_schedule="karras", num_train_timesteps=1000,
            prediction_type="epsilon", rho=7.0, final_sigmas_type="sigma_min",
        )  # fmt: skip
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 8 random text tokens (the negative: their opposite), 3 latent frames
    of 2×3 patches (32×48 pixels: 9 frames through Wan's VAE, 17 through Cosmos' tokenizer), and for image-to-video
    a random image; video-to-video: 9 random control frames (``_cosmos25_tiny.tiny_call``)."""
    if task == "video-to-video":
        return _cosmos25_tiny.tiny_call(pipe, generator, guided)
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, 8, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=7.0 if guided else 1.0)
    call.update(num_frames=9 if task == "image-to-video" else 17, height=32, width=48)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call


def version_25(config: dict) -> bool:
    """Whether a transformer with ``config`` is Predict2.5's or Transfer2.5's (Qwen2.5-VL's text, projected)."""
    return bool(config.get("use_crossattn_projection"))


def batch_refusal(config: dict) -> str:
    """Why the batch tool plans (``--dry-run``) but does not run a Cosmos checkpoint (``ModelSpec.batch_refusal``):
    Predict2.5's and Transfer2.5's alone."""
    if not version_25(config):
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
    if version_25(config):
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
)
