"""Wan 2.1 / 2.2 end to end on tiny random pipelines: every kind equal to the naive float64 reference of q and k
recomputed from each attention module's inputs, the video bit-identical, runs on disk, refusals, estimates."""

import json

import numpy as np
import PIL.Image
import pytest
import torch

pytest.importorskip("diffusers.models.transformers.transformer_wan")

import cogattn
import cogattn.models

if cogattn.models.wan is None:
    pytest.skip("cogattn has no Wan support with this diffusers (WanAttention came with 0.35)", allow_module_level=True)

from diffusers import WanImageToVideoPipeline
from reference import assert_topk

from cogattn.models.wan import tiny_pipeline as tiny_wan_pipeline
from cogattn.reference import naive_context, naive_kind, naive_probs, select

T2V, I2V = "text-to-video", "image-to-video"
TEXT = 512  # Wan's text context; diffusers' processor splits the image tokens off before it
SIZES = dict(block_size=7, topk=5)  # blocks that do not divide S = 18
SELF_KINDS = ("full", "frame", "query", "entropy", "received", "query_frame", "block", "topk")
CONTEXT = {"video_to_text": "text", "video_to_image": "image"}
BOUNDARY = 875  # tiny_wan_pipeline(experts=2): boundary_ratio 0.875 of 1000 training timesteps


def queries_for(grid):
    """Video coordinates and a token index: (2, 1, 2) on the 3 × 2 × 3 grid, the last token of the last frame."""
    return [(0, 0, 0), (grid[0] - 1, grid[1] - 1, grid[2] - 1), 5]


def kinds_for(task):
    return SELF_KINDS + ("video_to_text",) + (("video_to_image",) if task == I2V else ())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipes():
    """``pipes(task, experts, dtype)``: one tiny Wan pipeline per configuration for the whole module."""
    cache = {}

    def get(task=T2V, experts=1, dtype=torch.float32):
        if (task, experts, dtype) not in cache:
            cache[task, experts, dtype] = tiny_wan_pipeline(task, experts, dtype=dtype)
        return cache[task, experts, dtype]

    return get


def generate(pipe, *, steps=2, guidance=5.0, videos=1, height=32, width=48, seed=0, output="pt", embeds=None):
    """Output of one seeded call: 9 frames → 3 latent frames of (height/16) × (width/16) patches. With
    ``embeds`` (always for image-to-video: no text encoder run, which its maps do not need) random
    text embeddings of batch 1 stand in for the prompt."""
    g = torch.Generator().manual_seed(seed)
    i2v = isinstance(pipe, WanImageToVideoPipeline)
    if embeds or i2v:
        emb = torch.randn(1, TEXT, 16, generator=g).to(pipe.transformer.dtype)
        extra = dict(prompt_embeds=emb, negative_prompt_embeds=-emb)
    else:
        extra = dict(prompt="a red fox running", negative_prompt="blue sky")
    if i2v:
        pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
        extra["image"] = PIL.Image.fromarray(np.asarray(pixels))
    return pipe(
        num_frames=9,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        num_videos_per_prompt=videos,
        output_type=output,
        generator=torch.Generator().manual_seed(seed + 1),
        **extra,
    ).frames


def _rope(x, freqs_cos, freqs_sin):
    """diffusers' WanAttnProcessor rotary embedding, on ``(B, S, H, D)``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanSpy:
    """q and k of every ``attn1`` / ``attn2`` call of every transformer of a Wan pipeline, recomputed from the
    module's inputs with its own layers (no cogattn code), in call order: ``(expert, layer, role, q, keys)``
    with ``(B, H, S, D)`` tensors in the model's dtype; ``keys``: ``self``, or ``text`` (and ``image``)."""

    ARGS = ("hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb")

    def __init__(self, pipe):
        self.calls, self._handles = [], []
        for expert in ("transformer", "transformer_2"):
            for layer, block in enumerate(getattr(getattr(pipe, expert, None), "blocks", [])):
                for role, attn in (("self", block.attn1), ("cross", block.attn2)):
                    hook = self._hook(expert, layer, role)
                    self._handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))

    def _hook(self, expert, layer, role):
        def hook(attn, args, kwargs):
            given = {**dict(zip(self.ARGS, args)), **kwargs}
            hs, ctx, rope = given["hidden_states"], given.get("encoder_hidden_states"), given.get("rotary_emb")
            keys = {}
            if ctx is None:
                ctx = hs
            elif attn.add_k_proj is not None:  # Wan 2.1 I2V: image tokens first, then the 512 text tokens
                n = ctx.shape[1] - TEXT
                keys["image"] = attn.norm_added_k(attn.add_k_proj(ctx[:, :n])).unflatten(2, (attn.heads, -1))
                ctx = ctx[:, n:]
            q = attn.norm_q(attn.to_q(hs)).unflatten(2, (attn.heads, -1))
            k = attn.norm_k(attn.to_k(ctx)).unflatten(2, (attn.heads, -1))
            if rope is not None:
                q, k = _rope(q, *rope), _rope(k, *rope)
            keys["self" if role == "self" else "text"] = k
            take = lambda x: x.detach().transpose(1, 2).clone()  # noqa: E731
            self.calls.append((expert, layer, role, take(q), {n: take(v) for n, v in keys.items()}))

        return hook

    def steps(self, layer, role, calls_per_step):
        """Per step ``(expert, q, keys)`` of ``layer``: under guidance the step's two calls (conditional
        first) joined as the guidance batch ``[uncond..., cond...]``."""
        calls = [c for c in self.calls if c[1:3] == (layer, role)]
        out = []
        for i in range(0, len(calls), calls_per_step):
            group = calls[i : i + calls_per_step][::-1]
            assert len({c[0] for c in group}) == 1, "one step's calls ran on two transformers"
            # a context of batch 1 (prompt_embeds given with several videos) is broadcast, as SDPA does
            keys = {n: torch.cat([c[4][n].expand(len(c[3]), -1, -1, -1) for c in group]) for n in group[0][4]}
            out.append((group[0][0], torch.cat([c[3] for c in group]), keys))
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def assert_matches_spy(rec, spy, kinds, batch, heads, calls_per_step, tol=1e-5):
    """Every recorded map of ``kinds`` (every step and layer) equals the naive reference of the spied q, k."""
    lay = rec.layout
    tokens = [lay.token_index(*x) if isinstance(x, tuple) else x for x in queries_for(lay.grid)]
    layers = {c[1] for c in spy.calls}
    checked = 0
    for layer in sorted(layers):
        selfs, crosses = spy.steps(layer, "self", calls_per_step), spy.steps(layer, "cross", calls_per_step)
        assert len(selfs) == len(crosses) == len(rec.timesteps) > 0
        for step, ((expert, q, keys), (cross_expert, qc, kc)) in enumerate(zip(selfs, crosses)):
            assert expert == cross_expert == rec.experts[step], (step, layer)
            P = naive_probs(q, keys["self"])
            for kind in kinds:
                got = rec.get(kind, step, layer)
                if kind == "topk":
                    assert_topk(got, select(P, batch, heads), tol)
                    continue
                if kind in CONTEXT:
                    ref = naive_context(naive_probs(qc, kc[CONTEXT[kind]]), lay.grid)
                else:
                    ref = naive_kind(P, kind, 0, lay.grid, tokens, **SIZES)
                ref = select(ref, batch, heads)
                assert got.shape == ref.shape, (kind, got.shape, ref.shape)
                err = (got.double() - ref).abs().max().item()
                assert err <= (10 * tol if kind == "entropy" else tol), (kind, step, layer, err)
                checked += 1
    assert checked


# id: task, experts, dtype, call (generate's keywords), batch, the batch items it resolves to, heads, memory
# budget, methods
CASES = {
    "t2v-all-all": (T2V, 1, torch.float32, {}, "all", [0, 1], "all", "1GiB", ("rows", "sdpa", "auto")),
    "t2v-cond-h1-small": (T2V, 1, torch.float32, {}, "cond", [1], [1], 40_000, ("rows", "sdpa")),
    "t2v-3x2-mean": (T2V, 1, torch.float32, dict(height=48, width=32), "auto", [1], "mean", 40_000, ("auto",)),
    "t2v-noguidance": (T2V, 1, torch.float32, dict(guidance=1.0), "auto", [0], "all", "1GiB", ("sdpa",)),
    "t2v-2videos-list": (T2V, 1, torch.float32, dict(videos=2), [3, 0], [3, 0], [1], "1GiB", ("rows",)),
    "i2v-all-mean": (I2V, 1, torch.float32, {}, "all", [0, 1], "mean", "1GiB", ("rows", "sdpa", "auto")),
    "i2v-cond-all-small": (I2V, 1, torch.float32, {}, "cond", [1], "all", 40_000, ("rows", "auto")),
    "t2v-bf16": (T2V, 1, torch.bfloat16, {}, "all", [0, 1], "all", 250_000, ("rows", "sdpa", "auto")),
    "i2v-bf16": (I2V, 1, torch.bfloat16, {}, "cond", [1], "mean", "1GiB", ("auto",)),
    "t2v-2experts": (T2V, 2, torch.float32, dict(steps=3), "all", [0, 1], "all", "1GiB", ("sdpa",)),
}


@pytest.mark.parametrize(
    "task,experts,dtype,call,batch,expect,heads,budget,method",
    [pytest.param(*case[:-1], m, id=f"{name}-{m}") for name, case in CASES.items() for m in case[-1]],
)
def test_maps_match_reference(pipes, task, experts, dtype, call, batch, expect, heads, budget, method):
    """bf16 too at 1e-5: the maps and the reference come from the same bf16 q and k (naive_probs upcasts)."""
    pipe, kinds = pipes(task, experts, dtype), kinds_for(task)
    grid = (3, call.get("height", 32) // 16, call.get("width", 48) // 16)
    opts = dict(kinds=kinds, batch=batch, heads=heads, queries=queries_for(grid), memory_budget=budget, method=method)
    with WanSpy(pipe) as spy, cogattn.record(pipe, **opts, **SIZES) as rec:
        generate(pipe, output="latent", **call)
    assert rec.layout.grid == grid and rec.layout.text_len == 0
    assert (rec.layout.context_len, rec.layout.image_len) == (TEXT, 17 if task == I2V else 0)
    assert rec.batch_items == tuple(expect)
    if experts == 2:  # the pipeline's own rule: transformer above the boundary timestep, transformer_2 below
        assert rec.experts == ["transformer" if t >= BOUNDARY else "transformer_2" for t in rec.timesteps]
        assert set(rec.experts) == {"transformer", "transformer_2"}
    assert len(rec.keys()) == len(kinds) * len(rec.timesteps) * 2
    calls_per_step = 2 if call.get("guidance", 5.0) > 1 else 1
    assert_matches_spy(rec, spy, kinds, expect, heads, calls_per_step)


def _processor_names(pipe):
    models = [pipe.transformer] + ([pipe.transformer_2] if getattr(pipe, "transformer_2", None) else [])
    return {type(p).__name__ for m in models for p in m.attn_processors.values()}


@pytest.mark.parametrize(
    "task,experts,dtype",
    [(T2V, 1, torch.float32), (T2V, 1, torch.bfloat16), (I2V, 1, torch.float32), (I2V, 1, torch.bfloat16)]
    + [(T2V, 2, torch.float32)],
    ids=["t2v-fp32", "t2v-bf16", "i2v-fp32", "i2v-bf16", "t2v-2experts"],
)
def test_output_bit_identical_and_processors_restored(pipes, task, experts, dtype):
    pipe = pipes(task, experts, dtype)
    stock = generate(pipe)
    assert _processor_names(pipe) == {"WanAttnProcessor"}
    with cogattn.record(
        pipe, kinds=kinds_for(task), batch="all", heads="all", queries=queries_for((3, 2, 3)), **SIZES
    ) as rec:
        assert _processor_names(pipe) == {"WanAttnMapProcessor"}
        captured = generate(pipe)
    assert torch.equal(captured, stock)
    assert _processor_names(pipe) == {"WanAttnProcessor"}
    assert rec.keys() and rec.status == "finished"


def test_save_dir_round_trip(pipes, tmp_path):
    pipe, kinds = pipes(I2V), ("frame", "topk", "video_to_text", "video_to_image")
    path = tmp_path / "run"
    with WanSpy(pipe) as spy, cogattn.record(pipe, kinds=kinds, heads="all", save_dir=path, **SIZES) as rec:
        generate(pipe, output="latent")
    assert_matches_spy(rec, spy, kinds, [1], "all", 2)  # read back from disk
    run = cogattn.load(path)
    assert rec.keys() and run.keys() == rec.keys()
    for key in rec.keys():
        got, want = run.get(*key), rec.get(*key)
        for a, b in zip(*((got, want) if key[0] == "topk" else ((got,), (want,)))):
            assert torch.equal(a, b), key
    meta = json.loads((path / "run.json").read_text())
    assert meta["model"]["family"] == "wan" and meta["model"]["class"] == "WanTransformer3DModel"
    assert meta["sources"] == {"frame": "self", "topk": "self", "video_to_text": "text", "video_to_image": "image"}
    assert meta["layout"]["context_len"] == TEXT and meta["layout"]["image_len"] == 17


def test_text_to_video_refused(pipes):
    pipe = pipes(T2V)
    with pytest.raises(ValueError, match="text never queries"):
        cogattn.record(pipe, kinds=("text_to_video",))
    assert _processor_names(pipe) == {"WanAttnProcessor"}


def test_video_to_image_refused_without_image_context(pipes):
    pipe = pipes(T2V)
    rec = cogattn.record(pipe, kinds=("video_to_image",))  # the layout is known at the first call only
    with pytest.raises(ValueError, match="cross-attention to image tokens"), rec:
        generate(pipe, output="latent")
    assert rec.keys() == [] and _processor_names(pipe) == {"WanAttnProcessor"}


@pytest.mark.parametrize("heads,H", [(None, 1), ("all", 12), ([3, 5], 2)])  # default "mean": one head slot
def test_estimate_released_wan(heads, H):
    kw = {} if heads is None else dict(heads=heads)
    est = cogattn.estimate(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        num_frames=81,
        height=480,
        width=832,
        num_inference_steps=50,
        kinds=("frame", "video_to_text"),
        **kw,
    )
    lay = est.layout  # (81 - 1) / 4 + 1 = 21 latent frames of 480/16 × 832/16 patches
    assert (lay.text_len, lay.grid, lay.seq_len, lay.context_len) == (0, (21, 30, 52), 21 * 30 * 52, TEXT)
    assert lay.seq_len == 32760
    shapes = {kind: shape for kind, shape, _, _ in est.records}
    assert shapes == {"frame": (1, H, 21, 21), "video_to_text": (1, H, TEXT, 21, 30, 52)}
    assert all(n == 50 * 30 for *_, n in est.records)  # 50 steps × 30 layers


def test_estimate_released_wan_image_to_video():
    """Wan 2.1 I2V 480P: 257 CLIP tokens (ViT-H/14 at 224 px: 16 × 16 patches and the class token)."""
    est = cogattn.estimate(
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        num_frames=81,
        height=480,
        width=832,
        num_inference_steps=40,
        kinds=("video_to_image",),
        batch="all",
        device="cuda",
    )
    assert (est.layout.grid, est.layout.image_len) == ((21, 30, 52), 257)
    assert [(k, s, n) for k, s, _, n in est.records] == [("video_to_image", (2, 1, 257, 21, 30, 52), 40 * 40)]
    # the conditional call's item of each of the 40 layers waits for the unconditional call, in host memory
    assert est.plan.waiting_bytes == 40 * 4 * 257 * 32760 and est.plan.tile_budget == 2**30
    assert "and in host memory 1,347,091,200 bytes (1284.7 MiB) of results wait" in est.table()
    assert est.peak_extra_memory == est.plan.context_bytes + est.plan.result_bytes  # the GPU's: not the host's


def test_waiting_results_are_checked_against_the_host_memory(monkeypatch):
    """On an accelerator the waiting results are host memory: a recording checks them against what its host
    has available (an estimate, made elsewhere, reports them); on a CPU they share ``memory_budget`` with the
    tiles."""
    kw = dict(num_frames=81, height=480, width=832, num_inference_steps=40, kinds=("video_to_image",), batch="all")
    model = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
    monkeypatch.setattr(cogattn.exact.memory, "host_available", lambda: 10**9)
    plan = cogattn.estimate(model, device="cuda", **kw).plan  # no refusal: the run's host is not this one
    args = (plan.options, cogattn.exact.planner.ModelShape(40, 40, 128, torch.bfloat16), plan.layout)
    call = dict(batch_size=2, guidance=True, num_steps=40, sources=CONTEXT, calls_per_step=2)
    with pytest.raises(ValueError, match=r"1,347,091,200 bytes of results .* exceed the 1,000,000,000 bytes of host"):
        cogattn.exact.planner.plan_capture(*args, device="cuda", **call)  # as a recording plans it
    with pytest.raises(ValueError, match=r"memory_budget=1073741824 bytes cannot hold the 1,347,091,200 bytes"):
        cogattn.estimate(model, **kw)
    est = cogattn.estimate(model, memory_budget="2GiB", **kw)
    assert est.plan.tile_budget == 2**31 - est.plan.waiting_bytes
    assert est.peak_extra_memory >= est.plan.waiting_bytes + est.plan.result_bytes  # one memory on a CPU


def test_estimate_tiny_wan_matches_a_recording(pipes):
    kinds = ("frame", "video_to_text", "entropy")
    est = cogattn.estimate("tiny-wan", num_frames=9, height=32, width=48, num_inference_steps=2, kinds=kinds)
    pipe = pipes(T2V)
    with cogattn.record(pipe, kinds=kinds) as rec:
        generate(pipe, output="latent")
    assert est.layout == rec.layout
    assert {k: s for k, s, _, _ in est.records} == {k: tuple(rec.get(k, 0, 0).shape) for k in kinds}
    assert est.num_records == len(rec.keys())


def test_context_kinds_with_a_broadcast_text_batch(pipes):
    """Wan pipelines use ``prompt_embeds`` as given, unrepeated for ``num_videos_per_prompt``: the text keys
    have batch 1 against 2 videos, which the stock attention broadcasts."""
    pipe = pipes(T2V)
    with WanSpy(pipe) as spy, cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="all", heads="all") as rec:
        generate(pipe, videos=2, embeds=True, output="latent")
    assert_matches_spy(rec, spy, ("frame", "video_to_text"), [0, 1, 2, 3], "all", 2)


def test_the_selftest_checks_wan_and_catches_a_wrong_map(monkeypatch):
    """``python -m cogattn.selftest`` records every Wan kind against the reference; a cross-attention map off by
    1e-3 fails it."""
    from cogattn import selftest
    from cogattn.exact import context

    # every method: tests/test_families.py's self-test test for "wan"; here, row tiles and a corrupted context pass
    rows = selftest.family_rows(cogattn.models.wan.SPEC, torch.device("cpu"), torch.float32, quick=True)
    checked = [r for r in rows if r.passed is not None]
    assert checked and all(r.passed and r.bit_identical for r in checked), rows
    real = context.context_pass
    monkeypatch.setattr(cogattn.recorder.capture, "context_pass", lambda *a: [o + 1e-3 for o in real(*a)])
    rows = selftest.family_rows(cogattn.models.wan.SPEC, torch.device("cpu"), torch.float32, quick=True)
    assert not any(r.passed for r in rows if r.passed is not None)


def test_wan_2_2_ti2v_5b_geometry_and_per_token_timesteps():
    """TI2V-5B's VAE compresses space by 16 (patch 2: 32 pixels a token); its pipeline gives a timestep per
    token, 0 on a conditioning first frame, and the step's is the largest."""
    est = cogattn.estimate(
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers", num_frames=121, height=704, width=1280, num_inference_steps=50
    )
    assert est.layout.grid == ((121 - 1) // 4 + 1, 704 // 32, 1280 // 32) and est.layout.context_len == 512
    config = {"patch_size": (1, 2, 2)}
    latents = torch.zeros(2, 48, 31, 44, 80)
    t = torch.full((2, 31 * 22 * 40), 812.0)
    t[:, : 22 * 40] = 0  # the first latent frame is the given image
    layout, batch, step_t, _ = cogattn.models.wan.read_call(config, (latents, t, torch.zeros(2, 512, 8)), {})
    assert (layout.grid, layout.text_len, batch, step_t) == ((31, 22, 40), 0, 2, 812.0)
    assert layout.pixel_frames(121)[1] == range(1, 5)  # Wan's VAE: frame 0 alone, then 4 per latent frame


def test_hand_wired_processors_and_a_chosen_attention_backend():
    """``set_attn_processor(cogattn.WanAttnMapProcessor(rec))`` records what ``record`` records, and a
    recording keeps the attention backend the model was set to (the output stays the stock one's)."""
    pipe = tiny_wan_pipeline()  # its own: the backend and processors are changed here
    with cogattn.record(pipe, kinds=("frame", "video_to_text")) as auto:
        generate(pipe, output="latent")
    stock = pipe.transformer.attn_processors
    rec = cogattn.Recording(pipe, kinds=("frame", "video_to_text"))
    pipe.transformer.set_attn_processor(cogattn.WanAttnMapProcessor(rec))
    generate(pipe, output="latent")
    rec.close()
    pipe.transformer.set_attn_processor(stock)
    assert rec.keys() == auto.keys() and all(torch.equal(rec.get(*k), auto.get(*k)) for k in auto.keys())

    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    pipe.transformer.set_attention_backend("_native_math")
    try:
        reference = generate(pipe)
        with cogattn.record(pipe, kinds=("frame",)):
            backends = {getattr(p._attention_backend, "value", None) for p in pipe.transformer.attn_processors.values()}
            out = generate(pipe)
    finally:  # set_attention_backend also sets diffusers' process-wide active backend, which reset leaves
        pipe.transformer.reset_attention_backend()
        _AttentionBackendRegistry._active_backend = active
    assert backends == {"_native_math"} and torch.equal(out, reference)


@pytest.mark.parametrize("task", [T2V, "image-to-video"])
def test_a_ti2v_5b_style_pipeline_end_to_end(task):
    """Wan 2.2 TI2V-5B's build at toy size: a 48-channel VAE compressing space by 16, per-token timesteps
    (``expand_timesteps``; image-to-video with the image in the first latent frame, no CLIP): the video is
    bit-identical, the steps are the scheduler's, and the maps match the reference."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from cogattn.models.tiny_text import tiny_text_encoder, tiny_tokenizer

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
    )  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    cls = WanPipeline if task == T2V else WanImageToVideoPipeline
    pipe = cls(
        tokenizer=tiny_tokenizer(), text_encoder=tiny_text_encoder(), vae=vae.eval(), transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), expand_timesteps=True,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    extra = {} if task == T2V else {"image": PIL.Image.new("RGB", (96, 64), (200, 10, 10))}
    call = dict(prompt="a red fox", num_frames=9, height=64, width=96, num_inference_steps=2, output_type="pt", **extra)
    stock = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    with WanSpy(pipe) as spy, cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="all", heads="all") as rec:
        out = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(out, stock)
    assert rec.layout.grid == (3, 64 // 32, 96 // 32) and rec.timesteps == [float(t) for t in pipe.scheduler.timesteps]
    assert_matches_spy(rec, spy, ("frame", "video_to_text"), [0, 1], "all", 2)


def test_compiled_blocks_run_eagerly_while_recording():
    """``compile_repeated_blocks()`` (diffusers' way to compile Wan) compiles each block: a recording sets the
    compiled calls aside, with a warning, and puts them back when it closes."""
    pipe = tiny_wan_pipeline()
    stock = generate(pipe)
    pipe.transformer.compile_repeated_blocks(backend="eager", fullgraph=True)
    compiled = [b._compiled_call_impl for b in pipe.transformer.blocks]
    assert all(c is not None for c in compiled)
    with pytest.warns(UserWarning, match="runs uncompiled"), cogattn.record(pipe, kinds=("frame",)) as rec:
        assert all(b._compiled_call_impl is None for b in pipe.transformer.blocks)
        out = generate(pipe)
    assert torch.equal(out, stock) and len(rec.keys()) == 2 * 2
    assert [b._compiled_call_impl for b in pipe.transformer.blocks] == compiled


def test_misuse_gives_messages_that_say_what_to_do(pipes):
    pipe = pipes(T2V)
    with pytest.raises(RuntimeError, match=r"record the pipeline, `cogattn.record\(pipe"):
        with cogattn.record(pipe.transformer, kinds=("frame",), batch=[0]):
            generate(pipe, output="latent")  # the unconditional call looks like a repeated step to a bare transformer
    assert {type(p).__name__ for p in pipe.transformer.attn_processors.values()} == {"WanAttnProcessor"}

    # negative embeddings of another length than the prompt's: one generation; self kinds fine, text kinds refused
    emb = torch.randn(1, TEXT, 16)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb[:, :300], num_frames=9, height=32, width=48)
    call.update(num_inference_steps=2, output_type="latent")
    with cogattn.record(pipe, kinds=("frame",), batch="all") as rec:
        pipe(**call)
    assert rec.status == "finished" and len(rec.timesteps) == 2 and len(rec.keys()) == 2 * 2
    with pytest.raises(RuntimeError, match="negative_prompt_embeds of one length"):
        with cogattn.record(pipe, kinds=("video_to_text",), batch="all"):
            pipe(**call)

    flf2v = {"patch_size": [1, 2, 2], "image_dim": 1280, "pos_embed_seq_len": 514, "out_channels": 16}
    assert cogattn.models.wan.layout_for_video(flf2v, 81, 480, 832, None).image_len == 514  # two CLIP images

    no_transformer = tiny_wan_pipeline(experts=2)
    no_transformer.transformer = None
    with pytest.raises(TypeError, match="has no `transformer`"):
        cogattn.record(no_transformer, kinds=("frame",))


def test_results_waiting_for_the_second_call_are_planned_and_held_once(pipes):
    """Under guidance with ``batch="all"`` the conditional call's half of every captured layer waits in host
    memory for the unconditional call: the plan counts exactly those bytes, only they are held, and a
    budget that cannot hold them is refused before any block runs."""
    pipe = pipes(T2V)
    kinds, held = ("frame", "video_to_text", "topk"), []
    with cogattn.record(pipe, kinds=kinds, batch="all", heads="all", **SIZES) as rec:
        hook = pipe.transformer.register_forward_pre_hook(
            lambda *_: held.append(sum(part.nbytes for parts in rec._capture.pending.values() for _, part in parts[1:]))
        )
        generate(pipe, output="latent")
        hook.remove()
    one_item = sum(4 * rec.get(kind, 0, 0)[:1].numel() for kind in kinds if kind != "topk")
    one_item += 4 * 2 * rec.get("topk", 0, 0).values[:1].numel()  # stored as values and indices in float32
    layers = len(pipe.transformer.blocks)
    assert rec.plan.waiting_bytes == layers * one_item > 0
    assert held == [0, layers * one_item, 0, layers * one_item]  # each step's second call finds one half per layer
    assert rec.plan.peak_extra_memory >= rec.plan.waiting_bytes + rec.plan.result_bytes
    assert rec.plan.tile_budget == rec.options.memory_budget - rec.plan.waiting_bytes
    tiny = dict(num_frames=9, height=32, width=48, num_inference_steps=2, kinds=kinds, heads="all", **SIZES)
    est = cogattn.estimate("tiny-wan", guidance_scale=5.0, batch="all", **tiny)
    assert est.plan.waiting_bytes == rec.plan.waiting_bytes and "wait in host memory" in est.table()
    assert cogattn.estimate("tiny-wan", **tiny).plan.waiting_bytes == 0  # one half: nothing waits
    budget = layers * one_item  # the tiles alone fit it, the tiles and the waiting results do not
    need = rf"raise memory_budget to at least {budget + layers * one_item} bytes"
    with pytest.raises(ValueError, match=rf"cannot hold the [\d,]+ bytes of results that wait in host .*{need}"):
        with cogattn.record(pipe, kinds=kinds, batch="all", heads="all", memory_budget=budget, **SIZES):
            generate(pipe, output="latent")
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes is too small for one tile"):  # not the waiting
        cogattn.estimate("tiny-wan", batch="all", memory_budget=1000, **tiny)


def test_the_cross_attention_keeps_the_memory_budget():
    """``video_to_text``'s tiles fit ``memory_budget`` less its headroom, as every other kind's, and a budget
    too small for one row is refused with the same message as ``frame``'s."""
    for budget in (2**12, 2**16, 2**20, 2**30):
        for device in ("cpu", "cuda"):
            try:
                h, r, peak = cogattn.exact.memory.context_tile(12, 32760, 512, 128, budget, device)
            except ValueError as err:
                assert "is too small for one tile" in str(err) and budget < 4 * (512 + 128 + 512 * 128) * 33 // 32
                continue
            assert peak <= cogattn.exact.memory.usable(budget) and h >= 1 and r >= 1
    kw = dict(num_frames=9, height=32, width=48, num_inference_steps=2)
    for kind in ("frame", "video_to_text"):
        with pytest.raises(ValueError, match="memory_budget=1000 bytes is too small for one tile"):
            cogattn.estimate("tiny-wan", kinds=kind, memory_budget=1000, **kw)
    # one row of the 512 text keys takes 26 KB: 12,000 bytes hold a tile of frame's (with one thread's workspace of
    # the CPU flash kernel) but none of video_to_text's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cogattn.estimate("tiny-wan", kinds="frame", memory_budget=12_000, **kw).plan.tiles.peak_bytes <= 12_000
        with pytest.raises(ValueError, match=r"12000 bytes is too small for one tile of a cross-attention to 512 keys"):
            cogattn.estimate("tiny-wan", kinds="video_to_text", memory_budget=12_000, **kw)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scheduler", ["heun", "unipc"])
def test_each_scheduler_step_is_a_step_where_a_timestep_repeats(scheduler, monkeypatch):
    """Heun's scheduler evaluates the model twice at a timestep (its correction), and UniPC's integer timesteps repeat
    where flow_shift × steps passes 1000: each step of the scheduler is a recorded step (``rec.timesteps`` repeats),
    its maps the naive softmax of its own calls' q and k, ``[uncond, cond]``."""
    import diffusers
    from diffusers import FlowMatchHeunDiscreteScheduler, UniPCMultistepScheduler
    from diffusers.models.transformers import transformer_wan
    from reference import AttentionSpy, spy_probs

    pipe = tiny_wan_pipeline()
    pipe.scheduler, steps = {
        "heun": (FlowMatchHeunDiscreteScheduler(), 3),
        "unipc": (
            UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=300.0),
            5,
        ),
    }[scheduler]
    call = cogattn.models.wan.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)

    def run():
        return pipe(**call, num_inference_steps=steps, generator=torch.Generator().manual_seed(1), output_type="pt")

    spy = AttentionSpy(pipe, cogattn.models.wan.SPEC, monkeypatch, transformer_wan)
    try:
        stock = run().frames
    except AssertionError:  # diffusers 0.35's UniPC asserts at a repeated timestep (its order 0), without cogattn
        pytest.skip(f"diffusers {diffusers.__version__}'s {type(pipe.scheduler).__name__} fails at a repeated timestep")
    finally:
        spy.remove()
        monkeypatch.undo()
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all", layers=[1]) as rec:
        assert torch.equal(run().frames, stock)
    assert len(rec.timesteps) == len(spy.calls) // 2 == pipe._num_timesteps > len(set(rec.timesteps))
    for step in range(len(rec.timesteps)):
        cond, uncond = (spy.calls[2 * step + n][(1, "self")][0] for n in (0, 1))
        want = torch.cat([spy_probs(*c[:2], c[3]) for c in (uncond, cond)])
        assert (rec.get("full", step, 1).double() - want).abs().max() < 1e-5, step


def test_a_step_of_one_call_then_a_step_at_its_timestep_is_two_steps(monkeypatch):
    """Heun with guidance switched off after step 0 (a callback): step 1 makes one call at a timestep that step 2
    evaluates again; the scheduler stepped between them, so step 2's call is its own step, not step 1's second."""
    from diffusers import FlowMatchHeunDiscreteScheduler
    from diffusers.models.transformers import transformer_wan
    from reference import AttentionSpy, spy_probs

    pipe = tiny_wan_pipeline()
    pipe.scheduler = FlowMatchHeunDiscreteScheduler()

    def off(p, step, t, tensors):
        p._guidance_scale = 1.0 if step == 0 else p._guidance_scale
        return {}

    call = cogattn.models.wan.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    call.update(num_inference_steps=3, output_type="latent", callback_on_step_end=off)
    spy = AttentionSpy(pipe, cogattn.models.wan.SPEC, monkeypatch, transformer_wan)
    try:
        pipe(**call, generator=torch.Generator().manual_seed(1))
    finally:
        spy.remove()
        monkeypatch.undo()
    with cogattn.record(pipe, kinds=("full",), batch="cond", heads="all", layers=[1]) as rec:
        pipe(**call, generator=torch.Generator().manual_seed(1))
    assert rec.timesteps == [float(t) for t in pipe.scheduler.timesteps] and len(rec.timesteps) == 5
    cond = [seen[(1, "self")][0] for seen in spy.calls]  # 2 calls at step 0 (cond, uncond), then one a step
    for step, c in enumerate([cond[0], *cond[2:]]):
        assert (rec.get("full", step, 1).double() - spy_probs(*c[:2], c[3])).abs().max() < 1e-5, step
