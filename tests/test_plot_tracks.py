"""plot.track_figure and plot.motion_figure draw what cogattn.analysis.tracks computes, at the patch centres of the grid or
the video, patches without a match crossed out; the wheel's colours encode direction; layers over two copies of the
grid (Motif-Video's decoder) drawn over the video once per copy; the batch tool's previews of a frame_max run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.colors import rgb_to_hsv
from PIL import Image
from tiny_calls import generate

import cogattn
from cogattn import plot
from cogattn.analysis.tracks import motion_field, track
from cogattn.dump.previews import write_previews
from cogattn.exact.reducers.ranked import FrameMax
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.plot.tracks import ARROW_GID, MATCH_GID, NO_MATCH_GID, STILL_GID, WHEEL_GID, WHEEL_LEGEND_GID, flow_colors
from cogattn.plot.video import video_array

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
PIXELS_PER_PATCH = 16  # CogVideoX: 8 pixels a latent pixel, 2 latent pixels a patch
OWNER_OF_9 = [0, 1, 1, 1, 1, 2, 2, 2, 2]  # CogVideoX: latent frame 0 is pixel frame 0, then 4 each


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pipe = tiny_pipeline()
    out = {}
    for heads in ("all", "mean"):
        folder = tmp_path_factory.mktemp(heads)
        with cogattn.record(pipe, kinds=("frame_max",), heads=heads, steps=[1], layers=[1], save_dir=folder):
            frames = generate(pipe, steps=2)
        out[heads] = cogattn.load(folder)
    out["video"] = frames[0]  # (9, 3, 48, 80)
    out["folder"] = folder
    return out


def _one(ax, gid, where="collections"):
    found = [a for a in getattr(ax, where) if a.get_gid() == gid]
    assert len(found) == 1, (gid, len(found))
    return found[0]


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


@pytest.mark.parametrize("heads, head", [("all", 1), ("mean", "mean")])
@pytest.mark.parametrize("with_video", [False, True])
def test_track_markers_are_the_track_at_patch_centres(runs, heads, head, with_video):
    run, point = runs[heads], (1, 1, 3)
    t = track(run, point, 1, 1, head)
    fig = plot.track_figure(run, point, runs["video"] if with_video else None, step=1, layer=1, head=head)
    panels = _panels(fig)
    assert len(panels) == run.layout.frames == 3
    scale, off = (PIXELS_PER_PATCH, 0.5) if with_video else (1, 0.0)
    conf = t.confidence.numpy()
    for f, ax in enumerate(panels):
        match = _one(ax, MATCH_GID)
        row, col = t.positions[f].tolist()
        assert np.allclose(match.get_offsets(), [[(col + off) * scale, (row + off) * scale]])
        assert np.isclose(match.get_alpha(), 0.3 + 0.7 * conf[f] / conf.max())
        assert f"{conf[f]:.2g}" in [tx.get_text() for tx in ax.texts]
        crosses = [ln for ln in ax.lines if ln.get_gid() == "query-point"]
        if f == point[0]:
            (cross,) = crosses
            assert np.allclose(cross.get_xydata(), [[(3 + off) * scale, (1 + off) * scale]])
        else:
            assert not crosses
    title = fig.get_suptitle()
    assert "step 1" in title and "layer 1" in title and ("head 1" if head == 1 else "mean over heads") in title
    assert "batch item 1, conditional" in title  # slot 0 of batch "cond": the transformer batch's item 1


def test_every_pixel_frame_shows_the_match_of_the_latent_frame_covering_it(runs):
    run, point = runs["all"], (2, 0, 4)
    t = track(run, point, 1, 1, 0)
    fig = plot.track_figure(run, point, runs["video"], step=1, layer=1, head=0, frames="all")
    panels = _panels(fig)
    assert len(panels) == 9
    for n, ax in enumerate(panels):
        row, col = t.positions[OWNER_OF_9[n]].tolist()
        assert np.allclose(_one(ax, MATCH_GID).get_offsets(), [[(col + 0.5) * 16, (row + 0.5) * 16]])
        assert ax.get_title().startswith(f"f{OWNER_OF_9[n]}") and f"px {n})" in ax.get_title()
        assert len([ln for ln in ax.lines if ln.get_gid() == "query-point"]) == (OWNER_OF_9[n] == 2)


@pytest.mark.parametrize("with_video", [False, True])
@pytest.mark.parametrize("frames", [(0, 1), (2, 0)])
def test_the_quiver_is_the_motion_field(runs, with_video, frames):
    run, (a, b) = runs["all"], frames
    flow = motion_field(run, a, b, 1, 1, head=1).numpy()
    fig = plot.motion_figure(run, a, b, runs["video"] if with_video else None, step=1, layer=1, head=1)
    q = _one(fig.axes[0], ARROW_GID)
    scale, off = (PIXELS_PER_PATCH, 0.5) if with_video else (1, 0.0)
    Hp, Wp = run.layout.height, run.layout.width
    yy, xx = np.mgrid[:Hp, :Wp]
    assert np.array_equal(np.asarray(q.U), flow[..., 1].ravel() * scale)
    assert np.array_equal(np.asarray(q.V), flow[..., 0].ravel() * scale)
    assert np.allclose(q.XY, np.stack([(xx.ravel() + off) * scale, (yy.ravel() + off) * scale], -1))
    still = _one(fig.axes[0], STILL_GID, "lines")
    at_rest = (flow == 0).all(-1)
    assert np.allclose(still.get_xydata(), np.stack([(xx[at_rest] + off) * scale, (yy[at_rest] + off) * scale], -1))
    assert f"f{a}" in fig.axes[0].get_title() and f"→ f{b}" in fig.axes[0].get_title()


def test_the_wheel_encodes_direction_as_hue_and_length_as_value():
    # right, up (rows grow downwards), left, down, half as long to the right, no motion
    field = np.array([[[0, 2], [-2, 0], [0, -2], [2, 0], [0, 1], [0, 0]]], dtype=float)
    rgb = flow_colors(field)
    assert np.allclose(rgb[0, 0], [1, 0, 0])  # right: red
    assert np.allclose(rgb[0, 2], [0, 1, 1])  # left: cyan
    hsv = rgb_to_hsv(rgb)[0]
    assert np.allclose(hsv[:4, 0], [0, 0.25, 0.5, 0.75])
    assert np.allclose(hsv[:5, 2], [1, 1, 1, 1, 0.5])
    assert np.allclose(rgb[0, 5], 0)  # no motion: black
    assert np.allclose(flow_colors(field, max_magnitude=4)[0, 0], [0.5, 0, 0])
    with pytest.raises(ValueError, match="max_magnitude=0"):
        flow_colors(field, max_magnitude=0)
    with pytest.raises(ValueError, match=r"flow of shape \(3,\)"):
        flow_colors(np.zeros(3))


@pytest.mark.parametrize("with_video", [False, True])
def test_the_wheel_figure_shows_the_field_s_colours_and_its_legend(runs, with_video):
    run = runs["mean"]
    flow = motion_field(run, 0, 2, 1, 1).numpy()
    fig = plot.motion_figure(run, 0, 2, runs["video"] if with_video else None, step=1, layer=1, style="wheel")
    image = _one(fig.axes[0], WHEEL_GID, "images")
    assert np.allclose(image.get_array(), flow_colors(flow))
    Hp, Wp = run.layout.height, run.layout.width
    assert tuple(image.get_extent()) == ((0, 80, 48, 0) if with_video else (-0.5, Wp - 0.5, Hp - 0.5, -0.5))
    legend = _one(fig.axes[1], WHEEL_LEGEND_GID, "images").get_array()
    middle = legend.shape[0] // 2
    assert np.allclose(legend[middle, -1], [1, 0, 0, 1]) and np.allclose(legend[middle, 0], [0, 1, 1, 1])
    assert legend[0, 0, 3] == 0  # outside the disc: transparent
    with pytest.raises(ValueError, match="style='flow'"):
        plot.motion_figure(run, 0, 2, step=1, layer=1, style="flow")


class _Hidden:
    """``run`` as if a mask hid latent frame ``frame`` from the query tokens ``hidden``: their ``frame_max`` holds no
    key of it (probability 0, token −1), as SkyReels-V2's block-causal mask leaves a later frame."""

    def __init__(self, run, frame, hidden):
        self._run, self._frame, self._hidden = run, frame, hidden

    def __getattr__(self, name):
        return getattr(self._run, name)

    def get(self, kind, step, layer):
        got = self._run.get(kind, step, layer)
        if kind != "frame_max":
            return got
        values, indices = got.values.clone(), got.indices.clone()
        group = self._run.layout.text_groups + self._frame
        values[:, :, self._hidden, group], indices[:, :, self._hidden, group] = 0, -1
        return FrameMax(values, indices)


@pytest.mark.parametrize("style", ["arrows", "wheel"])
@pytest.mark.parametrize("lost_rows", [[0], [0, 1, 2]])
def test_patches_without_a_match_are_crossed_out_not_drawn_as_still(runs, style, lost_rows):
    """No key of frame 1 has attention for the patches of ``lost_rows`` of frame 0: the field is NaN there (not 0, a
    match that did not move), the figure draws no arrow or still dot there but a cross, and says "no match" where
    no patch has one."""
    run = runs["all"]
    lay = run.layout
    hidden = [lay.token_index(0, y, x) for y in lost_rows for x in range(lay.width)]
    source = _Hidden(run, 1, hidden)
    whole = motion_field(run, 0, 1, 1, 1, head=1).numpy()
    flow = motion_field(source, 0, 1, 1, 1, head=1).numpy()
    lost = np.zeros((lay.height, lay.width), dtype=bool)
    lost[lost_rows] = True
    assert np.isnan(flow[lost]).all() and np.array_equal(flow[~lost], whole[~lost])
    fig = plot.motion_figure(source, 0, 1, step=1, layer=1, head=1, style=style)
    ax = fig.axes[0]
    yy, xx = np.mgrid[: lay.height, : lay.width]
    assert np.array_equal(_one(ax, NO_MATCH_GID, "lines").get_xydata(), np.stack([xx[lost], yy[lost]], -1))
    assert ("no match" in [t.get_text() for t in ax.texts]) == lost.all()
    if style == "arrows":
        q = _one(ax, ARROW_GID)
        assert np.array_equal(q.XY, np.stack([xx[~lost], yy[~lost]], -1))
        assert np.array_equal(np.asarray(q.U), whole[~lost][:, 1]) and np.array_equal(
            np.asarray(q.V), whole[~lost][:, 0]
        )
        at_rest = (whole == 0).all(-1) & ~lost
        assert np.array_equal(_one(ax, STILL_GID, "lines").get_xydata(), np.stack([xx[at_rest], yy[at_rest]], -1))
    else:
        colours = _one(ax, WHEEL_GID, "images").get_array()
        assert np.allclose(colours[lost], 0.5)  # grey: neither black (no motion) nor a direction
        top = np.hypot(*whole[~lost].T).max(initial=0.0)
        if top > 0:
            assert np.allclose(colours[~lost], flow_colors(whole[~lost], top))


# -- layers over two copies of the grid ------------------------------------------------------------
DECODER = "single_transformer_blocks.1.attn"  # the tiny Motif-Video transformer's decoder block: layer 2


@pytest.fixture(scope="module")
def decoder():
    """A tiny Motif-Video generation: ``full`` and ``frame_max`` of its decoder layer, over two copies of the grid
    (6 latent frames of a 9-frame video), and the video ``(9, 3, 32, 48)``: 16 pixels a patch."""
    motif = pytest.importorskip("cogattn.models.motif_video", reason="this diffusers lacks Motif-Video (0.42 has it)")
    pipe = motif.tiny_pipeline("text-to-video")
    call = motif.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    with cogattn.record(pipe, kinds=("full", "frame_max"), layers=[DECODER], heads="all") as rec:
        video = pipe(**call, num_inference_steps=1, output_type="pt", generator=torch.Generator().manual_seed(1))
    assert rec.layout_of(2).grids == 2 and rec.layout_of(2).frames == 6
    return rec, video.frames[0]


MIDDLE_OF = [0, 3, 7]  # the middle pixel frame of each latent frame of one copy (9 frames: 1, 4, 4)


def _decoder_rows(rec, token):
    """The ``full`` head-mean row of decoder ``token`` over each latent frame: ``(6, 2, 3)``."""
    lay = rec.layout_of(2)
    row = rec.get("full", 0, 2)[0].mean(0)[token]
    return row[lay.grid_tokens].view(lay.grid).numpy()


def test_a_query_map_of_the_decoder_shows_each_copy_s_frames_over_the_video(decoder):
    rec, video = decoder
    point = (4, 1, 2)  # copy 2's latent frame 1: refused before as outside the generation's 3 frames
    maps = _decoder_rows(rec, rec.layout_of(2).token_index(*point))
    axes = [ax for ax in plot.query_map(rec, point, video, layers=2).axes if ax.get_label() != "<colorbar>"]
    assert len(axes) == 6  # no text in the decoder's sequence
    for f, ax in enumerate(axes):
        assert ax.get_title() == f"px {MIDDLE_OF[f % 3]} · f{f}"
        (im,) = [im for im in ax.images if im.get_gid() == "attention"]
        assert np.allclose(im.get_array(), np.kron(maps[f], np.ones((16, 16))), atol=1e-6)
        assert np.array_equal(ax.images[0].get_array(), video_array(video)[MIDDLE_OF[f % 3]])
        crosses = [ln for ln in ax.lines if ln.get_gid() == "query-point"]
        assert len(crosses) == (f == 4)


def test_a_track_on_the_decoder_is_drawn_in_both_copies_over_the_video(decoder):
    rec, video = decoder
    point = (4, 1, 2)
    t = track(rec, point, 0, 2, head=1)
    fig = plot.track_figure(rec, point, video, step=0, layer=2, head=1)
    axes = _panels(fig)
    assert len(axes) == 6
    for f, ax in enumerate(axes):
        assert ax.get_title() == f"f{f} · px {[0, 1, 5][f % 3]}{['', '–4', '–8'][f % 3]} (shows px {MIDDLE_OF[f % 3]})"
        row, col = t.positions[f].tolist()
        assert np.allclose(_one(ax, MATCH_GID).get_offsets(), [[(col + 0.5) * 16, (row + 0.5) * 16]])
        assert len([ln for ln in ax.lines if ln.get_gid() == "query-point"]) == (f == 4)
    frames = rec.get("full", 0, 2)[0, 1, rec.layout_of(2).token_index(*point), rec.layout_of(2).grid_tokens]
    best = frames.view(6, 6).argmax(-1)  # each latent frame's argmax, from the full row of head 1
    assert t.positions.tolist() == [[int(b) // 3, int(b) % 3] for b in best]


def test_the_decoder_s_motion_field_from_the_second_copy_is_drawn_over_its_frame(decoder):
    rec, video = decoder
    flow = motion_field(rec, 4, 1, 0, 2, head=1).numpy()
    fig = plot.motion_figure(rec, 4, 1, video, step=0, layer=2, head=1)  # a StopIteration before
    ax = fig.axes[0]
    assert ax.get_title() == "f4 · px 1–4 (shows px 3) → f1"
    assert np.array_equal(ax.images[0].get_array(), video_array(video)[3])
    q = _one(ax, ARROW_GID)
    assert np.array_equal(np.asarray(q.U), flow[..., 1].ravel() * 16)
    assert np.array_equal(np.asarray(q.V), flow[..., 0].ravel() * 16)


def test_previews_of_a_frame_max_run_pick_one_map(runs, tmp_path, monkeypatch):
    drawn = []

    def spy(name):
        real = getattr(plot, name)

        def draw(source, *args, **options):
            drawn.append((name, args[:-1] if name == "motion_figure" else args[0], options))
            return real(source, *args, **options)

        return draw

    for name in ("track_figure", "motion_figure"):
        monkeypatch.setattr(plot, name, spy(name))
    paths = write_previews(runs["folder"], tmp_path / "previews", runs["video"], dpi=40)
    assert sorted(p.name for p in paths) == ["motion.png", "track.png"]
    one = dict(step=1, layer=1, head="mean")  # the last step, the middle layer, the head mean: one map each
    assert drawn == [("track_figure", (0, 1, 2), one), ("motion_figure", (0, 1), one)]  # centre of frame 0; 0 → 1
    for p in paths:
        with Image.open(p) as im:
            im.verify()


def test_the_batch_tool_writes_track_and_motion_previews(tmp_path, dump):
    out = tmp_path / "runs"
    (tmp_path / "p.txt").write_text("a red fox running in the snow\n")
    sets = [f"prompts={tmp_path / 'p.txt'}", "capture.kinds=[frame_max]", "capture.heads=all", "num_inference_steps=2",
            f"save_dir={out}"]  # fmt: skip
    dump(ROOT / "configs" / "tiny.yaml", *(a for s in sets for a in ("--set", s)), check=0)
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    meta = json.loads((folder / "prompt.json").read_text())
    assert sorted(meta["previews"]) == ["motion.png", "track.png"]
    for name in meta["previews"]:
        with Image.open(folder / "previews" / name) as png:
            png.load()
            assert png.size[0] > 100 and png.size[1] > 100
