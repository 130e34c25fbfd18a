"""EasyAnimate V5.1 (text-to-video; its inpaint and control pipelines run the same transformer): the map
processor, the family's facts and its tiny pipeline (docs/design.md, "The model seam").

EasyAnimate's blocks run one joint self-attention over ``[text, video]``, text first as in CogVideoX
(``attn1``, 3D RoPE on the video tokens, QK LayerNorm). Its first ``mmdit_layers`` blocks project the text
apart (``add_q_proj``, ...; the 12B's 48 blocks all do), the others project ``[text, video]`` together
(the 7B's blocks 18–35). The text is the second-to-last hidden states of Qwen2-VL over the prompt in its
chat template, padded at the end to 256 tokens (``encode_prompt``'s ``max_sequence_length``; the pipeline
call takes none). The transformer gets no mask: the pipeline's ``prompt_attention_mask`` reaches the text
encoder only, so the padded text tokens are keys and queries of every block as the others are, and the
maps hold the attention they really get. The inpaint (33 input channels) and control (48) checkpoints add
their conditions as latent channels, not tokens: their layout is the text-to-video one.

Guidance is CogVideoX's: one call per step with the batch ``[uncond..., cond...]`` when ``guidance_scale > 1``.

The processor is diffusers' ``EasyAnimateAttnProcessor2_0`` (the same code in 0.33 – 0.42) line for line,
plus the lines that hand q and k to the recording (and, with the opt-in ``layer_output="lse"`` or
``"joint"``, let the recording make the output call itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from ..recorder.processor import MapSink
from .prompt_text import in_template, kept, tokenize
from .spec import ModelSpec, Site, Unavailable, call_argument
from .tiny_text import TEXT_DIM, cast, tiny_tokenizer

# Attention shapes of the released V5.1 checkpoints (their transformer/config.json), for plans made offline:
# 48 heads of 64, patch size 2 (no temporal patches), Qwen2-VL's 3584-wide text.
_V51 = {
    "_class_name": "EasyAnimateTransformer3DModel",
    "attention_head_dim": 64,
    "num_attention_heads": 48,
    "patch_size": 2,
    "out_channels": 16,
    "text_embed_dim": 3584,
    "text_embed_dim_t5": None,
    "add_norm_text_encoder": True,
    "enable_text_attention_mask": True,
    "time_embed_dim": 512,
}
_12B = {**_V51, "num_layers": 48, "mmdit_layers": 48}
_7B = {**_V51, "num_layers": 36, "mmdit_layers": 18}
KNOWN: dict[str, dict] = {
    "alibaba-pai/EasyAnimateV5.1-12b-zh": {**_12B, "in_channels": 16},
    "alibaba-pai/EasyAnimateV5.1-12b-zh-diffusers": {**_12B, "in_channels": 16},
    "alibaba-pai/EasyAnimateV5.1-7b-zh-diffusers": {**_7B, "in_channels": 16},
    # image-to-video / inpainting: the video's 16 latent channels, a mask's 1, the masked video's 16
    "alibaba-pai/EasyAnimateV5.1-12b-zh-InP-diffusers": {**_12B, "in_channels": 33},
    # control: the video's 16, the control video's 16, a reference image's 16
    "alibaba-pai/EasyAnimateV5.1-12b-zh-Control-diffusers": {**_12B, "in_channels": 48},
}

try:
    from diffusers import EasyAnimateTransformer3DModel
    from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0
except ImportError as missing:
    needs = "EasyAnimate needs diffusers >= 0.33 (EasyAnimateTransformer3DModel)"
    raise Unavailable("easyanimate", needs, KNOWN) from missing

__all__ = [
    "SPEC",
    "EasyAnimateAttnMapProcessor",
    "KNOWN",
    "TEXT_LEN",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 256  # Qwen2-VL tokens of every prompt, padding included (encode_prompt's max_sequence_length)


class EasyAnimateAttnMapProcessor:
    """Drop-in for ``EasyAnimateAttnProcessor2_0`` (MMDiT blocks and joint-projection blocks) that also feeds
    selected layers' q and k ``(B, H, S, D)``, the text first, to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``. One instance serves every layer.
    """

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # 3. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states)
            encoder_key = attn.add_k_proj(encoder_hidden_states)
            encoder_value = attn.add_v_proj(encoder_hidden_states)

            encoder_query = encoder_query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_key = encoder_key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_value = encoder_value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([encoder_query, query], dim=2)
            key = torch.cat([encoder_key, key], dim=2)
            value = torch.cat([encoder_value, value], dim=2)

        if image_rotary_emb is not None:
            from diffusers.models.embeddings import apply_rotary_emb

            query[:, :, encoder_hidden_states.shape[1] :] = apply_rotary_emb(
                query[:, :, encoder_hidden_states.shape[1] :], image_rotary_emb
            )
            if not attn.is_cross_attention:
                key[:, :, encoder_hidden_states.shape[1] :] = apply_rotary_emb(
                    key[:, :, encoder_hidden_states.shape[1] :], image_rotary_emb
                )

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and attention_mask is not None:  # its blocks pass none: a caller's own mask
            raise ValueError(
                "cogattn captures EasyAnimate's attention as its blocks call it, without a mask; this call "
                "passes an attention mask."
            )
        fused = None if layer is None else self.sink.attention(layer, query, key, value)

        # 5. Attention
        if fused is None:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
        if layer is not None:
            self.sink.capture(layer, query, key, lse, sums, value=value if self.sink.wants_value else None)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # 6. Output projection
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = (
                hidden_states[:, : encoder_hidden_states.shape[1]],
                hidden_states[:, encoder_hidden_states.shape[1] :],
            )

            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        else:
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

        return hidden_states, encoder_hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``EasyAnimateTransformer3DModel`` call: latents
    ``(B, C, F, H, W)`` (inpaint and control latents are more channels of them), the text first (Qwen2-VL's
    tokens, then T5's where a model takes both)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 3, "encoder_hidden_states")
    t5 = call_argument(args, kwargs, 4, "encoder_hidden_states_t5")
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p = int(config["patch_size"])
    _, _, frames, height, width = hidden.shape
    text_len = int(text.shape[1]) + (0 if t5 is None else int(t5.shape[1]))
    layout = TokenLayout(text_len=text_len, frames=frames, height=height // p, width=width // p, patch_size=p)
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of an EasyAnimate pipeline call: ``(num_frames − 1) // 4 + 1`` latent frames and 8× spatial
    (its Magvit VAE), patches of 2 × 2 latent pixels, 256 text tokens first."""
    return TokenLayout.for_video(num_frames, height, width, text_len or TEXT_LEN, int(config["patch_size"]))


def call_rules(cfg, config: dict) -> None:
    """The batch tool's EasyAnimate rules (``ModelSpec.call_rules``): text-to-video checkpoints, 256 text tokens."""
    ins, outs = int(config.get("in_channels", 16)), int(config.get("out_channels", 16))
    if ins != outs:
        which = "an inpaint (image-to-video)" if ins == 2 * outs + 1 else "a control"
        raise ValueError(
            f"model: {cfg.model} is {which} checkpoint ({ins} input channels); the batch tool runs EasyAnimate's "
            "text-to-video pipeline only: record its inpaint or control pipeline from Python with cogattn.record."
        )
    if (n := cfg.max_sequence_length) not in (None, TEXT_LEN):
        raise ValueError(
            f"max_sequence_length: {n}; EasyAnimate's pipeline pads every prompt to {TEXT_LEN} tokens (its call "
            "takes no max_sequence_length): leave it out."
        )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The ``length`` text tokens the transformer reads for ``prompt``, as ``EasyAnimatePipeline.encode_prompt``
    makes them (``ModelSpec.prompt_text``): the prompt as the user's message in the tokenizer's chat
    template with the generation prompt (Qwen2-VL's system and role tokens before it), padded on the right;
    nothing is cropped. ``template`` is unused (the call takes none)."""
    tokenizer = pipeline.tokenizer

    def chat(text: str) -> str:
        message = {"role": "user", "content": [{"type": "text", "text": text}]}
        return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)

    text = in_template(prompt, chat)
    return kept(tokenize(tokenizer, text.text, length, offsets, padding_side="right"), text)


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_LATENT_CHANNELS = 4
# The pipeline puts each prompt in the tokenizer's chat template: the tiny word-level tokenizer's keeps the
# words alone (Qwen2-VL's adds its role tokens).
_CHAT_TEMPLATE = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"


def tiny_transformer(
    *,
    num_layers: int = 2,
    mmdit_layers: int = 1,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``EasyAnimateTransformer3DModel``: ``mmdit_layers`` blocks projecting the text apart, then
    blocks projecting ``[text, video]`` together (as the 7B's), patch size 2, text width 16 (``head_dim`` is
    split over the 3D RoPE axes: a multiple of 8)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = EasyAnimateTransformer3DModel(
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            patch_size=2,
            sample_width=6,  # latent pixels: 48 px wide by default, 3 patch columns
            sample_height=4,  # 32 px high, 2 patch rows
            num_layers=num_layers,
            mmdit_layers=mmdit_layers,
            time_embed_dim=8,
            add_norm_text_encoder=True,  # the released checkpoints' RMSNorm before the text projection
            text_embed_dim=TEXT_DIM,
        )
    return cast(model, dtype)


def tiny_text_encoder(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random 2-layer ``Qwen2VLForConditionalGeneration`` (the pipeline takes its second-to-last hidden
    states) whose text embeddings have the tiny transformer's width."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # halves of the head's 8 channels
        **ids,
    )
    vision = dict(depth=1, embed_dim=8, hidden_size=TEXT_DIM, num_heads=2, patch_size=2, spatial_merge_size=1)
    config = Qwen2VLConfig(text_config=text, vision_config={**vision, "temporal_patch_size": 1}, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    return cast(model, dtype)


def tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``AutoencoderKLMagvit``: 8× spatial and 4× temporal compression, 4 latent channels."""
    from diffusers import AutoencoderKLMagvit

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLMagvit(
            in_channels=3,
            out_channels=3,
            down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
            up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=_LATENT_CHANNELS,
            layers_per_block=1,
            norm_num_groups=2,
            spatial_group_norm=False,
        )
    return cast(vae, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    mmdit_layers: int = 1,
    num_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``EasyAnimatePipeline`` with real components at toy size (no download).

    Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and ``num_frames=9``
    3 latent frames. A prompt is tokenized by the tiny word-level tokenizer and padded to 256 tokens, as
    the pipeline pads every prompt; ``prompt_embeds`` of shape ``(B, T, 16)`` need a
    ``prompt_attention_mask`` ``(B, T)``, which only the text encoder reads.

    Args:
        task (`str`, defaults to ``"text-to-video"``): the only task of the tiny pipeline.
        num_layers, mmdit_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import EasyAnimatePipeline, FlowMatchEulerDiscreteScheduler

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; the tiny EasyAnimate pipeline is text-to-video.")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    pipe = EasyAnimatePipeline(
        vae=tiny_vae(seed, dtype),
        text_encoder=tiny_text_encoder(len(tokenizer), seed, dtype),
        tokenizer=tokenizer,
        transformer=tiny_transformer(
            num_layers=num_layers,
            mmdit_layers=mmdit_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            dtype=dtype,
            seed=seed,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings of 7 tokens (the mask's last 2 are
    padding, which the transformer attends all the same), 9 frames of 32×48 (3×2×3 patches)."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, 7, TEXT_DIM, generator=generator).to(device, dtype)
    mask = (torch.arange(7) < 5).long()[None].to(device)
    call = dict(prompt_embeds=emb, prompt_attention_mask=mask, guidance_scale=5.0 if guided else 1.0)
    if guided:
        call.update(negative_prompt_embeds=-emb, negative_prompt_attention_mask=mask)
    call.update(num_frames=9, height=32, width=48)
    return call


SPEC = ModelSpec(
    "easyanimate",
    (EasyAnimateTransformer3DModel,),
    (Site("transformer_blocks", "attn1"),),
    {EasyAnimateAttnProcessor2_0: EasyAnimateAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    config_keys=("mmdit_layers",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "video_to_image": "EasyAnimate has no image attention (its inpaint pipeline puts the image in the "
        "latents' channels); its transformer sees text and video tokens."
    },
    frame_counts="1, 5, 9, ..., 49",
    call_rules=call_rules,
    empty_negative=True,  # its encode_prompt iterates over the negative prompt under guidance
    prompt_text=prompt_text,
)
