"""Independent reference: q and k recomputed from each attention module's inputs, and naive
``softmax(q @ k.T * scale)`` in float64 with every kind derived by plain indexing."""

from __future__ import annotations

import math

import torch
from diffusers.models.embeddings import apply_rotary_emb

from cogattn import KINDS


class QKSpy:
    """Keeps (q, k) of every ``attn1`` call, recomputed from the module's inputs with its own layers."""

    def __init__(self, transformer):
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in transformer.transformer_blocks]
        self._handles = [
            block.attn1.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, block in enumerate(transformer.transformer_blocks)
        ]

    def _hook(self, layer):
        def hook(attn, args, kwargs):
            hs, ehs, rope = kwargs["hidden_states"], kwargs["encoder_hidden_states"], kwargs.get("image_rotary_emb")
            T = ehs.shape[1]
            x = torch.cat([ehs, hs], dim=1)
            B, S, _ = x.shape
            q = attn.to_q(x).view(B, S, attn.heads, -1).transpose(1, 2)
            k = attn.to_k(x).view(B, S, attn.heads, -1).transpose(1, 2)
            q, k = attn.norm_q(q), attn.norm_k(k)
            if rope is not None:
                q = torch.cat([q[:, :, :T], apply_rotary_emb(q[:, :, T:], rope)], dim=2)
                k = torch.cat([k[:, :, :T], apply_rotary_emb(k[:, :, T:], rope)], dim=2)
            self.calls[layer].append((q.detach().clone(), k.detach().clone()))

        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def naive_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, S)`` float64 softmax(q kᵀ / sqrt(D))."""
    q, k = q.double(), k.double()
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)


def naive_kind(P: torch.Tensor, kind: str, T: int, grid: tuple[int, int, int], queries=None) -> torch.Tensor:
    """One kind from full probabilities ``P`` ``(B, H, S, S)`` by plain indexing (the definitions in docs/design.md)."""
    B, H, S, _ = P.shape
    F, Hp, Wp = grid
    if kind == "full":
        return P
    if kind == "query":
        return P[:, :, list(queries)]
    if kind == "video_to_text":
        return P[:, :, T:, :T].permute(0, 1, 3, 2).reshape(B, H, T, F, Hp, Wp)
    if kind == "text_to_video":
        return P[:, :, :T, T:].reshape(B, H, T, F, Hp, Wp)
    if kind == "frame":
        bounds = [0, T] + [T + (f + 1) * Hp * Wp for f in range(F)]
        G = F + 1
        out = torch.empty(B, H, G, G, dtype=P.dtype)
        for g in range(G):
            for h in range(G):
                block = P[:, :, bounds[g] : bounds[g + 1], bounds[h] : bounds[h + 1]]
                out[:, :, g, h] = block.sum(-1).mean(-1)
        return out
    raise ValueError(kind)


def select(x: torch.Tensor, batch, heads) -> torch.Tensor:
    """Apply a batch list and heads ("all", "mean" or a list) to a ``(B, H, ...)`` reference."""
    x = x[list(batch)]
    if heads == "mean":
        return x.mean(1, keepdim=True)
    if heads == "all":
        return x
    return x[:, list(heads)]


def assert_matches_naive(rec, spy: QKSpy, batch, heads, kinds=KINDS, queries=None, tol: float = 1e-5) -> None:
    """Every recorded map of ``kinds`` equals the naive float64 reference from the spied q and k within ``tol``."""
    lay = rec.layout
    tokens = [lay.token_index(*x) if isinstance(x, tuple) else x for x in queries] if queries else None
    for layer, calls in enumerate(spy.calls):
        for step, (q, k) in enumerate(calls):
            P = naive_probs(q.cpu().float(), k.cpu().float())
            for kind in kinds:
                ref = select(naive_kind(P, kind, lay.text_len, lay.grid, tokens), batch, heads)
                got = rec.get(kind, step, layer)
                assert got.shape == ref.shape, (kind, got.shape, ref.shape)
                err = (got.double() - ref).abs().max().item()
                assert err <= tol, (kind, step, layer, err)
