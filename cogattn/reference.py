"""The naive reference every map is checked against: ``softmax(q @ k.T * scale)`` in float64, every kind
taken from it by plain indexing (the definitions in docs/design.md).

It forms the full S × S probabilities, so it is for small sequences only: the tests, and
``python -m cogattn.selftest``. It shares no code with the engine or the reducers (it takes only the
units of the bounds from :mod:`cogattn.exact.checks`).
"""

from __future__ import annotations

import functools
import math

import torch

from .exact.checks import error_units  # the units of the documented bounds: the spot checks' own

TOP_P_MARGIN = 1e-6  # how near p a row's cumulative share of its total may come and still count as either side
# p = 1: a probability at least 2^-148 is nonzero in float32 however it is computed, one below 2^-152 is 0; between
# (float32's least subnormal is 2^-149), float32 rounds P to 0 or computes it as nonzero by its rounding of q·k
SUBNORMAL_EDGE = (-148, -152)

__all__ = [
    "kind_error",
    "naive_audio",
    "naive_context",
    "naive_kind",
    "naive_lse",
    "naive_pattern",
    "naive_probs",
    "select",
    "worst",
]


def worst(*errors: float) -> float:
    """The largest of ``errors``, NaN where any is NaN (Python's ``max`` keeps its first argument over a NaN, so a
    NaN result would read as no error)."""
    return math.nan if any(e != e for e in errors) else max(errors)


def _scores(q, k, scale, key_mask):
    q, k = q.double(), k.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if key_mask is None:
        return scores
    shaped = key_mask.view(key_mask.shape[0], *[1] * (scores.dim() - 2), -1)
    if key_mask.dtype == torch.bool:  # (B, S) bool: False keys take no attention
        return scores.masked_fill(~shaped, -math.inf)
    return scores + shaped.double()  # (B, S) float: added to the scores, as an additive attention mask


def naive_probs(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, key_mask=None) -> torch.Tensor:
    """``(B, ..., S, S)`` float64 ``softmax(q kᵀ · scale)``, ``scale`` defaulting to ``1/sqrt(D)``; with
    ``key_mask`` ``(B, S)`` bool, the keys it marks `False` have probability 0 (as a boolean attention mask); a float
    ``key_mask`` is added to each row's scores (an additive mask, LTX-Video's padded text: 0 or −10000)."""
    return torch.softmax(_scores(q, k, scale, key_mask), dim=-1)


def naive_lse(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, key_mask=None) -> torch.Tensor:
    """``(B, ..., S)`` float64 log-sum-exp of each row of ``q kᵀ · scale`` (the units of the bounds of
    ``entropy`` and ``received``: :func:`cogattn.exact.checks.error_units`), over the keys ``key_mask`` keeps."""
    return torch.logsumexp(_scores(q, k, scale, key_mask), dim=-1)


def naive_kind(
    P: torch.Tensor,
    kind: str,
    T: int,
    grid: tuple[int, int, int],
    queries=None,
    block_size: int = 128,
    topk: int = 32,
    text_at_end: bool = False,
    tile_shape: tuple[int, int, int] = (4, 4, 4),
    patterns: tuple = (),
    v: torch.Tensor | None = None,
    top_p: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99),
) -> torch.Tensor:
    """One kind from full probabilities ``P`` ``(B, H, S, S)``: ``T`` text tokens before the video (after it
    with ``text_at_end``), the latent ``grid`` ``(F, Hp, Wp)``, the ``query`` kind's token indices
    ``queries``, the ``block`` kind's ``block_size``, ``topk``'s k (``topk``: ``(B, H, S, k, 2)``, values
    and key indices, as stored) and the ``tile`` kind's ``tile_shape``. Frame group 0 is the text (when there
    is text), group ``f + 1`` frame f; tile group 0 the text, then the tiles in (t, y, x) order; ``offset``
    bins each pair of video tokens by its offset (Δf, Δy, Δx), over the V video queries; ``pattern_recall`` and
    ``pattern_error`` take ``patterns`` (:func:`naive_pattern`) and, for the error, the values ``v`` ``(B, H, S, D)``;
    ``top_p`` counts, for each p of ``top_p``, the keys of a full descending sort of the row's float32 probabilities
    until their float64 cumulative sum reaches p times the row's float64 total (p = 1: every key of nonzero float32
    probability); ``frame_max`` is ``(B, H, S, G, 2)``, each frame group's
    largest P[i, j] and its key token (−1 where the group's keys all have probability 0), as stored."""
    B, H, S, _ = P.shape
    F, Hp, Wp = grid
    V = F * Hp * Wp
    v0, t0 = (0, V) if text_at_end else (T, 0)
    text, video = slice(t0, t0 + T), slice(v0, v0 + V)
    groups = ([(t0, t0 + T)] if T else []) + [(v0 + f * Hp * Wp, v0 + (f + 1) * Hp * Wp) for f in range(F)]
    if kind == "entropy":
        return -torch.special.xlogy(P, P).sum(-1)
    if kind == "received":
        return P.sum(-2)
    if kind == "query_frame":
        return torch.stack([P[..., a:b].sum(-1) for a, b in groups], -1)
    if kind == "block":
        groups = [(a, min(a + block_size, S)) for a in range(0, S, block_size)]
    if kind == "topk":
        values, indices = P.topk(min(topk, S), dim=-1)
        return torch.stack([values, indices.to(values.dtype)], -1)
    if kind == "top_p":  # a full sort, a float64 cumulative sum
        return _top_p_counts(*_sorted_mass(P), top_p).to(P.dtype)
    if kind == "frame_max":  # the largest of each group's columns, its key token
        tops = [P[..., a:b].max(-1) for a, b in groups]
        values = torch.stack([top.values for top in tops], -1)
        tokens = torch.stack([top.indices + a for top, (a, _) in zip(tops, groups)], -1)
        return torch.stack([values, torch.where(values > 0, tokens, -1).to(P.dtype)], -1)
    if kind == "full":
        return P
    if kind == "query":
        return P[:, :, list(queries)]
    if kind == "video_to_text":
        return P[:, :, video, text].permute(0, 1, 3, 2).reshape(B, H, T, F, Hp, Wp)
    if kind == "text_to_video":
        return P[:, :, text, video].reshape(B, H, T, F, Hp, Wp)
    if kind == "offset":  # every (video query, video key) pair, binned by its offset, over the video queries
        f, y, x = torch.meshgrid(torch.arange(F), torch.arange(Hp), torch.arange(Wp), indexing="ij")
        f, y, x = f.flatten(), y.flatten(), x.flatten()  # coordinates of video token v0 + n
        bins = (
            ((f[None, :] - f[:, None] + F - 1) * (2 * Hp - 1) + (y[None, :] - y[:, None] + Hp - 1)) * (2 * Wp - 1)
            + x[None, :]
            - x[:, None]
            + Wp
            - 1
        )  # (query, key)
        out = torch.zeros(B, H, (2 * F - 1) * (2 * Hp - 1) * (2 * Wp - 1), dtype=P.dtype)
        out.index_add_(2, bins.flatten(), P[:, :, video, video].reshape(B, H, V * V))
        return (out / V).view(B, H, 2 * F - 1, 2 * Hp - 1, 2 * Wp - 1)
    if kind in ("pattern_recall", "pattern_error"):  # text rows and columns kept; means over the V video queries
        keep = torch.ones(S, S, dtype=torch.bool)
        out = torch.empty(B, H, len(patterns), dtype=P.dtype)
        for m, spec in enumerate(patterns):
            keep[video, video] = naive_pattern(spec, grid, tile_shape)
            if kind == "pattern_recall":
                out[..., m] = (P * keep)[:, :, video].sum(-1).mean(-1)
                continue
            kept = P * keep
            exact, sparse = P @ v.double(), (kept @ v.double()) / kept.sum(-1, keepdim=True)
            out[..., m] = (sparse - exact)[:, :, video].pow(2).mean(-1).mean(-1)
        return out
    if kind == "tile":  # a tile's tokens are runs of patch rows in several frames: token lists
        t, h, w = tile_shape
        groups = [list(range(t0, t0 + T))] if T else []
        for f0 in range(0, F, t):
            for y0 in range(0, Hp, h):
                for x0 in range(0, Wp, w):
                    groups.append(
                        [
                            v0 + (f * Hp + y) * Wp + x
                            for f in range(f0, min(f0 + t, F))
                            for y in range(y0, min(y0 + h, Hp))
                            for x in range(x0, min(x0 + w, Wp))
                        ]
                    )
    if kind in ("frame", "block", "tile"):
        groups = [g if isinstance(g, list) else list(range(*g)) for g in groups]
        G, (rows_held, keys_held) = len(groups), P.shape[-2:]  # a P of fewer rows or keys: those it holds
        # out[g, n]: the mean over group g's rows of their sums over group n's keys, as one product with the
        # groups' indicators (each row's weight 1/|g|; a group of no rows held: NaN, the mean of nothing)
        mean_of = torch.zeros(G, rows_held, dtype=P.dtype)
        in_group = torch.zeros(keys_held, G, dtype=P.dtype)
        for g, tokens in enumerate(groups):
            rows, cols = [i for i in tokens if i < rows_held], [j for j in tokens if j < keys_held]
            mean_of[g, rows] = 1 / len(rows) if rows else math.nan
            in_group[cols, g] = 1
        return torch.einsum("gs,bhst,tn->bhgn", mean_of, P, in_group)
    raise ValueError(kind)


def _sorted_mass(P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities rounded to float32 (what a capture ranks), sorted largest first, as their float64
    cumulative sum, and the count of nonzero ones."""
    x = P.float().double()
    return x.sort(-1, descending=True).values.cumsum(-1), (x > 0).sum(-1)


def _top_p_counts(mass: torch.Tensor, nonzero: torch.Tensor, top_p) -> torch.Tensor:
    """``top_p``'s counts from :func:`_sorted_mass`: the keys until the cumulative sum reaches each p times the row's
    total (its last cumulative sum), at most the nonzero ones; p ≥ 1 every nonzero key (a float64 sum can reach
    the total before the smallest keys, far below its epsilon, are added)."""
    total = mass[..., -1:]
    counts = [nonzero if p >= 1 else torch.minimum((mass < p * total).sum(-1) + 1, nonzero) for p in top_p]
    return torch.stack(counts, -1)


def naive_pattern(spec, grid: tuple[int, int, int], tile_shape=(4, 4, 4)) -> torch.Tensor:
    """``(V, V)`` bool over video queries and keys in token order, from the patterns' definitions in
    docs/design.md one pair at a time (a callable is called on the positions, as its contract says)."""
    F, Hp, Wp = grid
    pos = [(f, y, x) for f in range(F) for y in range(Hp) for x in range(Wp)]
    if callable(spec):
        f, y, x = (torch.tensor([p[a] for p in pos]) for a in range(3))
        return torch.as_tensor(spec(f[:, None], y[:, None], x[:, None], f[None], y[None], x[None])).expand(len(pos), -1)
    return _named_pattern(spec, tuple(grid), tuple(tile_shape)).clone()


@functools.lru_cache(maxsize=256)
def _named_pattern(spec: str, grid: tuple[int, int, int], tile_shape: tuple[int, int, int]) -> torch.Tensor:
    """:func:`naive_pattern` of a pattern named by a string, built once per pattern, grid and tile shape (the pairs
    one at a time are slow in Python: the suite asks for the same masks for every step, layer and item)."""
    F, Hp, Wp = grid
    pos = [(f, y, x) for f in range(F) for y in range(Hp) for x in range(Wp)]
    name, _, arg = spec.partition(":")

    def sta_axis(q, k, w, t, n):  # the window of w tiles centred on q's tile, moved inside the n tiles
        tiles, half = -(-n // t), w // 2
        centre = min(max(q // t, half), tiles - 1 - half)
        return abs(centre - k // t) <= half

    def keeps(a, b):
        (qf, qy, qx), (kf, ky, kx) = a, b
        if name == "spatial":
            return qf == kf
        if name == "temporal":
            return (qy, qx) == (ky, kx)
        if name == "window":
            return abs(qf - kf) <= int(arg)
        if name == "sta":
            return all(sta_axis(q, k, int(w), t, n) for q, k, w, t, n in zip(a, b, arg.split(","), tile_shape, grid))
        if name == "radial":
            d, s = abs(qf - kf), Hp * Wp
            band = 2 ** int(math.floor(math.log2(max(d, 1))))
            k, j = qy * Wp + qx, ky * Wp + kx
            return (abs(k - j) + 1) * band <= s if band <= s else k == j and d % -(-band // s) == 0
        raise ValueError(spec)

    return torch.tensor([[keeps(a, b) for b in pos] for a in pos], dtype=torch.bool)


def naive_context(P: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """``video_to_text`` / ``video_to_image`` from a cross-attention's probabilities ``P`` ``(B, H, V, C)``
    (video queries, context keys): ``(B, H, C, F, Hp, Wp)``."""
    B, H, _, C = P.shape
    return P.permute(0, 1, 3, 2).reshape(B, H, C, *grid)


def naive_audio(P: torch.Tensor, kind: str, grid: tuple[int, int, int]) -> torch.Tensor:
    """An audio kind from its attention's probabilities ``P`` ``(B, H, Q, K)``: ``audio`` (audio queries and keys)
    as it is; ``audio_to_text`` (audio queries, text keys) transposed, ``(B, H, T, A)``; ``frame_audio`` (video
    queries, audio keys) each latent frame's rows averaged, ``(B, H, F, A)``; ``audio_frame`` (audio queries, video
    keys) each latent frame's columns summed, ``(B, H, A, F)``. ``grid``: the video's ``(F, Hp, Wp)``."""
    B, H, Q, K = P.shape
    F = grid[0]
    if kind == "audio":
        return P
    if kind == "audio_to_text":
        return P.transpose(-1, -2)
    if kind == "frame_audio":
        return torch.stack([P[:, :, f * Q // F : (f + 1) * Q // F].mean(2) for f in range(F)], 2)
    if kind == "audio_frame":
        return torch.stack([P[..., f * K // F : (f + 1) * K // F].sum(-1) for f in range(F)], -1)
    raise ValueError(f"kind {kind!r} is not an audio kind")


def select(x: torch.Tensor, batch, heads) -> torch.Tensor:
    """Apply a batch list and heads (``"all"``, ``"mean"`` or a list) to a ``(B, H, ...)`` reference."""
    x = x[list(batch)]
    if heads == "mean":
        return x.mean(1, keepdim=True)
    if heads == "all":
        return x
    return x[:, list(heads)]


def kind_error(
    got,
    P: torch.Tensor,
    kind: str,
    T: int,
    grid: tuple[int, int, int],
    queries=None,
    lse=None,
    text_at_end: bool = False,
    mean_heads: bool = False,
    **sizes,
) -> float:
    """Largest error of a result ``got`` (as ``get`` returns it, ``(B, H, ...)``) against :func:`naive_kind` of
    ``P`` ``(B, H, S, S)``: absolute for probabilities and sums; for ``entropy`` and ``received``, given the
    rows' ``lse`` ``(B, H, S)`` (:func:`naive_lse`), in the units of their documented bounds
    (:func:`cogattn.exact.checks.error_units`), else relative to ``max(1, |H|)`` for ``entropy`` and absolute for
    ``received``; for ``topk`` the values, and the probabilities at the returned key tokens (equal
    probabilities may come in either order); for ``frame_max`` the values, the probabilities at the returned
    key tokens, and 1 for a token outside its group; for ``top_p`` how many keys a count lies outside the
    counts for p ∓ :data:`TOP_P_MARGIN` (0 inside: float32 cannot tell p from a mass that close to it), and for
    p = 1 from the count of probabilities that float32 keeps nonzero (at least 2⁻¹⁴⁸; one below 2⁻¹⁵² it rounds to
    0, and one between is either, by float32's rounding: :data:`SUBNORMAL_EDGE`).
    ``mean_heads``: ``got`` is of ``heads="mean"``: ``P`` is then each head's (``top_p``: the mean of the
    heads' counts), or, for ``topk`` and ``frame_max``, the head-mean row's."""
    if kind == "top_p":
        ps = sizes.pop("top_p", (0.5, 0.9, 0.95, 0.99))
        sorted_mass = _sorted_mass(P)  # one sort for both sides
        lo, hi = (
            _top_p_counts(*sorted_mass, [p if p >= 1 else p + sign * TOP_P_MARGIN for p in ps]).to(P.dtype)
            for sign in (-1, 1)
        )
        whole = [j for j, p in enumerate(ps) if p >= 1]  # a key near float32's least subnormal: counted or not
        lo[..., whole], hi[..., whole] = ((P >= 2.0**e).sum(-1, keepdim=True).to(P.dtype) for e in SUBNORMAL_EDGE)
        if mean_heads:
            lo, hi = lo.mean(1, keepdim=True), hi.mean(1, keepdim=True)
        return worst(0.0, (lo - got.double()).max().item(), (got.double() - hi).max().item())
    if kind == "frame_max":
        values, indices = got
        ref = naive_kind(P, kind, T, grid, text_at_end=text_at_end)[..., 0]
        at = torch.where(indices >= 0, P.gather(-1, indices.clamp(min=0)), 0.0)
        F, Hp, Wp = grid
        S, n = P.shape[-1], Hp * Wp
        group = torch.arange(F).repeat_interleave(n) + (T > 0)
        group = torch.cat([group, torch.zeros(T, dtype=torch.long)] if text_at_end else [group.new_zeros(T), group])
        outside = (indices >= 0) & (group[indices.clamp(min=0, max=S - 1)] != torch.arange(ref.shape[-1]))
        error = worst((values.double() - ref).abs().max().item(), (at - ref).abs().max().item())
        return worst(error, float(outside.any()))
    if kind == "topk":
        values, indices = got
        ref = P.topk(values.shape[-1], dim=-1).values
        return worst((values.double() - ref).abs().max().item(), (P.gather(-1, indices) - ref).abs().max().item())
    ref = naive_kind(P, kind, T, grid, queries, text_at_end=text_at_end, **sizes)
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"{kind}: shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}")
    error = (got.double() - ref).abs()
    if lse is not None and kind in ("entropy", "received"):
        return (error / error_units(kind, P, lse)).max().item()
    return (error / ref.abs().clamp(min=1) if kind == "entropy" else error).max().item()
