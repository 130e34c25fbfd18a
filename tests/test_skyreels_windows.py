"""A long SkyReels-V2 diffusion-forcing video (``num_frames`` > ``base_num_frames``, with ``overlap_history``)
is made in windows, each a denoising loop of its own whose timesteps start over: one recording of the call
numbers the steps on across windows and keeps each step's window, in memory and in run.json.

The reference is each attention call's own q and k, caught by a spy during a stock run (the pattern of
``tests/test_families.py``): the naive float64 softmax, block-causal mask applied, must reproduce the call's
output, and every recorded map must equal it; the video with recording on must be bit-identical.
"""

from __future__ import annotations

import inspect
import json

import PIL.Image
import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.models import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = next((spec for spec in FAMILIES if spec.family == "skyreels_v2"), None)
if SPEC is None:
    pytest.skip("this diffusers lacks SkyReels-V2", allow_module_level=True)

# 21 frames are 6 latent frames; windows of 13 frames (4 latent) overlapping by 5 frames (2 latent): two windows
LONG = dict(num_frames=21, base_num_frames=13, overlap_history=5, causal_block_size=2)


@pytest.fixture(scope="module")
def pipe():
    return cogattn.models.skyreels_v2.tiny_diffusion_forcing_pipeline(num_heads=3)


def generate(pipe, **more):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 512, 16, generator=g)
    call = dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=5.0, height=32, width=48)
    call.update(num_inference_steps=2, ar_step=0, output_type="pt", generator=torch.Generator().manual_seed(1))
    return pipe(**{**call, **LONG, **more}).frames


def stock(pipe, monkeypatch, run=None, **more):
    """The stock video, each transformer call's timestep (its largest frame's), and per transformer call and
    layer the reference probabilities ``(B, H, S, S)`` of its self-attention, proved against the call's output.
    ``run``: the pipeline call, when not ``generate``'s."""
    spy = AttentionSpy(pipe, SPEC, monkeypatch)
    times = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: times.append(float(k["timestep"].max())), with_kwargs=True
    )
    try:
        video = run() if run else generate(pipe, **more)
    finally:
        hook.remove()
        spy.remove()
        monkeypatch.undo()
    probs = []
    for seen in spy.calls:
        layers = {}
        for (layer, role), found in seen.items():
            if role == "self":
                ((q, k, v, mask, out),) = found
                P = spy_probs(q, k, mask)
                assert (P @ v.double() - out.double()).abs().max() < 1e-5  # the reference is the model's attention
                layers[layer] = P
        probs.append(layers)
    return video, times, probs


def assert_exact(source, probs, steps):
    """Every recorded ``full`` map of ``steps`` is the reference of its step's two calls, ``[uncond, cond]``."""
    for step in steps:
        for layer, cond in probs[2 * step].items():
            want = torch.cat([probs[2 * step + 1][layer], cond])  # the step's second call is the unconditional
            err = (source.get("full", step, layer).double() - want).abs().max().item()
            assert err <= 1e-5, (step, layer, err)


@pytest.mark.parametrize(
    "ar_step, windows",
    [
        (0, [0, 0, 1, 1]),  # synchronous: each window's loop is the 2 steps
        # two causal blocks a step apart: window 0 takes 3 steps; window 1's first block is its overlap
        # history, already denoised, so it takes 2
        (1, [0, 0, 0, 1, 1]),
    ],
)
def test_every_window_of_a_long_video_is_recorded_exactly(pipe, monkeypatch, tmp_path, ar_step, windows):
    video, times, probs = stock(pipe, monkeypatch, ar_step=ar_step)
    assert len(probs) == 2 * len(windows)  # the stock run: two calls (guidance) per step
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all", save_dir=tmp_path / "run") as rec:
        got = generate(pipe, ar_step=ar_step)
    assert torch.equal(got, video), "capture changed the video"
    assert rec.status == "finished" and rec.windows == windows
    assert rec.timesteps == times[::2]  # each step's timestep, the windows' loops one after the other
    assert sorted({step for _, step, _ in rec.keys()}) == list(range(len(windows)))
    assert_exact(rec, probs, range(len(windows)))
    run = cogattn.load(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["windows"] == windows
    assert run.windows == windows and run.timesteps == times[::2]
    assert_exact(run, probs, range(len(windows)))


def test_steps_of_a_later_window_can_be_selected(pipe, monkeypatch):
    """Steps are numbered on across windows: step 3 is window 1's second step, though each window's loop
    has 2 steps (the pipeline's ``num_timesteps``)."""
    video, _, probs = stock(pipe, monkeypatch)
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all", steps=[3]) as rec:
        got = generate(pipe)
    assert torch.equal(got, video) and rec.windows == [0, 0, 1, 1]
    assert {step for _, step, _ in rec.keys()} == {3}
    assert_exact(rec, probs, [3])


def test_a_last_window_of_another_grid_keeps_the_windows_before_and_warns(pipe, monkeypatch):
    """25 frames are 7 latent frames: windows of 4, 4 and 3 (the last of another grid). The recording keeps
    the first two windows exact, warns, and records nothing of the third."""
    more = dict(num_frames=25, causal_block_size=1)
    video, _, probs = stock(pipe, monkeypatch, **more)
    assert len(probs) == 12  # three windows of two guided steps
    match = r"went on with window 2 of 3, of the latent grid \(3, 2, 3\), after 4 steps of a 2×\(4, 2, 3\)"
    with pytest.warns(UserWarning, match=match):
        with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
            got = generate(pipe, **more)
    assert torch.equal(got, video) and rec.status == "finished"
    assert rec.windows == [0, 0, 1, 1] and len(rec.timesteps) == 4
    assert {step for _, step, _ in rec.keys()} == {0, 1, 2, 3}
    assert_exact(rec, probs, range(4))


def test_a_second_call_inside_one_recording_is_still_another_generation(pipe):
    """A window is told from a new pipeline call: the second call's first window is refused before it runs,
    and the recording holds the first call's windows."""
    with pytest.raises(RuntimeError, match=r"a second generation started inside one recording \(it already holds 4"):
        with cogattn.record(pipe, kinds=("entropy",)) as rec:
            generate(pipe, output_type="latent")
            generate(pipe, output_type="latent")
    assert rec.windows == [0, 0, 1, 1] and {step for _, step, _ in rec.keys()} == {0, 1, 2, 3}


def test_a_run_says_each_steps_window(tmp_path):
    """run.json's ``windows``: every step 0 where it is missing (runs made before it was kept, one window);
    one clear error, when the run is opened, where it is not a list of window indices."""
    run_dir = tmp_path / "run"
    pipe = cogattn.models.skyreels_v2.tiny_diffusion_forcing_pipeline(num_heads=3)
    with cogattn.record(pipe, kinds=("entropy",), save_dir=run_dir):
        generate(pipe, num_frames=13, output_type="latent")  # one window
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["windows"] == [0, 0] and cogattn.load(run_dir).windows == [0, 0]
    del meta["windows"]
    (run_dir / "run.json").write_text(json.dumps(meta))
    assert cogattn.load(run_dir).windows == [0, 0]
    (run_dir / "run.json").write_text(json.dumps({**meta, "windows": [0, "1"]}))
    with pytest.raises(cogattn.StoreError, match=r"run\.json': windows\[1\] is '1'; it must be a whole number"):
        cogattn.load(run_dir)


def test_video_to_video_windows_are_recorded_exactly(pipe, monkeypatch):
    """The video-to-video pipeline counts its windows in a local of another name: 9 frames to extend by 21,
    two windows of 4 latent frames, each starting with 2 frames of history."""
    from diffusers import SkyReelsV2DiffusionForcingVideoToVideoPipeline as VideoToVideo

    takes = inspect.signature(VideoToVideo.__init__).parameters
    v2v = VideoToVideo(**{k: v for k, v in pipe.components.items() if k in takes})
    v2v.set_progress_bar_config(disable=True)

    def run():
        g = torch.Generator().manual_seed(0)
        emb = torch.randn(1, 512, 16, generator=g)
        pixels = [torch.randint(0, 256, (32, 48, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(9)]
        call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=5.0, height=32, width=48)
        call.update(num_frames=21, base_num_frames=13, overlap_history=5, causal_block_size=1)
        video = [PIL.Image.fromarray(p) for p in pixels]
        g = torch.Generator().manual_seed(1)
        return v2v(video=video, **call, num_inference_steps=2, output_type="pt", generator=g).frames

    video, times, probs = stock(v2v, monkeypatch, run=run)
    with cogattn.record(v2v, kinds=("full",), batch="all", heads="all") as rec:
        got = run()
    assert torch.equal(got, video) and rec.windows == [0, 0, 1, 1] and rec.timesteps == times[::2]
    assert_exact(rec, probs, range(4))
