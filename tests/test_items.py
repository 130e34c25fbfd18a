"""Which batch item a reader shows: under classifier-free guidance the recorded batch may hold the
unconditional items (the negative prompt's) beside the conditional ones; every reader shows the prompt's
item unless told otherwise, and the figures name the item they show."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import cogattn
from cogattn import plot
from cogattn.analysis import aggregate
from cogattn.analysis.head_stats import head_table
from cogattn.items import item_label, item_role, pick_item
from cogattn.models.cogvideox import tiny_pipeline
from tests.tiny_calls import PROMPT, generate

pytestmark = pytest.mark.usefixtures("forget_accelerate_state", "one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _title(fig) -> str:
    return fig._suptitle.get_text() if fig._suptitle is not None else " ".join(t.get_text() for t in fig.texts)


def test_the_roles_of_a_guidance_batch():
    assert [item_role(i, 4, True) for i in range(4)] == ["uncond", "uncond", "cond", "cond"]
    assert [item_role(i, 2, False) for i in range(2)] == [None, None]
    assert item_role(0, 2, None) is None  # a bare transformer does not say


@pytest.fixture(scope="module")
def guided():
    """One tiny CogVideoX generation under guidance, recorded whole (batch 'all': [uncond, cond]) and the
    prompt's item alone (batch 'cond'), on disk."""

    def run(batch, folder):
        pipe = tiny_pipeline()
        info = {"prompt": PROMPT, "negative_prompt": "blue sky"}
        with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch=batch, save_dir=folder, info=info) as rec:
            generate(pipe, prompt=PROMPT)
        return rec

    return run


def test_readers_show_the_conditional_item_by_default_and_name_it(guided, tmp_path):
    both, cond = guided("all", tmp_path / "all"), guided("cond", tmp_path / "cond")
    assert both.batch_roles == ("uncond", "cond") and cond.batch_roles == ("cond",)
    run = cogattn.load(tmp_path / "all")
    assert run.batch_roles == ("uncond", "cond")
    assert json.loads((tmp_path / "all" / "run.json").read_text())["selection"]["batch_roles"] == ["uncond", "cond"]
    for source in (both, run):
        got = aggregate(source, "video_to_text", steps=0, layers=0)
        want = cond.get("video_to_text", 0, 0)[0].double().mean(0).float()  # the prompt's item, recorded alone
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        unconditional = source.get("video_to_text", 0, 0)[0].double().mean(0).float()
        assert not torch.allclose(got, unconditional)  # the negative prompt's item is another map
        torch.testing.assert_close(aggregate(source, "video_to_text", steps=0, layers=0, batch="uncond"), unconditional)
        assert pick_item(source) == pick_item(source, "cond") == 1 and pick_item(source, "uncond") == 0
        assert item_label(source) == f"batch item 1, conditional: {PROMPT!r}"
        assert item_label(source, 0) == "batch item 0, unconditional: 'blue sky'"
        for bad in (1.0, True, [1]):
            with pytest.raises(TypeError, match=r"batch=.*: pass a slot index, 'cond', 'uncond' or None\.$"):
                pick_item(source, bad)
        for bad in (-1, 2):  # -1 read the last slot under the label "batch item -1"
            with pytest.raises(ValueError, match=rf"batch={bad} is out of range: 2 batch item\(s\) were recorded"):
                item_label(source, bad)
    fig = plot.word_heatmap(run, [2], steps=0)
    assert f"batch item 1, conditional: {PROMPT!r}" in _title(fig)
    assert "unconditional: 'blue sky'" in _title(plot.word_heatmap(run, [2], steps=0, batch="uncond"))
    assert "unconditional" in _title(plot.head_atlas(run, item="uncond", color="same_frame_mass"))
    with pytest.raises(ValueError, match="batch='uncond', but the recorded items are \\['cond'\\]"):
        aggregate(cond, "frame", batch="uncond")


def test_figures_number_an_item_as_the_transformer_batch_does_whatever_was_recorded(guided, tmp_path):
    """The prompt's item is the transformer batch's item 1 (``[uncond, cond]``): slot 1 of a ``batch="all"`` run,
    slot 0 of a ``batch="cond"`` one; every title names it ``batch item 1``, and slot 0 of the conditional run
    holds the same map as slot 1 of the whole one."""
    guided("all", tmp_path / "all"), guided("cond", tmp_path / "cond")
    both, cond = cogattn.load(tmp_path / "all"), cogattn.load(tmp_path / "cond")
    assert both.batch_items == (0, 1) and cond.batch_items == (1,)
    torch.testing.assert_close(cond.get("frame", 0, 0)[0], both.get("frame", 0, 0)[1], rtol=0, atol=0)
    for source in (both, cond):
        assert item_label(source) == f"batch item 1, conditional: {PROMPT!r}"
        assert f"batch item 1, conditional: {PROMPT!r}" in _title(plot.frame_heatmap(source, steps=0))
        assert "batch item 1, conditional" in _title(plot.head_atlas(head_table(source), color="same_frame_mass"))


def test_without_guidance_the_items_have_no_role_and_the_first_is_shown(tmp_path):
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("frame",)) as rec:
        generate(pipe, guidance=1.0)
    assert rec.batch_roles == (None,) and pick_item(rec) == 0 and item_label(rec) == "batch item 0"
    assert "batch item" not in _title(plot.frame_heatmap(rec))  # one item, no guidance: nothing to name


# -- the batch tool and the viewer ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def both_items(tmp_path_factory) -> Path:
    """One prompt of the tiny default under guidance with both items recorded (batch 'all')."""
    from cogattn.dump import main as dump_main

    out = tmp_path_factory.mktemp("items") / "runs"
    (out.parent / "p.txt").write_text(PROMPT + "\n")
    sets = [f"save_dir={out}", f"prompts={out.parent / 'p.txt'}", "capture.batch=all", "capture.heads=all"]
    sets += ["capture.kinds=[frame,video_to_text,full,block,entropy]", "capture.block_size=7"]
    sets += ["previews=false"]  # the viewer's item switch reads the maps alone
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert dump_main([a for s in sets for a in ("--set", s)]) == 0
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return folder


def test_the_viewer_shows_the_conditional_item_names_it_and_switches(both_items):
    from cogattn.view import RunView

    run, view = cogattn.load(both_items / "maps"), RunView(both_items / "maps")
    assert run.batch_roles == ("uncond", "cond")
    summary = view.summary()
    assert summary["item"] == 1 and [it["role"] for it in summary["items"]] == ["uncond", "cond"]
    assert summary["items"][1]["label"] == f"batch item 1, conditional: {PROMPT!r}"
    assert summary["items"][0]["label"] == "batch item 0, unconditional"  # no negative prompt given: no text
    meta = json.loads((both_items / "prompt.json").read_text())
    assert summary["negative_tokens"] == meta["negative_tokens"] != meta["tokens"]
    fox = meta["tokens"].index("▁fox") if "▁fox" in meta["tokens"] else meta["tokens"].index("fox")
    for item in (None, 0, 1):
        slot = 1 if item is None else item
        by_hand = torch.stack([run.get("video_to_text", 0, la)[slot, :, fox] for la in (0, 1)]).double().mean((0, 1))
        got = view.map("video_to_text", 0, "mean", "mean", fox, item=item)["values"]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), by_hand.flatten(), rtol=0, atol=1e-6)
    point = view.point(0, 1, 0, 1, 1, 2, item=0)["values"]
    token = run.layout.token_index(1, 1, 2)
    row = run.get("full", 0, 1)[0, 0, token, run.layout.grid_tokens].double()
    torch.testing.assert_close(torch.tensor(point, dtype=torch.float64), row, rtol=0, atol=1e-7)
    assert "error" in view.map("frame", 0, "mean", item="sideways")


def test_the_page_switches_items_and_relabels_the_words(both_items):
    from test_view import _chromium, _page, _redrawn, _values

    from cogattn.view import ViewServer

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test dependency")

    run = cogattn.load(both_items / "maps")
    server = ViewServer(both_items).start()
    problems: list = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
            page = _page(browser, server.url, problems)
            assert page.text_content("#item-label") == f"batch item 1, conditional: {PROMPT!r}"
            step = len(run.timesteps) - 1  # the slider opens at the last step
            frame = torch.stack([run.get("frame", step, la)[1] for la in (0, 1)]).double().mean((0, 1))
            torch.testing.assert_close(torch.tensor(_values(page, "frame"), dtype=torch.float64), frame.flatten())
            words = page.eval_on_selector_all("#token option", "os => os.map(o => o.textContent)")
            _redrawn(page, lambda: page.select_option("#item", "0"))
            assert page.text_content("#item-label") == "batch item 0, unconditional"
            frame = torch.stack([run.get("frame", step, la)[0] for la in (0, 1)]).double().mean((0, 1))
            torch.testing.assert_close(torch.tensor(_values(page, "frame"), dtype=torch.float64), frame.flatten())
            negative = page.eval_on_selector_all("#token option", "os => os.map(o => o.textContent)")
            assert negative != words and "item=0" in page.url  # the negative prompt's tokens; a link keeps the item
            browser.close()
    finally:
        server.stop()
    assert problems == []
