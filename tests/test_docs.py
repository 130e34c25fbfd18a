"""Every snippet of the README and the documentation pages runs as written: each page's Python blocks in order
(as a reader pastes them, from a fresh interpreter, the shared set-up a page includes expanded; a block that starts
with ``# pip install <packages>`` where they are installed: .ci/run's feature stage), every command of the bash
blocks, and the dry-run output shown; the messages docs/troubleshooting.md quotes are the code's own words, and
what docs/versioning.md says a reader of an older run gets is what it gets."""

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

import cogattn.models
from cogattn.dump import main

ROOT = Path(__file__).parents[1]
PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$', re.M)  # pymdownx.snippets: a file of the repository, in place
OPTIONAL = re.compile(r"\A# pip install ([\w .-]+)\n")  # a block that needs packages beyond the test extra
# Commands that need a real checkpoint or a GPU: the test runs them as dry runs (the same config checks,
# no weights); `bash .ci/run` is this suite.
DRY_ONLY = {
    "python scripts/dump_maps.py configs/cogvideox-5b.yaml --set num_inference_steps=30 --set capture.steps=[0,15,29] "
    "--set capture.layers=[0,20,41]",
    "accelerate launch scripts/dump_maps.py configs/cogvideox-5b.yaml",
    'torchrun --nproc-per-node 4 scripts/dump_maps.py configs/wan2.1-t2v-14b.yaml --set "parallel={ulysses: 4}"',
}
# Pages of a family this diffusers may lack: the module that is None without it
NEEDS = {
    "docs/models/wan.md": "wan",
    "docs/models/hunyuan-video.md": "hunyuan_video",
    "docs/models/hunyuan-video-1-5.md": "hunyuan_video15",
    "docs/models/cosmos.md": "cosmos",
    "docs/models/ltx2.md": "ltx2",
    "docs/works-with.md": "wan",
}


def _blocks(text: str, lang: str) -> list[str]:
    blocks = re.findall(rf"```{lang}\n(.*?)```", text, re.S)
    return [INCLUDE.sub(lambda m: (ROOT / m.group(1)).read_text(), block) for block in blocks]


def _commands() -> list[str]:
    lines = [
        line.split("#")[0].strip()
        for text in PAGES.values()
        for block in _blocks(text, "bash")
        for line in block.splitlines()
    ]
    return sorted({line for line in lines if line})


def test_the_pages_python_snippets_include_only_files_that_exist():
    included = {m.group(1) for text in PAGES.values() for m in INCLUDE.finditer(text)}
    assert included and all((ROOT / name).is_file() for name in included)


def _check_readme(scope, tmp_path):
    rec = scope["rec"]
    assert tuple(rec.get("frame", step=1, layer=0).shape) == (1, 1, 4, 4) and rec.batch_roles == ("cond",)
    assert (tmp_path / "fox.png").stat().st_size > 0


def _check_getting_started(scope, tmp_path):
    rec, video = scope["rec"], scope["video"]
    assert tuple(rec.get("frame", step=0, layer=1).shape) == (1, 1, 4, 4)
    assert rec.timesteps == [999.0, 749.0, 499.0, 249.0] and rec.status == "finished"
    assert (rec.layout.text_len, rec.layout.grid) == (8, (3, 3, 5))
    assert rec.layout.token_index(2, 1, 4) == 8 + (2 * 3 + 1) * 5 + 4
    assert tuple(video.shape) == (9, 3, 48, 80)  # one video of 9 frames


def _check_streaming(scope, tmp_path):
    run = scope["run"]
    assert (run.status, run.info) == ("finished", {"prompt": "a red fox running in the snow", "seed": 0})
    assert run.timesteps == [999.0, 749.0, 499.0, 249.0] and run.layout.grid == (3, 3, 5)
    assert torch.equal(run.get("video_to_text", 3, 1, index=(0, 0, 3)), run.get("video_to_text", 3, 1)[0, 0, 3])


def _check_costs(scope, tmp_path):
    plan = scope["plan"]
    assert f"{plan.record_bytes:,}" == "33,318,919,200" and plan.tiles.method == "sdpa"


def _check_plots(scope, tmp_path):
    assert (tmp_path / "fox.gif").stat().st_size > 0


def _check_statistics(scope, tmp_path):  # what the comments say
    stats = scope["stats"]
    assert tuple(stats.get("block", step=3, layer=1).shape) == (1, 2, 7, 7)
    assert torch.allclose(stats.get("received", step=3, layer=1).sum(-1), torch.tensor(53.0))
    assert round(scope["mask"].float().mean().item(), 3) == 0.673
    assert tuple(scope["near"].get("offset", step=3, layer=1).shape) == (1, 2, 5, 5, 9)
    assert tuple(scope["dense"].get("top_p", step=3, layer=1).shape) == (1, 2, 53, 3)
    assert tuple(scope["sparse"].get("pattern_error", step=3, layer=1).shape) == (1, 2, 2)


def _check_tracks(scope, tmp_path):
    assert scope["t"].positions.tolist() == [[2, 4], [0, 0], [1, 3]]


def _check_cogvideox(scope, tmp_path):
    assert scope["plan"].layout.grid == (11, 48, 85) and scope["plan"].layout.seq_len == 45106


def _check_hunyuan_video(scope, tmp_path):  # the comments of the HunyuanVideo page
    hv = scope["hv_rec"]
    assert (hv.layout.text_len, hv.layout.grid, hv.layout.text_position) == (12, (3, 2, 3), "end")
    assert hv.layer_names[:3] == (
        "transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
        "single_transformer_blocks.0.attn",
    )
    assert tuple(hv.get("video_to_text", step=0, layer=3).shape) == (2, 1, 12, 3, 2, 3)
    assert hv.get("received", step=0, layer=3)[1, 0, hv.layout.text_tokens][3:].abs().max() == 0


def _check_hunyuan_video15(scope, tmp_path):
    hv15 = scope["hv15_rec"]
    assert (hv15.layout.text_len, hv15.batch_roles) == (40, ("uncond", "cond"))
    assert tuple(hv15.get("video_to_text", step=0, layer=1).shape) == (2, 1, 40, 3, 2, 3)
    assert scope["hv15_spans"] == {"image": (0, 0), "glyph": (0, 13), "prompt": (13, 21)}
    assert (scope["hv15_fox"], scope["hv15_glyph"]) == ([15], [6, 7, 8])


def _check_wan(scope, tmp_path):
    wan_rec = scope["wan_rec"]
    assert tuple(wan_rec.get("video_to_text", step=0, layer=1).shape) == (1, 1, 512, 3, 2, 3)
    assert (tmp_path / "wan_words.png").stat().st_size > 0


def _check_cosmos(scope, tmp_path):
    rec = scope["c25_rec"]
    assert tuple(rec.get("video_to_image", step=0, layer=1).shape) == (1, 1, 5, 3, 2, 3)
    assert (rec.layout.context_len, rec.layout.image_len, rec.batch_roles) == (8, 5, ("cond",))


def _check_ltx2(scope, tmp_path):
    rec = scope["lx_rec"]
    assert rec.layout.audio == cogattn.AudioAxis(tokens=18, rate=25.0, compression=4, fps=24.0)
    assert tuple(rec.get("frame_audio", step=0, layer=1).shape) == (1, 2, 3, 18) and rec.batch_roles == ("cond",)
    assert rec.layout.audio.frame_of_bin(rec.layout).tolist() == [0] * 2 + [1] * 8 + [2] * 8
    assert (tmp_path / "ltx2_sync.png").stat().st_size > 0
    ic_rec = scope["ic_rec"]  # an IC-LoRA reference's 16 tokens lead the video's
    assert ic_rec.layout.history_len == 16 and tuple(ic_rec.get("full", step=0, layer=1).shape) == (1, 1, 40, 40)


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


def _frame_rows_sum_to_one(rec, step: int, layer: int) -> None:
    """A ``frame`` map's rows are whole query groups' mass over the key groups: each sums to 1."""
    rows = rec.get("frame", step=step, layer=layer).double().sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5), rows


def _check_works_with(scope, tmp_path):  # each example's video is asserted on the page; what the comments say
    cache = scope["cache_rec"]
    assert cache.skipped.by == "FirstBlockCache" and scope["role"] == "self"
    with pytest.raises(cogattn.NotRecordedError, match="FirstBlockCache skipped this attention"):
        cache.get("frame", step=scope["step"], layer=scope["layer"])
    _frame_rows_sum_to_one(cache, 0, 0)  # the first step runs every block
    offload = scope["offload_rec"]
    assert offload.get("frame", step=3, layer=1).device.type == "cpu"
    _frame_rows_sum_to_one(offload, 3, 1)
    if _installed("peft"):
        lora, fused = (scope[name].get("frame", step=3, layer=1) for name in ("lora_rec", "fused_rec"))
        assert (lora - fused).abs().max() < 1e-6  # the adapter as it runs, and folded into the weights
        plain = cache.get("frame", step=0, layer=0)  # the first step of the cached run: the model without an adapter
        assert (scope["lora_rec"].get("frame", step=0, layer=0) - plain).abs().max() > 1e-4  # the adapter took effect
    if _installed("torchao"):
        to_q = scope["pipe"].transformer.transformer_blocks[0].attn1.to_q
        assert "Int8" in type(to_q.weight).__name__
        _frame_rows_sum_to_one(scope["int8_rec"], 3, 1)
    wan_rec = scope["wan_rec"]
    assert tuple(wan_rec.get("video_to_text", step=1, layer=1).shape) == (1, 1, 512, 3, 2, 3)
    _frame_rows_sum_to_one(wan_rec, 1, 1)
    guided = scope["guided"]
    assert guided.batch_roles == ("uncond", "cond") and guided.skipped.perturbed == {1}
    assert tuple(guided.get("frame", step=1, layer=1).shape) == (2, 1, 3, 3)
    train_rec = scope["train_rec"]
    assert train_rec.keys() == [("frame", 0, 0), ("frame", 0, 1)] and train_rec.timesteps == [500.0]
    _frame_rows_sum_to_one(train_rec, 0, 1)


# The pages with Python snippets, each with what its comments promise
CHECKS = {
    "README.md": _check_readme,
    "docs/getting-started.md": _check_getting_started,
    "docs/streaming.md": _check_streaming,
    "docs/costs.md": _check_costs,
    "docs/plots.md": _check_plots,
    "docs/statistics.md": _check_statistics,
    "docs/tracks.md": _check_tracks,
    "docs/models/cogvideox.md": _check_cogvideox,
    "docs/models/hunyuan-video.md": _check_hunyuan_video,
    "docs/models/hunyuan-video-1-5.md": _check_hunyuan_video15,
    "docs/models/wan.md": _check_wan,
    "docs/models/cosmos.md": _check_cosmos,
    "docs/models/ltx2.md": _check_ltx2,
    "docs/works-with.md": _check_works_with,
}


# Pages whose Python is a script for other machines, not snippets to run here, with what runs it instead
SCRIPTS = {"docs/many-gpus.md": "a torchrun script on GPUs: tests/test_context_parallel.py runs the same on gloo"}


def test_every_page_with_python_snippets_has_its_checks():
    assert {page for page, text in PAGES.items() if _blocks(text, "python")} == set(CHECKS) | set(SCRIPTS)


@pytest.mark.parametrize("page", list(CHECKS))
def test_a_page_s_python_snippets_run_in_order_and_say_what_they_print(page, tmp_path, monkeypatch):
    if page in NEEDS and getattr(cogattn.models, NEEDS[page]) is None:
        pytest.skip(f"{page}: this diffusers lacks the family")
    monkeypatch.chdir(tmp_path)  # the snippets write runs/fox, fox.gif and figures where they run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scope: dict = {}
    for number, code in enumerate(_blocks(PAGES[page], "python"), 1):
        if (needs := OPTIONAL.match(code)) and not _installed(*needs.group(1).split()):
            continue  # its check asks for what it makes only where the packages are installed
        exec(compile(code, f"{page}, Python block {number}", "exec"), scope)
    CHECKS[page](scope, tmp_path)


@pytest.fixture(scope="module")
def quick_tiny(tmp_path_factory):
    """A quick run of the tiny default (one step, no previews) for the ``cogattn view`` commands, made once."""
    made = []

    def get():
        if not made:
            runs = tmp_path_factory.mktemp("view") / "runs" / "tiny"
            assert main(["--set", f"save_dir={runs}", "--set", "num_inference_steps=1", "--set", "previews=false"]) == 0
            made.append(runs)
        return made[0]

    return get


@pytest.mark.parametrize("command", _commands())
def test_every_command_runs(command, tmp_path, monkeypatch, capsys, quick_tiny):
    if command == "bash .ci/run":
        return  # this suite
    if command in ("python scripts/dump_maps.py", "python -m cogattn.selftest"):
        return  # the same run as another command here: the README's first one (scripts/dev.sh), or with --json
    if command == "bash scripts/dev.sh python scripts/dump_maps.py":
        return  # tests/test_cli.py's default run is this script on the tiny default; .ci/run runs it installed
    if command.startswith("pip install -e"):  # the extras named exist
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert set(",".join(re.findall(r"\[(.*)\]", command)).split(",")) - {""} <= set(extras)
        return
    if command.startswith("bash scripts/dev.sh ruff "):
        return  # .ci/run's lint stage
    if command.startswith("bash scripts/dev.sh python -m pytest"):  # one test file alone: it exists
        assert all((ROOT / word).is_file() for word in shlex.split(command) if word.startswith("tests/"))
        return
    if command.startswith("mkdocs "):
        return  # .ci/run builds the site (mkdocs build --strict) with the docs extra
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

        runs = quick_tiny()
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
    if words and words[0].startswith("configs/tiny-"):  # tests/test_cli_families.py runs each of these end to end
        words.append("--dry-run")
    code = main([*words, "--set", f"save_dir={tmp_path / 'runs'}"])
    assert code == 0, capsys.readouterr().err
    if "--dry-run" not in words:  # every prompt of the config's prompts file written
        from cogattn.dump.config import load_config
        from cogattn.dump.prompts import read_prompts

        prompts = len(read_prompts(load_config(ROOT / words[0] if words else None)))
        assert prompts and len(list((tmp_path / "runs").glob("*/prompt.json"))) == prompts


def test_the_dry_run_output_shown_is_what_it_prints(monkeypatch, capsys):
    (shown,) = [b for b in _blocks(PAGES["docs/batch.md"], "text") if b.startswith("$ python scripts/dump_maps.py")]
    command, *expected = shown.rstrip("\n").splitlines()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the page's numbers: a CPU's fused passes hold a workspace per thread
    try:
        assert main(shlex.split(command.removeprefix("$ python scripts/dump_maps.py "))) == 0
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.rstrip("\n").splitlines() == expected


# A quoted message's varying parts: "…", with the brackets or quotes around it and a space on either side
PLACEHOLDER = re.compile(r" ?['\"\[(]?…['\"\])]? ?")


def test_the_troubleshooting_page_quotes_the_messages_as_the_code_words_them():
    """Each message quoted on the page (the code spans of its ``>`` lines) is, but for its ``…``, the text of one
    message in cogattn's source, its string literals joined as Python joins them."""
    source = "\n".join(path.read_text() for path in sorted((ROOT / "cogattn").rglob("*.py")))
    lines = re.sub(r"[\"']\s*\n\s*[rbfRBF]*[\"']", "", source).splitlines()  # a literal continued on the next line

    def said(quote: str) -> bool:
        pieces = PLACEHOLDER.split(quote)
        longest = max(pieces, key=len)
        pattern = re.compile("[^\n]*?".join(map(re.escape, pieces)))
        return any(pattern.search(line) for line in lines if longest in line)

    quoted = [
        m.group(1) or m.group(2)
        for line in PAGES["docs/troubleshooting.md"].splitlines()
        if line.startswith("> ")
        for m in re.finditer(r"``(.+?)``|`([^`]+)`", line)
    ]
    assert len(quoted) >= 20
    missing = [q for q in quoted if not said(q)]
    assert not missing, f"docs/troubleshooting.md quotes messages the code no longer says: {missing}"


def test_the_site_loads_no_web_fonts_and_lists_every_page():
    """The site works offline (Material's default fetches Google Fonts on every page), and every page is in the
    navigation."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["font"] is False
    listed = set(re.findall(r"[\w/-]+\.md", json.dumps(config["nav"])))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - {"index.md"} <= listed, pages - listed


def test_the_citation_names_this_version_and_the_license():
    import tomllib

    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert citation["cff-version"] == "1.2.0" and citation["version"] == cogattn.__version__
    assert citation["license"] == project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and project["license-files"] == ["LICENSE"]


def test_a_reader_of_an_older_run_gets_what_the_versioning_page_says(tmp_path):
    """docs/versioning.md: a run written before later fields existed reads their defaults; a field a later version
    adds is left alone; a run of another format is refused when opened, and ``overwrite=True`` does not delete it."""
    from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("frame",), save_dir=tmp_path / "run") as rec:
        pipe(
            prompt="a fox", num_frames=9, num_inference_steps=2, max_sequence_length=TINY_TEXT_LEN, output_type="latent"
        )
    meta_file = tmp_path / "run" / "run.json"
    meta = json.loads(meta_file.read_text())
    assert meta["format"] == "cogattn-run/1"
    older = {k: v for k, v in meta.items() if k not in ("skipped", "windows", "call_stats")}
    later = ("batch_roles", "text_lengths", "batch_resolved", "source_heads")
    older["selection"] = {k: v for k, v in meta["selection"].items() if k not in later}
    older["model"] = {k: v for k, v in meta["model"].items() if k not in ("layer_names", "step_experts")}
    assert "image_joins_text" not in meta["layout"]  # a field at its default is not written: older readers read it
    older["layout"] = {**meta["layout"], "a_later_layout_field": 3}
    meta_file.write_text(json.dumps({**older, "a_later_field": {"any": [1, 2]}}))
    run = cogattn.load(tmp_path / "run")
    assert (run.layer_names, run.batch_roles, run.text_lengths, run.batch_items) == (None, None, None, None)
    assert run.source_heads == {"self": run.head_ids} and run.layout == rec.layout
    assert run.experts == ["transformer"] * 2 and run.windows == [0, 0] and not run.skipped
    assert torch.equal(run.get("frame", 1, 1), rec.get("frame", 1, 1))  # the records read as written
    meta_file.write_text(json.dumps({**meta, "format": "cogattn-run/2"}))
    with pytest.raises(cogattn.StoreError, match=r"run\.json': format is 'cogattn-run/2', not 'cogattn-run/1'"):
        cogattn.load(tmp_path / "run")  # another format is refused when the run is opened, in one line
    with pytest.raises(cogattn.StoreError, match="holds no cogattn run, so overwrite=True will not delete it"):
        with cogattn.record(pipe, kinds=("frame",), save_dir=tmp_path / "run", overwrite=True):
            pass
    assert json.loads(meta_file.read_text())["format"] == "cogattn-run/2"
