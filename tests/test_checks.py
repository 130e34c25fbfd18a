"""Spot checks: a fast method that computes wrong numbers is caught, warned about once, and replaced by
exact row tiles, so nothing wrong is stored; an opt-in output call that is wrong falls back to the stock one."""

import json
import math
import warnings

import pytest
import torch
from reference import QKSpy, assert_matches_naive, naive_kind, naive_probs
from tiny_calls import generate

import cogattn
import cogattn.exact.attention as attention
import cogattn.exact.checks as checks
from cogattn.models.cogvideox import tiny_pipeline

KINDS = ("frame", "video_to_text", "query")
QUERIES = [0, (1, 2, 4)]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Every test starts as a new process would: no shape checked yet, none failed."""
    for name in ("ROWS_ONLY", "STOCK_OUTPUT"):
        monkeypatch.setattr(checks, name, set())


def _record(pipe, **kw):
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=KINDS, queries=QUERIES, heads="all", **kw) as rec:
        video = generate(pipe, steps=2)
    spy.remove()
    return rec, spy, video


def test_every_recording_checks_each_fast_method_once_per_shape_and_passes(tmp_path):
    pipe = tiny_pipeline(num_heads=3)
    rec, spy, _ = _record(pipe, save_dir=tmp_path / "run")
    assert [(c.step, c.layer, c.what, c.device, c.dtype, c.rows) for c in rec.checks] == [
        (0, 0, "sdpa", "cpu", "float32", 8)
    ]
    (check,) = rec.checks
    assert check.passed and check.max_error <= 1e-6 and check.tolerance == 1e-5
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checks"] == [check.asdict()]
    assert_matches_naive(rec, spy, [1], "all", kinds=KINDS, queries=QUERIES)
    again, _, _ = _record(pipe)  # the same shape in the same process: this recording checks it itself
    assert [(c.step, c.layer, c.what, c.passed) for c in again.checks] == [(0, 0, "sdpa", True)]


def test_rows_are_not_checked_and_verify_false_checks_nothing():
    pipe = tiny_pipeline()
    assert _record(pipe, method="rows")[0].checks == []
    assert _record(pipe, verify=False)[0].checks == []


@pytest.mark.parametrize("corrupt", ["sums", "lse"])
def test_a_wrong_fast_method_is_caught_and_nothing_wrong_is_stored(monkeypatch, corrupt):
    real = attention.sdpa_with_lse

    def wrong(q, k, v, scale):  # a kernel that is off by 1e-3: its sums, or its log-sum-exp
        out, lse = real(q, k, v, scale)
        return (out * 1.001, lse) if corrupt == "sums" else (out, lse + 1e-3)

    monkeypatch.setattr(attention, "sdpa_with_lse", wrong)
    pipe = tiny_pipeline(num_heads=3)
    stock = generate(pipe)
    with pytest.warns(UserWarning, match=r"spot check failed: sdpa on cpu \(float32, shape \(53, 3, 16\)\)") as seen:
        rec, spy, video = _record(pipe)
    assert len([w for w in seen if "spot check failed" in str(w.message)]) == 1  # warned once
    assert torch.equal(video, stock)
    (check,) = rec.checks
    assert not check.passed and check.max_error > 1e-4
    assert_matches_naive(rec, spy, [1], "all", kinds=KINDS, queries=QUERIES)  # every layer and step exact
    later, spy, _ = _record(pipe)  # a later recording in this process never returns to the failed method
    assert later.checks == []
    assert_matches_naive(later, spy, [1], "all", kinds=KINDS, queries=QUERIES)


@pytest.mark.parametrize("mode", ["lse", "joint"])
def test_a_wrong_output_call_falls_back_to_the_stock_one(monkeypatch, mode):
    name = "attention_with_lse" if mode == "lse" else "attention_joint_for"
    real = getattr(cogattn.recorder.capture, name)

    def wrong(*args):
        out, *rest = real(*args)
        return (out + 1e-2, *rest)

    monkeypatch.setattr(cogattn.recorder.capture, name, wrong)
    pipe = tiny_pipeline(num_heads=3)
    stock = generate(pipe)
    with pytest.warns(UserWarning, match=rf"spot check failed: layer_output={mode} .* take the stock output call"):
        rec, spy, video = _record(pipe, layer_output=mode)
    assert torch.equal(video, stock)  # every captured layer took the stock output
    outputs = [c for c in rec.checks if c.what.startswith("layer_output")]
    assert len(outputs) == 1 and not outputs[0].passed
    assert_matches_naive(rec, spy, [1], "all", kinds=KINDS, queries=QUERIES)


def test_probe_rows_are_spread_over_text_and_video():
    layout = cogattn.TokenLayout(8, 3, 3, 5)
    rows = checks.probe_rows(layout)
    assert rows.tolist() == [0, 7, 8, 17, 26, 34, 43, 52]  # text 0 and 7; video 8 .. 52 in 5 even gaps
    assert checks.probe_rows(cogattn.TokenLayout(1, 1, 1, 2)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("setting", ["none", "legacy", "new", "new-cuda"])
def test_capture_keeps_the_users_float32_matmul_setting(setting, monkeypatch):
    """The precision is saved, set and restored through one API (torch ≥ 2.9: the new one), so neither the
    capture nor the user's later calls meet torch's error for mixing the two."""
    saved = {b: b.fp32_precision for b in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)}
    legacy = torch.get_float32_matmul_precision()
    try:
        if setting == "legacy":
            torch.set_float32_matmul_precision("medium")
        elif setting == "new":
            torch.backends.fp32_precision = "tf32"
        elif setting == "new-cuda":
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        before = (torch.backends.fp32_precision, *(b.fp32_precision for b in saved))
        seen = []
        real = cogattn.exact.engine.capture

        def spy(*args, **kwargs):
            seen.append(torch.backends.mkldnn.matmul.fp32_precision)
            return real(*args, **kwargs)

        monkeypatch.setattr(cogattn.exact.engine, "capture", spy)
        pipe = tiny_pipeline()
        with cogattn.record(pipe, kinds="frame"):
            generate(pipe, steps=1, output_type="latent")
        assert seen and set(seen) == {"ieee"}  # capture's matmuls ran in full float32
        assert (torch.backends.fp32_precision, *(b.fp32_precision for b in saved)) == before
        torch.set_float32_matmul_precision("high")  # the user's own later call still works
    finally:
        torch.backends.fp32_precision = "none"
        for backend, value in saved.items():
            backend.fp32_precision = value
        torch.set_float32_matmul_precision(legacy)


def test_lse_only_honours_the_scale():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    for scale in (0.3, 1 / math.sqrt(16)):
        expected = torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1)
        assert (attention.lse_only(q, k, scale) - expected).abs().max() < 1e-5


def test_a_kind_first_served_by_a_later_recording_is_checked(monkeypatch):
    """A recording of ``frame`` checks the shape; a later one of ``entropy`` from a broken pass of the same
    shape is still checked, caught, and stores exact entropy."""
    pipe = tiny_pipeline(num_heads=3)
    rec, _, _ = _record(pipe)
    assert [c.passed for c in rec.checks] == [True]
    real = cogattn.exact.passes.entropy_pass
    monkeypatch.setattr(cogattn.exact.passes, "entropy_pass", lambda *a: (lambda e, lse: (e + 0.5, lse))(*real(*a)))
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match="spot check failed: sdpa"):
        with cogattn.record(pipe, kinds="entropy", heads="all", method="sdpa") as later:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    assert [c.passed for c in later.checks] == [False] and later.checks[0].max_error > 0.1
    assert_matches_naive(later, spy, [1], "all", kinds=("entropy",))


def test_the_lse_received_takes_from_another_pass_is_checked(monkeypatch):
    """``received`` alone takes its rows' lse from a pass of its own; a wrong lse there is caught."""
    real = cogattn.exact.passes.indicator_sums
    monkeypatch.setattr(cogattn.exact.passes, "indicator_sums", lambda *a: (lambda s, lse: (s, lse + 0.1))(*real(*a)))
    pipe = tiny_pipeline(num_heads=3)
    spy = QKSpy(pipe.transformer)
    with pytest.warns(UserWarning, match="spot check failed: sdpa"):
        with cogattn.record(pipe, kinds="received", heads="all", method="sdpa") as rec:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    (check,) = rec.checks
    assert not check.passed and check.max_error > 1e-3
    assert_matches_naive(rec, spy, [1], "all", kinds=("received",))
    S = rec.layout.seq_len
    assert abs(rec.get("received", 1, 1).sum(-1) - S).max() < 1e-3  # every row's mass: S in all


@pytest.mark.parametrize("peak", [30.0, 200.0, 465.0, 800.0])
def test_bounds_scale_with_lse_on_peaked_attention(peak):
    """Peaked attention (|lse| up to ``peak``; each query finds its own key, and video queries 0..4 find
    text key t as well): the fused passes are exact to what float32 can do, so the spot check passes, and
    every method stays within the documented bound against float64."""
    H, S, D, T = 2, 61, 16, 5
    layout = cogattn.TokenLayout(T, 2, 4, 7)
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, H, S, D, generator=gen), dim=-1) * peak**0.5 * D**0.25
    k = q + 0.01 * torch.randn(1, H, S, D, generator=gen)  # logits near peak on the diagonal
    k[:, :, :T] = q[:, :, T : 2 * T]  # video query T + t finds text key t too: P ≈ 1/2 on a text key
    P = naive_probs(q, k)[0]
    lse = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * D**-0.5, -1)[0]
    assert lse.abs().max() > 0.9 * peak and P[:, T:, :T].max() > 0.4
    kinds = ("entropy", "received", "video_to_text")
    reducers = [cogattn.exact.reducers.REDUCERS[kind](layout, H, False) for kind in kinds]
    video_to_text_units = checks.error_units("video_to_text", P, lse, P)[:, T:, :T].transpose(1, 2)
    for method in ("sdpa", "rows"):
        plan = cogattn.exact.planner.plan_tiles(reducers, S, H, D, 2**30, method, "cpu")
        outs, _, probes = cogattn.exact.engine.capture_items(
            q, k, [0], reducers, plan, probe_rows=checks.probe_rows(layout)
        )
        for red, out in zip(reducers, outs):
            exact = naive_kind(P[None], red.kind, T, layout.grid)[0]
            if red.kind == "video_to_text":
                units = video_to_text_units.reshape(exact.shape)  # per (video query, text key)
            else:
                units = checks.error_units(red.kind, P, lse)
            error = ((out[0].double() - exact).abs() / units).max().item()
            assert error <= checks.bound(torch.float32, False), (method, red.kind, error)
        if method == "sdpa":
            check = checks.Verifier(True).check_maps(probes, q, k, None, reducers, 0, 0, method, D**-0.5)
            assert check.passed, check


@pytest.mark.parametrize("corrupt", [0.0, 0.02])
def test_received_from_a_16_bit_output_calls_lse_is_held_to_its_bound(monkeypatch, corrupt):
    """bf16 with ``layer_output="lse"``: ``received`` takes the output call's lse, and its check takes that lse
    too, held to half an ulp at 1 (in received's units): an lse off by 0.02 is caught, none stored."""
    real = cogattn.recorder.capture.attention_with_lse
    monkeypatch.setattr(
        cogattn.recorder.capture, "attention_with_lse", lambda *a: (lambda o, lse: (o, lse + corrupt))(*real(*a))
    )
    pipe = tiny_pipeline(num_heads=3, dtype=torch.bfloat16)
    spy = QKSpy(pipe.transformer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with cogattn.record(pipe, kinds="received", heads="all", layer_output="lse", method="sdpa") as rec:
            generate(pipe, steps=2, output_type="latent")
    spy.remove()
    maps = [c for c in rec.checks if c.what != "layer_output=lse"]
    assert [c.what for c in maps] == ["sdpa, lse of the output call"] and maps[0].tolerance == 2**-8
    failed = [w for w in seen if "spot check failed" in str(w.message)]
    assert maps[0].passed == (not failed) == (corrupt == 0), maps
    assert_matches_naive(rec, spy, [1], "all", kinds=("received",), tol=2**-8 if corrupt == 0 else 1e-5)
