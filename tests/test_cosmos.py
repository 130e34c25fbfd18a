"""Cosmos' own rules (tests/test_families.py holds every kind of its tiny pipelines to the reference): Transfer2.5's
image branch under an image context that is not the pipeline's zeros, its control net left stock, Predict2.5's
Qwen2.5-VL text, the image kinds refused where there is no image context, and the released 2.5 shapes."""

from types import SimpleNamespace

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.models import family
from cogattn.reference import naive_context

cosmos = pytest.importorskip("cogattn.models.cosmos", reason="this diffusers lacks Cosmos (it needs 0.35)")
if not cosmos.TRANSFER25:
    pytest.skip("this diffusers lacks Cosmos Transfer2.5 (Cosmos2_5_TransferPipeline)", allow_module_level=True)
tiny25 = pytest.importorskip("cogattn.models.cosmos.tiny")

pytestmark = pytest.mark.usefixtures("one_thread")


def _transformer_call(g):
    """A Transfer2.5 transformer call of two videos: 3 latent frames of 2×3 patches, 8 text tokens and 5 random
    image tokens (not the pipeline's zeros: the image branch's probabilities then differ by key), a timestep per
    latent frame, the first frame conditioning."""
    mask = torch.zeros(2, 1, 3, 4, 6)
    mask[:, :, 0] = 1
    return dict(
        hidden_states=torch.randn(2, 16, 3, 4, 6, generator=g),
        timestep=torch.tensor([0.1, 0.7, 0.7]).view(1, 1, 3, 1, 1).expand(2, 1, 3, 1, 1).contiguous(),
        encoder_hidden_states=(
            torch.randn(2, 8, tiny25.TEXT_WIDTH, generator=g),
            torch.randn(2, tiny25.IMAGE_LEN, tiny25.IMAGE_DIM, generator=g),
        ),
        condition_mask=mask,
        return_dict=False,
    )


def test_the_image_branch_is_its_own_softmax_proved_by_its_output_and_recorded_exactly(monkeypatch):
    """The image branch's spied call: its float64 ``P @ V`` is that call's output (the reference is the model's
    attention); the recording's ``video_to_image`` and ``video_to_text`` are the two branches' probabilities, each
    row summing to 1 over its own keys, and the output stays bit-identical."""
    model = tiny25.tiny_transformer_25(num_heads=3)
    spec = family("cosmos")
    call = _transformer_call(torch.Generator().manual_seed(0))
    spy = AttentionSpy(SimpleNamespace(transformer=model), spec, monkeypatch)
    try:
        stock = model(**call)[0]
    finally:
        spy.remove()
        monkeypatch.undo()
    with cogattn.record(model, kinds=("video_to_text", "video_to_image"), batch="all", heads="all") as rec:
        got = model(**call)[0]
    assert torch.equal(got, stock), "capture changed the output"
    assert (rec.layout.context_len, rec.layout.image_len, rec.layout.grid) == (8, tiny25.IMAGE_LEN, (3, 2, 3))
    for layer in range(len(rec.layer_names)):
        text, image = spy.calls[0][(layer, "context")]  # the text branch's call, then the image branch's
        for (q, k, v, mask, out), kind in ((text, "video_to_text"), (image, "video_to_image")):
            P = spy_probs(q, k, mask)
            assert (P @ v.double() - out.double()).abs().max() < 1e-5, (layer, kind)
            want = naive_context(P, rec.layout.grid)
            result = rec.get(kind, 0, layer).double()
            assert result.shape == want.shape and (result - want).abs().max() <= 1e-5, (layer, kind)
            assert (result.sum(2) - 1).abs().max() <= 1e-5  # each video query's row, over its own keys
        assert image[1].shape[2] == tiny25.IMAGE_LEN and P.std(-1).max() > 1e-3  # an image branch that tells keys apart


def test_transfer_attends_its_zero_image_context_evenly_and_leaves_its_control_net_stock():
    """Transfer2.5's pipeline gives the image branch zeros: every image key is the same, so each video query
    attends the image tokens evenly. Its control net's blocks are a model of their own: the recording names the
    transformer's layers alone and leaves the control net's processors stock."""
    spec = family("cosmos")
    pipe = spec.tiny_pipeline("video-to-video", num_heads=3)
    call = spec.tiny_call(pipe, "video-to-video", torch.Generator().manual_seed(0), True)
    stock = {type(m.processor) for m in pipe.controlnet.modules() if hasattr(m, "processor")}
    with cogattn.record(pipe, kinds=("video_to_image",), batch="all") as rec:
        assert {type(m.processor) for m in pipe.controlnet.modules() if hasattr(m, "processor")} == stock
        pipe(**call, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(1))
    assert stock == {cosmos.CosmosAttnProcessor2_0, cosmos.CosmosAttnProcessor2_5}
    assert rec.layer_names == ("transformer_blocks.0.attn1", "transformer_blocks.1.attn1")
    for key in rec.keys():
        probs = rec.get(*key)
        assert probs.shape[2] == tiny25.IMAGE_LEN and (probs - 1 / tiny25.IMAGE_LEN).abs().max() <= 1e-6


def test_predict2_5_reads_512_qwen_tokens_of_a_prompt():
    """Predict2.5's pipeline renders a prompt in Qwen2.5-VL's chat template padded to 512 tokens and joins every
    layer's normalized hidden states: the cross-attention has 512 keys, the padding attended (no mask)."""
    pipe = tiny25.tiny_pipeline_25(False, num_heads=3)
    with cogattn.record(pipe, kinds=("video_to_text",), batch="cond") as rec:
        pipe(
            prompt="a red fox running in the snow",
            num_frames=9,
            height=32,
            width=48,
            num_inference_steps=1,
            output_type="latent",
        )
    probs = rec.get("video_to_text", 0, 0)
    assert rec.layout.context_len == cosmos.TEXT_LEN == 512 and probs.shape == (1, 1, 512, 3, 2, 3)
    assert (probs.sum(2) - 1).abs().max() <= 1e-5 and probs[:, :, 20:].min() > 0  # padding attended


def test_image_kinds_need_an_image_context():
    """Predict2's transformer has no image branch: video_to_image is refused at the first call, by name."""
    pipe = family("cosmos").tiny_pipeline("image-to-video", num_heads=3)
    call = family("cosmos").tiny_call(pipe, "image-to-video", torch.Generator().manual_seed(0), False)
    rec = cogattn.record(pipe, kinds=("video_to_image",))
    with pytest.raises(ValueError, match=r"kind 'video_to_image' needs the cross-attention to image tokens"), rec:
        pipe(**call, num_inference_steps=1, output_type="latent")
    assert rec.keys() == []


@pytest.mark.parametrize(
    "name,layers,heads,image",
    [
        ("nvidia/Cosmos-Predict2.5-2B", 28, 16, 0),
        ("nvidia/Cosmos-Predict2.5-14B", 36, 40, 0),
        ("nvidia/Cosmos-Transfer2.5-2B", 28, 16, 256),
    ],
)
def test_estimates_at_the_released_2_5_shapes(name, layers, heads, image):
    """93 frames of 704×1280 (the pipelines' default): 24 latent frames of 44×80 patches, 512 Qwen2.5-VL tokens and,
    for Transfer2.5, 256 image tokens in the second branch; its records are (B, H, I, F, Hp, Wp)."""
    kinds = ("video_to_text", "video_to_image") if image else ("video_to_text",)
    est = cogattn.estimate(
        name, num_frames=93, height=704, width=1280, num_inference_steps=36, kinds=kinds, heads="all", batch="cond"
    )
    lay = est.layout
    assert (lay.grid, lay.seq_len, lay.context_len, lay.image_len) == ((24, 44, 80), 24 * 44 * 80, 512, image)
    shapes = {k: (shape, n) for k, shape, _, n in est.records}
    assert shapes["video_to_text"] == ((1, heads, 512, 24, 44, 80), 36 * layers)
    if image:
        assert shapes["video_to_image"] == ((1, heads, 256, 24, 44, 80), 36 * layers)


def test_word_labels_read_predict2_5_s_chat_template(monkeypatch):
    """The prompt's tokens as Predict2.5's pipeline makes them (``prompt_text``): the system turn, then the prompt
    as the user's turn in the chat template, 512 tokens: the ids its text encoder reads, and each word's span in the
    rendered text. Predict2's are the prompt alone (T5)."""
    spec, pipe = family("cosmos"), tiny25.tiny_pipeline_25(False, num_heads=3)
    seen = []
    monkeypatch.setattr(pipe.text_encoder, "forward", lambda ids, *a, real=pipe.text_encoder.forward, **k: (
        seen.append(ids.clone()) or real(ids, *a, **k)
    ))  # fmt: skip
    pipe._get_prompt_embeds("a red fox running in the snow", max_sequence_length=512)
    text = spec.prompt_text(pipe, "a red fox running in the snow", 512, offsets=True)
    assert text.ids == seen[0][0].tolist() and len(text.ids) == 512
    pipe.tokenizer.padding_side = "left"  # a tokenizer padding on the left: the pipeline's padding, the labels' too
    try:
        pipe._get_prompt_embeds("a red fox", max_sequence_length=64)
        assert spec.prompt_text(pipe, "a red fox", 64).ids == seen[1][0].tolist() and seen[1][0, 0] == 0
    finally:
        pipe.tokenizer.padding_side = "right"
    assert text.text[slice(*text.prompt)] == "a red fox running in the snow" and text.prompt[0] > 0
    fox = text.text.index("fox")
    at = next(i for i, span in enumerate(text.spans) if span == (fox, fox + 3))
    assert text.ids[at] == pipe.tokenizer.convert_tokens_to_ids("fox")
    t5 = spec.tiny_pipeline("image-to-video")
    assert (
        spec.prompt_text(t5, "a red fox", 12).ids
        == t5.tokenizer("a red fox", padding="max_length", max_length=12)["input_ids"]
    )
