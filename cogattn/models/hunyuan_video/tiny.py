"""HunyuanVideo's tiny random pipelines (tests, the notebook, the self-test, the batch tool): text-to-video
and image-to-video with real components at toy size, built from configs (no download), and the self-test's
call of them. :mod:`cogattn.models.hunyuan_video` exports them.
"""

from __future__ import annotations

import diffusers
import torch
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformer3DModel

from ..tiny_text import TEXT_DIM, cast, tiny_tokenizer

__all__ = ["TINY_I2V_TEMPLATE", "tiny_call", "tiny_pipeline", "tiny_transformer"]

_LATENT_CHANNELS = 4
_POOLED_DIM = 8  # width of the tiny CLIP text encoder's pooled output
_CHAT = ("<image>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")  # the chat template's tokens
_TINY_IMAGE = 16  # image tokens of the tiny LLaVA: an 8×8 image in patches of 2
# The image-to-video prompt template of the tiny pipeline: the released one's shape (a system part holding
# the image, the user's prompt, an assistant header), in the tiny tokenizer's words. The pipeline crops the
# 11 tokens before the prompt and the 4 of the assistant header, and puts the image's tokens first.
TINY_I2V_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|><image>describe the video<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
    "crop_start": 11,
    "image_emb_start": 3,
    "image_emb_end": 3 + _TINY_IMAGE,
    "image_emb_len": _TINY_IMAGE,
}


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    image_condition_type: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cls: type = HunyuanVideoTransformer3DModel,
    **extra,
):
    """A random ``HunyuanVideoTransformer3DModel``: ``num_layers`` dual-stream and ``num_single_layers``
    single-stream blocks, patch size 2, text width 16 (``head_dim`` is split over the 3D RoPE axes); with an
    ``image_condition_type`` (``"token_replace"`` or ``"latent_concat"``, 2 × 4 + 1 input channels) an
    image-to-video one. ``cls`` and ``extra``: another class of HunyuanVideo's blocks and its own options
    (FramePack's)."""
    axes = (head_dim - 2 * (head_dim * 3 // 8), head_dim * 3 // 8, head_dim * 3 // 8)
    concat = image_condition_type == "latent_concat"
    if image_condition_type:
        extra["image_condition_type"] = image_condition_type
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(
            in_channels=2 * _LATENT_CHANNELS + 1 if concat else _LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=_POOLED_DIM,
            rope_axes_dim=axes,
            **extra,
        )
    return cast(model, dtype)


def _tiny_llava(vocab: int, image_token: int):
    """A random ``LlavaForConditionalGeneration``: a 2-layer CLIP vision tower reading an 8×8 image as 16
    tokens, and a LLaMA of the tiny text width (the pipeline takes its hidden states 3 from the end)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=2,
        projection_dim=8,
    )
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=_TINY_IMAGE,
        pad_token_id=0,
    )
    return LlavaForConditionalGeneration(config)


def _tiny_image_processor():
    """CLIP's image processor resizing to the tiny vision tower's 8×8 (its PIL version where transformers has
    one: the default needs torchvision)."""
    try:
        from transformers import CLIPImageProcessorPil as processor
    except ImportError:
        from transformers import CLIPImageProcessor as processor
    return processor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    image_condition_type: str = "token_replace",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``HunyuanVideoPipeline`` or ``HunyuanVideoImageToVideoPipeline`` with real components at toy
    size (no download).

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9``
    3 latent frames. A prompt is tokenized by the tiny word-level tokenizer; pass
    ``prompt_template={"template": "{}", "crop_start": 0}`` to the text-to-video pipeline (the default
    template's 95 cropped tokens are LLaMA's), :data:`TINY_I2V_TEMPLATE` to the image-to-video one (its tiny
    LLaVA reads the image as 16 tokens: the text is 4 of them with ``token_replace``, 8 with
    ``latent_concat``, then ``max_sequence_length − 4`` prompt tokens), and ``max_sequence_length`` for the
    padded length. ``true_cfg_scale > 1`` with a ``negative_prompt`` makes two transformer calls per step.

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"``.
        num_layers, num_single_layers, num_heads, head_dim (`int`): transformer size.
        image_condition_type (`str`, defaults to ``"token_replace"``): how image-to-video's transformer takes
            the image, ``"token_replace"`` or ``"latent_concat"``.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny HunyuanVideo pipelines are text-to-video and image-to-video.")
    i2v = task == "image-to-video"
    if i2v and image_condition_type not in ("token_replace", "latent_concat"):
        raise ValueError(f"image_condition_type={image_condition_type!r}; use 'token_replace' or 'latent_concat'.")
    if i2v and not hasattr(diffusers, "HunyuanVideoImageToVideoPipeline"):
        raise ValueError(f"diffusers {diffusers.__version__} has no HunyuanVideoImageToVideoPipeline.")
    tokenizer = tiny_tokenizer()
    if i2v:
        tokenizer.add_tokens(list(_CHAT), special_tokens=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=_LATENT_CHANNELS,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        )
        if i2v:
            encoder = _tiny_llava(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
        else:
            encoder = LlamaModel(
                LlamaConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=TEXT_DIM,
                    intermediate_size=32,
                    num_hidden_layers=3,  # the pipeline takes the hidden states 3 from the end
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    pad_token_id=0,
                )
            )
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=_POOLED_DIM,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                projection_dim=_POOLED_DIM,
                max_position_embeddings=77,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=1,
            )
        )
    parts = dict(
        text_encoder=cast(encoder, dtype),
        tokenizer=tokenizer,
        transformer=tiny_transformer(
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            image_condition_type=image_condition_type if i2v else None,
            dtype=dtype,
            seed=seed,
        ),
        vae=cast(vae, dtype),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=cast(clip, dtype),
        tokenizer_2=tiny_tokenizer(),
    )
    if i2v:
        pipe = diffusers.HunyuanVideoImageToVideoPipeline(**parts, image_processor=_tiny_image_processor())
    else:
        pipe = diffusers.HunyuanVideoPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings of 6 tokens, 4 of them kept by the
    mask (under true guidance the negative keeps 2), 9 frames of 32×48 (3×2×3 patches); image-to-video: a
    random 32×48 image, and text that the mask keeps as the pipeline's own (its first 4 tokens, the image's,
    always kept)."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    i2v = task == "image-to-video"
    length = 10 if i2v else 6

    def text(kept):
        emb = torch.randn(1, length, TEXT_DIM, generator=generator).to(device, dtype)
        pooled = torch.randn(1, _POOLED_DIM, generator=generator).to(device, dtype)
        return emb, pooled, (torch.arange(length) < kept + (length - 6)).long()[None].to(device)

    emb, pooled, mask = text(4)
    call = dict(prompt_embeds=emb, pooled_prompt_embeds=pooled, prompt_attention_mask=mask)
    if guided:
        emb, pooled, mask = text(2)
        call.update(negative_prompt_embeds=emb, negative_pooled_prompt_embeds=pooled, true_cfg_scale=4.0)
        call["negative_prompt_attention_mask"] = mask
    call.update(num_frames=9, height=32, width=48)
    if i2v:
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call
