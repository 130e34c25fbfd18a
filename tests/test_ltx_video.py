"""LTX-Video's own rules (tests/test_families.py holds every kind of its tiny pipelines to the reference): the grid
read from ``LTXConditionPipeline``'s ``video_coords``, a condition after frame 0 as tokens off the grid, and the
cross-attention's additive key mask read as one bias per item."""

import PIL.Image
import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.recorder.processor import context_bias
from cogattn.reference import naive_context

ltx_video = pytest.importorskip("cogattn.models.ltx_video", reason="this diffusers lacks LTX-Video (it needs 0.35)")


def _coords(frames, height, width, before=()):
    """``video_coords`` as LTXConditionPipeline makes them: condition tokens ``before`` (one latent frame each, at
    pixel frame ``k``), then the video's grid, scaled by the VAE (8 frames, 32 pixels) and a frame rate of 25."""
    f, y, x = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    grid = torch.stack([(f * 8 + 1 - 8).clamp(min=0), y * 32, x * 32]).reshape(3, -1).float()
    parts = []
    for k in before:
        _, y1, x1 = torch.meshgrid(torch.arange(1), torch.arange(height), torch.arange(width), indexing="ij")
        parts.append(torch.stack([torch.full_like(y1, k), y1 * 32, x1 * 32]).reshape(3, -1).float())
    coords = torch.cat([*parts, grid], dim=1)
    coords[0] /= 25
    return coords[None].repeat(2, 1, 1)


def test_the_grid_is_read_from_video_coords_and_conditions_before_it_are_off_the_grid():
    read = ltx_video._grid_of_coords
    assert read(_coords(3, 2, 3), 18) == (0, (3, 2, 3))
    assert read(_coords(4, 5, 7, before=(8, 16)), 2 * 35 + 140) == (70, (4, 5, 7))
    shuffled = _coords(3, 2, 3)[:, :, torch.randperm(18, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match="raster order"):
        read(shuffled, 18)
    differ = _coords(3, 2, 3)
    differ[1, 2] += 1
    with pytest.raises(ValueError, match="share video_coords"):
        read(differ, 18)


def test_the_cross_attention_mask_is_one_bias_per_item():
    bias = torch.tensor([[0.0, 0.0, -10000.0], [0.0, -10000.0, -10000.0]])
    per_head = bias[:, None, None, :].expand(2, 4, 1, 3)  # as prepare_attention_mask makes it
    assert torch.equal(context_bias(per_head, 2, 3), bias)
    keep = torch.tensor([[True, False, True]]).expand(2, 3)[:, None, None, :]
    assert torch.equal(context_bias(keep, 2, 3)[0], torch.tensor([0.0, -torch.inf, 0.0]))
    assert context_bias(None, 2, 3) is None
    other = per_head.clone()
    other[0, 1, 0, 0] = -1.0
    with pytest.raises(ValueError, match="same for every head"):
        context_bias(other, 2, 3)
    with pytest.raises(ValueError, match=r"\(B, H, 1, 3\)"):
        context_bias(per_head[:, :, :, :2], 2, 3)


def test_each_slot_s_valid_text_is_the_tokenizer_s_and_read_back_from_the_run(tmp_path):
    """Prompts and negative prompts of different lengths: the cross-attention's key mask keeps each item's own text,
    told per slot (``[uncond..., cond...]``) by ``text_lengths`` as the tokenizer's mask counts it, and in run.json;
    a text padded at the start counts its kept tokens as well (``kept_count``)."""
    from cogattn.recorder.processor import kept_count

    pipe = ltx_video.tiny_pipeline()
    prompts, negatives = ["a red fox running in the snow", "a fox"], ["blue sky", "snow in the red"]
    with cogattn.record(pipe, kinds=("video_to_text",), batch="all", layers=[0], save_dir=tmp_path) as rec:
        pipe(prompt=prompts, negative_prompt=negatives, num_frames=17, height=64, width=96, num_inference_steps=1,
             max_sequence_length=8, guidance_scale=3.0, generator=torch.Generator().manual_seed(1), output_type="latent")  # fmt: skip
    tokens = pipe.tokenizer(negatives + prompts, max_length=8, padding="max_length", truncation=True)
    want = tuple(sum(mask) for mask in tokens["attention_mask"])
    assert rec.text_lengths == want and min(want) < 8 and cogattn.load(tmp_path).text_lengths == list(want)
    m = rec.get("video_to_text", 0, 0)  # (B, H, T, F, Hp, Wp): a padded token's column holds 0
    assert [int((m[b].flatten(2).sum(-1) > 0).any(0).sum()) for b in range(4)] == list(want)
    assert kept_count(torch.tensor([[0.0, 0.0, -1e4], [-1e4, 0.0, 0.0], [-torch.inf] * 3])) == [2, 2, 0]


def test_a_condition_after_frame_0_is_recorded_off_the_grid_exactly(monkeypatch):
    """An image at frame 0 and one at frame 8: the second's latent frame leads the sequence (6 tokens off the
    grid); every token's row is exact, video_to_text holds the grid's queries, the video bit-identical, and the kinds
    that need every token on the grid say why not."""
    from diffusers import LTXConditionPipeline
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    pipe = LTXConditionPipeline(**ltx_video.tiny_pipeline(num_heads=3).components)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)

    def image():
        return PIL.Image.fromarray(torch.randint(0, 256, (64, 96, 3), generator=g, dtype=torch.uint8).numpy())

    call = ltx_video.tiny_call(pipe, "text-to-video", g, True)
    call["conditions"] = [
        LTXVideoCondition(image=image(), frame_index=0),
        LTXVideoCondition(image=image(), frame_index=8),
    ]

    def generate():
        return pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="pt").frames

    spy = AttentionSpy(pipe, ltx_video.SPEC, monkeypatch)
    try:
        stock = generate()
    finally:
        spy.remove()
        monkeypatch.undo()
    with cogattn.record(pipe, kinds=("full", "received", "video_to_text"), batch="all", heads="all") as rec:
        got = generate()
    assert torch.equal(got, stock)
    assert rec.layout.history_len == 6 and rec.layout.grid == (3, 2, 3) and rec.layout.seq_len == 24
    for step, calls in enumerate(spy.calls):
        for layer in range(2):
            ((q, k, v, mask, out),) = calls[(layer, "self")]
            P = spy_probs(q, k, mask)
            assert (P @ v.double() - out.double()).abs().max().item() < 1e-5  # the reference is the model's
            assert (rec.get("full", step, layer).double() - P).abs().max().item() < 1e-5
            assert (rec.get("received", step, layer).double() - P.sum(-2)).abs().max().item() < 1e-5
            # the cross-attention's rows of the grid's queries: the condition's, off the grid, are no part of it
            ((q, k, v, mask, out),) = calls[(layer, "context")]
            P = spy_probs(q, k, mask)
            assert (P @ v.double() - out.double()).abs().max().item() < 1e-5
            want = naive_context(P[:, :, 6:], (3, 2, 3))
            assert (rec.get("video_to_text", step, layer).double() - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="off the latent grid"), cogattn.record(pipe, kinds=("frame_max",)):
        generate()
