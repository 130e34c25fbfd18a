"""What to capture: kinds, layers, steps, batch items, heads, query tokens and the memory budget.

Everything that can be checked from the arguments and the model config is checked when the selection
is built; what depends on the call (batch size, guidance, latent grid, number of steps) is checked by
:meth:`Selection.resolve` at the first transformer call of a generation, before any block runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .engine import PATHS
from .layout import TokenLayout
from .reducers import REDUCERS

__all__ = ["Selection", "Resolved", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
BATCH_WORDS = ("auto", "all", "cond", "uncond")


def parse_bytes(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as ``"1GiB"``, ``"512 MB"``, ``"2e9"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"memory_budget must be an int (bytes) or a string like '1GiB', got {value!r}.")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"memory_budget={value!r} is not a byte size; use bytes or a number with a unit "
                f"({', '.join(u for u in _UNITS if u)}), e.g. '1GiB'."
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory_budget must be positive, got {value!r}.")
    return n


def _indices(name: str, value, upper: int | None, words: Sequence[str]) -> str | tuple[int, ...]:
    """Validate a selector that is one of ``words`` or a list of indices in ``[0, upper)``."""
    if isinstance(value, str):
        if value not in words:
            raise ValueError(f"{name}={value!r} is not allowed; use one of {list(words)} or a list of indices.")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple, range)) or not value:
        raise TypeError(f"{name} must be one of {list(words)} or a non-empty list of indices, got {value!r}.")
    out = []
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"{name} must hold integer indices, got {i!r} in {value!r}.")
        if i < 0 or (upper is not None and i >= upper):
            bound = f"0..{upper - 1}" if upper is not None else "≥ 0"
            raise ValueError(f"{name} index {i} is out of range; valid indices are {bound}.")
        out.append(i)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class Resolved:
    """The selection made concrete for one generation: batch rows, heads, query tokens, reducers' layout."""

    layout: TokenLayout
    batch: tuple[int, ...]
    heads: tuple[int, ...]
    mean_heads: bool
    queries: torch.Tensor | None


@dataclass(frozen=True)
class Selection:
    """A validated capture selection (see :func:`cogattn.record` for the meaning of each field)."""

    kinds: tuple[str, ...]
    layers: str | tuple[int, ...]
    steps: str | tuple[int, ...]
    batch: str | tuple[int, ...]
    heads: str | tuple[int, ...]
    queries: tuple | None
    memory_budget: int
    path: str

    @classmethod
    def build(cls, *, kinds, layers, steps, batch, heads, queries, memory_budget, path, num_layers, num_heads):
        if isinstance(kinds, str):
            kinds = (kinds,)
        kinds = tuple(kinds)
        if not kinds:
            raise ValueError(f"kinds is empty; choose from {list(REDUCERS)}.")
        for kind in kinds:
            if kind not in REDUCERS:
                raise ValueError(f"unknown kind {kind!r}; the kinds are {list(REDUCERS)}.")
        if path not in PATHS:
            raise ValueError(f"path={path!r} is not one of {list(PATHS)}.")
        if "query" in kinds and (queries is None or (not isinstance(queries, int) and len(queries) == 0)):
            raise ValueError("kind 'query' needs queries=[...]: token indices or (frame, row, col) coordinates.")
        if queries is not None and "query" not in kinds:
            raise ValueError("queries were given but 'query' is not in kinds; add it or drop queries.")
        return cls(
            kinds=tuple(dict.fromkeys(kinds)),
            layers=_indices("layers", layers, num_layers, ("all",)),
            steps=_indices("steps", steps, None, ("all",)),
            batch=_indices("batch", batch, None, BATCH_WORDS),
            heads=_indices("heads", heads, num_heads, ("all", "mean")),
            queries=_check_queries(queries),
            memory_budget=parse_bytes(memory_budget),
            path=path,
        )

    def wants_layer(self, layer: int) -> bool:
        return self.layers == "all" or layer in self.layers

    def wants_step(self, step: int) -> bool:
        return self.steps == "all" or step in self.steps

    def resolve(
        self, layout: TokenLayout, batch_size: int, guidance: bool | None, num_steps: int | None, num_heads: int
    ) -> Resolved:
        """Make the selection concrete for a call; raises `ValueError` naming what does not fit."""
        if num_steps is not None and self.steps != "all" and max(self.steps) >= num_steps:
            raise ValueError(
                f"steps={list(self.steps)} asks for step {max(self.steps)}, but this generation has "
                f"{num_steps} denoising steps (0..{num_steps - 1})."
            )
        return Resolved(
            layout=layout,
            batch=self._resolve_batch(batch_size, guidance),
            heads=tuple(range(num_heads)) if isinstance(self.heads, str) else self.heads,
            mean_heads=self.heads == "mean",
            queries=self._resolve_queries(layout),
        )

    def _resolve_batch(self, batch_size: int, guidance: bool | None) -> tuple[int, ...]:
        if self.batch == "all" or (self.batch == "auto" and not guidance):
            return tuple(range(batch_size))
        if isinstance(self.batch, tuple):
            if max(self.batch) >= batch_size:
                raise ValueError(
                    f"batch index {max(self.batch)} is out of range: the transformer batch has {batch_size} "
                    f"items (0..{batch_size - 1}; under guidance the first half is unconditional)."
                )
            return self.batch
        if guidance is None:
            raise ValueError(
                f"batch={self.batch!r} needs to know whether classifier-free guidance is on, which only a "
                "pipeline tells; with a bare transformer pass batch indices instead (under guidance the "
                "batch is [uncond..., cond...])."
            )
        if not guidance:
            raise ValueError(
                f"batch={self.batch!r} but this generation runs without classifier-free guidance "
                "(guidance_scale <= 1), so there is no separate cond/uncond half; use batch='all'."
            )
        if batch_size < 2 or batch_size % 2:
            raise ValueError(
                f"batch={self.batch!r} needs the guidance batch [uncond..., cond...], but the transformer got "
                f"a batch of {batch_size}; pass batch indices instead."
            )
        half = batch_size // 2
        return tuple(range(half)) if self.batch == "uncond" else tuple(range(half, batch_size))

    def _resolve_queries(self, layout: TokenLayout) -> torch.Tensor | None:
        if self.queries is None:
            return None
        index = []
        for q in self.queries:
            if isinstance(q, int):
                if not 0 <= q < layout.seq_len:
                    raise ValueError(
                        f"query token {q} is outside the sequence: S = {layout.seq_len} "
                        f"({layout.text_len} text + {layout.video_len} video tokens)."
                    )
                index.append(q)
            else:
                index.append(layout.token_index(*q))
        return torch.tensor(index, dtype=torch.long)


def _check_queries(queries) -> tuple | None:
    if queries is None:
        return None
    if isinstance(queries, int) and not isinstance(queries, bool):
        queries = [queries]
    if not isinstance(queries, (list, tuple, range)):
        raise TypeError(f"queries must be a list of token indices or (frame, row, col) tuples, got {queries!r}.")
    out = []
    for q in queries:
        if isinstance(q, int) and not isinstance(q, bool) and q >= 0:
            out.append(q)
        elif (
            isinstance(q, (tuple, list))
            and len(q) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in q)
        ):
            out.append(tuple(q))
        else:
            raise TypeError(
                f"query {q!r} is neither a token index (int >= 0) nor a video coordinate (frame, row, col) "
                "of non-negative ints."
            )
    return tuple(out)
