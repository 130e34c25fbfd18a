"""The tour notebook: its .ipynb and .py (jupytext percent) hold the same cells, and it runs end to end
on the tiny default, showing every figure."""

import importlib.util
import os
import time
from pathlib import Path

import pytest

import cogattn.models

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "notebooks" / "tour.ipynb"
SCRIPT = ROOT / "notebooks" / "tour.py"


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_notebook_and_script_are_in_sync():
    jupytext = pytest.importorskip("jupytext")
    nb, script = jupytext.read(NOTEBOOK), jupytext.read(SCRIPT)
    assert _cells(nb) == _cells(script), "run `jupytext --sync notebooks/tour.py` after editing either file"
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    (config,) = [c for c in nb.cells if c.source.startswith("MODEL = ")]  # the one variable to switch to a checkpoint
    assert config.source.startswith('MODEL = "tiny"')


def test_notebook_runs_end_to_end_on_the_tiny_default(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernelspec = pytest.importorskip("ipykernel.kernelspec")
    # A kernel spec for this interpreter, so the notebook runs in this environment whatever else is installed.
    kernelspec.write_kernel_spec(path=tmp_path / "kernels" / "cogattn-test")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the notebook writes its GIF
    nb = nbformat.read(NOTEBOOK, as_version=4)
    wan, hunyuan = cogattn.models.wan is not None, cogattn.models.hunyuan_video is not None
    # the Wan section needs diffusers >= 0.35, the HunyuanVideo one 0.33: without them, run the rest
    for section, present, until in (("## Wan", wan, "## HunyuanVideo"), ("## HunyuanVideo", hunyuan, "## Explore")):
        if not present:
            start = next(i for i, c in enumerate(nb.cells) if c.source.startswith(section))
            end = next(i for i, c in enumerate(nb.cells) if c.source.startswith(until))
            del nb.cells[start:end]
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="cogattn-test", resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    client.execute()
    assert time.perf_counter() - start < 120
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs[:-1] if "image/png" in o.get("data", {})]
    # frame map, per head, two grids, two word maps, query map, atlas, decay, block map; the sparse study's
    # label atlas, density curves, distance decay, track and two motion fields; Wan's frame and word maps;
    # HunyuanVideo's word map
    assert len(figures) == 16 + 2 * wan + hunyuan
    assert any("image/gif" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "latent grid (F, Hp, Wp) = (3, 3, 5); following the video point (1, 1, 2)" in text
    if hunyuan:  # "a cat" keeps 3 of its 12 text tokens: the other 9 receive nothing
        assert "padded text keys receive: [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]" in text
    assert "pixel frames of each latent frame: [range(0, 1), range(1, 5), range(5, 9)]" in text
    assert not wan or "expert of each step: ['transformer', 'transformer', 'transformer_2', 'transformer_2']" in text
    assert (tmp_path / "cogattn_fox_steps.gif").exists()
    widget = outputs[-1].get("data", {})
    has_widgets = importlib.util.find_spec("ipywidgets") is not None
    assert ("application/vnd.jupyter.widget-view+json" in widget) == has_widgets
    if not has_widgets:
        assert "image/png" in widget  # the static fallback
