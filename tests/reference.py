"""The suite's reference: q and k recomputed from each attention module's inputs (independently of
cogattn's processors), and the naive float64 softmax of :mod:`cogattn.reference`, which shares no code
with the engine."""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from cogattn.exact.patterns import DEFAULT_PATTERNS
from cogattn.models.cogvideox import SPEC as COGVIDEOX
from cogattn.reference import kind_error, naive_kind, naive_probs, select

__all__ = ["KINDS", "AttentionSpy", "QKSpy", "assert_matches_naive", "naive_kind", "naive_probs", "select", "spy_probs"]

# every kind CogVideoX makes but pattern_error, whose reference needs V, which QKSpy does not keep
# (tests/test_families.py and tests/test_patterns.py hold it to the reference with V)
KINDS = tuple(k for k in COGVIDEOX.kinds() if k != "pattern_error")


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


def assert_matches_naive(rec, spy: QKSpy, batch, heads, kinds=KINDS, queries=None, tol: float = 1e-5) -> None:
    """Every recorded map of ``kinds`` equals the naive float64 reference from the spied q and k within ``tol``
    (``entropy``: within ``10 · tol``, 1e-4 by default; ``topk``: the values, and the probabilities at the
    returned key tokens, since equal probabilities may come in either order)."""
    lay = rec.layout
    assert spy.calls and all(spy.calls), "the spy saw no attention call: nothing would be compared"
    tokens = [lay.token_index(*x) if isinstance(x, tuple) else x for x in queries] if queries else None
    patterns = rec.options.patterns or DEFAULT_PATTERNS
    sizes = dict(block_size=rec.block_size, topk=rec.topk, tile_shape=rec.tile_shape, patterns=patterns)
    for layer, calls in enumerate(spy.calls):
        for step, (q, k) in enumerate(calls):
            P = naive_probs(q.cpu().float(), k.cpu().float())
            for kind in kinds:
                got = rec.get(kind, step, layer)
                if kind == "topk":
                    assert_topk(got, select(P, batch, heads), tol)
                    continue
                if kind in ("top_p", "frame_max"):  # counts; values and key tokens (cogattn.reference says how)
                    per_head = select(P, batch, "all" if heads == "mean" and kind == "top_p" else heads)
                    err = kind_error(got, per_head, kind, lay.text_len, lay.grid, mean_heads=heads == "mean",
                                     top_p=rec.options.top_p)  # fmt: skip
                    assert err <= tol, (kind, step, layer, err)
                    continue
                ref = select(naive_kind(P, kind, lay.text_len, lay.grid, tokens, **sizes), batch, heads)
                assert got.shape == ref.shape, (kind, got.shape, ref.shape)
                err = (got.double() - ref).abs().max().item()
                assert err <= (10 * tol if kind == "entropy" else tol), (kind, step, layer, err)


def assert_topk(got, P: torch.Tensor, tol: float) -> None:
    """``got`` (a TopK) holds the k largest of each row of ``P`` ``(B, H, S, S)``, largest first."""
    values, indices = got
    ref = P.topk(values.shape[-1], dim=-1).values
    assert values.shape == ref.shape and indices.dtype == torch.long, (values.shape, ref.shape, indices.dtype)
    assert (values.double() - ref).abs().max().item() <= tol
    assert (P.gather(-1, indices) - ref).abs().max().item() <= tol  # the indices point at those probabilities
    assert bool((values[..., :-1] >= values[..., 1:]).all())


class AttentionSpy:
    """Every ``scaled_dot_product_attention`` call inside a capture site of a stock run: ``calls[n][(layer,
    role)]`` is the list of ``(q, k, v, mask, out)`` of transformer call ``n`` (role ``"self"``, ``"context"``, or
    the source of a site's other attention: LTX-2's ``"audio"``, ``"audio_text"``, ``"a2v"``, ``"v2a"``)."""

    def __init__(self, pipe, spec, monkeypatch, dispatch=None):
        self.calls: list[dict] = []
        self.where = None
        transformer = pipe.transformer
        self.handles = [transformer.register_forward_pre_hook(lambda *a: self.calls.append({}))]
        for layer, (_, attn, context) in enumerate(spec.layers(transformer)):
            for role, module in (("self", attn), ("context", context)):
                if module is not None:
                    self.handles.append(module.register_forward_pre_hook(self._enter(layer, role)))
                    self.handles.append(module.register_forward_hook(self._leave))
        blocks = [(b, site.others) for site in spec.sites for b in getattr(transformer, site.blocks, None) or ()]
        for layer, (block, others) in enumerate(blocks):  # a site's other attentions (LTX-2's audio): by source
            for source, attr in others:
                self.handles.append(block.get_submodule(attr).register_forward_pre_hook(self._enter(layer, source)))
                self.handles.append(block.get_submodule(attr).register_forward_hook(self._leave))
        # dispatch: a module whose dispatch_attention_fn the processors call, to spy there ((B, S, H, D)
        # tensors), whatever backend it runs; else torch's scaled_dot_product_attention
        owner, name = (
            (dispatch, "dispatch_attention_fn") if dispatch else (torch.nn.functional, "scaled_dot_product_attention")
        )
        real = getattr(owner, name)

        def spy(query, key, value, attn_mask=None, **kwargs):
            out = real(query, key, value, attn_mask=attn_mask, **kwargs)
            if self.where is not None:
                q, k, v, o = (x.transpose(1, 2) if dispatch else x for x in (query, key, value, out))
                mask = None if attn_mask is None else attn_mask.clone()
                self.calls[-1].setdefault(self.where, []).append((q.clone(), k.clone(), v.clone(), mask, o.clone()))
            return out

        monkeypatch.setattr(owner, name, spy)

    def _enter(self, layer, role):
        def hook(module, args):
            self.where = (layer, role)

        return hook

    def _leave(self, module, args, output):
        self.where = None

    def remove(self):
        for h in self.handles:
            h.remove()


def spy_probs(q, k, mask):
    """The naive float64 probabilities of one spied call: ``mask`` a key mask ``(B, 1, 1, S)`` or a query-key
    mask ``(B, 1, S, S)`` (masked scores at −inf), or an additive key mask ``(B, H, 1, S)`` or query-key bias
    ``(B, H, S, S)``, the same for every head (added to the scores), as the call was given it."""
    if mask is not None and mask.shape[-2] > 1 and mask.dtype != torch.bool:  # a bias (LTX-2's IC-LoRA), every head's
        assert torch.equal(mask, mask[:, :1].expand_as(mask)), mask.shape
        scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
        return (scores + mask[:, :1].double()).softmax(-1)
    if mask is not None and mask.shape[-2] > 1:  # a query-key mask (diffusion forcing): masked scores at -inf
        assert mask.dtype == torch.bool and mask.shape[1] == 1, mask.shape
        scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)
    key_mask = None
    if mask is not None and mask.dtype != torch.bool:  # an additive key mask per head (LTX-Video's): one for all
        assert mask.shape[2] == 1 and torch.equal(mask, mask[:, :1].expand_as(mask)), mask.shape
        key_mask = mask[:, 0, 0].double()
    elif mask is not None:
        assert mask.shape[1:3] == (1, 1), mask.shape  # a key mask
        key_mask = mask[:, 0, 0]
    return naive_probs(q, k, key_mask=key_mask)
