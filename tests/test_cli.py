"""cogattn-dump as a user runs it, checked by the files it wrote: in-process through ``main(argv)``;
subprocesses only for a killed run and ``accelerate launch`` (slow)."""

import contextlib
import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
import torch
from PIL import Image

import cogattn
from cogattn.costs import estimate
from cogattn.dump import main
from cogattn.dump.config import CAPTURE_KEYS, ConfigError, DumpConfig, default_config, load_config
from cogattn.dump.prompts import read_prompts

pytestmark = pytest.mark.usefixtures("forget_accelerate_state")  # every test of the module (conftest.py)
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "dump_maps.py"
TINY = ROOT / "configs" / "tiny.yaml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COGATTN_DEBUG": "1"}
# Fewer steps, no previews; the default video shape, so that the VAE's first-call cost per shape is paid once.
QUICK = ["--set", "num_inference_steps=1", "--set", "previews=false"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Each test runs in its own folder, with tracebacks of failed prompts on stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COGATTN_DEBUG", "1")


def _run_once(save_dir: Path, *args) -> Path:
    """A run shared by the tests of this module (they copy it before they change it)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["--set", f"save_dir={save_dir}", *map(str, args)])
    assert code == 0, err.getvalue()[-3000:]
    return save_dir


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The default command: the shipped tiny.yaml, previews included."""
    return _run_once(tmp_path_factory.mktemp("default") / "runs")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    return _run_once(tmp_path_factory.mktemp("quick") / "runs", *QUICK)


def _prompt_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def _meta(folder: Path) -> dict:
    return json.loads((folder / "prompt.json").read_text())


def _files(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


def test_tiny_default_writes_loadable_records_video_and_previews(default_run):
    out = default_run
    cfg = load_config(TINY)
    prompts = read_prompts(cfg)
    steps = cfg.num_inference_steps
    dirs = _prompt_dirs(out)
    assert [d.name for d in dirs] == [p.key() for p in prompts]
    for d, p in zip(dirs, prompts):
        meta = _meta(d)
        assert meta["complete"] and meta["prompt"] == p.prompt
        assert meta["config"]["capture"]["kinds"] == ["frame", "video_to_text", "text_to_video"]
        run = cogattn.load(d / "maps")
        assert run.complete and len(run) == 3 * steps * 2  # kinds × steps × layers
        assert run.get("frame", 3, 1).shape == (1, 1, 4, 4)
        assert run.meta["info"]["prompt"] == p.prompt
        with Image.open(d / meta["video"]) as gif:
            assert gif.n_frames == cfg.num_frames and gif.size == (cfg.width, cfg.height)
        assert meta["previews"]
        for name in meta["previews"]:
            with Image.open(d / "previews" / name) as png:
                png.load()
                assert png.size[0] > 100 and png.size[1] > 100


def test_dry_run_bytes_equal_what_a_run_writes(tmp_path, dump):
    out = tmp_path / "runs"
    sets = [
        "--set",
        f"save_dir={out}",
        "--set",
        "capture.kinds=[frame,query,text_to_video]",
        "--set",
        "capture.queries=[[1,2,3],0]",
        "--set",
        "capture.heads=all",
        "--set",
        "capture.storage_dtype=float16",
        "--set",
        "previews=false",
        "--set",
        "capture.layer_output=joint",
        "--set",
        "num_inference_steps=2",
    ]
    dry = dump("--dry-run", *sets, check=0)
    assert not out.exists()  # nothing written, no weights loaded
    assert dry.stdout.splitlines()[0] == f"config {TINY}"
    total_line = next(line for line in dry.stdout.splitlines() if line.split()[:1] == ["total"])
    total = int(total_line.split()[2].replace(",", ""))
    dump(*sets, check=0)
    written = sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors"))
    assert total == written
    for d in _prompt_dirs(out):
        run_meta = json.loads((d / "maps" / "run.json").read_text())
        assert run_meta["layer_output"] == "joint" and run_meta["storage_dtype"] == "float16"


def test_a_disk_too_small_refuses_a_run_before_loading_and_a_dry_run_reports_it(tmp_path, dump, monkeypatch):
    from cogattn.dump import cli

    out = tmp_path / "runs"
    sets = ["--set", f"save_dir={out}", "--set", "num_inference_steps=2"]
    dry = dump("--dry-run", *sets, check=0)
    assert "a run here would be refused" not in dry.stdout
    cfg = load_config(TINY, [f"save_dir={out}", "num_inference_steps=2"])
    plan = cli.plan(cfg, read_prompts(cfg))
    need, free, where = cli.disk_need(cfg, read_prompts(cfg), plan)
    assert need >= plan.record_bytes and where == tmp_path  # whole filesystem blocks
    real = shutil.disk_usage
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    monkeypatch.setattr(cli, "load_pipeline", lambda *a: pytest.fail("loaded a pipeline for a run that cannot fit"))
    short = dump("--dry-run", *sets, check=0)  # planned for another machine: reported, exit 0
    assert f"a run here would be refused: the remaining prompts will take {need:,} bytes" in short.stdout
    refused = dump(*sets, check=2)
    assert (
        f"will take {need:,} bytes of disk for their maps" in refused.stderr
        and f"{need - 1:,} bytes free" in refused.stderr
    )
    assert len(refused.stderr.strip().splitlines()) == 1 and not out.exists()


def test_estimate_matches_the_api_and_refuses_bad_selection():
    e = estimate("tiny", num_frames=9, height=48, width=80, num_inference_steps=4, kinds=("frame",), batch="cond")
    assert e.num_records == 4 * 2 and e.layout.grid == (3, 3, 5)
    with pytest.raises(ValueError, match="layers index 7 is out of range"):
        estimate("tiny", num_frames=9, height=48, width=80, num_inference_steps=4, layers=[7])


def test_the_config_holds_capture_options_and_the_output_key_ignores_how_maps_are_computed():
    cfg = load_config(TINY, ["capture.steps=[0,3]", "capture.memory_budget=2MiB"])
    assert isinstance(cfg.capture, cogattn.CaptureOptions)
    assert cfg.capture.steps == (0, 3) and cfg.capture.memory_budget == 2 * 2**20
    assert cfg.to_dict()["capture"]["steps"] == [0, 3]
    plain = load_config(TINY, ["capture.steps=[0,3]"])
    same = [
        "device=cpu",
        "offload=model",
        "vae_tiling=true",
        "save_dir=elsewhere",
        "prompts=other.txt",
        "capture.memory_budget=7MiB",
        "capture.method=rows",
    ]
    assert load_config(TINY, ["capture.steps=[0,3]", *same]).output_key() == plain.output_key() == cfg.output_key()
    for other in ("capture.steps=[0]", "capture.heads=all", "num_inference_steps=5", "seed=1", "dtype=bfloat16"):
        assert load_config(TINY, ["capture.steps=[0,3]", other]).output_key() != plain.output_key(), other
    # however a setting is written: 6 or 6.0, the steps, layers and kinds in any order (keys written before kept)
    written = load_config(TINY, ["capture.steps=[3,0]", "guidance_scale=6", "capture.kinds=[video_to_text,frame]"])
    spelled = load_config(TINY, ["capture.steps=[0,3]", "guidance_scale=6.0", "capture.kinds=[frame,video_to_text]"])
    assert written.output_key() == spelled.output_key() == spelled.output_key(legacy=True)
    assert written.output_key(legacy=True) != spelled.output_key(legacy=True)
    assert (
        load_config(TINY, ["capture.heads=[1,0]"]).output_key()
        != load_config(TINY, ["capture.heads=[0,1]"]).output_key()
    )
    per_prompt = cfg.capture_options(save_dir="x/maps", info={"prompt": "p"})
    assert per_prompt.save_dir == Path("x/maps") and per_prompt.steps == (0, 3)
    doc = DumpConfig.__doc__
    assert [k for k in [*cfg.to_dict(), *CAPTURE_KEYS] if not re.search(rf"\b{k}\b", doc)] == []  # every key documented


def test_resume_redoes_an_incomplete_prompt_and_skips_complete_ones(tmp_path, dump, quick_run):
    out = shutil.copytree(quick_run, tmp_path / "runs")
    first, second, third = _prompt_dirs(out)
    before = (first / "prompt.json").stat().st_mtime_ns
    meta = _meta(second)
    (second / "prompt.json").write_text(json.dumps({**meta, "complete": False}))  # as a killed run leaves it
    (second / "maps" / "run.json").unlink()
    (third / "prompt.json").write_text("[]")  # JSON, but not what the tool writes: redone
    rerun = dump("--set", f"save_dir={out}", *QUICK, check=0)
    assert "1 prompts already complete, skipped" in rerun.stdout
    assert "2 prompts written" in rerun.stdout
    assert "[process" not in rerun.stdout  # one process: its lines need no name
    assert rerun.stdout.splitlines()[-1] == f"see the maps in the browser: cogattn view {out}"
    assert (first / "prompt.json").stat().st_mtime_ns == before  # untouched
    assert _meta(second)["complete"] and cogattn.load(second / "maps").complete
    assert _meta(third)["complete"] and cogattn.load(third / "maps").complete


def test_a_save_dir_under_the_home_folder_is_one_folder_and_resumes(tmp_path, dump, quick_run, monkeypatch):
    """``save_dir: ~/runs``: the videos, prompt.json and the maps in one folder, and a rerun skips what is done."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = shutil.copytree(quick_run, tmp_path / "home" / "runs")
    _, second, _ = _prompt_dirs(out)
    (second / "prompt.json").write_text(json.dumps({**_meta(second), "complete": False}))
    (second / "maps" / "run.json").unlink()
    rerun = dump("--set", "save_dir=~/runs", *QUICK, check=0)
    assert "2 prompts already complete, skipped" in rerun.stdout and "1 prompts written" in rerun.stdout
    assert not (tmp_path / "~").exists() and _meta(second)["complete"] and cogattn.load(second / "maps").complete


def test_a_prompt_another_process_completed_meanwhile_is_kept(tmp_path, dump, quick_run, monkeypatch):
    """A prompt found incomplete when the tool chose its prompts, then completed by another process before this one
    took its lock: kept as the other wrote it, counted as skipped."""
    import cogattn.dump.cli as cli

    out = shutil.copytree(quick_run, tmp_path / "runs")
    _, second, _ = _prompt_dirs(out)
    finished = (second / "prompt.json").read_text()
    (second / "prompt.json").write_text(json.dumps({**_meta(second), "complete": False}))
    record = (second / "maps" / "run.json").stat().st_mtime_ns
    real = cli.run_prompt

    def another_process_finishes_first(pipe, cfg, prompt, folder, *args):
        (folder / "prompt.json").write_text(finished)
        return real(pipe, cfg, prompt, folder, *args)

    monkeypatch.setattr(cli, "run_prompt", another_process_finishes_first)
    rerun = dump("--set", f"save_dir={out}", *QUICK, check=0)
    assert "0 prompts written, 3 skipped, 0 failed" in rerun.stdout
    assert (second / "maps" / "run.json").stat().st_mtime_ns == record and _meta(second)["complete"]


def test_a_prompt_another_process_is_writing_is_left_alone(tmp_path, dump, quick_run):
    from cogattn.runs.folder import RunLock

    out = shutil.copytree(quick_run, tmp_path / "runs")
    _, second, _ = _prompt_dirs(out)
    (second / "prompt.json").write_text(json.dumps({**_meta(second), "complete": False}))
    lock = RunLock(second)  # as another run over the same save_dir, writing this prompt, holds it
    try:
        proc = dump("--set", f"save_dir={out}", *QUICK, check=0)  # its prompt: no failure of this run
    finally:
        lock.release()
    assert f"prompt {second.name[:4].lstrip('0') or 0} is being written by another process; left to it" in proc.stdout
    assert "0 prompts written, 3 skipped, 0 failed" in proc.stdout
    assert cogattn.load(second / "maps").keys()  # its records are untouched


def _quiet_main(argv) -> None:
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        main(argv)


@pytest.mark.slow
def test_resume_after_a_killed_run(tmp_path):
    out = tmp_path / "runs"
    sets = ["--set", f"save_dir={out}", "--set", "num_inference_steps=20", "--set", "previews=false"]
    proc = forked.start(_quiet_main, sets)
    deadline = time.time() + 120
    first = None
    while time.time() < deadline:
        done = [
            d for d in (out.iterdir() if out.exists() else []) if (d / "prompt.json").exists() and _meta(d)["complete"]
        ]
        started = [d for d in (out.iterdir() if out.exists() else []) if (d / "maps" / "manifest.jsonl").exists()]
        if done and len(started) >= 2 and (sorted(started)[1] / "maps" / "manifest.jsonl").read_text().count("\n") > 3:
            first = done[0]
            break
        time.sleep(0.01)
    forked.kill(proc)
    assert first is not None, "the first prompt did not complete in time"
    before = (first / "prompt.json").stat().st_mtime_ns
    second = sorted(out.iterdir())[1]
    assert not _meta(second)["complete"]
    out_text, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err):
        assert main(sets) == 0, err.getvalue()[-3000:]
    assert "1 prompts already complete, skipped" in out_text.getvalue()
    assert (first / "prompt.json").stat().st_mtime_ns == before  # untouched
    for d in _prompt_dirs(out):
        assert _meta(d)["complete"]
        assert cogattn.load(d / "maps").complete and len(cogattn.load(d / "maps")) == 3 * 20 * 2


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


BAD_JSONL = '{"prompt": "a red fox"}\n{"prompt": "a cat",}\n'  # line 2: a key expected at column 20
HUGE_SEED = '{"prompt": "a"}\n{"prompt": "b", "seed": 18446744073709551616}\n'  # 2**64: past torch's seeds
LATIN1 = "a café at night".encode("latin-1")  # é is byte 5
SURROGATE = '{"prompt": "a fox"}\n{"prompt": "a cat \\ud800"}\n'  # valid JSON, half a UTF-16 pair: no text


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing_prompts", "prompts file .* does not exist"),
        ("bad_yaml", "is not valid YAML"),
        ("unknown_key", r"unknown config key \['stepz'\]; valid keys: \['model', 'task'"),
        ("renamed_key", r"unknown config keys \['kinds', 'out'\] \(renamed: kinds → capture.kinds, out → save_dir\)"),
        ("unknown_task", r"task: 'video-to-video' is not one of \['text-to-video', 'image-to-video'\]"),
        ("layer_range", "layers index 9 is out of range; valid indices are 0..1"),
        ("query_grid", r"\(5, 0, 0\) is outside the latent grid"),
        ("missing_image", "image .*nowhere.png' does not exist"),
        (
            "bad_jsonl",
            r"bad\.jsonl:2: not valid JSON at column 20: Expecting property name enclosed in double quotes; write each "
            r'prompt as one JSON object on its own line, such as \{"prompt": "a red fox"\}\.$',
        ),
        ("not_utf8", r"prompts file .*latin1\.txt' is not UTF-8 text \(byte 5: b'\\xe9'\); save it as UTF-8\.$"),
        ("string_seed", r"s\.jsonl:1: seed is '7'; give a whole number from 0 to 2\*\*64 - 1\.$"),
        ("huge_seed", r"h\.jsonl:2: seed is 18446744073709551616; give a whole number"),
        ("number_image", r"n\.jsonl:1: image is 5; give a string\.$"),
        ("image_without_task", r"prompts \[0\] give an 'image', but task is 'text-to-video'; set task: image-to-video"),
        ("offload_on_cpu", r"offload: 'model' needs a GPU device, but device is 'cpu'; set offload: none\.$"),
        (
            "offload_auto_no_gpu",
            r"offload: 'sequential' needs a GPU, but device 'auto' finds none; set offload: none\.$",
        ),
        ("config_seed", r"seed must be from 0 to 2\*\*64 - 1 and guidance_scale finite"),
        ("infinite_guidance", r"guidance_scale inf\.$"),
        ("bad_override", "--set 'steps': expected key=value"),
        ("dotted_override", r"--set 'seed.x=1': only capture options have dotted keys"),
        ("unknown_output", r"capture: layer_output='fast' is not one of \['stock', 'lse', 'joint'\]"),
        (
            "joint_with_method",
            "layer_output='joint' computes the key-pooled kinds in the output call; method='rows' cannot apply",
        ),
        ("unknown_capture_key", r"unknown capture key \['path'\] \(renamed: path → method\); valid keys: \['kinds'"),
        ("capture_save_dir", r"capture.save_dir is set by the tool for each prompt .*; set the top-level save_dir"),
        ("capture_not_mapping", r"capture: expected a mapping of capture options"),
        ("bad_type", r"num_inference_steps: expected int, got 'four'"),
        ("zero_steps", r"num_inference_steps: 0 must be at least 1"),
        ("negative_steps", r"num_inference_steps: -3 must be at least 1"),
        ("narrow", r"width: 8 must be a positive multiple of 16"),
        ("zero_fps", r"fps: 0 must be at least 1"),
        ("zero_frames", r"num_frames: 0; the CogVideoX VAE decodes 4k \+ 1 frames"),
        ("odd_frames", r"num_frames: 10; .* use 9 or 13"),
        ("tpu", r"device: 'tpu' is not 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("save_dir_file", r"save_dir: .* is a file, not a folder"),
        ("flag_not_bool", r"previews: expected bool, got 'maybe'"),
        ("lone_surrogate", r"sur\.jsonl:2: prompt holds '\\ud800', half of a pair, no character"),
        ("yaml_exponent", r"guidance_scale: expected a number, got '1e3' \(YAML reads 1e3 as text: write 1\.0e\+3\)"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, dump, case, message):
    if case == "offload_auto_no_gpu" and torch.cuda.is_available():
        pytest.skip("device 'auto' finds a GPU here")
    out = tmp_path / "runs"
    args = {
        "missing_prompts": ["--set", "prompts=/nonexistent/prompts.txt"],
        "bad_yaml": [_write(tmp_path / "bad.yaml", "model: tiny\ncapture: {kinds: [frame}\n")],
        "unknown_key": ["--set", "stepz=4"],
        "renamed_key": ["--set", "out=x", "--set", "kinds=[frame]"],
        "unknown_task": ["--set", "task=video-to-video"],
        "layer_range": ["--set", "capture.layers=[0,9]"],
        "query_grid": ["--set", "capture.kinds=[query]", "--set", "capture.queries=[[5,0,0]]"],
        "missing_image": [
            "--set",
            "task=image-to-video",
            "--set",
            f"prompts={_write(tmp_path / 'p.jsonl', json.dumps({'prompt': 'x', 'image': 'nowhere.png'}))}",
        ],
        "bad_jsonl": ["--set", f"prompts={_write(tmp_path / 'bad.jsonl', BAD_JSONL)}"],
        "not_utf8": ["--set", f"prompts={_write(tmp_path / 'latin1.txt', LATIN1)}"],
        "string_seed": ["--set", f"prompts={_write(tmp_path / 's.jsonl', json.dumps({'prompt': 'x', 'seed': '7'}))}"],
        "huge_seed": ["--set", f"prompts={_write(tmp_path / 'h.jsonl', HUGE_SEED)}"],
        "number_image": ["--set", f"prompts={_write(tmp_path / 'n.jsonl', json.dumps({'prompt': 'x', 'image': 5}))}"],
        "image_without_task": [
            "--set",
            f"prompts={_write(tmp_path / 'i.jsonl', json.dumps({'prompt': 'x', 'image': str(ROOT / 'configs/prompts/images/gradient.png')}))}",
        ],
        "offload_on_cpu": ["--set", "offload=model", "--set", "device=cpu", "--dry-run"],
        "offload_auto_no_gpu": ["--set", "offload=sequential", "--set", "device=auto"],  # a dry run plans it
        "config_seed": ["--set", "seed=18446744073709551616", "--dry-run"],
        "infinite_guidance": ["--set", "guidance_scale=.inf", "--dry-run"],
        "bad_override": ["--set", "steps"],
        "dotted_override": ["--set", "seed.x=1"],
        "unknown_output": ["--set", "capture.layer_output=fast"],
        "joint_with_method": ["--set", "capture.layer_output=joint", "--set", "capture.method=rows"],
        "unknown_capture_key": ["--set", "capture.path=rows"],
        "capture_save_dir": ["--set", "capture.save_dir=elsewhere"],
        "capture_not_mapping": ["--set", "capture=[frame]"],
        "bad_type": ["--set", "num_inference_steps=four"],
        "zero_steps": ["--set", "num_inference_steps=0"],
        "negative_steps": ["--set", "num_inference_steps=-3", "--dry-run"],
        "narrow": ["--set", "width=8"],
        "zero_fps": ["--set", "fps=0"],
        "zero_frames": ["--set", "num_frames=0"],
        "odd_frames": ["--set", "num_frames=10"],
        "tpu": ["--set", "device=tpu"],
        "save_dir_file": ["--set", f"save_dir={_write(tmp_path / 'file', 'x') / 'runs'}"],
        "flag_not_bool": ["--set", "previews=maybe"],
        "lone_surrogate": ["--set", f"prompts={_write(tmp_path / 'sur.jsonl', SURROGATE)}"],
        "yaml_exponent": ["--set", "guidance_scale=1e3"],
    }[case]
    if not str(args[0]).endswith(".yaml"):
        args = [TINY, *args]
    before = _files(tmp_path)
    save = [] if case == "save_dir_file" else ["--set", f"save_dir={out}"]
    proc = dump(*args, *save, check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dump_maps: "), proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists() and _files(tmp_path) == before


def test_set_fills_an_empty_capture_section_and_takes_a_prompts_file_from_the_current_folder(tmp_path):
    """``capture:`` with nothing under it takes ``--set capture.KEY=``; ``--set prompts=FILE`` is where the command
    runs (as save_dir is), the config file's own ``prompts:`` beside the config."""
    (tmp_path / "configs").mkdir()
    _write(tmp_path / "configs" / "theirs.txt", "a prompt beside the config\n")
    config = _write(tmp_path / "configs" / "empty.yaml", "model: tiny\nprompts: theirs.txt\ncapture:\n")
    _write(tmp_path / "mine.txt", "a prompt of mine\n")  # the test runs in tmp_path (_in_tmp)
    cfg = load_config(config, ["capture.steps=[0]"])
    assert cfg.capture.steps == (0,) and read_prompts(cfg)[0].prompt == "a prompt beside the config"
    assert read_prompts(load_config(config, ["prompts=mine.txt"]))[0].prompt == "a prompt of mine"


def test_a_prompt_may_hold_any_character_but_a_line_end(tmp_path):
    odd = "a fox\u2028under\u2029the\x85moon\x0bat\x1dnight"  # str.splitlines() would cut at each of these
    rows = [{"prompt": odd, "seed": 3}, {"prompt": "a cat", "negative_prompt": "blur\u2028ry"}]
    jsonl = "\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\r\n"  # BOM, CRLF
    assert "\u2028" in jsonl and "\x85" in jsonl  # raw in the file, as JSON allows in a string
    _write(tmp_path / "p.jsonl", jsonl.encode())
    _write(tmp_path / "p.txt", f"\ufeff{odd}\r\n\n  a cat  \n".encode())
    for name in ("p.jsonl", "p.txt"):
        prompts = read_prompts(load_config(TINY, [f"prompts={tmp_path / name}"]))
        assert [p.prompt for p in prompts] == [odd, "a cat"], name
    assert [(p.seed, p.negative_prompt) for p in prompts] == [(None, None)] * 2
    got = read_prompts(load_config(TINY, [f"prompts={tmp_path / 'p.jsonl'}"]))
    assert [(p.index, p.seed, p.negative_prompt) for p in got] == [(0, 3, None), (1, None, "blur\u2028ry")]


def test_a_failing_prompt_does_not_stop_the_others(tmp_path, dump):
    out = tmp_path / "runs"
    (tmp_path / "broken.png").write_bytes(b"not an image")
    Image.new("RGB", (80, 48), (200, 30, 30)).save(tmp_path / "red.png")
    prompts = _write(
        tmp_path / "p.jsonl",
        "\n".join(
            json.dumps(x)
            for x in [
                {"prompt": "a red fox", "image": "red.png"},
                {"prompt": "a cat", "image": "broken.png"},
                {"prompt": "a dog", "image": "red.png", "seed": 3},
            ]
        ),
    )
    proc = dump(
        "--set", "task=image-to-video", "--set", f"prompts={prompts}", "--set", f"save_dir={out}", *QUICK, check=1
    )
    assert "failed: prompt 1 ('a cat')" in proc.stderr
    assert [_meta(d)["complete"] for d in _prompt_dirs(out)] == [True, False, True]


def test_what_fails_after_the_maps_names_its_file_and_previews_never_cost_the_generation(tmp_path, dump, monkeypatch):
    """A full disk after the generation: the video's failure names the file and the folder (the prompt is redone, as
    documented); a preview's is a warning, the prompt complete with its maps, video and head table, so that a rerun
    does not generate it again."""
    from matplotlib.figure import Figure

    from cogattn.dump import generate

    full = OSError(28, "No space left on device")

    def no_room(*args, **kwargs):
        raise full

    one = tmp_path / "one.txt"
    one.write_text("a red fox\n")
    base = ["--set", "num_inference_steps=1", "--set", f"prompts={one}", "--set", "capture.kinds=[frame]"]
    monkeypatch.setattr(generate, "_save_video", no_room)
    proc = dump(*base, "--set", f"save_dir={tmp_path / 'video'}", "--set", "previews=false", check=1)
    assert "prompt 0 failed: StoreError: its maps are written, but writing its video in" in proc.stderr
    assert "No space left on device" in proc.stderr and not _meta(_prompt_dirs(tmp_path / "video")[0])["complete"]
    monkeypatch.undo()
    monkeypatch.setattr(Figure, "savefig", no_room)
    with pytest.warns(UserWarning, match="prompt 0: its previews were not written .*frame.png failed: No space"):
        dump(*base, "--set", f"save_dir={tmp_path / 'previews'}", check=0)
    (folder,) = _prompt_dirs(tmp_path / "previews")
    meta = _meta(folder)
    assert meta["complete"] and "frame.png failed: No space left on device" in meta["previews_error"]
    assert cogattn.load(folder / "maps").keys() and (folder / meta["video"]).is_file() and "previews" not in meta


@pytest.mark.slow
def test_accelerate_launch_two_processes_cover_every_prompt_once(tmp_path):
    out = tmp_path / "runs"
    prompts = _write(tmp_path / "p.txt", "\n".join(f"prompt number {i}" for i in range(5)))
    # --multi_gpu picks accelerate's torchrun launcher; without GPUs the two processes run on CPU over gloo.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "cogattn.dump",
        "--set",
        f"save_dir={out}",
        "--set",
        f"prompts={prompts}",
        "--set",
        "previews=false",
        "--set",
        "num_inference_steps=2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metas = [_meta(d) for d in _prompt_dirs(out)]
    assert sorted(m["index"] for m in metas) == list(range(5)) and all(m["complete"] for m in metas)
    assert {m["process"] for m in metas} == {0, 1}
    by_process = {p: sorted(m["index"] for m in metas if m["process"] == p) for p in (0, 1)}
    assert sorted(by_process[0] + by_process[1]) == list(range(5))  # each prompt exactly once


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_plans_offline(config, tmp_path, dump, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:  # a family this diffusers lacks says which one it needs
        assert load_config(ROOT / "configs" / config).family
    except ConfigError as err:
        if "needs diffusers" not in str(err):
            raise
        pytest.skip(str(err))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import; set it for this call
    proc = dump(ROOT / "configs" / config, "--dry-run", "--set", f"save_dir={tmp_path / 'x'}", check=0)
    assert "predicted peak extra memory" in proc.stdout and not (tmp_path / "x").exists()


def test_rerun_with_other_settings_into_the_same_save_dir_is_refused(tmp_path, dump, quick_run):
    out = shutil.copytree(quick_run, tmp_path / "runs")
    first = _prompt_dirs(out)[0]  # a folder of an earlier version, whose key was its raw values': kept
    legacy = load_config(TINY, [*QUICK[1::2], f"save_dir={out}"]).output_key(legacy=True)
    (first / "prompt.json").write_text(json.dumps({**_meta(first), "config_key": legacy}))
    again = dump("--set", f"save_dir={out}", *QUICK, "--set", "capture.memory_budget=64MiB", check=0)
    assert "3 prompts already complete, skipped" in again.stdout  # the budget changes how, not what
    other = dump("--set", f"save_dir={out}", *QUICK, "--set", "seed=5", check=2)
    assert "was made with other settings" in other.stderr and len(other.stderr.strip().splitlines()) == 1


def test_the_default_config_is_the_top_level_configs_folder():
    assert default_config() == TINY


@pytest.mark.parametrize("entry", ["python -m cogattn.dump", "scripts/dump_maps.py"])
def test_module_and_script_entry_points(entry, tmp_path, capsys, monkeypatch):
    out = tmp_path / "runs"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout first
    monkeypatch.setattr(sys, "argv", [entry, "--dry-run", "--set", f"save_dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        if entry == "scripts/dump_maps.py":
            runpy.run_path(str(SCRIPT), run_name="__main__")
        else:
            runpy.run_module("cogattn.dump", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"config {TINY}\nmodel tiny (text-to-video), 3 prompts")
    assert not out.exists()


def test_cogattn_help_lists_its_commands_and_exits_0(capsys):
    from cogattn.__main__ import main as cogattn_main

    assert cogattn_main(["--help"]) == 0 and cogattn_main(["-h"]) == 0
    out = capsys.readouterr().out
    assert "cogattn view PATH" in out and "cogattn dump CONFIG" in out
    assert cogattn_main(["nope"]) == 2 and capsys.readouterr().err.startswith("usage: cogattn {view,dump}")


def test_cuda_without_a_gpu_is_refused_before_anything_loads(tmp_path, dump, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    proc = dump("--set", "device=cuda", "--set", f"save_dir={tmp_path / 'runs'}", check=2)
    assert (
        proc.stderr.strip()
        == "dump_maps: device: 'cuda', but this machine has no CUDA device; use device: auto or cpu."
    )


def test_a_checkpoint_that_cannot_be_loaded_is_one_line_and_exit_1(tmp_path, dump, monkeypatch):
    """A checkpoint neither cached nor reachable (the Hub's OSError, after a hundred lines of traceback before):
    one line naming it and what to do; nothing written."""
    import cogattn.dump.cli as cli

    def offline(cfg, device):
        raise OSError(f"Cannot load model {cfg.model}: model is not cached locally and an error occurred\nwhile ...")

    monkeypatch.setattr(cli, "load_pipeline", offline)
    proc = dump("--set", f"save_dir={tmp_path / 'runs'}", check=1)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("dump_maps: could not load tiny: Cannot load model tiny: model is not cached locally and")
    assert "HF_HUB_OFFLINE=1" in line and not any((tmp_path / "runs").glob("*/maps/*"))


def test_tiny_version_read_as_a_number_is_accepted(dump):
    assert "S = 38" in dump("--set", "tiny_version=1.5", "--dry-run", check=0).stdout  # 8 text + 2×3×5 video tokens


def test_ctrl_c_prints_one_line_saying_what_is_kept_and_exits_130(tmp_path, dump, monkeypatch):
    import cogattn.dump.cli as cli

    real, calls = cli.run_prompt, []

    def interrupted_at_the_second_prompt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*args, **kwargs)

    monkeypatch.setattr(cli, "run_prompt", interrupted_at_the_second_prompt)
    out = tmp_path / "runs"
    proc = dump(*QUICK, "--set", f"save_dir={out}", check=130)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dump_maps: interrupted; 1 of 3 prompts are complete in {str(out)!r} and kept; run the same command again "
        "to resume (complete prompts are skipped)."
    )
    monkeypatch.setattr(cli, "run_prompt", real)
    again = dump(*QUICK, "--set", f"save_dir={out}", check=0)
    assert "1 prompts already complete, skipped" in again.stdout


def test_the_head_table_is_saved_as_csv_next_to_the_maps(tmp_path, dump):
    import pandas as pd

    from cogattn.analysis.head_stats import head_table

    out, prompts = tmp_path / "runs", tmp_path / "one.txt"
    prompts.write_text("a red fox running in the snow\n")  # one prompt: the table is per prompt
    kinds = "capture.kinds=[frame,entropy,received,block]"
    dump("--set", f"save_dir={out}", "--set", kinds, "--set", "capture.heads=all", "--set", "capture.block_size=16",
         "--set", "num_inference_steps=2", "--set", f"prompts={prompts}", check=0)  # fmt: skip
    dirs = _prompt_dirs(out)
    assert len(dirs) == 1
    for d in dirs:
        assert _meta(d)["head_table"] == "heads.csv"
        saved, ref = pd.read_csv(d / "heads.csv"), head_table(cogattn.load(d / "maps"))
        assert len(saved) == len(ref) == 2 * 2 * 2  # steps × layers × heads of the tiny model
        for column in ("text_mass", "same_frame_mass", "entropy_mean", "sink_share"):
            assert (saved[column] - ref[column]).abs().max() <= 1e-9, column
        assert list(saved["label"]) == list(ref["label"])
        assert set(_meta(d)["previews"]) == {f"{k}.png" for k in ("frame", "entropy", "received", "block", "heads")}
