"""ChronoEdit (image editing as a short video): Wan 2.1 image-to-video's architecture under its own classes
(docs/design.md, "The model seam").

diffusers' ``ChronoEditTransformer3DModel`` runs copies of Wan's ``WanAttention`` and ``WanAttnProcessor``
(the same code in ``transformer_chronoedit``, with a RoPE that can skip temporal positions), so
:class:`cogattn.models.wan.WanAttnMapProcessor` is its processor line for line. The input image is
latent frame 0 and a CLIP image cross-attention, as in Wan 2.1 image-to-video: the kinds, the layout,
the call and the guidance (two calls per step, the conditional first) are Wan's. With
``enable_temporal_reasoning`` the pipeline drops its reasoning frames part-way through the steps; a
recording then sees another video and stops there, with a warning.
"""

from __future__ import annotations

import inspect

import torch

from .spec import ModelSpec, Site, Unavailable

# Attention shapes of the released checkpoint (its transformer/config.json): Wan 2.1 image-to-video 14B's.
KNOWN: dict[str, dict] = {
    "nvidia/ChronoEdit-14B-Diffusers": {
        "_class_name": "ChronoEditTransformer3DModel",
        "attention_head_dim": 128,
        "patch_size": [1, 2, 2],
        "num_layers": 40,
        "num_attention_heads": 40,
        "in_channels": 36,
        "out_channels": 16,
        "image_dim": 1280,
        "added_kv_proj_dim": 5120,
    },
}

try:
    from diffusers.models.transformers.transformer_chronoedit import (
        ChronoEditTransformer3DModel,
        WanAttnProcessor,
    )

    from . import wan
except ImportError as missing:
    needs = "ChronoEdit needs diffusers >= 0.36 (transformer_chronoedit)"
    raise Unavailable("chronoedit", needs, KNOWN) from missing

__all__ = ["SPEC", "KNOWN", "tiny_pipeline", "tiny_transformer"]


def tiny_transformer(image_to_video: bool = True, **size):
    """A random ``ChronoEditTransformer3DModel``: the tiny Wan image-to-video transformer's config."""
    return wan.tiny_transformer(True, cls=ChronoEditTransformer3DModel, **size)


def tiny_pipeline(task: str = "image-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``ChronoEditPipeline``: the tiny Wan image-to-video pipeline's parts (``wan.tiny_pipeline``)
    with a ChronoEdit transformer. Call it with ``image=`` a PIL image, ``height=32, width=48``; without
    temporal reasoning the pipeline makes 5 frames (2 latent frames)."""
    from diffusers import ChronoEditPipeline

    if task not in ("image-to-video", "image-edit"):
        raise ValueError(f"task={task!r}; ChronoEdit edits an image: 'image-to-video'.")
    base = wan.tiny_pipeline("image-to-video", dtype=dtype, seed=seed, **size)
    takes = inspect.signature(ChronoEditPipeline.__init__).parameters
    parts = {name: part for name, part in base.components.items() if name in takes}
    parts["transformer"] = tiny_transformer(dtype=dtype, seed=seed, **size)
    pipe = ChronoEditPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: Wan's (``wan.tiny_call``) with an image to edit, 5 frames."""
    return {**wan.tiny_call(pipe, "image-to-video", generator, guided), "num_frames": 5}


SPEC = ModelSpec(
    "chronoedit",
    (ChronoEditTransformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {WanAttnProcessor: wan.WanAttnMapProcessor},
    wan.read_call,
    wan.layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("image-to-video",),
    pipelines={"image-to-video": "ChronoEditPipeline"},
    float32=("vae", "image_encoder"),
    known=KNOWN,
    text_len=wan.TEXT_LEN,
    context_kinds=wan.SPEC.context_kinds,
    refused=wan.SPEC.refused,
    guidance_calls=2,
)
