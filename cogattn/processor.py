"""CogVideoX attention processors that capture attention maps and leave the output untouched.

The output path is diffusers' own ``CogVideoXAttnProcessor2_0`` / ``FusedCogVideoXAttnProcessor2_0``
line for line: the same projections, norms, RoPE on video tokens and the same
``F.scaled_dot_product_attention`` call, so generated videos are bit-identical with and without
capture. The capture path only reads ``q`` and ``k`` and hands them to the recording. (With the opt-in
``output="lse"`` the output comes from the fused kernel that SDPA itself dispatches to, called
directly so that it also returns each row's log-sum-exp; with ``output="joint"`` from one fused call
that also computes the key-pooled sums, see ``cogattn.record``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .engine import attention_with_lse

if TYPE_CHECKING:
    from .recording import Recording

__all__ = ["CogVideoXAttnMapProcessor", "FusedCogVideoXAttnMapProcessor"]


class CogVideoXAttnMapProcessor:
    """Drop-in for ``CogVideoXAttnProcessor2_0`` that also feeds selected layers' q, k to a recording.

    Args:
        recording (`Recording`): where maps go; it knows the layer of each attention module, the step
            and the latent grid. Build one with ``cogattn.Recording(pipe, ...)``.
        layer (`int | None`, defaults to `None`): the block index of the module this instance serves;
            `None` lets one instance serve every layer (the recording looks the module up).

    Example:
        ```python
        rec = cogattn.Recording(pipe, kinds=("frame",))
        pipe.transformer.set_attn_processor(cogattn.CogVideoXAttnMapProcessor(rec))
        pipe(...)
        rec.get("frame", step=0, layer=0)
        ```
    """

    def __init__(self, recording: Recording, layer: int | None = None):
        self.recording = recording
        self.layer = layer

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

        layer = self.layer if self.layer is not None else self.recording.layer_of(attn)
        capture = self.recording.wants(layer)
        if capture and attention_mask is not None:
            raise ValueError("cogattn cannot capture attention that uses an attention mask.")
        lse = sums = None
        output = self.recording.output if capture else "stock"
        if output == "lse":
            # Opt-in: the fused kernel SDPA dispatches to, called directly to also return the log-sum-exp.
            hidden_states, lse = attention_with_lse(query, key, value)
        elif output == "joint":
            # Opt-in: one fused call on widened values gives the output, the lse and the key-pooled sums.
            hidden_states, lse, sums = self.recording.joint_attention(query, key, value)
        else:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            )

        if capture:
            self.recording.capture(layer, query, key, lse, sums)

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
