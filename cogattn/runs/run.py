"""A run folder on disk, and the lazy reader of it; :class:`MapSource` is the read interface a
run shares with an in-memory or streaming :class:`cogattn.Recording`.

Layout of a run folder (written by :mod:`cogattn.runs.store`)::

    run.json                     metadata: layout, selection, timesteps, status, model, versions, ...
    manifest.jsonl               one line per committed record: the commit log
    records/<kind>/step0003_layer017.safetensors      one tensor named "map"
    .lock                        locked by the recording writing the run (released when it closes or dies)

A reader lists only what the manifest lists, so it never sees a half-written record; a manifest line
that cannot be read (a disk fault, a power loss's zero-filled tail) is skipped and reported.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from ..errors import StoreError
from ..exact.reducers import REDUCERS
from ..layout import TokenLayout
from .folder import MANIFEST, META, is_locked, parse_json
from .run_values import RecordShapes, checked_call_stats, checked_windows, line_problem, shape_problem
from .schema import read_meta
from .skips import Skips

__all__ = [
    "MapSource",
    "RecordInfo",
    "Run",
    "load",
]


class MapSource(Protocol):
    """What every holder of maps offers to readers (plots, ``cogattn.analysis``): a :class:`cogattn.Recording`
    (in memory or streaming) and a :class:`Run` loaded from disk."""

    @property
    def layout(self) -> TokenLayout | None:
        """Token layout of the generation."""

    def layout_of(self, layer: int) -> TokenLayout | None:
        """Token layout of ``layer``'s attention: :attr:`layout`, or the layer's own where it differs."""

    @property
    def timesteps(self) -> list[float | None]:
        """Timestep of each step, indexed by step."""

    @property
    def info(self) -> dict:
        """Facts kept with the maps (``info=`` of ``record``: prompt, seed, ...)."""

    @property
    def head_ids(self) -> tuple[int, ...] | None:
        """The model head of each slot of a result's head axis; `None` when heads were averaged."""

    @property
    def batch_roles(self) -> tuple[str | None, ...] | None:
        """Per slot of a result's batch axis: ``"cond"``, ``"uncond"`` (under guidance) or `None`; `None` when
        unknown."""

    text_spans = property(doc="Per slot of a result's batch axis, its text's parts (HunyuanVideo 1.5), or `None`.")

    @property
    def block_size(self) -> int:
        """Tokens per block of the ``block`` kind."""

    @property
    def topk(self) -> int:
        """How many of each row's largest probabilities ``topk`` asked for (the records keep min(topk, S))."""

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """Latent frames × patch rows × patch columns of a ``tile`` kind's tile."""

    @property
    def queries(self) -> tuple:
        """The ``query`` kind's queries as given: token indices or ``(frame, row, col)``."""

    @property
    def skipped(self) -> Skips:
        """The selected ``(step, layer, role)`` that have no record because a cache skipped the attention."""

    def keys(self) -> list[tuple[str, int, int]]:
        """Every ``(kind, step, layer)`` held, sorted."""

    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """One record as a float32 tensor; `NotRecordedError` if it is not held."""


@dataclass(frozen=True)
class RecordInfo:
    """One committed record: what it is, its shape and dtype on disk, and its file size in bytes."""

    kind: str
    step: int
    layer: int
    timestep: float | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    file: str


def missing_message(kind, step, layer, have, where: str = "") -> str:
    hint = f"; recorded: {have[:6]}{' ...' if len(have) > 6 else ''}" if have else "; nothing was recorded"
    return f"no record ({kind!r}, step={step}, layer={layer}){where}{hint}"


class Run:
    """A run folder opened for reading: the same ``get(kind, step, layer)`` as an in-memory recording.

    Only records listed in the manifest exist for the reader; leftovers of a crash (``*.tmp``) are
    ignored. Reads are lazy: nothing but the manifest and metadata is read until you ask for a record.
    Manifest lines that cannot be read are skipped, listed in :attr:`skipped_lines` and reported in one
    warning; every valid record stays readable.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        if not (self.path / MANIFEST).exists():
            raise FileNotFoundError(f"{str(self.path)!r} is not a cogattn run: it has no {MANIFEST}.")
        meta_file = self.path / META
        for file in (self.path / MANIFEST, meta_file):  # a pipe or a device would block or never end a read
            if file.exists() and not file.is_file():
                raise StoreError(f"{str(file)!r} is not a regular file; the run cannot be read.")
            if file.exists() and not file.resolve().is_relative_to(self.path.resolve()):  # a link out of the run
                raise StoreError(f"{str(file)!r} resolves outside the run's folder; the run cannot be read.")
        try:
            self.meta: dict = parse_json(meta_file.read_text()) if meta_file.exists() else {}
        except (OSError, ValueError) as err:
            raise StoreError(f"{str(meta_file)!r} cannot be read ({err}); the run's metadata is lost.") from None
        if not isinstance(self.meta, dict):
            raise StoreError(
                f"{str(meta_file)!r} holds {type(self.meta).__name__}, not an object; the run's metadata is lost."
            )
        self._layout, self._text_spans, shapes = read_meta(self.meta, meta_file)  # every value checked, once
        self._layer_layouts = shapes.layer_layouts
        self._records: dict[tuple[str, int, int], RecordInfo] = {}
        self.skipped_lines: list[str] = []  # "manifest.jsonl:7: why", for every manifest line not served
        with open(self.path / MANIFEST, "rb") as f:
            lines = f.read().split(b"\n")
        for number, raw in enumerate(lines[:-1], 1):  # the part after the last newline was never committed
            info = _parse_line(raw, shapes)
            if isinstance(info, str):
                self.skipped_lines.append(f"{MANIFEST}:{number}: {info}")
            else:
                self._records[(info.kind, info.step, info.layer)] = info
        if self.skipped_lines:
            warnings.warn(
                f"{len(self.skipped_lines)} line(s) of {str(self.path / MANIFEST)!r} cannot be read and were skipped "
                f"(see Run.skipped_lines): {'; '.join(self.skipped_lines[:3])}",
                stacklevel=3,
            )

    @property
    def status(self) -> str:
        """How the recording that wrote this run ended: ``"finished"``, ``"interrupted"`` (the pipeline's
        interrupt flag or Ctrl-C), ``"failed"`` (an exception), ``"running"`` (still being written), or
        ``"stopped"`` (its writer is gone without closing the run: a killed or crashed process)."""
        status = self.meta.get("status") or ("finished" if self.meta.get("complete") else "running")
        if status == "running" and not is_locked(self.path):
            return "stopped"
        return status

    @property
    def complete(self) -> bool:
        """True when the recording that wrote this run finished its generation and closed normally."""
        return self.status == "finished"

    @property
    def num_steps(self) -> int:
        """Denoising steps the recording saw."""
        return len(self.timesteps)

    layout = property(lambda self: self._layout, doc="Token layout of the generation, checked when the run was opened.")

    def layout_of(self, layer: int) -> TokenLayout | None:
        """Token layout of ``layer``'s attention: the generation's, or the layer's own (run.json's
        ``layer_layouts``: Motif-Video's decoder layers, over two copies of the grid)."""
        return self._layer_layouts.get(layer, self._layout)

    @property
    def info(self) -> dict:
        """The ``info`` the recording was given (prompt, seed, ...)."""
        return dict(self.meta.get("info") or {})

    @property
    def family(self) -> str:
        """The model family that made this run: ``"cogvideox"`` or ``"wan"``."""
        return (self.meta.get("model") or {}).get("family", "cogvideox")

    @property
    def text_lengths(self) -> list[int] | None:
        """Per slot of the batch axis, its valid text tokens where a mask kept fewer than T (`None`: all)."""
        return (self.meta.get("selection") or {}).get("text_lengths")

    text_spans = property(lambda self: self._text_spans, doc="``Recording.text_spans``, checked when loaded.")
    query_lengths = property(
        lambda self: (self.meta.get("selection") or {}).get("query_lengths"), doc="``Recording.query_lengths``."
    )

    @property
    def layer_names(self) -> list[str] | None:
        """Each layer's stable name, in layer order (`None` for a run recorded before names were kept)."""
        names = (self.meta.get("model") or {}).get("layer_names")
        return None if names is None else list(names)

    @property
    def skipped(self) -> Skips:
        """The selected ``(step, layer, role)`` a cache skipped, and the cache (:class:`cogattn.runs.skips.Skips`)."""
        return Skips.from_meta(self.meta.get("skipped"))

    @property
    def experts(self) -> list[str]:
        """Per step, the pipeline attribute of the transformer that ran it (Wan 2.2's ``"transformer_2"`` too)."""
        return list((self.meta.get("model") or {}).get("step_experts") or ["transformer"] * self.num_steps)

    windows = property(
        lambda self: checked_windows(self.meta.get("windows", [0] * self.num_steps)),
        doc="Per step, its window of the pipeline call (``Recording.windows``; 0 where run.json does not say).",
    )

    call_stats = property(lambda self: checked_call_stats(self.meta.get("call_stats", [])), doc="Recording.call_stats")

    @functools.cached_property
    def head_ids(self) -> tuple[int, ...] | None:
        """The model head of each slot of a result's head axis; `None` when heads were averaged."""
        sel = self.meta.get("selection") or {}
        if sel.get("heads", "mean") == "mean":
            return None
        if sel.get("heads_resolved") is not None:
            return tuple(sel["heads_resolved"])
        if sel["heads"] == "all":
            return tuple(range(int(self.meta["model"]["config"]["num_attention_heads"])))
        return tuple(sel["heads"])

    @property
    def source_heads(self) -> dict[str, tuple[int, ...] | None]:
        """``Recording.source_heads`` (run.json's ``selection.source_heads``): each attention's heads; a run that does
        not say has the self-attention's for every attention."""
        own = dict.fromkeys(["self", *(self.meta.get("sources") or {}).values()], self.head_ids)
        kept = (self.meta.get("selection") or {}).get("source_heads") or {}  # checked when the run was opened
        return own | {src: None if ids is None else tuple(ids) for src, ids in kept.items() if src in own}

    def head_ids_of(self, kind: str) -> tuple[int, ...] | None:
        """``Recording.head_ids_of``: the model head of each slot of ``kind``'s head axis, its attention's."""
        return self.source_heads.get((self.meta.get("sources") or {}).get(kind), self.head_ids)

    @property
    def batch_items(self) -> tuple[int, ...] | None:
        """``Recording.batch_items`` (run.json's ``selection.batch_resolved``); `None` where the run does not say."""
        items = (self.meta.get("selection") or {}).get("batch_resolved")  # checked when the run was opened
        return None if items is None else tuple(items)

    @property
    def batch_roles(self) -> tuple[str | None, ...] | None:
        """Per slot of a result's batch axis, ``"cond"`` (the prompt's item) or ``"uncond"`` (the negative
        prompt's) under classifier-free guidance, `None` without it; `None` where the run does not say (runs
        made before it was kept)."""
        roles = (self.meta.get("selection") or {}).get("batch_roles")  # checked when the run was opened
        return None if roles is None else tuple(roles)

    @property
    def block_size(self) -> int:
        """Tokens per block of the ``block`` kind (128 in runs made before it existed)."""
        return int((self.meta.get("selection") or {}).get("block_size", 128))

    @property
    def topk(self) -> int:
        """How many of each row's largest probabilities ``topk`` asked for (the records keep min(topk, S))."""
        return int((self.meta.get("selection") or {}).get("topk", 32))

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """Latent frames × patch rows × patch columns of a ``tile`` kind's tile."""
        return tuple((self.meta.get("selection") or {}).get("tile_shape", (4, 4, 4)))  # checked when opened

    @property
    def queries(self) -> tuple:
        """The ``query`` kind's queries as given: token indices or ``(frame, row, col)``."""
        queries = (self.meta.get("selection") or {}).get("queries") or ()
        return tuple(q if isinstance(q, int) else tuple(q) for q in queries)

    @property
    def timesteps(self) -> list[float | None]:
        """Timestep of each step, indexed by step: from the metadata, completed after a crash from the
        committed records (`None` where neither knows)."""
        ts = list(self.meta.get("timesteps") or [])
        for r in self._records.values():
            ts.extend([None] * (r.step + 1 - len(ts)))
            if ts[r.step] is None:
                ts[r.step] = r.timestep
        return ts

    def records(self) -> list[RecordInfo]:
        """Every committed record, sorted by (kind, step, layer)."""
        return [self._records[k] for k in sorted(self._records)]

    def keys(self) -> list[tuple[str, int, int]]:
        return sorted(self._records)

    def __contains__(self, key) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def record_info(self, kind: str, step: int, layer: int) -> RecordInfo:
        """The manifest entry of one record; `NotRecordedError` if it was not committed."""
        try:
            return self._records[(kind, step, layer)]
        except KeyError:
            source, batch = (self.meta.get("sources") or {}).get(kind), (self.meta.get("selection") or {}).get("batch")
            missing = missing_message(kind, step, layer, self.keys(), f" in {str(self.path)!r}")
            raise self.skipped.error(kind, step, layer, source, batch, missing) from None

    def get(self, kind: str, step: int, layer: int, index: tuple | None = None) -> torch.Tensor:
        """A record as a float32 tensor whatever dtype it is stored in (``top_p``'s int32 counts too: exact below 2²⁴;
        ``topk``: a :class:`cogattn.exact.reducers.TopK` of values and indices);
        ``index`` (ints, slices and ``...``, e.g. ``(0, 3, slice(0, 10))`` for batch item 0, head 3, the first
        10 rows) reads only that part, through memory-mapped slices; it indexes what ``get`` returns (``topk``:
        values and indices of shape (B, H, S, k))."""
        record = self.record_info(kind, step, layer)
        file = self.path / record.file
        root, real = self.path.resolve(), file.resolve()
        if not real.is_relative_to(root):  # a link out of the folder: another run's record, any file
            raise StoreError(
                f"record file {str(file)!r} (manifest.jsonl's 'file' {record.file!r}) resolves to {str(real)!r}, "
                f"outside the run folder {str(root)!r}; a run's records are read from inside it only."
            )
        if real.exists() and not real.is_file():  # a pipe would block the reader (and, in safetensors, every thread)
            raise StoreError(f"record file {str(file)!r} is not a regular file; it cannot be read.")
        if index is not None:
            index = index if isinstance(index, tuple) else (index,)
            index = REDUCERS[kind].stored_index(index) if kind in REDUCERS else index
        try:
            with safe_open(str(file), framework="pt") as f:
                part = f.get_slice("map")
                held = tuple(part.get_shape())
                if held == record.shape:  # else the file is not the record the manifest names
                    t = f.get_tensor("map") if index is None else part[index]
        except (IndexError, TypeError, ValueError):
            raise  # a bad `index`: the caller's mistake, not the file's
        except Exception as err:
            raise StoreError(f"record file {str(file)!r} cannot be read ({type(err).__name__}: {err}).") from err
        if held != record.shape:
            raise StoreError(f"record file {str(file)!r} holds shape {held}, the manifest says {record.shape}.")
        return REDUCERS[kind].unpack(t.float()) if kind in REDUCERS else t.float()

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, {len(self)} records, {self.status})"


def _parse_line(raw: bytes, shapes: RecordShapes) -> RecordInfo | str:
    """A manifest line as a `RecordInfo`, or why it cannot be one of this run's (``shapes``: run.json's)."""
    if not raw.strip(b" \t\r\x00"):
        return "empty" if b"\x00" not in raw else "zero bytes (a write cut short by a power loss)"
    try:
        d = parse_json(raw)
        info = RecordInfo(
            str(d["kind"]),
            int(d["step"]),
            int(d["layer"]),
            None if d["timestep"] is None else float(d["timestep"]),
            tuple(int(s) for s in d["shape"]),
            str(d["dtype"]),
            int(d["bytes"]),
            str(d["file"]),
        )
    except (ValueError, KeyError, TypeError, OverflowError) as err:  # OverflowError: infinities, 400-digit numbers
        return f"not a record line ({type(err).__name__}: {str(err)[:60]})"
    why = line_problem(info.step, info.layer, info.shape, info.nbytes, info.file)
    return why or shape_problem(info.kind, info.shape, shapes, info.layer) or info


def load(path: str | os.PathLike) -> Run:
    """Open a run folder written by ``cogattn.record(..., save_dir=path)``."""
    return Run(path)
