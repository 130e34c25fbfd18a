"""MiniMax-H3's tiny pipeline (tests, the notebook, the self-test, the batch tool's ``tiny-minimax-h3``): the modular
pipeline's own blocks and components at toy size, built in code (no download).

Called with ``prompt_embeds`` (the self-test's and the tests' calls) it runs the denoiser alone and returns the
latents; called with a prompt, as the modular pipeline is (``output=``), every block runs: the tiny Qwen3-VL text
encoder, the denoiser, and the tiny video and audio VAEs.
"""

from __future__ import annotations

import torch

from ..tiny_text import TEXT_DIM, cast, tiny_tokenizer

__all__ = ["TINY_TEXT", "TinyOutput", "tiny_call", "tiny_pipeline", "tiny_transformer"]

TINY_TEXT = 5  # text tokens of the tiny call
_VISION = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")  # Qwen3-VL's vision tokens
_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def tiny_transformer(
    *, num_layers: int = 2, num_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0
):
    """A random ``MiniMaxH3Transformer3DModel``: ``num_layers`` blocks (one refiner block), text width 16, the
    pipeline's latent channels (24 video, 32 audio), patch (1, 2, 2), RoPE on ``6 · head_dim // 8`` of each head's
    channels."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            hidden_size=24,
            num_layers=num_layers,
            num_refiner_layers=1,
            ffn_dim=32,
            in_channels=24,
            audio_in_channels=32,
            patch_size=(1, 2, 2),
            text_dim=TEXT_DIM,
            freq_dim=16,
            time_embed_hidden_dim=16,
            time_embed_dim=16,
            rope_freq_dim=max(1, head_dim // 8),
        )
    return cast(model, dtype)


class TinyOutput:
    """The tiny pipeline's output for a call with prompt embeddings: ``frames`` the denoised video latents
    ``(1, 24, F, H, W)``, ``audio`` the audio latents ``(2, 32, A)``."""

    def __init__(self, frames: torch.Tensor, audio: torch.Tensor):
        self.frames, self.audio = frames, audio


def _tiny_class():
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline

    class TinyMiniMaxH3Pipeline(MiniMaxH3ModularPipeline):
        """The modular pipeline at toy size: any duration (its 5 s floor lifted), its text from the tiny Qwen3-VL's
        first layer. Called with ``prompt_embeds``, as the other tiny pipelines are: the denoiser alone,
        ``num_inference_steps`` model evaluations (the modular pipeline's count is its sigma grid's points, one
        more), ``output_type`` taken and left unused; returns a `TinyOutput`."""

        @property
        def min_duration(self):
            return 0.0

        @property
        def text_encoder_layer(self):
            return 1

        def __call__(self, state=None, output=None, **kwargs):
            if state is not None or output is not None or "prompt_embeds" not in kwargs:
                return super().__call__(state, output, **kwargs)
            kwargs.pop("output_type", None)
            kwargs["num_inference_steps"] = kwargs.get("num_inference_steps", 2) + 1
            blocks, self._blocks = self._blocks, self._denoiser  # the text encoder and the decoders left out
            try:
                out = super().__call__(output=["latents", "audio_latents"], **kwargs)
            finally:
                self._blocks = blocks
            return TinyOutput(out["latents"], out["audio_latents"])

    return TinyMiniMaxH3Pipeline


def _tiny_text(seed: int, dtype: torch.dtype):
    """The tiny tokenizer with Qwen3-VL's vision tokens, a random 2-layer ``Qwen3VLForConditionalGeneration`` of the
    tiny text width over it, and a ``Qwen3VLProcessor`` over the tokenizer alone (its token types: the pipeline's
    one use of it; its image and video processors need torchvision, and a t2va call reads no image)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(list(_VISION), special_tokens=True)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(_VISION_IDS, _VISION)}
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    text = dict(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=2)
    text.update(num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    text.update(pad_token_id=tokenizer.pad_token_id, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    vision.update(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision, **ids))
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # built without its torchvision processors
    processor.tokenizer, processor.image_processor, processor.video_processor = tokenizer, None, None
    processor.image_token, processor.video_token = _VISION[:2]
    for name, value in ids.items():
        setattr(processor, name, value)
    return tokenizer, cast(encoder, dtype), processor


def _tiny_vaes(seed: int, dtype: torch.dtype):
    """Random video and audio VAEs of the pipeline's geometry at toy width: 16 × 16 pixels and clips of 17 frames in
    24 latent channels (5 latent frames a clip), 800 audio samples in 32 latent channels, decoders of one layer."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        video = AutoencoderKLMiniMaxH3(
            latent_channels=24,
            block_out_channels=(4, 4, 4, 4),
            layers_per_block=1,
            spatial_downsample_factors=(2, 2, 2, 2),
            temporal_downsample_factors=(1, 2, 2, 1),
            norm_num_groups=1,
            decoder_num_layers=1,
            decoder_num_attention_heads=1,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=1,
            decoder_ffn_mult=1,
            latents_mean=(0.0,) * 24,
            latents_std=(1.0,) * 24,
        )
        audio = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=1,
            encoder_rates=(20, 40),
            latent_dim=32,
            latent_channels=32,
            num_attention_heads=2,
            decoder_dim=4,
            decoder_rates=(40, 20),
            decoder_kernel_sizes=(80, 40),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1,),),
            latents_mean=[0.0] * 32,
            latents_std=[1.0] * 32,
        )
    return cast(video, dtype), cast(audio, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``MiniMaxH3ModularPipeline`` (no download): ``MiniMaxH3Blocks`` with a tiny Qwen3-VL text encoder,
    its two ``MiniMaxH3Scheduler`` (shift 12 video, 3 audio), a tiny transformer and tiny video and audio VAEs.

    Call it with ``prompt_embeds`` ``(1, T, 16)`` and ``text_token_tags`` ``(T,)`` (1: text), ``num_frames=5,
    height=96, width=128`` (:func:`tiny_call`: 2 latent frames of 3×4 patches, 24 tokens, after T text and 16 audio
    tokens) for the latents; or with a prompt and ``output=["videos", "audio"]`` as the modular pipeline is (its VAE
    decodes ``17 n + 5`` frames for n ≥ 1).

    Args:
        task (`str`, defaults to ``"text-to-video"``): the only tiny task (t2va).
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): the transformer's dtype.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; the tiny MiniMax-H3 pipeline is 'text-to-video' (t2va).")
    pipe = _tiny_class()(blocks=MiniMaxH3Blocks())
    pipe._denoiser = MiniMaxH3Blocks()
    for name in ("text_encoder", "decode"):  # what a call with prompt embeddings leaves out
        pipe._denoiser.sub_blocks.pop(name)
    tokenizer, text_encoder, processor = _tiny_text(seed, dtype)
    vae, audio_vae = _tiny_vaes(seed, dtype)
    pipe.update_components(
        transformer=tiny_transformer(
            num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, dtype=dtype, seed=seed
        ),
        scheduler=MiniMaxH3Scheduler(12.0),
        audio_scheduler=MiniMaxH3Scheduler(3.0),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        vae=vae,
        audio_vae=audio_vae,
    )
    blocks = [pipe._blocks, pipe._denoiser]
    while blocks:  # the denoising loop's progress bar is a nested block's
        block = blocks.pop()
        blocks += list(getattr(block, "sub_blocks", {}).values())
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: random embeddings of 5 text tokens, 5 frames of 96×128 (17n + 5 and 4k + 1: 2
    latent frames of 3×4 patches, 8 audio latents a channel); guidance-distilled, ``guided`` changes nothing."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, TINY_TEXT, TEXT_DIM, generator=generator).to(device, dtype)
    tags = torch.ones(TINY_TEXT, dtype=torch.long)
    return dict(prompt_embeds=emb, text_token_tags=tags, num_frames=5, height=96, width=128)
