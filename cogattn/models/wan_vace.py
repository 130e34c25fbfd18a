"""Wan VACE (video creation and editing with a control video, masks and reference images): Wan's blocks
and a control stream of its own (docs/design.md, "The model seam").

``WanVACETransformer3DModel`` first runs ``vace_blocks`` over the control video (its tokens on the
video's grid), whose outputs are added as hints after the main ``blocks`` of ``vace_layers``. Both lists
are ``WanAttention`` modules run by ``WanAttnProcessor``: a self-attention (``attn1``) and a
cross-attention to the text (``attn2``). cogattn numbers them in that order: the control stream's
``vace_blocks.0.attn1`` … first, then ``blocks.0.attn1`` …; the kinds, the layout, the call and the
guidance (two calls per step, the conditional first; two experts for Wan 2.2 VACE) are Wan's.
"""

from __future__ import annotations

import inspect

import torch

from .spec import ModelSpec, Site, Unavailable

# Attention shapes of the released checkpoints (their transformer/config.json): Wan 2.1's, with VACE layers.
_VACE = {"_class_name": "WanVACETransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
KNOWN: dict[str, dict] = {
    "Wan-AI/Wan2.1-VACE-1.3B-diffusers": {
        **_VACE,
        "num_layers": 30,
        "num_attention_heads": 12,
        "in_channels": 16,
        "out_channels": 16,
        "vace_layers": [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28],
    },
    "Wan-AI/Wan2.1-VACE-14B-diffusers": {
        **_VACE,
        "num_layers": 40,
        "num_attention_heads": 40,
        "in_channels": 16,
        "out_channels": 16,
        "vace_layers": [0, 5, 10, 15, 20, 25, 30, 35],
    },
}

try:
    from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel

    from . import wan
except ImportError as missing:
    needs = "Wan VACE needs diffusers >= 0.35 (WanVACETransformer3DModel)"
    raise Unavailable("wan_vace", needs, KNOWN) from missing

__all__ = ["SPEC", "KNOWN", "tiny_pipeline", "tiny_transformer"]


def tiny_transformer(*, num_layers: int = 3, num_heads: int = 2, head_dim: int = 12, dtype=torch.float32, seed=0):
    """A random ``WanVACETransformer3DModel``: the tiny Wan transformer's shapes, 3 blocks, VACE hints after
    blocks 0 and 2 (2 control blocks)."""
    base = dict(wan.tiny_transformer(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim).config)
    takes = inspect.signature(WanVACETransformer3DModel.__init__).parameters
    config = {k: v for k, v in base.items() if k in takes}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanVACETransformer3DModel(**config, vace_layers=[0, 2], vace_in_channels=96)
    return wan.cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``WanVACEPipeline``: the tiny Wan pipeline's parts (``wan.tiny_pipeline``: call it the same
    way) with a VACE transformer; without ``video`` the control video is blank, as the pipeline makes it."""
    from diffusers import WanVACEPipeline

    base = wan.tiny_pipeline("text-to-video", dtype=dtype, seed=seed)
    parts = {k: base.components[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler")}
    pipe = WanVACEPipeline(transformer=tiny_transformer(dtype=dtype, seed=seed, **size), **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """Wan's call of the tiny pipeline (``wan.tiny_call``) with a prompt for the embeddings (VACE's pipeline of
    diffusers 0.35 takes a prompt string only) and a blank control video."""
    call = {k: v for k, v in wan.tiny_call(pipe, task, generator, guided).items() if not k.endswith("prompt_embeds")}
    return {**call, "prompt": "a red fox running in the snow", "negative_prompt": "blue sky"}


SPEC = ModelSpec(
    "wan_vace",
    (WanVACETransformer3DModel,),
    (Site("vace_blocks", "attn1", context="attn2", count_key="vace_layers"), Site("blocks", "attn1", context="attn2")),
    {wan.WanAttnProcessor: wan.WanAttnMapProcessor},
    wan.read_call,
    wan.layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=wan.TEXT_LEN,
    context_kinds=wan.SPEC.context_kinds,
    refused=wan.SPEC.refused,
    experts=("transformer", "transformer_2"),
    guidance_calls=2,
    pipelines={"text-to-video": "WanVACEPipeline"},
    float32=("vae",),
)
