"""Recording a training forward (docs/works-with.md, "Training and fine-tuning"): capture stays out of autograd.

A tiny CogVideoX and a tiny Wan run a training forward and its backward, with gradient checkpointing off, on
(diffusers' default, non-reentrant) and reentrant, first stock, then inside ``record`` (asking for the opt-in fused
output call, which a training forward does not make). The gradients and the output must be bit-identical to
stock's, autograd must save the tensors it saves stock, each attention be captured once (a checkpointed block's
recomputation in the backward pass is neither captured again nor a step), and every map equal the naive float64
reference of the stock call's own q and k (``reference.AttentionSpy``, proved by ``P @ V``) and, bit for bit, the
map of the forward without checkpointing.
"""

from __future__ import annotations

import types

import pytest
import torch
from reference import AttentionSpy, spy_probs
from torch.utils.checkpoint import checkpoint

import cogattn
from cogattn.models import cogvideox, wan
from cogattn.reference import naive_context, naive_kind

pytestmark = pytest.mark.usefixtures("one_thread")


def _reentrant(module, *args):
    return checkpoint(module.__call__, *args, use_reentrant=True)


CHECKPOINTING = {"off": False, "non-reentrant": None, "reentrant": _reentrant}


def _model_and_call(family):
    """A tiny transformer in training mode and the keyword arguments of one training forward (two items)."""
    g = torch.Generator().manual_seed(3)
    if family == "cogvideox":
        model = cogvideox.tiny_transformer()
        call = dict(
            hidden_states=torch.randn(2, 3, 4, 6, 10, generator=g),
            encoder_hidden_states=torch.randn(2, cogvideox.TINY_TEXT_LEN, 16, generator=g),
        )
    else:
        if wan is None:
            pytest.skip("this diffusers has no Wan attention modules (0.35)")
        model = wan.tiny_transformer()
        call = dict(
            hidden_states=torch.randn(2, 16, 3, 4, 6, generator=g),
            encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        )
    return model.train(), dict(call, timestep=torch.tensor([700, 700]), return_dict=False)


class _Counted:
    """A recording's capture calls counted: ``(layer, "self" or "context")`` of each, in order (the processors
    call the recording's ``capture`` and ``capture_context``)."""

    def __init__(self, rec):
        self.seen, capture, context = [], rec.capture, rec.capture_context
        rec.capture = lambda layer, *a, **kw: self.seen.append((layer, "self")) or capture(layer, *a, **kw)
        rec.capture_context = lambda layer, *a, **kw: self.seen.append((layer, "context")) or context(layer, *a, **kw)


def _train_step(model, call, checkpointing):
    """The forward's output, every parameter's gradient after its backward, and how many tensors autograd saved
    for the backward outside checkpointed blocks (without checkpointing: all of them)."""
    model.zero_grad(set_to_none=True)
    if checkpointing is False:
        model.disable_gradient_checkpointing()
    else:
        model.enable_gradient_checkpointing(checkpointing)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        out = model(**call)[0]
    out.double().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], len(saved)


@pytest.mark.parametrize("family", ["cogvideox", "wan"])
def test_a_training_forward_records_once_per_layer_and_leaves_the_gradients_stock(family, monkeypatch):
    model, call = _model_and_call(family)
    spec = cogattn.models.family(family)
    dispatch = None
    if family == "wan":
        from diffusers.models.transformers import transformer_wan as dispatch
    spy = AttentionSpy(types.SimpleNamespace(transformer=model), spec, monkeypatch, dispatch)
    try:
        _train_step(model, call, False)
    finally:
        spy.remove()
        monkeypatch.undo()
    (seen,) = spy.calls  # one transformer call
    probs = {}  # (layer, role) → the naive float64 probabilities of that attention
    for (layer, role), ((q, k, v, mask, out), *_) in seen.items():
        probs[layer, role] = spy_probs(q, k, mask)
        assert (probs[layer, role] @ v.double() - out.double()).abs().max().item() < 1e-5  # it is the attention
    layers = len(spec.layer_names(model))
    kinds = ("frame", "video_to_text") if family == "wan" else ("frame",)  # fused passes, spot-checked rows
    assert len(probs) == layers * len(kinds), sorted(probs)  # each block's self- (and cross-)attention

    plain = None
    for name, checkpointing in CHECKPOINTING.items():
        stock_out, stock_grads, stock_saved = _train_step(model, call, checkpointing)
        with cogattn.record(model, kinds=kinds, batch="all", heads="all", layer_output="joint") as rec:
            counted = _Counted(rec)
            out, grads, saved = _train_step(model, call, checkpointing)
        assert not model._forward_pre_hooks and not model._forward_hooks  # the recording's hooks are gone
        assert torch.equal(out, stock_out), name
        assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads)), f"{name}: the gradients changed"
        assert saved == stock_saved, (name, saved, stock_saved)  # capture kept nothing for the backward
        assert sorted(counted.seen) == sorted(probs), (name, counted.seen)  # each captured once, not twice
        assert rec.timesteps == [700.0], (name, rec.timesteps)
        maps = {(kind, layer): rec.get(kind, 0, layer) for kind, _, layer in rec.keys()}
        assert sorted(maps) == sorted((kind, layer) for kind in kinds for layer in range(layers)), (name, sorted(maps))
        lay = rec.layout
        for (kind, layer), got in maps.items():
            if kind == "video_to_text":
                want = naive_context(probs[layer, "context"], lay.grid)
            else:
                want = naive_kind(probs[layer, "self"], kind, lay.text_len, lay.grid)
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-5, (name, kind, layer, err)
        plain = plain or maps
        assert all(torch.equal(maps[key], plain[key]) for key in maps), f"{name}: not the maps of a plain forward"
    model.disable_gradient_checkpointing()
