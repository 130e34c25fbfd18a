"""Token patterns of sparse video attention: which (query, key) pairs a sparse method keeps.

A pattern is a rule over the latent positions (frame, patch row, patch column) of a video query and a video
key; the text's rows and columns are always kept, as every one of these methods keeps the text. Each
pattern gives

* :meth:`Pattern.row_mask`: the boolean ``(r, S)`` mask of a tile of query rows, from positions (never
  S × S at once), which ``pattern_recall`` and ``pattern_error`` fold row tile by row tile;
* :meth:`Pattern.block_mask` and :meth:`Pattern.tile_mask`: its ``(N, N)`` approximation on the groups of the
  ``block`` and ``tile`` kinds, a group pair kept where any of its token pairs is kept, so
  ``masks.mask_recall`` compares a token pattern with the block-sparse kernel that runs it.

Named patterns (``CaptureOptions.patterns`` takes the names, :class:`Pattern` objects, or callables):

* ``"spatial"``: the same latent frame (Sparse VideoGen's spatial head);
* ``"temporal"``: the same patch (row, column) in any frame (its temporal head);
* ``"window:w"``: latent frames at most ``w`` apart;
* ``"sta:t,h,w"``: Sliding Tile Attention with a window of t × h × w tiles (odd counts) of the recording's
  ``tile_shape`` (:func:`sta`: tiles given explicitly); the window is centred on the query's tile and
  clamped to stay inside the grid, NATTEN's rule STA follows;
* ``"radial"``: Radial Attention's static mask (:func:`radial`);
* a callable ``keep(q_frame, q_row, q_col, k_frame, k_row, k_col)`` → bool tensor, called on int64 tensors
  shaped ``(r, 1)`` and ``(1, V)`` that broadcast to ``(r, V)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from ..layout import TokenLayout

__all__ = [
    "DEFAULT_PATTERNS",
    "NAMES",
    "Pattern",
    "check_option",
    "parse",
    "radial",
    "resolve",
    "spatial",
    "sta",
    "temporal",
    "window",
]

NAMES = ("spatial", "temporal", "window:w", "sta:t,h,w", "radial")  # the forms a pattern name takes
DEFAULT_PATTERNS = ("spatial", "temporal")  # Sparse VideoGen's two: a bare reducer's, and a run's that names none


class Pattern:
    """A token pattern: ``keep`` over query and key positions, and a ``name`` results are labelled with.

    Args:
        name (`str`): its label (``"spatial"``, ``"window:2"``, a callable's ``__name__``).
        keep (`Callable`): ``(q_frame, q_row, q_col, k_frame, k_row, k_col, layout)`` → bool tensor, the video
            pairs kept; int64 positions, query ones ``(r, 1)``, key ones ``(1, V)``.

    Attributes:
        frames (`int | None`): where the pattern keeps exactly the video keys of the latent frames at most this
            far from the query's (``spatial`` 0, ``window:w`` w): contiguous runs of keys, which
            ``pattern_recall`` and ``pattern_error`` sum without a mask.
        same_patch (`bool`): whether it keeps exactly the video keys of the query's patch in every frame
            (``temporal``): one key per frame, gathered.
    """

    def __init__(self, name: str, keep: Callable, frames: int | None = None, same_patch: bool = False):
        self.name, self._keep = name, keep
        self.frames, self.same_patch = frames, same_patch

    def __repr__(self) -> str:
        return f"Pattern({self.name!r})"

    def row_mask(self, layout: TokenLayout, rows) -> torch.Tensor:
        """``(r, S)`` bool: the pairs kept for the query tokens ``rows`` (a slice or index tensor) and every key."""
        f, y, x, video = _positions(layout)
        keep = self._keep(f[rows, None], y[rows, None], x[rows, None], f[None], y[None], x[None], layout)
        keep = torch.as_tensor(keep, dtype=torch.bool).expand(len(f[rows]), len(f))
        return keep | ~video[None] | ~video[rows, None]  # the text's rows and columns are kept

    def group_mask(self, layout: TokenLayout, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
        """``(N, N)`` bool over token groups (``groups`` ``(S,)``: each token's group): a pair of groups kept
        where any of its token pairs is kept."""
        S = layout.seq_len
        indicator = torch.zeros(S, num_groups, dtype=torch.float32).index_put_((torch.arange(S), groups), torch.ones(S))
        hits = torch.zeros(num_groups, num_groups, dtype=torch.float32)
        for r0 in range(0, S, 1024):  # (1024, S) masks at a time
            rows = slice(r0, min(S, r0 + 1024))
            hits.index_add_(0, groups[rows], self.row_mask(layout, rows).float() @ indicator)
        return hits > 0

    def block_mask(self, layout: TokenLayout, block_size: int) -> torch.Tensor:
        """``(N, N)`` bool over the ``block`` kind's blocks (runs of ``block_size`` tokens, N = ⌈S / block_size⌉)."""
        S = layout.seq_len
        return self.group_mask(layout, torch.arange(S) // block_size, math.ceil(S / block_size))

    def tile_mask(self, layout: TokenLayout, tile_shape: tuple[int, int, int]) -> torch.Tensor:
        """``(N, N)`` bool over the ``tile`` kind's groups (the text, then the 3-D tiles of ``tile_shape``)."""
        groups = layout.tile_of_token(tuple(tile_shape))
        return self.group_mask(layout, groups, int(groups.max()) + 1)


@functools.lru_cache(maxsize=8)
def _positions(layout: TokenLayout) -> tuple[torch.Tensor, ...]:
    """``(frame, row, col, is_video)`` of every token, ``(S,)`` each; text tokens at frame, row, col −1."""
    if layout.history_len:
        raise ValueError(
            f"{layout.history_len} video tokens of this layout are off the latent grid (history latents, or keyframe and reference tokens): a "
            "pattern over (frame, row, col) has no position for them."
        )
    S, v = layout.seq_len, layout.grid_tokens
    f, y, x = (torch.full((S,), -1, dtype=torch.long) for _ in range(3))
    n = torch.arange(layout.video_len)
    f[v], y[v], x[v] = n // layout.frame_tokens, n % layout.frame_tokens // layout.width, n % layout.width
    video = torch.zeros(S, dtype=torch.bool)
    video[v] = True
    return f, y, x, video


def spatial() -> Pattern:
    """The same latent frame: Sparse VideoGen's spatial head."""
    return Pattern("spatial", lambda qf, qy, qx, kf, ky, kx, layout: qf == kf, frames=0)


def temporal() -> Pattern:
    """The same patch (row, column) in any latent frame: Sparse VideoGen's temporal head."""
    return Pattern("temporal", lambda qf, qy, qx, kf, ky, kx, layout: (qy == ky) & (qx == kx), same_patch=True)


def window(w: int) -> Pattern:
    """Latent frames at most ``w`` apart (``window(0)`` is :func:`spatial`)."""
    _check_counts("window:w", (w,), 0)
    # comparisons of (1, S) keys with (r, 1) bounds: no (r, S) integer temporaries
    return Pattern(f"window:{w}", lambda qf, qy, qx, kf, ky, kx, layout: (kf >= qf - w) & (kf <= qf + w), frames=w)


def sta(window: Sequence[int], tile: Sequence[int]) -> Pattern:
    """Sliding Tile Attention: tiles of ``tile`` (latent frames, patch rows, patch columns; edge tiles
    smaller, as the ``tile`` kind's), and a query keeps the keys of the ``window`` (t, h, w tiles, odd
    counts) of tiles around its own tile. Per axis of n tiles, a window of ``w`` tiles is centred at
    ``c = min(max(q, w // 2), n − 1 − w // 2)`` (clamped to stay inside the grid, NATTEN's rule, as STA's
    reference mask) and keeps tile ``k`` where ``|c − k| ≤ w // 2``; a window wider than the grid keeps every tile."""
    window, tile = tuple(int(n) for n in window), tuple(int(n) for n in tile)
    _check_counts("sta:t,h,w", window, 1)
    if any(n % 2 == 0 for n in window):
        raise ValueError(f"sta:{','.join(map(str, window))}: the window is centred on a tile; use odd tile counts.")
    _check_counts("tile_shape", tile, 1)

    def keep(qf, qy, qx, kf, ky, kx, layout):
        kept = None
        for q, k, w, t, size in zip((qf, qy, qx), (kf, ky, kx), window, tile, layout.grid):
            n, half = math.ceil(size / t), w // 2
            centre = (q // t).clamp(min=half).clamp(max=n - 1 - half)  # max wins: a window wider than the grid
            tiles = k // t  # (1, S); compared with (r, 1) bounds, no (r, S) integer temporaries
            axis = (tiles >= centre - half) & (tiles <= centre + half)
            kept = axis if kept is None else kept & axis
        return kept

    return Pattern(f"sta:{','.join(map(str, window))}", keep)


def radial() -> Pattern:
    """Radial Attention's static mask (Li et al., 2025), as its paper defines it over tokens: for latent
    frames ``i``, ``j`` and ``s = Hp·Wp`` tokens per frame, with ``r = ⌊log2 max(|i − j|, 1)⌋``, the tokens
    at flat in-frame positions ``k``, ``l`` (``y·Wp + x``) are kept where ``2^r ≤ s`` and ``|k − l| + 1 ≤
    s / 2^r`` (a spatial band halving each time the frame distance doubles; frames at most 1 apart keep
    every pair), else only where ``k = l`` and ``|i − j|`` is a multiple of ``⌈2^r / s⌉``. Its released
    kernel runs a block approximation of this (128-token blocks, the band never narrower than a block,
    Wan's first frame kept as a sink); this is the token-level mask, without those."""

    def keep(qf, qy, qx, kf, ky, kx, layout):
        # Per pair of frames the kept pairs are |k − l| ≤ reach, reach = s // 2^r − 1 (−1: none): a (F, F) table,
        # then one band of comparisons per key frame, (r, 1) against (1, s).
        F, s, start = layout.frames, layout.frame_tokens, layout.grid_tokens.start
        d = (torch.arange(F)[:, None] - torch.arange(F)[None]).abs()
        band = 2 ** torch.floor(torch.log2(d.clamp(min=1).double())).long()
        reach = torch.where(band <= s, s // band - 1, torch.where(d % ((band + s - 1) // s) == 0, 0, -1))
        k, rows = qy * layout.width + qx, reach[qf.clamp(min=0)[:, 0]]  # (r, 1), (r, F)
        kept = torch.zeros(len(k), kf.shape[-1], dtype=torch.bool)
        positions = torch.arange(s)[None]
        for g in range(F):
            span = rows[:, g : g + 1]
            kept[:, start + g * s : start + (g + 1) * s] = (positions >= k - span) & (positions <= k + span)
        return kept

    return Pattern("radial", keep)


def _check_counts(name: str, values: tuple, least: int) -> None:
    if any(isinstance(n, bool) or not isinstance(n, int) or n < least for n in values):
        raise ValueError(f"{name}={list(values)}: use ints >= {least}.")


def parse(spec, tile_shape: Sequence[int] = (4, 4, 4)) -> Pattern:
    """A :class:`Pattern` from a name (:data:`NAMES`), a `Pattern`, or a callable over positions; raises
    `ValueError` for an unknown name, naming the valid ones. ``tile_shape``: the tiles of ``"sta:t,h,w"``."""
    if isinstance(spec, Pattern):
        return spec
    if callable(spec):
        return Pattern(getattr(spec, "__name__", "pattern"), lambda *pos: spec(*pos[:6]))
    if not isinstance(spec, str):
        raise TypeError(
            f"a pattern is a name from {list(NAMES)}, a cogattn.exact.patterns.Pattern or a callable; got {spec!r}."
        )
    name, _, arg = spec.partition(":")
    try:
        if spec in ("spatial", "temporal", "radial"):
            return {"spatial": spatial, "temporal": temporal, "radial": radial}[spec]()
        if name == "window" and arg:
            return window(int(arg))
        if name == "sta" and arg:
            counts = [int(n) for n in arg.split(",")]
            if len(counts) == 3:
                return sta(counts, tile_shape)
    except ValueError as err:
        if "invalid literal" not in str(err):
            raise
    raise ValueError(f"unknown pattern {spec!r}; the patterns are {list(NAMES)} (e.g. 'window:2', 'sta:3,3,3').")


def resolve(specs, tile_shape: Sequence[int] = (4, 4, 4)) -> tuple[Pattern, ...]:
    """The patterns of ``CaptureOptions.patterns``: a name, `Pattern` or callable, or a sequence of them."""
    if isinstance(specs, (str, Pattern)) or callable(specs):
        specs = (specs,)
    return tuple(parse(s, tile_shape) for s in specs)


def check_option(patterns, kinds: Sequence[str], tile_shape: Sequence[int]) -> tuple:
    """``CaptureOptions.patterns`` as a tuple, each checked: given with ``pattern_recall`` or ``pattern_error`` in
    ``kinds`` and only then, each name known (an unknown one refused, naming the valid ones), and no two patterns of
    one name (each labels a slot of the results and a column of the pattern table)."""
    patterns = (patterns,) if isinstance(patterns, (str, Pattern)) or callable(patterns) else tuple(patterns or ())
    asked = [k for k in kinds if k in ("pattern_recall", "pattern_error")]
    if patterns and not asked:
        raise ValueError("patterns were given but neither 'pattern_recall' nor 'pattern_error' is in kinds; add one.")
    if asked and not patterns:
        raise ValueError(
            f"kinds {asked} need patterns=[...], the token patterns to measure: any of {list(NAMES)}, a Pattern or a "
            f"callable, e.g. patterns={DEFAULT_PATTERNS} (Sparse VideoGen's spatial and temporal heads)."
        )
    names = [p.name for p in resolve(patterns, tile_shape if len(tile_shape) == 3 else (4, 4, 4))]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"patterns name {twice} more than once ({names}); each pattern labels its own slot of the results: "
            "drop the repeat, or give each Pattern its own name."
        )
    return patterns
