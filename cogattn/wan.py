"""Wan 2.1 / 2.2: the map processor and the facts of the family (docs/design.md, "The model seam").

Wan's blocks have a self-attention over the video alone (``attn1``, 3D RoPE) and a cross-attention from
the video to the text (``attn2``; 512 UMT5 tokens, and for Wan 2.1 image-to-video 257 CLIP image tokens
with their own softmax, added to the output). Both are ``WanAttention`` modules run by
``WanAttnProcessor``; :class:`WanAttnMapProcessor` is that processor line for line, the same
projections, norms, RoPE and ``dispatch_attention_fn`` calls with the module's attention backend, plus
the lines that hand q and k to the recording. The self-attention feeds the self-attention kinds, the
cross-attention ``video_to_text`` and ``video_to_image``.

Under classifier-free guidance the Wan pipelines call the transformer twice per step, the conditional
call first, each with the batch of the prompts; a recording numbers both as one step, and their items
as the guidance batch ``[uncond..., cond...]`` CogVideoX has.
"""

from __future__ import annotations

import inspect

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import (
    WanAttention,  # noqa: F401  (its absence, before diffusers 0.35, means no Wan support)
    WanAttnProcessor,
    WanTransformer3DModel,
    _get_added_kv_projections,
    _get_qkv_projections,
)

from .layout import VAE_SPATIAL, VAE_TEMPORAL, TokenLayout
from .processor import MapSink

__all__ = ["WanAttnMapProcessor", "KNOWN_WAN", "read_call", "layout_for_video", "TEXT_LEN", "IMAGE_LEN"]

TEXT_LEN = 512  # UMT5 tokens of every Wan pipeline (the processor hard-codes it too)
IMAGE_LEN = 257  # CLIP ViT-H/14 tokens of Wan 2.1 image-to-video
_PARALLEL = "parallel_config" in inspect.signature(dispatch_attention_fn).parameters


def _dispatch(processor, query, key, value, attention_mask, parallel_config):
    kwargs = {"parallel_config": parallel_config} if _PARALLEL else {}
    return dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        **kwargs,
    )


class WanAttnMapProcessor:
    """Drop-in for ``WanAttnProcessor`` (self- and cross-attention) that also feeds q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and
            the role (self- or cross-attention) of each module. One instance serves every module.

    Example:
        ```python
        rec = cogattn.Recording(pipe, kinds=("frame", "video_to_text"))
        pipe.transformer.set_attn_processor(cogattn.WanAttnMapProcessor(rec))
        pipe(...)
        ```
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
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hardcoded for now
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:

            def apply_rotary_emb(
                hidden_states: torch.Tensor,
                freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor,
            ):
                x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
                cos = freqs_cos[..., 0::2]
                sin = freqs_sin[..., 1::2]
                out = torch.empty_like(hidden_states)
                out[..., 0::2] = x1 * cos - x2 * sin
                out[..., 1::2] = x1 * sin + x2 * cos
                return out.type_as(hidden_states)

            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and attention_mask is not None:
            raise ValueError("cogattn cannot capture attention that uses an attention mask.")
        q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them

        # I2V task
        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)

            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))

            hidden_states_img = _dispatch(self, query, key_img, value_img, None, None)
            hidden_states_img = hidden_states_img.flatten(2, 3)
            hidden_states_img = hidden_states_img.type_as(query)
            if layer is not None:
                self.sink.capture_context(layer, q, key_img.transpose(1, 2), "image")

        fused = (
            None
            if layer is None or cross
            else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        )
        if fused is None:
            hidden_states = _dispatch(
                self,
                query,
                key,
                value,
                attention_mask,
                self._parallel_config if encoder_hidden_states is None else None,
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None and cross:
            self.sink.capture_context(layer, q, key.transpose(1, 2), "text")
        elif layer is not None:
            self.sink.capture(layer, q, key.transpose(1, 2), lse, sums)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


PROCESSORS = {WanAttnProcessor: WanAttnMapProcessor}
TRANSFORMER = WanTransformer3DModel


def spatial_compression(config) -> int:
    """Pixels per latent pixel of the VAE a Wan transformer works with: 16 for Wan 2.2 TI2V-5B (48 latent
    channels), 8 otherwise."""
    return 16 if int(config.get("out_channels", 16)) == 48 else VAE_SPATIAL


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``WanTransformer3DModel`` call."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    t = kwargs["timestep"] if "timestep" in kwargs else args[1]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[2]
    image = kwargs.get("encoder_hidden_states_image", args[3] if len(args) > 3 else None)
    # TI2V-5B gives a timestep per token, 0 on a conditioning first frame: the step's is the largest
    t = float(t.max()) if isinstance(t, torch.Tensor) else float(t)
    p_t, p_h, p_w = (int(p) for p in config["patch_size"])
    _, _, frames, height, width = hidden.shape
    image_len = 0 if image is None else image.shape[1]
    if image is not None and config.get("pos_embed_seq_len"):  # FLF2V: two images, joined by the model
        image_len = int(config["pos_embed_seq_len"])
    layout = TokenLayout(
        text_len=0,
        frames=frames // p_t,
        height=height // p_h,
        width=width // p_w,
        patch_size=p_h,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=int(text.shape[1]),
        image_len=int(image_len),
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Wan pipeline call for ``num_frames`` frames of ``height`` × ``width`` pixels (the
    pipeline rounds ``num_frames`` to ``num_frames // 4 * 4 + 1``, with a warning, and so does this)."""
    p_t, p_h, _ = (int(p) for p in config["patch_size"])
    return TokenLayout.for_video(
        max(int(num_frames) // VAE_TEMPORAL * VAE_TEMPORAL + 1, 1),
        height,
        width,
        0,
        p_h,
        p_t if p_t > 1 else None,
        spatial_compression=spatial_compression(config),
        context_len=text_len or TEXT_LEN,
        image_len=(config.get("pos_embed_seq_len") or IMAGE_LEN) if config.get("image_dim") else 0,  # FLF2V: 2 images
    )


# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_WAN = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_14B = {**_WAN, "num_layers": 40, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16}
KNOWN_WAN: dict[str, dict] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {**_WAN, "num_layers": 30, "num_attention_heads": 12, "out_channels": 16},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": _14B,
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {**_14B, "in_channels": 36, "image_dim": 1280},
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": {**_14B, "in_channels": 36, "image_dim": 1280},
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {**_WAN, "num_layers": 30, "num_attention_heads": 24, "out_channels": 48},
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {**_14B, "experts": 2},
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {**_14B, "in_channels": 36, "experts": 2},
}
