"""HunyuanVideo (text-to-video and image-to-video): the map processor, the family's facts and its tiny
pipelines (built in ``tiny.py``; docs/design.md, "The model seam").

HunyuanVideo runs 20 dual-stream blocks (``transformer_blocks``: video and text projected apart, one joint
attention) and then 40 single-stream blocks (``single_transformer_blocks``: one projection of ``[video,
text]``); cogattn numbers their attentions 0–19 and 20–59. The joint sequence is the video, then the text
(``text_position="end"``): up to 256 LLaMA tokens, padded at the end, with a boolean key mask ``(B, 1, 1,
S)`` that keeps each item's ``V + T_valid`` first keys. Padded text keys get probability exactly 0 in every
kind; padded text queries are computed, as the model computes them. The token refiner's attention is over
the text alone: it is not a capture site.

Image-to-video (``HunyuanVideoImageToVideoPipeline``; the transformer's ``image_condition_type``
``"token_replace"``, hunyuanvideo-community/HunyuanVideo-I2V, or ``"latent_concat"``, ...-I2V-33ch) runs
the same blocks and processor. Its LLaVA text encoder reads the image as 576 tokens; the pipeline keeps
every 4th of them (``token_replace``) or every 2nd (``latent_concat``; its ``image_embed_interleave``) and
puts them first in the text: the text after the video is ``layout.image_len`` image tokens (144 or 288),
then the prompt's ``max_sequence_length − 4`` tokens (the chat template's assistant header is cropped), and
the key mask keeps every image token. ``layout.prompt_start`` is where the prompt's tokens start on the
text axis. The image is also in the latents: ``token_replace`` puts its latent as the first latent frame,
which the model modulates as of timestep 0 (the call's timestep is the step's); ``latent_concat`` adds it
and a mask as input channels, and the pipeline drops the first 4 decoded frames.

Guidance is distilled into one call per step (``guidance_scale`` is an embedding, the batch holds the
prompts); true classifier-free guidance (``true_cfg_scale > 1`` with a negative prompt) calls the
transformer twice per step, the conditional call first, as Wan does. Both calls of a step must carry text
of one length (the image-to-video pipeline encodes a negative prompt with ``image_embed_interleave=2``
whatever the call's: a ``token_replace`` call under true guidance needs ``image_embed_interleave=2`` or
negative embeddings of the prompt's length).

The processor is diffusers' ``HunyuanVideoAttnProcessor2_0`` line for line, plus the lines that hand q, k
and the per-item key counts to the recording: the ``dispatch_attention_fn`` version of diffusers ≥ 0.36
here, the SDPA version of 0.33 – 0.35 in ``sdpa.py``. On 0.32, whose mask covers queries
as well as keys, the family is unavailable.
"""

from __future__ import annotations

import inspect
import sys

import diffusers
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoTransformer3DModel,
)
from packaging.version import Version

from ...layout import TokenLayout
from ...recorder.processor import MapSink, key_counts
from ..spec import ModelSpec, Site, Unavailable

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_HV = {
    "_class_name": "HunyuanVideoTransformer3DModel",
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "num_layers": 20,
    "num_single_layers": 40,
    "patch_size": 2,
    "patch_size_t": 1,
    "text_embed_dim": 4096,
}
KNOWN: dict[str, dict] = {
    "hunyuanvideo-community/HunyuanVideo": {**_HV, "in_channels": 16, "guidance_embeds": True},
    # image-to-video: the released checkpoint and the first release (diffusers' conversion script's
    # HYVideo-T/2-I2V-16ch and -33ch)
    "hunyuanvideo-community/HunyuanVideo-I2V": {
        **_HV,
        "in_channels": 16,
        "guidance_embeds": True,
        "image_condition_type": "token_replace",
    },
    "hunyuanvideo-community/HunyuanVideo-I2V-33ch": {
        **_HV,
        "in_channels": 33,
        "guidance_embeds": False,
        "image_condition_type": "latent_concat",
    },
}

if Version(diffusers.__version__).release < (0, 33):
    # 0.32 masks queries as well as keys (B, S, S); 0.33 keeps a key mask (B, 1, 1, S), which capture takes
    needs = "HunyuanVideo needs diffusers >= 0.33 (a key mask)"
    raise Unavailable("hunyuan_video", needs, KNOWN)
# The stock processor of 0.36 calls dispatch_attention_fn on (B, S, H, D); of 0.33 – 0.35, SDPA on (B, H, S, D).
DISPATCH = hasattr(HunyuanVideoAttnProcessor2_0, "_attention_backend")
if DISPATCH:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
from .sdpa import HunyuanVideoAttnMapProcessorSDPA  # noqa: E402
from .text import ASSISTANT_TOKENS, prompt_text  # noqa: E402
from .tiny import TINY_I2V_TEMPLATE, tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "HunyuanVideoAttnMapProcessor",
    "IMAGE_EMBEDS",
    "KNOWN",
    "TEXT_LEN",
    "TINY_I2V_TEMPLATE",
    "image_tokens",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 256  # LLaMA tokens after the prompt template is cropped (the pipelines' max_sequence_length)
IMAGE_EMBEDS = 576  # LLaVA's tokens of an image (24 × 24 patches), of which image-to-video keeps every 2nd or 4th
_INTERLEAVE = {"latent_concat": 2, "token_replace": 4}  # the pipeline's image_embed_interleave by default


class HunyuanVideoAttnMapProcessor:
    """Drop-in for ``HunyuanVideoAttnProcessor2_0`` (dual- and single-stream blocks) that also feeds q, k and
    each item's valid key count to a recording. The output call is always the stock one.

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
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                query = torch.cat(
                    [
                        apply_rotary_emb(
                            query[:, : -encoder_hidden_states.shape[1]],
                            image_rotary_emb,
                            sequence_dim=1,
                        ),
                        query[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
                key = torch.cat(
                    [
                        apply_rotary_emb(
                            key[:, : -encoder_hidden_states.shape[1]],
                            image_rotary_emb,
                            sequence_dim=1,
                        ),
                        key[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
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
        if layer is not None:  # (B, H, S, D), as the recording takes them; padded text keys are masked
            counts = key_counts(attention_mask, query.shape[1])
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, query.transpose(1, 2), key.transpose(1, 2), None, None, counts, value=v)

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
    """``(layout, batch_size, timestep, device)`` of one ``HunyuanVideoTransformer3DModel`` call: latents
    ``(B, C, F, H, W)``, the text after the video (its padded length: the mask sets each item's own), led by
    the image tokens of an image-to-video pipeline call (:func:`image_tokens`). The timestep is the call's,
    the step's: ``token_replace`` gives the first latent frame timestep 0 inside the model."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    t = kwargs["timestep"] if "timestep" in kwargs else args[1]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[2]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p, p_t = int(config["patch_size"]), int(config["patch_size_t"])
    _, _, frames, height, width = hidden.shape
    layout = TokenLayout(
        text_len=int(text.shape[1]),
        frames=frames // p_t,
        height=height // p,
        width=width // p,
        patch_size=p,
        patch_size_t=p_t if p_t > 1 else None,
        image_len=image_tokens(int(text.shape[1])) if config.get("image_condition_type") else 0,
        text_position="end",
    )
    return layout, hidden.shape[0], t, hidden.device


def _pipeline_call():
    """The locals of the running ``HunyuanVideoImageToVideoPipeline.__call__`` (on the stack at each of
    its transformer calls), `None` outside one."""
    pipeline = getattr(diffusers, "HunyuanVideoImageToVideoPipeline", None)
    if pipeline is None:
        return None
    code = inspect.unwrap(pipeline.__call__).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return None if frame is None else frame.f_locals


def image_tokens(text_len: int) -> int:
    """The image tokens that lead the ``text_len`` text tokens of the running image-to-video pipeline call.

    The pipeline crops its chat template (``crop_start > 0``) and puts first the LLaVA tokens of the image
    (``image_emb_start`` to ``image_emb_end`` of its template, every ``image_embed_interleave``-th), then
    the prompt's ``max_sequence_length − 4`` tokens. With a prompt, that is the call's text; given
    ``prompt_embeds``, their image tokens are named where they have the length of the pipeline's own
    encoding (``pipe.encode_prompt`` with the call's template, interleave and ``max_sequence_length``).
    0 outside such a call, for a template it does not crop (its image tokens are not set apart), and for
    embeddings of another length.
    """
    call = _pipeline_call()
    if call is None or not isinstance(call.get("prompt_template"), dict):
        return 0
    template, every = call["prompt_template"], call.get("image_embed_interleave")
    crop = template.get("crop_start")
    if crop is not None and crop <= 0:
        return 0
    n = max(0, int(template.get("image_emb_end", 581)) - int(template.get("image_emb_start", 5)))
    images = len(range(0, n, every)) if every is not None and 0 < every < 6 else n
    if call.get("prompt") is not None:
        return images if images <= text_len else 0
    length = call.get("max_sequence_length", TEXT_LEN)
    return images if isinstance(length, int) and text_len == images + length - ASSISTANT_TOKENS else 0


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a HunyuanVideo pipeline call (``(num_frames − 1) // 4 + 1`` latent frames, 8× spatial);
    ``text_len`` is the call's ``max_sequence_length``. Image-to-video's text is the image tokens the
    pipeline keeps by default (of 576, every 4th for ``token_replace``, every 2nd for ``latent_concat``) and
    ``max_sequence_length − 4`` prompt tokens."""
    p_t = int(config.get("patch_size_t", 1))
    text_len = text_len or TEXT_LEN
    kind = config.get("image_condition_type")
    images = len(range(0, IMAGE_EMBEDS, _INTERLEAVE[kind])) if kind in _INTERLEAVE else 0
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        images + max(text_len - ASSISTANT_TOKENS, 0) if images else text_len,
        int(config["patch_size"]),
        p_t if p_t > 1 else None,
        image_len=images,
        text_position="end",
    )


def true_cfg(pipeline) -> bool | None:
    """Whether the running HunyuanVideo pipeline call uses true classifier-free guidance (two transformer
    calls per step). The pipelines keep it in a local, ``do_true_cfg``, of their ``__call__``: read from that
    frame, which is on the stack at every transformer call; `None` when no such frame is found. Raises
    `ValueError` where the two calls of a step would carry text of different lengths (one recording holds
    one layout)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is pipeline and "do_true_cfg" in frame.f_locals:
            call = frame.f_locals
            on = bool(call["do_true_cfg"])
            cond, uncond = call.get("prompt_embeds"), call.get("negative_prompt_embeds")
            if on and isinstance(cond, torch.Tensor) and isinstance(uncond, torch.Tensor):
                if cond.shape[1] != uncond.shape[1]:
                    hint = ""
                    if "image_embed_interleave" in call:  # image-to-video: the negative's image tokens
                        hint = (
                            " The image-to-video pipeline encodes a negative prompt with image_embed_interleave=2 "
                            f"whatever the call's ({call['image_embed_interleave']}): pass image_embed_interleave=2, "
                            "or negative_prompt_embeds of the prompt's length."
                        )
                    raise ValueError(
                        f"under true classifier-free guidance the text of the conditional call has "
                        f"{cond.shape[1]} tokens and the unconditional call's {uncond.shape[1]}; a recording "
                        f"holds one layout, so both calls of a step need text of one length.{hint}"
                    )
            return on
        frame = frame.f_back
    return None


def call_rules(cfg, config: dict) -> None:
    """The batch tool's HunyuanVideo rules (``ModelSpec.call_rules``): the checkpoint's task; image-to-video's
    true guidance (``token_replace``: the negative prompt's text is longer) and previews (``latent_concat``:
    the pipeline drops the first 4 decoded frames, which the previews' frame mapping does not know); the tiny
    pipeline's image-to-video needs a prompt template of its own."""
    kind = config.get("image_condition_type")
    if cfg.tiny_spec() is not None and cfg.task == "image-to-video":
        raise ValueError(
            f"task: 'image-to-video'; the batch tool runs {cfg.model} (the tiny HunyuanVideo pipeline) for "
            "text-to-video only: its image-to-video call takes a prompt template of its own (TINY_I2V_TEMPLATE); "
            "record it directly."
        )
    a, task = ("an", "image-to-video") if kind else ("a", "text-to-video")
    if cfg.task != task:
        raise ValueError(
            f"task: {cfg.task!r}; the batch tool runs HunyuanVideo checkpoints for the task they were made for: "
            f"{cfg.model} is {a} {task} checkpoint; set task: {task}."
        )
    if kind == "token_replace" and (cfg.true_cfg_scale or 0) > 1:
        raise ValueError(
            f"true_cfg_scale: {cfg.true_cfg_scale!r}; {cfg.model} ({kind}) keeps every 4th image token of the "
            "prompt's text but every 2nd of the negative prompt's (the pipeline's default): the two calls of a "
            "step differ in length, which one recording cannot hold. Leave true_cfg_scale out (its guidance is "
            "distilled: guidance_scale)."
        )
    if kind == "latent_concat" and cfg.previews:
        raise ValueError(
            f"previews: true; {cfg.model} ({kind}) drops the first 4 decoded frames of its video, which the "
            "previews cannot place on the latent frames: set previews: false (the maps and the video are written)."
        )


SPEC = ModelSpec(
    "hunyuan_video",
    (HunyuanVideoTransformer3DModel,),
    (Site("transformer_blocks", "attn"), Site("single_transformer_blocks", "attn", count_key="num_single_layers")),
    {HunyuanVideoAttnProcessor2_0: HunyuanVideoAttnMapProcessor if DISPATCH else HunyuanVideoAttnMapProcessorSDPA},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=("num_single_layers",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "video_to_image": "HunyuanVideo has no image attention; its transformer sees text and video tokens (in "
        "image-to-video the image's LLaVA tokens lead the text: the first layout.image_len columns of "
        "video_to_text)."
    },
    guidance_calls=2,
    guidance=true_cfg,
    guidance_argument="true_cfg_scale",
    output_call=False,
    frame_counts="9, 13, ..., 61, ..., 129",
    pipelines={"text-to-video": "HunyuanVideoPipeline", "image-to-video": "HunyuanVideoImageToVideoPipeline"},
    float32=("vae",),
    call_rules=call_rules,
    tiny_prompt_arguments={"prompt_template": {"template": "{}", "crop_start": 0}},  # the 95 cropped tokens are LLaMA's
    prompt_text=prompt_text,
)
