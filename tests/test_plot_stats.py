"""Figures of the head table and the statistics kinds show what the records hold: atlas cells, decay
curves, per-token panels and sinks, the block map with a mask's outline and recall, animations, runs."""

import math
import re

import matplotlib

matplotlib.use("Agg")  # the plot module never picks a backend; tests render off-screen

import numpy as np
import pytest
import torch
from matplotlib.colors import LogNorm, to_rgba
from PIL import Image
from test_plot import _Maps
from tiny_calls import generate

import cogattn
from cogattn import plot
from cogattn.exact import patterns
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.plot import animation as plot_animation

KINDS = ("frame", "query_frame", "entropy", "received", "block", "full")
BLOCK = 6  # tokens per block: S = 53 gives N = 9 blocks, and neither the text (8) nor a frame (15) fills blocks
T, GRID = 8, (3, 3, 5)  # the tiny layout: text tokens, (F, Hp, Wp)


def _record(pipe, **kw):
    with cogattn.record(pipe, kinds=KINDS, heads="all", batch="all", block_size=BLOCK, **kw) as rec:
        frames = generate(pipe, steps=2)
    return rec, frames[0]


@pytest.fixture(scope="module")
def tiny():
    missing = [k for k in KINDS if k not in cogattn.KINDS]
    if missing:
        pytest.skip(f"kinds {missing} are not in cogattn.KINDS yet: the core does not record them")
    pipe = tiny_pipeline()
    rec, video = _record(pipe)
    return pipe, rec, video


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stats") / "run"
    _record(tiny[0], save_dir=folder)
    return cogattn.load(folder)


COND = 1  # the conditional item of the guidance batch [uncond, cond]: what the figures show by default


def ref(source, kind, steps=(0, 1), layers=(0, 1), head=None, batch=COND):
    """Mean over steps × layers, then over heads (or one head), from plain ``get`` calls."""
    t = torch.stack([source.get(kind, s, layer)[batch] for s in steps for layer in layers]).double().mean(0)
    return (t.mean(0) if head is None else t[head]).numpy()


def panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>" and a.get_visible()]


def heat(ax):
    (im,) = [im for im in ax.images if im.get_gid() == "attention"]
    return im


def table(source):
    from cogattn.analysis.head_stats import head_table

    return head_table(source)


# -- head atlas ------------------------------------------------------------------------------------
def test_head_atlas_cells_are_the_labels_of_the_head_table(tiny):
    from cogattn.analysis.head_stats import LabelRule, head_table

    _, rec, _ = tiny
    last = head_table(rec, steps=1)
    # thresholds between the heads' own numbers, so the atlas shows more than one label
    rule = LabelRule(text_min=float(last["text_mass"].median()), spatial_min=float(last["same_frame_mass"].median()))
    labelled = head_table(rec, steps=1, rule=rule)
    rows = labelled[labelled["item"] == 1]
    assert rows["label"].nunique() >= 2
    fig = plot.head_atlas(rec, rule=rule, item=1)  # default: the last step
    (ax,) = panels(fig)
    im = heat(ax)
    names = list(plot.LABEL_COLORS)
    for _, row in rows.iterrows():
        r, c = row["layer"], row["head"]
        assert names[int(im.get_array()[r, c])] == row["label"]
        assert tuple(im.to_rgba(im.get_array())[r, c]) == to_rgba(plot.LABEL_COLORS[row["label"]])
    (legend,) = fig.legends
    legend = [t.get_text() for t in legend.get_texts()]
    assert sorted(legend) == sorted(rows["label"].unique())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"] and ax.get_xlabel() == "head"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"] and ax.get_ylabel() == "layer"
    assert f"step 1 (t={rec.timesteps[1]:g})" in fig.get_suptitle() and "batch item 1" in fig.get_suptitle()


def test_head_atlas_numbers_and_step_mean(tiny):
    from cogattn.analysis.head_stats import LabelRule

    _, rec, _ = tiny
    full = table(rec)
    cond = rec.batch_roles.index("cond")  # the atlas shows the prompt's item under guidance
    im = heat(panels(plot.head_atlas(rec, color="entropy_mean", steps="mean"))[0])
    for layer in (0, 1):
        for head in (0, 1):
            # from the records: mean over steps of the mean entropy of the video queries
            direct = np.mean([rec.get("entropy", s, layer)[cond, head, T:].double().mean().item() for s in (0, 1)])
            rows = full[(full["layer"] == layer) & (full["head"] == head) & (full["item"] == cond)]
            assert im.get_array()[layer, head] == pytest.approx(direct, abs=1e-6)
            assert im.get_array()[layer, head] == pytest.approx(rows["entropy_mean"].mean(), abs=1e-9)
    assert im.get_clim() == pytest.approx((im.get_array().min(), im.get_array().max()))
    # a label over several steps is the rule's label of the averaged numbers
    rule = LabelRule(temporal_min=0.2)
    im = heat(panels(plot.head_atlas(full, steps="mean", rule=rule))[0])
    for layer in (0, 1):
        for head in (0, 1):
            rows = full[(full["layer"] == layer) & (full["head"] == head) & (full["item"] == cond)]
            mean = {c: rows[c].mean() for c in ("text_mass", "same_frame_mass", "dt_1", "dt_2")}
            assert list(plot.LABEL_COLORS)[int(im.get_array()[layer, head])] == rule.label(mean)
    # a table as the source, one step, another item
    im = heat(panels(plot.head_atlas(full, color="dt_1", steps=0, item=1 - cond))[0])
    rows = full[(full["step"] == 0) & (full["item"] == 1 - cond)]
    for _, row in rows.iterrows():
        assert im.get_array()[row["layer"], row["head"]] == row["dt_1"]
    with pytest.raises(ValueError, match="'label' or one of"):
        plot.head_atlas(full, color="sink_tokens")
    with pytest.raises(ValueError, match="no column"):
        plot.head_atlas(full, color="entropy")
    with pytest.raises(ValueError, match=r"step 5 is not in the table; it holds steps \[0, 1\]"):
        plot.head_atlas(full, steps=5)


def test_animate_head_atlas_one_frame_per_step_with_shared_limits(tiny, tmp_path, monkeypatch):
    _, rec, _ = tiny
    seen = []
    render = plot_animation._render

    def spy(fig):
        seen.append(heat(panels(fig)[0]).get_clim())
        return render(fig)

    monkeypatch.setattr(plot_animation, "_render", spy)
    path = plot.animate(plot.head_atlas, rec, tmp_path / "atlas.gif", over="step", dpi=30, color="sink_share")
    assert Image.open(path).n_frames == 2
    values = table(rec).query("item == @COND")["sink_share"]
    assert seen == [pytest.approx((values.min(), values.max()))] * 2  # one colour scale for both steps
    labels = plot.animate(plot.head_atlas, rec, tmp_path / "labels.gif", dpi=30)
    assert Image.open(labels).n_frames == 2


# -- decay with frame distance ---------------------------------------------------------------------
def test_decay_curves_per_layer_and_head(tiny):
    from cogattn.analysis.head_stats import temporal_decay

    _, rec, _ = tiny
    fig = plot.decay_curves(rec, by="layer")
    (ax,) = panels(fig)
    curves = [ln for ln in ax.lines if ln.get_gid() == "decay-curve"]
    assert [ln.get_label() for ln in curves] == ["layer 0", "layer 1"]
    expected = temporal_decay(table(rec).query("item == @COND"), by="layer")
    for layer, ln in enumerate(curves):
        assert list(ln.get_xdata()) == [0, 1, 2]
        assert np.allclose(ln.get_ydata(), expected.loc[layer].to_numpy(), atol=1e-12)
        # from the frame records: mass of video queries of frame q on the keys of frames k, |q - k| = d
        frame = ref(rec, "frame", layers=(layer,))[1:, 1:]  # (F query frames, F key frames)
        naive = [np.mean([sum(frame[q, k] for k in range(3) if abs(q - k) == d) for q in range(3)]) for d in range(3)]
        assert np.allclose(ln.get_ydata(), naive, atol=1e-6)
    assert "latent frame distance" in ax.get_xlabel()
    by_head = [ln for ln in panels(plot.decay_curves(rec, per_frame=True))[0].lines if ln.get_gid() == "decay-curve"]
    assert [ln.get_label() for ln in by_head] == ["head 0", "head 1"]
    per_head = temporal_decay(table(rec).query("item == @COND"), by="head")
    frames_at = np.array([1, 4 / 3, 2 / 3])  # F = 3: key frames at distance 0, 1, 2, averaged over query frames
    for head, ln in enumerate(by_head):
        assert np.allclose(ln.get_ydata(), per_head.loc[head].to_numpy() / frames_at, atol=1e-12)
    with pytest.raises(ValueError, match="by='frame'"):
        plot.decay_curves(rec, by="frame")


# -- per-token statistics --------------------------------------------------------------------------
def test_token_stat_entropy_panels_are_the_record_on_the_grid_and_the_video(tiny):
    _, rec, video = tiny
    values = ref(rec, "entropy")
    fig = plot.token_stat(rec, "entropy")
    axes = panels(fig)
    grid = values[T:].reshape(GRID)
    for f in range(3):
        assert np.allclose(heat(axes[f]).get_array(), grid[f], atol=1e-6)
        assert axes[f].get_title() == ["f0 · px 0", "f1 · px 1–4", "f2 · px 5–8"][f]
    assert np.allclose(heat(axes[3]).get_array(), values[None, :T], atol=1e-6)
    assert axes[3].get_xlabel() == "text tokens"
    assert f"text tokens' mean {values[:T].mean():.3g}" in fig.get_suptitle()
    assert f"ln S = {math.log(53):.2f}" in fig.get_suptitle()
    for ax in axes:
        assert heat(ax).get_clim() == pytest.approx((values.min(), values.max()), abs=1e-6)
    one = ref(rec, "entropy", steps=(1,), layers=(0,), head=1)[T:].reshape(GRID)
    over = panels(plot.token_stat(rec, "entropy", video, steps=1, layers=0, heads=1, scale="log"))
    assert [a.get_title() for a in over[:3]] == ["px 0 · f0", "px 3 · f1", "px 7 · f2"]
    for f, ax in enumerate(over[:3]):
        assert np.allclose(heat(ax).get_array(), np.kron(one[f], np.ones((16, 16))), atol=1e-6)
        assert isinstance(heat(ax).norm, LogNorm)
    with pytest.raises(ValueError, match="kind='frame'"):
        plot.token_stat(rec, "frame")
    with pytest.raises(ValueError, match="one head at a time"):
        plot.token_stat(rec, heads="all")


def test_token_stat_received_marks_the_top_sinks(tiny):
    _, rec, video = tiny
    values = ref(rec, "received")
    assert values.sum() == pytest.approx(53, abs=1e-3)  # every query gives 1 in all
    top = np.argsort(-values)[:4].tolist()
    for vid in (None, video):
        fig = plot.token_stat(rec, "received", vid, sinks=4)
        axes = panels(fig)
        assert np.allclose(heat(axes[3]).get_array(), values[None, :T], atol=1e-6)
        marks = {
            (i, ln.get_xdata()[0], ln.get_ydata()[0])
            for i, ax in enumerate(axes)
            for ln in ax.lines
            if ln.get_gid() == "sink-token"
        }
        expected = set()
        for t in top:
            if t < T:
                expected.add((3, t, 0))  # on the text strip
            else:
                f, rest = divmod(t - T, 15)
                y, x = divmod(rest, 5)
                expected.add((f, x, y) if vid is None else (f, (x + 0.5) * 16, (y + 0.5) * 16))
        assert marks == expected
        assert "top sinks (marked): #1 " in fig.get_suptitle()
        assert all(f"{values[t]:.3g}" in fig.get_suptitle() for t in top)
    assert not any(ln.get_gid() == "sink-token" for ax in panels(plot.token_stat(rec, "entropy")) for ln in ax.lines)


def test_sink_names_count_text_from_its_strip_and_name_history_tokens():
    """A sink's name in the title: the text by its index in the text strip (text last too), a history token as such."""
    from cogattn.plot.style import token_name

    last = TokenLayout(text_len=7, frames=2, height=2, width=3, text_position="end")
    history = TokenLayout(text_len=5, frames=2, height=2, width=3, history_len=4)
    assert [token_name(last, t) for t in (0, 11, 12, 18)] == ["f0 (0, 0)", "f1 (1, 2)", "text 0", "text 6"]
    assert [token_name(history, t) for t in (4, 5, 8, 9)] == ["text 4", "history 0", "history 3", "f0 (0, 0)"]


# -- block map -------------------------------------------------------------------------------------
def _cells_inside(segments, n):
    """The cells an outline encloses, by crossing its vertical edges along each row (parity)."""
    inside = np.zeros((n, n), dtype=bool)
    for r in range(n):
        xs = sorted(s[0][0] for s in segments if s[0][0] == s[1][0] and min(s[0][1], s[1][1]) == r - 0.5)
        for a, b in zip(xs[::2], xs[1::2]):
            inside[r, int(a + 0.5) : int(b + 0.5)] = True
    return inside


def test_block_map_data_ticks_outline_and_recall(tiny):
    from cogattn.analysis.masks import mask_recall, same_frame_mask

    _, rec, _ = tiny
    assert rec.block_size == BLOCK
    fig = plot.block_map(rec)
    (ax,) = panels(fig)
    assert np.allclose(heat(ax).get_array(), ref(rec, "block"), atol=1e-6)
    assert heat(ax).get_array().shape == (9, 9)  # ⌈53 / 6⌉
    # the text starts at token 0, frame f at token 8 + 15 f: in blocks of 6, at token / 6 on cells centred on integers
    assert np.allclose(ax.get_xticks(), [t / BLOCK - 0.5 for t in (0, 8, 23, 38)])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["text", "f0", "f1", "f2"]
    one = panels(plot.block_map(rec, steps=0, layers=1, heads=1, scale="log"))[0]
    assert np.array_equal(heat(one).get_array(), rec.get("block", 0, 1)[COND, 1].numpy())
    assert isinstance(heat(one).norm, LogNorm)

    mask = same_frame_mask(rec.layout, rec.block_size, text=False)
    mask[0, 8] = True  # a kept cell alone
    assert 0 < mask.sum() < 81
    for kwargs in ({}, {"steps": 1, "layers": 0, "heads": 1}):
        fig = plot.block_map(rec, mask, **kwargs)
        ax = panels(fig)[0]
        (outline,) = [c for c in ax.collections if c.get_gid() == "mask-outline"]
        assert np.array_equal(_cells_inside(outline.get_segments(), 9), mask.numpy())
        shown = float(re.search(r"recall (\d\.\d{4})", fig.get_suptitle()).group(1))
        steps, layers = ([kwargs["steps"]], [kwargs["layers"]]) if kwargs else ((0, 1), (0, 1))
        rows = mask_recall(rec, mask, steps=list(steps), layers=list(layers)).query("item == @COND")
        if kwargs:
            rows = rows[rows["head"] == 1]
        assert shown == pytest.approx(rows["recall"].mean(), abs=5e-5)
        # independently, from the full maps: the mass of P on the token pairs whose blocks the mask keeps
        keep = mask.numpy()[np.arange(53)[:, None] // BLOCK, np.arange(53)[None, :] // BLOCK]
        full = ref(rec, "full", steps, layers, head=kwargs.get("heads"))
        assert shown == pytest.approx((full * keep).sum() / 53, abs=5e-5)
    with pytest.raises(ValueError, match=r"\(9, 9\) bool"):
        plot.block_map(rec, mask[:8, :8])
    with pytest.raises(ValueError, match="one head at a time"):
        plot.block_map(rec, heads="all")
    with pytest.raises(ValueError, match=r"one \(N, N\) mask; got \(2, 2, 9, 9\): choose one batch item and head"):
        plot.block_map(rec, mask.expand(2, 2, 9, 9))
    spatial = plot.block_map(rec, "spatial")  # a token pattern: its block mask, as mask_recall takes it
    (outline,) = [c for c in panels(spatial)[0].collections if c.get_gid() == "mask-outline"]
    want = patterns.parse("spatial").block_mask(rec.layout, BLOCK)
    assert np.array_equal(_cells_inside(outline.get_segments(), 9), want.numpy())


@pytest.mark.parametrize(
    "layout",
    [
        TokenLayout(text_len=8, frames=3, height=3, width=5),
        TokenLayout(text_len=7, frames=3, height=2, width=4, text_position="end"),  # HunyuanVideo
        TokenLayout(text_len=5, frames=2, height=2, width=3, history_len=9),  # FramePack's history latents
    ],
    ids=["text-first", "text-last", "history"],
)
def test_block_map_ticks_are_where_each_group_s_first_token_is(layout):
    """Each tick at the block coordinate of the first token of the text, the history and each latent frame, in the
    sequence's order, from every token's own group."""
    from cogattn.plot.stats import _group_starts

    first = {}
    for i in range(layout.seq_len):
        c = layout.coordinates(i)
        name = "text" if i in range(layout.text_start, layout.text_start + layout.text_len) else "history"
        first.setdefault(name if c is None else f"f{c[0]}", i)
    starts, labels = _group_starts(layout, BLOCK)
    assert labels == sorted(first, key=first.get) and starts == [first[n] / BLOCK - 0.5 for n in labels]


def test_mask_outline_is_the_boundary_of_the_kept_cells():
    kept = np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=bool)
    segments = {tuple(map(tuple, s)) for s in plot.mask_outline(kept).tolist()}
    expected = {  # drawn by hand: a staircase of three cells, and one cell alone
        ((-0.5, -0.5), (-0.5, 0.5)),
        ((1.5, -0.5), (1.5, 0.5)),
        ((0.5, 0.5), (0.5, 1.5)),
        ((1.5, 0.5), (1.5, 1.5)),
        ((1.5, 1.5), (1.5, 2.5)),
        ((2.5, 1.5), (2.5, 2.5)),
        ((-0.5, -0.5), (0.5, -0.5)),
        ((0.5, -0.5), (1.5, -0.5)),
        ((-0.5, 0.5), (0.5, 0.5)),
        ((0.5, 1.5), (1.5, 1.5)),
        ((1.5, 1.5), (2.5, 1.5)),
        ((1.5, 2.5), (2.5, 2.5)),
    }
    assert segments == expected
    assert np.array_equal(_cells_inside(plot.mask_outline(kept), 3), kept)


def test_animate_block_map_and_token_stat(tiny, tmp_path):
    _, rec, video = tiny
    assert Image.open(plot.animate(plot.block_map, rec, tmp_path / "b.gif", dpi=30)).n_frames == 2
    path = plot.animate(plot.token_stat, rec, tmp_path / "r.gif", over="layer", dpi=30, kind="received", video=video)
    assert Image.open(path).n_frames == 2


def test_heads_recorded_as_their_mean_and_kinds_not_recorded(tiny):
    from cogattn.analysis.head_stats import head_table
    from cogattn.analysis.masks import mask_recall, temporal_window_mask

    pipe = tiny[0]
    with cogattn.record(pipe, kinds=("frame", "block"), steps=[0], block_size=BLOCK) as rec:
        generate(pipe, steps=2, output_type="latent")
    full = head_table(rec)
    assert list(full["head"].unique()) == ["mean"]
    (ax,) = panels(plot.head_atlas(rec, color="same_frame_mass"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["mean"]
    assert np.array_equal(heat(ax).get_array()[:, 0], full.query("item == 0")["same_frame_mass"].to_numpy())
    (ax,) = panels(plot.head_atlas(full))  # a table, its last step
    assert [list(plot.LABEL_COLORS)[int(c)] for c in heat(ax).get_array()[:, 0]] == list(
        full.query("item == 0")["label"]
    )
    curves = [ln for ln in panels(plot.decay_curves(rec))[0].lines if ln.get_gid() == "decay-curve"]
    assert [ln.get_label() for ln in curves] == ["mean over heads"]
    mask = temporal_window_mask(rec.layout, rec.block_size, 1)
    fig = plot.block_map(rec, mask, layers=1)
    recall = mask_recall(rec, mask, layers=1).query("item == 0")["recall"].item()
    assert float(re.search(r"recall (\d\.\d{4})", fig.get_suptitle()).group(1)) == pytest.approx(recall, abs=5e-5)
    with pytest.raises(ValueError, match="entropy_\\* needs 'entropy'"):
        plot.head_atlas(rec, color="entropy_mean")
    with pytest.raises(cogattn.NotRecordedError, match="kind 'received' was not recorded"):
        plot.token_stat(rec, "received")
    with pytest.raises(cogattn.NotRecordedError, match="heads='mean'"):
        plot.block_map(rec, heads=0)


# -- a loaded run ----------------------------------------------------------------------------------
def test_query_map_of_a_run_reads_the_query_s_row_alone(tiny, run, monkeypatch):
    """A video point's map from ``full`` on disk: each record's row of that query is read, never the (S, S) map."""
    reads = []
    real = type(run).get

    def spy(self, kind, step, layer, index=None):
        reads.append((kind, index))
        return real(self, kind, step, layer, index)

    monkeypatch.setattr(type(run), "get", spy)
    plot.query_map(run, (1, 1, 2), steps=0, layers=1)
    token = run.layout.token_index(1, 1, 2)
    assert reads and all(kind == "full" and index is not None and token in index for kind, index in reads), reads


def test_a_loaded_run_plots_the_same(tiny, run):
    from cogattn.analysis.masks import same_frame_mask

    _, rec, video = tiny
    assert run.block_size == BLOCK
    mask = same_frame_mask(run.layout, run.block_size)
    for make in (
        lambda s: plot.head_atlas(s, color="text_mass", steps="mean"),
        lambda s: plot.head_atlas(s),
        lambda s: plot.decay_curves(s, by="layer"),
        lambda s: plot.token_stat(s, "received", video),
        lambda s: plot.token_stat(s, "entropy", heads=0),
        lambda s: plot.block_map(s, mask),
    ):
        a, b = make(rec), make(run)
        assert a.get_suptitle() == b.get_suptitle()
        for x, y in zip(panels(a), panels(b)):
            assert [im.get_gid() for im in x.images] == [im.get_gid() for im in y.images]
            for u, v in zip(x.images, y.images):
                assert np.array_equal(u.get_array(), v.get_array())
            for u, v in zip(x.lines, y.lines):
                assert np.array_equal(u.get_xydata(), v.get_xydata())


# -- damaged runs and uneven keys ------------------------------------------------------------------
def test_sinks_leave_out_non_finite_tokens_and_the_figure_warns():
    """A damaged run's NaN and inf ranked first: the title read "#1 text 1: nan" and the marks were on them."""
    lay = TokenLayout(text_len=2, frames=2, height=2, width=2)  # S = 10
    received = torch.tensor([math.nan, 1.5, 0.2, math.inf, 0.9, 2.5, 0.1, 0.3, 1.2, 0.4])
    src = _Maps(lay, {("received", 0, 0): received[None, None]})
    with pytest.warns(RuntimeWarning, match="non-finite values") as caught:
        fig = plot.token_stat(src, "received", sinks=3)
    assert sum("non-finite" in str(w.message) for w in caught) == 1
    finite = [t for t in range(10) if math.isfinite(received[t])]
    top = sorted(finite, key=lambda t: -received[t])[:3]  # 5, 1, 8
    title = fig.get_suptitle()
    assert "top sinks (marked): #1 f0 (1, 1): 2.5, #2 text 1: 1.5, #3 f1 (1, 0): 1.2" in title
    assert top == [5, 1, 8]
    marks = [ln for ax in panels(fig) for ln in ax.lines if ln.get_gid() == "sink-token"]
    assert len(marks) == 3
    for im in [heat(ax) for ax in panels(fig)]:
        assert im.get_clim() == pytest.approx((0.1, 2.5))  # the finite values' range
    with pytest.warns(RuntimeWarning, match="non-finite values"):  # more sinks than finite tokens: those alone
        many = plot.token_stat(src, "received", sinks=10)
    assert len([ln for ax in panels(many) for ln in ax.lines if ln.get_gid() == "sink-token"]) == 8
    (line,) = [t for t in many.get_suptitle().splitlines() if t.startswith("top sinks")]
    assert [float(item.rsplit(": ", 1)[1]) for item in line.split(", #")] == [2.5, 1.5, 1.2, 0.9, 0.4, 0.3, 0.2, 0.1]


def test_block_map_of_nan_alone_warns_that_the_run_is_damaged():
    """color_norms takes a map of NaN alone for a skipped one; a block map is never one, so it says so."""
    lay = TokenLayout(text_len=2, frames=2, height=2, width=2)  # S = 10: two blocks of 8
    src = _Maps(lay, {("block", 0, 0): torch.full((1, 1, 2, 2), math.nan)})
    with pytest.warns(RuntimeWarning, match="non-finite values"):
        fig = plot.block_map(src)
    assert np.isfinite(heat(panels(fig)[0]).get_clim()).all()


def test_curves_under_a_colour_bar_take_its_colour_at_their_key():
    """With more than 12 curves, curve k took the k-th of N evenly spaced colours, which the colour bar over uneven
    keys (layers 0..12 and 41) gave to other layers."""
    from matplotlib.figure import Figure

    from cogattn.plot.heads import draw_curves

    keys = [*range(13), 41]
    ax = Figure().subplots()
    draw_curves(ax, np.arange(3), keys, np.random.default_rng(0).random((len(keys), 3)), "layer", {}, "decay-curve")
    (bar,) = [a for a in ax.figure.axes if a is not ax]
    mappable = bar._colorbar.mappable
    assert (mappable.norm.vmin, mappable.norm.vmax) == (0, 41)
    lines = [ln for ln in ax.lines if ln.get_gid() == "decay-curve"]
    assert [ln.get_label() for ln in lines] == [f"layer {k}" for k in keys]
    for key, ln in zip(keys, lines):
        assert to_rgba(ln.get_color()) == pytest.approx(mappable.cmap(mappable.norm(key)))
    assert to_rgba(lines[-1].get_color()) == pytest.approx(mappable.cmap(1.0))  # layer 41: the bar's top
    assert to_rgba(lines[12].get_color()) == pytest.approx(mappable.cmap(12 / 41))
