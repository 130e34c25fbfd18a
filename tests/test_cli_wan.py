"""cogattn-dump on Wan: the tiny random Wan pipelines (text-to-video, image-to-video, two experts) and a
Wan checkpoint folder, each run checked against a direct ``cogattn.record`` of the same pipeline call;
the Wan rules of the config. In-process through ``main(argv)``, as tests/test_cli.py."""

import json
import re
from pathlib import Path

import pytest

import cogattn.models

if cogattn.models.wan is None:
    pytest.skip("cogattn has no Wan support with this diffusers (WanAttention came with 0.35)", allow_module_level=True)
import torch
from PIL import Image

import cogattn
from cogattn.dump.config import load_config
from cogattn.models.wan import tiny_pipeline as tiny_wan_pipeline

pytestmark = pytest.mark.usefixtures("forget_accelerate_state")  # every test of the module (conftest.py)
ROOT = Path(__file__).resolve().parents[1]
TINY_WAN = ROOT / "configs" / "tiny-wan.yaml"
TINY = ROOT / "configs" / "tiny.yaml"
CALL = dict(num_frames=9, height=32, width=48, max_sequence_length=512)  # the tiny Wan shape of tiny-wan.yaml
ONE_PROMPT = "a white bird flying over the forest"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Each test runs in its own folder, offline, with tracebacks of failed prompts on stderr."""
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COGATTN_DEBUG", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def wan21_image_to_video():
    """A tiny image-to-video pipeline with Wan 2.1 I2V's image cross-attention (``added_kv_proj_dim``, as its
    config has: an ``add_k_proj`` / ``add_v_proj`` and a softmax of its own over the image tokens), which
    ``tiny_wan_pipeline("image-to-video")`` lacks (tests/test_wan.py, its xfail)."""
    from diffusers import WanTransformer3DModel

    pipe = tiny_wan_pipeline("image-to-video")
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    config["added_kv_proj_dim"] = config["num_attention_heads"] * config["attention_head_dim"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer = WanTransformer3DModel(**config).eval()
    return pipe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Tiny Wan pipelines saved with ``save_pretrained`` (checkpoint folders as the hub's, no network), each
    with the pipeline read back by its class's plain ``from_pretrained`` (a reloaded image processor rounds
    a little differently from the one built in memory)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    root = tmp_path_factory.mktemp("wan-checkpoints")
    saved = {}
    for task, pipe, cls in (
        ("text-to-video", tiny_wan_pipeline(), WanPipeline),
        ("image-to-video", wan21_image_to_video(), WanImageToVideoPipeline),
    ):
        pipe.save_pretrained(root / task)
        saved[task] = root / task, cls.from_pretrained(root / task)
    return saved


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _one_prompt(tmp_path: Path, image: bool = False) -> Path:
    """A prompts file of one prompt (with an image and its own seed for image-to-video)."""
    if not image:
        return _write(tmp_path / "p.txt", ONE_PROMPT + "\n")
    Image.new("RGB", (48, 32), (200, 30, 30)).save(tmp_path / "red.png")
    return _write(tmp_path / "p.jsonl", json.dumps({"prompt": ONE_PROMPT, "image": "red.png", "seed": 3}))


def _prompt_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir())


def _direct(pipe, kinds, steps: int, meta: dict, guidance_scale=5.0, **call) -> cogattn.Recording:
    """A direct recording of ``pipe`` called as the tool calls it for the prompt of ``meta``."""
    if meta["image"] is not None:
        from diffusers.utils import load_image

        call["image"] = load_image(str(Path(meta["config"]["prompts"]).parent / meta["image"]))
    with cogattn.record(pipe, kinds=kinds, layers="all", steps="all", batch="cond", heads="mean") as rec:
        pipe(
            prompt=meta["prompt"],
            **CALL,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            output_type="latent",  # the maps do not depend on the decoding
            generator=torch.Generator().manual_seed(meta["seed"]),
            **call,
        )
    return rec


def _check_prompt(folder: Path, pipe, kinds, steps: int, **call) -> cogattn.Run:
    """The prompt's folder is complete and its maps are those of a direct recording."""
    meta = json.loads((folder / "prompt.json").read_text())
    assert meta["complete"] is True and meta["config_key"] and meta["seconds"] > 0
    assert {"index", "prompt", "negative_prompt", "seed", "image", "model", "process", "config"} <= set(meta)
    assert meta["config"]["capture"]["kinds"] == list(kinds) and meta["config"]["max_sequence_length"] == 512
    with Image.open(folder / meta["video"]) as gif:
        assert meta["video"] == "video.gif" and gif.n_frames == 9 and gif.size == (48, 32)
    run = cogattn.load(folder / "maps")
    assert run.complete and run.meta["info"]["prompt"] == meta["prompt"]
    assert run.layout.context_len == 512 and run.layout.grid == (3, 2, 3)
    rec = _direct(pipe, kinds, steps, meta, **call)
    assert sorted(run.keys()) == sorted(rec.keys()) and len(run) == len(kinds) * steps * 2  # × 2 layers
    for kind, step, layer in run.keys():
        torch.testing.assert_close(run.get(kind, step, layer), rec.get(kind, step, layer), rtol=0, atol=0)
    assert run.experts == rec.experts
    return run


def test_tiny_wan_text_to_video_writes_the_maps_of_a_direct_recording(tmp_path, dump):
    out = tmp_path / "runs"
    dry = dump(TINY_WAN, "--dry-run", "--set", f"save_dir={out}", check=0)
    assert "model tiny-wan (text-to-video), 2 prompts, 2 steps, 9 frames at 32×48" in dry.stdout
    assert "S = 18" in dry.stdout and "(1, 1, 512, 3, 2, 3)" in dry.stdout and not out.exists()
    total_line = next(line for line in dry.stdout.splitlines() if line.split()[:1] == ["total"])
    total = int(total_line.split()[2].replace(",", ""))
    assert "2 prompts written" in dump(TINY_WAN, "--set", f"save_dir={out}", check=0).stdout
    assert sum(f.stat().st_size for f in out.rglob("records/**/*.safetensors")) == total
    cfg = load_config(TINY_WAN)
    dirs = _prompt_dirs(out)
    assert [json.loads((d / "prompt.json").read_text())["prompt"] for d in dirs] == [
        "a red fox running in the snow",
        "a small boat on the sea",
    ]
    pipe = tiny_wan_pipeline()
    for d in dirs:
        _check_prompt(d, pipe, cfg.capture.kinds, 2)
        meta = json.loads((d / "prompt.json").read_text())
        assert set(meta["previews"]) == {"frame.png", "video_to_text.png", "entropy.png", "heads.png"}
        assert meta["head_table"] == "heads.csv" and (d / "heads.csv").is_file()


def test_tiny_wan_image_to_video(tmp_path, dump):
    out = tmp_path / "runs"
    kinds = ("frame", "entropy")  # self-attention: the tiny pipeline has no image cross-attention of its own
    sets = [f"prompts={_one_prompt(tmp_path, image=True)}", "task=image-to-video", "previews=false",
            f"capture.kinds=[{','.join(kinds)}]", f"save_dir={out}"]  # fmt: skip
    dump(TINY_WAN, *(a for s in sets for a in ("--set", s)), check=0)
    (folder,) = _prompt_dirs(out)
    assert json.loads((folder / "prompt.json").read_text())["image"] == "red.png"
    _check_prompt(folder, tiny_wan_pipeline("image-to-video"), kinds, 2)


def test_a_wan_image_to_video_checkpoint_records_the_image_cross_attention(tmp_path, dump, checkpoints):
    out = tmp_path / "runs"
    kinds = ("frame", "video_to_text", "video_to_image")
    folder, pipe = checkpoints["image-to-video"]
    sets = [f"model={folder}", "task=image-to-video", f"prompts={_one_prompt(tmp_path, image=True)}",
            "previews=false", f"capture.kinds=[{','.join(kinds)}]", f"save_dir={out}"]  # fmt: skip
    dump(TINY_WAN, *(a for s in sets for a in ("--set", s)), check=0)
    (prompt_dir,) = _prompt_dirs(out)
    run = _check_prompt(prompt_dir, pipe, kinds, 2)
    assert run.layout.image_len == 17  # the tiny CLIP's tokens: 8×8 pixels in patches of 2, and its class token
    assert run.get("video_to_image", 1, 1).shape == (1, 1, 17, 3, 2, 3)


def test_tiny_wan_two_experts_take_turns_with_their_own_guidance(tmp_path, dump):
    out = tmp_path / "runs"
    sets = [f"prompts={_one_prompt(tmp_path)}", "tiny_experts=2", "num_inference_steps=6", "guidance_scale_2=2.0",
            "previews=false", "capture.kinds=[frame,video_to_text]", f"save_dir={out}"]  # fmt: skip
    dump(TINY_WAN, *(a for s in sets for a in ("--set", s)), check=0)
    (folder,) = _prompt_dirs(out)
    pipe = tiny_wan_pipeline(experts=2)
    kinds = ("frame", "video_to_text")
    run = _check_prompt(folder, pipe, kinds, 6, guidance_scale_2=2.0)
    assert run.experts[0] == "transformer" and run.experts[-2:] == ["transformer_2"] * 2  # the low-noise steps
    other = _direct(pipe, kinds, 6, json.loads((folder / "prompt.json").read_text()))  # guidance_scale_2 left out
    assert not torch.equal(other.get("frame", 5, 0), run.get("frame", 5, 0))  # so the tool passed it on


def test_a_wan_checkpoint_folder_loads_as_from_the_hub(tmp_path, dump, checkpoints):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from cogattn.dump.generate import load_pipeline

    out = tmp_path / "runs"
    folders = {task: folder for task, (folder, _) in checkpoints.items()}
    sets = [f"model={folders['text-to-video']}", f"prompts={_one_prompt(tmp_path)}", "previews=false",
            "capture.kinds=[frame,video_to_text]", f"save_dir={out}"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    assert "S = 18" in dump(TINY_WAN, *args, "--dry-run", check=0).stdout  # planned from the folder's config
    dump(TINY_WAN, *args, check=0)
    (folder,) = _prompt_dirs(out)
    _check_prompt(folder, checkpoints["text-to-video"][1], ("frame", "video_to_text"), 2)
    for task, cls in (("text-to-video", WanPipeline), ("image-to-video", WanImageToVideoPipeline)):
        cfg = load_config(TINY_WAN, [f"model={folders[task]}", f"task={task}", "dtype=bfloat16"])
        assert cfg.family == "wan"
        pipe = load_pipeline(cfg, "cpu")
        assert type(pipe) is cls and pipe.transformer.dtype == torch.bfloat16
        assert pipe.vae.dtype == torch.float32  # as the Wan model cards load it
        if task == "image-to-video":
            assert pipe.image_encoder.dtype == torch.float32
    one = dump(TINY_WAN, *args, "--set", "guidance_scale_2=3.0", "--set", f"save_dir={tmp_path / 'x'}", check=2)
    assert one.stderr.strip().splitlines()[-1] == (
        f"dump_maps: guidance_scale_2 is the guidance of Wan 2.2's second expert; {folders['text-to-video']} "
        "has one transformer."
    )
    assert not (tmp_path / "x").exists()


def test_max_sequence_length_defaults_to_the_family(tmp_path):
    assert load_config(TINY_WAN, ["max_sequence_length=null"]).max_sequence_length == 512
    assert load_config(TINY, ["max_sequence_length=null"]).max_sequence_length == 226
    assert load_config(TINY_WAN, ["max_sequence_length=null"]).call_arguments()["max_sequence_length"] == 512
    assert load_config(TINY_WAN).family == "wan" and load_config(TINY).family == "cogvideox"
    assert "guidance_scale_2" not in load_config(TINY_WAN).call_arguments()


I2V_480P = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"


@pytest.mark.parametrize(
    "sets,message",
    [
        (["height=40"], r"height: 40 must be a positive multiple of 16 \(the Wan VAE's 8 × the patch size 2\)\.$"),
        (
            ["model=Wan-AI/Wan2.2-TI2V-5B-Diffusers", "height=720", "width=1280"],
            r"height: 720 must be a positive multiple of 32 \(the Wan VAE's 16 × the patch size 2\)\.$",
        ),
        (
            ["num_frames=10"],
            r"num_frames: 10; the Wan VAE decodes 4k \+ 1 frames \(9, 13, ..., 81, ..., 121\): use 9 or 13",
        ),
        (["capture.kinds=[text_to_video]"], r"kind 'text_to_video' does not exist for wan: Wan's text never queries"),
        (["capture.kinds=[video_to_image]"], r"kind 'video_to_image' needs the cross-attention to image tokens"),
        (
            [f"model={I2V_480P}", "height=480", "width=832"],
            rf"task: 'text-to-video', but {I2V_480P} is an image-to-video checkpoint \(36 input channels\); "
            "set task: image-to-video",
        ),
        (
            ["model=Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "task=image-to-video"],
            r"is a text-to-video checkpoint \(16 input channels\); set task: text-to-video",
        ),
        (
            [f"model={I2V_480P}", "task=image-to-video", "max_sequence_length=226"],
            r"max_sequence_length: 226; Wan 2.1 image-to-video takes 512 text tokens",
        ),
        (
            ["guidance_scale_2=3"],
            r"guidance_scale_2 is .* second expert; tiny-wan has one transformer \(set tiny_experts: 2\)",
        ),
        (
            ["model=Wan-AI/Wan2.1-T2V-14B-Diffusers", "guidance_scale_2=3"],
            r"Wan-AI/Wan2.1-T2V-14B-Diffusers has one transformer\.$",
        ),
        (["tiny_experts=2", "guidance_scale_2=-1"], r"guidance_scale_2: -1 must be ≥ 0"),
        (["tiny_experts=3"], r"tiny_experts: 3 is not one of \[1, 2\]"),
        (["tiny_experts=true"], r"tiny_experts: expected int, got True"),
        (["model=tiny", "tiny_experts=2"], r"tiny_experts: 2 is for model: tiny-wan \(Wan 2.2's two experts\) only"),
        (["model=tiny", "guidance_scale_2=3"], r"guidance_scale_2 .*; CogVideoX has one transformer"),
        (["model=."], r"model: '.' is a folder without transformer/config.json"),
    ],
)
def test_wan_rules_exit_2_with_one_line_and_write_nothing(tmp_path, dump, sets, message):
    out = tmp_path / "runs"
    proc = dump(TINY_WAN, *(a for s in [*sets, f"save_dir={out}"] for a in ("--set", s)), check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dump_maps: "), proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()


def test_the_released_wan_configs_plan_their_models(dump, tmp_path):
    shapes = {
        "wan2.1-t2v-1.3b.yaml": "21×30×52 video tokens, S = 32,760",
        "wan2.1-t2v-14b.yaml": "21×30×52 video tokens, S = 32,760",
        "wan2.1-i2v-14b-480p.yaml": "21×30×52 video tokens, S = 32,760",
        "wan2.1-i2v-14b-720p.yaml": "21×45×80 video tokens, S = 75,600",
        "wan2.2-i2v-a14b.yaml": "21×30×52 video tokens, S = 32,760",
        "wan2.2-ti2v-5b.yaml": "31×22×40 video tokens, S = 27,280",
        "wan2.2-t2v-a14b.yaml": "21×30×52 video tokens, S = 32,760",
    }
    wan = [p.name for p in (ROOT / "configs").glob("wan*.yaml") if load_config(p).family == "wan"]  # not VACE
    assert sorted(shapes) == sorted(wan)
    for name, shape in shapes.items():
        proc = dump(ROOT / "configs" / name, "--dry-run", "--set", f"save_dir={tmp_path / 'x'}", check=0)
        image = " + 257 image" if name.startswith("wan2.1-i2v") else ""  # Wan 2.1 I2V: CLIP tokens
        assert f"layout: {shape}; cross-attention to 512 text{image} tokens" in proc.stdout, name
        assert load_config(ROOT / "configs" / name).family == "wan"
    i2v = dump(ROOT / "configs" / "wan2.1-i2v-14b-480p.yaml", "--dry-run", "--set", f"save_dir={tmp_path / 'x'}")
    assert "video_to_image  (1, 1, 257, 21, 30, 52)" in i2v.stdout
