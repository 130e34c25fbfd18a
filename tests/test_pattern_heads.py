"""Heads labelled by output error: the pattern table's numbers are the ``pattern_error`` and ``pattern_recall``
records read back, its labels their argmin, ``label_changes`` a count over the table by hand, and the head atlas
draws the labels."""

import math

import matplotlib

matplotlib.use("Agg")  # the plot module never picks a backend; tests render off-screen

import pandas as pd
import pytest
import torch
from matplotlib.colors import to_rgba
from tiny_calls import generate

import cogattn
from cogattn import plot
from cogattn.analysis.pattern_heads import ErrorLabelRule, label_changes, pattern_table
from cogattn.errors import NotRecordedError
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.plot.heads import EXTRA_LABEL_COLORS


def same_row(qf, qy, qx, kf, ky, kx):
    """A user's pattern: the query's patch row in every frame, as many keys as ``spatial`` keeps (3 × 5 here), so
    which of the two serves a head better depends on its attention, not on how many keys each keeps."""
    return qy == ky


PATTERNS = ("spatial", "temporal", same_row)
NAMES = ("spatial", "temporal", "same_row")
STEPS = 4
OPTIONS = dict(kinds=("pattern_error", "pattern_recall"), patterns=PATTERNS, batch="all")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny CogVideoX generation of 4 steps, every head, both items of the guidance batch: in memory and on disk."""
    pipe = tiny_pipeline()
    folder = tmp_path_factory.mktemp("pattern_heads") / "run"
    with cogattn.record(pipe, **OPTIONS, heads="all", save_dir=folder) as rec:
        generate(pipe, steps=STEPS, output_type="latent")
    return pipe, rec, cogattn.load(folder)


def _slot(source, head):
    return list(source.head_ids).index(head)


def test_error_columns_are_the_records_and_labels_their_argmin(recorded):
    _, rec, run = recorded
    table = pattern_table(run)
    H, (B, layers) = len(run.head_ids), (2, 2)
    assert len(table) == STEPS * layers * H * B
    assert list(table.columns) == [
        "step", "timestep", "expert", "layer", "head", "item",
        "error_spatial", "error_temporal", "error_same_row",
        "recall_spatial", "recall_temporal", "recall_same_row", "label",
    ]  # fmt: skip
    assert set(table["expert"]) == {"transformer"} and table.attrs["batch_roles"] == ["uncond", "cond"]
    for row in table.itertuples(index=False):
        error = run.get("pattern_error", row.step, row.layer)[row.item, _slot(run, row.head)].double()
        recall = run.get("pattern_recall", row.step, row.layer)[row.item, _slot(run, row.head)].double()
        assert [row.error_spatial, row.error_temporal, row.error_same_row] == error.tolist()
        assert [row.recall_spatial, row.recall_temporal, row.recall_same_row] == recall.tolist()
        assert row.label == NAMES[int(torch.argmin(error))]
        assert row.timestep == run.timesteps[row.step]
    assert set(table["label"]) == {"spatial", "same_row"}  # the argmin differs between heads: a real check
    # the recording in memory gives the same table as the run read back
    pd.testing.assert_frame_equal(pattern_table(rec), table)


def test_selections_follow_the_readers(recorded):
    _, _, run = recorded
    full = pattern_table(run)
    part = pattern_table(run, steps=[0, 2], layers=1, heads=[1], batch="cond")
    want = full[full["step"].isin([0, 2]) & (full["layer"] == 1) & (full["head"] == 1) & (full["item"] == 1)]
    pd.testing.assert_frame_equal(part, want.reset_index(drop=True))
    mean = pattern_table(run, steps=3, heads="mean", batch=None)  # None: the first conditional item
    assert set(mean["head"]) == {"mean"} and set(mean["item"]) == {1}
    for row in mean.itertuples(index=False):
        error = run.get("pattern_error", 3, row.layer)[1].double().mean(0)  # over the heads
        assert [row.error_spatial, row.error_temporal, row.error_same_row] == pytest.approx(error.tolist(), rel=1e-12)
        assert row.label == NAMES[int(torch.argmin(error))]


def test_a_heads_mean_run_gives_one_mean_head_and_steps_skipped_leave_no_rows(recorded):
    pipe = recorded[0]
    with cogattn.record(pipe, kinds=("pattern_error",), patterns=PATTERNS, steps=(0, 2)) as rec:
        generate(pipe, steps=3, output_type="latent")
    table = pattern_table(rec)
    assert set(table["head"]) == {"mean"} and "recall_spatial" not in table.columns
    assert sorted(table["step"].unique()) == [0, 2]
    for row in table.itertuples(index=False):
        error = rec.get("pattern_error", row.step, row.layer)[row.item, 0].double()
        assert [row.error_spatial, row.error_temporal, row.error_same_row] == error.tolist()
    changes = label_changes(table)
    assert set(changes["steps"]) == {2}  # steps 0 and 2 are consecutive recorded steps


def test_label_changes_equal_a_count_by_hand(recorded):
    _, _, run = recorded
    table = pattern_table(run)
    table.loc[table.index[::3], "label"] = "temporal"  # the tiny model's heads keep their labels: add changes
    got = label_changes(table)
    assert len(got) == 2 * len(run.head_ids) * 2  # (layer, head, item)
    seen = 0
    for layer in (0, 1):
        for head in run.head_ids:
            for item in (0, 1):
                labels = []
                for step in range(STEPS):
                    rows = table[(table.step == step) & (table.layer == layer) & (table["head"] == head)]
                    labels.append(rows[rows["item"] == item]["label"].item())
                changes = 0
                for a, b in zip(labels, labels[1:]):
                    if a != b:
                        changes += 1
                counts = {name: labels.count(name) for name in labels}
                best = max(counts.values())
                first = next(name for name in labels if counts[name] == best)
                row = got[(got.layer == layer) & (got["head"] == head) & (got["item"] == item)]
                assert row[["expert", "steps", "changes", "distinct"]].values.tolist() == [
                    ["transformer", STEPS, changes, len(counts)]
                ]
                assert row["most_common"].item() == first and row["share"].item() == best / STEPS
                seen += changes
    assert seen > 0 and got["changes"].sum() == seen


def test_the_rule_is_the_argmin_its_ties_and_margin():
    rule = ErrorLabelRule()
    assert rule.label({"error_spatial": 0.2, "error_temporal": 0.1, "recall_spatial": 0.0}) == "temporal"
    assert rule.label({"error_spatial": 0.1, "error_temporal": 0.1}) == "spatial"  # a tie: the first pattern
    assert rule.label({"error_spatial": math.nan, "error_temporal": 0.3}) == "temporal"
    assert rule.label({"error_spatial": math.nan, "error_temporal": math.nan}) == "unknown"
    strict = ErrorLabelRule(margin=0.25)
    assert strict.label({"error_spatial": 0.8, "error_temporal": 1.0}) == "unknown"  # 0.8 > 0.75
    assert strict.label({"error_spatial": 0.75, "error_temporal": 1.0}) == "spatial"
    assert strict.label({"error_a": 0.5}) == "a"
    with pytest.raises(ValueError, match=r"margin=1\.0; use a relative lead in \[0, 1\)"):
        ErrorLabelRule(margin=1.0)


def test_a_run_without_pattern_error_is_refused_naming_the_kind(recorded):
    pipe = recorded[0]
    with cogattn.record(pipe, kinds=("pattern_recall",), patterns=PATTERNS) as rec:
        generate(pipe, steps=1, output_type="latent")
    with pytest.raises(NotRecordedError) as err:
        pattern_table(rec)
    assert "needs kind 'pattern_error'" in str(err.value) and "\n" not in str(err.value)
    assert "kinds=('pattern_error',)" in str(err.value)
    with pytest.raises(ValueError, match="the table has no column"):
        label_changes(pd.DataFrame({"step": [0], "layer": [0]}))


def test_the_head_atlas_draws_the_labels(recorded):
    _, _, run = recorded
    table = pattern_table(run)
    colors = {**plot.LABEL_COLORS, "same_row": EXTRA_LABEL_COLORS[0]}  # a label beyond the mass-based ones

    def cells(fig):
        (im,) = [im for ax in fig.axes for im in ax.images if im.get_gid() == "attention"]
        return im.to_rgba(im.get_array())

    fig = plot.head_atlas(table)  # the last step, the conditional item
    rgba = cells(fig)
    rows = table[(table.step == STEPS - 1) & (table["item"] == 1)]
    for row in rows.itertuples(index=False):
        assert tuple(rgba[row.layer, row.head]) == to_rgba(colors[row.label])
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == sorted(rows["label"].unique())
    # over every step the table's own rule labels the mean errors
    rgba = cells(plot.head_atlas(table, steps="mean"))
    for (layer, head), group in table[table["item"] == 1].groupby(["layer", "head"]):
        mean = [group[f"error_{name}"].mean() for name in NAMES]
        assert tuple(rgba[layer, head]) == to_rgba(colors[NAMES[mean.index(min(mean))]])
    bar = plot.head_atlas(table, color="error_temporal").axes[-1]
    assert "output error of pattern 'temporal'" in bar.get_ylabel()
