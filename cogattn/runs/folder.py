"""A run folder as files: the names in it, its lock, the runs under a path, and making one ready for a recording
(`prepare_folder`) or removing one (`remove_run`). Nothing here reads a record, so
this module imports neither torch nor the rest of the package: ``cogattn view`` finds its runs before those load.

The lock is the OS lock (``flock``) a recording holds on ``.lock`` while it writes the run, so a second writer is
refused and a reader can tell an open run from a finished or abandoned one."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from ..errors import StoreError

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None

__all__ = [
    "FORMAT",
    "LOCK",
    "MAX_INDEX",
    "MANIFEST",
    "META",
    "RECORDS",
    "RunLock",
    "find_runs",
    "is_locked",
    "prepare_folder",
    "remove_run",
]

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


def _is_run(path: Path) -> bool:
    """Whether ``path`` holds a cogattn run: its ``run.json``, or a run killed before it wrote one (a manifest among
    a run's own files alone)."""
    try:
        if (path / META).is_file():
            return parse_json((path / META).read_text()).get("format") == FORMAT
        names = {p.name for p in path.iterdir()}
        return MANIFEST in names and names <= {MANIFEST, META + ".tmp", RECORDS, LOCK}
    except (OSError, ValueError, AttributeError):
        return False


def remove_run(path: Path, lock_too: bool = False, folder_too: bool = False) -> None:
    """Delete the files of a cogattn run (nothing else) from ``path``: with ``lock_too`` its lock file as
    well (once no recording holds it), with ``folder_too`` also the folder when nothing else is in it."""
    # the manifest last: a removal cut short (a kill) leaves a folder that is still a run (`_is_run`), which
    # overwrite=True replaces, not one that holds "no cogattn run"
    for name in (RECORDS, META + ".tmp", META, MANIFEST) + ((LOCK,) if lock_too else ()):
        p = path / name
        # a link (to a folder too) is removed, never followed: the run's own files only
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    if folder_too and path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def prepare_folder(path: str | os.PathLike, overwrite: bool) -> Path:
    """Create ``path``, refusing a non-empty folder unless ``overwrite`` and it holds a cogattn run that no
    recording is writing now (see :class:`cogattn.runs.folder.RunLock`)."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise StoreError(f"output path {str(path)!r} exists and is not a folder.")
    if path.is_dir() and any(p.name != LOCK for p in path.iterdir()):
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
        lock = RunLock(path)  # refuses a run another recording is writing
        try:
            remove_run(path)
        finally:
            lock.release()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(f"cannot create the output folder {str(path)!r}: {err.strerror or err}.") from err
    return path
