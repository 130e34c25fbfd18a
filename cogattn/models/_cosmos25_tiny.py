"""Cosmos Predict2.5's and Transfer2.5's tiny random pipelines (tests, the self-test): real components at toy size,
built from configs (no download). :mod:`cogattn.models.cosmos` serves them.

Both read a tiny Qwen2.5-VL's hidden states of every layer, normalized and joined (``QWEN_LAYERS`` × the tiny text
width: ``TEXT_WIDTH``), which the transformer's ``crossattn_proj`` maps to its text width, and decode with Wan 2.1's
VAE at toy size (8 pixels, 4 frames per latent pixel and frame). Transfer2.5's transformer has an image context of
``IMAGE_LEN`` tokens (the pipeline's are zeros) and a control net of 2 blocks, whose outputs are added after each of
the transformer's 2 blocks.
"""

from __future__ import annotations

import importlib.util
import types

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

from .tiny_text import TEXT_DIM, cast, tiny_tokenizer

__all__ = ["IMAGE_LEN", "TEXT_WIDTH", "tiny_call", "tiny_pipeline", "tiny_transformer"]

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


def tiny_transformer(
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
    multimodal RoPE sections (1, 1, 2) of its 8-wide heads, positions for the 512 tokens of a prompt."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    if hasattr(Qwen2_5_VLTextConfig, "rope_parameters"):  # transformers 5; 4 spells it rope_scaling
        rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]})
    else:
        rope = dict(rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=1e6)
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=QWEN_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        **rope,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLTextModel(config)
    return cast(model, dtype)


def tiny_pipeline(transfer: bool = True, *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
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

    from .cosmos import _PassingGuardrail

    tokenizer = _tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    transformer = tiny_transformer(transfer, dtype=dtype, seed=seed, **size)
    parts = dict(
        text_encoder=_tiny_qwen(tokenizer, seed, dtype),
        tokenizer=tokenizer,
        transformer=transformer,
        vae=cast(vae, dtype),
        scheduler=UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=5.0),
        safety_checker=_PassingGuardrail(),
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


def tiny_call(pipe, generator: torch.Generator, guided: bool, videos: int = 1) -> dict:
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
