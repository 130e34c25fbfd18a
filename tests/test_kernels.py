"""The fused Triton kernel for key-pooled sums, on the CPU through Triton's interpreter."""

import math

import pytest
import torch

pytest.importorskip("triton")

from reference import QKSpy, assert_matches_naive, naive_kind, naive_probs
from tiny_calls import generate

import cogattn
from cogattn.exact import checks, kernels, tile_kernel
from cogattn.exact.engine import capture
from cogattn.exact.key_groups import KeyGroups
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _naive(q, k, heads, keys):
    """float64 probabilities ``(h, S, keys)`` of the selected heads over the first ``keys`` keys, and their lse."""
    scores = q[heads].double() @ k[heads, :keys].double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, -1), torch.logsumexp(scores, -1)


# (S, D, groups): frames as runs in key order; groups of 5 keys (several per key tile) and of 150 (one over
# several tiles); random groups with keys in none (read through a permutation); ragged tails everywhere
GROUPINGS = [(150, 16, "runs20"), (133, 32, "runs5"), (200, 16, "runs150"), (150, 16, "random")]


def _groups(S, how):
    if how == "random":
        g = torch.Generator().manual_seed(1)
        kept = torch.rand(S, generator=g) < 0.85
        return KeyGroups(torch.arange(S)[kept], torch.randint(0, 7, (S,), generator=g)[kept], 7)
    size = int(how[4:])
    return KeyGroups(torch.arange(S), torch.arange(S) // size, -(-S // size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,D,how", GROUPINGS)
@pytest.mark.parametrize("given", [False, True])
def test_sweep_matches_naive(dtype, S, D, how, given):
    """Group sums, lse and entropy of selected heads of a transposed (strided) q, with a key mask keeping all
    but the last keys, against the float64 softmax; online (no lse) and given the lse."""
    torch.manual_seed(0)
    H, K = 4, S - 9
    q = (torch.randn(S, H, D) * 2).to(dtype).transpose(0, 1)  # (H, S, D), not contiguous: read through strides
    k = (torch.randn(H, S, D) * 2).to(dtype)
    heads = torch.tensor([2, 0, 3])
    groups = _groups(S, how)
    order = kernels.key_order(groups, K, DEVICE)
    assert (order.perm is None) == (how != "random")
    P, lse = _naive(q, k, heads, K)
    swept = kernels.sweep(
        q.to(DEVICE), k.to(DEVICE), order, heads, lse.float().to(DEVICE) if given else None, True, keys=K
    )
    ind = groups.indicator(S, torch.float64)[:K]
    entropy = -(P * P.clamp_min(1e-300).log()).sum(-1)
    assert swept.sums.shape == (3, S, groups.num_groups) and swept.sums.dtype == torch.float32
    assert (swept.sums.cpu().double() - P @ ind).abs().max() <= 1e-5
    assert (swept.lse.cpu().double() - lse).abs().max() <= 1e-5
    assert (swept.entropy.cpu().double() - entropy).abs().max() <= 1e-4


def test_sweep_without_groups_gives_the_lse_and_entropy():
    torch.manual_seed(1)
    q, k = torch.randn(2, 70, 16) * 3, torch.randn(2, 70, 16) * 3
    swept = kernels.sweep(q.to(DEVICE), k.to(DEVICE), kernels.key_order(None, 70, DEVICE), entropy=True)
    P, lse = _naive(q, k, torch.arange(2), 70)
    assert swept.sums is None and (swept.lse.cpu().double() - lse).abs().max() <= 1e-5
    assert (swept.entropy.cpu().double() + (P * P.log()).sum(-1)).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_received_matches_naive(dtype):
    """The mass each kept key receives from the formed query rows (the rows past a query limit add nothing)."""
    torch.manual_seed(2)
    S, K, NQ = 140, 131, 120
    q, k = (torch.randn(3, S, 32) * 2).to(dtype), (torch.randn(3, S, 32) * 2).to(dtype)
    heads = torch.tensor([1, 2])
    P, lse = _naive(q, k, heads, K)
    mass = kernels.received(q.to(DEVICE), k.to(DEVICE), lse.float().to(DEVICE), heads, queries=NQ, keys=K)
    assert mass.shape == (2, K)
    assert (mass.cpu().double() - P[:, :NQ].sum(1)).abs().max() <= 1e-5


def test_bad_head_dim_refused():
    with pytest.raises(ValueError, match="head dim 24 is not a power of two"):
        kernels.sweep(torch.zeros(1, 8, 24), torch.zeros(1, 8, 24), kernels.key_order(None, 8, "cpu"))
    with pytest.raises(ValueError, match="needs a head dim that is a power of two"):
        plan_tiles([REDUCERS["frame"](TokenLayout(2, 1, 2, 2), 1, False)], 6, 1, 24, 2**30, "triton", DEVICE)


@pytest.mark.parametrize("mean", [False, True])
def test_engine_triton_path_matches_naive(mean):
    torch.manual_seed(3)
    layout = TokenLayout(5, 2, 7, 3)
    H, S, D = 3, layout.seq_len, 16
    q, k = torch.randn(H, S, D) * 2, torch.randn(H, S, D) * 2
    kinds = ["frame", "video_to_text", "entropy", "received", "query_frame", "block", "tile"]
    reducers = [REDUCERS[kd](layout, H, mean, block_size=6, tile_shape=(1, 2, 2)) for kd in kinds]
    plan = plan_tiles(reducers, S, H, D, 2**30, "triton", DEVICE)
    assert plan.method == "triton"
    outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
    capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan)
    P = naive_probs(q[None], k[None])
    for kind, out in zip(kinds, outs):
        ref = naive_kind(P, kind, layout.text_len, layout.grid, block_size=6, tile_shape=(1, 2, 2))[0]
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
def kernel_on_this_device(monkeypatch):
    """``auto`` as on CUDA with Triton: it takes cogattn's kernels."""
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: kernels.available(device))


@pytest.mark.parametrize("broken", [False, True])
def test_auto_takes_the_kernel_and_falls_back_where_it_fails(kernel_on_this_device, monkeypatch, recwarn, broken):
    """``auto`` runs the kernels (no timing of other passes); where they fail to build or run, one warning, that
    shape takes the SDPA pass from then on, and the maps are still exact."""
    import cogattn.exact.attention as attention

    real_sweep, real_sdpa = kernels.sweep, attention.sdpa_with_lse
    calls = {"triton": 0, "sdpa": 0}

    def sweep(*a, **kw):
        calls["triton"] += 1
        if broken:
            raise RuntimeError("no kernel image is available for execution on the device")
        return real_sweep(*a, **kw)

    def sdpa(*a, **kw):
        calls["sdpa"] += 1
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(kernels, "sweep", sweep)
    monkeypatch.setattr(attention, "sdpa_with_lse", sdpa)
    stock, out, rec, spy = _record_tiny(layer_output="lse")
    failed = [w for w in recwarn if "Triton kernel failed" in str(w.message)]
    assert len(failed) == broken
    assert torch.equal(out, stock)
    assert rec.plan.tiles.method == "triton"
    assert list(rec.chosen_methods.values()) == ["sdpa" if broken else "triton"]
    layer_calls = 2 * 2  # 2 steps × 2 layers, the conditional item
    assert calls["triton"] == (1 if broken else layer_calls)  # tried once, then that shape keeps the SDPA pass
    assert calls["sdpa"] == (layer_calls if broken else 0)
    _assert_maps_match_naive(rec, spy)


SERVED = ["frame", "block", "tile", "query_frame", "video_to_text", "entropy", "received"]


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the kernel calls of the CPU path")
@pytest.mark.parametrize("kind", SERVED)
def test_method_triton_runs_the_kernel_for_every_served_kind(kind, monkeypatch):
    """``method="triton"`` goes through the kernels for each kind it serves (no silent fallback to another pass),
    and the maps match the naive softmax of the q and k the processors handed over."""
    import cogattn.exact.engine as engine

    real_sweep, real_received = kernels.sweep, kernels.received
    calls = []
    monkeypatch.setattr(kernels, "sweep", lambda *a, **kw: calls.append("sweep") or real_sweep(*a, **kw))
    monkeypatch.setattr(kernels, "received", lambda *a, **kw: calls.append("received") or real_received(*a, **kw))
    monkeypatch.setattr(engine, "pooled_pass", lambda *a, **kw: pytest.fail("the SDPA pass ran"))
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    sizes = {"block_size": 8, "tile_shape": (1, 2, 2)}
    with cogattn.record(pipe, kinds=(kind,), batch="cond", heads="all", method="triton", **sizes) as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    layers = len(pipe.transformer.transformer_blocks)
    assert rec.plan.tiles.method == "triton" and all(c.what == "triton" for c in rec.checks)
    # received: a launch a layer call, and the first call's spot check runs the kernel on its rows too
    assert calls.count("sweep") == layers and calls.count("received") == (layers + 1) * (kind == "received")
    assert_matches_naive(rec, spy, [1], "all", kinds=(kind,))


@pytest.fixture
def no_shape_failed(monkeypatch):
    """No shape sent to row tiles before: each test sees its own first check."""
    monkeypatch.setattr(checks, "ROWS_ONLY", set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_spot_check_runs_the_received_kernel(dtype, monkeypatch, no_shape_failed):
    """``method="triton"``: the check of ``received`` runs the kernel the capture ran (q and k in the model's dtype)
    on its rows with the lse the capture took, against their exact column sums: a kernel 5% off is caught, warned
    about once, and nothing it made is stored."""
    real = kernels.received
    seen = []

    def received(q, k, *a, **kw):
        seen.append(q.dtype)
        return real(q, k, *a, **kw) * 1.05

    monkeypatch.setattr(kernels, "received", received)
    pipe = tiny_pipeline(num_heads=2, dtype=dtype).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match=r"spot check failed: triton on") as warned:
        with cogattn.record(pipe, kinds="received", batch="cond", heads="all", method="triton") as rec:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    assert [(c.step, c.layer, c.what, c.passed) for c in rec.checks] == [(0, 0, "triton", False)]
    assert rec.checks[0].max_error > 1e-3 and len([w for w in warned if "spot check" in str(w.message)]) == 1
    assert seen == [dtype, dtype]  # the capture's launch and the check's, in the model's dtype
    assert_matches_naive(rec, spy, [1], "all", kinds=("received",))


def test_a_failed_check_of_the_kernel_shows_in_chosen_methods(kernel_on_this_device, monkeypatch, no_shape_failed):
    """``auto`` takes the kernel; its group sums are off, the spot check fails and the shape goes to row tiles:
    ``rec.chosen_methods`` says ``"rows"`` for it, and the maps are exact."""
    real = kernels.sweep

    def sweep(*a, **kw):
        out = real(*a, **kw)
        if out.sums is not None:
            out.sums.mul_(1.01)
        return out

    monkeypatch.setattr(kernels, "sweep", sweep)
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match="spot check failed: triton"):
        with cogattn.record(pipe, kinds="frame", batch="cond", heads="all", method="auto") as rec:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    assert [(c.what, c.passed) for c in rec.checks] == [("triton", False)]
    assert list(rec.chosen_methods.values()) == ["rows"]
    assert_matches_naive(rec, spy, [1], "all", kinds=("frame",))


COMPILE = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cogattn.exact import kernels, tile_kernel

tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
stacks, scales = [], []
for name, signature, constants, warps, stages in json.loads(sys.argv[1]):
    sig = dict(signature, **dict.fromkeys(constants, "constexpr"))
    src = ASTSource(fn=getattr(kernels, name, None) or getattr(tile_kernel, name), signature=sig, constexprs=constants)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    stacks.append(int(re.search(r"STACK:(\\d+)", usage.stdout).group(1)))
    ptx = compiled.asm["ptx"]  # the row tiles' scale back of a subnormal P: 2^-64, by a multiply that keeps it
    scales.append(name != "_probs_kernel" or ("0f1F800000" in ptx and not re.search(r"mul\\.[a-z.]*ftz", ptx)))
print(json.dumps([stacks, scales]))
"""

SWEEP_ARGS = "Q K HIDX KIDX GID LSE_IN OUT LSE_OUT ENT S NK scale sq_h sq_s sk_h sk_s so_h so_s sl_h".split()
SWEEP_TYPES = ["*bf16", "*bf16", "*i32", "*i32", "*i32", *["*fp32"] * 4, "i32", "i32", "fp32", *["i32"] * 7]
RECEIVED_ARGS = "Q K HIDX LSE OUT NQ NK scale sq_h sq_s sk_h sk_s sl_h so_h".split()
RECEIVED_TYPES = ["*bf16", "*bf16", "*i32", "*fp32", "*fp32", "i32", "i32", "fp32", *["i32"] * 6]
PROBS_ARGS = "Q K HIDX LSE OUT R NK S scale sq_h sq_s sk_h sk_s sl_h so_h so_r".split()
PROBS_TYPES = ["*bf16", "*bf16", "*i32", "*fp32", "*fp32", "i32", "i32", "i32", "fp32", *["i32"] * 7]


def test_kernels_compile_for_a_gpu_without_spilling():
    """Every launch config the autotuner may take builds for an H100/H200 with Triton's own compiler and ptxas (no
    GPU needed: the compiled path's front end, passes and register allocation, which the interpreter never runs),
    for bf16 (and float32), the lse found online, permuted key groups and entropy (the most the sweep carries), at head dims 64
    and 128, and keeps its state in registers (no stack: no spills); so do ``received`` and the row tiles' kernel, whose scale
    back of a subnormal probability is a multiply that does not flush it (no ``.ftz``)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    cuobjdump = os.path.join(os.path.dirname(kernels.triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("this Triton ships no cuobjdump")
    jobs = []
    for D in (64, 128):
        for bm, bn, warps, stages, _ in [c for c in kernels.CONFIGS if D <= c[-1]]:
            flags = dict(GIVEN_LSE=False, PERMUTED=True, GROUPS=True, ENTROPY=True, FP32=False, UPCAST=False)
            sweep = ["_sweep_kernel", dict(zip(SWEEP_ARGS, SWEEP_TYPES)), dict(D=D, BM=bm, BN=bn, **flags)]
            jobs.append([*sweep, warps, stages])
        fp32 = dict(zip(SWEEP_ARGS, SWEEP_TYPES), Q="*fp32", K="*fp32")  # a float32 model: 3×TF32 products
        jobs.append(["_sweep_kernel", fp32, dict(D=D, BM=64, BN=64, **dict(flags, FP32=True)), 4, 3])
        received = dict(D=D, BM=64, BN=64, FP32=False, UPCAST=False)
        jobs.append(["_received_kernel", dict(zip(RECEIVED_ARGS, RECEIVED_TYPES)), received, 4, 3])
        for bm, bn, warps, stages, _ in [c for c in tile_kernel.CONFIGS if D <= c[-1]]:  # the row tiles' kernel
            for fp32 in (False, True):  # bf16 products, and a float32 model's 3×TF32 ones
                tiles = dict(D=D, BM=bm, BN=bn, FP32=fp32, UPCAST=False)
                types = dict(zip(PROBS_ARGS, PROBS_TYPES), **(dict(Q="*fp32", K="*fp32") if fp32 else {}))
                jobs.append(["_probs_kernel", types, tiles, warps, stages])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled path, not the interpreter
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(jobs)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stacks, scales = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(scales), [j[0] for j, kept in zip(jobs, scales) if not kept]  # subnormal P kept on the GPU too
    spilled = [(j[0], j[2]["D"], j[2]["BM"], j[2]["BN"], j[3], j[4], s) for j, s in zip(jobs, stacks) if s]
    assert len(stacks) == len(jobs) and not spilled, spilled


def test_a_gpu_launch_takes_the_configs_of_its_head_dim(monkeypatch):
    """Compiled (not interpreted), each kernel launches through the autotuner holding the configs its head dim keeps
    in registers, over a grid of the tuned block: query blocks for the sweep, key blocks for ``received``."""
    seen = []

    class Tuned:  # stands in for Triton's autotuner: the grid it would launch under a config
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constants: seen.append((self.name, grid({"BM": 128, "BN": 32}), constants["D"]))

    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    monkeypatch.setattr(kernels, "_sweep_tuned", {64: Tuned("sweep ≤ 64"), 256: Tuned("sweep ≤ 256")})
    monkeypatch.setattr(kernels, "_received_tuned", {64: Tuned("received ≤ 64"), 256: Tuned("received ≤ 256")})
    q = torch.zeros(2, 300, 128, dtype=torch.bfloat16)
    kernels.sweep(q, q, kernels.key_order(None, 300, "cpu"), entropy=True)
    kernels.received(q[..., :64], q[..., :64], torch.zeros(2, 300), keys=290)
    assert seen == [("sweep ≤ 256", (3, 2), 128), ("received ≤ 64", (10, 2), 64)]
    assert all(d >= 64 for *_, d in kernels.CONFIGS) and any(d == 64 for *_, d in kernels.CONFIGS)


LATE = """
import os, torch
from cogattn.exact import kernels, planner
os.environ["TRITON_INTERPRET"] = "1"  # after the kernels were defined, compiled
assert not kernels.interpreted() and not kernels.available(torch.device("cpu"))
try:
    planner.choose_method("triton", [], 8, "cpu", 16)
except ValueError as err:
    print(err)
"""


def test_the_interpreter_asked_for_after_the_kernels_were_defined_is_refused_saying_so():
    """Triton reads ``TRITON_INTERPRET`` as it defines a kernel: set later, the kernels stay compiled for a GPU, so
    ``method="triton"`` on a CPU is refused in one line that says why, not a failure inside Triton at the first call."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", LATE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRITON_INTERPRET=1 was set after cogattn's kernels were defined" in done.stdout
