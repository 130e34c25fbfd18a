"""The model families cogattn knows, one module each, behind one registry (docs/design.md, "The model seam").

Which family serves a transformer is read from :data:`TABLE`, plain data: its transformer classes by name
(diffusers' copies of a model under another name included) and the config keys only it has. A family's
module, which imports its diffusers modules, is imported the first time a model of that family is asked
for (``spec_for_module``, ``spec_for_config``, ``family``), so reading runs and ``import cogattn`` import no
model code. ``FAMILIES`` (a :class:`ModelSpec` per family whose attention modules the installed diffusers
has), ``UNAVAILABLE`` (for the others, which diffusers they need) and ``KNOWN_MODELS`` import every family
when first read, as ``cogattn.models.<family>`` imports that one (`None` where this diffusers lacks it).
``transformer_config`` reads a transformer's config from a pipeline, a local folder, the hub cache, or the
released shapes the families list, so a plan can be made for a model that is not downloaded.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from .spec import ModelSpec, Site, Unavailable

__all__ = [
    "FAMILIES",
    "FamilyRow",
    "KNOWN_MODELS",
    "ModelSpec",
    "REFUSED",
    "Site",
    "TABLE",
    "UNAVAILABLE",
    "Unavailable",
    "family",
    "spec_for_config",
    "spec_for_module",
    "tiny_spec",
    "transformer_config",
]


class FamilyRow(NamedTuple):
    """What tells a family's models apart without importing its module.

    Args:
        classes (`tuple[str, ...]`): its transformer classes' names (a module whose class or a base has one, a
            config whose ``_class_name`` is one); the spec's ``transformers`` and a checkpoint's own name.
        config_keys (`tuple[str, ...]`): config keys only it has (a config without ``_class_name``), as its spec's.
    """

    classes: tuple[str, ...]
    config_keys: tuple[str, ...] = ()


# family (its module's name) → its row; the embedded default first, then by name, the order a config's keys are tried
TABLE: dict[str, FamilyRow] = {
    "cogvideox": FamilyRow(("CogVideoXTransformer3DModel",), ("max_text_seq_length",)),
    "allegro": FamilyRow(("AllegroTransformer3DModel",)),
    "anyflow": FamilyRow(("AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel")),
    "chronoedit": FamilyRow(("ChronoEditTransformer3DModel",)),
    "consisid": FamilyRow(("ConsisIDTransformer3DModel",)),
    "cosmos": FamilyRow(("CosmosTransformer3DModel",)),
    "cosmos3": FamilyRow(("Cosmos3OmniTransformer",)),
    "easyanimate": FamilyRow(("EasyAnimateTransformer3DModel",), ("mmdit_layers",)),
    "helios": FamilyRow(("HeliosTransformer3DModel",), ("has_multi_term_memory_patch",)),
    "hunyuan_video": FamilyRow(("HunyuanVideoTransformer3DModel",), ("num_single_layers",)),
    "hunyuan_video15": FamilyRow(("HunyuanVideo15Transformer3DModel",), ("text_embed_2_dim",)),
    "hunyuan_video_framepack": FamilyRow(
        ("HunyuanVideoFramepackTransformer3DModel", "HunyuanVideoTransformer3DModelPacked"), ("has_clean_x_embedder",)
    ),
    "kandinsky5": FamilyRow(("Kandinsky5Transformer3DModel",), ("num_visual_blocks",)),
    "kandinsky6": FamilyRow(("Kandinsky6Transformer3DModel", "Kandinsky6SRTransformer3DModel")),
    "latte": FamilyRow(("LatteTransformer3DModel",)),
    "ltx2": FamilyRow(("LTX2VideoTransformer3DModel",)),
    "ltx_video": FamilyRow(("LTXVideoTransformer3DModel",)),
    "minimax_h3": FamilyRow(("MiniMaxH3Transformer3DModel",)),
    "mochi": FamilyRow(("MochiTransformer3DModel",), ("max_sequence_length",)),
    "motif_video": FamilyRow(("MotifVideoTransformer3DModel",)),
    "sana_video": FamilyRow(("SanaVideoTransformer3DModel",)),
    "skyreels_v2": FamilyRow(("SkyReelsV2Transformer3DModel",)),
    "wan": FamilyRow(("WanTransformer3DModel",), ("text_dim",)),
    "wan_animate": FamilyRow(("WanAnimateTransformer3DModel",), ("inject_face_latents_blocks",)),
    "wan_vace": FamilyRow(("WanVACETransformer3DModel",)),
}
# video transformers of the installed diffusers that cogattn does not record, by class: why, in one line
REFUSED: dict[str, str] = {
    "WanAnimate2Transformer3DModel": "Wan-Animate-2 (WanAnimate2Transformer3DModel) is not recorded: its generation "
    "pass attends to the keys and values a reference pass cached, packed with its own into a 128-aligned buffer "
    "under a flex BlockMask, so a call's map is not a softmax of its own q and k; Wan Animate (WanAnimatePipeline) is.",
    "SanaWMTransformer3DModel": "SANA-WM (SanaWMTransformer3DModel) is not recorded: three of every four of its "
    "blocks are gated delta-net linear attention, which has no softmax map; SANA-Video (SanaVideoPipeline) is.",
    "SanaWMLTX2RefinerTransformer3DModel": "SANA-WM's refiner (SanaWMLTX2RefinerTransformer3DModel) is not recorded: "
    "its self-attention runs against a sliding-window cache of keys and values from earlier windows, not a call's "
    "own q and k; LTX-2 (LTX2Pipeline), whose architecture it shares, is.",
}
# Made by importing every family's module the first time one of them is read (a module `__getattr__`):
FAMILIES: list[ModelSpec]
"""A :class:`ModelSpec` per family whose attention modules the installed diffusers has, in ``TABLE``'s order."""
UNAVAILABLE: dict[str, Unavailable]
"""Family → what it needs, for each family whose attention modules the installed diffusers lacks."""
KNOWN_MODELS: dict[str, dict]
"""Hub id → the transformer config of every family's released checkpoints (those this diffusers lacks too)."""
_EVERY = ("FAMILIES", "UNAVAILABLE", "KNOWN_MODELS")
_LOADED: dict[str, ModelSpec | Unavailable] = {}


def _load(name: str) -> ModelSpec | Unavailable:
    """The spec of family ``name``, its module imported on first use; its `Unavailable` where this diffusers
    lacks the family."""
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(f"{__name__}.{name}").SPEC
        except Unavailable as missing:
            _LOADED[name] = missing
    return _LOADED[name]


def __getattr__(name: str):
    if name in TABLE:  # `cogattn.models.wan`: the family's module, `None` where this diffusers lacks the family
        return None if isinstance(_load(name), Unavailable) else importlib.import_module(f"{__name__}.{name}")
    if name in _EVERY:
        return _every_family()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _every_family() -> dict:
    """``FAMILIES``, ``UNAVAILABLE`` and ``KNOWN_MODELS``, made once by importing every family's module."""
    if "FAMILIES" not in globals():
        loaded = [_load(family) for family in TABLE]
        families = [found for found in loaded if isinstance(found, ModelSpec)]
        unavailable = {found.family: found for found in loaded if isinstance(found, Unavailable)}
        # the released shapes of every family, those this diffusers lacks too (whose configs then say what they need)
        known = {
            n: c for k in [m.known for m in unavailable.values()] + [s.known for s in families] for n, c in k.items()
        }
        globals().update(FAMILIES=families, UNAVAILABLE=unavailable, KNOWN_MODELS=known)  # later reads skip __getattr__
    return {name: globals()[name] for name in _EVERY}


def family(name: str) -> ModelSpec:
    """The spec of the family ``name`` (``"cogvideox"``, ``"wan"``, ...); `ValueError` names what it needs."""
    if name not in TABLE:
        raise ValueError(f"family {name!r} is not one cogattn supports; supported: {list(TABLE)}.")
    spec = _load(name)
    if isinstance(spec, Unavailable):
        raise ValueError(f"{spec}; upgrade diffusers.")
    return spec


def spec_for_module(module) -> ModelSpec | None:
    """The family of a transformer module, `None` when it is no family's; the names of its class and bases say
    which family's module to import."""
    names = {cls.__name__ for cls in type(module).__mro__}
    for name, row in TABLE.items():
        if not names.isdisjoint(row.classes):
            spec = _load(name)
            if isinstance(spec, ModelSpec) and spec.matches(module):
                return spec
    return None


def spec_for_config(config: dict) -> ModelSpec:
    """The family of a transformer config (its ``_class_name``, else the keys only one family has); a class
    cogattn does not record (:data:`REFUSED`) says why."""
    name = config.get("_class_name")
    if name in REFUSED:
        raise ValueError(REFUSED[name])
    if name is not None:
        candidates = [family for family, row in TABLE.items() if name in row.classes]
    else:
        candidates = [family for family, row in TABLE.items() if any(key in config for key in row.config_keys)]
    loaded = [_load(family) for family in candidates]
    spec = next((s for s in loaded if isinstance(s, ModelSpec) and s.matches_config(config)), None)
    if spec is not None:
        return spec
    for missing in loaded:
        if isinstance(missing, Unavailable):  # this diffusers lacks the family the config names
            raise ValueError(f"{missing}; upgrade diffusers.")
    raise ValueError(f"a transformer config of class {name!r} is not a model cogattn supports.")


def tiny_spec(name: str) -> ModelSpec | None:
    """The family whose tiny pipeline the batch tool's ``model:`` ``name`` is (its ``tiny_name``: ``"tiny"``,
    ``"tiny-wan"``), `None` for a name no available family's tiny pipeline has; the family a ``"tiny-<family>"``
    name spells is imported first."""
    if not name.startswith("tiny"):
        return None
    spelled = name.removeprefix("tiny-").replace("-", "_")
    for family in sorted(TABLE, key=lambda f: f != spelled):  # stable: then the table's order, the default first
        spec = _load(family)
        if isinstance(spec, ModelSpec) and spec.tiny_name == name:
            return spec
    return None


def _module_config(transformer) -> dict:
    """A transformer module's config with its class named, as a checkpoint's config.json names it: by its
    keys alone a copy of a model (Wan Animate's ``text_dim``, FramePack's ``num_single_layers``) would read
    as the model it copies."""
    named = {"_class_name": type(transformer).__name__} if isinstance(transformer, torch.nn.Module) else {}
    return {**named, **dict(transformer.config)}


def transformer_config(model) -> dict:
    """The transformer config of a pipeline, a transformer, a config (``transformer.config``, a dict as config.json
    holds it), ``"tiny"``, a local folder or a hub id (from the hub cache or the hub: the config only, never the
    weights)."""
    if isinstance(model, Mapping):
        return dict(model)
    transformer = getattr(model, "transformer", model)
    if hasattr(transformer, "config") and not isinstance(model, (str, os.PathLike)):
        return _module_config(transformer)
    name = str(model)
    tiny = tiny_spec(name)  # "tiny", "tiny-wan", ...
    if tiny is not None:
        return _module_config(tiny.tiny_transformer())
    if name.startswith("tiny-"):  # a family by its name ("tiny-cogvideox"), or one this diffusers lacks
        return _module_config(family(name.removeprefix("tiny-").replace("-", "_")).tiny_transformer())
    folder = Path(name)
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if folder.exists():
        raise ValueError(
            f"{name!r} is a folder without transformer/config.json; is it a checkpoint of a supported family?"
        )
    from huggingface_hub import hf_hub_download

    try:  # the hub cache first, then the released shapes, and only then the network
        return json.loads(Path(hf_hub_download(name, "transformer/config.json", local_files_only=True)).read_text())
    except Exception:
        pass
    known = _every_family()["KNOWN_MODELS"]  # offline: the released shapes, from every family's module
    if name in known:
        return dict(known[name])
    try:
        return json.loads(Path(hf_hub_download(name, "transformer/config.json")).read_text())
    except Exception as err:
        raise ValueError(
            f"cannot read the transformer config of {name!r} ({type(err).__name__}); pass a local folder, or "
            f"one of {list(known)}."
        ) from None
