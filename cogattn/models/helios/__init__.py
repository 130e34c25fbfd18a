"""Helios (text-, image- and video-to-video): Wan's two attentions over a window of latent frames that follows
its history latents (docs/design.md, "The model seam").

Each of ``HeliosTransformer3DModel``'s blocks has a self-attention (``attn1``: RMS norms across the heads, 3-D
RoPE) and a cross-attention to the UMT5 text (``attn2``, 512 tokens zero-padded after the prompt, no mask), both
``HeliosAttention`` modules run by ``HeliosAttnProcessor``. The self-attention's sequence is, in order::

    [long history (4×) | mid history (2×) | short history | window F·Hp·Wp]

The pipeline generates a long video in chunks of ``num_latent_frames_per_chunk`` latent frames (9), each a
denoising loop of its own, conditioned on the latest ``history_sizes`` (16, 2, 1) latent frames of what it made
before (zeros before there are any): the 16 oldest patched 4× coarser (kernel 4·p, after padding to 4 × 8 × 8
latent pixels), the next 2 patched 2× coarser (2 × 4 × 4), and the newest with the first frame (the image, or
the first chunk's first frame) at the window's patch size. The layout's video is that whole sequence:
``history_len`` history tokens off the grid, then the window's grid, which video points ``(frame, row, col)``
address; so the kinds that pool over frame groups or place every video token on the grid are refused, and
``full``, ``query``, ``entropy``, ``received``, ``block`` and ``topk`` are exact over every token.

Two lines of the model act on the history alone. With ``is_amplify_history`` the self-attention multiplies the
history's keys by ``1 + sigmoid(history_key_scale) · (max_scale − 1)`` (one factor per head, or one for all) after
RoPE: the q and k the processor hands the recording are those the attention call gets, scaled keys included,
so every map is of the scores the model forms. With ``guidance_cross_attn`` (the released checkpoints) only the
window's tokens query the text; without it every token does, and ``video_to_text`` (the window's grid) keeps the
window's rows, the history's having no (frame, row, col).

A recording follows the chunks as SkyReels-V2's windows (:func:`window`): every chunk has the layout of the
first (the same window and history), its steps are numbered on across the chunks and ``Recording.windows``
says each step's chunk. ``HeliosPyramidPipeline`` denoises each chunk at rising resolutions (stages): each
stage is a window of its own grid, so a recording holds the first stage of the first chunk and warns at the
next. Under classifier-free guidance the pipelines call the transformer twice per step, the conditional call
first, as Wan's.
"""

from __future__ import annotations

import math

import torch

from ...layout import VAE_SPATIAL, VAE_TEMPORAL, TokenLayout
from ...recorder.processor import MapSink
from .._call_frame import call_locals
from .._checkpoint import pipeline_name
from ..spec import ModelSpec, Site, Unavailable, call_argument, text_never_queries

# Attention shapes of the released checkpoints (their transformer/config.json: diffusers' defaults, Wan 2.1
# 14B's attention with the history patch embeddings), for plans made offline.
_HELIOS = {
    "_class_name": "HeliosTransformer3DModel",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "num_layers": 40,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "guidance_cross_attn": True,
    "has_multi_term_memory_patch": True,
    "is_amplify_history": False,
}
KNOWN: dict[str, dict] = {
    "BestWishYsh/Helios-Base": _HELIOS,
    "BestWishYsh/Helios-Mid": _HELIOS,
    "BestWishYsh/Helios-Distilled": _HELIOS,
}
CONFIG_KEYS = ("has_multi_term_memory_patch",)

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_helios import (
        HeliosAttnProcessor,
        HeliosTransformer3DModel,
        _get_qkv_projections,
        apply_rotary_emb_transposed,
    )
except ImportError as missing:
    needs = "Helios needs diffusers >= 0.37 (HeliosTransformer3DModel)"
    raise Unavailable("helios", needs, KNOWN) from missing
from .tiny import TEXT_LEN, tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "KNOWN",
    "HeliosAttnMapProcessor",
    "TEXT_LEN",
    "chunks",
    "history_tokens",
    "layout_for_video",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
    "window",
]

CHUNK = 9  # latent frames of a chunk (the pipelines' num_latent_frames_per_chunk): 33 frames
HISTORY_FRAMES = (2, 2, 16)  # short (the first frame and the newest), mid and long history latent frames
# the history patch embeddings: (padded to, the kernel in patches) of the short, mid and long history
_HISTORY = (((1, 1, 1), 1), ((2, 4, 4), 2), ((4, 8, 8), 4))


class HeliosAttnMapProcessor:
    """Drop-in for ``HeliosAttnProcessor`` (self- and cross-attention) that also feeds q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and the role
            (self- or cross-attention) of each module. One instance serves every module.
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
        original_context_length: int = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:
            query = apply_rotary_emb_transposed(query, rotary_emb)
            key = apply_rotary_emb_transposed(key, rotary_emb)

        if not attn.is_cross_attention and attn.is_amplify_history:
            history_seq_len = hidden_states.shape[1] - original_context_length

            if history_seq_len > 0:
                scale_key = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
                if attn.history_scale_mode == "per_head":
                    scale_key = scale_key.view(1, 1, -1, 1)
                key = torch.cat([key[:, :history_seq_len] * scale_key, key[:, history_seq_len:]], dim=1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and attention_mask is not None:  # Helios's blocks never pass one
            raise ValueError("cogattn captures Helios's attention without a mask; this call passes one.")
        # (B, H, S, D), as the recording takes them; the history's keys scaled as the attention gets them
        q = None if layer is None else query.transpose(1, 2)
        fused = (
            None
            if layer is None or cross
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
                # Reference: https://github.com/huggingface/diffusers/pull/12909
                parallel_config=(self._parallel_config if encoder_hidden_states is None else None),
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None and cross:
            self.sink.capture_context(layer, q, key.transpose(1, 2), "text")
        elif layer is not None:
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, q, key.transpose(1, 2), lse, sums, value=v)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def history_tokens(shapes: tuple, patch_size) -> int:
    """Tokens of the short, mid and long history latents of latent sizes ``shapes`` (``(frames, height, width)``
    each; `None`: not given): each padded to whole blocks of its padding (replicated) and patched by its kernel,
    ``patch_size`` times 1, 2 and 4."""
    tokens = 0
    for shape, (pad, scale) in zip(shapes, _HISTORY):
        if shape is not None:
            tokens += math.prod(-(-n // b) * b // (scale * int(p)) for n, b, p in zip(shape, pad, patch_size))
    return tokens


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``HeliosTransformer3DModel`` call: the window's latents
    ``(B, C, F, H, W)`` after the history latents the call gives (each with its frame indices), the text as the
    cross-attention's context."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    shapes = []  # each history's (F, H, W): at the full latent size, where the pyramid's window is smaller
    for i, name in enumerate(("short", "mid", "long")):
        latents = call_argument(args, kwargs, 7 + i, f"latents_history_{name}")
        indices = call_argument(args, kwargs, 4 + i, f"indices_latents_history_{name}")
        shapes.append(None if latents is None or indices is None else tuple(latents.shape[2:]))  # the model's test
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    layout = TokenLayout.of_video_latents(
        hidden.shape,
        config["patch_size"],
        context_len=int(text.shape[1]),
        history_len=history_tokens(tuple(shapes), config["patch_size"]),
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Helios pipeline call at ``height`` × ``width`` (8× spatial) with the pipelines' defaults: a
    chunk of 9 latent frames, whatever ``num_frames`` (which sets the number of chunks), after the history of
    ``history_sizes=[16, 2, 1]`` with the first frame, and ``text_len`` (512) text tokens in the cross-attention."""
    patch = [int(p) for p in config.get("patch_size", (1, 2, 2))]
    latent_height, latent_width = int(height) // VAE_SPATIAL, int(width) // VAE_SPATIAL
    return TokenLayout(
        text_len=0,
        frames=CHUNK // patch[0],
        height=latent_height // patch[1],
        width=latent_width // patch[2],
        patch_size=patch[1],
        patch_size_t=patch[0] if patch[0] > 1 else None,
        context_len=text_len or TEXT_LEN,
        temporal_compression=VAE_TEMPORAL,
        history_len=history_tokens(tuple((n, latent_height, latent_width) for n in HISTORY_FRAMES), patch),
    )


def call_steps(num_frames: int, num_inference_steps: int) -> int:
    """The steps of a pipeline call for ``num_frames`` frames with the pipelines' 9 latent frames a chunk
    (``ModelSpec.call_steps``): ⌈num_frames / 33⌉ chunks, each a denoising loop of ``num_inference_steps``."""
    per_chunk = (CHUNK - 1) * VAE_TEMPORAL + 1
    return max(1, -(-int(num_frames) // per_chunk)) * num_inference_steps


def call_rules(cfg, config: dict) -> None:
    """The batch tool's Helios rule (``ModelSpec.call_rules``): a checkpoint made for ``HeliosPyramidPipeline`` (its
    ``model_index.json`` names it; offline, ``Helios-Distilled``) is refused: the batch tool runs ``HeliosPipeline``,
    and a recording of the pyramid holds its first stage only."""
    name = pipeline_name(cfg.model)
    if "Pyramid" in name or "Helios-Distilled" in name:
        raise ValueError(
            f"model: {cfg.model} is a pyramid checkpoint; the batch tool runs HeliosPipeline only: record "
            "HeliosPyramidPipeline from Python with cogattn.record (a recording holds the first stage of the first chunk)."
        )


def window(pipeline) -> tuple[int, int] | None:
    """``(index, count)`` of the window running in ``pipeline``'s call (``ModelSpec.window``): a chunk of
    ``HeliosPipeline``, a stage of a chunk of ``HeliosPyramidPipeline`` (``chunk · stages + stage``). The chunk is
    read from the call's frame, on the stack at every transformer call: the frames decoded so far
    (``history_video``, ``window_num_frames`` per chunk), which a step's callback cannot rebind as it does the loop's
    ``k``. `None` outside such a call (a bare transformer)."""
    found = call_locals(pipeline)
    if found is None:
        return None
    decoded, per_chunk, chunks = (found.get(n) for n in ("history_video", "window_num_frames", "num_latent_chunk"))
    if not isinstance(per_chunk, int) or not isinstance(chunks, int):
        return None
    chunk = 0 if decoded is None else int(decoded.shape[2]) // per_chunk
    stages, stage = found.get("pyramid_num_stages"), found.get("stage_idx")
    if isinstance(stages, int) and isinstance(stage, int):
        return chunk * stages + stage, chunks * stages
    return chunk, chunks


_OFF_GRID = (
    "Helios's self-attention sequence starts with its history latents (short, mid and long), tokens off the "
    "window's latent frame grid"
)
SPEC = ModelSpec(
    "helios",
    (HeliosTransformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {HeliosAttnProcessor: HeliosAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=CONFIG_KEYS,
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "text_to_video": text_never_queries("Helios"),
        "video_to_image": "Helios has no image attention: an image to animate is the first frame of its history.",
        "frame": f"{_OFF_GRID}, so its tokens do not split into frame groups; full, query, entropy, received, "
        "block and topk cover every token.",
        "query_frame": f"{_OFF_GRID}, so its keys do not split into frame groups; query or full give a "
        "token's whole row.",
        "tile": f"{_OFF_GRID}, so its tokens do not split into 3-D tiles; block pools runs of tokens of every token.",
        "frame_max": f"{_OFF_GRID}, so its keys do not split into frame groups; topk gives each row's largest keys "
        "over every token.",
        "offset": f"{_OFF_GRID}, so they have no offset from a grid token; query or full give a video token's "
        "whole row.",
        **dict.fromkeys(
            ("pattern_recall", "pattern_error"),
            f"{_OFF_GRID}: a pattern over (frame, row, col) has no position for them; block with "
            "masks.mask_recall measures a block mask over every token.",
        ),
    },
    guidance_calls=2,
    float32=("vae",),
    title="Helios",
    frame_counts="33, 66, 99, 132, ... (chunks of 33)",
    pipelines={"text-to-video": "HeliosPipeline", "image-to-video": "HeliosPipeline"},
    call_rules=call_rules,
    window=window,
    call_steps=call_steps,
)
