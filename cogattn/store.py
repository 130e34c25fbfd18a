"""Writing runs: the crash-safe streaming writer of a run folder (see :mod:`cogattn.run` for its
layout and reader), and the in-memory store of a recording without ``save_dir``.

A record is written to ``<name>.tmp``, renamed, and only then appended to the manifest and flushed.
A reader lists only what the manifest lists, so a crash loses at most the record in flight and never
exposes a half-written one. Writing happens on a background thread behind a queue bounded in bytes:
generation waits when the disk falls behind, and memory never grows without bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from .errors import NotRecordedError, StoreError
from .options import STORAGE_DTYPES
from .run import FORMAT, MANIFEST, META, RECORDS, Run, missing_message

__all__ = ["MemoryStore", "RunWriter", "prepare_folder", "record_file_bytes", "remove_run", "write_record"]

_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _header(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, int]:
    """safetensors header of a one-tensor file (JSON padded with spaces to 8 bytes) and the data size."""
    n = 1
    for s in shape:
        n *= s
    data = n * torch.finfo(dtype).bits // 8
    header = json.dumps(
        {"map": {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [0, data]}}, separators=(",", ":")
    ).encode()
    return header + b" " * ((-len(header)) % 8), data


def record_file_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Exact size of a record file: safetensors' 8-byte length, its JSON header padded to 8, the data."""
    header, data = _header(shape, dtype)
    return 8 + len(header) + data


def write_record(path: str | os.PathLike, tensor: torch.Tensor) -> None:
    """Write ``tensor`` as a safetensors file holding one tensor named ``map``.

    The format is a length, a JSON header and the raw bytes; writing it directly from the tensor's
    memory avoids the full in-memory copy ``safetensors.torch.save_file`` makes, which halved the
    writer's throughput (benchmarks/bench_store.py). Files are read with safetensors itself."""
    t = tensor.contiguous()
    header, data = _header(tuple(t.shape), t.dtype)
    with open(path, "wb") as f:
        _reserve(f.fileno(), 8 + len(header) + data)
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))


def _load_fallocate():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


_FALLOCATE = _load_fallocate() if sys.platform.startswith("linux") else None


def _reserve(fd: int, size: int) -> None:
    """Reserve a new file's blocks before writing it: many files written with delayed allocation were
    about 1.6× slower to reach the disk on ext4 (measured by benchmarks/bench_store.py's predecessor).
    The raw ``fallocate`` call, not ``posix_fallocate``: where the filesystem cannot reserve, skip it
    rather than have libc write zeros first."""
    if _FALLOCATE is not None:
        _FALLOCATE(fd, 0, 0, size)  # a failure only means no reservation


def record_path(kind: str, step: int, layer: int) -> str:
    return f"{RECORDS}/{kind}/step{step:04d}_layer{layer:03d}.safetensors"


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _is_run(path: Path) -> bool:
    try:
        return json.loads((path / META).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def remove_run(path: Path) -> None:
    """Delete the files of a cogattn run (nothing else) from ``path``."""
    for name in (MANIFEST, META, RECORDS):
        p = path / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def prepare_folder(path: str | os.PathLike, overwrite: bool) -> Path:
    """Create ``path``, refusing a non-empty folder unless ``overwrite`` and it holds a cogattn run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"output path {str(path)!r} exists and is not a folder.")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise StoreError(
                f"output folder {str(path)!r} is not empty; choose another `save_dir`, or pass overwrite=True "
                "to replace the cogattn run in it."
            )
        if not _is_run(path):
            raise StoreError(
                f"output folder {str(path)!r} is not empty and holds no cogattn run, so overwrite=True will "
                "not delete it; choose another `save_dir`."
            )
        remove_run(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


class MemoryStore:
    """Results kept in memory as float32 CPU tensors (a recording with no ``save_dir``)."""

    def __init__(self):
        self._results: dict[tuple[str, int, int], torch.Tensor] = {}

    def put(self, kind: str, step: int, layer: int, timestep: float | None, tensor: torch.Tensor) -> None:
        self._results[(kind, step, layer)] = tensor.cpu()

    def keys(self) -> list[tuple[str, int, int]]:
        return sorted(self._results)

    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        try:
            return self._results[(kind, step, layer)]
        except KeyError:
            raise NotRecordedError(missing_message(kind, step, layer, self.keys())) from None

    def close(self, meta: dict | None = None) -> None:
        pass


class RunWriter:
    """Streams records into a run folder on a background thread.

    Args:
        path (`str | os.PathLike`): the run folder (see :func:`prepare_folder`).
        storage_dtype (`str`, defaults to ``"float32"``): ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        max_pending_bytes (`int`, defaults to 512 MiB): bytes queued for the disk before :meth:`put` waits
            (a single larger record is still accepted once the queue is empty).
        durable (`bool`, defaults to `False`): fsync every record and manifest line (survives power loss,
            not only a crash of the process; slower).
    """

    def __init__(self, path, storage_dtype: str = "float32", max_pending_bytes: int = 512 * 2**20,
                 durable: bool = False):  # fmt: skip
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype={storage_dtype!r}; choose one of {list(STORAGE_DTYPES)}.")
        self.path = Path(path)
        self.dtype = STORAGE_DTYPES[storage_dtype]
        self.durable = durable
        self.committed = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0  # time the writer thread spent writing (throughput = bytes / busy)
        self.blocked_seconds = 0.0  # time put() waited for queue space (the disk did not keep up)
        self._max_pending = max_pending_bytes
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._failed_key = None
        self._kinds_seen: set[str] = set()
        self._pinned: dict[tuple, list[torch.Tensor]] = {}
        self._manifest = open(self.path / MANIFEST, "a", encoding="utf-8")
        self._thread = threading.Thread(target=self._work, name="cogattn-writer", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        """Bytes queued for the disk and not yet committed (at most ``max_pending_bytes``, or one record)."""
        return self._pending_bytes

    # -- main thread -------------------------------------------------------------------------------
    def write_meta(self, meta: dict) -> None:
        _write_json_atomic(self.path / META, {"format": FORMAT, **meta})

    def check_space(self, expected: int) -> None:
        """Refuse a run whose ``expected`` bytes do not fit the free space of the disk."""
        free = shutil.disk_usage(self.path).free
        if expected > free:
            raise StoreError(
                f"this run will write {expected:,} bytes ({expected / 2**30:.2f} GiB) to {str(self.path)!r}, "
                f"but its disk has {free:,} bytes ({free / 2**30:.2f} GiB) free; select fewer kinds, layers, "
                "steps or heads, use storage_dtype='float16', or write elsewhere."
            )

    def put(self, kind: str, step: int, layer: int, timestep: float | None, tensor: torch.Tensor) -> None:
        """Queue one result; waits while the queue is full; raises `StoreError` if writing has failed."""
        self.raise_if_failed()
        if self._closing:
            raise StoreError(f"the run {str(self.path)!r} is closed; start a new recording to write more.")
        if kind not in self._kinds_seen:
            (self.path / RECORDS / kind).mkdir(parents=True, exist_ok=True)
            self._kinds_seen.add(kind)
        host, ready = self._to_host(tensor.to(self.dtype))
        n = host.numel() * host.element_size()
        with self._cond:
            t0 = time.perf_counter()
            while self._pending and self._pending_bytes + n > self._max_pending and self._error is None:
                self._cond.wait()
            self.blocked_seconds += time.perf_counter() - t0
            self._pending.append((kind, step, layer, timestep, host, ready, n))
            self._pending_bytes += n
            self._cond.notify_all()
        self.raise_if_failed()

    def flush(self) -> None:
        """Wait until everything queued is committed."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
        self.raise_if_failed()

    def close(self, meta: dict | None = None) -> None:
        """Finish writing, then write the final metadata; raises `StoreError` if a write failed."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._manifest.close()
        self._pinned.clear()  # page-locked host memory goes back now, not when the object dies
        if meta is not None and self._error is None:
            self.write_meta(meta)
        self.raise_if_failed()

    def keys(self) -> list[tuple[str, int, int]]:
        """Every committed record (waits for the queue)."""
        self.flush()
        return Run(self.path).keys()

    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """A committed record read back from disk (waits for the queue)."""
        self.flush()
        return Run(self.path).get(kind, step, layer)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            kind, step, layer = self._failed_key
            raise StoreError(
                f"writing record ({kind!r}, step={step}, layer={layer}) to {str(self.path)!r} failed: "
                f"{self._error}. Capture stopped; the {self.committed} records committed before it are intact "
                f"and `cogattn.load({str(self.path)!r})` reads them."
            ) from self._error

    def _to_host(self, t: torch.Tensor):
        """CPU copy of ``t``; from CUDA through a pinned buffer with a non-blocking copy and an event,
        so the stream is not stalled and the writer thread waits for the copy instead."""
        if t.device.type != "cuda":
            return t.contiguous(), None
        with self._cond:
            pool = self._pinned.setdefault((tuple(t.shape), t.dtype), [])
            buf = pool.pop() if pool else None
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.device(t.device):  # the copy and its event on the tensor's own device and stream
            stream = torch.cuda.current_stream(t.device)
            buf.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return buf, event

    # -- writer thread -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                item = self._pending[0]
            kind, step, layer, timestep, host, ready, n = item
            if self._error is None:
                try:
                    if ready is not None:
                        ready.synchronize()
                    t0 = time.perf_counter()
                    self._commit(kind, step, layer, timestep, host)
                    self.busy_seconds += time.perf_counter() - t0
                except BaseException as e:
                    self._error, self._failed_key = e, (kind, step, layer)
            with self._cond:
                if ready is not None:  # the pinned buffer goes back to its pool
                    self._pinned[(tuple(host.shape), host.dtype)].append(host)
                self._pending.popleft()
                self._pending_bytes -= n
                self._cond.notify_all()

    def _commit(self, kind, step, layer, timestep, host: torch.Tensor) -> None:
        rel = record_path(kind, step, layer)
        final = self.path / rel
        tmp = final.with_name(final.name + ".tmp")
        try:
            write_record(tmp, host)
            if self.durable:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        size = record_file_bytes(tuple(host.shape), host.dtype)
        line = {"kind": kind, "step": step, "layer": layer, "timestep": timestep, "shape": list(host.shape),
                "dtype": str(host.dtype).removeprefix("torch."), "bytes": size, "file": rel}  # fmt: skip
        self._manifest.write(json.dumps(line) + "\n")
        self._manifest.flush()
        if self.durable:
            os.fsync(self._manifest.fileno())
        self.committed += 1
        self.bytes_written += size
