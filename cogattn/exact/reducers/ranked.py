"""The kinds that rank each row's keys: ``top_p`` (how many of the largest keys reach a mass p) and
``frame_max`` (the largest key of every frame group). Both need every score of a row: row tiles only."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..top_p import top_p_columns, top_p_counts
from .base import Reducer
from .rows import pair_index

__all__ = ["FrameMax", "FrameMaxReducer", "TopPReducer", "check_top_p"]


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
    if len(set(values)) < len(values):
        raise ValueError(f"top_p={value!r} lists a p twice; give each mass once.")
    return tuple(float(p) for p in values)


class TopPReducer(Reducer):
    """``top_p``: ``(B, H, S, len(top_p))``, for every query token and each p of ``top_p`` the fewest keys whose
    largest probabilities sum to at least p times the row's total (NABLA's and XAttention's criterion; p = 1: the keys
    of nonzero float32 probability). Counts, exact integers, stored as int32; with heads averaged, the mean of the
    heads' counts, stored as float32."""

    kind = "top_p"
    dims = ("query token", "mass p")
    unit = "keys needed to reach mass p"

    def __init__(self, layout, num_heads, mean_heads, queries=None, **sizes):
        super().__init__(layout, num_heads, mean_heads, **sizes)
        self.rows = torch.arange(layout.seq_len)

    @classmethod
    def stored_dtype(cls, storage, mean_heads=False):
        return torch.float32 if mean_heads else torch.int32  # counts; their mean is no integer

    def row_columns(self, seq_len, cpu=True):
        return top_p_columns(seq_len, cpu)

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

    @classmethod
    def stored_dtype(cls, storage, mean_heads=False):
        return torch.float32  # values beside key indices, which float32 holds exactly below 2²⁴ tokens

    @staticmethod
    def unpack(tensor):
        return FrameMax(tensor[..., 0], tensor[..., 1].long())

    @staticmethod
    def stored_index(index):
        return pair_index(index, "frame_max", "(B, H, S, G)")

    def row_columns(self, seq_len, cpu=True):
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
