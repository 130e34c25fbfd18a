"""Configuration of ``cogattn-dump``: one YAML file, ``--set key=value`` on top.

Every top-level key is a field of :class:`DumpConfig`; the capture options sit in a nested ``capture:``
mapping parsed into :class:`cogattn.CaptureOptions`, the object ``cogattn.record`` and
``cogattn.estimate`` take, so a run and its ``--dry-run`` are planned from the same values. An unknown
key, a wrong type or a value outside its choices is refused with a one-line message.

The shipped configs (the repository's top-level ``configs/`` folder) are package data of this package,
installed as ``cogattn.dump.configs``; :func:`default_config` finds ``tiny.yaml`` there.

The model's family comes from its transformer config (``cogattn.models``: a local folder, the hub cache
or the table of released shapes, never the weights), read once when the config is checked, or from the
name of a family's tiny pipeline (``ModelSpec.tiny_name``); the family's spec sets the call's rules
(``rules.py``: frame count, pixel multiples, tasks, its own ``call_rules``), defaults and how its
pipeline loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..models import ModelSpec, spec_for_config, tiny_spec, transformer_config
from ..options import CaptureOptions
from .rules import check_call, check_tiny_options

__all__ = ["CAPTURE_KEYS", "ConfigError", "DumpConfig", "default_config", "load_config"]

TASKS = ("text-to-video", "image-to-video")
DTYPES = ("float32", "bfloat16", "float16")
OFFLOAD = ("none", "model", "sequential")
VIDEO_FORMATS = ("auto", "mp4", "gif")
# Settings added after configs were hashed, left out of the hash at these defaults (old folders stay valid).
_LATER = {"tiny_experts": 1, "guidance_scale_2": None, "true_cfg_scale": None}
# Capture options the tool sets itself for each prompt, refused inside ``capture:``.
PER_PROMPT = {
    "save_dir": "(<save_dir>/<index>-<hash>/maps); set the top-level save_dir instead",
    "overwrite": "(it redoes incomplete prompts and refuses complete ones made with other settings); leave it out",
    "info": "(the prompt, negative prompt, seed, image and model); leave it out",
}
CAPTURE_KEYS = tuple(f.name for f in dataclasses.fields(CaptureOptions) if f.name not in PER_PROMPT)
# Keys of older configs, named in the message that refuses them.
_RENAMED = {
    **{k: f"capture.{k}" for k in CAPTURE_KEYS},
    "out": "save_dir",
    "guidance": "guidance_scale",
    "steps": "num_inference_steps (captured steps: capture.steps)",
    "capture_steps": "capture.steps",
    "path": "capture.method",
    "output": "capture.layer_output",
}
_RENAMED_CAPTURE = {"capture_steps": "steps", "path": "method", "output": "layer_output"}


class ConfigError(ValueError):
    """A bad configuration, prompts file or input path; the message is one line for the user."""


@dataclass
class DumpConfig:
    """Everything ``cogattn-dump`` does (see ``configs/*.yaml`` for examples). A relative ``prompts`` file
    starts at the config file's folder; a relative ``save_dir`` or ``model`` folder where the command runs.

    Args:
        model (`str`): hub id or local checkpoint folder of a pipeline of a family cogattn knows (CogVideoX,
            Wan 2.1 / 2.2, HunyuanVideo, ...; read from its transformer config), or a family's embedded
            tiny random pipeline: ``"tiny"`` (CogVideoX), ``"tiny-wan"``, ``"tiny-hunyuan-video"``, ...
        task (`str`): ``"text-to-video"`` or ``"image-to-video"`` (HunyuanVideo: text-to-video only).
        tiny_version (`str`): ``"1.0"`` or ``"1.5"``, layout of the tiny pipeline (``model: tiny`` only).
        tiny_experts (`int`): ``1``, or ``2`` for Wan 2.2 A14B's two experts (``model: tiny-wan`` only).
            The tiny options are the families' (``ModelSpec.tiny_options``): their choices, and the model
            each is for, come from there.
        dtype (`str`): ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        device (`str`): ``"auto"`` (this process's GPU under accelerate, else the first GPU, else CPU),
            ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        offload (`str`): ``"none"``, ``"model"`` (``enable_model_cpu_offload``) or ``"sequential"``
            (``enable_sequential_cpu_offload``).
        vae_tiling (`bool`): decode the video in tiles (``vae.enable_tiling()``).
        prompts (`str`): a ``.txt`` file (one prompt per line) or ``.jsonl`` (objects with ``prompt`` and
            optional ``negative_prompt``, ``seed``, ``image``; a relative image starts at the file's folder).
        num_frames, height, width (`int`), num_inference_steps (`int`), guidance_scale (`float`),
            max_sequence_length (`int`, the text tokens T): the pipeline call, named as its arguments.
            ``num_frames`` is 4k + 1; ``height`` and ``width`` are multiples of the VAE's compression × the
            patch size (16; Wan 2.2 TI2V-5B: 32). ``max_sequence_length`` left out is the family's (226
            CogVideoX, 512 Wan, 256 HunyuanVideo). HunyuanVideo's ``guidance_scale`` is its distilled
            guidance embedding (one transformer call per step); a pipeline whose guidance is its ``guider``
            (HunyuanVideo 1.5) gets it set on the guider in place; arguments its call lacks are left out.
        guidance_scale_2 (`float | None`): Wan 2.2 A14B's guidance of its low-noise expert (the pipeline's
            ``guidance_scale_2``; left out: ``guidance_scale``); two-expert Wan pipelines only.
        true_cfg_scale (`float | None`): true classifier-free guidance of the families whose pipeline takes it
            (``ModelSpec.guidance_argument``: HunyuanVideo); left out: the pipeline's default (1.0, off).
            Above 1 it guides every prompt, with its ``negative_prompt`` or else the empty prompt (passed as
            ``negative_prompt=""``: the pipeline guides only with a negative prompt), two calls per step.
        seed (`int`): the generator's seed; a prompt's own seed wins.
        capture (`CaptureOptions`): the ``capture:`` mapping: ``kinds``, ``layers``, ``steps`` (the
            denoising steps captured, 0-based), ``batch``, ``heads``, ``queries``, ``block_size``,
            ``tile_shape``, ``topk``, ``top_p``, ``patterns``, ``memory_budget``, ``method``, ``layer_output``,
            ``storage_dtype``, ``verify``, ``durable``, documented and checked by
            :class:`cogattn.CaptureOptions` (a key left out takes its default there). Its ``save_dir``,
            ``overwrite`` and ``info`` are refused: the tool sets them for each prompt.
        save_dir (`str`): output root; each prompt gets ``<save_dir>/<index>-<hash>/``.
        video_format (`str`): ``"auto"`` (mp4 where imageio-ffmpeg exists, else gif), ``"mp4"``, ``"gif"``.
        fps (`int`): frames per second of the saved video.
        previews (`bool`): write preview PNGs of each prompt's maps next to them.
        parallel (`dict | None`): ``{ring: R, ulysses: U}``: each generation split over R × U processes by
            diffusers' context parallelism (under ``torchrun`` or ``accelerate launch``; more processes: the prompts
            dealt out over the meshes); the mesh's first process writes (docs/many-gpus.md).
    """

    model: str = "tiny"
    task: str = "text-to-video"
    tiny_version: str = "1.0"
    tiny_experts: int = 1
    dtype: str = "bfloat16"
    device: str = "auto"
    offload: str = "none"
    vae_tiling: bool = False
    prompts: str = "prompts/tiny.txt"
    num_frames: int = 49
    height: int = 480
    width: int = 720
    num_inference_steps: int = 50
    guidance_scale: float = 6.0
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    seed: int = 0
    max_sequence_length: int | None = None  # the family's (ModelSpec.text_len) once checked
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    save_dir: str = "runs/dump"
    video_format: str = "auto"
    fps: int = 8
    previews: bool = True
    parallel: dict | None = None
    config_dir: str = field(default=".", metadata={"internal": True})  # where relative paths start
    transformer: dict | None = field(default=None, repr=False, compare=False, metadata={"internal": True})

    def __post_init__(self):
        if not isinstance(self.capture, CaptureOptions):  # the mapping of a config file
            self.capture = _capture(self.capture)
        if isinstance(self.save_dir, str):  # "~/runs": one folder for the maps, the videos and prompt.json alike
            self.save_dir = str(Path(self.save_dir).expanduser())

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative)
        return p if p.is_absolute() else Path(self.config_dir) / p

    def tiny_spec(self) -> ModelSpec | None:
        """The family whose tiny pipeline ``model`` names (``ModelSpec.tiny_name``), `None` for a checkpoint."""
        return tiny_spec(self.model)

    def tiny_arguments(self) -> dict:
        """The tiny pipeline's options this config sets, as its ``tiny_pipeline`` keywords."""
        spec = self.tiny_spec()
        return {word: getattr(self, key) for key, (word, _, _) in (spec.tiny_options if spec else {}).items()}

    def model_config(self) -> dict:
        """The transformer config of ``model`` (read once; no weights): the tiny pipeline's for ``task`` and
        its options (with its number of ``experts``), else ``cogattn.models.transformer_config``. Raises
        `ConfigError`."""
        if self.transformer is None:
            tiny = self.tiny_spec()
            try:
                if tiny is not None:
                    pipe = tiny.tiny_pipeline(self.task, **self.tiny_arguments())
                    experts = sum(getattr(pipe, name, None) is not None for name in tiny.experts)
                    self.transformer = {**transformer_config(pipe.transformer), "experts": experts}
                else:
                    self.transformer = transformer_config(self.model)
                spec_for_config(self.transformer)
            except (ValueError, ImportError) as err:  # ImportError: what a tiny pipeline's parts need
                self.transformer = None
                raise ConfigError(f"model: {' '.join(str(err).split())}") from None
        return self.transformer

    def spec(self) -> ModelSpec:
        """The family of ``model``: a tiny pipeline's by its name, else from its transformer config."""
        return self.tiny_spec() or spec_for_config(self.model_config())

    @property
    def family(self) -> str:
        """``"cogvideox"``, ``"wan"``, ``"hunyuan_video"``, ...: the family of ``model``."""
        return self.spec().family

    def call_arguments(self) -> dict:
        """The pipeline call's arguments this config sets, named as the pipeline names them."""
        keys = ("num_frames", "height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")
        call = {key: getattr(self, key) for key in keys}
        if call["max_sequence_length"] is None:
            call["max_sequence_length"] = self.spec().text_len
        for key in ("guidance_scale_2", "true_cfg_scale"):  # left out: the pipeline's default
            if getattr(self, key) is not None:
                call[key] = getattr(self, key)
        return call

    def capture_options(self, **per_prompt) -> CaptureOptions:
        """The capture options of one prompt: ``capture`` with ``save_dir``, ``info``, ... on top."""
        return CaptureOptions.build(self.capture, **per_prompt)

    def to_dict(self) -> dict:
        """The settings as a JSON-able mapping in the config file's shape (``capture`` nested)."""
        data = {f: getattr(self, f) for f in _fields() if f != "capture"}
        return {**data, "capture": {k: _jsonable(getattr(self.capture, k)) for k in CAPTURE_KEYS}}

    def output_key(self, legacy: bool = False) -> str:
        """A hash of every setting that changes what a prompt's folder holds; not ``device``, ``offload``,
        ``vae_tiling``, ``parallel``, ``capture.memory_budget``, ``capture.method``, ``capture.verify``, ``capture.durable``, ``save_dir``
        or ``prompts``, which change only how or where it is computed. One key however a setting is written: a
        guidance scale of 6 or 6.0, the captured ``kinds``, ``steps`` and ``layers`` in any order (``legacy``: the
        key of the raw values, which folders written before said)."""
        settings = self.to_dict()
        for key in ("device", "offload", "vae_tiling", "save_dir", "prompts", "parallel"):
            del settings[key]
        for key, default in _LATER.items():
            if settings[key] == default:
                del settings[key]
        for key in ("memory_budget", "method", "verify", "durable"):
            del settings["capture"][key]
        if not legacy:
            settings.update({k: float(v) for k, v in settings.items() if k in _FLOATS and type(v) is int})
            cap = settings["capture"]
            cap.update({k: sorted(cap[k], key=str) for k in ("kinds", "steps", "layers") if isinstance(cap[k], list)})
        return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


_CHOICES = {
    "task": TASKS,
    "dtype": DTYPES,
    "offload": OFFLOAD,
    "video_format": VIDEO_FORMATS,
}
_TYPES = {
    "vae_tiling": bool,
    "previews": bool,
    "num_frames": int,
    "height": int,
    "width": int,
    "num_inference_steps": int,
    "seed": int,
    "max_sequence_length": int,
    "fps": int,
    "guidance_scale": (int, float),
    "guidance_scale_2": (int, float),
    "true_cfg_scale": (int, float),
    "model": str,
    "prompts": str,
    "save_dir": str,
    "device": str,
}
_FLOATS = ("guidance_scale", "guidance_scale_2", "true_cfg_scale")  # a whole number written is the same scale
_OPTIONAL = ("guidance_scale_2", "true_cfg_scale", "max_sequence_length")  # None: the pipeline's or family's default


def _number(text: str) -> bool:
    """Whether ``text`` is a number that YAML 1.1 reads as a string (``1e3``: no dot, no exponent sign)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(DumpConfig) if not f.metadata.get("internal")]


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _unknown(kind: str, unknown: list[str], renamed: dict, valid) -> ConfigError:
    hints = [f"{k} → {renamed[k]}" for k in unknown if k in renamed]
    hint = f" (renamed: {', '.join(hints)})" if hints else ""
    return ConfigError(f"unknown {kind}{'s' if len(unknown) > 1 else ''} {unknown}{hint}; valid keys: {list(valid)}.")


def _capture(value) -> CaptureOptions:
    """The ``capture:`` mapping as :class:`CaptureOptions`; every refusal is a one-line `ConfigError`."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"capture: expected a mapping of capture options ({', '.join(CAPTURE_KEYS)}), got {value!r}.")
    for key, why in PER_PROMPT.items():
        if key in value:
            raise ConfigError(f"capture.{key} is set by the tool for each prompt {why}.")
    unknown = sorted(set(value) - set(CAPTURE_KEYS))
    if unknown:
        raise _unknown("capture key", unknown, _RENAMED_CAPTURE, CAPTURE_KEYS)
    try:
        return CaptureOptions(**value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"capture: {err}") from None


def _check(data: dict, config_dir: str) -> DumpConfig:
    unknown = sorted(set(data) - set(_fields()))
    if unknown:
        raise _unknown("config key", unknown, _RENAMED, _fields())
    cfg = DumpConfig(**data, config_dir=config_dir)
    for key, types in _TYPES.items():
        value = getattr(cfg, key)
        if value is None and key in _OPTIONAL:
            continue
        if isinstance(value, bool) and types is not bool or not isinstance(value, types):
            hint = " (YAML reads 1e3 as text: write 1.0e+3)" if isinstance(value, str) and _number(value) else ""
            raise ConfigError(f"{key}: expected {getattr(types, '__name__', 'a number')}, got {value!r}{hint}.")
    for key, choices in _CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"{key}: {getattr(cfg, key)!r} is not one of {list(choices)}.")
    try:
        check_tiny_options(cfg)
        check_call(cfg)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def _override(data: dict, item: str) -> None:
    """Apply one ``key=value`` (or ``capture.key=value``) to the parsed YAML."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ConfigError(f"--set {item!r}: expected key=value.")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML.") from None
    head, dot, sub = key.strip().partition(".")
    if not dot:  # a prompts file named on the command line is where the command runs, as save_dir is
        data[head] = (
            str(Path(parsed).expanduser().absolute()) if head == "prompts" and isinstance(parsed, str) else parsed
        )
        return
    if head != "capture" or not sub or "." in sub:
        raise ConfigError(f"--set {item!r}: only capture options have dotted keys (capture.KEY=VALUE).")
    if data.get("capture") is None:  # absent, or `capture:` with nothing under it
        data["capture"] = {}
    section = data["capture"]
    if not isinstance(section, dict):
        raise ConfigError(f"--set {item!r}: capture is {section!r}, not a mapping.")
    section[sub] = parsed


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DumpConfig:
    """Read a YAML config and apply ``key=value`` overrides.

    Args:
        path (`str | Path | None`): the config file; `None` starts from :class:`DumpConfig`'s defaults.
        overrides (`list[str]`): ``key=value`` items, values parsed as YAML (``num_inference_steps=4``,
            ``capture.layers=[0,5]``, ``capture.queries=[[1,2,3]]``); ``capture=...`` replaces the mapping.

    Returns:
        `DumpConfig`: the checked configuration; raises `ConfigError` with a one-line message otherwise.
    """
    data: dict = {}
    config_dir = "."
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of keys to values.")
        config_dir = str(path.parent)
    if isinstance(data.get("capture"), dict):
        data["capture"] = dict(data["capture"])
    for item in overrides:
        _override(data, item)
    return _check(data, config_dir)


def default_config() -> Path:
    """``tiny.yaml`` of the shipped configs: package data ``cogattn.dump.configs`` when cogattn is
    installed (a wheel, or an editable install that maps it to the repository's ``configs/``), else the
    ``configs/`` folder of the checkout this module is in."""
    try:
        folder = Path(str(importlib.resources.files("cogattn.dump.configs")))
    except ModuleNotFoundError:  # run from a checkout that is not installed (scripts/dump_maps.py)
        folder = Path(__file__).resolve().parents[2] / "configs"
    path = folder / "tiny.yaml"
    if not path.is_file():
        raise ConfigError(f"the default config {str(path)!r} is missing; pass a config file.")
    return path
