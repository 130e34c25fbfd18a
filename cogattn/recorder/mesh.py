"""Recording under diffusers' context parallelism: one generation split over the processes of a ring × Ulysses mesh
(``transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=R, ulysses_degree=U))``).

diffusers' hooks split the hidden states along the sequence over the mesh flattened (ring, Ulysses) row-major, so
each rank's processors see q and k of one contiguous slice of the tokens, all heads. :class:`Mesh` makes the maps
exact whatever the split: the selected heads are dealt out over the ranks in consecutive parts, and one all-to-all
per call (:meth:`Mesh.exchange`, as Ulysses exchanges q, k and v) gives each rank every token of its part's heads,
so each rank's kinds are the single-process ones of its heads, computed by the same engine. Rank 0 then puts the
parts together (:meth:`Mesh.combine`): a per-head result's heads gathered in order, a head mean summed with each
part weighted by its heads. A kind of the head-mean row (``topk``, ``frame_max`` with ``heads="mean"``) needs every
head of a row at once: rank 0 takes all the heads of those (:meth:`Mesh.parts` with ``whole``). Rank 0 holds the
results and writes the run; the other ranks hold and write nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CHECKED_FAMILIES",
    "ElsewhereStore",
    "Mesh",
    "distributed",
    "exchange_bytes",
    "find_mesh",
    "no_context_heads",
    "no_heads",
]

# The families whose context-parallel runs are checked against the reference (tests/test_context_parallel.py). The
# others with a plan stay refused, each for what diffusers' own CP run of its tiny model did, without cogattn
# (docs/many-gpus.md): LTX-Video's and Helios' videos differ from the single-process run's (by 0.29 and 0.27: the
# ring applies one slice's text mask to every slice's keys; Helios' cause not found), LTX-2's processor fails in its
# split rotary embedding.
CHECKED_FAMILIES = ("wan", "chronoedit")


@dataclass
class Mesh:
    """The context-parallel mesh of a recording's transformer.

    Args:
        group: the process group of the mesh flattened (ring, Ulysses), whose rank order is the order of the
            sequence's slices.
        rank (`int`): this process's rank in ``group``.
        size (`int`): the ranks, ``ring × ulysses``.
        ring (`int`), ulysses (`int`): the mesh's degrees.
        uneven (`bool`): the slices are ``tensor_split``'s (``ulysses_anything``/``ring_anything``), else equal.
    """

    group: object
    rank: int
    size: int
    ring: int
    ulysses: int
    uneven: bool = False
    _local: dict = field(default_factory=dict, repr=False)

    @property
    def writer(self) -> bool:
        """Whether this process holds the results and writes the run (rank 0 of the mesh)."""
        return self.rank == 0

    def asdict(self) -> dict:
        """What run.json says of the mesh."""
        return {"ring": self.ring, "ulysses": self.ulysses, "ranks": self.size}

    def slices(self, length: int) -> list[int]:
        """The tokens of each rank's slice of a sequence of ``length``, as diffusers' hooks split it."""
        if not self.uneven and length % self.size:
            raise RuntimeError(
                f"a sequence of {length} tokens does not split evenly over {self.size} ranks, as context parallelism "
                "splits it (ulysses_anything or ring_anything split any length)."
            )
        return [len(part) for part in torch.arange(length).tensor_split(self.size)]

    def parts(self, heads: tuple[int, ...], whole: bool = False) -> list[tuple[int, ...]]:
        """The selected ``heads`` dealt out over the ranks in consecutive parts (the first ranks one more where they
        do not divide); with ``whole``, all of them on rank 0."""
        if whole:
            return [tuple(heads)] + [()] * (self.size - 1)
        return [tuple(int(h) for h in part) for part in torch.tensor(heads, dtype=torch.long).tensor_split(self.size)]

    def sharded(self, x: torch.Tensor, length: int) -> bool:
        """Whether ``x`` ``(B, H, n, D)`` holds this rank's slice of a sequence of ``length`` (else all of it, as Wan's
        text keys are on every rank); `RuntimeError` where it is neither."""
        n = x.shape[2]
        if n == length:
            return False
        if n == self.slices(length)[self.rank]:
            return True
        raise RuntimeError(
            f"an attention got {n} tokens where its sequence has {length}: neither all of them nor this rank's slice "
            f"({self.slices(length)[self.rank]} of {self.size}); cogattn cannot put this split together exactly."
        )

    def full_length(self, n: int, lengths) -> int:
        """The one of ``lengths`` whose sequence gives this rank ``n`` tokens (all of them, or its slice)."""
        for length in lengths:
            splits = length >= self.size and (self.uneven or length % self.size == 0)
            if n == length or (splits and self.slices(length)[self.rank] == n):
                return length
        raise RuntimeError(f"an attention got {n} tokens: no sequence of {sorted(set(lengths))} splits so here.")

    def gather_tokens(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's slice of ``x`` ``(B, n)`` along its token axis, ``(B, length)``: one all-gather."""
        lengths = self.slices(length)
        buf = x.new_zeros(x.shape[0], max(lengths))
        buf[:, : x.shape[1]] = x
        parts = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat([p[:, :m] for p, m in zip(parts, lengths)], dim=1)

    def exchange(self, x: torch.Tensor, parts: list[tuple[int, ...]], length: int) -> torch.Tensor:
        """This rank's part of the heads of ``x`` ``(B, H, n, D)`` over every token, ``(B, h, length, D)``: one
        all-to-all of buffers padded to the largest part and slice (the equal sizes every backend takes); ``x``
        holding every token already (:meth:`sharded`) is indexed without communication."""
        mine = torch.tensor(parts[self.rank], dtype=torch.long, device=x.device)
        if not self.sharded(x, length):
            return x.index_select(1, mine)
        B, _, n, D = x.shape
        lengths, most = self.slices(length), max(len(p) for p in parts)
        sends = []
        for part in parts:
            buf = x.new_zeros(B, most, max(lengths), D)
            buf[:, : len(part), :n] = x[:, list(part)]
            sends.append(buf)
        received = [torch.empty_like(sends[0]) for _ in range(self.size)]
        dist.all_to_all(received, sends, group=self.group)
        h = len(parts[self.rank])
        return torch.cat([buf[:, :h, :m] for buf, m in zip(received, lengths)], dim=2)

    def budget_less_exchange(self, options, plan, model, calls_per_step: int = 1):
        """``options`` with a ``memory_budget`` less what this rank holds of a call's exchange (:func:`exchange_bytes`
        for ``plan``, the :class:`~cogattn.exact.planner.ModelShape` ``model``, the selected items of one of a step's
        ``calls_per_step`` calls); `ValueError` where that is all of it."""
        res, elem = plan.resolved, torch.empty((), dtype=model.dtype).element_size()
        items = max(1, -(-len(res.batch) // calls_per_step))
        held = exchange_bytes(len(res.heads), items, res.layout.seq_len, model.head_dim, elem, self.size, plan.reducers)
        if held >= options.memory_budget:
            raise ValueError(
                f"memory_budget={options.memory_budget:,} bytes holds less than a rank's exchange of q and k under "
                f"context parallelism ({held:,} bytes): raise it above that."
            )
        return dataclasses.replace(options, memory_budget=options.memory_budget - held)

    def settle(self, error: BaseException | None, what: str) -> None:
        """The ``error`` this rank met alone (`None`: none; its run folder, its disk, its plan), and every other rank's,
        raised on every rank: one gather, so that no rank waits in the generation's next collective for one that
        stopped. A rank raises its own error, the others a `RuntimeError` naming the first rank that met one; every
        rank calls this at the same point of the generation."""
        said = [None] * self.size
        dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}", group=self.group)
        first = next((rank for rank, text in enumerate(said) if text is not None), None)
        if first is None:
            return
        if error is not None:
            raise error
        raise RuntimeError(f"rank {first} of the context-parallel mesh {what}, so this rank stops too: {said[first]}")

    def guarded(self, device, compute, *args) -> tuple[list | None, Exception | None]:
        """``compute(*args)``'s results, `None` on every rank where it raised on any (its own memory, say): one small
        all-reduce, so that no rank waits for one that stopped in the collectives of the call's results. Returns
        ``(results or None, this rank's error or None)``."""
        try:
            results, error = compute(*args), None
        except Exception as err:
            results, error = None, err
        failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        return (None if failed.item() else results), error

    def local(self, reducer, heads: int):
        """A copy of ``reducer`` for this rank's ``heads`` of its selection (kept for the recording's life)."""
        key = (id(reducer), heads)
        if key not in self._local:
            red = copy.copy(reducer)
            red.num_heads, red.out_heads = heads, 1 if red.mean_heads else heads
            self._local[key] = (reducer, red)  # the original kept alive: its id stays its own
        return self._local[key][1]

    def combine(self, out: torch.Tensor, reducer, parts: list[tuple[int, ...]]) -> torch.Tensor | None:
        """The whole result on rank 0 (`None` elsewhere) from each rank's ``out`` ``(B, h, ...)`` of its part of the
        heads: per-head parts gathered in order, a head mean summed with each part weighted by its share of the
        heads; a part held whole by rank 0 (``parts`` with one non-empty part) needs nothing."""
        held = [len(p) for p in parts]
        if sum(h > 0 for h in held) == 1 and held[0]:
            return out if self.writer else None
        if reducer.mean_heads:
            total = out.float() * (held[self.rank] / sum(held)) if held[self.rank] else torch.zeros_like(out)
            dist.reduce(total, dst=self._root(), group=self.group)
            return total if self.writer else None
        most = max(held)
        padded = out if out.shape[1] == most else out.new_zeros(out.shape[0], most, *out.shape[2:])
        if padded is not out:
            padded[:, : out.shape[1]] = out
        # rank 0 receives every part into one buffer: (ranks, B, heads of the largest part, ...)
        received = padded.new_empty(self.size, *padded.shape) if self.writer else None
        dist.gather(padded.contiguous(), list(received) if self.writer else None, dst=self._root(), group=self.group)
        if not self.writer:
            return None
        if all(h == most for h in held):  # equal parts: one reshape
            return received.transpose(0, 1).flatten(1, 2)
        return torch.cat([part[:, :h] for part, h in zip(received, held)], dim=1)

    def _root(self) -> int:
        """Rank 0 of the mesh's group, as a global rank (what the collectives' ``dst`` names)."""
        return dist.get_global_rank(self.group, 0)


def exchange_bytes(heads: int, items: int, seq_len: int, head_dim: int, elem: int, ranks: int, reducers=()) -> int:
    """What a rank holds of one call's exchange over ``ranks``: q and k of every token of its part of ``heads`` (the
    largest part) for ``items`` batch items, and the buffers of the slice they cross in (as large again). With
    ``reducers`` (a plan's): every head where a kind of the head-mean row takes them all on rank 0
    (:meth:`Mesh.parts` with ``whole``), and the values too where a kind folds them (``pattern_error``)."""
    whole = any(r.mean_rows for r in reducers)
    tensors = 3 if any(r.needs_value for r in reducers) else 2
    return tensors * items * (heads if whole else -(-heads // ranks)) * seq_len * head_dim * elem * 2


def find_mesh(configs) -> Mesh | None:
    """The :class:`Mesh` of the first of ``configs`` (a transformer's or its processors' ``_parallel_config``) with a
    context-parallel degree above 1, `None` without one."""
    for config in filter(None, configs):
        cp = getattr(config, "context_parallel_config", config)
        ring, ulysses = (getattr(cp, "ring_degree", 1) or 1), (getattr(cp, "ulysses_degree", 1) or 1)
        if ring * ulysses > 1 and getattr(cp, "_flattened_mesh", None) is not None:
            group = cp._flattened_mesh.get_group()
            uneven = bool(getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False))
            return Mesh(group, dist.get_rank(group), ring * ulysses, ring, ulysses, uneven)
    return None


def distributed() -> bool:
    """Whether this process is one of several of ``torch.distributed`` (then a run folder waits for the first call,
    where a context-parallel mesh is known: its rank 0 alone writes)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ElsewhereStore:
    """The store of a rank other than 0 of a context-parallel mesh: rank 0 holds the results and writes the run; this
    one keeps nothing and says so when read."""

    def __init__(self, rank: int):
        self.rank = rank

    def put(self, kind: str, step: int, layer: int, timestep, tensor: torch.Tensor) -> None:
        pass

    def keys(self) -> list:
        return []

    def get(self, kind: str, step: int, layer: int):
        raise RuntimeError(
            f"this process is rank {self.rank} of the context-parallel mesh: rank 0 holds the results (and writes the "
            "run); read them there (rec.mesh.writer says which process holds them)."
        )

    def close(self, meta: dict | None = None) -> None:
        pass


def no_heads(plan, layer, query, key, reducers, *args) -> list[torch.Tensor]:
    """The results of a rank that holds none of the heads (``Capture._outs``' arguments, which :meth:`Mesh.guarded`
    passes on): zeros, which it sends in the call's collectives as every rank does."""
    return [query.new_zeros(r.shape(len(args[-2]))) for r in reducers]  # args[-2]: the items


def no_context_heads(query, key, items, reducers, *args) -> list[torch.Tensor]:
    """As :func:`no_heads`, for a cross-attention (``context_pass``' arguments)."""
    return [query.new_zeros(r.shape(len(items))) for r in reducers]
