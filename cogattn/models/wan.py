"""Wan 2.1 / 2.2: the map processor, the facts of the family and its tiny pipeline (docs/design.md, "The model seam").

Wan's blocks have a self-attention over the video alone (``attn1``, 3D RoPE) and a cross-attention from
the video to the text (``attn2``; 512 UMT5 tokens, and for Wan 2.1 image-to-video 257 CLIP image tokens
with their own softmax, added to the output). Both are ``WanAttention`` modules run by
``WanAttnProcessor``; :class:`WanAttnMapProcessor` is that processor line for line, the same
projections, norms, RoPE and ``dispatch_attention_fn`` calls with the module's attention backend, plus
the lines that hand q and k to the recording. The self-attention feeds the self-attention kinds, the
cross-attention ``video_to_text`` and ``video_to_image``.

Under classifier-free guidance the Wan pipelines call the transformer twice per step, the conditional
call first, each with the batch of the prompts; a recording numbers both as one step, and their items
as the guidance batch ``[uncond..., cond...]`` CogVideoX has.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from ..layout import VAE_SPATIAL, VAE_TEMPORAL, TokenLayout
from ..recorder.processor import MapSink, query_key_mask
from .spec import ModelSpec, Site, StepTime, Unavailable, text_never_queries
from .tiny_text import TEXT_DIM, cast, tiny_text_encoder, tiny_tokenizer

# Attention shapes of the released checkpoints (their transformer/config.json), for plans made offline.
_WAN = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_14B = {**_WAN, "num_layers": 40, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16}
KNOWN: dict[str, dict] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {**_WAN, "num_layers": 30, "num_attention_heads": 12, "out_channels": 16},
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": _14B,
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {**_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": {**_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {**_WAN, "num_layers": 30, "num_attention_heads": 24, "out_channels": 48},
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {**_14B, "experts": 2},
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {**_14B, "in_channels": 36, "experts": 2},
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_wan import (
        WanAttention,  # noqa: F401  (its absence, before diffusers 0.35, means no Wan support)
        WanAttnProcessor,
        WanTransformer3DModel,
        _get_added_kv_projections,
        _get_qkv_projections,
    )
except ImportError as missing:
    needs = "Wan needs diffusers >= 0.35 (WanAttention)"
    raise Unavailable("wan", needs, KNOWN) from missing


__all__ = [
    "SPEC",
    "WanAttnMapProcessor",
    "KNOWN",
    "read_call",
    "layout_for_video",
    "TEXT_LEN",
    "IMAGE_LEN",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 512  # UMT5 tokens of every Wan pipeline (the processor hard-codes it too)
IMAGE_LEN = 257  # CLIP ViT-H/14 tokens of Wan 2.1 image-to-video
_PARALLEL = "parallel_config" in inspect.signature(dispatch_attention_fn).parameters


def _dispatch(processor, query, key, value, attention_mask, parallel_config):
    kwargs = {"parallel_config": parallel_config} if _PARALLEL else {}
    return dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        **kwargs,
    )


class WanAttnMapProcessor:
    """Drop-in for ``WanAttnProcessor`` (self- and cross-attention) that also feeds q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and
            the role (self- or cross-attention) of each module. One instance serves every module.

    Example:
        ```python
        rec = cogattn.Recording(pipe, kinds=("frame", "video_to_text"))
        pipe.transformer.set_attn_processor(cogattn.WanAttnMapProcessor(rec))
        pipe(...)
        ```
    """

    _attention_backend = None
    _parallel_config = None
    _parallel_in_every_call = False  # Wan's: the self-attention's call only (SkyReels-V2's copy: every call)

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hardcoded for now
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:

            def apply_rotary_emb(
                hidden_states: torch.Tensor,
                freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor,
            ):
                x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
                cos = freqs_cos[..., 0::2]
                sin = freqs_sin[..., 1::2]
                out = torch.empty_like(hidden_states)
                out[..., 0::2] = x1 * cos - x2 * sin
                out[..., 1::2] = x1 * sin + x2 * cos
                return out.type_as(hidden_states)

            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)

        layer = self.sink.layer_to_capture(attn)
        # SkyReels-V2's diffusion forcing masks the self-attention block-causally: capture applies the mask
        mask = None if layer is None or cross else query_key_mask(attention_mask, query.shape[0], query.shape[1])
        q = None if layer is None else query.transpose(1, 2)  # (B, H, S, D), as the recording takes them

        # I2V task
        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)

            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))

            parallel = self._parallel_config if self._parallel_in_every_call else None
            hidden_states_img = _dispatch(self, query, key_img, value_img, None, parallel)
            hidden_states_img = hidden_states_img.flatten(2, 3)
            hidden_states_img = hidden_states_img.type_as(query)
            if layer is not None:
                self.sink.capture_context(layer, q, key_img.transpose(1, 2), "image")

        fused = (
            None
            if layer is None or cross or attention_mask is not None  # the opt-in output call takes no mask
            else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        )
        if fused is None:
            hidden_states = _dispatch(
                self,
                query,
                key,
                value,
                attention_mask,
                self._parallel_config if encoder_hidden_states is None or self._parallel_in_every_call else None,
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None and cross:
            self.sink.capture_context(layer, q, key.transpose(1, 2), "text")
        elif layer is not None:
            v = value.transpose(1, 2) if self.sink.wants_value else None
            self.sink.capture(layer, q, key.transpose(1, 2), lse, sums, mask=mask, value=v)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``WanTransformer3DModel`` call."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    t = kwargs["timestep"] if "timestep" in kwargs else args[1]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[2]
    image = kwargs.get("encoder_hidden_states_image", args[3] if len(args) > 3 else None)
    # TI2V-5B gives a timestep per token, 0 on a conditioning first frame, and SkyReels-V2's diffusion forcing
    # one per frame: the step's is the largest
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    image_len = 0 if image is None else image.shape[1]
    if image is not None and config.get("pos_embed_seq_len"):  # FLF2V: two images, joined by the model
        image_len = int(config["pos_embed_seq_len"])
    layout = TokenLayout.of_video_latents(
        hidden.shape,
        config["patch_size"],
        context_len=int(text.shape[1]),
        image_len=int(image_len),
        image_joins_text=bool(image_len) and not config.get("added_kv_proj_dim"),  # no image projections of its own
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Wan pipeline call for ``num_frames`` frames of ``height`` × ``width`` pixels (the
    pipeline rounds ``num_frames`` to ``num_frames // 4 * 4 + 1``, with a warning, and so does this)."""
    p_t, p_h, _ = (int(p) for p in config["patch_size"])
    layout = TokenLayout.for_video(
        max(int(num_frames) // VAE_TEMPORAL * VAE_TEMPORAL + 1, 1),
        height,
        width,
        0,
        p_h,
        p_t if p_t > 1 else None,
        spatial_compression=16 if int(config.get("out_channels", 16)) == 48 else VAE_SPATIAL,  # TI2V-5B: 16
        context_len=text_len or TEXT_LEN,
        image_len=(config.get("pos_embed_seq_len") or IMAGE_LEN) if config.get("image_dim") else 0,  # FLF2V: 2 images
    )
    joins = bool(config.get("image_dim")) and not config.get("added_kv_proj_dim")  # no image projections of its own
    return dataclasses.replace(layout, image_joins_text=joins)


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_IMAGE_DIM = 4  # CLIP width of the tiny image encoder


def tiny_transformer(
    image_to_video: bool = False,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cls: type = WanTransformer3DModel,
):
    """A random ``WanTransformer3DModel`` (diffusers' own test config); with ``image_to_video`` the Wan 2.1
    image-to-video one (36 input channels, an image cross-attention). ``cls``: a copy of Wan's transformer
    under another name with the same arguments (SkyReels-V2's, ChronoEdit's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(
            patch_size=(1, 2, 2),
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=36 if image_to_video else 16,
            out_channels=16,
            text_dim=TEXT_DIM,
            freq_dim=256,
            ffn_dim=32,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
            image_dim=_IMAGE_DIM if image_to_video else None,
            added_kv_proj_dim=num_heads * head_dim if image_to_video else None,
        )
    return cast(model, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    experts: int = 1,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random Wan pipeline with real components at toy size (no download).

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and
    ``num_frames=9`` 3 latent frames; the prompt is padded to 512 tokens as in Wan, and image-to-video
    adds 17 image tokens (an 8×8 CLIP of patch 2).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (Wan 2.1, with a CLIP image
            encoder; pass ``image=`` a PIL image).
        experts (`int`, defaults to 1): 2 gives Wan 2.2 A14B's two experts (``transformer`` for the
            high-noise steps, ``transformer_2`` for the others, ``boundary_ratio=0.875``).
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; choose 'text-to-video' or 'image-to-video'.")
    if experts not in (1, 2):
        raise ValueError(f"experts={experts!r}; Wan pipelines have 1 or 2 transformers.")
    i2v = task == "image-to-video"
    size = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    parts = dict(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=cast(vae, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=tiny_transformer(i2v, seed=seed, **size),
    )
    if experts == 2:
        parts.update(transformer_2=tiny_transformer(i2v, seed=seed + 1, **size), boundary_ratio=0.875)
    if i2v:
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        try:  # transformers 5 names the processor that needs no torchvision so
            from transformers import CLIPImageProcessorPil as CLIPImageProcessor
        except ImportError:
            from transformers import CLIPImageProcessor

        config = CLIPVisionConfig(
            hidden_size=_IMAGE_DIM,
            projection_dim=_IMAGE_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            intermediate_size=16,
            patch_size=2,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            encoder = CLIPVisionModelWithProjection(config)
        parts.update(image_encoder=cast(encoder, dtype), image_processor=CLIPImageProcessor(crop_size=8, size=8))
    if i2v:
        from diffusers import WanImageToVideoPipeline as cls
    else:
        from diffusers import WanPipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings (512 tokens), 9 frames of 32×48
    (3×2×3 patches), and for image-to-video a random image."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, TEXT_LEN, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=5.0 if guided else 1.0)
    call.update(num_frames=9, height=32, width=48)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call


def call_rules(cfg, config: dict) -> None:
    """The batch tool's Wan rules (``ModelSpec.call_rules``): the checkpoint's task, Wan 2.1 I2V's text."""
    ins, outs = int(config.get("in_channels", 16)), int(config.get("out_channels", 16))
    a, task = ("an", "image-to-video") if ins > outs else ("a", "text-to-video")
    if outs != 48 and cfg.task != task:  # Wan 2.2 TI2V-5B does both tasks; the others one
        raise ValueError(
            f"task: {cfg.task!r}, but {cfg.model} is {a} {task} checkpoint ({ins} input channels); set task: {task}."
        )
    if config.get("image_dim") and (n := cfg.max_sequence_length) not in (None, TEXT_LEN):  # images: all but 512
        raise ValueError(f"max_sequence_length: {n}; Wan 2.1 image-to-video takes {TEXT_LEN} text tokens; leave it out")


SPEC = ModelSpec(
    "wan",
    (WanTransformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {WanAttnProcessor: WanAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=("text_dim",),
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text", "video_to_image": "image"},
    refused={
        "text_to_video": text_never_queries("Wan"),
    },
    experts=("transformer", "transformer_2"),
    guidance_calls=2,
    float32=("vae", "image_encoder"),
    call_rules=call_rules,
    tiny_options={"tiny_experts": ("experts", (1, 2), "Wan 2.2's two experts")},
)
