"""The fused Triton kernel for key-pooled sums, on the CPU through Triton's interpreter."""

import math

import pytest
import torch

pytest.importorskip("triton")

from reference import QKSpy, assert_matches_naive, naive_kind, naive_probs
from tiny_calls import generate

import cogattn
from cogattn.exact import kernels
from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,D,C", [(150, 16, 5), (53, 32, 21), (64, 16, 1), (40, 16, 300)])  # 300: 3 launches
def test_pooled_sums_match_naive(dtype, S, D, C):
    torch.manual_seed(0)
    H = 2
    q, k = (torch.randn(H, S, D) * 2).to(dtype), (torch.randn(H, S, D) * 2).to(dtype)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    ind = torch.zeros(S, C)
    ind[torch.arange(S), torch.randint(0, C, (S,))] = 1
    out = kernels.pooled_sums(
        q.to(DEVICE), k.to(DEVICE), torch.logsumexp(scores, -1).float().to(DEVICE), ind.to(DEVICE)
    )
    ref = torch.softmax(scores, -1) @ ind.double()
    assert out.shape == (H, S, C) and out.dtype == torch.float32
    assert (out.cpu().double() - ref).abs().max() <= 1e-5


def test_bad_head_dim_refused():
    with pytest.raises(ValueError, match="head dim 24 is not a power of two"):
        kernels.pooled_sums(torch.zeros(1, 8, 24), torch.zeros(1, 8, 24), torch.zeros(1, 8), torch.zeros(8, 2))


@pytest.mark.parametrize("mean", [False, True])
def test_engine_triton_path_matches_naive(mean):
    torch.manual_seed(3)
    layout = TokenLayout(5, 2, 7, 3)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    kinds = ["frame", "video_to_text", "entropy", "received", "query_frame", "block"]
    reducers = [REDUCERS[kd](layout, H, mean, block_size=6) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, "triton", DEVICE)
    assert plan.method == "triton"
    outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
    capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan)
    P = naive_probs(q[None], k[None])
    for kind, out in zip(kinds, outs):
        ref = naive_kind(P, kind, layout.text_len, layout.grid, block_size=6)[0]
        ref = ref.mean(0, keepdim=True) if mean else ref
        assert (out.cpu().double() - ref).abs().max() <= (1e-4 if kind == "entropy" else 1e-5), kind


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("queries", [False, True])
def test_engine_triton_path_under_key_counts_without_another_lse(mean, queries):
    """Text after the video, padded keys dropped (a key far above every row's lse among them, which an
    unmasked kernel would turn into inf · 0), and no entropy pass: the kernel's lse is over the kept keys
    alone. With query counts (Mochi), the unformed rows are left out too."""
    torch.manual_seed(4)
    layout = TokenLayout(6, 3, 2, 3, text_position="end")
    H, S, D, K = 2, layout.seq_len, 16, layout.seq_len - 3
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    k[:, S - 1] = q[:, 0] * 40  # masked: never attended
    kinds = ["frame", "video_to_text", "received", "query_frame", "block"]
    reducers = [REDUCERS[kd](layout, H, mean, block_size=7) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, "triton", DEVICE)
    outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
    capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan, keys=K, queries=K if queries else None)
    n = K if queries else S  # the formed query rows; a shorter item's text is as much shorter
    P = naive_probs(q[None, :, :n], k[None, :, :K])
    for kind, out in zip(kinds, outs):
        ref = naive_kind(P, kind, layout.text_len - (S - K), layout.grid, block_size=7, text_at_end=True)[0]
        if not queries:  # every row formed, the masked keys' columns 0
            P_full = torch.nn.functional.pad(naive_probs(q[None], k[None, :, :K]), (0, S - K))
            ref = naive_kind(P_full, kind, layout.text_len, layout.grid, block_size=7, text_at_end=True)[0]
        ref = ref.mean(0, keepdim=True) if mean else ref
        got = out.cpu().double()[tuple(slice(0, m) for m in ref.shape)]
        assert torch.isfinite(out).all() and (got - ref).abs().max() <= 1e-5, kind


def _record_tiny(**record_kw):
    """A 2-step tiny generation without and with ``cogattn.record(**record_kw)``: (stock, captured, rec, spy)."""
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    stock = generate(pipe)
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond", heads="all", **record_kw) as rec:
        out = generate(pipe)
    spy.remove()
    return stock, out, rec, spy


def _assert_maps_match_naive(rec, spy):
    assert_matches_naive(rec, spy, [1], "all", kinds=("frame", "video_to_text"))


@pytest.fixture
def timed_on_this_device(monkeypatch):
    """``auto`` as on CUDA with Triton: the first capture of a shape times the kernel against the SDPA pass."""
    import cogattn.exact.planner as planner

    monkeypatch.setattr(planner, "can_time_triton", kernels.available)


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the calls of the CPU path (its output call gives the lse); "
                    "tests/test_gpu.py times the passes on CUDA")  # fmt: skip
@pytest.mark.parametrize("slow", ["triton", "sdpa", "broken"])
def test_auto_times_both_passes_and_keeps_the_faster(timed_on_this_device, monkeypatch, recwarn, slow):
    import time

    import cogattn.exact.attention as attention

    real_kernel, real_sdpa = kernels.pooled_sums, attention.sdpa_with_lse
    calls = {"triton": 0, "sdpa": 0}

    def kernel(*a, **kw):
        if slow == "broken":
            raise RuntimeError("no kernel image is available for execution on the device")
        calls["triton"] += 1
        time.sleep(0.3 if slow == "triton" else 0)
        return real_kernel(*a, **kw)

    def sdpa(*a, **kw):
        calls["sdpa"] += 1
        time.sleep(0.3 if slow == "sdpa" else 0)
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(kernels, "pooled_sums", kernel)
    monkeypatch.setattr(attention, "sdpa_with_lse", sdpa)
    stock, out, rec, spy = _record_tiny(layer_output="lse")
    failed = [w for w in recwarn if "Triton pooled-sum kernel failed" in str(w.message)]
    assert len(failed) == (slow == "broken")
    assert torch.equal(out, stock)
    assert rec.plan.tiles.method == "timed"
    (choice,) = rec.chosen_methods.values()
    assert choice == ("sdpa" if slow in ("triton", "broken") else "triton")
    # the probe ran each pass once (the kernel twice: build, then timed); all 4 captures then ran the choice
    probe = {"triton": 0 if slow == "broken" else 2, "sdpa": 1 if slow != "broken" else 0}
    other = "sdpa" if choice == "triton" else "triton"
    assert calls[choice] == probe[choice] + 4 and calls[other] == probe[other]
    _assert_maps_match_naive(rec, spy)
