"""LTX-2's audio stream recorded: the kinds ``audio``, ``audio_to_text``, ``frame_audio`` and ``audio_frame`` of the
tiny pipelines (text- and image-to-video) and of a bare transformer, against the naive float64 softmax of each audio
attention module's own q and k (RoPE applied by the model, caught by tests/test_ltx2.py's spy, whose P·V proof holds
them to the module's output); the layout's audio axis against the model's own positions; run.json's audio axis
written, read back and refused when hostile; the readers of the new kinds."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("cogattn.models.ltx2.attention", reason="this diffusers lacks LTX-2")
from test_ltx2 import _masked_direct_call, _run, _stock
from test_view import _page, _redrawn, _values, browser  # noqa: F401  (browser: that module's fixture, used here)

import cogattn
from cogattn.analysis import aggregate
from cogattn.models import FAMILIES, ltx2
from cogattn.models.ltx2 import tiny as _ltx2_tiny
from cogattn.reference import naive_audio, naive_probs

AUDIO = ("audio", "audio_to_text", "frame_audio", "audio_frame")
ATTR = {"audio": "audio_attn1", "audio_to_text": "audio_attn2", "frame_audio": "audio_to_video_attn"}
ATTR["audio_frame"] = "video_to_audio_attn"
TOL = 1e-5


def _reference(spied, kind, grid):
    """The naive float64 ``kind`` ``(B, H, ...)`` of one spied call of its attention (the text's bias added)."""
    _, _, q, k, _, mask, _, _ = spied
    bias = None if mask is None else mask[:, 0, 0]
    return naive_audio(naive_probs(q, k, key_mask=bias), kind, grid)


@pytest.fixture(scope="module", params=["text-to-video", "image-to-video"])
def recorded(request, tmp_path_factory):
    """One stock run under the spy and one recorded run (saved) of the tiny pipeline with 3 audio heads (2 video
    heads): ``(pipe, stock output, spied calls, recording, output, run folder)``."""
    monkeypatch = pytest.MonkeyPatch()
    task = request.param
    pipe = _ltx2_tiny.tiny_pipeline(task, audio_heads=3)
    stock, calls = _stock(pipe, monkeypatch, task=task)
    folder = tmp_path_factory.mktemp("ltx2a") / "run"
    kinds = (*AUDIO, "frame", "video_to_text")
    with cogattn.record(pipe, kinds=kinds, heads="all", batch="all", save_dir=folder) as rec:
        out = _run(pipe, task=task)
    return pipe, stock, calls, rec, out, folder


def test_each_audio_kind_is_the_naive_softmax_of_its_module_and_the_output_is_bit_identical(recorded):
    pipe, stock, calls, rec, out, _ = recorded
    assert torch.equal(out.frames, stock.frames) and torch.equal(out.audio, stock.audio)
    layout = rec.layout
    assert layout.audio == cogattn.AudioAxis(18, 25.0, 4, 24.0) and layout.grid == (3, 2, 4)
    F, A, T = 3, 18, _ltx2_tiny.TEXT_LEN
    shapes = {"audio": (2, 3, A, A), "audio_to_text": (2, 3, T, A), "frame_audio": (2, 3, F, A)}
    shapes["audio_frame"] = (2, 3, A, F)
    for step in range(2):
        for layer in range(2):
            for kind in AUDIO:
                got = rec.get(kind, step, layer)
                assert tuple(got.shape) == shapes[kind], kind
                want = _reference(calls[step][(layer, ATTR[kind])], kind, layout.grid)
                assert (got.double() - want).abs().max().item() < TOL, (kind, step, layer)
                sums = got.sum(-2) if kind == "audio_to_text" else got.sum(-1)  # each query's (frame's) row
                assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), kind
            # the video's kinds as before: the self-attention's frame map and video_to_text, 2 video heads
            _, _, q, k, *_ = calls[step][(layer, "attn1")]
            P = naive_probs(q, k)
            frame = P.view(2, 2, 24, 3, 8).sum(-1).view(2, 2, 3, 8, 3).mean(-2)
            assert (rec.get("frame", step, layer).double() - frame).abs().max().item() < TOL
            _, _, q, k, *_ = calls[step][(layer, "attn2")]
            want = naive_probs(q, k).transpose(-1, -2).reshape(2, 2, T, *layout.grid)
            assert (rec.get("video_to_text", step, layer).double() - want).abs().max().item() < TOL


def test_the_audio_axis_is_the_models_own_time(recorded):
    pipe = recorded[0]
    layout, rope = recorded[3].layout, pipe.transformer.audio_rope
    coords = rope.prepare_audio_coords(1, layout.audio.tokens, torch.device("cpu"))[0, 0].double()
    assert torch.allclose(layout.audio.seconds(), coords, atol=1e-6)
    assert layout.audio.seconds()[:2].tolist() == [[0.0, 0.01], [0.01, 0.05]]  # bin i: [max(0, i − ¾), i + ¼) / 25
    video = pipe.transformer.rope.prepare_video_coords(1, 3, 2, 4, torch.device("cpu"), fps=24.0)[0, 0].double()
    assert torch.allclose(layout.audio.frame_seconds(layout), video[:: 2 * 4], atol=1e-6)
    mid, spans, owner = (
        layout.audio.seconds().mean(-1),
        layout.audio.frame_seconds(layout),
        layout.audio.frame_of_bin(layout),
    )
    for i, f in enumerate(owner.tolist()):  # each bin's midpoint in its frame's span (the last frame's after it)
        assert spans[f, 0] <= mid[i] and (mid[i] < spans[f, 1] or f == layout.frames - 1)
    released = ltx2.layout_for_video(ltx2.KNOWN["Lightricks/LTX-2"], 121, 512, 768, 1024)
    assert (released.audio.tokens, released.grid, released.audio.frame_of_bin(released)[-1].item()) == (
        126,
        (16, 16, 24),
        15,
    )


def test_slow_motion_keeps_the_audio_axis_at_the_playback_rate(recorded):
    """``motion_speed`` 0.2 conditions the transformer on 5 × ``frame_rate`` (its ``fps``), while the audio and the
    frames heard with it follow ``frame_rate``: the axis' rate is the playback's, each latent frame's span and its
    bins as at ``motion_speed`` 1 (the bins spread over the frames, not piled on the last)."""
    pipe = recorded[0]
    if recorded[3].layout is None or "motion_speed" not in _signature(pipe):
        pytest.skip("this diffusers' LTX-2 pipeline takes no motion_speed")
    seen, task = [], "image-to-video" if "Image" in type(pipe).__name__ else "text-to-video"
    for speed in (1.0, 0.2):
        with cogattn.record(pipe, kinds=("frame_audio",), steps=[0], layers=[0]) as rec:
            _run(pipe, task=task, motion_speed=speed)
        seen.append(rec.layout.audio)
    assert seen[0] == seen[1] == cogattn.AudioAxis(18, 25.0, 4, 24.0)
    bare = ltx2.audio_axis(pipe.transformer.config, 18, 24.0 / 0.2)  # the transformer's own fps, without a pipeline
    assert bare.frame_of_bin(recorded[3].layout).tolist() != seen[1].frame_of_bin(recorded[3].layout).tolist()


def _signature(pipe) -> set:
    import inspect

    return set(inspect.signature(pipe.__call__).parameters)


def test_the_run_folder_keeps_the_audio_axis_and_reads_the_audio_kinds(recorded):
    rec, folder = recorded[3], recorded[5]
    meta = json.loads((folder / "run.json").read_text())
    assert meta["layout"]["audio"] == {"tokens": 18, "rate": 25.0, "compression": 4, "fps": 24.0}
    run = cogattn.load(folder)
    assert run.layout == rec.layout
    for kind in AUDIO:
        assert torch.equal(run.get(kind, 1, 1), rec.get(kind, 1, 1)), kind
        mean = aggregate(run, kind, steps=[1], layers=[1], heads="mean", batch=1)
        assert torch.allclose(mean, rec.get(kind, 1, 1)[1].mean(0), atol=1e-6), kind
        row = aggregate(run, kind, steps=[1], layers=[1], heads=[2, 0], batch=1, row=2)  # read from disk alone
        assert torch.equal(row, rec.get(kind, 1, 1)[1, [2, 0], 2]), kind


@pytest.mark.parametrize(
    "audio",
    [
        {"tokens": 0},
        {"tokens": -18, "rate": 25.0},
        {"tokens": 18.5},
        {"tokens": True},
        {"tokens": 18, "rate": "25"},
        {"tokens": 18, "fps": float("nan")},
        {"tokens": 18, "compression": 0},
        {"tokens": 18, "bins": 4},
        {"rate": 25.0},
        [18, 25.0],
        "18",
    ],
)
def test_a_hostile_audio_axis_is_refused_in_one_line(recorded, tmp_path, audio):
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(recorded[5], folder)
    meta = json.loads((folder / "run.json").read_text())
    meta["layout"]["audio"] = audio
    (folder / "run.json").write_text(json.dumps(meta))
    with pytest.raises(cogattn.StoreError) as err:
        cogattn.load(folder)
    said = str(err.value)
    assert len(said.splitlines()) == 1 and "run.json" in said and "layout.audio" in said


def test_a_bare_transformer_records_the_audio_kinds_the_text_bias_added(recorded, monkeypatch):
    transformer = recorded[0].transformer
    inputs, stock, call = _masked_direct_call(transformer, monkeypatch)
    with cogattn.record(transformer, kinds=AUDIO, heads=[2, 0]) as rec:
        got = transformer(**inputs, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(got, stock))
    assert rec.layout.audio.tokens == 5 and rec.layout.grid == (1, 2, 3)
    for layer in range(2):
        for kind in AUDIO:
            want = _reference(call[(layer, ATTR[kind])], kind, rec.layout.grid)[:, [2, 0]]
            assert (rec.get(kind, 0, layer).double() - want).abs().max().item() < TOL, kind
        assert bool((rec.get("audio_to_text", 0, layer)[:, :, [0, 3]] == 0).all())  # a masked text key: exactly 0


def test_audio_heads_are_checked_per_source(recorded):
    pipe = recorded[0]  # 2 video heads, 3 audio heads
    with pytest.raises(ValueError, match=r"heads index 2 is out of range; valid indices are 0..1 \(") as err:
        cogattn.Recording(pipe, kinds=("frame", "audio"), heads=[2])
    said = str(err.value)  # both ranges, in one line
    assert "each kind's attention: frame 0..1, audio 0..2)" in said and "\n" not in said
    cogattn.Recording(pipe, kinds=("audio", "frame_audio"), heads=[2]).close()  # the audio's alone: in range
    with cogattn.record(pipe, kinds=("audio",), heads="mean", steps=[0]) as rec:
        _run(pipe, task="text-to-video" if recorded[0].__class__.__name__ == "LTX2Pipeline" else "image-to-video")
    assert tuple(rec.get("audio", 0, 0).shape) == (1, 1, 18, 18)


def test_each_attention_s_heads_are_named_on_the_recording_and_the_run(recorded):
    """``heads="all"`` with 2 video heads and 3 audio heads: ``head_ids`` names the video's, ``source_heads`` and
    ``head_ids_of`` each attention's, as many as its kinds' head axis holds, the same read back from run.json."""
    rec, run = recorded[3], cogattn.load(recorded[5])
    video, audio = (0, 1), (0, 1, 2)
    want = {"self": video, "text": video, "audio": audio, "audio_text": audio, "a2v": audio, "v2a": audio}
    for source in (rec, run):
        assert source.head_ids == video and source.source_heads == want
        for kind in (*AUDIO, "frame", "video_to_text"):
            assert len(source.head_ids_of(kind)) == source.get(kind, 0, 0).shape[1], kind
    assert json.loads((recorded[5] / "run.json").read_text())["selection"]["source_heads"]["v2a"] == [0, 1, 2]
    assert run.batch_items == rec.batch_items == (0, 1)
    torch.testing.assert_close(
        aggregate(run, "audio", steps=0, layers=0, heads=2, batch=1), run.get("audio", 0, 0)[1, 2]
    )


def test_every_other_family_refuses_the_audio_kinds_in_one_line():
    for spec in FAMILIES:
        name = spec.family
        if "audio" in spec.context_kinds.values():  # an audio stream of its own (LTX-2's, Kandinsky 6's)
            assert set(AUDIO) <= set(spec.kinds()), name
            continue
        for kind in AUDIO:
            with pytest.raises(ValueError) as err:
                spec.check_kinds([kind])
            said = str(err.value)
            assert "audio" in said.split(": ", 1)[1] and len(said.splitlines()) == 1 and repr(kind) in said, name


@pytest.mark.parametrize("kind", ["frame_audio", "audio_frame"])
def test_the_audio_sync_figure_shows_frames_by_bins_in_seconds(recorded, kind):
    from cogattn.plot import audio_sync
    from cogattn.plot.style import MAP_GID

    run = cogattn.load(recorded[5])
    fig = audio_sync(run, kind, heads="all")
    images = [im for ax in fig.axes for im in ax.get_images() if im.get_gid() == MAP_GID]
    want = aggregate(run, kind, heads="all")
    want = want.transpose(1, 2) if kind == "audio_frame" else want  # frames × bins either way
    assert len(images) == 3 and all(torch.allclose(torch.tensor(im.get_array()), w) for im, w in zip(images, want))
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == "0.00" and ticks[-1] == f"{(4 * 17 - 3) / 4 / 25:.2f}"  # bin 17 starts at 0.65 s
    assert "seconds" in fig.axes[0].get_xlabel() and fig.axes[0].get_ylabel() == "video: latent frame"
    with pytest.raises(ValueError, match="kind='audio'; audio_sync draws"):
        audio_sync(run, "audio")


def test_the_viewer_and_the_previews_take_a_run_with_the_audio_kinds(recorded, tmp_path):
    from urllib.request import urlopen

    from cogattn.dump.previews import write_previews
    from cogattn.view import ViewServer, export

    folder, out = recorded[5], recorded[4]
    server = ViewServer(folder).start()
    try:
        summary = json.loads(urlopen(f"{server.url}api/summary").read())
        assert set(AUDIO) <= set(summary["kinds"])
        assert urlopen(server.url).status == 200
        frame = json.loads(urlopen(f"{server.url}api/map?kind=frame&step=0&layer=mean&head=mean").read())
        assert frame["shape"] == [3, 3]
        run = cogattn.load(folder)
        for kind in AUDIO:  # each map the analysis' own
            got = json.loads(urlopen(f"{server.url}api/map?kind={kind}&step=1&layer=mean&head=mean").read())
            want = aggregate(run, kind, steps=1)
            assert got["shape"] == list(want.shape) and torch.allclose(torch.tensor(got["values"]), want.flatten())
    finally:
        server.stop()
    page = export(folder, tmp_path / "view.html")
    assert page.stat().st_size > 0
    video = out.frames[0].permute(0, 2, 3, 1).mul(255).byte().numpy()  # (F, H, W, 3)
    written = write_previews(folder, tmp_path / "previews", video)
    assert {p.name for p in written} >= {"frame.png", "video_to_text.png"}


def test_the_self_test_rows_of_ltx2_hold_the_audio_kinds_to_the_reference(monkeypatch):
    from cogattn import selftest_pipelines

    compared = []
    real = selftest_pipelines.naive_audio
    monkeypatch.setattr(
        selftest_pipelines, "naive_audio", lambda P, kind, grid: compared.append(kind) or real(P, kind, grid)
    )
    rows = selftest_pipelines.family_rows(ltx2.SPEC, torch.device("cpu"), torch.float32, quick=True)
    assert len(rows) == 2 and all(r.passed for r in rows), rows  # text- and image-to-video, row tiles
    assert set(compared) == set(AUDIO) and len(compared) == 2 * 2 * 2 * len(AUDIO)  # tasks × steps × layers


def test_the_estimate_plans_the_audio_kinds_at_the_released_shape():
    """121 frames of 512 × 768 at 24 fps: 16 latent frames, A = 126 bins, T = 1,024, 32 audio heads of 64; one float32
    record per layer and step is 126² × 32 × 4 B (2.0 MB) for ``audio``, 1,024 × 126 × 32 × 4 B (16.5 MB) for
    ``audio_to_text``, 16 × 126 × 32 × 4 B (0.26 MB) for each cross-modal kind."""
    est = cogattn.estimate("Lightricks/LTX-2", num_frames=121, height=512, width=768, num_inference_steps=30,
                           kinds=AUDIO, heads="all", batch="cond", storage_dtype="float32")  # fmt: skip
    shapes = {kind: shape for kind, shape, _, _ in est.records}
    assert shapes == {"audio": (1, 32, 126, 126), "audio_to_text": (1, 32, 1024, 126), "frame_audio": (1, 32, 16, 126),
                      "audio_frame": (1, 32, 126, 16)}  # fmt: skip
    for kind, shape, size, count in est.records:
        assert 4 * torch.Size(shape).numel() <= size < 4 * torch.Size(shape).numel() + 4096 and count == 48 * 30, kind
    plan = est.plan  # v2a's rows are 6,144 video keys long: its tiles fit the budget
    heads, rows = plan.context_tiles["v2a"]
    assert plan.context_heads["v2a"] == tuple(range(32)) and 4 * heads * rows * (6144 + 64) <= plan.tile_budget
    assert est.layout.audio == cogattn.AudioAxis(126) and "audio: 126 bins (25 a second)" in est.table()


def test_in_bfloat16_the_audio_kinds_are_the_reference_of_the_bfloat16_q_and_k(monkeypatch):
    _check_on(monkeypatch, "cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_audio_kinds_are_the_reference_and_the_output_is_bit_identical(monkeypatch, dtype):
    _check_on(monkeypatch, "cuda", dtype)


def _check_on(monkeypatch, device, dtype):
    pipe = _ltx2_tiny.tiny_pipeline(audio_heads=3, dtype=dtype).to(device)
    stock, calls = _stock(pipe, monkeypatch)
    with cogattn.record(pipe, kinds=(*AUDIO, "frame"), heads="all", batch="all") as rec:
        out = _run(pipe)
    assert torch.equal(out.frames, stock.frames) and torch.equal(out.audio, stock.audio)
    for step in range(2):
        for layer in range(2):
            for kind in AUDIO:
                spied = [x.cpu() if torch.is_tensor(x) else x for x in calls[step][(layer, ATTR[kind])]]
                want = _reference(spied, kind, rec.layout.grid)
                assert (rec.get(kind, step, layer).double() - want).abs().max().item() < TOL, (kind, step, layer)


def test_the_pipeline_s_perturbed_calls_are_left_out_of_the_audio_kinds(monkeypatch):
    """Under the pipeline's spatio-temporal guidance and modality isolation (blocks of ``LTX2PerturbedAttnProcessor``)
    the audio kinds are each step's guidance call's."""
    pipe = _ltx2_tiny.tiny_pipeline(perturbed=True)
    extra = dict(stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0, audio_modality_scale=3.0)
    extra["spatio_temporal_guidance_blocks"] = [1]
    stock, calls = _stock(pipe, monkeypatch, **extra)
    assert len(calls) == 6  # each step: the guidance call, then STG's and modality isolation's
    with cogattn.record(pipe, kinds=AUDIO, batch="all", heads="all") as rec:
        out = _run(pipe, **extra)
    assert torch.equal(out.frames, stock.frames) and torch.equal(out.audio, stock.audio)
    for step in range(2):
        for kind in AUDIO:
            want = _reference(calls[3 * step][(1, ATTR[kind])], kind, rec.layout.grid)
            assert (rec.get(kind, step, 1).double() - want).abs().max().item() < TOL, (kind, step)


def test_the_viewer_page_draws_each_audio_kind_live_and_exported(recorded, browser, tmp_path):  # noqa: F811
    """The page's audio panel: each audio kind the run holds, its map the analysis' own (the mean over layers at
    the page's step), a cell read out with its axes (bins in seconds); the same in the exported page."""
    from cogattn.view import ViewServer, export

    folder = recorded[5]
    run = cogattn.load(folder)
    step = len(run.timesteps) - 1  # the page opens at the last step
    want = {kind: aggregate(run, kind, steps=step) for kind in AUDIO}
    seconds = run.layout.audio.seconds()
    server = ViewServer(folder).start()
    pages = [server.url, export(folder, tmp_path / "view.html").as_uri()]
    problems = []
    try:
        for url in pages:
            page = _page(browser, url, problems)
            options = page.eval_on_selector_all("#audio-kind option", "os => os.map(o => o.value)")
            assert options == list(AUDIO)  # the kinds' order
            for kind in AUDIO:
                if page.input_value("#audio-kind") != kind:
                    _redrawn(page, lambda page=page, kind=kind: page.select_option("#audio-kind", kind))
                got = torch.tensor(_values(page, "audio"), dtype=torch.float64)
                assert torch.allclose(got, want[kind].double().flatten(), atol=1e-4), (url, kind)
            box = page.locator("#audio canvas").first.bounding_box()  # audio_frame: rows are audio bins
            page.mouse.move(box["x"] + 2, box["y"] + 2)
            assert page.inner_text("#audio-panel .readout").startswith(
                f"audio query bin 0 ({seconds[0, 0]:.2f}–{seconds[0, 1]:.2f} s), latent frame 0:"
            )
            page.close()
    finally:
        server.stop()
    assert not problems, problems
