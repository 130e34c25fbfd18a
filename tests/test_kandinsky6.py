"""Kandinsky 6 (``cogattn.models.kandinsky6``): a bare transformer's six attentions of every fused block recorded against
the naive float64 softmax of the q and k each attention call got (the video's self-attention and text cross-attention
under its padding mask, the audio stream's four as LTX-2's kinds, video and audio heads of their own), how a call is
read (the image's reference frame off the grid, the audio's bins and frame rate), the word labels of the pipeline's
template, the released shapes, and the refusals in one line (the SR model's too)."""

from __future__ import annotations

import math

import pytest
import torch

k6 = pytest.importorskip("cogattn.models.kandinsky6", reason="this diffusers lacks Kandinsky 6")
import cogattn  # noqa: E402
from cogattn.reference import naive_audio, naive_context  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5
ATTRS = tuple(k6.SOURCES)  # a fused block's six attentions, by their source


@pytest.fixture(scope="module")
def transformer():
    return k6.tiny_transformer(num_heads=3, audio_heads=2)


def _call(transformer, batch=2, frames=2, reference=False):
    """A direct call: ``frames`` latent frames of 2×3 patches (and the image's frame after them), 7 audio bins, 5
    text tokens, the first item's last 2 padded."""
    g = torch.Generator().manual_seed(0)
    channels = 2 * transformer.config.in_visual_dim + 1
    total = frames + reference
    call = dict(
        hidden_states=torch.randn(batch, total, 4, 6, channels, generator=g),
        encoder_hidden_states=torch.randn(batch, 5, transformer.config.in_text_dim, generator=g),
        pooled_projections=torch.randn(batch, transformer.config.in_text_dim2, generator=g),
        timestep=torch.full((batch,), 500.0),
        audio_hidden_states=torch.randn(batch, 7, transformer.config.in_audio_dim, generator=g),
        encoder_attention_mask=torch.tensor([[1, 1, 1, 0, 0]] + [[1] * 5] * (batch - 1)).bool(),
    )
    if reference:
        types = torch.zeros(batch, total, dtype=torch.long)
        types[:, -1] = 1
        call["visual_token_type_ids"] = types
        call["visual_rope_pos"] = (torch.tensor([*range(frames), 0]), torch.arange(2), torch.arange(3))
    return call


def _spied(transformer, call, monkeypatch):
    """The stock output of ``transformer(**call)`` and, per ``(layer, attribute)``, the probabilities of its attention
    call (the naive float64 softmax of its q, k under its mask), each proved by P·V against the call's output."""
    from diffusers.models.transformers import transformer_kandinsky6 as owner

    where, seen = [None], {}
    handles = []
    for i, block in enumerate(transformer.visual_transformer_blocks):
        for attr in ATTRS:
            module = block.get_submodule(attr)
            handles.append(module.register_forward_pre_hook(lambda m, a, key=(i, attr): where.__setitem__(0, key)))
            handles.append(module.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))
    real = owner.dispatch_attention_fn

    def spy(query, key, value, attn_mask=None, **kwargs):
        out = real(query, key, value, attn_mask=attn_mask, **kwargs)
        if where[0] is not None:
            q, k, v, o = (t.transpose(1, 2).double() for t in (query, key, value, out))
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            if attn_mask is not None:  # the text's padding mask (B, T)
                scores = scores.masked_fill(~attn_mask[:, None, None], -torch.inf)
            P = scores.softmax(-1)
            assert (P @ v - o).abs().max().item() < TOL, where[0]  # the reference is the model's attention
            seen[where[0]] = P
        return out

    monkeypatch.setattr(owner, "dispatch_attention_fn", spy)
    try:
        stock = transformer(**call, return_dict=False)
    finally:
        monkeypatch.undo()
        for handle in handles:
            handle.remove()
    return stock, seen


def test_a_bare_transformer_s_six_attentions_match_their_float64_softmax(transformer, monkeypatch):
    call = _call(transformer)
    stock, seen = _spied(transformer, call, monkeypatch)
    assert len(seen) == 2 * len(ATTRS)
    kinds = ("full", "video_to_text", "audio", "audio_to_text", "frame_audio", "audio_frame")
    with cogattn.record(transformer, kinds=kinds, batch="all", heads="all") as rec:
        got = transformer(**call, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(got, stock)), "capture changed the output"
    lay = rec.layout
    assert (lay.grid, lay.context_len, lay.audio.tokens, lay.history_len) == ((2, 2, 3), 5, 7, 0)
    heads = {"full": 3, "video_to_text": 3, "audio": 2, "audio_to_text": 2, "frame_audio": 3, "audio_frame": 2}
    for layer in range(2):
        P = {k6.SOURCES[attr]: p for (i, attr), p in seen.items() if i == layer}
        want = {"full": P["self"], "video_to_text": naive_context(P["text"], lay.grid)}
        for kind, source in (("audio", "audio"), ("audio_to_text", "audio_text"), ("frame_audio", "a2v")):
            want[kind] = naive_audio(P[source], kind, lay.grid)
        want["audio_frame"] = naive_audio(P["v2a"], "audio_frame", lay.grid)
        for kind in kinds:
            result = rec.get(kind, 0, layer).double()
            assert result.shape == want[kind].shape and result.shape[1] == heads[kind], kind
            assert (result - want[kind]).abs().max().item() <= TOL, (kind, layer)
        # the padded text keys of the first item hold exactly 0, in both streams' text attentions
        assert bool((rec.get("video_to_text", 0, layer)[0, :, 3:] == 0).all())
        assert bool((rec.get("audio_to_text", 0, layer)[0, :, 3:] == 0).all())


def test_the_image_s_reference_frame_is_off_the_grid_and_leads_the_video(transformer, monkeypatch):
    call = _call(transformer, batch=1, reference=True)
    stock, seen = _spied(transformer, call, monkeypatch)
    with cogattn.record(transformer, kinds=("full", "frame_audio"), batch="all", heads="all") as rec:
        got = transformer(**call, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(got, stock))
    lay = rec.layout
    assert (lay.grid, lay.history_len, lay.video_len) == ((2, 2, 3), 6, 18)
    order = torch.cat([torch.arange(12, 18), torch.arange(12)])  # the reference frame's 6 tokens first
    for layer in range(2):
        full = seen[(layer, "video_dec_block.self_attention")][:, :, order][..., order]
        assert (rec.get("full", 0, layer).double() - full).abs().max().item() <= TOL
        frames = naive_audio(seen[(layer, "va_cross_attention")][:, :, :12], "frame_audio", lay.grid)
        assert (rec.get("frame_audio", 0, layer).double() - frames).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="6 video keys of this layout are off the latent grid") as err:
        with cogattn.record(transformer, kinds=("audio_frame",)):
            transformer(**call)
    assert "\n" not in str(err.value)


def test_a_call_is_read_with_its_audio_axis_and_reference_frames():
    config = {"patch_size": [1, 2, 2]}
    call = dict(hidden_states=torch.zeros(2, 4, 4, 6, 9), encoder_hidden_states=torch.zeros(2, 8, 16))
    call.update(timestep=torch.tensor([900.0, 900.0]), audio_hidden_states=torch.zeros(2, 17, 4))
    layout, batch, t, _ = k6.read_call(config, (), call)
    assert (layout.grid, layout.context_len, layout.history_len, batch, t) == ((4, 2, 3), 8, 0, 2, 900.0)
    # a bare transformer: the pipeline's defaults, 24 frames a second and MMAudio's 44100 / 1024 bins a second
    audio = layout.audio
    assert (audio.tokens, audio.rate, audio.compression, audio.fps) == (17, 44100 / 1024, 1, 24)
    assert layout.audio.seconds()[1].tolist() == [1024 / 44100, 2048 / 44100]  # bins with no causal offset
    types = torch.tensor([[0, 0, 0, 1]] * 2)
    assert k6.read_call(config, (), {**call, "visual_token_type_ids": types})[0].history_len == 6
    assert k6.read_call(config, (), {**call, "audio_hidden_states": None})[0].audio is None  # video only
    with pytest.raises(ValueError, match="visual_token_type_ids .* are not the video's frames") as err:
        k6.read_call(config, (), {**call, "visual_token_type_ids": torch.tensor([[1, 0, 0, 0]] * 2)})
    assert "\n" not in str(err.value)


def test_a_pipeline_call_s_frame_rate_times_its_audio_bins():
    pipe = k6.tiny_pipeline(num_heads=2)
    call = k6.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    with cogattn.record(pipe, kinds=("frame_audio",)) as rec:
        pipe(**{**call, "frame_rate": 12.0}, num_inference_steps=1, output_type="latent")
    audio = rec.layout.audio
    assert (audio.fps, audio.rate, audio.tokens) == (12.0, 44100 / 1024, math.ceil(9 / 12 * 44100 / 1024))
    assert rec.get("frame_audio", 0, 0).shape == (1, 1, 3, audio.tokens)


def test_released_shapes_and_the_estimate():
    config = k6.KNOWN["kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers"]
    assert k6.head_shape(config) == (32, 128)
    assert k6.audio_shapes(config) == {"audio": (16, 128), "audio_text": (16, 128), "a2v": (32, 128), "v2a": (16, 128)}
    layout = k6.layout_for_video(config, 121, 512, 768, None)
    assert (layout.grid, layout.context_len) == ((31, 32, 48), 1024)
    assert layout.audio.tokens == math.ceil(121 / 24 * 44100 / 1024) == 218  # the pipeline's audio_length
    est = cogattn.estimate(
        "kandinskylab/Kandinsky-6.0-Pro-sft-5s-Diffusers",
        num_frames=121,
        height=512,
        width=768,
        num_inference_steps=50,
        kinds=("entropy", "audio"),
        dtype="bfloat16",
    )
    assert est.layout.seq_len == 31 * 32 * 48 and "audio: 218 bins" in est.table()


def test_word_labels_are_the_pipeline_s_tokens_after_its_template_s_crop():
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as module

    pipe = k6.tiny_pipeline(num_heads=2)
    prompt = "a small cat"
    text = k6.prompt_text(pipe, prompt, 8)
    enc = pipe.tokenizer(
        text=[module._PROMPT_TEMPLATE.format(prompt)], max_length=8 + 129, truncation=True, padding="max_length"
    )
    assert text.ids == enc["input_ids"][0][129:]  # what the pipeline's _get_prompt_embeds keeps
    tokens = pipe.tokenizer.convert_ids_to_tokens(text.ids)
    assert tokens[:5] == ["a", "small", "cat", "<|im_end|>", "</s>"] and text.text[slice(*text.prompt)] == prompt


def test_refusals_in_one_line(transformer):
    for kind, says in (("text_to_video", "never queries"), ("video_to_image", "no image attention")):
        with pytest.raises(ValueError, match=f"kind '{kind}' does not exist for kandinsky6: .*{says}") as err:
            cogattn.Recording(transformer, kinds=(kind,))
        assert "\n" not in str(err.value)
    name = "visual_transformer_blocks.1.av_cross_attention"
    with pytest.raises(ValueError, match="audio queries to the video, no layer of its own: .*'audio_frame'"):
        cogattn.Recording(transformer, kinds=("entropy",), layers=[name])
    name = "visual_transformer_blocks.0.audio_dec_block.self_attention"
    with pytest.raises(ValueError, match="audio self-attention, no layer of its own: its maps are kind 'audio'"):
        cogattn.Recording(transformer, kinds=("entropy",), layers=[name])


def test_the_sr_transformer_is_refused_saying_why():
    from diffusers import Kandinsky6SRTransformer3DModel

    from cogattn.models import spec_for_config

    size = dict(in_visual_dim=4, out_visual_dim=4, time_dim=16, model_dim=32, ff_dim=32, num_visual_blocks=1)
    sr = Kandinsky6SRTransformer3DModel(**size, axes_dims=(8, 4, 4))
    for target in (sr, type("Pipe", (), {"transformer": sr})()):
        with pytest.raises(TypeError, match="Kandinsky 6 SR .* is not recorded: it refines tiles") as err:
            cogattn.record(target, kinds=("entropy",))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="Kandinsky 6 SR"):
        spec_for_config({"_class_name": "Kandinsky6SRTransformer3DModel"})
