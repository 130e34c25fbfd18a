"""The rules of a ``cogattn-dump`` config's pipeline call, checked before anything loads (a bad value would
fail every prompt).

The common rules read the model's family spec (``cogattn.models.ModelSpec``): the call's sizes as
:func:`cogattn.estimate` checks them (``cogattn.models.call_sizes``: the VAE's frames, pixels in whole patches, at
least one step), the tasks the family's pipelines take,
``true_cfg_scale`` where the pipeline has it (``guidance_argument``), ``guidance_scale_2`` for two experts, and
the tiny pipelines' options (``tiny_options``, set for their family's ``tiny_name`` only); then the family's own
(``call_rules``). Each refusal is a `ValueError` with one line for the user, which ``config.py`` raises
as its ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ..models import FAMILIES, KNOWN_MODELS, ModelSpec
from ..models.call_sizes import check_sizes

__all__ = ["check_call", "check_tiny_options"]

# The tiny pipelines' options: config key → (its family, tiny_pipeline keyword, choices, what it sets).
TINY_OPTIONS = {key: (spec, *option) for spec in FAMILIES for key, option in spec.tiny_options.items()}


def check_tiny_options(cfg) -> None:
    """The tiny pipelines' options of ``cfg`` (its ``tiny_*`` fields): one of their family's choices, and
    set only for that family's tiny model."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for key in (name for name in defaults if name.startswith("tiny_")):
        value = getattr(cfg, key)
        if key not in TINY_OPTIONS:  # a family this diffusers lacks
            if value != defaults[key]:
                raise ValueError(f"{key}: {value!r} is an option of a tiny pipeline this diffusers does not run.")
            continue
        spec, _, choices, about = TINY_OPTIONS[key]
        if isinstance(value, float) and isinstance(choices[0], str):  # YAML reads 1.5 as a number
            value = str(value)
            setattr(cfg, key, value)
        kind = type(choices[0])
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}.")
        if value not in choices:
            raise ValueError(f"{key}: {value!r} is not one of {list(choices)}.")
        if value != defaults[key] and cfg.model != spec.tiny_name:
            raise ValueError(f"{key}: {value!r} is for model: {spec.tiny_name} ({about}) only.")


def check_call(cfg) -> None:
    """The pipeline call of ``cfg`` (a ``DumpConfig``): the common rules, then its family's; sets
    ``max_sequence_length`` left out to the family's."""
    for key in ("fps", "max_sequence_length"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ValueError(f"{key}: {getattr(cfg, key)!r} must be at least 1.")
    spec = cfg.spec()
    spec.check_task(cfg.task, tiny=cfg.tiny_spec() is not None)
    config = cfg.model_config()
    sizes = ("num_frames", "height", "width", "num_inference_steps")
    check_sizes(spec, config, **{key: getattr(cfg, key) for key in sizes}, padded=False)
    if not 0 <= cfg.seed < 2**64 or not 0 <= cfg.guidance_scale < math.inf:
        raise ValueError(
            f"seed must be from 0 to 2**64 - 1 and guidance_scale finite and ≥ 0; got seed {cfg.seed!r}, "
            f"guidance_scale {cfg.guidance_scale!r}."
        )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ValueError(f"device: {cfg.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    _check_guidance(cfg, spec, config)
    if spec.call_rules is not None:
        spec.call_rules(cfg, config)
    if cfg.max_sequence_length is None:
        cfg.max_sequence_length = spec.text_len


def _check_guidance(cfg, spec: ModelSpec, config: dict) -> None:
    """``true_cfg_scale`` for the families whose pipeline takes it; ``guidance_scale_2`` for two experts."""
    if cfg.true_cfg_scale is not None:
        if spec.guidance_argument != "true_cfg_scale":
            raise ValueError(
                f"true_cfg_scale: {cfg.model} is a {spec.title} model, whose pipeline has no true_cfg_scale; its "
                f"classifier-free guidance is {spec.guidance_argument}: leave true_cfg_scale out."
            )
        if not cfg.true_cfg_scale >= 0:
            raise ValueError(f"true_cfg_scale: {cfg.true_cfg_scale!r} must be ≥ 0.")
    if cfg.guidance_scale_2 is None:
        return
    tiny = cfg.tiny_spec() is not None
    known = {cfg.model: config} if tiny else KNOWN_MODELS  # a tiny config holds its experts, as the released ones
    experts = known[cfg.model].get("experts", 1) if cfg.model in known else None  # None: told when it loads
    if len(spec.experts) < 2 or experts == 1:
        more = [f"{key}: {choices[-1]}" for key, (word, choices, _) in spec.tiny_options.items() if word == "experts"]
        hint = f" (set {more[0]})." if tiny and more else "."
        one = spec.title if len(spec.experts) < 2 else cfg.model
        raise ValueError(
            f"guidance_scale_2 is the guidance of Wan 2.2's second expert; {one} has one transformer{hint}"
        )
    if not cfg.guidance_scale_2 >= 0:
        raise ValueError(f"guidance_scale_2: {cfg.guidance_scale_2!r} must be ≥ 0.")
