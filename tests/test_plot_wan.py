"""Plots, the head table, masks, words and previews on Wan recordings: the self-attention sequence is the
video alone (``text_len == 0``, no text group), the text is a cross-attention of 512 tokens
(``video_to_text``), and Wan 2.1 image-to-video adds an image cross-attention (``video_to_image``)."""

import math
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")  # the plot module never picks a backend; tests render off-screen

import numpy as np
import pytest

import cogattn.models

if cogattn.models.wan is None:
    pytest.skip("cogattn has no Wan support with this diffusers (WanAttention came with 0.35)", allow_module_level=True)
import torch
from PIL import Image

import cogattn
from cogattn import plot
from cogattn.analysis import aggregate, head_stats, masks, words
from cogattn.dump.previews import write_previews
from cogattn.models.wan import tiny_pipeline as tiny_wan_pipeline
from cogattn.plot.stats import _group_starts

PROMPT = "a red fox running in the snow"  # tiny tokenizer: a red fox running in the snow </s> <pad> ...
KINDS = ("frame", "video_to_text", "query_frame", "entropy", "received", "block", "full", "query")
F, HP, WP, S, BLOCK = 3, 2, 3, 18, 4  # 9 frames of 32 × 48: 3 latent frames of 2 × 3 patches


def _generate(task, folder):
    extra, kinds = {}, KINDS
    if task == "i2v":
        pipe = tiny_wan_pipeline("image-to-video")
        extra, kinds = dict(image=Image.new("RGB", (48, 32), (200, 80, 40))), KINDS + ("video_to_image",)
    else:
        pipe = tiny_wan_pipeline()
    options = dict(heads="all", queries=[(0, 0, 0), (2, 1, 2)], block_size=BLOCK, info={"prompt": PROMPT})
    with cogattn.record(pipe, kinds=kinds, save_dir=folder, **options) as rec:
        video = pipe(
            prompt=PROMPT,
            num_frames=9,
            height=32,
            width=48,
            num_inference_steps=2,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
            **extra,
        ).frames[0]
    return SimpleNamespace(pipe=pipe, rec=rec, run=cogattn.load(folder), folder=folder, video=video)


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    return _generate("t2v", tmp_path_factory.mktemp("wan") / "t2v")


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    return _generate("i2v", tmp_path_factory.mktemp("wan") / "i2v")


@pytest.fixture(params=["t2v", "i2v"])
def wan(request):
    return request.getfixturevalue(request.param)


def panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>" and a.get_visible()]


def heat(ax):
    (im,) = [im for im in ax.images if im.get_gid() == "attention"]
    return im.get_array()


def labels(ticks):
    return [t.get_text() for t in ticks]


# -- the recordings ---------------------------------------------------------------------------------
def test_wan_layout_and_shapes(t2v, i2v):
    for w, image_len in ((t2v, 0), (i2v, 17)):
        layout = w.run.layout
        assert layout == w.rec.layout  # run.json keeps the context and image lengths
        assert (layout.text_len, layout.context_len, layout.image_len) == (0, 512, image_len)
        assert (layout.text_groups, layout.num_groups, layout.seq_len) == (0, F, S)
        assert tuple(w.run.get("frame", 0, 0).shape) == (1, 2, F, F)
        assert tuple(w.run.get("video_to_text", 0, 0).shape) == (1, 2, 512, F, HP, WP)
    v2i = aggregate(i2v.run, "video_to_image", heads="all")
    assert tuple(v2i.shape) == (2, 17, F, HP, WP)
    torch.testing.assert_close(v2i.sum(1), torch.ones(2, F, HP, WP), atol=1e-5, rtol=0)  # its own softmax


# -- frame maps ------------------------------------------------------------------------------------
def test_frame_heatmap_has_no_text_group(wan):
    fig = plot.frame_heatmap(wan.run, heads="all")
    axes = panels(fig)
    assert len(axes) == 2  # one panel per head
    want = ["f0\npx 0", "f1\npx 1–4", "f2\npx 5–8"]
    for h, ax in enumerate(axes):
        assert labels(ax.get_xticklabels()) == want and labels(ax.get_yticklabels()) == want
        assert ax.get_xlabel() == "key: latent frame" and ax.get_ylabel() == "query: latent frame"
        np.testing.assert_allclose(heat(ax), aggregate(wan.run, "frame", heads=h).numpy(), rtol=1e-6)
        np.testing.assert_allclose(heat(ax).sum(1), np.ones(F), atol=1e-5)  # rows sum to 1, no text column
    grid = plot.layer_step_grid(wan.run, "frame")
    first = grid.axes[0]
    assert labels(first.get_yticklabels()) == ["f0", "f1", "f2"]
    assert len(first.get_xticks()) == F


# -- the head table ---------------------------------------------------------------------------------
def test_head_table_without_text_keys(wan):
    table = head_stats.head_table(wan.run)
    assert len(table) == 2 * 2 * 2  # steps × layers × heads, one item
    assert table["text_mass"].isna().all()  # Wan's self-attention has no text keys
    dt = table[[f"dt_{d}" for d in range(F)]].to_numpy()
    np.testing.assert_allclose(dt.sum(1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(table["same_frame_mass"], table["dt_0"])
    assert set(table["label"]) <= {"spatial", "temporal", "global"}
    for row in table.to_dict("records"):
        assert row["label"] == head_stats.LabelRule().label({**row, "text_mass": 0.0})
    distance = np.abs(np.arange(F)[:, None] - np.arange(F)[None, :])
    for row in table.itertuples():
        frame = wan.run.get("frame", row.step, row.layer)[0, row.head].double().numpy()  # (F, F)
        hand = [frame[distance == d].sum() / F for d in range(F)]
        np.testing.assert_allclose([getattr(row, f"dt_{d}") for d in range(F)], hand, atol=1e-6)
        e = wan.run.get("entropy", row.step, row.layer)[0, row.head].double()
        assert row.entropy_mean == pytest.approx(e.mean().item(), abs=1e-6)  # every query is a video query

    class NoFrame:  # the same source without kind frame: the numbers come from query_frame
        def __init__(self, source):
            self.source = source

        def __getattr__(self, name):
            return getattr(self.source, name)

        def keys(self):
            return [k for k in self.source.keys() if k[0] != "frame"]

    other = head_stats.head_table(NoFrame(wan.run))
    assert other["text_mass"].isna().all()
    np.testing.assert_allclose(other[[f"dt_{d}" for d in range(F)]].to_numpy(), dt, atol=1e-5)


def test_labels_without_text_mass():
    rule, nan = head_stats.LabelRule(), math.nan
    # without text keys (text_mass NaN, frame numbers known) a row is labelled with a text mass of 0
    assert head_stats.label_row(rule, {"text_mass": nan, "same_frame_mass": 0.7, "dt_1": 0.2}) == "spatial"
    assert head_stats.label_row(rule, {"text_mass": nan, "same_frame_mass": 0.2, "dt_1": 0.6}) == "temporal"
    assert head_stats.label_row(rule, {"text_mass": nan, "same_frame_mass": 0.2, "dt_1": 0.3}) == "global"
    assert head_stats.label_row(rule, {"text_mass": nan, "same_frame_mass": nan, "dt_1": nan}) == "unknown"
    assert head_stats.label_row(rule, {"text_mass": 0.6, "same_frame_mass": 0.3, "dt_1": 0.1}) == "text"
    assert rule.label({"text_mass": nan, "same_frame_mass": 0.7, "dt_1": 0.2}) == "unknown"  # the rule alone


def test_head_figures(t2v):
    atlas = plot.head_atlas(t2v.run)
    (ax,) = panels(atlas)
    assert {t.get_text() for t in ax.texts} <= {"spat", "temp", "glob"}  # labels, none "unknown"
    assert {t.get_text() for t in panels(plot.head_atlas(t2v.run, steps="mean"))[0].texts} <= {"spat", "temp", "glob"}
    assert labels(ax.get_xticklabels()) == ["0", "1"] and labels(ax.get_yticklabels()) == ["0", "1"]
    plot.head_atlas(t2v.run, "dt_1")
    with pytest.raises(ValueError, match="no text keys"):
        plot.head_atlas(t2v.run, "text_mass")
    curves = plot.decay_curves(t2v.run)
    lines = [line for line in curves.axes[0].lines if line.get_gid() == "decay-curve"]
    assert len(lines) == 2 and all(len(line.get_xdata()) == F for line in lines)


# -- block masks ------------------------------------------------------------------------------------
def test_block_grid_and_masks_without_text(t2v):
    layout = t2v.run.layout
    grid = masks.BlockGrid(layout, BLOCK)
    assert grid.num_blocks == 5 and grid.sizes.tolist() == [4, 4, 4, 4, 2]
    assert not grid.has_text.any() and grid.text_tokens(0) == range(0)
    assert [grid.frames(m) for m in range(5)] == [[0], [0, 1], [1], [2], [2]]  # frames of 6 tokens
    same = masks.same_frame_mask(layout, BLOCK)
    assert torch.equal(same, masks.same_frame_mask(layout, BLOCK, text=False))  # no text rows to keep
    assert same.sum().item() == 11  # 7 pairs among blocks 0–2 (frames 0, 1) and 4 among blocks 3–4 (frame 2)
    assert masks.temporal_window_mask(layout, BLOCK, F - 1).all()
    assert masks.spatial_window_mask(layout, BLOCK, 2).all()


def test_mask_recall_and_oracle_are_exact_without_text(wan):
    layout = wan.run.layout
    full_keep = torch.ones(5, 5, dtype=torch.bool)
    np.testing.assert_allclose(masks.mask_recall(wan.run, full_keep)["recall"], 1.0, atol=1e-5)
    np.testing.assert_allclose(masks.mask_recall(wan.run, ~full_keep)["recall"], 0.0, atol=0)
    same = masks.same_frame_mask(layout, BLOCK)
    table = masks.mask_recall(wan.run, same)
    block = torch.arange(S) // BLOCK
    tokens = same[block][:, block].double()  # (S, S) the mask on tokens
    for row in table.itertuples():
        p = wan.run.get("full", row.step, row.layer)[0, row.head].double()
        assert row.recall == pytest.approx((p * tokens).sum().item() / S, abs=1e-5)
    curve = masks.oracle_curve(wan.run, ks=[1, 2, 5])
    np.testing.assert_allclose(curve[curve["k"] == 5]["recall"], 1.0, atol=1e-5)
    per = curve.pivot_table(index=["step", "layer", "head"], columns="k", values="recall").to_numpy()
    assert (np.diff(per, axis=1) >= -1e-9).all()


def test_block_map_ticks_and_recall(wan):
    layout = wan.run.layout
    starts, names = _group_starts(layout, BLOCK)
    assert names == ["f0", "f1", "f2"] and starts == [-0.5, 1.0, 2.5]
    same = masks.same_frame_mask(layout, BLOCK)
    fig = plot.block_map(wan.run, same, heads=1)
    (ax,) = panels(fig)
    assert labels(ax.get_xticklabels()) == ["f0", "f1", "f2"]
    assert "where frames start" in ax.get_xlabel()
    recall = masks.mask_recall(wan.run, same)
    assert f"recall {recall[recall['head'] == 1]['recall'].mean():.4f}" in fig.get_suptitle()


# -- per-token statistics and query maps ------------------------------------------------------------
def test_token_stat_has_no_text_strip(wan):
    for kind in ("entropy", "received"):
        fig = plot.token_stat(wan.run, kind, heads=0)
        axes = panels(fig)
        assert len(axes) == F  # one panel per latent frame, no text strip
        values = aggregate(wan.run, kind, heads=0).reshape(F, HP, WP)
        for f, ax in enumerate(axes):
            np.testing.assert_allclose(heat(ax), values[f].numpy(), rtol=1e-6)
        assert "text tokens" not in fig.get_suptitle()
    fig = plot.token_stat(wan.run, "received", wan.video, sinks=4)
    marks = [line for ax in fig.axes for line in ax.lines if line.get_gid() == "sink-token"]
    assert len(marks) == 4  # every sink is a video token, each on its frame's panel
    assert aggregate(wan.run, "received").sum().item() == pytest.approx(S, rel=1e-5)


def test_query_map_over_the_video_alone(wan):
    fig = plot.query_map(wan.run, (2, 1, 2), heads=1)
    axes = panels(fig)
    assert len(axes) == F
    row = aggregate(wan.run, "query", heads=1)[1].reshape(F, HP, WP)
    for f, ax in enumerate(axes):
        np.testing.assert_allclose(heat(ax), row[f].numpy(), rtol=1e-6)
    (point,) = [line for ax in axes for line in ax.lines if line.get_gid() == "query-point"]
    assert point.axes is axes[2] and (point.get_xdata()[0], point.get_ydata()[0]) == (2, 1)


# -- words and the text cross-attention --------------------------------------------------------------
def test_word_heatmap_on_the_512_text_tokens(t2v):
    run, tokenizer = t2v.run, t2v.pipe.tokenizer
    assert words.word_positions("fox", tokenizer, PROMPT, run.layout.prompt_len) == [2]
    fig = plot.word_heatmap(run, ["fox", 7, 300], tokenizer=tokenizer)  # prompt from info
    axes = np.array(panels(fig)).reshape(3, F)
    m = aggregate(run, "video_to_text")
    for r, t in enumerate((2, 7, 300)):
        for f in range(F):
            np.testing.assert_allclose(heat(axes[r, f]), m[t, f].numpy(), rtol=1e-6)
    assert axes[0, 0].get_ylabel().startswith('"fox" (token 2)')
    assert axes[1, 0].get_ylabel().startswith('"</s>" (token 7)')
    assert axes[2, 0].get_ylabel().startswith('"<pad>" (token 300)')
    with pytest.raises(ValueError, match="T = 512 tokens"):
        plot.word_heatmap(run, 512)
    with pytest.raises(ValueError, match="cross-attention"):
        plot.word_heatmap(run, 2, kind="text_to_video")
    on_video = plot.word_heatmap(run, "snow", t2v.video, tokenizer=tokenizer)
    assert [ax.get_title() for ax in panels(on_video)] == ["px 0 · f0", "px 3 · f1", "px 7 · f2"]


def test_words_with_umt5_like_pieces_and_the_cleaned_prompt():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # UMT5's sentencepiece pieces: "▁" starts a word, and a word not in the vocabulary may be a lone "▁"
    # and pieces without it ("▁", "fox", "es")
    pieces = ["<pad>", "</s>", "<unk>", "▁a", "▁red", "▁", "fox", "es", ",", "▁run", "ning", "▁in", "▁snow"]
    model = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=2))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    prompt = "a red foxes, running in snow"
    assert words.text_tokens(fast, prompt, 512)[:6] == ["▁a", "▁red", "▁", "fox", "es", ","]
    assert words.word_positions("foxes", fast, prompt, 512) == [3, 4]  # not the lone "▁"
    assert words.word_positions("running", fast, prompt, 512) == [6, 7]
    with pytest.raises(ValueError, match=r"then 501 × '<pad>'"):  # the message leaves out the padding
        words.word_positions("cat", fast, prompt, 512)

    class Slow:  # the slow (offset-free) sentencepiece path with the same pieces
        is_fast = False
        all_special_tokens = ("</s>", "<pad>")

        def __call__(self, text, **kw):
            return {"input_ids": list(range(10))}

        def convert_ids_to_tokens(self, ids):
            return ["▁a", "▁red", "▁", "fox", "es", ",", "▁run", "ning", "</s>", "<pad>"]

    assert words.word_positions("foxes", Slow(), "a red foxes, running", 10) == [3, 4]
    assert words.word_positions("red foxes", Slow(), "a red foxes, running", 10) == [1, 3, 4]

    # Wan tokenizes prompt_clean(prompt): entities unescaped, runs of white space made one
    messy = "  a  red &amp;amp;\n fox "
    assert words.clean_prompt(messy) == "a red & fox"
    assert words.text_tokens(fast, messy, 8, clean=True)[:4] == ["▁a", "▁red", "▁", "<unk>"]
    tiny = tiny_wan_pipeline.__globals__["tiny_tokenizer"]()
    assert words.word_positions("fox", tiny, messy, 512, clean=True) == [3]


# -- the image cross-attention (Wan 2.1 image-to-video) ----------------------------------------------
def test_video_to_image_overlay(i2v):
    run = i2v.run
    fig = plot.word_heatmap(run, [0, 5], kind="video_to_image")
    axes = np.array(panels(fig)).reshape(2, F)
    m = aggregate(run, "video_to_image")
    for r, t in enumerate((0, 5)):
        assert axes[r, 0].get_ylabel().startswith(f"image token {t}")
        for f in range(F):
            np.testing.assert_allclose(heat(axes[r, f]), m[t, f].numpy(), rtol=1e-6)
    assert "video → image" in fig.get_suptitle()
    on_video = plot.word_heatmap(run, 3, i2v.video, kind="video_to_image")
    assert len(panels(on_video)) == F
    with pytest.raises(ValueError, match="I = 17 image tokens"):
        plot.word_heatmap(run, 17, kind="video_to_image")
    with pytest.raises(ValueError, match="image tokens have none"):
        plot.word_heatmap(run, "fox", kind="video_to_image", tokenizer=i2v.pipe.tokenizer)
    grid = plot.layer_step_grid(run, "video_to_image", index=(0, 1))
    assert len(panels(grid)) == 4  # 2 layers × 2 steps


def test_animation_over_steps_of_video_to_image(i2v, tmp_path):
    path = plot.animate(plot.word_heatmap, i2v.run, tmp_path / "image.gif", kind="video_to_image", tokens=[0])
    with Image.open(path) as gif:
        assert gif.n_frames == 2  # the two recorded steps


# -- previews ---------------------------------------------------------------------------------------
def test_previews_of_wan_runs(wan, tmp_path):
    paths = write_previews(wan.folder, tmp_path / "previews", wan.video, wan.pipe.tokenizer, PROMPT, dpi=40)
    names = {p.stem for p in paths}
    want = {"frame", "video_to_text", "query", "entropy", "received", "block", "heads"}
    assert names == want | ({"video_to_image"} if wan.run.layout.image_len else set())
    for p in paths:
        with Image.open(p) as im:
            im.verify()
