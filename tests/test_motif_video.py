"""Motif-Video's own rules (tests/test_families.py holds every kind of its tiny text-to-video pipeline to the
reference): the decoder blocks are layers of their own layout (the grid twice, no text), the
text cross-attention is its layer's ``video_to_text`` over the prompt's tokens alone while image-to-video's image
tokens lead the joint attention's text, a bare transformer records as the pipeline does, a transformer without the
cross-attention has no ``video_to_text``, and the released shapes' plan."""

import json

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.analysis import aggregate
from cogattn.analysis.density import kept_keys
from cogattn.analysis.head_stats import head_table
from cogattn.analysis.layouts import layers_view
from cogattn.plot import frame_heatmap, layer_step_grid
from cogattn.reference import naive_context, naive_kind
from cogattn.view import RunView

motif = pytest.importorskip("cogattn.models.motif_video", reason="this diffusers lacks Motif-Video (0.42 has it)")

pytestmark = pytest.mark.usefixtures("one_thread")
DECODER = "single_transformer_blocks.1.attn"  # the tiny transformer's decoder block (after 1 encoder block)


@pytest.fixture(scope="module")
def i2v():
    return motif.tiny_pipeline("image-to-video", num_heads=3)


def spied(pipe, monkeypatch, run):
    """The stock output and the spy's calls (``calls[n][(layer, role)]``: ``(q, k, v, mask, out)``), each call's
    naive float64 probabilities proved against its output: the reference is the model's own attention."""
    spy = AttentionSpy(pipe, motif.SPEC, monkeypatch)
    try:
        out = run()
    finally:
        spy.remove()
        monkeypatch.undo()
    for seen in spy.calls:
        for ((q, k, v, mask, out_),) in seen.values():
            assert (spy_probs(q, k, mask) @ v.double() - out_.double()).abs().max() < 1e-5
    return out, spy.calls


def test_the_decoder_blocks_are_layers_of_their_own_layout(i2v, monkeypatch, tmp_path):
    """The decoder block attends over [decoder video | encoder video]: its layer's layout is the grid with 2F frames
    and no text, every grid kind of it the naive softmax of the module's own q and k (its P·V proved against the
    module's output), no text kind recorded there, and a run folder reads every record back with that layout."""
    transformer = i2v.transformer
    names = ("transformer_blocks.0.attn", "single_transformer_blocks.0.attn", DECODER)
    assert motif.SPEC.layer_names(transformer) == names

    def run():
        call = motif.tiny_call(i2v, "image-to-video", torch.Generator().manual_seed(0), True)
        return i2v(**call, num_inference_steps=1, output_type="pt", generator=torch.Generator().manual_seed(1)).frames

    video, calls = spied(i2v, monkeypatch, run)
    kinds = ("frame", "entropy", "offset", "query", "text_to_video", "video_to_text")
    options = dict(batch="all", heads="all", queries=[(1, 0, 2), 3], save_dir=tmp_path / "run")
    with cogattn.record(i2v, kinds=kinds, layers=[1, DECODER], **options) as rec:
        assert type(transformer.single_transformer_blocks[1].attn.processor) is motif.MotifVideoAttnMapProcessor
        got = run()
    assert torch.equal(got, video)
    lay, own = rec.layout, rec.layout_of(2)
    assert own == motif.decoder_layout(lay) and rec.layout_of(1) == lay
    assert (own.text_len, own.grid, own.grids, own.one_grid.grid) == (0, (2 * lay.frames, *lay.grid[1:]), 2, lay.grid)
    cond, uncond = calls[0][(2, "self")][0], calls[1][(2, "self")][0]
    assert cond[0].shape[2] == own.seq_len == 2 * lay.video_len and cond[3] is None  # 2V tokens, no mask
    P = torch.cat([spy_probs(*uncond[:2], None), spy_probs(*cond[:2], None)])
    queries = [own.token_index(1, 0, 2), 3]
    for kind in ("frame", "entropy", "offset", "query"):
        want = naive_kind(P, kind, 0, own.grid, queries=queries)
        assert (rec.get(kind, 0, 2).double() - want).abs().max() < 1e-5, kind
    assert rec.get("frame", 0, 2).shape[-2:] == (2 * lay.frames, 2 * lay.frames)
    assert {k for k, _, n in rec.keys() if n == 2} == {"frame", "entropy", "offset", "query"}  # no text there
    assert {k for k, _, n in rec.keys() if n == 1} == set(kinds)
    saved = cogattn.load(tmp_path / "run")
    assert not saved.skipped_lines and saved.layout == lay and saved.layout_of(2) == own and saved.layout_of(1) == lay
    for kind, step, layer in rec.keys():
        assert torch.equal(saved.get(kind, step, layer), rec.get(kind, step, layer))
    assert own.pixel_frames(9) == lay.pixel_frames(9) * 2  # each copy of the grid covers the video's frames
    # readers: "all" is the generation's layers, a mean never mixes layouts, a figure of the decoder reads its own
    assert torch.equal(aggregate(saved, "frame"), aggregate(saved, "frame", layers=1))
    assert aggregate(saved, "frame", layers=2).shape == (2 * lay.frames, 2 * lay.frames)
    with pytest.raises(ValueError, match=r"would mix token layouts: layer 1 attends over 3 latent frames and 24 text"):
        aggregate(saved, "frame", layers=[1, 2])
    fig = frame_heatmap(saved, layers=range(2, 3))  # its own frames, labelled as such: no text group
    assert fig.axes[0].get_images()[0].get_array().shape == (2 * lay.frames, 2 * lay.frames)
    assert "text" not in {t.get_text() for t in fig.axes[0].get_xticklabels()}
    with pytest.raises(ValueError, match="would mix token layouts"):
        layer_step_grid(saved, "frame", layers=[1, 2])
    assert kept_keys(layers_view(saved, [2], "a test"), 2).tolist() == [own.seq_len] * 2  # no text to pad there
    assert set(head_table(saved)["layer"]) == {1} and set(head_table(saved, layers=[2])["layer"]) == {2}
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    for bad in ({"²": meta["layer_layouts"]["2"]}, {"2": {**meta["layer_layouts"]["2"], "grids": 4}}, []):
        (tmp_path / "run" / "run.json").write_text(json.dumps({**meta, "layer_layouts": bad}))
        with pytest.raises(cogattn.StoreError, match="layer_layouts|grids"):
            cogattn.load(tmp_path / "run")
    (tmp_path / "run" / "run.json").write_text(json.dumps(meta))
    view = RunView(tmp_path / "run")
    assert view.map("frame", 0, "mean")["shape"] == [lay.frames + 1] * 2
    assert "its own sequence (6 latent frames, 2 copies of the grid)" in view.map("frame", 0, 2)["error"]


def test_image_to_video_image_tokens_lead_the_joint_text_and_the_cross_attention_reads_the_prompt(i2v, monkeypatch):
    """Under guidance, one video: the joint attention's text is 16 SigLIP tokens then the prompt's 8 (6 kept, the
    negative's 3); the cross-attention's keys are the prompt's 8 alone under its mask, and its video_to_text has the
    layout's text axis, the image's 16 columns exactly 0. Every recorded number is the naive softmax of the module's
    own q and k."""

    def run():
        call = motif.tiny_call(i2v, "image-to-video", torch.Generator().manual_seed(0), True)
        return i2v(**call, num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(1)).frames

    video, calls = spied(i2v, monkeypatch, run)
    kinds = ("frame", "text_to_video", "video_to_text")
    with cogattn.record(i2v, kinds=kinds, batch="all", heads="all") as rec:
        got = run()
    assert torch.equal(got, video)
    lay = rec.layout
    images, T = motif.tiny.IMAGE_LEN, motif.tiny.TEXT_LEN
    assert (lay.text_len, lay.image_len, lay.context_len, lay.text_position) == (images + T, images, images + T, "end")
    assert rec.text_lengths == (images + 3, images + 6)  # [uncond, cond]: the image's tokens and the valid prompt's
    for step in range(2):
        for layer in range(2):
            cond, uncond = calls[2 * step][(layer, "self")][0], calls[2 * step + 1][(layer, "self")][0]
            P = torch.cat([spy_probs(*uncond[:2], uncond[3]), spy_probs(*cond[:2], cond[3])])
            assert P.shape[-1] == lay.seq_len and bool((P[0, :, :, lay.video_len + images + 3 :] == 0).all())
            for kind in ("frame", "text_to_video"):
                want = naive_kind(P, kind, lay.text_len, lay.grid, text_at_end=True)
                assert (rec.get(kind, step, layer).double() - want).abs().max() < 1e-5, (kind, step, layer)
            cross = [calls[2 * step + c][(layer, "context")][0] for c in (1, 0)]
            for _, k, _, mask, _ in cross:
                assert k.shape[2] == T and mask.shape[-1] == T  # the prompt's keys, not the image's
            Pc = torch.cat([spy_probs(q, k, mask) for q, k, _, mask, _ in cross])
            got = rec.get("video_to_text", step, layer).double()
            assert (got[:, :, images:] - naive_context(Pc, lay.grid)).abs().max() < 1e-5
            assert bool((got[:, :, :images] == 0).all())  # the image's columns, which the attention never reads
            assert bool((got[0, :, images + 3 :] == 0).all()) and bool((got[1, :, images + 6 :] == 0).all())


@pytest.mark.parametrize("text_mask", [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]], ids=["right", "left"])
def test_a_bare_transformer_records_as_the_pipeline_does(monkeypatch, text_mask):
    """Two videos, the second's text padded at the end or at the start (a Gemma tokenizer pads on the left by
    default): every number is the naive softmax of the module's own q, k under its key mask."""
    model = motif.tiny_transformer(num_heads=2)
    g = torch.Generator().manual_seed(0)
    call = dict(
        hidden_states=torch.randn(2, 33, 3, 4, 6, generator=g),
        timestep=torch.tensor([700, 700]),
        encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
        encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], text_mask]),
    )

    def run():
        with torch.no_grad():
            return model(**call).sample

    holder = type("Holder", (), {"transformer": model})()
    out, calls = spied(holder, monkeypatch, run)
    with cogattn.record(model, kinds=("entropy", "frame", "video_to_text"), batch="all", heads="all") as rec:
        got = run()
    assert torch.equal(got, out)
    lay = rec.layout
    assert (lay.grid, lay.text_len, lay.context_len, lay.seq_len) == ((3, 2, 3), 5, 5, 23)
    assert rec.text_lengths == (5, 2)  # each item's kept text, wherever it is padded
    for layer in range(2):
        q, k, _, mask, _ = calls[0][(layer, "self")][0]
        P = spy_probs(q, k, mask)
        entropy = -(P * P.clamp_min(1e-300).log()).sum(-1)
        assert (rec.get("entropy", 0, layer).double() - entropy).abs().max() < 1e-4
        frame = naive_kind(P, "frame", lay.text_len, lay.grid, text_at_end=True)
        assert (rec.get("frame", 0, layer).double() - frame).abs().max() < 1e-5
        q, k, _, mask, _ = calls[0][(layer, "context")][0]
        want = naive_context(spy_probs(q, k, mask), lay.grid)
        assert (rec.get("video_to_text", 0, layer).double() - want).abs().max() < 1e-5


def test_without_the_cross_attention_video_to_text_is_refused():
    pipe = motif.tiny_pipeline(cross_attention=False)
    assert all(context is None for _, _, context in motif.SPEC.layers(pipe.transformer))
    with pytest.raises(ValueError, match="needs the cross-attention to text tokens"):
        with cogattn.record(pipe, kinds=("video_to_text",)):
            call = motif.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
            pipe(**call, num_inference_steps=1, output_type="latent")


def test_the_estimate_of_the_released_checkpoint():
    """Motif-Video 2B at 1280×736, 121 frames: 31 × 46 × 80 video tokens and 512 text tokens in each of its 28
    encoder blocks' joint attention (12 heads of 128), the cross-attention's 512 prompt tokens for video_to_text, and
    its 8 decoder blocks' attention over twice the video's tokens."""
    released = dict(num_frames=121, height=736, width=1280, num_inference_steps=50, kinds=("frame", "video_to_text"))
    est = cogattn.estimate("Motif-Technologies/Motif-Video-2B", **released, dtype="bfloat16")
    lay = est.layout
    assert (lay.grid, lay.text_len, lay.context_len, lay.seq_len) == ((31, 46, 80), 512, 512, 31 * 46 * 80 + 512)
    names = motif.SPEC.layer_names_for_config(motif.KNOWN["Motif-Technologies/Motif-Video-2B"])
    assert len(names) == 36 and names[27:29] == (
        "single_transformer_blocks.15.attn",
        "single_transformer_blocks.16.attn",
    )
    # the cross-attention is the single-stream encoder blocks' alone (enable_text_cross_attention_single): 16 of 36;
    # the 8 decoder blocks' frame maps are over both copies of the grid (62 frames, no text group)
    records = [(kind, tuple(shape), n) for kind, shape, _, n in est.records]
    want = [("frame", (1, 1, 32, 32), 28 * 50), ("video_to_text", (1, 1, 512, 31, 46, 80), 16 * 50)]
    assert records == [*want, ("frame", (1, 1, 62, 62), 8 * 50)]
    decoder = cogattn.estimate(
        "Motif-Technologies/Motif-Video-2B", **released, layers=["single_transformer_blocks.20.attn"]
    )
    assert [(kind, tuple(shape), n) for kind, shape, _, n in decoder.records] == [
        ("frame", (1, 1, 32, 32), 0),
        ("video_to_text", (1, 1, 512, 31, 46, 80), 0),
        ("frame", (1, 1, 62, 62), 50),
    ]
