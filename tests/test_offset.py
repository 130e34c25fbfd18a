"""The ``offset`` kind against the naive float64 reference (itself checked token by token), on every method,
budget, head selection, text position, query limit and query-key mask; its decay table against sums over
the ``full`` map of the same tiny generation; its figure's arrays against those numbers."""

import pytest
import torch

from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.reference import naive_kind, naive_probs

LAYOUTS = [
    TokenLayout(8, 3, 3, 5),
    TokenLayout(5, 2, 7, 3),
    TokenLayout(3, 1, 1, 1),
    TokenLayout(0, 4, 2, 3),  # no text in the sequence (Wan)
    TokenLayout(6, 2, 3, 4, text_position="end"),  # the text after the video (HunyuanVideo)
]


def _ids(lay):
    return f"T{lay.text_len}{lay.text_position[0]}-{lay.frames}x{lay.height}x{lay.width}"


def _offset(q, k, layout, mean, budget=2**30, path="rows", **extra):
    H, S, D = q.shape
    red = REDUCERS["offset"](layout, H, mean)
    plan = plan_tiles([red], S, H, D, budget, path, q.device)
    out = torch.zeros(red.shape(1)[1:])
    capture(q, k, [red], [out], plan, **extra)
    return out, plan


def _by_hand(P, layout):
    """``offset`` token by token from ``P`` ``(H, S, S)``, with the layout's own coordinates (no index arithmetic)."""
    F, Hp, Wp = layout.grid
    H = P.shape[0]
    out = torch.zeros(H, 2 * F - 1, 2 * Hp - 1, 2 * Wp - 1, dtype=torch.float64)
    video = range(layout.video_start, layout.video_start + layout.video_len)
    for i in video:
        fi, yi, xi = layout.coordinates(i)
        for j in video:
            fj, yj, xj = layout.coordinates(j)
            out[:, fj - fi + F - 1, yj - yi + Hp - 1, xj - xi + Wp - 1] += P[:, i, j]
    return out / layout.video_len


@pytest.mark.parametrize("layout", LAYOUTS[:2] + LAYOUTS[4:], ids=_ids)
def test_the_reference_is_the_definition_token_by_token(layout):
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, layout.seq_len, 8), torch.randn(1, 2, layout.seq_len, 8)
    P = naive_probs(q, k)
    ref = naive_kind(P, "offset", layout.text_len, layout.grid, text_at_end=layout.text_position == "end")[0]
    assert (ref - _by_hand(P[0], layout)).abs().max() < 1e-12
    text = P[0][:, layout.video_tokens, layout.text_tokens].sum(-1).mean(-1)  # mean text mass of video queries
    assert torch.allclose(ref.sum((1, 2, 3)) + text, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("path", ["rows", "sdpa", "auto"])
@pytest.mark.parametrize("mean", [False, True])
def test_offset_matches_the_naive_reference(layout, path, mean):
    torch.manual_seed(0)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2  # peaked rows, like trained attention
    got, plan = _offset(q, k, layout, mean, path=path)
    assert plan.method == "rows"  # every row is formed: the rows serve it whatever the method asked
    P = naive_probs(q[None], k[None])
    ref = naive_kind(P, "offset", layout.text_len, layout.grid, text_at_end=layout.text_position == "end")[0]
    ref = ref.mean(0, keepdim=True) if mean else ref
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got.double() - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("budget", [5_000, 9_000, 2**30])
def test_offset_does_not_depend_on_the_budget(budget):
    torch.manual_seed(1)
    layout = TokenLayout(8, 3, 3, 5)
    q, k = torch.randn(4, layout.seq_len, 16), torch.randn(4, layout.seq_len, 16)
    small, plan = _offset(q, k, layout, False, budget)
    big, _ = _offset(q, k, layout, False)
    assert plan.peak_bytes <= budget and (plan.row_rows < 20 or budget == 2**30)  # several row tiles
    assert (small - big).abs().max() <= 1e-6


@pytest.mark.parametrize("rows", [1, 4, 7, 13, 10_000])
@pytest.mark.parametrize("mean", [False, True])
def test_tiles_that_cut_lines_and_frames_of_queries(rows, mean):
    """Row tiles of 1 to every row, all heads at once: a tile's whole lines of queries (one row of a frame) fold
    by axis, and the lines it cuts at either end (and the text rows) a row at a time."""
    from dataclasses import replace

    from cogattn.exact.planner import size_tiles

    torch.manual_seed(5)
    layout = TokenLayout(8, 3, 3, 5)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    red = REDUCERS["offset"](layout, H, mean)
    plan = replace(size_tiles("rows", [red], S, H, D, 2**30), row_heads=H, row_rows=min(rows, S))
    out = torch.zeros(red.shape(1)[1:])
    capture(q, k, [red], [out], plan)
    ref = naive_kind(naive_probs(q[None], k[None]), "offset", layout.text_len, layout.grid)[0]
    ref = ref.mean(0, keepdim=True) if mean else ref
    assert (out.double() - ref).abs().max() <= 1e-6


def test_heads_chunks_and_head_mean_on_a_budget_that_splits_heads():
    """Tiles of several heads (an accelerator's plan) fold the head mean as the mean of the per-head maps."""
    from cogattn.exact.planner import size_tiles

    torch.manual_seed(2)
    layout = TokenLayout(5, 2, 7, 3)
    H, S, D = 5, layout.seq_len, 8
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    red = REDUCERS["offset"](layout, H, True)
    plan = size_tiles("rows", [red], S, H, D, 2**30)  # no CPU cap: every head in one tile
    assert plan.row_heads == H
    out = torch.zeros(red.shape(1)[1:])
    capture(q, k, [red], [out], plan)
    ref = naive_kind(naive_probs(q[None], k[None]), "offset", layout.text_len, layout.grid)[0].mean(0, keepdim=True)
    assert (out.double() - ref).abs().max() <= 1e-6


def test_masked_keys_and_unformed_rows():
    """Text after the video with its last keys masked and its last query rows never formed (Mochi): the
    masked keys add nothing, the mean is over the video queries (all formed), and nothing is cleared."""
    torch.manual_seed(3)
    layout = TokenLayout(6, 2, 3, 4, text_position="end")  # video 0-23, text 24-29
    H, S, D = 2, layout.seq_len, 8
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    kept = 27  # the item's first 27 tokens: its 3 valid text tokens
    got, _ = _offset(q, k, layout, False, keys=kept, queries=kept)
    P = naive_probs(q[None, :, :kept], k[None, :, :kept])  # the item alone, its padded text dropped
    ref = naive_kind(P, "offset", 3, layout.grid, text_at_end=True)[0]
    assert (got.double() - ref).abs().max() <= 1e-6


def test_a_query_key_mask_gives_masked_offsets_no_mass():
    """A block-causal mask (SkyReels-V2's diffusion forcing): later frames get no mass at positive Δt."""
    torch.manual_seed(4)
    layout = TokenLayout(0, 4, 2, 3)
    H, S, D = 2, layout.seq_len, 8
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    block = torch.arange(S) // (2 * 2 * 3)  # two latent frames a block
    mask = block[None, :] <= block[:, None]
    got, _ = _offset(q, k, layout, False, mask=mask)
    P = (q[None].double() @ k[None].double().transpose(-1, -2) / D**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    ref = naive_kind(P, "offset", 0, layout.grid)[0]
    assert (got.double() - ref).abs().max() <= 1e-6
    assert bool((got[:, 3 + 2 :] == 0).all())  # Δt ≥ 2 always crosses into a later block


def test_offsets_beside_other_row_kinds_share_one_pass():
    torch.manual_seed(5)
    layout = TokenLayout(8, 3, 3, 5)
    H, S, D = 2, layout.seq_len, 8
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    reds = [REDUCERS[kd](layout, H, False) for kd in ("full", "offset", "frame")]
    plan = plan_tiles(reds, S, H, D, 2**30, "auto", "cpu")
    outs = [torch.zeros(r.shape(1)[1:]) for r in reds]
    capture(q, k, reds, outs, plan)
    ref = naive_kind(outs[0][None].double(), "offset", layout.text_len, layout.grid)[0]  # from the recorded full map
    assert (outs[1].double() - ref).abs().max() <= 1e-6


def test_video_tokens_off_the_grid_are_refused():
    from cogattn.models.hunyuan_video_framepack import SPEC

    with pytest.raises(ValueError, match="kind 'offset' needs every video token on the latent grid"):
        REDUCERS["offset"](TokenLayout(4, 2, 2, 2, history_len=5), 1, False)
    assert "offset" in SPEC.refused and "offset" not in SPEC.kinds()
    with pytest.raises(ValueError, match="offset"):
        SPEC.check_kinds(["offset"])


# -- the decay table from a tiny generation ------------------------------------------------------------
@pytest.fixture(scope="module")
def recording():
    """A tiny CogVideoX generation with ``offset`` and ``full`` of every head and both guidance items."""
    from tiny_calls import generate

    import cogattn
    from cogattn.models.cogvideox import tiny_pipeline

    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("offset", "full", "frame"), heads="all", batch="all") as rec:
        generate(pipe, steps=2, output_type="latent")
    return rec


def _curves_by_hand(P, layout):
    """Mass against |Δt| and rounded Euclidean patch distance, straight from ``P`` ``(H, S, S)`` pair by pair:
    ``(H, F)`` and ``(H, D + 1)``."""
    import math

    F, Hp, Wp = layout.grid
    H = P.shape[0]
    far = round(math.hypot(Hp - 1, Wp - 1))
    temporal = torch.zeros(H, F, dtype=torch.float64)
    spatial = torch.zeros(H, far + 1, dtype=torch.float64)
    video = range(layout.video_start, layout.video_start + layout.video_len)
    coords = {i: layout.coordinates(i) for i in video}
    for i in video:
        fi, yi, xi = coords[i]
        for j in video:
            fj, yj, xj = coords[j]
            temporal[:, abs(fj - fi)] += P[:, i, j]
            spatial[:, round(math.hypot(yj - yi, xj - xi))] += P[:, i, j]
    return temporal / layout.video_len, spatial / layout.video_len


def test_decay_table_against_sums_over_the_full_map(recording):
    import numpy as np

    from cogattn.analysis.decay import decay_table
    from cogattn.analysis.head_stats import head_table

    rec, layout = recording, recording.layout
    table = decay_table(rec)
    steps, layers = len(rec.timesteps), len(rec.layer_names)
    B, H = rec.get("full", 0, 0).shape[:2]
    assert len(table) == steps * layers * H * B
    assert table.columns[:7].tolist() == ["step", "timestep", "expert", "layer", "head", "item", "text_mass"]
    F = layout.frames
    checked = 0
    for step in range(steps):
        for layer in range(layers):
            full = rec.get("full", step, layer).double()
            for b in range(B):
                temporal, spatial = _curves_by_hand(full[b], layout)
                text = full[b][:, layout.video_tokens, layout.text_tokens].sum(-1).mean(-1)
                for h in range(H):
                    row = table[
                        (table.step == step) & (table.layer == layer) & (table["head"] == h) & (table["item"] == b)
                    ]
                    assert len(row) == 1
                    row = row.iloc[0]
                    assert abs(row.text_mass - text[h].item()) < 1e-5
                    got_t = np.array([row[f"dt_{d}"] for d in range(F)])
                    got_s = np.array([row[f"ds_{d}"] for d in range(spatial.shape[1])])
                    assert np.abs(got_t - temporal[h].numpy()).max() < 1e-5
                    assert np.abs(got_s - spatial[h].numpy()).max() < 1e-5
                    for prefix, d, m in (("t", np.arange(F), got_t), ("s", np.arange(len(got_s)), got_s)):
                        keep = m > 0
                        slope, intercept = np.polyfit(d[keep], np.log(m[keep]), 1)
                        fitted = intercept + slope * d[keep]
                        y = np.log(m[keep])
                        r2 = 1 - ((y - fitted) ** 2).sum() / ((y - y.mean()) ** 2).sum()
                        assert row[f"{prefix}_rate"] == pytest.approx(-slope, abs=1e-9)
                        assert row[f"{prefix}_scale"] == pytest.approx(np.exp(intercept), rel=1e-9)
                        assert row[f"{prefix}_r2"] == pytest.approx(r2, abs=1e-9)
                    checked += 1
    assert checked == len(table)
    # the same dt_d as the head table's, which comes from the frame kind
    heads = head_table(rec)
    dt = [f"dt_{d}" for d in range(F)]
    assert np.abs(heads[dt].to_numpy() - table[dt].to_numpy()).max() < 1e-5


def test_per_key_decay_of_uniform_attention_is_flat():
    """Uniform attention over the video: the mean probability per key is 1/V at every distance, its fit a rate 0."""
    from cogattn.analysis.decay import fit_decay, keys_at_distance, offset_curves

    layout = TokenLayout(0, 3, 4, 5)
    V = layout.video_len
    P = torch.full((1, 1, V, V), 1.0 / V, dtype=torch.float64)
    offset = naive_kind(P, "offset", 0, layout.grid)
    temporal, spatial = offset_curves(offset, layout)
    t_keys, s_keys = keys_at_distance(layout)
    assert t_keys.sum() == pytest.approx(V) and s_keys.sum() == pytest.approx(V)
    assert torch.allclose(temporal / t_keys, torch.full_like(temporal, 1.0 / V))
    assert torch.allclose(spatial / s_keys, torch.full_like(spatial, 1.0 / V))
    scale, rate, r2 = fit_decay(range(3), (temporal / t_keys)[0, 0].tolist())
    assert scale == pytest.approx(1.0 / V) and rate == pytest.approx(0.0, abs=1e-12) and r2 != r2  # R² NaN: flat


def test_fit_of_an_exact_exponential_and_of_too_few_points():
    import math

    from cogattn.analysis.decay import fit_decay

    scale, rate, r2 = fit_decay([0, 1, 2, 3], [2 * math.exp(-0.7 * d) for d in range(4)])
    assert (scale, rate, r2) == pytest.approx((2.0, 0.7, 1.0))
    assert all(math.isnan(v) for v in fit_decay([0, 1, 2], [0.5, 0.0, 0.0]))  # one positive point


def test_a_curve_flat_within_float32_rounding_and_a_damaged_one_are_no_fits():
    """Uniform attention in float32 keeps ~1e-8 of rounding in its curve: it was fitted as signal (R² 0.72, −2.0);
    a NaN point left a fit of the others, R² 1.0; mean_decay left a damaged row out of one distance's mean only."""
    import math

    import pandas as pd

    from cogattn.analysis.decay import fit_decay, mean_decay

    third = torch.tensor(1 / 3, dtype=torch.float32).item()
    scale, rate, r2 = fit_decay([0, 1, 2], [third, third, third * (1 + 2**-23)])
    assert scale == pytest.approx(third) and rate == 0.0 and math.isnan(r2)
    assert all(math.isnan(v) for v in fit_decay([0, 1, 2, 3], [1.0, 0.5, math.nan, 0.125]))
    assert all(math.isnan(v) for v in fit_decay([0, 1, 2], [1.0, math.inf, 0.25]))
    table = pd.DataFrame(
        {"step": [0, 0], "layer": [0, 0], "head": [0, 1], "dt_0": [0.5, math.nan], "dt_1": [0.25, 0.2]}
    )
    table = table.assign(ds_0=[0.4, 0.3], ds_1=[0.2, 0.1])
    by_layer = mean_decay(table, by="layer")
    assert math.isnan(by_layer.loc[0, "dt_0"]) and math.isnan(by_layer.loc[0, "t_rate"])


def test_mean_decay_averages_the_curves_then_fits(recording):
    import numpy as np

    from cogattn.analysis.decay import decay_table, fit_decay, mean_decay

    table = decay_table(recording)
    by_layer = mean_decay(table, by="layer")
    assert by_layer.index.tolist() == sorted(table.layer.unique())
    ds = [c for c in table.columns if c.startswith("ds_")]
    want = table[table.layer == 1][ds].to_numpy().mean(0)
    assert np.abs(by_layer.loc[1, ds].to_numpy(dtype=float) - want).max() < 1e-12
    assert by_layer.loc[1, "s_rate"] == pytest.approx(fit_decay(range(len(ds)), want)[1])
    two = table.assign(expert=np.where(table.step == 0, "transformer", "transformer_2"))
    with pytest.raises(ValueError, match="experts"):
        mean_decay(two, by="head")
    with pytest.raises(ValueError, match="by='rows'"):
        mean_decay(table, by="rows")


# -- the figures --------------------------------------------------------------------------------------
def test_offset_map_draws_the_mean_offset_map_one_panel_per_frame_offset(recording):
    import numpy as np

    from cogattn import plot
    from cogattn.plot.style import MAP_GID

    rec, layout = recording, recording.layout
    F = layout.frames
    fig = plot.offset_map(rec, layers=1)
    images = [im for ax in fig.axes for im in ax.get_images() if im.get_gid() == MAP_GID]
    cond = rec.batch_roles.index("cond")
    want = np.mean([rec.get("offset", s, 1)[cond].double().mean(0).numpy() for s in range(len(rec.timesteps))], 0)
    assert len(images) == 2 * F - 1
    for d, im in enumerate(images):
        assert np.abs(np.asarray(im.get_array()) - want[d]).max() < 1e-6
    bar = [ax for ax in fig.axes if ax.get_ylabel().startswith("attention mass (mean over video queries")]
    assert bar, "a colour bar labelled with the unit"
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[F - 1].startswith("Δt = 0") and titles[0].startswith(f"Δt = -{F - 1}")
    with pytest.raises(ValueError, match="one head at a time"):
        plot.offset_map(rec, heads="all")


def test_distance_decay_draws_the_mean_curves_and_their_fits(recording):
    import numpy as np

    from cogattn import plot
    from cogattn.analysis.decay import decay_table, mean_decay
    from cogattn.plot.decay import FIT_GID, POINTS_GID

    table = decay_table(recording)
    cond = recording.batch_roles.index("cond")
    curves = mean_decay(table[table["item"] == cond], by="layer")
    fig = plot.distance_decay(recording, by="layer")
    temporal, spatial = fig.axes[:2]
    for ax, prefix, name in ((temporal, "t", "dt"), (spatial, "s", "ds")):
        lines = [ln for ln in ax.get_lines() if ln.get_gid() == POINTS_GID]
        fits = [ln for ln in ax.get_lines() if ln.get_gid() == FIT_GID]
        assert len(lines) == len(fits) == len(curves)
        columns = [c for c in curves.columns if c.startswith(f"{name}_")]
        for line, fit, (_, row) in zip(lines, fits, curves.iterrows()):
            d = np.arange(len(columns))
            assert np.allclose(line.get_ydata(), row[columns].to_numpy(dtype=float), rtol=0, atol=1e-12)
            assert np.allclose(fit.get_ydata(), row[f"{prefix}_scale"] * np.exp(-row[f"{prefix}_rate"] * d))
        assert ax.get_yscale() == "log" and ax.get_xlabel() and ax.get_ylabel()
    same = plot.distance_decay(table, by="layer")  # from the table itself
    assert np.allclose(same.axes[0].get_lines()[0].get_ydata(), temporal.get_lines()[0].get_ydata())
    assert table.attrs["frame_unit"] == "latent frame"  # CogVideoX 1.0: no temporal patches
    assert temporal.get_xlabel() == same.axes[0].get_xlabel() == "temporal distance |Δt| (latent frames)"
    table.attrs["frame_unit"] = "temporal patch"  # CogVideoX 1.5's: a Δt step is 2 latent frames
    assert plot.distance_decay(table, by="layer").axes[0].get_xlabel() == "temporal distance |Δt| (temporal patches)"
