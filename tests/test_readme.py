"""Every README snippet runs as written: the Python blocks in order (as a reader pastes them), every
command of the bash blocks, and the dry-run output it shows."""

import re
import shlex
from pathlib import Path

import pytest
import torch

import cogattn.models
from cogattn.dump import main

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
# Commands that need a real checkpoint or a GPU: the test runs them as dry runs (the same config checks,
# no weights); `bash .ci/run` is this suite.
DRY_ONLY = {
    "python scripts/dump_maps.py configs/cogvideox-5b.yaml --set num_inference_steps=30 --set capture.steps=[0,15,29] "
    "--set capture.layers=[0,20,41]",
    "accelerate launch scripts/dump_maps.py configs/cogvideox-5b.yaml",
}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _commands() -> list[str]:
    lines = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line]


def test_python_snippets_run_in_order_and_say_what_they_print(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippets write runs/fox and fox.gif where they run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scope: dict = {}
    for number, code in enumerate(_blocks("python"), 1):
        if "tiny_wan_pipeline" in code and cogattn.models.wan is None:
            continue  # the Wan section: Wan needs diffusers >= 0.35
        if "tiny_hunyuan_pipeline" in code and cogattn.models.hunyuan_video is None:
            continue  # the HunyuanVideo section: diffusers >= 0.33
        if "tiny_hv15_pipeline" in code and cogattn.models.hunyuan_video15 is None:
            continue  # the HunyuanVideo 1.5 section: diffusers >= 0.36
        exec(compile(code, f"README.md, Python block {number}", "exec"), scope)
    rec, video = scope["rec"], scope["video"]
    assert tuple(rec.get("frame", step=0, layer=1).shape) == (1, 1, 4, 4)
    assert rec.timesteps == [999.0, 749.0, 499.0, 249.0] and rec.status == "finished"
    assert (rec.layout.text_len, rec.layout.grid) == (8, (3, 3, 5))
    assert rec.layout.token_index(2, 1, 4) == 8 + (2 * 3 + 1) * 5 + 4
    assert tuple(video.shape) == (9, 3, 48, 80)  # one video of 9 frames
    run = scope["run"]
    assert (run.status, run.info) == ("finished", {"prompt": "a red fox running in the snow", "seed": 0})
    assert torch.equal(run.get("frame", 0, 1), rec.get("frame", 0, 1).half().float())  # the same seeded call
    assert torch.equal(run.get("video_to_text", 3, 1, index=(0, 0, 3)), run.get("video_to_text", 3, 1)[0, 0, 3])
    plan = scope["plan"]
    assert f"{plan.record_bytes:,}" == "33,318,919,200" and plan.tiles.method == "sdpa"
    assert (tmp_path / "fox.gif").stat().st_size > 0
    if cogattn.models.hunyuan_video is not None:  # the HunyuanVideo section's comments
        hv = scope["hv_rec"]
        assert (hv.layout.text_len, hv.layout.grid, hv.layout.text_position) == (12, (3, 2, 3), "end")
        assert hv.layer_names[:3] == (
            "transformer_blocks.0.attn",
            "transformer_blocks.1.attn",
            "single_transformer_blocks.0.attn",
        )
        assert tuple(hv.get("video_to_text", step=0, layer=3).shape) == (2, 1, 12, 3, 2, 3)
        assert hv.get("received", step=0, layer=3)[1, 0, hv.layout.text_tokens][3:].abs().max() == 0
    if cogattn.models.hunyuan_video15 is not None:  # the HunyuanVideo 1.5 section's comment
        hv15 = scope["hv15_rec"]
        assert (hv15.layout.text_len, hv15.batch_roles) == (40, ("uncond", "cond"))
        assert tuple(hv15.get("video_to_text", step=0, layer=1).shape) == (2, 1, 40, 3, 2, 3)


@pytest.mark.parametrize("command", _commands())
def test_every_command_runs(command, tmp_path, monkeypatch, capsys):
    if command == "bash .ci/run":
        return  # this suite
    if command in ("python scripts/dump_maps.py", "python -m cogattn.selftest"):
        return  # the same run as another command here: the README's first one (scripts/dev.sh), or with --json
    if command == "bash scripts/dev.sh python scripts/dump_maps.py":
        return  # tests/test_cli.py's default run is this script on the tiny default; .ci/run runs it installed
    if "wan" in command and cogattn.models.wan is None:
        pytest.skip("cogattn has no Wan support with this diffusers (WanAttention came with 0.35)")
    if "hunyuan" in command and cogattn.models.hunyuan_video is None:
        pytest.skip("cogattn has no HunyuanVideo support with this diffusers (it needs 0.33)")
    if command.startswith("python -m cogattn.selftest"):
        # tests/test_selftest.py runs it (--quick, with --json), .ci/run's plain stage every family's quick rows
        assert shlex.split(command)[3:] == ["--json", "selftest.json"]
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if command.startswith("cogattn view"):  # on a quick run of the tiny default
        from cogattn.view import ViewServer
        from cogattn.view import main as view

        runs = tmp_path / "runs" / "tiny"
        assert main(["--set", f"save_dir={runs}", "--set", "num_inference_steps=1", "--set", "previews=false"]) == 0
        words = [str(runs), *shlex.split(command)[3:]]
        if "--export" in words:
            words[words.index("--export") + 1] = str(tmp_path / "report.html")
            assert view(words) == 0 and (tmp_path / "report.html").stat().st_size > 0
        else:  # it serves until Ctrl-C: start it and stop it
            server = ViewServer(runs)
            assert len(server.runs) == 3 and server.url.startswith("http://127.0.0.1:")
            server.httpd.server_close()
        return
    words = shlex.split(command.removeprefix("bash scripts/dev.sh "))
    words = words[words.index("scripts/dump_maps.py") + 1 :]
    if command in DRY_ONLY:
        words.append("--dry-run")
    else:
        tiny = words[:1] in ([], ["--dry-run"]) or words[0].startswith("configs/tiny")  # the tiny random models
        assert tiny or "--dry-run" in words, f"{command!r} needs a checkpoint: add it to DRY_ONLY"
    if words and words[0].startswith("configs/tiny-"):  # the families' previews are tests/test_plot_wan.py's
        words += ["--set", "previews=false"]
    code = main([*words, "--set", f"save_dir={tmp_path / 'runs'}"])
    assert code == 0, capsys.readouterr().err
    if "--dry-run" not in words:  # every prompt of the config's prompts file written
        from cogattn.dump.config import load_config
        from cogattn.dump.prompts import read_prompts

        prompts = len(read_prompts(load_config(ROOT / words[0] if words else None)))
        assert prompts and len(list((tmp_path / "runs").glob("*/prompt.json"))) == prompts


def test_the_dry_run_output_shown_is_what_it_prints(monkeypatch, capsys):
    (shown,) = [b for b in _blocks("text") if b.startswith("$ python scripts/dump_maps.py")]
    command, *expected = shown.rstrip("\n").splitlines()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(shlex.split(command.removeprefix("$ python scripts/dump_maps.py "))) == 0
    assert capsys.readouterr().out.rstrip("\n").splitlines() == expected
