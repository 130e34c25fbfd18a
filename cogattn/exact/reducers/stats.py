"""The row statistics the engine computes: ``entropy`` (per query) and ``received`` (per key)."""

from __future__ import annotations

import torch

from .base import Reducer

__all__ = ["EntropyReducer", "ReceivedReducer"]


class EntropyReducer(Reducer):
    """``entropy``: ``(B, H, S)``, ``−Σ_j P[i, j] ln P[i, j]`` in nats for every query token."""

    kind = "entropy"
    dims = ("query token",)
    unit = "entropy (nats)"
    stat = "entropy"

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len)

    def from_rows(self, probs):
        return -torch.special.xlogy(probs, probs).sum(-1, keepdim=True)

    def fold_pooled(self, out, h0, r0, pooled):
        self._accumulate(out[:, r0 : r0 + pooled.shape[1]], h0, pooled[..., 0])


class ReceivedReducer(Reducer):
    """``received``: ``(B, H, S)``, ``Σ_i P[i, j]`` over every query token for every key token (sums to S; one key
    can receive up to S, past float16's 65,504 in long videos: float32 where the storage dtype is float16)."""

    kind = "received"
    dims = ("key token",)
    unit = "attention received (sums to S)"
    stat = "received"

    @classmethod
    def stored_dtype(cls, storage, mean_heads=False):
        return torch.float32 if storage == torch.float16 else storage

    def shape(self, num_batch):
        return (num_batch, self.out_heads, self.layout.seq_len)

    def fold_received(self, out, h0, sums):
        self._accumulate(out, h0, sums)
