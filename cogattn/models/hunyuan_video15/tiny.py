"""HunyuanVideo 1.5's tiny random pipelines (tests, the notebook, the self-test, the batch tool): text-to-video
and image-to-video with real components at toy size, built from configs (no download), and the self-test's
call of them. :mod:`cogattn.models.hunyuan_video15` exports them.

The tiny context has the released one's three parts at toy size, packed by the transformer per item as
``[valid image | valid glyph | valid prompt | padding]``: ``IMAGE_LEN`` SigLIP tokens (zeros in text-to-video,
all padding there), ``GLYPH_LEN`` ByT5 tokens of the prompt's quoted words and ``MLLM_LEN`` Qwen2.5-VL tokens
of the prompt (after the chat template's ``PROMPT_CROP`` tokens): ``TEXT_LEN`` in all.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel

from ..tiny_text import TEXT_DIM, cast, qwen_text_config, tiny_siglip, tiny_text_encoder, tiny_tokenizer

__all__ = [
    "GLYPH_DIM",
    "GLYPH_LEN",
    "IMAGE_DIM",
    "IMAGE_LEN",
    "MLLM_LEN",
    "PROMPT_CROP",
    "SYSTEM_MESSAGE",
    "TEXT_LEN",
    "TINY_CHAT_TEMPLATE",
    "tiny_call",
    "tiny_pipeline",
    "tiny_transformer",
]

_LATENT_CHANNELS = 4
MLLM_LEN = 8  # Qwen2.5-VL tokens after the crop (the pipeline's tokenizer_max_length; released 1000)
GLYPH_LEN = 16  # ByT5 bytes of the quoted words (tokenizer_2_max_length; released 256): 'Text "fox". ' + EOS = 13
IMAGE_LEN = 16  # SigLIP tokens (vision_num_semantic_tokens; released 729): a 16 px image in 4 px patches
TEXT_LEN = IMAGE_LEN + GLYPH_LEN + MLLM_LEN  # the transformer's padded context T (released 1985)
GLYPH_DIM = 8  # width of the tiny ByT5 encoder (text_embed_2_dim; released 1472)
IMAGE_DIM = 12  # width of the tiny SigLIP tokens (image_embed_dim; released 1152)
_SIGLIP_SIDE = 16

# The tiny chat template: Qwen2.5-VL's shape (a system turn, the user's prompt, an assistant header) in the
# tiny tokenizer's words. With SYSTEM_MESSAGE it renders
# "<|im_start|>system the video<|im_end|><|im_start|>user {prompt}<|im_end|><|im_start|>assistant": the
# pipeline crops the PROMPT_CROP tokens before the prompt and keeps the prompt and the 3 tokens after it
# (the released keeps `<|im_end|>\n<|im_start|>assistant\n`, 5 tokens).
_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
_ROLES = ("system", "user", "assistant")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
SYSTEM_MESSAGE = "the video"
PROMPT_CROP = 7  # <|im_start|> system the video <|im_end|> <|im_start|> user


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    task: str = "text-to-video",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideo15Transformer3DModel``: ``num_layers`` dual-stream blocks, patch size 1, 2 × 4 + 1
    input channels (latents, image latents, mask), a 1-layer token refiner, context widths ``TEXT_DIM``
    (Qwen2.5-VL), ``GLYPH_DIM`` (ByT5) and ``IMAGE_DIM`` (SigLIP), ``head_dim`` split over the 3D RoPE axes,
    ``target_size=48`` (a 32×48 image keeps its size).

    Args:
        num_layers, num_heads, head_dim (`int`): transformer size.
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (the config's ``task_type``).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the weights.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny HunyuanVideo 1.5 transformers are text-to-video and image-to-video.")
    axes = (head_dim - 2 * (head_dim * 3 // 8), head_dim * 3 // 8, head_dim * 3 // 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HunyuanVideo15Transformer3DModel(
            in_channels=2 * _LATENT_CHANNELS + 1,
            out_channels=_LATENT_CHANNELS,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=TEXT_DIM,
            text_embed_2_dim=GLYPH_DIM,
            image_embed_dim=IMAGE_DIM,
            rope_axes_dim=axes,
            target_size=48,
            task_type="i2v" if task == "image-to-video" else "t2v",
        )
    return cast(model, dtype)


def _tiny_qwen_tokenizer():
    """The tiny word-level tokenizer (``tiny_text.tiny_tokenizer``) with Qwen's chat tokens, the role words
    and :data:`TINY_CHAT_TEMPLATE`: ``apply_chat_template`` works on it as on Qwen2.5-VL's."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(list(_CHAT_TOKENS), special_tokens=True)
    tokenizer.add_tokens(list(_ROLES))
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def _tiny_qwen(tokenizer):
    """A random 3-layer ``Qwen2_5_VLTextModel`` of the tiny text width (the pipeline takes its hidden states 3
    from the end; :func:`cogattn.models.tiny_text.qwen_text_config`)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(**qwen_text_config(tokenizer, 3, 128))
    return Qwen2_5_VLTextModel(config)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideo15Pipeline`` or ``HunyuanVideo15ImageToVideoPipeline`` with real components at
    toy size (no download): a Qwen2.5-VL text model on the tiny word-level tokenizer with a Qwen-shaped chat
    template, ByT5's tokenizer with a tiny T5 encoder, the HunyuanVideo 1.5 VAE at its real compression
    (×16 spatial, ×4 temporal), a ``ClassifierFreeGuidance(guidance_scale=6.0)`` guider and, for
    image-to-video, a tiny SigLIP.

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9``
    3 latent frames; image-to-video takes its size from the image (a 32×48 one keeps it). A prompt is read
    by the tiny tokenizers: ``MLLM_LEN`` word tokens after the template's ``PROMPT_CROP``, and its quoted
    words as ``GLYPH_LEN`` ByT5 bytes. Guidance is the guider's: set ``pipe.guider.guidance_scale`` in place
    (``> 1``: two transformer calls per step, the conditional one first).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"``.
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    import diffusers
    from transformers import ByT5Tokenizer

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny HunyuanVideo 1.5 pipelines are text-to-video and image-to-video.")
    i2v = task == "image-to-video"
    tokenizer, tokenizer_2 = _tiny_qwen_tokenizer(), ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = diffusers.AutoencoderKLHunyuanVideo15(
            in_channels=3,
            out_channels=3,
            latent_channels=_LATENT_CHANNELS,
            block_out_channels=(8,) * 5,
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
        )
        text_encoder = _tiny_qwen(tokenizer)
    parts = dict(
        text_encoder=cast(text_encoder, dtype),
        tokenizer=tokenizer,
        transformer=tiny_transformer(
            num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, task=task, dtype=dtype, seed=seed
        ),
        vae=cast(vae, dtype),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=tiny_text_encoder(seed, dtype, len(tokenizer_2), GLYPH_DIM),  # ByT5's bytes
        tokenizer_2=tokenizer_2,
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=6.0),
    )
    if i2v:
        image_encoder, feature_extractor = tiny_siglip(seed, dtype, IMAGE_DIM, _SIGLIP_SIDE)
        pipe = diffusers.HunyuanVideo15ImageToVideoPipeline(
            **parts, image_encoder=image_encoder, feature_extractor=feature_extractor
        )
    else:
        pipe = diffusers.HunyuanVideo15Pipeline(**parts)
    # the pipeline's sizes are instance attributes, not config: the released ones' at toy size
    pipe.system_message = SYSTEM_MESSAGE
    pipe.prompt_template_encode_start_idx = PROMPT_CROP
    pipe.tokenizer_max_length = MLLM_LEN
    pipe.tokenizer_2_max_length = GLYPH_LEN
    pipe.vision_num_semantic_tokens = IMAGE_LEN
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings, the prompt's ``MLLM_LEN`` Qwen tokens
    6 kept by the mask and its ``GLYPH_LEN`` ByT5 tokens 13 (a quoted word), the negative's 3 and none (no
    quoted word); 9 frames of 32×48 (3×2×3 patches); image-to-video: a random 32×48 image (its size is the
    image's). Sets ``pipe.guider.guidance_scale`` in place: 6.0 guided (two calls per step), 1.0 not.

    Args:
        pipe: a tiny pipeline (:func:`tiny_pipeline`).
        task (`str`): ``"text-to-video"`` or ``"image-to-video"``.
        generator (`torch.Generator`): draws the embeddings and the image.
        guided (`bool`): classifier-free guidance (the negative's embeddings are passed only then).
    """
    device, dtype = pipe._execution_device, pipe.transformer.dtype

    def text(kept, kept_2):
        emb = torch.randn(1, MLLM_LEN, TEXT_DIM, generator=generator).to(device, dtype)
        emb_2 = torch.randn(1, GLYPH_LEN, GLYPH_DIM, generator=generator).to(device, dtype)
        mask = (torch.arange(MLLM_LEN) < kept).long()[None].to(device)
        return emb, mask, emb_2, (torch.arange(GLYPH_LEN) < kept_2).long()[None].to(device)

    emb, mask, emb_2, mask_2 = text(6, 13)
    call = dict(prompt_embeds=emb, prompt_embeds_mask=mask, prompt_embeds_2=emb_2, prompt_embeds_mask_2=mask_2)
    if guided:
        emb, mask, emb_2, mask_2 = text(3, 0)
        call.update(negative_prompt_embeds=emb, negative_prompt_embeds_mask=mask)
        call.update(negative_prompt_embeds_2=emb_2, negative_prompt_embeds_mask_2=mask_2)
    pipe.guider.guidance_scale = 6.0 if guided else 1.0
    call["num_frames"] = 9
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    else:
        call.update(height=32, width=48)
    return call
