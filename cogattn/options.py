"""Every capture option, once: :class:`CaptureOptions` lists them with their docs and checks them.

``cogattn.record``, ``cogattn.Recording``, ``cogattn.estimate`` and the ``capture:`` section of a
``dump_maps.py`` config all take these options, so a run and its estimate are planned from the same
values. Checks happen in three places, each as early as its facts are known:

* what the options alone decide, when a :class:`CaptureOptions` is built;
* what the model decides (layer and head ranges), in :meth:`CaptureOptions.check_model`;
* what the call decides (batch size, guidance, latent grid, number of steps), in
  :meth:`CaptureOptions.resolve`, at the first transformer call of a generation, before any block runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .exact.memory import parse_bytes
from .exact.patterns import check_option, resolve
from .exact.reducers import REDUCERS
from .exact.reducers.ranked import check_top_p
from .items import item_role
from .layout import TokenLayout

__all__ = ["CaptureOptions", "Resolved", "METHODS", "LAYER_OUTPUTS", "STORAGE_DTYPES"]

METHODS = ("auto", "rows", "sdpa", "triton")
LAYER_OUTPUTS = ("stock", "lse", "joint")
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BATCH_WORDS = ("auto", "all", "cond", "uncond")


@dataclass(frozen=True)
class CaptureOptions:
    """What to capture, how, and where to keep it.

    Pass the fields as keyword arguments to :func:`cogattn.record` (or build one object and pass it
    first: ``cogattn.record(pipe, options)``); the values are checked and normalised on construction.

    Args:
        kinds (`str | Sequence[str]`, defaults to ``("frame",)``): any of ``"full"``, ``"frame"``,
            ``"video_to_text"``, ``"text_to_video"``, ``"query"``, and the statistics ``"entropy"``,
            ``"received"``, ``"query_frame"``, ``"block"``, ``"topk"``, and Wan 2.1 image-to-video's
            ``"video_to_image"`` (shapes in ``docs/kinds.md`` and ``docs/design.md``). In Wan the self-attention
            kinds come from the video-only self-attention and ``video_to_text`` from the cross-attention;
            ``text_to_video`` does not exist there.
        layers (`"all" | int | str | Sequence[int | str]`, defaults to ``"all"``): 0-based layer indices, in
            execution order across the model's block lists, or layer names (``rec.layer_names``:
            ``"transformer_blocks.3.attn1"``, HunyuanVideo's ``"single_transformer_blocks.12.attn"``).
        steps (`"all" | int | Sequence[int]`, defaults to ``"all"``): 0-based denoising-step indices
            (they count the transformer calls of the generation).
        batch (`"auto" | "all" | "cond" | "uncond" | int | Sequence[int]`, defaults to ``"auto"``):
            transformer batch items. Under classifier-free guidance the batch is ``[uncond..., cond...]``
            (Wan makes one call per half; its items are numbered the same way);
            ``"auto"`` is ``"cond"`` when a pipeline runs with guidance and ``"all"`` otherwise; ``"cond"``
            and ``"uncond"`` need a pipeline.
        heads (`"all" | "mean" | int | Sequence[int]`, defaults to ``"mean"``): ``"mean"`` averages all
            heads into one head slot.
        queries (`int | Sequence[int | tuple[int, int, int]] | None`): for ``"query"``: token indices (ints)
            or video points ``(frame, row, col)`` on the latent patch grid (tuples), in a list; kept as a list.
            A bare tuple of three ints is refused as ambiguous: write ``[2, 1, 4]`` for tokens 2, 1 and 4,
            ``[(2, 1, 4)]`` for the point.
        block_size (`int`, defaults to 128): tokens per block of the ``block`` kind (runs of tokens in the
            model's order from token 0; the last may be shorter).
        tile_shape (`tuple[int, int, int]`, defaults to ``(4, 4, 4)``): latent frames × patch rows × patch
            columns of each 3-D tile of the ``tile`` kind (the grid's edge tiles are smaller).
        patterns (`str | Sequence`, defaults to ``()``): for ``pattern_recall`` and ``pattern_error``, which refuse
            to run without them: token patterns (:mod:`cogattn.exact.patterns`), ``"spatial"``, ``"temporal"``,
            ``"window:w"``, ``"sta:t,h,w"``, ``"radial"``, `Pattern` objects or callables, each name once.
        topk (`int`, defaults to 32): how many of each row's largest probabilities ``topk`` keeps (at
            most S).
        top_p (`float | Sequence[float]`, defaults to ``(0.5, 0.9, 0.95, 0.99)``): the masses p, each in
            (0, 1], for which ``top_p`` counts the fewest keys whose largest probabilities reach p; kept as a
            tuple of floats in the order given.
        memory_budget (`int | str`, defaults to ``"1GiB"``): bound on the transient working memory of
            capture (results excluded): bytes, or a string such as ``"512MiB"``; stored as bytes.
        method (`"auto" | "rows" | "sdpa" | "triton"`, defaults to ``"auto"``): how the key-pooled kinds
            (``frame``, ``video_to_text``, ``query_frame``, ``block``) and the statistics ``entropy`` and
            ``received`` are computed. All are exact. ``"rows"`` forms row tiles of P; ``"sdpa"`` runs
            fused attention calls on other value matrices (indicator columns; the keys for
            ``entropy``; a swapped pass for ``received``); ``"triton"`` runs cogattn's Triton kernels for all
            of them, q and k in the model's dtype (CUDA, or Triton's interpreter; a head dim that is a power of
            two ≥ 16). ``"auto"`` takes ``"rows"`` when each head's rows are formed anyway (``full``, ``topk``
            per head); else on CUDA with Triton ``"triton"`` (where its kernels fail to build or run: one
            warning, ``"sdpa"`` for that shape); else ``"sdpa"``, or ``"rows"`` where one row pass costs less
            than the fused passes the kinds need (on a CPU two or more: ``received``, ``block`` at
            S/block_size > head dim, several statistics together).
        layer_output (`"stock" | "lse" | "joint"`, defaults to ``"stock"``): how captured layers compute
            their own attention output (layers not captured always run the stock call).

            * ``"stock"``: diffusers' own ``F.scaled_dot_product_attention`` call; the video is
              bit-identical to a run without cogattn.
            * ``"lse"`` (opt-in): the flash kernel that SDPA dispatches to (CPU; CUDA for fp16/bf16),
              called directly so that it also returns each row's log-sum-exp, which ``video_to_text``
              then reuses instead of an attention pass of its own.
            * ``"joint"`` (opt-in, the fastest): one fused call on values widened with the key-group
              indicator columns returns the output, the lse and the ``frame`` sums together; capture
              then runs no attention pass. The sums carry the model dtype's rounding (within 2⁻⁸ per
              query row in bf16) and need ``method="auto"``.

            On the CPU both opt-in modes gave bit-identical videos in the tests (fp32 and bf16); on CUDA
            they run another kernel than SDPA may choose, so the output can differ in the last bits. A
            training forward (the transformer in training mode, or inputs that require grad) keeps the stock
            call, whose backward gives the stock gradients.
        save_dir (`str | os.PathLike | None`, defaults to `None`): a folder to stream every record to as
            soon as it exists (read it with ``cogattn.load``); `None` keeps results in memory.
        overwrite (`bool`, defaults to `False`): replace a cogattn run already in ``save_dir``; a
            non-empty folder is refused otherwise, and a folder that holds no run is never deleted.
        storage_dtype (`"float32" | "float16" | "bfloat16"`, defaults to ``"float32"``): the dtype on
            disk of the records of probabilities and masses; the 16-bit ones halve their size. Counts (``top_p``:
            int32) and key indices (``topk``, ``frame_max``: float32) stay exact, and float16 keeps ``received`` and
            ``pattern_error`` in float32 (past its 65,504); docs/streaming.md gives each kind's worst error.
        durable (`bool`, defaults to `False`): with ``save_dir``, put every record and manifest line on the disk
            (fsync) before the next: a run then survives a power loss or a machine's crash, not only its process's.
        info (`dict | None`): JSON-able facts to keep with the run (prompt, seed, ...).
        verify (`bool`, defaults to `True`): spot-check the fast methods against exact float32 rows at the
            first capture of each shape (and 1% of the later ones), and fall back to exact row tiles (or the
            stock output call) where they disagree; see :mod:`cogattn.exact.checks`. The checks are listed in
            ``Recording.checks`` and the run's metadata.
    """

    kinds: str | Sequence[str] = ("frame",)
    layers: str | int | Sequence[int] = "all"
    steps: str | int | Sequence[int] = "all"
    batch: str | int | Sequence[int] = "auto"
    heads: str | int | Sequence[int] = "mean"
    queries: int | Sequence[int | tuple[int, int, int]] | None = None
    block_size: int = 128
    tile_shape: tuple[int, int, int] = (4, 4, 4)
    topk: int = 32
    top_p: float | Sequence[float] = (0.5, 0.9, 0.95, 0.99)
    patterns: str | Sequence = ()
    memory_budget: int | str = "1GiB"
    method: str = "auto"
    layer_output: str = "stock"
    save_dir: str | os.PathLike | None = None
    overwrite: bool = False
    storage_dtype: str = "float32"
    durable: bool = False
    info: dict | None = None
    verify: bool = True

    def __post_init__(self):
        kinds = (self.kinds,) if isinstance(self.kinds, str) else self.kinds
        if not isinstance(kinds, (list, tuple)):
            raise TypeError(f"kinds must be a kind or a list of kinds from {list(REDUCERS)}, got {self.kinds!r}.")
        if not kinds:
            raise ValueError(f"kinds is empty; choose from {list(REDUCERS)}.")
        for kind in kinds:
            if not isinstance(kind, str) or kind not in REDUCERS:
                raise ValueError(f"unknown kind {kind!r}; the kinds are {list(REDUCERS)}.")
        _choice("method", self.method, METHODS)
        _choice("layer_output", self.layer_output, LAYER_OUTPUTS)
        _choice("storage_dtype", self.storage_dtype, tuple(STORAGE_DTYPES))
        if self.layer_output == "joint" and self.method != "auto":
            raise ValueError(
                f"layer_output='joint' computes the key-pooled kinds in the output call; method={self.method!r} "
                "cannot apply. Leave method='auto'."
            )
        queries = _check_queries(self.queries)
        if "query" in kinds and not queries:
            raise ValueError("kind 'query' needs queries=[...]: token indices or (frame, row, col) coordinates.")
        if queries is not None and "query" not in kinds:
            raise ValueError("queries were given but 'query' is not in kinds; add it or drop queries.")
        for name in ("block_size", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        tile = self.tile_shape
        if not isinstance(tile, (list, tuple)) or len(tile) != 3 or not all(_is_index(n) and n >= 1 for n in tile):
            raise ValueError(
                f"tile_shape={tile!r}; pass 3 positive ints (latent frames, patch rows, patch columns), e.g. (1, 8, 8) "
                "for Sliding Tile Attention's spatial tiles or (4, 4, 4) for VSA's cubes."
            )
        top_p = check_top_p(self.top_p)
        pattern_list = check_option(self.patterns, kinds, self.tile_shape)
        for flag in ("overwrite", "verify", "durable"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}.")
        if self.info is not None and not isinstance(self.info, dict):
            raise TypeError(f"info must be a dict of JSON-able facts (or None), got {self.info!r}.")
        if self.save_dir is not None and (not isinstance(self.save_dir, (str, os.PathLike)) or self.save_dir == ""):
            raise TypeError(f"save_dir must be a folder path (or None), got {self.save_dir!r}.")
        normalised = dict(
            kinds=tuple(dict.fromkeys(kinds)),
            layers=_layers(self.layers),
            steps=_indices("steps", self.steps, None, ("all",)),
            batch=_indices("batch", self.batch, None, BATCH_WORDS),
            heads=_indices("heads", self.heads, None, ("all", "mean")),
            queries=queries,
            tile_shape=tuple(int(n) for n in self.tile_shape),
            top_p=top_p,
            patterns=pattern_list,
            memory_budget=parse_bytes(self.memory_budget),
            save_dir=None if self.save_dir is None else Path(self.save_dir).expanduser(),
            info=dict(self.info or {}),
        )
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @classmethod
    def build(cls, options: CaptureOptions | None = None, **kwargs) -> CaptureOptions:
        """``options`` (or the defaults) with ``kwargs`` on top; an unknown keyword is a `TypeError`."""
        if options is not None and not isinstance(options, CaptureOptions):
            raise TypeError(
                f"options must be a CaptureOptions, got {type(options).__name__}; pass options as keywords."
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"unknown capture option{'s' if len(unknown) > 1 else ''} {unknown}; the options are {names}."
            )
        return dataclasses.replace(options or cls(), **kwargs)

    # -- against the model --------------------------------------------------------------------------
    def check_model(self, num_layers: int, num_heads: int | dict[str, int], layer_names: Sequence[str] = ()) -> None:
        """Raise `ValueError` for layer or head indices outside the model (``num_heads``, or kind → its attention's
        heads: LTX-2's audio has its own); layer names (``layer_names``, in layer order) become their indices."""
        if isinstance(self.layers, tuple) and any(isinstance(x, str) for x in self.layers):
            index = {name: i for i, name in enumerate(layer_names)}
            unknown = [x for x in self.layers if isinstance(x, str) and x not in index]
            if unknown:
                shown = ", ".join(layer_names[:2]) + (f", ..., {layer_names[-1]}" if len(layer_names) > 2 else "")
                raise ValueError(f"layers={list(self.layers)}: {unknown} name no layer of this model ({shown}).")
            layers = tuple(index[x] if isinstance(x, str) else x for x in self.layers)
            if len(set(layers)) < len(layers):
                raise ValueError(f"layers={list(self.layers)} names one layer twice.")
            object.__setattr__(self, "layers", layers)
        counts = num_heads if isinstance(num_heads, dict) else dict.fromkeys(self.kinds, num_heads)
        each = ", ".join(f"{k} 0..{n - 1}" for k, n in counts.items()) if len(set(counts.values())) > 1 else ""
        for name, value, upper in (("layers", self.layers, num_layers), ("heads", self.heads, min(counts.values()))):
            if isinstance(value, tuple) and max(value) >= upper:  # LTX-2's audio kinds have heads of their own
                why = f" (a heads list selects the same heads in each kind's attention: {each})" * (
                    name == "heads" and bool(each)
                )
                raise ValueError(f"{name} index {max(value)} is out of range; valid indices are 0..{upper - 1}{why}.")

    def wants_layer(self, layer: int) -> bool:
        return self.layers == "all" or layer in self.layers

    def wants_step(self, step: int) -> bool:
        return self.steps == "all" or step in self.steps

    def selection_meta(self) -> dict:
        """The selection as JSON-able values (what a run's ``run.json`` keeps under ``"selection"``)."""
        keep = ("kinds", "layers", "steps", "batch", "heads", "queries", "block_size", "tile_shape", "topk", "top_p")
        keep += ("memory_budget", "method")
        meta = {k: _jsonable(getattr(self, k)) for k in keep}
        if {"pattern_recall", "pattern_error"} & set(self.kinds):  # by name: a callable's is its __name__
            meta["patterns"] = [p if isinstance(p, str) else resolve([p])[0].name for p in self.patterns]
        return meta

    # -- against the call ---------------------------------------------------------------------------
    def resolve(
        self, layout: TokenLayout, batch_size: int, guidance: bool | None, num_steps: int | None, num_heads: int
    ) -> Resolved:
        """Make the selection concrete for a call; raises `ValueError` naming what does not fit."""
        if num_steps is not None and self.steps != "all" and max(self.steps) >= num_steps:
            raise ValueError(
                f"steps={list(self.steps)} asks for step {max(self.steps)}, but this generation has "
                f"{num_steps} denoising steps (0..{num_steps - 1})."
            )
        batch = self._resolve_batch(batch_size, guidance)
        return Resolved(
            layout=layout,
            batch=batch,
            roles=tuple(item_role(i, batch_size, guidance) for i in batch),
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
                "(guidance_scale <= 1; HunyuanVideo: true_cfg_scale <= 1 or no negative prompt), so there is no "
                "separate cond/uncond half; use batch='all'."
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


@dataclass(frozen=True)
class Resolved:
    """The selection made concrete for one generation: batch rows, heads, query tokens, and the layout."""

    layout: TokenLayout
    batch: tuple[int, ...]
    roles: tuple[str | None, ...]  # per batch slot: "cond", "uncond", or None (no guidance batch)
    heads: tuple[int, ...]
    mean_heads: bool
    queries: torch.Tensor | None


def _choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}.")


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
        if isinstance(i, bool) or not isinstance(i, int):  # a NumPy integer too: `.tolist()` makes ints
            raise TypeError(f"{name} must hold Python int indices, got {i!r} ({type(i).__name__}) in {value!r}.")
        if i < 0 or (upper is not None and i >= upper):
            bound = f"0..{upper - 1}" if upper is not None else "≥ 0"
            raise ValueError(f"{name} index {i} is out of range; valid indices are {bound}.")
        if i in out:
            raise ValueError(f"{name} lists index {i} twice: {list(value)}.")
        out.append(i)
    return tuple(out)  # the user's order: results keep it (batch and heads axes)


def _layers(value):
    """``layers``: ``"all"``, or indices and layer names (``"single_transformer_blocks.12.attn"``), which the
    model resolves (:meth:`CaptureOptions.check_model`)."""
    if isinstance(value, str) and value != "all":
        value = [value]
    if isinstance(value, (list, tuple)) and any(isinstance(x, str) for x in value):
        bad = [x for x in value if not isinstance(x, str) and not _is_index(x)]
        if bad or not value:
            raise TypeError(f"layers must hold layer indices or names, got {bad[0]!r} in {value!r}.")
        ints = [x for x in value if _is_index(x)]
        _indices("layers", ints or [0], None, ())
        return tuple(value)
    return _indices("layers", value, None, ("all",))


def _is_index(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_queries(queries) -> list | None:
    """The queries as a list (ints: token indices; ``(frame, row, col)`` tuples: video points), which checks
    as itself again; a bare tuple of three ints, a point or three tokens, is refused."""
    if queries is None:
        return None
    if _is_index(queries):
        queries = [queries]
    if not isinstance(queries, (list, tuple, range)):
        raise TypeError(f"queries must be a list of token indices or (frame, row, col) tuples, got {queries!r}.")
    if isinstance(queries, tuple) and len(queries) == 3 and all(_is_index(x) for x in queries):
        listed = ", ".join(map(str, queries))
        raise ValueError(
            f"queries={queries!r} is ambiguous: three token indices or one video point (frame, row, col)? "
            f"Write [{listed}] for token indices or [({listed})] for the video point."
        )
    out = []
    for q in queries:
        if _is_index(q) and q >= 0:
            out.append(q)
        elif isinstance(q, (tuple, list)) and len(q) == 3 and all(_is_index(x) and x >= 0 for x in q):
            out.append(tuple(q))
        else:
            raise TypeError(
                f"query {q!r} ({type(q).__name__}) is neither a token index (a Python int >= 0) nor a video "
                "coordinate (frame, row, col) of non-negative ints; `.tolist()` makes NumPy integers ints."
            )
    return out


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value
