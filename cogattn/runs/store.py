"""Writing runs: the crash-safe streaming writer of a run folder (see :mod:`cogattn.runs.run` for its
layout and reader), and the in-memory store of a recording without ``save_dir``.

A record is written to ``<name>.tmp``, renamed, and only then appended to the manifest and flushed.
A reader lists only what the manifest lists, so a crash loses at most the record in flight and never
exposes a half-written one. Writing happens on a background thread behind a queue bounded in bytes:
generation waits when the disk falls behind, and memory never grows without bound.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import deque
from pathlib import Path

import torch

from ..errors import NotRecordedError, StoreError
from ..exact.reducers import REDUCERS
from ..options import STORAGE_DTYPES
from .folder import FORMAT, MANIFEST, META, RECORDS, RunLock, prepare_folder, remove_run
from .record_file import record_file_bytes, write_record
from .run import Run, missing_message

__all__ = ["MemoryStore", "RunWriter", "disk_bytes", "prepare_folder", "remove_run", "write_json_atomic"]

_MANIFEST_LINE = 256  # bytes a manifest line takes, at most, for the disk-space check


def disk_bytes(folder: str | os.PathLike, records: list[tuple[int, int]]) -> int:
    """Disk space ``records`` (``(file bytes, count)`` pairs) take in ``folder``: each file rounded up to
    whole filesystem blocks, plus the manifest lines and run.json."""
    try:
        block = os.statvfs(folder).f_frsize or 4096
    except (OSError, AttributeError):  # no statvfs (not POSIX): assume the common 4 KiB
        block = 4096
    count = sum(n for _, n in records)
    files = sum(n * -(-b // block) * block for b, n in records)
    return files + -(-count * _MANIFEST_LINE // block) * block + 16 * block


def record_path(kind: str, step: int, layer: int) -> str:
    return f"{RECORDS}/{kind}/step{step:04d}_layer{layer:03d}.safetensors"


def write_json_atomic(path: Path, obj: dict) -> None:
    """Replace ``path`` with ``obj`` as JSON through a temporary file and a rename: readers see the old
    file or the new one, never a part. Raises `StoreError` (chained), and leaves no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps(obj, indent=1, default=str).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"writing {str(path)!r} failed: {err.strerror or err}.") from err
    except BaseException:  # Ctrl-C halfway: no temporary file left behind either
        tmp.unlink(missing_ok=True)
        raise


class MemoryStore:
    """Results kept in memory as float32 CPU tensors (a recording with no ``save_dir``). A CUDA result is copied
    into pinned memory without blocking (no device sync a layer) and waited for when first read."""

    def __init__(self):
        self._results: dict[tuple[str, int, int], torch.Tensor] = {}
        self._copying: dict[tuple[str, int, int], torch.cuda.Event] = {}

    def put(self, kind: str, step: int, layer: int, timestep: float | None, tensor: torch.Tensor) -> None:
        key = (kind, step, layer)
        if tensor.device.type != "cuda":
            self._results[key] = tensor.cpu()
            return
        with torch.cuda.device(tensor.device):  # the copy and its event on the tensor's own device and stream
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._copying[key] = torch.cuda.Event()
            self._copying[key].record(torch.cuda.current_stream(tensor.device))
        self._results[key] = host

    def keys(self) -> list[tuple[str, int, int]]:
        return sorted(self._results)

    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        key = (kind, step, layer)
        if key not in self._results:
            raise NotRecordedError(missing_message(kind, step, layer, self.keys()))
        copying = self._copying.pop(key, None)
        if copying is not None:
            copying.synchronize()
        return REDUCERS[kind].unpack(self._results[key])

    def close(self, meta: dict | None = None) -> None:
        pass


class RunWriter:
    """Streams records into a run folder on a background thread.

    Args:
        path (`str | os.PathLike`): the run folder (see :func:`prepare_folder`).
        storage_dtype (`str`, defaults to ``"float32"``): ``"float32"``, ``"float16"`` or ``"bfloat16"``: the dtype of
            the records of probabilities and masses; each kind's :meth:`Reducer.stored_dtype` says where its
            records keep another (``top_p``'s counts int32, ``topk``'s and ``frame_max``'s key indices float32).
        mean_heads (`bool`, defaults to `False`): the records average the heads (``top_p``'s mean count is float32).
        max_pending_bytes (`int`, defaults to 512 MiB): bytes queued for the disk before :meth:`put` waits
            (a single larger record is still accepted once the queue is empty).
        durable (`bool`, defaults to `False`): fsync every record and manifest line (survives power loss,
            not only a crash of the process; slower).
    """

    def __init__(
        self,
        path,
        storage_dtype: str = "float32",
        max_pending_bytes: int = 512 * 2**20,
        durable: bool = False,
        mean_heads: bool = False,
    ):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype={storage_dtype!r}; choose one of {list(STORAGE_DTYPES)}.")
        self.path = Path(path)
        self.dtype = STORAGE_DTYPES[storage_dtype]
        self.mean_heads = mean_heads
        self.made_from: Path | None = None  # set by create(): the outermost folder it made, which discard() removes
        self._lock = RunLock(self.path)  # held until close: nobody else writes or replaces this run
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
        self._reported = False  # the failure was raised to the caller already
        self._failed_key = None
        self._kinds_seen: set[str] = set()
        self._pinned: dict[tuple, list[torch.Tensor]] = {}
        try:  # unbuffered appends: a failed write leaves at most a partial last line, which readers skip
            self._manifest = os.open(self.path / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            self._lock.release()
            raise StoreError(f"cannot write to {str(self.path)!r}: {err.strerror or err}.") from err
        self._thread = threading.Thread(target=self._work, name="cogattn-writer", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, options, meta: dict) -> RunWriter:
        """A writer for a new run in ``options.save_dir`` (a `CaptureOptions`'s: ``overwrite``, ``storage_dtype``,
        ``durable``; see :func:`prepare_folder`), its ``run.json`` written; nothing is left behind when that fails."""
        path = Path(options.save_dir).expanduser().absolute()
        missing = [p for p in (path, *path.parents) if not p.exists()]  # what prepare_folder will make
        mean_heads = (meta.get("selection") or {}).get("heads") == "mean"
        folder = prepare_folder(path, options.overwrite)
        writer = cls(folder, options.storage_dtype, durable=options.durable, mean_heads=mean_heads)
        writer.made_from = missing[-1] if missing else None
        try:
            writer.write_meta(meta)
        except StoreError:
            writer.close()
            writer.discard()
            raise
        return writer

    def discard(self) -> None:
        """After :meth:`close`: remove the run, its lock file, and the folders :meth:`create` made (its parents
        too) while nothing else is in them: a run refused before its first record leaves nothing behind."""
        remove_run(self.path, lock_too=True)
        if self.made_from is None:
            return
        for folder in (self.path, *self.path.parents):  # deepest first
            if not folder.is_dir() or any(folder.iterdir()):
                return
            folder.rmdir()
            if folder == self.made_from:
                return

    @property
    def failed(self) -> bool:
        """Whether a record could not be written (the run misses it and those queued after it)."""
        return self._error is not None

    @property
    def pending_bytes(self) -> int:
        """Bytes queued for the disk and not yet committed (at most ``max_pending_bytes``, or one record)."""
        return self._pending_bytes

    # -- main thread -------------------------------------------------------------------------------
    def write_meta(self, meta: dict) -> None:
        """Replace ``run.json``; `StoreError` if it cannot be written."""
        write_json_atomic(self.path / META, {"format": FORMAT, **meta})

    def check_space(self, records: list[tuple[int, int]]) -> None:
        """Refuse a run whose records (``(file bytes, count)`` pairs) do not fit the free space of the disk.

        Each file takes whole filesystem blocks, and each record adds a manifest line: a run of many small
        records needs far more than the sum of its file sizes."""
        expected = sum(b * n for b, n in records)
        need = disk_bytes(self.path, records)
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise StoreError(
                f"this run will write {expected:,} bytes ({expected / 2**30:.2f} GiB; {need:,} bytes of disk "
                f"in whole blocks) to {str(self.path)!r}, but its disk has {free:,} bytes ({free / 2**30:.2f} GiB) "
                "free; select fewer kinds, layers, steps or heads, use storage_dtype='float16', or write elsewhere."
            )

    def put(self, kind: str, step: int, layer: int, timestep: float | None, tensor: torch.Tensor) -> None:
        """Queue one result; waits while the queue is full; raises `StoreError` if writing has failed."""
        self.raise_if_failed()
        if self._closing:
            raise StoreError(f"the run {str(self.path)!r} is closed; start a new recording to write more.")
        if kind not in self._kinds_seen:
            (self.path / RECORDS / kind).mkdir(parents=True, exist_ok=True)
            self._kinds_seen.add(kind)
        dtype = REDUCERS[kind].stored_dtype(self.dtype, self.mean_heads) if kind in REDUCERS else self.dtype
        host, ready = self._to_host(tensor.to(dtype))
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
        """Finish writing, then write the final metadata; raises `StoreError` if a write failed (run.json then says
        how the recording ended all the same, where it can still be written). A Ctrl-C while the queue drains drops
        the records still queued (the one being written commits), and the run is closed as ``"interrupted"`` before
        the interrupt goes on: never left locked and "running"."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        interrupted = self._drain()
        self._pinned.clear()  # page-locked host memory goes back now, not when the object dies
        try:
            try:
                os.close(self._manifest)
            except OSError as err:
                raise StoreError(f"closing {str(self.path / MANIFEST)!r} failed: {err.strerror or err}.") from err
            if meta is not None:
                ended = "failed" if self.failed else "interrupted" if interrupted is not None else None
                meta = meta if ended is None else {**meta, "status": ended, "complete": False}  # records are missing
                try:
                    self.write_meta(meta)
                except StoreError:
                    if self._error is None:  # after a failed record (a full disk) that error is the one raised
                        raise
        finally:
            self._lock.release()
        if interrupted is not None:
            raise interrupted
        self.raise_if_failed(again=False)

    def _drain(self) -> BaseException | None:
        """Wait for the writer thread to commit the queue; an interrupt of the wait (Ctrl-C) drops the records still
        queued, waits for the one being written, and is returned. (Not by ``Thread.join``: Python 3.11's, interrupted,
        marks a running thread stopped.)"""
        interrupted = None
        while True:
            try:
                with self._cond:
                    while self._pending:  # the thread takes a record off the queue once it is committed
                        self._cond.wait()
                break
            except BaseException as err:
                interrupted = interrupted or err
                with self._cond:
                    while len(self._pending) > 1:  # the first is being written: it commits
                        self._pending_bytes -= self._pending.pop()[-1]
        self._thread.join()  # nothing queued and closing: it returns now
        return interrupted

    def keys(self) -> list[tuple[str, int, int]]:
        """Every committed record (waits for the queue)."""
        self.flush()
        return Run(self.path).keys()

    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """A committed record read back from disk (waits for the queue)."""
        self.flush()
        return Run(self.path).get(kind, step, layer)

    def raise_if_failed(self, again: bool = True) -> None:
        """Raise `StoreError` if a write failed (with ``again=False``: only if not raised before)."""
        if self._error is not None and (again or not self._reported):
            self._reported = True
            kind, step, layer = self._failed_key
            kept = (
                f"the {self.committed} records committed before it are intact and `cogattn.load({str(self.path)!r})` "
                "reads them"
                if self.committed
                else "no record had been committed, so nothing of the run is kept"
            )
            raise StoreError(
                f"writing record ({kind!r}, step={step}, layer={layer}) to {str(self.path)!r} failed: "
                f"{self._error}. Capture stopped; {kept}."
            ) from self._error

    def _to_host(self, t: torch.Tensor):
        """CPU copy of ``t``; from CUDA through a pinned buffer with a non-blocking copy and an event
        (returned with its device), so the stream is not stalled and the writer thread waits for the copy."""
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
        return buf, (event, t.device)

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
                    if ready is not None:  # on the copy's device: no context on GPU 0 for a process on another
                        event, device = ready
                        with torch.cuda.device(device):
                            event.synchronize()
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
        line = {
            "kind": kind,
            "step": step,
            "layer": layer,
            "timestep": timestep,
            "shape": list(host.shape),
            "dtype": str(host.dtype).removeprefix("torch."),
            "bytes": size,
            "file": rel,
        }
        data = (json.dumps(line) + "\n").encode()
        while data:  # the line is committed when its newline is on disk
            data = data[os.write(self._manifest, data) :]
        if self.durable:
            os.fsync(self._manifest)
        self.committed += 1
        self.bytes_written += size
