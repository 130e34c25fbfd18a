"""LTX-2's attentions on its tiny pipelines (``cogattn.models.ltx2.attention``, ``cogattn.models.ltx2.tiny``): the reference
of each of a block's six attentions is proved from the module's own call, and the map processors are diffusers' own.

During a stock run a spy catches every ``dispatch_attention_fn`` call inside each attention module (q, k, v, mask)
and the module's input and output. The naive float64 ``softmax(q kᵀ / √D + mask)`` times v must reproduce the
call's output, and, with the module's per-head gate ``2·sigmoid(to_gate_logits(x))`` and ``to_out`` applied in
float64, the module's output: so the probabilities the maps will hold are the model's, gates and all. The map
processors must leave the video and the audio bit-identical and hand over exactly the q, k and key bias the model
attended with, each attention under its own source.
"""

from __future__ import annotations

import pytest
import torch

ltx2 = pytest.importorskip("cogattn.models.ltx2.attention", reason="this diffusers lacks LTX-2")
from cogattn.layout import TokenLayout  # noqa: E402
from cogattn.models.ltx2 import tiny as _ltx2_tiny  # noqa: E402  (after the skip: it needs the same diffusers)

SOURCES = ltx2.SOURCES
TOL = 1e-5


class Spy:
    """Every attention call of the six attentions of each block: ``calls[n][(layer, attr)]`` is ``(x, context, q,
    k, v, mask, out, module_out)`` of transformer call ``n``: the module's inputs and output, and the attention
    call's q, k, v and out ``(B, H, S, D)`` and mask, as diffusers' processor made them (`None` where it made no
    attention call)."""

    def __init__(self, transformer, monkeypatch, owner):
        self.calls: list[dict] = []
        self.where = None
        self.handles = [transformer.register_forward_pre_hook(lambda *a: self.calls.append({}))]
        for i, block in enumerate(transformer.transformer_blocks):
            for attr in SOURCES:
                module = getattr(block, attr)
                self.handles.append(module.register_forward_pre_hook(self._enter(i, attr), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave))
        real = owner.dispatch_attention_fn

        def spy(query, key, value, attn_mask=None, **kwargs):
            out = real(query, key, value, attn_mask=attn_mask, **kwargs)
            if self.where is not None:
                q, k, v, o = (t.transpose(1, 2).clone() for t in (query, key, value, out))
                mask = None if attn_mask is None else attn_mask.clone()
                self.calls[-1][self.where[0]] = [*self.where[1], q, k, v, mask, o]
            return out

        monkeypatch.setattr(owner, "dispatch_attention_fn", spy)

    def _enter(self, layer, attr):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            self.where = ((layer, attr), [x.clone(), None if context is None else context.clone()])

        return hook

    def _leave(self, module, args, output):
        key, inputs = self.where  # a module whose attention call was skipped (perturbed by STG) has no q, k, v
        self.calls[-1].setdefault(key, [*inputs, None, None, None, None, None]).append(output.clone())
        self.where = None

    def remove(self):
        for h in self.handles:
            h.remove()


class Sink:
    """A `MapSink` that keeps what the map processors hand over: ``(layer, source, q, k, bias)`` in call order (the
    self-attention's bias: its ``QueryKeyBias``)."""

    wants_value = False
    layout = TokenLayout(0, 1, 2, 3)  # the direct calls' grid: no tokens after it

    def __init__(self, transformer, active=lambda: True):
        self.layers = {id(getattr(b, a)): i for i, b in enumerate(transformer.transformer_blocks) for a in SOURCES}
        self.active, self.seen = active, []

    def layer_to_capture(self, attn):
        return self.layers[id(attn)] if self.active() else None

    def attention(self, *args):
        return None

    def capture(self, layer, q, k, lse, sums, key_counts=None, query_counts=None, mask=None, value=None):
        self.seen.append((layer, "self", q.clone(), k.clone(), mask))

    def capture_context(self, layer, q, k, context, bias=None):
        self.seen.append((layer, context, q.clone(), k.clone(), None if bias is None else bias.clone()))


def _run(pipe, task="text-to-video", guided=True, **extra):
    g = torch.Generator().manual_seed(0)
    call = {**_ltx2_tiny.tiny_call(pipe, task, g, guided), "output_type": "pt", **extra}
    return pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1))


def _stock(pipe, monkeypatch, **kwargs):
    from diffusers.models.transformers import transformer_ltx2

    spy = Spy(pipe.transformer, monkeypatch, transformer_ltx2)
    try:
        out = _run(pipe, **kwargs)
    finally:
        spy.remove()
        monkeypatch.undo()
    return out, spy.calls


@pytest.fixture(scope="module")
def pipes():
    made = {}

    def get(task="text-to-video", **size):
        key = (task, tuple(sorted(size.items())))
        if key not in made:
            made[key] = _ltx2_tiny.tiny_pipeline(task, **size)
        return made[key]

    return get


def _linear64(layer, x):
    return torch.nn.functional.linear(x, layer.weight.double(), None if layer.bias is None else layer.bias.double())


def _check(blocks, layer, attr, record, lengths):
    """The float64 reference of one spied call ``record``: its P·V is the attention call's output, and with the
    gate and ``to_out`` the module's; ``lengths``: the (queries, keys) of each attention. Returns P."""
    x, context, q, k, v, mask, out, module_out = record
    attn = getattr(blocks[layer], attr)
    heads, dim = attn.heads, attn.head_dim
    B = q.shape[0]
    assert q.shape == (B, heads, lengths[attr][0], dim) and k.shape == (B, heads, lengths[attr][1], dim), attr
    assert context is None if attr.endswith("attn1") else context.shape[1] == lengths[attr][1]
    scores = q.double() @ k.double().transpose(-1, -2) / dim**0.5
    if attr in ("attn2", "audio_attn2"):  # the text's key bias, 0 or −10000, the same for every head
        assert mask.shape == (B, heads, 1, lengths[attr][1]) and torch.equal(mask, mask[:, :1].expand_as(mask))
        scores = scores + mask.double()
    else:
        assert mask is None, attr
    P = scores.softmax(-1)
    attended = P @ v.double()
    assert (attended - out.double()).abs().max().item() < TOL, (layer, attr)
    # the module's output: each head's output times its gate, then to_out, from the module's own input
    gates = 2.0 * torch.sigmoid(_linear64(attn.to_gate_logits, x.double()))  # (B, S, H)
    assert (gates - 1).abs().max().item() > 0.1  # random gates: one left out would show
    y = _linear64(attn.to_out[0], (attended.transpose(1, 2) * gates[..., None]).flatten(2))
    err = (y - module_out.double()).abs().max().item()
    assert err < TOL * max(1.0, module_out.abs().max().item()), (layer, attr, err)
    return P


def _lengths(V, A, T):
    """(queries, keys) of each attention of a call of V video tokens, A audio bins and T text tokens."""
    return {
        "attn1": (V, V),
        "audio_attn1": (A, A),
        "attn2": (V, T),
        "audio_attn2": (A, T),
        "audio_to_video_attn": (V, A),
        "video_to_audio_attn": (A, V),
    }


@pytest.mark.parametrize("task", ["text-to-video", "image-to-video"])
def test_each_attention_is_its_float64_softmax_times_v_then_the_gate_and_output(pipes, task, monkeypatch):
    pipe = pipes(task)
    _, calls = _stock(pipe, monkeypatch, task=task)
    blocks = pipe.transformer.transformer_blocks
    lengths = _lengths(3 * 2 * 4, 18, _ltx2_tiny.TEXT_LEN)  # the tiny call's video tokens, audio bins, text
    assert len(calls) == 2 and all(len(c) == len(blocks) * len(SOURCES) for c in calls)  # one call a step, guided
    for call in calls:
        for (layer, attr), record in call.items():
            _check(blocks, layer, attr, record, lengths)
            if attr in ("attn2", "audio_attn2"):  # the registers fill the padding: every text key kept
                assert not record[5].any(), record[5]


def _direct_call(transformer, text_mask=None):
    """A transformer call of its own (1 latent frame of 2 × 3, 5 audio bins, 4 text tokens), with ``text_mask`` as
    the text's key mask ``(1, 4)``."""
    g = torch.Generator().manual_seed(0)
    width = transformer.config.caption_channels
    return dict(
        hidden_states=torch.randn(1, 6, transformer.config.in_channels, generator=g),
        audio_hidden_states=torch.randn(1, 5, transformer.config.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 4, width, generator=g),
        audio_encoder_hidden_states=torch.randn(1, 4, width, generator=g),
        timestep=torch.tensor([500.0]),
        encoder_attention_mask=text_mask,
        audio_encoder_attention_mask=text_mask,
        num_frames=1,
        height=2,
        width=3,
        audio_num_frames=5,
    )


def _masked_direct_call(transformer, monkeypatch):
    """A direct call of ``transformer`` under a text key mask: its inputs, its stock output and what each attention
    module got (the spy's one call)."""
    inputs = _direct_call(transformer, text_mask=torch.tensor([[0, 1, 1, 0]]))
    return (inputs, *_spied(transformer, inputs, monkeypatch))


def _spied(transformer, inputs, monkeypatch):
    """The stock output of ``transformer(**inputs)`` and what each attention module got (the spy's one call)."""
    from diffusers.models.transformers import transformer_ltx2

    spy = Spy(transformer, monkeypatch, transformer_ltx2)
    try:
        stock = transformer(**inputs, return_dict=False)
    finally:
        spy.remove()
        monkeypatch.undo()
    (call,) = spy.calls
    return stock, call


def _mapped_call(transformer, inputs, stock):
    """A :class:`Sink` of ``transformer(**inputs)`` under the map processors, whose output must be ``stock``'s."""
    sink = Sink(transformer)
    saved = _install(transformer, sink)
    try:
        mapped = transformer(**inputs, return_dict=False)
    finally:
        _restore(transformer, saved)
    assert all(torch.equal(a, b) for a, b in zip(mapped, stock))
    return sink


def test_a_text_key_mask_is_added_as_the_model_adds_it_and_handed_over(pipes, monkeypatch):
    transformer = pipes().transformer
    blocks = transformer.transformer_blocks
    inputs, stock, call = _masked_direct_call(transformer, monkeypatch)
    for (layer, attr), record in call.items():
        P = _check(blocks, layer, attr, record, _lengths(6, 5, 4))
        if attr in ("attn2", "audio_attn2"):
            assert torch.equal(record[5][0, 0, 0], torch.tensor([-10000.0, 0.0, 0.0, -10000.0]))
            assert bool((P[..., [0, 3]] == 0).all())  # a masked text key: exactly 0
    sink = _mapped_call(transformer, inputs, stock)
    for ((layer, attr), record), (got_layer, source, q, k, bias) in zip(call.items(), sink.seen, strict=True):
        assert (got_layer, source) == (layer, SOURCES[attr]) and torch.equal(q, record[2]) and torch.equal(k, record[3])
        mask = record[5]
        assert (bias is None) if mask is None else torch.equal(bias, mask[:, 0, 0].float()), (layer, attr)


def _install(transformer, sink):
    stock = {}
    for name, proc in ltx2.map_processors(transformer, sink).items():
        module = transformer.get_submodule(name)
        stock[name] = module.processor
        module.set_processor(proc)
    return stock


def _restore(transformer, stock):
    for name, proc in stock.items():
        transformer.get_submodule(name).set_processor(proc)


def test_map_processors_keep_the_output_and_hand_over_the_models_q_k_and_bias(pipes, monkeypatch):
    pipe = pipes()
    stock, calls = _stock(pipe, monkeypatch)
    sink = Sink(pipe.transformer)
    saved = _install(pipe.transformer, sink)
    try:
        mapped = _run(pipe)
    finally:
        _restore(pipe.transformer, saved)
    assert torch.equal(mapped.frames, stock.frames) and torch.equal(mapped.audio, stock.audio)
    expected = [(key, got) for call in calls for key, got in call.items()]  # in the model's call order
    assert len(sink.seen) == len(expected) == 2 * 2 * len(SOURCES)
    for ((layer, attr), spied), (got_layer, source, q, k, bias) in zip(expected, sink.seen):
        assert (got_layer, source) == (layer, SOURCES[attr])
        assert torch.equal(q, spied[2]) and torch.equal(k, spied[3]), (layer, attr)
        mask = spied[5]
        assert (bias is None) if mask is None else torch.equal(bias, mask[:, 0, 0].float()), (layer, attr)


def test_a_perturbed_call_is_not_captured_and_the_output_is_stock(pipes, monkeypatch):
    pipe = pipes(perturbed=True)
    stg = dict(stg_scale=1.0, audio_stg_scale=1.0, spatio_temporal_guidance_blocks=[1])
    stock, calls = _stock(pipe, monkeypatch, **stg)
    assert len(calls) == 4  # the guidance call and the STG call, each step
    perturbed = []
    pipe.transformer.register_forward_pre_hook(  # the pipeline's STG calls name the blocks they perturb
        lambda m, a, kw: perturbed.append(bool(kw.get("spatio_temporal_guidance_blocks"))), with_kwargs=True
    )
    sink = Sink(pipe.transformer, active=lambda: not perturbed[-1])
    saved = _install(pipe.transformer, sink)
    try:
        mapped = _run(pipe, **stg)
        assert torch.equal(mapped.frames, stock.frames) and torch.equal(mapped.audio, stock.audio)
        unperturbed = [(key, got) for call, p in zip(calls, perturbed) if not p for key, got in call.items()]
        assert perturbed == [False, True, False, True] and len(sink.seen) == len(unperturbed)
        for (_, spied), (_, _, q, k, _) in zip(unperturbed, sink.seen):
            assert torch.equal(q, spied[2]) and torch.equal(k, spied[3])
        sink.active = lambda: True  # a sink that would capture the STG call too
        with pytest.raises(ValueError, match="perturbed by spatio-temporal guidance"):
            _run(pipe, **stg)
    finally:
        _restore(pipe.transformer, saved)
        pipe.transformer._forward_pre_hooks.clear()


def test_refusals(pipes):
    transformer = pipes().transformer
    sink = Sink(transformer)
    with pytest.raises(ValueError, match="source='audio_to_video'"):
        ltx2.LTX2AttnMapProcessor(sink, "audio_to_video")
    saved = _install(transformer, sink)
    try:
        with pytest.raises(TypeError, match="runs a LTX2AttnMapProcessor"):
            ltx2.map_processors(transformer, sink)
    finally:
        _restore(transformer, saved)


def test_the_ic_lora_mask_is_handed_over_as_the_bias_the_model_adds(pipes, monkeypatch):
    """``video_self_attention_mask`` (IC-LoRA's strengths in [0, 1]) is added by the video self-attention as
    −10000·(1 − m), per head: the float64 reference with it reproduces the call's output, the map processors keep the
    output bit-identical and hand over that bias once for every head, as a ``QueryKeyBias`` in the model's order."""
    transformer = pipes().transformer
    inputs = _direct_call(transformer)
    strength = torch.ones(1, 6, 6)
    strength[:, :4, 4:], strength[:, 4:, :4] = 0.9998, 0.9998  # 2 tokens as references: a bias of −2
    inputs["video_self_attention_mask"] = strength
    stock, call = _spied(transformer, inputs, monkeypatch)
    sink = _mapped_call(transformer, inputs, stock)
    selfs = [(layer, got) for layer, source, *_, got in sink.seen if source == "self"]
    assert len(selfs) == 2
    for layer, got in selfs:
        x, context, q, k, v, mask, out, module_out = call[(layer, "attn1")]
        assert torch.equal(mask, mask[:, :1].expand_as(mask)) and got.order is None
        assert torch.equal(got.bias, mask[:, 0]) and abs(float(mask.min()) + 2.0) < 1e-2
        P = (q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5 + mask.double()).softmax(-1)
        assert (P @ v.double() - out.double()).abs().max().item() < TOL  # the reference is the model's attention


@pytest.mark.parametrize("perturbed", [False, True])
def test_a_recording_keeps_each_step_s_guidance_call_and_leaves_the_perturbed_calls_out(pipes, perturbed, monkeypatch):
    """The pipeline's defaults add a spatio-temporal guidance call and a modality-isolation call after each step's
    guidance call, at the same timestep: the recording's steps are the guidance calls', its maps theirs (blocks of
    ``LTX2PerturbedAttnProcessor`` too, whose STG call skips block 1's self-attentions)."""
    import cogattn

    pipe = pipes(perturbed=True) if perturbed else pipes()
    extra = dict(stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0, audio_modality_scale=3.0)
    extra["spatio_temporal_guidance_blocks"] = [1]
    stock, calls = _stock(pipe, monkeypatch, **extra)
    assert len(calls) == 6  # each step: the guidance call (2 items), then STG's and modality isolation's (1 each)
    with cogattn.record(pipe, kinds=("full", "video_to_text"), batch="all", heads="all") as rec:
        got = _run(pipe, **extra)
    assert torch.equal(got.frames, stock.frames) and torch.equal(got.audio, stock.audio)
    assert len(rec.timesteps) == 2 and rec.batch_items == (0, 1)
    for step in range(2):
        for layer in range(2):
            q, k = calls[3 * step][(layer, "attn1")][2:4]
            P = (q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
            assert (rec.get("full", step, layer).double() - P).abs().max().item() < TOL
            q, k = calls[3 * step][(layer, "attn2")][2:4]
            P = (q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)  # (B, H, V, T)
            want = P.transpose(-1, -2).reshape(*P.shape[:2], P.shape[-1], *rec.layout.grid)
            assert (rec.get("video_to_text", step, layer).double() - want).abs().max().item() < TOL


def test_a_call_is_read_as_the_video_grid_alone_and_the_perturbed_calls_are_named():
    from cogattn.models import ltx2 as family

    config = {"patch_size": 1, "patch_size_t": 1, "vae_scale_factors": [8, 32, 32]}
    call = dict(hidden_states=torch.zeros(2, 24, 4), encoder_hidden_states=torch.zeros(2, 8, 16))
    call["audio_hidden_states"] = torch.zeros(2, 18, 4)  # round(17 / 24 · 25) bins, as the pipeline makes them
    call.update(timestep=torch.tensor([900.0, 900.0]), num_frames=3, height=2, width=4)
    layout, batch, t, _ = family.read_call(config, (), call)
    assert (layout.grid, layout.text_len, layout.context_len, layout.temporal_compression) == ((3, 2, 4), 0, 8, 8)
    assert (batch, float(t)) == (2, 900.0)
    assert layout == family.layout_for_video(config, 17, 64, 128, 8)
    call["timestep"] = torch.tensor([[0.0] * 8 + [900.0] * 16] * 2)  # image-to-video: 0 on the image's frame
    assert float(family.read_call(config, (), call)[2]) == 900.0
    call["hidden_states"] = torch.zeros(2, 24 + 8, 4)  # a keyframe condition's tokens appended after the grid
    keyframe = family.read_call(config, (), call)[0]
    assert (keyframe.history_len, keyframe.grid, keyframe.video_len) == (8, (3, 2, 4), 32)
    call["hidden_states"] = torch.zeros(2, 20, 4)
    with pytest.raises(ValueError, match="has 20 video tokens, fewer than its grid \\(3, 2, 4\\) holds \\(24\\)"):
        family.read_call(config, (), call)
    assert family.extra_call((), dict(spatio_temporal_guidance_blocks=[28])) == "spatio-temporal guidance"
    assert family.extra_call((), dict(isolate_modalities=True)) == "modality isolation"
    assert family.extra_call((), dict(spatio_temporal_guidance_blocks=None, isolate_modalities=False)) is None


def test_a_layer_name_of_an_audio_attention_is_refused_naming_its_kind_and_layer(pipes):
    import cogattn

    pipe = pipes()
    with pytest.raises(ValueError, match="'transformer_blocks.1.audio_attn1' is LTX-2's audio self-attention, no layer "
                       "of its own: its maps are kind 'audio' of the block's layer, transformer_blocks.<i>.attn1"):  # fmt: skip
        cogattn.Recording(pipe, kinds=("entropy",), layers=["transformer_blocks.1.audio_attn1"])
    with pytest.raises(ValueError, match="cross-attention of the audio queries to the video.*'audio_frame'"):
        cogattn.estimate("Lightricks/LTX-2", num_frames=121, height=512, width=768, num_inference_steps=30,
                         kinds=("entropy",), layers=["transformer_blocks.0.video_to_audio_attn"])  # fmt: skip
    rec = cogattn.Recording(pipe, kinds=("entropy",), layers=["transformer_blocks.1.attn1"])
    assert rec.options.layers == (1,)
    rec.close()


@pytest.mark.parametrize(
    "kind, says",
    [
        ("frame", "off the latent grid"),
        ("offset", "off it"),
        ("frame_max", "off the latent grid"),
        ("pattern_recall", "off the latent grid"),
        ("audio_frame", "share the softmax"),
    ],
)
def test_kinds_that_need_the_grid_refuse_a_keyframe_s_tokens_in_one_line(pipes, kind, says):
    """LTX2ConditionPipeline appends the latents of a condition placed after frame 0 to the video's tokens (a
    condition at frame 0 is the grid's first frame; every kind of both is tests/test_families.py's): the kinds that
    place every video token on the grid, or sum the video keys per latent frame, refuse the call in one line."""
    import PIL.Image
    from diffusers import LTX2ConditionPipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    import cogattn

    pipe = LTX2ConditionPipeline(**pipes().components)
    pipe.set_progress_bar_config(disable=True)
    image = PIL.Image.new("RGB", (128, 64), (200, 40, 40))
    call = _ltx2_tiny.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    condition = LTX2VideoCondition(frames=image, index=2, crf=0)
    with pytest.raises(ValueError, match=f"8 video (tokens|keys) of this layout.*{says}") as err:
        with cogattn.record(pipe, kinds=(kind,), patterns=("spatial",) if kind.startswith("pattern_") else ()):
            pipe(conditions=[condition], **call, num_inference_steps=1, output_type="latent")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pipeline", ["LTX2InContextPipeline", "LTX2ConditionPipeline"])
def test_the_batch_tool_refuses_a_checkpoint_of_a_conditioned_pipeline_in_one_line(tmp_path, pipeline):
    """A checkpoint folder whose ``model_index.json`` names the in-context (IC-LoRA) or condition pipeline: the batch
    tool passes no reference or keyframe conditions from a config, so its config is refused before anything loads;
    the same folder as an ``LTX2Pipeline`` checkpoint is taken."""
    import json

    from cogattn.dump.config import ConfigError, load_config
    from cogattn.models import ltx2 as family

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(family.KNOWN["Lightricks/LTX-2"]))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    config = tmp_path / "ltx2.yaml"
    config.write_text(f"model: {tmp_path}\nnum_frames: 121\nheight: 512\nwidth: 768\n")
    with pytest.raises(ConfigError, match=f"is a {pipeline} checkpoint; .* record {pipeline} from Python") as err:
        load_config(config)
    assert "\n" not in str(err.value)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))
    assert load_config(config).family == "ltx2"
