"""CogVideoX attention processors that capture attention maps and leave the output untouched.

The output path is diffusers' own ``CogVideoXAttnProcessor2_0`` / ``FusedCogVideoXAttnProcessor2_0``
line for line: the same projections, norms, RoPE on video tokens and the same
``F.scaled_dot_product_attention`` call, so generated videos are bit-identical with and without
capture. What capture adds is a few lines around that call: ask the sink whether this call is
captured, and hand it ``q`` and ``k``. (With the opt-in ``layer_output="lse"`` or ``"joint"``, the
sink makes the output call itself, with a fused kernel that also returns what capture needs.)

The processor knows the recording only through :class:`MapSink`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["CogVideoXAttnMapProcessor", "FusedCogVideoXAttnMapProcessor", "MapSink"]


class MapSink(Protocol):
    """What a map processor hands its captures to (a :class:`cogattn.Recording`); CogVideoX's and Wan's
    processors (:mod:`cogattn.wan`) both use it."""

    def layer_to_capture(self, attn) -> int | None:
        """The block index of the module ``attn`` when this call is captured, else `None`."""

    def attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """For a captured call: `None` to keep the stock output call, or ``(output, lse, sums)`` from the
        opt-in fused call (``lse`` ``(B, H, S)`` and ``sums`` ``(B, H, S, C)`` where it brings them)."""

    def capture(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor | None, sums: torch.Tensor | None
    ) -> None:
        """Compute the selected maps of ``layer`` from ``query`` and ``key`` ``(B, H, S, D)``."""

    def capture_context(self, layer: int, query: torch.Tensor, key: torch.Tensor, context: str) -> None:
        """Compute the selected kinds of a cross-attention (Wan's ``attn2``) from the video queries ``query``
        ``(B, H, V, D)`` and the keys ``key`` ``(B, H, C, D)`` of its ``context`` (``"text"`` or ``"image"``)."""


class CogVideoXAttnMapProcessor:
    """Drop-in for ``CogVideoXAttnProcessor2_0`` that also feeds selected layers' q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer of each
            attention module, the step and the latent grid. One instance serves every layer.

    Example:
        ```python
        rec = cogattn.Recording(pipe, kinds=("frame",))
        pipe.transformer.set_attn_processor(cogattn.CogVideoXAttnMapProcessor(rec))
        pipe(...)
        rec.get("frame", step=0, layer=0)
        ```
    """

    def __init__(self, sink: MapSink):
        self.sink = sink

    def _project(self, attn, hidden_states: torch.Tensor):
        return attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_length = encoder_hidden_states.size(1)

        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        batch_size, sequence_length, _ = hidden_states.shape

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query, key, value = self._project(attn, hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and attention_mask is not None:
            raise ValueError("cogattn cannot capture attention that uses an attention mask.")
        fused = None if layer is None else self.sink.attention(layer, query, key, value)
        if fused is None:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
        if layer is not None:
            self.sink.capture(layer, query, key, lse, sums)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states


class FusedCogVideoXAttnMapProcessor(CogVideoXAttnMapProcessor):
    """Drop-in for ``FusedCogVideoXAttnProcessor2_0`` (after ``transformer.fuse_qkv_projections()``)."""

    def _project(self, attn, hidden_states: torch.Tensor):
        qkv = attn.to_qkv(hidden_states)
        split_size = qkv.shape[-1] // 3
        return torch.split(qkv, split_size, dim=-1)
