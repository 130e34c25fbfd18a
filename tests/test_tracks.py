"""``cogattn.analysis.tracks`` against the argmax of each frame of the ``full`` map of the same tiny generation, and
where a block-causal mask leaves a frame no key with attention (SkyReels-V2), no match."""

import numpy as np
import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn.analysis.tracks import frame_matches, motion_field, track
from cogattn.models.cogvideox import tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pipe = tiny_pipeline()
    out = {}
    for heads in ("all", "mean"):
        folder = tmp_path_factory.mktemp(heads)
        with cogattn.record(pipe, kinds=("full", "frame_max"), heads=heads, steps=[1], layers=[1], save_dir=folder):
            generate(pipe, steps=2, output_type="latent")
        out[heads] = cogattn.load(folder)
    return out


def _frame_rows(run, head, query):
    """The query's ``full`` row over each latent frame, ``(F, Hp·Wp)`` (head ``None``: the head-mean row)."""
    P = run.get("full", 1, 1)[0]
    row = (P.mean(0) if head is None else P[head])[query]
    lay = run.layout
    return row[lay.grid_tokens].view(lay.frames, lay.frame_tokens)


@pytest.mark.parametrize("heads, head", [("all", 0), ("all", 1), ("mean", "mean")])
def test_track_is_the_argmax_of_each_frame_of_the_full_row(runs, heads, head):
    run = runs[heads]
    lay = run.layout
    for point in [(0, 0, 0), (1, 2, 3), (lay.frames - 1, lay.height - 1, lay.width - 1)]:
        t = track(run, point, step=1, layer=1, head=head)
        rows = _frame_rows(run, None if head == "mean" else head, lay.token_index(*point))
        best = rows.max(-1).values
        assert t.positions.shape == (lay.frames, 2) and t.confidence.shape == (lay.frames,)
        at = rows.gather(1, (t.positions[:, 0] * lay.width + t.positions[:, 1])[:, None])[:, 0]
        assert torch.equal(at, best)  # the matched key holds the frame's largest probability (either of a tie)
        assert torch.allclose(t.confidence, best, rtol=1e-6, atol=1e-7)
    if head != "mean":  # a NumPy integer is the same head (it was refused as neither an index nor 'mean')
        assert torch.equal(track(run, point, step=1, layer=1, head=np.int64(head)).positions, t.positions)
    numpy_point = tuple(np.int64(x) for x in point)  # a point and frames of NumPy integers too (from an argmax)
    assert torch.equal(track(run, numpy_point, step=1, layer=1, head=head).positions, t.positions)
    flow = motion_field(run, np.int64(0), np.int64(1), step=1, layer=1, head=head)
    assert torch.allclose(flow, motion_field(run, 0, 1, step=1, layer=1, head=head), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("frames", [(0, 1), (2, 0), (1, 1)])
def test_motion_field_is_each_patch_s_argmax_in_the_other_frame(runs, frames):
    run = runs["all"]
    lay = run.layout
    a, b = frames
    flow = motion_field(run, a, b, step=1, layer=1, head=1)
    assert flow.shape == (lay.height, lay.width, 2) and flow.dtype == torch.float32
    for y in range(lay.height):
        for x in range(lay.width):
            row = _frame_rows(run, 1, lay.token_index(a, y, x))[b]
            dy, dx = map(int, flow[y, x].tolist())
            assert dy == flow[y, x, 0] and dx == flow[y, x, 1]  # whole patches
            assert row[(y + dy) * lay.width + (x + dx)] == row.max()


def test_matches_of_one_map_and_what_is_refused(runs):
    lay = runs["all"].layout
    m = frame_matches(runs["all"], 1, 1, head=1)
    assert m.values.shape == m.indices.shape == (lay.seq_len, lay.num_groups)
    with pytest.raises(ValueError, match="recorded per head"):
        track(runs["all"], (0, 0, 0), 1, 1)  # the head mean's argmax is not made of the heads'
    with pytest.raises(cogattn.NotRecordedError, match="heads='mean'"):
        track(runs["mean"], (0, 0, 0), 1, 1, head=0)
    with pytest.raises(ValueError, match="outside the latent grid"):
        track(runs["mean"], (0, lay.height, 0), 1, 1)
    with pytest.raises(ValueError, match="frame_b=99"):
        motion_field(runs["mean"], 0, 99, 1, 1)
    for bad in [(0, 0.0, 0), (True, 0, 0), (0, 0), "000"]:
        with pytest.raises(ValueError, match="pass a video point"):
            track(runs["mean"], bad, 1, 1)
    with pytest.raises(ValueError, match="frame_a=1.0"):
        motion_field(runs["mean"], 1.0, 0, 1, 1)


def test_motion_field_is_nan_where_a_block_causal_mask_leaves_no_key_with_attention():
    """SkyReels-V2 diffusion forcing, 4 latent frames in causal blocks of 2: frames 0 and 1 never see frames 2 and 3.
    Where a patch's ``full`` row over frame b is all 0 the field is NaN (no match), never 0 (a match that did not
    move); elsewhere it is the argmax."""
    skyreels = pytest.importorskip("cogattn.models.skyreels_v2")
    if "skyreels_v2" not in {spec.family for spec in cogattn.models.FAMILIES}:
        pytest.skip("this diffusers lacks SkyReels-V2")
    pipe = skyreels.tiny_diffusion_forcing_pipeline()
    emb = torch.randn(1, 512, 16, generator=torch.Generator().manual_seed(0))
    call = dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=-emb, height=32, width=48, ar_step=0)
    call.update(num_frames=13, base_num_frames=13, causal_block_size=2, num_inference_steps=1, output_type="latent")
    with cogattn.record(pipe, kinds=("full", "frame_max"), layers=[0], heads="all", batch="cond") as rec:
        pipe(**call, generator=torch.Generator().manual_seed(1))
    lay = rec.layout
    assert lay.grid == (4, 2, 3)
    P = rec.get("full", 0, 0)[0, 1]
    for a, b in [(0, 2), (1, 3), (2, 0), (3, 2)]:
        flow = motion_field(rec, a, b, step=0, layer=0, head=1)
        for y in range(lay.height):
            for x in range(lay.width):
                row = P[lay.token_index(a, y, x), lay.grid_tokens].view(lay.frames, lay.frame_tokens)[b]
                if row.max() == 0:  # the mask hides frame b from this query
                    assert flow[y, x].isnan().all(), (a, b, y, x)
                else:
                    dy, dx = map(int, flow[y, x].tolist())
                    assert row[(y + dy) * lay.width + (x + dx)] == row.max()
        assert flow.isnan().all() == (b // 2 > a // 2)  # a later causal block: no key of it has attention
