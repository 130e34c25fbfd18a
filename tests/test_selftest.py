"""``python -m cogattn.selftest`` passes on this machine, and fails (exit 1) when a method is wrong."""

import json

import pytest
import torch

import cogattn.attention as attention
from cogattn.selftest import main


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_quick_selftest_passes_and_writes_its_report(tmp_path, capsys, dtype):
    assert main(["--quick", "--seq-len", "300", "--dtype", dtype, "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "torch " in out and "diffusers " in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and {"torch", "diffusers", "triton", "device", "cogattn"} <= set(report["versions"])
    rows = report["rows"]
    kinds = {(r["kind"], r["method"], r["output"]) for r in rows if r["part"].startswith("layer")}
    assert {(k, "rows", "stock") for k in ("full", "frame", "video_to_text", "text_to_video", "query")} <= kinds
    assert {("frame", "sdpa", "stock"), ("frame", "joint", "joint"), ("video_to_text", "sdpa", "lse")} <= kinds
    tiny = [r for r in rows if r["part"] == "tiny 1.0 t2v" and r["passed"] is not None]
    combos = {(r["method"], r["output"]) for r in tiny} - {("triton", "stock")}  # where Triton runs here
    assert combos == {("rows", "stock"), ("sdpa", "stock"), ("auto", "lse"), ("auto", "joint")}
    assert all(r["bit_identical"] for r in tiny) and all(r["max_error"] <= r["tolerance"] for r in tiny)
    assert report["dtype"] == dtype
    # every kind is held to its documented bound: half an ulp at 1 only where made from the output call's
    # lse or sums (with "joint" the entropy pass gives video_to_text and received a float32 lse)
    half_ulp = 2**-8 if dtype == "bfloat16" else 1e-5
    limits = {(r["kind"], r["method"], r["output"]): r["tolerance"] for r in rows if r["part"].startswith("layer")}
    expected = {
        ("received", "sdpa", "stock"): 1e-5,
        ("entropy", "sdpa", "stock"): 1e-5,
        ("video_to_text", "sdpa", "lse"): half_ulp,
        ("received", "sdpa", "lse"): half_ulp,
        ("frame", "joint", "joint"): half_ulp,
        ("query_frame", "joint", "joint"): half_ulp,
        ("block", "joint", "joint"): half_ulp,
        ("video_to_text", "joint", "joint"): 1e-5,
        ("received", "joint", "joint"): 1e-5,
        ("entropy", "joint", "joint"): 1e-5,
    }
    assert {key: limits[key] for key in expected} == expected


@pytest.mark.parametrize("corrupt", ["sums", "lse"])
def test_a_wrong_method_fails_the_selftest_with_exit_1(monkeypatch, capsys, tmp_path, corrupt):
    real = attention.sdpa_with_lse

    def wrong(q, k, v, scale):
        out, lse = real(q, k, v, scale)
        return (out * 1.001, lse) if corrupt == "sums" else (out, lse + 1e-3)

    monkeypatch.setattr(attention, "sdpa_with_lse", wrong)
    assert main(["--quick", "--seq-len", "300", "--json", str(tmp_path / "r.json")]) == 1
    assert "check(s) FAILED" in capsys.readouterr().out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    failed = {r["method"] for r in rows if r["passed"] is False}
    # every method that calls the corrupted kernel: sdpa, triton (for the lse), and the opt-in outputs'
    # recordings (auto), whose entropy and received passes call it too
    assert "sdpa" in failed and failed <= {"sdpa", "triton", "auto", "joint"}
    assert all(r["passed"] for r in rows if r["method"] == "rows")


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--dtype", "int8"])
    assert err.value.code == 2
    assert main(["--device", "tpu", "--quick"]) == 2 and "selftest:" in capsys.readouterr().err


def test_the_selftest_checks_the_tiny_wan_under_every_attention_backend_installed():
    from cogattn.models import wan
    from cogattn.selftest_pipelines import backend_rows

    if wan is None:
        pytest.skip("this diffusers has no Wan attention modules (0.35)")
    rows = {r.part.split(", ")[1]: r for r in backend_rows(torch.device("cpu"), torch.float32)}
    assert {"native backend", "_native_math backend", "flex backend"} <= set(rows)  # torch's, on every machine
    ran = [r for r in rows.values() if r.passed is not None]
    assert ran and all(r.passed and r.bit_identical and r.max_error <= r.tolerance for r in ran)
    assert all(r.note.startswith("does not run here") for r in rows.values() if r.passed is None)
