"""One prompt's generation with capture: the pipeline of a config, the folder a prompt gets, its video.

A prompt's folder holds ``maps/`` (a run: ``cogattn.load`` reads it), the video, ``heads.csv`` (the head
table of :func:`cogattn.analysis.head_stats.head_table`, when a kind it reads was recorded), ``previews/*.png`` and
``prompt.json``, whose ``complete`` is set last: a folder without it is redone by a rerun.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import re
import shutil
import time
import warnings
import wave
from pathlib import Path

import torch

from ..analysis.head_stats import TABLE_KINDS, head_table
from ..analysis.words import PromptFormat, item_spans, text_tokens
from ..errors import StoreError
from ..recorder.recording import record
from ..runs.folder import LOCK, LockHeldError, RunLock
from ..runs.run import load
from ..runs.store import write_json_atomic
from .config import ConfigError, DumpConfig
from .previews import write_previews
from .prompts import Prompt

__all__ = ["NotPrepared", "is_complete", "load_pipeline", "prompt_meta", "run_prompt"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pipeline(cfg: DumpConfig, device: str):
    """The pipeline of ``cfg`` on ``device``: from the hub or a folder (weights in ``cfg.dtype``), or a tiny
    random one; with the offload and VAE tiling the config asks for.

    The model's family spec loads it (``ModelSpec.load_pipeline``: CogVideoX as ``CogVideoXPipeline`` or
    ``CogVideoXImageToVideoPipeline``, Wan as ``WanPipeline`` or ``WanImageToVideoPipeline`` with its VAE
    and image encoder in float32 as the Wan model cards load them, HunyuanVideo as ``HunyuanVideoPipeline``
    with its VAE in float32), or builds its tiny pipeline (``ModelSpec.tiny_pipeline`` with the config's
    tiny options). Raises `ConfigError` when ``guidance_scale_2`` is set for a pipeline with one expert.
    """
    spec, dtype = cfg.spec(), _DTYPES[cfg.dtype]
    if cfg.tiny_spec() is not None:
        pipe = spec.tiny_pipeline(cfg.task, **cfg.tiny_arguments(), dtype=dtype)
    else:
        pipe = spec.load_pipeline(cfg.model, cfg.task, dtype)
    if cfg.guidance_scale_2 is not None and sum(getattr(pipe, e, None) is not None for e in spec.experts) < 2:
        raise ConfigError(
            f"guidance_scale_2 is the guidance of Wan 2.2's second expert; {cfg.model} has one transformer."
        )
    if cfg.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif cfg.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)
    if cfg.vae_tiling:
        pipe.vae.enable_tiling()
    pipe.set_progress_bar_config(leave=False, desc="steps", disable=None)  # no bar when not a terminal
    return pipe


def prompt_meta(folder: Path) -> dict:
    """The ``prompt.json`` of a prompt's folder (``{}`` when there is none, it is unreadable or not an object: the
    prompt is redone)."""
    file = Path(folder) / "prompt.json"
    try:
        meta = json.loads(file.read_text()) if file.is_file() else {}  # a pipe would block the read
    except (OSError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def is_complete(folder: Path) -> bool:
    """Whether the prompt in ``folder`` was written to the end (a rerun skips it)."""
    return prompt_meta(folder).get("complete") is True


def _save_video(frames, path_stem: Path, cfg: DumpConfig) -> Path:
    from diffusers.utils import export_to_gif, export_to_video

    fmt = cfg.video_format
    if fmt == "auto":
        try:
            import imageio_ffmpeg  # noqa: F401

            fmt = "mp4"
        except ImportError:
            fmt = "gif"
    path = path_stem.with_suffix("." + fmt)
    if fmt == "mp4":
        export_to_video(frames, str(path), fps=cfg.fps)
    else:
        export_to_gif(frames, str(path), fps=cfg.fps)
    return path


def _modular(pipe) -> bool:
    """Whether ``pipe`` is a diffusers modular pipeline (MiniMax-H3's), called with its blocks' inputs."""
    import diffusers

    modular = getattr(diffusers, "ModularPipeline", None)  # diffusers ≥ 0.35
    return modular is not None and isinstance(pipe, modular)


def encoded_negative(pipe, negative: str | None) -> str:
    """The negative prompt ``pipe`` encodes for the one a call gives: its default where the call gives none (Cosmos'
    module's ``DEFAULT_NEGATIVE_PROMPT``, Kandinsky 5's in its ``__call__``; Kandinsky 6's ``_DEFAULT_NEGATIVE_PROMPT``
    for none or ``""``), else ``negative`` (``""`` for none)."""
    if negative:
        return negative
    own = getattr(type(pipe), "_DEFAULT_NEGATIVE_PROMPT", None)
    if negative is None and own is None:
        own = getattr(inspect.getmodule(type(pipe)), "DEFAULT_NEGATIVE_PROMPT", None)
    if negative is None and own is None:  # a literal in the call: `if negative_prompt is None: negative_prompt = "..."`
        with contextlib.suppress(OSError, TypeError):
            source = inspect.getsource(type(pipe).__call__)
            found = re.search(r'if negative_prompt is None:\s*\n\s*negative_prompt = ("[^"\n]*")\n', source)
            own = found and ast.literal_eval(found.group(1))
    return own if isinstance(own, str) else ""


def _save_audio(waveform: torch.Tensor, rate: int, path: Path) -> Path:
    """A soundtrack ``(1, channels, samples)`` in [-1, 1], on any device, as a 16-bit PCM WAV file."""
    if waveform.ndim != 3 or waveform.shape[0] != 1 or not 1 <= waveform.shape[1] <= 8:
        raise ValueError(f"the pipeline's audio has shape {tuple(waveform.shape)}, not (1, channels, samples).")
    samples = waveform[0].detach().float().cpu().nan_to_num(0.0).clamp(-1, 1)
    samples = (samples * 32767).round().to(torch.int16).T.contiguous()  # (samples, channels)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(samples.shape[1])
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.numpy().tobytes())
    return path


def _write_head_table(maps: Path, path: Path) -> bool:
    """The head table of a prompt's run as CSV, when it recorded a kind the table reads."""

    run = load(maps)
    if not {kind for kind, _, _ in run.keys()} & set(TABLE_KINDS):
        return False
    head_table(run).to_csv(path, index=False)
    return True


class NotPrepared(StoreError):
    """A context-parallel mesh's first process could not prepare a prompt's folder: every process of the mesh skips
    the prompt (none generates it), and the mesh goes on with the next, its processes still together."""


def run_prompt(
    pipe,
    cfg: DumpConfig,
    prompt: Prompt,
    folder: Path,
    process: int,
    writes: bool = True,
    alone: bool = True,
    agree=None,
) -> bool | None:
    """Generate one video with capture into ``folder`` (a fresh or incomplete one is (re)made): `True`; `False` where
    another process completed it since this one chose its prompts, `None` where one is writing it now (``alone``: no
    mesh waits on this process; another run over the same ``save_dir``), left as it is.

    Args:
        pipe: the pipeline from :func:`load_pipeline`.
        cfg (`DumpConfig`): the configuration; its ``capture`` options with ``save_dir=folder/"maps"``
            and the prompt's facts as ``info`` are what ``cogattn.record`` gets.
        prompt (`Prompt`): the prompt.
        folder (`Path`): the prompt's folder, ``<save_dir>/<prompt.key()>``.
        process (`int`): index of this process under ``accelerate launch`` (kept in ``prompt.json``).
        writes (`bool`): `False` on a process of a context-parallel mesh other than its first: it takes part in the
            generation and writes nothing (its recording neither: :mod:`cogattn.dump.parallel`).
        alone (`bool`): `False` in a mesh, whose processes generate every prompt they agreed on together.
        agree (`Callable | None`): in a mesh, ``Meshes.agree``: the first process's word that the prompt's folder is
            ready, on every process; where it is not, none generates the prompt (`NotPrepared`), so the mesh's
            processes never run two prompts against each other.
    """
    if not writes:
        if agree is not None and not agree(None):
            raise NotPrepared("the mesh's first process could not prepare this prompt's folder; skipped")
        _generate(pipe, cfg, prompt, folder, process, writes=False)
        return True
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:  # held until the prompt is complete: another process never deletes or mixes into it
            lock = RunLock(folder)
        except LockHeldError:  # (a folder it cannot write is RunLock's own StoreError, naming it)
            if alone:  # another run over the same save_dir is writing it: its prompt, not a failure of this one
                return None
            raise StoreError(f"{str(folder)!r} is being written by another process; it is left alone.") from None
        try:
            if alone and is_complete(folder):  # finished by another process since the list was made: kept
                lock.release()
                return False
            for old in folder.iterdir():  # an incomplete earlier attempt
                if old.name != LOCK:
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
        except BaseException:
            lock.release()
            raise
    except Exception as err:
        if agree is None:
            raise
        agree(False)
        raise NotPrepared(str(err)) from err
    if agree is not None:
        agree(True)
    try:
        _generate(pipe, cfg, prompt, folder, process)
    finally:
        lock.release()
    return True


def _generate(pipe, cfg: DumpConfig, prompt: Prompt, folder: Path, process: int, writes: bool = True) -> None:

    seed = cfg.seed if prompt.seed is None else prompt.seed
    negative, spec = prompt.negative_prompt, cfg.spec()
    guided = (cfg.true_cfg_scale or 0) > 1 or (spec.empty_negative and (cfg.guidance_scale or 0) > 1)
    if negative is None and guided:  # true guidance (EasyAnimate's: any) needs one: the empty prompt, as elsewhere
        negative = ""
    meta = {
        "complete": False,
        "config_key": cfg.output_key(),
        "index": prompt.index,
        "prompt": prompt.prompt,
        "negative_prompt": negative,
        "seed": seed,
        "image": prompt.image,
        "model": cfg.model,
        "process": process,
        "config": cfg.to_dict(),
    }
    if writes:
        write_json_atomic(folder / "prompt.json", meta)
    device = pipe._execution_device
    call = dict(
        prompt=prompt.prompt,
        negative_prompt=negative,
        **cfg.call_arguments(),
        output_type="pil",
        generator=torch.Generator(device).manual_seed(seed),
    )
    modular = _modular(pipe)  # MiniMax-H3's: its blocks' inputs, its outputs by name
    takes = {p.name for p in pipe.blocks.inputs} if modular else inspect.signature(pipe.__call__).parameters
    if "num_frames" not in takes and "video_length" in takes:  # LattePipeline's name of the frame count
        call["video_length"] = call.pop("num_frames")
    if "num_frames" not in takes and "frames" in takes:  # SANA-Video's pipelines' name of the frame count
        call["frames"] = call.pop("num_frames")
    if "guidance_scale" not in takes and getattr(pipe, "guider", None) is not None:
        # guidance is the pipeline's guider (HunyuanVideo 1.5): set in place, as record wrapped this object
        pipe.guider.guidance_scale = call["guidance_scale"]
    # what a pipeline sets itself: the text's length (EasyAnimate, HunyuanVideo 1.5), the size from the image
    # (HunyuanVideo 1.5's image-to-video), guidance through its guider; any other key it does not take is an error
    own = {"max_sequence_length", "guidance_scale", *(("height", "width") if cfg.task == "image-to-video" else ())}
    for key in [k for k in call if k not in takes]:
        if modular and (call[key] is None or key == "guidance_scale" and call[key] <= 1):
            del call[key]  # no negative prompt, no guidance: a guidance-distilled modular pipeline's (MiniMax-H3's)
            continue
        if key not in own or (key == "guidance_scale" and getattr(pipe, "guider", None) is None):
            where = "the prompts file" if key == "negative_prompt" and prompt.negative_prompt else "the config"
            raise ValueError(f"{key}: {type(pipe).__name__} takes no such argument; remove it from {where}.")
        del call[key]
    if cfg.tiny_spec() is not None:  # what the tiny pipeline needs with a text prompt (HunyuanVideo's template)
        call.update(cfg.tiny_spec().tiny_prompt_arguments)
    if cfg.task == "image-to-video":
        from diffusers.utils import load_image

        call["image"] = load_image(prompt.image_path)
    t0 = time.perf_counter()
    info = {k: meta[k] for k in ("index", "prompt", "negative_prompt", "seed", "image", "model")}
    sound = None
    with record(pipe, cfg.capture_options(save_dir=folder / "maps", info=info)) as rec:
        if modular:  # its outputs by name: the video, and a soundtrack where it makes one
            out = pipe(**call, output=["videos", "audio", "sampling_rate"])
            frames, sound = out["videos"][0], (out.get("audio"), out.get("sampling_rate"))
        else:
            out = pipe(**call)
            frames = out.frames[0] if hasattr(out, "frames") else out.video  # Cosmos 3's: one video, named `video`
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    if not writes:
        return
    # the viewer's and the previews' word labels: the tokens of the text the transformer read, through the
    # pipeline's own template and crop (and the call's prompt_template where it passed one)
    tokenizer = getattr(pipe, "tokenizer", None) or getattr(pipe, "text_tokenizer", None)  # Cosmos 3's name
    template = call.get("prompt_template")
    if template is None and hasattr(pipe, "tokenize_prompt"):  # a text made with the call's arguments (Cosmos 3's)
        template = {k: v for k, v in call.items() if k in inspect.signature(pipe.tokenize_prompt).parameters}
        template = {k: v for k, v in template.items() if k not in ("prompt", "negative_prompt")}
    text = PromptFormat(pipe, template) if tokenizer is not None else None
    if text is not None and rec.layout is not None:
        lay, roles = rec.layout, rec.batch_roles or ()
        try:
            meta["tokens"] = text_tokens(text, prompt.prompt, lay.prompt_len, spans=item_spans(rec))
            if "uncond" in roles:  # the unconditional item's text: the negative prompt the pipeline encoded
                spans = item_spans(rec, "uncond")
                own = spec.negative_template  # the negative prompt's template, where not the prompt's (SANA-Video)
                own = {**template, **own} if isinstance(own, dict) and isinstance(template, dict) else own  # Cosmos 3
                negative_text = text if own is None else PromptFormat(pipe, own)
                encoded = encoded_negative(pipe, negative)
                meta["negative_tokens"] = text_tokens(negative_text, encoded, lay.prompt_len, spans=spans)
        except ValueError as err:  # labels it cannot name (a prompt Kandinsky 5 cut): the maps are kept, unlabelled
            meta["tokens_error"] = str(err)
            warnings.warn(f"prompt {prompt.index}: its text tokens are not labelled: {err}", stacklevel=2)
    what = "video"  # what a failure here names: the maps are written by now
    try:
        meta["video"] = _save_video(frames, folder / "video", cfg).name
        if sound is not None and sound[0] is not None:  # MiniMax-H3's stereo soundtrack, as 16-bit PCM
            what = "audio.wav"
            meta["audio"] = _save_audio(sound[0], int(sound[1]), folder / "audio.wav").name
        what = "heads.csv"
        if _write_head_table(folder / "maps", folder / "heads.csv"):
            meta["head_table"] = "heads.csv"
    except OSError as err:
        raise StoreError(f"its maps are written, but writing its {what} in {str(folder)!r} failed: {err}") from err
    if cfg.previews:
        try:
            written = write_previews(folder / "maps", folder / "previews", frames, text, prompt.prompt)
            meta["previews"] = [p.name for p in written]
        except Exception as err:  # a figure is no reason to generate the prompt again: kept, and said
            meta["previews_error"] = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"prompt {prompt.index}: its previews were not written ({meta['previews_error']}); its maps, video "
                "and head table are, and the prompt is complete.",
                stacklevel=2,
            )
    meta["complete"] = True
    write_json_atomic(folder / "prompt.json", meta)
