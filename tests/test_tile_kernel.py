"""Row tiles formed by cogattn's kernels (``exact/tile_kernel.py``), on the CPU through Triton's interpreter."""

import math

import pytest
import torch

pytest.importorskip("triton")

from reference import QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
from cogattn.exact import checks, engine, kernels, tile_kernel
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fresh(monkeypatch):
    """No shape checked or failed before: each test sees its own first check."""
    monkeypatch.setattr(tile_kernel, "CHECKED", {})
    monkeypatch.setattr(tile_kernel, "TORCH_TILES", set())


def _spy(monkeypatch, change=None):
    """Count the kernel's tiles (each changed by ``change`` when given) and fail on a torch tile."""
    real, calls = tile_kernel.probs, []

    def probs(*a, **kw):
        calls.append(1)
        out = real(*a, **kw)
        return out if change is None else change(out)

    monkeypatch.setattr(tile_kernel, "probs", probs)
    return calls


def test_the_plan_forms_tiles_by_kernel_where_asked_and_the_kernels_serve(monkeypatch):
    """``triton`` asked for row kinds alone where the kernels cannot run refuses, as it does for pooled kinds."""
    frame = [REDUCERS["full"](TokenLayout(2, 1, 2, 2), 1, False)]
    tiles = {m: plan_tiles(frame, 6, 1, 16, 2**30, m, "cpu").kernel_tiles for m in ("rows", "sdpa", "auto", "triton")}
    assert tiles == {"rows": False, "sdpa": False, "auto": False, "triton": True}  # auto: SDPA beats the interpreter
    with pytest.raises(
        ValueError, match="method='triton' needs a head dim that is a power of two from 16 to 256, not 24"
    ):
        plan_tiles(frame, 6, 1, 24, 2**30, "triton", "cpu")  # refused as for the pooled kinds, not torch's tiles
    with pytest.raises(ValueError, match="power of two from 16 to 256, not 512"):  # no tile config is sized for it
        plan_tiles(frame, 6, 1, 512, 2**30, "triton", "cpu")
    assert [kernels.takes_head_dim(d) for d in (8, 16, 24, 64, 128, 256, 512)] == [0, 1, 0, 1, 1, 1, 0]
    monkeypatch.setattr(kernels, "available", lambda device: False)  # no Triton, or a CPU without the interpreter
    with pytest.raises(ValueError, match="method='triton' needs Triton and a CUDA device"):
        plan_tiles(frame, 6, 1, 16, 2**30, "triton", "cpu")
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: True)  # as on CUDA with Triton
    assert plan_tiles(frame, 6, 1, 16, 2**30, "auto", "cpu").kernel_tiles


ROW_KINDS = ("full", "topk", "top_p", "frame_max", "offset", "pattern_recall")


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the kernel's tiles of the CPU path")
@pytest.mark.parametrize("method,kinds", [("triton", (*ROW_KINDS, "frame")), ("auto", ROW_KINDS)])
def test_a_recording_forms_every_row_kind_from_the_kernel(method, kinds, monkeypatch, fresh):
    """``method="triton"``, and ``auto`` where the kernels serve (CUDA; here the interpreter stands in): the row
    kinds' tiles come from the kernel (no torch tile), whichever method serves the key-pooled kinds, and match the
    naive softmax of the q and k the processors handed over."""
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: kernels.available(device))
    calls = _spy(monkeypatch)
    monkeypatch.setattr(engine, "_torch_tile", lambda *a, **kw: pytest.fail("a torch tile was formed"))
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    sizes = dict(patterns=("spatial",)) if "pattern_recall" in kinds else {}
    with cogattn.record(pipe, kinds=kinds, batch="cond", heads="all", method=method, **sizes) as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    layers = len(pipe.transformer.transformer_blocks)
    assert rec.plan.tiles.kernel_tiles and rec.plan.tiles.method == ("triton" if "frame" in kinds else "rows")
    assert len(calls) >= layers + 1  # the check's few rows, then at least a tile a layer call
    assert len(tile_kernel.CHECKED) == 1 and max(tile_kernel.CHECKED.values()) <= 1
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_tiles_over_the_kept_keys_match_the_naive_softmax(dtype, monkeypatch, fresh):
    """Ragged row and key tiles (S = 150 over 64-wide blocks), several row tiles, a key count (the padded keys,
    one far above every score among them, at probability 0), in float32 and bf16 q and k."""
    torch.manual_seed(5)
    layout = TokenLayout(6, 2, 8, 9)
    H, S, D, K = 2, layout.seq_len, 16, layout.seq_len - 7
    q, k = (torch.randn(H, S, D) * 2).to(dtype), (torch.randn(H, S, D) * 2).to(dtype)
    k[:, S - 1] = q[:, 0] * 40  # masked: never attended
    calls = _spy(monkeypatch)
    reducers = [REDUCERS["full"](layout, H, False)]
    plan = plan_tiles(reducers, S, H, D, 2**30, "triton", DEVICE)
    plan = type(plan)(**{**plan.__dict__, "row_heads": 1, "row_rows": 40})  # several row tiles and head chunks
    outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
    engine.capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan, keys=K)
    scores = q.double() @ k[:, :K].double().transpose(1, 2) / math.sqrt(D)
    ref = torch.nn.functional.pad(torch.softmax(scores, -1), (0, S - K))
    assert len(calls) == 1 + H * math.ceil(S / 40)
    assert torch.isfinite(outs[0]).all() and (outs[0].cpu().double() - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("broken", ["raises", "disagrees"])
def test_a_kernel_that_fails_its_check_is_warned_once_and_torch_forms_the_tiles(broken, monkeypatch, fresh):
    """The check runs before any tile is folded: a kernel that raises or is off by more than the bound warns once,
    its shape is put on torch tiles for the process, and the maps are exact."""

    def change(out):
        if broken == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return out.add_(1e-3)

    calls = _spy(monkeypatch, change)
    torch.manual_seed(6)
    layout = TokenLayout(4, 2, 4, 4)
    H, S, D = 2, layout.seq_len, 16
    q, k = torch.randn(H, S, D), torch.randn(H, S, D)
    reducers = [REDUCERS["full"](layout, H, False)]
    plan = plan_tiles(reducers, S, H, D, 2**30, "triton", DEVICE)
    with pytest.warns(UserWarning, match="row tiles on .* are not used for this shape") as warned:
        for _ in range(2):
            outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
            engine.capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan)
    assert len([w for w in warned if "row tiles" in str(w.message)]) == 1 and len(calls) == 1
    assert tile_kernel.TORCH_TILES == {(str(torch.device(DEVICE)), torch.float32, S, D, S)}
    ref = torch.softmax(q.double() @ k.double().transpose(1, 2) / math.sqrt(D), -1)
    assert (outs[0].cpu().double() - ref).abs().max() <= 1e-5


def test_a_gpu_launch_of_the_tiles_takes_the_configs_of_its_head_dim(monkeypatch):
    """Compiled (not interpreted), the tiles' kernel launches through the autotuner holding its configs for the head
    dim, over a grid of (row blocks, key blocks, heads) of the tuned block, for the tile's rows alone."""
    seen = []

    class Tuned:  # stands in for Triton's autotuner: the grid it would launch under a config
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constants: seen.append((self.name, grid({"BM": 128, "BN": 64}), args[5:9]))

    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    monkeypatch.setattr(tile_kernel, "_probs_tuned", {64: Tuned("≤ 64"), 256: Tuned("≤ 256")})
    q = engine.passes.HeadView(torch.zeros(3, 300, 128, dtype=torch.bfloat16), torch.tensor([0, 2]))
    heads = torch.tensor([0, 2], dtype=torch.int32)
    out = tile_kernel.probs(q, q, heads, 10, 150, torch.zeros(2, 300), 290, 0.5, torch.empty(2 * 140 * 300))
    assert seen == [("≤ 256", (2, 5, 2), (140, 290, 300, 0.5))] and out.shape == (2, 140, 300)
    assert all(d >= 128 for *_, d in tile_kernel.CONFIGS)


def _entropy_off(monkeypatch):
    """The kernels' sweep with its entropy off by 0.05 nats (its lse and sums right)."""
    real = kernels.sweep

    def sweep(*a, **kw):
        out = real(*a, **kw)
        if out.entropy is not None:
            out.entropy.add_(0.05)
        return out

    monkeypatch.setattr(kernels, "sweep", sweep)


def test_the_tiles_check_holds_the_sweeps_entropy_too(monkeypatch, fresh):
    """The ``entropy`` kind takes the chunk's sweep's entropy beside the tiles: a sweep whose entropy is off fails the
    shape's check, whose probabilities agree, and the shape takes torch's tiles."""
    _entropy_off(monkeypatch)
    torch.manual_seed(7)
    q, k = torch.randn(2, 40, 16).to(DEVICE), torch.randn(2, 40, 16).to(DEVICE)
    view = engine.passes.HeadView
    with pytest.warns(UserWarning, match="probabilities or entropy were off"):
        assert not tile_kernel.agrees(view(q, None), view(k, None), 40, 0.25)
    assert tile_kernel.TORCH_TILES == {(str(torch.device(DEVICE)), torch.float32, 40, 16, 40)}


@pytest.mark.parametrize("wrong", ["probs", "entropy"])
def test_a_recordings_kernel_tiles_are_spot_checked_and_nothing_wrong_is_stored(wrong, monkeypatch, fresh):
    """``auto`` where the kernels serve, with a row kind: the plan's method is ``rows``, the tiles and ``entropy`` the
    kernels'. Their shape agreed at its check once a process (here: ``agrees`` says so), and the kernel then goes wrong
    (another backend or library): the recording's own spot check of ``"triton tiles"`` catches it, warns once, and
    the call is recomputed with torch's tiles, as every later one of the shape; every stored map is exact."""
    monkeypatch.setattr(checks, "ROWS_ONLY", set())
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: kernels.available(device))
    monkeypatch.setattr(tile_kernel, "agrees", lambda *a: True)  # checked earlier in the process, when it was right
    if wrong == "probs":
        _spy(monkeypatch, lambda out: out.mul_(1.001))
    else:
        _entropy_off(monkeypatch)
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    kinds = ("topk", "entropy", "frame")
    with pytest.warns(UserWarning, match=r"spot check failed: triton tiles on") as warned:
        with cogattn.record(pipe, kinds=kinds, batch="cond", heads="all", method="auto") as rec:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    assert rec.plan.tiles.method == "rows" and rec.plan.tiles.kernel_tiles
    assert [(c.step, c.layer, c.what, c.passed) for c in rec.checks] == [(0, 0, "triton tiles", False)]
    assert len([w for w in warned if "spot check failed" in str(w.message)]) == 1
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


def test_a_recordings_kernel_tiles_that_agree_pass_their_check(monkeypatch, fresh):
    """The same recording with the kernels right: one passing check of ``"triton tiles"`` per shape and kind set, the
    maps from the kernels' tiles exact."""
    monkeypatch.setattr(checks, "ROWS_ONLY", set())
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: kernels.available(device))
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    spy = QKSpy(pipe.transformer)
    kinds = ("topk", "entropy", "received")
    with cogattn.record(pipe, kinds=kinds, batch="cond", heads="all", method="auto") as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    (check,) = rec.checks
    assert check.what == "triton tiles" and check.passed and check.max_error <= 1e-6, check
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


@pytest.mark.parametrize(
    "kinds, heads", [(("topk",), "mean"), (("frame_max",), "mean"), (("text_to_video",), "all"), (("topk",), "all")]
)
def test_a_check_of_triton_tiles_is_filed_only_where_the_kernels_formed_the_rows(kinds, heads, monkeypatch, fresh):
    """The head-mean row's kinds and rows of chosen queries take torch's tiles (docs/design.md): no tile of the
    kernels, and no check that says it compared them; every row's kinds of each head take the kernels' and are
    checked."""
    monkeypatch.setattr(checks, "ROWS_ONLY", set())
    monkeypatch.setattr(kernels, "serves", lambda device, head_dim: kernels.available(device))
    calls = []
    real = tile_kernel.probs
    monkeypatch.setattr(tile_kernel, "probs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pipe = tiny_pipeline(num_heads=2).to(DEVICE)
    with cogattn.record(pipe, kinds=kinds, batch="cond", heads=heads, method="auto") as rec:
        generate(pipe, steps=1, output_type="latent")
    by_kernel = heads == "all" and kinds == ("topk",)
    assert bool(calls) == by_kernel
    assert [(c.what, c.passed) for c in rec.checks] == ([("triton tiles", True)] if by_kernel else [])
    if by_kernel:
        assert 0 < rec.checks[0].max_error <= 1e-6  # rows compared, not a check of nothing


def _flush_to_zero_exp2(monkeypatch):
    """Triton's interpreter computes ``tl.exp2`` with numpy, which keeps subnormal results; a GPU's ``ex2.approx.ftz``
    flushes them to 0 (and Triton lowers ``tl.exp2`` to it): the interpreter made to do the same."""
    import numpy as np
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_exp2

    def exp2(self, arg):
        out = real(self, arg)
        data = out.data
        flushed = np.where(np.abs(data) < np.finfo(data.dtype).tiny, np.zeros_like(data), data)
        return interpreter.TensorHandle(flushed, arg.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", exp2)


def test_kernel_tiles_keep_subnormal_probabilities(monkeypatch, fresh):
    """A peaked row (a sink key) whose other keys lie 60 to 98 nats below it: a frame's probabilities are subnormal
    in float32 (below 2^-126), which ``top_p`` at p = 1 counts and ``frame_max`` finds. The kernel's tile keeps them as
    torch's float32 softmax does, where the device's exp2 flushes subnormal results to 0 (a GPU's; on a CPU the
    interpreter is made to)."""
    if DEVICE == "cpu":
        _flush_to_zero_exp2(monkeypatch)
    layout = TokenLayout(4, 2, 4, 4)  # text 0..3, frame 0 keys 4..19, frame 1 keys 20..35
    S, D, T = layout.seq_len, 64, layout.text_len
    gen = torch.Generator().manual_seed(8)
    scores = torch.rand(S, S, generator=gen) - 0.5  # ± 0.5 nats per pair
    scores[:, 0] += 100.0  # the sink
    scores[:, 1:T] -= 10.0  # 110 nats below: 0 in float32 (below 2^-149)
    scores[:, T : T + 16] += torch.linspace(30.0, 40.0, 16)  # normal: 60 to 70 nats below
    scores[:, T + 16 :] += torch.linspace(3.0, 11.0, 16)  # subnormal: 88 to 98 nats below
    # q_i = √D·e_i and k_j = scores[:, j]: q·k_j / √D = scores[i, j], exactly in float32
    q = torch.zeros(1, S, D)
    q[0, :, :S] = torch.eye(S) * math.sqrt(D)
    k = torch.zeros(1, S, D)
    k[0, :, :S] = scores.T
    reducers = [REDUCERS[kind](layout, 1, False, top_p=(0.5, 1.0)) for kind in ("full", "top_p", "frame_max")]
    plan = plan_tiles(reducers, S, 1, D, 2**30, "triton", DEVICE)
    assert plan.kernel_tiles
    calls = _spy(monkeypatch)
    outs = [torch.zeros(r.shape(1)[1:], device=DEVICE) for r in reducers]
    engine.capture(q.to(DEVICE), k.to(DEVICE), reducers, outs, plan)
    assert len(calls) == 2  # the check's rows, then the one tile: the kernel's
    ref32 = torch.softmax(scores[None], -1)  # torch's float32 tile
    subnormal = (ref32 > 0) & (ref32 < torch.finfo(torch.float32).tiny)
    assert subnormal[:, :, T + 16 :].all() and not ref32[:, :, 1:T].any()
    full, counts, frame_max = (out.cpu() for out in outs)
    assert torch.equal(full > 0, ref32 > 0)  # every subnormal kept, nothing below 2^-149 made up
    assert (full.double() - torch.softmax(scores[None].double(), -1)).abs().max() <= 1e-5
    close = (full - ref32).abs() <= 1e-4 * ref32 + 2 * 2.0**-149  # the subnormals too, within their rounding
    assert close[subnormal].all()
    assert torch.equal(counts[..., 1], torch.full((1, S), S - T + 1.0))  # p = 1: every nonzero key
    last_frame = ref32[..., T + 16 :].max(-1)
    assert torch.equal(frame_max[..., 2, 1], (last_frame.indices + T + 16).float())  # found, not "no attention" (−1)
    assert torch.equal(frame_max[..., 2, 0], full[..., T + 16 :].max(-1).values)
