"""Reducers: each folds exact attention-probability tiles of one layer call into one small result.

A reducer asks the engine for one of two things:

* ``rows``: exact probability rows ``P[i, :]`` for the query tokens ``i`` it lists, delivered to
  :meth:`Reducer.fold_rows` as tiles ``(h, r, S)``;
* ``key_groups``: for every query token, the sums of ``P[i, j]`` over keys ``j`` in each of its key
  groups, delivered to :meth:`Reducer.fold_pooled` as tiles ``(h, r, C)``. Key-pooled sums are what the
  engine can compute without forming P (attention applied to an indicator matrix, see docs/design.md);
* ``stat``: a row statistic, ``"entropy"`` (per query, delivered to :meth:`Reducer.fold_pooled` as
  ``(h, r, 1)``) or ``"received"`` (per key, column sums over every query, delivered to
  :meth:`Reducer.fold_received` as ``(h, S)`` partial sums), which the engine computes from row tiles
  or from fused passes with other value matrices (docs/design.md says why each is exact).

Every result is float32 with shape ``(B, H, ...)``; ``H`` is 1 when heads are averaged. To add a kind,
subclass :class:`Reducer`, give it its ``kind``, ``dims`` and ``unit``, implement ``shape`` and one
``fold_*`` method, and register it in ``REDUCERS``; plots, the store and ``estimate`` read the rest from
the class.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch

from .layout import KeyGroups, TokenLayout

__all__ = [
    "KeyGroups",
    "Reducer",
    "FullReducer",
    "FrameReducer",
    "VideoToTextReducer",
    "TextToVideoReducer",
    "QueryReducer",
    "QueryFrameReducer",
    "BlockReducer",
    "TileReducer",
    "EntropyReducer",
    "ReceivedReducer",
    "TopK",
    "TopKReducer",
    "REDUCERS",
]


class Reducer:
    """Base class: one kind of result for one layer call.

    Args:
        layout (`TokenLayout`): the token layout of this call.
        num_heads (`int`): heads the engine delivers (the selected heads).
        mean_heads (`bool`): average over the delivered heads into a single head slot.
        queries (`torch.Tensor | None`): query token indices, for kinds that take them.
    """

    kind: ClassVar[str]
    dims: ClassVar[tuple[str, ...]]  # names of the per-item, per-head dimensions (after B and H)
    unit: ClassVar[str] = "attention probability"  # what an entry is (colour-bar label)
    rows: torch.Tensor | None = None  # query tokens whose full rows this kind needs
    key_groups: KeyGroups | None = None  # key pooling this kind needs for every query
    stat: ClassVar[str | None] = None  # "entropy" or "received": a row statistic the engine computes
    query_limit: int | None = None  # set by the engine per item: query rows from here on are never formed
    keep_float32: ClassVar[bool] = False  # stored in float32 whatever the storage dtype (indices)

    def __init__(
        self,
        layout: TokenLayout,
        num_heads: int,
        mean_heads: bool,
        queries: torch.Tensor | None = None,
        *,
        block_size: int = 128,
        topk: int = 32,
        tile_shape: tuple[int, int, int] = (4, 4, 4),
    ):
        self.layout = layout
        self.num_heads = num_heads
        self.mean_heads = mean_heads
        self.out_heads = 1 if mean_heads else num_heads
        self.block_size, self.topk, self.tile_shape = block_size, topk, tuple(tile_shape)

    @property
    def mean_rows(self) -> bool:
        """Whether :meth:`fold_rows` takes head-mean rows ``(1, r, S)`` (a statistic of the head-mean row)
        instead of each head's rows."""
        return False

    @staticmethod
    def unpack(tensor: torch.Tensor):
        """What ``get`` returns for a stored result (the tensor itself, but for ``topk``)."""
        return tensor

    @staticmethod
    def stored_index(index: tuple) -> tuple:
        """The index of the stored result that reads ``index`` of what ``get`` returns (the same, but for ``topk``)."""
        return index

    def from_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """The per-query values ``(h, r, C)`` this kind's :meth:`fold_pooled` takes, from exact rows
        ``probs`` ``(h, r, S)`` (the spot checks compare the fast methods with these)."""
        keys = self.key_groups
        if keys.single_keys:
            return probs.index_select(-1, keys.keys.to(probs.device))
        return probs @ keys.indicator(probs.shape[-1], device=probs.device)

    def shape(self, num_batch: int) -> tuple[int, ...]:
        """Shape of the result for ``num_batch`` selected batch items."""
        raise NotImplementedError

    def nbytes(self, num_batch: int) -> int:
        """Bytes of the float32 result."""
        return 4 * int(torch.Size(self.shape(num_batch)).numel())

    def fold_rows(self, out: torch.Tensor, h0: int, r0: int, probs: torch.Tensor) -> None:
        """Fold ``probs`` ``(h, r, S)``: heads ``h0:h0+h`` of rows ``self.rows[r0:r0+r]``, into ``out`` (one batch item)."""
        raise NotImplementedError

    def fold_pooled(self, out: torch.Tensor, h0: int, r0: int, pooled: torch.Tensor) -> None:
        """Fold ``pooled`` ``(h, r, C)``: key-group sums of heads ``h0:h0+h``, query tokens ``r0:r0+r``."""
        raise NotImplementedError

    def fold_received(self, out: torch.Tensor, h0: int, sums: torch.Tensor) -> None:
        """Fold ``sums`` ``(h, S)``: column sums of heads ``h0:h0+h`` over some query rows (``received``)."""
        raise NotImplementedError

    def clear_unformed(self, out: torch.Tensor, limit: int) -> None:
        """Zero what ``out`` (one item) holds for the query rows from ``limit`` on, which the model never
        forms (Mochi's padded text): the kinds with a query axis hold 0 there."""
        if self.rows is not None:  # rows of the listed query tokens
            out[:, (self.rows >= limit).nonzero().flatten().to(out.device)] = 0
        elif self.stat == "entropy" or self.kind == "query_frame":  # every query token
            out[:, limit:] = 0

    def _accumulate(self, dest: torch.Tensor, h0: int, values: torch.Tensor) -> None:
        # dest: (H_out, ...) view of the result; values: (h, ...) for heads h0:h0+h.
        if self.mean_heads:  # one head (a CPU's row tiles) needs no temporary sum
            dest[0].add_(values[0] if values.shape[0] == 1 else values.sum(0), alpha=1.0 / self.num_heads)
        else:
            dest[h0 : h0 + values.shape[0]] += values


class FullReducer(Reducer):
    """``full``: ``(B, H, S, S)``, every ``P[i, j]``. Only for small sequences or when you mean it."""

    kind = "full"
    dims = ("query token", "key token")

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.seq_len)

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, self.layout.seq_len)

    def fold_rows(self, out, h0, r0, probs):
        self._accumulate(out[:, r0 : r0 + probs.shape[1]], h0, probs)


class QueryReducer(Reducer):
    """``query``: ``(B, H, Q, S)``, ``P[i, :]`` for the chosen query tokens ``i``."""

    kind = "query"
    dims = ("query", "key token")

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        if queries is None or len(queries) == 0:
            raise ValueError("kind 'query' needs `queries`: token indices or (frame, row, col) coordinates.")
        self.rows = queries

    def shape(self, num_batch):
        return (num_batch, self.out_heads, len(self.rows), self.layout.seq_len)

    def fold_rows(self, out, h0, r0, probs):
        self._accumulate(out[:, r0 : r0 + probs.shape[1]], h0, probs)


class TextToVideoReducer(Reducer):
    """``text_to_video``: ``(B, H, T, F, Hp, Wp)``, ``P[text query t, video key (f, y, x)]``."""

    kind = "text_to_video"
    dims = ("text token", "latent frame", "patch row", "patch column")

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.text_start, layout.text_start + layout.text_len)

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.text_len, *self.layout.grid)

    def fold_rows(self, out, h0, r0, probs):
        flat = out.view(self.out_heads, self.layout.text_len, self.layout.video_len)
        self._accumulate(flat[:, r0 : r0 + probs.shape[1]], h0, probs[..., self.layout.video_tokens])


class FrameReducer(Reducer):
    """``frame``: ``(B, H, G, G)``, mean over queries in group g of ``Σ_{j in group h} P[i, j]``; rows sum to 1."""

    kind = "frame"
    dims = ("query group", "key group")
    unit = "attention mass (each query row sums to 1)"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.key_groups = self._groups()  # every token is a key; queries pool by the same groups
        self._pools: dict = {}  # (rows, query limit, device) → the groups the rows meet, their weights

    def _groups(self) -> KeyGroups:
        return KeyGroups(torch.arange(self.layout.seq_len), self.layout.group_of_token(), self.layout.num_groups)

    def shape(self, num_batch):
        G = self.key_groups.num_groups
        return (num_batch, self.out_heads, G, G)

    def _pool(self, r0: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups rows ``r0:end`` meet, and their ``(groups met, rows)`` weights in each group's mean: kept
        per row tile, which every head and layer reuses."""
        key = (r0, end, self.query_limit, str(device))
        if key not in self._pools:
            group = self.key_groups.groups
            formed = group[: self.query_limit]  # a query limit leaves out rows the model never forms
            counts = torch.bincount(formed, minlength=self.key_groups.num_groups).clamp_(min=1)
            met, inverse = torch.unique(group[r0:end], return_inverse=True)
            pool = torch.zeros(len(met), end - r0).scatter_(0, inverse[None], (1.0 / counts[group[r0:end]])[None])
            self._pools[key] = (met.to(device), pool.to(device))
        return self._pools[key]

    def fold_pooled(self, out, h0, r0, pooled):
        # A weight matrix, not slices: a 3-D tile's rows are no run of tokens; deterministic, no (G, G) temporary.
        end = r0 + pooled.shape[1] if self.query_limit is None else min(r0 + pooled.shape[1], self.query_limit)
        if end <= r0:
            return
        met, pool = self._pool(r0, end, pooled.device)
        means = pool.to(pooled.dtype) @ pooled[:, : end - r0]  # (h, groups met, G)
        if self.mean_heads:
            out[0, met] += means.sum(0) / self.num_heads
        else:
            out[h0 : h0 + means.shape[0], met] += means


class BlockReducer(FrameReducer):
    """``block``: ``(B, H, N, N)``, ``N = ⌈S / block_size⌉``: mean over queries in block m of
    ``Σ_{j in block n} P[i, j]``; blocks are runs of ``block_size`` tokens from token 0 (text included, the
    last may be shorter); rows sum to 1."""

    kind = "block"
    dims = ("query block", "key block")

    def _groups(self) -> KeyGroups:
        S, size = self.layout.seq_len, self.block_size
        return KeyGroups(torch.arange(S), torch.arange(S) // size, math.ceil(S / size))


class TileReducer(FrameReducer):
    """``tile``: ``(B, H, N, N)``: group 0 the text (where the sequence has text), then the video's 3-D tiles of
    ``tile_shape`` (latent frames, patch rows, patch columns) in (t, y, x) row-major order, the edge tiles
    smaller (Sliding Tile Attention's and VSA's tiles); as ``frame`` otherwise, which ``(1, Hp, Wp)`` gives."""

    kind = "tile"
    dims = ("query tile", "key tile")

    def _groups(self) -> KeyGroups:
        group = self.layout.tile_of_token(self.tile_shape)
        return KeyGroups(torch.arange(self.layout.seq_len), group, int(group.max()) + 1)


class QueryFrameReducer(Reducer):
    """``query_frame``: ``(B, H, S, G)``, ``Σ_{j in group g} P[i, j]`` for every query token; rows sum to 1."""

    kind = "query_frame"
    dims = ("query token", "key group")
    unit = "attention mass (each query row sums to 1)"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.key_groups = KeyGroups(torch.arange(layout.seq_len), layout.group_of_token(), layout.num_groups)

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, self.layout.num_groups)

    def fold_pooled(self, out, h0, r0, pooled):
        self._accumulate(out[:, r0 : r0 + pooled.shape[1]], h0, pooled)


class EntropyReducer(Reducer):
    """``entropy``: ``(B, H, S)``, ``−Σ_j P[i, j] ln P[i, j]`` in nats for every query token."""

    kind = "entropy"
    dims = ("query token",)
    unit = "entropy (nats)"
    stat = "entropy"

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len)

    def from_rows(self, probs):
        return -torch.special.xlogy(probs, probs).sum(-1, keepdim=True)

    def fold_pooled(self, out, h0, r0, pooled):
        self._accumulate(out[:, r0 : r0 + pooled.shape[1]], h0, pooled[..., 0])


class ReceivedReducer(Reducer):
    """``received``: ``(B, H, S)``, ``Σ_i P[i, j]`` over every query token for every key token (sums to S)."""

    kind = "received"
    dims = ("key token",)
    unit = "attention received (sums to S)"
    stat = "received"

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len)

    def fold_received(self, out, h0, sums):
        self._accumulate(out, h0, sums)


class TopK(NamedTuple):
    """``topk`` as ``get`` returns it: ``values`` ``(B, H, S, k)`` float32, largest first, and the key
    tokens ``indices`` ``(B, H, S, k)`` int64."""

    values: torch.Tensor
    indices: torch.Tensor


class TopKReducer(Reducer):
    """``topk``: the k largest ``P[i, j]`` of every query row and their key tokens, stored as ``(B, H, S, k, 2)``
    float32 (values, indices: exact below 2²⁴ tokens) and read back as a :class:`TopK`. With heads averaged,
    of the head-mean row."""

    kind = "topk"
    dims = ("query token", "rank", "value, key token")
    keep_float32 = True

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.seq_len)
        self.k = min(self.topk, layout.seq_len)

    @property
    def mean_rows(self) -> bool:
        return self.mean_heads

    @staticmethod
    def unpack(tensor):
        return TopK(tensor[..., 0], tensor[..., 1].long())

    @staticmethod
    def stored_index(index):
        axes = [i for i in index if i is not Ellipsis]
        if len(axes) > 4:
            raise ValueError(
                f"index={index!r} has {len(axes)} entries, but topk reads as values and key indices of shape "
                "(B, H, S, k); index at most those 4 axes (index=(b, h, i, 0): row i's largest) and take `.values` "
                "or `.indices` of the result."
            )
        return (*index, slice(None))  # the stored (value, key token) axis is read whole

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, self.k, 2)

    def fold_rows(self, out, h0, r0, probs):
        h, r, _ = probs.shape  # with heads averaged: the head-mean rows (1, r, S)
        values, indices = probs.topk(self.k, dim=-1)  # sorted, largest first
        dest = out[h0 : h0 + h, r0 : r0 + r]
        dest[..., 0] = values
        dest[..., 1] = indices.to(values.dtype)


class VideoToTextReducer(Reducer):
    """``video_to_text``: ``(B, H, T, F, Hp, Wp)``, ``P[video query (f, y, x), text key t]``."""

    kind = "video_to_text"
    dims = ("text token", "latent frame", "patch row", "patch column")

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        T = layout.text_len
        self.key_groups = KeyGroups(torch.arange(layout.text_start, layout.text_start + T), torch.arange(T), T)

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.text_len, *self.layout.grid)

    def fold_pooled(self, out, h0, r0, pooled):
        video = self.layout.video_tokens
        start, end = (
            max(r0, video.start),
            min(r0 + pooled.shape[1], video.stop),
        )  # text queries are not part of this kind
        if start >= end:
            return
        part = pooled[:, start - r0 : end - r0].transpose(1, 2)  # (h, T, r')
        flat = out.view(self.out_heads, self.layout.text_len, self.layout.video_len)
        self._accumulate(flat[:, :, start - video.start : end - video.start], h0, part)

    def clear_unformed(self, out, limit):
        flat = out.view(self.out_heads, self.layout.text_len, self.layout.video_len)  # its queries: the video
        flat[:, :, max(0, limit - self.layout.video_start) :] = 0


REDUCERS: dict[str, type[Reducer]] = {
    cls.kind: cls
    for cls in (
        FullReducer,
        FrameReducer,
        VideoToTextReducer,
        TextToVideoReducer,
        QueryReducer,
        EntropyReducer,
        ReceivedReducer,
        QueryFrameReducer,
        BlockReducer,
        TileReducer,
        TopKReducer,
    )
}
