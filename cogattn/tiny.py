"""Tiny random CogVideoX and Wan pipelines and transformers: the embedded defaults, built from configs, no download.

The shapes are small enough for a CPU test in seconds but keep what matters for attention maps: a
joint text + video sequence, several latent frames, odd and non-square patch grids, rotary or sincos
positions, temporal patches (CogVideoX 1.5), fused QKV, and the image-to-video pipeline.

```python
pipe = tiny_pipeline()                                # text-to-video, CogVideoX 1.0 layout
video = pipe(prompt="a red fox", num_frames=9, num_inference_steps=2).frames
wan = tiny_wan_pipeline()                             # Wan 2.1 text-to-video; experts=2: Wan 2.2 A14B
video = wan(prompt="a red fox", num_frames=9, height=32, width=48, num_inference_steps=2).frames
```
"""

from __future__ import annotations

import torch

__all__ = [
    "TINY_TEXT_LEN",
    "tiny_transformer",
    "tiny_vae",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_pipeline",
    "tiny_wan_transformer",
    "tiny_wan_pipeline",
]

TINY_TEXT_LEN = 8  # text tokens (max_sequence_length); pass it to the pipeline call
_TEXT_DIM = 16
_LATENT_CHANNELS = 4
_VOCAB = (
    "a an the of and in on with at to is are red green blue white black small big tiny fox cat dog bird "
    "fish horse car boat tree river sky sea forest city street night day sun snow rain running flying "
    "swimming walking jumping sitting under over slowly quickly camera pan zoom video"
).split()


def tiny_transformer(
    version: str = "1.0",
    *,
    rotary: bool = True,
    image_to_video: bool = False,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``CogVideoXTransformer3DModel``.

    Args:
        version (`str`, defaults to ``"1.0"``): ``"1.0"`` (no temporal patches) or ``"1.5"`` (``patch_size_t=2``,
            rotary positions, and an ``ofs`` embedding for image-to-video).
        rotary (`bool`, defaults to `True`): rotary positions; `False` gives CogVideoX-2b-style sincos
            (version 1.0 only).
        image_to_video (`bool`, defaults to `False`): twice the input channels (noise + image latents).
        num_layers, num_heads, head_dim (`int`): size of the attention.
        dtype (`torch.dtype`, defaults to `torch.float32`): parameter dtype.
        seed (`int`, defaults to 0): weights are a function of the seed.
    """
    from diffusers import CogVideoXTransformer3DModel

    if version not in ("1.0", "1.5"):
        raise ValueError(f"version={version!r}; choose '1.0' or '1.5'.")
    if version == "1.5" and not rotary:
        raise ValueError("CogVideoX 1.5 uses rotary positions; rotary=False exists only for version '1.0'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CogVideoXTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=_LATENT_CHANNELS * (2 if image_to_video else 1),
            out_channels=_LATENT_CHANNELS,
            time_embed_dim=8,
            ofs_embed_dim=8 if (version == "1.5" and image_to_video) else None,
            text_embed_dim=_TEXT_DIM,
            num_layers=num_layers,
            sample_width=10,  # latent pixels: 80 px wide by default, 5 patch columns
            sample_height=6,  # 48 px high, 3 patch rows
            sample_frames=9,
            patch_size=2,
            patch_size_t=2 if version == "1.5" else None,
            temporal_compression_ratio=4,
            max_text_seq_length=TINY_TEXT_LEN,
            use_rotary_positional_embeddings=rotary,
        )
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``AutoencoderKLCogVideoX``: 8× spatial and 4× temporal compression, 4 latent channels."""
    from diffusers import AutoencoderKLCogVideoX

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLCogVideoX(
            in_channels=3,
            out_channels=3,
            down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=_LATENT_CHANNELS,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        )
    return (vae if dtype == torch.float32 else vae.to(dtype)).eval()


def tiny_tokenizer():
    """A word-level tokenizer built in code (no vocabulary download); unknown words map to ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *_VOCAB])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def tiny_text_encoder(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random 1-layer ``T5EncoderModel`` whose embeddings have the tiny transformer's text width."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=3 + len(_VOCAB),
        d_model=_TEXT_DIM,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(config)
    return model.to(dtype).eval()


def tiny_pipeline(
    task: str = "text-to-video",
    version: str = "1.0",
    *,
    rotary: bool = True,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random CogVideoX pipeline with real components at toy size.

    Call it as a real one, with ``max_sequence_length=TINY_TEXT_LEN`` (the tiny text length), either with
    a prompt (tokenised by :func:`tiny_tokenizer`) or with ``prompt_embeds`` of shape ``(B, 8, 16)``.
    Default video: 48×80 pixels → 3×5 patches per latent frame; ``num_frames=9`` gives 3 latent frames
    (version 1.0) or 2 temporal patches (version 1.5).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (pass ``image=`` a PIL
            image or a ``(3, H, W)`` tensor in [0, 1]).
        version (`str`, defaults to ``"1.0"``): ``"1.0"`` or ``"1.5"`` (``patch_size_t=2``).
        rotary (`bool`, defaults to `True`): rotary (5b-style) or sincos (2b-style, version 1.0) positions.
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline, CogVideoXPipeline

    tasks = {"text-to-video": CogVideoXPipeline, "image-to-video": CogVideoXImageToVideoPipeline}
    if task not in tasks:
        raise ValueError(f"task={task!r}; choose one of {list(tasks)}.")
    scheduler = CogVideoXDDIMScheduler(  # CogVideoX-2b's scheduler config
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=3.0,
        timestep_spacing="trailing",
    )
    transformer = tiny_transformer(
        version,
        rotary=rotary,
        image_to_video=task == "image-to-video",
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    pipe = tasks[task](
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=tiny_vae(seed, dtype),
        transformer=transformer,
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- Wan -------------------------------------------------------------------------------------------
_WAN_IMAGE_DIM = 4  # CLIP width of the tiny image encoder


def tiny_wan_transformer(
    image_to_video: bool = False,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``WanTransformer3DModel`` (diffusers' own test config); with ``image_to_video`` the Wan 2.1
    image-to-video one (36 input channels, an image cross-attention)."""
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=36 if image_to_video else 16,
            out_channels=16,
            text_dim=_TEXT_DIM,
            freq_dim=256,
            ffn_dim=32,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
            image_dim=_WAN_IMAGE_DIM if image_to_video else None,
            added_kv_proj_dim=num_heads * head_dim if image_to_video else None,
        )
    return _cast(model, dtype)


def _cast(model, dtype: torch.dtype):
    """``model`` in ``dtype``, in eval mode (a float32 model is left as built: no cast, no cast warning)."""
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_wan_pipeline(
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
        vae=_cast(vae, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=tiny_wan_transformer(i2v, seed=seed, **size),
    )
    if experts == 2:
        parts.update(transformer_2=tiny_wan_transformer(i2v, seed=seed + 1, **size), boundary_ratio=0.875)
    if i2v:
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        try:  # transformers 5 names the processor that needs no torchvision so
            from transformers import CLIPImageProcessorPil as CLIPImageProcessor
        except ImportError:
            from transformers import CLIPImageProcessor

        config = CLIPVisionConfig(
            hidden_size=_WAN_IMAGE_DIM,
            projection_dim=_WAN_IMAGE_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            intermediate_size=16,
            patch_size=2,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            encoder = CLIPVisionModelWithProjection(config)
        parts.update(image_encoder=_cast(encoder, dtype), image_processor=CLIPImageProcessor(crop_size=8, size=8))
    if i2v:
        from diffusers import WanImageToVideoPipeline as cls
    else:
        from diffusers import WanPipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe
