"""The kinds that measure token patterns (``cogattn.exact.patterns``) against the real attention, from exact rows:
``pattern_recall`` (the mass each pattern keeps) and ``pattern_error`` (the output error it causes)."""

from __future__ import annotations

import torch

from ..patterns import DEFAULT_PATTERNS, resolve
from .base import Reducer

__all__ = ["PatternErrorReducer", "PatternRecallReducer"]


class PatternRecallReducer(Reducer):
    """``pattern_recall``: ``(B, H, M)``, for each of the M ``patterns``, the mean over video queries i of
    ``Σ_j P[i, j]·mask(i, j)``, the attention mass the pattern keeps (1 keeps everything)."""

    kind = "pattern_recall"
    dims = ("pattern",)
    unit = "attention mass the pattern keeps"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.resolved = resolve(self.patterns or DEFAULT_PATTERNS, self.tile_shape)
        for pattern in self.resolved:  # before any block runs: a grid without positions, a callable that fails
            pattern.row_mask(layout, slice(0, 1))
        self.rows = torch.arange(layout.seq_len)  # every row: the one row pass every row kind shares
        self._masks: tuple = (None, [])  # (rows, device) → the patterns' masks of the last row tile

    @property
    def names(self) -> list[str]:
        """The patterns' labels, in the order of the result's last axis."""
        return [p.name for p in self.resolved]

    def shape(self, num_batch):
        return (num_batch, self.out_heads, len(self.resolved))

    def row_columns(self, seq_len):
        # the tile times one mask, and the tile's masks with two boolean temporaries (bool: a quarter of float32)
        return seq_len + (len(self.resolved) + 2) * -(-seq_len // 4)

    def clear_unformed(self, out, limit):
        pass  # a mean over video queries, which a query limit (Mochi's padded text) never cuts

    def _video_rows(self, r0: int, r: int) -> tuple[int, int]:
        """The video queries among rows ``r0:r0+r`` (every row is a query token in order), formed ones only."""
        grid = self.layout.grid_tokens
        end = min(r0 + r, grid.stop, self.layout.seq_len if self.query_limit is None else self.query_limit)
        return max(r0, grid.start), end

    def _row_masks(self, start: int, end: int, device) -> list[torch.Tensor]:
        # Each head of a CPU's row tiles meets the same rows again later; the last tile's masks are kept.
        key = (start, end, str(device))
        if self._masks[0] != key:
            self._masks = (key, [p.row_mask(self.layout, slice(start, end)).to(device) for p in self.resolved])
        return self._masks[1]

    def fold_rows(self, out, h0, r0, probs):
        start, end = self._video_rows(r0, probs.shape[1])
        if start >= end:
            return
        part, V = probs[:, start - r0 : end - r0], self.layout.frames * self.layout.frame_tokens
        rows = part.transpose(0, 1)  # (r, h, S), a view
        for m, mask in enumerate(self._row_masks(start, end, probs.device)):
            # each row's kept mass as a product with its mask (P·mask is not formed), then summed over the rows
            kept = torch.bmm(rows, mask.to(part.dtype).unsqueeze(-1))[..., 0].sum(0)  # (h,)
            self._accumulate(out[:, m], h0, kept / V)


class PatternErrorReducer(PatternRecallReducer):
    """``pattern_error``: ``(B, H, M)``, for each pattern, the mean over video queries and head dimensions of
    ``(O_pattern − O)²``: ``O = P·V`` the attention's output, ``O_pattern`` the softmax over the pattern's kept
    keys times V (P restricted to the mask and renormalised), Sparse VideoGen's criterion; needs V."""

    kind = "pattern_error"
    unit = "mean squared output error"
    needs_value = True

    def row_columns(self, seq_len):
        return super().row_columns(seq_len) + 2 * 128  # O and O_pattern of a row: 2 D, D at most 128

    def _values(self, h0: int, h: int) -> torch.Tensor:
        # The row pass runs every row tile of a head chunk before the next chunk: one float32 copy per chunk.
        if getattr(self, "_v_chunk", (None,))[0] != (id(self.value), h0, h):
            self._v_chunk = ((id(self.value), h0, h), self.value.chunk(h0, h0 + h))
        return self._v_chunk[1]

    def fold_rows(self, out, h0, r0, probs):
        start, end = self._video_rows(r0, probs.shape[1])
        if start >= end:
            return
        part, V = probs[:, start - r0 : end - r0], self.layout.frames * self.layout.frame_tokens
        values = self._values(h0, probs.shape[0])  # (h, S, D)
        output = torch.bmm(part, values)  # O = P·V, (h, r, D)
        kept = torch.empty_like(part)  # one buffer for every pattern's P·mask
        for m, mask in enumerate(self._row_masks(start, end, probs.device)):
            torch.mul(part, mask, out=kept)
            sparse = torch.bmm(kept, values).div_(kept.sum(-1, keepdim=True))
            error = sparse.sub_(output).square_().mean(-1)  # (h, r)
            self._accumulate(out[:, m], h0, error.sum(-1) / V)

    def release(self) -> None:
        """Drop the values of the last item (the engine calls it when the item is done)."""
        self.value, self._v_chunk = None, (None,)
