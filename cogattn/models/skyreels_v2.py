"""SkyReels-V2 (text- and image-to-video): Wan 2.1's architecture under its own classes (docs/design.md,
"The model seam").

diffusers ships SkyReels-V2 as a copy of Wan: ``SkyReelsV2Transformer3DModel`` with ``SkyReelsV2Attention``
modules run by ``SkyReelsV2AttnProcessor``, which is ``WanAttnProcessor`` line for line but for the
context-parallel config it passes to every attention call (Wan: to the self-attention's only). The
layout, the call, the kinds and the guidance (two calls per step, the conditional first) are Wan's.
Diffusion forcing (``SkyReelsV2DiffusionForcingPipeline`` with ``causal_block_size`` > 1) masks the
self-attention block-causally (a frame block attends itself and the blocks before it) and gives each frame
its own timestep: capture applies the mask in row tiles (``processor.query_key_mask``), so masked keys hold
exactly 0 in every kind, and a step's timestep is its largest frame's (asynchronous steps, ``ar_step`` > 0,
are told apart by their frames' timesteps). A long video (``num_frames`` > ``base_num_frames``, with
``overlap_history``) is made in windows, each a denoising loop over ``base_num_frames`` of latent frames whose
first frames are the previous window's last (its overlap history); :func:`window` reads the running window
from the pipeline call, so one recording numbers the steps on across windows and keeps each step's window
(``Recording.windows``). A last window of fewer latent frames has another grid: a recording holds one, so
it keeps the windows before it and warns.
"""

from __future__ import annotations

import inspect

import torch

from ._call_frame import call_locals
from ._checkpoint import pipeline_name
from .spec import ModelSpec, Site, Unavailable

# Attention shapes of the released checkpoints (their transformer/config.json): Wan 2.1's 1.3B and 14B.
_SKY = {"_class_name": "SkyReelsV2Transformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_SKY_14B = {**_SKY, "num_layers": 40, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16}
KNOWN: dict[str, dict] = {
    "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers": _SKY_14B,
    "Skywork/SkyReels-V2-T2V-14B-720P-Diffusers": _SKY_14B,
    "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers": {
        **_SKY_14B,
        "in_channels": 36,
        "image_dim": 1280,
        "added_kv_proj_dim": 5120,
    },
    "Skywork/SkyReels-V2-DF-14B-540P-Diffusers": _SKY_14B,
    "Skywork/SkyReels-V2-DF-14B-720P-Diffusers": _SKY_14B,
    "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers": {
        **_SKY,
        "num_layers": 30,
        "num_attention_heads": 12,
        "in_channels": 16,
        "out_channels": 16,
    },
    "Skywork/SkyReels-V2-I2V-1.3B-540P-Diffusers": {
        **_SKY,
        "num_layers": 30,
        "num_attention_heads": 12,
        "in_channels": 36,
        "out_channels": 16,
        "image_dim": 1280,
        "added_kv_proj_dim": 1536,
    },
}

try:
    from diffusers.models.transformers.transformer_skyreels_v2 import (
        SkyReelsV2AttnProcessor,
        SkyReelsV2Transformer3DModel,
    )

    from . import wan
except ImportError as missing:
    needs = "SkyReels-V2 needs diffusers >= 0.36 (SkyReelsV2Attention)"
    raise Unavailable("skyreels_v2", needs, KNOWN) from missing

__all__ = [
    "SPEC",
    "KNOWN",
    "SkyReelsV2AttnMapProcessor",
    "tiny_diffusion_forcing_pipeline",
    "tiny_pipeline",
    "tiny_transformer",
    "window",
]


class SkyReelsV2AttnMapProcessor(wan.WanAttnMapProcessor):
    """Drop-in for ``SkyReelsV2AttnProcessor``: :class:`cogattn.models.wan.WanAttnMapProcessor` with the
    context-parallel config passed to every attention call, as SkyReels-V2's copy of Wan's processor does."""

    _parallel_in_every_call = True


def tiny_transformer(image_to_video: bool = False, **size):
    """A random ``SkyReelsV2Transformer3DModel``: the tiny Wan transformer's config (``wan.tiny_transformer``)."""
    return wan.tiny_transformer(image_to_video, cls=SkyReelsV2Transformer3DModel, **size)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random SkyReels-V2 pipeline (``SkyReelsV2Pipeline``, or ``SkyReelsV2ImageToVideoPipeline``): the
    tiny Wan pipeline's parts (``wan.tiny_pipeline``: call it the same way) with a SkyReels-V2 transformer
    and its UniPC flow scheduler."""
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline, UniPCMultistepScheduler

    base = wan.tiny_pipeline(task, dtype=dtype, seed=seed, **size)
    cls = SkyReelsV2ImageToVideoPipeline if task == "image-to-video" else SkyReelsV2Pipeline
    takes = inspect.signature(cls.__init__).parameters
    parts = {name: part for name, part in base.components.items() if name in takes}
    parts["transformer"] = tiny_transformer(task == "image-to-video", dtype=dtype, seed=seed, **size)
    parts["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0
    )
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_diffusion_forcing_pipeline(*, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``SkyReelsV2DiffusionForcingPipeline`` of the tiny pipeline's parts. Call it with
    ``causal_block_size=2``, ``num_frames=13`` (4 latent frames: two causal blocks) and ``base_num_frames=13``
    for a block-causal mask; ``num_frames=21`` and ``overlap_history=5`` besides make a long video of two
    windows of 4 latent frames, the second starting with the first's last 2."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    base = tiny_pipeline(dtype=dtype, seed=seed, **size)
    takes = inspect.signature(SkyReelsV2DiffusionForcingPipeline.__init__).parameters
    pipe = SkyReelsV2DiffusionForcingPipeline(**{k: v for k, v in base.components.items() if k in takes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def window(pipeline) -> tuple[int, int] | None:
    """``(index, count)`` of the window running in ``pipeline``'s call (``ModelSpec.window``): the diffusion-
    forcing pipelines loop over ``n_iter`` windows, counting them in a local of their ``__call__``
    (``iter_idx``; video-to-video's ``long_video_iter``), which is on the stack at every transformer call.
    `None` outside such a call (the text- and image-to-video pipelines, a bare transformer)."""
    found = call_locals(pipeline)
    if found is None:
        return None
    index = found.get("iter_idx", found.get("long_video_iter"))
    count = found.get("n_iter")
    if not isinstance(index, int) or not isinstance(count, int):
        return None
    return index, count


def call_rules(cfg, config: dict) -> None:
    """The batch tool's SkyReels-V2 rule (``ModelSpec.call_rules``): a diffusion-forcing checkpoint (its
    ``model_index.json`` names ``SkyReelsV2DiffusionForcingPipeline``; offline, ``-DF-`` in its hub id) is
    refused: the batch tool would run it through the plain pipeline, without diffusion forcing."""
    name = pipeline_name(cfg.model)
    if "DiffusionForcing" in name or "-DF-" in name:
        raise ValueError(
            f"model: {cfg.model} is a diffusion-forcing checkpoint; the batch tool runs SkyReels-V2's text- and "
            "image-to-video pipelines only: record SkyReelsV2DiffusionForcingPipeline from Python with "
            "cogattn.record."
        )


SPEC = ModelSpec(
    "skyreels_v2",
    (SkyReelsV2Transformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {SkyReelsV2AttnProcessor: SkyReelsV2AttnMapProcessor},
    wan.read_call,
    wan.layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=wan.tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    float32=("vae", "image_encoder"),
    known=KNOWN,
    text_len=wan.TEXT_LEN,
    context_kinds=wan.SPEC.context_kinds,
    refused=wan.SPEC.refused,
    guidance_calls=2,
    call_rules=call_rules,
    window=window,
)
