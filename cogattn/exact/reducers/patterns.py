"""The kinds that measure token patterns (``cogattn.exact.patterns``) against the real attention, from exact rows:
``pattern_recall`` (the mass each pattern keeps) and ``pattern_error`` (the output error it causes)."""

from __future__ import annotations

import torch

from ..patterns import DEFAULT_PATTERNS, resolve
from .base import Reducer

__all__ = ["NEGLIGIBLE_MASS", "PatternErrorReducer", "PatternRecallReducer"]

# A row's kept mass below which pattern_error renormalises from exact scores: above it, the kept probabilities below
# float32's 2⁻¹²⁶ (their absolute rounding ~2⁻¹⁵⁰ each) weigh under 2⁻³⁷ of it, even over 10⁵ kept keys.
NEGLIGIBLE_MASS = 2.0**-96


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

    def row_columns(self, seq_len, cpu=True):
        # the tile times one mask, and the tile's masks with two boolean temporaries (bool: a quarter of float32)
        return seq_len + (len(self.resolved) + 2) * -(-seq_len // 4)

    def clear_unformed(self, out, limit):
        pass  # a mean over video queries, which a query limit (Mochi's padded text) never cuts

    def _formed_video(self) -> int:
        """The video queries whose rows the model forms (all but where a query limit cuts the grid): the mean's."""
        grid = self.layout.grid_tokens
        return max(
            1, min(grid.stop, self.layout.seq_len if self.query_limit is None else self.query_limit) - grid.start
        )

    def _video_rows(self, r0: int, r: int) -> tuple[int, int]:
        """The video queries among rows ``r0:r0+r`` (every row is a query token in order), formed ones only."""
        grid = self.layout.grid_tokens
        end = min(r0 + r, grid.stop, self.layout.seq_len if self.query_limit is None else self.query_limit)
        return max(r0, grid.start), end

    def _row_masks(self, start: int, end: int, device) -> list[torch.Tensor | None]:
        # Each head of a CPU's row tiles meets the same rows again later; the last tile's masks are kept. A pattern
        # of whole frames or of one patch per frame needs none (_structured).
        key = (start, end, str(device))
        if self._masks[0] != key:
            masks = [
                None if p.frames is not None or p.same_patch else p.row_mask(self.layout, slice(start, end)).to(device)
                for p in self.resolved
            ]
            self._masks = (key, masks)
        return self._masks[1]

    def _structured(self, pattern, part, start: int, values=None):
        """The kept mass ``(h, r)`` of the video query rows ``part`` ``(h, r, S)`` (the first is token ``start``)
        and, given ``values`` ``(h, S, D)``, ``Σ_j P[i, j]·mask(i, j)·V[j]`` ``(h, r, D)``, for a pattern that keeps
        whole latent frames around the query's (runs of keys) or its patch in every frame (a key per frame), with
        every key off the grid (the text); no mask is formed."""
        lay = self.layout
        grid, FT, F = lay.grid_tokens, lay.frame_tokens, lay.frames
        outside = [s for s in (slice(0, grid.start), slice(grid.stop, lay.seq_len)) if s.stop > s.start]
        h, r, _ = part.shape
        kept = part.new_zeros(h, r)
        summed = None if values is None else part.new_zeros(h, r, values.shape[-1])
        for keys in outside:
            kept += part[..., keys].sum(-1)
            if values is not None:
                summed.baddbmm_(part[..., keys], values[:, keys])
        video = torch.arange(start - grid.start, start - grid.start + r, device=part.device)  # (r,): grid index
        if pattern.same_patch:
            keys = grid.start + video[:, None] % FT + torch.arange(F, device=part.device) * FT  # (r, F)
            taken = part.gather(-1, keys.expand(h, r, F))
            kept += taken.sum(-1)
            if values is not None:
                summed += torch.einsum("hrf,hrfd->hrd", taken, values[:, keys])
            return kept, summed
        frame = video // FT
        for f in range(int(frame[0]), int(frame[-1]) + 1):  # the rows of each frame are a run
            rows = slice(int((frame < f).sum()), int((frame <= f).sum()))
            keys = slice(grid.start + max(0, f - pattern.frames) * FT, grid.start + min(F, f + pattern.frames + 1) * FT)
            kept[:, rows] += part[:, rows, keys].sum(-1)
            if values is not None:
                summed[:, rows].baddbmm_(part[:, rows, keys], values[:, keys])
        return kept, summed

    def fold_rows(self, out, h0, r0, probs):
        start, end = self._video_rows(r0, probs.shape[1])
        if start >= end:
            return
        part, V = probs[:, start - r0 : end - r0], self._formed_video()
        rows = part.transpose(0, 1)  # (r, h, S), a view
        for m, (pattern, mask) in enumerate(zip(self.resolved, self._row_masks(start, end, probs.device))):
            if mask is None:
                kept = self._structured(pattern, part, start)[0].sum(-1)
            else:  # each row's kept mass as a product with its mask (P·mask is not formed), summed over the rows
                kept = torch.bmm(rows, mask.to(part.dtype).unsqueeze(-1))[..., 0].sum(0)  # (h,)
            self._accumulate(out[:, m], h0, kept / V)


class PatternErrorReducer(PatternRecallReducer):
    """``pattern_error``: ``(B, H, M)``, for each pattern, the mean over video queries and head dimensions of
    ``(O_pattern − O)²``: ``O = P·V`` the attention's output, ``O_pattern`` the softmax over the pattern's kept
    keys times V (P restricted to the mask and renormalised), Sparse VideoGen's criterion; needs V."""

    kind = "pattern_error"
    unit = "mean squared output error"
    needs_value = True

    @classmethod
    def stored_dtype(cls, storage, mean_heads=False):
        # squares of the model's values: any size, above float16's 65,504 or far below its 6.1e-5 (subnormals)
        return torch.float32 if storage == torch.float16 else storage

    def row_columns(self, seq_len, cpu=True):
        return super().row_columns(seq_len, cpu) + 2 * 128  # O and O_pattern of a row: 2 D, D at most 128

    def _values(self, h0: int, h: int) -> torch.Tensor:
        # The row pass runs every row tile of a head chunk before the next chunk: one float32 copy per chunk.
        if getattr(self, "_v_chunk", (None,))[0] != (id(self.value), h0, h):
            self._v_chunk = ((id(self.value), h0, h), self.value.chunk(h0, h0 + h))
        return self._v_chunk[1]

    def fold_rows(self, out, h0, r0, probs):
        start, end = self._video_rows(r0, probs.shape[1])
        if start >= end:
            return
        part, V = probs[:, start - r0 : end - r0], self._formed_video()
        values = self._values(h0, probs.shape[0])  # (h, S, D)
        output = torch.bmm(part, values)  # O = P·V, (h, r, D)
        kept = None  # one buffer for every masked pattern's P·mask, and the scores of the rows rescued
        for m, (pattern, mask) in enumerate(zip(self.resolved, self._row_masks(start, end, probs.device))):
            if mask is None:
                mass, summed = self._structured(pattern, part, start, values)
            else:
                kept = torch.empty_like(part) if kept is None else kept
                torch.mul(part, mask, out=kept)
                mass, summed = kept.sum(-1), torch.bmm(kept, values)
            o_pattern = summed.div_(mass[..., None])  # P restricted to the mask, renormalised
            # (h, r): a kept mass so small that subnormal (or underflowed) kept probabilities weigh in it, which its
            # renormalisation would magnify: from the exact scores (a device sync, as _structured's)
            lost = mass < NEGLIGIBLE_MASS
            if bool(lost.any()):
                kept = torch.empty_like(part) if kept is None else kept
                self._renormalise_lost(o_pattern, lost, pattern, h0, start, values, kept)
            error = o_pattern.sub_(output).square_().mean(-1)  # (h, r)
            self._accumulate(out[:, m], h0, error.sum(-1) / V)

    def _renormalise_lost(self, o_pattern, lost, pattern, h0: int, start: int, values, buffer) -> None:
        """O_pattern ``(h, r, D)`` of the rows whose kept mass is below :data:`NEGLIGIBLE_MASS` (kept logits ~66 or more
        below the row's largest: float32 keeps a kept probability below 2⁻¹²⁶ with few bits, or none, and P·mask
        renormalises their rounding, or 0 / 0), in place, from their exact scores
        (``Reducer.scores``, written into ``buffer``, the tile's P·mask buffer, which the plan counts): the softmax
        over the pattern's kept keys times V."""
        rows = lost.any(0).nonzero().squeeze(1)  # the tile's rows lost for some head
        h, n, S = lost.shape[0], len(rows), buffer.shape[-1]
        scores = self.scores(h0, h0 + h, rows + start, out=buffer.view(-1)[: h * n * S].view(h, n, S))
        keep = pattern.row_mask(self.layout, (rows + start).cpu()).to(scores.device)  # (n, S)
        scores.masked_fill_(keep.logical_not_(), -torch.inf).sub_(scores.amax(-1, keepdim=True)).exp_()  # in place
        exact = torch.bmm(scores.div_(scores.sum(-1, keepdim=True)), values)  # (h, n, D)
        o_pattern[:, rows] = torch.where(lost[:, rows, None], exact, o_pattern[:, rows])

    def release(self) -> None:
        """Drop the values of the last item (the engine calls it when the item is done)."""
        self.value, self._v_chunk = None, (None,)
