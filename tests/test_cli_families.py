"""cogattn-dump reaches every family through its spec (``cogattn.models.ModelSpec``): the tiny pipeline a
config names, the rules of the call, the pipeline a checkpoint loads as. HunyuanVideo end to end: the tiny
random pipeline's maps are those of a direct ``cogattn.record`` of the same call, with and without true
classifier-free guidance; the released checkpoint's plan. In-process through ``main(argv)``, as
tests/test_cli.py."""

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

import cogattn
from cogattn.dump.config import ConfigError, load_config
from cogattn.models import FAMILIES, family

pytestmark = pytest.mark.usefixtures("forget_accelerate_state")  # every test of the module (conftest.py)
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
TINY_HV = ROOT / "configs" / "tiny-hunyuan-video.yaml"
HV = ROOT / "configs" / "hunyuan-video.yaml"
needs_hunyuan = pytest.mark.skipif(
    cogattn.models.hunyuan_video is None,
    reason="cogattn has no HunyuanVideo support with this diffusers (it needs 0.33)",
)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Each test runs in its own folder, offline, with tracebacks of failed prompts on stderr."""
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COGATTN_DEBUG", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _prompt_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def _total(dry_stdout: str) -> int:
    line = next(line for line in dry_stdout.splitlines() if line.split()[:1] == ["total"])
    return int(line.split()[2].replace(",", ""))


@pytest.mark.parametrize("name", [spec.family for spec in FAMILIES])
def test_every_family_s_tiny_model_is_named_and_checked_through_its_spec(name):
    spec = family(name)
    if spec.tiny_call is None:
        pytest.skip(f"{name} gives no call of its tiny pipeline")
    task = spec.tiny_tasks[0]
    try:
        pipe = spec.tiny_pipeline(task)
    except ImportError as missing:  # what its parts need (ConsisID's pipeline: OpenCV)
        with pytest.raises(ConfigError, match="^model: "):  # one line for the user, not a traceback
            load_config(None, [f"model={spec.tiny_name}", f"task={task}"])
        pytest.skip(f"{name}'s tiny pipeline needs what this environment lacks: {' '.join(str(missing).split())}")
    call = spec.tiny_call(pipe, task, torch.Generator().manual_seed(0), False)
    call.setdefault("num_frames", call.get("frames", call.get("video_length")))  # SANA-Video's, Latte's names
    if name == "minimax_h3":  # its tiny call's 5 frames run the denoiser alone; its VAE decodes 17n + 5 for n ≥ 1
        call["num_frames"] = 22
    shape = [f"{key}={call[key]}" for key in ("num_frames", "height", "width")]
    shape += ["guidance_scale=1.0"] * (name == "minimax_h3")  # guidance-distilled: a config's 6.0 is refused
    try:
        cfg = load_config(None, [f"model={spec.tiny_name}", f"task={task}", *shape])
    except ConfigError as err:  # a family the tool plans but does not run, tiny or not (HunyuanVideo 1.5)
        assert spec.refusal(dict(pipe.transformer.config)) and str(err).startswith(
            f"model: '{spec.tiny_name}'; the batch tool does not run"
        )
        return
    assert cfg.family == name and cfg.tiny_spec() is spec and spec.title
    named = {"_class_name": type(pipe.transformer).__name__, **pipe.transformer.config}  # as config.json names it
    assert {k: v for k, v in cfg.model_config().items() if k != "experts"} == named
    assert cfg.max_sequence_length == spec.text_len and cfg.call_arguments()["max_sequence_length"] == spec.text_len


def test_the_tiny_names_of_the_first_families_stay():
    assert family("cogvideox").tiny_name == "tiny" and family("cogvideox").title == "CogVideoX"
    if cogattn.models.wan is not None:
        assert family("wan").tiny_name == "tiny-wan" and family("wan").title == "Wan"
    if cogattn.models.hunyuan_video is not None:
        assert family("hunyuan_video").tiny_name == "tiny-hunyuan-video"
        assert family("hunyuan_video").pipelines == {
            "text-to-video": "HunyuanVideoPipeline",
            "image-to-video": "HunyuanVideoImageToVideoPipeline",
        }


def _direct(pipe, meta: dict, kinds, steps: int, batch: str, **call) -> cogattn.Recording:
    """A direct recording of the tiny HunyuanVideo pipeline called as tiny-hunyuan-video.yaml calls it."""
    with cogattn.record(pipe, kinds=kinds, layers="all", steps="all", batch=batch, heads="mean") as rec:
        pipe(
            prompt=meta["prompt"],
            prompt_template={"template": "{}", "crop_start": 0},  # the tiny tokenizer's words, no LLaMA template
            max_sequence_length=12,
            num_frames=9,
            height=32,
            width=48,
            num_inference_steps=steps,
            guidance_scale=6.0,
            output_type="latent",  # the maps do not depend on the decoding
            generator=torch.Generator().manual_seed(meta["seed"]),
            **call,
        )
    return rec


def _check_against(run: cogattn.Run, rec: cogattn.Recording) -> None:
    assert sorted(run.keys()) == sorted(rec.keys())
    for kind, step, layer in run.keys():
        torch.testing.assert_close(run.get(kind, step, layer), rec.get(kind, step, layer), rtol=0, atol=0)


@needs_hunyuan
def test_tiny_hunyuan_video_writes_the_maps_of_a_direct_recording(tmp_path, dump):
    from cogattn.models.hunyuan_video import tiny_pipeline

    out = tmp_path / "runs"
    dry = dump(TINY_HV, "--dry-run", "--set", f"save_dir={out}", check=0)
    assert "model tiny-hunyuan-video (text-to-video), 3 prompts, 2 steps, 9 frames at 32×48" in dry.stdout
    assert "layout: 3×2×3 video + 12 text tokens, S = 30" in dry.stdout and not out.exists()
    assert "3 prompts written" in dump(TINY_HV, "--set", f"save_dir={out}", check=0).stdout
    assert sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors")) == _total(dry.stdout)
    cfg = load_config(TINY_HV)
    kinds = cfg.capture.kinds
    pipe = tiny_pipeline()
    for folder, words in zip(_prompt_dirs(out), (7, 6, 7)):  # the words of prompts/tiny.txt
        meta = json.loads((folder / "prompt.json").read_text())
        assert meta["complete"] is True and meta["negative_prompt"] is None
        assert meta["config"]["max_sequence_length"] == 12 and meta["config"]["true_cfg_scale"] is None
        with Image.open(folder / meta["video"]) as gif:
            assert meta["video"] == "video.gif" and gif.n_frames == 9 and gif.size == (48, 32)
        assert {"frame.png", "video_to_text.png", "text_to_video.png", "heads.png"} <= set(meta["previews"])
        run = cogattn.load(folder / "maps")
        assert run.complete and run.layout.text_position == "end" and run.layout.grid == (3, 2, 3)
        assert run.layer_names[2] == "single_transformer_blocks.0.attn" and len(run) == 3 * 2 * 4  # kinds×steps×layers
        _check_against(run, _direct(pipe, meta, kinds, 2, "all"))
        kept = words + 1  # and </s>; the padded text keys get exactly 0
        assert run.get("video_to_text", 1, 3)[:, :, kept:].abs().max() == 0
        assert run.get("video_to_text", 1, 3)[:, :, :kept].sum(2).min() > 0


@needs_hunyuan
def test_true_cfg_scale_guides_with_the_empty_negative_prompt_and_the_plan_counts_both_calls(tmp_path, dump):
    from cogattn.models.hunyuan_video import tiny_pipeline

    out = tmp_path / "runs"
    (tmp_path / "p.txt").write_text("a red fox running in the snow\n")
    sets = _sets(f"prompts={tmp_path / 'p.txt'}", "true_cfg_scale=4.0", "capture.kinds=[frame,video_to_text]",
                 "previews=false", f"save_dir={out}")  # fmt: skip
    dry = dump(TINY_HV, *sets, "--dry-run", check=0)
    dump(TINY_HV, *sets, check=0)
    assert sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors")) == _total(dry.stdout)
    (folder,) = _prompt_dirs(out)
    meta = json.loads((folder / "prompt.json").read_text())
    assert meta["negative_prompt"] == "" and meta["config"]["true_cfg_scale"] == 4.0
    run = cogattn.load(folder / "maps")
    assert run.get("frame", 0, 0).shape[0] == 2  # batch "all" under true guidance: [uncond, cond]
    pipe = tiny_pipeline()
    kinds = ("frame", "video_to_text")
    _check_against(run, _direct(pipe, meta, kinds, 2, "all", negative_prompt="", true_cfg_scale=4.0))
    plain = _direct(pipe, meta, kinds, 2, "all")  # one call per step: the conditional item alone
    assert plain.get("frame", 0, 0).shape[0] == 1
    assert torch.equal(plain.get("frame", 0, 0)[0], run.get("frame", 0, 0)[1])  # the same first step
    assert not torch.equal(plain.get("frame", 1, 0)[0], run.get("frame", 1, 0)[1])  # guided from step 0 on


@needs_hunyuan
def test_the_released_hunyuan_video_plans_offline(dump, tmp_path):
    proc = dump(HV, "--dry-run", "--set", f"save_dir={tmp_path / 'x'}", check=0)
    assert "model hunyuanvideo-community/HunyuanVideo (text-to-video), 3 prompts, 50 steps, 129 frames" in proc.stdout
    assert "layout: 33×45×80 video + 256 text tokens, S = 119,056" in proc.stdout  # 33·45·80 + 256
    assert "video_to_text  (1, 1, 256, 33, 45, 80)" in proc.stdout
    records = 60 * 6 * 3  # layers (20 dual + 40 single) × captured steps × prompts, per kind
    assert re.search(rf"frame  \(1, 1, 34, 34\) +[\d,]+ +{records:,}", proc.stdout)  # 33 latent frames + the text
    cfg = load_config(HV)
    assert cfg.family == "hunyuan_video" and cfg.call_arguments()["max_sequence_length"] == 256
    assert "true_cfg_scale" not in cfg.call_arguments()  # left out: the pipeline's default
    assert not (tmp_path / "x").exists()


@needs_hunyuan
def test_a_hunyuan_video_checkpoint_folder_loads_with_its_vae_in_float32(tmp_path):
    from diffusers import HunyuanVideoPipeline

    from cogattn.dump.generate import load_pipeline
    from cogattn.models.hunyuan_video import tiny_pipeline

    tiny_pipeline().save_pretrained(tmp_path / "checkpoint")
    cfg = load_config(TINY_HV, [f"model={tmp_path / 'checkpoint'}", "dtype=bfloat16"])
    assert cfg.family == "hunyuan_video" and cfg.tiny_spec() is None
    pipe = load_pipeline(cfg, "cpu")
    assert type(pipe) is HunyuanVideoPipeline and pipe.transformer.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32


@pytest.mark.parametrize(
    "config,sets,message",
    [
        (
            TINY,
            ["true_cfg_scale=4"],
            r"true_cfg_scale: tiny is a CogVideoX model, whose pipeline has no true_cfg_scale; its classifier-free "
            r"guidance is guidance_scale",
        ),
        (TINY, ["tiny_version=2.0"], r"tiny_version: '2.0' is not one of \['1.0', '1.5'\]"),
        (TINY, ["model=THUDM/CogVideoX-5b", "tiny_version=1.5"], r"tiny_version: '1.5' is for model: tiny \("),
        (
            TINY_HV,
            ["height=40"],
            r"height: 40 must be a positive multiple of 16 \(the HunyuanVideo VAE's 8 × the patch",
        ),
        (HV, ["width=1000"], r"width: 1000 must be a positive multiple of 16"),
        (TINY_HV, ["num_frames=10"], r"num_frames: 10; the HunyuanVideo VAE decodes 4k \+ 1 frames .*: use 9 or 13"),
        (
            TINY_HV,
            ["task=image-to-video"],
            r"task: 'image-to-video'; the batch tool runs tiny-hunyuan-video \(the tiny HunyuanVideo pipeline\) "
            r"for text-to-video only",
        ),
        (HV, ["task=image-to-video"], r"task: 'image-to-video'; the batch tool runs HunyuanVideo checkpoints for"),
        (TINY_HV, ["true_cfg_scale=-1"], r"true_cfg_scale: -1 must be ≥ 0"),
        (TINY_HV, ["true_cfg_scale=high"], r"true_cfg_scale: expected a number, got 'high'"),
        (TINY_HV, ["guidance_scale_2=3"], r"guidance_scale_2 .*; HunyuanVideo has one transformer\.$"),
        (TINY_HV, ["capture.layer_output=joint"], r"hunyuan_video's attention takes a key mask"),
        (TINY_HV, ["capture.kinds=[video_to_image]"], r"kind 'video_to_image' does not exist for hunyuan_video"),
    ],
)
def test_bad_values_exit_2_with_one_line_and_write_nothing(tmp_path, dump, config, sets, message):
    if config != TINY and cogattn.models.hunyuan_video is None:
        pytest.skip("cogattn has no HunyuanVideo support with this diffusers (it needs 0.33)")
    out = tmp_path / "runs"
    proc = dump(config, *_sets(*sets, f"save_dir={out}"), check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dump_maps: "), proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "config,model,message",
    [
        (
            "skyreels-v2-t2v-14b-540p.yaml",
            "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
            r"is a diffusion-forcing checkpoint; .* record SkyReelsV2DiffusionForcingPipeline from Python",
        ),
        (
            "helios-base.yaml",
            "BestWishYsh/Helios-Distilled",
            r"is a pyramid checkpoint; the batch tool runs HeliosPipeline only: record HeliosPyramidPipeline from Python",
        ),
        (
            "kandinsky5-t2v-lite-5s.yaml",
            "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-10s-Diffusers",
            r"runs NABLA sparse attention, which needs flex attention; .* record it from Python",
        ),
        (
            "easyanimate-v5.1-12b.yaml",
            "alibaba-pai/EasyAnimateV5.1-12b-zh-InP-diffusers",
            r"is an inpaint \(image-to-video\) checkpoint .* record its inpaint or control pipeline from Python",
        ),
    ],
)
def test_a_checkpoint_recorded_from_python_only_is_refused_in_one_line_even_in_a_plan(
    tmp_path, dump, monkeypatch, config, model, message
):
    """Released checkpoints whose pipeline the batch tool does not call (diffusion forcing, EasyAnimate's
    inpaint) are refused by name, offline, rather than run through the plain pipeline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        load_config(ROOT / "configs" / config)
    except ConfigError as err:  # a family this diffusers lacks
        pytest.skip(str(err))
    proc = dump(ROOT / "configs" / config, "--dry-run", *_sets(f"model={model}", f"save_dir={tmp_path}/x"), check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), proc.stderr


def test_a_family_the_batch_tool_only_plans_is_refused_before_anything_loads(tmp_path, dump, monkeypatch):
    """Wan Animate's call needs pose and face videos that a prompts file does not give: its released config
    plans (``--dry-run``), and a run is refused in one line, before any weight is loaded or folder written."""
    if cogattn.models.wan_animate is None:
        pytest.skip("this diffusers lacks Wan Animate")
    from cogattn.dump import cli

    config = ROOT / "configs" / "wan2.2-animate-14b.yaml"
    out = tmp_path / "runs"
    monkeypatch.setattr(cli, "load_pipeline", lambda *a: pytest.fail("loaded a pipeline the tool cannot run"))
    dry = dump(config, "--dry-run", "--set", f"save_dir={out}", check=0)
    assert "S = 75,600" in dry.stdout
    refused = dump(config, "--set", f"save_dir={out}", check=2)
    assert "the batch tool does not run Wan Animate yet" in refused.stderr and not out.exists()
    assert len(refused.stderr.strip().splitlines()) == 1


def _hv15_labels(pipe, prompt: str) -> list[str]:
    """The valid tokens HunyuanVideo 1.5's pipeline encodes for ``prompt``, read from the ids its own
    ``encode_prompt`` hands its Qwen2.5-VL and ByT5 encoders: the ByT5 bytes of the quoted words, then the Qwen
    tokens after the template's crop (the transformer packs them so, after any image tokens)."""
    seen = {}

    def spy(name):
        def hook(module, args, kwargs):
            seen[name] = (kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask"))

        return hook

    hooks = [pipe.text_encoder.register_forward_pre_hook(spy("mllm"), with_kwargs=True)]
    hooks.append(pipe.text_encoder_2.register_forward_pre_hook(spy("byt5"), with_kwargs=True))
    with torch.no_grad():
        pipe.encode_prompt(prompt, device=torch.device("cpu"))
    for hook in hooks:
        hook.remove()
    crop = pipe.prompt_template_encode_start_idx
    ids, mask = seen["mllm"]
    names = []
    if "byt5" in seen:
        glyph, glyph_mask = seen["byt5"]
        names += pipe.tokenizer_2.convert_ids_to_tokens(glyph[0][glyph_mask[0].bool()].tolist())
    return names + pipe.tokenizer.convert_ids_to_tokens(ids[0, crop:][mask[0, crop:].bool()].tolist())


def test_hunyuan_video_1_5_runs_its_tiny_config_and_plans_the_released_one(tmp_path, dump, monkeypatch):
    """The tiny config runs end to end under the guider's guidance (two calls a step, set in place): each prompt's
    words are labelled at its own item's spans (after the glyph bytes of a quoted word), the negative's at the
    unconditional item's, and the previews pick the prompt's words; the released config plans offline, its packed
    context's parts printed, and a plan of another context length is refused."""
    if cogattn.models.hunyuan_video15 is None:
        pytest.skip("this diffusers lacks HunyuanVideo 1.5")
    from cogattn.analysis import words
    from cogattn.dump import previews
    from cogattn.models.hunyuan_video15 import tiny_pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = ROOT / "configs" / "hunyuan-video1.5-480p-t2v.yaml"
    dry = dump(config, "--dry-run", "--set", f"save_dir={tmp_path / 'released'}", check=0)
    assert "31×30×53 video + 1985 text tokens, S = 51,275" in dry.stdout
    assert (
        "text: 729 image, 256 glyph, 1000 prompt, packed per item" in dry.stdout and "108 tokens cropped" in dry.stdout
    )
    other = dump(config, "--dry-run", "--set", "max_sequence_length=256", check=2)
    assert "max_sequence_length: 256; HunyuanVideo 1.5's pipelines take none" in other.stderr

    tiny, out = ROOT / "configs" / "tiny-hunyuan-video1.5.yaml", tmp_path / "runs"
    dry = dump(tiny, "--dry-run", "--set", f"save_dir={out}", check=0)
    assert "2 prompts written" in dump(tiny, "--set", f"save_dir={out}", check=0).stdout
    assert sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors")) == _total(dry.stdout)
    pipe = tiny_pipeline()
    glyphs = []
    for folder in _prompt_dirs(out):
        meta, run = json.loads((folder / "prompt.json").read_text()), cogattn.load(folder / "maps")
        assert run.batch_roles == ("uncond", "cond") and len(run.timesteps) == 2  # the guider's two calls a step
        for key, text, slot in (("tokens", meta["prompt"], 1), ("negative_tokens", meta["negative_prompt"], 0)):
            expected = _hv15_labels(pipe, text)
            a, b = run.text_spans[slot]["glyph"][0], run.text_spans[slot]["prompt"][1]
            assert (a, b - a) == (0, len(expected)) and meta[key][a:b] == expected
            assert set(meta[key][b:]) == {pipe.tokenizer.pad_token}
        glyphs.append(run.text_spans[1]["glyph"])
        picked = previews._words(run, pipe, meta["prompt"])
        assert picked and all(run.text_spans[1]["prompt"][0] <= i for i in picked)
        assert {meta["tokens"][i] for i in picked} <= set(meta["prompt"].replace('"', " ").split())
        assert picked == words.word_positions("a", pipe, meta["prompt"], 40, spans=run.text_spans[1])[:1] + picked[1:]
        assert "video_to_text.png" in meta["previews"]
    assert glyphs == [(0, 0), (0, 13)]  # 'Text "fox". ' and ByT5's end token move the second prompt's words on


def test_the_released_kandinsky5_lite_plans_offline(tmp_path, dump, monkeypatch):
    """Kandinsky 5.0 Lite's released config plans offline: 31 latent frames of 32×48 patches and the cross-attention's
    text at its upper bound, max_sequence_length."""
    if cogattn.models.kandinsky5 is None:
        pytest.skip("this diffusers lacks Kandinsky 5")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dry = dump(
        ROOT / "configs" / "kandinsky5-t2v-lite-5s.yaml", "--dry-run", "--set", f"save_dir={tmp_path}/x", check=0
    )
    assert "layout: 31×32×48 video tokens, S = 47,616; cross-attention to 512 text tokens" in dry.stdout
    assert re.search(r"video_to_text  \(1, 1, 512, 31, 32, 48\) +[\d,]+ +45 ", dry.stdout)  # 5 layers × 3 steps × 3
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "config,plan",
    [
        ("cosmos-predict2.5-2b.yaml", "cross-attention to 512 text tokens"),
        ("cosmos-transfer2.5-2b.yaml", "cross-attention to 512 text + 256 image tokens"),
    ],
)
def test_cosmos_2_5_is_planned_and_refused_in_one_line(tmp_path, dump, monkeypatch, config, plan):
    """Cosmos Predict2.5's and Transfer2.5's released configs plan offline (84,480 video tokens; Transfer2.5's image
    branch too), and a run is refused in one line before anything loads; Predict2's checkpoints still run."""
    if cogattn.models.cosmos is None:
        pytest.skip("this diffusers lacks Cosmos")
    from cogattn.dump import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "runs"
    monkeypatch.setattr(cli, "load_pipeline", lambda *a: pytest.fail("loaded a pipeline the tool cannot run"))
    dry = dump(ROOT / "configs" / config, "--dry-run", "--set", f"save_dir={out}", check=0)
    assert f"24×44×80 video tokens, S = 84,480; {plan}" in dry.stdout
    small = ("--set", "capture.kinds=[frame]", "--set", "capture.steps=[0]")  # a plan that fits any disk
    refused = dump(ROOT / "configs" / config, "--set", f"save_dir={out}", *small, check=2)
    assert "plans Cosmos Predict2.5 and Transfer2.5 checkpoints (--dry-run) but does not run" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not out.exists()
    assert family("cosmos").refusal(cogattn.models.cosmos.KNOWN["nvidia/Cosmos-Predict2-2B-Video2World"]) == ""


def test_hunyuan_video_1_5_image_to_video_labels_the_image_tokens_before_each_item_s_text(tmp_path, dump):
    """The tiny config's image-to-video: the image's 16 SigLIP tokens lead every item's context, then the prompt's
    glyph bytes and words (the size is the image's: 720×480 keeps the tiny pipeline's 32×48)."""
    if cogattn.models.hunyuan_video15 is None:
        pytest.skip("this diffusers lacks HunyuanVideo 1.5")
    from cogattn.models.hunyuan_video15 import tiny_pipeline

    prompts = tmp_path / "prompts.jsonl"
    image = ROOT / "configs" / "prompts" / "images" / "gradient.png"
    prompts.write_text(json.dumps({"prompt": 'a "fox" in the snow', "image": str(image), "negative_prompt": "a dog"}))
    out, sets = tmp_path / "runs", ["--set", "task=image-to-video", "--set", f"prompts={prompts}"]
    dump(ROOT / "configs" / "tiny-hunyuan-video1.5.yaml", *sets, "--set", f"save_dir={out}", check=0)
    (folder,) = _prompt_dirs(out)
    meta, run = json.loads((folder / "prompt.json").read_text()), cogattn.load(folder / "maps")
    pipe = tiny_pipeline("image-to-video")
    assert run.layout.image_len == 16 and run.text_spans[1] == {"image": (0, 16), "glyph": (16, 29), "prompt": (29, 37)}
    assert meta["tokens"][:37] == ["<image>"] * 16 + _hv15_labels(pipe, meta["prompt"])
    assert meta["negative_tokens"][:21] == ["<image>"] * 16 + _hv15_labels(pipe, "a dog")


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("tiny*.yaml")))
def test_every_shipped_tiny_config_runs_end_to_end(config, tmp_path, dump):
    """Each family's tiny config as shipped: every prompt complete, its maps readable with the layout of the
    call (the pipeline's own arguments: EasyAnimate takes no max_sequence_length and needs a negative prompt)."""
    try:
        cfg = load_config(ROOT / "configs" / config)
    except ConfigError as err:  # a family this diffusers lacks says which one it needs
        pytest.skip(str(err))
    out = tmp_path / "runs"
    dump(ROOT / "configs" / config, "--set", f"save_dir={out}", "--set", "previews=false", check=0)
    dirs = _prompt_dirs(out)
    assert dirs and all(json.loads((d / "prompt.json").read_text())["complete"] for d in dirs)
    run = cogattn.load(dirs[0] / "maps")
    spec = cfg.spec()  # a call made in windows (Helios's chunks) runs the steps once per window
    steps = spec.call_steps(cfg.num_frames, cfg.num_inference_steps) if spec.call_steps else cfg.num_inference_steps
    assert run.family == cfg.family and len(run.timesteps) == steps and run.records()
    if cfg.family == "cosmos3":  # its labels: tokenize_prompt's ids, the call's metadata sentences (its default) too
        pipe, meta = spec.tiny_pipeline(), json.loads((dirs[0] / "prompt.json").read_text())
        size = dict(num_frames=cfg.num_frames, height=cfg.height, width=cfg.width)
        ids, plain = (pipe.tokenize_prompt(meta["prompt"], **size, add_resolution_template=on)[0] for on in (1, 0))
        assert meta["tokens"] == pipe.text_tokenizer.convert_ids_to_tokens(ids) and len(ids) > len(plain)
    if cfg.family == "minimax_h3":  # a modular pipeline: its prompt verbatim, its soundtrack beside the video
        import wave

        pipe, meta = spec.tiny_pipeline(), json.loads((dirs[0] / "prompt.json").read_text())
        ids = pipe.tokenizer(meta["prompt"], add_special_tokens=False)["input_ids"]
        assert meta["tokens"][: len(ids)] == pipe.tokenizer.convert_ids_to_tokens(ids) and len(run.timesteps) == 2
        with wave.open(str(dirs[0] / meta["audio"])) as sound:  # 37 audio latents (22 frames at 24 fps, 40 a second)
            assert (sound.getnchannels(), sound.getframerate(), sound.getnframes()) == (2, 32000, 37 * 800)


def test_ltx2_s_audio_kinds_run_through_the_batch_tool_and_the_released_config_plans_them(tmp_path, dump):
    """The tiny LTX-2 config records the audio kinds end to end (the maps a direct recording of the same call makes);
    the released config plans them offline at 126 audio bins (121 frames at 24 fps, 25 bins a second)."""
    if cogattn.models.ltx2 is None:
        pytest.skip("this diffusers lacks LTX-2")
    from cogattn.models.ltx2 import tiny_pipeline

    dry = dump(ROOT / "configs" / "ltx2.yaml", "--dry-run", "--set", f"save_dir={tmp_path / 'x'}", check=0)
    assert "S = 6,144; cross-attention to 1024 text tokens; audio: 126 bins (25 a second)" in dry.stdout
    records = 48 * 4 * 3  # layers × captured steps × prompts
    shapes = {"audio": (126, 126), "audio_to_text": (1024, 126), "frame_audio": (16, 126), "audio_frame": (126, 16)}
    for kind, (rows, cols) in shapes.items():  # float16 records of 32 heads' mean
        assert re.search(rf"{kind}  \(1, 1, {rows}, {cols}\) +[\d,]+ +{records:,} ", dry.stdout), kind
    tiny, out = ROOT / "configs" / "tiny-ltx2.yaml", tmp_path / "runs"
    dry = dump(tiny, "--dry-run", "--set", f"save_dir={out}", check=0)
    dump(tiny, "--set", f"save_dir={out}", "--set", "previews=false", check=0)
    assert sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors")) == _total(dry.stdout)
    folder = _prompt_dirs(out)[0]
    meta, run = json.loads((folder / "prompt.json").read_text()), cogattn.load(folder / "maps")
    assert run.layout.audio == cogattn.AudioAxis(18) and run.get("frame_audio", 1, 1).shape == (1, 1, 3, 18)
    pipe, kinds = tiny_pipeline(), ("audio", "audio_to_text", "frame_audio", "audio_frame")
    with cogattn.record(pipe, kinds=kinds, batch="cond", heads="mean") as rec:
        pipe(prompt=meta["prompt"], num_frames=17, height=64, width=128, num_inference_steps=2, guidance_scale=3.0,
             max_sequence_length=8, generator=torch.Generator("cpu").manual_seed(meta["seed"]), output_type="latent")  # fmt: skip
    for kind in kinds:
        for step, layer in ((0, 0), (1, 1)):
            torch.testing.assert_close(run.get(kind, step, layer), rec.get(kind, step, layer), rtol=0, atol=1e-6)


def test_the_negative_prompt_s_labels_are_those_of_the_text_the_pipeline_encoded(tmp_path):
    """Cosmos encodes its own DEFAULT_NEGATIVE_PROMPT where a call gives none: the unconditional item's labels are
    that text's tokens as its text encoder read them (they were the empty prompt's)."""
    from PIL import Image

    from cogattn.dump.config import load_config
    from cogattn.dump.generate import load_pipeline, run_prompt
    from cogattn.dump.prompts import Prompt

    Image.new("RGB", (64, 64)).save(tmp_path / "image.png")
    sets = ["capture.batch=all", "num_inference_steps=1", "previews=false"]
    cfg = load_config(ROOT / "configs" / "tiny-cosmos.yaml", sets)
    pipe = load_pipeline(cfg, "cpu")
    seen, forward = [], pipe.text_encoder.forward

    def spied(*args, **kwargs):
        seen.append(kwargs.get("input_ids", args[0] if args else None)[0].tolist())
        return forward(*args, **kwargs)

    pipe.text_encoder.forward = spied
    run_prompt(pipe, cfg, Prompt(0, "a red fox", None, image=str(tmp_path / "image.png")), tmp_path / "p", 0)
    meta = json.loads((tmp_path / "p" / "prompt.json").read_text())
    assert meta["negative_prompt"] is None and len(seen) == 2  # the prompt's text, then the negative's
    assert meta["negative_tokens"] == pipe.tokenizer.convert_ids_to_tokens(seen[1]) != meta["tokens"]


def test_a_prompt_whose_words_cannot_be_named_keeps_its_generation(tmp_path):
    """Kandinsky 5 cuts a prompt past max_sequence_length by characters, whose tokens cogattn does not name: the batch
    tool keeps the prompt's maps and video, complete, unlabelled with a warning (it failed after the generation, and
    every rerun generated it again)."""
    if cogattn.models.kandinsky5 is None:
        pytest.skip("this diffusers lacks Kandinsky 5")
    from cogattn.dump.config import load_config
    from cogattn.dump.generate import load_pipeline, run_prompt
    from cogattn.dump.prompts import Prompt

    cfg = load_config(ROOT / "configs" / "tiny-kandinsky5.yaml", ["num_inference_steps=1", "previews=false"])
    pipe = load_pipeline(cfg, "cpu")
    long = " ".join(["a red fox runs through the snowy forest at dawn"] * 6)
    with pytest.warns(UserWarning, match="prompt 0: its text tokens are not labelled: this prompt makes"):
        assert run_prompt(pipe, cfg, Prompt(0, long, None), tmp_path / "p", 0)
    meta = json.loads((tmp_path / "p" / "prompt.json").read_text())
    assert meta["complete"] and "tokens" not in meta and "more than the 40" in meta["tokens_error"]
    assert (tmp_path / "p" / meta["video"]).is_file() and cogattn.load(tmp_path / "p" / "maps").complete
