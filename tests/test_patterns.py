"""Token patterns and the kinds that measure them: masks against plain definitions over positions, and
``pattern_recall`` and ``pattern_error`` against the naive float64 reference (P from q and k, O and O_pattern
from P and v)."""

import itertools
import json

import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn.analysis.masks import mask_recall
from cogattn.exact import patterns
from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models import FAMILIES
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.reference import naive_kind, naive_pattern, naive_probs

LAYOUTS = [
    TokenLayout(text_len=5, frames=5, height=3, width=4),  # text first; 5 frames: radial's bands 0..2
    TokenLayout(text_len=0, frames=3, height=2, width=3),  # video alone (Wan)
    TokenLayout(text_len=4, frames=2, height=3, width=3, text_position="end"),  # text last (HunyuanVideo)
]
TILE = (2, 2, 3)  # tiles that divide no grid: edge tiles smaller
NAMES = ("spatial", "temporal", "window:1", "sta:1,3,1", "sta:3,1,3", "radial")


def after_frame(qf, qy, qx, kf, ky, kx):
    """A user's pattern: keys in the query's frame or later."""
    return kf >= qf


def _token_mask(layout, spec):
    """``(S, S)`` from the reference's per-pair definition, text rows and columns kept."""
    keep = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
    video = layout.video_tokens
    keep[video, video] = naive_pattern(spec, layout.grid, TILE)
    return keep


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"T{lay.text_len}-{lay.text_position}")
@pytest.mark.parametrize("spec", [*NAMES, after_frame], ids=lambda spec: getattr(spec, "__name__", spec))
def test_row_masks_equal_the_definition_over_positions(layout, spec):
    pattern, want = patterns.parse(spec, TILE), _token_mask(layout, spec)
    S = layout.seq_len
    for r0 in range(0, S, 7):  # row tiles that cut frames and the text
        rows = slice(r0, min(S, r0 + 7))
        assert torch.equal(pattern.row_mask(layout, rows), want[rows]), (spec, r0)
    picked = torch.tensor([S - 1, 0, layout.video_start + 2])
    assert torch.equal(pattern.row_mask(layout, picked), want[picked])


def test_sta_and_radial_keep_what_their_definitions_say_on_hand_examples():
    # STA along one axis of 7 tiles of 1, window 3: the window moves inside the grid at the edges.
    line = TokenLayout(text_len=0, frames=1, height=1, width=7)
    keep = patterns.sta((1, 1, 3), (1, 1, 1)).row_mask(line, slice(0, 7))
    kept = {i: keep[i].nonzero().flatten().tolist() for i in (0, 3, 6)}
    assert kept == {0: [0, 1, 2], 3: [2, 3, 4], 6: [4, 5, 6]}
    # Radial with s = 4 tokens per frame: d ≤ 1 every pair; d = 2, 3: |k − l| ≤ 1; d = 4..7: k = l; d = 8: k = l
    # (every 2nd frame of that band: 8 % 2 = 0); d = 9: nothing.
    frames = TokenLayout(text_len=0, frames=10, height=2, width=2)
    keep = patterns.radial().row_mask(frames, slice(0, 4))  # the queries of frame 0
    per_frame = keep.view(4, 10, 4)  # (query position k, key frame, key position j)
    k, j = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    assert per_frame[:, 1].all() and per_frame[:, 0].all()
    assert torch.equal(per_frame[:, 2], (k - j).abs() <= 1) and torch.equal(per_frame[:, 3], (k - j).abs() <= 1)
    for d in (4, 7, 8):
        assert torch.equal(per_frame[:, d], k == j), d
    assert not per_frame[:, 9].any()


@pytest.mark.parametrize(
    "spec", ["spatial", "sta:1,3,1", "radial", after_frame], ids=lambda spec: getattr(spec, "__name__", spec)
)
def test_block_and_tile_masks_keep_a_group_pair_where_any_token_pair_is_kept(spec):
    layout, pattern = LAYOUTS[0], patterns.parse(spec, TILE)
    tokens = _token_mask(layout, spec)
    S = layout.seq_len
    for groups, mask in (
        (torch.arange(S) // 8, pattern.block_mask(layout, 8)),
        (layout.tile_of_token(TILE), pattern.tile_mask(layout, TILE)),
    ):
        N = int(groups.max()) + 1
        want = torch.zeros(N, N, dtype=torch.bool)
        for i, j in itertools.product(range(S), range(S)):
            want[groups[i], groups[j]] |= bool(tokens[i, j])
        assert torch.equal(mask, want)


def _capture(q, k, v, layout, kinds, mean, budget, pats, heads=None):
    H, S, D = q.shape
    n = H if heads is None else len(heads)
    sizes = dict(tile_shape=TILE, patterns=pats)
    reducers = [REDUCERS[kd](layout, n, mean, None, **sizes) for kd in kinds]
    plan = plan_tiles(reducers, S, n, D, budget, "rows", q.device)
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan, heads=heads, value=v)
    return outs, plan


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"T{lay.text_len}-{lay.text_position}")
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("budget", [30_000, 2**30])
def test_recall_and_error_equal_the_naive_reference(layout, mean, budget):
    torch.manual_seed(0)
    H, S, D = 3, layout.seq_len, 16
    q, k, v = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2, torch.randn(H, S, D)
    pats = (*NAMES, after_frame)
    heads = torch.tensor([2, 0])  # a head selection in another order
    outs, plan = _capture(q, k, v, layout, ("pattern_recall", "pattern_error"), mean, budget, pats, heads)
    if budget < 2**20 and S > 60:
        assert plan.row_rows < S  # several row tiles, which cut frames
    P = naive_probs(q[None], k[None])[:, heads]
    text_at_end = layout.text_position == "end"
    for kind, got in zip(("pattern_recall", "pattern_error"), outs):
        ref = naive_kind(
            P,
            kind,
            layout.text_len,
            layout.grid,
            text_at_end=text_at_end,
            tile_shape=TILE,
            patterns=pats,
            v=v[None, heads],
        )[0]
        ref = ref.mean(0, keepdim=True) if mean else ref
        assert got.shape == ref.shape == (1 if mean else 2, len(pats))
        assert (got.double() - ref).abs().max() <= 1e-5, kind
        assert (ref - float(kind == "pattern_recall")).abs().max() > 1e-2  # the patterns drop real mass: a real check


@pytest.mark.parametrize("mean", [False, True])
def test_error_of_a_row_whose_kept_probabilities_all_underflow_is_the_softmax_over_its_kept_keys(mean):
    """A video query whose every kept key lies > 104 logits below one outside its pattern: its float32 P·mask is
    all 0 (0 / 0 renormalised); O_pattern comes from its exact scores, as the float64 reference forms it, for
    patterns without a mask (whole frames, one patch a frame) and with one (STA), over several row tiles."""
    layout = TokenLayout(text_len=0, frames=3, height=2, width=2)  # no text, which patterns always keep
    torch.manual_seed(0)
    H, S, D = 2, layout.seq_len, 16
    q, k, v = torch.randn(H, S, D), torch.randn(H, S, D), torch.randn(H, S, D)
    k[:, 0] = 0
    k[:, 0, 0] = 1.0  # key 0 (frame 0) ...
    q[0, 8] = 0
    q[0, 8, 0] = 440.0  # ... dominates query 8 (frame 2) of head 0 by 110 logits (scale 1 / 4)
    k[:, 8:] *= 0.01
    pats = ("spatial", "temporal", "sta:1,1,1")
    (error,), plan = _capture(q, k, v, layout, ("pattern_error",), mean, 6_000, pats)
    assert plan.row_rows < S
    P = naive_probs(q[None], k[None])
    assert P[0, 0, 8, 8:].max() < 1e-45 and torch.softmax(q[0, 8] @ k[0].T / 4, -1)[8:].max() == 0  # lost in float32
    ref = naive_kind(P, "pattern_error", 0, layout.grid, tile_shape=TILE, patterns=pats, v=v[None].double())[0]
    ref = ref.mean(0, keepdim=True) if mean else ref
    assert torch.isfinite(ref).all() and (error.double() - ref).abs().max() <= 1e-5


def test_error_of_a_row_whose_kept_mass_is_subnormal_is_the_softmax_over_its_kept_keys():
    """Kept keys 103 and 103.4 logits below one outside the pattern: their float32 probabilities are subnormal, both
    1.4e-45, so P·mask renormalised weighs them 0.5 / 0.5 where the softmax over them gives 0.599 / 0.401 (the
    error read 0.0 against 0.0195); below NEGLIGIBLE_MASS the row is taken from its exact scores."""
    layout = TokenLayout(0, 2, 1, 2)  # no text: frame 0 is tokens 0, 1; frame 1 tokens 2, 3
    S = layout.seq_len
    q = torch.ones(1, S, 1)
    k = torch.tensor([-103.0, -103.4, 0.0, -50.0]).view(1, S, 1)  # token 0's own frame far below key 2
    v = torch.tensor([1.0, -1.0, 0.0, 0.0]).view(1, S, 1)
    red = REDUCERS["pattern_error"](layout, 1, False, patterns=("spatial",))
    out = torch.zeros(red.shape(1)[1:])
    capture(q, k, [red], [out], plan_tiles([red], S, 1, 1, 2**26, "rows", "cpu"), scale=1.0, value=v)
    P = torch.softmax(q.double() @ k.double().transpose(1, 2), -1)[0]
    assert 0 < torch.softmax(q[0] @ k[0].T, -1)[0, :2].max() < 2**-126  # subnormal in float32
    frame = torch.tensor([0, 0, 1, 1])
    kept = P * (frame[:, None] == frame[None])
    ref = ((kept @ v[0].double()) / kept.sum(-1, keepdim=True) - P @ v[0].double()).pow(2).mean()
    assert ref > 0.019 and abs(out.item() - ref.item()) <= 1e-6 * ref.item()


def test_pattern_kinds_average_over_the_video_rows_the_model_forms():
    """A query limit that cuts the grid's rows: recall and error are means over the formed video queries (the mean
    was over every video query, half the recall here), as offset's."""
    layout = TokenLayout(3, 2, 2, 2)
    torch.manual_seed(0)
    H, S, D = 1, layout.seq_len, 8
    q, k, v = torch.randn(H, S, D), torch.randn(H, S, D), torch.randn(H, S, D)
    reducers = [REDUCERS[kind](layout, H, False, patterns=("spatial",)) for kind in ("pattern_recall", "pattern_error")]
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan_tiles(reducers, S, H, D, 2**26, "rows", "cpu"), queries=S - 4, value=v)
    formed = slice(layout.grid_tokens.start, S - 4)  # the first 4 of 8 video queries
    P = naive_probs(q[None], k[None])[0, 0]
    frame = torch.full((S,), -1)
    frame[layout.grid_tokens] = torch.arange(8) // 4
    keep = (frame[:, None] == frame[None]) | (frame[None] == -1)  # a query's own frame and the text
    recall = (P * keep)[formed].sum(-1).mean()
    output, kept = P @ v[0].double(), P * keep
    error = ((kept @ v[0].double()) / kept.sum(-1, keepdim=True) - output)[formed].pow(2).mean()
    assert abs(outs[0].item() - recall.item()) <= 1e-6 and abs(outs[1].item() - error.item()) <= 1e-6


@pytest.mark.parametrize("pats", [("spatial",), ("sta:1,3,3", "temporal")], ids=["runs", "masks"])
def test_rows_recomputed_where_every_kept_probability_underflows_stay_in_the_budget(pats):
    """Every query of frames 1-3 loses its own frame's mass to key 0 (110 logits above): their O_pattern comes from
    their exact scores, written into the tile's P·mask buffer the plan counts; the live bytes stay in the budget."""
    from test_engine import _live_peak

    from cogattn.exact import memory

    layout = TokenLayout(text_len=0, frames=4, height=16, width=16)
    H, S, D, budget = 4, layout.seq_len, 64, 3 * 2**20
    torch.manual_seed(0)
    q, k, v = torch.randn(H, S, D), torch.randn(H, S, D), torch.randn(H, S, D)
    k[:, 0] = 0
    k[:, 0, 0] = 1.0
    q[:, :, 0] = 880.0
    k[:, 1:] *= 0.01
    red = [REDUCERS["pattern_error"](layout, H, False, None, patterns=pats)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = plan_tiles(red, S, H, D, budget, "rows", "cpu")
        out = torch.zeros(red[0].shape(1)[1:])
        capture(q, k, red, [out.clone()], plan, value=v)
        peak = _live_peak(lambda: capture(q, k, red, [out], plan, value=v))
    finally:
        torch.set_num_threads(threads)
    assert plan.row_rows < S and torch.isfinite(out).all() and peak <= memory.usable(budget), (peak, plan)


def test_whole_frame_and_same_patch_patterns_form_no_mask_and_equal_their_rules_as_callables():
    """``spatial``, ``window:w`` and ``temporal`` sum runs of keys or gather a key per frame; the same rules given as
    callables go through masks: the numbers agree, over row tiles that cut frames (text first, last and none)."""
    rules = {
        "spatial": lambda qf, qy, qx, kf, ky, kx: qf == kf,
        "window:1": lambda qf, qy, qx, kf, ky, kx: (kf - qf).abs() <= 1,
        "temporal": lambda qf, qy, qx, kf, ky, kx: (qy == ky) & (qx == kx),
    }
    for layout in LAYOUTS:
        torch.manual_seed(2)
        q, k, v = (torch.randn(2, layout.seq_len, 8) * 2 for _ in range(3))
        pats = (*rules, *rules.values())
        reducer = REDUCERS["pattern_error"](layout, 2, False, patterns=pats, tile_shape=TILE)
        masks = reducer._row_masks(layout.grid_tokens.start, layout.grid_tokens.stop, "cpu")
        assert [m is None for m in masks] == [True] * 3 + [False] * 3
        (recall, error), plan = _capture(q, k, v, layout, ("pattern_recall", "pattern_error"), False, 30_000, pats)
        assert plan.row_rows < layout.seq_len
        assert torch.allclose(recall[:, :3], recall[:, 3:], atol=1e-6, rtol=0)
        assert torch.allclose(error[:, :3], error[:, 3:], atol=1e-7, rtol=1e-5) and error.min() > 0


def test_a_pattern_that_keeps_everything_has_recall_one_and_no_error():
    layout = LAYOUTS[0]
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, layout.seq_len, 8) for _ in range(3))
    keep_all = patterns.Pattern("all", lambda *pos: torch.tensor(True))
    (recall, error), _ = _capture(q, k, v, layout, ("pattern_recall", "pattern_error"), False, 2**30, (keep_all,))
    assert torch.allclose(recall, torch.ones(2, 1), atol=1e-6) and error.abs().max() < 1e-10


def test_bad_patterns_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown pattern 'diagonal'; the patterns are \['spatial', 'temporal'"):
        cogattn.CaptureOptions(kinds=("pattern_recall",), patterns=("spatial", "diagonal"))
    with pytest.raises(ValueError, match="unknown pattern 'window:x'"):
        cogattn.CaptureOptions(kinds=("pattern_error",), patterns="window:x")
    assert REDUCERS["pattern_error"](LAYOUTS[0], 2, False).names == ["spatial", "temporal"]  # the default pair
    with pytest.raises(ValueError, match="patterns were given but neither"):
        cogattn.CaptureOptions(kinds=("frame",), patterns=("spatial",))
    with pytest.raises(ValueError, match="use odd tile counts"):
        cogattn.CaptureOptions(kinds=("pattern_recall",), patterns=("sta:2,3,3",))
    options = cogattn.CaptureOptions(kinds=("pattern_recall",), patterns=("spatial", after_frame))
    assert options.selection_meta()["patterns"] == ["spatial", "after_frame"]  # run.json names them


def _named(name):
    """A user's pattern called ``name``: every key."""
    return patterns.Pattern(name, lambda *pos: torch.tensor(True))


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(kinds=("pattern_recall",)), r"kinds \['pattern_recall'\] need patterns=\[\.\.\.\]"),
        (dict(kinds=("frame", "pattern_error"), patterns=()), r"kinds \['pattern_error'\] need patterns=.*'radial'"),
        (dict(kinds=("pattern_recall",), patterns=("spatial", "temporal", "spatial")), r"name \['spatial'\] more"),
        (dict(kinds=("pattern_error",), patterns=(after_frame, _named("after_frame"))), r"name \['after_frame'\]"),
    ],
)
def test_pattern_kinds_without_patterns_or_with_one_twice_are_refused_before_the_pipeline_runs(tmp_path, options, says):
    """Refused by ``record`` itself, in one line: no processor installed, no run folder made, no model call."""
    pipe = tiny_pipeline()
    stock = {name: type(proc) for name, proc in pipe.transformer.attn_processors.items()}
    with pytest.raises(ValueError, match=says) as err:
        cogattn.record(pipe, save_dir=tmp_path / "run", **options)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    assert {name: type(proc) for name, proc in pipe.transformer.attn_processors.items()} == stock


def test_run_json_names_the_patterns_in_order_and_their_slots_hold_them(tmp_path):
    """The patterns' names in run.json, in the order given, label the slots of the result: each slot equals the
    pattern recorded alone."""
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("pattern_recall",), patterns=("temporal", "spatial"), save_dir=tmp_path / "run"):
        generate(pipe, steps=1, output_type="latent")
    run = cogattn.load(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["selection"]["patterns"] == ["temporal", "spatial"]
    with cogattn.record(pipe, kinds=("pattern_recall",), patterns=("spatial",)) as alone:
        generate(pipe, steps=1, output_type="latent")
    assert torch.equal(run.get("pattern_recall", 0, 0)[..., 1:], alone.get("pattern_recall", 0, 0))


def test_a_grid_with_history_tokens_refuses_patterns_before_any_block_runs():
    framepack = next((spec for spec in FAMILIES if spec.family == "hunyuan_video_framepack"), None)
    if framepack is not None:
        assert "pattern_recall" not in framepack.kinds() and "pattern_error" in framepack.refused
    history = TokenLayout(text_len=3, frames=2, height=2, width=2, history_len=4)
    with pytest.raises(ValueError, match="off the latent grid"):
        REDUCERS["pattern_recall"](history, 2, False, patterns=("spatial",))


def test_mask_recall_of_a_pattern_on_block_and_tile_maps_is_the_token_mass_of_its_group_mask():
    pipe = tiny_pipeline()
    options = dict(kinds=("block", "tile", "full", "pattern_recall"), heads="all", batch="cond", block_size=6)
    with cogattn.record(pipe, **options, tile_shape=(1, 2, 3), patterns=("spatial", "sta:1,3,1")) as rec:
        generate(pipe, steps=1, output_type="latent")
    layout, S = rec.layout, rec.layout.seq_len
    full = rec.get("full", 0, 1).double()  # (1, H, S, S)
    for spec, column in (("spatial", 0), ("sta:1,3,1", 1)):
        pattern = patterns.parse(spec, (1, 2, 3))
        for kind, groups, mask in (
            ("block", torch.arange(S) // 6, pattern.block_mask(layout, 6)),
            ("tile", layout.tile_of_token((1, 2, 3)), pattern.tile_mask(layout, (1, 2, 3))),
        ):
            tokens = mask[groups[:, None], groups[None, :]]  # the group mask's token pairs
            want = (full * tokens).sum((-1, -2)) / S  # (1, H)
            got = mask_recall(rec, spec, layers=1, kind=kind)
            assert torch.allclose(torch.tensor(got.recall.values), want[0], atol=1e-6), (spec, kind)
        # the token pattern keeps no more than its group mask: pattern_recall (over video queries) is exact
        exact = rec.get("pattern_recall", 0, 1)[0, :, column].double()
        video = layout.video_tokens
        token_keep = torch.ones(S, S, dtype=torch.bool)
        token_keep[video, video] = naive_pattern(spec, layout.grid, (1, 2, 3))
        assert torch.allclose(exact, (full[0][:, video] * token_keep[video]).sum((-1, -2)) / layout.video_len)
