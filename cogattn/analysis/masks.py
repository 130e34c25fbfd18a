"""Block-sparse attention masks and how much of the real attention they keep, from ``block`` records.

A block-sparse kernel splits the joint sequence into blocks of ``block_size`` tokens in the model's
own order (text first, when the sequence has it: Wan's self-attention is the video alone, and its masks
have no text blocks; the last block may be shorter) and computes only the (query block, key block)
pairs its mask keeps. The ``block`` kind holds, for every pair (m, n), the mean over the queries of
block m of their mass on the keys of block n, so the share of all attention mass a mask keeps is exact:

    recall = Σ_m w_m Σ_n mask[m, n] · block[m, n] / S,   w_m = query tokens of block m.

```python
from cogattn.analysis.masks import BlockGrid, mask_recall, oracle_curve, same_frame_mask, temporal_window_mask
mask = same_frame_mask(rec.layout, rec.block_size) | temporal_window_mask(rec.layout, rec.block_size, 1)
mask_recall(rec, mask)          # step, expert, layer, head, item, recall
oracle_curve(rec, ks=[4, 8])    # the best recall with k key blocks per query block
keep = top_p_mask(rec.get("block", 0, 0), 0.9)  # NABLA: per query block, the fewest key blocks reaching 0.9
mask_recall(rec, keep, steps=0, layers=0), mask_density(rec, keep)
```

Masks are ``(N, N)`` bool tensors over blocks (never expanded to tokens); combine them with ``&`` and ``|``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import NotRecordedError
from ..exact.patterns import Pattern, parse
from ..layout import TokenLayout
from ..runs.run import MapSource
from .groups import BlockGrid, TileGrid, block_grid, query_weights
from .layouts import for_layers
from .maps import choose, expert_steps

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "BlockGrid",
    "mask_density",
    "mask_recall",
    "oracle_curve",
    "same_frame_mask",
    "spatial_window_mask",
    "temporal_window_mask",
    "top_p_mask",
]


# -- masks ------------------------------------------------------------------------------------------
def same_frame_mask(layout: TokenLayout, block_size: int, *, text: bool = True) -> torch.Tensor:
    """Keep (m, n) when blocks m and n hold video tokens of a common latent frame.

    Args:
        layout (`TokenLayout`): the token layout.
        block_size (`int`): tokens per block.
        text (`bool`, defaults to `True`): also keep every row and column of a block holding text or history tokens.

    Returns:
        `torch.Tensor`: ``(N, N)`` bool.
    """
    return temporal_window_mask(layout, block_size, 0, text=text)


def temporal_window_mask(layout: TokenLayout, block_size: int, window: int, *, text: bool = True) -> torch.Tensor:
    """Keep (m, n) when some video token of block m and some of block n are at most ``window`` latent
    frames apart (``window=0``: `same_frame_mask`).

    Args:
        layout (`TokenLayout`): the token layout.
        block_size (`int`): tokens per block.
        window (`int`): largest latent-frame distance kept, >= 0.
        text (`bool`, defaults to `True`): also keep every row and column of a block holding text or history tokens.

    Returns:
        `torch.Tensor`: ``(N, N)`` bool.
    """
    _check_window(window, "window")
    grid = BlockGrid(layout, block_size)
    f = torch.arange(layout.frames)
    band = ((f[:, None] - f[None, :]).abs() <= window).float()  # (F, F)
    touch = grid.frame_touch.float()
    near = (touch @ band) > 0  # (N, F): frames within the window of one of block m's frames
    return _with_text(grid, (near.float() @ touch.T) > 0, text)


def spatial_window_mask(layout: TokenLayout, block_size: int, radius: int, *, text: bool = True) -> torch.Tensor:
    """Keep (m, n) when some video token of block m and some of block n are within ``radius`` latent
    patches of each other in row and in column (in any frames; ``& temporal_window_mask(...)`` bounds the
    frames too, pair by block pair).

    Args:
        layout (`TokenLayout`): the token layout.
        block_size (`int`): tokens per block.
        radius (`int`): largest row and column distance kept, in latent patches, >= 0.
        text (`bool`, defaults to `True`): also keep every row and column of a block holding text or history tokens.

    Returns:
        `torch.Tensor`: ``(N, N)`` bool.
    """
    _check_window(radius, "radius")
    grid = BlockGrid(layout, block_size)
    touch = grid.position_touch.float()[:, None]  # (N, 1, Hp, Wp)
    # patches within the radius of one of block m's patches: a max over the (2r+1)² square around each
    near = torch.nn.functional.max_pool2d(touch, 2 * radius + 1, stride=1, padding=radius)
    keep = (near.flatten(1) @ touch.flatten(1).T) > 0
    return _with_text(grid, keep, text)


def _with_text(grid: BlockGrid, keep: torch.Tensor, text: bool) -> torch.Tensor:
    if text:
        keep[grid.off_grid] = True
        keep[:, grid.off_grid] = True
    return keep


def _check_window(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}; use an int >= 0 (latent frames or patches).")


def top_p_mask(pooled_map: torch.Tensor, p: float) -> torch.Tensor:
    """NABLA's selection on a pooled map: each query group keeps the fewest key groups whose pooled mass,
    largest first, sums to at least ``p`` (a row that never reaches p, a float sum just below 1, keeps its
    nonzero groups; a row of zeros keeps none). The first of equal entries in a sort wins a tie.

    Args:
        pooled_map (`torch.Tensor`): a ``block`` or ``tile`` map ``(..., N, N)``, e.g. ``rec.get("block", 0, 0)``
            ``(B, H, N, N)`` or one head's ``(N, N)``.
        p (`float`): the mass to reach, in (0, 1].

    Returns:
        `torch.Tensor`: bool, the shape of ``pooled_map``; ``mask_recall`` and ``mask_density`` take it.
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"p={p!r}; use a mass in (0, 1], e.g. 0.9.")
    if not isinstance(pooled_map, torch.Tensor) or pooled_map.ndim < 2 or pooled_map.shape[-1] != pooled_map.shape[-2]:
        got = tuple(pooled_map.shape) if isinstance(pooled_map, torch.Tensor) else type(pooled_map).__name__
        raise ValueError(f"pooled_map is {got}; pass a block or tile map (..., N, N), e.g. rec.get('block', 0, 0).")
    values, order = pooled_map.double().sort(-1, descending=True)
    before = torch.nn.functional.pad(values.cumsum(-1)[..., :-1], (1, 0))  # the mass ahead of each in the sort
    keep = (before < p) & (values > 0)
    return torch.zeros_like(keep).scatter_(-1, order, keep)


# -- recall -----------------------------------------------------------------------------------------
def mask_recall(
    source: MapSource,
    mask,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    kind: str = "block",
) -> pd.DataFrame:
    """The exact share of all attention mass a block mask keeps, per (step, layer, head, batch item).

    ``recall = Σ_m w_m Σ_n mask[m, n] · block[m, n] / S`` with ``w_m`` the query tokens of block m: 1
    for a mask that keeps everything, the mass a block-sparse kernel with this mask would compute. On a
    ``tile`` map (``kind="tile"``) the groups are the text and the 3-D tiles, ``w_m`` the tokens of group m.

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``block`` (or ``tile``).
        mask (`torch.Tensor | str | Pattern | Callable`): ``(N, N)`` bool, N = ⌈S / source.block_size⌉ (see
            `same_frame_mask` and the other helpers; on ``tile``, N tile groups), one mask per batch item and
            head ``(B, H, N, N)`` (`top_p_mask` of a record; choose its one step and layer), or a token pattern
            (:mod:`cogattn.exact.patterns`: ``"spatial"``, ``"sta:3,3,3"``, ...), taken as its block or tile mask
            (a group pair kept where any of its token pairs is; ``"sta:t,h,w"`` over the source's ``tile_shape``).
        steps (`"all" | int | Sequence[int]`, defaults to ``"all"``): steps of ``block``.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers of ``block``.
        kind (`"block" | "tile"`, defaults to ``"block"``): the pooled map the mask is over.

    Returns:
        `pandas.DataFrame`: columns ``step, expert, layer, head, item, recall``; ``head`` is the model head, or
        ``"mean"`` when heads were averaged at record time.

    Raises:
        TypeError: ``mask`` is not a bool tensor.
        ValueError: ``mask`` is not (N, N) or (B, H, N, N) of the records, or a record disagrees with the layout.
        NotRecordedError: ``block``, or a chosen step or layer, was not recorded.
    """
    import pandas as pd  # slow to import: only where a table is made

    if kind not in ("block", "tile"):
        raise ValueError(f"kind={kind!r}; mask_recall reads a 'block' or a 'tile' map.")
    source = for_layers(source, kind, layers, "mask_recall")  # layers of another layout: theirs
    grid = block_grid(source) if kind == "block" else TileGrid(source)
    if isinstance(mask, (str, Pattern)) or callable(mask):  # a token pattern: its block or tile mask
        pattern = parse(mask, tuple(getattr(source, "tile_shape", None) or (4, 4, 4)))  # "sta:"'s tiles: the run's
        shape = grid.block_size if kind == "block" else grid.tile_shape
        mask = (pattern.block_mask if kind == "block" else pattern.tile_mask)(source.layout, shape)
    keep = _check_mask(mask, grid).double()
    parts = []
    for step, layer, blk in _blocks(source, grid, steps, layers, kind):
        if keep.ndim == 4 and keep.shape[:2] != blk.shape[:2]:
            raise ValueError(
                f"mask is {tuple(keep.shape)}; the {kind} record of step {step}, layer {layer} is "
                f"{tuple(blk.shape)}: pass one (N, N) mask or one per batch item and head."
            )
        w, S = query_weights(source, grid, blk.shape[0])
        recall = ((blk * keep).sum(-1) * w).sum(-1) / S  # (B, H)
        parts.append(_rows(source, step, layer, recall[..., None]))
    return pd.concat(parts, ignore_index=True)


def mask_density(source: MapSource, mask: torch.Tensor, kind: str = "block") -> torch.Tensor:
    """The share of all (query, key) token pairs a block or tile mask computes: ``Σ_m Σ_n mask[m, n]·w_m·w_n / S²``,
    w the tokens of each group; the mean over queries of the share of key tokens kept (1 for a full mask). Every
    token of the layout counts, an item's padded text too: the pairs a kernel over the sequence computes (where
    :func:`mask_recall` weighs the rows the model forms).

    Args:
        source (`MapSource`): a `Recording` or a `Run` (its layout, ``block_size`` or ``tile_shape``).
        mask (`torch.Tensor`): bool ``(..., N, N)``, N groups of the ``kind`` map (e.g. `top_p_mask` of a record).
        kind (`"block" | "tile"`, defaults to ``"block"``): the groups the mask is over.

    Returns:
        `torch.Tensor`: float64, the mask's leading shape (0-d for one ``(N, N)`` mask).
    """
    if kind not in ("block", "tile"):
        raise ValueError(f"kind={kind!r}; mask_density reads a 'block' or a 'tile' mask.")
    grid = block_grid(source) if kind == "block" else TileGrid(source)
    w = grid.sizes.double()
    return (_check_mask(mask, grid).double() * w[:, None] * w).sum((-2, -1)) / source.layout.seq_len**2


def oracle_curve(
    source: MapSource,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    ks: Sequence[int] | None = None,
) -> pd.DataFrame:
    """The best recall any mask with ``k`` key blocks per query block could reach: each query block keeps
    its ``k`` largest entries of the block map (the bound a fixed-pattern mask of that density is held to).

    Args:
        source (`MapSource`): a `Recording` or a `Run` holding kind ``block``.
        steps (`"all" | int | Sequence[int]`, defaults to ``"all"``): steps of ``block``.
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers of ``block``.
        ks (`Sequence[int] | int | None`, defaults to `None`): key blocks kept per query block, each in
            1..N, in the order given; `None` is every k from 1 to N.

    Returns:
        `pandas.DataFrame`: columns ``step, expert, layer, head, item, k, recall``, recall rising with k to 1.

    Raises:
        ValueError: a ``k`` outside 1..N, or a record that disagrees with the layout and block size.
        NotRecordedError: ``block``, or a chosen step or layer, was not recorded.
    """
    import pandas as pd  # slow to import: only where a table is made

    source = for_layers(source, "block", layers, "oracle_curve")  # layers of another layout: theirs
    grid = block_grid(source)
    N = grid.num_blocks
    ks = list(range(1, N + 1)) if ks is None else [ks] if isinstance(ks, int) else list(ks)
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= N]
    if bad or not ks:
        raise ValueError(f"ks={ks!r}; use key-block counts in 1..{N} (N = ⌈S / block_size⌉ blocks).")
    parts = []
    for step, layer, blk in _blocks(source, grid, steps, layers):
        best = blk.sort(-1, descending=True).values.cumsum(-1)  # (B, H, N, N): mass of the top k per row
        w, S = query_weights(source, grid, blk.shape[0])
        recall = (best * w[..., None]).sum(-2) / S[..., None]  # (B, H, N) over k = 1..N
        parts.append(_rows(source, step, layer, recall[..., [k - 1 for k in ks]], ks))
    return pd.concat(parts, ignore_index=True)


def _check_mask(mask, grid) -> torch.Tensor:
    N = grid.num_blocks
    want = (
        f"an ({N}, {N}) bool torch tensor (N = ⌈S / block_size⌉ = ⌈{grid.layout.seq_len} / {grid.block_size}⌉ "
        "blocks), e.g. same_frame_mask(source.layout, source.block_size)"
        if isinstance(grid, BlockGrid)
        else f"an ({N}, {N}) bool torch tensor over the tile map's {N} groups, e.g. a pattern's tile_mask"
    )
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be {want}; got a {type(mask).__name__}.")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be {want}; got dtype {mask.dtype} (make one with `m > 0` or `m.bool()`).")
    if mask.ndim not in (2, 4) or tuple(mask.shape[-2:]) != (N, N):
        raise ValueError(f"mask must be {want} (or one per batch item and head); got shape {tuple(mask.shape)}.")
    return mask.cpu()


def _blocks(source: MapSource, grid, steps, layers, kind: str = "block"):
    """``(step, layer, block map (B, H, N, N) float64)`` of every recorded chosen pair (``tile`` maps too)."""
    step_list, layer_list = choose(source, kind, "step", steps), choose(source, kind, "layer", layers)
    keys = set(source.keys())
    pairs = [(s, la) for s in step_list for la in layer_list if (kind, s, la) in keys]
    if not pairs:
        raise NotRecordedError(
            f"{kind!r} was not recorded at any chosen (step, layer): steps {step_list} × layers {layer_list}; "
            "choose steps and layers recorded together."
        )
    N = grid.num_blocks
    for step, layer in pairs:
        blk = source.get(kind, step, layer)
        if blk.ndim != 4 or tuple(blk.shape[2:]) != (N, N):
            why = "" if kind == "tile" else f": S = {grid.layout.seq_len} and block_size = {grid.block_size} give "
            raise ValueError(
                f"the {kind} record of step {step}, layer {layer} has shape {tuple(blk.shape)}, not (B, H, {N}, {N})"
                + ("." if kind == "tile" else f"{why}that; the source's block_size does not match its records.")
            )
        yield step, layer, blk.double()


def _rows(source: MapSource, step: int, layer: int, recall: torch.Tensor, ks: list[int] | None = None) -> pd.DataFrame:
    """One record's rows in (head slot, item, k) order: ``recall`` (B, H, K), ``ks`` its k (`None`: no k column)."""
    import pandas as pd  # slow to import: only where a table is made

    B, H, K = recall.shape
    heads = ["mean"] * H if source.head_ids is None else [int(source.head_ids[h]) for h in range(H)]
    (expert,) = expert_steps(source, [step])  # the one transformer that ran the step
    columns = {
        "step": step,
        "expert": expert,  # layer L of Wan 2.2's transformer is not layer L of its transformer_2
        "layer": layer,
        "head": [heads[h] for h in range(H) for _ in range(B * K)],
        "item": [b for _ in range(H) for b in range(B) for _ in range(K)],
    }
    columns.update({} if ks is None else {"k": list(ks) * (H * B)})
    columns["recall"] = recall.transpose(0, 1).reshape(-1).tolist()
    return pd.DataFrame(columns)
