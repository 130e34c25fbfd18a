"""Configuration of batch extraction (``scripts/dump_maps.py``): one YAML file, ``--set key=value`` on top.

Every key is a field of :class:`DumpConfig`; an unknown key, a wrong type or a value outside its
choices is refused with a one-line message that lists what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .engine import OUTPUTS, PATHS

__all__ = ["DumpConfig", "Prompt", "ConfigError", "load_config", "read_prompts"]

TASKS = ("text-to-video", "image-to-video")
DTYPES = ("float32", "bfloat16", "float16")
OFFLOAD = ("none", "model", "sequential")
VIDEO_FORMATS = ("auto", "mp4", "gif")


class ConfigError(ValueError):
    """A bad configuration, prompts file or input path; the message is one line for the user."""


@dataclass
class DumpConfig:
    """Everything ``dump_maps.py`` does, as one flat record (see ``configs/*.yaml`` for examples).

    Args:
        model (`str`): hub id, local checkpoint folder, or ``"tiny"`` (the embedded random pipeline).
        task (`str`): ``"text-to-video"`` or ``"image-to-video"``.
        tiny_version (`str`): ``"1.0"`` or ``"1.5"``, layout of the tiny pipeline (``model: tiny`` only).
        dtype (`str`): ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        device (`str`): ``"auto"`` (this process's GPU under accelerate, else the first GPU, else CPU),
            ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        offload (`str`): ``"none"``, ``"model"`` (``enable_model_cpu_offload``) or ``"sequential"``
            (``enable_sequential_cpu_offload``).
        vae_tiling (`bool`): decode the video in tiles (``vae.enable_tiling()``).
        prompts (`str`): a ``.txt`` file (one prompt per line) or ``.jsonl`` (objects with ``prompt`` and
            optional ``negative_prompt``, ``seed``, ``image``), relative to the config file.
        num_frames, height, width, steps (`int`), guidance (`float`), seed (`int`): the pipeline call;
            a prompt's own seed wins. ``max_sequence_length`` (`int`): text tokens T.
        kinds, layers, capture_steps, batch, heads, queries, memory_budget, path, output, storage_dtype: the
            capture selection (see ``cogattn.record``; ``capture_steps`` is its ``steps``).
        out (`str`): output root; each prompt gets ``<out>/<index>-<hash>/``.
        video_format (`str`): ``"auto"`` (mp4 where imageio-ffmpeg exists, else gif), ``"mp4"``, ``"gif"``.
        fps (`int`): frames per second of the saved video.
        previews (`bool`): write preview PNGs of the last step's maps next to the records.
    """

    model: str = "tiny"
    task: str = "text-to-video"
    tiny_version: str = "1.0"
    dtype: str = "bfloat16"
    device: str = "auto"
    offload: str = "none"
    vae_tiling: bool = False
    prompts: str = "prompts/tiny.txt"
    num_frames: int = 49
    height: int = 480
    width: int = 720
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    max_sequence_length: int = 226
    kinds: list = field(default_factory=lambda: ["frame", "video_to_text"])
    layers: object = "all"
    capture_steps: object = "all"
    batch: object = "cond"
    heads: object = "mean"
    queries: object = None
    memory_budget: object = "1GiB"
    path: str = "auto"
    output: str = "stock"
    storage_dtype: str = "float16"
    out: str = "runs/dump"
    video_format: str = "auto"
    fps: int = 8
    previews: bool = True
    config_dir: str = field(default=".", metadata={"internal": True})  # where relative paths start

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative)
        return p if p.is_absolute() else Path(self.config_dir) / p

    def capture_options(self) -> dict:
        """Keyword arguments for ``cogattn.record`` / ``cogattn.estimate``."""
        queries = None if self.queries is None else [tuple(q) if isinstance(q, list) else q for q in self.queries]
        return dict(kinds=self.kinds, layers=self.layers, steps=self.capture_steps, batch=self.batch,
                    heads=self.heads, queries=queries, memory_budget=self.memory_budget, path=self.path,
                    output=self.output, storage_dtype=self.storage_dtype)  # fmt: skip

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "config_dir"}

    def output_key(self) -> str:
        """A hash of every setting that changes what a prompt's folder holds (not device, offload,
        memory budget or path, which change only how it is computed)."""
        import hashlib

        same = {"device", "offload", "vae_tiling", "memory_budget", "path", "out", "prompts"}
        settings = {k: v for k, v in self.to_dict().items() if k not in same}
        return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


_CHOICES = {"task": TASKS, "dtype": DTYPES, "offload": OFFLOAD, "video_format": VIDEO_FORMATS,
            "tiny_version": ("1.0", "1.5"), "path": PATHS, "output": OUTPUTS,
            "storage_dtype": ("float32", "float16", "bfloat16")}  # fmt: skip
_TYPES = {"vae_tiling": bool, "previews": bool, "num_frames": int, "height": int, "width": int, "steps": int,
          "seed": int, "max_sequence_length": int, "fps": int, "guidance": (int, float), "kinds": (list, str),
          "model": str, "prompts": str, "out": str, "device": str}  # fmt: skip


def _check(cfg: DumpConfig) -> DumpConfig:
    for key, types in _TYPES.items():
        value = getattr(cfg, key)
        if isinstance(value, bool) and types is not bool or not isinstance(value, types):
            raise ConfigError(f"{key}: expected {getattr(types, '__name__', 'a number or list')}, got {value!r}.")
    for key, choices in _CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"{key}: {getattr(cfg, key)!r} is not one of {list(choices)}.")
    if isinstance(cfg.kinds, str):
        cfg.kinds = [k.strip() for k in cfg.kinds.split(",")]
    return cfg


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(DumpConfig) if not f.metadata.get("internal")]


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DumpConfig:
    """Read a YAML config and apply ``key=value`` overrides (values parsed as YAML: ``steps=4``,
    ``layers=[0,5]``, ``queries=[[1,2,3]]``)."""
    data: dict = {}
    config_dir = "."
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of keys to values.")
        config_dir = str(path.parent)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value.")
        try:
            data[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML.") from None
    unknown = sorted(set(data) - set(_fields()))
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} {unknown}; valid keys: {_fields()}.")
    return _check(DumpConfig(**data, config_dir=config_dir))


@dataclass(frozen=True)
class Prompt:
    """One line of the prompts file."""

    index: int
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    image: str | None = None  # as written in the prompts file
    base: str = field(default=".", compare=False)  # the prompts file's folder: relative images start here

    @property
    def image_path(self) -> str | None:
        return None if self.image is None else str(Path(self.base, self.image))

    def key(self) -> str:
        """Folder name: the prompt's index and a short hash of what it asks for (stable across reruns,
        whatever folder the command runs from)."""
        import hashlib

        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "base"}
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.index:04d}-{digest}"


def read_prompts(cfg: DumpConfig) -> list[Prompt]:
    """Parse the prompts file; checks image paths exist (image-to-video needs one per prompt)."""
    path = cfg.resolve(cfg.prompts)
    if not path.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist.")
    prompts = []
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        allowed = {"prompt", "negative_prompt", "seed", "image"}
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{n}: not valid JSON ({err.msg}).") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f"{path}:{n}: expected an object with a string 'prompt'.")
            extra = sorted(set(obj) - allowed)
            if extra:
                raise ConfigError(f"{path}:{n}: unknown keys {extra}; allowed: {sorted(allowed)}.")
            prompt = Prompt(len(prompts), obj["prompt"], obj.get("negative_prompt"), obj.get("seed"), obj.get("image"),
                            base=str(path.parent))  # fmt: skip
            if prompt.image is not None and not Path(prompt.image_path).is_file():
                raise ConfigError(f"{path}:{n}: image {prompt.image_path!r} does not exist.")
            prompts.append(prompt)
    elif path.suffix == ".txt":
        prompts = [Prompt(i, p) for i, p in enumerate(line.strip() for line in lines if line.strip())]
    else:
        raise ConfigError(f"prompts file {str(path)!r} must end in .txt (one prompt per line) or .jsonl.")
    if not prompts:
        raise ConfigError(f"prompts file {str(path)!r} holds no prompts.")
    if cfg.task == "image-to-video":
        missing = [p.index for p in prompts if p.image is None]
        if missing:
            raise ConfigError(f"task image-to-video needs an 'image' for every prompt; prompts {missing} have none.")
    return prompts
