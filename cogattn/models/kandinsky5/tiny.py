"""Kandinsky 5's tiny random pipelines (tests, the notebook, the self-test, the batch tool): text-to-video and
image-to-video with real components at toy size, built from configs (no download), and the self-test's call of
them. :mod:`cogattn.models.kandinsky5` exports them.

The text side is the released one's at toy size: a Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, a 1-block
vision tower it never runs) whose last hidden states are the cross-attention's text, on the tiny word-level
tokenizer with Qwen's chat tokens, and a CLIP text model whose pooled output joins the timestep. The pipeline
puts every prompt in its own system template and crops the template's first ``prompt_template_encode_start_idx``
tokens (128 with Qwen's tokenizer): the tiny pipeline keeps the template and crops as many tokens as the tiny
tokenizer makes of it before the prompt, so the text the transformer reads is the prompt's
words, then ``<|im_end|>`` and the tiny tokenizer's ``</s>``.

The tokenizer is the tokenizer alone, not a ``Qwen2VLProcessor``: the pipeline calls it with ``images=None,
videos=None``, which is the processor's tokenizer call, and a ``Qwen2VLProcessor`` cannot be made without its
video processor, which needs torchvision.
"""

from __future__ import annotations

import torch

from ..tiny_text import TEXT_DIM, cast, tiny_clip_text, tiny_qwen_vl, tiny_tokenizer

__all__ = ["CLIP_DIM", "TINY_TEXT_LEN", "tiny_call", "tiny_pipeline", "tiny_transformer"]

_LATENT_CHANNELS = 4
CLIP_DIM = 8  # width of the tiny CLIP's pooled output (in_text_dim2; released 768)
TINY_TEXT_LEN = 6  # Qwen tokens of the tiny calls' random text embeddings
_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
_ROLES = ("system", "user", "assistant")


def _tiny_qwen_tokenizer():
    """The tiny word-level tokenizer with Qwen's chat tokens and role words."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(list(_CHAT_TOKENS), special_tokens=True)
    tokenizer.add_tokens(list(_ROLES))
    return tokenizer


def _prompt_crop(tokenizer, template: str) -> int:
    """The template's tokens before the prompt, as the tiny tokenizer makes them (the released 128 are Qwen's)."""
    before = template.split("{}")[0]
    return len(tokenizer(before, add_special_tokens=False)["input_ids"])


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    attention_type: str = "regular",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``Kandinsky5Transformer3DModel``: one text block, ``num_layers`` visual blocks, patches (1, 2, 2),
    ``visual_cond`` as the released checkpoints (2 × 4 + 1 input channels: latents, the image's latents, its mask),
    ``head_dim`` split over the 3D RoPE axes. The modulations, which diffusers makes zero (every gate shut until
    trained), are drawn at random so that every attention reaches the video; in another ``dtype`` the timestep's
    embedding and the modulations stay float32, as ``from_pretrained`` keeps them (``_keep_in_fp32_modules``).

    Args:
        num_layers, num_heads, head_dim (`int`): transformer size (``head_dim`` a multiple of 8).
        attention_type (`str`, defaults to ``"regular"``): or ``"nabla"`` (NABLA sparse attention, P 0.5 and an STA
            window of the query's own block, so that it masks at toy size; the 10 s checkpoints': P 0.9, 11 × 3 × 3).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the weights.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import Kandinsky5Transformer3DModel

    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim}; the tiny transformer splits it over three RoPE axes: a multiple of 8.")
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    sparse = {}
    if attention_type == "nabla":
        # the released P 0.9 and STA window 11 × 3 × 3 would keep every block of a toy grid: a narrower one masks
        sparse = dict(attention_P=0.5, attention_wT=1, attention_wH=1, attention_wW=1, attention_add_sta=True)
        sparse.update(attention_method="topcdf")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Kandinsky5Transformer3DModel(
            in_visual_dim=_LATENT_CHANNELS,
            in_text_dim=TEXT_DIM,
            in_text_dim2=CLIP_DIM,
            time_dim=16,
            out_visual_dim=_LATENT_CHANNELS,
            patch_size=(1, 2, 2),
            model_dim=num_heads * head_dim,
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=num_layers,
            axes_dims=axes,
            visual_cond=True,
            attention_type=attention_type,
            **sparse,
        )
        for name, module in model.named_modules():
            if name.endswith("modulation"):
                torch.nn.init.normal_(module.out_layer.weight, std=0.2)
                torch.nn.init.normal_(module.out_layer.bias, std=0.2)
    model = cast(model, dtype)
    for name, module in model.named_modules():  # as from_pretrained keeps them: the timestep's path in float32
        if name.split(".")[-1] in model._keep_in_fp32_modules:
            module.float()
    return model


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    attention_type: str = "regular",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``Kandinsky5T2VPipeline`` or ``Kandinsky5I2VPipeline`` with real components at toy size (no
    download): a Qwen2.5-VL and a CLIP text model on the tiny word-level tokenizer, HunyuanVideo's VAE at its real
    compression (×8 spatial, ×4 temporal).

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9`` 3 latent
    frames (height and width in multiples of 16; image-to-video needs 5 latent frames or more, ``num_frames=17``: it
    renormalises the first 4 by the next ones). A prompt is read by the tiny tokenizer in the pipeline's own
    template, cropped before the prompt (``pipe.prompt_template_encode_start_idx``).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"``.
        num_layers, num_heads, head_dim (`int`): transformer size.
        attention_type (`str`, defaults to ``"regular"``): the transformer's attention (``"nabla"``: sparse).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    import diffusers

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny Kandinsky 5 pipelines are text-to-video and image-to-video.")
    tokenizer, tokenizer_2 = _tiny_qwen_tokenizer(), tiny_tokenizer()
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
        text_encoder, text_encoder_2 = tiny_qwen_vl(tokenizer), tiny_clip_text(tokenizer_2, CLIP_DIM)
    transformer = tiny_transformer(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        attention_type=attention_type,
        dtype=dtype,
        seed=seed,
    )
    cls = diffusers.Kandinsky5I2VPipeline if task == "image-to-video" else diffusers.Kandinsky5T2VPipeline
    pipe = cls(
        transformer=transformer,
        vae=cast(vae, dtype),
        text_encoder=cast(text_encoder, dtype),
        tokenizer=tokenizer,
        text_encoder_2=cast(text_encoder_2, dtype),
        tokenizer_2=tokenizer_2,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    # an instance attribute, not config: the template's tokens before the prompt, as the tiny tokenizer makes them
    pipe.prompt_template_encode_start_idx = _prompt_crop(tokenizer, pipe.prompt_template)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of :data:`TINY_TEXT_LEN` random Qwen text embeddings and a random CLIP
    embedding (the negative's as many tokens: the cross-attention's text is as long in both of a step's calls), 9
    frames of 32×48 (3×2×3 patches); image-to-video: a random 32×48 image and 17 frames (5×2×3 patches: the
    pipeline renormalises the first 4 latent frames by the ones after them).

    Args:
        pipe: a tiny pipeline (:func:`tiny_pipeline`).
        task (`str`): ``"text-to-video"`` or ``"image-to-video"``.
        generator (`torch.Generator`): draws the embeddings and the image.
        guided (`bool`): classifier-free guidance (``guidance_scale`` 5.0: two transformer calls per step).
    """
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    T = TINY_TEXT_LEN
    lengths = torch.tensor([0, T], dtype=torch.int32, device=device)

    def text():
        return (
            torch.randn(1, T, TEXT_DIM, generator=generator).to(device, dtype),
            torch.randn(1, CLIP_DIM, generator=generator).to(device, dtype),
        )

    emb, pooled = text()
    call = dict(prompt_embeds_qwen=emb, prompt_embeds_clip=pooled, prompt_cu_seqlens=lengths)
    negative, negative_pooled = text()
    call.update(negative_prompt_embeds_qwen=negative, negative_prompt_embeds_clip=negative_pooled)
    call.update(negative_prompt_cu_seqlens=lengths, guidance_scale=5.0 if guided else 1.0)
    call.update(num_frames=9, height=32, width=48)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call.update(image=PIL.Image.fromarray(pixels), num_frames=17)
    return call
