"""``top_p`` and ``frame_max``: the histogram count against a full float64 sort, a tiny generation against its
own ``full`` map, the record on disk, and what is refused."""

import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn.analysis import aggregate
from cogattn.exact import top_p
from cogattn.exact.reducers import REDUCERS, FrameMax
from cogattn.layout import TokenLayout
from cogattn.models import FAMILIES
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.reference import naive_kind

pytestmark = pytest.mark.usefixtures("one_thread")
PS = (0.05, 0.5, 0.9, 0.99, 1.0)


def _sorted_counts(x, ps, margin=0.0):
    """Fewest entries reaching each p of the row's total by a full descending sort and a float64 cumulative sum;
    p = 1: every nonzero entry."""
    mass = x.double().sort(-1, descending=True).values.cumsum(-1)
    total, nonzero = mass[..., -1:], (x > 0).sum(-1)
    counts = [nonzero if p >= 1 else torch.minimum((mass < (p + margin) * total).sum(-1) + 1, nonzero) for p in ps]
    return torch.stack(counts, -1).float()


def _hard_rows(S):
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(S, generator=g) * s).softmax(-1) for s in (0.3, 1.5, 4.0, 12.0, 40.0)]
    tied = torch.full((S,), 1.0 / S)  # every entry equal: counts from ties alone
    lone = torch.zeros(S)
    lone[3] = 1.0
    tiny = torch.full((S,), 1e-12)  # most entries below the histogram's lowest octave
    tiny[:2] = (1 - (S - 2) * 1e-12) / 2
    masked = (torch.randn(S, generator=g) * 2).softmax(-1)
    masked[S // 3 :] = 0
    masked /= masked.sum()
    return torch.stack([*rows, tied, lone, torch.zeros(S), tiny, masked])


# both ways of counting, whatever the device: by chunks of rows (a CPU's) and over the whole tile (a GPU's)
WAYS = {"chunks": top_p._counts_in_chunks, "sort": top_p._counts_by_sort}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("S", [53, 700, 5000, 17776])
def test_top_p_counts_equal_a_full_sort(S, way):
    x = _hard_rows(S)
    got = WAYS[way](x, PS)
    lo, hi = _sorted_counts(x, PS, -1e-9), _sorted_counts(x, PS, 1e-9)
    decided = lo == hi  # p not within 1e-9 of a cumulative sum: one exact answer
    assert torch.equal(got[decided], lo[decided])
    assert bool(((got >= lo) & (got <= hi)).all())
    assert decided.float().mean() > 0.8
    assert got[6, 1] == 1 and got[7].tolist() == [0.0] * len(PS)  # one key; no key
    assert got[5, 1] == pytest.approx(round(S / 2), abs=1)  # equal entries: half of them for half the mass


def _peaked_rows(S, n=48):
    """Float32 softmax rows whose tails lie far below float32's epsilon: a first key at score 0, keys at −30, −40
    and −60, the rest spread over [−70, −5] (half the rows with a few keys near the top too), a third of them scaled
    by 1 − 4e-7 and a third by 1 + 4e-7 (the sums of exp(s − lse) with the lse a few ulps off)."""
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(n, S, generator=g) * -65 - 5
    scores[:, :4] = torch.tensor([0.0, -30.0, -40.0, -60.0])
    scores[n // 2 :, 1:6] = -torch.rand(n - n // 2, 5, generator=g) * 3
    return scores.softmax(-1) * torch.tensor([1 - 4e-7, 1.0, 1 + 4e-7]).repeat(n // 3)[:, None]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("S", [72, 700, 17776])
def test_top_p_of_peaked_rows_counts_every_nonzero_key_at_1_and_a_share_of_the_rows_total_below(S, way):
    """Rows whose float32 sum is a few ulps above or below 1: p = 1 counts every key (none is 0), where a running
    sum compared with 1 stops early on rows above 1 (it reaches 1 before the smallest keys are added) and never
    reaches p = 1 − 1e-7 on rows below it; p just below 1 counts the keys reaching p of the row's total."""
    x = _peaked_rows(S)
    assert bool((x > 0).all())
    ps = (0.5, 0.999, 1 - 1e-7, 1.0)
    got = WAYS[way](x, ps)
    assert got[:, 3].tolist() == [float(S)] * len(x)
    lo, hi = _sorted_counts(x, ps, -1e-12), _sorted_counts(x, ps, 1e-12)
    decided = lo == hi  # p · total not within 1e-12 of a running sum (near 1 − 1e-7 the keys add ~1e-11 each)
    assert torch.equal(got[decided], lo[decided]) and bool(((got >= lo) & (got <= hi)).all())
    assert decided.float().mean() > 0.9
    running = x.double().sort(-1, descending=True).values.cumsum(-1)
    total = running[:, -1]
    # what the rows test: some reach 1 before their last key, some never reach 1 − 1e-7
    assert bool((running[:, -2] >= 1).any()) and bool((total < 1 - 1e-7).any()) and bool((total > 1).any())
    assert bool((got[:, 2] < S).all())  # 1 − 1e-7 of the total needs fewer keys than every one
    assert float(running.gather(1, got[:, 2:3].long() - 1).div(total[:, None]).min()) >= 1 - 1e-7


def test_tiny_generation_matches_its_own_full_map(tmp_path):
    """frame_max and top_p of each recorded map, read back from disk, against the same run's ``full`` rows
    (the same float32 probabilities): argmax of each frame group and a float64 sort of each row."""
    pipe = tiny_pipeline()
    ps = (0.5, 0.9, 0.99)
    with cogattn.record(
        pipe, kinds=("full", "top_p", "frame_max"), heads="all", top_p=ps, save_dir=tmp_path, steps=[1], layers=[0, 1]
    ):
        generate(pipe, steps=2, output_type="latent")
    run = cogattn.load(tmp_path)
    lay = run.layout
    assert run.meta["selection"]["top_p"] == list(ps)
    for layer in (0, 1):
        P = run.get("full", 1, layer)
        counts = run.get("top_p", 1, layer)
        lo, hi = _sorted_counts(P, ps, -1e-9), _sorted_counts(P, ps, 1e-9)
        assert torch.equal(counts[lo == hi], lo[lo == hi]) and bool(((counts >= lo) & (counts <= hi)).all())
        got = run.get("frame_max", 1, layer)
        assert isinstance(got, FrameMax) and got.indices.dtype == torch.long
        assert got.values.shape == (1, P.shape[1], lay.seq_len, lay.num_groups)
        want = naive_kind(P.double(), "frame_max", lay.text_len, lay.grid)
        assert torch.equal(got.values, want[..., 0].float()) and torch.equal(got.indices, want[..., 1].long())
        part = run.get("frame_max", 1, layer, index=(0, 1, 5))  # one row, read alone
        assert torch.equal(part.values, got.values[0, 1, 5]) and torch.equal(part.indices, got.indices[0, 1, 5])
    with pytest.raises(ValueError, match="frame_max records are values and key indices"):
        aggregate(run, "frame_max")
    mean = aggregate(run, "top_p", steps=[1], layers=[0])  # a mean count of keys
    assert torch.allclose(mean, run.get("top_p", 1, 0)[0].mean(0))


def test_a_peaked_tiny_generation_counts_every_key_at_p_1(tmp_path):
    """A tiny CogVideoX whose q norm's weight is ×4: rows with tails near 1e-11, none 0, whose float32 sums miss 1 by
    up to ~2e-7 (a third of a layer's rows reach 1 before their smallest key). Read back from disk, p = 1 counts
    every key and p just below 1 a share of each row's total, against the same run's ``full`` rows."""
    pipe = tiny_pipeline()
    with torch.no_grad():
        for block in pipe.transformer.transformer_blocks:
            block.attn1.norm_q.weight.mul_(4)
    ps = (0.5, 0.999, 1 - 1e-7, 1.0)
    with cogattn.record(pipe, kinds=("full", "top_p"), heads="all", top_p=ps, save_dir=tmp_path, steps=[1]):
        generate(pipe, steps=2, output_type="latent")
    run = cogattn.load(tmp_path)
    for layer in (0, 1):
        P, counts = run.get("full", 1, layer), run.get("top_p", 1, layer)
        running = P.double().sort(-1, descending=True).values.cumsum(-1)
        assert bool((P > 0).all()) and (running[..., -2] >= 1).double().mean() > 0.15
        assert bool((counts[..., 3] == P.shape[-1]).all())
        lo, hi = _sorted_counts(P, ps, -1e-12), _sorted_counts(P, ps, 1e-12)
        assert torch.equal(counts[lo == hi], lo[lo == hi]) and bool(((counts >= lo) & (counts <= hi)).all())


@pytest.mark.parametrize("bad", [(), 0, (0.5, 0.0), 1.5, (0.9, -1), ("0.9",), True, (0.5, float("nan"))])
def test_top_p_outside_0_1_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^top_p=.*\(0, 1\]") as err:
        cogattn.CaptureOptions(kinds=("top_p",), top_p=bad)
    assert "\n" not in str(err.value)


def test_frame_max_is_refused_off_the_grid_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="history latents"):
        REDUCERS["frame_max"](TokenLayout(4, 2, 2, 3, history_len=5), 2, False)
    spec = next((s for s in FAMILIES if s.family == "hunyuan_video_framepack"), None)
    if spec is None:
        pytest.skip("this diffusers lacks FramePack")
    pipe = spec.tiny_pipeline(num_heads=3)
    with pytest.raises(ValueError, match="kind 'frame_max' does not exist for hunyuan_video_framepack") as err:
        cogattn.Recording(pipe, kinds=("frame_max",), save_dir=tmp_path / "run")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("way", WAYS)
def test_top_p_counts_of_many_near_uniform_rows_stay_exact_and_equal_each_row_counted_alone(way):
    """A tile of near-uniform rows puts most entries in the bins where p is crossed, which are read
    again (by levels or in sorted chunks): the counts equal those of each row counted alone, and a full sort's."""
    x = torch.cat([_hard_rows(700)] * 6)
    x[::3] = (torch.randn(x[::3].shape, generator=torch.Generator().manual_seed(1)) * 0.05).softmax(-1)
    got = WAYS[way](x, PS)
    alone = torch.cat([WAYS[way](row[None], PS) for row in x])
    assert torch.equal(got, alone)
    lo, hi = _sorted_counts(x, PS, -1e-9), _sorted_counts(x, PS, 1e-9)
    assert bool(((got >= lo) & (got <= hi)).all())


def test_top_p_at_1_holds_rows_with_keys_at_float32_s_least_subnormal():
    """Peaked rows (q and k ×6) whose tails reach float32's least subnormal, 2⁻¹⁴⁹: a key of float64 probability
    6e-46 rounds to 0 in float32 and comes out of float32's softmax as 1.4e-45. p = 1 counts the keys float32
    keeps nonzero; the reference leaves the keys between 2⁻¹⁵² and 2⁻¹⁴⁸ to either side, and no other."""
    from cogattn.exact.engine import capture
    from cogattn.exact.planner import plan_tiles
    from cogattn.reference import kind_error, naive_probs

    lay = TokenLayout(5, 3, 3, 4)
    S, H, D = lay.seq_len, 3, 16
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(H, S, D, generator=g) * 6, torch.randn(H, S, D, generator=g) * 6
    red = REDUCERS["top_p"](lay, H, False, top_p=(0.9, 1.0))
    out = torch.zeros(red.shape(1)[1:])
    capture(q, k, [red], [out], plan_tiles([red], S, H, D, 2**30, "rows", "cpu"))
    P = naive_probs(q[None], k[None])
    edge = (P >= 2.0**-152) & (P < 2.0**-148)
    assert bool(edge.any()), "the case should reach the subnormal edge"
    assert not torch.equal(out[..., 1], (P[0].float() > 0).sum(-1).float())  # float32's rounding of P64 differs
    assert kind_error(out[None], P, "top_p", lay.text_len, lay.grid, top_p=(0.9, 1.0)) == 0
    sure, maybe = (P[0] >= 2.0**-148).sum(-1), (P[0] >= 2.0**-152).sum(-1)
    assert bool(((out[..., 1] >= sure) & (out[..., 1] <= maybe)).all())
    wrong = out.clone()
    wrong[0, 0, 1] = maybe[0, 0] + 1  # a count past the edge: held
    assert kind_error(wrong[None], P, "top_p", lay.text_len, lay.grid, top_p=(0.9, 1.0)) == 1
