"""The kind of attention by relative position: ``offset``, the mass on video keys at each offset (Δt, Δy, Δx)
from a video query, averaged over the video queries (the decay of attention over time and space)."""

from __future__ import annotations

import torch

from .base import Reducer

__all__ = ["OffsetReducer"]


class OffsetReducer(Reducer):
    """``offset``: ``(B, H, 2F−1, 2Hp−1, 2Wp−1)``, the mean over video queries i of the attention mass on the
    video keys j at offset ``(f_j − f_i, y_j − y_i, x_j − x_i)``, at index ``[Δf + F − 1, Δy + Hp − 1, Δx + Wp − 1]``.

    With the mean mass on the text keys (not in the array) it sums to 1; without text in the sequence (Wan's
    self-attention) it sums to 1 alone. From exact rows: each video query's row, as an ``(F, Hp, Wp)`` grid of
    keys, is added to the window of the result that starts at the query's own offset ``(F − 1 − f_i, Hp − 1 − y_i,
    Wp − 1 − x_i)``, by whole lines of queries (Wp of one row of a frame) where a tile holds them
    (:meth:`_fold_lines`: the columns first, Wp shifted adds over the tile, then an add a line: a GPU launch a line,
    not a row), the lines a tile cuts a row at a time; no index tensor (a scatter with an index per entry is about
    ten times slower on a CPU).
    """

    kind = "offset"
    dims = ("frame offset", "row offset", "column offset")
    unit = "attention mass (mean over video queries)"  # with the text's mass, it sums to 1

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        if layout.history_len:
            raise ValueError(
                f"kind 'offset' needs every video token on the latent grid, but {layout.history_len} video tokens "
                "of this layout are off it (history latents, or keyframe and reference tokens); 'full' or 'query' give their rows."
            )
        self.rows = torch.arange(layout.seq_len)  # every row: the pass is shared with the other row kinds

    def shape(self, num_batch):
        F, Hp, Wp = self.layout.grid
        return (num_batch, self.out_heads, 2 * F - 1, 2 * Hp - 1, 2 * Wp - 1)

    def clear_unformed(self, out, limit):
        pass  # no query axis: rows the model never forms are not folded, and the mean is over the formed ones

    def _video_rows(self) -> tuple[int, int]:
        """The video query tokens whose rows are formed: ``[start, stop)``."""
        grid = self.layout.grid_tokens
        stop = grid.stop if self.query_limit is None else min(grid.stop, self.query_limit)
        return grid.start, max(grid.start, stop)

    def row_columns(self, seq_len: int, cpu: bool = True) -> int:
        """Per row of a tile, the column offsets of its line :meth:`_fold_lines` holds (about 2/Wp of the row's
        video keys), twice with heads averaged (their sum over the heads as well); none with one column."""
        F, Hp, Wp = self.layout.grid
        return 0 if Wp == 1 else -(-F * Hp * (2 * Wp - 1) // Wp) * (2 if self.mean_heads else 1)

    def fold_rows(self, out, h0, r0, probs):
        h, r, _ = probs.shape
        first, stop = self._video_rows()
        start, end = max(r0, first), min(r0 + r, stop)
        if start >= end:
            return
        Wp = self.layout.grid[2]
        scale = 1.0 / (stop - first) / (self.num_heads if self.mean_heads else 1)
        keys = probs[..., self.layout.grid_tokens]  # (h, r, V): the video keys of the tile's rows
        dest = out[:1] if self.mean_heads else out[h0 : h0 + h]
        a = start + (first - start) % Wp  # the whole lines of patches (Wp queries of one row of a frame) in [a, b)
        b = max(a, end - (end - first) % Wp)
        if a < b and Wp > 1:  # (a line of one query gains nothing)
            self._fold_lines(dest, keys[:, a - r0 : b - r0], (a - first) // Wp, scale)
        else:
            a = b = end
        for token in [*range(start, min(a, end)), *range(max(b, start), end)]:  # the rest, a row at a time
            self._fold_row(dest, keys[:, token - r0], token - first, scale)

    def _fold_row(self, dest, keys, at: int, scale: float):
        """One video query's row ``keys`` ``(h, V)`` (video query ``at``) added to the window at its offset."""
        F, Hp, Wp = self.layout.grid
        f, rest = divmod(at, Hp * Wp)
        y, x = divmod(rest, Wp)
        row = keys.reshape(-1, F, Hp, Wp)
        if self.mean_heads and row.shape[0] > 1:
            row = row.sum(0, keepdim=True)
        dest[:, F - 1 - f : 2 * F - 1 - f, Hp - 1 - y : 2 * Hp - 1 - y, Wp - 1 - x : 2 * Wp - 1 - x].add_(
            row, alpha=scale
        )

    def _fold_lines(self, dest, keys, line0: int, scale: float):
        """The rows ``keys`` ``(h, n·Wp, V)`` of ``n`` whole lines from line ``line0`` (line = frame·Hp + y): the
        queries at column x add their keys at Δx = x_k − x (``Wp`` shifted adds over the tile), then each line its
        sums at its (Δf, Δy) window: about Wp + n operations a tile, not one a row. It holds the lines' column
        offsets alone (:meth:`row_columns`): nothing of the result's size."""
        F, Hp, Wp = self.layout.grid
        h, n = keys.shape[0], keys.shape[1] // Wp
        grid = keys.reshape(h, n, Wp, F, Hp, Wp)  # a view: lines × columns of queries, the keys as the grid
        lines = keys.new_zeros(h, n, F, Hp, 2 * Wp - 1)
        for x in range(Wp):
            lines[..., Wp - 1 - x : 2 * Wp - 1 - x] += grid[:, :, x]
        if self.mean_heads and h > 1:
            lines = lines.sum(0, keepdim=True)
        for i in range(n):
            f, y = divmod(line0 + i, Hp)
            dest[:, F - 1 - f : 2 * F - 1 - f, Hp - 1 - y : 2 * Hp - 1 - y].add_(lines[:, i], alpha=scale)
