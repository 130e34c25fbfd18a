"""HunyuanVideo FramePack (image-to-video): HunyuanVideo's blocks over a sequence that also holds history
latents (docs/design.md, "The model seam").

``HunyuanVideoFramepackTransformer3DModel`` runs HunyuanVideo's 20 dual-stream and 40 single-stream blocks
(their attentions are layers 0–19 and 20–59, run by ``HunyuanVideoAttnProcessor2_0``). Its sequence is,
in order: the video tokens (the latent stream, RoPE on all of it), then the conditions, with a key mask over
the padded text::

    [4× history | 2× history | clean latents | current window F·Hp·Wp] [SigLIP image (729) | text (256)]

The pipeline denoises a window of ``latent_window_size`` = 9 latent frames at a time, conditioned on clean
latents (the input image and the latest generated frame, 2 latent frames on the window's patch grid) and on
older history downsampled 2× (2 frames, kernel 2×4×4) and 4× (16 frames, kernel 4×8×8). The layout's video
is that whole latent stream: ``history_len`` history tokens off the grid, then the window's grid, which
video points ``(frame, row, col)`` (the ``query`` kind's) address. The layout's text is the condition stream
after the video: the image's SigLIP tokens (an image embedding in the joint attention, no cross-attention),
then the prompt's tokens; ``Recording.text_lengths`` counts both.

The history tokens belong to no latent frame of the window, so the kinds that pool over frame groups or
index the grid (``frame``, ``query_frame``, ``tile``, ``video_to_text``, ``text_to_video``) are refused; ``full``,
``query``, ``entropy``, ``received``, ``block`` and ``topk`` are exact over every token. With one video in
the call the transformer drops the padded text instead of masking it (the sequence is ``V + I + T_valid``
long): the processor hands the recording the layout's whole sequence, zero-padded, with that count of keys
and query rows (the rows past it are never formed: 0 in every kind with a query axis, as Mochi's).

A long video is several windows (sections), ⌈num_frames / 33⌉, each its own denoising loop whose timestep
starts again at the top: one recording numbers the steps on across them (:func:`window`; the batch tool refuses
``num_frames`` above 33). Guidance is HunyuanVideo's: distilled (``guidance_scale``, one call per
step), true classifier-free guidance with ``true_cfg_scale > 1`` and a negative prompt (two calls per step,
the conditional first).

The processor is HunyuanVideo's (:class:`cogattn.models.hunyuan_video.HunyuanVideoAttnMapProcessor`, or its
SDPA version before diffusers 0.36) in front of a sink that pads a one-video call's sequence.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from ..recorder.processor import MapSink
from ._call_frame import call_locals
from .spec import ModelSpec, Site, Unavailable, call_argument
from .tiny_text import TEXT_DIM, cast, tiny_siglip

# Attention shapes of the released checkpoints (their config.json, which names the class of FramePack's own
# code; diffusers loads it as HunyuanVideoFramepackTransformer3DModel), for plans made offline.
_FP = {
    "_class_name": "HunyuanVideoTransformer3DModelPacked",
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "num_layers": 20,
    "num_single_layers": 40,
    "patch_size": 2,
    "patch_size_t": 1,
    "in_channels": 16,
    "text_embed_dim": 4096,
    "guidance_embeds": True,
    "image_proj_dim": 1152,
    "has_clean_x_embedder": True,
}
KNOWN: dict[str, dict] = {
    "lllyasviel/FramePackI2V_HY": _FP,  # inverted anti-drifting sampling (the pipeline's default)
    "lllyasviel/FramePack_F1_I2V_HY_20250503": _FP,  # F1: sampling_type="vanilla"
}
CLASS_NAMES = ("HunyuanVideoFramepackTransformer3DModel", "HunyuanVideoTransformer3DModelPacked")

try:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video_framepack import (
        HunyuanVideoFramepackTransformer3DModel,
    )

    from . import hunyuan_video
except ImportError as missing:  # hunyuan_video's Unavailable too
    needs = "HunyuanVideo FramePack needs diffusers >= 0.34 (HunyuanVideoFramepackTransformer3DModel)"
    raise Unavailable("hunyuan_video_framepack", needs, KNOWN) from missing
from .hunyuan_video.sdpa import HunyuanVideoAttnMapProcessorSDPA  # noqa: E402

__all__ = ["SPEC", "FramepackSpec", "HunyuanVideoFramepackAttnMapProcessor", "IMAGE_TOKENS", "KNOWN", "LATENT_WINDOW"]
__all__ += ["TEXT_LEN", "history_tokens", "layout_for_video", "read_call", "tiny_pipeline", "tiny_transformer"]

TEXT_LEN = hunyuan_video.TEXT_LEN  # LLaMA tokens after the prompt template (the pipeline's max_sequence_length)
LATENT_WINDOW = 9  # latent frames of a section (the pipeline's latent_window_size): (9 − 1)·4 + 1 = 33 frames
HISTORY_FRAMES = (2, 2, 16)  # latent frames of the clean (the image and one generated), 2× and 4× history
HISTORY_KERNELS = ((1, 2, 2), (2, 4, 4), (4, 8, 8))  # the history patch embedding's, in latent pixels
IMAGE_ENCODER = "lllyasviel/flux_redux_bfl"  # SigLIP so400m-patch14-384 (subfolders image_encoder, feature_extractor)
BASE = "hunyuanvideo-community/HunyuanVideo"  # text encoders, tokenizers, VAE and scheduler
_TINY_IMAGE_DIM, _TINY_IMAGE_TOKENS = 12, 16  # the tiny SigLIP: 12 channels, 16 px images of 4 px patches
IMAGE_TOKENS = {1152: 729, _TINY_IMAGE_DIM: _TINY_IMAGE_TOKENS}  # image tokens by image_proj_dim (the encoder)


class _WholeSequence:
    """The sink a FramePack processor hands q and k to: the recording, with a call of one video, whose
    padded text the transformer drops (a sequence ``V + I + T_valid`` long), zero-padded to the layout's
    sequence with as many kept keys and formed query rows (what a mask and the model's rows would say)."""

    def __init__(self, sink: MapSink | None):
        self.sink = sink

    def layer_to_capture(self, attn) -> int | None:
        return self.sink.layer_to_capture(attn)

    wants_value = False  # the kinds that need values are refused for FramePack

    def capture(self, layer, query, key, lse=None, sums=None, key_counts=None, query_counts=None, value=None) -> None:
        S, full = query.shape[2], self.sink.layout.seq_len
        if S < full:
            query, key = F.pad(query, (0, 0, 0, full - S)), F.pad(key, (0, 0, 0, full - S))
            key_counts = query_counts = torch.full((query.shape[0],), S)
        self.sink.capture(layer, query, key, lse, sums, key_counts, query_counts)


_PROCESSOR = hunyuan_video.HunyuanVideoAttnMapProcessor if hunyuan_video.DISPATCH else HunyuanVideoAttnMapProcessorSDPA


class HunyuanVideoFramepackAttnMapProcessor(_PROCESSOR):
    """Drop-in for ``HunyuanVideoAttnProcessor2_0`` in FramePack's blocks: HunyuanVideo's map processor (the
    stock output call), whose q and k of a one-video call reach the recording padded to the layout's
    sequence, with that item's counts.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    def __init__(self, sink: MapSink):
        super().__init__(_WholeSequence(sink))


def history_tokens(frames: tuple, height: int, width: int) -> int:
    """Tokens of the history latents of ``frames`` latent frames each (clean, 2×, 4×; `None`: not given) on a
    latent grid of ``height`` × ``width``: each embedded by its kernel, the 2× and 4× after padding to whole
    kernels (the clean latents come in whole ones)."""
    tokens = 0
    for count, kernel, padded in zip(frames, HISTORY_KERNELS, (False, True, True)):
        if count is not None:
            sizes = zip((count, height, width), kernel)
            tokens += math.prod(-(-n // k) if padded else n // k for n, k in sizes)
    return tokens


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``HunyuanVideoFramepackTransformer3DModel`` call:
    the window's latents ``(B, C, F, H, W)`` after the history's tokens, then the image's tokens and the text
    (its padded length: a mask, or with one video the sequence's own length, sets each item's)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    image = call_argument(args, kwargs, 5, "image_embeds")
    names = ("latents_clean", "latents_history_2x", "latents_history_4x")
    history = [call_argument(args, kwargs, i, name) for i, name in zip((8, 10, 12), names)]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    _, _, frames, height, width = hidden.shape
    layout = TokenLayout(
        text_len=int(image.shape[1]) + int(text.shape[1]),
        image_len=int(image.shape[1]),  # SigLIP's tokens lead the text (the transformer's cat([image, text]))
        frames=frames // p_t,
        height=height // p,
        width=width // p,
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        text_position="end",
        history_len=history_tokens(tuple(None if x is None else x.shape[2] for x in history), height, width),
    )
    return layout, hidden.shape[0], t, hidden.device


def image_tokens(config: dict) -> int:
    """The image tokens of a pipeline call: SigLIP so400m-patch14-384's 729 (27 × 27 patches; its width,
    the transformer's ``image_proj_dim``, is 1152), or the tiny pipeline's 16."""
    return IMAGE_TOKENS.get(int(config.get("image_proj_dim", 1152)), IMAGE_TOKENS[1152])


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a FramePack pipeline call at ``height`` × ``width`` (8× spatial): a window of 9 latent
    frames, whatever ``num_frames`` (which sets the number of sections), after the history, then the image's
    tokens and ``text_len`` (default 256) text tokens."""
    p, latent_height, latent_width = int(config["patch_size"]), int(height) // 8, int(width) // 8
    return TokenLayout(
        text_len=image_tokens(config) + (text_len or TEXT_LEN),
        image_len=image_tokens(config),
        frames=LATENT_WINDOW,
        height=latent_height // p,
        width=latent_width // p,
        patch_size=p,
        text_position="end",
        history_len=history_tokens(HISTORY_FRAMES, latent_height, latent_width),
    )


def call_rules(cfg, config: dict) -> None:
    """The batch tool's FramePack rules (``ModelSpec.call_rules``): one section (its previews place one window)."""
    most = 4 * (LATENT_WINDOW - 1) + 1
    if cfg.num_frames > most:
        raise ValueError(
            f"num_frames: {cfg.num_frames}; FramePack generates ⌈num_frames / {most}⌉ sections of {LATENT_WINDOW} "
            f"latent frames, each a denoising loop of its own, and the batch tool runs one: use at most {most} (the "
            f"pipeline decodes {most + 4} frames: the image, then the section), or record a longer call from Python."
        )


def call_steps(num_frames: int, num_inference_steps: int) -> int:
    """The steps of a pipeline call for ``num_frames`` frames (``ModelSpec.call_steps``): a denoising loop of
    ``num_inference_steps`` per section of 33 frames, as the pipeline counts them."""
    window = 4 * (LATENT_WINDOW - 1) + 1
    return max(1, -(-int(num_frames) // window)) * num_inference_steps


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideoFramepackTransformer3DModel``: ``num_layers`` dual-stream and
    ``num_single_layers`` single-stream blocks, patch size 2, text width 16, the history embedding and an
    image projection of the tiny SigLIP's 12 channels (``head_dim`` is split over the 3D RoPE axes)."""
    model = hunyuan_video.tiny_transformer(
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        seed=seed,
        cls=HunyuanVideoFramepackTransformer3DModel,
        has_image_proj=True,
        image_proj_dim=_TINY_IMAGE_DIM,
        has_clean_x_embedder=True,
    )
    return cast(model, dtype)


def tiny_pipeline(
    task: str = "image-to-video",
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideoFramepackPipeline`` with real components at toy size (no download): the tiny
    HunyuanVideo pipeline's text encoders, tokenizers, VAE and scheduler (``hunyuan_video.tiny_pipeline``),
    a tiny SigLIP image encoder and a FramePack transformer.

    Call it as a real one, with an ``image``: ``height=32, width=48`` gives 2×3 patches per latent frame, a
    window of 9 latent frames (54 tokens) after 18 history tokens, then 16 image tokens and the text;
    ``num_frames`` at most 33 is one section. Pass ``prompt_template={"template": "{}", "crop_start": 0}``
    with a prompt (the tiny word-level tokenizer reads it as it is).

    Args:
        task (`str`, defaults to ``"image-to-video"``): the only task of this family.
        num_layers, num_single_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import HunyuanVideoFramepackPipeline

    if task != "image-to-video":
        raise ValueError(f"task={task!r}; the tiny HunyuanVideo FramePack pipeline is image-to-video.")
    base = hunyuan_video.tiny_pipeline(dtype=dtype, seed=seed, num_layers=1, num_single_layers=1, num_heads=1)
    parts = {name: part for name, part in base.components.items() if name != "transformer"}
    image_encoder, feature_extractor = tiny_siglip(seed, dtype, _TINY_IMAGE_DIM)
    transformer = tiny_transformer(
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    pipe = HunyuanVideoFramepackPipeline(
        transformer=transformer, image_encoder=image_encoder, feature_extractor=feature_extractor, **parts
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of a random image and random text embeddings of 6 tokens, 4 of
    them valid (under true guidance the negative's 2), 9 frames of 32×48: one section of 9×2×3 patches."""
    import PIL.Image

    device, dtype = pipe._execution_device, pipe.transformer.dtype
    pooled_dim = pipe.transformer.config.pooled_projection_dim

    def text(kept):
        emb = torch.randn(1, 6, TEXT_DIM, generator=generator).to(device, dtype)
        pooled = torch.randn(1, pooled_dim, generator=generator).to(device, dtype)
        return emb, pooled, (torch.arange(6) < kept).long()[None].to(device)

    pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
    emb, pooled, mask = text(4)
    call = dict(image=PIL.Image.fromarray(pixels), prompt_embeds=emb, pooled_prompt_embeds=pooled)
    call["prompt_attention_mask"] = mask
    if guided:
        emb, pooled, mask = text(2)
        call.update(negative_prompt_embeds=emb, negative_pooled_prompt_embeds=pooled, true_cfg_scale=4.0)
        call["negative_prompt_attention_mask"] = mask
    call.update(num_frames=9, height=32, width=48)
    return call


class FramepackSpec(ModelSpec):
    """FramePack's spec: its checkpoints' configs name FramePack's own class (``_class_name``), and a
    checkpoint is a transformer alone, which the batch tool loads into the HunyuanVideo pipeline's parts
    and the SigLIP image encoder, as diffusers' docs do."""

    def matches_config(self, config: dict) -> bool:
        name = config.get("_class_name")
        return name in CLASS_NAMES if name is not None else super().matches_config(config)

    def load_pipeline(self, model: str, task: str, dtype: torch.dtype):
        """``HunyuanVideoFramepackPipeline`` of a whole pipeline folder, or of a FramePack transformer
        (``lllyasviel/FramePackI2V_HY``) with ``hunyuanvideo-community/HunyuanVideo``'s text encoders,
        tokenizers, VAE (float32) and scheduler and the SigLIP of ``lllyasviel/flux_redux_bfl``."""
        from diffusers import HunyuanVideoFramepackPipeline
        from transformers import SiglipImageProcessor, SiglipVisionModel

        self.check_task(task)
        dtypes = {"default": dtype, **dict.fromkeys(self.float32, torch.float32)}
        if (Path(model) / "model_index.json").is_file():
            return HunyuanVideoFramepackPipeline.from_pretrained(model, torch_dtype=dtypes)
        transformer = HunyuanVideoFramepackTransformer3DModel.from_pretrained(model, torch_dtype=dtype)
        image_encoder = SiglipVisionModel.from_pretrained(IMAGE_ENCODER, subfolder="image_encoder", torch_dtype=dtype)
        feature_extractor = SiglipImageProcessor.from_pretrained(IMAGE_ENCODER, subfolder="feature_extractor")
        parts = dict(transformer=transformer, image_encoder=image_encoder, feature_extractor=feature_extractor)
        return HunyuanVideoFramepackPipeline.from_pretrained(BASE, **parts, torch_dtype=dtypes)


def window(pipeline) -> tuple[int, int] | None:
    """``(index, count)`` of the section running in ``pipeline``'s call (``ModelSpec.window``): the latent frames made
    so far (``total_generated_latent_frames``, the image's first where the vanilla sampling starts from it), a
    ``latent_window_size`` a section, of ``num_latent_sections``; `None` outside such a call (a bare transformer)."""
    found = call_locals(pipeline) or {}
    made, size, count = (
        found.get(n) for n in ("total_generated_latent_frames", "latent_window_size", "num_latent_sections")
    )
    if not all(isinstance(n, int) for n in (made, size, count)):
        return None
    kind = found.get("sampling_type")
    first = str(getattr(kind, "value", kind)) == "vanilla"  # the vanilla sampling's history starts with the image
    return (made - first) // size, count


_OFF_GRID = (
    "FramePack's video tokens start with history latents (clean, 2× and 4× downsampled) that are off the "
    "window's latent frame grid"
)
SPEC = FramepackSpec(
    "hunyuan_video_framepack",
    (HunyuanVideoFramepackTransformer3DModel,),
    (Site("transformer_blocks", "attn"), Site("single_transformer_blocks", "attn", count_key="num_single_layers")),
    {HunyuanVideoAttnProcessor2_0: HunyuanVideoFramepackAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("image-to-video",),
    window=window,
    call_steps=call_steps,
    config_keys=("has_clean_x_embedder",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "frame": f"{_OFF_GRID}, so its tokens do not split into frame groups; full, query, entropy, received, "
        "block and topk cover every token.",
        "query_frame": f"{_OFF_GRID}, so its keys do not split into frame groups; query or full give a "
        "token's whole row.",
        "video_to_text": f"{_OFF_GRID}, and its condition tokens are the image's and the text's; query (video "
        "points address the window's grid) or full give a video token's attention to them.",
        "text_to_video": f"{_OFF_GRID}; query or full give a text token's whole row.",
        "tile": f"{_OFF_GRID}, so its tokens do not split into 3-D tiles; block pools runs of tokens of every token.",
        "frame_max": f"{_OFF_GRID}, so its keys do not split into frame groups; topk gives each row's largest keys "
        "over every token.",
        "offset": f"{_OFF_GRID}, so they have no offset from a grid token; query or full give a video token's "
        "whole row.",
        "video_to_image": "FramePack has no image cross-attention: its SigLIP image tokens are keys of the joint "
        "attention, the first tokens of the layout's text (query or full give them).",
        **dict.fromkeys(
            ("pattern_recall", "pattern_error"),
            f"{_OFF_GRID}: a pattern over (frame, row, col) has no position for them; block with "
            "masks.mask_recall measures a block mask over every token.",
        ),
    },
    guidance_calls=2,
    guidance=hunyuan_video.true_cfg,
    guidance_argument="true_cfg_scale",
    output_call=False,
    title="HunyuanVideo FramePack",
    frame_counts="9, 13, ..., 33 (one section)",
    pipelines={"image-to-video": "HunyuanVideoFramepackPipeline"},
    float32=("vae",),
    call_rules=call_rules,
    tiny_prompt_arguments={"prompt_template": {"template": "{}", "crop_start": 0}},  # the 95 cropped tokens are LLaMA's
    prompt_text=hunyuan_video.prompt_text,  # the same LLaMA template and crop
)
