"""The record file: one safetensors tensor named ``map``, written straight from the tensor's memory into
blocks reserved up front, and its exact size (the planner's disk figures)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys

import torch

__all__ = ["record_file_bytes", "write_record"]

_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32"}


def _header(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, int]:
    """safetensors header of a one-tensor file (JSON padded with spaces to 8 bytes) and the data size."""
    n = 1
    for s in shape:
        n *= s
    data = n * dtype.itemsize
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
