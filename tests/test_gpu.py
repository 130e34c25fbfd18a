"""CUDA paths: the fused kernel with log-sum-exp, pinned-memory streaming. Skipped without a GPU."""

import pytest
import torch
from reference import naive_kind, naive_probs
from tiny_calls import generate

import cogattn
from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sdpa_path_matches_naive(dtype):
    torch.manual_seed(0)
    layout = TokenLayout(8, 3, 3, 5)
    H, S, D = 3, layout.seq_len, 64
    q = (torch.randn(H, S, D) * 2).to("cuda", dtype)
    k = (torch.randn(H, S, D) * 2).to("cuda", dtype)
    kinds = ["frame", "video_to_text"]
    reducers = [REDUCERS[kd](layout, H, False) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, "sdpa", "cuda")
    outs = [torch.zeros(r.shape(1)[1:], device="cuda") for r in reducers]
    capture(q, k, reducers, outs, plan)
    P = naive_probs(q[None].cpu().float(), k[None].cpu().float())
    for kind, out in zip(kinds, outs):
        ref = naive_kind(P, kind, layout.text_len, layout.grid)[0]
        assert (out.cpu().double() - ref).abs().max() <= 1e-5, kind


def test_cuda_generation_bit_identical_and_streamed(tmp_path):
    pipe = tiny_pipeline(dtype=torch.bfloat16).to("cuda")
    stock = generate(pipe)
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond") as mem:
        in_memory = generate(pipe)
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond", save_dir=tmp_path / "run"):
        streamed = generate(pipe)
    assert torch.equal(in_memory, stock) and torch.equal(streamed, stock)
    run = cogattn.load(tmp_path / "run")
    for key in mem.keys():
        assert torch.equal(run.get(*key), mem.get(*key)), key


def test_cuda_auto_takes_the_kernel_and_matches_naive():
    """On CUDA with Triton, ``auto`` takes cogattn's kernels."""
    pytest.importorskip("triton")
    from reference import QKSpy, assert_matches_naive

    pipe = tiny_pipeline(dtype=torch.bfloat16, num_heads=2).to("cuda")
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond", heads="all", layer_output="lse") as rec:
        generate(pipe, output_type="latent")
    spy.remove()
    assert rec.plan.tiles.method == "triton"
    assert rec.chosen_methods and set(rec.chosen_methods.values()) == {"triton"}
    assert_matches_naive(rec, spy, [1], "all", kinds=("frame", "video_to_text"))


def test_cuda_joint_output_close_to_stock_and_maps_within_bf16():
    """``layer_output="joint"`` on CUDA: the widened call is another kernel than SDPA may pick, so its output
    equals the stock call's within bf16 rounding (checked per layer call, where rounding does not compound
    over steps), and the frame sums carry bf16 rounding."""
    from reference import QKSpy, assert_matches_naive

    from cogattn.exact.attention import attention_joint
    from cogattn.exact.engine import multi_key_indicator

    pipe = tiny_pipeline(dtype=torch.bfloat16, num_heads=2).to("cuda")
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond", heads="all", layer_output="joint") as rec:
        generate(pipe, output_type="latent")
    spy.remove()
    assert_matches_naive(rec, spy, [1], "all", kinds=("frame",), tol=2**-8)
    assert_matches_naive(rec, spy, [1], "all", kinds=("video_to_text",), tol=1e-5)
    indicator = multi_key_indicator(rec.plan.reducers, rec.layout.seq_len, "cuda")
    for q, k in (calls[0] for calls in spy.calls):
        v = torch.randn_like(q)
        out, _, _ = attention_joint(q, k, v, indicator)
        stock = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert (out.float() - stock.float()).abs().max() <= 2**-7 * stock.float().abs().max()


SPARSE_SIZES = dict(
    tile_shape=(2, 2, 3),
    patterns=("spatial", "temporal", "window:1", "sta:1,3,3", "radial"),
    top_p=(0.5, 0.9, 0.99, 1.0),
)


@pytest.mark.parametrize("method", ["rows", "sdpa", "triton"])
def test_cuda_sparse_kinds_match_naive(method):
    """The sparse-attention kinds on CUDA, every row-tile kind by torch's tiles (``rows``) and the kernel's
    (``triton``), and ``tile`` by each pooled method, equal the naive float64 reference of the same q, k and v
    (``pattern_error``'s needs V)."""
    from cogattn.reference import kind_error

    if method == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    layout = TokenLayout(8, 3, 4, 5)
    H, S, D = 3, layout.seq_len, 64
    q, k, v = ((torch.randn(H, S, D) * s).to("cuda") for s in (2, 2, 1))
    kinds = (
        ("tile", "top_p", "frame_max", "offset", "pattern_recall", "pattern_error")
        if method in ("rows", "triton")
        else ("tile",)
    )
    reducers = [REDUCERS[kd](layout, H, False, **SPARSE_SIZES) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, method, "cuda")
    assert plan.kernel_tiles == (method == "triton")
    outs = [torch.zeros(r.shape(1)[1:], device="cuda") for r in reducers]
    capture(q, k, reducers, outs, plan, value=v)
    P = naive_probs(q[None].cpu().double(), k[None].cpu().double())
    for kind, reducer, out in zip(kinds, reducers, outs):
        got = reducer.unpack(out[None].cpu())
        err = kind_error(got, P, kind, layout.text_len, layout.grid, v=v[None].cpu().double(), **SPARSE_SIZES)
        assert err <= 1e-5, (kind, err)


def test_cuda_sparse_kinds_in_a_generation_bit_identical():
    """A bf16 generation on CUDA recording the sparse-attention kinds: the video equals stock, and each map the
    naive reference of the spied q and k."""
    from reference import QKSpy, assert_matches_naive

    from cogattn.exact import tile_kernel

    pipe = tiny_pipeline(dtype=torch.bfloat16, num_heads=2).to("cuda")
    stock = generate(pipe)
    spy = QKSpy(pipe.transformer)
    kinds = ("tile", "top_p", "frame_max", "offset", "pattern_recall")
    real, tiles = tile_kernel.probs, []
    tile_kernel.probs = lambda *a, **kw: tiles.append(1) or real(*a, **kw)
    try:
        with cogattn.record(pipe, kinds=kinds, batch="cond", heads="all", **SPARSE_SIZES) as rec:
            out = generate(pipe)
    finally:
        tile_kernel.probs = real
    spy.remove()
    assert torch.equal(out, stock)
    assert rec.plan.tiles.kernel_tiles and len(tiles) >= 2 * 2  # auto on CUDA: every layer call's tiles by the kernel
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


def test_cuda_capture_under_a_bias_stays_within_its_budget():
    """Row tiles under an additive bias (LTX-2's IC-LoRA, bfloat16, reordered as LTX-2's tokens after the grid):
    the capture's measured peak above its inputs and outputs stays within the budget the tiles were planned for,
    the mask's rows counted (``passes.mask_cost``), and its frame sums equal the naive reference's."""
    from cogattn.exact import passes
    from cogattn.recorder.processor import QueryKeyBias

    torch.manual_seed(0)
    layout = TokenLayout(0, 8, 24, 32)
    H, S, D = 4, layout.seq_len, 64
    q, k = ((torch.randn(H, S, D) * 2).to("cuda", torch.bfloat16) for _ in range(2))
    bias = torch.zeros(S, S)
    bias[:, :512] = -2.0  # IC-LoRA's −10000·(1 − strength) at strength 0.9998
    order = torch.cat([torch.arange(S - 512, S), torch.arange(S - 512)])
    mask = QueryKeyBias(bias[None].to("cuda", torch.bfloat16), order.cuda())[0]
    reducers = [REDUCERS["frame"](layout, H, False)]
    budget = 64 * 2**20
    plan = plan_tiles(reducers, S, H, D, budget, "rows", "cuda", mask_cost=passes.mask_cost(mask))
    outs = [torch.zeros(r.shape(1)[1:], device="cuda") for r in reducers]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    capture(q, k, reducers, outs, plan, mask=mask)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    qd, kd = q.cpu().double(), k.cpu().double()
    P = (qd @ kd.transpose(-1, -2) / D**0.5 + bias[order][:, order].double())[None].softmax(-1)
    ref = naive_kind(P, "frame", 0, layout.grid)[0]
    assert (outs[0].cpu().double() - ref).abs().max() <= 1e-5
