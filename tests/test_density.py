"""Density numbers against naive computations from the full probabilities P of the same tiny generation: the
head table's keys_p* columns (keys needed for each mass p, as a share of the keys), NABLA's CDF mask on block and
tile maps (against a brute-force sort), its recall, density and the token-level density beside it, and the
density curves' line data."""

import numpy as np
import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn import NotRecordedError
from cogattn.analysis.density import top_p_density
from cogattn.analysis.head_stats import head_table, keys_column
from cogattn.analysis.masks import mask_density, mask_recall, top_p_mask
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.plot.density import DENSITY_GID, density_curves

PS = (0.5, 0.9, 0.99)
BLOCK, TILE = 6, (1, 2, 3)  # a short last block; tiles that cut the 3 × 5 patch grid unevenly
OPTIONS = dict(kinds=("full", "top_p", "block", "tile"), batch="cond", block_size=BLOCK, tile_shape=TILE, top_p=PS)


@pytest.fixture(scope="module")
def rec():
    pipe = tiny_pipeline()
    with cogattn.record(pipe, heads="all", **OPTIONS) as recording:
        generate(pipe, steps=2, output_type="latent")
    return recording


def naive_counts(P: torch.Tensor, p: float) -> torch.Tensor:
    """For each row of ``P`` (..., S), the fewest keys whose largest probabilities sum to at least p: a full
    descending sort and a float64 running sum (the rows' nonzero keys where the sum stays below p)."""
    values = P.double().sort(-1, descending=True).values
    before = values.cumsum(-1) - values
    return ((before < p) & (values > 0)).sum(-1)


def brute_mask(row: list[float], p: float) -> list[bool]:
    """One row of NABLA's selection by hand: take groups largest first until their mass reaches p."""
    keep, total = [False] * len(row), 0.0
    for j in sorted(range(len(row)), key=lambda j: -row[j]):
        if total >= p or row[j] == 0:
            break
        keep[j], total = True, total + row[j]
    return keep


def full_row(rec, row) -> torch.Tensor:
    """P of a table row's (step, layer, head, item), (S, S) float64."""
    return rec.get("full", row["step"], row["layer"]).double()[row["item"], rec.head_ids.index(row["head"])]


def test_head_table_keys_columns_are_the_full_maps_counts(rec):
    table = head_table(rec)
    lay = rec.layout
    columns = [keys_column(p) for p in PS]
    assert columns == ["keys_p0.5", "keys_p0.9", "keys_p0.99"] and table.attrs["top_p"] == list(PS)
    assert len(table) == 2 * len({layer for _, _, layer in rec.keys()}) * len(rec.head_ids)
    for row in table.to_dict("records"):
        P = full_row(rec, row)[lay.video_tokens]
        for p in PS:
            want = naive_counts(P, p).double().mean() / lay.seq_len
            assert row[keys_column(p)] == pytest.approx(float(want), abs=1e-12), (row["step"], row["layer"], p)
    shares = table[columns].to_numpy()
    assert (np.diff(shares, axis=1) > 0).all() and (shares < 1).all()  # more mass needs more keys
    assert table["keys_p0.9"].nunique() > 1  # heads and layers differ


def test_head_mean_columns_are_the_mean_of_the_heads(rec):
    pipe = tiny_pipeline()
    with cogattn.record(pipe, heads="mean", **{**OPTIONS, "kinds": ("top_p",)}) as mean_rec:
        generate(pipe, steps=2, output_type="latent")
    columns = [keys_column(p) for p in PS]
    mean = head_table(mean_rec)
    assert set(mean["head"]) == {"mean"} and {"text_mass", "entropy_mean"} <= set(mean.columns)
    assert mean["text_mass"].isna().all()  # only top_p recorded: the other columns are NaN
    want = head_table(rec).groupby(["step", "layer", "item"])[columns].mean()
    got = mean.set_index(["step", "layer", "item"])[columns]
    np.testing.assert_allclose(got.to_numpy(), want.loc[got.index].to_numpy(), rtol=0, atol=1e-7)


class FakeSource:
    """A source with top_p counts and a key mask that keeps item 0 fewer text keys (HunyuanVideo's layout)."""

    def __init__(self, layout, counts, text_lengths):
        self.layout, self.records, self.text_lengths = layout, {("top_p", 0, 0): counts}, text_lengths
        self.head_ids, self.timesteps, self.top_p = (0, 1), [], (0.5, 0.9)

    def keys(self):
        return sorted(self.records)

    def get(self, kind, step, layer):
        return self.records[(kind, step, layer)].clone()


def test_keys_columns_divide_by_the_items_kept_keys():
    layout = TokenLayout(text_len=6, frames=2, height=2, width=3, text_position="end")  # S = 18, text last
    counts = torch.randint(1, 12, (2, 2, layout.seq_len, 2)).float()
    table = head_table(FakeSource(layout, counts, text_lengths=[2, 6]))
    video = counts[:, :, layout.video_tokens].double().mean(2)  # (B, H, P)
    for row in table.to_dict("records"):
        kept = 12 + [2, 6][row["item"]]
        want = video[row["item"], row["head"]] / kept
        assert [row["keys_p0.5"], row["keys_p0.9"]] == pytest.approx(want.tolist(), abs=1e-12)


def test_top_p_mask_is_a_brute_force_sort():
    g = torch.Generator().manual_seed(0)
    pooled = torch.rand(2, 3, 7, 7, generator=g) ** 4
    pooled[..., 3] = 0  # a key group without mass
    pooled = pooled / pooled.sum(-1, keepdim=True)
    pooled[0, 0, 2] = 0  # a query group whose rows the model never forms
    for p in (0.2, 0.5, 0.9, 0.99, 1.0):
        mask = top_p_mask(pooled, p)
        assert mask.dtype == torch.bool and mask.shape == pooled.shape
        want = [brute_mask(r, p) for r in pooled.reshape(-1, 7).tolist()]
        assert mask.reshape(-1, 7).tolist() == want, p
        assert torch.equal(top_p_mask(pooled[1, 2], p), mask[1, 2])  # one (N, N) map alike
    assert not top_p_mask(pooled, 1.0)[..., 3].any() and not top_p_mask(pooled, 1.0)[0, 0, 2].any()
    assert 0 < top_p_mask(pooled, 0.5).double().mean() < top_p_mask(pooled, 0.9).double().mean() < 1
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="use a mass in"):
            top_p_mask(pooled, bad)
    with pytest.raises(ValueError, match=r"pass a block or tile map \(\.\.\., N, N\)"):
        top_p_mask(pooled[..., :5], 0.9)


@pytest.mark.parametrize("kind", ["block", "tile"])
def test_top_p_density_is_the_full_maps_kept_mass_and_count(rec, kind):
    lay, S = rec.layout, rec.layout.seq_len
    group = torch.arange(S) // BLOCK if kind == "block" else lay.tile_of_token(TILE)  # each token's group
    table = top_p_density(rec, 0.9, kind=kind)
    assert list(table.columns) == [
        "step", "expert", "layer", "head", "item", "p", "recall", "density", "token_density"
    ]  # fmt: skip
    assert len(table) == len({(s, la) for _, s, la in rec.keys()}) * len(rec.head_ids)
    for row in table.to_dict("records"):
        P = full_row(rec, row)
        pooled = rec.get(kind, row["step"], row["layer"])[row["item"], rec.head_ids.index(row["head"])]
        tokens = top_p_mask(pooled, 0.9)[group][:, group].double()  # the group mask as (S, S) token pairs
        assert row["recall"] == pytest.approx(float((P * tokens).sum() / S), abs=1e-5)
        assert row["density"] == pytest.approx(float(tokens.mean()), abs=1e-12)
        assert row["token_density"] == pytest.approx(float(naive_counts(P, 0.9).double().mean() / S), abs=1e-12)
        assert row["recall"] >= 0.9 - 1e-5  # each query group keeps at least p of its mean mass
    assert (table["density"] < 1).all() and (table["token_density"] < table["density"]).any()
    one = top_p_density(rec, 0.5, kind=kind, steps=1, layers=0, heads=rec.head_ids[1])
    assert len(one) == 1 and one["head"].item() == rec.head_ids[1] and one["p"].item() == 0.5
    turned = top_p_density(rec, 0.9, kind=kind, steps=1, layers=0, heads=rec.head_ids[::-1])  # in the order asked
    assert turned["head"].tolist() == list(rec.head_ids[::-1])
    mean = top_p_density(rec, 0.9, kind=kind, heads="mean")  # one row per (step, layer, item): its heads' mean
    assert len(mean) == len(table) // len(rec.head_ids) and set(mean["head"]) == {"mean"}
    assert list(mean.columns) == list(table.columns)
    for row in mean.to_dict("records"):
        heads = table[
            (table["step"] == row["step"]) & (table["layer"] == row["layer"]) & (table["item"] == row["item"])
        ]
        for column in ("recall", "density", "token_density"):
            assert row[column] == pytest.approx(sum(heads[column]) / len(rec.head_ids), abs=1e-12)


def test_density_and_recall_of_batched_masks(rec):
    blk = rec.get("block", 0, 0)
    mask = top_p_mask(blk, 0.9)
    batched = mask_recall(rec, mask, steps=0, layers=0)["recall"].tolist()
    each = [mask_recall(rec, mask[0, h], steps=0, layers=0)["recall"][h] for h in range(blk.shape[1])]
    assert batched == pytest.approx(each, abs=1e-12)
    assert mask_density(rec, torch.ones(blk.shape[-2:], dtype=torch.bool)).item() == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="one per batch item and head"):
        mask_recall(rec, mask[:, :1].expand(1, 3, -1, -1), steps=0, layers=0)


def test_bad_density_requests_are_refused(rec):
    with pytest.raises(ValueError, match=r"top_p records hold p in \[0.5, 0.9, 0.99\]"):
        top_p_density(rec, 0.8)
    with pytest.raises(ValueError, match="'block' or a 'tile' map"):
        top_p_density(rec, 0.9, kind="frame")
    with pytest.raises(ValueError, match="use a mass in"):
        top_p_density(rec, 0)
    with pytest.raises(NotRecordedError):
        top_p_density(rec, 0.9, heads=7)
    with pytest.raises(ValueError, match="record kind 'top_p'"):
        density_curves(head_table(rec).drop(columns=[keys_column(p) for p in PS]))


@pytest.mark.parametrize("by", ["head", "layer"])
def test_density_curves_draw_the_head_table_columns(rec, by):
    table = head_table(rec)
    columns = [keys_column(p) for p in PS]
    want = table.groupby(by, sort=True)[columns].mean()
    for fig in (density_curves(rec, by=by), density_curves(table, by=by)):
        lines = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == DENSITY_GID]
        assert [line.get_label() for line in lines] == [f"{by} {key}" for key in want.index]
        for line, values in zip(lines, want.to_numpy()):
            np.testing.assert_allclose(line.get_xdata(), PS)
            np.testing.assert_allclose(line.get_ydata(), values, rtol=0, atol=1e-12)
        title = fig.get_suptitle()
        assert f"one curve per {by}" in title and "steps 0–1" in title, title
        assert "batch item 1, conditional" in title, title  # slot 0 holds the transformer batch's item 1
    assert cogattn.plot.density_curves is density_curves
