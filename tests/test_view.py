"""``cogattn view``: the server's answers against ``cogattn.analysis`` on a batch run of the tiny default,
and the page in a real browser (headless Chromium from the system's packages, driven by Playwright): it
loads with no console error, a step or word change redraws, a click on a video point shows that point's
row, the numbers on the page equal the run's (each map's colour bar ends at its values' limits, the value
under the pointer is the run's), and the export opens with no request leaving the file."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from cogattn.analysis import aggregate
from cogattn.analysis.head_stats import head_table
from cogattn.analysis.masks import mask_recall, same_frame_mask
from cogattn.dump import main as dump_main
from cogattn.runs.run import load
from cogattn.view import RunView, ViewServer, export, find_runs
from cogattn.view.data import POINT_HINT
from cogattn.view.server import main

KINDS = "capture.kinds=[frame,video_to_text,text_to_video,full,entropy,block]"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The tiny default's three prompts, with every head and the full map (a video point's row)."""
    out = tmp_path_factory.mktemp("view") / "runs"
    args = ["--set", f"save_dir={out}", "--set", KINDS, "--set", "capture.heads=all", "--set", "capture.block_size=7"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main(args) == 0
    return out


def _first(runs: Path) -> Path:
    return sorted(p for p in runs.iterdir() if p.is_dir())[0]


def _close(got: list, want: torch.Tensor, digits: int | None = None) -> bool:
    """``got`` equals ``want`` (to ``digits`` significant digits where the export rounds)."""
    rtol = 0.0 if digits is None else 0.5 * 10 ** (1 - digits)
    return torch.allclose(torch.tensor(got, dtype=torch.float64), want.double().flatten(), rtol=rtol, atol=1e-6)


def test_find_runs_takes_a_run_a_prompt_folder_or_a_folder_of_them(runs):
    folder = _first(runs)
    assert len(find_runs(runs)) == 3
    assert find_runs(folder) == {folder.name: folder / "maps"} and find_runs(folder / "maps") == {
        "maps": folder / "maps"
    }
    with pytest.raises(FileNotFoundError, match="holds no cogattn run"):
        find_runs(folder / "previews")


def test_the_answers_are_the_analysis_of_the_run(runs):
    view = RunView(_first(runs) / "maps")
    run = load(_first(runs) / "maps")
    summary = view.summary()
    assert summary["kinds"] == ["block", "entropy", "frame", "full", "text_to_video", "video_to_text"]
    assert summary["tokens"][:3] == ["a", "red", "fox"] and summary["video"] and summary["heads"] == [0, 1]
    frame = view.map("frame", 2, 1, 0)
    assert frame["shape"] == [4, 4] and _close(frame["values"], aggregate(run, "frame", steps=2, layers=1, heads=0))
    word = view.map("video_to_text", 1, "mean", "mean", 2)
    assert _close(word["values"], aggregate(run, "video_to_text", steps=1)[2])
    lay = run.layout
    point = view.point(3, "mean", "mean", 1, 2, 3)
    row = aggregate(run, "full", steps=3)[lay.token_index(1, 2, 3)][lay.grid_tokens]
    assert point["shape"] == [lay.frames, lay.height, lay.width] and _close(point["values"], row)
    assert "not recorded" in view.map("query", 0, "mean")["error"]


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cogattn view: ") and "holds no cogattn run" in err[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([str(runs), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {port} on 127.0.0.1 cannot be used" in err[0]
    from urllib.error import HTTPError
    from urllib.request import urlopen

    server = ViewServer(runs).start()
    try:  # a request without a parameter it needs: 400 and one line, not a traceback
        with pytest.raises(HTTPError) as answer:
            urlopen(f"{server.url}api/map?step=0")
        assert answer.value.code == 400 and "missing parameter 'kind'" in json.loads(answer.value.read())["error"]
    finally:
        server.stop()


def test_a_damaged_record_says_so_in_its_panel_and_the_rest_works(runs, tmp_path):
    folder = shutil.copytree(_first(runs), tmp_path / "copy")
    record = sorted((folder / "maps" / "records" / "frame").iterdir())[0]
    record.write_bytes(b"not a safetensors file")
    view = RunView(folder / "maps")
    step, layer = (int(x.lstrip("steplayr")) for x in record.stem.split("_"))  # step0003_layer001
    assert "cannot be read" in view.map("frame", step, layer)["error"]
    assert "values" in view.map("video_to_text", step, layer, "mean", 0) and view.summary()["kinds"]
    from safetensors.torch import save_file  # a readable file, but not the record: one head where two were kept

    wrong = folder / "maps" / "records" / "full" / record.name
    save_file({"map": torch.rand(1, 1, 4, 4)}, str(wrong))
    assert "holds shape (1, 1, 4, 4), the manifest says" in view.point(step, layer, "mean", 1, 2, 3)["error"]


@pytest.fixture(scope="module")
def sparse(runs, tmp_path_factory) -> Path:
    """The first prompt again, recording a point's row only as ``topk`` and ``query_frame``."""
    out = tmp_path_factory.mktemp("view") / "sparse"
    prompts = out.parent / "prompt.txt"
    prompts.write_text(load(_first(runs) / "maps").info["prompt"] + "\n")
    args = ["--set", f"save_dir={out}", "--set", f"prompts={prompts}", "--set", "capture.kinds=[topk,query_frame]"]
    args += ["--set", "capture.heads=all", "--set", "capture.topk=5", "--set", "previews=false"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main(args) == 0
    return _first(out) / "maps"


def test_a_point_without_full_or_query_shows_its_topk_or_its_mass_per_frame(runs, sparse):
    full, lay = load(_first(runs) / "maps"), load(sparse).layout
    view = RunView(sparse)
    token = lay.token_index(1, 2, 3)
    row = full.get("full", 2, 1)[0, 0, token]  # the same generation's full row: layer 1, head 0, step 2
    got = view.point(2, 1, 0, 1, 2, 3)
    assert got["kind"] == "topk" and got["shape"] == [lay.frames, lay.height, lay.width]
    values = torch.tensor([float("nan") if v is None else v for v in got["values"]])
    top = torch.topk(row, 5)
    grid = torch.arange(lay.seq_len)[lay.grid_tokens].tolist()
    on_video = [i for i in top.indices.tolist() if i in grid]
    where = [grid.index(i) for i in on_video]
    assert on_video  # the check below compares something
    assert torch.allclose(values[where], row[on_video], atol=1e-6)
    assert int(values.isfinite().sum()) == len(on_video) and "the 5 largest" in got["note"]
    assert "choose a layer" in view._topk_refusal("mean", 0) and "choose a head" in view._topk_refusal(1, "mean")
    # where topk's k largest do not average (the mean of layers or of heads): query_frame, the row's mass to
    # each key group, equal to the same generation's full row summed per group
    groups = lay.group_of_token()
    assert view.point(2, 1, "mean", 1, 2, 3)["kind"] == "query_frame"
    got = view.point(2, "mean", "mean", 1, 2, 3)
    mean_row = aggregate(full, "full", steps=2, row=token)
    want = torch.zeros(lay.num_groups, dtype=torch.float64).index_add_(0, groups, mean_row.double())
    assert got["kind"] == "query_frame" and got["shape"] == [1, lay.num_groups] and _close(got["values"], want)
    assert got["groups"][0] == "text" and len(got["groups"]) == lay.num_groups


# -- in a real browser -------------------------------------------------------------------------------------
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium on this machine (Debian: apt-get install chromium); .ci/run installs it")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is a test dependency (pip install -e .[test])"
    )
    path = _chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def _page(browser, url: str, problems: list):
    page = browser.new_page()
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_function("Number(document.body.dataset.ready) >= 1", timeout=20000)
    return page


def _values(page, panel: str) -> list:
    return json.loads(page.get_attribute(f"#{panel}", "data-values"))


def _redrawn(page, action):
    before = int(page.evaluate("Number(document.body.dataset.ready)"))
    action()
    page.wait_for_function(f"Number(document.body.dataset.ready) > {before}", timeout=20000)


def test_the_page_shows_the_run_s_numbers_and_follows_steps_words_and_clicks(runs, browser):
    folder = _first(runs)
    run = load(folder / "maps")
    lay = run.layout
    server = ViewServer(runs).start()
    problems = []
    try:
        page = _page(browser, f"{server.url}?run={folder.name}", problems)
        last = len(run.timesteps) - 1  # the slider starts at the last step
        assert _close(_values(page, "frame"), aggregate(run, "frame", steps=last))
        _redrawn(page, lambda: page.fill("#step", "0"))  # a step change redraws, with step 0's numbers
        assert _close(_values(page, "frame"), aggregate(run, "frame", steps=0))
        assert _close(_values(page, "word"), aggregate(run, "video_to_text", steps=0)[0])
        _redrawn(page, lambda: page.select_option("#token", "2"))  # the word "fox"
        assert _close(_values(page, "word"), aggregate(run, "video_to_text", steps=0)[2])
        _redrawn(page, lambda: page.select_option("#head", "1"))
        assert _close(_values(page, "frame"), aggregate(run, "frame", steps=0, heads=1))
        table = head_table(run, steps=0)  # the head atlas: a head_table column per layer and head
        atlas = table.pivot(index="layer", columns="head", values="same_frame_mass")
        assert _close(_values(page, "heads"), torch.tensor(atlas.to_numpy()))
        atlas_cell = page.locator("#heads canvas")  # layer 1, head 0 picks them
        size = atlas_cell.bounding_box()
        _redrawn(page, lambda: atlas_cell.click(position={"x": 0.5 * size["width"] / 2, "y": 1.5 * size["height"] / 2}))
        assert (page.input_value("#layer"), page.input_value("#head")) == ("1", "0")
        assert _close(_values(page, "frame"), aggregate(run, "frame", steps=0, layers=1, heads=0))
        _redrawn(page, lambda: page.select_option("#layer", "mean"))
        _redrawn(page, lambda: page.select_option("#head", "1"))
        _redrawn(page, lambda: page.select_option("#mask", "same_frame"))  # a block mask and its recall
        assert _close(_values(page, "block"), aggregate(run, "block", steps=0, heads=1))
        keep = same_frame_mask(lay, run.block_size)
        recall = mask_recall(run, keep, steps=[0]).query("head == 1 and item == 0")["recall"].mean()
        assert float(page.get_attribute("#block", "data-recall")) == pytest.approx(recall, abs=1e-9)
        entropy = aggregate(run, "entropy", steps=0, heads=1)[lay.grid_tokens]
        assert _close(_values(page, "stat"), entropy)  # entropy over the video
        # the word's map over the video: pixel frame 5 of 9 is under latent frame 2 (frames 1-4: 1, 5-8: 2)
        assert page.is_visible("#overlay") and page.get_attribute("#pixel-frame", "max") == "8"
        page.fill("#pixel-frame", "5")
        page.wait_for_function("document.getElementById('overlay').dataset.pixel === '5'")
        assert int(page.get_attribute("#overlay", "data-latent")) == lay.latent_of_pixel(9)[5] == 2
        cell = page.locator("#word canvas[data-frame='1']")  # frame 1, row 2, column 3 of the word map
        box = cell.bounding_box()
        rows, cols = lay.height, lay.width
        x, y = (3 + 0.5) * box["width"] / cols, (2 + 0.5) * box["height"] / rows
        _redrawn(page, lambda: cell.click(position={"x": x, "y": y}))
        assert json.loads(page.get_attribute("#point", "data-point")) == [1, 2, 3]
        row = aggregate(run, "full", steps=0, heads=1)[lay.token_index(1, 2, 3)][lay.grid_tokens]
        assert _close(_values(page, "point"), row)
        # the README's screenshot, written where asked (COGATTN_SCREENSHOT=docs/view.png), else beside the run
        shot = Path(os.environ.get("COGATTN_SCREENSHOT") or runs.parent / "view.png")
        page.set_viewport_size({"width": 1100, "height": 560})
        _hover(page, "word", 1, 2, 3)  # the value under the pointer, in the line under its panel
        page.screenshot(path=str(shot), full_page=True)
        # the folder: a table of its runs, searchable by prompt
        listing = _page(browser, server.url, problems)
        assert listing.locator("tr.run").count() == 3
        listing.fill("#search", "fox")
        prompts = [p.lower() for p in (load(f / "maps").info["prompt"] for f in sorted(runs.iterdir()))]
        assert listing.locator("tr.run:visible").count() == sum("fox" in p for p in prompts)
    finally:
        server.stop()
    assert not problems, problems


def test_a_link_opens_the_same_view(runs, browser):
    folder = _first(runs)
    run = load(folder / "maps")
    lay = run.layout
    server = ViewServer(runs).start()
    problems = []
    try:
        link = f"{server.url}?run={folder.name}&step=1&layer=mean&head=1&word-kind=text_to_video&token=2&point=1,2,3"
        page = _page(browser, link, problems)
        assert _close(_values(page, "word"), aggregate(run, "text_to_video", steps=1, heads=1)[2])
        row = aggregate(run, "full", steps=1, heads=1)[lay.token_index(1, 2, 3)][lay.grid_tokens]
        assert _close(_values(page, "point"), row)
        _redrawn(page, lambda: page.select_option("#token", "3"))  # the address follows the controls
        again = _page(browser, page.url, problems)
        assert "token=3" in page.url and _values(again, "word") == _values(page, "word")
        assert _close(_values(again, "word"), aggregate(run, "text_to_video", steps=1, heads=1)[3])
    finally:
        server.stop()
    assert not problems, problems


# -- colour bars and the value under the pointer -------------------------------------------------------------
def _bars(page, panel: str) -> list[dict]:
    """Each colour bar of ``panel``: its scale, its ticks (value, label, position in percent) and its unit."""
    return page.eval_on_selector_all(
        f"#{panel} .colorbar",
        """bars => bars.map(b => ({
            scale: b.dataset.scale,
            ticks: [...b.querySelectorAll('.tick')].map(t => [Number(t.dataset.value), t.textContent, parseFloat(t.style.left)]),
            unit: b.querySelector('.unit').textContent,
        }))""",
    )


def _check_bars(page, panel: str, log: bool, per_frame: bool = False) -> str:
    """The bars of ``panel`` (one, or one per latent frame) end at the min and max of its ``data-values`` (the
    positive ones on a log scale), label them, and place every tick where its value falls on that scale; a log
    scale's ticks between are 1, 2 or 5 times a power of ten. Returns the bars' unit."""
    values = _values(page, panel)
    shape = json.loads(page.get_attribute(f"#{panel}", "data-shape"))
    size = shape[-1] * shape[-2]
    parts = [values[f * size : (f + 1) * size] for f in range(shape[0])] if per_frame else [values]
    bars = _bars(page, panel)
    assert len(bars) == len(parts)
    for bar, part in zip(bars, parts, strict=True):
        kept = [v for v in part if v is not None and (v > 0 or not log)]
        lo, hi = min(kept), max(kept)
        ticks = bar["ticks"]
        assert bar["scale"] == ("log" if log else "linear") and (ticks[0][0], ticks[-1][0]) == (lo, hi)
        assert float(ticks[0][1]) == pytest.approx(lo, rel=5e-4) and float(ticks[-1][1]) == pytest.approx(hi, rel=5e-4)
        for value, label, left in ticks:
            at = (math.log(value / lo) / math.log(hi / lo)) if log else (value - lo) / (hi - lo)
            assert lo <= value <= hi and left == pytest.approx(100 * at, abs=1e-3)
            assert float(label) == pytest.approx(value, rel=5e-3)
        for value, _, _ in ticks[1:-1] if log else []:
            mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
            assert min(abs(mantissa - m) for m in (1, 2, 5)) < 1e-9, value
        if not log and not per_frame:
            assert len(ticks) >= 3  # values between the ends
    assert len({bar["unit"] for bar in bars}) == 1
    return bars[0]["unit"]


def _hover(page, panel: str, frame: int, row: int, col: int) -> tuple[str, float | None]:
    """Moves the pointer over cell (``row``, ``col``) of ``panel``'s map ``frame``: the line under the panel,
    and the value it holds (`None` where it says the cell is blank)."""
    shape = json.loads(page.get_attribute(f"#{panel}", "data-shape"))
    rows, cols = shape[-2:]
    canvas = page.locator(f"#{panel} canvas[data-frame='{frame}']")
    box = canvas.bounding_box()
    x, y = box["x"] + (col + 0.5) * box["width"] / cols, box["y"] + (row + 0.5) * box["height"] / rows
    canvas.dispatch_event("mousemove", {"clientX": x, "clientY": y, "bubbles": True})
    readout = page.locator(f"#{panel}-panel .readout")
    value = readout.get_attribute("data-value")
    return readout.inner_text(), float(value) if value else None


def _shows(text: str, where: str, want: float, exact: float | None, rel: float = 1e-6) -> None:
    """``text`` names the cell and writes its value ``exact`` to 6 digits, and ``exact`` is ``want`` (the run's)."""
    assert text.startswith(f"{where}: ") and float(text.split(": ")[-1]) == pytest.approx(exact, rel=5e-6), text
    assert exact == pytest.approx(want, rel=rel)


def test_every_map_has_a_colour_bar_with_its_limits_and_shows_the_value_under_the_pointer(runs, browser):
    from cogattn.exact.reducers import REDUCERS

    folder = _first(runs)
    run = load(folder / "maps")
    lay = run.layout
    groups = RunView(folder / "maps").summary()["groups"]
    server = ViewServer(runs).start()
    problems = []
    try:
        link = f"{server.url}?run={folder.name}&step=1&head=1&token=2&stat-kind=entropy&mask=same_frame&point=1,2,3"
        page = _page(browser, link, problems)
        kinds = {"frame": "frame", "word": "video_to_text", "stat": "entropy", "block": "block", "point": "full"}
        for panel, kind in kinds.items():  # the unit is the reducer's, as on the plots' colour bars
            assert _check_bars(page, panel, log=False) == REDUCERS[kind].unit
        assert "mean over video queries" in _check_bars(page, "heads", log=False)
        # the value under the pointer, named by where it is, equal to the run's
        text, value = _hover(page, "word", 1, 2, 3)
        want = float(aggregate(run, "video_to_text", steps=1, heads=1)[2][1, 2, 3])
        _shows(text, "latent frame 1, patch row 2, patch column 3", want, value)
        text, value = _hover(page, "frame", 0, 2, 0)
        want = float(aggregate(run, "frame", steps=1, heads=1)[2, 0])
        _shows(text, f"query group {groups[2]}, key group {groups[0]}", want, value)
        text, value = _hover(page, "stat", 2, 1, 0)
        want = float(aggregate(run, "entropy", steps=1, heads=1)[lay.token_index(2, 1, 0)])
        _shows(text, "latent frame 2, patch row 1, patch column 0", want, value)
        text, value = _hover(page, "block", 0, 1, 2)
        _shows(text, "query block 1, key block 2", float(aggregate(run, "block", steps=1, heads=1)[1, 2]), value)
        text, value = _hover(page, "point", 0, 2, 1)  # where point (1, 2, 3) attends: its row over the video
        row = aggregate(run, "full", steps=1, heads=1)[lay.token_index(1, 2, 3)][lay.grid_tokens]
        want = float(row.reshape(lay.frames, lay.height, lay.width)[0, 2, 1])
        _shows(text, "latent frame 0, patch row 2, patch column 1", want, value)
        table = head_table(run, steps=1).query("item == 0")
        cell = table.query("layer == 1 and head == 0").iloc[0]
        text, value = _hover(page, "heads", 0, 1, 0)
        _shows(text, f"layer 1, head 0 ({cell['label']})", float(cell["same_frame_mass"]), value, rel=1e-5)
        # a log scale: the bars end at the smallest and largest positive values, log-spaced ticks between
        _redrawn(page, lambda: page.select_option("#scale", "log"))
        for panel in (*kinds, "heads"):
            _check_bars(page, panel, log=True)
        # colours per map: a bar under each latent frame's map, at that map's own limits
        _redrawn(page, lambda: page.select_option("#limits", "per-map"))
        for panel in ("word", "stat", "point"):
            _check_bars(page, panel, log=True, per_frame=True)
        _redrawn(page, lambda: page.select_option("#scale", "linear"))
        for panel in ("word", "stat", "point"):
            _check_bars(page, panel, log=False, per_frame=True)
        assert len(_bars(page, "frame")) == 1  # one map, one bar
    finally:
        server.stop()
    assert not problems, problems


def test_a_blank_cell_says_it_was_not_recorded(runs, sparse, browser):
    lay = load(sparse).layout
    token = lay.token_index(1, 2, 3)
    row = load(_first(runs) / "maps").get("full", 2, 1)[0, 0, token][lay.grid_tokens]  # the same generation's
    server = ViewServer(sparse).start()
    problems = []
    try:  # a point's topk row (layer 1, head 0): its k largest where they fall, the rest blank
        page = _page(browser, f"{server.url}?step=2&layer=1&head=0&point=1,2,3", problems)
        values = _values(page, "point")
        hw = lay.height * lay.width
        cell = lambda i: (i // hw, i % hw // lay.width, i % lay.width)  # noqa: E731
        blank, kept = values.index(None), next(i for i, v in enumerate(values) if v is not None)
        f, r, c = cell(blank)
        assert _hover(page, "point", f, r, c) == (
            f"latent frame {f}, patch row {r}, patch column {c}: not recorded",
            None,
        )
        f, r, c = cell(kept)
        text, value = _hover(page, "point", f, r, c)
        _shows(text, f"latent frame {f}, patch row {r}, patch column {c}", float(row[kept]), value, rel=1e-5)
        _check_bars(page, "point", log=False)
    finally:
        server.stop()
    assert not problems, problems


def test_the_export_shows_the_colour_bars_and_the_value_under_the_pointer(runs, browser, tmp_path):
    from cogattn.exact.reducers import REDUCERS

    folder = _first(runs)
    run = load(folder / "maps")
    out = export(folder, tmp_path / "report.html")
    problems = []
    page = _page(browser, out.as_uri(), problems)
    _redrawn(page, lambda: page.fill("#step", "1"))
    assert _check_bars(page, "frame", log=False) == REDUCERS["frame"].unit
    assert _check_bars(page, "word", log=False) == REDUCERS["video_to_text"].unit
    text, value = _hover(page, "word", 1, 2, 0)  # token 0 over the video, as the export keeps it (4 digits)
    want = float(aggregate(run, "video_to_text", steps=1)[0][1, 2, 0])
    _shows(text, "latent frame 1, patch row 2, patch column 0", want, value, rel=5e-4)
    text, value = _hover(page, "frame", 0, 1, 3)
    groups = RunView(folder / "maps").summary()["groups"]
    want = float(aggregate(run, "frame", steps=1)[1, 3])
    _shows(text, f"query group {groups[1]}, key group {groups[3]}", want, value, rel=5e-4)
    _redrawn(page, lambda: page.select_option("#scale", "log"))
    _check_bars(page, "frame", log=True)
    _check_bars(page, "heads", log=True)
    assert not problems, problems


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Path:
    """A run of the tiny pipeline under First Block Cache, which skips layers' attention at some steps."""
    import diffusers

    if not hasattr(diffusers, "FirstBlockCacheConfig"):
        pytest.skip(f"diffusers {diffusers.__version__} has no First Block Cache")
    from tiny_calls import generate

    import cogattn
    from cogattn.models.cogvideox import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.3))
    folder = tmp_path_factory.mktemp("view") / "cached"
    with cogattn.record(pipe, kinds=("frame",), layers="all", steps="all", save_dir=folder) as rec:
        generate(pipe, steps=4, output_type="latent")
    assert rec.skipped.calls
    return folder


def test_the_step_slider_marks_what_a_cache_skipped(cached, browser):
    run = load(cached)
    gaps = {}
    for s, layer, _ in sorted(run.skipped.calls):
        if ("frame", s, layer) not in run.keys():
            gaps.setdefault(s, []).append(layer)
    view = RunView(cached)
    assert {int(s): v for s, v in view.summary()["gaps"]["frame"].items()} == gaps
    for s, layers in gaps.items():  # a skipped map's panel says what skipped it
        assert all("FirstBlockCache skipped this" in view.map("frame", s, n)["error"] for n in layers)
    server = ViewServer(cached).start()
    problems = []
    try:
        page = _page(browser, server.url, problems)
        marks = json.loads(page.get_attribute("#step-gaps", "data-gaps"))
        assert marks == [len(gaps.get(s, [])) for s in range(len(run.timesteps))] and page.is_visible("#step-gaps")
        step = min(gaps)
        _redrawn(page, lambda: page.fill("#step", str(step)))
        assert f"{len(gaps[step])} layer(s) skipped by FirstBlockCache" in page.inner_text("#step-label")
        held = [n for n in range(len(run.layer_names)) if n not in gaps[step]]  # the mean leaves the gaps out
        assert _close(_values(page, "frame"), aggregate(run, "frame", steps=step, layers=held))
        _redrawn(page, lambda: page.select_option("#layer", str(gaps[step][0])))
        assert "FirstBlockCache skipped this" in page.inner_text("#frame-panel .error")
    finally:
        server.stop()
    assert not problems, problems


def test_the_export_opens_with_no_request_leaving_the_file(runs, browser, tmp_path):
    folder = _first(runs)
    run = load(folder / "maps")
    out = export(folder, tmp_path / "report.html")
    requests, problems = [], []
    page = browser.new_page()
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.goto(out.as_uri())
    page.wait_for_function("Number(document.body.dataset.ready) >= 1", timeout=20000)
    assert _close(_values(page, "frame"), aggregate(run, "frame", steps=len(run.timesteps) - 1), digits=4)
    _redrawn(page, lambda: page.fill("#step", "1"))
    assert _close(_values(page, "word"), aggregate(run, "video_to_text", steps=1)[0], digits=4)
    assert "export: " in page.inner_text("#meta")
    page.click("#details summary")  # the run's options, spot checks and what was kept
    assert '"kinds":["frame","video_to_text","text_to_video","full","entropy","block"]' in page.inner_text(
        "#details-text"
    )
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == [] and requests[0] == out.as_uri()
    assert not problems, problems


def test_a_run_still_being_written_shows_what_is_committed_and_picks_up_new_records(runs, tmp_path):
    from urllib.request import urlopen

    folder = shutil.copytree(_first(runs) / "maps", tmp_path / "maps")
    manifest = folder / "manifest.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    frame = [x for x in lines if json.loads(x)["kind"] == "frame" and json.loads(x)["step"] == 0]
    manifest.write_bytes(frame[0])  # step 0 of frame holds its first layer only
    server = ViewServer(folder).start()
    try:
        # the mean over the layers of a step still being written: the layers it holds
        got = json.loads(urlopen(f"{server.url}api/map?kind=frame&step=0&layer=mean").read())
        assert _close(got["values"], aggregate(load(folder), "frame", steps=0, layers=[json.loads(frame[0])["layer"]]))
        manifest.write_bytes(b"".join(lines[:3]))  # three records committed so far

        def held() -> int:
            summary = json.loads(urlopen(f"{server.url}api/summary").read())
            return sum(len(summary["steps"][k]) * len(summary["layers"][k]) for k in summary["kinds"])

        before = held()
        manifest.write_bytes(b"".join(lines))  # the writer commits the rest
        assert before == 3 and held() == len(lines)
    finally:
        server.stop()


def test_the_export_keeps_the_word_kinds_at_ten_steps_at_most_the_first_and_the_last_among_them():
    from cogattn.view.report import MAX_STEPS, _spread

    kept = _spread(list(range(50)), MAX_STEPS)
    assert len(kept) == MAX_STEPS == 10 and kept[0] == 0 and kept[-1] == 49 and kept == sorted(set(kept))
    assert _spread([3, 7], MAX_STEPS) == [3, 7]


def test_the_export_keeps_what_it_is_told_and_says_so(runs, tmp_path, capsys):
    folder = _first(runs)
    run = load(folder / "maps")
    out = tmp_path / "small.html"
    assert main([str(folder), "--export", str(out), "--tokens", "2", "--steps", "1", "--side", "2"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out} (") and said.rstrip().endswith("MiB)")
    text = out.read_text()
    data = json.loads(text[text.index("COGATTN_EMBEDDED = ") + 19 : text.index(";</script>")].replace("<\\/", "</"))
    kept = data["summaries"][folder.name]["export"]
    last = len(run.timesteps) - 1
    assert kept["tokens"] == 2 and kept["max_side"] == 2 and kept["word_steps"]["video_to_text"] == [last]
    keys = sorted(k for k in data["maps"] if "|video_to_text|" in k)
    assert keys == [f"{folder.name}|video_to_text|{last}|mean|mean|{t}" for t in (0, 1)]
    got = data["maps"][keys[1]]  # token 1 over the video, pooled to 2 patches on the longer side
    want = torch.nn.functional.adaptive_avg_pool2d(
        aggregate(run, "video_to_text", steps=last)[1][:, None].double(), (1, 2)
    )
    assert got["shape"] == [run.layout.frames, 1, 2] and _close(got["values"], want[:, 0], digits=4)
    assert main([str(folder), "--export", str(out), "--tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokens=0" in err[0]


def test_only_requests_for_this_machine_are_answered(runs):
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    with pytest.raises(TypeError, match="pass a tuple of host names"):
        ViewServer(runs, allow_hosts="hub.example")
    server = ViewServer(runs, allow_hosts=("hub.example:443",)).start()
    try:
        for host in ("localhost:9999", "127.0.0.1", "[::1]:8000", "HUB.example:443"):  # a tunnel, a proxy
            assert json.loads(urlopen(Request(f"{server.url}api/runs", headers={"Host": host})).read())
        with pytest.raises(HTTPError) as answer:  # a page of another site, its name resolved to 127.0.0.1
            urlopen(Request(f"{server.url}api/runs", headers={"Host": f"attacker.example:{server.port}"}))
        assert answer.value.code == 403 and b"--allow-host" in answer.value.read()
    finally:
        server.stop()


def test_an_mp4_this_python_cannot_decode_shows_without_its_overlay_and_says_why(runs, tmp_path, monkeypatch):
    import sys

    folder = shutil.copytree(_first(runs), tmp_path / "copy")
    facts = json.loads((folder / "prompt.json").read_text())
    (folder / "video.mp4").write_bytes(b"an mp4 this machine cannot decode")
    (folder / "prompt.json").write_text(json.dumps({**facts, "video": "video.mp4"}))
    monkeypatch.setitem(sys.modules, "imageio.v3", None)  # imageio is not installed
    summary = RunView(folder / "maps").summary()
    assert summary["video"] == "mp4" and summary["video_frames"] == 0 and summary["latent_of_pixel"] == []
    assert "pip install 'cogattn[video]'" in summary["video_note"]


@pytest.mark.parametrize("frames, side", [(10**6, 2), (3, 5000)], ids=["many frames", "large frames"])
def test_an_mp4_of_more_than_the_page_overlays_is_decoded_no_further(runs, tmp_path, monkeypatch, frames, side):
    """An MP4 (imageio's frames, made up here) of a million frames, or of 5000 × 5000 pixels: counted up to the
    limit and no further, shown without the overlay, with its note."""
    import sys
    import types

    import numpy as np

    folder = shutil.copytree(_first(runs), tmp_path / "copy")
    facts = json.loads((folder / "prompt.json").read_text())
    (folder / "video.mp4").write_bytes(b"frames made up by the test")
    (folder / "prompt.json").write_text(json.dumps({**facts, "video": "video.mp4"}))
    decoded = []

    def imiter(path):
        for _ in range(frames):
            decoded.append(1)
            yield np.zeros((side, side, 3), dtype=np.uint8)

    v3 = types.SimpleNamespace(imiter=imiter)
    monkeypatch.setitem(sys.modules, "imageio", types.SimpleNamespace(v3=v3))
    monkeypatch.setitem(sys.modules, "imageio.v3", v3)
    summary = RunView(folder / "maps").summary()
    assert summary["video"] == "mp4" and summary["video_frames"] == 0
    assert "more than the page overlays (4096 frames of at most 16,777,216 pixels)" in summary["video_note"]
    assert len(decoded) == (4097 if side == 2 else 1)


@pytest.fixture(scope="module")
def default_tiny(tmp_path_factory) -> Path:
    """One prompt of the tiny default as ``scripts/dump_maps.py`` records it (frame and the word kinds, the heads'
    mean), and beside it the same prompt recording a point's row only as a ``query``."""
    out = tmp_path_factory.mktemp("default") / "runs"
    prompts = out.parent / "prompt.txt"
    prompts.write_text("a red fox\n")
    common = ["--set", f"prompts={prompts}", "--set", "num_inference_steps=2", "--set", "previews=false"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main(["--set", f"save_dir={out / 'default'}", *common]) == 0
        query = ["--set", "capture.kinds=[frame,query]", "--set", "capture.queries=[[2,0,4]]"]
        assert dump_main(["--set", f"save_dir={out / 'query'}", *common, *query]) == 0
    return out


def test_the_default_page_shows_no_error_and_says_what_to_record(default_tiny, browser):
    default, query = (next((default_tiny / name).iterdir()) for name in ("default", "query"))
    view = RunView(default / "maps")
    assert view.point(1, "mean", "mean", 1, 1, 2) == {"hint": POINT_HINT}  # the page's first point: a hint, once
    assert POINT_HINT.count("record") == 1 and RunView(query / "maps").summary()["points"] == [[2, 0, 4]]
    problems = []
    for folder in (default, query):
        server = ViewServer(folder).start()
        try:
            page = _page(browser, server.url, problems)
            errors = page.eval_on_selector_all(".error", "es => es.map(e => e.textContent)")
            assert errors and not any(errors), errors  # no panel says something went wrong
            run = load(folder / "maps")
            assert _close(_values(page, "frame"), aggregate(run, "frame", steps=len(run.timesteps) - 1))
            if folder == default:  # the point panel says what to record, in the hint's grey
                assert page.inner_text("#point-panel .note") == POINT_HINT
                assert (
                    page.eval_on_selector("#point-panel .note", "e => getComputedStyle(e).color")
                    == "rgb(119, 119, 119)"
                )
                assert page.get_attribute("#point", "data-values") == ""
            else:  # the recorded query is the first point: its row over the video
                assert json.loads(page.get_attribute("#point", "data-point")) == [2, 0, 4]
                lay = run.layout
                row = aggregate(run, "query", steps=len(run.timesteps) - 1)[0][lay.grid_tokens]
                assert _close(_values(page, "point"), row) and page.inner_text("#point-panel .note") == ""
        finally:
            server.stop()
    assert not problems, problems


def test_a_run_of_heads_in_descending_order_has_its_atlas_live_and_in_the_export(tmp_path, capsys, monkeypatch):
    """``heads=[1, 0]`` (the docs' own example of an order kept): the atlas' grid came out of pandas with a negative
    stride, which torch refused, so the atlas panel said so and ``--export`` left the whole run out (exit 0); a
    failure of one map now costs that map alone."""
    from tiny_calls import generate

    import cogattn
    from cogattn.models.cogvideox import tiny_pipeline

    pipe = tiny_pipeline(num_heads=2)
    with cogattn.record(pipe, kinds=("frame", "entropy"), heads=[1, 0], save_dir=tmp_path / "run"):
        generate(pipe, steps=1, output_type="latent")
    atlas = RunView(tmp_path / "run").heads(0, "entropy_mean")
    table = head_table(load(tmp_path / "run"), steps=0)
    want = [[table[(table.layer == n) & (table["head"] == h)].entropy_mean.item() for h in (1, 0)] for n in (0, 1)]
    assert atlas["heads"] == [1, 0] and _close(atlas["values"], torch.tensor(want), digits=6)
    out = tmp_path / "page.html"
    assert main([str(tmp_path / "run"), "--export", str(out)]) == 0
    assert "not in the export" not in capsys.readouterr().err
    monkeypatch.setattr(RunView, "heads", lambda *a, **k: 1 / 0)  # a reader failing as nothing checked
    assert main([str(tmp_path / "run"), "--export", str(out)]) == 0
    text = out.read_text()
    data = json.loads(text[text.index("COGATTN_EMBEDDED = ") + 19 : text.index(";</script>")].replace("<\\/", "</"))
    assert data["maps"]["run|heads|0|entropy_mean"] == {"error": "ZeroDivisionError: division by zero"}
    assert data["maps"]["run|frame|0|mean|mean|"]["shape"]
