"""Latte's own rules (tests/test_families.py holds every kind of its tiny pipeline to the reference): the layers
interleave the spatial and temporal blocks as they run; a bare transformer call is recorded as the ``(S, S)``
attention over the video's tokens, each layer's map the model's per-frame or per-position softmax of its own q and
k, exactly 0 outside; the text kinds are the spatial layers'; the released checkpoint is planned offline."""

from types import SimpleNamespace

import pytest
import torch

import cogattn
from cogattn.models import latte
from cogattn.reference import naive_context, naive_kind

pytestmark = pytest.mark.usefixtures("one_thread")

F, HP, WP = 3, 2, 3  # the tiny call's latent grid: 3 frames of 2×3 patches
S = F * HP * WP


@pytest.fixture(scope="module")
def model():
    return latte.tiny_transformer(num_heads=3)


def _call(batch=2, text=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, 4, F, 2 * HP, 2 * WP, generator=g),
        timestep=torch.tensor([500] * batch),
        encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
        return_dict=False,
    )


def test_the_layers_interleave_the_spatial_and_temporal_blocks_as_they_run(model):
    """Layer 2i is the spatial block i's self-attention (its text attention beside it), layer 2i + 1 the temporal
    block i's, the order the forward calls them in; a config alone gives the same names."""
    names = latte.SPEC.layer_names(model)
    assert names == (
        "transformer_blocks.0.attn1",
        "temporal_transformer_blocks.0.attn1",
        "transformer_blocks.1.attn1",
        "temporal_transformer_blocks.1.attn1",
    )
    assert latte.SPEC.layer_names_for_config(dict(model.config)) == names
    roles = latte.SPEC.roles(model)
    for i in range(2):
        spatial, temporal = model.transformer_blocks[i], model.temporal_transformer_blocks[i]
        assert roles[id(spatial.attn1)] == (2 * i, "self") and roles[id(spatial.attn2)] == (2 * i, "context")
        assert roles[id(temporal.attn1)] == (2 * i + 1, "self") and temporal.attn2 is None
    ran = []
    modules = {id(attn): name for name, attn, _ in latte.SPEC.layers(model)}
    hooks = [attn.register_forward_pre_hook(lambda m, a: ran.append(modules[id(m)])) for _, attn, _ in
             latte.SPEC.layers(model)]  # fmt: skip
    try:
        with torch.no_grad():
            model(**_call())
    finally:
        for h in hooks:
            h.remove()
    assert tuple(ran) == names


def _spied(model, call):
    """Each attention module's q, k, v of the call, from its own input and projections (``(n, H, L, D)``), each
    call's naive softmax proved against the module's output."""
    seen = {}

    def hook(module, args, kwargs, output):
        h = args[0] if args else kwargs["hidden_states"]
        ctx = kwargs.get("encoder_hidden_states")
        ctx = h if ctx is None else ctx
        heads = module.heads

        def split(x):
            return x.unflatten(-1, (heads, -1)).transpose(1, 2).double()

        q, k, v = split(module.to_q(h)), split(module.to_k(ctx)), split(module.to_v(ctx))
        P = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
        out = module.to_out[0]((P @ v).transpose(1, 2).flatten(2).to(h.dtype))
        assert (out - output).abs().max() < 1e-5  # the reference is the module's attention
        seen[id(module)] = P

    hooks = [m.register_forward_hook(hook, with_kwargs=True) for m in latte.SPEC.site_modules(model).values()]
    try:
        with torch.no_grad():
            model(**call)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _whole(P, spatial):
    """A factorised call's ``P`` ``(B·n, H, L, L)`` as each video's ``(B, H, S, S)`` over its tokens ``f·6 + p``:
    item ``b·F + f`` of a spatial call holds frame f's positions, item ``b·6 + p`` of a temporal one position p's
    frames; 0 elsewhere."""
    positions = HP * WP
    items = [[f * positions + p for p in range(positions)] for f in range(F)] if spatial else [
        [f * positions + p for f in range(F)] for p in range(positions)]  # fmt: skip
    B = P.shape[0] // len(items)
    full = torch.zeros(B, P.shape[1], S, S, dtype=torch.float64)
    for b in range(B):
        for i, tokens in enumerate(items):
            full[b, :, torch.tensor(tokens)[:, None], torch.tensor(tokens)] = P[b * len(items) + i]
    return full


def test_a_bare_transformer_call_is_each_layer_s_factorised_softmax_over_every_video_token(model):
    """``record(transformer)`` on a call of two videos: ``full`` of layer 2i is the spatial softmax within each frame,
    of layer 2i + 1 the temporal one at each position, placed in the ``(S, S)`` map and exactly 0 elsewhere; the
    pooled kinds follow from it; ``video_to_text`` is layer 2i's, every frame's queries over its video's text."""
    call = _call()
    seen = _spied(model, call)
    kinds = ("full", "frame", "entropy", "received", "video_to_text")
    with cogattn.record(model, kinds=kinds, batch="all", heads="all") as rec:
        with torch.no_grad():
            model(**call)
    assert rec.layout.grid == (F, HP, WP) and rec.layout.context_len == 5
    for layer, (_, attn, context) in enumerate(latte.SPEC.layers(model)):
        P = _whole(seen[id(attn)], spatial=layer % 2 == 0)
        got = rec.get("full", 0, layer)
        assert (got.double() - P).abs().max() <= 1e-5
        assert bool((got[P == 0] == 0).all()) and int((P == 0).sum()) > 0  # outside the frame or the position: 0
        for kind in ("frame", "entropy", "received"):
            want = naive_kind(P, kind, 0, rec.layout.grid)
            assert (rec.get(kind, 0, layer).double() - want).abs().max() <= 1e-4, (kind, layer)
        if context is None:  # the temporal blocks have no text attention
            with pytest.raises(cogattn.NotRecordedError):
                rec.get("video_to_text", 0, layer)
            continue
        per_frame = seen[id(context)].unflatten(0, (-1, F))  # (B, F, H, 6, T): a video's frames in order
        text = naive_context(per_frame.transpose(1, 2).flatten(2, 3), rec.layout.grid)
        assert (rec.get("video_to_text", 0, layer).double() - text).abs().max() <= 1e-5


def test_a_call_without_its_temporal_blocks_says_so_for_their_layers(model):
    """``enable_temporal_attentions=False`` leaves the temporal blocks out of the call: their layers hold no map, and
    reading one says the call did not run it (no cache to blame); the spatial layers are recorded."""
    with cogattn.record(model, kinds=("frame",)) as rec:
        with torch.no_grad():
            model(**_call(batch=1), enable_temporal_attentions=False)
    assert rec.get("frame", 0, 0).shape == (1, 1, F, F)
    with pytest.raises(cogattn.NotRecordedError, match=r"the model skipped this attention at step 0 \(no cache was "):
        rec.get("frame", 0, 1)


def test_the_refused_kinds_and_the_output_call_are_one_line_each(model):
    for kind, why in [("text_to_video", "text never queries"), ("video_to_image", "no image attention")]:
        with pytest.raises(ValueError, match=f"kind '{kind}' does not exist for latte: .*{why}") as err:
            cogattn.Recording(model, kinds=(kind,))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="layer_output='lse'"):
        cogattn.Recording(model, kinds=("entropy",), layer_output="lse")


def test_method_triton_where_its_kernels_cannot_run_is_refused_though_the_mask_takes_row_tiles(model):
    """Latte's layers run under a mask over token groups, so row tiles serve every kind whatever the method; a method
    that cannot run here is still refused, by the recording and by ``estimate`` alike (the estimate accepted it)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device runs the kernels")
    size = dict(num_frames=F, height=32, width=48, num_inference_steps=1, text_len=5)
    with pytest.raises(ValueError, match="method='triton' needs"):
        cogattn.estimate(model, kinds=("frame",), method="triton", **size)
    with pytest.raises(ValueError, match="method='triton' needs"):
        with cogattn.record(model, kinds=("frame",), method="triton"):
            model(**_call())
    assert cogattn.estimate(model, kinds=("frame",), **size).plan.tiles.method == "rows"


def test_the_batch_tool_takes_the_transformer_s_video_length_alone():
    """The transformer adds its temporal position table of ``video_length`` rows: the batch tool refuses another
    count in one line."""
    config = latte.KNOWN["maxin-cn/Latte-1"]
    for frames in (16, 1):
        latte.call_rules(SimpleNamespace(num_frames=frames), config)
    with pytest.raises(ValueError, match=r"num_frames: 17; Latte's transformer takes 16 frames .* use 16\."):
        latte.call_rules(SimpleNamespace(num_frames=17), config)


def test_the_released_checkpoint_is_planned_offline():
    """Latte-1 at 512×512, 16 frames: 16 latent frames of 32×32 patches (an image VAE), S = 16,384; 56 layers, the
    spatial and temporal blocks interleaved; its masked pass costs S² per head."""
    est = cogattn.estimate(
        "maxin-cn/Latte-1", num_frames=16, height=512, width=512, num_inference_steps=50, kinds=("entropy",),
        layers=["temporal_transformer_blocks.27.attn1"], dtype="float16",
    )  # fmt: skip
    assert est.layout.grid == (16, 32, 32) and est.layout.seq_len == 16384 and est.layout.context_len == 120
    names = latte.SPEC.layer_names_for_config(latte.KNOWN["maxin-cn/Latte-1"])
    assert len(names) == 56 and names[54:] == ("transformer_blocks.27.attn1", "temporal_transformer_blocks.27.attn1")
    assert {kind: n for kind, _, _, n in est.records} == {"entropy": 50}
    assert "S = 16,384" in est.table() and "method rows" in est.table()  # under the factorisation's mask
    # video_to_text is made by the spatial blocks' text cross-attention alone: 28 of the 56 layers
    size = dict(num_frames=16, height=512, width=512, num_inference_steps=2)
    est = cogattn.estimate("maxin-cn/Latte-1", **size, kinds=("frame", "video_to_text"))
    assert {kind: n for kind, _, _, n in est.records} == {"frame": 56 * 2, "video_to_text": 28 * 2}
    est = cogattn.estimate("maxin-cn/Latte-1", **size, kinds=("video_to_text",), layers=[53, 54, 55])
    assert {kind: n for kind, _, _, n in est.records} == {"video_to_text": 1 * 2}  # 54 is spatial block 27


def test_word_labels_are_the_tokens_the_pipeline_keeps_of_one_prompt():
    """One prompt's text is cropped to its own tokens (``mask_feature``): the labels are those tokens."""
    pipe = latte.tiny_pipeline()
    prompt = "a red fox running in the snow"
    embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
    text = latte.prompt_text(pipe, prompt, embeds.shape[1], offsets=True)
    assert embeds.shape[1] == 8 and len(text.ids) == 8  # 7 words and </s>
    assert [text.text[a:b] for a, b in text.spans[:7]] == prompt.split()
