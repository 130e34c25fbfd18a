"""A run folder is data someone else may have written: ``cogattn view`` and ``cogattn.load`` read nothing
outside it (absolute and ``..`` paths in ``prompt.json`` and the manifest, symlinks leaving the folder),
check its values before using them, and put its text on the page as text. Each test builds a hostile
copy of one batch run of the tiny default and asks the real server over HTTP on 127.0.0.1, the exported
file's bytes, or the page in headless Chromium."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from cogattn.analysis import aggregate
from cogattn.dump import main as dump_main
from cogattn.errors import StoreError
from cogattn.runs.run import load
from cogattn.runs.run_values import MAX_SLOTS
from cogattn.view import RunView, ViewServer, export
from cogattn.view.data import open_runs
from cogattn.view.server import main

MARK = b"SECRET-OUTSIDE-THE-RUN"  # bytes of a file outside the run: never served, never embedded


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One prompt of the tiny default, as the batch tool writes it: prompt.json, video.gif, previews/, maps/."""
    out = tmp_path_factory.mktemp("hostile") / "runs"
    prompts = out.parent / "prompt.txt"
    prompts.write_text("a red fox\n")
    args = ["--set", f"save_dir={out}", "--set", f"prompts={prompts}", "--set", "capture.heads=all"]
    args += ["--set", "capture.kinds=[frame,video_to_text,entropy]"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main(args) == 0
    return next(p for p in out.iterdir() if p.is_dir())


@pytest.fixture
def folder(made, tmp_path) -> Path:
    """A copy of the prompt's folder to damage, named ``prompt``, beside a file that must stay unread."""
    return shutil.copytree(made, tmp_path / "prompt")


@pytest.fixture
def secret(folder) -> tuple[Path, bytes]:
    """A valid GIF outside the run (the run's own video, marked), so a reader that follows a path to it
    would decode it and serve it as the video."""
    data = (folder / "video.gif").read_bytes() + MARK
    path = folder.parent / "secret.gif"
    path.write_bytes(data)
    return path, data


@contextlib.contextmanager
def _served(path: Path):
    server = ViewServer(path).start()
    try:
        yield server
    finally:
        server.stop()


def _get(url: str) -> tuple[int, bytes]:
    """Status and body of a GET; a dropped connection raises."""
    try:
        with urlopen(url, timeout=30) as answer:
            return answer.status, answer.read()
    except HTTPError as err:
        return err.code, err.read()


def _strict_json(body: bytes):
    """``body`` as JSON the way a browser parses it: no NaN or Infinity."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(body, parse_constant=refuse)


def _set_prompt(folder: Path, **facts) -> None:
    prompt = json.loads((folder / "prompt.json").read_text())
    (folder / "prompt.json").write_text(json.dumps({**prompt, **facts}))


def _embedded(report: Path) -> dict:
    text = report.read_text()
    return json.loads(text[text.index("COGATTN_EMBEDDED = ") + 19 : text.index(";</script>")])


# -- paths that leave the run --------------------------------------------------------------------------------
def test_the_export_embeds_the_run_s_own_video(folder, tmp_path):
    """The reference for the refusals below: a video inside the prompt's folder goes into the report."""
    report = export(folder, tmp_path / "report.html")
    video = base64.b64encode((folder / "video.gif").read_bytes()).decode()
    assert _embedded(report)["files"] == {"prompt/video": f"data:image/gif;base64,{video}"}


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_video_outside_the_prompt_folder_is_neither_served_nor_embedded(folder, secret, tmp_path, how):
    path, data = secret
    if how == "absolute":
        _set_prompt(folder, video=str(path))
    elif how == "dotdot":
        _set_prompt(folder, video="../secret.gif")
    else:  # the name is the batch tool's own; the file is a link out of the folder
        (folder / "video.gif").unlink()
        (folder / "video.gif").symlink_to(path)
    view = RunView(folder / "maps")
    summary = view.summary()
    assert view.files.video is None and summary["video"] is None and summary["video_frames"] == 0
    note = summary["video_note"]
    assert "prompt.json" in note and "'video'" in note and "outside" in note and len(note.splitlines()) == 1
    assert summary["kinds"] == ["entropy", "frame", "video_to_text"]  # the rest of the run opens
    with _served(folder) as server:
        for what in ("video", "frame/0"):
            status, body = _get(f"{server.url}file/prompt/{what}")
            assert status == 404 and MARK not in body
        status, body = _get(f"{server.url}api/summary?run=prompt")
        assert status == 200 and _strict_json(body)["video_note"] == note
    report = export(folder, tmp_path / "report.html")
    text = report.read_bytes()
    assert _embedded(report)["files"] == {}
    assert base64.b64encode(data) not in text and MARK not in text


def test_a_thumbnail_that_links_out_of_the_folder_is_not_served(folder, secret):
    path, data = secret
    preview = folder / "previews" / "frame.png"
    preview.unlink()
    preview.symlink_to(path)
    assert RunView(folder / "maps").files.thumbnail is None
    with _served(folder) as server:
        assert _strict_json(_get(f"{server.url}api/runs")[1])[0]["thumbnail"] is False
        status, body = _get(f"{server.url}file/prompt/thumbnail")
        assert status == 404 and MARK not in body


def test_a_prompt_json_that_links_out_of_the_folder_is_not_read(folder, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"video": "video.gif", "tokens": ["LEAKED"]}))
    (folder / "prompt.json").unlink()
    (folder / "prompt.json").symlink_to(elsewhere)
    view = RunView(folder / "maps")
    assert view.files.prompt == {} and "LEAKED" not in view.tokens()


def test_pipes_in_place_of_prompt_json_and_the_video_are_not_waited_on(folder):
    """FIFOs (tar and rsync -a carry them) where the prompt's files are: a read would block the server for ever."""
    view = RunView(folder / "maps")
    for name in ("prompt.json", "video.gif"):
        (folder / name).unlink()
        os.mkfifo(folder / name)
    assert view.files.file("video") is None  # made a pipe after the run was opened
    view = RunView(folder / "maps")
    assert view.files.prompt == {} and view.files.video is None
    with _served(folder) as server:
        assert _strict_json(_get(f"{server.url}api/runs")[1])[0]["status"] == "finished"
        assert _get(f"{server.url}file/prompt/video")[0] == 404


@pytest.fixture
def outside_record(folder) -> tuple[Path, list[bytes]]:
    """A readable record outside the run, of the first frame record's shape, every value 7."""
    manifest = folder / "maps" / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    first = json.loads(next(x for x in lines if json.loads(x)["kind"] == "frame"))
    path = folder.parent / "other.safetensors"
    save_file({"map": torch.full(first["shape"], 7.0)}, str(path))
    return path, lines


def _frame_lines(lines: list[bytes]) -> list[int]:
    return [i for i, x in enumerate(lines) if json.loads(x)["kind"] == "frame"]


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_a_manifest_line_naming_a_file_outside_the_run_is_skipped_and_reported(folder, outside_record, how):
    path, lines = outside_record
    i = _frame_lines(lines)[0]
    line = json.loads(lines[i])
    line["file"] = str(path) if how == "absolute" else "../../other.safetensors"
    lines[i] = json.dumps(line).encode() + b"\n"
    (folder / "maps" / "manifest.jsonl").write_bytes(b"".join(lines))
    with pytest.warns(UserWarning, match="cannot be read and were skipped"):
        run = load(folder / "maps")
    key = (line["kind"], line["step"], line["layer"])
    assert key not in run and len(run) == len(lines) - 1
    assert len(run.skipped_lines) == 1
    why = run.skipped_lines[0]
    assert why.startswith(f"manifest.jsonl:{i + 1}: ") and "'file'" in why and "outside the run folder" in why
    with _served(folder) as server:  # the viewer: that map is not recorded, the others are
        got = _strict_json(_get(f"{server.url}api/map?kind=frame&step={key[1]}&layer={key[2]}&head=0")[1])
        assert "error" in got and "values" not in got


def test_a_record_file_that_links_out_of_the_run_is_not_read(folder, outside_record):
    path, lines = outside_record
    line = json.loads(lines[_frame_lines(lines)[0]])
    record = folder / "maps" / line["file"]
    record.unlink()
    record.symlink_to(path)
    run = load(folder / "maps")
    with pytest.raises(StoreError, match=r"manifest\.jsonl's 'file'.*outside the run folder") as err:
        run.get("frame", line["step"], line["layer"])
    assert len(str(err.value).splitlines()) == 1 and str(record) in str(err.value)
    with _served(folder) as server:
        got = _strict_json(_get(f"{server.url}api/map?kind=frame&step={line['step']}&layer={line['layer']}&head=0")[1])
        assert "outside the run folder" in got["error"] and "values" not in got
    other = json.loads(lines[_frame_lines(lines)[1]])  # the rest of the run reads as before
    assert run.get("frame", other["step"], other["layer"]).shape == tuple(other["shape"])


def test_a_run_folder_reached_through_a_symlink_reads_as_usual(folder, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(folder / "maps")
    run, direct = load(link), load(folder / "maps")
    kind, step, layer = run.keys()[0]
    assert torch.equal(run.get(kind, step, layer), direct.get(kind, step, layer))


# -- values ---------------------------------------------------------------------------------------------------
def _set_meta(folder: Path, change) -> None:
    meta_file = folder / "maps" / "run.json"
    meta = json.loads(meta_file.read_text())
    change(meta)
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "field, value",
    [
        ("frames", -3),
        ("frames", 0),
        ("height", 0),
        ("width", "4"),
        ("width", True),
        ("text_len", -1),
        ("patch_size_t", 0),
        ("history_len", -2),
        ("temporal_compression", 0),
        ("text_position", "middle"),
        ("audio", {"tokens": 0}),
        ("audio", {"tokens": 2**30}),
        ("audio", {"tokens": 18, "rate": -25.0}),
        ("audio", {"tokens": 18, "fps": "24"}),
        ("audio", {"tokens": 18, "compression": 4.5}),
        ("audio", {"tokens": 18, "shift": 1}),
        ("audio", [18, 25.0]),
        ("audio", "18"),
    ],
)
def test_a_layout_with_a_bad_value_is_refused_naming_run_json_and_the_field(folder, field, value):
    _set_meta(folder, lambda meta: meta["layout"].update({field: value}))
    with pytest.raises(StoreError) as err:
        load(folder / "maps")
    said = str(err.value)
    assert len(said.splitlines()) == 1 and "run.json" in said and f"layout.{field}" in said and repr(value) in said


def test_a_model_without_an_audio_stream_writes_no_audio_axis_and_reads_back_none(folder):
    meta = json.loads((folder / "maps" / "run.json").read_text())
    assert "audio" not in meta["layout"] and load(folder / "maps").layout.audio is None


def test_a_layout_that_is_not_an_object_is_refused(folder):
    _set_meta(folder, lambda meta: meta.update(layout=[1, 2, 3]))
    with pytest.raises(StoreError, match=r"run\.json.*'layout'"):
        load(folder / "maps")


def test_a_bad_layout_leaves_its_run_out_of_the_viewer_with_one_line(folder, capsys):
    _set_meta(folder, lambda meta: meta["layout"].update(frames=-3))
    problems = []
    with pytest.raises(FileNotFoundError):
        open_runs(folder, problems)
    assert len(problems) == 1 and "layout.frames" in problems[0]
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layout.frames" in err[0] and "run.json" in err[0]


@pytest.mark.parametrize(
    "field, value, why",
    [("step", -1, "step"), ("step", 10**12, "step"), ("layer", -4, "layer"), ("shape", [2, -1], "shape")],
)
def test_a_manifest_line_with_a_bad_number_is_skipped_and_reported(folder, field, value, why):
    manifest = folder / "maps" / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    line = json.loads(lines[0])
    line[field] = value
    manifest.write_bytes(json.dumps(line).encode() + b"\n" + b"".join(lines[1:]))
    with pytest.warns(UserWarning):
        run = load(folder / "maps")
    assert len(run) == len(lines) - 1 and len(run.skipped_lines) == 1
    assert run.skipped_lines[0].startswith("manifest.jsonl:1: ") and why in run.skipped_lines[0]
    assert len(run.timesteps) == len(json.loads((folder / "maps" / "run.json").read_text())["timesteps"])


def test_the_summary_is_json_a_browser_parses_whatever_the_run_json_holds(folder):
    _set_meta(folder, lambda meta: meta.update(timesteps=[math.nan, math.inf, 1.0, 2.0], info={"seed": math.nan}))
    with _served(folder) as server:
        status, body = _get(f"{server.url}api/summary?run=prompt")
        summary = _strict_json(body)
        assert status == 200 and summary["timesteps"][:3] == [None, None, 1.0] and summary["info"]["seed"] is None


def test_every_request_gets_an_answer_an_unexpected_error_a_500_logged_once(folder, monkeypatch, capsys):
    def broken(self, step, column="same_frame_mass", item=None):
        raise RuntimeError("shape '[-3, 4, 4]' is invalid\nsecond line")

    monkeypatch.setattr(RunView, "heads", broken)
    with _served(folder) as server:
        answers = [_get(f"{server.url}api/heads?run=prompt&step=0") for _ in range(2)]
        assert _get(f"{server.url}api/runs")[0] == 200  # the server goes on answering
    for status, body in answers:
        error = _strict_json(body)["error"]
        assert status == 500 and "RuntimeError" in error and "[-3, 4, 4]" in error and "\n" not in error
    logged = [line for line in capsys.readouterr().err.splitlines() if "RuntimeError" in line]
    assert len(logged) == 1 and "/api/heads" in logged[0]


# -- run.json checked as a whole, manifest lines against it: a damaged run costs only itself ----------------------
def _two_runs(made: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A folder of two copies of the prompt, ``good`` and ``bad`` (to damage)."""
    root = tmp_path / "runs"
    return root, shutil.copytree(made, root / "good"), shutil.copytree(made, root / "bad")


def _set(meta: dict, field: str, value) -> None:
    *parents, last = field.split(".")
    for key in parents:
        meta = meta[key]
    meta[last] = value


HOSTILE_META = [  # (field set, value, the field the refusal names, the value it shows there)
    ("selection", "all", "selection", "'all'"),
    ("model", ["x"], "model", "['x']"),
    ("checks", 5, "checks", "5"),
    ("info", ["a"], "info", "['a']"),
    ("skipped", {"by": 5, "calls": []}, "skipped.by", "5"),
    ("selection.heads", 5, "selection.heads", "5"),
    ("model.layer_names", 7, "model.layer_names", "7"),
    ("checks", [{"step": 0, "passed": "yes"}], "checks[0].passed", "'yes'"),
    ("timesteps", "999", "timesteps", "'999'"),
    ("windows", [0, -1], "windows[1]", "-1"),
    ("skipped.calls", [[0, 0]], "skipped.calls[0]", "[0, 0]"),
    ("selection.tile_shape", [4, 4], "selection.tile_shape", "[4, 4]"),
    ("selection.top_p", [0.5, 2.0], "selection.top_p[1]", "2.0"),
    ("selection.batch_roles", ["cond", "cond"], "selection.batch_roles", "['cond', 'cond']"),  # one slot recorded
    ("selection.queries", [[3, 0, 0]], "selection.queries[0]", "[3, 0, 0]"),  # the latent frames are 0 to 2
    ("status", "exploded", "status", "'exploded'"),
    ("model.config.num_attention_heads", "2", "model.config.num_attention_heads", "'2'"),
]


@pytest.mark.parametrize("field, value, named, shown", HOSTILE_META)
def test_a_run_json_value_of_the_wrong_type_is_refused_naming_the_field(folder, field, value, named, shown):
    _set_meta(folder, lambda meta: _set(meta, field, value))
    with pytest.raises(StoreError) as err:
        load(folder / "maps")
    said = str(err.value)
    assert len(said.splitlines()) == 1 and "run.json" in said and f": {named} is " in said
    assert f"{named} is {shown}; it must be " in said


@pytest.mark.parametrize("field, value, named, shown", HOSTILE_META[:7])  # a wrong type in each part of run.json, once
def test_a_run_with_a_damaged_run_json_is_listed_unreadable_and_the_others_are_served(made, tmp_path, field, value, named, shown, capsys):  # fmt: skip
    root, good, bad = _two_runs(made, tmp_path)
    _set_meta(bad, lambda meta: _set(meta, field, value))
    run = load(good / "maps")
    want = aggregate(run, "frame", steps=1).flatten().double()
    with _served(root) as server:
        status, body = _get(f"{server.url}api/runs")
        rows = {r["name"]: r for r in _strict_json(body)}
        assert status == 200 and rows["good"]["status"] == "finished" and rows["bad"]["status"] == "unreadable"
        why = rows["bad"]["error"]
        assert len(why.splitlines()) == 1 and "run.json" in why and f": {named} is " in why
        status, body = _get(f"{server.url}api/map?run=good&kind=frame&step=1")
        assert status == 200 and torch.allclose(torch.tensor(_strict_json(body)["values"], dtype=torch.float64), want)
        for api in ("summary", "map?kind=frame&step=1", "heads?step=1"):  # the damaged run: its line, on every endpoint
            status, body = _get(f"{server.url}api/{api}{'&' if '?' in api else '?'}run=bad")
            assert status == 200 and f": {named} is " in _strict_json(body)["error"] and "values" not in body.decode()
    report = tmp_path / "report.html"
    assert main([str(root), "--export", str(report)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the export: bad: left out" in err[0] and f": {named} is " in err[0]
    data = _embedded(report)
    assert (
        list(data["summaries"]) == ["good"] and len(data["left_out"]) == 1 and f": {named} is " in data["left_out"][0]
    )
    assert [r["status"] for r in data["runs"]] == ["finished", "unreadable"] and data["runs"][1]["error"] == why
    got = data["maps"]["good|frame|1|mean|mean|"]["values"]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=5e-4)


def _manifest_line(folder: Path, kind: str, change) -> tuple[list[bytes], int]:
    """The manifest with ``change`` made to the first line of ``kind``; its lines before, and that line's index."""
    manifest = folder / "maps" / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    i = next(i for i, x in enumerate(lines) if json.loads(x)["kind"] == kind)
    line = json.loads(lines[i])
    change(line)
    manifest.write_bytes(b"".join([*lines[:i], json.dumps(line).encode() + b"\n", *lines[i + 1 :]]))
    return lines, i


@pytest.mark.parametrize(
    "kind, change, why",
    [
        ("frame", lambda line: line.update(kind="frame_of_a_later_version"), "not a kind this version"),
        ("frame", lambda line: line["shape"].__setitem__(0, 10**12), "batch slot axis"),  # no MemoryError
        (
            "frame",
            lambda line: line["shape"].__setitem__(0, 3),
            "batch slot axis of a 'frame' record; run.json gives 1",
        ),
        ("frame", lambda line: line["shape"].__setitem__(1, 5), "head axis of a 'frame' record; run.json gives 2"),
        ("frame", lambda line: line.update(shape=line["shape"][:3]), "has 4 axes"),
        ("entropy", lambda line: line["shape"].__setitem__(2, line["shape"][2] - 3), "query token axis"),
        ("video_to_text", lambda line: line["shape"].__setitem__(5, 99), "patch column axis"),
    ],
)
def test_a_manifest_line_run_json_does_not_allow_is_skipped_and_the_run_is_served(folder, tmp_path, kind, change, why):
    lines, i = _manifest_line(folder, kind, change)
    with pytest.warns(UserWarning, match="cannot be read and were skipped"):
        run = load(folder / "maps")
    assert len(run) == len(lines) - 1 and len(run.skipped_lines) == 1
    said = run.skipped_lines[0]
    assert said.startswith(f"manifest.jsonl:{i + 1}: ") and why in said and len(said) < 300
    assert {k for k, _, _ in run.keys()} == {"frame", "video_to_text", "entropy"}
    step = 3 if kind != "frame" or json.loads(lines[i])["step"] != 3 else 2  # a map the damage left whole
    with _served(folder) as server:
        status, body = _get(f"{server.url}api/summary")
        summary = _strict_json(body)
        assert status == 200 and summary["kinds"] == ["entropy", "frame", "video_to_text"]
        assert summary["items"] == [{"slot": 0, "label": summary["items"][0]["label"], "role": "cond"}]  # one slot
        status, body = _get(f"{server.url}api/map?kind=frame&step={step}")
        want = aggregate(run, "frame", steps=step).flatten().double()
        assert status == 200 and torch.allclose(torch.tensor(_strict_json(body)["values"], dtype=torch.float64), want)
    data = _embedded(export(folder, tmp_path / "report.html"))
    assert list(data["summaries"]) == ["prompt"] and data["left_out"] == []


def test_a_batch_axis_is_bounded_where_run_json_does_not_name_the_slots(folder):
    """A run from before the slots were kept: a line's batch axis is bounded before a reader lists its slots."""
    _set_meta(folder, lambda meta: [meta["selection"].pop(k) for k in ("batch_roles", "batch_resolved")])
    _manifest_line(folder, "frame", lambda line: line["shape"].__setitem__(0, 10**12))
    with pytest.warns(UserWarning):
        run = load(folder / "maps")
    assert len(run.skipped_lines) == 1 and f"at most {MAX_SLOTS}" in run.skipped_lines[0]
    assert RunView(folder / "maps").summary()["items"] == [{"slot": 0, "label": "batch item 0", "role": None}]


# -- every endpoint checks its parameters ---------------------------------------------------------------------
ENDPOINT_QUERIES = {  # a good request of each endpoint that takes an item, from the page's own parameters
    "map": "kind=frame&step=1",
    "point": "step=1&frame=1&row=1&col=2",
    "heads": "step=1",
    "block": "step=1",
    "tile": "step=1",
    "density": "step=1",
    "decay": "step=1",
    "track": "step=1&layer=1&head=0&frame=1&row=1&col=2",
}


def test_every_endpoint_answers_a_bad_parameter_400_in_one_line(folder):
    with _served(folder) as server:

        def answer(api: str, query: str) -> tuple[int, str]:
            status, body = _get(f"{server.url}api/{api}?{query}")
            got = _strict_json(body)
            return status, got.get("error", "")

        for api, query in ENDPOINT_QUERIES.items():
            assert answer(api, query)[0] == 200, api
            for item in ("1", "99", "uncond"):  # one slot recorded, the conditional item's
                status, error = answer(api, f"{query}&item={item}")
                assert status == 400 and ("out of range" in error or "'uncond'" in error), (api, item, error)
                assert len(error.splitlines()) == 1 and "item=" in error
        for bad, words in [
            ("kind=frame&step=x", "step='x' is not a whole number"),
            ("kind=frame&step=-1", "step='-1' is not a whole number"),
            ("kind=frame&step=99999999999", "not a whole number from 0 to"),
            ("kind=frame&step=1&layer=all", "layer='all'"),
            ("kind=frame&step=1&head=1.5", "head='1.5'"),
            ("kind=video_to_text&step=1&token=999", "token=999 is out of range"),
            ("step=1", "missing parameter 'kind'"),
        ]:
            status, error = answer("map", bad)
            assert status == 400 and words in error, (bad, error)
        for where in ("frame=3&row=0&col=0", "frame=0&row=3&col=0", "frame=0&row=0&col=5", "frame=0&row=0"):
            status, error = answer("point", f"step=1&{where}")
            assert status == 400 and ("out of range" in error or "missing parameter 'col'" in error), where
        status, error = answer("point", "step=1&frame=0&row=0&col=9")
        assert "col=9 is out of range: the latent grid is 3 × 3 × 5" in error
        assert answer("nothing", "step=1")[0] == 404


@pytest.mark.parametrize(
    "path", ["file/x", "file/", "file/prompt", "file/nobody/video", "file/prompt/nothing", "file/prompt/frame/%C2%B2"]
)
def test_a_file_path_that_names_no_file_answers_404(folder, path):
    with _served(folder) as server:
        status, body = _get(f"{server.url}{path}")
    assert status == 404 and body == b"not found"


def test_only_exact_host_names_are_answered(folder):
    import socket

    def status(host: bytes) -> int:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as c:
            c.sendall(b"GET /api/runs HTTP/1.1\r\n" + host + b"Connection: close\r\n\r\n")
            data = b""
            while chunk := c.recv(65536):
                data += chunk
        return int(data.split(b" ", 2)[1])

    with _served(folder) as server:
        port = str(server.port).encode()
        for good in (b"localhost", b"127.0.0.1:" + port, b"[::1]:8000", b"LOCALHOST:9999"):
            assert status(b"Host: " + good + b"\r\n") == 200, good
        bad = [b"localhost:80@evil.com", b"127.0.0.1:", b"127.0.0.1 ", b"localhost:123456", b"127.0.0.1:80:80"]
        bad += [b"evil.com", b"127.0.0.1.evil.com", b"localhost@evil.com", b"[::1]x"]
        for host in bad:
            assert status(b"Host: " + host + b"\r\n") == 403, host
        assert status(b"Host:\r\n 127.0.0.1\r\n") == 403  # a folded header: the value is " 127.0.0.1"
        assert status(b"") == 403  # no Host at all


# -- a damaged video -------------------------------------------------------------------------------------------
def test_a_damaged_video_costs_the_video_panel_only(folder, tmp_path, capsys):
    video = folder / "video.gif"
    video.write_bytes(video.read_bytes()[:200])  # cut short
    view = RunView(folder / "maps")
    run = load(folder / "maps")
    summary = view.summary()
    assert summary["video"] is None and summary["video_frames"] == 0 and summary["latent_of_pixel"] == []
    assert "video.gif" in summary["video_note"] and "cannot be decoded" in summary["video_note"]
    got = view.map("frame", 1, "mean")
    assert torch.allclose(
        torch.tensor(got["values"], dtype=torch.float64), aggregate(run, "frame", steps=1).flatten().double()
    )
    with _served(folder) as server:
        status, body = _get(f"{server.url}api/summary?run=prompt")
        assert status == 200 and _strict_json(body)["kinds"] == summary["kinds"]
        assert _get(f"{server.url}file/prompt/video")[0] == 404
    report = tmp_path / "report.html"
    assert main([str(folder), "--export", str(report)]) == 0
    capsys.readouterr()
    data = _embedded(report)
    assert data["files"] == {} and data["summaries"]["prompt"]["video_note"] == summary["video_note"]
    assert "prompt|frame|1|mean|mean|" in data["maps"]


def test_a_video_of_another_length_shows_without_its_overlay_and_says_why(folder):
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "green", "blue")]  # 3 frames: no VAE makes them
    frames[0].save(folder / "video.gif", save_all=True, append_images=frames[1:])
    summary = RunView(folder / "maps").summary()
    assert summary["video"] == "gif" and summary["video_frames"] == 0 and summary["latent_of_pixel"] == []
    assert "3 frames" in summary["video_note"] or "never 3 frames" in summary["video_note"]


@pytest.mark.parametrize("inside", ["video.gif", "maps/report.html", "previews/frame.png"])
def test_the_export_refuses_to_write_into_a_run_folder_it_reads(folder, capsys, inside):
    target = folder / inside
    before = target.read_bytes() if target.exists() else None
    assert main([str(folder), "--export", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inside" in err[0] and str(target) in err[0]
    assert (target.read_bytes() if target.exists() else None) == before


def test_an_export_that_cannot_be_written_names_the_report(folder, tmp_path, capsys):
    report = tmp_path / "a folder"
    report.mkdir()
    assert main([str(folder), "--export", str(report)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{str(report)!r} cannot be written" in err[0]


# -- text on the page -----------------------------------------------------------------------------------------
HOSTILE = '<!--<script>x</script><script>document.title="script ran"</script>'
TOKENS = ["<!--<script>", '</script><img src=x onerror="document.title=1">', "a\u2028b\u2029c", "<!--", "]]>"]


@pytest.fixture
def hostile(folder) -> Path:
    _set_prompt(folder, prompt=HOSTILE, tokens=TOKENS)
    _set_meta(folder, lambda meta: meta.update(info={"prompt": HOSTILE, "seed": "<script>", "note": "<!--"}))
    return folder


def test_the_export_escapes_what_a_script_element_cannot_hold(hostile, tmp_path):
    report = export(hostile, tmp_path / "report.html")
    text = report.read_text()
    script = text[text.index("COGATTN_EMBEDDED = ") : text.index(";</script>")]
    for bad in ("<!--", "<script", "</script", "\u2028", "\u2029", "<"):
        assert bad not in script
    data = _embedded(report)
    assert data["runs"][0]["prompt"] == HOSTILE and data["summaries"]["prompt"]["tokens"][:5] == TOKENS


def _chromium_page(browser, url: str, problems: list, dialogs: list):
    page = browser.new_page()
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(url)
    page.wait_for_function("Number(document.body.dataset.ready) >= 1", timeout=20000)
    return page


def _shows_the_text_as_text(page, run) -> None:
    assert HOSTILE in page.inner_text("#meta")
    options = page.eval_on_selector_all("#token option", "os => os.map(o => o.textContent)")
    assert options[:5] == [f"{i}: {t}" for i, t in enumerate(TOKENS)]
    assert page.evaluate("document.querySelectorAll('img:not(#video)').length") == 0  # the token's <img> is text
    assert page.title() != "script ran"
    values = json.loads(page.get_attribute("#frame", "data-values"))  # the script ran: a panel is drawn
    want = aggregate(run, "frame", steps=len(run.timesteps) - 1).flatten().double()
    assert torch.allclose(torch.tensor(values, dtype=torch.float64), want, rtol=5e-4, atol=1e-6)


def test_hostile_text_is_text_in_the_export_and_on_the_live_page(hostile, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test dependency")
    from test_view import _chromium

    run = load(hostile / "maps")
    report = export(hostile, tmp_path / "report.html")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            problems, dialogs = [], []
            page = _chromium_page(browser, report.as_uri(), problems, dialogs)
            _shows_the_text_as_text(page, run)
            assert page.evaluate("document.querySelectorAll('script').length") == 2
            with _served(hostile) as server:
                page = _chromium_page(browser, server.url, problems, dialogs)
                _shows_the_text_as_text(page, run)
        finally:
            browser.close()
    assert not problems and not dialogs, (problems, dialogs)


def test_the_page_lists_an_unreadable_run_with_its_line_live_and_in_the_export(made, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test dependency")
    from test_view import _chromium

    root, _, bad = _two_runs(made, tmp_path)
    _set_meta(bad, lambda meta: meta["selection"].update(heads=5))
    report = export(root, tmp_path / "report.html")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            problems, dialogs = [], []
            with _served(root) as server:
                for url in (server.url, report.as_uri()):
                    page = _chromium_page(browser, url, problems, dialogs)
                    rows = page.eval_on_selector_all(
                        "tr.run", "rs => rs.map(r => [...r.cells].map(c => c.textContent))"
                    )
                    assert [r[1] for r in rows] == ["good", "bad"] and [r[3] for r in rows] == [
                        "finished",
                        "unreadable",
                    ]
                    assert "selection.heads is 5; it must be " in rows[1][2]
                    assert page.eval_on_selector("tr.run:nth-child(2) td.error", "e => e.textContent") == rows[1][2]
                    page = _chromium_page(browser, f"{url}?run=bad", problems, dialogs)
                    assert page.inner_text("#run-name") == f"bad: {rows[1][2]}" and page.is_hidden("#viewer")
        finally:
            browser.close()
    assert not problems and not dialogs, (problems, dialogs)


# -- one number of run.json, or one folder's name, costs only what the run holds --------------------------------
def _add_block(folder: Path) -> None:
    """A ``block`` record beside each ``frame`` record: one block a side, as S = 53 and block_size 128 give."""
    manifest = folder / "maps" / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    for x in [json.loads(x) for x in lines if json.loads(x)["kind"] == "frame"]:
        file = f"records/block/step{x['step']:04d}_layer{x['layer']:03d}.safetensors"
        (folder / "maps" / file).parent.mkdir(exist_ok=True)
        save_file({"map": torch.ones(1, 2, 1, 1)}, str(folder / "maps" / file))
        line = {**x, "kind": "block", "shape": [1, 2, 1, 1], "bytes": (folder / "maps" / file).stat().st_size}
        lines.append(json.dumps({**line, "file": file}).encode() + b"\n")
    manifest.write_bytes(b"".join(lines))


@pytest.mark.parametrize("change", ["block_size", "no layout"])
def test_a_block_mask_is_made_only_for_a_block_map_of_run_json_s_size(folder, monkeypatch, change):
    """The block record's N is checked against ⌈S / block_size⌉ before a mask is made of run.json's layout (a
    block_size of 1 asks for an S × S mask over a 1 × 1 map), and a run without a layout answers one line."""
    from cogattn.view import data

    _add_block(folder)
    assert "recall" in RunView(folder / "maps").block(1, "mean", "mean", "same_frame")  # the reference: N = 1
    made = []
    monkeypatch.setitem(data.MASKS, "same_frame", lambda layout, size: made.append(size) or 1 / 0)
    _set_meta(folder, lambda m: m["selection"].update(block_size=1) if change == "block_size" else m.pop("layout"))
    with _served(folder) as server:
        status, body = _get(f"{server.url}api/block?step=1&layer=0&head=0&mask=same_frame")
        error = _strict_json(body)["error"]
        assert status == 200 and len(error.splitlines()) == 1 and "mask 'none'" in error and not made
        assert ("1 × 1 blocks" in error and "53 × 53" in error) if change == "block_size" else "no layout" in error
        got = _strict_json(_get(f"{server.url}api/block?step=1&layer=0&head=0")[1])  # the map itself is shown
        assert got["shape"] == [1, 1] and got["values"] == [1.0]


def test_an_unexpected_error_in_one_run_costs_that_run_only(made, tmp_path, monkeypatch):
    """A run without a layout (its block panel, its export), and any error of a run nothing foresaw, in the
    listing and in the export: one line naming the run, and the other run is listed, served and exported."""
    root, good, bad = _two_runs(made, tmp_path)
    for run in (good, bad):
        _add_block(run)
    _set_meta(bad, lambda meta: meta.pop("layout"))
    data = _embedded(export(root, tmp_path / "report.html"))
    assert sorted(data["summaries"]) == ["bad", "good"] and data["left_out"] == []
    assert "no layout" in data["maps"]["bad|block|1|mean|mean|same_frame"]["error"]
    init, summary = RunView.__init__, RunView.summary

    def broken_init(self, path):
        if Path(path).parent.name == "bad":
            raise AttributeError("'NoneType' object has no attribute 'seq_len'")
        init(self, path)

    monkeypatch.setattr(RunView, "summary", lambda self: 1 / 0 if self.path.parent.name == "bad" else summary(self))
    left: list[str] = []
    data = _embedded(export(root, tmp_path / "report.html", left_out=left))
    assert list(data["summaries"]) == ["good"] and left == data["left_out"] and len(left) == 1
    assert left[0] == "bad: left out (ZeroDivisionError: division by zero)"
    monkeypatch.setattr(RunView, "__init__", broken_init)
    problems: list[str] = []
    assert list(open_runs(root, problems)) == ["good"]
    assert problems == ["bad: left out (AttributeError: 'NoneType' object has no attribute 'seq_len')"]
    with _served(root) as server:
        rows = {r["name"]: r for r in _strict_json(_get(f"{server.url}api/runs")[1])}
        assert rows["good"]["status"] == "finished" and rows["bad"]["status"] == "unreadable"
        assert rows["bad"]["error"].startswith("AttributeError: ")
        assert _get(f"{server.url}api/map?run=good&kind=frame&step=1")[0] == 200


def test_one_number_in_run_json_does_not_make_the_summary_large(folder):
    """The audio bins' seconds and the text tokens' labels are sent for what the records hold, at most MAX_LABELS:
    an audio axis with no audio record, or a text of 2**17 tokens, is not a list of 2**17 entries."""
    from cogattn.view.labels import MAX_LABELS, token_labels

    _set_prompt(folder, tokens=None)  # no kept labels: one per token, from run.json's text_len
    sizes = {}
    for name, change in [
        ("audio", lambda meta: meta["layout"].update(audio={"tokens": 2**17})),
        ("text_len", lambda meta: meta["layout"].update(text_len=2**17)),
    ]:
        _set_meta(folder, change)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the records run.json's text no longer fits are skipped
            with _served(folder) as server:
                status, body = _get(f"{server.url}api/summary")
        summary = _strict_json(body)
        assert status == 200 and "frame" in summary["kinds"] and summary["audio_seconds"] is None
        assert len(summary["tokens"]) <= MAX_LABELS and len(summary["negative_tokens"]) <= MAX_LABELS
        sizes[name] = len(body)
    assert max(sizes.values()) < 100_000, sizes
    held = type("Record", (), {"kind": "video_to_text", "shape": (1, 1, 10**7, 1, 1, 1)})
    long = type("Run", (), {"layout": type("Layout", (), {"prompt_len": 10**7}), "batch_roles": None})
    long.text_spans, long.records = ({"prompt": (2, 10**7)},), lambda: [held]
    labels = token_labels(long, None)  # a run that holds 10**7 text tokens: the first MAX_LABELS
    assert len(labels) == MAX_LABELS and labels[:3] == ["pad 0", "pad 1", "prompt 0"]


def test_the_frame_groups_and_the_tile_labels_are_not_made_for_a_layout_no_record_fits(folder, monkeypatch):
    """``frames`` of 2**24 − 8 on a 1 × 1 grid (within MAX_TOKENS; every record line then skipped): the summary names
    no group (the page numbers them), and a tile map compares its groups before it makes a label for each."""
    from cogattn.view import sparse

    _set_meta(folder, lambda meta: meta["layout"].update(frames=2**24 - 8, height=1, width=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        view = RunView(folder / "maps")
        assert view.summary()["groups"] == []
    made_labels, original = [], sparse.tile_labels
    fake = type("View", (), {"run": type("Run", (), {"layout": view.run.layout, "tile_shape": (1, 1, 1)})})
    fake.map = lambda self, *args, **kwargs: {"shape": [2, 2], "values": [0.0] * 4}  # a 2 × 2 tile record
    monkeypatch.setattr(sparse, "options", lambda run: {"patterns": []})
    monkeypatch.setattr(sparse, "tile_labels", lambda *a: made_labels.append(a) or original(*a))
    assert "16777209 groups" in sparse.tile(fake(), 0, 0, "mean")["error"] and made_labels == []


def test_a_lock_file_that_is_a_named_pipe_is_not_waited_on(folder):
    """run.json says "running" and the lock is a named pipe (no recording makes one): the run opens, stopped."""
    import threading

    _set_meta(folder, lambda meta: meta.update(status="running", complete=False))
    lock = folder / "maps" / ".lock"
    lock.unlink(missing_ok=True)
    os.mkfifo(lock)
    got = []
    reader = threading.Thread(target=lambda: got.append(load(folder / "maps").status), daemon=True)
    reader.start()
    reader.join(30)
    assert got == ["stopped"]


def test_skipped_calls_are_matched_once_each_not_over_every_step_and_layer():
    """``skipped_pairs`` reads the steps and layers asked for once each and looks at the skipped calls alone (a
    run.json of a million skipped calls made a summary over every step × layer pair, their square)."""
    from cogattn.analysis.maps import skipped_pairs
    from cogattn.runs.skips import Skips

    class Counted(list):
        reads = 0

        def __iter__(self):
            Counted.reads += 1
            return super().__iter__()

    source = type("Source", (), {"skipped": Skips(by="cache", calls={(3, 1, "self"), (4, 2, "self"), (9, 9, "self")})})
    source.keys = lambda self: [("frame", 4, 2)]
    assert skipped_pairs(source(), "frame", Counted(range(1000)), Counted(range(1000))) == {(3, 1), (9, 9)}
    assert Counted.reads == 2
    assert skipped_pairs(source(), "frame", [3, 4], [1, 2]) == {(3, 1)}


def test_a_deeply_nested_json_file_costs_its_line_or_its_run_in_one_line(folder):
    """Brackets nested past Python's recursion: a manifest line of them is a skipped line, a prompt.json of them
    leaves the prompt's facts out, and a run.json nested past 64 levels is refused in one line (a reader recurses)."""
    manifest = folder / "maps" / "manifest.jsonl"
    manifest.write_bytes(b"[" * 100_000 + b"\n" + manifest.read_bytes())
    (folder / "prompt.json").write_text("[" * 100_000)
    with pytest.warns(UserWarning):
        run = load(folder / "maps")
    assert run.skipped_lines == ["manifest.jsonl:1: not a record line (ValueError: JSON nested deeper than 64 levels)"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert RunView(folder / "maps").files.prompt == {}
    deep: list = []
    for _ in range(200):
        deep = [deep]
    _set_meta(folder, lambda meta: meta.update(info={"notes": deep}))
    with pytest.raises(StoreError, match=r"run\.json' cannot be read \(JSON nested deeper than 64 levels\)"):
        load(folder / "maps")


def test_a_run_json_that_links_out_of_the_run_is_not_read(folder, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text((folder / "maps" / "run.json").read_text().replace("a red fox", "SECRET-OUTSIDE-THE-RUN"))
    (folder / "maps" / "run.json").unlink()
    (folder / "maps" / "run.json").symlink_to(outside)
    with pytest.raises(StoreError, match="resolves outside the run's folder"):
        load(folder / "maps")


def test_a_layout_s_factors_are_bounded(folder):
    """A patch or VAE factor of millions would have readers list millions of frame counts: refused in one line."""
    _set_meta(folder, lambda meta: meta["layout"].update(patch_size_t=10**7))
    with pytest.raises(StoreError, match=r"layout\.patch_size_t = 10000000; it is a whole number from 1 to 64"):
        load(folder / "maps")


def test_a_gif_of_more_pixels_than_the_page_overlays_is_shown_not_overlaid(folder):
    """A 2 KB GIF of 1-pixel frames on a 9000 × 9000 screen: each frame would be composited at full size through
    every frame before it. Shown as the video, with its note; no frame is decoded for the overlay."""
    import struct

    gif = bytearray(b"GIF89a" + struct.pack("<HH", 9000, 9000) + bytes([0x80, 0, 0, 0, 0, 0, 255, 255, 255]))
    for k in range(9):
        gif += b"\x21\xf9\x04\x00\x01\x00\x00\x00\x2c" + struct.pack("<HHHH", k, 0, 1, 1) + b"\x00\x02\x02\x44\x01\x00"
    (folder / "video.gif").write_bytes(bytes(gif + b"\x3b"))
    with _served(folder) as server:
        summary = _strict_json(_get(f"{server.url}api/summary")[1])
        assert summary["video_frames"] == 0 and "9 frames of 9000 × 9000 pixels" in summary["video_note"]
        assert _get(f"{server.url}file/prompt/frame/8")[0] == 404


def test_a_damaged_word_record_costs_its_maps_in_the_export_not_the_run(folder, tmp_path):
    manifest = [json.loads(line) for line in (folder / "maps" / "manifest.jsonl").read_text().splitlines()]
    line = next(m for m in manifest if m["kind"] == "video_to_text")
    record = folder / "maps" / line["file"]
    record.write_bytes(record.read_bytes()[:100])
    data = _embedded(export(folder, tmp_path / "report.html"))
    assert list(data["summaries"]) == ["prompt"] and data["left_out"] == []
    damaged = [v for k, v in data["maps"].items() if k.startswith(f"prompt|video_to_text|{line['step']}|")]
    assert damaged and all("error" in v and str(record) in v["error"] for v in damaged)
    assert any(k.startswith("prompt|frame|") and "values" in v for k, v in data["maps"].items())


def test_a_run_folder_whose_name_is_not_text_is_listed_and_served_with_the_others(made, tmp_path):
    """A folder name of Latin-1 bytes (b"caf\\xe9", from an archive) is not UTF-8: the run gets a name that is text
    (its byte written \\xe9), the page's URLs of it reach it, and the runs after it are listed too."""
    from urllib.parse import quote

    from cogattn.view.labels import run_names

    root = tmp_path / "runs"
    for name in ("a_first", "z_last"):
        shutil.copytree(made, root / name)
    shutil.copytree(made, os.fsdecode(os.fsencode(str(root)) + b"/m_caf\xe9"))
    with _served(root) as server:
        rows = _strict_json(_get(f"{server.url}api/runs")[1])
        assert [r["name"] for r in rows] == ["a_first", "m_caf\\xe9", "z_last"]
        assert [r["status"] for r in rows] == ["finished"] * 3
        for row in rows:
            name = quote(row["name"].encode("utf-8"))  # as encodeURIComponent writes it
            status, body = _get(f"{server.url}api/summary?run={name}")
            assert status == 200 and _strict_json(body)["kinds"] == ["entropy", "frame", "video_to_text"]
            assert _get(f"{server.url}file/{name}/thumbnail")[0] == 200
    assert run_names(["a\\xe9", "a\udce9", "a\udce9", "b\ud800"]) == ["a\\xe9", "a\\xe9 (2)", "a\\xe9 (3)", "b\\ud800"]
