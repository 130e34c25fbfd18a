"""A pipeline call made in windows, each a denoising loop whose timesteps start over (FramePack's sections, Cosmos
Transfer2.5's chunks of a long control video): one recording numbers the steps on across the windows and keeps each
step's window (``ModelSpec.window``, read from the pipeline call's locals). SkyReels-V2's and Helios' windows have
tests of their own (tests/test_skyreels_windows.py, tests/test_helios.py).

The reference is each attention call's own q and k, caught by a spy during a stock run: its naive float64 softmax
must reproduce the call's output, and every recorded map must equal it; the video with recording on is bit-identical.
"""

from __future__ import annotations

import PIL.Image
import pytest
import torch
from reference import AttentionSpy, spy_probs
from test_families import CASES

import cogattn

pytestmark = pytest.mark.usefixtures("one_thread")


def _spied(pipe, spec, monkeypatch, run):
    """The stock output and each transformer call's reference ``(B, H, S, S)`` of layer 1, proved by its P·V."""
    spy = AttentionSpy(pipe, spec, monkeypatch)
    try:
        out = run()
    finally:
        spy.remove()
        monkeypatch.undo()
    refs = []
    for seen in spy.calls:
        q, k, v, mask, o = seen[(1, "self")][0]
        P = spy_probs(q, k, mask)
        assert (P @ v.double() - o.double()).abs().max() < 1e-5  # the reference is the model's attention
        refs.append(P)
    return out, refs


def _recorded_as_called(pipe, run, refs, windows):
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all", layers=[1]) as rec:
        out = run()
    assert rec.windows == windows and len(rec.timesteps) == len(refs)
    assert rec.timesteps[: len(refs) // 2] == rec.timesteps[len(refs) // 2 :]  # each window's loop starts over
    for step, P in enumerate(refs):
        assert (rec.get("full", step, 1).double() - P).abs().max() < 1e-5, step
    return out


def test_framepack_s_sections_are_windows(monkeypatch):
    """40 frames are two sections of 33 (9 latent frames each, the same grid after the same history): four steps."""
    spec = cogattn.models.family("hunyuan_video_framepack")
    pipe = spec.tiny_pipeline(num_heads=3)
    call = {**CASES["hunyuan_video_framepack"].call(pipe, torch.Generator().manual_seed(0), False), "num_frames": 40}

    def run():
        g = torch.Generator().manual_seed(1)
        return pipe(**call, num_inference_steps=2, generator=g, output_type="pt").frames

    stock, refs = _spied(pipe, spec, monkeypatch, run)
    assert torch.equal(_recorded_as_called(pipe, run, refs, [0, 0, 1, 1]), stock)


def test_cosmos_transfer_s_chunks_are_windows(monkeypatch):
    """17 control frames in chunks of 9 overlapping by 1: two chunks of the same grid, four steps."""
    if "cosmos25_transfer" not in CASES or cogattn.models.family("cosmos") is None:
        pytest.skip("this diffusers lacks Cosmos Transfer2.5")
    spec, pipe = cogattn.models.family("cosmos"), CASES["cosmos25_transfer"].make()
    g = torch.Generator().manual_seed(5)
    controls = [torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(17)]
    call = CASES["cosmos25_transfer"].call(pipe, torch.Generator().manual_seed(0), False)
    call.update(controls=[PIL.Image.fromarray(f) for f in controls], num_frames=17, num_frames_per_chunk=9)

    def run():
        g = torch.Generator().manual_seed(1)
        return pipe(**call, num_ar_conditional_frames=1, num_inference_steps=2, generator=g, output_type="pt").frames

    stock, refs = _spied(pipe, spec, monkeypatch, run)
    assert torch.equal(_recorded_as_called(pipe, run, refs, [0, 0, 1, 1]), stock)


def test_ltx_video_s_long_video_windows_of_another_grid_keep_the_first_and_warn():
    """LTXI2VLongMultiPromptPipeline's later temporal windows carry another token grid (the overlap's conditioning):
    the recording keeps the first window's steps and says where it stopped, instead of taking the second window
    for another generation."""
    ltx = cogattn.models.ltx_video
    diffusers = pytest.importorskip("diffusers")
    if ltx is None or not hasattr(diffusers, "LTXI2VLongMultiPromptPipeline"):
        pytest.skip("this diffusers lacks LTXI2VLongMultiPromptPipeline")
    parts = ltx.tiny_pipeline()
    names = ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")
    pipe = diffusers.LTXI2VLongMultiPromptPipeline(**{k: parts.components[k] for k in names})
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a cat | a dog", height=32, width=32, num_frames=33, num_inference_steps=3, seed=0)
    call.update(temporal_tile_size=16, temporal_overlap=8, output_type="latent", max_sequence_length=8)
    with pytest.warns(UserWarning, match=r"the pipeline went on with window 1 of 4"):
        with cogattn.record(pipe, kinds=("frame",)) as rec:
            pipe(**call)
    assert rec.windows == [0, 0] and rec.timesteps == [float(t) for t in pipe.scheduler.timesteps[:2]]


def test_a_plan_counts_every_section_s_steps():
    """FramePack's plan of 129 frames: four sections of 25 steps each, as a recording numbers them."""
    est = cogattn.estimate(
        "lllyasviel/FramePackI2V_HY", num_frames=129, height=640, width=640, num_inference_steps=25,
        kinds=("entropy",), layers=[0],
    )  # fmt: skip
    assert est.num_records == 4 * 25
