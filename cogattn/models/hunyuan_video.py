"""HunyuanVideo (text-to-video): the map processor, the family's facts and its tiny pipeline (docs/design.md,
"The model seam").

HunyuanVideo runs 20 dual-stream blocks (``transformer_blocks``: video and text projected apart, one joint
attention) and then 40 single-stream blocks (``single_transformer_blocks``: one projection of ``[video,
text]``); cogattn numbers their attentions 0–19 and 20–59. The joint sequence is the video, then the text
(``text_position="end"``): up to 256 LLaMA tokens, padded at the end, with a boolean key mask ``(B, 1, 1,
S)`` that keeps each item's ``V + T_valid`` first keys. Padded text keys get probability exactly 0 in every
kind; padded text queries are computed, as the model computes them. The token refiner's attention is over
the text alone: it is not a capture site.

Guidance is distilled into one call per step (``guidance_scale`` is an embedding, the batch holds the
prompts); true classifier-free guidance (``true_cfg_scale > 1`` with a negative prompt) calls the
transformer twice per step, the conditional call first, as Wan does.

The processor is diffusers' ``HunyuanVideoAttnProcessor2_0`` line for line, plus the lines that hand q, k
and the per-item key counts to the recording: the ``dispatch_attention_fn`` version of diffusers ≥ 0.36
here, the SDPA version of 0.33 – 0.35 in ``_hunyuan_video_sdpa.py``. On 0.32, whose mask covers queries
as well as keys, the family is unavailable.
"""

from __future__ import annotations

import sys

import diffusers
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoTransformer3DModel,
)
from packaging.version import Version

from ..layout import TokenLayout
from ..processor import MapSink, key_counts
from .spec import ModelSpec, Site, Unavailable
from .tiny_text import TEXT_DIM, cast, tiny_tokenizer

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_HV = {
    "_class_name": "HunyuanVideoTransformer3DModel",
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "num_layers": 20,
    "num_single_layers": 40,
    "patch_size": 2,
    "patch_size_t": 1,
    "text_embed_dim": 4096,
}
KNOWN: dict[str, dict] = {
    "hunyuanvideo-community/HunyuanVideo": {**_HV, "in_channels": 16, "guidance_embeds": True},
}

if Version(diffusers.__version__).release < (0, 33):
    # 0.32 masks queries as well as keys (B, S, S); 0.33 keeps a key mask (B, 1, 1, S), which capture takes
    needs = "HunyuanVideo needs diffusers >= 0.33 (a key mask)"
    raise Unavailable("hunyuan_video", needs, ("HunyuanVideoTransformer3DModel",), ("num_single_layers",), KNOWN)
# The stock processor of 0.36 calls dispatch_attention_fn on (B, S, H, D); of 0.33 – 0.35, SDPA on (B, H, S, D).
DISPATCH = hasattr(HunyuanVideoAttnProcessor2_0, "_attention_backend")
if DISPATCH:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
from ._hunyuan_video_sdpa import HunyuanVideoAttnMapProcessorSDPA  # noqa: E402

__all__ = [
    "SPEC",
    "HunyuanVideoAttnMapProcessor",
    "KNOWN",
    "TEXT_LEN",
    "layout_for_video",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 256  # LLaMA tokens after the prompt template is cropped (the pipelines' max_sequence_length)


class HunyuanVideoAttnMapProcessor:
    """Drop-in for ``HunyuanVideoAttnProcessor2_0`` (dual- and single-stream blocks) that also feeds q, k and
    each item's valid key count to a recording. The output call is always the stock one.

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
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                query = torch.cat(
                    [
                        apply_rotary_emb(
                            query[:, : -encoder_hidden_states.shape[1]],
                            image_rotary_emb,
                            sequence_dim=1,
                        ),
                        query[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
                key = torch.cat(
                    [
                        apply_rotary_emb(
                            key[:, : -encoder_hidden_states.shape[1]],
                            image_rotary_emb,
                            sequence_dim=1,
                        ),
                        key[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states)
            encoder_key = attn.add_k_proj(encoder_hidden_states)
            encoder_value = attn.add_v_proj(encoder_hidden_states)

            encoder_query = encoder_query.unflatten(2, (attn.heads, -1))
            encoder_key = encoder_key.unflatten(2, (attn.heads, -1))
            encoder_value = encoder_value.unflatten(2, (attn.heads, -1))

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # (B, H, S, D), as the recording takes them; padded text keys are masked
            counts = key_counts(attention_mask, query.shape[1])
            self.sink.capture(layer, query.transpose(1, 2), key.transpose(1, 2), None, None, counts)

        # 5. Attention
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
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # 6. Output projection
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )

            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``HunyuanVideoTransformer3DModel`` call: latents
    ``(B, C, F, H, W)``, the text after the video (its padded length: the mask sets each item's own)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    t = kwargs["timestep"] if "timestep" in kwargs else args[1]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[2]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    _, _, frames, height, width = hidden.shape
    layout = TokenLayout(
        text_len=int(text.shape[1]),
        frames=frames // p_t,
        height=height // p,
        width=width // p,
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        text_position="end",
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a HunyuanVideo pipeline call (``(num_frames − 1) // 4 + 1`` latent frames, 8× spatial)."""
    p_t = int(config.get("patch_size_t", 1))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        text_len or TEXT_LEN,
        int(config["patch_size"]),
        p_t if p_t > 1 else None,
        text_position="end",
    )


def true_cfg(pipeline) -> bool | None:
    """Whether the running HunyuanVideo pipeline call uses true classifier-free guidance (two transformer
    calls per step). The pipelines keep it in a local, ``do_true_cfg``, of their ``__call__``: read from that
    frame, which is on the stack at every transformer call; `None` when no such frame is found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is pipeline and "do_true_cfg" in frame.f_locals:
            return bool(frame.f_locals["do_true_cfg"])
        frame = frame.f_back
    return None


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_LATENT_CHANNELS = 4
_POOLED_DIM = 8  # width of the tiny CLIP text encoder's pooled output


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideoTransformer3DModel``: ``num_layers`` dual-stream and ``num_single_layers``
    single-stream blocks, patch size 2, text width 16 (``head_dim`` is split over the 3D RoPE axes)."""
    axes = (head_dim - 2 * (head_dim * 3 // 8), head_dim * 3 // 8, head_dim * 3 // 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HunyuanVideoTransformer3DModel(
            in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=_POOLED_DIM,
            rope_axes_dim=axes,
        )
    return cast(model, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideoPipeline`` with real components at toy size (no download).

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9``
    3 latent frames. A prompt is tokenized by the tiny word-level tokenizer; pass
    ``prompt_template={"template": "{}", "crop_start": 0}`` (the default template's 95 cropped tokens are
    LLaMA's), and ``max_sequence_length`` for the padded text length. ``true_cfg_scale > 1`` with a
    ``negative_prompt`` makes two transformer calls per step.

    Args:
        task (`str`, defaults to ``"text-to-video"``): the only task of this family here.
        num_layers, num_single_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; the tiny HunyuanVideo pipeline is text-to-video.")
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=_LATENT_CHANNELS,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        )
        llama = LlamaModel(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=TEXT_DIM,
                intermediate_size=32,
                num_hidden_layers=3,  # the pipeline takes the hidden states 3 from the end
                num_attention_heads=2,
                num_key_value_heads=2,
                pad_token_id=0,
            )
        )
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=_POOLED_DIM,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                projection_dim=_POOLED_DIM,
                max_position_embeddings=77,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=1,
            )
        )
    pipe = HunyuanVideoPipeline(
        text_encoder=cast(llama, dtype),
        tokenizer=tokenizer,
        transformer=tiny_transformer(
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            dtype=dtype,
            seed=seed,
        ),
        vae=cast(vae, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=cast(clip, dtype),
        tokenizer_2=tiny_tokenizer(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings of 6 tokens, 4 of them kept by the
    mask (under true guidance the negative keeps 2), 9 frames of 32×48 (3×2×3 patches)."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype

    def text(kept):
        emb = torch.randn(1, 6, TEXT_DIM, generator=generator).to(device, dtype)
        pooled = torch.randn(1, _POOLED_DIM, generator=generator).to(device, dtype)
        return emb, pooled, (torch.arange(6) < kept).long()[None].to(device)

    emb, pooled, mask = text(4)
    call = dict(prompt_embeds=emb, pooled_prompt_embeds=pooled, prompt_attention_mask=mask)
    if guided:
        emb, pooled, mask = text(2)
        call.update(negative_prompt_embeds=emb, negative_pooled_prompt_embeds=pooled, true_cfg_scale=4.0)
        call["negative_prompt_attention_mask"] = mask
    call.update(num_frames=9, height=32, width=48)
    return call


SPEC = ModelSpec(
    "hunyuan_video",
    (HunyuanVideoTransformer3DModel,),
    (Site("transformer_blocks", "attn"), Site("single_transformer_blocks", "attn", count_key="num_single_layers")),
    {HunyuanVideoAttnProcessor2_0: HunyuanVideoAttnMapProcessor if DISPATCH else HunyuanVideoAttnMapProcessorSDPA},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    config_keys=("num_single_layers",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={"video_to_image": "HunyuanVideo has no image attention; its transformer sees text and video tokens."},
    guidance_calls=2,
    guidance=true_cfg,
    guidance_argument="true_cfg_scale",
    output_call=False,
    frame_counts="9, 13, ..., 61, ..., 129",
    float32=("vae",),
    tiny_prompt_arguments={"prompt_template": {"template": "{}", "crop_start": 0}},  # the 95 cropped tokens are LLaMA's
)
