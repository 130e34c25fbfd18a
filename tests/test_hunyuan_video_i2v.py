"""HunyuanVideo image-to-video on the tiny random pipeline: the image's LLaVA tokens lead the text after the
video, and the layout names them where the pipeline put them (``layout.image_len``, ``layout.prompt_start``,
checked against the pipeline's own ``encode_prompt``); a word of the prompt is found after them, never
among them. Both ``image_condition_type``s; embeddings; true guidance; the released checkpoints' plans and
the batch tool's rules. (The maps themselves are tests/test_families.py's cases.)"""

import PIL.Image
import pytest
import torch

import cogattn
import cogattn.models
from cogattn.analysis import words

hv = cogattn.models.hunyuan_video
if hv is None or not hasattr(__import__("diffusers"), "HunyuanVideoImageToVideoPipeline"):
    pytest.skip("this diffusers has no HunyuanVideo image-to-video", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT, OTHER = "a red fox running in the snow", "a red cat running in the snow"  # one word apart
TEXT = 16  # max_sequence_length: 12 prompt tokens after the template's 4 are cropped, 4 of them padding
IMAGES = {"token_replace": 4, "latent_concat": 8}  # of the tiny LLaVA's 16: every 4th, every 2nd
CALL = dict(prompt_template=hv.TINY_I2V_TEMPLATE, max_sequence_length=TEXT, num_frames=9, height=32, width=48)


@pytest.fixture(scope="module", params=list(IMAGES))
def pipe(request):
    return hv.tiny_pipeline("image-to-video", image_condition_type=request.param, num_heads=3)


def _image(seed):
    pixels = torch.randint(0, 256, (32, 48, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return PIL.Image.fromarray(pixels.numpy())


def _encode(pipe, image, prompt, **kwargs):
    every = {"token_replace": 4, "latent_concat": 2}[pipe.transformer.config.image_condition_type]
    with torch.no_grad():
        return pipe.encode_prompt(
            image=image,
            prompt=prompt,
            prompt_template=hv.TINY_I2V_TEMPLATE,
            max_sequence_length=TEXT,
            image_embed_interleave=every,
            **kwargs,
        )


def _record(pipe, **call):
    with cogattn.record(pipe, kinds=("video_to_text",), batch="all", heads="all") as rec:
        pipe(**CALL, **call, num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    return rec


def test_the_image_tokens_lead_the_text_where_the_pipeline_put_them(pipe):
    kind = pipe.transformer.config.image_condition_type
    rec = _record(pipe, image=_image(0), prompt=PROMPT)
    lay, n = rec.layout, IMAGES[kind]
    emb, _, mask = _encode(pipe, _image(0), PROMPT)
    assert (lay.text_len, lay.image_len, lay.prompt_start) == (emb.shape[1], n, n) == (n + TEXT - 4, n, n)
    # the pipeline's own text: its first n rows ignore the prompt and each follows the image (the prompt's
    # rows follow it too: the text encoder is causal, the image before the prompt)
    other_prompt, other_image = _encode(pipe, _image(0), OTHER)[0], _encode(pipe, _image(1), PROMPT)[0]
    assert torch.equal(emb[0, :n], other_prompt[0, :n]) and not torch.equal(emb, other_prompt)
    assert all(not torch.equal(emb[0, i], other_image[0, i]) for i in range(n))
    # every image token is kept, then the prompt's 7 words and </s>; the recording says so
    assert mask[0].tolist() == [1] * (n + 8) + [0] * (TEXT - 4 - 8) and rec.text_lengths == (n + 8,)
    # the recorded video attends to the image tokens (keys of the joint attention like the prompt's)
    assert rec.get("video_to_text", 0, 0)[0, :, :n].sum() > 0


def test_word_lookup_skips_the_image_tokens(pipe):
    lay = _record(pipe, image=_image(0), prompt=PROMPT).layout
    T, n = lay.prompt_len, lay.prompt_start
    names = words.text_tokens(pipe.tokenizer, PROMPT, T, prompt_start=n)
    assert names[:n] == [words.IMAGE_TOKEN] * n and names[n:] == words.text_tokens(pipe.tokenizer, PROMPT, T - n)
    assert names[n : n + 8] == PROMPT.split() + ["</s>"]
    for word in set(PROMPT.split()):
        assert min(words.word_positions(word, pipe.tokenizer, PROMPT, T, prompt_start=n)) >= n
    # the word is where the pipeline put it: the first row of the text that another word there changes
    fox = words.word_positions("fox", pipe.tokenizer, PROMPT, T, prompt_start=n)
    emb, other = _encode(pipe, _image(0), PROMPT)[0][0], _encode(pipe, _image(0), OTHER)[0][0]
    changed = [i for i in range(T) if not torch.equal(emb[i], other[i])]
    assert fox == [n + 2] == changed[:1]
    with pytest.raises(ValueError, match=f"not among the {T - n} prompt tokens from text token {n}"):
        words.word_positions("dog", pipe.tokenizer, PROMPT, T, prompt_start=n)
    with pytest.raises(ValueError, match="prompt_start"):
        words.text_tokens(pipe.tokenizer, PROMPT, T, prompt_start=T + 1)
    # the word maps find it there too: the plot's word is the pipeline's token, past the image tokens
    from cogattn.plot.overlays import _resolve_tokens

    rec = _record(pipe, image=_image(0), prompt=PROMPT)
    assert _resolve_tokens(rec, "video_to_text", "fox", words.PromptFormat(pipe, hv.TINY_I2V_TEMPLATE), PROMPT)[0][
        0
    ] == [n + 2]


def test_embeddings_of_the_pipeline_s_own_length_are_named_and_others_are_not(pipe):
    emb, pooled, mask = _encode(pipe, _image(0), PROMPT)
    given = dict(image=_image(0), pooled_prompt_embeds=pooled)
    rec = _record(pipe, prompt_embeds=emb, prompt_attention_mask=mask, **given)
    assert rec.layout.image_len == IMAGES[pipe.transformer.config.image_condition_type]
    rec = _record(pipe, prompt_embeds=emb[:, 1:], prompt_attention_mask=mask[:, 1:], **given)
    assert rec.layout.image_len == 0 and rec.layout.prompt_start == 0  # not the pipeline's: all text
    # a transformer called outside the pipeline names none
    config = pipe.transformer.config
    call = dict(hidden_states=torch.zeros(1, 4, 3, 4, 6), timestep=torch.tensor([500.0]), encoder_hidden_states=emb)
    layout, batch, t, _ = hv.read_call(config, (), call)
    assert (layout.image_len, layout.text_len, batch, t) == (0, emb.shape[1], 1, 500.0)


def test_true_guidance_needs_text_of_one_length(pipe):
    call = dict(image=_image(0), prompt=PROMPT, negative_prompt="blue sky", true_cfg_scale=4.0)
    if pipe.transformer.config.image_condition_type == "token_replace":
        # the pipeline encodes the negative prompt with image_embed_interleave=2: 8 image tokens, not 4
        with pytest.raises(ValueError, match=r"16 tokens and the unconditional call's 20.*image_embed_interleave=2"):
            _record(pipe, **call)
        call["image_embed_interleave"] = 2
    rec = _record(pipe, **call)
    assert rec.layout.image_len == 8 and rec.get("video_to_text", 0, 0).shape[0] == 2  # [uncond, cond]


def test_the_released_checkpoints_plan_their_text():
    for name, images, frames in (
        ("hunyuanvideo-community/HunyuanVideo-I2V", 144, 129),
        ("hunyuanvideo-community/HunyuanVideo-I2V-33ch", 288, 129),
    ):
        est = cogattn.estimate(name, num_frames=frames, height=720, width=1280, num_inference_steps=50)
        lay = est.layout
        assert (lay.text_len, lay.image_len, lay.prompt_start, lay.grid) == (images + 252, images, images, (33, 45, 80))
    plain = cogattn.estimate(
        "hunyuanvideo-community/HunyuanVideo", num_frames=129, height=720, width=1280, num_inference_steps=50
    )
    assert (plain.layout.text_len, plain.layout.image_len, plain.layout.prompt_start) == (256, 0, 0)


@pytest.mark.parametrize(
    "sets,message",
    [
        (["true_cfg_scale=4"], r"true_cfg_scale: 4; .* every 4th image token .* every 2nd of the negative prompt's"),
        (["model=hunyuanvideo-community/HunyuanVideo-I2V-33ch"], r"previews: true; .* drops the first 4 decoded"),
        (["task=text-to-video"], r"HunyuanVideo-I2V is an image-to-video checkpoint; set task: image-to-video"),
        (["model=tiny-hunyuan-video"], r"tiny-hunyuan-video \(the tiny HunyuanVideo pipeline\) for text-to-video"),
    ],
)
def test_the_batch_tool_s_rules_for_image_to_video(sets, message, monkeypatch):
    from pathlib import Path

    from cogattn.dump.config import ConfigError, load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = Path(__file__).resolve().parents[1] / "configs" / "hunyuan-video-i2v.yaml"
    cfg = load_config(config)
    assert (cfg.family, cfg.task, cfg.spec().pipelines[cfg.task]) == (
        "hunyuan_video",
        "image-to-video",
        "HunyuanVideoImageToVideoPipeline",
    )
    with pytest.raises(ConfigError, match=message):
        load_config(config, sets)


def test_framepack_s_siglip_tokens_lead_its_text_and_a_word_is_found_after_them():
    """FramePack's transformer puts the image's SigLIP tokens before the prompt's (``cat([image, text])``): the
    layout names them (``image_len``, as read from the call and as planned) and a word of the prompt is found
    after them (before, ``prompt_start`` was 0 and the prompt's words were put on the image tokens)."""
    framepack = cogattn.models.hunyuan_video_framepack
    if framepack is None:
        pytest.skip("this diffusers has no FramePack")
    pipe = framepack.tiny_pipeline(num_heads=3)
    seen = {}

    def image_tokens(module, args, kwargs):
        seen.setdefault("image", kwargs["image_embeds"].shape[1])

    pipe.transformer.register_forward_pre_hook(image_tokens, with_kwargs=True)
    image = PIL.Image.fromarray(torch.randint(0, 256, (32, 48, 3), dtype=torch.uint8).numpy())
    prompt = "a red fox runs"
    with cogattn.record(pipe, kinds=("entropy",)) as rec:
        pipe(prompt=prompt, image=image, num_frames=9, height=32, width=48, num_inference_steps=1,
             output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    lay, n = rec.layout, seen["image"]
    planned = framepack.layout_for_video(pipe.transformer.config, 9, 32, 48, lay.text_len - n)
    assert (lay.image_len, lay.prompt_start, planned.image_len) == (n, n, n) and n > 0
    assert lay.spans() == {"image": (0, n), "prompt": (n, lay.text_len)}
    spans = words.item_spans(rec, 0)
    fox = words.word_positions("fox", pipe, prompt, lay.text_len, spans=spans, family="hunyuan_video_framepack")
    alone = words.word_positions("fox", pipe, prompt, lay.text_len - n, family="hunyuan_video_framepack")
    assert fox == [i + n for i in alone]
