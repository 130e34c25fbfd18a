"""The model families cogattn knows, one module each, behind one registry (docs/design.md, "The model seam").

``FAMILIES`` holds a :class:`ModelSpec` per family whose attention modules the installed diffusers has;
``UNAVAILABLE`` says, for the others, which diffusers they need. A module is a family's when the spec's
``matches`` says so (an instance of one of its transformer classes, diffusers' copies of a model under
another name included). ``transformer_config`` reads a transformer's config from a pipeline, a local
folder, the hub cache, or the released shapes the families list, so a plan can be made for a model
that is not downloaded.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from pathlib import Path

import torch

from .spec import ModelSpec, Site, Unavailable

__all__ = [
    "FAMILIES",
    "KNOWN_MODELS",
    "ModelSpec",
    "Site",
    "UNAVAILABLE",
    "Unavailable",
    "family",
    "spec_for_config",
    "spec_for_module",
    "transformer_config",
]

FAMILIES: list[ModelSpec] = []
UNAVAILABLE: dict[str, Unavailable] = {}  # family → what it needs, where this diffusers lacks its attention modules
for _found in pkgutil.iter_modules(__path__):  # every module of this package but these is a family
    if _found.name in ("spec", "tiny_text", "prompt_text") or _found.name.startswith("_"):  # a family's private part
        continue
    try:
        _module = importlib.import_module(f"{__name__}.{_found.name}")
    except Unavailable as missing:
        UNAVAILABLE[missing.family] = missing
        globals()[_found.name] = None  # `cogattn.models.wan is None`: this diffusers lacks the family
    else:
        globals()[_found.name] = _module
        FAMILIES.append(_module.SPEC)
FAMILIES.sort(key=lambda spec: spec.family != "cogvideox")  # the embedded default first, then by name

# the released shapes of every family, those this diffusers lacks too (whose configs then say what they need)
KNOWN_MODELS: dict[str, dict] = {
    name: config
    for known in [m.known for m in UNAVAILABLE.values()] + [s.known for s in FAMILIES]
    for name, config in known.items()
}


def family(name: str) -> ModelSpec:
    """The spec of the family ``name`` (``"cogvideox"``, ``"wan"``, ...); `ValueError` names what it needs."""
    for spec in FAMILIES:
        if spec.family == name:
            return spec
    if name in UNAVAILABLE:
        raise ValueError(f"{UNAVAILABLE[name]}; upgrade diffusers.")
    raise ValueError(f"family {name!r} is not one cogattn supports; supported: {[s.family for s in FAMILIES]}.")


def spec_for_module(module) -> ModelSpec | None:
    """The family of a transformer module, `None` when it is no family's."""
    return next((spec for spec in FAMILIES if spec.matches(module)), None)


def spec_for_config(config: dict) -> ModelSpec:
    """The family of a transformer config (its ``_class_name``, else the keys only one family has)."""
    for spec in FAMILIES:
        if spec.matches_config(config):
            return spec
    name = config.get("_class_name")
    for missing in UNAVAILABLE.values():
        if name in missing.class_names or (name is None and any(k in config for k in missing.config_keys)):
            raise ValueError(f"{missing}; upgrade diffusers.")
    raise ValueError(f"a transformer config of class {name!r} is not a model cogattn supports.")


def _module_config(transformer) -> dict:
    """A transformer module's config with its class named, as a checkpoint's config.json names it: by its
    keys alone a copy of a model (Wan Animate's ``text_dim``, FramePack's ``num_single_layers``) would read
    as the model it copies."""
    named = {"_class_name": type(transformer).__name__} if isinstance(transformer, torch.nn.Module) else {}
    return {**named, **dict(transformer.config)}


def transformer_config(model) -> dict:
    """The transformer config of a pipeline, a transformer, ``"tiny"``, a local folder or a hub id
    (from the hub cache or the hub: the config only, never the weights)."""
    transformer = getattr(model, "transformer", model)
    if hasattr(transformer, "config") and not isinstance(model, (str, os.PathLike)):
        return _module_config(transformer)
    name = str(model)
    tiny = next((spec for spec in FAMILIES if spec.tiny_name == name), None)  # "tiny", "tiny-wan", ...
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
    if name in KNOWN_MODELS:
        return dict(KNOWN_MODELS[name])
    try:
        return json.loads(Path(hf_hub_download(name, "transformer/config.json")).read_text())
    except Exception as err:
        raise ValueError(
            f"cannot read the transformer config of {name!r} ({type(err).__name__}); pass a local folder, or "
            f"one of {list(KNOWN_MODELS)}."
        ) from None
