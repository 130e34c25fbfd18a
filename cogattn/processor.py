"""What a map processor hands the recording: the :class:`MapSink` protocol every family's processor uses.

A family's processor (``cogattn.models.cogvideox``, ``.wan``, ...) is diffusers' own processor line for
line, plus a few calls on a :class:`MapSink`; it knows the recording only through this protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["MapSink", "key_counts"]


class MapSink(Protocol):
    """What a map processor hands its captures to (a :class:`cogattn.Recording`); CogVideoX's and Wan's
    processors (:mod:`cogattn.wan`) both use it."""

    def layer_to_capture(self, attn) -> int | None:
        """The block index of the module ``attn`` when this call is captured, else `None`."""

    def attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """For a captured call: `None` to keep the stock output call, or ``(output, lse, sums)`` from the
        opt-in fused call (``lse`` ``(B, H, S)`` and ``sums`` ``(B, H, S, C)`` where it brings them)."""

    def capture(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        lse: torch.Tensor | None,
        sums: torch.Tensor | None,
        key_counts: torch.Tensor | None = None,
        query_counts: torch.Tensor | None = None,
    ) -> None:
        """Compute the selected maps of ``layer`` from ``query`` and ``key`` ``(B, H, S, D)``; ``key_counts``
        ``(B,)``: each item's kept keys (the first ones), under a key mask; ``query_counts`` ``(B,)``: each
        item's formed query rows (the first ones), where the model never forms the others."""

    def capture_context(self, layer: int, query: torch.Tensor, key: torch.Tensor, context: str) -> None:
        """Compute the selected kinds of a cross-attention (Wan's ``attn2``) from the video queries ``query``
        ``(B, H, V, D)`` and the keys ``key`` ``(B, H, C, D)`` of its ``context`` (``"text"`` or ``"image"``)."""


def key_counts(mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """Each batch item's number of kept keys, ``(B,)``, for a boolean key mask ``(B, 1, 1, S)`` that keeps a
    prefix of the keys (padded text at the end of the sequence, HunyuanVideo); `None` when it keeps every
    key. Raises `ValueError` for any other mask, which capture does not take."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[-1] != seq_len:
        raise ValueError(
            f"cogattn captures attention under a boolean key mask (B, 1, 1, {seq_len}) keeping each item's first "
            f"keys; this call's mask is {mask.dtype} {tuple(mask.shape)}."
        )
    keep = mask[:, 0, 0]
    counts = keep.sum(-1)
    if not torch.equal(keep, torch.arange(seq_len, device=mask.device) < counts[:, None]):
        raise ValueError("cogattn captures a key mask that keeps each item's first keys; this one keeps others.")
    return None if bool((counts == seq_len).all()) else counts.cpu()
