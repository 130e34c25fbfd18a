"""Cosmos 3's own rules (tests/test_families.py holds every kind of its tiny pipeline to the reference): the two calls
of a layer recorded as one S × S map (causal text rows, video rows over every key) with each key/value head repeated
for its query heads, a bare transformer's call, the two guidance calls of texts of different lengths, the refusals,
and the estimate at the released shape."""

import pytest
import torch

import cogattn
from cogattn.analysis import words
from cogattn.recorder import guiders

cosmos3 = pytest.importorskip("cogattn.models.cosmos3", reason="this diffusers lacks Cosmos 3 (it needs 0.42)")
modular_blocks = pytest.importorskip("diffusers.modular_pipelines.cosmos.modular_blocks_cosmos3")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe():
    return cosmos3.tiny_pipeline(num_heads=4, kv_heads=2)


def run(pipe, guided=True, **more):
    call = cosmos3.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), guided)
    call.update(num_inference_steps=2, output_type="pt", **more)
    return pipe(**call, generator=torch.Generator().manual_seed(1)).video


def layer_inputs(transformer):
    """A forward hook keeping each layer attention's inputs ``(und_seq, gen_seq, rotary_emb)`` of every call, each
    proved by :func:`reference` against the module's own output."""
    seen = []

    def hook(module, args, output):
        reference(module, *args, output=output)
        seen.append((module, args))

    handles = [layer.self_attn.register_forward_hook(hook) for layer in transformer.layers]
    return seen, handles


def reference(attn, und_seq, gen_seq, rotary_emb, output=None):
    """The naive float64 S × S probabilities ``(H, S, S)`` of one layer, from the module's own projections: the text's
    causal softmax over its keys, the video's over every key, each key head serving its group of query heads. With the
    module's ``output`` ``(text, video)``: its P·V through the two output projections is that output."""
    H, Hkv, D = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    cu, su, cg, sg = (x.double()[:, None] for x in rotary_emb)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    with torch.no_grad():
        qt = rope(attn.norm_q(attn.to_q(und_seq).view(-1, H, D)).double(), cu, su)
        kt = rope(attn.norm_k(attn.to_k(und_seq).view(-1, Hkv, D)).double(), cu, su)
        qv = rope(attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, H, D)).double(), cg, sg)
        kv = rope(attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, Hkv, D)).double(), cg, sg)
    q, k = torch.cat([qt, qv]), torch.cat([kt, kv])
    k = k[:, torch.arange(H) // (H // Hkv)]  # query head h reads key head h // group
    scores = torch.einsum("shd,thd->hst", q, k) / D**0.5
    T, S = len(qt), len(q)
    keep = torch.ones(S, S, dtype=torch.bool).tril() | (torch.arange(S) >= T)[:, None]
    P = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    if output is not None:
        with torch.no_grad():
            v = torch.cat([attn.to_v(und_seq).view(-1, Hkv, D), attn.add_v_proj(gen_seq).view(-1, Hkv, D)]).double()
            pv = torch.einsum("hst,thd->shd", P, v[:, torch.arange(H) // (H // Hkv)]).flatten(1).to(und_seq.dtype)
            for got, out in zip(output, (attn.to_out(pv[:T]), attn.to_add_out(pv[T:]))):
                assert (got - out).abs().max() < 1e-5
    return P


def test_a_bare_transformer_records_the_two_calls_as_one_map(pipe):
    """``record(transformer)`` on the pipeline's first call: ``full`` is the text's causal rows (0 on the video keys)
    and the video's rows over every key, with grouped key heads, to float64's naive softmax of the module's q, k."""
    transformer, kwargs = pipe.transformer, {}

    def grab(module, args, named):
        kwargs.setdefault("call", named)

    handle = transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        run(pipe, guided=False)
    finally:
        handle.remove()
    call = kwargs["call"]
    seen, handles = layer_inputs(transformer)
    try:
        stock = transformer(**call)[0]
    finally:
        for h in handles:
            h.remove()
    with cogattn.record(transformer, kinds=("full", "video_to_text"), heads="all") as rec:
        got = transformer(**call)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, stock))
    T, lay = call["und_len"], rec.layout
    assert (lay.text_len, lay.grid, rec.batch_items) == (T, (3, 2, 3), (0,))
    for layer, (attn, args) in enumerate(seen):
        want = reference(attn, *args)
        full = rec.get("full", 0, layer)[0].double()
        assert (full - want).abs().max() < 1e-5
        assert full[:, :T, T:].abs().max() == 0  # the causal text never reads the video
        assert torch.equal(full[:, :T, :T], full[:, :T, :T].tril())
        to_text = rec.get("video_to_text", 0, layer)[0].double().flatten(2)  # (H, T, F·Hp·Wp)
        assert (to_text - want[:, T:, :T].transpose(1, 2)).abs().max() < 1e-5


def test_guidance_numbers_the_calls_and_texts_of_other_lengths_record_the_prompts(pipe):
    """The prompt's call, then the negative prompt's: slots ``[uncond, cond]``; a negative prompt of another length
    records the prompt's item (``batch="cond"``, the default) and refuses the other in one line."""
    stock = run(pipe)
    with cogattn.record(pipe, kinds=("frame",), batch="all") as rec:
        assert torch.equal(run(pipe), stock)
    assert rec.batch_roles == ("uncond", "cond") and len(rec.timesteps) == 2
    longer = dict(negative_prompt="a red fox running in the snow")
    stock = run(pipe, **longer)
    with cogattn.record(pipe, kinds=("frame",)) as rec:
        assert torch.equal(run(pipe, **longer), stock)
    assert rec.batch_roles == ("cond",) and rec.get("frame", 1, 1).shape == (1, 1, 4, 4)
    with pytest.raises(ValueError, match="negative prompt of the prompt's token count"):
        with cogattn.record(pipe, kinds=("frame",), batch="all"):
            run(pipe, **longer)


def test_the_modular_pipeline_reads_its_guidance_from_its_loop_and_batches_its_calls_as_the_classic_one(pipe):
    """``Cosmos3OmniModularPipeline`` has no guider: its denoising loop keeps the guidance scale in its block state,
    read there. Its two calls a step (the prompt's, then the negative prompt's) are the batch ``[uncond, cond]``, each
    slot the naive softmax of its own call's layer inputs; the video is bit-identical; its loop's method is its own
    again after the recording, and without guidance one call a step is the one item."""
    modular = modular_blocks.Cosmos3OmniBlocks().init_pipeline()
    modular.update_components(**{name: part for name, part in pipe.components.items() if part is not None})
    modular.disable_safety_checker()
    modular.set_progress_bar_config(disable=True)
    (loop,) = [b for b in guiders._loops(modular._blocks) if "vision" in type(b).__name__.lower()][:1]

    def video(guided=True):
        call = cosmos3.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), guided)
        call.pop("enable_safety_check")
        call.update(num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="pt")
        return modular(**call, output="videos")

    stock = video()
    seen, handles = layer_inputs(modular.transformer)
    try:
        with cogattn.record(modular, kinds=("full",), batch="all", heads="all") as rec:
            assert "loop_step" in vars(loop)
            got = video()
    finally:
        for h in handles:
            h.remove()
    assert "loop_step" not in vars(loop) and torch.equal(got, stock)
    assert rec.batch_roles == ("uncond", "cond") and len(rec.timesteps) == 2 and len(seen) == 2 * 2 * 2
    for n, (attn, args) in enumerate(seen):  # per step: the prompt's call's layers, then the negative prompt's
        step, call, layer = n // 4, n // 2 % 2, n % 2
        full = rec.get("full", step, layer)[1 - call].double()
        assert (full - reference(attn, *args)).abs().max() < 1e-5, (step, call, layer)
    with cogattn.record(modular, kinds=("frame",)) as rec:
        video(guided=False)
    assert rec.batch_roles == (None,) and len(rec.timesteps) == 2


def test_refusals_in_one_line(pipe):
    for kind in ("text_to_video", "video_to_image", "audio_frame"):
        with pytest.raises(ValueError, match=f"kind '{kind}' does not exist for cosmos3"):
            cogattn.Recording(pipe, kinds=(kind,))
    config = dict(pipe.transformer.config)
    base = dict(und_len=4, sequence_length=22, vision_token_shapes=[(3, 2, 3)], vision_timesteps=torch.ones(18))
    base["vision_sequence_indexes"] = torch.arange(4, 22)
    layout, batch, t, _ = cosmos3.read_call(config, (), base)
    assert (layout.seq_len, layout.text_len, batch, t) == (22, 4, 1, 1.0)
    with pytest.raises(ValueError, match="sound tokens after the video"):
        cosmos3.read_call(config, (), {**base, "sound_tokens": [torch.zeros(1)], "sound_sequence_indexes": 0})
    with pytest.raises(ValueError, match="action tokens after the video"):
        cosmos3.read_call(config, (), {**base, "action_tokens": [torch.zeros(1)], "action_sequence_indexes": 0})
    with pytest.raises(ValueError, match="keys of their own"):
        cosmos3.read_call({**config, "use_und_k_norm_for_gen": True, "qk_norm_for_text": False}, (), base)
    with pytest.raises(ValueError, match="the text, then the video"):
        cosmos3.read_call(config, (), {**base, "sequence_length": 23})


def test_the_estimate_of_the_released_checkpoint():
    """nvidia/Cosmos3-Nano at 189 frames of 720×1280: 48 latent frames of 23 × 40 patches (45 latent rows padded to
    whole patches) after the text; 36 layers of 32 query heads of 128."""
    shape = dict(num_frames=189, height=720, width=1280, text_len=300, num_inference_steps=35)
    est = cogattn.estimate("nvidia/Cosmos3-Nano", **shape, kinds=("entropy",))
    assert est.layout.grid == (48, 23, 40) and est.layout.seq_len == 300 + 48 * 23 * 40
    assert (
        "S = 44,460" in est.table()
        and "method rows" in est.table()
        and cogattn.models.transformer_config("nvidia/Cosmos3-Nano")["head_dim"] == 128
    )
    below = cogattn.estimate("nvidia/Cosmos3-Nano", **shape, kinds=("frame",), batch="all", guidance_scale=0.5)
    assert below.records[0][1][0] == 2  # the pipeline guides at any scale but 1: both items


def test_word_labels_are_the_pipelines_tokens(pipe):
    """``prompt_text``: the system turn, the prompt as the user's turn, the generation prompt, then the end and
    vision-start tokens: the ids the pipeline's ``tokenize_prompt`` gives a call without the metadata sentences."""
    ids, _ = pipe.tokenize_prompt(
        "a red fox", "", num_frames=9, height=32, width=48, add_resolution_template=False, add_duration_template=False
    )
    text = cosmos3.prompt_text(pipe, "a red fox", len(ids), offsets=True)
    assert text.ids == ids and text.text[slice(*text.prompt)] == "a red fox"
    labels = words.text_tokens(pipe, "a red fox", len(ids))
    assert labels == pipe.text_tokenizer.convert_ids_to_tokens(ids)
    assert words.word_positions("red fox", pipe, "a red fox", len(ids)) == [labels.index("red"), labels.index("fox")]


@pytest.mark.parametrize("num_frames", [9, 1])
def test_word_labels_of_a_call_with_its_metadata_sentences(pipe, num_frames):
    """The pipeline's default call appends its duration (not for an image) and size to the prompt, the inverse ones to
    the negative prompt: given the call's arguments, the labels are ``tokenize_prompt``'s ids of both; without them a
    text of that length is refused in one line; the batch tool passes them."""
    call = dict(num_frames=num_frames, height=32, width=48, fps=16.0)
    ids, negative = pipe.tokenize_prompt("a red fox.", "a blue cat", **call)
    plain, _ = pipe.tokenize_prompt("a red fox.", add_resolution_template=False, add_duration_template=False, **call)
    assert len(ids) > len(plain)  # the sentences
    text = cosmos3.prompt_text(pipe, "a red fox.", len(ids), call, offsets=True)
    assert text.ids == ids and text.text[slice(*text.prompt)] == "a red fox."
    assert ("16 FPS" in text.text) == (num_frames > 1) and "32x48 resolution" in text.text
    labels = words.text_tokens(words.PromptFormat(pipe, call), "a red fox.", len(ids))
    assert labels == pipe.text_tokenizer.convert_ids_to_tokens(ids)
    assert cosmos3.prompt_text(pipe, "a blue cat", len(negative), {**call, "negative": True}).ids == negative
    with pytest.raises(ValueError, match=r"metadata sentences .*PromptFormat\(pipe, dict\(num_frames="):
        words.text_tokens(pipe, "a red fox.", len(ids))
