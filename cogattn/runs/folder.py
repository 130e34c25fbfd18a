"""A run folder as files: the names in it, its lock, and the runs under a path. Nothing here reads a record, so
this module imports neither torch nor the rest of the package: ``cogattn view`` finds its runs before those load.

The lock is the OS lock (``flock``) a recording holds on ``.lock`` while it writes the run, so a second writer is
refused and a reader can tell an open run from a finished or abandoned one."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import StoreError

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None

__all__ = ["FORMAT", "LOCK", "MAX_INDEX", "MANIFEST", "META", "RECORDS", "RunLock", "find_runs", "is_locked"]

MANIFEST, META, RECORDS, LOCK = "manifest.jsonl", "run.json", "records", ".lock"
MAX_INDEX = 2**20  # a step, layer, head or token: no generation has more, and a reader lists them all
FORMAT = "cogattn-run/1"  # run.json's "format": a reader refuses another (docs/versioning.md)


class LockHeldError(StoreError):
    """Another recording holds a run folder's lock (:class:`RunLock`): the folder is being written."""


class RunLock:
    """An exclusive OS lock (``flock``) on a run folder's lock file, held while a recording writes the run.

    The OS releases it when the file is closed or the process dies, so a run whose writer was killed is
    never locked for good. Raises `LockHeldError` naming the holder when another writer has the folder, and
    `StoreError` naming the folder when its lock file cannot be written (read-only, a full disk)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK
        try:
            self._file = open(self.path, "a+")
        except OSError as err:
            raise StoreError(
                f"cannot write to {str(folder)!r}: {err.strerror or err}; choose another save_dir."
            ) from err
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._file.seek(0)
                holder = self._file.read().strip() or "another process"
                self._file.close()
                raise LockHeldError(
                    f"the run in {str(folder)!r} is being written by another recording ({holder}); wait for it to "
                    "finish, or choose another save_dir."
                ) from None
        try:  # who holds it, for the message above
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"process {os.getpid()}")
            self._file.flush()
        except OSError as err:
            self._file.close()
            raise StoreError(f"cannot write to {str(folder)!r}: {err.strerror or err}.") from err

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()  # closing the file releases the lock


MAX_DEPTH = 64  # the deepest nesting a run folder's JSON may have (its own is a few levels; a reader recurses)


def parse_json(text: str | bytes):
    """A run folder's JSON text (run.json, a manifest line, prompt.json) parsed; `ValueError` where it is no JSON or
    nests deeper than :data:`MAX_DEPTH` (a file of brackets would exhaust Python's recursion, here or in a reader)."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return obj


def is_locked(folder: Path) -> bool:
    """Whether a recording holds the lock of ``folder`` now. A lock file that is not a plain file (a link, a named
    pipe, whose open would wait for a writer) is none a recording made: not locked."""
    try:
        fd = os.open(Path(folder) / LOCK, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # none, a link, unreadable
        return False
    try:
        if fcntl is None or not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def find_runs(path: str | os.PathLike) -> dict[str, Path]:
    """The runs under ``path``, by a name for each: ``path`` itself when it is a run or a batch prompt's folder
    (``maps/`` beside ``prompt.json`` and the video), else every such folder directly inside it (a batch tool's
    output). Raises `FileNotFoundError` (one line) when there is none."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a folder; pass a run folder or a folder of runs.")

    def run_of(folder: Path) -> Path | None:
        if (folder / MANIFEST).exists():
            return folder
        return folder / "maps" if (folder / "maps" / MANIFEST).exists() else None

    if (own := run_of(path)) is not None:
        return {path.name: own}
    runs = {sub.name: run for sub in sorted(path.iterdir()) if sub.is_dir() and (run := run_of(sub)) is not None}
    if not runs:
        raise FileNotFoundError(f"{str(path)!r} holds no cogattn run (no {MANIFEST} in it or its subfolders).")
    return runs
