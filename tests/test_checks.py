"""Spot checks: a fast method that computes wrong numbers is caught, warned about once, and replaced by
exact row tiles, so nothing wrong is stored; an opt-in output call that is wrong falls back to the stock one."""

import json
import math

import pytest
import torch
from reference import QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
import cogattn.attention as attention
import cogattn.checks as checks
from cogattn.testing import tiny_pipeline

KINDS = ("frame", "video_to_text", "query")
QUERIES = [0, (1, 2, 4)]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Every test starts as a new process would: no shape checked yet, none failed."""
    for name in ("SEEN", "ROWS_ONLY", "STOCK_OUTPUT"):
        monkeypatch.setattr(checks, name, set())


def _record(pipe, **kw):
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=KINDS, queries=QUERIES, heads="all", **kw) as rec:
        video = generate(pipe, steps=2)
    spy.remove()
    return rec, spy, video


def test_every_fast_method_is_checked_once_per_shape_and_passes(tmp_path):
    pipe = tiny_pipeline(num_heads=3)
    rec, spy, _ = _record(pipe, save_dir=tmp_path / "run")
    assert [(c.step, c.layer, c.what, c.device, c.dtype, c.rows) for c in rec.checks] == [
        (0, 0, "sdpa", "cpu", "float32", 8)
    ]
    (check,) = rec.checks
    assert check.passed and check.max_error <= 1e-6 and check.tolerance == 1e-5
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checks"] == [check.asdict()]
    assert_matches_naive(rec, spy, [1], "all", kinds=KINDS, queries=QUERIES)
    rec, _, _ = _record(pipe)  # the same shape in the same process: not checked again (but 1% of captures)
    assert rec.checks == []


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
    real = getattr(cogattn.sink, name)

    def wrong(*args):
        out, *rest = real(*args)
        return (out + 1e-2, *rest)

    monkeypatch.setattr(cogattn.sink, name, wrong)
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
        real = cogattn.engine.capture

        def spy(*args, **kwargs):
            seen.append(torch.backends.mkldnn.matmul.fp32_precision)
            return real(*args, **kwargs)

        monkeypatch.setattr(cogattn.engine, "capture", spy)
        pipe = tiny_pipeline()
        with cogattn.record(pipe, kinds="frame"):
            generate(pipe, steps=1)
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
