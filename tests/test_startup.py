"""Start-up: ``import cogattn``, the viewer's modules and reading a run import no model code (no family module, no
diffusers transformer module), and recording a tiny CogVideoX imports that family's module alone; the registry
finds a family by its row of ``cogattn.models.TABLE`` and imports its module on first use."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn import models
from cogattn.models import TABLE, Unavailable
from cogattn.models.cogvideox import tiny_pipeline

TESTS = Path(__file__).parent

# run in a fresh interpreter: what each stage left in sys.modules, and the numbers it read and recorded
STAGES = r"""
import json, sys
import cogattn, cogattn.__main__, cogattn.view
from cogattn.models import TABLE

def seen():
    return {
        "families": sorted(name for name in TABLE if f"cogattn.models.{name}" in sys.modules),
        "model_code": sorted(m for m in sys.modules if m.startswith("diffusers.models.transformers")),
        "batch_tool": sorted(m for m in sys.modules if m.startswith("cogattn.dump")),
    }

out = {"imported": seen()}
run = cogattn.load(sys.argv[1])
out["read"] = run.get("frame", step=0, layer=1).tolist()
from cogattn.view.data import RunView

out["layers"] = RunView(sys.argv[1]).summary()["layer_names"]  # the viewer's reading side too
out["reading"] = seen()
sys.path.insert(0, sys.argv[2])
from tiny_calls import generate
from cogattn.models.cogvideox import tiny_pipeline

pipe = tiny_pipeline()
with cogattn.record(pipe, kinds=("frame",)) as rec:
    generate(pipe, steps=1, output_type="latent")
out["recorded"] = rec.get("frame", step=0, layer=1).tolist()
out["recording"] = seen()
print(json.dumps(out))
"""


def test_import_view_and_reading_import_no_model_code_and_recording_imports_its_family_alone(tmp_path):
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("frame",), save_dir=tmp_path / "run") as rec:
        generate(pipe, steps=1, output_type="latent")
    want = rec.get("frame", step=0, layer=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", STAGES, str(tmp_path / "run"), str(TESTS)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    for stage in ("imported", "reading"):
        assert out[stage] == {"families": [], "model_code": [], "batch_tool": []}, stage
    assert out["recording"]["families"] == ["cogvideox"] and out["recording"]["batch_tool"] == []
    read, recorded = torch.tensor(out["read"]), torch.tensor(out["recorded"])
    assert torch.equal(read, want)  # the file read back in the other process is what this one recorded
    assert out["layers"] == [f"transformer_blocks.{i}.attn1" for i in (0, 1)]  # the tiny CogVideoX's two blocks
    assert torch.allclose(recorded, want, atol=1e-6)  # the same seeded call there, recorded again
    assert torch.allclose(read.sum(-1), torch.ones(read.shape[:-1]), atol=1e-5)  # frame's rows sum to 1


def test_every_family_module_has_a_row_and_the_rows_agree_with_the_specs():
    ignored = {
        "spec",
        "site",
        "tiny_text",
        "prompt_text",
        "call_sizes",
    }  # the registry's helpers; `_name`: a family's parts
    found = {m.name for m in pkgutil.iter_modules(models.__path__)}
    assert set(TABLE) == {name for name in found if name not in ignored and not name.startswith("_")}
    assert [spec.family for spec in models.FAMILIES] == [name for name in TABLE if name not in models.UNAVAILABLE]
    for spec in models.FAMILIES:
        row = TABLE[spec.family]
        assert {cls.__name__ for cls in spec.transformers} <= set(row.classes), spec.family
        assert row.config_keys == spec.config_keys, spec.family
        for name in row.classes:  # each name routes to this family: a checkpoint's config names one
            try:
                found = models.spec_for_config({"_class_name": name})
            except ValueError as refused:  # a class the row names only to refuse it with why (Kandinsky 6 SR)
                assert name in str(refused) and "not recorded" in str(refused), refused
                continue
            assert found is spec
        for key in row.config_keys:  # a config without its class: the first family in TABLE's order with a key
            first = next(f for f, r in TABLE.items() if key in r.config_keys)
            assert models.spec_for_config({key: 1}).family == first


def test_a_module_is_found_by_its_class_and_bases_and_the_tiny_names_by_their_family():
    cogvideox = models.family("cogvideox")

    class Mine(cogvideox.transformers[0]):  # a user's subclass: found by its base's name
        pass

    assert models.spec_for_module(Mine.__new__(Mine)) is cogvideox
    assert models.spec_for_module(object()) is None and models.spec_for_module(None) is None
    assert models.tiny_spec("tiny") is cogvideox and models.tiny_spec("tiny-wan") is models.family("wan")
    assert models.tiny_spec("THUDM/CogVideoX-2b") is None and models.tiny_spec("tiny-nothing") is None
    assert cogattn.WanAttnMapProcessor is models.wan.WanAttnMapProcessor
    assert cogattn.CogVideoXAttnMapProcessor is models.cogvideox.CogVideoXAttnMapProcessor
    with pytest.raises(AttributeError, match="no_such_name"):
        cogattn.no_such_name  # noqa: B018
    with pytest.raises(ValueError, match=r"family 'nothing' is not one cogattn supports; supported: \['cogvideox'"):
        models.family("nothing")


def test_a_family_this_diffusers_lacks_is_none_and_says_what_it_needs(monkeypatch):
    needs = "Wan needs diffusers >= 0.35 (WanAttention)"
    monkeypatch.setitem(models._LOADED, "wan", Unavailable("wan", needs))
    monkeypatch.delattr(models, "wan")  # as where its module failed to import
    assert models.wan is None and cogattn.WanAttnMapProcessor is None
    with pytest.raises(ValueError, match=r"^Wan needs diffusers >= 0\.35 \(WanAttention\); upgrade diffusers\.$"):
        models.family("wan")
    with pytest.raises(ValueError, match="Wan needs diffusers >= 0.35"):
        models.spec_for_config({"_class_name": "WanTransformer3DModel"})
    with pytest.raises(ValueError, match="Wan needs diffusers >= 0.35"):
        models.spec_for_config({"text_dim": 4096})

    class WanTransformer3DModel:  # a module of that class: no family's, where its family cannot load
        pass

    assert models.spec_for_module(WanTransformer3DModel()) is None
