"""Wan Animate (a character image animated by a pose and a face video): Wan 2.1 image-to-video's blocks,
a reference frame and face adapters, under its own classes (docs/design.md, "The model seam").

diffusers' ``WanAnimateTransformer3DModel`` runs ``WanTransformerBlock``s whose ``attn1`` (self-attention,
3D RoPE) and ``attn2`` (cross-attention to 512 UMT5 text tokens and, with a softmax of its own, 257 CLIP
tokens of the character image) are ``WanAttention`` modules run by ``WanAttnProcessor``: diffusers' copies
in ``transformer_wan_animate``, line for line Wan's (``# Copied from`` ``transformer_wan``, which
diffusers' copy check enforces), so :class:`cogattn.models.wan.WanAttnMapProcessor` is their processor
and the kinds are Wan image-to-video's.

The reference frame is in the self-attention's sequence. The pipeline denoises a segment of
``segment_frame_length`` frames (4k + 1, 77 by default; what ``num_frames`` means for this family in
``estimate`` and the batch tool) as L = (frames − 1) / 4 + 1 latent frames and puts the character image's
latent frame before them: the transformer's latents are ``(B, 36, L + 1, H, W)`` (16 noise channels, then
4 mask and 16 conditioning channels: the image's latent at frame 0; after it the previous segment's last
frames and a blank video, or the background video), and the pose video's latents are added to frames 1 …
L only. So the layout's grid has F = L + 1 latent frames, grid frame 0 the reference (at temporal
position 0 of the RoPE) and frames 1 … L the segment; frame group 0 of ``frame`` and ``query_frame`` is
the character image. The pipeline drops frame 0 before decoding, so a decoded segment of 4(L − 1) + 1
frames covers grid frames 1 … L: grid frame f is the video's latent frame f − 1.
``layout.pixel_frames`` does not know that frame 0 is not decoded, so the plots drawn over the decoded
video refuse this family's videos (one latent frame fewer than the grid); draw them without the video.

The face adapters (``face_adapter``, ``WanAnimateFaceBlockCrossAttention`` after every
``inject_face_latents_blocks``-th block) are not capture sites: each latent frame's video tokens attend
only the few motion tokens of their own frame (the face encoder's heads and a padding token, a softmax per
frame), which is neither the text nor the image of ``video_to_text`` / ``video_to_image`` nor attention of
the video to itself.

Under classifier-free guidance (``guidance_scale > 1``; the pipeline's default is 1) the pipeline calls
the transformer twice per step, the conditional call first, the unconditional one with the negative
prompt and a blank face video. A pose video longer than one segment is denoised segment by segment, each
a full run of the steps, and a recording holds one generation: record a call of one segment (a pose video
of at most ``segment_frame_length`` frames). Inside ``with cogattn.record(...)`` a second segment is
refused as a second generation; a recording left open keeps the first segment and closes, with a warning.

The batch tool plans a run of a released checkpoint (``--dry-run``) but runs none: a prompts file gives no
pose and face videos. The tiny pipeline's call takes the segment length as ``num_frames`` too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from .spec import ModelSpec, Site, Unavailable

# Attention shapes of the released checkpoint (its transformer config, as diffusers' conversion script
# writes it: Wan 2.1 I2V-14B's blocks, face adapters after every 5th block).
KNOWN: dict[str, dict] = {
    "Wan-AI/Wan2.2-Animate-14B-Diffusers": {
        "_class_name": "WanAnimateTransformer3DModel",
        "attention_head_dim": 128,
        "patch_size": [1, 2, 2],
        "num_layers": 40,
        "num_attention_heads": 40,
        "in_channels": 36,
        "out_channels": 16,
        "image_dim": 1280,
        "added_kv_proj_dim": 5120,
        "inject_face_latents_blocks": 5,
    },
}

try:
    from diffusers.models.transformers import transformer_wan_animate
    from diffusers.models.transformers.transformer_wan_animate import WanAnimateTransformer3DModel

    from . import wan
except ImportError as missing:
    needs = "Wan Animate needs diffusers >= 0.36 (WanAnimateTransformer3DModel)"
    raise Unavailable("wan_animate", needs, KNOWN) from missing

__all__ = ["SPEC", "KNOWN", "read_call", "layout_for_video", "tiny_pipeline", "tiny_transformer", "tiny_call"]

# The processor class its blocks run: diffusers' copy of Wan's, or Wan's own where the module imports it.
_STOCK = getattr(transformer_wan_animate, "WanAttnProcessor", wan.WanAttnProcessor)


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``WanAnimateTransformer3DModel`` call: Wan's
    (``wan.read_call``), whose latent frames already count the reference frame 0 (and whose image tokens join the
    text's softmax where the model has no ``added_kv_proj_dim``: ``TokenLayout.image_joins_text``)."""
    return wan.read_call(config, args, kwargs)


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None):
    """The layout of a ``WanAnimatePipeline`` call whose segments have ``num_frames`` frames (its
    ``segment_frame_length``, rounded as Wan rounds ``num_frames``) of ``height`` × ``width`` pixels: Wan's,
    with the reference frame before the segment's latent frames (F = L + 1)."""
    layout = wan.layout_for_video(config, num_frames, height, width, text_len)
    return dataclasses.replace(layout, frames=layout.frames + 1)


# -- the tiny pipeline (tests, notebook, self-test) -------------------------------------------------
_FACE = 16  # pixels of the tiny motion encoder's square face frames
_FRAMES = 9  # the tiny call's segment: 3 latent frames after the reference frame


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``WanAnimateTransformer3DModel``: the tiny Wan image-to-video transformer's shapes
    (``wan.tiny_transformer``), a motion encoder of 16×16 face frames and a face adapter after every block."""
    base = dict(wan.tiny_transformer(True, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim).config)
    takes = inspect.signature(WanAnimateTransformer3DModel.__init__).parameters
    config = {k: v for k, v in base.items() if k in takes and not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanAnimateTransformer3DModel(
            **config,
            motion_encoder_channel_sizes={"4": 8, "8": 8, str(_FACE): 8},
            motion_encoder_size=_FACE,
            motion_style_dim=8,
            motion_dim=4,
            motion_encoder_dim=8,
            face_encoder_hidden_dim=8,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=1,  # a face adapter per block (the released model: every 5th)
        )
    return wan.cast(model, dtype)


@functools.cache
def _tiny_pipeline_class() -> type:
    """``WanAnimatePipeline`` whose call also takes the segment length as ``num_frames``, the name every other
    pipeline gives the frames it makes (the self-test's and the batch tool's checks read it from the call). Made on
    first use: importing the pipeline module at import time would import its image processor (and, without
    torchvision, print transformers' warning) whenever cogattn is imported."""
    from diffusers import WanAnimatePipeline

    class _TinyWanAnimatePipeline(WanAnimatePipeline):
        def __call__(self, *args, num_frames: int | None = None, **kwargs):
            if num_frames is not None:
                kwargs["segment_frame_length"] = num_frames
            return super().__call__(*args, **kwargs)

    return _TinyWanAnimatePipeline


def tiny_pipeline(task: str = "image-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``WanAnimatePipeline`` with real components at toy size (no download): the tiny Wan
    image-to-video pipeline's text encoder, VAE and CLIP (``wan.tiny_pipeline``), a Wan Animate transformer
    and a UniPC flow scheduler (the pipeline's).

    Call it with ``image=`` a PIL image, ``pose_video=`` and ``face_video=`` lists of PIL images (face frames
    16×16), ``height=32, width=48`` (2×3 patches per latent frame) and ``num_frames=9`` (its
    ``segment_frame_length``): 3 latent frames after the reference frame, 4 in the grid. A pose video of at
    most that many frames is one segment.
    """
    from diffusers import UniPCMultistepScheduler, WanAnimatePipeline

    if task != "image-to-video":
        raise ValueError(f"task={task!r}; Wan Animate animates a character image: 'image-to-video'.")
    base = wan.tiny_pipeline("image-to-video", dtype=dtype, seed=seed, **size)
    takes = inspect.signature(WanAnimatePipeline.__init__).parameters
    parts = {name: part for name, part in base.components.items() if name in takes}
    parts["transformer"] = tiny_transformer(dtype=dtype, seed=seed, **size)
    parts["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    pipe = _tiny_pipeline_class()(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: Wan's (``wan.tiny_call``: one video of random text embeddings, 32×48)
    with a random character image and random pose and face videos of one 9-frame segment."""
    import PIL.Image

    def frames(count: int, height: int, width: int) -> list:
        shape = (height, width, 3)
        return [
            PIL.Image.fromarray(torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).numpy())
            for _ in range(count)
        ]

    call = wan.tiny_call(pipe, "image-to-video", generator, guided)
    call.update(num_frames=_FRAMES, pose_video=frames(_FRAMES, 32, 48), face_video=frames(_FRAMES, _FACE, _FACE))
    return call


SPEC = ModelSpec(
    "wan_animate",
    (WanAnimateTransformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {_STOCK: wan.WanAttnMapProcessor, wan.WanAttnProcessor: wan.WanAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("image-to-video",),
    config_keys=("inject_face_latents_blocks",),
    known=KNOWN,
    text_len=wan.TEXT_LEN,
    context_kinds=wan.SPEC.context_kinds,
    refused=wan.SPEC.refused,
    guidance_calls=2,
    title="Wan Animate",
    frame_counts="5, 9, ..., 77 (a segment), ..., 81",
    pipelines={"image-to-video": "WanAnimatePipeline"},
    call_rules=wan.call_rules,  # Wan's: an image-to-video checkpoint, 512 text tokens
    batch_refusal=(
        "the batch tool does not run Wan Animate yet: its pipeline animates each image with a pose and a face "
        "video, which a prompts file does not give (--dry-run plans the run); record a WanAnimatePipeline call "
        "from Python with cogattn.record."
    ),
)
