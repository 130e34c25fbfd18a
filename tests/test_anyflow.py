"""AnyFlow's own rules (tests/test_families.py holds every kind of its tiny pipeline to the reference): latents
``(B, F, C, H, W)`` and a timestep per frame, read from a bare transformer's call; an ``image_dim`` model's image
tokens leading the text's in one cross-attention softmax; a conditioning video's frames at timestep 0; AnyFlow-FAR
refused in one line; the released checkpoints planned offline.

The reference is each stock attention call, spied where the processors dispatch it (``reference.AttentionSpy``): the
naive float64 softmax of its q and k, proved by ``P @ V``; the self-attention's q and k are also recomputed from the
module's inputs with its own layers and the RoPE as complex numbers, so the spied ones are the model's.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.analysis.words import PromptFormat
from cogattn.models import spec_for_config
from cogattn.reference import naive_context

anyflow = pytest.importorskip("cogattn.models.anyflow", reason="this diffusers lacks AnyFlow (it needs 0.42)")

pytestmark = pytest.mark.usefixtures("one_thread")


def _spied(model, monkeypatch, run):
    """The stock output and the spy's calls, each call's reference proved against its output."""
    dispatch = sys.modules[type(model).__module__]
    spy = AttentionSpy(SimpleNamespace(transformer=model), anyflow.SPEC, monkeypatch, dispatch)
    try:
        out = run()
    finally:
        spy.remove()
        monkeypatch.undo()
    for seen in spy.calls:
        for found in seen.values():
            for q, k, v, mask, o in found:
                assert (spy_probs(q, k, mask) @ v.double() - o.double()).abs().max() < 1e-5  # the model's attention
    return out, spy.calls


def _module_qk(inputs):
    """q, k ``(B, H, S, D)`` of each ``attn1`` call, recomputed from its inputs: its projections and norms, then the
    RoPE as a product of complex numbers in float64, cast back."""
    out = []
    for attn, kwargs in inputs:
        x, freqs = kwargs["hidden_states"], kwargs["rotary_emb"]
        qk = []
        for proj, norm, name in ((attn.to_q, attn.norm_q, "query"), (attn.to_k, attn.norm_k, "key")):
            y = norm(proj(x)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
            z = torch.view_as_complex(y.double().unflatten(-1, (-1, 2)).contiguous()) * freqs[name]
            qk.append(torch.view_as_real(z).flatten(-2).to(y.dtype))
        out.append(qk)
    return out


def test_a_bare_transformer_s_call_with_an_image_is_recorded_from_its_own_q_and_k(monkeypatch):
    """``record(transformer)``: latents (B, F, C, H, W), a timestep per frame (the first frame's 0), and 5 image
    tokens that lead 7 text tokens in one softmax; ``full`` is the self-attention's softmax, ``video_to_image`` and
    ``video_to_text`` the image's and the text's columns of the cross-attention's, each row summing to 1 over both;
    the step's timestep is the largest frame's and the output stays bit-identical."""
    model = anyflow.tiny_transformer(True, num_heads=3)
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([[0.0, 700.0, 700.0]]).expand(2, 3)
    call = dict(
        hidden_states=torch.randn(2, 3, 16, 4, 6, generator=g),
        timestep=t,
        r_timestep=t * 0.5,
        encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        encoder_hidden_states_image=torch.randn(2, 5, 4, generator=g),
        return_dict=False,
    )
    inputs = []
    hooks = [
        b.attn1.register_forward_pre_hook(lambda m, a, kw: inputs.append((m, kw)), with_kwargs=True)
        for b in model.blocks
    ]
    try:
        with torch.no_grad():
            stock, calls = _spied(model, monkeypatch, lambda: model(**call)[0])
    finally:
        for h in hooks:
            h.remove()
    kinds = ("full", "video_to_text", "video_to_image")
    with torch.no_grad(), cogattn.record(model, kinds=kinds, batch="all", heads="all") as rec:
        assert torch.equal(model(**call)[0], stock), "capture changed the output"
    lay = rec.layout
    assert (lay.grid, lay.image_len, lay.context_len, lay.image_joins_text) == ((3, 2, 3), 5, 7, True)
    assert rec.timesteps == [700.0] and rec.batch_items == (0, 1)
    for layer, (q_mod, k_mod) in enumerate(_module_qk(inputs)):
        ((q, k, v, mask, out),) = calls[0][(layer, "self")]
        assert mask is None and (q - q_mod).abs().max() <= 1e-6 and (k - k_mod).abs().max() <= 1e-6
        assert (rec.get("full", 0, layer).double() - spy_probs(q_mod, k_mod, None)).abs().max() <= 1e-5
        ((q, k, v, mask, out),) = calls[0][(layer, "context")]
        assert k.shape[2] == 5 + 7  # one attention over the image's keys, then the text's
        P = spy_probs(q, k, mask)
        image, text = rec.get("video_to_image", 0, layer).double(), rec.get("video_to_text", 0, layer).double()
        assert (image - naive_context(P[..., :5], lay.grid)).abs().max() <= 1e-5
        assert (text - naive_context(P[..., 5:], lay.grid)).abs().max() <= 1e-5
        assert (image.sum(2) + text.sum(2) - 1).abs().max() <= 1e-5


def test_a_conditioning_video_s_frames_keep_timestep_0_and_guidance_is_one_batched_call(monkeypatch):
    """``video_latents=`` holds the first latent frame at timestep 0: each step's timestep is its noisy frames',
    the scheduler's; under guidance each step is one call of the batch ``[uncond, cond]``, recorded exactly."""
    pipe = anyflow.tiny_pipeline(num_heads=3)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 1, 16, 4, 6, generator=g)

    def run():
        call = anyflow.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(1), True)
        return pipe(
            **call, video_latents=latents, num_inference_steps=2, output_type="latent", generator=g.manual_seed(2)
        ).frames

    stock, calls = _spied(pipe.transformer, monkeypatch, run)
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
        assert torch.equal(run(), stock)
    assert len(calls) == 2 and rec.batch_items == (0, 1)  # one call per step, both halves
    assert rec.timesteps == [float(t) for t in pipe.scheduler.timesteps] == [1000.0, 500.0]
    for step in range(2):
        for layer in range(2):
            ((q, k, _, mask, _),) = calls[step][(layer, "self")]
            assert (rec.get("full", step, layer).double() - spy_probs(q, k, mask)).abs().max() <= 1e-5


def test_anyflow_far_is_refused_in_one_line():
    """A FAR transformer (or a pipeline holding one), a FAR checkpoint's plan: one `ValueError` saying why; its
    config still names the family."""
    from diffusers import AnyFlowFARTransformer3DModel

    far = AnyFlowFARTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, num_layers=1, text_dim=16, ffn_dim=32, rope_max_seq_len=32
    )
    for target in (far, SimpleNamespace(transformer=far)):
        with pytest.raises(ValueError, match="AnyFlow-FAR .* is not recorded: its self-attention's keys"):
            cogattn.record(target, kinds=("frame",))
    assert spec_for_config({"_class_name": "AnyFlowFARTransformer3DModel"}) is anyflow.SPEC
    with pytest.raises(ValueError, match="compressed context frames"):
        cogattn.estimate(
            "nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers", num_frames=81, height=480, width=832, num_inference_steps=4
        )
    with pytest.raises(ValueError, match="model: x: AnyFlow-FAR"):
        anyflow.call_rules(SimpleNamespace(model="x"), anyflow.KNOWN["nvidia/AnyFlow-FAR-Wan2.1-14B-Diffusers"])
    with pytest.raises(ValueError, match="kind 'text_to_video' does not exist for anyflow: AnyFlow's text never"):
        anyflow.SPEC.check_kinds(("text_to_video",))


def test_the_released_checkpoints_are_planned_offline():
    """AnyFlow-Wan2.1-T2V-14B at 480×832, 81 frames, 4 steps: Wan 2.1's 21×30×52 grid, 512 text tokens, 40 layers;
    its default guidance (1.0) one video per call."""
    est = cogattn.estimate(
        "nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers", num_frames=81, height=480, width=832, num_inference_steps=4,
        guidance_scale=1.0, kinds=("entropy", "video_to_text"), steps="all", dtype="bfloat16",
    )  # fmt: skip
    lay = est.layout
    assert (lay.grid, lay.seq_len, lay.context_len, lay.image_len) == ((21, 30, 52), 32760, 512, 0)
    assert {kind: n for kind, _, _, n in est.records} == {"entropy": 4 * 40, "video_to_text": 4 * 40}
    assert "S = 32,760" in est.table()
    small = cogattn.estimate(
        "nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers", num_frames=81, height=480, width=832, num_inference_steps=4,
        kinds=("entropy",), layers="all",
    )  # fmt: skip
    assert small.layout == lay and {n for _, _, _, n in small.records} == {4 * 30}


def test_word_labels_are_the_pipeline_s_own_tokens_of_the_cleaned_prompt():
    """The text tokens a reader labels are those ``AnyFlowPipeline._get_t5_prompt_embeds`` makes: its tokenizer on
    the prompt cleaned by the pipeline module's ``prompt_clean`` (HTML entities unescaped twice, spaces folded)."""
    from diffusers.pipelines.anyflow.pipeline_anyflow import prompt_clean

    pipe = anyflow.tiny_pipeline()
    prompt = "a  red fox &amp;amp; a   hen"
    text = PromptFormat(pipe).encode(prompt, 512)
    made = pipe.tokenizer(
        [prompt_clean(prompt)], padding="max_length", max_length=512, truncation=True, add_special_tokens=True
    )
    assert text.text == "a red fox & a hen" and text.ids == made.input_ids[0]
