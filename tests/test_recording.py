"""End to end on tiny random pipelines: outputs bit-identical, every kind equal to the naive reference."""

import pytest
import torch
from reference import KINDS, QKSpy, assert_matches_naive
from tiny_calls import generate

import cogattn
from cogattn.models.cogvideox import TINY_TEXT_LEN, tiny_pipeline

QUERIES = [0, (1, 2, 4), (0, 0, 0), 20]
SIZES = dict(block_size=7, topk=5)  # blocks that do not divide S (the default 128 is one block here)
PATTERNS = ("spatial", "temporal")  # reference.KINDS holds pattern_recall, which needs them


CONFIGS = [
    pytest.param(
        task, version, dtype, fused, id=f"{task[:5]}-{version}-{str(dtype)[6:]}-{'fused' if fused else 'plain'}"
    )
    for task in ("text-to-video", "image-to-video")
    for version in ("1.0", "1.5")
    for dtype in (torch.float32, torch.bfloat16)
    for fused in (False, True)
]


@pytest.mark.parametrize("task,version,dtype,fused", CONFIGS)
def test_output_bit_identical_with_every_kind(task, version, dtype, fused):
    pipe = tiny_pipeline(task, version, dtype=dtype)
    if fused:
        pipe.transformer.fuse_qkv_projections()
    stock = generate(pipe)
    originals = pipe.transformer.attn_processors
    with cogattn.record(
        pipe, kinds=KINDS, queries=QUERIES, heads="all", memory_budget="64MiB", patterns=PATTERNS
    ) as rec:
        captured = generate(pipe)
    assert torch.equal(captured, stock)
    assert len(rec.keys()) == len(KINDS) * 2 * len(pipe.transformer.transformer_blocks)
    assert rec.get("frame", 1, 1).dtype == torch.float32
    restored = pipe.transformer.attn_processors
    assert all(restored[n] is originals[n] for n in originals)


@pytest.mark.parametrize("path", ["rows", "sdpa"])
@pytest.mark.parametrize(
    "batch,heads,expect_batch",
    [
        ("cond", "all", [2, 3]),
        ("uncond", "mean", [0, 1]),
        ([3, 0], [1], [3, 0]),
        ([1, 0], [2, 0], [1, 0]),
        ("all", "mean", [0, 1, 2, 3]),
    ],
)
def test_cfg_two_videos_per_prompt_match_naive(path, batch, heads, expect_batch):
    """Odd, non-square 3x7 grid; CFG with two videos gives the batch [u, u, c, c]; batch and head lists keep
    their order in the results."""
    pipe = tiny_pipeline(num_heads=3)
    spy = QKSpy(pipe.transformer)
    options = dict(batch=batch, heads=heads, queries=QUERIES, method=path, patterns=PATTERNS)
    with cogattn.record(pipe, kinds=KINDS, **options, **SIZES) as rec:
        generate(pipe, videos=2, width=112, output_type="latent")
    spy.remove()
    assert rec.layout.grid == (3, 3, 7) and rec.batch_items == tuple(expect_batch)
    assert_matches_naive(rec, spy, expect_batch, heads, queries=QUERIES)


@pytest.mark.parametrize(
    "task,version,rotary,fused",
    [
        ("text-to-video", "1.0", False, False),  # sincos positions (2b style)
        ("text-to-video", "1.5", True, False),  # temporal patches
        ("image-to-video", "1.5", True, True),  # I2V with ofs embedding, fused QKV
        ("image-to-video", "1.0", True, False),
    ],
)
def test_model_variants_match_naive(task, version, rotary, fused):
    pipe = tiny_pipeline(task, version, rotary=rotary)
    if fused:
        pipe.transformer.fuse_qkv_projections()
    spy = QKSpy(pipe.transformer)
    budget = 20_000
    with cogattn.record(
        pipe, kinds=KINDS, batch="cond", heads="mean", queries=QUERIES, memory_budget=budget, patterns=PATTERNS, **SIZES
    ) as rec:
        generate(pipe, output_type="latent")
    spy.remove()
    expected_frames = 2 if version == "1.5" else 3
    assert rec.layout.grid == (expected_frames, 3, 5)
    assert_matches_naive(rec, spy, [1], "mean", queries=QUERIES)


def test_layers_steps_selection_and_timesteps():
    pipe = tiny_pipeline(num_layers=3)
    with cogattn.record(pipe, kinds="frame", layers=[2, 0], steps=[1, 2]) as rec:
        generate(pipe, steps=3, output_type="latent")
    assert rec.keys() == [("frame", s, layer) for s in (1, 2) for layer in (0, 2)]
    assert len(rec.timesteps) == 3 and rec.timesteps == sorted(rec.timesteps, reverse=True)
    assert rec.timesteps == [float(t) for t in pipe.scheduler.timesteps]
    with pytest.raises(KeyError, match="step=0"):
        rec.get("frame", 0, 0)


@pytest.mark.parametrize("path", ["rows", "sdpa"])
def test_bf16_maps_are_float32_and_match_naive(path):
    pipe = tiny_pipeline(dtype=torch.bfloat16)
    spy = QKSpy(pipe.transformer)
    kinds = ("frame", "video_to_text", "entropy", "received", "query_frame", "block", "topk")
    with cogattn.record(pipe, kinds=kinds, batch="cond", heads="all", method=path, **SIZES) as rec:
        generate(pipe, output_type="latent")
    spy.remove()
    assert all(rec.get(k, 0, 0)[0].dtype == torch.float32 for k in kinds)
    assert_matches_naive(rec, spy, [1], "all", kinds=kinds)


def test_bare_transformer_target():
    pipe = tiny_pipeline()
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe.transformer, kinds=("query",), queries=[3, (2, 2, 4)], batch=[1]) as rec:
        generate(pipe, steps=1, output_type="latent")
    spy.remove()
    assert_matches_naive(rec, spy, [1], "mean", kinds=("query",), queries=[3, (2, 2, 4)])


def test_hand_wired_processor():
    pipe = tiny_pipeline()
    stock = generate(pipe, steps=1)
    spy = QKSpy(pipe.transformer)
    rec = cogattn.Recording(pipe, kinds=("frame",), batch="cond")
    pipe.transformer.set_attn_processor(cogattn.CogVideoXAttnMapProcessor(rec))
    out = generate(pipe, steps=1)
    rec.close()
    spy.remove()
    assert torch.equal(out, stock)
    assert_matches_naive(rec, spy, [1], "mean", kinds=("frame",))


def test_loaded_from_pretrained_folder(tmp_path):
    from diffusers import CogVideoXPipeline

    tiny_pipeline().save_pretrained(tmp_path)
    pipe = CogVideoXPipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a red fox", num_frames=9, num_inference_steps=1, max_sequence_length=TINY_TEXT_LEN)
    stock = pipe(**call, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    spy = QKSpy(pipe.transformer)
    with cogattn.record(pipe, kinds=("frame",), batch="cond") as rec:
        out = pipe(**call, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    spy.remove()
    assert torch.equal(out, stock)
    assert rec.get("frame", 0, 1).shape == (1, 1, 4, 4)
    assert_matches_naive(rec, spy, [1], "mean", kinds=("frame",))


@pytest.mark.parametrize(
    "output,dtype,batch,heads",
    [
        ("lse", torch.float32, "cond", "all"),
        ("lse", torch.bfloat16, "cond", "all"),
        ("joint", torch.float32, "cond", "all"),
        ("joint", torch.bfloat16, "cond", "all"),
        ("joint", torch.float32, [3, 0], [2, 0]),  # batch items not side by side: gathered, the rest stock
        ("joint", torch.float32, "all", "mean"),
        ("joint", torch.float32, [3, 2, 1, 0], [2, 1, 0]),  # every batch item and every head, reordered
    ],
)
def test_opt_in_outputs_keep_cpu_output_identical_and_maps_exact(output, dtype, batch, heads, monkeypatch):
    """Opt-in outputs. "lse": the output comes from the flash kernel SDPA dispatches to on the CPU, and
    video_to_text needs no attention pass of its own. "joint": one call on values widened with the frame
    indicator gives the output, the lse and the frame sums, and capture runs no attention pass at all.
    On the CPU both keep the video bit-identical."""
    import cogattn.exact.attention as attention

    pipe = tiny_pipeline(dtype=dtype, num_heads=3)
    stock = generate(pipe, videos=2, width=112)
    passes = []
    real = attention.sdpa_with_lse
    monkeypatch.setattr(attention, "sdpa_with_lse", lambda *a: passes.append(1) or real(*a))
    spy = QKSpy(pipe.transformer)
    kinds = ("frame", "video_to_text", "query")
    with cogattn.record(pipe, kinds=kinds, batch=batch, heads=heads, queries=QUERIES, layer_output=output) as rec:
        out = generate(pipe, videos=2, width=112)
    spy.remove()
    assert torch.equal(out, stock)
    items = rec.batch_items
    # "lse": frame still needs its indicator pass, per step, layer and batch item
    assert len(passes) == (2 * 2 * len(items) if output == "lse" else 0)
    # the joint call's frame sums carry bf16 rounding (one bf16 value per query row and frame)
    tol = 2**-8 if output == "joint" and dtype == torch.bfloat16 else 1e-5  # P and sums rounded to bf16: ½ ulp each
    assert_matches_naive(rec, spy, list(items), heads, kinds=kinds, queries=QUERIES, tol=tol)


def test_output_choice_is_checked():
    pipe = tiny_pipeline()
    with pytest.raises(ValueError, match="layer_output='fast'"):
        cogattn.record(pipe, layer_output="fast")
    with pytest.raises(ValueError, match="method='rows'"):
        cogattn.record(pipe, layer_output="joint", method="rows")
