"""Helios's own rules (tests/test_families.py holds every kind of its tiny pipeline to the reference): the history
tokens counted from the call as the model makes them, the history's keys scaled per head as the model scales them,
the chunks recorded as windows, the history's cross-attention rows left out of ``video_to_text``, and the pyramid's
stages, each a grid of its own."""

import dataclasses
import json

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.reference import naive_context

helios = pytest.importorskip("cogattn.models.helios", reason="this diffusers lacks Helios (it needs 0.37)")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return helios.tiny_pipeline(num_heads=3)


def generate(pipe, **more):
    """Two chunks of 2 latent frames (9 frames of 32×48), under guidance, one video."""
    call = helios.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    call.update(num_latent_frames_per_chunk=2, num_inference_steps=2, output_type="pt")
    return pipe(**{**call, **more}, generator=torch.Generator().manual_seed(1)).frames


def spied(pipe, monkeypatch, run):
    """The stock video and the spy's calls (``calls[n][(layer, role)]``: ``(q, k, v, mask, out)``), each call's
    reference proved against its output."""
    spy = AttentionSpy(pipe, helios.SPEC, monkeypatch)
    try:
        video = run()
    finally:
        spy.remove()
        monkeypatch.undo()
    for seen in spy.calls:
        for ((q, k, v, mask, out),) in seen.values():
            assert (spy_probs(q, k, mask) @ v.double() - out.double()).abs().max() < 1e-5  # the model's attention
    return video, spy.calls


@pytest.mark.parametrize("height, width", [(32, 48), (48, 80), (64, 112)])
def test_the_history_tokens_read_from_a_call_are_the_models_sequence(height, width):
    """The short, mid and long history at latent grids that need padding to whole mid (2 × 4 × 4) and long (4 × 8 ×
    8) blocks: the layout's tokens are the self-attention's sequence, the window's grid after the history."""
    model = helios.tiny_transformer(num_heads=2)
    g = torch.Generator().manual_seed(0)
    h, w = height // 8, width // 8
    call = dict(
        hidden_states=torch.randn(1, 16, 3, h, w, generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, 16, generator=g),
        indices_hidden_states=torch.arange(19, 22)[None],
        indices_latents_history_short=torch.tensor([[0, 18]]),
        indices_latents_history_mid=torch.tensor([[16, 17]]),
        indices_latents_history_long=torch.arange(0, 16)[None],
        latents_history_short=torch.randn(1, 16, 2, h, w, generator=g),
        latents_history_mid=torch.randn(1, 16, 2, h, w, generator=g),
        latents_history_long=torch.randn(1, 16, 16, h, w, generator=g),
    )
    seen = []
    hook = model.blocks[0].attn1.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    with torch.no_grad():
        model(**call)
    hook.remove()
    layout, batch, t, _ = helios.read_call(model.config, (), call)
    short = 2 * (h // 2) * (w // 2)
    mid = -(-h // 4) * -(-w // 4)
    long = 4 * -(-h // 8) * -(-w // 8)
    assert layout.history_len == short + mid + long and layout.grid == (3, h // 2, w // 2)
    assert seen == [layout.seq_len] and (batch, t, layout.context_len) == (1, 500.0, 7)
    planned = helios.layout_for_video(model.config, 132, height, width, 7)  # a chunk of 9 latent frames
    assert planned == dataclasses.replace(layout, frames=9)


def test_the_history_keys_are_scaled_per_head_as_the_model_scales_them(pipe, monkeypatch):
    """The keys the attention call gets are the module's own keys with the history's multiplied by each head's
    factor, 1 + sigmoid(history_key_scale)·(10 − 1); the factors differ by head and change the maps; the recorded
    maps are those of the scaled keys."""
    inputs = []
    hooks = [
        block.attn1.register_forward_pre_hook(lambda m, a: inputs.append((m, a))) for block in pipe.transformer.blocks
    ]
    try:
        video, calls = spied(pipe, monkeypatch, lambda: generate(pipe))
    finally:
        for h in hooks:
            h.remove()
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
        assert torch.equal(generate(pipe), video)
    lay = rec.layout
    assert lay.history_len == 18 and lay.grid == (2, 2, 3) and lay.seq_len == 30
    for n, (attn, (hidden, _, _, rope, window_len)) in enumerate(inputs):
        layer, call = n % 2, n // 2
        ((q, k, v, mask, out),) = calls[call][(layer, "self")]
        # the module's keys, recomputed from its input with its own layers, then the factor per head
        key = attn.norm_k(attn.to_k(hidden)).unflatten(2, (attn.heads, -1))
        key = helios.apply_rotary_emb_transposed(key, rope).transpose(1, 2)
        factor = 1 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1)
        history = hidden.shape[1] - window_len
        assert history == lay.history_len and factor.unique().numel() == 3
        want = torch.cat([key[:, :, :history] * factor[:, None, None], key[:, :, history:]], dim=2)
        assert (k - want).abs().max() <= 1e-5
        unscaled = spy_probs(q, key, None)
        assert (spy_probs(q, k, None) - unscaled).abs().max() > 1e-2  # the factor changes the maps
        step, cond = divmod(call, 2)
        if cond == 0:  # the step's conditional call: the second half of the recorded batch
            got = rec.get("full", step, layer)[1:].double()
            assert (got - spy_probs(q, k, None)).abs().max() <= 1e-5


def test_every_chunk_is_recorded_as_a_window_even_under_a_callback(pipe, monkeypatch, tmp_path):
    """Two chunks, each a denoising loop of 2 steps over the same window and history: the steps are numbered on
    across the chunks and each keeps its chunk, in memory and in run.json. A step callback rebinds the pipeline's
    chunk counter ``k``; the chunk is read from the frames decoded so far, which it leaves alone."""

    def callback(pipeline, i, t, kwargs):
        return kwargs

    def run():
        return generate(pipe, callback_on_step_end=callback)

    video, calls = spied(pipe, monkeypatch, run)
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all", save_dir=tmp_path / "run") as rec:
        assert torch.equal(run(), video)
    assert rec.windows == [0, 0, 1, 1] and len(rec.timesteps) == 4 and rec.timesteps[2] == rec.timesteps[0]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["windows"] == [0, 0, 1, 1]
    for step in range(4):
        for layer in range(2):
            cond, uncond = (calls[2 * step + c][(layer, "self")][0] for c in (0, 1))
            want = torch.cat([spy_probs(*uncond[:2], None), spy_probs(*cond[:2], None)])
            assert (rec.get("full", step, layer).double() - want).abs().max() <= 1e-5, (step, layer)


def test_without_guidance_cross_attention_the_history_rows_are_left_out_of_video_to_text(monkeypatch):
    """``guidance_cross_attn=False``: every token queries the text, the history's too; ``video_to_text`` holds the
    window grid's rows of the cross-attention, exactly."""
    pipe = helios.tiny_pipeline(num_heads=3, guidance_cross_attn=False)
    video, calls = spied(pipe, monkeypatch, lambda: generate(pipe))
    with cogattn.record(pipe, kinds=("video_to_text", "received"), batch="all", heads="all") as rec:
        assert torch.equal(generate(pipe), video)
    lay = rec.layout
    for step in range(4):
        for layer in range(2):
            cond, uncond = (calls[2 * step + c][(layer, "context")][0] for c in (0, 1))
            assert cond[0].shape[2] == lay.seq_len  # the history's tokens query the text too
            P = torch.cat([spy_probs(*uncond[:2], None), spy_probs(*cond[:2], None)])
            want = naive_context(P[:, :, lay.history_len :], lay.grid)
            assert (rec.get("video_to_text", step, layer).double() - want).abs().max() <= 1e-5


def test_the_pyramid_records_the_first_stage_and_warns_at_the_next(monkeypatch):
    """``HeliosPyramidPipeline`` denoises each chunk in 3 stages of rising resolution: a stage is a window of its own
    grid, so the recording holds the first stage's steps (a 4 × 8 latent grid's quarter: 1 × 2 patches, after the
    full-size history), exact, and warns; the video is the stock one."""
    pipe = helios.tiny_pipeline(pyramid=True, num_heads=3)

    def run():
        call = helios.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
        call.update(num_frames=5, height=64, width=128, num_latent_frames_per_chunk=2, output_type="pt")
        return pipe(**call, pyramid_num_inference_steps_list=[2, 1, 1], generator=torch.Generator().manual_seed(1))

    video, calls = spied(pipe, monkeypatch, lambda: run().frames)
    with pytest.warns(UserWarning, match=r"went on with window 1 of 3, of the latent grid \(2, 2, 4\), after 2 steps"):
        with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
            assert torch.equal(run().frames, video)
    assert rec.layout.grid == (2, 1, 2) and rec.layout.history_len == 64 + 8 + 8 and rec.windows == [0, 0]
    for step in range(2):
        for layer in range(2):
            cond, uncond = (calls[2 * step + c][(layer, "self")][0] for c in (0, 1))
            want = torch.cat([spy_probs(*uncond[:2], None), spy_probs(*cond[:2], None)])
            assert (rec.get("full", step, layer).double() - want).abs().max() <= 1e-5


def test_a_released_checkpoint_is_planned_offline_with_every_chunk_s_steps():
    """Helios-Base at 384×640, 129 frames: four chunks of 9 latent frames, each of 50 steps after 2,400 history
    tokens; the plan counts the steps of every chunk, numbered on (200)."""
    est = cogattn.estimate(
        "BestWishYsh/Helios-Base", num_frames=129, height=384, width=640, num_inference_steps=50,
        kinds=("entropy", "video_to_text"), steps="all", dtype="bfloat16",
    )  # fmt: skip
    lay = est.layout
    assert (lay.history_len, lay.grid, lay.seq_len, lay.context_len) == (2400, (9, 24, 40), 11040, 512)
    assert {kind: n for kind, _, _, n in est.records} == {"entropy": 4 * 50 * 40, "video_to_text": 4 * 50 * 40}
    assert "layout: 2400 history + 9×24×40 video tokens, S = 11,040; cross-attention to 512 text tokens" in est.table()
    assert [helios.call_steps(n, 5) for n in (33, 34, 132)] == [5, 10, 20]  # 1, 2 and 4 chunks of 5 steps


def test_a_call_of_any_number_of_frames_is_planned_and_taken_by_the_batch_tool():
    """The pipeline makes ⌈num_frames / 33⌉ chunks of any count (the batch tool refused 66 frames, its own example,
    for not being 4k + 1); 0 frames is one line."""
    from cogattn.dump.config import ConfigError, load_config

    est = cogattn.estimate("BestWishYsh/Helios-Base", num_frames=66, height=384, width=640, num_inference_steps=3,
                           kinds=("entropy",), steps="all")  # fmt: skip
    assert est.records[0][3] == 2 * 3 * 40  # two chunks of three steps, 40 layers
    config = "configs/tiny-helios.yaml"
    assert load_config(config, ["num_frames=66"]).num_frames == 66
    with pytest.raises(ConfigError, match=r"^num_frames: 0 must be at least 1 \(33, 66, 99"):
        load_config(config, ["num_frames=0"])
