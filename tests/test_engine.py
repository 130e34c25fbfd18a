"""The engine on random q, k against the naive float64 softmax, on every path and many budgets."""

import re

import pytest
import torch
from reference import KINDS as RECORDED
from reference import assert_topk, naive_kind, naive_probs
from tiny_calls import PROMPT, generate

import cogattn
from cogattn.exact import memory
from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import SPEC as COGVIDEOX
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.reference import kind_error

pytestmark = pytest.mark.usefixtures("one_thread")  # the CPU plans' numbers: one thread's flash workspace

LAYOUTS = [TokenLayout(8, 3, 3, 5), TokenLayout(5, 2, 7, 3), TokenLayout(3, 1, 1, 1)]
KINDS = list(COGVIDEOX.kinds())  # the kinds of a joint text + video attention
# blocks and tiles that do not divide S or the grid; masses p down to one key and up to every key
SIZES = dict(block_size=7, topk=4, tile_shape=(2, 2, 3), top_p=(0.05, 0.5, 0.9, 0.99, 1.0))
SIZES["patterns"] = ("spatial", "temporal", "window:1", "sta:1,3,1", "radial")  # pattern_recall, pattern_error


def _value(q):
    """The attention's values for ``q`` ``(H, S, D)`` (``pattern_error`` folds them), the same for a call's reference."""
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(7))


RANKED = ("top_p", "frame_max")  # counts and key tokens: held to kind_error's rule, not a plain difference


def _ranked_error(got, P, kind, layout, mean):
    """``kind_error`` of one item's ``got`` (``frame_max`` with heads averaged: of the head-mean row)."""
    rows = P.mean(1, keepdim=True) if mean and kind == "frame_max" else P
    got = REDUCERS[kind].unpack(got[None])
    return kind_error(got, rows, kind, layout.text_len, layout.grid, mean_heads=mean, **SIZES)


def _run(q, k, layout, kinds, heads_mean, budget, path, queries=None):
    H, S, D = q.shape
    reducers = [REDUCERS[kd](layout, H, heads_mean, queries, **SIZES) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, budget, path, q.device)
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan, value=_value(q))
    return dict(zip(kinds, outs)), plan


def _assert_masked_kinds(kinds, outs, P, layout, mean, queries, v):
    """Each of ``kinds``' results ``outs`` equals the naive kind of the float64 probabilities ``P`` ``(1, H, S, S)``
    (the ranked kinds and top-k by their own measures), head-averaged where ``mean``."""
    for kind, got in zip(kinds, outs):
        if kind in RANKED:
            assert _ranked_error(got, P, kind, layout, mean) <= 1e-5, kind
            continue
        if kind == "topk":
            assert_topk(REDUCERS[kind].unpack(got[None]), P.mean(1, keepdim=True) if mean else P, 1e-5)
            continue
        ref = naive_kind(P, kind, 0, layout.grid, queries, v=v, **SIZES)[0]
        ref = ref.mean(0, keepdim=True) if mean else ref
        assert (got.double() - ref).abs().max() <= (1e-4 if kind == "entropy" else 1e-5), kind


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"T{lay.text_len}-{lay.frames}x{lay.height}x{lay.width}")
@pytest.mark.parametrize("path", ["rows", "sdpa"])
@pytest.mark.parametrize("mean", [False, True])
def test_every_kind_matches_naive_softmax(layout, path, mean):
    torch.manual_seed(0)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2  # peaked rows, like trained attention
    queries = torch.tensor([0, S - 1, layout.text_len])
    got, _ = _run(q, k, layout, KINDS, mean, 2**30, path, queries)
    P = naive_probs(q[None], k[None])
    for kind in KINDS:
        assert got[kind].dtype == torch.float32
        if kind in RANKED:
            assert _ranked_error(got[kind], P, kind, layout, mean) <= 1e-5, kind
            continue
        if kind == "topk":  # of the head-mean row
            assert_topk(REDUCERS[kind].unpack(got[kind][None]), P.mean(1, keepdim=True) if mean else P, 1e-5)
            continue
        ref = naive_kind(P, kind, layout.text_len, layout.grid, queries.tolist(), v=_value(q)[None], **SIZES)[0]
        ref = ref.mean(0, keepdim=True) if mean else ref
        assert got[kind].shape == ref.shape, kind
        assert (got[kind].double() - ref).abs().max() <= (1e-4 if kind == "entropy" else 1e-5), kind


@pytest.mark.parametrize("budget", [50_000, 60_000, 200_000, 2**30])
@pytest.mark.parametrize("path", ["rows", "sdpa"])
def test_results_do_not_depend_on_budget(budget, path):
    torch.manual_seed(1)
    layout = TokenLayout(8, 3, 3, 5)
    H, S, D = 4, layout.seq_len, 16
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    queries = torch.tensor([1, 9, 30])
    small, plan = _run(q, k, layout, KINDS, False, budget, path, queries)
    big, _ = _run(q, k, layout, KINDS, False, 2**30, path, queries)
    assert plan.peak_bytes <= budget
    for kind in KINDS:
        assert (small[kind] - big[kind]).abs().max() <= 1e-6, kind


def test_budget_splits_heads_and_rows():
    layout = TokenLayout(8, 3, 3, 5)
    reducers = [REDUCERS["full"](layout, 4, False)]
    S, D = layout.seq_len, 16
    plan = plan_tiles(reducers, S, 4, D, 8_000, "rows", "cpu")
    assert plan.row_heads < 4 and plan.row_rows < S and plan.peak_bytes <= 8_000


def _live_peak(fn) -> int:
    """The largest total of live CPU tensor bytes while ``fn()`` runs, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("kind", ["received", "frame"])
def test_the_fused_passes_stay_in_the_least_budget_with_the_cpu_kernels_workspace(kind):
    """At the least budget the planner takes, a fused pass's live bytes (the CPU flash kernel allocates a workspace
    per thread at every call) stay within it, with two threads."""
    layout = TokenLayout(26, 5, 16, 24)  # S = 1946: the kernel's 256-row blocks
    S, H, D = layout.seq_len, 4, 64
    torch.manual_seed(0)
    q, k = (torch.randn(H, S, D).bfloat16() for _ in range(2))
    reducers = [REDUCERS[kind](layout, H, False)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError) as err:
            plan_tiles(reducers, S, H, D, 100, "sdpa", "cpu")
        least = int(re.search(r"at least (\d+) bytes", str(err.value)).group(1))
        plan = plan_tiles(reducers, S, H, D, least, "sdpa", "cpu")
        out = torch.zeros(reducers[0].shape(1)[1:])
        capture(q, k, reducers, [out.clone()], plan)  # the first call's one-time caches
        peak = _live_peak(lambda: capture(q, k, reducers, [out], plan))
    finally:
        torch.set_num_threads(threads)
    assert plan.pooled_heads >= 1 and 0.9 * plan.peak_bytes <= peak <= memory.usable(least), (peak, plan)


@pytest.mark.parametrize(
    "kinds, method", [(("frame",), "sdpa"), (("full",), "rows"), (("full", "frame"), "sdpa"), (("frame",), "rows")]
)
def test_budget_too_small_names_one_budget_the_planner_takes(kinds, method):
    """One number in one line: the least budget that plans (every pass's smallest tile: the rows of ``full`` and the
    fused pass of ``frame`` together); a byte less is refused, naming the same number."""
    layout = TokenLayout(8, 3, 3, 5)
    reducers = [REDUCERS[k](layout, 2, True) for k in kinds]
    with pytest.raises(ValueError, match=r"memory_budget=100 bytes is too small for one tile") as err:
        plan_tiles(reducers, layout.seq_len, 2, 16, 100, method, "cpu")
    said = str(err.value)
    numbers = [int(n) for n in re.findall(r"\d+", said.split("head dim 16")[1].replace("'1GiB'", ""))]
    assert len(numbers) == 1 and "\n" not in said, said  # no second minimum beside the budget
    least = numbers[0]
    plan_tiles(reducers, layout.seq_len, 2, 16, least, method, "cpu")
    with pytest.raises(ValueError, match=f"memory_budget={least - 1} bytes .* at least {least} bytes"):
        plan_tiles(reducers, layout.seq_len, 2, 16, least - 1, method, "cpu")
    # the headroom rule it inverts: usable(b) = b − min(b // 32, 16 MiB)
    for need in (1, 31, 32, 7384, 31 * 2**24 - 1, 31 * 2**24, 31 * 2**24 + 1, 2**30):
        budget = memory.least_budget(need)
        assert budget - min(budget // 32, 2**24) >= need > budget - 1 - min((budget - 1) // 32, 2**24), need


def test_auto_prefers_sdpa_for_pooled_kinds_and_rows_with_full():
    layout = TokenLayout(8, 3, 3, 5)
    pooled = [REDUCERS["frame"](layout, 2, True), REDUCERS["video_to_text"](layout, 2, True)]
    assert plan_tiles(pooled, layout.seq_len, 2, 16, 2**30, "auto", "cpu").method == "sdpa"
    with_full = pooled + [REDUCERS["full"](layout, 2, True)]
    assert plan_tiles(with_full, layout.seq_len, 2, 16, 2**30, "auto", "cpu").method == "rows"


def test_frame_rows_sum_to_one_and_many_groups():
    """More frame groups than the head dimension: the SDPA path needs several indicator passes."""
    torch.manual_seed(2)
    layout = TokenLayout(4, 20, 1, 2)  # G = 21 > D = 8 columns per pass
    H, S, D = 2, layout.seq_len, 8
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    got, _ = _run(q, k, layout, ["frame"], False, 2**30, "sdpa")
    ref = naive_kind(naive_probs(q[None], k[None]), "frame", 4, layout.grid)[0]
    assert (got["frame"].double() - ref).abs().max() <= 1e-5
    assert torch.allclose(got["frame"].sum(-1), torch.ones(H, 21), atol=1e-5)


@pytest.mark.parametrize("path", ["rows", "sdpa"])
def test_a_pooled_fold_of_many_rows_and_groups_weighs_them_by_runs(path):
    """1,290 query rows (the SDPA pass's sums of all, row tiles of 1,024), fine 3-D tiles (642 groups), blocks of 2:
    the fold weighs its rows in runs of ``FOLD_ROWS`` (each run's weights and means a small share of the tile's,
    where one matrix of every group met by every row held 3.3 MB here, 320 MB at CogVideoX-5b's size, kept for the
    recording's life), the maps as the naive softmax's."""
    from cogattn.exact.reducers.pooled import FOLD_ROWS

    torch.manual_seed(3)
    layout = TokenLayout(10, 4, 16, 20)  # S = 1,290
    H, S, D = 2, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    sizes = dict(SIZES, tile_shape=(1, 2, 2), block_size=2)
    kinds = ["tile", "block", "frame", "query_frame"]
    reducers = [REDUCERS[kd](layout, H, False, None, **sizes) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, path, q.device)
    assert S > 2 * FOLD_ROWS and plan.method == path  # the sdpa pass folds every row's sums at once
    assert plan.row_rows > FOLD_ROWS if path == "rows" else plan.pooled_heads  # rows: tiles of several runs
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan)
    P = naive_probs(q[None], k[None])
    for kind, got in zip(kinds, outs):
        ref = naive_kind(P, kind, layout.text_len, layout.grid, **sizes)[0]
        assert (got.double() - ref).abs().max() <= 1e-5, kind
    for red in reducers[:3]:  # the runs' weights: at most FOLD_ROWS² a run (tiles, blocks: 512 rows; frames: one)
        pools = [pool for _, pool in red._pools.values()]
        assert sum(p.numel() for p in pools) <= S * FOLD_ROWS and max(p.numel() for p in pools) <= FOLD_ROWS**2
        assert (len(pools) == 1) == (red.kind == "frame") if path == "sdpa" else True  # 5 frames: one run of 1,290


def test_query_rows_in_any_order_even_all_of_them():
    """A query list of exactly S tokens, permuted, is not mistaken for the full rows in order."""
    torch.manual_seed(4)
    layout = TokenLayout(3, 1, 2, 2)
    H, S, D = 2, layout.seq_len, 8
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    queries = torch.arange(S).flip(0)
    got, _ = _run(q, k, layout, ["query", "full"], False, 2**30, "auto", queries)
    P = naive_probs(q[None], k[None])[0]
    assert (got["query"].double() - P[:, queries]).abs().max() <= 1e-6
    assert (got["full"].double() - P).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_call_gives_output_lse_and_pooled_sums(dtype):
    """One fused call on widened values: its first D columns are the stock output (bit for bit on the
    CPU), the rest the key-group sums, and its lse is every row's log-sum-exp."""
    import math

    from cogattn.exact.attention import attention_joint, joint_width

    torch.manual_seed(0)
    layout = TokenLayout(5, 2, 7, 3)
    B, H, S, D = 2, 3, layout.seq_len, 16
    q, k, v = (
        (torch.randn(B, H, S, D) * 2).to(dtype),
        (torch.randn(B, H, S, D) * 2).to(dtype),
        torch.randn(B, H, S, D).to(dtype),
    )
    groups = REDUCERS["frame"](layout, H, False).key_groups
    indicator = groups.indicator(S)
    out, lse, sums = attention_joint(q, k, v, indicator)
    assert joint_width(D, indicator.shape[1]) == 24
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    assert (lse.double() - scores.logsumexp(-1)).abs().max() <= 1e-4
    ref = naive_probs(q.float(), k.float()) @ indicator.double()
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: P and the sums each rounded, half an ulp at 1 each
    assert sums.shape == (B, H, S, groups.num_groups) and (sums.double() - ref).abs().max() <= tol


def test_run_sums_of_runs_out_of_sequence_order_match_the_indicator():
    """Groups whose runs are not in sequence order (the text group last) are summed run by run."""
    from cogattn.exact.key_groups import KeyGroups
    from cogattn.exact.passes import run_sums

    groups = KeyGroups(torch.arange(7), torch.tensor([0, 0, 2, 2, 1, 1, 3]), 4)
    probs = torch.arange(7.0).repeat(1, 1, 1)
    assert run_sums(probs, groups.runs).tolist() == (probs @ groups.indicator(7)).tolist() == [[[1.0, 9.0, 5.0, 6.0]]]


def test_video_to_text_holds_nothing_for_unformed_video_rows():
    """With the text first and a query limit inside the video, the video queries past it hold 0."""
    from cogattn.exact.reducers import REDUCERS

    layout = TokenLayout(2, 2, 2, 2)  # S = 10: text 0-1, video 2-9
    red = REDUCERS["video_to_text"](layout, 1, False)
    out = torch.ones(red.shape(1)[1:])
    red.clear_unformed(out, 6)  # rows 6..9 are video tokens 4..7
    flat = out.view(1, 2, 8)
    assert flat[..., :4].eq(1).all() and flat[..., 4:].eq(0).all()


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("budget", [40_000, 2**30])
def test_a_query_key_mask_gives_masked_pairs_exactly_zero_in_every_kind(mean, budget):
    """A block-causal mask (SkyReels-V2's diffusion forcing: a frame block attends itself and the blocks
    before it) applied by row tiles, at any tile size: every kind equals the naive softmax with masked
    scores at -inf, and a fused method is refused."""
    torch.manual_seed(3)
    layout = TokenLayout(0, 4, 2, 3)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    block = torch.arange(S) // (2 * 2 * 3)  # two latent frames a block
    mask = block[None, :] <= block[:, None]  # (S, S): query row, key column
    queries = torch.tensor([0, S - 1, 7])
    kinds = [kd for kd in KINDS if kd not in ("video_to_text", "text_to_video")]  # no text here
    reducers = [REDUCERS[kd](layout, H, mean, queries, **SIZES) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, budget, "rows", q.device)
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan, mask=mask, value=_value(q))
    scores = q[None].double() @ k[None].double().transpose(-1, -2) / D**0.5
    P = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    assert bool((P[0][:, ~mask] == 0).all())
    _assert_masked_kinds(kinds, outs, P, layout, mean, queries.tolist(), _value(q)[None])
    full = outs[kinds.index("full")]
    assert bool((full[:, ~mask] == 0).all()) if not mean else bool((full[0][~mask] == 0).all())
    sdpa = plan_tiles(reducers, S, H, D, budget, "sdpa", q.device)
    with pytest.raises(ValueError, match="row tiles only"):
        capture(q, k, reducers, outs, sdpa, mask=mask)


@pytest.mark.parametrize("mean", [False, True])
def test_a_mask_per_head_over_token_groups_follows_the_selected_heads(mean):
    """A per-head mask over groups of tokens (``processor.GroupMask``: NABLA's blocks), heads [2, 0] selected:
    every kind equals the naive softmax of each selected head under its own mask, masked pairs exactly 0."""
    from cogattn.recorder.processor import GroupMask

    torch.manual_seed(4)
    layout = TokenLayout(0, 4, 2, 3)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    group = torch.randperm(S) // 4  # 6 groups of 4 tokens, scattered over the sequence
    keep = (torch.rand(H, 6, 6) < 0.5) | torch.eye(6, dtype=torch.bool)
    heads = torch.tensor([2, 0])
    kinds = [kd for kd in KINDS if kd not in ("video_to_text", "text_to_video")]
    reducers = [REDUCERS[kd](layout, 2, mean, torch.tensor([0, 9]), **SIZES) for kd in kinds]
    plan = plan_tiles(reducers, S, 2, D, 40_000, "rows", q.device)
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan, heads, mask=GroupMask(keep, group), value=_value(q))
    mask = keep[heads][:, group][:, :, group]  # (2, S, S): each selected head's token mask
    scores = q[heads][None].double() @ k[heads][None].double().transpose(-1, -2) / D**0.5
    P = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    _assert_masked_kinds(kinds, outs, P, layout, mean, [0, 9], _value(q)[heads][None])
    if not mean:
        assert bool((outs[kinds.index("full")][~mask] == 0).all())


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("mean", [False, True])
def test_an_additive_bias_is_added_to_the_scaled_scores_in_the_captures_token_order(mean, rotated):
    """An additive bias (``processor.QueryKeyBias``: LTX-2's IC-LoRA, −10000·(1 − strength)), given in the model's
    token order with the order capture is handed its tokens in, heads [2, 0] selected: every kind equals the naive
    softmax of ``q·kᵀ·scale + bias`` (the bias reordered, entropy with its term); methods but rows refuse it."""
    from cogattn.recorder.processor import QueryKeyBias

    torch.manual_seed(5)
    layout = TokenLayout(0, 4, 2, 3)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    bias = -3 * torch.rand(S, S)  # the model's order
    bias[:, :4] = -10000.0  # keys no query reaches but by e^−10000: probability 0, as the model's
    order = torch.cat([torch.arange(S - 5, S), torch.arange(S - 5)])  # the last 5 tokens lead, as LTX-2's extras
    order = order if rotated else torch.randperm(S, generator=torch.Generator().manual_seed(1))
    assert (QueryKeyBias(bias[None], order).shift is not None) == rotated  # a rotation's rows: two slices
    heads = torch.tensor([2, 0])
    kinds = [kd for kd in KINDS if kd not in ("video_to_text", "text_to_video")]
    reducers = [REDUCERS[kd](layout, 2, mean, torch.tensor([0, 9]), **SIZES) for kd in kinds]
    plan = plan_tiles(reducers, S, 2, D, 40_000, "rows", q.device)
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan, heads, mask=QueryKeyBias(bias[None], order)[0], value=_value(q))
    scores = q[heads][None].double() @ k[heads][None].double().transpose(-1, -2) / D**0.5
    P = (scores + bias[order][:, order].double()).softmax(-1)
    _assert_masked_kinds(kinds, outs, P, layout, mean, [0, 9], _value(q)[heads][None])
    sdpa = plan_tiles(reducers, S, 2, D, 40_000, "sdpa", q.device)
    with pytest.raises(ValueError, match="row tiles only"):
        capture(q, k, reducers, outs, sdpa, heads, mask=QueryKeyBias(bias[None])[0])


def test_the_additive_masks_capture_takes_and_those_it_refuses(monkeypatch):
    from cogattn.recorder import processor
    from cogattn.recorder.processor import query_key_bias

    bias = -2 * torch.rand(1, 1, 6, 6)
    got = query_key_bias(bias.expand(2, 3, 6, 6), 2, 6)  # per head as prepare_attention_mask makes it: the same
    assert torch.equal(got.bias, bias.expand(2, 1, 6, 6)[:, 0]) and got.order is None
    assert query_key_bias(torch.zeros(2, 3, 6, 6), 2, 6) is None  # adds nothing
    with pytest.raises(ValueError, match="the same for every head"):
        query_key_bias(torch.cat([bias, 2 * bias], 1).expand(2, 2, 6, 6), 2, 6)
    monkeypatch.setattr(processor, "_SLAB", 2 * 6)  # compared a row at a time: a difference in the last row is seen
    late = bias.expand(2, 3, 6, 6).clone()
    late[1, 2, 5, 0] += 1
    with pytest.raises(ValueError, match="the same for every head"):
        query_key_bias(late, 2, 6)
    tail = torch.zeros(2, 3, 6, 6)
    tail[:, :, 5, 1] = -2.0  # a bias in the last row only: found
    assert query_key_bias(tail, 2, 6) is not None
    with pytest.raises(ValueError, match=r"\(B, H, 6, 6\); this call's mask is \(2, 3, 1, 6\)"):
        query_key_bias(bias[:, :, :1].expand(2, 3, 1, 6), 2, 6)
    with pytest.raises(ValueError, match="additive \\(float\\) mask"):
        query_key_bias(torch.ones(2, 1, 6, 6, dtype=torch.bool), 2, 6)


def test_the_masks_capture_takes_and_those_it_refuses():
    from cogattn.recorder.processor import query_key_mask

    causal = torch.ones(6, 6).tril().bool()[None, None]  # (1, 1, S, S)
    assert torch.equal(query_key_mask(causal, 2, 6), causal[:, 0])
    additive = torch.zeros(1, 1, 6, 6).masked_fill(~causal, float("-inf"))
    assert torch.equal(query_key_mask(additive, 2, 6), causal[:, 0])  # 0 / -inf: the same mask
    assert query_key_mask(torch.ones(2, 1, 6, 6, dtype=torch.bool), 2, 6) is None  # masks nothing
    with pytest.raises(ValueError, match="a bias"):
        query_key_mask(torch.randn(1, 1, 6, 6), 2, 6)
    with pytest.raises(ValueError, match=r"\(B or 1, 1, 6, 6\); this call's mask is \(1, 3, 6, 6\)"):
        query_key_mask(causal.expand(1, 3, 6, 6), 2, 6)  # a mask per head
    with pytest.raises(ValueError, match="leaves a query row no key"):
        query_key_mask(torch.zeros(1, 1, 6, 6, dtype=torch.bool), 2, 6)
    # every block of a call passes the same mask: read once, read again once it changes
    mask = torch.ones(1, 1, 6, 6).tril().bool()
    assert torch.equal(query_key_mask(mask, 2, 6), mask[:, 0]) and mask._cogattn_read[0][0] == mask._version
    mask.fill_(True)  # in place: another version
    assert query_key_mask(mask, 2, 6) is None


@pytest.mark.parametrize("gpu_tiles", [False, True])
def test_a_masks_rows_count_in_the_tiles_budget(gpu_tiles):
    """The rows of a mask a tile applies are counted in its budget: an additive bias's rows in its dtype (twice under
    an order that is no rotation) and in float32 (shared by the heads), a boolean mask's rows and their inverse, a group mask's per head; the tiles then fit the
    budget with them, where the same plan without them would not. (A CUDA capture's measured peak: test_gpu.py.)"""
    from cogattn.exact import memory, passes
    from cogattn.exact.planner import size_tiles
    from cogattn.recorder.processor import GroupMask, QueryKeyBias

    layout = TokenLayout(0, 8, 16, 16)
    H, S, D = 4, layout.seq_len, 64
    reducers = [REDUCERS["frame"](layout, H, False)]
    cap = None if gpu_tiles else 4 * 64 * S  # a GPU's tiles as large as the budget, or the CPU's cache-sized ones
    budget = 8 * 2**20
    plain = size_tiles("rows", reducers, S, H, D, budget, True, cap)
    bias = torch.zeros(1, S, S, dtype=torch.bfloat16)
    rotated = torch.cat([torch.arange(S - 5, S), torch.arange(S - 5)])
    masks = {  # bfloat16 rows, once or twice (an order's column gather), then float32; booleans and their inverse
        "bias": (QueryKeyBias(bias), (0, 6)),
        "rotated bias": (QueryKeyBias(bias, rotated), (0, 6)),
        "permuted bias": (QueryKeyBias(bias, torch.randperm(S, generator=torch.Generator().manual_seed(0))), (0, 8)),
        "bool": (torch.ones(1, S, S, dtype=torch.bool), (0, 2)),
        "groups": (GroupMask(torch.ones(H, 4, 4, dtype=torch.bool), torch.arange(S) % 4), (2, 0)),
    }
    for name, (mask, expected) in masks.items():
        cost = passes.mask_cost(mask)
        assert cost == expected, name
        if isinstance(mask, QueryKeyBias):  # an item's bias, moved, keeps its order's kind
            assert passes.mask_cost(mask[0].to("cpu")) == cost and mask[0].shift == mask.shift, name
        plan = size_tiles("rows", reducers, S, H, D, budget, True, cap, cost)
        held = cost[0] * plan.row_heads * plan.row_rows * S + cost[1] * plan.row_rows * S
        assert held + 4 * plan.row_heads * plan.row_rows * S <= plan.peak_bytes <= memory.usable(budget), name
        assert plan.row_rows <= plain.row_rows, name
        missed = cost[0] * plain.row_heads * plain.row_rows * S + cost[1] * plain.row_rows * S
        if gpu_tiles:  # tiles as large as the budget: without the mask's rows they would overrun it
            assert plain.peak_bytes + missed > memory.usable(budget), name


@pytest.mark.parametrize("method", ["rows", "sdpa"])
def test_a_recording_under_another_default_dtype_equals_the_float32_default_one(method):
    """``torch.set_default_dtype(torch.float64)`` (or bfloat16) in the user's script: every buffer the capture makes
    names its dtype, so a recording runs and stores what it stores under float32's default, bit for bit."""
    pooled = ("frame", "block", "tile", "query_frame", "video_to_text", "entropy", "received")
    kinds = RECORDED if method == "rows" else pooled
    pipe = tiny_pipeline(num_heads=2)
    sizes = dict(block_size=8, tile_shape=(1, 2, 2), queries=[0, (1, 2, 4)] if method == "rows" else None)
    sizes.update(patterns=("spatial",) if method == "rows" else None, topk=4)

    def record(default):
        torch.set_default_dtype(default)
        try:
            with cogattn.record(pipe, kinds=kinds, heads="all", method=method, **sizes) as rec:
                generate(pipe, steps=1, output_type="latent", prompt=PROMPT)  # no random embeddings: the same call
        finally:
            torch.set_default_dtype(torch.float32)
        return rec

    want, got = record(torch.float32), record(torch.float64)
    assert sorted(got.keys()) == sorted(want.keys()) and len(want.keys()) == len(kinds) * 2
    for key in want.keys():
        a, b = want.get(*key), got.get(*key)
        for x, y in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.mark.parametrize("position", ["start", "end"])
@pytest.mark.parametrize("method", ["rows", "sdpa"])
def test_text_kinds_of_a_layout_with_history_tokens_take_the_grid_s_tokens(position, method):
    """video_to_text's queries and text_to_video's keys are the grid's: a history before the grid (FramePack's,
    LTX-2's keyframes) is left out (they read the history as video and raised a shape error)."""
    layout = TokenLayout(5, 2, 2, 3, history_len=4, text_position=position)
    torch.manual_seed(0)
    H, S, D = 2, layout.seq_len, 16
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    kinds = ("video_to_text", "text_to_video")
    reducers = [REDUCERS[kind](layout, H, False) for kind in kinds]
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan_tiles(reducers, S, H, D, 2**26, method, "cpu"))
    P = naive_probs(q[None], k[None])[0]
    text, grid = slice(layout.text_start, layout.text_start + 5), layout.grid_tokens
    assert grid.stop - grid.start == 12 and (grid.start == 9 if position == "start" else grid.start == 4)
    want = (P[:, grid, text].transpose(1, 2), P[:, text, grid])  # (H, T, F·Hp·Wp)
    for got, ref in zip(outs, want):
        assert got.shape == (H, 5, 2, 2, 3) and (got.double().flatten(2) - ref).abs().max() <= 1e-6
