"""Helios's tiny pipelines (tests, notebook, batch tool): built in code at toy size, no download
(``cogattn.models.helios`` is the family)."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_helios import HeliosTransformer3DModel

from ..tiny_text import TEXT_DIM, cast, tiny_text_encoder, tiny_tokenizer

__all__ = ["TEXT_LEN", "tiny_call", "tiny_pipeline", "tiny_transformer"]

TEXT_LEN = 512  # UMT5 tokens of the pipelines' calls (max_sequence_length)


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    amplify_history: bool = True,
    guidance_cross_attn: bool = True,
):
    """A random ``HeliosTransformer3DModel`` (diffusers' own test config, text width 16). With ``amplify_history``
    each self-attention scales the history's keys by a factor per head, drawn at random (the model's are all equal
    at initialisation); ``guidance_cross_attn=False`` lets the history query the text too."""
    t_dim = head_dim - 4 * (head_dim // 6)  # RoPE's channels per axis, Wan's split
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HeliosTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=TEXT_DIM,
            freq_dim=256,
            ffn_dim=32,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_dim=(t_dim, 2 * (head_dim // 6), 2 * (head_dim // 6)),
            guidance_cross_attn=guidance_cross_attn,
            is_amplify_history=amplify_history,
            history_scale_mode="per_head",
        )
        if amplify_history:
            for block in model.blocks:
                block.attn1.history_key_scale.data.normal_(0.0, 2.0)
    return cast(model, dtype)


def _tiny_scheduler(pyramid: bool):
    """``HeliosScheduler`` shifting its sigmas by the sequence's length, as the pipelines ask: one stage, or the
    pyramid's three (``gamma`` 1/4: the stages' renoising draws from a covariance positive definite in float32)."""
    from diffusers import HeliosScheduler

    if not pyramid:
        return HeliosScheduler(stages=1, stage_range=[0, 1], use_dynamic_shifting=True)
    return HeliosScheduler(stages=3, stage_range=[0, 1 / 3, 2 / 3, 1], gamma=0.25, use_dynamic_shifting=True)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    pyramid: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **size,
):
    """A random ``HeliosPipeline`` (or, with ``pyramid``, ``HeliosPyramidPipeline``) with real components at toy
    size (no download): Wan's tiny tokenizer, text encoder and VAE, ``HeliosScheduler`` and a Helios transformer.

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame;
    ``num_latent_frames_per_chunk=2`` chunks of 2 latent frames (5 frames), so ``num_frames=9`` is two chunks,
    each of 6 window tokens after 18 history tokens (``history_sizes=[16, 2, 1]``); an ``image=`` or a ``video=``
    conditions it (the pipeline does text-, image- and video-to-video).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"``; one pipeline does both.
        pyramid (`bool`, defaults to `False`): ``HeliosPyramidPipeline``, each chunk in 3 stages of rising
            resolution (call it with ``pyramid_num_inference_steps_list``, ``height`` and ``width`` multiples of 64).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim``, ``amplify_history``, ``guidance_cross_attn`` of the
            transformer (:func:`tiny_transformer`).
    """
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosPyramidPipeline

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; choose 'text-to-video' or 'image-to-video'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    parts = dict(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=cast(vae, dtype),
        scheduler=_tiny_scheduler(pyramid),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
    )
    pipe = (HeliosPyramidPipeline if pyramid else HeliosPipeline)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings (512 tokens), 9 frames of 32×48 in two
    chunks of 2 latent frames (2×3 patches each, after 18 history tokens), and for image-to-video a random image."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, TEXT_LEN, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=5.0 if guided else 1.0)
    call.update(num_frames=9, height=32, width=48, num_latent_frames_per_chunk=2)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call
