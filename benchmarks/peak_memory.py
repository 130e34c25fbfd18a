"""Peak memory above a baseline, for the benchmarks: CUDA allocator statistics, or on Linux the
process's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``).

Import it first thing: on Linux it re-executes the script with ``MALLOC_MMAP_THRESHOLD_=65536`` so
every large tensor is mmapped and leaves the process when freed, making resident peaks live peaks.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

__all__ = ["PeakMemory"]


class PeakMemory:
    """``start()`` then ``stop()`` returns the peak bytes above what was in use at ``start()``."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident size
            self.base = _status("VmRSS")

    def measured(self, real, total: list):
        """``real`` wrapped: adds its time to ``total[0]`` and keeps its largest peak in ``total[1]``."""

        def measured(*args, **kwargs):
            self.start()
            t0 = time.perf_counter()
            real(*args, **kwargs)
            if self.device == "cuda":
                torch.cuda.synchronize()
            total[0] += time.perf_counter() - t0
            total[1] = max(total[1], self.stop())

        return measured

    def stop(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status("VmHWM") - self.base


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)
