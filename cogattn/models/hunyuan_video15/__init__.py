"""HunyuanVideo 1.5 (text-to-video and image-to-video): the map processor, the family's facts and its tiny
pipelines (built in ``tiny.py``; docs/design.md, "The model seam").

HunyuanVideo 1.5 runs 54 dual-stream blocks (``transformer_blocks``: the video and a context projected
apart, one joint attention); its token refiner attends over the text alone and is no capture site. The
joint sequence is the video, then the context (``text_position="end"``) of three encoders' tokens, which the
transformer packs per item: the item's valid SigLIP image tokens (729 in image-to-video; text-to-video's
are zeros and all padding), its valid ByT5 tokens of the prompt's quoted words (up to 256; none without a
quote), its valid Qwen2.5-VL tokens of the prompt (up to 1000, after the chat template's system turn is
cropped), then every padding token: T = 729 + 256 + 1000 = 1985. Its processor masks pairs ``keep ⊗ keep``,
``keep`` the item's video and valid context (a prefix of the sequence), so a padded token neither is
attended nor attends: cogattn records the layout's ``V + T`` tokens, item b's keys past its kept count at
probability 0 and its query rows past it never formed (0), as Mochi's. Where a prompt's words sit differs
per item (after its own glyph tokens): every call's per-item spans of ``image``, ``glyph`` and ``prompt`` on the
text axis (:func:`text_spans`, from the call's masks) are kept with the recording (``text_spans``, run.json), and
the word labels place each item's words at its own spans (:func:`prompt_text`: the pipeline's chat template and
crop; :func:`glyph_text`: the ByT5 bytes of the quoted words). The layout names the parts
(``text_parts``, in packing order, and ``prompt_crop``, the template tokens the pipeline crops).

Guidance is the pipeline's ``guider`` (``ClassifierFreeGuidance``): two transformer calls per step, the
conditional first; ``pipe.guider.guidance_scale`` turns it on (6.0 in the released pipelines).

The processor is diffusers' ``HunyuanVideo15AttnProcessor2_0`` line for line, plus the lines that hand q, k
and each item's kept count to the recording.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch
import torch.nn.functional as F

from ...layout import TokenLayout
from ...recorder.processor import MapSink, key_counts
from ..spec import ModelSpec, Site, Unavailable, call_argument

# Attention shapes of the released checkpoints (diffusers' conversion script's configs), for plans made offline.
_HV15 = {
    "_class_name": "HunyuanVideo15Transformer3DModel",
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "patch_size": 1,
    "patch_size_t": 1,
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_axes_dim": [16, 56, 56],
    "target_size": 640,
}
KNOWN: dict[str, dict] = {  # the ids diffusers' own parity test loads, and those its pipelines' docstrings name
    f"hunyuanvideo-community/HunyuanVideo-1.5{infix}-480p_{task}": {**_HV15, "task_type": task}
    for infix in ("-Diffusers", "")
    for task in ("t2v", "i2v")
}

try:
    import diffusers
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0,
        HunyuanVideo15Transformer3DModel,
    )
except ImportError:
    needs = "HunyuanVideo 1.5 needs diffusers >= 0.36 (HunyuanVideo15Transformer3DModel)"
    raise Unavailable("hunyuan_video15", needs, KNOWN) from None
from .text import glyph_text, prompt_crop, prompt_text  # noqa: E402
from .tiny import tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "HunyuanVideo15AttnMapProcessor",
    "IMAGE_LEN",
    "KNOWN",
    "TEXT_LEN",
    "glyph_text",
    "kept_counts",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "text_spans",
    "tiny_pipeline",
    "tiny_transformer",
]

IMAGE_LEN = 729  # SigLIP tokens of the image (the pipelines' vision_num_semantic_tokens)
GLYPH_LEN, MLLM_LEN = 256, 1000  # ByT5 and Qwen2.5-VL tokens (tokenizer_2_max_length, tokenizer_max_length)
TEXT_LEN = IMAGE_LEN + GLYPH_LEN + MLLM_LEN  # the packed context: image, ByT5 and Qwen2.5-VL tokens, each padded
PROMPT_CROP = 108  # the chat template's tokens the released pipelines crop (prompt_template_encode_start_idx)


def kept_counts(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """Each item's kept tokens of ``seq_len`` (`None`: all), from the model's context mask ``(B, T)``: the video and
    the valid context, a prefix of each item's packed context (the transformer puts the valid tokens first), read by
    :func:`cogattn.recorder.processor.key_counts` as the key mask the processor pads it to. Raises `ValueError` for a
    mask that keeps anything else."""
    padded = F.pad(attention_mask.bool(), (seq_len - attention_mask.shape[1], 0), value=True)
    return key_counts(padded[:, None, None], seq_len)


class HunyuanVideo15AttnMapProcessor:
    """Drop-in for ``HunyuanVideo15AttnProcessor2_0`` that also feeds q, k and each item's kept count to a
    recording. The output call is always the stock one.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        # 2. QK normalization
        query = attn.norm_q(query)
        key = attn.norm_k(key)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
        if encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states)
            encoder_key = attn.add_k_proj(encoder_hidden_states)
            encoder_value = attn.add_v_proj(encoder_hidden_states)

            encoder_query = encoder_query.unflatten(2, (attn.heads, -1))
            encoder_key = encoder_key.unflatten(2, (attn.heads, -1))
            encoder_value = encoder_value.unflatten(2, (attn.heads, -1))

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # (B, H, S, D); each item keeps its video and its valid context, queries too
            counts = None if attention_mask is None else kept_counts(attention_mask, query.shape[1])
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, query.transpose(1, 2), key.transpose(1, 2), None, None, counts, counts, value=v)

        batch_size, seq_len, heads, dim = query.shape
        attention_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
        attention_mask = attention_mask.bool()
        self_attn_mask_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        self_attn_mask_2 = self_attn_mask_1.transpose(2, 3)
        attention_mask = (self_attn_mask_1 & self_attn_mask_2).bool()

        # 5. Attention
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )

        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # 6. Output projection
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )

            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``HunyuanVideo15Transformer3DModel`` call: latents
    ``(B, C, F, H, W)`` in patches of 1, the packed context after the video (its padded length: each item's
    mask keeps its own), led by the image's SigLIP tokens where the call carries an image (the model's own
    test: image embeddings not all zero)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 2, "encoder_hidden_states")
    glyph = call_argument(args, kwargs, 5, "encoder_hidden_states_2")
    image = call_argument(args, kwargs, 7, "image_embeds")
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    _, _, frames, height, width = hidden.shape
    images = 0 if image is None else int(image.shape[1])
    parts = (("image", images), ("glyph", 0 if glyph is None else int(glyph.shape[1])), ("prompt", int(text.shape[1])))
    context = sum(n for _, n in parts)
    pipeline = _running_pipeline()
    layout = TokenLayout(
        text_len=context,
        frames=frames // p_t,
        height=height // p,
        width=width // p,
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        image_len=images if image is not None and not bool((image == 0).all()) else 0,
        text_position="end",
        text_parts=parts,
        prompt_crop=0 if pipeline is None else prompt_crop(pipeline),
    )
    return layout, hidden.shape[0], t, hidden.device


def text_spans(config, args: tuple, kwargs: dict) -> list[dict[str, tuple[int, int]]]:
    """Per item of one ``HunyuanVideo15Transformer3DModel`` call, where the parts of its packed context sit
    (``ModelSpec.text_spans``): ``image`` (the image's SigLIP tokens where the call carries an image, the model's
    test of the whole batch; else none), ``glyph`` (its valid ByT5 tokens) and ``prompt`` (its valid Qwen2.5-VL
    tokens), each starting where the one before ends, as the model packs them; the padding follows."""
    mask = call_argument(args, kwargs, 3, "encoder_attention_mask")
    glyph = call_argument(args, kwargs, 5, "encoder_hidden_states_2")
    mask_2 = call_argument(args, kwargs, 6, "encoder_attention_mask_2")
    image = call_argument(args, kwargs, 7, "image_embeds")
    images = 0 if image is None or bool((image == 0).all()) else int(image.shape[1])
    prompts = mask.bool().sum(1).tolist()
    glyphs = [0] * len(prompts) if glyph is None or mask_2 is None else mask_2.bool().sum(1).tolist()
    spans = []
    for m, g in zip(prompts, glyphs):
        spans.append({"image": (0, images), "glyph": (images, images + g), "prompt": (images + g, images + g + m)})
    return spans


def _running_pipeline():
    """The HunyuanVideo 1.5 pipeline whose ``__call__`` is on the stack (its transformer calls run inside it),
    `None` outside one (a bare transformer): its crop is an instance attribute, not a call argument."""
    codes = set()
    for name in ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"):
        cls = getattr(diffusers, name, None)
        if cls is not None:
            codes.add(inspect.unwrap(cls.__call__).__code__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in codes:
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("self")


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a HunyuanVideo 1.5 pipeline call: ``(num_frames − 1) // 4 + 1`` latent frames, 16 pixels
    a token (a 16× VAE, patches of 1), and the packed context of ``text_len`` tokens (the released 1985 when
    `None`: 729 image, 256 glyph and 1000 prompt tokens, the parts in packing order, and the released template's
    108 tokens cropped before the prompt; another length names no parts), led by the image's 729 tokens in
    image-to-video."""
    images = IMAGE_LEN if config.get("task_type") == "i2v" else 0
    text_len = text_len or TEXT_LEN
    parts = (("image", IMAGE_LEN), ("glyph", GLYPH_LEN), ("prompt", MLLM_LEN))
    layout = TokenLayout.for_video(
        num_frames,
        height,
        width,
        text_len,
        int(config.get("patch_size", 1)),
        None,
        spatial_compression=16,
        image_len=images,
        text_position="end",
    )
    if text_len != TEXT_LEN:  # another length: the pipeline's own sizes, unknown here
        return layout
    return dataclasses.replace(layout, text_parts=parts, prompt_crop=PROMPT_CROP)


def call_rules(cfg, config: dict) -> None:
    """The batch tool's HunyuanVideo 1.5 rules (``ModelSpec.call_rules``): a plan's context is the pipelines'
    fixed one (they take no ``max_sequence_length``; the tiny pipeline's is its own)."""
    if cfg.tiny_spec() is None and cfg.max_sequence_length not in (None, TEXT_LEN):
        raise ValueError(
            f"max_sequence_length: {cfg.max_sequence_length!r}; HunyuanVideo 1.5's pipelines take none: its context "
            f"is always {IMAGE_LEN} image, {GLYPH_LEN} glyph and {MLLM_LEN} prompt tokens ({TEXT_LEN}). Leave it out."
        )


SPEC = ModelSpec(
    "hunyuan_video15",
    (HunyuanVideo15Transformer3DModel,),
    (Site("transformer_blocks", "attn"),),
    {HunyuanVideo15AttnProcessor2_0: HunyuanVideo15AttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=("text_embed_2_dim",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "video_to_image": "HunyuanVideo 1.5 has no image attention; its image's SigLIP tokens lead the joint "
        "attention's context (the first layout.image_len columns of video_to_text)."
    },
    guidance_calls=2,  # the guider's branches, which recorder/guiders.Branches tells
    output_call=False,
    title="HunyuanVideo 1.5",
    frame_counts="9, 13, ..., 121",
    pipelines={"text-to-video": "HunyuanVideo15Pipeline", "image-to-video": "HunyuanVideo15ImageToVideoPipeline"},
    call_rules=call_rules,
    prompt_text=prompt_text,
    glyph_text=glyph_text,
    text_spans=text_spans,
)
