"""scripts/dump_maps.py as a user runs it: a subprocess on the tiny default, checked by the files it wrote."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

import cogattn
from cogattn.config import load_config, read_prompts
from cogattn.estimate import estimate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "dump_maps.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COGATTN_DEBUG": "1"}


def dump(*args, cwd=None, check=None, **kw):
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=300, **kw)  # fmt: skip
    if check is not None:
        assert proc.returncode == check, proc.stderr[-3000:]
    return proc


def _prompt_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def test_tiny_default_writes_loadable_records_video_and_previews(tmp_path):
    out = tmp_path / "runs"
    dump("--set", f"out={out}", check=0)
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    prompts = read_prompts(cfg)
    dirs = _prompt_dirs(out)
    assert [d.name for d in dirs] == [p.key() for p in prompts]
    for d, p in zip(dirs, prompts):
        meta = json.loads((d / "prompt.json").read_text())
        assert meta["complete"] and meta["prompt"] == p.prompt
        run = cogattn.load(d / "maps")
        assert run.complete and len(run) == 3 * cfg.steps * 2  # kinds × steps × layers
        assert run.get("frame", 3, 1).shape == (1, 1, 4, 4)
        assert run.meta["info"]["prompt"] == p.prompt
        with Image.open(d / meta["video"]) as gif:
            assert gif.n_frames == cfg.num_frames and gif.size == (cfg.width, cfg.height)
        for name in meta.get("previews", []):
            with Image.open(d / "previews" / name) as png:
                png.load()
                assert png.size[0] > 100 and png.size[1] > 100


def test_dry_run_bytes_equal_what_a_run_writes(tmp_path):
    out = tmp_path / "runs"
    sets = ["--set", f"out={out}", "--set", "kinds=[frame,query,text_to_video]", "--set", "queries=[[1,2,3],0]",
            "--set", "heads=all", "--set", "storage_dtype=float16", "--set", "previews=false",
            "--set", "output=joint"]  # fmt: skip
    dry = dump("--dry-run", *sets, check=0)
    assert not out.exists()  # nothing written, no weights loaded
    total = int(dry.stdout.split("total")[1].split()[1].replace(",", ""))
    dump(*sets, check=0)
    written = sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors"))
    assert total == written
    assert all(json.loads((d / "maps" / "run.json").read_text())["output"] == "joint" for d in _prompt_dirs(out))


def test_estimate_matches_the_api_and_refuses_bad_selection():
    e = estimate("tiny", num_frames=9, height=48, width=80, num_inference_steps=4, kinds=("frame",), batch="cond")
    assert e.num_records == 4 * 2 and e.layout.grid == (3, 3, 5)
    with pytest.raises(ValueError, match="layers index 7 is out of range"):
        estimate("tiny", num_frames=9, height=48, width=80, num_inference_steps=4, layers=[7])


def test_resume_after_a_killed_run(tmp_path):
    out = tmp_path / "runs"
    sets = ["--set", f"out={out}", "--set", "steps=40", "--set", "previews=false"]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *sets], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 120
    first = None
    while time.time() < deadline:
        done = [d for d in (out.iterdir() if out.exists() else []) if (d / "prompt.json").exists()
                and json.loads((d / "prompt.json").read_text())["complete"]]  # fmt: skip
        started = [d for d in (out.iterdir() if out.exists() else []) if (d / "maps" / "manifest.jsonl").exists()]
        if done and len(started) >= 2 and (sorted(started)[1] / "maps" / "manifest.jsonl").read_text().count("\n") > 3:
            first = done[0]
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first is not None, "the first prompt did not complete in time"
    before = (first / "prompt.json").stat().st_mtime_ns
    second = sorted(out.iterdir())[1]
    assert not json.loads((second / "prompt.json").read_text())["complete"]
    rerun = dump(*sets, check=0)
    assert "1 prompts already complete, skipped" in rerun.stdout
    assert (first / "prompt.json").stat().st_mtime_ns == before  # untouched
    for d in _prompt_dirs(out):
        assert json.loads((d / "prompt.json").read_text())["complete"]
        assert cogattn.load(d / "maps").complete and len(cogattn.load(d / "maps")) == 3 * 40 * 2


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing_prompts", "prompts file .* does not exist"),
        ("bad_yaml", "is not valid YAML"),
        ("unknown_key", r"unknown config key \['stepz'\]; valid keys: \['model', 'task'"),
        ("unknown_task", r"task: 'video-to-video' is not one of \['text-to-video', 'image-to-video'\]"),
        ("layer_range", "layers index 9 is out of range; valid indices are 0..1"),
        ("query_grid", r"\(5, 0, 0\) is outside the latent grid"),
        ("missing_image", "image .*nowhere.png' does not exist"),
        ("bad_override", "--set 'steps': expected key=value"),
        ("unknown_output", r"output: 'fast' is not one of \['stock', 'lse', 'joint'\]"),
        ("joint_with_path", "output='joint' computes key-pooled kinds in the output call; path='rows' cannot apply"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, case, message):
    out = tmp_path / "runs"
    cfg = ROOT / "configs" / "tiny.yaml"
    args = {
        "missing_prompts": ["--set", "prompts=/nonexistent/prompts.txt"],
        "bad_yaml": [_write(tmp_path / "bad.yaml", "model: tiny\nkinds: [frame\n")],
        "unknown_key": ["--set", "stepz=4"],
        "unknown_task": ["--set", "task=video-to-video"],
        "layer_range": ["--set", "layers=[0,9]"],
        "query_grid": ["--set", "kinds=[query]", "--set", "queries=[[5,0,0]]"],
        "missing_image": ["--set", "task=image-to-video", "--set",
                          f"prompts={_write(tmp_path / 'p.jsonl', json.dumps({'prompt': 'x', 'image': 'nowhere.png'}))}"],
        "bad_override": ["--set", "steps"],
        "unknown_output": ["--set", "output=fast"],
        "joint_with_path": ["--set", "output=joint", "--set", "path=rows"],
    }[case]  # fmt: skip
    if not str(args[0]).endswith(".yaml"):
        args = [cfg, *args]
    proc = dump(*args, "--set", f"out={out}", check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dump_maps: "), proc.stderr
    assert __import__("re").search(message, lines[0]), lines[0]
    assert not out.exists()


def test_a_failing_prompt_does_not_stop_the_others(tmp_path):
    out = tmp_path / "runs"
    (tmp_path / "broken.png").write_bytes(b"not an image")
    from PIL import Image as PILImage

    PILImage.new("RGB", (80, 48), (200, 30, 30)).save(tmp_path / "red.png")
    prompts = _write(tmp_path / "p.jsonl", "\n".join(json.dumps(x) for x in [
        {"prompt": "a red fox", "image": "red.png"}, {"prompt": "a cat", "image": "broken.png"},
        {"prompt": "a dog", "image": "red.png", "seed": 3}]))  # fmt: skip
    proc = dump("--set", "task=image-to-video", "--set", f"prompts={prompts}", "--set", f"out={out}",
                "--set", "previews=false", check=1)  # fmt: skip
    assert "failed: prompt 1 ('a cat')" in proc.stderr
    complete = [json.loads((d / "prompt.json").read_text())["complete"] for d in _prompt_dirs(out)]
    assert complete == [True, False, True]


def test_accelerate_launch_two_processes_cover_every_prompt_once(tmp_path):
    out = tmp_path / "runs"
    prompts = _write(tmp_path / "p.txt", "\n".join(f"prompt number {i}" for i in range(5)))
    # --multi_gpu picks accelerate's torchrun launcher; without GPUs the two processes run on CPU over gloo.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), "--set", f"out={out}",
           "--set", f"prompts={prompts}", "--set", "previews=false", "--set", "steps=2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metas = [json.loads((d / "prompt.json").read_text()) for d in _prompt_dirs(out)]
    assert sorted(m["index"] for m in metas) == list(range(5)) and all(m["complete"] for m in metas)
    assert {m["process"] for m in metas} == {0, 1}
    by_process = {p: sorted(m["index"] for m in metas if m["process"] == p) for p in (0, 1)}
    assert sorted(by_process[0] + by_process[1]) == list(range(5))  # each prompt exactly once


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_plans_offline(config, tmp_path):
    env = {**ENV, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(ROOT / "configs" / config), "--dry-run", "--set",
                           f"out={tmp_path / 'x'}"], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "predicted peak extra memory" in proc.stdout and not (tmp_path / "x").exists()


def test_rerun_with_other_settings_into_the_same_out_is_refused(tmp_path):
    out = tmp_path / "runs"
    dump("--set", f"out={out}", "--set", "steps=1", "--set", "previews=false", check=0)
    again = dump("--set", f"out={out}", "--set", "steps=1", "--set", "previews=false", check=0)
    assert "3 prompts already complete, skipped" in again.stdout
    other = dump("--set", f"out={out}", "--set", "steps=1", "--set", "previews=false", "--set", "seed=5", check=2)
    assert "was made with other settings" in other.stderr and len(other.stderr.strip().splitlines()) == 1
