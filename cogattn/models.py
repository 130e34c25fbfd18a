"""The model seam: what cogattn knows of each model family, in one registry keyed by transformer class.

A family is one :class:`ModelSpec`: where its attention modules are, which stock processors cogattn's
stand in for, how a transformer call tells the token layout, the batch and the timestep, the layout of
a pipeline call (for plans made offline), which kinds its attentions make, and which transformers of a
pipeline take turns (Wan 2.2's two experts). CogVideoX's facts are here; Wan's in :mod:`cogattn.wan`.
docs/design.md, "The model seam", lists the steps to add a family. ``transformer_config`` reads a
transformer's config from a pipeline, a local folder, the hub cache, or a table of the released
shapes, so a plan can be made for a model that is not downloaded.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

from .layout import TokenLayout
from .processor import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor

try:  # Wan's attention modules came with diffusers 0.35
    from diffusers.models.transformers.transformer_wan import WanAttention  # noqa: F401
except ImportError:
    wan = None
else:
    from . import wan

__all__ = [
    "KNOWN_MODELS",
    "MODELS",
    "EagerWhileRecording",
    "ModelSpec",
    "Transformers",
    "find_transformer",
    "spec_for_config",
    "transformer_config",
]


@dataclass(frozen=True)
class ModelSpec:
    """One model family's facts (docs/design.md, "The model seam").

    Args:
        family (`str`): its name in run metadata (``"cogvideox"``, ``"wan"``).
        blocks (`str`): attribute of the transformer holding the blocks, in forward order.
        attention (`str`): attribute of a block holding its self-attention (CogVideoX: the joint text +
            video attention).
        processors (`dict[type, type]`): stock processor class → the cogattn processor copying it.
        read_call (`Callable`): ``(config, args, kwargs)`` of a transformer call → ``(TokenLayout, batch
            size, timestep, device)``.
        layout_for_video (`Callable`): ``(config, num_frames, height, width, text_len)`` → the
            `TokenLayout` of a pipeline call.
        context (`str | None`): attribute of a block holding its cross-attention to the text, if any.
        context_kinds (`dict[str, str]`): kinds made by the cross-attention → ``"text"`` or ``"image"``.
        refused (`dict[str, str]`): kinds the family has no attention for → why.
        experts (`tuple[str, ...]`): pipeline attributes holding transformers that take turns by step.
        guidance_calls (`int`): transformer calls per step under classifier-free guidance (1: the batch
            ``[uncond..., cond...]`` in one call; 2: the conditional call, then the unconditional one).
    """

    family: str
    blocks: str
    attention: str
    processors: dict[type, type]
    read_call: Callable
    layout_for_video: Callable
    context: str | None = None
    context_kinds: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    experts: tuple[str, ...] = ("transformer",)
    guidance_calls: int = 1

    def kinds(self, source: str | None = None) -> tuple[str, ...]:
        """The kinds this family makes (of one ``source``: ``"self"``, ``"text"``, ``"image"``), in
        ``cogattn.KINDS`` order."""
        from .reducers import REDUCERS  # every kind is registered once cogattn is imported

        made = [k for k in REDUCERS if k not in self.refused]
        return tuple(k for k in made if source is None or self.source(k) == source)

    def source(self, kind: str) -> str:
        """Which attention makes ``kind``: ``"self"``, or the cross-attention's ``"text"`` / ``"image"``."""
        return self.context_kinds.get(kind, "self")

    def check_kinds(self, kinds) -> None:
        """Raise `ValueError` for a kind this family has no attention for."""
        for kind in kinds:
            if kind in self.refused:
                raise ValueError(f"kind {kind!r} does not exist for {self.family}: {self.refused[kind]}")

    def attention_modules(self, transformer) -> list:
        """The self-attention module of every block."""
        return [getattr(block, self.attention) for block in getattr(transformer, self.blocks)]

    def roles(self, transformer) -> dict[int, tuple[int, str]]:
        """``id(module)`` → ``(block index, "self" or "context")`` for every attention module captured."""
        out = {}
        for i, block in enumerate(getattr(transformer, self.blocks)):
            out[id(getattr(block, self.attention))] = (i, "self")
            if self.context is not None:
                out[id(getattr(block, self.context))] = (i, "context")
        return out

    def processor_names(self, num_layers: int) -> list[str]:
        """Keys of the captured modules in ``transformer.attn_processors``."""
        attrs = [self.attention] + ([self.context] if self.context else [])
        return [f"{self.blocks}.{i}.{a}.processor" for i in range(num_layers) for a in attrs]

    def map_processors(self, current: dict, num_layers: int, sink) -> dict:
        """cogattn processors feeding ``sink`` for the captured attention of every layer, keyed as
        ``transformer.attn_processors`` (``current``) is; refuses processors that are not stock."""
        replacement = {}
        for name in self.processor_names(num_layers):
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
            for attr in ("_attention_backend", "_parallel_config"):  # set_attention_backend(...) and the like
                if hasattr(proc, attr):
                    setattr(replacement[name], attr, getattr(proc, attr))
        return replacement


def _cogvideox_call(config, args: tuple, kwargs: dict):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
    t = kwargs["timestep"] if "timestep" in kwargs else args[2]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    return TokenLayout.from_latents(tuple(hidden.shape), text.shape[1], config), hidden.shape[0], t, hidden.device


def _cogvideox_layout(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    text_len = text_len or int(config["max_text_seq_length"])
    return TokenLayout.for_video(
        num_frames, height, width, text_len, int(config["patch_size"]), config.get("patch_size_t")
    )


COGVIDEOX = ModelSpec(
    "cogvideox",
    "transformer_blocks",
    "attn1",
    {
        CogVideoXAttnProcessor2_0: CogVideoXAttnMapProcessor,
        FusedCogVideoXAttnProcessor2_0: FusedCogVideoXAttnMapProcessor,
    },
    _cogvideox_call,
    _cogvideox_layout,
    refused={
        "video_to_image": "CogVideoX has no image cross-attention (its image-to-video pipelines put the image "
        "in the latents); the image's tokens are video tokens of latent frame 0."
    },
)
MODELS: dict[type, ModelSpec] = {CogVideoXTransformer3DModel: COGVIDEOX}
if wan is not None:
    WAN = ModelSpec(
        "wan",
        "blocks",
        "attn1",
        wan.PROCESSORS,
        wan.read_call,
        wan.layout_for_video,
        context="attn2",
        context_kinds={"video_to_text": "text", "video_to_image": "image"},
        refused={
            "text_to_video": "Wan's text never queries (its self-attention is over the video alone; the text is "
            "a key of the cross-attention), so there are no text → video probabilities. Use 'video_to_text'."
        },
        experts=("transformer", "transformer_2"),
        guidance_calls=2,
    )
    MODELS[wan.TRANSFORMER] = WAN


def spec_for_config(config: dict) -> ModelSpec:
    """The family of a transformer config (its ``_class_name``, else the keys only one family has)."""
    name = config.get("_class_name")
    for cls, spec in MODELS.items():
        if name == cls.__name__:
            return spec
    if name is None and "max_text_seq_length" in config:
        return COGVIDEOX
    if name is None and "text_dim" in config and wan is not None:
        return MODELS[wan.TRANSFORMER]
    if name == "WanTransformer3DModel" or "text_dim" in config:
        raise ValueError("Wan needs diffusers >= 0.35 (WanAttention); upgrade diffusers.")
    raise ValueError(f"a transformer config of class {name!r} is not a model cogattn supports.")


def find_transformer(target) -> tuple[object, object | None, ModelSpec]:
    """``(transformer, pipeline or None, spec)`` for a pipeline or a bare transformer; a transformer compiled
    with ``torch.compile`` gives the module inside the compiled wrapper."""
    pipeline = None
    transformer = target
    if not isinstance(_uncompiled(target), tuple(MODELS)) and hasattr(target, "transformer"):
        pipeline, transformer = target, target.transformer
    if pipeline is not None and transformer is None:
        raise TypeError(
            f"this {type(target).__name__} has no `transformer` (it is None); cogattn records a pipeline's "
            "`transformer` and the experts that take turns with it (`transformer_2`): load the pipeline with both."
        )
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
        f"{type(target).__name__} is not a pipeline or transformer cogattn supports; cogattn supports "
        f"transformers of class {known} (or pipelines holding one as `.transformer`, compiled or not)"
        + ("" if wan is not None else "; Wan needs diffusers >= 0.35")
        + "."
    )


def _uncompiled(module):
    return getattr(module, "_orig_mod", module)  # torch.compile(module) wraps it as `_orig_mod`


class EagerWhileRecording:
    """Runs a compiled transformer eagerly while a recording is open, and compiled again after.

    ``pipe.transformer = torch.compile(pipe.transformer)`` (the pipeline then holds the module inside the
    wrapper for the recording), ``pipe.transformer.compile()`` and compiled blocks
    (``compile_repeated_blocks()``, diffusers' usual way to compile Wan: each compiled call is set aside)
    are undone by :meth:`restore`. Capture runs cogattn's code at every layer, which a compiled
    graph cannot call; the output is then the uncompiled model's, and a warning says so."""

    def __init__(self, pipeline, transformer, attr: str = "transformer", stacklevel: int = 4):
        self._undo = []
        if pipeline is not None and getattr(pipeline, attr) is not transformer:
            wrapper = getattr(pipeline, attr)
            setattr(pipeline, attr, transformer)
            self._undo.append(lambda: setattr(pipeline, attr, wrapper))
        for module in transformer.modules():  # the transformer itself, or its blocks
            compiled_call = getattr(module, "_compiled_call_impl", None)
            if compiled_call is not None:
                module._compiled_call_impl = None
                self._undo.append(lambda m=module, c=compiled_call: setattr(m, "_compiled_call_impl", c))
        if self._undo:
            warnings.warn(
                "the transformer is compiled with torch.compile; while this recording is open it runs uncompiled "
                "(cogattn's code runs at every layer, which a compiled graph cannot call), so the output is the "
                "uncompiled model's. It is compiled again when the recording closes.",
                stacklevel=stacklevel,
            )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class Transformers:
    """The transformers a recording follows: the pipeline's ``transformer`` and the experts that take
    turns with it (Wan 2.2's ``transformer_2``), with the block and role of each attention module.

    Args:
        pipeline: the pipeline, or `None` for a bare transformer.
        transformer: the (uncompiled) main transformer.
        spec (`ModelSpec`): the family.
    """

    def __init__(self, pipeline, transformer, spec: ModelSpec):
        self.spec = spec
        self.modules, attrs = [transformer], [spec.experts[0]]
        for name in spec.experts[1:]:
            other = getattr(pipeline, name, None) if pipeline is not None else None
            if other is not None:
                self.modules.append(_uncompiled(other))
                attrs.append(name)
        self.names = tuple(attrs)
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.roles: dict[int, tuple[int, str]] = {}
        for m in self.modules:
            self.roles.update(spec.roles(m))
        self._pipeline, self._attrs = pipeline, attrs
        self._eager: list[EagerWhileRecording] = []
        self._originals: list[dict] | None = None

    def run_eager(self) -> None:
        """Run compiled transformers uncompiled until :meth:`restore` (:class:`EagerWhileRecording`)."""
        self._eager = [EagerWhileRecording(self._pipeline, m, a, 5) for m, a in zip(self.modules, self._attrs)]

    def hook(self, hook) -> list:
        """Register the forward pre-hook ``hook`` on every transformer; returns the handles."""
        return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self.modules]

    def check_install(self) -> None:
        """Raise what :meth:`install` would raise (a processor that is not stock, another recording's),
        changing nothing."""
        for m in self.modules:
            self.spec.map_processors(m.attn_processors, len(getattr(m, self.spec.blocks)), None)

    def install(self, sink) -> None:
        """Replace the stock processors of every captured module with cogattn's, feeding ``sink``."""
        self._originals = []  # filled as each is replaced: a refusal restores those replaced before it
        for m in self.modules:
            current = m.attn_processors
            replacement = self.spec.map_processors(current, len(getattr(m, self.spec.blocks)), sink)
            m.set_attn_processor({**current, **replacement})
            self._originals.append(current)

    def restore(self) -> None:
        """Put the original processors back and compile again what was compiled (idempotent)."""
        if self._originals is not None:
            for m, original in zip(self.modules, self._originals):
                m.set_attn_processor(original)
            self._originals = None
        for eager in self._eager:
            eager.restore()


# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_BASE = {"attention_head_dim": 64, "patch_size": 2, "patch_size_t": None, "max_text_seq_length": 226}
KNOWN_MODELS: dict[str, dict] = {
    "THUDM/CogVideoX-2b": {**_BASE, "num_layers": 30, "num_attention_heads": 30},
    "THUDM/CogVideoX-5b": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX-5b-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX1.5-5B": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
    "THUDM/CogVideoX1.5-5B-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
    **(wan.KNOWN_WAN if wan is not None else {}),
}


def transformer_config(model) -> dict:
    """The transformer config of a pipeline, a transformer, ``"tiny"``, a local folder or a hub id
    (from the hub cache or the hub: the config only, never the weights)."""
    transformer = getattr(model, "transformer", model)
    if hasattr(transformer, "config") and not isinstance(model, (str, os.PathLike)):
        return dict(transformer.config)
    name = str(model)
    if name in ("tiny", "tiny-wan"):
        from .tiny import tiny_transformer, tiny_wan_transformer

        return dict((tiny_transformer if name == "tiny" else tiny_wan_transformer)().config)
    folder = Path(name)
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if folder.exists():
        raise ValueError(f"{name!r} is a folder without transformer/config.json; is it a CogVideoX or Wan checkpoint?")
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
