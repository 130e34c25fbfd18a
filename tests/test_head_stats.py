"""The head table's numbers equal naive computations from the full probabilities P (float64, token by
token): text mass, mass by latent-frame distance, entropy statistics, sinks; labels follow the rule."""

import math

import numpy as np
import pytest
import torch
from tiny_calls import generate

import cogattn
from cogattn import NotRecordedError
from cogattn.analysis.head_stats import LabelRule, head_table, temporal_decay
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import tiny_pipeline
from cogattn.reference import naive_kind

NEW_KINDS = ("entropy", "received", "query_frame", "block", "topk")
LAYOUT = TokenLayout(text_len=5, frames=3, height=3, width=5)  # S = 50, an odd grid
HEAD_IDS = (3, 0, 5, 1)  # model heads of the 4 slots, not in order
KEYS = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (step, layer)


@pytest.fixture(autouse=True)
def known_kinds(monkeypatch):
    """Until the core registers the new kinds, analysis.choose must accept them for the fake sources."""
    for kind in NEW_KINDS:
        if kind not in REDUCERS:
            monkeypatch.setitem(REDUCERS, kind, object)


class FakeSource:
    """The MapSource members the head table uses, over records given as a dict."""

    def __init__(self, layout, records, head_ids=HEAD_IDS, timesteps=(), block_size=8):
        self.layout, self.records, self.head_ids = layout, records, head_ids
        self.timesteps, self.block_size, self.topk = list(timesteps), block_size, 32
        self.info, self.queries = {}, ()

    def keys(self):
        return sorted(self.records)

    def get(self, kind, step, layer):
        if (kind, step, layer) not in self.records:
            raise NotRecordedError(f"no record ({kind!r}, {step}, {layer})")
        return self.records[(kind, step, layer)].clone()


def token_frames(layout):
    """Latent frame of every token (None for text), from TokenLayout.coordinates one token at a time."""
    return [None if (c := layout.coordinates(i)) is None else c[0] for i in range(layout.seq_len)]


def designed_probs(layout, seed, B=2):
    """(B, 4, S, S) float64: head slot 0 leans to the text, 1 to the query's own frame, 2 to adjacent
    frames, 3 is plain noise (no lean)."""
    g = torch.Generator().manual_seed(seed)
    S, T = layout.seq_len, layout.text_len
    frames = token_frames(layout)
    scores = torch.randn(B, 4, S, S, generator=g, dtype=torch.float64)
    for i in range(T, S):
        for j in range(S):
            if j < T:
                scores[:, 0, i, j] += 5
            elif frames[j] == frames[i]:
                scores[:, 1, i, j] += 4
            elif abs(frames[j] - frames[i]) == 1:
                scores[:, 2, i, j] += 4
    return scores.softmax(-1)


def records_of(P, layout, mean=False):
    """Every kind's record (float32) from P, by its definition in docs/design.md."""
    T, S, G = layout.text_len, layout.seq_len, layout.num_groups
    bounds = [0, T] + [T + (f + 1) * layout.frame_tokens for f in range(layout.frames)]
    query_frame = torch.stack([P[..., bounds[g] : bounds[g + 1]].sum(-1) for g in range(G)], -1)
    out = {
        "frame": naive_kind(P, "frame", T, layout.grid),
        "query_frame": query_frame,
        "entropy": -(P * P.log()).sum(-1),
        "received": P.sum(-2),
    }
    assert out["received"].sum(-1).sub(S).abs().max() < 1e-9
    return {k: (v.mean(1, keepdim=True) if mean else v).float() for k, v in out.items()}


def naive_numbers(p, layout, sink_k=1):
    """One head's numbers from its (S, S) float64 probabilities, query token by query token."""
    T, S, F = layout.text_len, layout.seq_len, layout.frames
    frames = token_frames(layout)
    video = [i for i in range(S) if frames[i] is not None]
    text = sum(float(p[i, :T].sum()) for i in video) / len(video)
    dt = [0.0] * F
    for i in video:
        for j in video:
            dt[abs(frames[i] - frames[j])] += float(p[i, j]) / len(video)
    ent = [-sum(x * math.log(x) for x in p[i].tolist() if x > 0) for i in video]
    mean = sum(ent) / len(ent)
    std = math.sqrt(sum((e - mean) ** 2 for e in ent) / len(ent))
    received = [float(p[:, j].sum()) for j in range(S)]
    top = sorted(range(S), key=lambda j: -received[j])[:sink_k]
    out = {"text_mass": text, "same_frame_mass": dt[0], "entropy_mean": mean, "entropy_std": std}
    out.update({f"dt_{d}": v for d, v in enumerate(dt)})
    out["sink_share"] = sum(received[j] for j in top) / S
    out["sink_tokens"] = " ".join(map(str, top))
    return out


@pytest.fixture(scope="module")
def probs():
    return {key: designed_probs(LAYOUT, seed=10 * key[0] + key[1]) for key in KEYS}


def source_of(probs, kinds=("frame", "entropy", "received"), keys=KEYS, mean=False, timesteps=(999.0, 500.0)):
    records = {}
    for step, layer in keys:
        recs = records_of(probs[(step, layer)], LAYOUT, mean)
        records.update({(k, step, layer): recs[k] for k in kinds})
    return FakeSource(LAYOUT, records, head_ids=None if mean else HEAD_IDS, timesteps=timesteps)


NUMBERS = ["text_mass", "same_frame_mass", "dt_0", "dt_1", "dt_2", "entropy_mean", "entropy_std", "sink_share"]


def test_columns_equal_naive_numbers(probs):
    table = head_table(source_of(probs))
    assert list(table.columns) == [
        "step", "timestep", "expert", "layer", "head", "item", "text_mass", "same_frame_mass",
        "dt_0", "dt_1", "dt_2", "entropy_mean", "entropy_std", "sink_share", "sink_tokens", "label",
    ]  # fmt: skip
    assert len(table) == len(KEYS) * 4 * 2
    for row in table.to_dict("records"):
        slot = HEAD_IDS.index(row["head"])
        ref = naive_numbers(probs[(row["step"], row["layer"])][row["item"], slot], LAYOUT)
        for name in NUMBERS:
            assert row[name] == pytest.approx(ref[name], abs=2e-5), (name, row["step"], row["layer"], slot)
        assert row["sink_tokens"] == ref["sink_tokens"]
        assert row["timestep"] == (999.0, 500.0)[row["step"]]
    # rows in step, layer, head slot, item order
    assert list(table["head"][:8]) == [3, 3, 0, 0, 5, 5, 1, 1]
    assert list(table["item"][:4]) == [0, 1, 0, 1]


def test_frame_mass_adds_up(probs):
    table = head_table(source_of(probs))
    dt = table[[f"dt_{d}" for d in range(LAYOUT.frames)]].sum(axis=1)
    assert ((table["text_mass"] + dt - 1).abs() < 1e-5).all()
    assert (table["same_frame_mass"] == table["dt_0"]).all()


def test_query_frame_gives_the_frame_numbers(probs):
    by_frame = head_table(source_of(probs, kinds=("frame",)))
    by_query = head_table(source_of(probs, kinds=("query_frame",)))
    cols = ["text_mass", "dt_0", "dt_1", "dt_2"]
    assert (by_frame[cols] - by_query[cols]).abs().max().max() < 1e-6
    row = by_query.iloc[5]
    ref = naive_numbers(probs[(0, 0)][1, 2], LAYOUT)
    assert (row["head"], row["item"]) == (5, 1)
    assert row["dt_1"] == pytest.approx(ref["dt_1"], abs=2e-5)


def test_entropy_is_over_the_grid_s_queries_where_history_tokens_precede_it():
    """FramePack's history latents are video tokens off the grid: the entropy columns are the grid queries' alone,
    as the naive numbers take them (a query with coordinates)."""
    layout = TokenLayout(text_len=3, frames=2, height=2, width=3, history_len=5)
    g = torch.Generator().manual_seed(3)
    P = torch.randn(2, 4, layout.seq_len, layout.seq_len, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    P[:, :, layout.video_start : layout.grid_tokens.start] = torch.eye(layout.seq_len, dtype=torch.float64)[
        layout.video_start : layout.grid_tokens.start
    ]  # history queries of entropy 0: counted, they would lower the mean
    entropy = -(P * P.clamp(min=1e-300).log()).sum(-1)
    table = head_table(FakeSource(layout, {("entropy", 0, 0): entropy.float()}))
    for row in table.itertuples():
        slot = HEAD_IDS.index(row.head)
        want = naive_numbers(P[row.item, slot], layout)
        assert row.entropy_mean == pytest.approx(want["entropy_mean"], abs=1e-5)
        assert row.entropy_std == pytest.approx(want["entropy_std"], abs=1e-5)


def test_missing_kinds_are_nan(probs):
    table = head_table(source_of(probs, kinds=("entropy",)))
    assert table[["text_mass", "dt_0", "sink_share"]].isna().all().all()
    assert (table["sink_tokens"] == "").all() and (table["label"] == "unknown").all()
    ref = naive_numbers(probs[(0, 0)][0, 0], LAYOUT)
    assert table["entropy_mean"][0] == pytest.approx(ref["entropy_mean"], abs=2e-5)
    # entropy recorded at step 0 only: step 1's entropy columns are NaN, its frame numbers are not
    src = source_of(probs, kinds=("frame", "received"))
    src.records.update(source_of(probs, kinds=("entropy",), keys=[(0, 0), (0, 1)]).records)
    table = head_table(src)
    assert table.loc[table.step == 1, "entropy_mean"].isna().all()
    assert table.loc[table.step == 0, "entropy_mean"].notna().all()
    assert table["text_mass"].notna().all()


def test_nothing_to_tabulate_says_what_to_record(probs):
    src = FakeSource(LAYOUT, {("block", 0, 0): torch.zeros(1, 1, 7, 7)})
    with pytest.raises(NotRecordedError, match="entropy"):
        head_table(src)


def test_heads_mean(probs):
    table = head_table(source_of(probs, mean=True))
    assert len(table) == len(KEYS) * 2 and (table["head"] == "mean").all()
    row = table.iloc[3]  # step 0, layer 1, item 1
    per_head = [naive_numbers(probs[(0, 1)][1, h], LAYOUT) for h in range(4)]
    for name in ("text_mass", "dt_1", "entropy_mean"):
        assert row[name] == pytest.approx(sum(r[name] for r in per_head) / 4, abs=2e-5)


def test_selections_and_timesteps(probs):
    src = source_of(probs, timesteps=(999.0, None))
    table = head_table(src, steps=1, layers=[1])
    assert set(zip(table.step, table.layer)) == {(1, 1)} and table["timestep"].isna().all()
    assert set(head_table(src, layers=0).layer) == {0}
    with pytest.raises(NotRecordedError, match="recorded steps are"):
        head_table(src, steps=[0, 5])
    with pytest.raises(ValueError, match="use 'all'"):
        head_table(src, steps="first")
    assert head_table(source_of(probs, timesteps=()))["timestep"].isna().all()
    apart = source_of(probs, keys=[(0, 0), (1, 1)])
    with pytest.raises(NotRecordedError, match="recorded together"):
        head_table(apart, steps=0, layers=1)


def test_sinks(probs):
    table = head_table(source_of(probs, kinds=("received",)), sink_fraction=0.1)  # the top 5 of 50 keys
    for row in table.to_dict("records"):
        ref = naive_numbers(probs[(row["step"], row["layer"])][row["item"], HEAD_IDS.index(row["head"])], LAYOUT, 5)
        assert row["sink_share"] == pytest.approx(ref["sink_share"], abs=2e-5)
        assert row["sink_tokens"] == ref["sink_tokens"]
        assert len(row["sink_tokens"].split()) == 5
    with pytest.raises(ValueError, match="sink_fraction"):
        head_table(source_of(probs), sink_fraction=0)


def test_a_damaged_received_record_names_no_sink(probs):
    """An inf in one head's received mass: its sink share is not finite and its sink tokens are empty (they named
    the damaged token); the other heads are as before."""
    source = source_of(probs, kinds=("received",))
    clean = head_table(source, sink_fraction=0.1)
    source.records[("received", 0, 0)][0, 1, 5] = math.inf
    table = head_table(source, sink_fraction=0.1)
    damaged = (table.step == 0) & (table.layer == 0) & (table["item"] == 0) & (table["head"] == HEAD_IDS[1])
    assert damaged.sum() == 1 and not np.isfinite(table[damaged].sink_share).any()
    assert table[damaged].sink_tokens.tolist() == [""]
    assert table[~damaged].sink_tokens.tolist() == clean[~damaged].sink_tokens.tolist()


def test_sink_tokens_are_read_from_one_list_not_element_by_element(probs, monkeypatch):
    """int() on each index tensor took 49 s of a 120 s head table at CogVideoX-5b's size; the text is unchanged."""
    source = source_of(probs, kinds=("received",))
    calls = []
    to_int = torch.Tensor.__int__

    def counted(self):
        calls.append(1)
        return to_int(self)

    monkeypatch.setattr(torch.Tensor, "__int__", counted)
    table = head_table(source, sink_fraction=0.1)
    monkeypatch.undo()
    assert not calls
    for row in table.to_dict("records"):  # the text as the element-by-element join made it
        received = source.get("received", row["step"], row["layer"]).double()
        top = received.topk(5, dim=-1).indices[row["item"], HEAD_IDS.index(row["head"])]
        assert row["sink_tokens"] == " ".join(str(int(i)) for i in top)


def test_labels_follow_the_rule(probs):
    table = head_table(source_of(probs))
    for row in table.to_dict("records"):  # each designed head gets its label (and the numbers say why)
        expected = {3: "text", 0: "spatial", 5: "temporal", 1: "global"}[row["head"]]
        assert row["label"] == expected, row
    assert head_table(source_of(probs), rule=LabelRule(text_min=0.0))["label"].eq("text").all()

    class Always:
        def label(self, row):
            return f"layer{row['layer']}"

    assert set(head_table(source_of(probs), rule=Always())["label"]) == {"layer0", "layer1"}


def test_label_rule_thresholds():
    rule = LabelRule(text_min=0.4, spatial_min=0.3, temporal_min=0.5, near_frames=2)
    row = {"text_mass": 0.1, "same_frame_mass": 0.2, "dt_0": 0.2, "dt_1": 0.3, "dt_2": 0.25, "dt_3": 0.15}
    assert rule.label(row) == "temporal"  # dt_1 + dt_2 = 0.55
    assert LabelRule().label(row) == "global"  # dt_1 = 0.3 < 0.5
    assert rule.label({**row, "text_mass": 0.4}) == "text"
    assert rule.label({**row, "same_frame_mass": 0.3}) == "spatial"
    assert rule.label({**row, "text_mass": math.nan}) == "unknown"
    assert rule.label({"text_mass": 0.1, "same_frame_mass": 0.2, "dt_0": 0.2, "dt_1": 0.7}) == "temporal"
    with pytest.raises(ValueError, match="near_frames"):
        LabelRule(near_frames=0)


def test_temporal_decay(probs):
    table = head_table(source_of(probs))
    by_layer = temporal_decay(table, by="layer")
    assert list(by_layer.columns) == ["dt_0", "dt_1", "dt_2"] and list(by_layer.index) == [0, 1]
    for layer in (0, 1):
        refs = [naive_numbers(probs[(s, layer)][b, h], LAYOUT) for s in (0, 1) for b in (0, 1) for h in range(4)]
        for d in range(3):
            assert by_layer.loc[layer, f"dt_{d}"] == pytest.approx(sum(r[f"dt_{d}"] for r in refs) / 16, abs=2e-5)
    by_head = temporal_decay(table)
    assert sorted(by_head.index) == [0, 1, 3, 5]
    assert by_head.loc[0, "dt_0"] > 0.5 > by_head.loc[5, "dt_0"]  # slot 1 leans to its own frame
    with pytest.raises(ValueError, match="by="):
        temporal_decay(table, by="item")


@pytest.mark.skipif("entropy" not in cogattn.KINDS, reason="kinds entropy/received not in this core yet")
def test_tiny_recording_against_its_full_map(tmp_path):
    pipe = tiny_pipeline()
    kinds = ("frame", "entropy", "received", "full")
    with cogattn.record(pipe, kinds=kinds, heads="all", batch="cond", save_dir=tmp_path / "run") as rec:
        generate(pipe, steps=2, output_type="latent")
    on_disk = head_table(cogattn.load(tmp_path / "run"))
    with cogattn.record(pipe, kinds=kinds, heads="all", batch="cond") as rec:
        generate(pipe, steps=2, output_type="latent")
    assert on_disk.equals(head_table(rec))  # a run on disk gives the same table as the recording in memory
    lay = rec.layout
    table = head_table(rec, rule=LabelRule())
    assert len(table) == len({(s, la) for _, s, la in rec.keys()}) * len(rec.head_ids)
    for row in table.to_dict("records"):
        P = rec.get("full", row["step"], row["layer"]).double()[row["item"], rec.head_ids.index(row["head"])]
        ref = naive_numbers(P, lay)
        for name in NUMBERS:
            assert row[name] == pytest.approx(ref[name], abs=1e-4), name
        assert row["timestep"] == rec.timesteps[row["step"]]


def test_selectors_take_numpy_integers_and_refuse_booleans(probs):
    """A step, layer or head read from a table is a NumPy integer (it raised "'numpy.int64' object is not iterable");
    a bool is no index (heads=True read head 1)."""
    from cogattn.analysis import aggregate

    source = source_of(probs, kinds=("frame",))
    want = aggregate(source, "frame", steps=1, layers=0, heads=HEAD_IDS[1])
    got = aggregate(source, "frame", steps=np.int64(1), layers=[np.int32(0)], heads=np.int64(HEAD_IDS[1]))
    assert got.shape == want.shape and torch.equal(got, want)
    pair = aggregate(source, "frame", steps=[0, 1], layers=0)  # an array or tensor of several is a list, as before
    assert torch.equal(aggregate(source, "frame", steps=np.arange(2), layers=0), pair)
    assert torch.equal(aggregate(source, "frame", steps=torch.tensor([0, 1]), layers=0), pair)
    table = head_table(source, steps=np.int64(1))
    assert set(table.step) == {1}
    for bad in (dict(heads=True), dict(steps=True), dict(layers=[0, False])):
        with pytest.raises(TypeError, match="is a bool, not an index"):
            aggregate(source, "frame", **bad)
    with pytest.raises(ValueError, match="steps=2.0; use 'all', an index, or a list of indices"):
        aggregate(source, "frame", steps=2.0)
