"""``python -m cogattn.selftest`` passes on this machine, and fails (exit 1) when a method is wrong."""

import json
import re

import pytest
import torch

import cogattn
import cogattn.exact.attention as attention
import cogattn.selftest as selftest
import cogattn.selftest_pipelines as selftest_pipelines
from cogattn.exact import kernels
from cogattn.exact.checks import output_identical
from cogattn.models import family
from cogattn.selftest import main


def _cogvideox_only(monkeypatch):
    """The quick self-test without the other families' rows, for the checks of the methods themselves (the
    families' rows are checked in float32 once: in bfloat16 on a CPU, Mochi's alone takes 17 s)."""
    monkeypatch.setattr(selftest, "FAMILIES", [family("cogvideox")])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_quick_selftest_passes_and_writes_its_report(tmp_path, capsys, monkeypatch, dtype):
    if dtype != "float32":
        _cogvideox_only(monkeypatch)
    else:  # with one other family (every family's quick rows: .ci/run's plain-install stage runs them all)
        monkeypatch.setattr(selftest, "FAMILIES", [family("cogvideox"), family("mochi")])
    assert main(["--quick", "--seq-len", "100", "--dtype", dtype, "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "torch " in out and "diffusers " in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and {"torch", "diffusers", "triton", "device", "cogattn"} <= set(report["versions"])
    rows = report["rows"]
    kinds = {(r["kind"], r["method"], r["output"]) for r in rows if r["part"].startswith("layer")}
    assert {(k, "rows", "stock") for k in ("full", "frame", "video_to_text", "text_to_video", "query")} <= kinds
    assert {("frame", "sdpa", "stock"), ("frame", "joint", "joint"), ("video_to_text", "sdpa", "lse")} <= kinds
    if kernels.available(torch.device("cpu")):  # the interpreter: the kernels' row tiles checked for every row kind
        assert {(k, "triton", "stock") for k in ("full", "topk", "top_p", "frame_max", "offset")} <= kinds
    tiny = [r for r in rows if r["part"] == "tiny 1.0 t2v" and r["passed"] is not None]
    combos = {(r["method"], r["output"]) for r in tiny} - {("triton", "stock")}  # where Triton runs here
    assert combos == {("rows", "stock"), ("sdpa", "stock"), ("auto", "lse"), ("auto", "joint")}
    # the video bit-identical where promised (every output mode in float32 on a CPU, the stock call in any dtype)
    promised = [r for r in tiny if output_identical(r["output"], torch.device("cpu"), getattr(torch, dtype))]
    assert {r["output"] for r in promised} == ({"stock", "lse", "joint"} if dtype == "float32" else {"stock"})
    assert all(r["bit_identical"] for r in promised) and all(r["max_error"] <= r["tolerance"] for r in tiny)
    output = [r for r in rows if r["kind"] == "output"]  # the synthetic layer's opt-in calls: within their bound
    assert output and all(r["max_error"] <= r["tolerance"] and r["passed"] for r in output)
    assert report["dtype"] == dtype
    if dtype == "float32":  # the other family's every tiny pipeline, once, under row tiles
        others = [r for r in rows if r["part"].startswith("tiny ") and not r["part"][5].isdigit()]
        parts = {f"tiny {s.family} {selftest_pipelines.task_label(t)}" for s in selftest.FAMILIES for t in s.tiny_tasks}
        assert sorted(r["part"] for r in others) == sorted(parts - {"tiny cogvideox t2v", "tiny cogvideox i2v"})
        assert all(r["method"] == "rows" and r["passed"] and r["max_error"] <= r["tolerance"] for r in others)
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
    _cogvideox_only(monkeypatch)
    monkeypatch.setattr(selftest, "pipeline_rows", lambda *args: [])  # the synthetic layer calls every method
    assert main(["--quick", "--seq-len", "100", "--json", str(tmp_path / "r.json")]) == 1
    assert "check(s) FAILED" in capsys.readouterr().out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    failed = {r["method"] for r in rows if r["passed"] is False}
    # every method that calls the corrupted kernel: sdpa, triton (for the lse), and the opt-in outputs'
    # recordings (auto), whose entropy and received passes call it too
    assert "sdpa" in failed and failed <= {"sdpa", "triton", "auto", "joint"}
    assert all(r["passed"] for r in rows if r["method"] == "rows")


def test_where_no_kernel_returns_the_lse_its_rows_say_so_and_the_rest_still_runs(monkeypatch):
    """As on CUDA in float32, where no fused kernel returns the lse (``attention_with_lse`` gives `None`): the
    synthetic layer's lse rows are one skipped line saying why, and its joint rows still run and pass."""
    import torch.nn.functional as F

    def no_lse(q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, scale=scale), None

    monkeypatch.setattr(selftest, "attention_with_lse", no_lse)
    rows = selftest.layer_rows(torch.device("cpu"), torch.float32, 100)
    (lse,) = [r for r in rows if r.output == "lse"]
    assert lse.passed is None and "no fused kernel returns the lse for float32" in lse.note
    joint = [r for r in rows if r.output == "joint"]
    assert len(joint) > 5 and all(r.passed for r in joint)
    assert all(r.passed for r in rows if r.output == "stock" and r.max_error is not None)


def test_every_row_of_the_synthetic_layer_is_measured_against_the_naive_lse_not_a_kernel_s():
    """The error units of ``entropy`` and ``received`` come from the float64 reference's lse in every row, the
    opt-in outputs' included, whose kernels' lse (on the device) are what those rows test."""
    from cogattn.reference import naive_lse

    seen = []
    real = selftest.kind_error

    def kind_error(got, P, kind, T, grid, queries, lse, **kwargs):
        seen.append(lse)
        return real(got, P, kind, T, grid, queries, lse, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(selftest, "kind_error", kind_error)
        rows = selftest.layer_rows(torch.device("cpu"), torch.float32, 100)
    assert {r.output for r in rows} >= {"stock", "lse", "joint"} and all(r.passed for r in rows if r.kind != "-")
    layout = selftest.synthetic_layout(100)
    gen = torch.Generator().manual_seed(0)  # the layer's q and k, as layer_rows makes them
    q, k = (torch.randn(4, layout.seq_len, 64, generator=gen) * 1.5 for _ in range(2))
    want = naive_lse(q[None], k[None])
    assert len(seen) > 20 and all(lse.dtype == want.dtype and torch.equal(lse, want) for lse in seen)


def test_a_part_that_raises_is_one_failed_row_naming_the_error_and_the_others_still_run(monkeypatch, capsys):
    """An exception in one part (a family's tiny pipelines here) is a failed row with the error and cogattn's
    line that raised it, the traceback on stderr; the other parts' rows are all there and the verdict fails."""
    monkeypatch.setattr(selftest, "FAMILIES", [family("cogvideox"), family("mochi"), family("wan")])

    def passing(part):
        return [selftest.Row(part, "frame", "rows", "stock", 0.0, 1e-5, True, 1.0, True)]

    def family_rows(spec, *args, **kwargs):
        if spec.family == "mochi":
            cogattn.CaptureOptions(kinds=["nope"])  # raises in cogattn's own code, as the device mismatch did
        return passing(f"tiny {spec.family} t2v")

    monkeypatch.setattr(selftest, "layer_rows", lambda *args: passing("layer S=8"))
    monkeypatch.setattr(selftest, "pipeline_rows", lambda *args: passing("tiny 1.0 t2v"))
    monkeypatch.setattr(selftest, "family_rows", family_rows)
    report = selftest.run("cpu", quick=True)
    err = capsys.readouterr().err
    parts = [r["part"] for r in report["rows"]]
    assert parts == ["layer S=8", "tiny 1.0 t2v", "tiny mochi", "tiny wan t2v"]
    broken = report["rows"][2]
    assert broken["passed"] is False and broken["note"].startswith("ValueError: ") and "'nope'" in broken["note"]
    assert re.search(r"\(options\.py:\d+\)$", broken["note"]) and "Traceback" in err
    assert report["passed"] is False


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


def _without_opencv(monkeypatch):
    """This environment as a plain install leaves it: no OpenCV, so diffusers' top-level
    ``ConsisIDPipeline`` is its placeholder, which refuses to build (as it does without ``opencv-python``)."""
    import sys

    import diffusers
    from diffusers.pipelines.consisid import pipeline_consisid
    from diffusers.utils import dummy_torch_and_transformers_and_opencv_objects as placeholders
    from diffusers.utils import import_utils

    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ImportError
    monkeypatch.delattr(pipeline_consisid, "cv2", raising=False)  # what the module imported, if it could
    monkeypatch.setattr(import_utils, "_opencv_available", False)
    monkeypatch.setattr(diffusers, "ConsisIDPipeline", placeholders.ConsisIDPipeline)
    with pytest.raises(ImportError, match="requires the OpenCV library"):  # the simulation is what users get
        diffusers.ConsisIDPipeline()


def test_the_consisid_family_runs_without_opencv(monkeypatch):
    from cogattn.selftest_pipelines import family_rows

    _without_opencv(monkeypatch)
    (row,) = family_rows(family("consisid"), torch.device("cpu"), torch.float32, quick=True)
    assert (row.part, row.method, row.note) == ("tiny consisid i2v", "rows", "")
    assert row.passed and row.bit_identical and 0 <= row.max_error <= row.tolerance == 1e-5


def test_a_family_that_needs_a_missing_package_is_one_skipped_line_and_the_verdict_counts_what_ran(
    monkeypatch, capsys, tmp_path
):
    import dataclasses

    import diffusers

    from cogattn.selftest_pipelines import missing_package

    _without_opencv(monkeypatch)
    monkeypatch.setitem(__import__("sys").modules, "imageio", None)

    def needs_opencv(task, **size):  # a pipeline diffusers gates behind OpenCV, as ConsisID's was built
        return diffusers.ConsisIDPipeline()

    def needs_imageio(task, **size):  # a part that imports an optional package
        import imageio  # noqa: F401

    fakes = [
        dataclasses.replace(family("consisid"), tiny_pipeline=needs_opencv),
        dataclasses.replace(family("mochi"), tiny_pipeline=needs_imageio),
    ]
    monkeypatch.setattr(selftest, "FAMILIES", [family("cogvideox"), *fakes])
    monkeypatch.setattr(selftest, "layer_rows", lambda *args: [])  # the synthetic layer's rows are other tests'
    report = tmp_path / "r.json"
    assert main(["--quick", "--seq-len", "100", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("tiny ")}
    assert lines["consisid"].split()[-8:] == "skip needs OpenCV, not installed (pip install opencv-python)".split()
    assert lines["mochi"].split()[-5:] == "skip needs imageio, not installed".split()
    rows = json.loads(report.read_text())["rows"]
    ran = [r for r in rows if r["passed"] is not None]
    skipped = [r["part"] for r in rows if r["passed"] is None and r["method"] != "triton"]  # Triton's: no CUDA
    assert skipped == ["tiny consisid i2v", "tiny mochi t2v"]
    assert ran and all(r["passed"] for r in ran) and {r["part"] for r in ran} >= {"tiny 1.0 t2v"}
    assert f"all checks passed ({len(ran)} checked, {len(rows) - len(ran)} skipped)" in out
    # --strict: a package missing fails the run, naming it (the rows that pass are the same as above)
    monkeypatch.setattr(selftest, "pipeline_rows", lambda *args: [])
    assert main(["--quick", "--seq-len", "100", "--strict", "--json", str(report)]) == 1
    failed = [r for r in json.loads(report.read_text())["rows"] if r["passed"] is False]
    assert [(r["part"], r["note"]) for r in failed] == [
        ("tiny consisid i2v", "needs OpenCV, not installed (pip install opencv-python)"),
        ("tiny mochi t2v", "needs imageio, not installed"),
    ]
    # an import that fails in an installed package is a bug, not a missing package: no skip
    assert missing_package(ImportError("cannot import name 'Nope' from 'diffusers'", name="diffusers")) is None


def test_a_nan_or_an_unchecked_layer_fails_a_family_s_row(monkeypatch):
    """A NaN in a family's map fails its row (``max(0.0, nan)`` is 0.0: it read as no error); so does a recording
    to which a layer was never handed (its reference had nothing to check, so the row passed at error 0)."""
    from cogattn.recorder.capture import Capture
    from cogattn.recorder.recording import Recording
    from cogattn.selftest_pipelines import family_rows

    wan, real_get, real_layer = family("wan"), Recording.get, Capture.layer_to_capture

    def nan_get(self, kind, step, layer):
        got = real_get(self, kind, step, layer)
        if kind == "frame":
            got = got.clone()
            got.view(-1)[0] = float("nan")
        return got

    monkeypatch.setattr(Recording, "get", nan_get)
    (row,) = family_rows(wan, torch.device("cpu"), torch.float32, quick=True)[:1]
    assert row.passed is False and row.max_error != row.max_error  # NaN, shown as such
    monkeypatch.setattr(Recording, "get", real_get)
    monkeypatch.setattr(
        Capture, "layer_to_capture", lambda self, attn: None if (n := real_layer(self, attn)) == 1 else n
    )
    with pytest.warns(UserWarning, match="selected attention calls .* did not run"):
        (row,) = family_rows(wan, torch.device("cpu"), torch.float32, quick=True)[:1]
    assert row.passed is False and "selected attention calls were not recorded" in row.note


def test_a_family_whose_stock_call_fails_is_a_failed_row_and_its_other_pipelines_still_run(monkeypatch):
    import dataclasses

    from cogattn.selftest_pipelines import family_rows

    wan = family("wan")

    def broken(task, **kwargs):
        pipe = wan.tiny_pipeline(task, **kwargs)
        if task == wan.tiny_tasks[0]:  # its first pipeline's transformer raises, as a broken tiny pipeline does

            def forward(*args, **kwargs):
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

            pipe.transformer.forward = forward
        return pipe

    rows = family_rows(dataclasses.replace(wan, tiny_pipeline=broken), torch.device("cpu"), torch.float32, quick=True)
    assert (
        rows[0].passed is False and rows[0].note == "the stock call failed: mat1 and mat2 shapes cannot be multiplied"
    )
    assert len(rows) == len(wan.tiny_tasks) and all(r.passed for r in rows[1:])  # skipped before: no row, a pass


def test_an_older_library_without_a_name_a_tiny_pipeline_imports_is_a_skip_and_cuda_without_cuda_one_line(capsys):
    from cogattn.selftest_pipelines import missing_package

    old = ImportError("cannot import name 'T5Gemma2Encoder' from 'transformers' (/x/__init__.py)", name="transformers")
    assert missing_package(old) == "needs a newer transformers (with T5Gemma2Encoder: pip install -U transformers)"
    if not torch.cuda.is_available():  # a torch built without CUDA asserts: one line, exit 2
        assert main(["--device", "cuda", "--quick"]) == 2
        assert capsys.readouterr().err.startswith("selftest: device cuda is not available here")
