"""Exact ``top_p`` counts of probability rows without sorting a row: for every row, the fewest entries whose
largest values sum to at least each share p of the row's own total (:func:`top_p_counts`, the ``top_p`` kind's
computation): a histogram of each row, then a sort of the few entries in the bins where each p is crossed.

p is a share of the row's float64 total, not of 1: a float32 probability row sums to 1 only within its rounding
(a peaked row, whose tail lies far below float32's epsilon, can sum to just above 1 and so reach 1 before its
smallest keys). Taking p of the row's own total, p = 1 is every key of nonzero probability and p < 1 does not
move with the row's rounding."""

from __future__ import annotations

import torch

__all__ = ["top_p_columns", "top_p_counts"]

_LOW = 0x2F800000  # the bits of 2⁻³²: the first histogram keeps one bin for every value below it
_ONE = 0x3F800000  # the bits of 1.0: a float32 ≥ 0 orders as its bits
_SORTED_SHARE = 16  # the sort path sorts the crossing bins' entries in chunks of at most 1/16 of a tile's
_CHUNK = 1 << 18  # entries of the tile per pass chunk (5 MiB of buffers, made once per call)


def top_p_columns(seq_len: int, cpu: bool = True) -> int:
    """The working memory of :func:`top_p_counts` per row of ``seq_len`` entries, in float32-sized columns. On a CPU:
    every entry's int32 bin, a chunk's int64 bins, float64 weights and byte marks (at most a row each), the
    crossing bins' entries with their positions, bins, bits, sort order and running sums at about 11 columns each,
    every entry at worst (near-uniform rows), per bin the float64 histogram, its counts, the bins' lookup and their
    indices, and per row its float64 total and its count of nonzero entries. On a GPU, the sort's: int64 bins, float64
    weights, int32 marks and the sorted share of the entries, and its float64 histograms."""
    if cpu:
        shift = _level1_shift(seq_len)
        return 17 * seq_len + 7 * ((_ONE >> shift) - (_LOW >> shift) + 2) + 3
    return 6 * seq_len + 13 * _bins(seq_len)[1]


def _level1_shift(seq_len: int) -> int:
    """The first histogram's shift of the float32 bits: ``2^(23 - shift)`` bins to an octave (up to 64: a factor
    2^(1/64) each), fewer for short rows, whose histogram would outweigh the row."""
    per_octave = 1 << max(0, min(6, (seq_len // 64).bit_length() - 1))
    return 23 - (per_octave.bit_length() - 1)


def top_p_counts(probs: torch.Tensor, ps: tuple[float, ...]) -> torch.Tensor:
    """For every row of ``probs`` ``(n, S)`` (float32, ≥ 0 and below 1 + 2⁻⁶), the fewest entries whose largest
    values sum to at least each ``p`` of ``ps`` times the row's float64 total: ``(n, len(ps))`` float32 counts
    (exact integers); p = 1 counts the nonzero entries, a row of zeros 0 for every p. Exact without sorting a row: a
    float32 ≥ 0 orders as its bits, so a histogram of its top bits finds the bin where p is crossed, and only that
    bin's entries are read again. On a CPU by chunks of rows, into buffers made once (:func:`_counts_in_chunks`:
    no page faults per tile); on a GPU in one go over the tile (:func:`_counts_by_sort`)."""
    if probs.device.type == "cpu":
        return _counts_in_chunks(probs, ps)
    return _counts_by_sort(probs, ps)


def _counts_in_chunks(probs: torch.Tensor, ps: tuple[float, ...]) -> torch.Tensor:
    """:func:`top_p_counts` on a CPU: for every row of ``probs`` ``(n, S)`` (float32, ≥ 0 and below 1 + 2⁻⁶), the
    fewest entries whose largest values sum to at least each ``p`` of ``ps`` times the row's float64 sum:
    ``(n, len(ps))`` float32 counts; p = 1 counts the nonzero entries, a row of zeros 0.

    Exact without sorting: a float32 ≥ 0 orders as its bits. A histogram of the top bits (up to 64 bins to an
    octave, one bin for all values below 2⁻³²) gives each bin's count and float64 mass; their cumulative sums from
    the top find, for each row and p, the bin where p is crossed, and the count and mass of every bin above it.
    Only the crossing bins' entries are read again, and sorted (:func:`_finish_by_sort`: a few percent of the
    entries at most in near-uniform rows, far fewer in peaked ones). The bins' count and mass are one float64
    sum of ``2 + x`` per entry: its integer part is exact (counts below 2⁵²), so ``count = floor(sum / 2)`` and
    ``mass = sum − 2·count`` (a bin's mass is below 2). The mass so carries the rounding of a sum whose magnitude is
    ``2·count``: below ``count · ulp(2·count) / 2`` per bin, about 1e-13 for a bin of 1000 entries, 1e-9 for
    all masses above p together in the worst case (every entry above p in bins of thousands) and ~1e-12 in real
    rows; a full sort's float64 cumulative sum differs from the exact sum by as much. The row's total is its own
    float64 sum, taken in the same pass (the bins' total would carry the rounding of every bin, the lowest's of
    thousands of tiny entries, ~1e-10). Only a p within that of a cumulative sum's share of the total can get
    another count, far inside the 1e-6 at which float32 entries cannot tell. p = 1 is no search: its count is the
    row's nonzero entries, counted in the same pass."""
    n, S = probs.shape
    device = probs.device
    P = len(ps)
    shift = _level1_shift(S)
    top = _ONE >> shift  # the key of 1.0's bin; keys above (values ≥ 1 + 2⁻⁶) are clamped into it
    low = (_LOW >> shift) - 1  # the key of the bin of all values below 2⁻³²
    nbins = top - low + 1
    bits = probs.view(torch.int32)
    # Pass 1: every row's histogram, by chunks of rows (row-wise scatters and gathers, which torch runs on every
    # thread: a flat index_add_ runs on one, at twice the time per entry), keeping each entry's bin for pass 2
    rows = max(1, min(n, _CHUNK // S))
    keys = torch.empty(n, S, dtype=torch.int32, device=device)  # each entry's bin, counted from the top: 0 holds 1.0
    bins = torch.empty(rows, S, dtype=torch.int64, device=device)  # a chunk's bins as an index
    weights = torch.empty(rows, S, dtype=torch.float64, device=device)
    hist = torch.zeros(n, nbins, dtype=torch.float64, device=device)
    total = torch.empty(n, 1, dtype=torch.float64, device=device)
    whole = [j for j, p in enumerate(ps) if p >= 1]  # p = 1: every nonzero entry, counted here
    nonzero = torch.empty(n if whole else 0, dtype=torch.int32, device=device)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        k = torch.bitwise_right_shift(bits[a:b], shift, out=keys[a:b]).clamp_(low, top).neg_().add_(top)
        w = weights[: b - a].copy_(probs[a:b])
        # the row's own float64 sum: the bins' 2 + x sums round by up to ulp(2·count) / 2 per entry, ~1e-10 over a
        # row's many tiny entries, which would move p · total past several of the smallest keys near p = 1
        torch.sum(w, 1, keepdim=True, out=total[a:b])
        w.add_(2.0)  # float64: 2 + x exactly (x ≥ 2⁻²⁹; below, lost under 2⁻⁵²)
        hist[a:b].scatter_add_(1, bins[: b - a].copy_(k), w)
        if whole:
            nonzero[a:b] = (probs[a:b] > 0).sum(-1, dtype=torch.int32)
    del weights
    count = hist.mul(0.5).floor_()
    mass = hist.sub_(count, alpha=2)
    above_mass = mass.cumsum_(1)  # [d]: the mass of the top d + 1 bins
    above_count = count.cumsum_(1)  # float64 sums of integers: exact
    targets = _targets(total, ps, above_mass[:, -1:])
    cross = torch.searchsorted(above_mass, targets)  # (n, P): p's bin, nbins for p = 1 and rows of zeros
    reached = cross < nbins
    before = (cross - 1).clamp_(0, nbins - 1)
    first = cross == 0
    rest = targets - torch.where(first, 0.0, above_mass.gather(1, before))  # the mass p still needs in its bin
    done = torch.where(first, 0.0, above_count.gather(1, before))  # the entries above its bin
    del above_mass, above_count, count, mass, hist
    # The queries (row, p) that reach p, and the bins they cross in: the segments refined, each once.
    q_row, q_p = reached.nonzero(as_tuple=True)
    counts = torch.zeros(n, P, dtype=torch.float32, device=device)
    if q_row.numel():
        q_rest, q_done = rest[q_row, q_p], done[q_row, q_p]
        seg_keys, q_seg = torch.unique(q_row * nbins + cross[q_row, q_p], return_inverse=True)
        # Pass 2: the entries of the crossing bins (a row-wise lookup of their bins), their positions and segments
        lut = torch.zeros(n, nbins, dtype=torch.uint8, device=device)
        lut.view(-1)[seg_keys] = 1
        seg_of = torch.zeros(n * nbins, dtype=torch.int64, device=device)
        seg_of[seg_keys] = torch.arange(seg_keys.numel(), device=device)
        e_at, row_bin = [], []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            k = bins[: b - a].copy_(keys[a:b])
            at = lut[a:b].gather(1, k).view(-1).nonzero().squeeze(1)
            row_bin.append(k.view(-1).index_select(0, at).add_(at.div(S, rounding_mode="floor").add_(a).mul_(nbins)))
            e_at.append(at.add_(a * S))
        del lut, bins, keys
        e_at = torch.cat(e_at)
        e_seg = seg_of.index_select(0, torch.cat(row_bin))
        e_bits = bits.reshape(-1).index_select(0, e_at).long()
        e_val = probs.reshape(-1).index_select(0, e_at)
        del e_at, seg_of, row_bin
        q_out = _finish_by_sort(e_bits, e_val, e_seg, seg_keys.numel(), q_seg, q_rest, q_done)
        counts[q_row, q_p] = q_out.float()
    if whole:  # a row of zeros, which reaches no p, holds 0 as it was made
        counts[:, whole] = nonzero[:, None].float()
    return counts


def _targets(total: torch.Tensor, ps: tuple[float, ...], binned: torch.Tensor) -> torch.Tensor:
    """``(n, len(ps))`` float64: the mass each row's largest entries must reach for each p, p times the row's
    ``total`` ``(n, 1)`` and at most its bins' sum ``binned`` ``(n, 1)`` (a total summed more exactly than the bins
    may pass theirs by ~1e-10); infinite (never reached: no search) for p = 1, which counts the nonzero entries, and
    for a row of zeros, which needs no entry."""
    p = torch.tensor(ps, dtype=torch.float64, device=total.device)
    return torch.where((p < 1) & (total > 0), (total * p).minimum(binned), torch.inf)


def _finish_by_sort(e_bits, e_val, e_seg, nseg, q_seg, q_rest, q_done) -> torch.Tensor:
    """Where inside its crossing bin each query reaches the mass ``q_rest`` it still needs: the bins' entries (bits
    ``e_bits``, values ``e_val``, bin ``e_seg`` of ``nseg``) sorted by bin and then largest first, one float64
    cumulative sum, and for each query the entries of its bin ``q_seg`` whose running sum stays below its rest,
    plus the one that reaches it (at most the bin's entries: a float64 sum in another order can leave the bin a
    hair short). Returns each query's count: ``q_done`` plus the entries it takes."""
    order = (e_seg << 31).add_(0x7FFFFFFF - e_bits).argsort()  # a float32 ≥ 0 orders as its bits, below 2³¹
    csum = e_val.index_select(0, order).double().cumsum_(0)
    in_bin = torch.bincount(e_seg, minlength=nseg)
    start = in_bin.cumsum(0) - in_bin  # each bin's first entry in the sorted entries
    base = torch.cat([csum.new_zeros(1), csum]).index_select(0, start)  # the running sum before it
    q_start = start.index_select(0, q_seg)
    short = torch.searchsorted(csum, base.index_select(0, q_seg) + q_rest) - q_start  # running sums below the rest
    return q_done + torch.minimum(short + 1, in_bin.index_select(0, q_seg)).double()


def _bins(seq_len: int) -> tuple[int, int]:
    """The histogram for rows of ``seq_len``: ``(shift, bins)``, bins ``2^(23 - shift)`` to an octave of values
    (up to 16: a factor 2^(1/16) each) for the 32 octaves from 2⁻³² to 1, and one bin below them; fewer for
    short rows, whose histogram would outweigh the row."""
    per_octave = 1 << max(0, min(4, (seq_len // 256).bit_length() - 1))
    return 23 - per_octave.bit_length() + 1, 32 * per_octave + 2


def _counts_by_sort(probs: torch.Tensor, ps: tuple[float, ...]) -> torch.Tensor:
    """:func:`top_p_counts` on a GPU: for every row of ``probs`` ``(n, S)`` (float32, ≥ 0), the fewest entries whose
    largest values sum to at least each ``p`` of ``ps`` times the row's total (its float64 histogram's):
    ``(n, len(ps))`` float32 counts; p = 1 counts the nonzero entries, a row of zeros 0.

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
    targets = _targets(above_mass[:, -1:], ps, above_mass[:, -1:])
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
            _within_bins(probs[a:b], marked, mass_before[a:b], count_before[a:b], targets[a:b], counts[a:b])
    del bins
    if not bool(reached.all()):  # p = 1 and rows of zeros: their nonzero entries (0 in a row of zeros)
        nonzero = (probs > 0).sum(-1).float()
        counts.copy_(torch.where(reached, counts, nonzero[:, None]))
    return counts


def _within_bins(probs, marked, mass_before, count_before, targets, counts) -> None:
    """Where inside its crossing bin each row reaches each of its ``targets`` ``(n, P)``: the entries ``marked`` (bit
    j for p j) sorted by their bits, largest first, and summed on from ``mass_before``; writes ``counts`` ``(n, P)``."""
    n = probs.shape[0]
    bits = probs.view(torch.int32)
    all_rows, all_cols = marked.nonzero(as_tuple=True)
    all_flags = marked[all_rows, all_cols]
    for j in range(targets.shape[1]):
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
        short = mass_before[rows, j] + (csum - base[rows]) < targets[rows, j]  # the entries taken before it
        need = torch.minimum(torch.bincount(rows, weights=short.double(), minlength=n).long() + 1, in_bin)
        counts[:, j] = (count_before[:, j] + need).float()
