"""What a map processor hands the recording: the :class:`MapSink` protocol every family's processor uses.

A family's processor (``cogattn.models.cogvideox``, ``.wan``, ...) is diffusers' own processor line for
line, plus a few calls on a :class:`MapSink`; it knows the recording only through this protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..layout import TokenLayout
    from ..options import CaptureOptions

__all__ = [
    "GroupMask",
    "MapSink",
    "QueryKeyBias",
    "context_bias",
    "key_counts",
    "key_mask",
    "query_key_bias",
    "query_key_mask",
]


class MapSink(Protocol):
    """What a map processor hands its captures to (a :class:`cogattn.Recording`); CogVideoX's and Wan's
    processors (:mod:`cogattn.wan`) both use it. ``options`` (`CaptureOptions`): what the recording was asked,
    ``memory_budget`` among them, for a processor's own passes (Kandinsky 5's NABLA recall)."""

    options: CaptureOptions
    layout: TokenLayout | None  # the generation's, once its first transformer call has made the plan

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
        mask: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> None:
        """Compute the selected maps of ``layer`` from ``query`` and ``key`` ``(B, H, S, D)``; ``key_counts``
        ``(B,)``: each item's kept keys (the first ones), under a key mask; ``query_counts`` ``(B,)``: each
        item's formed query rows (the first ones), where the model never forms the others; ``mask``
        ``(B or 1, S, S)``: any other mask, from :func:`query_key_mask` (or an additive one, a :class:`QueryKeyBias`
        from :func:`query_key_bias`); ``value`` ``(B, H, S, D)``: the values,
        handed over only where :attr:`wants_value` says a kind needs them (``pattern_error``)."""

    def capture_stat(self, layer: int, name: str, values: torch.Tensor) -> None:
        """Keep a per-call statistic ``name`` of ``layer``'s captured call, one value per batch item of the call
        and head, ``(B, H)`` (Kandinsky 5's ``"nabla_recall"``: the share of the dense attention's mass its sparse
        mask keeps): the recording's ``call_stats``, in run.json."""

    @property
    def wants_value(self) -> bool:
        """Whether a selected kind needs the attention's values (processors then pass ``value`` to :meth:`capture`)."""

    def capture_context(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, context: str, bias: torch.Tensor | None = None
    ) -> None:
        """Compute the selected kinds of a cross-attention (Wan's ``attn2``) from the video queries ``query``
        ``(B, H, V, D)`` and the keys ``key`` ``(B, H, C, D)`` of its ``context`` (``"text"`` or ``"image"``);
        ``bias`` ``(B, C)``: what the attention adds to each item's scores of its keys, where it takes a key
        mask (LTX-Video's padded text: 0 or −10000), from :func:`context_bias`."""


class GroupMask:
    """A query-key mask given per head over groups of tokens, where a model masks blocks of tokens (NABLA's
    64-token blocks): query i attends key j where ``keep[h, group[i], group[j]]``. Capture takes it as ``mask``
    as it takes a ``(B or 1, S, S)`` one, and forms each row tile's ``(h, r, S)`` mask from it (:meth:`rows`),
    never the ``(H, S, S)`` whole.

    Args:
        keep (`torch.Tensor`): boolean ``(B, H, N, N)`` (one item's: ``(H, N, N)``), `True` where a query group
            attends a key group.
        group (`torch.Tensor`): ``(S,)`` the group of each token of the sequence capture is handed.
        kept (`torch.Tensor | None`): ``(B,)`` each item's kept keys, where the mask is a key mask (:func:`key_mask`).
    """

    def __init__(self, keep: torch.Tensor, group: torch.Tensor, kept: torch.Tensor | None = None):
        self.keep, self.group, self.kept = keep.bool(), group.long(), kept

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keep.shape)

    def __getitem__(self, item: int) -> GroupMask:
        """Batch item ``item``'s mask, ``keep`` ``(H, N, N)``."""
        return GroupMask(self.keep[item], self.group)

    def select_heads(self, heads: torch.Tensor | None) -> GroupMask:
        """One item's mask of the selected ``heads`` (`None`: all), in their order."""
        return self if heads is None else GroupMask(self.keep.index_select(0, heads.to(self.keep.device)), self.group)

    def to(self, device) -> GroupMask:
        return GroupMask(self.keep.to(device), self.group.to(device))

    def rows(self, rows, h0: int, h1: int) -> torch.Tensor:
        """One item's mask of query ``rows`` (a slice or indices) for heads ``h0:h1``: boolean ``(h, r, S)``."""
        by_query = self.keep[h0:h1].index_select(1, self.group[rows].flatten())  # (h, r, N)
        return by_query.index_select(2, self.group)


class QueryKeyBias:
    """An additive bias of a self-attention's scores, the same for every head, where a model adds one that is no
    mask (LTX-2's IC-LoRA: −10000·(1 − strength) between reference and generated tokens): query i's score of key j
    gains ``bias[i, j]`` before the softmax, as the attention adds it. Capture takes it as ``mask``; row tiles add
    each tile's float32 ``(1, r, S)`` rows (:meth:`rows`), never a copy of the ``(S, S)`` whole.

    Args:
        bias (`torch.Tensor`): float ``(B or 1, S, S)`` (one item's: ``(S, S)``) in the model's token order.
        order (`torch.Tensor | None`): ``(S,)`` the model's token at each position of the sequence capture is handed,
            where the processor reorders it for the capture (LTX-2's tokens after the grid, moved first); `None`:
            the model's order.
    """

    additive = True  # row tiles add it to the scores (a boolean mask sets masked scores to −inf)

    def __init__(self, bias: torch.Tensor, order: torch.Tensor | None = None, shift: int | None = None):
        self.bias, self.order = bias, None if order is None else order.long()
        self.shift = shift  # where the order is a rotation (LTX-2's: the last tokens first), its first token
        if shift is None and self.order is not None and len(self.order):
            first, n = int(self.order[0]), len(self.order)
            rotated = torch.arange(first, first + n, device=self.order.device) % n
            self.shift = first if torch.equal(self.order, rotated) else None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bias.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes :meth:`rows` holds per score: the rows in the bias's dtype (twice, under an order that is no
        rotation: the column gather) and in float32."""
        gathers = 2 if self.order is not None and self.shift is None else 1
        return 4 + gathers * self.bias.element_size()

    def __getitem__(self, item: int) -> QueryKeyBias:
        """Batch item ``item``'s bias ``(S, S)``."""
        return QueryKeyBias(self.bias[item], self.order, self.shift)

    def select_heads(self, heads: torch.Tensor | None) -> QueryKeyBias:
        """The same for every head: itself."""
        return self

    def to(self, device) -> QueryKeyBias:
        order = None if self.order is None else self.order.to(device)
        return QueryKeyBias(self.bias.to(device), order, self.shift)

    def rows(self, rows, h0: int, h1: int) -> torch.Tensor:
        """One item's bias of query ``rows`` (a slice or indices of the capture's order), float32 ``(1, r, S)``."""
        if self.order is None:
            return self.bias[rows].float()[None]
        picked = self.bias[self.order[rows]]  # (r, S): the rows, in the model's column order
        if self.shift is None:
            return picked.index_select(-1, self.order).float()[None]
        out = torch.empty(1, *picked.shape, dtype=torch.float32, device=picked.device)
        cut = picked.shape[-1] - self.shift  # a rotation: two slices, copied and made float32 at once
        out[0, :, :cut].copy_(picked[:, self.shift :])
        out[0, :, cut:].copy_(picked[:, : self.shift])
        return out


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


def key_mask(mask: torch.Tensor | None, seq_len: int, heads: int) -> tuple[torch.Tensor | None, GroupMask | None]:
    """A boolean key mask ``(B, 1, 1, S)`` as capture takes it: ``(counts, None)`` where it keeps each item's first
    keys (:func:`key_counts`: padded text at the end), else ``(None, GroupMask)`` (text padded on the left, as a Gemma
    tokenizer pads by default): a token's group is the set of items that keep it, and each item's queries attend the
    groups it keeps; row tiles apply it. Its ``kept`` is each item's count of kept keys (``Recording.text_lengths``)."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, 1, seq_len):
        return key_counts(mask, seq_len), None  # no mask, or one key_counts refuses in one line
    keep = mask[:, 0, 0]
    counts = keep.sum(-1)
    if torch.equal(keep, torch.arange(seq_len, device=mask.device) < counts[:, None]):
        return key_counts(mask, seq_len), None
    if keep.shape[0] > 63:
        raise ValueError(f"cogattn captures a key mask of at most 63 items; this one has {keep.shape[0]}.")
    bit = 1 << torch.arange(keep.shape[0], device=mask.device)
    patterns, group = torch.unique((keep.long() * bit[:, None]).sum(0), return_inverse=True)  # (N,), (S,)
    kept = (patterns[None, :] & bit[:, None]) > 0  # (B, N): the item keeps the group's keys
    n = len(patterns)
    return None, GroupMask(kept[:, None, None, :].expand(-1, heads, n, n), group, counts.cpu())


def context_bias(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """The key mask of a cross-attention call as capture takes it: float32 ``(B, C)``, what the attention adds to
    each item's scores of its ``C = length`` keys (a boolean mask: 0 where kept, −inf where not); `None` where
    there is none. Takes a mask ``(B, 1 or H, 1, C)`` that is the same for every head (LTX-Video's, made per head
    by ``prepare_attention_mask``); raises `ValueError` for any other, which capture does not take."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] != batch or mask.shape[2] != 1 or mask.shape[3] != length:
        raise ValueError(
            f"cogattn captures a cross-attention under a key mask (B, H, 1, {length}); this call's mask is "
            f"{tuple(mask.shape)}."
        )
    if not torch.equal(mask, mask[:, :1].expand_as(mask)):
        raise ValueError(
            "cogattn captures a cross-attention key mask that is the same for every head; this one is not."
        )
    first = mask[:, 0, 0]
    if first.dtype == torch.bool:
        return torch.zeros(first.shape, device=mask.device).masked_fill_(~first, float("-inf"))
    return first.float()


def kept_count(bias: torch.Tensor) -> list[int]:
    """Per item of a key mask ``bias`` ``(B, C)`` (:func:`context_bias`'s), the keys it keeps (a key below −1000 has
    no probability in float32), wherever they are: a text padded at the end or at the start."""
    return (bias > -1000.0).sum(-1).tolist()


def query_key_mask(mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    """The attention mask of a self-attention call as capture takes it: boolean ``(B or 1, S, S)``, `True`
    where a query attends a key (SkyReels-V2's block-causal mask under diffusion forcing); `None` when it
    masks nothing. Takes a boolean mask or an additive one of 0 and −inf, ``(B or 1, 1, S, S)``; raises
    `ValueError` for any other (a bias, or a mask per head), which capture does not take. Every block of a
    transformer call passes the same mask: it is read once (kept on the tensor, while it is unchanged)."""
    if mask is None:
        return None
    key = (mask._version, batch, seq_len)
    read = getattr(mask, "_cogattn_read", None)
    if read is None or read[0] != key:
        read = (key, *_read_mask(mask, batch, seq_len))
        mask._cogattn_read = read
    _, masks_nothing, converted = read
    return None if masks_nothing else (mask if converted is None else converted)[:, 0]


def _read_mask(mask: torch.Tensor, batch: int, seq_len: int) -> tuple[bool, torch.Tensor | None]:
    """``(whether it masks nothing, the boolean mask of an additive one)``, or `ValueError`."""
    ok_shape = mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, batch)
    if not ok_shape or tuple(mask.shape[2:]) != (seq_len, seq_len):
        raise ValueError(
            f"cogattn captures attention under a mask of shape (B or 1, 1, {seq_len}, {seq_len}); this call's mask "
            f"is {tuple(mask.shape)}."
        )
    converted = None
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == -torch.inf)).all()):
            raise ValueError(
                "cogattn captures attention under a boolean mask or an additive one of 0 and -inf; this call adds "
                "other values (a bias), which is no mask."
            )
        converted = mask == 0
    keep = mask if converted is None else converted
    if not bool(keep.any(-1).all()):
        raise ValueError("this call's attention mask leaves a query row no key, whose attention is undefined.")
    return bool(keep.all()), converted


_SLAB = 2**24  # entries of the mask query_key_bias compares at a time


def query_key_bias(mask: torch.Tensor | None, batch: int, seq_len: int, order=None) -> QueryKeyBias | None:
    """The additive mask of a self-attention call as capture takes it, a :class:`QueryKeyBias` (``order``: its
    argument); `None` where it adds nothing. Takes a float mask ``(B, 1 or H, S, S)`` that is the same for every head
    (LTX-2's, made per head by ``prepare_attention_mask``); raises `ValueError` for any other."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] != batch or tuple(mask.shape[2:]) != (seq_len, seq_len):
        raise ValueError(
            f"cogattn captures a self-attention under an additive mask (B, H, {seq_len}, {seq_len}); this call's "
            f"mask is {tuple(mask.shape)}."
        )
    if mask.dtype == torch.bool or not mask.is_floating_point():
        raise ValueError(f"cogattn takes an additive (float) mask here; this call's is {mask.dtype}.")
    first = mask[:, 0]  # a view: the model's mask is not copied
    rows = max(1, _SLAB // (batch * seq_len))  # compared in slabs: no (B, H, S, S) temporary
    slabs = [slice(r0, r0 + rows) for r0 in range(0, seq_len, rows)]
    if not all(torch.equal(mask[:, h, r], first[:, r]) for h in range(1, mask.shape[1]) for r in slabs):
        raise ValueError(
            "cogattn captures an additive self-attention mask that is the same for every head; this one is not."
        )
    return QueryKeyBias(first, order) if any(bool(first[:, r].any()) for r in slabs) else None
