"""Plots show what they claim: image data equal to the maps, labels, limits, frame mapping, files."""

import io
import math

import matplotlib

matplotlib.use("Agg")  # the plot module never picks a backend; tests render off-screen

import numpy as np
import pytest
import torch
from matplotlib.colors import LogNorm
from PIL import Image

import cogattn
from cogattn import NotRecordedError, analysis, plot
from cogattn.analysis import words
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline
from cogattn.plot import animation as plot_animation
from cogattn.plot import style as plot_style
from cogattn.plot import video as plot_video
from cogattn.reference import naive_kind
from cogattn.runs.skips import Skips

PROMPT = "a red fox running in the snow"  # tiny tokenizer: a red fox running in the snow </s>
KINDS = ("frame", "video_to_text", "text_to_video", "query", "full")
QUERIES = [(1, 1, 2), 3]  # a video point and text token 3


def _generate(pipe, steps=2, **record_kw):
    with cogattn.record(
        pipe, kinds=KINDS, batch="cond", heads="all", queries=QUERIES, info={"prompt": PROMPT}, **record_kw
    ) as rec:
        video = pipe(
            prompt=PROMPT,
            num_frames=9,
            num_inference_steps=steps,
            max_sequence_length=TINY_TEXT_LEN,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).frames[0]
    return rec, video


@pytest.fixture(scope="module")
def tiny():
    pipe = tiny_pipeline()
    rec, video = _generate(pipe)
    return pipe, rec, video


@pytest.fixture(scope="module")
def tiny15():
    pipe = tiny_pipeline("text-to-video", "1.5")
    rec, video = _generate(pipe)
    return pipe, rec, video


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plot") / "run"
    _generate(tiny[0], save_dir=folder)
    return cogattn.load(folder)


def ref(source, kind, steps=(0, 1), layers=(0, 1), head=None, batch=0):
    """Mean over steps × layers, then over heads (or one head), from plain ``get`` calls."""
    t = torch.stack([source.get(kind, s, layer)[batch] for s in steps for layer in layers]).double().mean(0)
    return (t.mean(0) if head is None else t[head]).float().numpy()


def panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>" and a.get_visible()]


def heat(ax):
    (im,) = [im for im in ax.images if im.get_gid() == "attention"]
    return im


def colorbar_labels(fig):
    return [a.get_ylabel() for a in fig.axes if a.get_label() == "<colorbar>"]


# -- latent ↔ pixel frames -------------------------------------------------------------------------
def _spans(ranges):
    return [(r.start, r.stop - 1) for r in ranges]


def test_pixel_frames_hand_tables_for_1_0_and_1_5():
    v10 = {"text_len": 8, "height": 3, "width": 5}
    assert _spans(TokenLayout(frames=3, **v10).pixel_frames(9)) == [(0, 0), (1, 4), (5, 8)]
    assert _spans(TokenLayout(frames=13, **v10).pixel_frames(49)) == [
        (0, 0),
        (1, 4),
        (5, 8),
        (9, 12),
        (13, 16),
        (17, 20),
        (21, 24),
        (25, 28),
        (29, 32),
        (33, 36),
        (37, 40),
        (41, 44),
        (45, 48),
    ]
    # 1.5, 81 frames: L = 21 latent frames, one padding frame at the start, F = 11 temporal patches;
    # patch 0 = {padding, latent 0} = pixel frame 0, patch p = latents {2p-1, 2p} = pixel frames 8p-7 .. 8p.
    lay15 = TokenLayout(frames=11, patch_size_t=2, **v10)
    assert _spans(lay15.pixel_frames(81)) == [
        (0, 0),
        (1, 8),
        (9, 16),
        (17, 24),
        (25, 32),
        (33, 40),
        (41, 48),
        (49, 56),
        (57, 64),
        (65, 72),
        (73, 80),
    ]
    # 85 frames: L = 22, no padding: patch p = latents {2p, 2p+1}.
    assert _spans(lay15.pixel_frames(85)) == [
        (0, 4),
        (5, 12),
        (13, 20),
        (21, 28),
        (29, 36),
        (37, 44),
        (45, 52),
        (53, 60),
        (61, 68),
        (69, 76),
        (77, 84),
    ]
    assert _spans(TokenLayout(frames=2, patch_size_t=2, **v10).pixel_frames(9)) == [(0, 0), (1, 8)]
    with pytest.raises(ValueError, match="F = 3"):
        TokenLayout(frames=3, **v10).pixel_frames(49)


def test_1_5_pipeline_pads_latents_at_the_start(tiny15):
    """The mapping's premise, checked on the pipeline: the decoded video is the final latents minus the
    first (padding) latent frame, not the last."""
    pipe, rec, video = tiny15
    final = {}

    def grab(p, i, t, kw):
        final["latents"] = kw["latents"]
        return {}

    out = pipe(
        prompt=PROMPT,
        num_frames=9,
        num_inference_steps=2,
        max_sequence_length=TINY_TEXT_LEN,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=grab,
        callback_on_step_end_tensor_inputs=["latents"],
    ).frames[0]
    assert torch.equal(out, video)
    latents = final["latents"]
    assert latents.shape[1] == 4 and rec.layout.frames == 2  # L = 3 latent frames + 1 padding = 2 patches

    def decode(lat):
        return pipe.video_processor.postprocess_video(video=pipe.decode_latents(lat), output_type="pt")[0]

    with torch.no_grad():
        assert torch.allclose(decode(latents[:, 1:]), video, atol=1e-6)
        assert not torch.allclose(decode(latents[:, :-1]), video, atol=1e-3)


def test_upsample_to_video_nearest_and_bilinear():
    layout = TokenLayout(text_len=8, frames=3, height=3, width=5)
    maps = torch.rand(3, 3, 5, generator=torch.Generator().manual_seed(0))
    up = plot.upsample_to_video(maps, layout, 9, (48, 80))
    owner = [0, 1, 1, 1, 1, 2, 2, 2, 2]
    expected = maps[owner].repeat_interleave(16, 1).repeat_interleave(16, 2)
    assert up.shape == (9, 48, 80) and torch.equal(up, expected)
    smooth = plot.upsample_to_video(maps, layout, 9, (48, 80), mode="bilinear")
    assert smooth.shape == (9, 48, 80) and smooth[5, 7, 7] == pytest.approx(maps[2, 0, 0])  # corner patch centre
    # half-pixel centres, clamped at the border: pixel y samples patch row (y + 0.5) / 16 - 0.5
    rows, cols = (np.clip((np.arange(n) + 0.5) / 16 - 0.5, 0, k - 1) for n, k in ((48, 3), (80, 5)))
    for n, f in enumerate(owner):
        by_row = np.stack([np.interp(rows, np.arange(3), maps[f, :, x].numpy()) for x in range(5)], 1)  # (48, 5)
        expected_n = np.stack([np.interp(cols, np.arange(5), r) for r in by_row])  # (48, 80)
        assert np.allclose(smooth[n].numpy(), expected_n, atol=1e-6)
    assert maps[2].min() <= smooth[5].min() and smooth[5].max() <= maps[2].max()
    assert smooth[5].diff(dim=1).abs().max() < expected[5].diff(dim=1).abs().max() / 4  # smooth, no patch edges
    with pytest.raises(ValueError, match="latent grid"):
        plot.upsample_to_video(maps[:2], layout, 9, (48, 80))


def test_video_array_accepts_every_output_type(tiny):
    video = tiny[2]  # (9, 3, 48, 80) in [0, 1]
    hwc = video.permute(0, 2, 3, 1).numpy()
    assert np.array_equal(plot_video.video_array(video[None]), hwc)
    uint8 = (hwc * 255).round().astype(np.uint8)
    pil = [Image.fromarray(f) for f in uint8]
    assert np.allclose(plot_video.video_array(uint8), hwc, atol=1 / 255)
    assert np.array_equal(plot_video.video_array([pil]), uint8 / np.float32(255))
    # a uint8 tensor is bytes too, in either axis order: not floats above 1 clipped to white
    for tensor in (torch.from_numpy(uint8), torch.from_numpy(uint8).permute(0, 3, 1, 2)):
        assert np.array_equal(plot_video.video_array(tensor), uint8 / np.float32(255))


def test_upsample_to_video_gives_the_video_once_per_copy_of_the_grid():
    """Two copies of the grid (Motif-Video's decoder layers): copy c's pixel frame n is map c·N + n, the map of
    copy c's latent frame covering n."""
    layout = TokenLayout(text_len=0, frames=6, height=3, width=5, grids=2)
    maps = torch.rand(6, 3, 5, generator=torch.Generator().manual_seed(0))
    up = plot.upsample_to_video(maps, layout, 9, (48, 80))
    owner = [0, 1, 1, 1, 1, 2, 2, 2, 2]  # of one copy: 3 latent frames, 9 pixel frames
    expected = maps[owner + [3 + f for f in owner]].repeat_interleave(16, 1).repeat_interleave(16, 2)
    assert up.shape == (18, 48, 80) and torch.equal(up, expected)


# -- aggregation -----------------------------------------------------------------------------------
def test_aggregate_means_and_head_selection(tiny):
    _, rec, _ = tiny
    assert np.allclose(analysis.aggregate(rec, "frame").numpy(), ref(rec, "frame"), atol=1e-6)
    one = analysis.aggregate(rec, "video_to_text", steps=1, layers=0, heads=1)
    assert torch.equal(one, rec.get("video_to_text", 1, 0)[0, 1])
    steps_only = analysis.aggregate(rec, "frame", steps="all", layers=1, heads="all")
    assert steps_only.shape == (2, 4, 4)
    per_head = np.stack([ref(rec, "frame", layers=(1,), head=h) for h in (0, 1)])
    assert np.allclose(steps_only.numpy(), per_head, atol=1e-6)
    kept = analysis.aggregate(rec, "frame", heads=[1])
    assert kept.shape == (1, 4, 4) and np.allclose(kept.numpy(), ref(rec, "frame", head=1)[None], atol=1e-6)
    with pytest.raises(ValueError, match="unknown kind"):
        analysis.aggregate(rec, "frames")
    with pytest.raises(NotRecordedError, match=r"step 7 .* recorded steps are \[0, 1\]"):
        analysis.aggregate(rec, "frame", steps=7)
    with pytest.raises(NotRecordedError, match="head 5 was not recorded"):
        analysis.aggregate(rec, "frame", heads=5)
    with pytest.raises(ValueError, match="batch=1"):
        analysis.aggregate(rec, "frame", batch=1)


def test_single_heads_refused_when_recorded_as_mean():
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds="frame", steps=[0], batch="cond") as rec:
        pipe(
            prompt=PROMPT, num_frames=9, num_inference_steps=1, max_sequence_length=TINY_TEXT_LEN, output_type="latent"
        )
    with pytest.raises(NotRecordedError, match="heads='mean'"):
        analysis.aggregate(rec, "frame", heads=0)
    with pytest.raises(NotRecordedError, match=r"kind 'query' was not recorded; this source holds \['frame'\]"):
        analysis.aggregate(rec, "query")
    fig = plot.frame_heatmap(rec, heads="all")  # one panel: the mean recorded
    assert [a.get_title() for a in panels(fig)] == ["mean over heads"]
    assert np.allclose(heat(panels(fig)[0]).get_array(), ref(rec, "frame", steps=(0,)), atol=1e-6)
    with cogattn.record(pipe, kinds="frame", steps=[0], batch="cond", heads=[1]) as one:
        pipe(
            prompt=PROMPT, num_frames=9, num_inference_steps=1, max_sequence_length=TINY_TEXT_LEN, output_type="latent"
        )
    (ax,) = panels(plot.frame_heatmap(one, heads="all"))
    assert ax.get_title() == "head 1"
    assert np.allclose(heat(ax).get_array(), ref(one, "frame", steps=(0,), head=0), atol=1e-6)
    one_head = analysis.aggregate(one, "frame", layers=1, heads=1)
    assert torch.equal(one_head, one.get("frame", 0, 1)[0, 0])  # model head 1 is slot 0
    with pytest.raises(NotRecordedError, match=r"head 0 was not recorded; recorded heads are \[1\]"):
        analysis.aggregate(one, "frame", heads=0)


# -- frame to frame --------------------------------------------------------------------------------
def test_frame_heatmap_data_labels_and_limits(tiny):
    _, rec, _ = tiny
    fig = plot.frame_heatmap(rec)
    (ax,) = panels(fig)
    im = heat(ax)
    expected = ref(rec, "frame")
    assert np.allclose(im.get_array(), expected, atol=1e-6)
    assert im.get_clim() == pytest.approx((expected.min(), expected.max()), abs=1e-6)
    ticks = ["text", "f0\npx 0", "f1\npx 1–4", "f2\npx 5–8"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ticks
    assert [t.get_text() for t in ax.get_yticklabels()] == ticks
    assert ax.get_xlabel() == "key: text or latent frame" and ax.get_ylabel() == "query: text or latent frame"
    assert ax.get_xlim() == (-0.5, 3.5) and ax.get_ylim() == (3.5, -0.5)
    assert colorbar_labels(fig) == ["attention mass (each query row sums to 1)"]
    assert "mean over steps 0–1" in fig.get_suptitle() and "mean over layers 0–1" in fig.get_suptitle()
    # the annotated numbers are the values
    assert [t.get_text() for t in ax.texts][:4] == [f"{v:.2f}" for v in expected[0]]


def test_frame_heatmap_small_multiples_per_head_and_colour_scales(tiny):
    _, rec, _ = tiny
    fig = plot.frame_heatmap(rec, heads="all", steps=1)
    axes = panels(fig)
    assert [a.get_title() for a in axes] == ["head 0", "head 1"]
    maps = [ref(rec, "frame", steps=(1,), head=h) for h in (0, 1)]
    for ax, m in zip(axes, maps):
        assert np.allclose(heat(ax).get_array(), m, atol=1e-6)
        assert heat(ax).get_clim() == pytest.approx((min(x.min() for x in maps), max(x.max() for x in maps)), abs=1e-6)
    assert len(colorbar_labels(fig)) == 1  # shared limits: one colour bar
    per_map = plot.frame_heatmap(rec, heads="all", steps=1, limits="per-map")
    for ax, m in zip(panels(per_map), maps):
        assert heat(ax).get_clim() == pytest.approx((m.min(), m.max()), abs=1e-6)
    assert len(colorbar_labels(per_map)) == 2
    log = plot.frame_heatmap(rec, heads=[1], scale="log", limits=(0.01, 1.0))
    (ax,) = panels(log)
    assert ax.get_title() == "head 1" and isinstance(heat(ax).norm, LogNorm)
    assert heat(ax).get_clim() == (0.01, 1.0)
    with pytest.raises(ValueError, match="scale='loog'"):
        plot.frame_heatmap(rec, scale="loog")
    with pytest.raises(ValueError, match="limits='same'"):
        plot.frame_heatmap(rec, limits="same")


def test_frame_heatmap_names_temporal_patches_for_1_5(tiny15):
    _, rec, _ = tiny15
    (ax,) = panels(plot.frame_heatmap(rec, num_pixel_frames=9))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["text", "f0\npx 0", "f1\npx 1–8"]
    assert "temporal patch" in ax.get_xlabel()
    (ax,) = panels(plot.frame_heatmap(rec))  # 1.5 does not guess the video length
    assert [t.get_text() for t in ax.get_xticklabels()] == ["text", "f0", "f1"]


# -- layers × steps --------------------------------------------------------------------------------
def test_layer_step_grid_rows_are_layers_columns_are_steps(tiny):
    _, rec, _ = tiny
    fig = plot.layer_step_grid(rec, "video_to_text", index=(2, 1), heads=0)
    axes = np.array(panels(fig)).reshape(2, 2)
    for r, layer in enumerate((0, 1)):
        for c, s in enumerate((0, 1)):
            expected = rec.get("video_to_text", s, layer)[0, 0, 2, 1].numpy()
            assert np.array_equal(heat(axes[r, c]).get_array(), expected)
    assert [a.get_title() for a in axes[0]] == [f"step {s} (t={rec.timesteps[s]:g})" for s in (0, 1)]
    assert [a.get_ylabel() for a in axes[:, 0]] == ["layer 0\npatch row", "layer 1\npatch row"]
    assert [a.get_xlabel() for a in axes[-1]] == ["patch column"] * 2
    assert colorbar_labels(fig) == ["attention probability"]
    frame = plot.layer_step_grid(rec, "frame", steps=[1], layers=[0, 1])
    assert np.array_equal(heat(panels(frame)[1]).get_array(), rec.get("frame", 1, 1)[0].mean(0).numpy())
    with pytest.raises(ValueError, match="3-D"):
        plot.layer_step_grid(rec, "video_to_text", index=(2,))
    with pytest.raises(ValueError, match="one head at a time"):
        plot.layer_step_grid(rec, "frame", heads="all")


# -- words on the video ----------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["1.0", "1.5"])
def test_word_overlay_maps_each_pixel_frame_to_its_latent_frame(tiny, tiny15, version):
    pipe, rec, video = tiny if version == "1.0" else tiny15
    owner = [0, 1, 1, 1, 1, 2, 2, 2, 2] if version == "1.0" else [0, 1, 1, 1, 1, 1, 1, 1, 1]  # by hand
    fig = plot.word_heatmap(rec, "fox", video, tokenizer=pipe.tokenizer, frames="all")
    axes = panels(fig)
    assert len(axes) == 9
    word = ref(rec, "video_to_text")[2]  # "fox" is token 2: (F, Hp, Wp)
    for n, ax in enumerate(axes):
        background, overlay = ax.images
        assert np.array_equal(background.get_array(), video[n].permute(1, 2, 0).numpy())
        expected = np.kron(word[owner[n]], np.ones((16, 16), dtype=np.float32))  # one patch = 16 × 16 pixels
        assert overlay.get_gid() == "attention" and np.allclose(overlay.get_array(), expected, atol=1e-6)
        assert overlay.get_extent() == [0, 80, 48, 0] and background.get_extent() == [0, 80, 48, 0]
        assert ax.get_xlim() == (0, 80) and ax.get_ylim() == (48, 0)
        assert ax.get_title() == f"px {n} · f{owner[n]}"
    assert axes[0].get_ylabel() == '"fox" (token 2)'
    default = panels(plot.word_heatmap(rec, "fox", video, tokenizer=pipe.tokenizer))  # middle frame of each
    assert [a.get_title() for a in default] == (
        ["px 0 · f0", "px 3 · f1", "px 7 · f2"] if version == "1.0" else ["px 0 · f0", "px 5 · f1"]
    )


def test_word_heatmap_tokens_directions_and_patch_grid(tiny):
    pipe, rec, _ = tiny
    by_word = plot.word_heatmap(rec, ["fox", "snow"], tokenizer=pipe.tokenizer)  # prompt from info
    by_index = plot.word_heatmap(rec, [2, 6])
    v2t, t2v = ref(rec, "video_to_text"), ref(rec, "text_to_video")
    for fig in (by_word, by_index):
        axes = np.array(panels(fig)).reshape(2, 3)
        for r, t in enumerate((2, 6)):
            for f in range(3):
                assert np.allclose(heat(axes[r, f]).get_array(), v2t[t, f], atol=1e-6)
    axes = np.array(panels(by_word)).reshape(2, 3)
    assert [a.get_ylabel() for a in axes[:, 0]] == ['"fox" (token 2)\npatch row', '"snow" (token 6)\npatch row']
    assert [a.get_title() for a in axes[0]] == ["f0 · px 0", "f1 · px 1–4", "f2 · px 5–8"]
    assert axes[0, 0].get_xlabel() == "patch column" and axes[0, 0].get_xlim() == (-0.5, 4.5)
    reverse = panels(plot.word_heatmap(rec, "red fox", kind="text_to_video", tokenizer=pipe.tokenizer))
    for f, ax in enumerate(reverse):  # a word of two tokens: the mean of their rows for text_to_video
        assert np.allclose(heat(ax).get_array(), t2v[[1, 2], f].mean(0), atol=1e-6)
    summed = np.array(panels(plot.word_heatmap(rec, "red fox", tokenizer=pipe.tokenizer))).ravel()
    assert np.allclose(heat(summed[0]).get_array(), v2t[[1, 2], 0].sum(0), atol=1e-6)  # and the sum for video_to_text
    assert "text → video" in plot.word_heatmap(rec, 2, kind="text_to_video").get_suptitle()
    with pytest.raises(ValueError, match="out of range; this layout has T = 8"):
        plot.word_heatmap(rec, 8)
    with pytest.raises(ValueError, match="pass tokenizer="):
        plot.word_heatmap(rec, "fox")
    with pytest.raises(ValueError, match="'wolf' is not among"):
        plot.word_heatmap(rec, "wolf", tokenizer=pipe.tokenizer)
    with pytest.raises(ValueError, match="kind='frame'"):
        plot.word_heatmap(rec, 2, kind="frame")


def test_word_positions_fast_and_sentencepiece_tokenizers():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tiny = tiny_pipeline().tokenizer
    assert words.word_positions("Snow", tiny, PROMPT, 8) == [6]
    assert words.word_positions("red", tiny, "a red fox and a red cat", 8) == [1, 5]
    with pytest.raises(ValueError, match="first 8 text tokens"):  # cut off by max_sequence_length
        words.word_positions("snow", tiny, "a red fox and a red cat in the snow", 8)
    assert words.text_tokens(tiny, PROMPT, 8) == ["a", "red", "fox", "running", "in", "the", "snow", "</s>"]

    pieces = ["<pad>", "</s>", "<unk>", "▁a", "▁fox", "hound", ",", "▁running", "▁in", "▁the", "▁snow"]
    model = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=2))  # T5-like sentencepiece pieces
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    prompt = "a foxhound, running in the snow"
    assert words.text_tokens(fast, prompt, 10)[:4] == ["▁a", "▁fox", "hound", ","]
    assert words.word_positions("foxhound", fast, prompt, 10) == [1, 2]
    assert words.word_positions("running", fast, prompt, 10) == [4]

    class Slow:  # a sentencepiece tokenizer without offsets (transformers' slow T5Tokenizer)
        is_fast = False
        all_special_tokens = ("</s>", "<pad>")

        def __call__(self, text, **kw):
            return {"input_ids": list(range(8))}

        def convert_ids_to_tokens(self, ids):
            return ["▁a", "▁fox", "hound", ",", "▁running", "▁fast", "</s>", "<pad>"]

    assert words.word_positions("foxhound", Slow(), "a foxhound, running fast", 8) == [1, 2]
    assert words.word_positions("running fast", Slow(), "a foxhound, running fast", 8) == [4, 5]
    with pytest.raises(ValueError):
        words.word_positions("fox", Slow(), "a foxhound, running fast", 8)
    with pytest.raises(ValueError):
        words.word_positions("fox", fast, prompt, 10)


# -- query maps ------------------------------------------------------------------------------------
def test_query_map_strip_marks_the_point(tiny):
    pipe, rec, video = tiny
    T, grid = 8, (3, 3, 5)
    row = ref(rec, "query")[0]  # query 0 is (1, 1, 2)
    fig = plot.query_map(rec, (1, 1, 2), tokenizer=pipe.tokenizer)
    axes = panels(fig)
    frames, text = axes[:3], axes[3]
    for f, ax in enumerate(frames):
        assert np.allclose(heat(ax).get_array(), row[T:].reshape(grid)[f], atol=1e-6)
        points = [ln for ln in ax.lines if ln.get_gid() == "query-point"]
        assert len(points) == (f == 1)
    (point,) = [ln for ln in frames[1].lines if ln.get_gid() == "query-point"]
    assert (point.get_xdata()[0], point.get_ydata()[0]) == (2, 1)  # (col, row) on the patch grid
    assert np.allclose(heat(text).get_array(), row[None, :T], atol=1e-6)
    assert [t.get_text() for t in text.get_xticklabels()] == words.text_tokens(pipe.tokenizer, PROMPT, 8)
    assert text.get_xlabel() == "text keys"
    for ax in axes:  # text and video panels share one colour scale
        assert heat(ax).get_clim() == pytest.approx((row.min(), row.max()), abs=1e-6)
    assert "(frame, row, col) = (1, 1, 2)" in fig.get_suptitle()
    # on the video: the cross sits at the patch centre in pixels
    over = panels(plot.query_map(rec, 0, video, scale="log"))
    (point,) = [ln for ln in over[1].lines if ln.get_gid() == "query-point"]
    assert (point.get_xdata()[0], point.get_ydata()[0]) == (2.5 * 16, 1.5 * 16)
    assert isinstance(heat(over[0]).norm, LogNorm)
    assert np.allclose(heat(over[2]).get_array(), np.kron(row[T:].reshape(grid)[2], np.ones((16, 16))), atol=1e-6)


def test_query_map_text_queries_full_fallback_and_errors(tiny):
    _, rec, _ = tiny
    text_query = panels(plot.query_map(rec, 1))  # the second recorded query: text token 3
    assert not any(ln.get_gid() == "query-point" for a in text_query for ln in a.lines)
    assert np.allclose(heat(text_query[3]).get_array(), ref(rec, "query")[1][None, :8], atol=1e-6)
    # (0, 2, 4) was not a recorded query, but kind "full" holds its row
    token = rec.layout.token_index(0, 2, 4)
    axes = panels(plot.query_map(rec, (0, 2, 4)))
    assert np.allclose(heat(axes[0]).get_array(), ref(rec, "full")[token, 8:].reshape(3, 3, 5)[0], atol=1e-6)
    with pytest.raises(NotRecordedError, match=r"recorded queries \[\(1, 1, 2\), 3\]"):
        plot.query_map(rec, 2)
    with pytest.raises(ValueError, match="outside the latent grid"):
        plot.query_map(rec, (3, 0, 0))


class _Rows:
    """A recording of one step and layer of a ``layout`` made from seeded probabilities ``P`` ``(1, 2, S, S)``: the
    ``query`` rows of ``queries`` (token indices) and each token's ``entropy``."""

    def __init__(self, layout, queries, family=None, prompt=None):
        S = layout.seq_len
        self.P = (torch.randn(1, 2, S, S, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3).softmax(
            -1
        )
        self.records = {
            ("query", 0, 0): self.P[:, :, list(queries)],
            ("entropy", 0, 0): naive_kind(self.P, "entropy", 0, (0, 0, 0)),
        }
        self.layout, self.queries, self.family, self.info = layout, tuple(queries), family, {"prompt": prompt}
        self.head_ids, self.timesteps, self.batch_roles = (0, 1), [999], None

    def keys(self):
        return sorted(self.records)

    def get(self, kind, step, layer):
        if (kind, step, layer) not in self.records:
            raise NotRecordedError(f"no record ({kind!r}, {step}, {layer})")
        return self.records[(kind, step, layer)].float()


@pytest.mark.parametrize("figure", ["query_map", "token_stat"])
def test_a_pipeline_and_its_tokenizer_name_the_same_text_ticks(figure):
    """Past 40 text tokens the strip names the prompt's tokens, not the padding after them, and ticks every tenth
    of the axis by index: the same for tokenizer=pipe (the call docs/statistics.md shows) as for its tokenizer."""
    pipe = tiny_pipeline()
    source = _Rows(TokenLayout(text_len=64, frames=2, height=3, width=5), [70], family="cogvideox", prompt=PROMPT)
    prompt_tokens = ["a", "red", "fox", "running", "in", "the", "snow", "</s>"]  # then 56 × <pad>
    assert words.text_tokens(pipe.tokenizer, PROMPT, 64) == prompt_tokens + [pipe.tokenizer.pad_token] * 56
    want = sorted(set(range(8)) | set(range(0, 64, 6)))
    draw = getattr(plot, figure)
    for tokenizer in (pipe, pipe.tokenizer):
        fig = draw(source, 0, tokenizer=tokenizer) if figure == "query_map" else draw(source, tokenizer=tokenizer)
        text = panels(fig)[-1]
        assert list(text.get_xticks()) == want, type(tokenizer).__name__
        assert [t.get_text() for t in text.get_xticklabels()] == prompt_tokens + [str(i) for i in want[8:]]


def test_query_map_names_a_text_query_by_its_text_index_and_a_history_query_as_history():
    """The title names the query token as the strip counts it: text last (HunyuanVideo), its index in the text; a
    video token off the grid (FramePack's, Helios's history) as history."""
    last = TokenLayout(text_len=7, frames=2, height=2, width=3, text_position="end")  # video 0..11, text 12..18
    history = TokenLayout(text_len=5, frames=2, height=2, width=3, history_len=4)  # text 0..4, history 5..8
    for layout, token, name in ((last, 14, "text 2"), (history, 6, "history 1"), (history, 3, "text 3")):
        source = _Rows(layout, [token])
        fig = plot.query_map(source, 0)
        assert fig.get_suptitle().splitlines()[0] == f"where {name} attends"
        row = source.P[0].mean(0)[token].float().numpy()
        assert np.allclose(heat(panels(fig)[0]).get_array(), row[layout.grid_tokens][:6].reshape(2, 3), atol=1e-6)


# -- sources, files, animations, widgets -----------------------------------------------------------
def test_a_loaded_run_plots_the_same(tiny, run):
    pipe, rec, video = tiny
    for make in (
        lambda s: plot.frame_heatmap(s, heads="all"),
        lambda s: plot.query_map(s, (1, 1, 2), video),
        lambda s: plot.word_heatmap(s, "fox", video, tokenizer=pipe.tokenizer),
    ):
        a, b = make(rec), make(run)
        assert [ax.get_title() for ax in panels(a)] == [ax.get_title() for ax in panels(b)]
        for x, y in zip(panels(a), panels(b)):
            assert np.array_equal(heat(x).get_array(), heat(y).get_array())


def test_aggregate_one_row_reads_only_that_row_from_a_run(tiny, run, monkeypatch):
    rec = tiny[1]
    for source in (rec, run):  # a row of the word kinds, of full and of query: the whole map's row
        for kind, row in (("video_to_text", 2), ("full", 7), ("query", 1)):
            want = torch.tensor(ref(source, kind, head=1))[row]
            assert torch.allclose(analysis.aggregate(source, kind, heads=1, row=row), want, atol=1e-6)
    reads = []
    get = type(run).get
    monkeypatch.setattr(type(run), "get", lambda self, *a, **kw: reads.append(kw.get("index")) or get(self, *a, **kw))
    assert analysis.aggregate(run, "full", steps=0, layers=1, row=7).shape == (run.layout.seq_len,)
    assert reads == [(0, slice(None), 7)]  # one memory-mapped row, not the (S, S) map
    with pytest.raises(ValueError, match=r"row=999 is out of range: 'full' has \d+ rows"):
        analysis.aggregate(run, "full", row=999)
    with pytest.raises(ValueError, match="batch=3 is out of range"):
        analysis.aggregate(run, "full", batch=3, row=0)
    with pytest.raises(TypeError, match="row=True"):
        analysis.aggregate(run, "full", row=True)
    assert torch.equal(analysis.aggregate(run, "full", row=np.int64(7)), analysis.aggregate(run, "full", row=7))


def test_saved_png_decodes_to_the_figure_size(tiny, tmp_path):
    fig = plot.frame_heatmap(tiny[1], heads="all")
    fig.savefig(tmp_path / "f.png", dpi=50)
    w, h = fig.get_size_inches() * 50
    assert Image.open(tmp_path / "f.png").size == (round(w), round(h))
    assert Image.open(io.BytesIO(fig._repr_png_())).format == "PNG"  # how a notebook shows it, pyplot or not


def test_animations_to_gif_share_limits_and_count_frames(tiny, tmp_path, monkeypatch):
    pipe, rec, video = tiny
    seen = []
    render = plot_animation._render

    def spy(fig):
        seen.append({heat(a).get_clim() for a in panels(fig)})
        return render(fig)

    monkeypatch.setattr(plot_animation, "_render", spy)
    path = plot.animate(
        plot.word_heatmap,
        rec,
        tmp_path / "steps.gif",
        over="step",
        dpi=40,
        tokens="fox",
        video=video,
        tokenizer=pipe.tokenizer,
    )
    gif = Image.open(path)
    fig = plot.word_heatmap(rec, "fox", video, tokenizer=pipe.tokenizer)
    w, h = fig.get_size_inches() * 40
    assert gif.n_frames == 2 and gif.size == (round(w), round(h))
    per_step = [ref(rec, "video_to_text", steps=(s,))[2] for s in (0, 1)]
    lo, hi = min(m.min() for m in per_step), max(m.max() for m in per_step)
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 1  # one scale for every frame
    assert next(iter(seen[0])) == pytest.approx((lo, hi), abs=1e-6)
    frames = plot.animate(plot.word_heatmap, rec, tmp_path / "frames.gif", over="frame", dpi=30, tokens=2, video=video)
    assert Image.open(frames).n_frames == 9
    layers = plot.animate(plot.frame_heatmap, rec, tmp_path / "layers.gif", over="layer", dpi=30, values=[1, 0, 1])
    assert Image.open(layers).n_frames == 3
    with pytest.raises(ValueError, match="over='frame'"):
        plot.animate(plot.frame_heatmap, rec, tmp_path / "x.gif", over="frame")
    with pytest.raises(ValueError, match=".gif or .mp4"):
        plot.animate(plot.frame_heatmap, rec, tmp_path / "x.avi")


def test_mp4_needs_ffmpeg(tiny, tmp_path, monkeypatch):
    rec = tiny[1]
    if plot_video._ffmpeg() is not None:
        path = plot.animate(plot.frame_heatmap, rec, tmp_path / "steps.mp4", dpi=30)
        try:
            import imageio_ffmpeg

            assert imageio_ffmpeg.count_frames_and_secs(str(path))[0] == 2
        except ImportError:
            assert path.stat().st_size > 0
    monkeypatch.setattr(plot_video, "_ffmpeg", lambda: None)
    with pytest.raises(RuntimeError, match="needs ffmpeg"):
        plot.animate(plot.frame_heatmap, rec, tmp_path / "none.mp4", dpi=30)


def test_explore_sliders_and_static_fallback(tiny, monkeypatch):
    pipe, rec, video = tiny
    widgets = pytest.importorskip("ipywidgets")
    w = plot.explore(rec, video, view="word", tokens="fox", tokenizer=pipe.tokenizer)
    assert isinstance(w, widgets.interactive)
    sliders = {c.description: c for c in w.children if hasattr(c, "description") and c.description}
    assert list(sliders["step"].options) == [0, 1] and list(sliders["head"].options) == ["mean", 0, 1]
    assert list(sliders["layer"].options) == ["mean", 0, 1] and sliders["frame"].max == 8
    sliders["head"].value, sliders["frame"].value = 1, 6
    (ax,) = panels(w.result)
    assert ax.get_title() == "px 6 · f2"
    assert np.allclose(
        heat(ax).get_array(), np.kron(ref(rec, "video_to_text", steps=(1,), head=1)[2, 2], np.ones((16, 16))), atol=1e-6
    )
    monkeypatch.setitem(__import__("sys").modules, "ipywidgets", None)  # ipywidgets missing
    static = plot.explore(rec, view="frame")
    assert isinstance(static, matplotlib.figure.Figure)
    assert "step 1" in static.get_suptitle()


def test_readme_figures_script_makes_every_committed_figure(tmp_path):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("make_readme_figures", root / "scripts" / "make_readme_figures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--dpi", "40"]) == 0
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == sorted(p.name for p in (root / "docs" / "figures").iterdir())
    for name in made:
        with Image.open(tmp_path / name) as im:
            assert im.format == ("GIF" if name.endswith(".gif") else "PNG")
            assert getattr(im, "n_frames", 1) == (4 if name.endswith(".gif") else 1)  # one frame per step


def test_a_grid_padded_to_whole_patches_is_placed_patch_by_patch_and_cut_at_the_video_s_edge():
    """Cosmos 3 at 720 × 1280: 45 latent rows padded to 23 patches of 32 pixels. Patch row r covers pixels
    32r .. 32r + 31, the last cut at 720 (before, the 23 rows were stretched over 720 pixels: 31.3 each, the last
    starting at pixel 689); a grid that fits the video exactly is unchanged."""
    from cogattn.plot.video import patch_pixels, upsample_to_video

    lay = TokenLayout(0, 2, 23, 40, patch_size=2)
    maps = torch.arange(23, dtype=torch.float32)[None, :, None].expand(2, 23, 40)  # each patch row's index
    up = upsample_to_video(maps, lay, 5, (720, 1280))
    assert up.shape == (5, 720, 1280)
    assert torch.equal(up[0, :, 0], (torch.arange(720) // 32).float())
    assert patch_pixels(lay, (720, 1280)) == (32.0, 32.0) and patch_pixels(lay, (360, 640)) == (16.0, 16.0)
    exact = TokenLayout(0, 2, 30, 45)
    assert patch_pixels(exact, (480, 720)) == (16.0, 16.0)
    grid = torch.rand(2, 30, 45)
    assert torch.equal(
        upsample_to_video(grid, exact, 5, (480, 720))[0], grid[0].repeat_interleave(16, 0).repeat_interleave(16, 1)
    )


# -- degenerate and damaged maps -------------------------------------------------------------------
class _Maps:
    """The MapSource members the figures use, over records given as a dict ``(kind, step, layer) -> tensor``."""

    def __init__(self, layout, records, heads=1):
        self.layout, self.records, self.head_ids = layout, records, tuple(range(heads))
        self.timesteps, self.info, self.batch_roles, self.skipped = [999.0, 500.0], {}, (None,), Skips()
        self.block_size, self.queries, self.text_spans = 8, (), None

    def layout_of(self, layer):
        return self.layout

    def keys(self):
        return sorted(self.records)

    def get(self, kind, step, layer):
        return self.records[(kind, step, layer)].clone()


def _drawn(fig):
    fig.savefig(io.BytesIO(), format="png")  # colour bars may change their norm when drawn
    return [heat(ax) for ax in panels(fig)]


def test_constant_maps_draw_one_colour_under_shared_limits():
    """Wan at num_frames=1: one latent frame and no text, so the frame map is [[1.0]] for every head. A colour bar
    widened the first panel's norm alone (to 0.9..1.1), drawing the same value mid-scale there and darkest elsewhere."""
    lay = TokenLayout(text_len=0, frames=1, height=2, width=3)
    src = _Maps(lay, {("frame", s, 0): torch.ones(1, 3, 1, 1) for s in (0, 1)}, heads=3)
    for fig in (plot.frame_heatmap(src, heads="all"), plot.layer_step_grid(src, "frame", heads=1)):
        images = _drawn(fig)
        assert len(images) > 1
        assert len({tuple(im.to_rgba(im.get_array())[0, 0]) for im in images}) == 1
        for im in images:
            assert im.get_clim() == pytest.approx((0.9, 1.1))  # widened by 10%, as a colour bar would
    for scale in ("linear", "log"):
        shared = plot_style.color_norms([np.full((2, 2), 0.25)] * 3, scale, "shared")
        assert shared[0] is shared[1] is shared[2]  # one norm: a change to one is a change to all
        for norm in (*shared, *plot_style.color_norms([np.full((2, 2), 0.25)], scale, "per-map")):
            assert (norm.vmin, norm.vmax) == pytest.approx((0.225, 0.275))
    (zero,) = plot_style.color_norms([np.zeros((2, 2))], "linear", "per-map")
    assert (zero.vmin, zero.vmax) == pytest.approx((-0.1, 0.1))


def test_non_finite_cells_are_drawn_bad_and_left_out_of_the_limits():
    """A damaged run: one inf cell made the scale (-0.1, 0.1), every finite cell one colour, and a log scale raise."""
    lay = TokenLayout(text_len=2, frames=2, height=2, width=2)  # 3 groups: text, f0, f1
    frame = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.1, 0.2, 0.7]]).expand(1, 2, 3, 3).clone()
    frame[0, 1] *= 0.5  # head 1 differs from head 0
    frame[0, 1, 2, 2] = math.inf
    offset = torch.rand(1, 2, 3, 3, 3, generator=torch.Generator().manual_seed(0)) + 0.1
    offset[0, 0, 1, 1, 1] = math.inf
    src = _Maps(lay, {("frame", 0, 0): frame, ("offset", 0, 0): offset}, heads=2)
    values = frame[0].numpy()
    finite = values[np.isfinite(values)]
    magma = matplotlib.colormaps[plot_style.CMAP]
    for scale in ("linear", "log"):
        with pytest.warns(RuntimeWarning, match="non-finite values") as caught:
            fig = plot.frame_heatmap(src, heads="all", scale=scale)
        assert sum("non-finite" in str(w.message) for w in caught) == 1  # once a figure
        images = _drawn(fig)
        for h, im in enumerate(images):
            assert im.get_clim() == pytest.approx((finite.min(), finite.max()))
            rgba = im.to_rgba(im.get_array())
            for (r, c), v in np.ndenumerate(values[h]):
                if np.isfinite(v):  # the colour map at the value's place between the finite limits
                    at = (v - finite.min()) / np.ptp(finite)
                    if scale == "log":
                        at = np.log(v / finite.min()) / np.log(finite.max() / finite.min())
                    assert rgba[r, c] == pytest.approx(np.array(magma(at)), abs=1 / 255), (h, r, c)
                else:
                    assert tuple(rgba[r, c]) == pytest.approx(im.cmap.get_bad())
        (bar,) = [a for a in fig.axes if a.get_label() == "<colorbar>"]
        assert bar.get_ylim() == pytest.approx((finite.min(), finite.max()))
    with pytest.warns(RuntimeWarning, match="non-finite values"):
        grid = _drawn(plot.layer_step_grid(src, "frame", heads=1))
    head1 = values[1][np.isfinite(values[1])]
    assert grid[0].get_clim() == pytest.approx((head1.min(), head1.max()))  # head 1 without its inf
    with pytest.warns(RuntimeWarning, match="non-finite values"):
        images = _drawn(plot.offset_map(src))  # log scale by default: raised "Invalid vmin or vmax"
    o = offset[0].mean(0).numpy()
    assert images[0].get_clim() == pytest.approx((o.min(), o[np.isfinite(o)].max()))
