"""Per-model facts, kept in one registry keyed by transformer class.

A model is CogVideoX-like when its transformer class is registered here: the spec says where its
attention modules are and which stock processors cogattn can stand in for.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

__all__ = ["ModelSpec", "MODELS", "find_transformer"]


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's 3D full attention lives.

    Args:
        blocks (`str`): attribute of the transformer holding the blocks, in forward order.
        attention (`str`): attribute of a block holding its full-attention module.
        plain (`type`): the stock processor with separate q, k, v projections.
        fused (`type`): the stock processor after ``fuse_qkv_projections()``.
    """

    blocks: str
    attention: str
    plain: type
    fused: type

    def attention_modules(self, transformer) -> list:
        return [getattr(block, self.attention) for block in getattr(transformer, self.blocks)]

    def processor_name(self, layer: int) -> str:
        """Key of layer ``layer`` in ``transformer.attn_processors``."""
        return f"{self.blocks}.{layer}.{self.attention}.processor"


MODELS: dict[type, ModelSpec] = {
    CogVideoXTransformer3DModel: ModelSpec(
        "transformer_blocks", "attn1", CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0
    ),
}


def find_transformer(target) -> tuple[object, object | None, ModelSpec]:
    """``(transformer, pipeline or None, spec)`` for a pipeline or a bare transformer."""
    pipeline = None
    transformer = target
    if not isinstance(target, tuple(MODELS)) and hasattr(target, "transformer"):
        pipeline, transformer = target, target.transformer
    for cls, spec in MODELS.items():
        if isinstance(transformer, cls):
            return transformer, pipeline, spec
    known = ", ".join(c.__name__ for c in MODELS)
    raise TypeError(
        f"{type(target).__name__} is not a CogVideoX-like pipeline or transformer; cogattn supports "
        f"transformers of class {known} (or pipelines holding one as `.transformer`)."
    )
