"""A run folder on disk, and the lazy reader of it; :class:`MapSource` is the read interface a
run shares with an in-memory or streaming :class:`cogattn.Recording`.

Layout of a run folder (written by :mod:`cogattn.store`)::

    run.json                     metadata: layout, selection, timesteps, model, versions, ...
    manifest.jsonl               one line per committed record: the commit log
    records/<kind>/step0003_layer017.safetensors      one tensor named "map"

A reader lists only what the manifest lists, so it never sees a half-written record.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from .errors import NotRecordedError
from .layout import TokenLayout

__all__ = ["MapSource", "RecordInfo", "Run", "load", "MANIFEST", "META", "RECORDS", "FORMAT"]

MANIFEST, META, RECORDS = "manifest.jsonl", "run.json", "records"
FORMAT = "cogattn-run/1"


class MapSource(Protocol):
    """What every holder of maps offers to readers (plots, ``cogattn.analysis``): a :class:`cogattn.Recording`
    (in memory or streaming) and a :class:`Run` loaded from disk."""

    @property
    def layout(self) -> TokenLayout | None:
        """Token layout of the generation."""

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
    def queries(self) -> tuple:
        """The ``query`` kind's queries as given: token indices or ``(frame, row, col)``."""

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
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / MANIFEST).exists():
            raise FileNotFoundError(f"{str(self.path)!r} is not a cogattn run: it has no {MANIFEST}.")
        meta_file = self.path / META
        self.meta: dict = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        self._records: dict[tuple[str, int, int], RecordInfo] = {}
        with open(self.path / MANIFEST, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a line cut by a crash was never committed
                d = json.loads(line)
                info = RecordInfo(d["kind"], d["step"], d["layer"], d["timestep"], tuple(d["shape"]), d["dtype"],
                                  d["bytes"], d["file"])  # fmt: skip
                self._records[(info.kind, info.step, info.layer)] = info

    @property
    def complete(self) -> bool:
        """True when the recording that wrote this run closed normally."""
        return bool(self.meta.get("complete"))

    @property
    def layout(self) -> TokenLayout | None:
        lay = self.meta.get("layout")
        return TokenLayout(**lay) if lay else None

    @property
    def info(self) -> dict:
        """The ``info`` the recording was given (prompt, seed, ...)."""
        return dict(self.meta.get("info") or {})

    @property
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
            raise NotRecordedError(missing_message(kind, step, layer, self.keys(), f" in {str(self.path)!r}")) from None

    def get(self, kind: str, step: int, layer: int, index: tuple | None = None) -> torch.Tensor:
        """A record as a float32 tensor; ``index`` (ints and slices, e.g. ``(0, 3, slice(0, 10))`` for
        batch item 0, head 3, the first 10 rows) reads only that part, through memory-mapped slices."""
        record = self.record_info(kind, step, layer)
        with safe_open(str(self.path / record.file), framework="pt") as f:
            if index is None:
                t = f.get_tensor("map")
            else:
                t = f.get_slice("map")[index if isinstance(index, tuple) else (index,)]
        return t.float()

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"Run({str(self.path)!r}, {len(self)} records, {state})"


def load(path: str | os.PathLike) -> Run:
    """Open a run folder written by ``cogattn.record(..., save_dir=path)``."""
    return Run(path)
