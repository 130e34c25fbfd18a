"""CogVideoX 1.0, 1.5 and image-to-video (and ConsisID, which runs CogVideoX's processor): the map
processors, the family's facts and its tiny pipeline (docs/design.md, "The model seam").

CogVideoX's blocks run one joint self-attention over ``[text, video]`` (``attn1``, 3D RoPE on the video
tokens, or sincos positions added before the blocks for CogVideoX-2b). The processors are diffusers'
``CogVideoXAttnProcessor2_0`` / ``FusedCogVideoXAttnProcessor2_0`` line for line: the same projections,
norms, RoPE on video tokens and the same ``F.scaled_dot_product_attention`` call, so generated videos
are bit-identical with and without capture. What capture adds is a few lines around that call: ask the
sink whether this call is captured, and hand it ``q`` and ``k``. (With the opt-in ``layer_output="lse"``
or ``"joint"``, the sink makes the output call itself, with a fused kernel that also returns what capture
needs.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

from ..layout import TokenLayout
from ..recorder.processor import MapSink
from .spec import ModelSpec, Site
from .tiny_text import TEXT_DIM, TINY_TEXT_LEN, tiny_text_encoder, tiny_tokenizer

__all__ = [
    "SPEC",
    "CogVideoXAttnMapProcessor",
    "FusedCogVideoXAttnMapProcessor",
    "KNOWN",
    "TINY_TEXT_LEN",
    "tiny_pipeline",
    "tiny_transformer",
    "tiny_vae",
]

_LATENT_CHANNELS = 4  # of the tiny VAE


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
            self.sink.capture(layer, query, key, lse, sums, value=value if self.sink.wants_value else None)

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


# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_BASE = {
    "_class_name": "CogVideoXTransformer3DModel",
    "attention_head_dim": 64,
    "patch_size": 2,
    "patch_size_t": None,
    "max_text_seq_length": 226,
}
KNOWN: dict[str, dict] = {
    "THUDM/CogVideoX-2b": {**_BASE, "num_layers": 30, "num_attention_heads": 30},
    "THUDM/CogVideoX-5b": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX-5b-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX1.5-5B": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
    "THUDM/CogVideoX1.5-5B-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
}


def _cogvideox_call(config, args: tuple, kwargs: dict):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
    t = kwargs["timestep"] if "timestep" in kwargs else args[2]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    return TokenLayout.from_latents(tuple(hidden.shape), text.shape[1], config), hidden.shape[0], t, hidden.device


def _cogvideox_layout(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    text_len = text_len or int(config["max_text_seq_length"])
    return TokenLayout.for_video(
        num_frames, height, width, text_len, int(config["patch_size"]), config.get("patch_size_t")
    )


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
def tiny_transformer(
    version: str = "1.0",
    *,
    rotary: bool = True,
    image_to_video: bool = False,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``CogVideoXTransformer3DModel``.

    Args:
        version (`str`, defaults to ``"1.0"``): ``"1.0"`` (no temporal patches) or ``"1.5"`` (``patch_size_t=2``,
            rotary positions, and an ``ofs`` embedding for image-to-video).
        rotary (`bool`, defaults to `True`): rotary positions; `False` gives CogVideoX-2b-style sincos
            (version 1.0 only).
        image_to_video (`bool`, defaults to `False`): twice the input channels (noise + image latents).
        num_layers, num_heads, head_dim (`int`): size of the attention.
        dtype (`torch.dtype`, defaults to `torch.float32`): parameter dtype.
        seed (`int`, defaults to 0): weights are a function of the seed.
    """
    from diffusers import CogVideoXTransformer3DModel

    if version not in ("1.0", "1.5"):
        raise ValueError(f"version={version!r}; choose '1.0' or '1.5'.")
    if version == "1.5" and not rotary:
        raise ValueError("CogVideoX 1.5 uses rotary positions; rotary=False exists only for version '1.0'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CogVideoXTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=_LATENT_CHANNELS * (2 if image_to_video else 1),
            out_channels=_LATENT_CHANNELS,
            time_embed_dim=8,
            ofs_embed_dim=8 if (version == "1.5" and image_to_video) else None,
            text_embed_dim=TEXT_DIM,
            num_layers=num_layers,
            sample_width=10,  # latent pixels: 80 px wide by default, 5 patch columns
            sample_height=6,  # 48 px high, 3 patch rows
            sample_frames=9,
            patch_size=2,
            patch_size_t=2 if version == "1.5" else None,
            temporal_compression_ratio=4,
            max_text_seq_length=TINY_TEXT_LEN,
            use_rotary_positional_embeddings=rotary,
        )
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``AutoencoderKLCogVideoX``: 8× spatial and 4× temporal compression, 4 latent channels."""
    from diffusers import AutoencoderKLCogVideoX

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLCogVideoX(
            in_channels=3,
            out_channels=3,
            down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=_LATENT_CHANNELS,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        )
    return (vae if dtype == torch.float32 else vae.to(dtype)).eval()


def tiny_pipeline(
    task: str = "text-to-video",
    version: str = "1.0",
    *,
    rotary: bool = True,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random CogVideoX pipeline with real components at toy size.

    Call it as a real one, with ``max_sequence_length=TINY_TEXT_LEN`` (the tiny text length), either with
    a prompt (tokenised by :func:`tiny_tokenizer`) or with ``prompt_embeds`` of shape ``(B, 8, 16)``.
    Default video: 48×80 pixels → 3×5 patches per latent frame; ``num_frames=9`` gives 3 latent frames
    (version 1.0) or 2 temporal patches (version 1.5).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (pass ``image=`` a PIL
            image or a ``(3, H, W)`` tensor in [0, 1]).
        version (`str`, defaults to ``"1.0"``): ``"1.0"`` or ``"1.5"`` (``patch_size_t=2``).
        rotary (`bool`, defaults to `True`): rotary (5b-style) or sincos (2b-style, version 1.0) positions.
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline, CogVideoXPipeline

    tasks = {"text-to-video": CogVideoXPipeline, "image-to-video": CogVideoXImageToVideoPipeline}
    if task not in tasks:
        raise ValueError(f"task={task!r}; choose one of {list(tasks)}.")
    scheduler = CogVideoXDDIMScheduler(  # CogVideoX-2b's scheduler config
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=3.0,
        timestep_spacing="trailing",
    )
    transformer = tiny_transformer(
        version,
        rotary=rotary,
        image_to_video=task == "image-to-video",
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    pipe = tasks[task](
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=tiny_vae(seed, dtype),
        transformer=transformer,
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings, 9 frames of 48×80 (3×3×5 patches)."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, TINY_TEXT_LEN, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=6.0 if guided else 1.0)
    call.update(num_frames=9, height=48, width=80, max_sequence_length=TINY_TEXT_LEN)
    if task == "image-to-video":
        call["image"] = torch.rand(3, 48, 80, generator=generator)
    return call


SPEC = ModelSpec(
    "cogvideox",
    (CogVideoXTransformer3DModel,),
    (Site("transformer_blocks", "attn1"),),
    {
        CogVideoXAttnProcessor2_0: CogVideoXAttnMapProcessor,
        FusedCogVideoXAttnProcessor2_0: FusedCogVideoXAttnMapProcessor,
    },
    _cogvideox_call,
    _cogvideox_layout,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=("max_text_seq_length",),
    known=KNOWN,
    text_len=226,
    refused={
        "video_to_image": "CogVideoX has no image cross-attention (its image-to-video pipelines put the image "
        "in the latents); the image's tokens are video tokens of latent frame 0."
    },
    frame_counts="9, 13, ..., 49, ..., 81",
    tiny_name="tiny",
    tiny_options={"tiny_version": ("version", ("1.0", "1.5"), "CogVideoX 1.0's or 1.5's layout")},
)
