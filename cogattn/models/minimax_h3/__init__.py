"""MiniMax-H3 (joint video and audio, ``MiniMaxH3ModularPipeline``): one self-attention over one packed sequence
(docs/design.md, "The model seam").

``MiniMaxH3Transformer3DModel`` runs ``num_layers`` blocks, each one full self-attention
(``MiniMaxH3AttnProcessor``, no mask, no cross-attention) over the sequence the pipeline packs::

    [text T | keyframe conditions K·Hp·Wp | audio 2·A | video F·Hp·Wp]

The text is the Qwen3-VL presentation (fl2va: a ``"<Picture i>: "`` label and a vision block per keyframe, then the
prompt verbatim; t2va: the prompt alone, no special tokens, no padding), the conditions are the keyframes' latents
(one latent frame each, on the video's patch grid), the audio is the stereo soundtrack's latents (channel-major,
40 a second), and the video is the generated latent grid, patch (1, 2, 2) of a VAE that compresses 16 × 16
pixels and 17 frames into 5 latent frames (``17 n + 5`` frames, ``5 n + 2`` latent frames).

The layout puts every token before the grid in the layout's text, the conditioning stream (as FramePack's image
tokens and text): ``text_len = T + K·Hp·Wp + 2·A``, the grid after it. So every grid kind is exact: frame group 0
(the ``frame`` kinds) pools the text, the keyframes and the audio; ``video_to_text`` and ``text_to_video`` keep one
column (row) per token, the prompt's first, then the keyframes', then the audio's. ``image_len`` is the
presentation before the prompt (through the last vision block: the rows the pipeline tags as video), so word labels
(:func:`prompt_text`, the prompt tokenized alone) sit on the prompt; the keyframe and audio tokens after it are
named as the tokenizer's padding. ``ref2va``'s references (``transformer_ref``) are tokens before the grid as
well, in the layout's text.

The checkpoint is guidance-distilled: one call per step, no unconditional branch. The token refiner's attentions
(``token_refiner.refiner_blocks.N.attn``, the text alone, before the blocks) are no layers and keep diffusers'
processor. The tiny pipeline (``tiny.py``) is the modular pipeline's own blocks and components at toy size; the
batch tool loads a checkpoint's ``t2va`` components (``ModelSpec.workflows``) and saves the soundtrack beside the video.
"""

from __future__ import annotations

import torch

from ...layout import TokenLayout
from ...recorder.processor import MapSink, query_key_mask
from ..prompt_text import PromptText, kept, tokenize
from ..spec import ModelSpec, Site, Unavailable, call_argument

# Attention shapes of the released checkpoint: diffusers' MiniMaxH3Transformer3DModel defaults, which its docstring
# and the modular pipeline's docs give as MiniMaxAI/MiniMax-H3's (its transformer/ and transformer_ref/ partitions).
KNOWN: dict[str, dict] = {
    "MiniMaxAI/MiniMax-H3": {
        "_class_name": "MiniMaxH3Transformer3DModel",
        "num_attention_heads": 56,
        "attention_head_dim": 128,
        "hidden_size": 5376,
        "num_layers": 50,
        "num_refiner_layers": 2,
        "in_channels": 24,
        "audio_in_channels": 32,
        "patch_size": [1, 2, 2],
        "text_dim": 5120,
    },
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3AttnProcessor,
        MiniMaxH3Transformer3DModel,
        _apply_rotary_emb,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        align_num_frames,
        audio_latent_num_frames,
        video_latent_num_frames,
    )
except ImportError as missing:
    needs = "MiniMax-H3 needs a diffusers with MiniMaxH3Transformer3DModel and its modular pipeline (0.42 has them)"
    raise Unavailable("minimax_h3", needs, KNOWN) from missing

from .tiny import TINY_TEXT, tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = ["SPEC", "KNOWN", "MiniMaxH3AttnMapProcessor", "TEXT_LEN", "layout_for_video", "prompt_text", "read_call"]
__all__ += ["TINY_TEXT", "tiny_call", "tiny_pipeline", "tiny_transformer"]

TEXT_LEN = 128  # the prompt's tokens in a plan (the pipeline pads nothing: a call's own count)
SPATIAL = 16  # pixels per latent pixel, each way (the video VAE's spatial_compression_ratio)
CHUNK_FRAMES, CHUNK_LATENTS = 17, 5  # the VAE's clip_length and tokens_chunk_size: 17 n + 5 frames → 5 n + 2
VIDEO_TAG = 0  # the modality tag of a video row (a vision block's rows of the text too)


class MiniMaxH3AttnMapProcessor:
    """Drop-in for ``MiniMaxH3AttnProcessor`` (the blocks' self-attention over the packed sequence) that also feeds
    q, k to a recording.

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
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)

        layer = self.sink.layer_to_capture(attn)
        # the model passes no mask; a caller's (B or 1, 1, S, S) one is applied by capture as the attention applies it
        mask = None if layer is None else query_key_mask(attention_mask, query.shape[0], query.shape[1])
        q, k = (None, None) if layer is None else (query.transpose(1, 2), key.transpose(1, 2))  # (B, H, S, D)
        fused = (
            None
            if layer is None or attention_mask is not None
            else self.sink.attention(layer, q, k, value.transpose(1, 2))
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
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, q, k, lse, sums, mask=mask, value=v)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def _grid(positions: torch.Tensor) -> tuple[int, int, int]:
    """``(F, Hp, Wp)`` of the video grid whose rotary coordinates ``(N, 3)`` are ``positions``: its distinct times,
    rows and columns, which must be their full product in frame-major, then row-major order."""
    axes = [torch.unique(positions[:, i]) for i in range(3)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    if grid.shape != positions.shape or not torch.equal(grid, positions):
        raise ValueError(
            f"the last {positions.shape[0]} rows of this MiniMax-H3 call (its video rows after the last text or audio "
            "row) are no (t, h, w) grid in frame-major order; cogattn records the sequences the pipeline packs, "
            "[text | conditions | audio | video]."
        )
    return tuple(len(axis) for axis in axes)


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``MiniMaxH3Transformer3DModel`` call: the grid is the video
    rows after the last text or audio row (their ``position_ids`` its times, rows and columns), every row before it
    the layout's text; ``image_len`` the text rows through the last one tagged as video (the vision blocks before the
    prompt); the step's time the generated video's noise level σ = 1 − t (its rows' entry of ``timestep``)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    names = ("timestep", "timestep_indices", "token_tags", "position_ids", "video_indices", "text_indices")
    t, t_index, tags, positions, video, text = (
        call_argument(args, kwargs, i, n) for i, n in zip((3, 4, 5, 6, 7, 9), names)
    )
    if positions is None or video is None or tags is None:
        raise ValueError(
            "cogattn reads MiniMax-H3's layout from the call's position_ids, token_tags and video_indices."
        )
    S = positions.shape[0]
    is_video = torch.zeros(S, dtype=torch.bool, device=video.device)
    is_video[video] = True
    others = torch.nonzero(~is_video).flatten()
    start = int(others.max()) + 1 if len(others) else 0  # the grid: the video rows after every other row
    frames, height, width = _grid(positions[start:].detach().double().cpu())
    p_t, p_h, _ = (int(p) for p in config["patch_size"])
    text_tags = tags[text].cpu() if text is not None else tags[:0].cpu()
    vision = torch.nonzero(text_tags == VIDEO_TAG).flatten()
    layout = TokenLayout(
        text_len=start,
        frames=frames,
        height=height,
        width=width,
        patch_size=p_h,
        patch_size_t=p_t if p_t > 1 else None,
        image_len=int(vision.max()) + 1 if len(vision) else 0,
        clip_latents=CHUNK_LATENTS,  # the VAE's clips: 17 frames in 5 latent frames, each clip causal
    )
    # MiniMax-H3's t runs up from 0 (noise) to 1 (clean); a recording counts steps down: the video's σ = 1 − t
    time = 1.0 - (float(t.flatten()[t_index[-1]]) if isinstance(t, torch.Tensor) else float(t))
    return layout, hidden.shape[0], time, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a text-to-video-and-audio (t2va) call: ``num_frames`` (rounded up to ``17 n + 5``, as the
    pipeline rounds it) as ``5 n + 2`` latent frames of ``height / 32`` × ``width / 32`` patches, after ``text_len``
    (default 128) prompt tokens and the soundtrack's ``2 · round(frames / 24 · 40)`` audio tokens."""
    frames = align_num_frames(max(int(num_frames), 1), CHUNK_FRAMES, CHUNK_LATENTS)
    latent = video_latent_num_frames(frames, CHUNK_FRAMES, CHUNK_LATENTS)
    p_t, p_h, p_w = (int(p) for p in config["patch_size"])
    audio = MINIMAX_H3_AUDIO_CHANNELS * audio_latent_num_frames(frames)
    return TokenLayout(
        text_len=(text_len or TEXT_LEN) + audio,
        frames=latent // p_t,
        height=int(height) // SPATIAL // p_h,
        width=int(width) // SPATIAL // p_w,
        patch_size=p_h,
        patch_size_t=p_t if p_t > 1 else None,
        clip_latents=CHUNK_LATENTS,
    )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The prompt's tokens as the pipeline's text encoder steps make them (``ModelSpec.prompt_text``): the prompt
    verbatim, no chat template and no special tokens, padded to ``length`` (the keyframe and audio tokens after it)."""
    tokens = tokenize(pipeline.tokenizer, prompt, length, offsets, add_special_tokens=False, padding_side="right")
    return kept(tokens, PromptText([], prompt, (0, len(prompt))))


def call_rules(cfg, config: dict) -> None:
    """The batch tool's MiniMax-H3 rules (``ModelSpec.call_rules``): ``17 n + 5`` frames (the VAE's, each 17 a clip)
    of 5 to 15 seconds at 24 fps; the tiny pipeline's of any duration its VAE decodes (n ≥ 1); no guidance (the
    checkpoint is guidance-distilled) and no diffusers offload (a modular pipeline has none)."""
    seconds = 22 <= cfg.num_frames if cfg.tiny_spec() is not None else 120 <= cfg.num_frames <= 360
    if cfg.num_frames % CHUNK_FRAMES != CHUNK_LATENTS or not seconds:
        low, high = (22, None) if cfg.tiny_spec() is not None else (124, 345)
        counts = f"{low}, {low + 17}, {low + 34}, ..." + (f", {high}" if high else "")
        raise ValueError(
            f"num_frames: {cfg.num_frames}; MiniMax-H3 generates 17n + 5 frames"
            + (" of 5 to 15 seconds at 24 fps" if high else "")
            + f": use {counts}."
        )
    if cfg.guidance_scale is not None and cfg.guidance_scale > 1:
        raise ValueError(
            f"guidance_scale: {cfg.guidance_scale}; MiniMax-H3 is guidance-distilled (one call per step, no "
            "unconditional branch): set guidance_scale: 1.0."
        )
    if cfg.offload != "none":
        raise ValueError(
            f"offload: {cfg.offload!r}; MiniMax-H3's modular pipeline has no diffusers CPU offload: set offload: none."
        )


_AUDIO = (
    "MiniMax-H3's audio is no stream of its own: its tokens are keys and queries of the one self-attention, in the "
    "layout's text after the prompt and the keyframes; full, query, video_to_text and text_to_video give them."
)
SPEC = ModelSpec(
    "minimax_h3",
    (MiniMaxH3Transformer3DModel,),
    (Site("transformer_blocks", "attn"),),
    {MiniMaxH3AttnProcessor: MiniMaxH3AttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "video_to_image": "MiniMax-H3 has no image cross-attention: its keyframe latents and vision blocks are keys of "
        "the one self-attention, in the layout's text (video_to_text gives them).",
        **dict.fromkeys(("audio", "audio_to_text", "frame_audio", "audio_frame"), _AUDIO),
    },
    guidance=lambda pipeline: False,  # guidance-distilled: one call per step, no unconditional branch
    experts=("transformer", "transformer_ref"),  # t2va and fl2va run the first, ref2va the second
    call_steps=lambda num_frames, num_inference_steps: num_inference_steps - 1,  # its grid's last point: no call
    title="MiniMax-H3",
    frame_counts="124, 141, ..., 345 (17n + 5)",
    pipelines={"text-to-video": "MiniMaxH3ModularPipeline"},
    workflows={"text-to-video": "t2va"},
    call_rules=call_rules,
    prompt_text=prompt_text,
)
