"""The kinds made of exact probability rows: ``full``, ``query``, ``text_to_video``, ``topk``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import Reducer

__all__ = ["FullReducer", "QueryReducer", "TextToVideoReducer", "TopK", "TopKReducer", "pair_index"]


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
        grid = self.layout.grid_tokens  # its keys: the grid's (a history off the grid is left out)
        flat = out.view(self.out_heads, self.layout.text_len, grid.stop - grid.start)
        self._accumulate(flat[:, r0 : r0 + probs.shape[1]], h0, probs[..., grid])


class TopK(NamedTuple):
    """``topk`` as ``get`` returns it: ``values`` ``(B, H, S, k)`` float32, largest first, and the key
    tokens ``indices`` ``(B, H, S, k)`` int64."""

    values: torch.Tensor
    indices: torch.Tensor


def pair_index(index: tuple, kind: str, shape: str, example: str = "") -> tuple:
    """The index of a stored (..., 2) record of values and key tokens that reads ``index`` of what ``get``
    returns (``topk``, ``frame_max``): the (value, key token) axis is read whole."""
    axes = [i for i in index if i is not Ellipsis]
    if len(axes) > 4:
        raise ValueError(
            f"index={index!r} has {len(axes)} entries, but {kind} reads as values and key indices of shape {shape}; "
            f"index at most those 4 axes{example} and take `.values` or `.indices` of the result."
        )
    return (*index, slice(None))


class TopKReducer(Reducer):
    """``topk``: the k largest ``P[i, j]`` of every query row and their key tokens, stored as ``(B, H, S, k, 2)``
    float32 (values, indices: exact below 2²⁴ tokens) and read back as a :class:`TopK`. With heads averaged,
    of the head-mean row."""

    kind = "topk"
    dims = ("query token", "rank", "value, key token")

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.seq_len)
        self.k = min(self.topk, layout.seq_len)

    @property
    def mean_rows(self) -> bool:
        return self.mean_heads

    @classmethod
    def stored_dtype(cls, storage, mean_heads=False):
        return torch.float32  # values beside key indices, which float32 holds exactly below 2²⁴ tokens

    @staticmethod
    def unpack(tensor):
        return TopK(tensor[..., 0], tensor[..., 1].long())

    @staticmethod
    def stored_index(index):
        return pair_index(index, "topk", "(B, H, S, k)", " (index=(b, h, i, 0): row i's largest)")

    def row_columns(self, seq_len, cpu=True):
        return 4 * self.k  # values, int64 indices, their float copy

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, self.k, 2)

    def fold_rows(self, out, h0, r0, probs):
        h, r, _ = probs.shape  # with heads averaged: the head-mean rows (1, r, S)
        values, indices = probs.topk(self.k, dim=-1)  # sorted, largest first
        dest = out[h0 : h0 + h, r0 : r0 + r]
        dest[..., 0] = values
        dest[..., 1] = indices.to(values.dtype)
