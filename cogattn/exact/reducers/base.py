"""The base class of every kind: what it asks the engine for, and how it folds what it gets."""

from __future__ import annotations

from typing import ClassVar

import torch

from ...layout import TokenLayout
from ..key_groups import KeyGroups

__all__ = ["Reducer"]


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
    multi_key: ClassVar[bool] = False  # pools every query's keys in groups of several (frame, block, tile, ...)
    needs_value: ClassVar[bool] = False  # folds the attention's values V too (the engine sets ``value``)
    value = None  # set by the engine per item when ``needs_value``: the values' selected heads (a HeadView)
    # set by the engine during a row pass: ``scores(h0, h1, rows)``, float32 scores (h, r, S) of query rows (an index
    # tensor), masked as the tiles are, for the few rows whose float32 probabilities lost what a kind needs
    scores = None

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
        patterns: tuple = (),
        top_p: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99),
    ):
        self.layout = layout
        self.num_heads = num_heads
        self.mean_heads = mean_heads
        self.out_heads = 1 if mean_heads else num_heads
        self.block_size, self.topk, self.tile_shape = block_size, topk, tuple(tile_shape)
        self.top_p = tuple(top_p)  # top_p's masses p
        self.patterns = patterns  # pattern_recall's and pattern_error's (names, Pattern objects or callables)

    @property
    def mean_rows(self) -> bool:
        """Whether :meth:`fold_rows` takes head-mean rows ``(1, r, S)`` (a statistic of the head-mean row)
        instead of each head's rows."""
        return False

    @classmethod
    def stored_dtype(cls, storage: torch.dtype, mean_heads: bool = False) -> torch.dtype:
        """The dtype a run folder keeps this kind's records in, given its ``storage_dtype`` ``storage`` and whether
        heads were averaged: ``storage`` for probabilities and masses (most kinds); a kind of counts, of key indices
        or of values that pass float16's largest finite 65,504 says otherwise (docs/streaming.md's table)."""
        return storage

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

    def row_columns(self, seq_len: int, cpu: bool = True) -> int:
        """Float32 values per head and query row this kind holds while it folds a row tile, beyond the tile
        itself (the planner's and ``estimate``'s working set), on a CPU or a GPU (``top_p`` counts in
        another way on each): 0 for most kinds."""
        return 0

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
