"""A Wan-family transformer with ``image_dim`` but no ``added_kv_proj_dim`` (diffusers' own test configs of Wan
image-to-video, ChronoEdit, SkyReels-V2 image-to-video and Wan Animate) puts the image tokens before the text in one
cross-attention softmax (docs/models/wan.md, "Image tokens in the text's attention").

The reference is each stock cross-attention call, spied where the family's processor dispatches it
(``reference.AttentionSpy``): the naive float64 softmax of its q and k over all its keys, proved by ``P @ V``.
A guided recording must leave the video bit-identical and hold ``video_to_text`` as that softmax's text columns and
``video_to_image`` as its image columns, a run folder reading both back with the layout that says so.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.errors import StoreError
from cogattn.reference import naive_context
from cogattn.runs.run_values import checked_layout

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2


def _pipe(family):
    """The family's tiny image-to-video pipeline, its transformer remade without image projections of its own."""
    spec = cogattn.models.family(family)  # ValueError where this diffusers lacks the family
    pipe = spec.tiny_pipeline("image-to-video")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = {**pipe.transformer.config, "added_kv_proj_dim": None}
        pipe.transformer = type(pipe.transformer).from_config(config).eval()
    assert pipe.transformer.config.image_dim and pipe.transformer.blocks[0].attn2.add_k_proj is None
    return pipe, spec


def _run(pipe, spec):
    call = spec.tiny_call(pipe, "image-to-video", torch.Generator().manual_seed(0), True)
    out = pipe(**call, num_inference_steps=STEPS, output_type="latent", generator=torch.Generator().manual_seed(1))
    return out.frames


@pytest.mark.parametrize("family", ["wan", "chronoedit", "skyreels_v2", "wan_animate"])
def test_the_image_and_text_columns_of_one_cross_attention_softmax(family, monkeypatch, tmp_path):
    if family not in {s.family for s in cogattn.models.FAMILIES}:
        pytest.skip(f"this diffusers has no {family} transformer")
    pipe, spec = _pipe(family)
    dispatch = sys.modules[type(pipe.transformer).__module__]  # where the stock processor calls the attention
    spy = AttentionSpy(pipe, spec, monkeypatch, dispatch)
    try:
        stock = _run(pipe, spec)
    finally:
        spy.remove()
        monkeypatch.undo()
    assert len(spy.calls) == 2 * STEPS  # guided: the conditional call, then the unconditional one, per step

    with cogattn.record(
        pipe, kinds=("video_to_text", "video_to_image"), batch="all", heads="all", save_dir=tmp_path / "run"
    ) as rec:
        got = _run(pipe, spec)
    assert torch.equal(got, stock), "capture changed the video"
    lay = rec.layout
    assert lay.image_joins_text and lay.image_len == 17 and lay.context_len == 512, lay

    run = cogattn.load(tmp_path / "run")
    assert run.layout == lay
    fields = json.loads((tmp_path / "run" / "run.json").read_text())["layout"]
    assert fields["image_joins_text"] is True
    with pytest.raises(StoreError, match="layout.image_joins_text = 1; it is true or false"):
        checked_layout({**fields, "image_joins_text": 1}, tmp_path / "run" / "run.json")
    layers = len(rec.layer_names)
    assert len(rec.keys()) == 2 * STEPS * layers
    for n, seen in enumerate(spy.calls):
        step, call = divmod(n, 2)
        slot = 0 if call else 1  # the results' batch is [uncond, cond]; the conditional call runs first
        for layer in range(layers):
            (q, k, v, mask, out), *_ = seen[layer, "context"]
            assert k.shape[2] == lay.image_len + lay.context_len, k.shape  # one attention over both
            P = spy_probs(q, k, mask)
            assert (P @ v.double() - out.double()).abs().max().item() < 1e-5  # the reference is the attention
            image = naive_context(P[..., : lay.image_len], lay.grid)[0]
            text = naive_context(P[..., lay.image_len :], lay.grid)[0]
            for kind, want in (("video_to_image", image), ("video_to_text", text)):
                for source in (rec, run):
                    result = source.get(kind, step, layer)[slot]
                    err = (result.double() - want).abs().max().item()
                    assert err <= 1e-5, (family, kind, step, layer, call, err)
            row_sums = rec.get("video_to_image", step, layer)[slot].double().sum(1)
            row_sums += rec.get("video_to_text", step, layer)[slot].double().sum(1)
            assert (row_sums - 1).abs().max().item() < 1e-5  # each video query's row: the image's and text's columns


def test_every_released_image_to_video_checkpoint_has_its_own_image_softmax():
    """The released configs (``KNOWN``, which ``estimate`` plans offline) all have ``added_kv_proj_dim``: their layout
    keeps the image's softmax apart; the same config without it plans one softmax over the image and the text."""
    known = {
        name: (spec, config)
        for spec in cogattn.models.FAMILIES
        for name, config in spec.known.items()
        if "image_dim" in config
    }
    assert {"Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "Skywork/SkyReels-V2-I2V-1.3B-540P-Diffusers"} <= set(known)
    for name, (spec, config) in known.items():
        width = config["attention_head_dim"] * config["num_attention_heads"]
        assert config["added_kv_proj_dim"] == width, name  # image projections to the model's width
        lay = spec.layout_for_video(config, 81, 480, 832, None)
        assert lay.image_len and not lay.image_joins_text, name
        lay = spec.layout_for_video({**config, "added_kv_proj_dim": None}, 81, 480, 832, None)
        assert lay.image_joins_text, name
