"""Kandinsky 6's tiny random pipeline (tests, the self-test, the batch tool): ``Kandinsky6TI2VAPipeline`` with every
component at toy size, built from configs in code (no download), for text-to-video and image-to-video with sound,
and the self-test's call of it. :mod:`cogattn.models.kandinsky6` exports them.

The parts are the released ones' kinds: a ``Kandinsky6Transformer3DModel`` with the released flags (text padding,
RoPE in the cross-modal attentions, cross gates, fixed modulation, two visual token types), HunyuanVideo's VAE at its
real compression (8 pixels, 4 frames), MMAudio's VAE and vocoder, a Qwen2.5-VL text model and a CLIP text model on the
tiny word-level tokenizer. The pipeline crops the first 129 tokens of its chat template (Qwen's count before the
prompt): the tiny tokenizer makes 122 of the template and leads every text with 7 ``<|lead|>`` tokens, so the text the
transformer reads is the prompt's words, ``<|im_end|>``, ``</s>``, then padding, as the released one's.
"""

from __future__ import annotations

import torch
from tokenizers import processors

from ..tiny_text import TEXT_DIM, cast, tiny_clip_text, tiny_qwen_vl, tiny_tokenizer

__all__ = ["CLIP_DIM", "NEGATIVE_PROMPTS", "PROMPTS", "TINY_TEXT_LEN", "tiny_call", "tiny_pipeline", "tiny_transformer"]

_LATENT = 4  # latent channels of the tiny video VAE
_AUDIO_LATENT = 4  # latent channels of the tiny audio VAE (the transformer's in_audio_dim; released 40)
_MEL_BINS = 8
CLIP_DIM = 8  # width of the tiny CLIP's pooled output (in_text_dim2; released 768)
TINY_TEXT_LEN = 8  # Qwen tokens a prompt keeps after the template's crop (max_sequence_length; released 1024)
_LEAD = 7  # tokens the tiny tokenizer puts first: with the template's 122, the pipeline's crop of 129
PROMPTS = ("red fox running in the snow", "a small cat")  # the tiny calls' prompts: 8 and 5 of 8 tokens kept
NEGATIVE_PROMPTS = ("blue sky", "a big dog jumping over the river")  # 4 and 8 of 8


def _tiny_qwen_tokenizer():
    """The tiny word-level tokenizer with Qwen's chat tokens and role words, every text led by :data:`_LEAD` tokens."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "<|lead|>"], special_tokens=True)
    tokenizer.add_tokens(["system", "user", "assistant"])
    lead = tokenizer.convert_tokens_to_ids("<|lead|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(["<|lead|>"] * _LEAD + ["$A", "</s>"]), special_tokens=[("<|lead|>", lead), ("</s>", 1)]
    )
    return tokenizer


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    audio_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``Kandinsky6Transformer3DModel``: one text block per branch, ``num_layers`` fused blocks, patches
    (1, 2, 2), ``num_heads`` video heads and ``audio_heads`` audio heads of ``head_dim`` channels (both streams share
    it, as released: RoPE in the cross-modal attentions applies each stream's to the other's), the released flags. The
    modulations are drawn at random (wide gates, so that every attention reaches the output); in another ``dtype``
    the timestep's embedding and the modulations stay float32, as ``from_pretrained`` keeps them.

    Args:
        num_layers, num_heads, audio_heads, head_dim (`int`): transformer size (``head_dim`` a multiple of 8).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the weights.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import Kandinsky6Transformer3DModel

    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim}; the tiny transformer splits it over three RoPE axes: a multiple of 8.")
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Kandinsky6Transformer3DModel(
            in_visual_dim=_LATENT,
            out_visual_dim=_LATENT,
            in_text_dim=TEXT_DIM,
            in_text_dim2=CLIP_DIM,
            time_dim=16,
            patch_size=(1, 2, 2),
            model_dim=num_heads * head_dim,
            ff_dim=32,
            num_text_blocks=1,
            num_visual_blocks=num_layers,
            axes_dims=axes,
            visual_cond=True,
            in_audio_dim=_AUDIO_LATENT,
            out_audio_dim=_AUDIO_LATENT,
            model_dim_a=audio_heads * head_dim,
            time_dim_a=16,
            ff_dim_a=32,
            axes_dims_a=axes,
            text_token_padding=True,
            ca_rope=True,
            cross_gates=True,
            fix_modulation=True,
            visual_token_type_num_embeddings=2,
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


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``Kandinsky6TI2VAPipeline`` with real components at toy size (no download): ``num_frames=9, height=32,
    width=48`` gives 3 latent frames of 2×3 patches and 17 audio bins at 24 frames a second (the released 44.1 kHz and
    hop 2 × 512: 43.07 bins a second); image-to-video (the same pipeline, given ``image=``) appends the image's
    latent frame after them.

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (the same pipeline class).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: keywords of :func:`tiny_transformer`.
    """
    import diffusers

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; the tiny Kandinsky 6 pipeline makes text-to-video and image-to-video.")
    tokenizer, tokenizer_2 = _tiny_qwen_tokenizer(), tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=_LATENT,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        )
        audio_vae = diffusers.MMAudioVAE(
            mel_bins=_MEL_BINS,
            latent_channels=_AUDIO_LATENT,
            hidden_channels=8,
            channel_multipliers=(1, 2),
            layers_per_block=1,
            sample_rate=44100,
            n_fft=1024,
            hop_length=512,
        )
        vocoder = diffusers.MMAudioVocoder(
            num_mels=_MEL_BINS,
            upsample_initial_channel=8,
            upsample_rates=(2, 2),
            upsample_kernel_sizes=(4, 4),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1, 3, 5),),
        )
        text_encoder, text_encoder_2 = tiny_qwen_vl(tokenizer), tiny_clip_text(tokenizer_2, CLIP_DIM)
    pipe = diffusers.Kandinsky6TI2VAPipeline(
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
        vae=cast(vae, dtype),
        text_encoder=cast(text_encoder, dtype),
        tokenizer=tokenizer,
        text_encoder_2=cast(text_encoder_2, dtype),
        tokenizer_2=tokenizer_2,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        audio_vae=cast(audio_vae, dtype),
        vocoder=cast(vocoder, dtype),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of a prompt that keeps 5 of its :data:`TINY_TEXT_LEN` text tokens and a
    negative that keeps 4 (a padding mask in both calls of a step), 9 frames of 32×48 (3×2×3 patches) and 17 audio bins;
    image-to-video: a random 32×48 image too, whose latent frame follows the video's.

    Args:
        pipe: a tiny pipeline (:func:`tiny_pipeline`).
        task (`str`): ``"text-to-video"`` or ``"image-to-video"``.
        generator (`torch.Generator`): draws the image.
        guided (`bool`): classifier-free guidance (``guidance_scale`` 5.0: two transformer calls per step).
    """
    call = dict(prompt=PROMPTS[1], negative_prompt=NEGATIVE_PROMPTS[0], max_sequence_length=TINY_TEXT_LEN)
    call.update(guidance_scale=5.0 if guided else 1.0, num_frames=9, height=32, width=48, frame_rate=24.0)
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 48, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call
