"""Wan 2.2 A14B's two experts are never averaged together: every head-table row names the transformer that
ran its step, and every average over steps (``aggregate``, ``temporal_decay``, the head atlas, the decay
curves, the map figures, the batch tool's previews) keeps to one expert or says why it will not, checked
against means computed by hand from ``get`` on a tiny two-expert pipeline."""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # the plot module never picks a backend; tests render off-screen

import numpy as np
import pandas as pd
import pytest
import torch

import cogattn
import cogattn.models

if cogattn.models.wan is None:
    pytest.skip("cogattn has no Wan support with this diffusers (WanAttention came with 0.35)", allow_module_level=True)

from tiny_calls import generate

from cogattn import analysis, plot
from cogattn.analysis import aggregate
from cogattn.analysis.head_stats import head_table, temporal_decay
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.models.wan import tiny_pipeline as tiny_wan_pipeline
from cogattn.plot.heads import CURVE_GID
from cogattn.plot.style import MAP_GID

# 4 steps of tiny_wan_pipeline(experts=2) (boundary_ratio 0.875): timesteps 1000, 934 | 781, 47
EXPERTS = {"transformer": [0, 1], "transformer_2": [2, 3]}
KINDS = ("frame", "entropy", "received", "block")
F, LAYERS = 3, (0, 1)  # latent frames, layers
MIXED = re.escape("transformer ran steps [0, 1]; transformer_2 ran steps [2, 3]")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """``(recording, run)`` of one 4-step two-expert call under guidance (both batch items), every head."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    pipe = tiny_wan_pipeline(experts=2)
    emb = torch.randn(1, 512, 16, generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("experts") / "run"
    call = dict(num_frames=9, height=32, width=48, num_inference_steps=4, output_type="latent")
    opts = dict(kinds=KINDS, heads="all", batch="all", block_size=7)
    with cogattn.record(pipe, **opts) as rec:
        pipe(prompt_embeds=emb, negative_prompt_embeds=-emb, **call)
    with cogattn.record(pipe, **opts, save_dir=folder):
        pipe(prompt_embeds=emb, negative_prompt_embeds=-emb, **call)
    torch.set_num_threads(before)
    assert rec.experts == ["transformer", "transformer", "transformer_2", "transformer_2"]
    return rec, cogattn.load(folder)


COND = 1  # the conditional item of the guidance batch [uncond, cond]: what readers show by default


def by_hand(source, kind, steps, layers=LAYERS, item=COND) -> torch.Tensor:
    """The mean over ``steps`` × ``layers`` of one item's records (heads kept), from plain ``get`` calls."""
    return torch.stack([source.get(kind, s, la)[item] for s in steps for la in layers]).double().mean(0)


def dt_by_hand(frame: torch.Tensor) -> torch.Tensor:
    """(..., F) mass at each latent-frame distance from a Wan frame map (..., F, F): mean over query frames."""
    return torch.stack(
        [sum(frame[..., q, k] for q in range(F) for k in range(F) if abs(q - k) == d) / F for d in range(F)], -1
    )


def images(fig):
    return [im for ax in fig.axes for im in ax.get_images() if im.get_gid() == MAP_GID]


# -- the head table --------------------------------------------------------------------------------
def test_every_head_table_row_names_its_expert(wan):
    for source in wan:
        table = head_table(source)
        assert table["expert"].tolist() == [source.experts[s] for s in table["step"]]
        assert {e: sorted(g["step"].unique().tolist()) for e, g in table.groupby("expert")} == EXPERTS
        assert analysis.expert_steps(source) == EXPERTS
        only = head_table(source, steps="transformer_2")  # an expert's name selects its steps
        assert sorted(only["step"].unique().tolist()) == [2, 3] and set(only["expert"]) == {"transformer_2"}
        row = only[(only["step"] == 3) & (only["layer"] == 1) & (only["head"] == 1) & (only["item"] == 1)]
        frame = source.get("frame", 3, 1)[1, 1].double()  # (F, F): Wan's groups are the latent frames alone
        assert row["same_frame_mass"].item() == pytest.approx(frame.diagonal().mean().item(), abs=1e-6)


def test_a_cogvideox_table_says_transformer():
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("frame",)) as rec:
        generate(pipe, steps=2, output_type="latent")
    table = head_table(rec)
    assert table["expert"].tolist() == ["transformer"] * len(table) and len(table) == 2 * 2  # steps × layers
    assert aggregate(rec, "frame").numpy() == pytest.approx(
        by_hand(rec, "frame", [0, 1], item=0).mean(0).numpy(), abs=1e-6
    )


# -- aggregate -------------------------------------------------------------------------------------
def test_aggregate_keeps_to_one_expert_or_says_why_not(wan):
    for source in wan:
        for expert, steps in EXPERTS.items():
            got = aggregate(source, "frame", steps=expert, heads="all", batch=1).double()
            assert torch.allclose(got, by_hand(source, "frame", steps, item=1), atol=1e-6)
            same = aggregate(source, "entropy", steps=steps, layers=1)  # a list of one expert's steps
            assert torch.allclose(same.double(), by_hand(source, "entropy", steps, layers=(1,)).mean(0), atol=1e-6)
        with pytest.raises(ValueError, match=MIXED) as err:
            aggregate(source, "frame")
        assert "Pass steps='transformer' or steps='transformer_2'" in str(err.value)
        with pytest.raises(ValueError, match=re.escape("transformer ran steps [1]; transformer_2 ran steps [2]")):
            aggregate(source, "frame", steps=[1, 2])
        with pytest.raises(ValueError, match=r"steps='transformer_3'.*'transformer', 'transformer_2'"):
            aggregate(source, "frame", steps="transformer_3")


# -- temporal decay and the head figures -----------------------------------------------------------
def test_temporal_decay_is_per_expert(wan):
    rec, _ = wan
    table = head_table(rec)
    for by in ("layer", "head"):
        with pytest.raises(ValueError, match=MIXED):
            temporal_decay(table, by=by)
    for expert, steps in EXPERTS.items():
        got = temporal_decay(table[table["expert"] == expert], by="layer")
        for layer in LAYERS:
            frames = torch.stack([rec.get("frame", s, layer) for s in steps]).double()  # (steps, B, H, F, F)
            want = dt_by_hand(frames).mean((0, 1, 2))  # over steps, items and heads
            assert np.allclose(got.loc[layer].to_numpy(), want.numpy(), atol=1e-6)
    per_step = temporal_decay(table, by="step")  # each step is one expert's: nothing mixed
    frames = torch.stack([rec.get("frame", 3, la) for la in LAYERS]).double()
    assert np.allclose(per_step.loc[3].to_numpy(), dt_by_hand(frames).mean((0, 1, 2)).numpy(), atol=1e-6)


def test_head_atlas_mean_keeps_to_one_expert(wan):
    rec, run = wan
    for source in (rec, head_table(run)):
        with pytest.raises(ValueError, match=MIXED):
            plot.head_atlas(source, "dt_1", steps="mean")
    fig = plot.head_atlas(run, "dt_1", steps="transformer_2", item=1)
    (im,) = images(fig)
    frames = torch.stack([torch.stack([run.get("frame", s, la)[1] for s in (2, 3)]) for la in LAYERS]).double()
    want = dt_by_hand(frames)[..., 1].mean(1)  # (layers, heads): mean over the expert's steps
    assert np.allclose(np.ma.getdata(im.get_array()), want.numpy(), atol=1e-6)
    assert "transformer_2" in fig.get_suptitle()


def test_decay_curves_keep_to_one_expert(wan):
    rec, _ = wan
    with pytest.raises(ValueError, match=MIXED):
        plot.decay_curves(rec, by="layer")
    fig = plot.decay_curves(rec, by="layer", steps="transformer")
    curves = [ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == CURVE_GID]
    assert len(curves) == 2 and "transformer" in fig.get_suptitle()
    for layer, ln in zip(LAYERS, curves):
        frames = torch.stack([rec.get("frame", s, layer)[COND] for s in (0, 1)]).double()
        assert np.allclose(ln.get_ydata(), dt_by_hand(frames).mean((0, 1)).numpy(), atol=1e-6)
    per_step = plot.decay_curves(rec, by="step")  # one curve per step: no average over steps
    labels = [ln.get_label() for ax in per_step.axes for ln in ax.lines if ln.get_gid() == CURVE_GID]
    assert labels == [
        "step 0 · transformer",
        "step 1 · transformer",
        "step 2 · transformer_2",
        "step 3 · transformer_2",
    ]


# -- the map figures -------------------------------------------------------------------------------
def test_map_figures_average_one_expert(wan):
    rec, run = wan
    for draw in (plot.frame_heatmap, plot.block_map, lambda s, **kw: plot.token_stat(s, "received", **kw)):
        with pytest.raises(ValueError, match=MIXED):
            draw(run)
    (im,) = images(plot.frame_heatmap(run, steps="transformer_2"))
    assert np.allclose(im.get_array(), by_hand(run, "frame", [2, 3]).mean(0).numpy(), atol=1e-6)
    (im,) = images(plot.block_map(rec, steps="transformer"))
    assert np.allclose(im.get_array(), by_hand(rec, "block", [0, 1]).mean(0).numpy(), atol=1e-6)
    grid = plot.layer_step_grid(rec, "frame", layers=[0])  # one step per column: each names its expert
    assert [ax.get_title().split("\n")[-1] for ax in grid.axes[:4]] == [rec.experts[s] for s in range(4)]
    panels = images(plot.token_stat(rec, "received", steps="transformer_2", sinks=0))
    want = by_hand(rec, "received", [2, 3]).mean(0).reshape(F, 2, 3)  # (F, Hp, Wp) on the patch grid
    assert np.allclose(np.stack([im.get_array() for im in panels]), want.numpy(), atol=1e-5)


# -- the batch tool --------------------------------------------------------------------------------
def test_the_batch_tool_writes_experts_and_previews_per_expert(tmp_path, monkeypatch, dump):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "p.txt").write_text("a white bird flying over the forest\n")
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny-wan.yaml"
    sets = [f"prompts={tmp_path / 'p.txt'}", "tiny_experts=2", "num_inference_steps=4", "capture.kinds=[frame,entropy]",
            "capture.heads=all", f"save_dir={tmp_path / 'out'}"]  # fmt: skip
    dump(config, *(a for s in sets for a in ("--set", s)), check=0)
    (folder,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    run = cogattn.load(folder / "maps")
    assert run.experts == ["transformer", "transformer", "transformer_2", "transformer_2"]
    csv = pd.read_csv(folder / "heads.csv")
    assert csv["expert"].tolist() == [run.experts[s] for s in csv["step"]] and set(csv["step"]) == {0, 1, 2, 3}
    for row in csv.itertuples():
        frame = run.get("frame", row.step, row.layer)[row.item, int(row.head)].double()
        assert row.same_frame_mass == pytest.approx(frame.diagonal().mean().item(), abs=1e-6)
    meta = json.loads((folder / "prompt.json").read_text())
    per_expert = {f"{kind}_{e}.png" for kind in ("frame", "entropy") for e in EXPERTS}
    assert set(meta["previews"]) == per_expert | {"heads.png"}
    assert all((folder / "previews" / name).is_file() for name in meta["previews"])


def test_mask_recall_rows_name_their_expert(wan):
    """Block-mask recall rows say which transformer ran their step, as the head table's do, and a row's recall
    is that step's own block map, by hand."""
    from cogattn.analysis.masks import mask_recall, oracle_curve, same_frame_mask

    for source in wan:
        mask = same_frame_mask(source.layout, source.block_size)
        table = mask_recall(source, mask)
        assert {s: set(table[table.step == s].expert) for s in range(4)} == {
            s: {name} for name, steps in EXPERTS.items() for s in steps
        }
        row = table[(table.step == 2) & (table.layer == 1) & (table["item"] == 0)].iloc[0]
        blk = source.get("block", 2, 1)[0, int(row["head"])].double()  # (N, N): mean over each query block
        S, size = source.layout.seq_len, source.block_size
        weights = torch.tensor([min(size, S - m * size) for m in range(blk.shape[0])], dtype=torch.float64)
        assert row["recall"] == pytest.approx(((blk * mask).sum(1) * weights).sum().item() / S, abs=1e-6)
        assert set(oracle_curve(source, ks=[1]).query("step >= 2").expert) == {"transformer_2"}
