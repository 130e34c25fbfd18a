"""The prompts file of a ``cogattn-dump`` config: ``.txt`` (one prompt per line) or ``.jsonl`` (objects with
``prompt`` and optional ``negative_prompt``, ``seed``, ``image``), UTF-8. A line ends at ``\\n`` (or ``\\r\\n``)
alone, as JSON Lines says: a prompt may hold any other character, U+2028 and U+2029 included."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .config import ConfigError, DumpConfig

__all__ = ["Prompt", "read_prompts"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of the prompts file.

    Args:
        index (`int`): its position among the prompts, from 0.
        prompt (`str`), negative_prompt (`str | None`): the texts of the pipeline call.
        seed (`int | None`): its own seed (the config's ``seed`` otherwise).
        image (`str | None`): the conditioning image as written in the file (image-to-video).
        base (`str`): the prompts file's folder, where a relative image starts.
    """

    index: int
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    image: str | None = None
    base: str = field(default=".", compare=False)

    @property
    def image_path(self) -> str | None:
        return None if self.image is None else str(Path(self.base, self.image))

    def key(self) -> str:
        """Folder name: the prompt's index and a short hash of what it asks for (stable across reruns,
        whatever folder the command runs from)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "base"}
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.index:04d}-{digest}"


def _read_jsonl(path: Path, lines: list[str]) -> list[Prompt]:
    allowed = {"prompt", "negative_prompt", "seed", "image"}
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{path}:{n}: not valid JSON at column {err.colno}: {err.msg}; write each prompt as one JSON "
                'object on its own line, such as {"prompt": "a red fox"}.'
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ConfigError(f"{path}:{n}: expected an object with a string 'prompt'.")
        extra = sorted(set(obj) - allowed)
        if extra:
            raise ConfigError(f"{path}:{n}: unknown keys {extra}; allowed: {sorted(allowed)}.")
        for key in ("negative_prompt", "image"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise ConfigError(f"{path}:{n}: {key} is {obj[key]!r}; give a string.")
        for key in ("prompt", "negative_prompt", "image"):  # a JSON escape of half a surrogate pair is no text
            if isinstance(obj.get(key), str) and not obj[key].isascii():
                try:
                    obj[key].encode("utf-8")
                except UnicodeEncodeError as err:
                    raise ConfigError(
                        f"{path}:{n}: {key} holds {err.object[err.start]!r}, half of a pair, no character."
                    ) from None
        seed = obj.get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
            raise ConfigError(f"{path}:{n}: seed is {seed!r}; give a whole number from 0 to 2**64 - 1.")
        prompt = Prompt(
            len(prompts),
            obj["prompt"],
            obj.get("negative_prompt"),
            obj.get("seed"),
            obj.get("image"),
            base=str(path.parent),
        )
        if prompt.image is not None and not Path(prompt.image_path).is_file():
            raise ConfigError(f"{path}:{n}: image {prompt.image_path!r} does not exist.")
        prompts.append(prompt)
    return prompts


def _lines(path: Path) -> list[str]:
    """The file's lines, split at ``\\n`` alone (``str.splitlines`` also splits at U+2028, U+0085, form feed, ...,
    which a JSON string may hold raw), each without the ``\\r`` of a ``\\r\\n``; a leading byte-order mark is dropped."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # bytes: reading as text would turn a lone \r into a line end
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"prompts file {str(path)!r} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.end]!r}); "
            "save it as UTF-8."
        ) from None
    return [line.removesuffix("\r") for line in text.split("\n")]


def read_prompts(cfg: DumpConfig) -> list[Prompt]:
    """Parse the prompts file of ``cfg`` (relative to the config file's folder).

    Checks that images exist and that image-to-video has one per prompt; raises `ConfigError`.
    """
    path = cfg.resolve(cfg.prompts)
    if not path.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist.")
    lines = _lines(path)
    if path.suffix == ".jsonl":
        prompts = _read_jsonl(path, lines)
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
    elif any(p.image is not None for p in prompts):  # an image the task never reads, which prompt.json would name
        given = [p.index for p in prompts if p.image is not None]
        raise ConfigError(f"prompts {given} give an 'image', but task is {cfg.task!r}; set task: image-to-video.")
    return prompts
