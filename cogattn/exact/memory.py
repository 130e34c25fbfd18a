"""The memory model of a capture: the bytes each method's tiles hold, and the one rule of ``memory_budget``.

Everything capture holds on its device beyond one layer call's results — the transient tiles of every
method and a cross-attention's tiles — fits ``memory_budget`` less a headroom of ``min(budget / 32,
16 MiB)``; a budget too small for the smallest tile is refused with the least budget that would do
(:class:`TooSmall`, :func:`least_budget`). Results that wait in host memory between a step's two calls (Wan under guidance, a
selection spanning both halves) share the budget with the tiles on a CPU, where they are the same
memory, and must fit the host's available memory (:func:`host_available`) on an accelerator.
:mod:`cogattn.exact.planner` sizes the tiles with these functions.
"""

from __future__ import annotations

import math
import os
import re

import torch

__all__ = [
    "CPU_ROW_TILE",
    "TooSmall",
    "box_columns",
    "check_host",
    "context_tile",
    "cpu_flash_bytes",
    "host_available",
    "least_budget",
    "one_refusal",
    "parse_bytes",
    "pooled_bytes",
    "row_tile_bytes",
    "usable",
    "waiting_bytes",
    "waiting_refusal",
]

_F32 = 4
_RESERVE = 16 * 2**20  # at most this much of the budget is kept back as headroom
CPU_ROW_TILE = 8 * 2**20  # a CPU's row tile of scores: cache-sized (docs/benchmarks.md)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as ``"1GiB"``, ``"512 MB"``, ``"2e9"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"memory_budget must be an int (bytes) or a string like '1GiB', got {value!r}.")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"memory_budget={value!r} is not a byte size; use bytes or a number with a unit "
                f"({', '.join(u for u in _UNITS if u)}), e.g. '1GiB'."
            )
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(size):
            raise ValueError(f"memory_budget={value!r} is more bytes than a float holds; give a size such as '1GiB'.")
        n = int(size)
    if n <= 0:
        raise ValueError(f"memory_budget={value!r} is less than one byte; give a size such as '1GiB'.")
    return n


def host_available() -> int | None:
    """Bytes of host memory available now (``MemAvailable``, else free pages), `None` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def usable(budget: int) -> int:
    """The part of ``budget`` tiles may take: less the headroom for what the model below leaves out (softmax
    row statistics, fold temporaries, kernel workspaces; measured at 1 GiB these add up to a few MiB)."""
    return budget - min(budget // 32, _RESERVE)


def row_tile_bytes(
    h: int, r: int, S: int, D: int, C: int, copies: bool, received=False, mean_heads: int = 0, mask=(0, 0)
) -> int:
    # float32 K of the head chunk (when the input must be copied; of all ``mean_heads`` heads for head-mean
    # rows, which revisit every head per row tile), the q rows, the scores (the softmax runs in place), the
    # pooled sums, a column sum per head (received), the head-mean rows (topk of the mean); and the tile's rows
    # of a mask, ``mask`` bytes per score of each head and per score shared by the heads (passes.mask_cost)
    k_copy = max(h, mean_heads) * S * D * copies
    held = _F32 * (k_copy + h * r * D + h * r * S + h * r * C + h * S * received + r * S * bool(mean_heads))
    return held + mask[0] * h * r * S + mask[1] * r * S


def pooled_bytes(
    h: int,
    r: int,
    S: int,
    D: int,
    n_multi: int,
    n_single: int,
    copies: bool,
    joint: bool,
    stats=frozenset(),
    cpu_threads: int = 0,
) -> int:
    # Phases of a head chunk, one after another: the entropy pass (its output), the multi-key sums, the
    # single-key tiles, the received pass (the widened keys and queries and its output). Each fused call on a CPU
    # also holds the flash kernel's workspace, per thread of ``cpu_threads`` (cpu_flash_bytes).
    width = -(-(D + 1) // 8) * 8
    if cpu_threads:
        return pooled_bytes(h, r, S, D, n_multi, n_single, copies, joint, stats) + cpu_flash_bytes(
            S, width, cpu_threads
        )
    stat_phases = [h * S * D + h * S] * ("entropy" in stats) + [3 * h * S * width + h * S + S * width] * (
        "received" in stats
    )
    if joint:  # sums and lse came with the output: a float32 chunk of the sums, then the single-key tiles
        held = h * S + h * D * n_single + 2 * h * S * D * copies * bool(stats)  # lse, single keys' k, q and k
        return _F32 * (held + max(h * S * n_multi, h * r * (n_single + D * copies), *stat_phases))
    # Held throughout: float32 q and k (when copied), the padded indicator (plus a per-call slice when
    # there are several calls), lse. Then first the outputs (gathered in a buffer when there are several
    # calls), freed before the single-key tiles of r rows.
    calls = max(1, math.ceil(n_multi / D))
    held = 2 * h * S * D * copies + S * D * (calls + (calls > 1)) + h * S
    # with several calls' columns, runs of keys (passes.key_ranges) also hold float64 lse sums per row
    outputs = h * S * D * (calls + 1) + 16 * h * S if calls > 1 else h * S * D
    single = h * r * n_single + h * D * n_single
    return _F32 * (held + max(outputs, single, *stat_phases))


def cpu_flash_bytes(S: int, D: int, threads: int) -> int:
    """The workspace of torch's CPU flash attention kernel for ``S`` queries and keys of head dim ``D`` (values of
    ``D`` columns at most), float32: per thread a block of scores (256 query rows × 512 keys at most) and its rows'
    outputs and statistics, allocated by every call beside its inputs and output."""
    rows = 256 if S >= 768 else 64 if S >= 192 else 32
    return _F32 * threads * (rows * min(512, S) + rows * (D + 2))


def box_columns(grid: tuple[int, int, int], shape: tuple[int, int, int]) -> int:
    """The columns per row :func:`cogattn.exact.passes.box_sums` holds at once: its largest partial sum, twice (the whole runs' sums and
    their copy with the edge run's), and the result with the text's."""
    dims, largest = list(grid), 0
    for axis, size in enumerate(shape):
        if size > 1:
            dims[axis] = -(-dims[axis] // size)
            largest = max(largest, dims[0] * dims[1] * dims[2])
    return 2 * largest + dims[0] * dims[1] * dims[2] + 1


def context_tile(
    heads: int, queries: int, context: int, head_dim: int, budget: int, device="cpu"
) -> tuple[int, int, int]:
    """``(heads, rows, peak bytes)`` of the largest cross-attention tile within ``budget`` (less the
    headroom): float32 scores of ``heads × rows × context``, and the tile's float32 copies of q and of the
    heads' keys. On a CPU a tile is at most :data:`CPU_ROW_TILE` bytes, which stays in cache
    (docs/benchmarks.md). Raises `ValueError` when one row of one head does not fit."""

    def cost(h: int, r: int) -> int:
        return _F32 * h * (r * context + r * head_dim + context * head_dim)

    fits = usable(budget)
    if cost(1, 1) > fits:
        raise TooSmall(budget, cost(1, 1), f"a cross-attention to {context} keys", head_dim)
    if torch.device(device).type == "cpu":
        fits = min(fits, max(CPU_ROW_TILE, cost(1, 1)))
    h = max(1, min(heads, fits // max(1, cost(1, queries))))
    r = queries
    if cost(h, r) > fits:
        h = 1
        r = max(1, min(queries, (fits // _F32 - context * head_dim) // (context + head_dim)))
    return h, r, cost(h, r)


def least_budget(need: int) -> int:
    """The smallest ``memory_budget`` whose :func:`usable` part holds ``need`` bytes (the planner's own rule)."""
    # below 32 × 16 MiB the headroom is budget // 32, so usable = ⌈31·budget / 32⌉; above, budget − 16 MiB
    small = 32 * (need - 1) // 31 + 1
    return small if small // 32 <= _RESERVE else need + _RESERVE


class TooSmall(ValueError):
    """The one refusal of a budget too small for the smallest tile of ``what`` (a sequence length, or words), naming
    one number: the least budget that holds ``need`` bytes, that tile's, after the headroom (:func:`least_budget`);
    a plan of several passes refuses once, with the largest (:func:`one_refusal`)."""

    def __init__(self, budget: int, need: int, what: str | int, D: int):
        self.budget, self.need, self.what, self.head_dim = budget, need, what, D
        where = f"sequence length S={what}" if isinstance(what, int) else what
        super().__init__(
            f"memory_budget={budget} bytes is too small for one tile of {where}, head dim {D}; raise memory_budget "
            f"to at least {least_budget(need)} bytes (e.g. '1GiB')."
        )


def one_refusal(*plans) -> list:
    """What each of ``plans`` (callables sizing tiles within one budget) returns; a budget too small for several is
    refused once, with the largest ``need``: the least budget it names holds them all."""
    done, refused = [], []
    for plan in plans:
        try:
            done.append(plan())
        except TooSmall as err:
            refused.append(err)
    if refused:
        raise max(refused, key=lambda err: err.need)
    return done


def waiting_bytes(reducers, batch, batch_size: int, calls: int, layers: int) -> int:
    """Bytes of results that wait in host memory for a step's last call: when the selected items (``batch``,
    indices of the ``batch_size`` items of a step's ``calls`` calls) span several calls, those outside the
    last call (which holds the first ``batch_size / calls``), for every reducer and each of ``layers``."""
    per_call = batch_size // calls
    spanned = {b // per_call for b in batch}
    if calls < 2 or len(spanned) < 2:
        return 0
    early = sum(1 for b in batch if b >= per_call)
    return early * layers * sum(r.nbytes(1) for r in reducers)


def _waiting(waiting: int, batch) -> str:
    return (
        f"the {waiting:,} bytes of results that wait in host memory for each step's second call (batch={batch!r} "
        "spans both of its calls, so every captured layer's first half waits)"
    )


def check_host(waiting: int, batch) -> None:
    """Refuse ``waiting`` bytes of results held in host memory beyond what the host has available now."""
    available = host_available() if waiting else None
    if available is not None and waiting > available:
        raise ValueError(
            f"{_waiting(waiting, batch)} exceed the {available:,} bytes of host memory available; capture fewer "
            "layers or heads, or one half (batch='cond' or 'uncond')."
        )


def waiting_refusal(budget: int, waiting: int, batch) -> ValueError:
    """The refusal of a CPU budget that holds the tiles but not the tiles and ``waiting`` bytes together."""
    return ValueError(
        f"memory_budget={budget} bytes cannot hold {_waiting(waiting, batch)} beside the tiles; raise memory_budget "
        f"to at least {budget + waiting} bytes, capture fewer layers or heads, or one half (batch='cond' or 'uncond')."
    )
