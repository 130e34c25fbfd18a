"""``cogattn view``'s sparse-attention and correspondence panels on a batch run of the tiny CogVideoX that recorded
``tile``, ``top_p``, ``offset`` and ``frame_max``: the server's answers equal the library's own numbers
(``masks.mask_recall`` on the tile map, the mean ``top_p`` count over the video queries, ``decay.decay_table``
and ``mean_decay``, ``tracks.track``), a pattern's tile mask is the tiles its token pairs touch, a damaged run
answers an error in the panel, and in headless Chromium the panels show those numbers, a click draws the
point's track at the positions ``track`` gives, and the export carries the panels."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path
from urllib.request import urlopen

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_view import _check_bars, _close, _hover, _page, _redrawn, _shows, _values

from cogattn.analysis import aggregate
from cogattn.analysis.decay import decay_table, mean_decay
from cogattn.analysis.masks import mask_recall
from cogattn.analysis.tracks import track
from cogattn.dump import main as dump_main
from cogattn.errors import StoreError
from cogattn.exact.reducers import REDUCERS
from cogattn.runs.run import load
from cogattn.view import RunView, ViewServer, export, sparse

TILE = (1, 2, 2)
TOP_P = (0.5, 0.9, 0.99)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One prompt of the tiny default (the batch tool's folder: video, prompt.json, maps/), every head."""
    out = tmp_path_factory.mktemp("sparse") / "runs"
    prompts = out.parent / "prompt.txt"
    prompts.write_text("a red fox\n")
    kinds = "capture.kinds=[frame,video_to_text,tile,top_p,offset,frame_max]"
    args = ["--set", f"save_dir={out}", "--set", f"prompts={prompts}", "--set", kinds, "--set", "capture.heads=all"]
    args += ["--set", f"capture.tile_shape={list(TILE)}", "--set", f"capture.top_p={list(TOP_P)}"]
    args += ["--set", "previews=false"]  # the panels read the maps alone
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main(args) == 0
    return next(p for p in out.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test dependency")
    path = next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)
    if path is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def _naive_tile_mask(run, same) -> torch.Tensor:
    """A tile mask from the tiles' positions: text rows and columns kept, tiles (t, y, x) kept where
    ``same(tile_a, tile_b)`` (for ``tile_shape`` (1, h, w): spatial keeps one frame, temporal one patch range)."""
    lay = run.layout
    nt, nh, nw = lay.tile_counts(TILE)
    places = [(k // (nh * nw), k // nw % nh, k % nw) for k in range(nt * nh * nw)]
    n = len(places) + 1
    keep = torch.ones(n, n, dtype=torch.bool)
    for a, pa in enumerate(places):
        for b, pb in enumerate(places):
            keep[a + 1, b + 1] = same(pa, pb)
    return keep


def test_the_answers_are_the_library_s_numbers(folder):
    run, view = load(folder / "maps"), RunView(folder / "maps")
    lay, S = run.layout, run.layout.seq_len
    assert view.summary()["sparse"] == {"tile_shape": list(TILE), "top_p": list(TOP_P), "patterns": ["spatial", "temporal"]}  # fmt: skip
    step = 2
    # tile: the map, a pattern's mask (the tiles its token pairs touch), and mask_recall's recall of it
    got = sparse.tile(view, step, 1, 0, "spatial")
    assert _close(got["values"], aggregate(run, "tile", steps=step, layers=1, heads=0))
    assert got["labels"][:3] == ["text", "t0 y0 x0", "t0 y0 x1"] and len(got["labels"]) == got["shape"][0]
    spatial = _naive_tile_mask(run, lambda a, b: a[0] == b[0])
    assert got["mask"] == spatial.flatten().int().tolist()
    table = mask_recall(run, "spatial", steps=[step], layers=[1], kind="tile")
    assert got["recall"] == pytest.approx(float(table.query("head == 0 and item == 0")["recall"].iloc[0]), abs=1e-12)
    got = sparse.tile(view, step, "mean", "mean", "temporal")
    temporal = _naive_tile_mask(run, lambda a, b: a[1:] == b[1:])
    assert got["mask"] == temporal.flatten().int().tolist()
    table = mask_recall(run, "temporal", steps=[step], kind="tile").query("item == 0")
    assert got["recall"] == pytest.approx(float(table["recall"].mean()), abs=1e-12)
    assert "choose 'none' or one of" in sparse.tile(view, step, 1, 0, "radial")["error"]
    # density: the mean top_p count over the video queries, as a share of the S keys
    got = sparse.density(view, step, 1, 1)
    counts = run.get("top_p", step, 1)[0, 1][lay.grid_tokens].double().mean(0)
    assert got["p"] == list(TOP_P) and got["keys"] == S
    assert _close(got["counts"], counts) and _close(got["share"], counts / S)
    layers = [n for k, s, n in run.keys() if k == "top_p" and s == step]
    mean = torch.stack([run.get("top_p", step, n)[0] for n in layers]).double().mean((0, 1))[lay.grid_tokens].mean(0)
    assert _close(sparse.density(view, step, "mean", "mean")["counts"], mean)
    # decay: decay_table's row of the head, and mean_decay of the rows averaged, with their fits
    table = decay_table(run, steps=[step]).query("item == 0")
    got = sparse.decay(view, step, 1, 0)
    row = table.query("layer == 1 and head == 0").iloc[0]
    assert got["dt"] == pytest.approx([row[f"dt_{d}"] for d in range(lay.frames)], abs=1e-12)
    assert got["ds"] == pytest.approx([row[c] for c in table.columns if c.startswith("ds_")], abs=1e-12)
    assert got["t_fit"]["rate"] == pytest.approx(row["t_rate"]) and got["s_fit"]["r2"] == pytest.approx(row["s_r2"])
    both = mean_decay(table, by="step").iloc[0]
    got = sparse.decay(view, step, "mean", "mean")
    assert got["t_fit"] == pytest.approx({"rate": both["t_rate"], "scale": both["t_scale"], "r2": both["t_r2"]})
    assert got["t_fitted"][1] == pytest.approx(both["t_scale"] * torch.tensor(-both["t_rate"]).exp().item())
    # track: tracks.track of one map, and the pixel frame under each latent frame
    got = sparse.track(view, step, 1, 1, 1, 2, 3)
    want = track(run, (1, 2, 3), step=step, layer=1, head=1)
    assert got["positions"] == want.positions.tolist() and _close(got["confidence"], want.confidence)
    of_pixel = lay.latent_of_pixel(view.files.frame_count())
    assert [of_pixel[i] for i in got["under"]] == list(range(lay.frames))
    assert "choose a layer" in sparse.track(view, step, "mean", 1, 1, 2, 3)["hint"]  # a choice to make, not an error
    assert "recorded per head" in sparse.track(view, step, 1, "mean", 1, 2, 3)["hint"]
    assert "outside the latent grid" in sparse.track(view, step, 1, 1, 9, 2, 3)["error"]


@pytest.fixture
def damaged(folder, tmp_path) -> Path:
    return shutil.copytree(folder, tmp_path / "prompt") / "maps"


def test_a_damaged_run_answers_an_error_in_the_panel(damaged):
    meta = json.loads((damaged / "run.json").read_text())
    for field, value in (("top_p", "<b>all</b>"), ("patterns", ["temporal", 7])):  # a type run.json never holds
        (damaged / "run.json").write_text(json.dumps({**meta, "selection": {**meta["selection"], field: value}}))
        with pytest.raises(StoreError, match=rf"selection\.{field}(\[1\])? is "):
            RunView(damaged)
    meta["selection"].update(top_p=[], patterns=["temporal", "sta:2,2,2", "no such", "window:1"])
    (damaged / "run.json").write_text(json.dumps(meta))
    view = RunView(damaged)
    assert view.summary()["sparse"]["patterns"] == ["temporal", "window:1"]  # what parses, once
    assert "selection.top_p" in sparse.density(view, 1, 1, 0)["error"]
    run = load(damaged)
    lay = run.layout
    (record,) = [r for r in run.records() if r.kind == "frame_max" and (r.step, r.layer) == (1, 1)]
    tensors = load_file(str(damaged / record.file))  # (B, H, S, G, 2): values and key tokens
    for t in tensors.values():
        t[..., lay.grid_tokens, lay.text_groups, 1] = lay.seq_len - 1  # frame 0's match, a token of the last frame
    save_file(tensors, str(damaged / record.file))
    assert "outside the frames they match in" in sparse.track(view, 1, 1, 0, 1, 2, 3)["error"]
    (record,) = [r for r in run.records() if r.kind == "tile" and (r.step, r.layer) == (1, 1)]
    save_file({k: v[..., :-1, :-1].contiguous() for k, v in load_file(str(damaged / record.file)).items()}, str(damaged / record.file))  # fmt: skip
    answer = sparse.tile(view, 1, 1, 0, "temporal")
    assert "error" in answer and "values" not in answer
    meta["selection"].update(top_p=[0.5, 0.9])  # two masses, where the records count three
    (damaged / "run.json").write_text(json.dumps(meta))
    assert "the run's files do not agree" in sparse.density(RunView(damaged), 1, 1, 0)["error"]
    # an offset record a patch short on each spatial axis: its file no longer the record its manifest line names
    (record,) = [r for r in run.records() if r.kind == "offset" and (r.step, r.layer) == (1, 1)]
    save_file({"map": torch.rand(*record.shape[:-2], record.shape[-2] - 1, record.shape[-1] - 1)}, str(damaged / record.file))  # fmt: skip
    server = ViewServer(damaged.parent).start()
    try:
        answer = json.loads(urlopen(f"{server.url}api/decay?step=1&layer=1&head=0").read())
    finally:
        server.stop()
    assert "cannot be read" in answer["error"] or "the manifest says" in answer["error"]
    assert "values" not in answer and "dt" not in answer


def test_the_page_shows_the_panels_numbers_and_a_click_draws_the_track(folder, browser):
    run = load(folder / "maps")
    lay = run.layout
    server = ViewServer(folder).start()
    problems = []
    try:
        api = json.loads(urlopen(f"{server.url}api/density?step=1&layer=1&head=0").read())
        assert api == json.loads(json.dumps(sparse.density(RunView(folder / "maps"), 1, 1, 0)))
        page = _page(browser, f"{server.url}?step=1&layer=1&head=0&pattern=spatial&point=0,0,0", problems)
        assert page.is_visible("#tile-panel") and page.is_visible("#density-panel") and page.is_visible("#decay-panel")
        assert _close(_values(page, "tile"), aggregate(run, "tile", steps=1, layers=1, heads=0))
        recall = mask_recall(run, "spatial", steps=[1], layers=[1], kind="tile").query("head == 0 and item == 0")
        recall = float(recall["recall"].iloc[0])
        assert float(page.get_attribute("#tile", "data-recall")) == pytest.approx(recall, abs=1e-12)
        assert page.inner_text("#tile-recall") == f"recall {float(f'{recall:.4g}')} of the attention mass"
        assert _check_bars(page, "tile", log=False) == REDUCERS["tile"].unit
        text, value = _hover(page, "tile", 0, 1, 2)
        want = float(aggregate(run, "tile", steps=1, layers=1, heads=0)[1, 2])
        _shows(text, "query tile t0 y0 x0, key tile t0 y0 x1", want, value)
        counts = run.get("top_p", 1, 1)[0, 0][lay.grid_tokens].double().mean(0)
        cells = page.locator("#density-table tr").nth(1).locator("td").all_inner_texts()
        assert [float(c) for c in cells] == pytest.approx((counts / lay.seq_len).tolist(), rel=5e-4)
        assert page.locator("#density circle").count() == len(TOP_P)
        row = decay_table(run, steps=[1], layers=[1]).query("head == 0 and item == 0").iloc[0]
        fit = page.inner_text("#decay-fit")  # each number to 4 significant digits
        for axis, per in (("t", "latent frame"), ("s", "patch")):
            shown = re.search(f"rate λ (\\S+) per {per}, R² (\\S+),", fit)
            want = (row[f"{axis}_rate"], row[f"{axis}_r2"])
            assert [float(x) for x in shown.groups()] == pytest.approx(want, rel=5e-4), fit
        # a click on the word map's patch (frame 1, row 2, column 3) draws that point's track
        cell = page.locator("#word canvas[data-frame='1']")
        box = cell.bounding_box()
        x, y = (3 + 0.5) * box["width"] / lay.width, (2 + 0.5) * box["height"] / lay.height
        _redrawn(page, lambda: cell.click(position={"x": x, "y": y}))
        want = track(run, (1, 2, 3), step=1, layer=1, head=0)
        drawn = json.loads(page.get_attribute("#track", "data-track"))
        assert drawn["point"] == [1, 2, 3] and drawn["positions"] == want.positions.tolist()
        for f in range(lay.frames):
            canvas = page.locator(f"#track canvas[data-frame='{f}']")
            assert json.loads(canvas.get_attribute("data-match")) == want.positions[f].tolist()
            caption = page.locator("#track figcaption").nth(f).inner_text()
            r, c = want.positions[f].tolist()
            assert caption == f"f{f}: ({r}, {c}) p {float(f'{want.confidence[f].item():.4g}')}"
        assert not page.is_visible("#point-panel")  # no kind holds a point's row: the clicks are the track's
        # a click on the track's own frames tracks that patch
        canvas = page.locator("#track canvas[data-frame='2']")
        box = canvas.bounding_box()
        _redrawn(page, lambda: canvas.click(position={"x": 0.5 * box["width"] / lay.width, "y": 0.5 * box["height"] / lay.height}))  # fmt: skip
        want = track(run, (2, 0, 0), step=1, layer=1, head=0)
        assert json.loads(page.get_attribute("#track", "data-track"))["positions"] == want.positions.tolist()
        assert "point=2%2C0%2C0" in page.url
        # each latent frame's match is drawn over a frame of the video (not the blank grid drawn without one)
        r, c = next((r, c) for r in range(lay.height) for c in range(lay.width) if [r, c] != want.positions[1].tolist())
        under = """([r, c, cols]) => {
            const canvas = document.querySelector("#track canvas[data-frame='1']");
            const cell = canvas.width / cols;
            const rgb = canvas.getContext("2d").getImageData((c + 0.5) * cell, (r + 0.5) * cell, 1, 1).data;
            return rgb[0] !== 238 || rgb[1] !== 238 || rgb[2] !== 238;
        }"""
        page.wait_for_function(under, arg=[r, c, lay.width], timeout=20000)
    finally:
        server.stop()
    assert not problems, problems


def test_the_export_carries_the_panels_and_says_the_track_is_live_only(folder, browser, tmp_path):
    run = load(folder / "maps")
    out = export(folder, tmp_path / "report.html")
    problems = []
    page = _page(browser, out.as_uri(), problems)
    _redrawn(page, lambda: page.fill("#step", "1"))
    _redrawn(page, lambda: page.select_option("#pattern", "temporal"))
    assert _close(_values(page, "tile"), aggregate(run, "tile", steps=1), digits=4)
    recall = mask_recall(run, "temporal", steps=[1], kind="tile").query("item == 0")["recall"].mean()
    assert float(page.get_attribute("#tile", "data-recall")) == pytest.approx(recall, abs=1e-12)
    _check_bars(page, "tile", log=False)
    density = json.loads(page.get_attribute("#density", "data-values"))
    assert density == json.loads(json.dumps(sparse.density(RunView(folder / "maps"), 1, "mean", "mean")))
    _redrawn(page, lambda: page.select_option("#layer", "1"))
    decay = json.loads(page.get_attribute("#decay", "data-values"))
    assert decay["dt"] == pytest.approx(sparse.decay(RunView(folder / "maps"), 1, 1, "mean")["dt"], abs=1e-12)
    assert "open the run with `cogattn view`" in page.inner_text("#track-panel .note")  # a hint: nothing went wrong
    assert page.inner_text("#track-panel .error") == "" and page.inner_text("#point-panel .error") == ""
    assert not problems, problems
