"""ConsisID (identity-preserving image-to-video): CogVideoX's joint attention under its own transformer
(docs/design.md, "The model seam").

diffusers' ``ConsisIDTransformer3DModel`` runs CogVideoX blocks whose ``attn1`` is an ``Attention`` with
``CogVideoXAttnProcessor2_0``, so :class:`cogattn.models.cogvideox.CogVideoXAttnMapProcessor` is its
processor, and the layout (text first, then the video), the call and the guidance (one batched call) are
CogVideoX's. Its perceiver cross-attentions to the face features (``is_train_face``) are not capture
sites: they are no attention of the video to its text or to itself.
"""

from __future__ import annotations

import inspect

import torch
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

from . import cogvideox
from .spec import ModelSpec, Site, Unavailable
from .tiny_text import TEXT_DIM, TINY_TEXT_LEN

# Attention shapes of the released checkpoint (its transformer/config.json): CogVideoX-5b's blocks.
KNOWN: dict[str, dict] = {
    "BestWishYsh/ConsisID-preview": {
        **cogvideox.KNOWN["THUDM/CogVideoX-5b-I2V"],
        "_class_name": "ConsisIDTransformer3DModel",
    },
}

try:
    from diffusers import ConsisIDTransformer3DModel
except ImportError as missing:
    needs = "ConsisID needs diffusers >= 0.33"
    raise Unavailable("consisid", needs, KNOWN) from missing

__all__ = ["SPEC", "KNOWN", "tiny_pipeline", "tiny_transformer"]


def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 16, dtype=torch.float32, seed=0):
    """A random ``ConsisIDTransformer3DModel`` with the tiny CogVideoX's shapes (image-to-video: twice the
    latent channels), rotary positions, no face branch."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ConsisIDTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=8,
            out_channels=4,
            time_embed_dim=8,
            text_embed_dim=TEXT_DIM,
            num_layers=num_layers,
            sample_width=10,
            sample_height=6,
            sample_frames=9,
            patch_size=2,
            temporal_compression_ratio=4,
            max_text_seq_length=TINY_TEXT_LEN,
            use_rotary_positional_embeddings=True,
            is_train_face=False,
        )
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_pipeline(task: str = "image-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``ConsisIDPipeline``: the tiny CogVideoX image-to-video pipeline's parts
    (``cogvideox.tiny_pipeline``: call it the same way, with ``image=``) and a ConsisID transformer.

    It runs without OpenCV (not a dependency of cogattn): the pipeline's own module imports ``cv2`` only
    where installed and uses it only to draw face keypoints, for a transformer with ``is_kps`` (this one has
    none). diffusers' top-level ``ConsisIDPipeline`` is a placeholder that refuses to build without OpenCV.
    """
    from diffusers import CogVideoXDPMScheduler
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline

    if task != "image-to-video":
        raise ValueError(f"task={task!r}; ConsisID animates an image of a face: 'image-to-video'.")
    base = cogvideox.tiny_pipeline("image-to-video", dtype=dtype, seed=seed)
    takes = inspect.signature(ConsisIDPipeline.__init__).parameters
    parts = {name: part for name, part in base.components.items() if name in takes}
    parts["transformer"] = tiny_transformer(dtype=dtype, seed=seed, **size)
    parts["scheduler"] = CogVideoXDPMScheduler.from_config(base.scheduler.config)
    pipe = ConsisIDPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


SPEC = ModelSpec(
    "consisid",
    (ConsisIDTransformer3DModel,),
    (Site("transformer_blocks", "attn1"),),
    {CogVideoXAttnProcessor2_0: cogvideox.CogVideoXAttnMapProcessor},
    cogvideox.SPEC.read_call,
    cogvideox.SPEC.layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=cogvideox.tiny_call,
    tiny_tasks=("image-to-video",),
    pipelines={"image-to-video": "ConsisIDPipeline"},
    known=KNOWN,
    text_len=226,
    refused=cogvideox.SPEC.refused,
)
