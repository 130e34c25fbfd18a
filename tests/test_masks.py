"""Block masks and their recall: the helpers equal brute-force token-level definitions, and recall and
the oracle curve equal the mass of P kept under the mask expanded to tokens (float64, naive)."""

import itertools

import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn import NotRecordedError
from cogattn.analysis.masks import (
    BlockGrid,
    mask_recall,
    oracle_curve,
    same_frame_mask,
    spatial_window_mask,
    temporal_window_mask,
)
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline

LAYOUT = TokenLayout(text_len=5, frames=3, height=3, width=5)  # S = 50: blocks of 8 leave a last block of 2
BLOCK = 8
HISTORY = TokenLayout(text_len=4, frames=3, height=2, width=3, history_len=5)  # video tokens off the grid first
HEAD_IDS = (2, 0, 1)


@pytest.fixture(autouse=True)
def known_kinds(monkeypatch):
    """Until the core registers kind ``block``, analysis.choose must accept it for the fake source."""
    if "block" not in REDUCERS:
        monkeypatch.setitem(REDUCERS, "block", object)


class FakeSource:
    """The MapSource members mask recall uses, over ``block`` records given as a dict."""

    def __init__(self, layout, records, block_size, head_ids=HEAD_IDS):
        self.layout, self.records, self.block_size, self.head_ids = layout, records, block_size, head_ids
        self.timesteps, self.info, self.queries, self.topk = [], {}, (), 32

    def keys(self):
        return sorted(self.records)

    def get(self, kind, step, layer):
        if (kind, step, layer) not in self.records:
            raise NotRecordedError(f"no record ({kind!r}, {step}, {layer})")
        return self.records[(kind, step, layer)].clone()


def random_probs(S, seed, B=2, H=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, S, generator=g, dtype=torch.float64) * 2).softmax(-1)


def naive_block(P, block_size):
    """(B, H, N, N): mean over the queries of block m of their mass on the keys of block n, by loops."""
    S = P.shape[-1]
    starts = list(range(0, S, block_size))
    N = len(starts)
    out = torch.zeros(*P.shape[:2], N, N, dtype=torch.float64)
    for m, n in itertools.product(range(N), range(N)):
        rows = P[..., starts[m] : starts[m] + block_size, :]
        out[..., m, n] = rows[..., starts[n] : starts[n] + block_size].sum(-1).mean(-1)
    return out


def token_mask(mask, S, block_size):
    """The block mask expanded to every (query token, key token) pair."""
    block = [i // block_size for i in range(S)]
    return torch.tensor([[bool(mask[block[i], block[j]]) for j in range(S)] for i in range(S)])


def brute_mask(layout, block_size, related, text):
    """Block (m, n) kept when some token pair of the two blocks is ``related``, or (with ``text``) either
    block holds a text token."""
    S = layout.seq_len
    N = -(-S // block_size)
    coords = [layout.coordinates(i) for i in range(S)]
    out = torch.zeros(N, N, dtype=torch.bool)
    for i, j in itertools.product(range(S), range(S)):
        ci, cj = coords[i], coords[j]
        if (text and (ci is None or cj is None)) or (ci is not None and cj is not None and related(ci, cj)):
            out[i // block_size, j // block_size] = True
    return out


@pytest.fixture(scope="module")
def probs():
    return {(s, la): random_probs(LAYOUT.seq_len, seed=7 * s + la) for s in (0, 1) for la in (0, 2)}


def source_of(probs, block_size=BLOCK, head_ids=HEAD_IDS):
    records = {("block", s, la): naive_block(P, block_size).float() for (s, la), P in probs.items()}
    return FakeSource(LAYOUT, records, block_size, head_ids)


@pytest.mark.parametrize("block_size", [1, 4, 7, 8, 16, 64])
@pytest.mark.parametrize("layout", [LAYOUT, HISTORY], ids=["text", "history"])
def test_block_grid(block_size, layout):
    grid = BlockGrid(layout, block_size)
    S, T = layout.seq_len, layout.text_len
    assert len(grid) == grid.num_blocks == -(-S // block_size)
    tokens = [i for m in range(len(grid)) for i in grid.token_range(m)]
    assert tokens == list(range(S))  # runs from token 0, in order, covering every token once
    assert grid.sizes.tolist() == [len(r) for r in grid.ranges]
    assert grid.sizes[:-1].eq(block_size).all() and 1 <= grid.sizes[-1] <= block_size
    for m, r in enumerate(grid.ranges):
        coords = [c for c in map(layout.coordinates, r) if c is not None]
        assert grid.frames(m) == sorted({c[0] for c in coords})
        assert grid.rows(m) == sorted({c[1] for c in coords})
        assert grid.cols(m) == sorted({c[2] for c in coords})
        assert list(grid.text_tokens(m)) == [i for i in r if i < T]
        assert bool(grid.has_text[m]) == any(i < T for i in r)
        assert bool(grid.off_grid[m]) == (len(coords) < len(r))  # text or history tokens
    with pytest.raises(ValueError, match="block_size"):
        BlockGrid(LAYOUT, 0)


@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
@pytest.mark.parametrize("text", [True, False])
@pytest.mark.parametrize(
    "layout",
    [LAYOUT, TokenLayout(text_len=0, frames=4, height=2, width=3), HISTORY],
    ids=["text", "no-text", "history"],
)
def test_masks_equal_token_definitions(layout, block_size, text):
    got = same_frame_mask(layout, block_size, text=text)
    assert got.dtype == torch.bool
    assert torch.equal(got, brute_mask(layout, block_size, lambda a, b: a[0] == b[0], text))
    for window in (0, 1, 2):
        ref = brute_mask(layout, block_size, lambda a, b, w=window: abs(a[0] - b[0]) <= w, text)
        assert torch.equal(temporal_window_mask(layout, block_size, window, text=text), ref), window
    for radius in (0, 1, 2):
        ref = brute_mask(
            layout, block_size, lambda a, b, r=radius: abs(a[1] - b[1]) <= r and abs(a[2] - b[2]) <= r, text
        )
        assert torch.equal(spatial_window_mask(layout, block_size, radius, text=text), ref), radius
    with pytest.raises(ValueError, match="window"):
        temporal_window_mask(layout, block_size, -1)


def test_masks_are_not_trivial():
    # the comparisons above would also pass for masks that keep everything: these do not
    m = same_frame_mask(LAYOUT, 4, text=False)
    assert 0 < m.sum() < m.numel()
    assert not torch.equal(spatial_window_mask(LAYOUT, 4, 0), spatial_window_mask(LAYOUT, 4, 1))
    both = same_frame_mask(LAYOUT, 4) & spatial_window_mask(LAYOUT, 4, 0)
    assert both.sum() < same_frame_mask(LAYOUT, 4).sum()


def kept_mass(P, mask, block_size):
    """Share of all of P's mass (S rows) inside the token-level expansion of ``mask``: (B, H)."""
    S = P.shape[-1]
    return (P * token_mask(mask, S, block_size)).sum((-1, -2)) / S


@pytest.mark.parametrize("block_size", [BLOCK, 7])
def test_recall_is_the_kept_mass(probs, block_size):
    src = source_of(probs, block_size)
    g = torch.Generator().manual_seed(3)
    N = -(-LAYOUT.seq_len // block_size)
    masks = [
        same_frame_mask(LAYOUT, block_size),
        temporal_window_mask(LAYOUT, block_size, 1, text=False) | spatial_window_mask(LAYOUT, block_size, 1),
        torch.rand(N, N, generator=g) < 0.4,
        torch.ones(N, N, dtype=torch.bool),
    ]
    for mask in masks:
        table = mask_recall(src, mask)
        assert list(table.columns) == ["step", "expert", "layer", "head", "item", "recall"]
        assert set(table["expert"]) == {"transformer"}
        assert len(table) == len(probs) * 3 * 2
        for row in table.to_dict("records"):
            P = probs[(row["step"], row["layer"])]
            ref = kept_mass(P, mask, block_size)[row["item"], HEAD_IDS.index(row["head"])]
            assert row["recall"] == pytest.approx(float(ref), abs=1e-5)
    assert mask_recall(src, masks[-1])["recall"].sub(1).abs().max() < 1e-5
    assert list(mask_recall(src, masks[0])["head"][:6]) == [2, 2, 0, 0, 1, 1]


def test_oracle_is_the_best_kept_mass(probs):
    src = source_of(probs)
    N = len(BlockGrid(LAYOUT, BLOCK))
    table = oracle_curve(src)
    assert list(table.columns) == ["step", "expert", "layer", "head", "item", "k", "recall"]
    assert len(table) == len(probs) * 3 * 2 * N
    starts = list(range(0, LAYOUT.seq_len, BLOCK))
    for (step, layer), P in probs.items():
        for b, h in itertools.product(range(2), range(3)):
            # mass of every (query block, key block) pair summed over tokens; each row keeps its k largest
            mass = [
                sorted((float(P[b, h, s : s + BLOCK, t : t + BLOCK].sum()) for t in starts), reverse=True)
                for s in starts
            ]
            rows = table[
                (table["step"] == step)
                & (table["layer"] == layer)
                & (table["head"] == HEAD_IDS[h])
                & (table["item"] == b)
            ]
            assert list(rows["k"]) == list(range(1, N + 1))
            for k, got in zip(rows["k"], rows["recall"]):
                assert got == pytest.approx(sum(sum(r[:k]) for r in mass) / LAYOUT.seq_len, abs=1e-5)
    # no mask with k key blocks per query block keeps more than the oracle
    g = torch.Generator().manual_seed(0)
    for k in (1, 3):
        mask = torch.zeros(N, N, dtype=torch.bool)
        for m in range(N):
            mask[m, torch.randperm(N, generator=g)[:k]] = True
        recall = mask_recall(src, mask)["recall"].to_numpy()
        best = oracle_curve(src, ks=[k])["recall"].to_numpy()
        assert (recall <= best + 1e-6).all() and (recall < best - 1e-3).any()
    picked = oracle_curve(src, steps=1, layers=[2], ks=[3, 1])
    assert list(picked["k"][:4]) == [3, 1, 3, 1] and set(picked.step) == {1}
    with pytest.raises(ValueError, match="ks="):
        oracle_curve(src, ks=[0])
    with pytest.raises(ValueError, match="ks="):
        oracle_curve(src, ks=[N + 1])


def test_heads_mean(probs):
    records = {("block", s, la): naive_block(P, BLOCK).mean(1, keepdim=True).float() for (s, la), P in probs.items()}
    src = FakeSource(LAYOUT, records, BLOCK, head_ids=None)
    mask = same_frame_mask(LAYOUT, BLOCK)
    table = mask_recall(src, mask, steps=0, layers=2)
    assert list(table["head"]) == ["mean", "mean"] and list(table["item"]) == [0, 1]
    ref = kept_mass(probs[(0, 2)], mask, BLOCK).mean(1)
    assert table["recall"].tolist() == pytest.approx(ref.tolist(), abs=1e-5)


def test_bad_masks_and_sources_are_refused(probs):
    src = source_of(probs)
    N = len(BlockGrid(LAYOUT, BLOCK))
    with pytest.raises(TypeError, match=r"bool torch tensor.*float32"):
        mask_recall(src, torch.ones(N, N))
    with pytest.raises(TypeError, match="ndarray"):
        mask_recall(src, torch.ones(N, N, dtype=torch.bool).numpy())
    with pytest.raises(ValueError, match=rf"\({N}, {N}\).*got shape \({N + 1}, {N + 1}\)"):
        mask_recall(src, torch.ones(N + 1, N + 1, dtype=torch.bool))
    wrong = source_of(probs)
    wrong.block_size = 16  # records made with 8
    with pytest.raises(ValueError, match="block_size does not match"):
        mask_recall(wrong, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(NotRecordedError, match="recorded steps are"):
        mask_recall(src, torch.ones(N, N, dtype=torch.bool), steps=4)
    apart = source_of({(0, 0): probs[(0, 0)], (1, 2): probs[(1, 2)]})
    with pytest.raises(NotRecordedError, match="recorded together"):
        oracle_curve(apart, steps=0, layers=2)
    with pytest.raises(NotRecordedError, match="'block' was not recorded"):
        oracle_curve(FakeSource(LAYOUT, {("frame", 0, 0): torch.zeros(1, 1, 4, 4)}, BLOCK))


@pytest.mark.skipif("block" not in cogattn.KINDS, reason="kind block not in this core yet")
def test_tiny_recording_against_its_full_map():
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds=("block", "full"), heads="all", batch="cond", block_size=6) as rec:
        generate(pipe, steps=2, output_type="latent")
    lay, S = rec.layout, rec.layout.seq_len
    assert rec.block_size == 6 and S % 6 and lay.text_len % 6  # a short last block, a block of text and video
    mask = temporal_window_mask(lay, 6, 1, text=False) | spatial_window_mask(lay, 6, 0)
    recall, oracle = mask_recall(rec, mask), oracle_curve(rec, ks=[2])
    for table in (recall, oracle):
        assert len(table) == len({(s, la) for _, s, la in rec.keys()}) * len(rec.head_ids)
    for row, best in zip(recall.to_dict("records"), oracle["recall"]):
        P = rec.get("full", row["step"], row["layer"]).double()[row["item"], rec.head_ids.index(row["head"])]
        assert row["recall"] == pytest.approx(float(kept_mass(P, mask, 6)), abs=1e-5)
        blocks = naive_block(P[None, None], 6)[0, 0] * BlockGrid(lay, 6).sizes[:, None]
        assert best == pytest.approx(float(blocks.topk(2, -1).values.sum() / S), abs=1e-5)


def test_recall_weighs_the_query_rows_a_model_forms_alone(tmp_path):
    """Mochi forms no query row of an item's padded text: its block maps average over the formed rows, and recall
    weighs those alone (a keep-all mask keeps all of an item's mass; same-frame recall is the naive mass of its
    formed rows), in memory and read back from run.json's ``query_lengths``."""
    from cogattn.models.mochi import tiny_call
    from cogattn.models.mochi import tiny_pipeline as mochi

    pipe = mochi()
    call = tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    kw = dict(kinds=("block", "full"), batch="all", heads="all", block_size=4, steps=[0], layers=[0])
    with cogattn.record(pipe, **kw, save_dir=tmp_path / "run") as rec:
        pipe(**call, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(1))
    layout, run = rec.layout, cogattn.load(tmp_path / "run")
    formed = [layout.seq_len - layout.text_len + n for n in rec.text_lengths]
    assert list(rec.query_lengths) == run.query_lengths == formed and min(formed) < layout.seq_len
    N = -(-layout.seq_len // 4)
    frame = same_frame_mask(layout, 4)
    keep = frame[torch.arange(layout.seq_len) // 4][:, torch.arange(layout.seq_len) // 4].double()
    P = rec.get("full", 0, 0).double()
    for source in (rec, run):
        every = mask_recall(source, torch.ones(N, N, dtype=torch.bool))
        assert (every["recall"] - 1).abs().max() < 1e-5
        got = mask_recall(source, frame)
        for row in got.itertuples():
            n = formed[row.item]
            assert row.recall == pytest.approx((P[row.item, row.head, :n] * keep[:n]).sum().item() / n, abs=1e-5)
        best = oracle_curve(source, ks=[N])
        assert (best["recall"] - 1).abs().max() < 1e-5
