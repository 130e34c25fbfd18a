"""The kinds that rank each row's keys: ``top_p`` (how many of the largest keys reach a mass p) and
``frame_max`` (the largest key of every frame group). Both need every score of a row: row tiles only."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import Reducer
from .rows import pair_index

__all__ = ["FrameMax", "FrameMaxReducer", "TopPReducer", "check_top_p", "top_p_counts"]

_ONE = 0x3F800000  # the bits of 1.0: a float32 ≥ 0 orders as its bits
_LOW = 0x2F800000  # the bits of 2⁻³²: the histogram keeps one bin for every value below it
_SORTED_SHARE = 16  # the crossing bins' entries are sorted in chunks of at most 1/16 of a tile's (top_p_counts)


def _bins(seq_len: int) -> tuple[int, int]:
    """The histogram for rows of ``seq_len``: ``(shift, bins)``, bins ``2^(23 - shift)`` to an octave of values
    (up to 16: a factor 2^(1/16) each) for the 32 octaves from 2⁻³² to 1, and one bin below them; fewer for
    short rows, whose histogram would outweigh the row."""
    per_octave = 1 << max(0, min(4, (seq_len // 256).bit_length() - 1))
    return 23 - per_octave.bit_length() + 1, 32 * per_octave + 2


def check_top_p(value) -> tuple[float, ...]:
    """The ``top_p`` option as a tuple of floats, each in (0, 1]; a bare number is one p. Raises `ValueError`
    naming the value otherwise."""
    values = (value,) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if (
        not isinstance(values, (list, tuple))
        or not values
        or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1 for p in values)
    ):
        raise ValueError(
            f"top_p={value!r}; pass masses p in (0, 1], e.g. (0.5, 0.9, 0.95, 0.99): top_p counts the fewest keys "
            "whose largest probabilities reach each p."
        )
    return tuple(float(p) for p in values)


def top_p_counts(probs: torch.Tensor, ps: tuple[float, ...]) -> torch.Tensor:
    """For every row of ``probs`` ``(n, S)`` (float32, ≥ 0), the fewest entries whose largest values sum to at
    least each ``p`` of ``ps``: ``(n, len(ps))`` float32 counts; a row that never reaches p (p = 1 and its
    float32 sum just below 1, or a row of zeros) counts its nonzero entries.

    Exact without sorting the row: a float32 ≥ 0 orders as its bits, so a histogram of the top bits (each
    bin's count and float64 mass) finds the bin where the descending cumulative mass crosses p, and only
    that bin's entries are sorted (by their bits) to find where inside it p is reached. The
    masses are float64 sums of the float32 entries, in another order than a sort's cumulative sum: they
    differ from it by about 1e-12, far below the entries' own float32 rounding."""
    n, S = probs.shape
    device = probs.device
    shift, nbins = _bins(S)
    bits = probs.view(torch.int32)
    # bin 0 holds everything below 2⁻³² (only p = 1 can need it); the clamp keeps a rounded 1 + ulp in the top bin
    bins = (((bits - _LOW) >> shift).clamp_(-1, nbins - 2) + 1).long()
    mass = torch.zeros(n, nbins, dtype=torch.float64, device=device).scatter_add_(1, bins, probs.double())
    ones = torch.ones(1, 1, dtype=torch.float64, device=device).expand(n, S)
    count = torch.zeros(n, nbins, dtype=torch.float64, device=device).scatter_add_(1, bins, ones)
    above_mass = mass.flip(-1).cumsum(-1)  # [i]: the mass of the top i + 1 bins
    above_count = count.flip(-1).cumsum(-1)  # float64 sums of ones: exact
    targets = torch.tensor(ps, dtype=torch.float64, device=device).expand(n, len(ps)).contiguous()
    top = torch.searchsorted(above_mass, targets)  # (n, P): how many top bins come before p's bin
    reached = top < nbins
    before = (top - 1).clamp(min=0, max=nbins - 1)
    mass_before = torch.where(top > 0, above_mass.gather(1, before), 0.0)
    count_before = torch.where(top > 0, above_count.gather(1, before), 0.0).long()
    # One pass marks the bins where each p is crossed (a bit per p: two p may cross in one bin).
    crossing = torch.where(reached, nbins - 1 - top, 0)
    flags = torch.zeros(n, nbins, dtype=torch.int32, device=device)
    for j in range(len(ps)):
        flags.scatter_add_(1, crossing[:, j : j + 1], (reached[:, j : j + 1] * (1 << j)).to(torch.int32))
    # Those bins' entries are sorted in chunks of rows holding at most 1/_SORTED_SHARE of the tile's entries (and
    # one row more), so that a row tile of near-uniform rows, whose entries fall in a few bins, stays in its budget.
    cap = max(S, n * S // _SORTED_SHARE)
    cum = (count * (flags != 0)).sum(1).cumsum(0).cpu()
    edges = torch.searchsorted(cum, torch.arange(cap, float(cum[-1]) + cap, cap, dtype=torch.float64), right=True)
    edges = [0, *sorted({min(int(e), n) for e in edges} - {0}), n]
    counts = torch.empty(n, len(ps), dtype=torch.float32, device=device)
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            marked = flags[a:b].gather(1, bins[a:b])
            _within_bins(probs[a:b], marked, mass_before[a:b], count_before[a:b], ps, counts[a:b])
    del bins
    if not bool(reached.all()):  # rows that never reach p: their nonzero entries
        missed = (~reached).any(1).nonzero().flatten()
        nonzero = (probs[missed] > 0).sum(-1).float()
        counts[missed] = torch.where(reached[missed], counts[missed], nonzero[:, None])
    return counts


def _within_bins(probs, marked, mass_before, count_before, ps, counts) -> None:
    """Where inside its crossing bin each row reaches each p: the entries ``marked`` (bit j for p j) sorted by their
    bits, largest first, and summed on from ``mass_before``; writes ``counts`` ``(n, len(ps))``."""
    n = probs.shape[0]
    bits = probs.view(torch.int32)
    all_rows, all_cols = marked.nonzero(as_tuple=True)
    all_flags = marked[all_rows, all_cols]
    for j, p in enumerate(ps):
        pick = (all_flags >> j) & 1 == 1
        rows, cols = all_rows[pick], all_cols[pick]
        del pick
        key = rows * (1 << 31) + (_ONE - bits[rows, cols])  # by row, then largest first
        order = key.argsort()
        del key
        rows, values = rows[order], probs[rows, cols][order].double()
        del cols, order
        in_bin = torch.bincount(rows, minlength=n)
        csum = values.cumsum(0)
        start = in_bin.cumsum(0) - in_bin  # each row's first entry in the sorted bin entries
        base = torch.cat([csum.new_zeros(1), csum])[start]  # the cumulative sum before each row's first
        short = mass_before[rows, j] + (csum - base[rows]) < p  # the bin's entries taken before p is reached
        need = torch.minimum(torch.bincount(rows, weights=short.double(), minlength=n).long() + 1, in_bin)
        counts[:, j] = (count_before[:, j] + need).float()


class TopPReducer(Reducer):
    """``top_p``: ``(B, H, S, len(top_p))``, for every query token and each p of ``top_p`` the fewest keys whose
    largest probabilities sum to at least p (NABLA's and XAttention's criterion; p = 1: the keys of nonzero
    float32 probability). Counts, exact integers; with heads averaged, the mean of the heads' counts."""

    kind = "top_p"
    dims = ("query token", "mass p")
    unit = "keys needed to reach mass p"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.seq_len)

    def row_columns(self, seq_len):
        # the int64 bins with the float64 weights, then with the int32 marks and the sorted share of the entries (a
        # CUDA sort's buffers included: about 20 columns of its entries); float64 histograms, their flips and sums
        return 6 * seq_len + 13 * _bins(seq_len)[1]

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, len(self.top_p))

    def fold_rows(self, out, h0, r0, probs):
        h, r, S = probs.shape
        counts = top_p_counts(probs.reshape(h * r, S), self.top_p).view(h, r, -1)
        self._accumulate(out[:, r0 : r0 + r], h0, counts)


class FrameMax(NamedTuple):
    """``frame_max`` as ``get`` returns it: ``values`` ``(B, H, S, G)`` float32, each query's largest probability
    in each frame group, and the key tokens ``indices`` ``(B, H, S, G)`` int64 where they are (−1 where no key
    of the group has attention: masked keys, rows the model never forms)."""

    values: torch.Tensor
    indices: torch.Tensor


class FrameMaxReducer(Reducer):
    """``frame_max``: for every query token, the largest ``P[i, j]`` over the keys j of each frame group (group 0
    the text where the sequence has text, then the latent frames) and the key token where it is (the first on
    a tie), stored as ``(B, H, S, G, 2)`` float32 (values, indices: exact below 2²⁴ tokens) and read back as a
    :class:`FrameMax`. DiffTrack's and DiTFlow's matching: each frame's highest-attention key. With heads
    averaged, of the head-mean row."""

    kind = "frame_max"
    dims = ("query token", "key group", "value, key token")
    keep_float32 = True

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        if layout.history_len:
            raise ValueError(
                f"kind 'frame_max' needs frame groups, but {layout.history_len} video tokens of this layout are off "
                "the latent grid (history latents); topk or query give those rows' largest keys."
            )
        self.rows = torch.arange(layout.seq_len)

    @property
    def mean_rows(self) -> bool:
        return self.mean_heads

    @staticmethod
    def unpack(tensor):
        return FrameMax(tensor[..., 0], tensor[..., 1].long())

    @staticmethod
    def stored_index(index):
        return pair_index(index, "frame_max", "(B, H, S, G)")

    def row_columns(self, seq_len):
        return 4 * self.layout.num_groups  # values and int64 indices per group

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len, self.layout.num_groups, 2)

    def fold_rows(self, out, h0, r0, probs):
        h, r, _ = probs.shape  # with heads averaged: the head-mean rows (1, r, S)
        lay = self.layout
        dest = out[h0 : h0 + h, r0 : r0 + r]
        grid = lay.grid_tokens
        values, indices = probs[..., grid].unflatten(-1, (lay.frames, lay.frame_tokens)).max(-1)
        first = grid.start + torch.arange(lay.frames, device=probs.device) * lay.frame_tokens
        dest[..., lay.text_groups :, 0] = values
        dest[..., lay.text_groups :, 1] = torch.where(values > 0, indices + first, -1).to(values.dtype)
        if lay.text_len:
            value, index = probs[..., lay.text_tokens].max(-1)
            dest[..., 0, 0] = value
            dest[..., 0, 1] = torch.where(value > 0, index + lay.text_start, -1).to(value.dtype)

    def clear_unformed(self, out, limit):
        out[:, limit:, :, 0] = 0
        out[:, limit:, :, 1] = -1  # no key of a row the model never forms has attention
