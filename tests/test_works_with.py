"""Recording under what diffusers users switch on (docs/works-with.md): caches first.

Each feature runs on the tiny CogVideoX (one ``[uncond, cond]`` call per step) and the tiny Wan (a
conditional, then an unconditional call per step). The reference is the stock run of the same
configuration, spied (``reference.AttentionSpy``: every ``scaled_dot_product_attention`` call inside an
attention module, proved by ``P @ V``): the video with capture on must be bit-identical to it, every
attention that ran must be recorded and equal the naive float64 reference of its own q and k, and every
attention a cache skipped must have no record, be listed in ``rec.skipped`` and say so when asked for.
"""

from __future__ import annotations

import contextlib

import diffusers
import pytest
import torch
from reference import AttentionSpy, spy_probs
from test_families import CASES
from tiny_calls import generate

import cogattn
from cogattn.models import cogvideox, wan

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not hasattr(diffusers, "MagCacheConfig"),
        reason="the features tested here (caches, group offloading, attention backends, modular pipelines) are "
        "those of the newest diffusers, which .ci/run tests them on",
    ),
]

STEPS = 4


def _pipe(family):
    if family == "wan" and wan is None:
        pytest.skip("this diffusers has no Wan attention modules (0.35)")
    return cogvideox.tiny_pipeline() if family == "cogvideox" else wan.tiny_pipeline()


def _run(pipe, family, output_type="pt"):
    """The seeded, guided call of the tiny pipeline: frames ``(1, 9, 3, H, W)`` (``"latent"``: its latents)."""
    if family == "cogvideox":
        return generate(pipe, steps=STEPS, output_type=output_type)
    call = wan.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    g = torch.Generator().manual_seed(1)
    return pipe(**call, num_inference_steps=STEPS, output_type=output_type, generator=g).frames


def _stock(pipe, family, monkeypatch, batch="cond"):
    """The stock video of the configuration, and the probabilities of every attention that ran, over the
    selected items: ``{(step, layer): (B, H, S, S)}``, each proved by ``P @ V``. ``batch``: ``"cond"`` (the
    conditional item) or ``"all"`` (``[uncond, cond]``, where every call of the step ran that attention on
    both). Wan's calls are spied where its processors dispatch, whatever attention backend they use."""
    spec = cogattn.models.family(family)
    dispatch = None
    if family == "wan":
        from diffusers.models.transformers import transformer_wan as dispatch
    spy = AttentionSpy(pipe, spec, monkeypatch, dispatch)
    try:
        video = _run(pipe, family)
    finally:
        spy.remove()
        monkeypatch.undo()
    calls = 2 if family == "wan" else 1  # Wan: the conditional call first, then the unconditional one
    items: dict = {}  # (step, layer) → {"uncond": P, "cond": P}
    for n, seen in enumerate(spy.calls):
        step, call = divmod(n, calls)
        for (layer, role), found in seen.items():
            if role != "self":
                continue
            (q, k, v, mask, out), *_ = found
            P = spy_probs(q, k, mask)
            assert (P @ v.double() - out.double()).abs().max().item() < 1e-5  # the reference is the attention
            got = items.setdefault((step, layer), {})
            if family == "wan":
                got["uncond" if call else "cond"] = P[0]
            else:  # [uncond, cond], or the conditional half alone (FasterCache)
                got.update(zip(("uncond", "cond")[-P.shape[0] :], P))
    want = ("cond",) if batch == "cond" else ("uncond", "cond")
    ref = {key: torch.stack([got[w] for w in want]) for key, got in items.items() if all(w in got for w in want)}
    return video, ref


def _assert_recorded_what_ran(rec, ref, cache: str | None, layers: int) -> None:
    """Records exactly where the attention ran, each equal to its reference; the rest skipped, by name
    (``cache`` `None`: every attention ran)."""
    ran = set(ref)
    recorded = {(s, layer) for kind, s, layer in rec.keys() if kind == "full"}
    assert recorded == ran, (sorted(recorded), sorted(ran))
    for (s, layer), P in ref.items():
        got = rec.get("full", s, layer)
        assert got.device.type == "cpu"
        err = (got.double() - P).abs().max().item()
        assert err <= 1e-5, (s, layer, err)
    every = {(s, layer) for s in range(STEPS) for layer in range(layers)}
    if cache is None:
        assert ran == every and not rec.skipped, (sorted(ran), rec.skipped)
        return
    assert ran < every, f"{cache} skipped nothing in {STEPS} steps: the test would not see a skip"
    assert {(s, layer) for s, layer, role in rec.skipped.calls if role == "self"} == every - ran
    assert rec.skipped.by == cache
    s, layer = min(every - ran)
    with pytest.raises(cogattn.NotRecordedError, match=rf"step={s}, layer={layer}\): {cache} "):
        rec.get("full", s, layer)


def _caches(family):
    from diffusers import FasterCacheConfig, FirstBlockCacheConfig, PyramidAttentionBroadcastConfig

    try:  # newer caches
        from diffusers import MagCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig
    except ImportError:
        MagCacheConfig = SeaCacheConfig = TaylorSeerCacheConfig = None

    def now(pipe):
        return lambda: pipe.current_timestep

    attn1 = r"transformer_blocks\.\d+\.attn1" if family == "cogvideox" else r"blocks\.\d+\.attn1"
    found = {
        "FirstBlockCache": lambda pipe: FirstBlockCacheConfig(threshold=0.3),
        "PyramidAttentionBroadcast": lambda pipe: PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(0, 1001),
            cross_attention_block_skip_range=2,
            cross_attention_timestep_skip_range=(0, 1001),
            current_timestep_callback=now(pipe),
        ),
        # one [uncond, cond] call per step (CogVideoX): the conditional half alone at some steps, and skipped
        # attention; two calls (Wan): only as a guidance-distilled model, its attention skipped
        "FasterCache": lambda pipe: FasterCacheConfig(
            spatial_attention_timestep_skip_range=(-1, 990),
            current_timestep_callback=now(pipe),
            attention_weight_callback=lambda _: 0.5,
            tensor_format="BFCHW" if family == "cogvideox" else "BCFHW",
            is_guidance_distilled=family == "wan",
        ),
    }
    if MagCacheConfig is not None:
        found["MagCache"] = lambda pipe: MagCacheConfig(
            mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS, retention_ratio=0.0, max_skip_steps=1
        )
        found["TaylorSeerCache"] = lambda pipe: TaylorSeerCacheConfig(
            cache_identifiers=[attn1], disable_cache_before_step=1, cache_interval=2, taylor_factors_dtype=torch.float32
        )
        if family == "wan":  # CogVideoX's pipeline gives SeaCache no step, sigma or step count: it never skips
            found["SeaCache"] = lambda pipe: SeaCacheConfig(threshold=10.0, cache_end_steps=0)
    return found


CACHES = ["FirstBlockCache", "PyramidAttentionBroadcast", "FasterCache", "MagCache", "TaylorSeerCache", "SeaCache"]


@pytest.mark.parametrize("family", ["cogvideox", "wan"])
@pytest.mark.parametrize("cache", CACHES)
def test_a_cache_s_skipped_attentions_have_no_record_and_say_so(family, cache, monkeypatch, tmp_path):
    pipe = _pipe(family)
    if cache not in _caches(family):
        pytest.skip(f"{cache}: not in this diffusers, or it never skips on {family} (docs/works-with.md)")
    pipe.transformer.enable_cache(_caches(family)[cache](pipe))
    for batch in ("all", "cond"):
        video, ref = _stock(pipe, family, monkeypatch, batch)
        with cogattn.record(pipe, kinds=("full",), layers="all", steps="all", batch=batch, heads="all") as rec:
            got = _run(pipe, family)
        assert torch.equal(got, video), "capture changed the video"
        if batch == "all" or set(ref) != {(s, n) for s in range(STEPS) for n in range(len(rec.layer_names))}:
            _assert_recorded_what_ran(rec, ref, cache, len(rec.layer_names))
        else:  # the cache skipped only unconditional attention: batch='cond' has every map
            _assert_recorded_what_ran(rec, ref, None, len(rec.layer_names))
    with cogattn.record(pipe, kinds=("full",), layers="all", batch="all", heads="all", save_dir=tmp_path) as on_disk:
        _run(pipe, family, "latent")
    run = cogattn.load(tmp_path)
    assert run.skipped == on_disk.skipped and run.skipped.calls
    s, layer, _ = min(run.skipped.calls)
    with pytest.raises(cogattn.NotRecordedError, match=f"{cache} "):
        run.get("full", s, layer)


def test_faster_cache_s_conditional_half_is_recorded_for_batch_cond_only(monkeypatch):
    pipe = _pipe("cogvideox")
    pipe.transformer.enable_cache(_caches("cogvideox")["FasterCache"](pipe))
    with cogattn.record(pipe, kinds=("frame",), layers="all", batch="all") as rec:
        _run(pipe, "cogvideox", "latent")
    assert rec.skipped.halves, "FasterCache ran no step on the conditional half: nothing is tested"
    step = min(rec.skipped.halves)
    with pytest.raises(cogattn.NotRecordedError, match=f"conditional half of the batch at step {step}.*batch='all'"):
        rec.get("frame", step, 0)
    with cogattn.record(pipe.transformer, kinds=("frame",), layers="all", batch=[1]) as bare:  # no pipeline
        _run(pipe, "cogvideox", "latent")
    assert bare.skipped.halves == rec.skipped.halves and ("frame", step, 0) in bare.keys()


def test_plots_the_head_table_and_previews_show_a_cache_s_gaps(tmp_path):
    from cogattn import plot
    from cogattn.analysis import aggregate
    from cogattn.analysis.head_stats import head_table
    from cogattn.dump.previews import write_previews

    pipe = _pipe("cogvideox")
    pipe.transformer.enable_cache(_caches("cogvideox")["FirstBlockCache"](pipe))
    kinds = ("frame", "entropy", "received")
    with cogattn.record(pipe, kinds=kinds, layers="all", steps="all", heads="all", save_dir=tmp_path / "run") as rec:
        video = _run(pipe, "cogvideox")
    gaps = {(s, layer) for s, layer, _ in rec.skipped.calls}
    assert gaps and all(layer > 0 for _, layer in gaps)  # block 0 always runs under First Block Cache
    s = min(s for s, _ in gaps)
    # an average over the layers leaves the skipped ones out, and its title says how many
    held = [layer for layer in range(len(rec.layer_names)) if (s, layer) not in gaps]
    mean = torch.stack([rec.get("frame", s, layer)[0].mean(0) for layer in held]).mean(0)
    assert torch.allclose(aggregate(rec, "frame", steps=s), mean, atol=1e-6)
    fig = plot.frame_heatmap(rec, steps=s)
    n = len(rec.layer_names)
    assert f"{n - len(held)} of {n} skipped by FirstBlockCache" in fig.texts[-1].get_text()
    # the layer × step grid: an empty panel that says so, per gap
    grid = plot.layer_step_grid(rec, "frame")
    said = [x for ax in grid.axes for x in ax.texts if x.get_text() == "skipped\n(FirstBlockCache)"]
    assert len(said) == len(gaps)
    # an animation over the steps of a layer the cache skipped: a frame per step, the gaps say so
    out = cogattn.plot.animate(plot.frame_heatmap, rec, tmp_path / "steps.gif", over="step", layers=max(held) + 1)
    from PIL import Image

    assert Image.open(out).n_frames == STEPS
    table = head_table(rec)
    assert not gaps & set(zip(table["step"], table["layer"])) and len(table)
    paths = write_previews(tmp_path / "run", tmp_path / "previews", video[0])
    assert {p.name for p in paths} >= {"frame.png", "entropy.png", "received.png", "heads.png"}


def _check(pipe, family, monkeypatch) -> cogattn.Recording:
    """The video with capture on bit-identical to the configuration's stock video, every attention recorded
    and equal to the reference of its own q and k, nothing skipped."""
    video, ref = _stock(pipe, family, monkeypatch)
    with cogattn.record(pipe, kinds=("full",), layers="all", steps="all", batch="cond", heads="all") as rec:
        got = _run(pipe, family)
    assert torch.equal(got, video), "capture changed the video"
    _assert_recorded_what_ran(rec, ref, None, len(rec.layer_names))
    assert rec.skipped.by is None
    return rec


def _to_q(pipe):
    blocks = getattr(pipe.transformer, "transformer_blocks", None) or pipe.transformer.blocks
    return blocks[0].attn1.to_q


# -- offloading --------------------------------------------------------------------------------------
def _group(offload_type, disk=False):
    def setup(pipe, tmp_path):
        where = {"offload_to_disk_path": str(tmp_path)} if disk else {}
        per = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type=offload_type, **per, **where)

    return setup


def _sequential(pipe, tmp_path):
    # enable_sequential_cpu_offload(device="cpu") fails in accelerate on a machine without an accelerator
    # (diffusers passes cpu:0); these are the same hooks, with the CPU as the execution device.
    from accelerate import cpu_offload

    for part in (pipe.transformer, pipe.text_encoder, pipe.vae):
        cpu_offload(part, execution_device=torch.device("cpu"))


OFFLOAD = {
    "model_cpu_offload": lambda pipe, tmp_path: pipe.enable_model_cpu_offload(device="cpu"),
    "sequential_cpu_offload": _sequential,
    "group_offload_block_level": _group("block_level"),
    "group_offload_leaf_level": _group("leaf_level"),
    "group_offload_leaf_level_to_disk": _group("leaf_level", disk=True),
    "layerwise_casting_float8": lambda pipe, tmp_path: pipe.transformer.enable_layerwise_casting(
        storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32
    ),
}


@pytest.mark.parametrize("family", ["cogvideox", "wan"])
@pytest.mark.parametrize("feature", list(OFFLOAD))
def test_offloading_and_layerwise_casting_keep_the_video_and_the_maps(family, feature, monkeypatch, tmp_path):
    pipe = _pipe(family)
    OFFLOAD[feature](pipe, tmp_path)
    _check(pipe, family, monkeypatch)
    if feature.startswith("layerwise"):
        assert _to_q(pipe).weight.dtype == torch.float8_e4m3fn  # stored in float8 between calls


# -- LoRA ----------------------------------------------------------------------------------------------
def _adapter(pipe, name, rank=4, seed=1):
    from peft import LoraConfig

    torch.manual_seed(seed)  # init_lora_weights=False: random, non-zero LoRA weights
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    pipe.transformer.add_adapter(config, adapter_name=name)


def _saved_adapter(family, name, rank, seed, folder):
    from peft.utils import get_peft_model_state_dict

    pipe = _pipe(family)
    _adapter(pipe, name, rank, seed)
    layers = get_peft_model_state_dict(pipe.transformer, adapter_name=name)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=layers)
    return folder


def _two_adapters(pipe, family, tmp_path):
    _adapter(pipe, "a", seed=1)
    _adapter(pipe, "b", seed=2)
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.3])


def _fused(pipe, family, tmp_path):
    _adapter(pipe, "a")
    pipe.fuse_lora(components=["transformer"])


def _unfused(pipe, family, tmp_path):
    _fused(pipe, family, tmp_path)
    pipe.unfuse_lora(components=["transformer"])


def _hotswapped(pipe, family, tmp_path):
    first = _saved_adapter(family, "a", 4, 1, tmp_path / "a")
    second = _saved_adapter(family, "b", 8, 2, tmp_path / "b")
    pipe.enable_lora_hotswap(target_rank=8)
    pipe.load_lora_weights(first, adapter_name="x")
    pipe.load_lora_weights(second, adapter_name="x", hotswap=True)


LORA = {"set_adapters": _two_adapters, "fuse_lora": _fused, "unfuse_lora": _unfused, "hotswap": _hotswapped}


@pytest.mark.parametrize("family", ["cogvideox", "wan"])
@pytest.mark.parametrize("feature", list(LORA))
def test_lora_maps_are_those_of_the_adapted_model(family, feature, monkeypatch, tmp_path):
    pytest.importorskip("peft", reason="LoRA needs peft (tests/test_works_with.py runs in .ci/run's feature stage)")
    pipe = _pipe(family)
    before = _to_q(pipe).weight.detach().clone()
    LORA[feature](pipe, family, tmp_path)
    assert hasattr(_to_q(pipe), "lora_A") or not torch.equal(_to_q(pipe).weight, before), "no LoRA took effect"
    _check(pipe, family, monkeypatch)


# -- quantization --------------------------------------------------------------------------------------
def _quantized(pipe, family, config, tmp_path):
    """The pipeline's transformer saved, and loaded again with ``config``."""
    pipe.transformer.save_pretrained(tmp_path)
    cls = type(pipe.transformer)
    pipe.register_modules(
        transformer=cls.from_pretrained(tmp_path, quantization_config=config, torch_dtype=torch.float32)
    )
    return pipe


def _torchao(pipe, family, tmp_path):
    pytest.importorskip("torchao", reason="torchao runs in .ci/run's feature stage")
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    _quantized(pipe, family, TorchAoConfig(Int8WeightOnlyConfig()), tmp_path)
    assert "Int8" in type(_to_q(pipe).weight).__name__


def _quanto(pipe, family, tmp_path):
    pytest.importorskip("optimum.quanto", reason="quanto runs in .ci/run's feature stage")
    from diffusers import QuantoConfig

    with pytest.warns(FutureWarning, match="deprecated"):
        _quantized(pipe, family, QuantoConfig(weights_dtype="int8"), tmp_path)
    assert type(_to_q(pipe)).__name__ == "QLinear"


def _gguf(pipe, family, tmp_path):
    """The transformer written as a .gguf (Q8_0 where a weight's rows are whole 32-blocks) and loaded with
    ``from_single_file``; diffusers loads GGUF for Wan (CogVideoX has no single-file loader)."""
    gguf = pytest.importorskip("gguf", reason="gguf runs in .ci/run's feature stage")
    from diffusers import GGUFQuantizationConfig

    pipe.transformer.save_pretrained(tmp_path)
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), arch="tiny")
    for name, tensor in pipe.transformer.state_dict().items():
        a = tensor.detach().float().numpy()
        if a.ndim == 2 and a.shape[-1] % 32 == 0 and name.endswith("weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = GGUFQuantizationConfig(compute_dtype=torch.float32)
    cls = type(pipe.transformer)
    transformer = cls.from_single_file(
        str(tmp_path / "tiny.gguf"), config=str(tmp_path), quantization_config=config, torch_dtype=torch.float32
    )
    pipe.register_modules(transformer=transformer)
    assert type(_to_q(pipe)).__name__ == "GGUFLinear"


QUANTIZED = {"torchao_int8_weight_only": _torchao, "quanto_int8": _quanto, "gguf_q8_0": _gguf}


@pytest.mark.parametrize(
    "family, feature", [(f, q) for f in ("cogvideox", "wan") for q in QUANTIZED if (f, q) != ("cogvideox", "gguf_q8_0")]
)
def test_quantized_transformers_give_the_maps_of_the_quantized_model(family, feature, monkeypatch, tmp_path):
    size = {"head_dim": 16} if feature == "gguf_q8_0" else {}  # Q8_0 quantizes rows of whole 32-blocks
    pipe = wan.tiny_pipeline(**size) if family == "wan" and size else _pipe(family)
    QUANTIZED[feature](pipe, family, tmp_path)
    _check(pipe, family, monkeypatch)


# -- attention backends ----------------------------------------------------------------------------------
@pytest.fixture
def active_backend():
    """``set_attention_backend`` also sets diffusers' process-wide active backend: put it back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = before


def _cpu_backends() -> list[str]:
    """The backends Wan's processors dispatch to on this machine: every one diffusers names whose
    requirements are installed and which runs attention on the CPU."""
    if wan is None:
        return ["native"]
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    q = torch.randn(1, 4, 2, 8)
    names = []
    for backend in AttentionBackendName:
        try:
            _check_attention_backend_requirements(backend)
            dispatch_attention_fn(q, q, q, backend=backend)
        except Exception:  # not installed, or no CPU kernel: docs/works-with.md says which
            continue
        names.append(backend.value)
    return names


@pytest.mark.parametrize("backend", _cpu_backends())
def test_every_attention_backend_on_the_machine_makes_the_output_and_the_maps_stay_exact(
    backend, monkeypatch, active_backend
):
    pipe = _pipe("wan")
    pipe.transformer.set_attention_backend(backend)
    _check(pipe, "wan", monkeypatch)
    assert {p._attention_backend.value for p in pipe.transformer.attn_processors.values()} == {backend}


def test_a_backend_set_while_recording_stays_set_after(monkeypatch, active_backend):
    pipe = _pipe("wan")
    pipe.transformer.set_attention_backend("native")
    with cogattn.record(pipe, kinds=("frame",)):
        pipe.transformer.set_attention_backend("_native_math")
        _run(pipe, "wan", "latent")
    assert {p._attention_backend.value for p in pipe.transformer.attn_processors.values()} == {"_native_math"}


# -- guidance --------------------------------------------------------------------------------------------
def test_a_callback_that_changes_latents_or_switches_guidance_off_keeps_the_steps_right(monkeypatch):
    """``callback_on_step_end`` may change the latents (the steps stay those of the scheduler) or switch
    classifier-free guidance off part-way (Wan then calls the transformer once per step): ``batch='cond'``
    keeps every step, ``batch='all'`` says which steps lost their unconditional call."""
    pipe = _pipe("wan")

    def callback(pipe, step, timestep, tensors):
        if step == 0:
            pipe._guidance_scale = 1.0  # no unconditional call from step 1 on
        return {"latents": tensors["latents"] * 0.9}

    call = wan.tiny_call(pipe, "text-to-video", torch.Generator().manual_seed(0), True)
    call.update(num_inference_steps=STEPS, output_type="latent", callback_on_step_end=callback)
    for batch in ("cond", "all"):
        with (
            pytest.warns(UserWarning, match="did not run, and no cache was found")
            if batch == "all"
            else contextlib.nullcontext()
        ):
            with cogattn.record(pipe, kinds=("frame",), layers="all", steps="all", batch=batch) as rec:
                pipe(**call, generator=torch.Generator().manual_seed(1))
        assert rec.timesteps == [float(t) for t in pipe.scheduler.timesteps]
        steps = {s for _, s, _ in rec.keys()}
        assert steps == (set(range(STEPS)) if batch == "cond" else {0}), (batch, steps)
    with pytest.raises(cogattn.NotRecordedError, match="step 1 made no transformer call for the unconditional"):
        rec.get("frame", 1, 0)


def _modular(guider):
    """The tiny Wan as a modular pipeline (``WanBlocks``, its text encoder block left out: the calls give
    prompt embeddings) with ``guider``."""
    diffusers = pytest.importorskip("diffusers")
    if wan is None or not hasattr(diffusers, "WanBlocks"):
        pytest.skip("this diffusers has no modular Wan pipeline")
    parts = wan.tiny_pipeline()
    blocks = diffusers.WanBlocks()
    blocks.sub_blocks.pop("text_encoder")
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=parts.transformer, vae=parts.vae, scheduler=parts.scheduler, guider=guider)
    call = wan.tiny_call(parts, "text-to-video", torch.Generator().manual_seed(0), True)
    keep = ("prompt_embeds", "negative_prompt_embeds", "num_frames", "height", "width")

    def run():
        g = torch.Generator().manual_seed(1)
        args = {k: call[k] for k in keep}
        return pipe(**args, num_inference_steps=STEPS, generator=g, output_type="pt", output="videos")

    return pipe, run


def _guided_stock(pipe, run, monkeypatch):
    """The stock video, and the probabilities of each step's unperturbed calls, ``{(step, layer):
    [uncond, cond]}``, told apart by the guider's own count of the step's calls (its ``_input_predictions``
    in order: conditional, unconditional, then the perturbed branch)."""
    from diffusers.models.transformers import transformer_wan

    spy = AttentionSpy(pipe, cogattn.models.family("wan"), monkeypatch, transformer_wan)
    guider, where = pipe.guider, []
    hook = pipe.transformer.register_forward_pre_hook(lambda *a: where.append((guider._step, guider._count_prepared)))
    try:
        video = run()
    finally:
        hook.remove()
        spy.remove()
        monkeypatch.undo()
    parts: dict = {}
    for (step, n), seen in zip(where, spy.calls):
        branch = type(guider)._input_predictions[n - 1]
        for (layer, role), ((q, k, v, mask, out), *_) in seen.items():
            if role == "self" and branch in ("pred_cond", "pred_uncond"):
                P = spy_probs(q, k, mask)
                assert (P @ v.double() - out.double()).abs().max().item() < 1e-5  # the reference is the attention
                parts.setdefault((step, layer), {})[branch] = P[0]
    ref = {key: torch.stack([p["pred_uncond"], p["pred_cond"]]) for key, p in parts.items()}
    return video, ref, {step for step, n in where if n == 3}


@pytest.mark.parametrize("guider", ["ClassifierFreeGuidance", "AdaptiveProjectedGuidance", "SkipLayerGuidance"])
def test_a_modular_pipeline_s_guider_keeps_the_branches_apart_and_leaves_perturbed_calls_out(guider, monkeypatch):
    import diffusers

    options = dict(guidance_scale=5.0)
    if guider == "SkipLayerGuidance":  # block 0 skipped in a third, perturbed call of the steps within range
        options.update(skip_layer_config=diffusers.LayerSkipConfig([0]), skip_layer_guidance_start=0.0)
        options.update(skip_layer_guidance_stop=1.0)
    pipe, run = _modular(getattr(diffusers, guider)(**options))
    video, ref, perturbed = _guided_stock(pipe, run, monkeypatch)
    assert bool(perturbed) == (guider == "SkipLayerGuidance"), perturbed
    with cogattn.record(pipe, kinds=("full",), layers="all", steps="all", batch="all", heads="all") as rec:
        got = run()
    assert torch.equal(got, video), "capture changed the video"
    assert rec.batch_items == (0, 1) and rec.skipped.perturbed == perturbed
    _assert_recorded_what_ran(rec, ref, None, len(rec.layer_names))
    with cogattn.record(pipe, kinds=("full",), layers="all", steps="all", batch="cond", heads="all") as cond:
        run()
    assert {(s, layer) for _, s, layer in cond.keys()} == set(ref)
    assert all(torch.allclose(cond.get("full", *key)[0].double(), P[1], atol=1e-5) for key, P in ref.items())
    registry = getattr(pipe.transformer.blocks[0], "_diffusers_hook", None)
    assert not any(name.startswith("SkipLayerGuidance") for name in getattr(registry, "hooks", {}))
    assert "prepare_inputs_from_block_state" not in vars(pipe.guider)  # the guider's own method again


def test_a_guider_makes_a_call_per_branch_for_a_family_that_batches_them_too(monkeypatch):
    """LTX-Video's pipelines batch ``[uncond, cond]`` into one call; its modular pipeline's guider makes a call per
    branch, the conditional first: under ``batch="all"`` each slot is its own call's softmax, ``[uncond, cond]``."""
    ltx = cogattn.models.ltx_video
    if ltx is None or not hasattr(diffusers, "LTXAutoBlocks"):
        pytest.skip("this diffusers has no modular LTX-Video pipeline")
    from diffusers.models.transformers import transformer_ltx

    parts, pipe = ltx.tiny_pipeline(), diffusers.LTXAutoBlocks().init_pipeline()
    guider = diffusers.ClassifierFreeGuidance(guidance_scale=3.0)
    pipe.update_components(**{k: v for k, v in parts.components.items() if v is not None}, guider=guider)
    call = dict(prompt="a red fox", negative_prompt="blurry", num_frames=17, height=64, width=96, output="videos")

    def run():
        return pipe(**call, num_inference_steps=2, max_sequence_length=6, generator=torch.Generator().manual_seed(1))

    spy = AttentionSpy(pipe, ltx.SPEC, monkeypatch, transformer_ltx)
    try:
        video = run()
    finally:
        spy.remove()
        monkeypatch.undo()
    assert len(spy.calls) == 4  # two steps of the conditional call, then the unconditional one
    with cogattn.record(pipe, kinds=("full",), batch="all", heads="all") as rec:
        got = run()
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(got[0], video[0]))
    assert rec.batch_roles == ("uncond", "cond") and len(rec.timesteps) == 2
    for step in range(2):
        for layer in range(len(rec.layer_names)):
            cond, uncond = (spy.calls[2 * step + n][(layer, "self")][0] for n in (0, 1))
            want = torch.cat([spy_probs(*c[:2], c[3]) for c in (uncond, cond)])
            assert (rec.get("full", step, layer).double() - want).abs().max() < 1e-5, (step, layer)


def test_a_second_expert_s_guider_guides_the_generation_where_the_first_does_not():
    """Wan 2.2's modular pipeline: ``guider`` (the first expert's) at 1, ``guider_2`` at 3. The generation is guided:
    ``batch="cond"`` records every step; ``batch="all"`` the second expert's, and a step of the first says it made no
    call for the unconditional items."""
    if wan is None or not hasattr(diffusers, "Wan22Blocks"):
        pytest.skip("this diffusers has no modular Wan 2.2 pipeline")
    parts, blocks = wan.tiny_pipeline(experts=2), diffusers.Wan22Blocks()
    blocks.sub_blocks.pop("text_encoder")
    pipe = blocks.init_pipeline()
    guiders = {name: diffusers.ClassifierFreeGuidance(guidance_scale=s) for name, s in (("guider", 1), ("guider_2", 3))}
    pipe.update_components(
        **{k: getattr(parts, k) for k in ("transformer", "transformer_2", "vae", "scheduler")}, **guiders
    )
    call = wan.tiny_call(parts, "text-to-video", torch.Generator().manual_seed(0), True)
    args = {k: call[k] for k in ("prompt_embeds", "negative_prompt_embeds", "num_frames", "height", "width")}
    for batch, steps in (("cond", {0, 1, 2, 3}), ("all", {2, 3})):  # the boundary: 2 steps an expert
        with cogattn.record(pipe, kinds=("frame",), batch=batch, layers=[1]) as rec:
            pipe(**args, num_inference_steps=4, generator=torch.Generator().manual_seed(1), output="videos")
        assert {s for _, s, _ in rec.keys()} == steps and rec.experts[:3] == ["transformer"] * 2 + ["transformer_2"]
    with pytest.raises(cogattn.NotRecordedError, match="step 0 made no transformer call for the unconditional items"):
        rec.get("frame", 0, 1)


def test_auto_guidance_s_perturbed_unconditional_call_is_left_out(monkeypatch):
    import diffusers

    guider = diffusers.AutoGuidance(
        guidance_scale=5.0, auto_guidance_config=diffusers.LayerSkipConfig([0]), dropout=1.0
    )
    pipe, run = _modular(guider)
    with cogattn.record(pipe, kinds=("frame",), layers="all", steps="all", batch="cond") as cond:
        run()
    assert {s for _, s, _ in cond.keys()} == set(range(STEPS)) and not cond.skipped
    with cogattn.record(pipe, kinds=("frame",), layers="all", steps="all", batch="all") as both:
        run()
    assert not both.keys() and both.skipped.perturbed == set(range(STEPS))
    with pytest.raises(cogattn.NotRecordedError, match="the guider perturbed the model for a call"):
        both.get("frame", 0, 1)


@pytest.mark.parametrize("family", sorted(CASES))
def test_first_block_cache_on_every_family_diffusers_runs_it_with(family, monkeypatch):
    """The conformance tests' tiny pipeline of each family under First Block Cache: what ran is recorded
    and equals the reference of its own q and k (``test_families.stock_reference``), the rest is skipped."""
    from diffusers import FirstBlockCacheConfig
    from test_families import _padded, _spec, generate, stock_reference

    if _spec(family) is None:
        pytest.skip(f"this diffusers lacks {family}")
    pipe = CASES[family].make()
    if not hasattr(pipe.transformer, "enable_cache"):
        pytest.skip(f"{type(pipe.transformer).__name__} takes no cache in diffusers")
    try:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
        video, ref = stock_reference(pipe, family, True, monkeypatch)
    except (ValueError, KeyError, RuntimeError) as err:  # diffusers' cache does not run on this pipeline (Kandinsky
        # 5's image-to-video passes its blocks' inputs by position, which the hook looks up as hidden_states; Motif-
        # Video's first block returns text states of another length than its input's): nothing to record
        pytest.skip(f"First Block Cache does not run on {family} in diffusers: {err}")
    with cogattn.record(pipe, kinds=("full",), layers="all", steps="all", batch="all", heads="all") as rec:
        got = generate(pipe, family, True).frames
    assert torch.equal(got, video)
    if len(rec.timesteps) < 2:  # video-to-video at strength 0.8 runs the last of the 2 steps
        pytest.skip(f"{family}'s tiny call runs one denoising step: nothing for a cache to skip")
    ran = {(key[0], key[1]) for key in ref if key[0] != "mask" and key[2] == "self"}
    assert {(s, layer) for _, s, layer in rec.keys()} == ran
    every = {(s, layer) for s in range(len(rec.timesteps)) for layer in range(len(rec.layer_names))}
    assert ran < every and {(s, layer) for s, layer, _ in rec.skipped.calls} == every - ran
    for s, layer in ran:  # one (1, H, S_b, S_b) per item, [uncond, cond]; zeros where an item has fewer tokens
        want = torch.cat([_padded(P, rec.layout.seq_len) for P in ref[(s, layer, "self")]])
        assert (rec.get("full", s, layer).double() - want).abs().max().item() <= 1e-5


def test_a_guider_whose_guidance_starts_after_the_first_step(monkeypatch):
    """Classifier-free guidance from 30 % of the steps on: step 0 makes one call, the later steps two."""
    import diffusers

    pipe, run = _modular(diffusers.ClassifierFreeGuidance(guidance_scale=5.0, start=0.3))
    video = run()
    for batch in ("cond", "all"):
        with cogattn.record(pipe, kinds=("frame",), layers="all", steps="all", batch=batch) as rec:
            got = run()
        assert torch.equal(got, video)
        steps = {s for _, s, _ in rec.keys()}
        assert steps == (set(range(STEPS)) if batch == "cond" else set(range(1, STEPS))), (batch, steps)
    with pytest.raises(cogattn.NotRecordedError, match="step 0 made no transformer call for the unconditional"):
        rec.get("frame", 0, 0)
