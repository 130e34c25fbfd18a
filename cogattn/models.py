"""Per-model facts, kept in one registry keyed by transformer class, and model configs read without weights.

A model is CogVideoX-like when its transformer class is registered here: the spec says where its
attention modules are and which stock processors cogattn can stand in for. ``transformer_config``
reads a transformer's config from a pipeline, a local folder, the hub cache, or a table of the
released shapes, so a plan can be made for a model that is not downloaded.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

from .processor import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor

__all__ = ["KNOWN_MODELS", "MODELS", "EagerWhileRecording", "ModelSpec", "find_transformer", "transformer_config"]


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's 3D full attention lives, and which cogattn processor stands in for which stock one.

    Args:
        blocks (`str`): attribute of the transformer holding the blocks, in forward order.
        attention (`str`): attribute of a block holding its full-attention module.
        processors (`dict[type, type]`): stock processor class → the cogattn processor copying it (plain
            q, k, v projections, and the fused ones of ``fuse_qkv_projections()``).
    """

    blocks: str
    attention: str
    processors: dict[type, type]

    def attention_modules(self, transformer) -> list:
        return [getattr(block, self.attention) for block in getattr(transformer, self.blocks)]

    def processor_name(self, layer: int) -> str:
        """Key of layer ``layer`` in ``transformer.attn_processors``."""
        return f"{self.blocks}.{layer}.{self.attention}.processor"

    def map_processors(self, current: dict, num_layers: int, sink) -> dict:
        """cogattn processors feeding ``sink`` for the attention of every layer, keyed as
        ``transformer.attn_processors`` (``current``) is; refuses processors that are not stock."""
        replacement = {}
        for i in range(num_layers):
            name = self.processor_name(i)
            proc = current[name]
            if isinstance(proc, tuple(self.processors.values())):
                raise ValueError(f"{name} already runs a cogattn processor; close the other recording first.")
            if type(proc) not in self.processors:
                stock = [cls.__name__ for cls in self.processors]
                raise TypeError(
                    f"{name} is a {type(proc).__name__}; cogattn captures through the stock {' or '.join(stock)}. "
                    f"Reset with `transformer.set_attn_processor({stock[0]}())`."
                )
            replacement[name] = self.processors[type(proc)](sink)
        return replacement


MODELS: dict[type, ModelSpec] = {
    CogVideoXTransformer3DModel: ModelSpec(
        "transformer_blocks",
        "attn1",
        {
            CogVideoXAttnProcessor2_0: CogVideoXAttnMapProcessor,
            FusedCogVideoXAttnProcessor2_0: FusedCogVideoXAttnMapProcessor,
        },
    ),
}


def find_transformer(target) -> tuple[object, object | None, ModelSpec]:
    """``(transformer, pipeline or None, spec)`` for a pipeline or a bare transformer; a transformer compiled
    with ``torch.compile`` gives the module inside the compiled wrapper."""
    pipeline = None
    transformer = target
    if not isinstance(_uncompiled(target), tuple(MODELS)) and hasattr(target, "transformer"):
        pipeline, transformer = target, target.transformer
    inner = _uncompiled(transformer)
    for cls, spec in MODELS.items():
        if isinstance(inner, cls):
            if inner is not transformer and pipeline is None:
                raise TypeError(
                    "this transformer is compiled with torch.compile, whose graph cannot call cogattn at every "
                    "layer; record the module inside it, `cogattn.record(compiled._orig_mod, ...)`, and call that "
                    "module for the generation you record (or record the pipeline that holds it)."
                )
            return inner, pipeline, spec
    known = ", ".join(c.__name__ for c in MODELS)
    raise TypeError(
        f"{type(target).__name__} is not a CogVideoX-like pipeline or transformer; cogattn supports "
        f"transformers of class {known} (or pipelines holding one as `.transformer`, compiled or not)."
    )


def _uncompiled(module):
    return getattr(module, "_orig_mod", module)  # torch.compile(module) wraps it as `_orig_mod`


class EagerWhileRecording:
    """Runs a compiled transformer eagerly while a recording is open, and compiled again after.

    Both ``pipe.transformer = torch.compile(pipe.transformer)`` (the pipeline then holds the module
    inside the wrapper for the recording) and ``pipe.transformer.compile()`` (its compiled call is set
    aside) are undone by :meth:`restore`. Capture runs cogattn's code at every layer, which a compiled
    graph cannot call; the output is then the uncompiled model's, and a warning says so."""

    def __init__(self, pipeline, transformer):
        self._undo = []
        if pipeline is not None and pipeline.transformer is not transformer:
            wrapper = pipeline.transformer
            pipeline.transformer = transformer
            self._undo.append(lambda: setattr(pipeline, "transformer", wrapper))
        compiled_call = getattr(transformer, "_compiled_call_impl", None)
        if compiled_call is not None:
            transformer._compiled_call_impl = None
            self._undo.append(lambda: setattr(transformer, "_compiled_call_impl", compiled_call))
        if self._undo:
            warnings.warn(
                "the transformer is compiled with torch.compile; while this recording is open it runs uncompiled "
                "(cogattn's code runs at every layer, which a compiled graph cannot call), so the output is the "
                "uncompiled model's. It is compiled again when the recording closes.",
                stacklevel=4,
            )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_BASE = {"attention_head_dim": 64, "patch_size": 2, "patch_size_t": None, "max_text_seq_length": 226}
KNOWN_MODELS: dict[str, dict] = {
    "THUDM/CogVideoX-2b": {**_BASE, "num_layers": 30, "num_attention_heads": 30},
    "THUDM/CogVideoX-5b": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX-5b-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX1.5-5B": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
    "THUDM/CogVideoX1.5-5B-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
}


def transformer_config(model) -> dict:
    """The transformer config of a pipeline, a transformer, ``"tiny"``, a local folder or a hub id
    (from the hub cache or the hub: the config only, never the weights)."""
    transformer = getattr(model, "transformer", model)
    if hasattr(transformer, "config") and not isinstance(model, (str, os.PathLike)):
        return dict(transformer.config)
    name = str(model)
    if name == "tiny":
        from .testing import tiny_transformer

        return dict(tiny_transformer().config)
    folder = Path(name)
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if folder.exists():
        raise ValueError(f"{name!r} is a folder without transformer/config.json; is it a CogVideoX checkpoint?")
    from huggingface_hub import hf_hub_download

    try:  # the hub cache first, then the released shapes, and only then the network
        return json.loads(Path(hf_hub_download(name, "transformer/config.json", local_files_only=True)).read_text())
    except Exception:
        pass
    if name in KNOWN_MODELS:
        return dict(KNOWN_MODELS[name])
    try:
        return json.loads(Path(hf_hub_download(name, "transformer/config.json")).read_text())
    except Exception as err:
        raise ValueError(
            f"cannot read the transformer config of {name!r} ({type(err).__name__}); pass a local folder, or "
            f"one of {list(KNOWN_MODELS)}."
        ) from None
