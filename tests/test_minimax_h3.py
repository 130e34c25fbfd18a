"""MiniMax-H3's own rules (tests/test_families.py holds every kind of its tiny pipeline to the reference): the
layout read from the packed sequence (keyframe conditions and audio before the grid, in the layout's text; the
presentation before the prompt as ``image_len``), a bare transformer recorded as the modular pipeline calls it, the
token refiner's attentions left stock, the prompt's tokens, and the released shape planned offline."""

import types

import pytest
import torch
from reference import AttentionSpy, spy_probs

import cogattn
from cogattn.models.tiny_text import tiny_tokenizer
from cogattn.reference import naive_kind

minimax = pytest.importorskip("cogattn.models.minimax_h3", reason="this diffusers lacks MiniMax-H3 (it needs 0.42)")

pytestmark = pytest.mark.usefixtures("one_thread")

# two keyframes: "<Picture i>: " (text, 1) and a vision block (video, 0) each, then a prompt of 3 tokens
TAGS = torch.tensor([1, 0, 0, 0, 1, 0, 0, 1, 1, 1])


def fl2va_call(model, g):
    """A first-and-last keyframe (fl2va) call, packed by the pipeline's own layout step: 10 text rows, 2 keyframes of
    2×3 patches, 2·37 audio rows, 7 latent frames of 2×3 patches."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    positions, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        TAGS, 7, 4, 6, 37, (1, 2, 2), 2, 2, 0, ("first", "last")
    )
    S = positions.shape[0]
    timesteps = torch.tensor([0.25, 0.999, 1.0])  # the video's, the keyframes', the audio's: a row's by its index
    t_index = torch.zeros(S, dtype=torch.long)
    t_index[video[:12]], t_index[audio] = 1, 2
    return dict(
        hidden_states=torch.randn(1, len(video), 96, generator=g),
        audio_hidden_states=torch.randn(1, len(audio), 32, generator=g),
        encoder_hidden_states=torch.randn(1, len(text), 16, generator=g),
        timestep=timesteps,
        timestep_indices=t_index,
        token_tags=tags,
        position_ids=positions,
        video_indices=video,
        audio_indices=audio,
        text_indices=text,
        return_dict=False,
    )


def test_a_keyframe_call_of_a_bare_transformer_is_recorded_as_the_model_attends(monkeypatch):
    """Every token before the grid (the presentation, the keyframes' 12 tokens, the 74 audio tokens) is the layout's
    text, the grid after it; ``full``, ``frame`` and ``video_to_text`` equal the naive float64 softmax of the module's
    own q and k, and the output is the stock one."""
    model = minimax.tiny_transformer(num_heads=3)
    call = fl2va_call(model, torch.Generator().manual_seed(0))
    layout, batch, t, _ = minimax.read_call(model.config, (), call)
    assert (layout.text_len, layout.image_len, layout.grid, batch, t) == (10 + 12 + 74, 7, (7, 2, 3), 1, 0.75)
    assert layout.seq_len == call["position_ids"].shape[0]
    spy = AttentionSpy(types.SimpleNamespace(transformer=model), minimax.SPEC, monkeypatch)
    try:
        with torch.no_grad():
            stock = model(**call)[0]
    finally:
        spy.remove()
        monkeypatch.undo()
    kinds = ("full", "frame", "video_to_text")
    with cogattn.record(model, kinds=kinds, heads="all", layers="all") as rec, torch.no_grad():
        got = model(**call)[0]
    assert torch.equal(got, stock) and rec.layout == layout
    for layer in range(2):
        ((q, k, v, mask, out),) = spy.calls[0][(layer, "self")]
        P = spy_probs(q, k, mask)
        assert (P @ v.double() - out.double()).abs().max() < 1e-5  # the reference is the model's attention
        for kind in kinds:
            want = naive_kind(P, kind, layout.text_len, layout.grid)
            assert (rec.get(kind, 0, layer).double() - want).abs().max() < 1e-5, (kind, layer)


def test_the_modular_pipeline_is_recorded_by_its_transformer_and_the_refiner_is_no_layer():
    """``record(pipe)`` finds the modular pipeline's ``transformer``; one call a step, each step's time the
    generated video's noise level σ = 1 − t (t the scheduler's, up from 0 to 1); the token refiner's attentions keep diffusers' processor."""
    pipe = minimax.tiny_pipeline()
    call = minimax.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    refiner = pipe.transformer.token_refiner.refiner_blocks[0].attn
    with cogattn.record(pipe, kinds=("entropy",), steps="all") as rec:
        assert type(refiner.processor).__name__ == "MiniMaxH3AttnProcessor"
        pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1))
    assert rec.layer_names == ("transformer_blocks.0.attn", "transformer_blocks.1.attn")
    assert rec.timesteps == [1.0 - float(t) for t in pipe.scheduler.timesteps] and len(rec.timesteps) == 2
    assert rec.layout.text_len == minimax.TINY_TEXT + 16 and rec.batch_items == (0,)
    with pytest.raises(ValueError, match="name no layer"):
        cogattn.Recording(pipe, kinds=("entropy",), layers=["token_refiner.refiner_blocks.0.attn"])
    with pytest.raises(ValueError, match="audio is no stream of its own"):
        cogattn.Recording(pipe, kinds=("audio",))


def test_the_ref2va_denoiser_s_transformer_ref_is_recorded_from_the_pipeline(monkeypatch):
    """ref2va's denoiser runs the pipeline's ``transformer_ref``: ``record(pipe)`` follows it as the pipeline's other
    transformer (``rec.experts``), each map the naive softmax of its own call (the tiny pipeline's t2va denoisers
    pointed at it: the tiny pipeline has no reference encoders)."""
    import copy

    pipe = minimax.tiny_pipeline()
    pipe.update_components(transformer_ref=copy.deepcopy(pipe.transformer))
    todo, denoisers = [pipe._blocks, pipe._denoiser], []  # the whole pipeline's, and a call with embeddings' own
    while todo:
        block = todo.pop()
        denoisers += [block] * hasattr(block, "transformer_name")
        todo += list((getattr(block, "sub_blocks", None) or {}).values())
    for block in denoisers:
        monkeypatch.setattr(block, "transformer_name", "transformer_ref")
    call = minimax.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), False)
    holder = types.SimpleNamespace(transformer=pipe.transformer_ref)
    spying = pytest.MonkeyPatch()  # undone after the stock run; the denoisers stay pointed at transformer_ref
    spy = AttentionSpy(holder, minimax.SPEC, spying)
    try:
        stock = pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1)).frames
    finally:
        spy.remove()
        spying.undo()
    with cogattn.record(pipe, kinds=("frame",), steps="all") as rec:
        got = pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1)).frames
    assert torch.equal(got, stock) and rec.experts == ["transformer_ref"] * 2 and len(spy.calls) == 2
    for step in range(2):
        for layer in range(2):
            ((q, k, _, mask, _),) = spy.calls[step][(layer, "self")]
            want = naive_kind(
                spy_probs(q, k, mask).mean(1, keepdim=True), "frame", rec.layout.text_len, rec.layout.grid
            )
            assert (rec.get("frame", step, layer).double() - want).abs().max() < 1e-5


def test_word_labels_are_the_prompt_alone_after_the_presentation_s_vision_blocks():
    """The pipeline tokenizes the prompt verbatim, no special tokens (its text encoder step's call); the labels put
    it after ``prompt_start`` (``image_len``: the keyframes' labels and vision blocks) and name the keyframe and audio
    tokens after it as padding."""
    from cogattn.analysis import words

    tokenizer, prompt = tiny_tokenizer(), "a red fox"
    pipeline = types.SimpleNamespace(tokenizer=tokenizer, transformer=minimax.tiny_transformer())
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # MiniMaxH3TextEncoderStep's
    assert minimax.prompt_text(pipeline, prompt, 5).ids == ids + [tokenizer.pad_token_id] * 2
    tokenizer.padding_side = "left"  # the keyframe and audio tokens follow the prompt, whatever the tokenizer's side
    assert minimax.prompt_text(pipeline, prompt, 5).ids == ids + [tokenizer.pad_token_id] * 2
    names = words.text_tokens(pipeline, prompt, 8, prompt_start=2)
    assert names == ["<image>", "<image>", "a", "red", "fox", "<pad>", "<pad>", "<pad>"]
    assert words.word_positions("red fox", pipeline, prompt, 8, prompt_start=2) == [3, 4]


def test_a_released_checkpoint_is_planned_offline_and_its_frame_counts_are_the_pipeline_s():
    """141 frames at 768×1344: 42 latent frames of 24×42 patches after 128 prompt and 2·235 audio tokens; a frame
    count the pipeline rounds plans the rounded one, and the batch tool asks for 17n + 5."""
    est = cogattn.estimate(
        "MiniMaxAI/MiniMax-H3", num_frames=141, height=768, width=1344, num_inference_steps=40, kinds=("frame",)
    )
    assert est.layout.seq_len == 42 * 24 * 42 + 128 + 470 and est.layout.grid == (42, 24, 42)
    layers = minimax.KNOWN["MiniMaxAI/MiniMax-H3"]["num_layers"]  # 40 grid points, 39 model calls (the scheduler's)
    assert est.num_records == 39 * layers
    # guidance-distilled, whatever guidance_scale says: one item, and batch="cond" refused as a recording refuses it
    size = dict(num_frames=141, height=768, width=1344, num_inference_steps=2, kinds=("frame",), guidance_scale=6.0)
    assert [shape[0] for _, shape, _, _ in cogattn.estimate("MiniMaxAI/MiniMax-H3", **size, batch="all").records] == [1]
    with pytest.raises(ValueError, match="runs without classifier-free guidance"):
        cogattn.estimate("MiniMaxAI/MiniMax-H3", **size, batch="cond")
    config = minimax.KNOWN["MiniMaxAI/MiniMax-H3"]
    assert minimax.layout_for_video(config, 130, 768, 1344, 7) == minimax.layout_for_video(config, 141, 768, 1344, 7)
    with pytest.raises(ValueError, match="17n \\+ 5"):
        minimax.call_rules(types.SimpleNamespace(num_frames=125, tiny_spec=lambda: None), config)
    # the batch tool's call: no guidance (distilled) and no diffusers offload (a modular pipeline has none)
    call = dict(num_frames=141, tiny_spec=lambda: None, guidance_scale=1.0, offload="none")
    minimax.call_rules(types.SimpleNamespace(**call), config)
    with pytest.raises(ValueError, match="guidance-distilled .* set guidance_scale: 1.0"):
        minimax.call_rules(types.SimpleNamespace(**dict(call, guidance_scale=6.0)), config)
    with pytest.raises(ValueError, match="no diffusers CPU offload: set offload: none"):
        minimax.call_rules(types.SimpleNamespace(**dict(call, offload="model")), config)


def test_the_layout_maps_pixel_frames_as_the_vae_encodes_its_clips():
    """The VAE encodes 17-frame clips on their own, each causal: a change to pixel frame j first changes the latent
    frame that layout.pixel_frames gives it, and no latent frame of another clip (a float64 tiny VAE, its own
    encoder); the decoded count is the layout's, and a call's layout carries the clips."""
    from cogattn.models.minimax_h3.tiny import _tiny_vaes

    vae = _tiny_vaes(0, torch.float64)[0].eval()  # the tiny pipeline's video VAE, in float64
    lay = minimax.layout_for_video(minimax.KNOWN["MiniMaxAI/MiniMax-H3"], 39, 32, 32, 4)
    assert (lay.frames, lay.clip_latents, lay.decoded_frames(), lay.default_pixel_frames) == (12, 5, [39], 39)
    ranges = lay.pixel_frames(39)
    assert [len(r) for r in ranges[:6]] == [1, 4, 4, 4, 4, 1] and ranges[-1] == range(35, 39)
    with pytest.raises(ValueError, match="never 37"):
        lay.pixel_frames(37)
    x = torch.randn(1, 3, 39, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        base = vae.encode(x).latent_dist.mean
        assert vae.decode(base.float().double(), return_dict=False)[0].shape[2] == 39
        latent_of = lay.latent_of_pixel(39)
        for j in (0, 1, 4, 5, 16, 17, 18, 21, 22, 34, 35, 38):
            y = x.clone()
            y[:, :, j] += 1.0
            changed = (vae.encode(y).latent_dist.mean - base).abs().amax(dim=(0, 1, 3, 4)).nonzero().flatten()
            clip = latent_of[j] // 5
            assert int(changed[0]) == latent_of[j] and int(changed[-1]) < 5 * (clip + 1), (j, changed.tolist())


def test_a_checkpoint_folder_loads_the_t2va_components_in_the_dtype_asked(tmp_path):
    """The batch tool's loading (``ModelSpec.load_pipeline``) of a modular checkpoint saved as diffusers saves one:
    the pipeline class its index names, the t2va workflow's components (no transformer_ref), in the dtype asked.
    (The folder holds no processor: Qwen3-VL's needs torchvision to load; a released checkpoint's has one.)"""
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline

    tiny = minimax.tiny_pipeline()
    names = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler")
    saved = MiniMaxH3ModularPipeline(blocks=MiniMaxH3Blocks())
    saved.update_components(**{name: getattr(tiny, name) for name in names})
    saved.save_pretrained(str(tmp_path / "minimax-h3"))
    pipe = minimax.SPEC.load_pipeline(str(tmp_path / "minimax-h3"), "text-to-video", torch.bfloat16)
    assert type(pipe) is MiniMaxH3ModularPipeline and getattr(pipe, "transformer_ref", None) is None
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    loaded = pipe.transformer.state_dict()  # the model's float32 modules stay float32
    for name, param in tiny.transformer.state_dict().items():
        assert torch.equal(loaded[name], param.to(loaded[name].dtype)), name


def test_the_soundtrack_is_written_from_any_device_and_a_wrong_shape_refused(tmp_path, monkeypatch):
    """``audio.wav``: 16-bit PCM of the clamped samples (NaN silent), channels and rate as given; a tensor that is
    not ``(1, channels, samples)`` is refused; a diffusers without modular pipelines is no modular pipeline."""
    import wave

    import diffusers

    from cogattn.dump import generate as gen

    samples = torch.tensor([[[0.5, -2.0, float("nan")], [1.0, -0.25, 0.0]]], dtype=torch.bfloat16)
    gen._save_audio(samples, 8000, tmp_path / "a.wav")
    with wave.open(str(tmp_path / "a.wav")) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (2, 2, 8000, 3)
        got = torch.frombuffer(bytearray(f.readframes(3)), dtype=torch.int16).view(3, 2).T
    assert got.tolist() == [[16384, -32767, 0], [32767, -8192, 0]]
    with pytest.raises(ValueError, match="not \\(1, channels, samples\\)"):
        gen._save_audio(samples[0], 8000, tmp_path / "b.wav")
    monkeypatch.delattr(diffusers, "ModularPipeline")
    assert not gen._modular(object())
