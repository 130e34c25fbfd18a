"""Pipeline calls on the tiny random CogVideoX, the same in every test file."""

from __future__ import annotations

import torch

from cogattn.models.cogvideox import TINY_TEXT_LEN

PROMPT = "a red fox running in the snow"  # every word is in the tiny tokenizer's vocabulary


def generate(
    pipe, *, steps=2, videos=1, guidance=6.0, height=48, width=80, prompt=None, seed=0, output_type="pt", **extra
):
    """Frames ``(videos, 9, 3, height, width)`` of one seeded call of a tiny pipeline (``output_type="latent"``:
    its latents, no VAE decode, for a test that looks at no video).

    Without ``prompt``, random text embeddings (negatives: their opposite) stand in for a prompt; with
    ``videos > 1`` a list of prompts gives the transformer batch ``[uncond..., cond...]`` that several
    videos per prompt would (CogVideoX pipelines force one video per prompt). Image-to-video pipelines
    get a random image."""
    g = torch.Generator().manual_seed(seed)
    device = pipe._execution_device
    if videos > 1 or prompt is not None:
        extra.update(prompt=[prompt or PROMPT] * videos, negative_prompt=["blue sky"] * videos)
    else:
        emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=g).to(device, pipe.transformer.dtype)
        extra.update(prompt_embeds=emb, negative_prompt_embeds=-emb)
    if type(pipe).__name__ == "CogVideoXImageToVideoPipeline":
        extra["image"] = torch.rand(3, height, width, generator=g)
    return pipe(
        num_frames=9,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        max_sequence_length=TINY_TEXT_LEN,
        output_type=output_type,
        generator=torch.Generator(device).manual_seed(seed + 1),
        **extra,
    ).frames
