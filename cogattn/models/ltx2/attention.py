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

The video self-attention may take an additive mask (``LTX2InContextPipeline``'s ``video_self_attention_mask``:
−10000·(1 − strength) between the IC-LoRA reference tokens and the others, made per head by
``prepare_attention_mask``): capture is handed it as a ``QueryKeyBias``, which row tiles add to the scaled scores
as the model adds it. Video tokens after the grid (keyframe conditions, references) lead the video in what capture
is handed (the self-attention's q, k, v and bias, the video queries of the text and audio cross-attentions), the
layout's ``history_len``; the model's output is the stock call's, in the model's order.
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

from ...recorder.processor import MapSink, context_bias, query_key_bias

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
    """The source of a call: the processor's, else read from the call."""
    return processor.source or ("text" if cross else "self")


def _stock_output(sink: MapSink, layer: int | None, source: str, mask) -> bool:
    """Whether a call keeps the stock output call: all but a captured video self-attention over the grid alone
    without a mask (the opt-in output call takes no mask, and its lse would be in the model's token order)."""
    return layer is None or source != "self" or mask is not None or bool(sink.layout.history_len)


def _leading_extras(sink: MapSink, length: int, device) -> torch.Tensor | None:
    """The capture's token order of a video sequence of ``length``: the tokens after the grid (keyframe and IC-LoRA
    reference tokens, the layout's ``history_len``) first, then the grid's; `None` where there are none."""
    extras = sink.layout.history_len
    if not extras:
        return None
    grid = length - extras
    return torch.cat([torch.arange(grid, length, device=device), torch.arange(grid, device=device)])


def _capture(sink: MapSink, source: str, layer: int, q, key, value, lse, sums, mask) -> None:
    """Hand a captured call's ``q`` ``(B, H, S, D)`` and ``key``, ``value`` ``(B, S, H, D)`` to ``sink`` by
    ``source``, with the lse and sums of the opt-in output call and the call's additive mask ``(B, H, Q, K)``: the
    video self-attention's as a :class:`QueryKeyBias` (IC-LoRA's), a cross-attention's as a key bias. Video tokens
    after the grid lead the video in what capture is handed (q, k, v and the bias alike): the model's output is
    the stock call's, in the model's order."""
    if source == "self":
        order = _leading_extras(sink, q.shape[2], q.device)
        bias = query_key_bias(mask, q.shape[0], q.shape[2], order)
        key, v = key.transpose(1, 2), value.transpose(1, 2) if sink.wants_value else None
        if order is not None:
            q, key = q.index_select(2, order), key.index_select(2, order)
            v = None if v is None else v.index_select(2, order)
        sink.capture(layer, q, key, lse, sums, mask=bias, value=v)
        return
    if source in ("text", "a2v"):  # video queries: the grid's are the kinds' rows, the tokens after it lead
        order = _leading_extras(sink, q.shape[2], q.device)
        q = q if order is None else q.index_select(2, order)
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
            if _stock_output(self.sink, layer, source, attention_mask)
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
                if _stock_output(self.sink, layer, source, attention_mask)
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
