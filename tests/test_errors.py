"""Bad input is refused before any block runs, with a message naming the value and the allowed ones;
processors and hooks are always put back."""

import pytest
import torch
from reference import QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
from cogattn.models.cogvideox import tiny_pipeline, tiny_transformer


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


def _assert_clean(pipe, originals):
    procs = pipe.transformer.attn_processors
    assert all(procs[n] is originals[n] for n in originals)
    assert not pipe.transformer._forward_pre_hooks


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(kinds=("frames",)), ValueError, r"unknown kind 'frames'; the kinds are \['full', 'frame'"),
        (dict(kinds=()), ValueError, "kinds is empty"),
        (dict(layers=[0, 2]), ValueError, r"layers index 2 is out of range; valid indices are 0..1"),
        (
            dict(layers="some"),
            ValueError,
            r"layers=\['some'\]: \['some'\] name no layer of this model \(transformer_blocks",
        ),
        (dict(heads=[5]), ValueError, r"heads index 5 is out of range; valid indices are 0..1"),
        (dict(heads="max"), ValueError, r"heads='max'.*\['all', 'mean'\]"),
        (dict(steps=[-1]), ValueError, "steps index -1 is out of range"),
        (dict(batch="both"), ValueError, r"batch='both'.*\['auto', 'all', 'cond', 'uncond'\]"),
        (dict(layers=[1.5]), TypeError, "int indices, got 1.5 \\(float\\)"),
        (dict(kinds=("query",)), ValueError, "needs queries"),
        (dict(kinds=("frame",), queries=[1]), ValueError, "'query' is not in kinds"),
        (dict(kinds=("query",), queries=[(1, 2)]), TypeError, r"query \(1, 2\) \(tuple\) is neither"),
        (dict(memory_budget="lots"), ValueError, "memory_budget='lots' is not a byte size"),
        (dict(memory_budget=0), ValueError, "memory_budget=0 is less than one byte"),
        (dict(method="fast"), ValueError, r"method='fast' is not one of \['auto', 'rows', 'sdpa', 'triton'\]"),
    ],
)
def test_bad_selection_refused_at_record(pipe, kwargs, error, match):
    originals = pipe.transformer.attn_processors
    with pytest.raises(error, match=match):
        cogattn.record(pipe, **kwargs)
    _assert_clean(pipe, originals)


@pytest.mark.parametrize(
    "kwargs,call,match",
    [
        (dict(steps=[5]), {}, r"steps=\[5\] asks for step 5, but this generation has 2 denoising steps"),
        (
            dict(kinds=("query",), queries=[(3, 0, 0)]),
            {},
            r"\(3, 0, 0\) is outside the latent grid \(F, Hp, Wp\) = \(3, 3, 5\)",
        ),
        (dict(kinds=("query",), queries=[53]), {}, "query token 53 is outside the sequence: S = 53"),
        (dict(batch="cond"), dict(guidance=1.0), "without classifier-free guidance"),
        (dict(batch=[2]), {}, "batch index 2 is out of range: the transformer batch has 2 items"),
        (dict(memory_budget=1000), {}, r"memory_budget=1000 bytes is too small .* at least \d+"),
    ],
)
def test_bad_selection_for_this_call_refused_before_any_block(pipe, kwargs, call, match):
    originals = pipe.transformer.attn_processors
    calls = []
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=match):
        with cogattn.record(pipe, **kwargs):
            generate(pipe, **call, output_type="latent")
    hook.remove()
    assert calls == []  # refused before the first block ran
    _assert_clean(pipe, originals)


def test_not_a_cogvideox_model():
    with pytest.raises(TypeError, match="Linear is not a pipeline or transformer cogattn supports"):
        cogattn.record(torch.nn.Linear(2, 2))


def test_foreign_processor_refused(pipe):
    from diffusers.models.attention_processor import AttnProcessor2_0, CogVideoXAttnProcessor2_0

    pipe.transformer.set_attn_processor(AttnProcessor2_0())
    try:
        with pytest.raises(TypeError, match="runs a AttnProcessor2_0; cogattn captures through the stock"):
            cogattn.record(pipe)
        assert not pipe.transformer._forward_pre_hooks
    finally:
        pipe.transformer.set_attn_processor(CogVideoXAttnProcessor2_0())


def test_nested_recording_refused(pipe):
    originals = pipe.transformer.attn_processors
    with cogattn.record(pipe):
        with pytest.raises(ValueError, match="already runs a cogattn processor"):
            cogattn.record(pipe)
    _assert_clean(pipe, originals)


def test_cond_needs_a_pipeline():
    with pytest.raises(ValueError, match="batch='cond' needs a pipeline"):
        cogattn.record(tiny_transformer(), batch="cond")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_processors_restored_after_exception_mid_generation(pipe, exc):
    originals = pipe.transformer.attn_processors

    def boom(p, i, t, kw):
        if i == 1:
            raise exc("stop")
        return kw

    with pytest.raises(exc):
        with cogattn.record(pipe, kinds=("frame",)) as rec:
            generate(pipe, steps=3, callback_on_step_end=boom, output_type="latent")
    assert len(rec.timesteps) == 2 and ("frame", 1, 1) in rec  # what ran is kept
    _assert_clean(pipe, originals)


def test_second_generation_is_not_mixed(pipe):
    with cogattn.record(pipe, kinds=("frame",)) as rec:
        generate(pipe, output_type="latent")
        with pytest.raises(RuntimeError, match="a second generation started inside one recording"):
            generate(pipe, output_type="latent")
    assert len(rec.timesteps) == 2


def test_steps_beyond_a_bare_transformer_run_warn():
    pipe = tiny_pipeline()
    with pytest.warns(UserWarning, match=r"steps \[4\] were selected but the generation ran 2 steps"):
        with cogattn.record(pipe.transformer, steps=[0, 4]) as rec:
            generate(pipe, output_type="latent")
    assert [k[1] for k in rec.keys()] == [0, 0]


def test_batch_auto_is_cond_under_guidance_and_all_without():
    pipe = tiny_pipeline()
    with cogattn.record(pipe, kinds="frame") as rec:
        generate(pipe, steps=1, output_type="latent")
    assert rec.batch_items == (1,) and rec.get("frame", 0, 0).shape[0] == 1
    with cogattn.record(pipe, kinds="frame") as rec:
        generate(pipe, steps=1, guidance=1.0, output_type="latent")
    assert rec.batch_items == (0,)
    with cogattn.record(pipe.transformer, kinds="frame") as rec:
        generate(pipe, steps=1, output_type="latent")
    assert rec.batch_items == (0, 1)  # a bare transformer cannot know: everything


def test_cond_needs_an_even_guidance_batch():
    from cogattn.layout import TokenLayout

    sel = cogattn.CaptureOptions(batch="uncond")
    with pytest.raises(ValueError, match="needs the guidance batch .* got a batch of 3"):
        sel.resolve(TokenLayout(8, 3, 3, 5), 3, True, 2, 2)


def test_queries_zero_is_a_token_index(pipe):
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds="query", queries=0) as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    assert rec.get("query", 0, 0).shape == (1, 1, 1, 53)
    assert_matches_naive(rec, spy, [1], "mean", kinds=("query",), queries=[0])


def test_closed_recording_captures_nothing_even_if_its_processor_stays(pipe, tmp_path):
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    rec = cogattn.Recording(pipe, kinds=("frame",), save_dir=tmp_path / "run")
    pipe.transformer.set_attn_processor(cogattn.CogVideoXAttnMapProcessor(rec))
    try:
        generate(pipe, steps=1, output_type="latent")
        rec.close()
        generate(
            pipe, steps=2, output_type="latent"
        )  # the processor is still installed: it must neither capture nor hang
        assert rec.keys() == [("frame", 0, 0), ("frame", 0, 1)]
    finally:
        pipe.transformer.set_attn_processor(CogVideoXAttnProcessor2_0())
