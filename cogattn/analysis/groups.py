"""The groups of a pooled map (``block`` or ``tile``): what each group of tokens holds (:class:`BlockGrid`: the blocks
of ``block_size`` tokens in the model's order; ``TileGrid``: the text and the 3-D tiles), and how many query tokens
of each an item's map averages over (``query_weights``), which :mod:`cogattn.analysis.masks` weighs recall by."""

from __future__ import annotations

import math

import torch

from ..layout import TokenLayout
from ..runs.run import MapSource

__all__ = ["BlockGrid", "TileGrid", "block_grid", "query_weights"]


class BlockGrid:
    """The blocks of ``block_size`` tokens of a layout's joint sequence, and what each one holds.

    Args:
        layout (`TokenLayout`): the token layout (``source.layout``).
        block_size (`int`): tokens per block (``source.block_size``).

    Attributes:
        num_blocks (`int`): N = ⌈S / block_size⌉ (also ``len(grid)``).
        sizes (`torch.Tensor`): ``(N,)`` int64, query tokens in each block (block_size, the last maybe fewer).
        frame_touch (`torch.Tensor`): ``(N, F)`` bool, block m holds a video token of latent frame f (video
            tokens off the grid, a layout's ``history_len``, touch no frame and no patch).
        position_touch (`torch.Tensor`): ``(N, Hp, Wp)`` bool, block m holds a video token at patch
            (row, col) of some frame.
        has_text (`torch.Tensor`): ``(N,)`` bool, block m holds a text token (none when
            ``layout.text_len == 0``, Wan).
        off_grid (`torch.Tensor`): ``(N,)`` bool, block m holds a token off the grid (text, history latents).
    """

    def __init__(self, layout: TokenLayout, block_size: int):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r}; use an int >= 1 (the source's block_size).")
        self.layout, self.block_size = layout, block_size
        S, video, text = layout.seq_len, layout.grid_tokens, layout.text_tokens
        self.num_blocks = N = math.ceil(S / block_size)
        self.sizes = torch.clamp(S - torch.arange(N) * block_size, max=block_size)
        self.token_groups = block = torch.arange(S) // block_size  # block of each token
        v = torch.arange(layout.frames * layout.frame_tokens)  # the grid's tokens: history tokens have no position
        frame, row, col = v // layout.frame_tokens, v % layout.frame_tokens // layout.width, v % layout.width
        self.frame_touch = torch.zeros(N, layout.frames, dtype=torch.bool)
        self.frame_touch[block[video], frame] = True
        self.position_touch = torch.zeros(N, layout.height, layout.width, dtype=torch.bool)
        self.position_touch[block[video], row, col] = True
        self.has_text = torch.zeros(N, dtype=torch.bool)
        self.has_text[block[text]] = True
        self.off_grid = self.has_text.clone()
        self.off_grid[block[layout.video_start : video.start]] = True  # the history tokens before the grid

    def __len__(self) -> int:
        return self.num_blocks

    def __repr__(self) -> str:
        return f"BlockGrid(S={self.layout.seq_len}, block_size={self.block_size}, N={self.num_blocks})"

    def token_range(self, m: int) -> range:
        """Token indices of block ``m`` (query and key tokens alike)."""
        if not 0 <= m < self.num_blocks:
            raise ValueError(f"block {m} is outside 0..{self.num_blocks - 1}.")
        return range(m * self.block_size, min((m + 1) * self.block_size, self.layout.seq_len))

    @property
    def ranges(self) -> list[range]:
        """Token range of every block, in order."""
        return [self.token_range(m) for m in range(self.num_blocks)]

    def frames(self, m: int) -> list[int]:
        """Latent frames block ``m`` touches."""
        return self.frame_touch[self._check(m)].nonzero().flatten().tolist()

    def rows(self, m: int) -> list[int]:
        """Patch rows block ``m`` touches (in any frame)."""
        return self.position_touch[self._check(m)].any(1).nonzero().flatten().tolist()

    def cols(self, m: int) -> list[int]:
        """Patch columns block ``m`` touches (in any frame)."""
        return self.position_touch[self._check(m)].any(0).nonzero().flatten().tolist()

    def text_tokens(self, m: int) -> range:
        """Text tokens in block ``m`` (empty when it holds none)."""
        r = self.token_range(m)
        text = self.layout.text_tokens
        return range(max(r.start, text.start), max(min(r.stop, text.stop), max(r.start, text.start)))

    def _check(self, m: int) -> int:
        self.token_range(m)
        return m


def block_grid(source: MapSource) -> BlockGrid:
    return BlockGrid(_layout(source), int(source.block_size))


def _layout(source: MapSource) -> TokenLayout:
    if source.layout is None:
        raise ValueError("this source has no token layout (it saw no generation); record a generation first.")
    return source.layout


class TileGrid:
    """The groups of a ``tile`` map: the text, then the 3-D tiles of the source's ``tile_shape``."""

    def __init__(self, source: MapSource):
        self.layout, self.tile_shape = _layout(source), tuple(source.tile_shape)
        self.token_groups = groups = self.layout.tile_of_token(self.tile_shape)
        self.num_blocks = int(groups.max()) + 1
        self.sizes = torch.bincount(groups, minlength=self.num_blocks)


def query_weights(source: MapSource, grid, items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query tokens of each group per batch slot ``(B, 1, N)`` and their total ``(B, 1)``, float64: every token, or
    an item's first ``source.query_lengths`` where the model forms only those (Mochi's padded text), as the pooled
    maps average over them."""
    formed = getattr(source, "query_lengths", None) or [grid.layout.seq_len] * items
    if len(formed) != items:  # a source whose slots it does not say: every query formed
        formed = [grid.layout.seq_len] * items
    w = [torch.bincount(grid.token_groups[: int(n)], minlength=grid.num_blocks) for n in formed]
    return torch.stack(w).double()[:, None], torch.tensor(formed, dtype=torch.float64)[:, None]
