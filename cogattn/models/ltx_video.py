"""LTX-Video (0.9.x): the map processor, the family's facts and its tiny pipeline (docs/design.md, "The model seam").

Each of LTX-Video's blocks has a self-attention over the video alone (``attn1``: RMS norms across the heads, 3-D
RoPE) and a cross-attention from the video to the T5 text (``attn2``, 128 tokens) under a key mask: the
transformer turns the pipeline's 0/1 text mask into a bias, 0 on the prompt's tokens and −10000 on the padding,
which the attention adds to every score. Both are ``LTXAttention`` modules run by ``LTXVideoAttnProcessor``;
:class:`LTXVideoAttnMapProcessor` is that processor line for line, plus the lines that hand q and k (and the
cross-attention's bias) to the recording. The self-attention feeds the self-attention kinds, the
cross-attention ``video_to_text``, with the bias added as the model adds it (a padded token's probability is 0).

The sequence is the video's latents packed one token per latent pixel (patch size 1 in every release): the grid
comes from the call's ``num_frames``, ``height`` and ``width`` (the latent sizes), or, from
``LTXConditionPipeline``, from its ``video_coords``: the latents of a condition placed after frame 0 lead the
sequence, tokens off the grid (the layout's ``history_len``). The VAE compresses 32 × 32 pixels and 8 frames
(after the first) into one latent pixel. The pipelines make one call per step, ``[uncond..., cond...]`` under
guidance, as CogVideoX; image-to-video gives a timestep per token (0 on the image's frame).
"""

from __future__ import annotations

import inspect

import torch

from ..layout import TokenLayout
from ..recorder.processor import MapSink, context_bias
from ._call_frame import window_reader
from .spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast, masked_text, tiny_text_encoder, tiny_tokenizer

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_LTX = {"_class_name": "LTXVideoTransformer3DModel", "patch_size": 1, "patch_size_t": 1, "in_channels": 128}
_2B = {**_LTX, "num_layers": 28, "num_attention_heads": 32, "attention_head_dim": 64, "cross_attention_dim": 2048}
_13B = {**_LTX, "num_layers": 48, "num_attention_heads": 32, "attention_head_dim": 128, "cross_attention_dim": 4096}
KNOWN: dict[str, dict] = {
    "Lightricks/LTX-Video": _2B,
    "Lightricks/LTX-Video-0.9.1": _2B,
    "Lightricks/LTX-Video-0.9.5": _2B,
    "Lightricks/LTX-Video-0.9.7-dev": _13B,
    "Lightricks/LTX-Video-0.9.7-distilled": _13B,
    "Lightricks/LTX-Video-0.9.8-13B-distilled": _13B,
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_ltx import (
        LTXAttention,  # noqa: F401  (its absence, before diffusers 0.35, means no LTX-Video support)
        LTXVideoAttnProcessor,
        LTXVideoTransformer3DModel,
        apply_rotary_emb,
    )
except ImportError as missing:
    needs = "LTX-Video needs diffusers >= 0.35 (LTXAttention)"
    raise Unavailable("ltx_video", needs, KNOWN) from missing

__all__ = [
    "SPEC",
    "KNOWN",
    "LTXVideoAttnMapProcessor",
    "TEXT_LEN",
    "VAE_SPATIAL",
    "VAE_TEMPORAL",
    "layout_for_video",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 128  # T5 tokens of the pipelines' calls (max_sequence_length)
VAE_SPATIAL = 32  # pixels per latent pixel, each way
VAE_TEMPORAL = 8  # pixel frames per latent frame after the first
_PARALLEL = "parallel_config" in inspect.signature(dispatch_attention_fn).parameters


class LTXVideoAttnMapProcessor:
    """Drop-in for ``LTXVideoAttnProcessor`` (self- and cross-attention) that also feeds q, k to a recording.

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
        image_rotary_emb: torch.Tensor | None = None,
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

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and not cross and attention_mask is not None:  # LTX-Video's blocks never pass one
            raise ValueError("cogattn captures LTX-Video's self-attention without a mask; this call passes one.")
        q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them
        fused = (
            None
            if layer is None or cross  # the opt-in output call: the self-attention (it takes no mask)
            else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        )
        if fused is None:
            parallel = {"parallel_config": self._parallel_config} if _PARALLEL else {}
            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                **parallel,
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None and cross:
            bias = context_bias(attention_mask, batch_size, key.shape[1])
            self.sink.capture_context(layer, q, key.transpose(1, 2), "text", bias)
        elif layer is not None:
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, q, key.transpose(1, 2), lse, sums, value=v)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def _grid_of_coords(coords: torch.Tensor, seq_len: int) -> tuple[int, tuple[int, int, int]]:
    """``(tokens before the grid, (F, Hp, Wp))`` of ``LTXConditionPipeline``'s ``video_coords`` ``(B, 3, S)``: the
    video's grid is the tokens from the last at coordinates (0, 0, 0) on (a condition placed after frame 0 leads,
    its frames later in time), in raster order (f, y, x); anything else raises `ValueError`."""
    if coords.dim() != 3 or coords.shape[1] != 3 or coords.shape[2] != seq_len:
        raise ValueError(f"video_coords of shape {tuple(coords.shape)}; LTX-Video takes (B, 3, {seq_len}).")
    c = coords[0].detach().to("cpu", torch.float64)
    if not torch.equal(coords.detach().cpu().double(), c.expand(coords.shape[0], -1, -1)):
        raise ValueError("cogattn captures LTX-Video calls whose items share video_coords; these differ.")
    origins = (c == 0).all(0).nonzero().flatten()
    start = int(origins[-1]) if len(origins) else -1
    grid = c[:, max(start, 0) :]
    first = (grid[0] == 0) & (grid[1] == 0)
    width, frame_tokens = int(first.cumprod(0).sum()), int((grid[0] == 0).cumprod(0).sum())
    ok = start >= 0 and width > 0 and frame_tokens % width == 0 and grid.shape[1] % frame_tokens == 0
    if ok:
        shaped = grid.reshape(3, -1, frame_tokens // width, width)  # (3, F, Hp, Wp)
        ok = (
            bool((shaped[0] == shaped[0, :, :1, :1]).all() and (shaped[0, 1:, 0, 0] > shaped[0, :-1, 0, 0]).all())
            and bool((shaped[1] == shaped[1, :1, :, :1]).all() and (shaped[1, 0, 1:, 0] > shaped[1, 0, :-1, 0]).all())
            and bool((shaped[2] == shaped[2, :1, :1, :]).all() and (shaped[2, 0, 0, 1:] > shaped[2, 0, 0, :-1]).all())
        )
    if not ok:
        raise ValueError(
            "cogattn reads LTX-Video's grid from video_coords whose last tokens are the video's latents in raster "
            "order from (0, 0, 0), as LTXConditionPipeline makes them; these are not."
        )
    return start, tuple(shaped.shape[1:])


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``LTXVideoTransformer3DModel`` call: packed latents
    ``(B, S, C)``, the grid from ``num_frames``, ``height`` and ``width`` (latent sizes) or from ``video_coords``."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 1, "encoder_hidden_states")
    t = call_argument(args, kwargs, 2, "timestep")
    frames, height, width = (
        call_argument(args, kwargs, i, n) for i, n in ((4, "num_frames"), (5, "height"), (6, "width"))
    )
    coords = call_argument(args, kwargs, 8, "video_coords")
    # image-to-video gives a timestep per token, 0 on the image's: the step's is the largest
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    seq_len = hidden.shape[1]
    if coords is not None:
        history, grid = _grid_of_coords(coords, seq_len)
    elif None in (frames, height, width):
        raise ValueError(
            "cogattn reads LTX-Video's grid from the call's num_frames, height and width, or video_coords."
        )
    else:
        history, grid = 0, (int(frames) // p_t, int(height) // p, int(width) // p)
    if history + grid[0] * grid[1] * grid[2] != seq_len:
        raise ValueError(f"this LTX-Video call has {seq_len} tokens, but its grid {grid} holds {history} + the grid's.")
    layout = TokenLayout(
        text_len=0,
        frames=grid[0],
        height=grid[1],
        width=grid[2],
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=int(text.shape[1]),
        temporal_compression=VAE_TEMPORAL,
        history_len=history,
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of an LTX-Video pipeline call: ``(num_frames − 1) // 8 + 1`` latent frames of ``height / 32`` ×
    ``width / 32`` latent pixels, and ``text_len`` (128) text tokens in the cross-attention."""
    p, p_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        p_t if p_t > 1 else None,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        temporal_compression=VAE_TEMPORAL,
    )


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_LATENT = 8  # latent channels of the tiny VAE


def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 12, dtype=torch.float32, seed=0):
    """A random ``LTXVideoTransformer3DModel`` (diffusers' own test config, text width 16)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LTXVideoTransformer3DModel(
            in_channels=_LATENT,
            out_channels=_LATENT,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            cross_attention_dim=num_heads * head_dim,
            num_layers=num_layers,
            caption_channels=TEXT_DIM,
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random LTX-Video pipeline at toy size (no download), its VAE compressing as the released one (32 × 32
    pixels, 8 frames): ``num_frames=17, height=64, width=96`` gives 3 latent frames of 2 × 3 latent pixels.

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (``LTXImageToVideoPipeline``; pass
            ``image=`` a PIL image).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim`` of the transformer.
    """
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; choose 'text-to-video' or 'image-to-video'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLLTXVideo(
            latent_channels=_LATENT,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            patch_size=4,  # with three 2 × 2 × 2 downsamplings: 32 pixels, 8 frames, as released
        )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    parts = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=cast(vae, dtype),
        text_encoder=tiny_text_encoder(seed, dtype),
        tokenizer=tiny_tokenizer(),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
    )
    if task == "image-to-video":
        from diffusers import LTXImageToVideoPipeline as cls
    else:
        from diffusers import LTXPipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 6 text tokens, 4 of them the prompt's (the negative's 2), 17
    frames of 64×96 (3×2×3 latent pixels), and for image-to-video a random image."""
    call = masked_text(pipe, generator)
    call.update(guidance_scale=3.0 if guided else 1.0, num_frames=17, height=64, width=96)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (64, 96, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call


SPEC = ModelSpec(
    "ltx_video",
    (LTXVideoTransformer3DModel,),
    (Site("transformer_blocks", "attn1", context="attn2"),),
    {LTXVideoAttnProcessor: LTXVideoAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    window=window_reader("w_idx", "windows"),  # LTXI2VLongMultiPromptPipeline's temporal windows
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "text_to_video": text_never_queries("LTX-Video"),
        "video_to_image": "LTX-Video has no image attention: an image to animate is the video's first latent frame.",
    },
    title="LTX-Video",
    frame_counts="9, 17, ..., 121, ..., 257",
    pipelines={"text-to-video": "LTXPipeline", "image-to-video": "LTXImageToVideoPipeline"},
)
