"""Child processes forked from the test process itself, for the tests that kill a writer with SIGKILL: the
child has torch, diffusers and cogattn imported already, where a new interpreter imports them again (about
8 s of a test's time each). Linux and macOS only (``fork``), as the tests that use it."""

from __future__ import annotations

import multiprocessing
import os
import signal

_FORK = multiprocessing.get_context("fork")


def event():
    """An event the child sets and the test waits on."""
    return _FORK.Event()


def start(target, *args) -> multiprocessing.Process:
    """``target(*args)`` in a forked child, on one thread (OpenMP's pool is not the parent's after a fork)."""
    proc = _FORK.Process(target=_one_thread, args=(target, args), daemon=True)
    proc.start()
    return proc


def kill(proc: multiprocessing.Process) -> None:
    """SIGKILL, as a crash or the OOM killer ends a process: no handler, no cleanup."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()


def _one_thread(target, args) -> None:
    import faulthandler
    import sys

    import torch
    import tqdm

    # A lock another thread of the parent held at the fork stays held in the child: tqdm's (its monitor thread
    # takes it) would stop the pipeline's progress bar forever. A fresh one; and a child stuck anyway prints its
    # stack after 45 s, so a test that waits on it says where.
    if "_lock" in tqdm.tqdm.__dict__:
        del tqdm.tqdm._lock
    faulthandler.dump_traceback_later(45, exit=False, file=sys.stderr)
    torch.set_num_threads(1)
    target(*args)
