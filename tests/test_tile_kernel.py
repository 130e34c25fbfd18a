"""Row tiles formed by cogattn's kernels (``exact/tile_kernel.py``), on the CPU through Triton's interpreter."""

import math

import pytest
import torch

pytest.importorskip("triton")

from reference import QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
from cogattn.exact import engine, kernels, tile_kernel
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
    frame = [REDUCERS["full"](TokenLayout(2, 1, 2, 2), 1, False)]
    tiles = {m: plan_tiles(frame, 6, 1, 16, 2**30, m, "cpu").kernel_tiles for m in ("rows", "sdpa", "auto", "triton")}
    assert tiles == {"rows": False, "sdpa": False, "auto": False, "triton": True}  # auto: SDPA beats the interpreter
    assert not plan_tiles(frame, 6, 1, 24, 2**30, "triton", "cpu").kernel_tiles  # a head dim the tiles do not take
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
