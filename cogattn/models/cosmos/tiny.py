"""Cosmos' tiny random pipelines (tests, the notebook, the self-test, the batch tool): real components at toy size,
built from configs (no download), each with a guardrail that passes everything. :mod:`cogattn.models.cosmos` serves
them as its ``tiny_pipeline``: Predict2 video-to-world (``"image-to-video"``), Predict1 text-to-world
(``"text-to-video"``) and Transfer2.5 (``"video-to-video"``); :func:`tiny_pipeline_25` makes Predict2.5's too.

Predict2.5 and Transfer2.5 read a tiny Qwen2.5-VL's hidden states of every layer, normalized and joined
(``QWEN_LAYERS`` × the tiny text width: ``TEXT_WIDTH``), which the transformer's ``crossattn_proj`` maps to its text
width, and decode with Wan 2.1's VAE at toy size (8 pixels, 4 frames per latent pixel and frame). Transfer2.5's
transformer has an image context of ``IMAGE_LEN`` tokens (the pipeline's are zeros) and a control net of 2 blocks,
whose outputs are added after each of the transformer's 2 blocks.
"""

from __future__ import annotations

import importlib.util
import types

import diffusers
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

from ..tiny_text import TEXT_DIM, cast, qwen_text_config, tiny_text_encoder, tiny_tokenizer

__all__ = [
    "IMAGE_LEN",
    "TEXT_WIDTH",
    "TRANSFER25",
    "PassingGuardrail",
    "tiny_call",
    "tiny_call_25",
    "tiny_pipeline",
    "tiny_pipeline_25",
    "tiny_transformer",
    "tiny_transformer_25",
]

# Transfer2.5's tiny pipeline: a diffusers with its pipeline (and CosmosAttnProcessor2_5)
TRANSFER25 = hasattr(diffusers, "Cosmos2_5_TransferPipeline")

QWEN_LAYERS = 2
TEXT_WIDTH = QWEN_LAYERS * TEXT_DIM  # the pipelines' prompt embeddings (released: 28 × 3584 = 100352)
IMAGE_DIM = 12  # width of the image context (img_context_dim_in; released 1152)
IMAGE_LEN = 5  # its tokens (img_context_num_tokens; released 256)

# The pipelines' chat turns hold a list of text parts: the tiny template renders them in the tiny tokenizer's words,
# between Qwen's chat tokens
_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>{% endfor %}"
)


class PassingGuardrail(torch.nn.Module):
    """The tiny pipelines' stand-in for ``cosmos_guardrail.CosmosSafetyChecker`` (a download of its own): it
    passes every prompt and video. A real Cosmos pipeline loads NVIDIA's guardrail, as its license asks."""

    def __init__(self):
        super().__init__()
        self.register_buffer("_where", torch.zeros(()), persistent=False)  # the pipeline asks its parts' device

    device = property(lambda self: self._where.device)
    dtype = property(lambda self: self._where.dtype)

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames):
        return frames


# -- Predict1 and Predict2 ----------------------------------------------------------------------------
def tiny_transformer(
    image_to_video: bool = True,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``CosmosTransformer3DModel`` at toy size, text width 16: Predict2's video-to-world (16 latent
    channels and the conditioning mask's), or with ``image_to_video=False`` Predict1's text-to-world (a learnable
    positional embedding). No padding-mask channel: its resizing needs torchvision, which a plain install lacks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CosmosTransformer3DModel(
            in_channels=17 if image_to_video else 16,
            out_channels=16,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            adaln_lora_dim=4,
            max_size=(8, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0) if image_to_video else (2.0, 1.0, 1.0),
            concat_padding_mask=False,
            extra_pos_embed_type=None if image_to_video else "learnable",
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "image-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random Cosmos pipeline at toy size (no download; its guardrail passes everything).

    ``"image-to-video"``: ``Cosmos2VideoToWorldPipeline`` (Predict2) with Wan 2.1's VAE at toy size (8 pixels, 4
    frames): ``num_frames=9, height=32, width=48`` gives 3 latent frames of 2×3 patches; pass ``image=`` a PIL image.
    ``"text-to-video"``: ``CosmosTextToWorldPipeline`` (Predict1) with a toy Cosmos tokenizer (8 pixels, 8 frames):
    ``num_frames=17`` gives 3 latent frames. ``"video-to-video"``: ``Cosmos2_5_TransferPipeline`` (Transfer2.5: a
    control video's frames drive it through a control net; its cross-attention has an image branch), built by
    ``tiny_pipeline_25``, as Predict2.5's ``Cosmos2_5_PredictBasePipeline``.

    Args:
        task (`str`, defaults to ``"image-to-video"``): or ``"text-to-video"``, ``"video-to-video"``.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim`` of the transformer.
    """
    from diffusers import EDMEulerScheduler, FlowMatchEulerDiscreteScheduler

    if task not in ("text-to-video", "image-to-video", "video-to-video"):
        raise ValueError(
            f"task={task!r}; choose 'image-to-video' (Predict2), 'text-to-video' (Predict1) or 'video-to-video' "
            "(Transfer2.5)."
        )
    if task == "video-to-video" and not TRANSFER25:
        raise ValueError(
            "task='video-to-video' is Cosmos Transfer2.5's; this diffusers lacks Cosmos2_5_TransferPipeline."
        )
    if task == "video-to-video":
        return tiny_pipeline_25(dtype=dtype, seed=seed, **size)
    i2v = task == "image-to-video"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if i2v:
            from diffusers import AutoencoderKLWan

            vae = AutoencoderKLWan(
                base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
            )
        else:
            from diffusers import AutoencoderKLCosmos

            vae = AutoencoderKLCosmos(
                latent_channels=16,
                encoder_block_out_channels=(8, 8, 8, 8),
                decode_block_out_channels=(8, 8, 8, 8),
                attention_resolutions=(),
                resolution=64,
                num_layers=1,
                patch_size=4,
                spatial_compression_ratio=8,
                temporal_compression_ratio=8,
            )
    parts = dict(
        text_encoder=tiny_text_encoder(seed, dtype),
        tokenizer=tiny_tokenizer(),
        transformer=tiny_transformer(i2v, dtype=dtype, seed=seed, **size),
        vae=cast(vae, dtype),
        safety_checker=PassingGuardrail(),
    )
    if i2v:
        from diffusers import Cosmos2VideoToWorldPipeline as cls

        parts["scheduler"] = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
    else:
        from diffusers import CosmosTextToWorldPipeline as cls

        parts["scheduler"] = EDMEulerScheduler(
            sigma_min=0.002, sigma_max=80, sigma_data=0.5, sigma_schedule="karras", num_train_timesteps=1000,
            prediction_type="epsilon", rho=7.0, final_sigmas_type="sigma_min",
        )  # fmt: skip
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 8 random text tokens (the negative: their opposite), 3 latent frames
    of 2×3 patches (32×48 pixels: 9 frames through Wan's VAE, 17 through Cosmos' tokenizer), and for image-to-video
    a random image; video-to-video: 9 random control frames (``tiny_call_25``)."""
    if task == "video-to-video":
        return tiny_call_25(pipe, generator, guided)
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, 8, TEXT_DIM, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=7.0 if guided else 1.0)
    call.update(num_frames=9 if task == "image-to-video" else 17, height=32, width=48)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call


# -- Predict2.5 and Transfer2.5 ----------------------------------------------------------------------
def tiny_transformer_25(
    image_context: bool = True,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random Predict2.5 ``CosmosTransformer3DModel`` (16 latent channels and the condition mask's, the text
    projected from ``TEXT_WIDTH``); with ``image_context`` Transfer2.5's (an image context of ``IMAGE_LEN`` tokens,
    control residuals after every block). No padding-mask channel: its resizing needs torchvision."""
    hidden = num_heads * head_dim
    image = dict(img_context_dim_in=IMAGE_DIM, img_context_num_tokens=IMAGE_LEN, img_context_dim_out=hidden)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CosmosTransformer3DModel(
            in_channels=17,
            out_channels=16,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            adaln_lora_dim=4,
            max_size=(16, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(1.0, 3.0, 3.0),
            concat_padding_mask=False,
            extra_pos_embed_type=None,
            use_crossattn_projection=True,
            crossattn_proj_in_channels=TEXT_WIDTH,
            encoder_hidden_states_channels=TEXT_DIM,
            **(dict(controlnet_block_every_n=1, **image) if image_context else {}),
        )
    return cast(model, dtype)


def _control_net(transformer, seed: int, dtype: torch.dtype):
    """A random ``CosmosControlNetModel`` of 2 blocks of ``transformer``'s shape (the control video's 16 latent
    channels, the condition and padding masks)."""
    from diffusers import CosmosControlNetModel

    config = transformer.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = CosmosControlNetModel(
            n_controlnet_blocks=2,
            in_channels=18,
            latent_channels=18,
            model_channels=config.num_attention_heads * config.attention_head_dim,
            num_attention_heads=config.num_attention_heads,
            attention_head_dim=config.attention_head_dim,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            adaln_lora_dim=4,
            patch_size=(1, 2, 2),
            max_size=tuple(config.max_size),
            rope_scale=tuple(config.rope_scale),
            img_context_dim_in=IMAGE_DIM,
            img_context_dim_out=config.img_context_dim_out,
            use_crossattn_projection=True,
            crossattn_proj_in_channels=TEXT_WIDTH,
            encoder_hidden_states_channels=TEXT_DIM,
        )
    return cast(model, dtype)


def _nearest_resize():
    """Where torchvision is absent, diffusers' control net module gets the one call of it it makes: a nearest
    resize of the padding mask, as torchvision's own on a tensor (``interpolate(mode="nearest")``)."""
    from diffusers.models.controlnets import controlnet_cosmos

    if importlib.util.find_spec("torchvision") or hasattr(controlnet_cosmos, "transforms"):
        return
    mode = types.SimpleNamespace(NEAREST="nearest")

    def resize(image, size, interpolation="nearest"):
        return F.interpolate(image, size=list(size), mode=interpolation)

    functional = types.SimpleNamespace(resize=resize)
    controlnet_cosmos.transforms = types.SimpleNamespace(functional=functional, InterpolationMode=mode)


def _tiny_qwen_tokenizer():
    """The tiny word-level tokenizer (``tiny_text.tiny_tokenizer``) with Qwen's chat tokens, the role words and the
    tiny chat template: ``apply_chat_template`` works on it as on Qwen2.5-VL's."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(list(_CHAT_TOKENS), special_tokens=True)
    tokenizer.add_tokens(["system", "user", "assistant"])
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _tiny_qwen(tokenizer, seed: int, dtype: torch.dtype):
    """A random ``QWEN_LAYERS``-layer ``Qwen2_5_VLTextModel`` of the tiny text width over the tiny tokenizer,
    positions for the 512 tokens of a prompt (:func:`cogattn.models.tiny_text.qwen_text_config`)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(**qwen_text_config(tokenizer, QWEN_LAYERS, 512))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLTextModel(config)
    return cast(model, dtype)


def tiny_pipeline_25(transfer: bool = True, *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``Cosmos2_5_TransferPipeline`` (Transfer2.5: a control video's frames drive it through the control
    net), or with ``transfer=False`` a ``Cosmos2_5_PredictBasePipeline`` (Predict2.5: text, image or video to
    world), at toy size (no download; its guardrail passes everything): ``num_frames=9, height=32, width=48`` gives 3
    latent frames of 2×3 patches.

    Args:
        transfer (`bool`, defaults to `True`): Transfer2.5, or Predict2.5.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim`` of the transformer.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    tokenizer = _tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    transformer = tiny_transformer_25(transfer, dtype=dtype, seed=seed, **size)
    parts = dict(
        text_encoder=_tiny_qwen(tokenizer, seed, dtype),
        tokenizer=tokenizer,
        transformer=transformer,
        vae=cast(vae, dtype),
        scheduler=UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=5.0),
        safety_checker=PassingGuardrail(),
    )
    if transfer:
        from diffusers import Cosmos2_5_TransferPipeline as cls

        _nearest_resize()
        parts["controlnet"] = _control_net(transformer, seed, dtype)
    else:
        from diffusers import Cosmos2_5_PredictBasePipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call_25(pipe, generator: torch.Generator, guided: bool, videos: int = 1) -> dict:
    """A call of a tiny 2.5 pipeline: ``videos`` videos of 8 random text embeddings (the negative: their opposite),
    9 frames of 32×48 (3 latent frames of 2×3 patches); Transfer2.5's controlled by 9 random frames."""
    import PIL.Image

    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(videos, 8, TEXT_WIDTH, generator=generator).to(device, dtype)
    call = dict(prompt_embeds=emb, negative_prompt_embeds=-emb, guidance_scale=7.0 if guided else 1.0)
    call.update(num_frames=9, height=32, width=48)
    if hasattr(pipe, "controlnet"):
        shape = (32, 48, 3)
        frames = [torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).numpy() for _ in range(9)]
        call.update(controls=[PIL.Image.fromarray(f) for f in frames], num_frames_per_chunk=9)
    return call
