"""SANA-Video's own rules (tests/test_families.py holds its tiny pipelines' video_to_text to the reference): its
linear self-attention is no capture site and every kind of it is refused in one line, its softmax cross-attention
under the text's key mask is recorded exactly (the naive float64 softmax of the module's own q and k, the bias
added), from a pipeline and from a bare transformer, in one batched call per step under guidance; the word labels
are the tokens the transformer reads through the instruction template; the released shapes plan offline."""

from types import SimpleNamespace

import pytest
import torch

import cogattn
from cogattn.analysis.words import PromptFormat, text_tokens, word_positions
from cogattn.exact.reducers import REDUCERS
from cogattn.reference import naive_context

sana_video = pytest.importorskip("cogattn.models.sana_video", reason="this diffusers lacks SANA-Video (it needs 0.36)")
SPEC = sana_video.SPEC
GRID = (3, 2, 4)  # the tiny call's 9 frames of 32×64


@pytest.fixture(scope="module")
def pipe():
    return sana_video.tiny_pipeline(num_heads=3)


def _generate(pipe, guided=True, **more):
    call = sana_video.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), guided)
    call.update(more)
    return pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="pt").frames


class _Calls:
    """Every ``attn2`` call of a run: ``(layer, hidden_states, text, bias, output)``, and the transformer's calls."""

    def __init__(self, transformer):
        self.seen, self.batches = [], []
        self.handles = [transformer.register_forward_pre_hook(lambda m, a: self.batches.append(a[0].shape[0]))]
        for layer, block in enumerate(transformer.transformer_blocks):
            self.handles.append(block.attn2.register_forward_hook(self._keep(layer), with_kwargs=True))

    def _keep(self, layer):
        def hook(module, args, kwargs, output):
            text, bias = kwargs["encoder_hidden_states"], kwargs["attention_mask"]
            self.seen.append((layer, args[0].clone(), text.clone(), bias[:, 0].clone(), output.clone()))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _reference(attn, hidden, text, bias):
    """The float64 probabilities ``(B, H, V, C)`` of SANA-Video's cross-attention from the module's own projections
    and norms, the bias added to every score; and the module's output they make (checked against the call's)."""
    with torch.no_grad():
        q, k, v = attn.norm_q(attn.to_q(hidden)), attn.norm_k(attn.to_k(text)), attn.to_v(text)
        q, k, v = (x.double().unflatten(-1, (attn.heads, -1)).transpose(1, 2) for x in (q, k, v))
        P = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias.double()[:, None, None, :]).softmax(-1)
        out = attn.to_out[0]((P @ v).transpose(1, 2).flatten(2).float())
    return P, out


def test_the_cross_attention_is_the_only_site_and_the_linear_self_attention_stays_stock(pipe):
    from diffusers.models.transformers.transformer_sana_video import SanaAttnProcessor2_0, SanaLinearAttnProcessor3_0

    transformer = pipe.transformer
    assert SPEC.layer_names(transformer) == ("transformer_blocks.0.attn2", "transformer_blocks.1.attn2")
    assert set(SPEC.roles(transformer).values()) == {(0, "context"), (1, "context")}
    assert SPEC.layer_names_for_config(sana_video.KNOWN["Efficient-Large-Model/SANA-Video_2B_480p_diffusers"])[-1] == (
        "transformer_blocks.19.attn2"
    )
    with cogattn.record(pipe, kinds=("video_to_text",)):
        for block in transformer.transformer_blocks:
            assert type(block.attn1.processor) is SanaLinearAttnProcessor3_0
            assert type(block.attn2.processor) is sana_video.SanaVideoAttnMapProcessor
    assert all(type(b.attn2.processor) is SanaAttnProcessor2_0 for b in transformer.transformer_blocks)


def test_every_self_attention_kind_and_the_output_modes_are_refused_in_one_line(pipe):
    assert SPEC.kinds() == ("video_to_text",)
    for kind in [k for k in REDUCERS if k != "video_to_text"]:
        extra = {"queries": [0]} if kind == "query" else {}
        extra.update({"patterns": ("spatial",)} if kind.startswith("pattern_") else {})
        with pytest.raises(ValueError, match=f"kind '{kind}' does not exist for sana_video") as err:
            cogattn.Recording(pipe, kinds=(kind,), **extra)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="linear attention .* no softmax"):
        cogattn.Recording(pipe, kinds=("entropy",))
    for output in ("lse", "joint"):
        with pytest.raises(ValueError, match="key mask") as err:
            cogattn.Recording(pipe, kinds=("video_to_text",), layer_output=output)
        assert "\n" not in str(err.value)


def test_video_to_text_is_the_softmax_of_the_module_s_own_q_k_one_batched_call_a_step(pipe):
    """Under guidance one transformer call a step, batch [uncond, cond]; each layer's video_to_text the naive float64
    softmax of the module's q and k with the text's bias (the negative keeps 2 of 6 tokens, the prompt 4), the padded
    tokens at exactly 0, the video bit-identical."""
    calls = _Calls(pipe.transformer)
    try:
        stock = _generate(pipe)
    finally:
        calls.remove()
    assert calls.batches == [2, 2]  # two steps, one call each, [uncond, cond]
    with cogattn.record(pipe, kinds=("video_to_text",), batch="all", heads="all") as rec:
        got = _generate(pipe)
    assert torch.equal(got, stock) and rec.batch_items == (0, 1) and rec.batch_roles == ("uncond", "cond")
    assert rec.layout.grid == GRID and rec.layout.context_len == 6 and rec.layout.seq_len == 24
    for n, (layer, hidden, text, bias, out) in enumerate(calls.seen):
        attn = pipe.transformer.transformer_blocks[layer].attn2
        assert torch.equal(bias, torch.tensor([[0.0] * 2 + [-10000.0] * 4, [0.0] * 4 + [-10000.0] * 2]))
        P, made = _reference(attn, hidden, text, bias)
        assert (made - out).abs().max().item() < 1e-5  # the reference is the model's attention
        result = rec.get("video_to_text", n // 2, layer)
        assert (result.double() - naive_context(P, GRID)).abs().max().item() < 1e-5
        assert not result[0, :, 2:].any() and not result[1, :, 4:].any()  # padded text: exactly 0


def test_a_bare_transformer_is_recorded_with_its_key_mask(pipe):
    transformer = pipe.transformer
    g = torch.Generator().manual_seed(3)
    latents, text = torch.randn(2, 16, 3, 4, 8, generator=g), torch.randn(2, 5, 16, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])

    def call():
        with torch.no_grad():
            return transformer(latents, text, torch.tensor([700.0, 700.0]), encoder_attention_mask=mask).sample

    calls = _Calls(transformer)
    try:
        stock = call()
    finally:
        calls.remove()
    with cogattn.record(transformer, kinds=("video_to_text",), batch="all", heads=[2, 0]) as rec:
        got = call()
    assert torch.equal(got, stock) and rec.layout.grid == GRID and rec.layout.context_len == 5
    for layer, hidden, enc, bias, _ in calls.seen:
        P, _ = _reference(transformer.transformer_blocks[layer].attn2, hidden, enc, bias)
        want = naive_context(P[:, [2, 0]], GRID)
        result = rec.get("video_to_text", 0, layer)
        assert (result.double() - want).abs().max().item() < 1e-5 and not result[0, :, 3:].any()


def test_image_to_video_gives_each_token_its_timestep_and_is_recorded_per_step():
    pipe = sana_video.tiny_pipeline("image-to-video", num_heads=3)
    call = sana_video.tiny_call(pipe, "image-to-video", torch.Generator().manual_seed(0), True)

    def generate():
        return pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="pt").frames

    stock = generate()
    given = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: given.append(kw["timestep"]), with_kwargs=True)
    try:
        with cogattn.record(pipe, kinds=("video_to_text",), batch="cond") as rec:
            got = generate()
    finally:
        handle.remove()
    assert torch.equal(got, stock) and rec.layout.grid == GRID
    # each token its timestep, the image's latent frame held at 0: each step's is the largest
    frame = GRID[1] * GRID[2]
    per_token = [t.flatten(1) for t in given]  # (B, 1, F, Hp, Wp): a timestep per latent token
    assert all(t.shape[1] == frame * GRID[0] and not t[:, :frame].any() and t[:, frame:].all() for t in per_token)
    assert rec.timesteps == [float(t.max()) for t in given] == [float(t) for t in pipe.scheduler.timesteps]
    assert sorted({step for _, step, _ in rec.keys()}) == [0, 1]


def test_word_labels_are_the_tokens_the_transformer_reads_through_the_template(pipe):
    """The prompt, lower-cased, after the instruction template: the transformer reads the text's first token and its
    last ``max_sequence_length − 1`` (the pipeline's select_index), as the ids its text encoder was given say."""
    given = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda m, a: given.append(a[0].clone()))
    prompt, length = "A Red fox running in the snow", 12
    try:
        for template in (None, ["a tree", "and a river:"], []):
            given.clear()
            more = {} if template is None else {"complex_human_instruction": template}
            _generate(pipe, prompt=prompt, prompt_embeds=None, prompt_attention_mask=None, max_sequence_length=length,
                      negative_prompt="", negative_prompt_embeds=None, negative_prompt_attention_mask=None, **more)  # fmt: skip
            ids = given[0][0]  # the prompt's call (the negative's next: no template)
            read = torch.cat([ids[:1], ids[len(ids) - length + 1 :]]).tolist()
            text = sana_video.prompt_text(pipe, prompt, length, template, offsets=True)
            assert text.ids == read and text.text.endswith("a red fox running in the snow")
            fox = pipe.tokenizer.convert_tokens_to_ids("fox")
            assert word_positions("Fox", PromptFormat(pipe, template), prompt, length) == [read.index(fox)]
    finally:
        hook.remove()
    # the tiny word-level tokenizer adds no BOS and ends the text with </s>: the template's first token (unknown),
    # then the prompt's (Gemma's adds a BOS and no EOS: the BOS, the template's last token, then the prompt's)
    assert text_tokens(pipe, prompt, length)[:3] == ["<unk>", "a", "red"]
    side, pipe.tokenizer.padding_side = pipe.tokenizer.padding_side, "left"
    try:  # the labels pad as the pipeline does, and leave its tokenizer as it was
        assert (
            sana_video.prompt_text(pipe, prompt, length, []).ids == text.ids and pipe.tokenizer.padding_side == "left"
        )
    finally:
        pipe.tokenizer.padding_side = side
    given.clear()  # the negative prompt: in no template, its first max_sequence_length tokens (the spec's negative_template)
    hook = pipe.text_encoder.register_forward_pre_hook(lambda m, a: given.append(a[0].clone()))
    try:
        pipe.encode_prompt(prompt, True, negative_prompt="a dog in the snow", max_sequence_length=length)
    finally:
        hook.remove()
    own = PromptFormat(pipe, cogattn.models.family("sana_video").negative_template)
    assert own.encode("a dog in the snow", length).ids == given[1][0].tolist() != given[0][0][:length].tolist()
    with pytest.raises(ValueError, match="makes the transformer's text its own way"):
        word_positions("fox", pipe.tokenizer, prompt, length, family="sana_video")


def test_the_released_shapes_plan_offline_and_the_batch_tool_keeps_to_the_size_bins():
    est = cogattn.estimate(
        "Efficient-Large-Model/SANA-Video_2B_480p_diffusers", num_frames=81, height=480, width=832,
        num_inference_steps=50, kinds=("video_to_text",), dtype="bfloat16",
    )  # fmt: skip
    assert est.layout.grid == (21, 30, 52) and est.layout.context_len == 300 and "S = 32,760" in est.table()
    est = cogattn.estimate(
        "Efficient-Large-Model/SANA-Video_2B_720p_diffusers", num_frames=81, height=704, width=1280,
        num_inference_steps=50, kinds=("video_to_text",), dtype="bfloat16",
    )  # fmt: skip
    assert est.layout.grid == (11, 22, 40) and est.layout.temporal_compression == 8  # the LTX-2 VAE, patch 1
    config = sana_video.KNOWN["Efficient-Large-Model/SANA-Video_2B_480p_diffusers"]
    assert SPEC.attention_shape(config) == (20, 112)
    SPEC.call_rules(SimpleNamespace(height=480, width=832), config)
    with pytest.raises(ValueError, match=r"bins the size .* \(480, 832\)"):
        SPEC.call_rules(SimpleNamespace(height=480, width=848), config)
    SPEC.call_rules(SimpleNamespace(height=704, width=1280), sana_video.KNOWN["Efficient-Large-Model/SANA-Video_2B_720p_diffusers"])  # fmt: skip
