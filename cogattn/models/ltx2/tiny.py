"""LTX-2's tiny random pipelines (tests, the self-test): text- and image-to-video with sound, every component at toy
size and built from a config in code (no download).

The parts are the released ones' kinds: an ``LTX2VideoTransformer3DModel`` with both streams (gated heads on, so
the per-head output gates are exercised), a video VAE compressing as the released one (32 × 32 pixels, 8 frames
after the first, in latent pixels of ``_LATENT`` channels), the audio VAE (4 mel frames per latent bin, 2 latent
mel bins of 2 channels: 4 audio input channels of the transformer), the vocoder, a 2-layer Gemma 3 text encoder
over the tiny word-level tokenizer and LTX-2's text connectors, with learnable registers as released: the
connectors move each prompt's valid tokens first and fill the rest with registers, so the transformer's text mask
keeps every key (a bias of 0).
"""

from __future__ import annotations

import torch

from ..tiny_text import TEXT_DIM, cast, tiny_tokenizer

__all__ = ["TEXT_LAYERS", "TEXT_LEN", "tiny_call", "tiny_pipeline", "tiny_transformer"]

_LATENT = 4  # latent channels of the tiny video VAE
_AUDIO_LATENT = 2  # latent channels of the tiny audio VAE
_MEL_BINS = 8  # mel bins of the tiny audio VAE (2 latent bins)
TEXT_LAYERS = 2  # Gemma 3 layers: the pipeline stacks their 3 hidden states (embeddings included)
TEXT_LEN = 8  # text tokens of the tiny call (max_sequence_length; released 1024)
_REGISTERS = 4  # learnable registers of the tiny connectors (released 128); TEXT_LEN is a multiple


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 8,
    audio_heads: int = 2,
    audio_head_dim: int | None = None,
    gated: bool = True,
    perturbed: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``LTX2VideoTransformer3DModel``: ``num_layers`` audio-video blocks, patch size 1, video heads
    ``num_heads`` × ``head_dim``, audio heads ``audio_heads`` × ``audio_head_dim`` (the cross-modal attentions'
    too), text width ``TEXT_DIM``, split RoPE, per-head output gates on both streams where ``gated``. The
    cross-modal RoPE splits the audio width by the *video* heads (diffusers' ``cross_attn_rope``), so ``num_heads``
    must divide ``audio_heads · audio_head_dim / 2``: ``audio_head_dim`` left out is the least even width from 4
    that does (4 for 2 video heads, 6 for 3).

    Args:
        num_layers, num_heads, head_dim, audio_heads, audio_head_dim (`int`): transformer size.
        gated (`bool`, defaults to `True`): per-head output gates (``gated_attn``, ``audio_gated_attn``).
        perturbed (`bool`, defaults to `False`): blocks run by ``LTX2PerturbedAttnProcessor`` (``perturbed_attn``:
            spatio-temporal guidance may replace a block's self-attentions by their values).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the weights.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import LTX2VideoTransformer3DModel

    if audio_head_dim is None:
        audio_head_dim = next(d for d in range(4, 4 + 2 * num_heads + 1, 2) if (audio_heads * d // 2) % num_heads == 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LTX2VideoTransformer3DModel(
            in_channels=_LATENT,
            out_channels=_LATENT,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            cross_attention_dim=num_heads * head_dim,
            audio_in_channels=_AUDIO_LATENT * (_MEL_BINS // 4),
            audio_out_channels=_AUDIO_LATENT * (_MEL_BINS // 4),
            audio_num_attention_heads=audio_heads,
            audio_attention_head_dim=audio_head_dim,
            audio_cross_attention_dim=audio_heads * audio_head_dim,
            num_layers=num_layers,
            caption_channels=TEXT_DIM,
            rope_double_precision=False,
            rope_type="split",
            gated_attn=gated,
            audio_gated_attn=gated,
            perturbed_attn=perturbed,
        )
        if gated:  # zero-initialised in diffusers (every gate 1): random, so that a gate left out shows
            for name, param in model.named_parameters():
                if "to_gate_logits" in name:
                    torch.nn.init.normal_(param, std=0.5)
    return cast(model, dtype)


def _tiny_gemma(seed: int, dtype: torch.dtype):
    """A random 2-layer ``Gemma3ForConditionalGeneration`` of the tiny text width over the tiny tokenizer's
    vocabulary (its vision tower is never run: the pipeline passes text alone)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vocab = len(tiny_tokenizer())
    text = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=8,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    vision = SiglipVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config)
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random LTX-2 pipeline at toy size (no download), its video VAE compressing as the released one:
    ``num_frames=17, height=64, width=128`` gives 3 latent frames of 2 × 4 latent pixels (24 video tokens), and 18
    audio bins at 24 frames per second (25 bins per second).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (``LTX2ImageToVideoPipeline``;
            pass ``image=`` a PIL image).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: keywords of :func:`tiny_transformer`.
    """
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; choose 'text-to-video' or 'image-to-video'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLLTX2Video(
            latent_channels=_LATENT,
            block_out_channels=(8, 8, 8),
            down_block_types=("LTX2VideoDownBlock3D",) * 3,
            decoder_block_out_channels=(8, 8, 8),
            layers_per_block=(1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True),
            decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False, False, False, False),
            downsample_type=("spatiotemporal",) * 3,
            upsample_type=("spatiotemporal",) * 3,
            upsample_residual=(False, False, False),
            upsample_factor=(1, 1, 1),
            patch_size=4,  # with three 2 × 2 × 2 downsamplings: 32 pixels, 8 frames, as released
        )
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4,
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            attn_resolutions=None,
            in_channels=2,
            resolution=32,
            latent_channels=_AUDIO_LATENT,
            mel_bins=_MEL_BINS,
        )
        vocoder = LTX2Vocoder(
            in_channels=2 * _MEL_BINS,
            hidden_channels=8,
            out_channels=2,
            upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]],
            output_sampling_rate=16000,
        )
        connectors = LTX2TextConnectors(
            caption_channels=TEXT_DIM,
            text_proj_in_factor=TEXT_LAYERS + 1,
            video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=TEXT_DIM // 2,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=_REGISTERS,
            audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=TEXT_DIM // 2,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=_REGISTERS,
            connector_rope_base_seq_len=32,
            rope_double_precision=False,
            rope_type="split",
        )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    parts = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=cast(vae, dtype),
        audio_vae=cast(audio_vae, dtype),
        text_encoder=_tiny_gemma(seed, dtype),
        tokenizer=tiny_tokenizer(),
        connectors=cast(connectors, dtype),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
        vocoder=cast(vocoder, dtype),
    )
    if task == "image-to-video":
        from diffusers import LTX2ImageToVideoPipeline as cls
    else:
        from diffusers import LTX2Pipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of ``TEXT_LEN`` text tokens left-padded as Gemma's are (the prompt's
    last 5 valid, the negative's last 3), 17 frames of 64 × 128 at 24 frames per second (3 × 2 × 4 latent pixels,
    18 audio bins), classifier-free guidance alone (no spatio-temporal or modality guidance: one transformer call
    per step), and for image-to-video a random image, not re-compressed."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    width = TEXT_DIM * (TEXT_LAYERS + 1)  # the Gemma hidden states the pipeline stacks
    emb = torch.randn(1, TEXT_LEN, width, generator=generator).to(device, dtype)
    position = torch.arange(TEXT_LEN, device=device)[None]
    scale = 3.0 if guided else 1.0
    call = dict(
        prompt_embeds=emb,
        prompt_attention_mask=(position >= TEXT_LEN - 5).long(),
        negative_prompt_embeds=-emb,
        negative_prompt_attention_mask=(position >= TEXT_LEN - 3).long(),
        max_sequence_length=TEXT_LEN,
        num_frames=17,
        height=64,
        width=128,
        frame_rate=24.0,
        guidance_scale=scale,
        audio_guidance_scale=scale,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_rescale=0.0,
        spatio_temporal_guidance_blocks=None,
    )
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (64, 128, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
        call["image_crf"] = 0  # the image's H.264 re-compression needs PyAV; the transformer's inputs do not
    return call
