"""The statistics kinds (entropy, received, query_frame, block, topk): the passes that serve them, how
``auto`` chooses, their spot checks, and how they are stored, read back and estimated. Their values on every
tiny model, method, budget and selection are checked against the naive reference in test_engine.py and
test_recording.py (every kind of ``cogattn.KINDS``)."""

import pytest
import torch
from reference import QKSpy, assert_matches_naive
from safetensors import safe_open
from tiny_calls import generate

import cogattn
import cogattn.exact.attention as attention
import cogattn.exact.checks as checks
import cogattn.exact.passes as passes
from cogattn.exact.reducers import TopK
from cogattn.models.cogvideox import tiny_pipeline

STATS = ("entropy", "received", "query_frame", "block", "topk")
SIZES = dict(block_size=7, topk=5)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    for name in ("ROWS_ONLY", "STOCK_OUTPUT"):
        monkeypatch.setattr(checks, name, set())


def _count_passes(monkeypatch) -> list:
    calls = []
    real = attention.sdpa_with_lse
    monkeypatch.setattr(attention, "sdpa_with_lse", lambda *a: calls.append(a[0].shape[-1]) or real(*a))
    return calls


@pytest.mark.parametrize(
    "kinds,output,widths",
    [
        (("entropy",), "stock", [16]),  # one pass, the keys as values; it gives the lse too
        (("received",), "stock", [16, 24]),  # the lse, then the swapped pass (16 + 1 columns, padded to 24)
        (("received",), "lse", [24]),  # the output call's lse: the swapped pass alone
        (("entropy", "query_frame"), "stock", [16, 16]),  # the keys, then the indicator as values
        (("entropy", "received"), "stock", [16, 24]),  # entropy's lse serves received
        (("entropy", "received", "frame"), "joint", [16, 24]),  # frame and the lse from the output call
    ],
)
def test_each_statistic_costs_the_passes_it_should_and_is_exact(monkeypatch, kinds, output, widths):
    pipe = tiny_pipeline(num_heads=3)
    stock = generate(pipe)
    spy = QKSpy(pipe.transformer)
    calls = _count_passes(monkeypatch)
    method = "auto" if output == "joint" else "sdpa"  # auto takes row tiles for two passes on a CPU
    with cogattn.record(pipe, kinds=kinds, heads="all", method=method, layer_output=output, verify=False) as rec:
        out = generate(pipe)
    spy.remove()
    assert torch.equal(out, stock)
    layer_calls = 2 * len(pipe.transformer.transformer_blocks)  # steps × layers, one batch item (cond)
    assert rec.plan.tiles.method == ("joint" if output == "joint" else "sdpa")
    assert calls == widths * layer_calls
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


CHOICES = [  # (kinds, sizes, on a CPU, on CUDA with Triton: cogattn's kernels whenever no rows are formed)
    (("entropy",), {}, "sdpa", "triton"),  # one pass: the keys as values
    (("query_frame",), {}, "sdpa", "triton"),  # one pass: 14 indicator columns
    (("received",), {}, "rows", "triton"),  # the lse, then the swapped pass: two
    (("received",), {"layer_output": "lse"}, "sdpa", "triton"),  # the output call's lse: one
    (("entropy", "received"), {}, "rows", "triton"),  # entropy's lse serves received: two
    (("block",), {}, "sdpa", "triton"),  # 139 blocks: runs of keys, each meeting at most 64: one pass
    (("block",), {"block_size": 2048}, "sdpa", "triton"),  # 9 blocks: one pass
    (("entropy", "received", "query_frame", "block"), {}, "rows", "triton"),  # three
    (("entropy", "received", "block"), {"block_size": 16}, "rows", "triton"),  # 1,111 blocks in runs of keys: three
    (("tile",), {"tile_shape": (1, 8, 8)}, "sdpa", "triton"),  # 313 tiles, each within its frame: one pass
    (("topk",), {}, "rows", "rows"),  # every score of a row
]


@pytest.mark.parametrize("kinds,sizes,cpu,cuda", CHOICES)
def test_auto_takes_row_tiles_where_one_row_pass_beats_the_fused_passes(kinds, sizes, cpu, cuda, monkeypatch):
    monkeypatch.setattr(cogattn.exact.planner.kernels, "available", lambda device: device.type == "cuda")
    for device, method in (("cpu", cpu), ("cuda", cuda)):
        est = cogattn.estimate(
            "THUDM/CogVideoX-2b", num_frames=49, height=480, width=720, num_inference_steps=50, kinds=kinds,
            device=device, **sizes,
        )  # fmt: skip
        assert est.layout.seq_len == 17_776 and est.tiles.method == method, device
        assert est.tiles.peak_bytes <= 2**30


def test_a_wrong_entropy_pass_is_caught_and_nothing_wrong_is_stored(monkeypatch):
    real = passes.entropy_pass
    monkeypatch.setattr(passes, "entropy_pass", lambda *a: (real(*a)[0] + 1e-3, real(*a)[1]))
    pipe = tiny_pipeline(num_heads=3)
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match=r"spot check failed: sdpa"):
        with cogattn.record(pipe, kinds=("entropy", "frame"), heads="all", method="sdpa") as rec:
            generate(pipe, output_type="latent")
    spy.remove()
    (check,) = rec.checks
    assert not check.passed and check.max_error > 1e-4
    assert_matches_naive(rec, spy, [1], "all", kinds=("entropy", "frame"))


def test_stored_statistics_read_back_with_their_sizes_and_topk_keeps_float32(tmp_path):
    pipe = tiny_pipeline()
    kw = dict(kinds=STATS, heads="all", **SIZES)
    with cogattn.record(pipe, **kw) as mem:
        generate(pipe, output_type="latent")
    with cogattn.record(pipe, save_dir=tmp_path / "run", storage_dtype="bfloat16", **kw):
        generate(pipe, output_type="latent")
    run = cogattn.load(tmp_path / "run")
    assert (run.block_size, run.topk) == (7, 5) == (mem.block_size, mem.topk)
    assert run.meta["selection"]["block_size"] == 7 and run.meta["selection"]["topk"] == 5
    got, want = run.get("topk", 1, 0), mem.get("topk", 1, 0)
    assert isinstance(got, TopK) and got.indices.dtype == torch.long and got.values.shape == (1, 2, 53, 5)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)  # float32 on disk
    with safe_open(str(tmp_path / "run" / run.record_info("topk", 1, 0).file), "pt") as f:
        assert f.get_slice("map").get_dtype() == "F32"
    entropy = run.get("entropy", 1, 0)
    assert torch.equal(entropy, mem.get("entropy", 1, 0).bfloat16().float())
    assert torch.equal(run.get("entropy", 1, 0, index=(0, 1, slice(3, 9))), entropy[0, 1, 3:9])
    assert run.get("block", 0, 1).shape == (1, 2, 8, 8)  # ⌈53 / 7⌉ blocks
    partial = run.get("topk", 0, 0, index=(0, 1, slice(0, 4)))
    assert torch.equal(partial.indices, run.get("topk", 0, 0).indices[0, 1, :4])


def test_topk_partial_reads_index_values_and_indices_of_shape_b_h_s_k(tmp_path):
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds="topk", heads="all", topk=5, save_dir=tmp_path / "run"):
        generate(pipe, steps=1, output_type="latent")
    run = cogattn.load(tmp_path / "run")
    full = run.get("topk", 0, 0)  # (1, 2, 53, 5) each, sliced by hand below
    indices = [(0, 1, 7, 0), (0, 1, 7, slice(1, 3)), (0, 1, slice(None), 0), (..., 2), (0, slice(None), 3, -1), 0]
    for index in indices:
        got = run.get("topk", 0, 0, index=index)
        assert torch.equal(got.values, full.values[index]) and torch.equal(got.indices, full.indices[index]), index
    assert run.get("topk", 0, 0, index=(0, 1, 7, 0)).values.item() == full.values[0, 1, 7].max()
    with pytest.raises(ValueError, match=r"has 5 entries.*\(B, H, S, k\)"):  # not the stored (value, key) axis
        run.get("topk", 0, 0, index=(0, 1, 7, slice(None), 0))


def test_estimate_predicts_the_records_a_run_writes(tmp_path):
    kw = dict(kinds=STATS, heads=[1, 0], storage_dtype="float16", **SIZES)
    est = cogattn.estimate("tiny", num_frames=9, height=48, width=80, num_inference_steps=2, batch="cond", **kw)
    pipe = tiny_pipeline()
    with cogattn.record(pipe, save_dir=tmp_path / "run", **kw):
        generate(pipe, output_type="latent")
    written = sum(f.stat().st_size for f in (tmp_path / "run").rglob("*.safetensors"))
    assert est.num_records == len(cogattn.load(tmp_path / "run")) == len(STATS) * 2 * 2
    assert est.record_bytes == written


@pytest.mark.parametrize(
    "option,value", [("block_size", 0), ("block_size", 2.5), ("topk", True), ("topk", "32"), ("topk", -1)]
)
def test_bad_sizes_are_refused(option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive int"):
        cogattn.CaptureOptions(kinds=("block", "topk"), **{option: value})


def test_cpu_row_tiles_are_cache_sized_one_head_at_a_time():
    from cogattn.exact.planner import CPU_ROW_TILE, plan_tiles
    from cogattn.exact.reducers import REDUCERS
    from cogattn.layout import TokenLayout

    layout = TokenLayout(226, 13, 30, 45)  # CogVideoX-2b at 49 frames
    S = layout.seq_len
    for mean in (False, True):
        reducers = [REDUCERS[k](layout, 30, mean) for k in ("entropy", "received", "block", "topk")]
        cpu = plan_tiles(reducers, S, 30, 64, 2**30, "auto", "cpu")
        assert cpu.method == "rows" and cpu.row_heads == 1 and 4 * cpu.row_rows * S <= CPU_ROW_TILE
        assert 4 * (cpu.row_rows + 1) * S > CPU_ROW_TILE and cpu.peak_bytes <= 2**30
        gpu = plan_tiles(reducers, S, 30, 64, 2**30, "rows", "cuda")  # as large as the budget allows
        assert gpu.row_heads == 30 and gpu.peak_bytes <= 2**30 < gpu.peak_bytes * 1.1


def test_a_wrong_received_pass_is_caught(monkeypatch):
    real = passes.received_pass
    monkeypatch.setattr(passes, "received_pass", lambda *a: real(*a) * 1.001)
    pipe = tiny_pipeline(num_heads=3)
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match=r"spot check failed: sdpa"):
        with cogattn.record(pipe, kinds=("received",), heads="all", method="sdpa") as rec:
            generate(pipe, output_type="latent")
    spy.remove()
    (check,) = rec.checks
    assert not check.passed and check.max_error > 1e-4
    assert_matches_naive(rec, spy, [1], "all", kinds=("received",))  # recomputed on row tiles


@pytest.mark.parametrize("logit", [5.0, 60.0])
def test_the_entropy_check_holds_peaked_rows_of_large_logits(logit):
    """lse − scale·q·(PK) cancels numbers of the size of the largest logit: the check counts the error per
    unit of |lse|, so a correct pass on rows with logits of 60 passes, and the values stay within 1e-4."""
    from cogattn.exact.checks import RowProbe, Verifier, probe_rows
    from cogattn.exact.engine import capture
    from cogattn.exact.planner import plan_tiles
    from cogattn.exact.reducers import REDUCERS
    from cogattn.layout import TokenLayout
    from cogattn.reference import naive_kind, naive_probs

    torch.manual_seed(0)
    layout = TokenLayout(10, 4, 9, 10)
    H, S, D = 4, layout.seq_len, 64
    q = torch.randn(H, S, D)
    k = torch.nn.functional.normalize(torch.randn(H, S, D), dim=-1) * logit  # q·k/8 up to ~logit
    reducers = [REDUCERS["entropy"](layout, H, False), REDUCERS["received"](layout, H, False)]
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    probe = RowProbe(probe_rows(layout), H)
    capture(q, k, reducers, outs, plan_tiles(reducers, S, H, D, 2**30, "sdpa", "cpu"), probe=probe)
    check = Verifier(True).check_maps([(0, probe)], q[None], k[None], None, reducers, 0, 0, "sdpa", D**-0.5)
    assert check.passed, check
    P = naive_probs(q[None], k[None])
    assert (outs[0].double() - naive_kind(P, "entropy", 10, layout.grid)[0]).abs().max() <= 1e-4
    assert (outs[1].double() - naive_kind(P, "received", 10, layout.grid)[0]).abs().max() <= 1e-4


def test_one_block_per_token_and_topk_of_the_mean_beside_a_pooled_kind():
    from reference import assert_topk

    from cogattn.exact.engine import capture
    from cogattn.exact.planner import plan_tiles
    from cogattn.exact.reducers import REDUCERS
    from cogattn.layout import TokenLayout
    from cogattn.reference import naive_kind, naive_probs

    torch.manual_seed(1)
    layout = TokenLayout(3, 2, 3, 4)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    reducers = [REDUCERS["block"](layout, H, True, block_size=1), REDUCERS["topk"](layout, H, True, topk=S + 5)]
    plan = plan_tiles(reducers, S, H, D, 2**30, "auto", "cpu")
    assert plan.method == "sdpa"  # the head-mean rows of topk serve no per-head kind: block takes its pass
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan)
    P = naive_probs(q[None], k[None])
    block = naive_kind(P, "block", 3, layout.grid, block_size=1)[0].mean(0, keepdim=True)
    assert (outs[0].double() - block).abs().max() <= 1e-5  # block_size 1: P itself, head-mean
    assert_topk(REDUCERS["topk"].unpack(outs[1][None]), P.mean(1, keepdim=True), 1e-5)  # k = S: every key
