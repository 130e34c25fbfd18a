"""The key-pooled kinds: sums of probabilities over groups of keys, for every query (``frame``, ``block``,
``tile``, ``query_frame``, ``video_to_text``)."""

from __future__ import annotations

import math

import torch

from ..key_groups import KeyGroups
from .base import Reducer

__all__ = ["BlockReducer", "FrameReducer", "QueryFrameReducer", "TileReducer", "VideoToTextReducer"]

FOLD_ROWS = 512  # query rows a pooled fold weighs at once, at least (see FrameReducer.fold_pooled)


class FrameReducer(Reducer):
    """``frame``: ``(B, H, G, G)``, mean over queries in group g of ``Σ_{j in group h} P[i, j]``; rows sum to 1."""

    multi_key = True
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
            weights = (1.0 / counts[group[r0:end]]).float()[None]
            pool = torch.zeros(len(met), end - r0, dtype=torch.float32).scatter_(0, inverse[None], weights)
            self._pools[key] = (met.to(device), pool.to(device))
        return self._pools[key]

    def fold_pooled(self, out, h0, r0, pooled):
        # A weight matrix, not slices: a 3-D tile's rows are no run of tokens; deterministic, no (G, G) temporary.
        # By runs of rows, of FOLD_ROWS at least and of FOLD_ROWS² weights at most: a run meets at most as many groups
        # as it has rows, so its weights (groups met × rows) and means (h × groups met × G) stay a small share of the
        # tile's however many groups (fine tiles, blocks), and a few groups (frames) take one run, one matmul.
        end = r0 + pooled.shape[1] if self.query_limit is None else min(r0 + pooled.shape[1], self.query_limit)
        run = max(FOLD_ROWS, FOLD_ROWS * FOLD_ROWS // self.key_groups.num_groups)
        for a in range(r0, end, run):
            b = min(end, a + run)
            met, pool = self._pool(a, b, pooled.device)
            means = pool.to(pooled.dtype) @ pooled[:, a - r0 : b - r0]  # (h, groups met, G)
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
        lay = self.layout
        group = lay.tile_of_token(self.tile_shape)
        boxes = (lay.text_tokens, lay.video_start, lay.grid, tuple(self.tile_shape))
        return KeyGroups(torch.arange(lay.seq_len), group, int(group.max()) + 1, boxes)


class QueryFrameReducer(Reducer):
    """``query_frame``: ``(B, H, S, G)``, ``Σ_{j in group g} P[i, j]`` for every query token; rows sum to 1."""

    multi_key = True
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
        grid = self.layout.grid_tokens  # text queries and a history off the grid are not part of this kind
        start, end = max(r0, grid.start), min(r0 + pooled.shape[1], grid.stop)
        if start >= end:
            return
        part = pooled[:, start - r0 : end - r0].transpose(1, 2)  # (h, T, r')
        flat = out.view(self.out_heads, self.layout.text_len, grid.stop - grid.start)
        self._accumulate(flat[:, :, start - grid.start : end - grid.start], h0, part)

    def clear_unformed(self, out, limit):
        grid = self.layout.grid_tokens  # its queries: the grid's
        flat = out.view(self.out_heads, self.layout.text_len, grid.stop - grid.start)
        flat[:, :, max(0, limit - grid.start) :] = 0
