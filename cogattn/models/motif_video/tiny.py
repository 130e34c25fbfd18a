"""Motif-Video's tiny random pipelines (tests, the notebook, the self-test, the batch tool): text-to-video and
image-to-video with real components at toy size, built from configs (no download), and the self-test's call of
them. :mod:`cogattn.models.motif_video` exports them.

The text encoder is a 1-layer ``T5Gemma2Encoder`` over the tiny word-level tokenizer, whose vision tower (a 1-layer
SigLIP of ``IMAGE_LEN`` patches) gives image-to-video's image tokens, as the released T5Gemma2's gives its.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_motif_video import MotifVideoTransformer3DModel

from ..tiny_text import TEXT_DIM, cast, masked_text, tiny_siglip, tiny_tokenizer

__all__ = ["IMAGE_DIM", "IMAGE_LEN", "TEXT_LEN", "tiny_call", "tiny_pipeline", "tiny_transformer"]

_LATENT_CHANNELS = 16  # the Wan VAE's (its latents_mean and latents_std have 16 entries)
TEXT_LEN = 8  # text tokens of the tiny call (max_sequence_length; released 512)
IMAGE_DIM = 12  # width of the tiny SigLIP tokens (image_embed_dim)
IMAGE_LEN = 16  # SigLIP tokens of an image: a 16 px image in 4 px patches
_SIGLIP_SIDE = 16


def tiny_transformer(
    *,
    num_layers: int = 1,
    num_single_layers: int = 1,
    num_decoder_layers: int = 1,
    num_heads: int = 2,
    head_dim: int = 8,
    cross_attention: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``MotifVideoTransformer3DModel``: ``num_layers`` dual-stream blocks, ``num_single_layers``
    single-stream encoder blocks and ``num_decoder_layers`` decoder blocks after them, patches of 2, 2 × 16 + 1
    input channels (latents, the image's latents, a mask), text width ``TEXT_DIM``, image width ``IMAGE_DIM``,
    ``head_dim`` split over the 3D RoPE axes; with ``cross_attention`` every encoder block has the text
    cross-attention.

    Args:
        num_layers, num_single_layers, num_decoder_layers, num_heads, head_dim (`int`): transformer size.
        cross_attention (`bool`, defaults to `True`): ``enable_text_cross_attention_dual`` and ``_single``.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the weights.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    axes = (head_dim // 4, head_dim // 4, head_dim - 2 * (head_dim // 4))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MotifVideoTransformer3DModel(
            in_channels=2 * _LATENT_CHANNELS + 1,
            out_channels=_LATENT_CHANNELS,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            num_single_layers=num_single_layers + num_decoder_layers,
            num_decoder_layers=num_decoder_layers,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            text_embed_dim=TEXT_DIM,
            image_embed_dim=IMAGE_DIM,
            rope_axes_dim=axes,
            enable_text_cross_attention_dual=cross_attention,
            enable_text_cross_attention_single=cross_attention,
        )
    return cast(model, dtype)


def _tiny_t5gemma2(tokenizer, seed: int):
    """A random 1-layer ``T5Gemma2Encoder`` of the tiny text width over ``tokenizer``, its vision tower a 1-layer
    SigLIP of ``IMAGE_DIM`` channels (the image-to-video pipeline reads the image with it)."""
    from transformers import SiglipVisionConfig, T5Gemma2Encoder, T5Gemma2EncoderConfig, T5Gemma2TextConfig

    text = T5Gemma2TextConfig(
        hidden_size=TEXT_DIM,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        dropout_rate=0.0,
    )
    side, patch = _SIGLIP_SIDE, _SIGLIP_SIDE // 4
    vision = SiglipVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=side,
        patch_size=patch,
    )
    config = T5Gemma2EncoderConfig(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_LEN)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T5Gemma2Encoder(config)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 1,
    num_single_layers: int = 1,
    num_decoder_layers: int = 1,
    num_heads: int = 2,
    head_dim: int = 8,
    cross_attention: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``MotifVideoPipeline`` or ``MotifVideoImage2VideoPipeline`` with real components at toy size (no
    download): a T5Gemma2 encoder (with its SigLIP vision tower) on the tiny word-level tokenizer, the Wan VAE at
    its real compression (×8 spatial, ×4 temporal), a ``ClassifierFreeGuidance(guidance_scale=5.0)`` guider and,
    for image-to-video, SigLIP's image processor.

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9`` 3 latent
    frames; image-to-video's image gives ``IMAGE_LEN`` tokens before the text. Guidance is the guider's: set
    ``pipe.guider.guidance_scale`` in place (``> 1``: two transformer calls per step, the conditional one first).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"``.
        num_layers, num_single_layers, num_decoder_layers, num_heads, head_dim (`int`): transformer size.
        cross_attention (`bool`, defaults to `True`): every encoder block's text cross-attention.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    import diffusers

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny Motif-Video pipelines are text-to-video and image-to-video.")
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = diffusers.AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    size = dict(num_layers=num_layers, num_single_layers=num_single_layers, num_decoder_layers=num_decoder_layers)
    transformer = tiny_transformer(
        **size, num_heads=num_heads, head_dim=head_dim, cross_attention=cross_attention, dtype=dtype, seed=seed
    )
    parts = dict(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        vae=cast(vae, dtype),
        text_encoder=cast(_tiny_t5gemma2(tokenizer, seed), dtype),
        tokenizer=tokenizer,
        transformer=transformer,
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=5.0),
    )
    if task == "image-to-video":
        _, feature_extractor = tiny_siglip(seed, dtype, IMAGE_DIM, _SIGLIP_SIDE)
        pipe = diffusers.MotifVideoImage2VideoPipeline(**parts, feature_extractor=feature_extractor)
    else:
        pipe = diffusers.MotifVideoPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of ``TEXT_LEN`` random text embeddings under a key mask (the
    prompt's 6 kept, the negative's 3), 9 frames of 32×48 (3×2×3 patches); image-to-video: a random 32×48 image.
    Sets ``pipe.guider.guidance_scale`` in place: 5.0 guided (two calls per step), 1.0 not.

    Args:
        pipe: a tiny pipeline (:func:`tiny_pipeline`).
        task (`str`): ``"text-to-video"`` or ``"image-to-video"``.
        generator (`torch.Generator`): draws the embeddings and the image.
        guided (`bool`): classifier-free guidance.
    """
    call = masked_text(pipe, generator, TEXT_LEN, kept=6, negative_kept=3)
    pipe.guider.guidance_scale = 5.0 if guided else 1.0
    call.update(num_frames=9, height=32, width=48)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call.update(image=PIL.Image.fromarray(pixels), prompt=None)
    return call
