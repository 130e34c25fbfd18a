"""Which keys pool together: :class:`KeyGroups` (frames, blocks, 3-D tiles, text tokens), the key axis of every
pooled kind, made from a :class:`cogattn.layout.TokenLayout` by the reducers."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["KeyGroups"]


@dataclass(frozen=True)
class KeyGroups:
    """Key ``keys[n]`` belongs to group ``groups[n]`` (``0 <= groups[n] < num_groups``); a key may be left out.
    ``boxes``: for the 3-D tiles of the video grid, ``(text slice, video start, grid, tile_shape)``: each group a
    box of the grid (and the text one group), summed by reshapes (:func:`cogattn.exact.passes.box_sums`), not through
    an ``(S, C)`` indicator."""

    keys: torch.Tensor
    groups: torch.Tensor
    num_groups: int
    boxes: tuple | None = None

    @property
    def single_keys(self) -> bool:
        """True when every group holds exactly one key (column ``c`` is then ``P[:, keys[c]]``)."""
        return len(self.keys) == self.num_groups and bool((self.groups == torch.arange(self.num_groups)).all())

    @functools.cached_property  # asked at every capture; a frozen dataclass keeps it in its __dict__
    def runs(self) -> list[tuple[int, int]] | None:
        """``[(start, end)]`` of each group, in group order, when every group is one run of consecutive keys
        and together they cover ``0..S`` (frames, with the text before or after the video; blocks), else
        `None`: sums over a run are a slice and a sum."""
        S = len(self.keys)
        if not torch.equal(self.keys.cpu(), torch.arange(S)):
            return None
        change = torch.nonzero(self.groups.cpu().diff()).flatten().add(1).tolist()
        starts, ends = [0, *change], [*change, S]
        order = self.groups.cpu()[starts].tolist()
        if sorted(order) != list(range(self.num_groups)):  # a group in two runs, or an empty one
            return None
        return [run for _, run in sorted(zip(order, zip(starts, ends)))]

    def indicator(self, seq_len: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """Dense indicator ``V`` of shape ``(S, C)``: ``V[j, c] = 1`` if key ``j`` is in group ``c``."""
        v = torch.zeros(seq_len, self.num_groups, dtype=dtype, device=device)
        v[self.keys.to(device), self.groups.to(device)] = 1
        return v
