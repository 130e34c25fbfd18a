"""LTX-2's map processors: diffusers' ``LTX2AudioVideoAttnProcessor`` and ``LTX2PerturbedAttnProcessor`` line for
line, plus the lines that hand each attention's q and k to a recording (:mod:`cogattn.models.ltx2` installs them
on all six attentions of every block, each told its source).

Each LTX-2 block has six ``LTX2Attention`` modules, one processor class for all of them: the video self-attention
(``attn1``, 3-D RoPE), the audio self-attention (``audio_attn1``, 1-D RoPE over time), a cross-attention from each
stream to its text (``attn2``, ``audio_attn2``, under the text's additive key mask, 0 or −10000), and the two
cross-modal attentions, video queries over audio keys (``audio_to_video_attn``) and audio queries over video keys
(``video_to_audio_attn``), both with the audio heads and a RoPE of time alone on each side. A module's per-head
output gate (``to_gate_logits``, ``2·sigmoid``) scales each head's output after P·V: the probabilities are the
softmax's. The processor hands q and k of each to the sink by its :data:`SOURCES` name: the video self-attention to
``capture`` (the self-attention kinds; the opt-in output call makes its output), the others to ``capture_context``
with their source and key bias. A processor told no source reads it from the call: the video self-attention without
a context, else the video's text cross-attention (the two a recording installs it on).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from ..recorder.processor import MapSink, context_bias

__all__ = ["PROCESSORS", "SOURCES", "LTX2AttnMapProcessor", "LTX2PerturbedAttnMapProcessor", "map_processors"]

# block attribute → the source its maps are of: "self" (the video self-attention, the self-attention kinds), "text"
# (the video's text cross-attention, video_to_text), and the audio stream's four
SOURCES = {
    "attn1": "self",
    "attn2": "text",
    "audio_attn1": "audio",
    "audio_attn2": "audio_text",
    "audio_to_video_attn": "a2v",
    "video_to_audio_attn": "v2a",
}


def _source(processor, layer: int | None, cross: bool, mask) -> str:
    """The source of a call (the processor's, else read from the call); refuses a captured video self-attention
    under a mask."""
    source = processor.source or ("text" if cross else "self")
    if source == "self" and mask is not None and layer is not None:
        # IC-LoRA's reference tokens: −10000·(1 − strength), a bias, not 0 / −inf
        raise ValueError(
            "cogattn does not yet capture LTX-2's video self-attention under an attention mask (IC-LoRA's "
            "conditioning_attention_strength < 1 or conditioning_attention_mask); record without them."
        )
    return source


def _capture(sink: MapSink, source: str, layer: int, q, key, value, lse, sums, mask) -> None:
    """Hand a captured call's ``q`` ``(B, H, S, D)`` and ``key``, ``value`` ``(B, S, H, D)`` to ``sink`` by
    ``source``, with the lse and sums of the opt-in output call and the call's additive mask ``(B, H, Q, K)``."""
    if source == "self":
        v = value.transpose(1, 2) if sink.wants_value else None
        sink.capture(layer, q, key.transpose(1, 2), lse, sums, value=v)
    else:
        sink.capture_context(layer, q, key.transpose(1, 2), source, context_bias(mask, q.shape[0], key.shape[1]))


class LTX2AttnMapProcessor:
    """Drop-in for ``LTX2AudioVideoAttnProcessor`` (each of a block's six attentions) that also feeds q, k to a
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
            raise ValueError(f"source={source!r}; an LTX-2 attention is one of {sorted(set(SOURCES.values()))}.")
        self.sink, self.source = sink, source

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        if attn.to_gate_logits is not None:
            # Calculate gate logits on original hidden_states
            gate_logits = attn.to_gate_logits(hidden_states)

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if query_rotary_emb is not None:
            if attn.rope_type == "interleaved":
                query = apply_interleaved_rotary_emb(query, query_rotary_emb)
                key = apply_interleaved_rotary_emb(
                    key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
                )
            elif attn.rope_type == "split":
                query = apply_split_rotary_emb(query, query_rotary_emb)
                key = apply_split_rotary_emb(key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        layer = self.sink.layer_to_capture(attn)
        source = _source(self, layer, cross, attention_mask)
        q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them
        fused = (  # the opt-in output call: the video self-attention (it takes no mask)
            None
            if layer is None or source != "self"
            else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        )
        if fused is None:
            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None:
            _capture(self.sink, source, layer, q, key, value, lse, sums, attention_mask)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if attn.to_gate_logits is not None:
            hidden_states = hidden_states.unflatten(2, (attn.heads, -1))  # [B, T, H, D]
            # The factor of 2.0 is so that if the gates logits are zero-initialized the initial gates are all 1
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, T, H]
            hidden_states = hidden_states * gates.unsqueeze(-1)
            hidden_states = hidden_states.flatten(2, 3)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class LTX2PerturbedAttnMapProcessor:
    """Drop-in for ``LTX2PerturbedAttnProcessor`` (blocks built with ``perturbed_attn``: spatio-temporal guidance
    replaces a block's self-attentions by their values) that also feeds q, k to a recording. A perturbed call is
    not the model's attention: a captured call under a perturbation raises `ValueError`.

    Args:
        sink (`MapSink`): where maps go.
        source (`str | None`): which attention the module is (a value of :data:`SOURCES`); `None`: read from the
            call (the video's self-attention without a context, else its text cross-attention).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink, source: str | None = None):
        if source is not None and source not in SOURCES.values():
            raise ValueError(f"source={source!r}; an LTX-2 attention is one of {sorted(set(SOURCES.values()))}.")
        self.sink, self.source = sink, source

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | None = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        if attn.to_gate_logits is not None:
            # Calculate gate logits on original hidden_states
            gate_logits = attn.to_gate_logits(hidden_states)

        value = attn.to_v(encoder_hidden_states)
        if all_perturbed is None:
            all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and perturbation_mask is not None:
            raise ValueError(
                "cogattn captures LTX-2's attention in the calls that run it; this one is perturbed by "
                "spatio-temporal guidance (its self-attention replaced by the values), which is not captured."
            )
        if all_perturbed:
            # Skip attention, use the value projection value
            hidden_states = value
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(encoder_hidden_states)

            query = attn.norm_q(query)
            key = attn.norm_k(key)

            if query_rotary_emb is not None:
                if attn.rope_type == "interleaved":
                    query = apply_interleaved_rotary_emb(query, query_rotary_emb)
                    key = apply_interleaved_rotary_emb(
                        key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
                    )
                elif attn.rope_type == "split":
                    query = apply_split_rotary_emb(query, query_rotary_emb)
                    key = apply_split_rotary_emb(
                        key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
                    )

            query = query.unflatten(2, (attn.heads, -1))
            key = key.unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))

            source = _source(self, layer, cross, attention_mask)
            q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them
            fused = (  # the opt-in output call: the video self-attention (it takes no mask)
                None
                if layer is None or source != "self"
                else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
            )
            if fused is None:
                hidden_states = dispatch_attention_fn(
                    query,
                    key,
                    value,
                    attn_mask=attention_mask,
                    dropout_p=0.0,
                    is_causal=False,
                    backend=self._attention_backend,
                    parallel_config=self._parallel_config,
                )
                lse = sums = None
            else:
                hidden_states, lse, sums = fused
                hidden_states = hidden_states.transpose(1, 2)
            if layer is not None:
                _capture(self.sink, source, layer, q, key, value, lse, sums, attention_mask)
            hidden_states = hidden_states.flatten(2, 3)
            hidden_states = hidden_states.to(query.dtype)

            if perturbation_mask is not None:
                value = value.flatten(2, 3)
                hidden_states = torch.lerp(value, hidden_states, perturbation_mask)

        if attn.to_gate_logits is not None:
            hidden_states = hidden_states.unflatten(2, (attn.heads, -1))  # [B, T, H, D]
            # The factor of 2.0 is so that if the gates logits are zero-initialized the initial gates are all 1
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, T, H]
            hidden_states = hidden_states * gates.unsqueeze(-1)
            hidden_states = hidden_states.flatten(2, 3)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


PROCESSORS = {
    LTX2AudioVideoAttnProcessor: LTX2AttnMapProcessor,
    LTX2PerturbedAttnProcessor: LTX2PerturbedAttnMapProcessor,
}


def map_processors(transformer, sink: MapSink) -> dict[str, object]:
    """A map processor feeding ``sink`` for each of the six attentions of every block, by its path
    (``"transformer_blocks.3.audio_attn1"``), each told its source; refuses a processor that is not stock."""
    out = {}
    for i, block in enumerate(transformer.transformer_blocks):
        for attr, source in SOURCES.items():
            proc = getattr(block, attr).processor
            if type(proc) not in PROCESSORS:
                raise TypeError(
                    f"transformer_blocks.{i}.{attr} runs a {type(proc).__name__}; cogattn captures through the stock "
                    "LTX2AudioVideoAttnProcessor or LTX2PerturbedAttnProcessor."
                )
            out[f"transformer_blocks.{i}.{attr}"] = PROCESSORS[type(proc)](sink, source)
    return out
