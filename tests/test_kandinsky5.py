"""Kandinsky 5's own checks beyond the conformance suite's (``tests/test_families.py``): the dense sequence is the
video's raster order, word labels follow the pipeline's template and crop, and the sparse mode (NABLA: tokens in
8×8 patches under a block mask per call, run by flex attention) is recorded as the model computes it, in the
video's own order, against a reference built from each attention call's own q, k, v and block mask."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from reference import assert_topk

import cogattn
from cogattn.analysis import words
from cogattn.reference import kind_error, naive_context, naive_kind

k5 = cogattn.models.kandinsky5
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(k5 is None, reason="this diffusers has no Kandinsky 5"),
]
SIZES = dict(block_size=7, topk=4, top_p=(0.5, 0.9, 0.99, 1.0), patterns=("spatial", "temporal", "window:1"))


def _tokens_in_blocks(F, Hp, Wp):
    """``(S,)``: the video token (raster index f·Hp·Wp + y·Wp + x) at each position of NABLA's sequence, from the
    definition (8×8 patches of each frame in (f, y, x) order, each patch's tokens in raster order)."""
    out = []
    for f in range(F):
        for by in range(Hp // 8):
            for bx in range(Wp // 8):
                out += [f * Hp * Wp + (by * 8 + iy) * Wp + bx * 8 + ix for iy in range(8) for ix in range(8)]
    return torch.tensor(out)


def _token_mask(block_mask, S):
    """Boolean ``(B, H, S, S)``: each query's attended keys, from the block mask's kv index lists (full and partial
    blocks of 64 tokens)."""
    keep = torch.zeros(*block_mask.kv_num_blocks.shape, S // 64, dtype=torch.bool)
    for nums, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                          (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):  # fmt: skip
        for idx in torch.cartesian_prod(*[torch.arange(n) for n in nums.shape]):
            b, h, i = idx.tolist()
            keep[b, h, i, indices[b, h, i, : nums[b, h, i]].long()] = True
    return keep.repeat_interleave(64, -2).repeat_interleave(64, -1)


class _Spy:
    """Every attention call of the visual blocks of a stock run: ``calls[(n, layer, role)] = (q, k, v, mask, out)``,
    ``(B, S, H, D)`` as the processor hands them to ``dispatch_attention_fn``, for transformer call ``n``."""

    def __init__(self, pipe, monkeypatch):
        from diffusers.models.transformers import transformer_kandinsky as module

        self.calls, self.where, self.n = {}, None, -1
        transformer = pipe.transformer
        self.handles = [transformer.register_forward_pre_hook(lambda *a: setattr(self, "n", self.n + 1))]
        for layer, block in enumerate(transformer.visual_transformer_blocks):
            for role, attn in (("self", block.self_attention), ("context", block.cross_attention)):
                self.handles.append(attn.register_forward_pre_hook(self._enter(layer, role)))
                self.handles.append(attn.register_forward_hook(lambda *a: setattr(self, "where", None)))
        real = module.dispatch_attention_fn

        def spy(query, key, value, attn_mask=None, **kwargs):
            out = real(query, key, value, attn_mask=attn_mask, **kwargs)
            if self.where is not None:
                self.calls[(self.n, *self.where)] = (query.clone(), key.clone(), value.clone(), attn_mask, out.clone())
            return out

        monkeypatch.setattr(module, "dispatch_attention_fn", spy)

    def _enter(self, layer, role):
        return lambda *a: setattr(self, "where", (layer, role))

    def remove(self):
        for h in self.handles:
            h.remove()


def _nabla_pipe():
    """The tiny NABLA pipeline, its processors under flex attention. ``set_attention_backend`` also sets diffusers'
    process-wide active backend, which the later tests of the process would run: put back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    pipe = k5.tiny_pipeline(attention_type="nabla", num_heads=3)
    pipe.transformer.set_attention_backend("flex")
    _AttentionBackendRegistry._active_backend = active
    return pipe


def _nabla_call(pipe, guided):
    """One video of 9 frames at 256×256: 3 latent frames of 16×16 patches, four 8×8 NABLA blocks each."""
    call = k5.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), guided)
    return {**call, "height": 256, "width": 256}


def _generate(pipe, guided):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex attention without torch.compile
        call = _nabla_call(pipe, guided)
        return pipe(**call, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(1))


def _skipping_blocks(monkeypatch):
    """Make the attention calls of both processors (diffusers' and cogattn's) skip the blocks a ``BlockMask`` leaves
    out, as compiled flex attention does (eager flex attention applies its ``mask_mod`` alone: NABLA's is none)."""
    from diffusers.models.transformers import transformer_kandinsky as module
    from torch.nn.attention.flex_attention import BlockMask

    real = module.dispatch_attention_fn

    def dispatch(query, key, value, attn_mask=None, **kwargs):
        if not isinstance(attn_mask, BlockMask):
            return real(query, key, value, attn_mask=attn_mask, **kwargs)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        mask = _token_mask(attn_mask, q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)

    monkeypatch.setattr(module, "dispatch_attention_fn", dispatch)
    monkeypatch.setattr(k5, "dispatch_attention_fn", dispatch)


@pytest.fixture(scope="module", params=["eager", "blocks"])
def nabla(request):
    """The tiny NABLA pipeline under eager flex attention (``"eager"``) or under a kernel that skips the masked
    blocks (``"blocks"``), its stock latents and, per (call, layer, role), the reference: float64 probabilities in
    the video's order, of the attention the call's own output proves it ran (P @ V against it), the token mask,
    the values and the dense probabilities."""
    pipe = _nabla_pipe()
    with pytest.MonkeyPatch.context() as monkeypatch:
        if request.param == "blocks":
            _skipping_blocks(monkeypatch)
        spy = _Spy(pipe, monkeypatch)
        try:
            video = _generate(pipe, True).frames
        finally:
            spy.remove()
    ref = {}
    back = _tokens_in_blocks(3, 16, 16).argsort()  # sequence position of each raster token
    for (n, layer, role), (q, k, v, mask, out) in spy.calls.items():
        q, k, v, out = (x.transpose(1, 2).double() for x in (q, k, v, out))  # (B, H, S, D)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        dense = P = torch.softmax(scores, -1)
        keep = None
        if role == "self":
            keep = _token_mask(mask, q.shape[2])
            masked = torch.softmax(scores.masked_fill(~keep, -math.inf), -1)
            assert (masked @ v - dense @ v).abs().max() > 1e-3  # the two attentions differ: the output tells
            P = masked if request.param == "blocks" else dense
        assert (P @ v - out).abs().max() < 1e-5, (n, layer, role)  # the reference is the model's attention
        P, dense = P.index_select(2, back), dense.index_select(2, back)
        if role == "self":
            P, dense = P.index_select(3, back), dense.index_select(3, back)
            keep, v = keep.index_select(2, back).index_select(3, back), v.index_select(2, back)
        ref[(n, layer, role)] = (P, keep, v, dense)
    return request.param, pipe, video, ref


def test_the_dense_sequence_is_the_video_in_raster_order_and_the_text_blocks_are_no_sites():
    pipe = k5.tiny_pipeline(num_heads=3)
    seen = {}

    def keep(name):
        def hook(module, args, out=None):
            seen.setdefault(name, args[0] if out is None else out)

        return hook

    pipe.transformer.visual_embeddings.register_forward_hook(keep("grid"))
    pipe.transformer.visual_transformer_blocks[0].register_forward_pre_hook(keep("sequence"))
    call = k5.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    with cogattn.record(pipe, kinds=("entropy",)) as rec:
        text_attention = pipe.transformer.text_transformer_blocks[0].self_attention
        assert type(text_attention.processor).__name__ == "Kandinsky5AttnProcessor"  # the text blocks: no sites
        pipe(**call, num_inference_steps=1, output_type="latent")
    assert rec.layer_names == tuple(f"visual_transformer_blocks.{i}.self_attention" for i in range(2))
    grid, sequence, lay = seen["grid"], seen["sequence"], rec.layout  # (B, F, Hp, Wp, C), (B, S, C)
    assert grid.shape[1:4] == lay.grid == (3, 2, 3)
    for f, y, x in [(0, 0, 0), (1, 0, 2), (2, 1, 1)]:
        assert torch.equal(sequence[:, lay.token_index(f, y, x)], grid[:, f, y, x])


def test_word_labels_are_the_prompt_after_the_template_s_crop_and_a_cut_prompt_is_refused():
    pipe = k5.tiny_pipeline()
    prompt = "a red fox running in the snow"
    labels = words.text_tokens(pipe, prompt, 9)
    assert labels == ["a", "red", "fox", "running", "in", "the", "snow", "<|im_end|>", "</s>"]
    assert words.word_positions("fox", pipe, prompt, 9) == [2]
    with pytest.raises(ValueError, match="the pipeline cut it"):  # 9 tokens, 6 read: max_sequence_length=6
        words.text_tokens(pipe, prompt, 6)


def test_nabla_attention_is_recorded_as_the_model_computes_it_in_the_video_s_order(nabla, monkeypatch):
    """Eager flex attention runs NABLA's block mask as dense attention (its BlockMask has no mask_mod); a kernel
    that skips the masked blocks runs the sparse one: either way every kind is the attention the call's output
    proves, in the video's raster order, with masked pairs exactly 0 where the blocks are skipped; and each call's
    ``nabla_recall`` is the share of the dense attention's mass the mask keeps."""
    mode, pipe, video, ref = nabla
    if mode == "blocks":
        _skipping_blocks(monkeypatch)
    kinds = tuple(k for k in k5.SPEC.kinds() if k != "video_to_image")
    if mode == "eager":  # dense attention: every kind of it is the dense family case's; the order and the recall here
        kinds = ("full", "frame", "query", "entropy", "video_to_text")
    sizes = SIZES if mode == "blocks" else {}  # the options of the kinds asked for
    options = dict(kinds=kinds, batch="all", heads="all", queries=[0, (1, 9, 10)], **sizes)
    with cogattn.record(pipe, **options) as rec:
        got = _generate(pipe, True).frames
    assert torch.equal(got, video), "capture changed the video"
    lay = rec.layout
    assert lay.grid == (3, 16, 16) and len(rec.timesteps) == 2
    tokens = [0, lay.token_index(1, 9, 10)]
    for step in range(2):
        for layer in range(2):
            # the results' batch is [uncond, cond]: the step's second call (the negative prompt's) first
            calls = [ref[(2 * step + c, layer, "self")] for c in (1, 0)]
            P, keep, v, dense = (torch.cat(x) for x in zip(*calls))
            recall = (dense * keep).sum(-1).mean(-1)  # (B, H): each query's dense mass on its kept keys, averaged
            assert (rec.call_stats[(step, layer, "nabla_recall")] - recall).abs().max() < 1e-5
            assert bool((recall < 1 - 1e-3).any()), "the tiny mask should leave out some mass"
            full = rec.get("full", step, layer)
            if mode == "blocks":
                assert bool((full.masked_select(~keep) == 0).all()), "a masked pair got attention"
            for kind in kinds:
                result = rec.get(kind, step, layer)
                if kind == "video_to_text":
                    context = torch.cat([ref[(2 * step + c, layer, "context")][0] for c in (1, 0)])
                    err = (result.double() - naive_context(context, lay.grid)).abs().max().item()
                elif kind == "topk":
                    assert_topk(result, P, 1e-5)
                    continue
                elif kind in ("top_p", "frame_max"):
                    err = kind_error(result, P, kind, 0, lay.grid, **SIZES)
                else:
                    want = naive_kind(P, kind, 0, lay.grid, tokens, v=v, **SIZES)
                    assert result.shape == want.shape, (kind, result.shape, want.shape)
                    err = (result.double() - want).abs().max().item()
                assert err <= (1e-4 if kind == "entropy" else 1e-5), (mode, kind, step, layer, err)


def test_a_nabla_call_on_another_grid_is_refused_before_any_block_runs():
    pipe = _nabla_pipe()
    call = _nabla_call(pipe, False)
    real = pipe.get_sparse_params

    def other(sample, device):
        params = real(sample, device)
        return {**params, "visual_shape": (3, 8, 32)}

    pipe.get_sparse_params = other
    with pytest.raises(ValueError, match=r"visual_shape=\(3, 8, 32\); cogattn records it on the call's own grid"):
        with cogattn.record(pipe, kinds=("entropy",)):
            pipe(**call, num_inference_steps=1, output_type="latent")


def test_nabla_heads_in_another_order_and_the_recall_in_run_json(nabla, monkeypatch, tmp_path):
    """Heads [2, 0] of the conditional item: the per-head mask follows the selected heads; the recall of every head
    is run.json's ``call_stats``, one slot (the conditional call's), its tiles fitted to ``memory_budget`` (1 MiB:
    151 query rows of the 768 keys at a time, 2.25 · rows · S float32s)."""
    import json

    mode, pipe, video, ref = nabla
    if mode == "blocks":
        _skipping_blocks(monkeypatch)
    rows = []
    real = k5.kept_mass
    monkeypatch.setattr(k5, "kept_mass", lambda q, k, keep, r: rows.append(r) or real(q, k, keep, r))
    options = dict(batch="cond", heads=[2, 0], save_dir=tmp_path / "run", memory_budget="1MiB")
    with cogattn.record(pipe, kinds=("full", "entropy"), **options) as rec:
        _generate(pipe, True)
    assert rows == [2**20 // (9 * 768)] * 4 == [151] * 4  # each captured call: 2 steps × 2 layers
    P, keep, _, dense = ref[(2, 1, "self")]  # step 1's conditional call, layer 1
    want = P[:, [2, 0]]
    assert (rec.get("full", 1, 1).double() - want).abs().max() < 1e-5
    assert (rec.get("entropy", 1, 1).double() - naive_kind(want, "entropy", 0, rec.layout.grid)).abs().max() < 1e-4
    recall = (dense * keep).sum(-1).mean(-1)  # (1, H): every head's
    stats = json.loads((tmp_path / "run" / "run.json").read_text())["call_stats"]
    saved = {(e["step"], e["layer"], e["name"]): e["values"] for e in stats}
    assert set(saved) == {(s, la, "nabla_recall") for s in (0, 1) for la in (0, 1)}
    assert (torch.tensor(saved[(1, 1, "nabla_recall")], dtype=torch.float64) - recall).abs().max() < 1e-5
    assert torch.equal(
        cogattn.load(tmp_path / "run").call_stats[(1, 1, "nabla_recall")], rec.call_stats[(1, 1, "nabla_recall")]
    )


@pytest.mark.parametrize(
    "entry",
    [
        "recall",
        {"step": 0, "layer": 0, "name": "nabla_recall"},
        {"step": -1, "layer": 0, "name": "nabla_recall", "values": [[0.5]]},
        {"step": 0, "layer": 0, "name": "nabla_recall", "values": [[0.5], [0.5, 0.4]]},
        {"step": 0, "layer": 0, "name": "nabla_recall", "values": [["0.5"]]},
        {"step": 0, "layer": 0, "name": "nabla_recall", "values": [[float("inf")]]},
        {"step": 0, "layer": True, "name": "nabla_recall", "values": [[0.5]]},
    ],
)
def test_a_run_s_call_stats_are_tables_of_numbers_and_anything_else_is_refused(entry):
    """run.json may come from anyone: ``Run.call_stats`` reads numbers and null (NaN), and names a bad entry."""
    from cogattn.errors import StoreError
    from cogattn.runs.run_values import checked_call_stats

    good = {"step": 1, "layer": 2, "name": "nabla_recall", "values": [[0.25, None]]}
    table = checked_call_stats([good])[(1, 2, "nabla_recall")]
    assert table[0, 0] == 0.25 and table[0, 1].isnan() and table.dtype == torch.float64
    with pytest.raises(StoreError, match="call_stats entry 1"):
        checked_call_stats([good, entry])


@pytest.mark.parametrize(
    "name, frames, seq_len, heads",
    [
        ("kandinskylab/Kandinsky-5.0-T2V-Lite-sft-10s-Diffusers", 241, 61 * 32 * 48, 28),  # NABLA: 8×8 patches fit
        ("kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers", 121, 31 * 32 * 48, 32),
    ],
)
def test_estimates_at_the_released_shapes(name, frames, seq_len, heads):
    est = cogattn.estimate(
        name, num_frames=frames, height=512, width=768, num_inference_steps=50, kinds=("entropy",), heads="all"
    )
    assert est.layout.seq_len == seq_len and est.layout.context_len == k5.TEXT_LEN
    assert {shape for _, shape, _, _ in est.records} == {(1, heads, seq_len)}
    assert (est.tiles.method == "rows") == ("10s" in name)  # NABLA's block mask takes row tiles
