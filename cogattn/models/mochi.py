"""Mochi 1 (text-to-video): the map processor, the family's facts and its tiny pipeline (docs/design.md,
"The model seam").

Mochi's 48 blocks run one asymmetric joint attention (``attn1``, a ``MochiAttention``: the video and the
text projected apart, with per-head learned RoPE on the video) over the video, then the text. Its
processor drops each item's padded text: item b attends over ``V + T_b`` tokens (its valid text, a prefix
of the 256 padded T5 tokens) and its padded text rows are never formed. cogattn records the layout's
``V + T`` tokens: for item b the keys past ``V + T_b`` get probability 0 and the query rows past it are
never formed (0 in every kind with a query axis, nothing in ``received``, left out of ``frame``'s and
``block``'s means). Mochi's VAE compresses time by 6; its pipelines make one batched call per step,
``[uncond..., cond...]`` under guidance, as CogVideoX.

The processor is diffusers' ``MochiAttnProcessor2_0`` line for line (the same since diffusers 0.32), plus
the lines that hand the recording q and k of the whole sequence and each item's counts.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import MochiAttnProcessor2_0
from diffusers.models.transformers.transformer_mochi import MochiTransformer3DModel

from ..layout import TokenLayout
from ..recorder.processor import MapSink
from .spec import ModelSpec, Site
from .tiny_text import TEXT_DIM, cast, masked_text, tiny_text_encoder, tiny_tokenizer

__all__ = ["SPEC", "KNOWN", "MochiAttnMapProcessor", "TEXT_LEN", "VAE_TEMPORAL", "tiny_pipeline", "tiny_transformer"]

TEXT_LEN = 256  # T5 tokens of the pipelines' calls (max_sequence_length)
VAE_TEMPORAL = 6  # pixel frames per latent frame after the first


def _valid_text(mask: torch.Tensor) -> list[int]:
    """Each item's valid text tokens, which must be its first ones (the tokenizer pads at the end)."""
    counts = [int(m.sum()) for m in mask.bool()]
    for m, n in zip(mask.bool(), counts):
        if not bool(m[:n].all()):
            raise ValueError("cogattn captures Mochi's text mask where it keeps each item's first tokens.")
    return counts


class MochiAttnMapProcessor:
    """Drop-in for ``MochiAttnProcessor2_0`` that also feeds q, k and each item's counts to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        encoder_query = attn.add_q_proj(encoder_hidden_states)
        encoder_key = attn.add_k_proj(encoder_hidden_states)
        encoder_value = attn.add_v_proj(encoder_hidden_states)

        encoder_query = encoder_query.unflatten(2, (attn.heads, -1))
        encoder_key = encoder_key.unflatten(2, (attn.heads, -1))
        encoder_value = encoder_value.unflatten(2, (attn.heads, -1))

        if attn.norm_added_q is not None:
            encoder_query = attn.norm_added_q(encoder_query)
        if attn.norm_added_k is not None:
            encoder_key = attn.norm_added_k(encoder_key)

        if image_rotary_emb is not None:

            def apply_rotary_emb(x, freqs_cos, freqs_sin):
                x_even = x[..., 0::2].float()
                x_odd = x[..., 1::2].float()

                cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
                sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)

                return torch.stack([cos, sin], dim=-1).flatten(-2)

            query = apply_rotary_emb(query, *image_rotary_emb)
            key = apply_rotary_emb(key, *image_rotary_emb)

        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        encoder_query, encoder_key, encoder_value = (
            encoder_query.transpose(1, 2),
            encoder_key.transpose(1, 2),
            encoder_value.transpose(1, 2),
        )

        sequence_length = query.size(2)
        encoder_sequence_length = encoder_query.size(2)
        total_length = sequence_length + encoder_sequence_length

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # the whole sequence; each item keeps its video and its valid text
            counts = torch.tensor([sequence_length + n for n in _valid_text(attention_mask)])
            q, k = torch.cat([query, encoder_query], dim=2), torch.cat([key, encoder_key], dim=2)
            v = torch.cat([value, encoder_value], dim=2) if self.sink.wants_value else None
            self.sink.capture(layer, q, k, None, None, counts, counts, value=v)
            del q, k, v

        batch_size, heads, _, dim = query.shape
        attn_outputs = []
        for idx in range(batch_size):
            mask = attention_mask[idx][None, :]
            valid_prompt_token_indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()

            valid_encoder_query = encoder_query[idx : idx + 1, :, valid_prompt_token_indices, :]
            valid_encoder_key = encoder_key[idx : idx + 1, :, valid_prompt_token_indices, :]
            valid_encoder_value = encoder_value[idx : idx + 1, :, valid_prompt_token_indices, :]

            valid_query = torch.cat([query[idx : idx + 1], valid_encoder_query], dim=2)
            valid_key = torch.cat([key[idx : idx + 1], valid_encoder_key], dim=2)
            valid_value = torch.cat([value[idx : idx + 1], valid_encoder_value], dim=2)

            attn_output = F.scaled_dot_product_attention(
                valid_query, valid_key, valid_value, dropout_p=0.0, is_causal=False
            )
            valid_sequence_length = attn_output.size(2)
            attn_output = F.pad(attn_output, (0, 0, 0, total_length - valid_sequence_length))
            attn_outputs.append(attn_output)

        hidden_states = torch.cat(attn_outputs, dim=0)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)

        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (sequence_length, encoder_sequence_length), dim=1
        )

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``MochiTransformer3DModel`` call: latents
    ``(B, C, F, H, W)``, the text after the video (its padded length: the mask sets each item's own)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
    t = kwargs["timestep"] if "timestep" in kwargs else args[2]
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p = int(config["patch_size"])
    _, _, frames, height, width = hidden.shape
    layout = TokenLayout(
        text_len=int(text.shape[1]),
        frames=frames,
        height=height // p,
        width=width // p,
        patch_size=p,
        text_position="end",
        temporal_compression=VAE_TEMPORAL,
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Mochi pipeline call (``(num_frames − 1) // 6 + 1`` latent frames, 8× spatial)."""
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        text_len or TEXT_LEN,
        int(config["patch_size"]),
        text_position="end",
        temporal_compression=VAE_TEMPORAL,
    )


# Attention shapes of the released checkpoint (its transformer/config.json), for plans made offline.
KNOWN: dict[str, dict] = {
    "genmo/mochi-1-preview": {
        "_class_name": "MochiTransformer3DModel",
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "num_layers": 48,
        "patch_size": 2,
        "in_channels": 12,
        "text_embed_dim": 4096,
        "pooled_projection_dim": 1536,
    },
}


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 16, dtype=torch.float32, seed=0):
    """A random ``MochiTransformer3DModel`` (diffusers' own test config, text width 16)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            pooled_projection_dim=16,
            in_channels=12,
            qk_norm="rms_norm",
            text_embed_dim=TEXT_DIM,
            time_embed_dim=4,
            activation_fn="swiglu",
            max_sequence_length=16,
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random ``MochiPipeline`` at toy size (no download): ``num_frames=13`` gives 3 latent frames and
    ``height=32, width=48`` 2×3 patches per latent frame."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; Mochi is text-to-video.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLMochi(
            latent_channels=12,
            out_channels=3,
            encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32),
            layers_per_block=(1, 1, 1, 1, 1),
        )
    takes = inspect.signature(MochiPipeline.__init__).parameters
    parts = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=cast(vae, dtype),
        text_encoder=tiny_text_encoder(seed, dtype),
        tokenizer=tiny_tokenizer(),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
    )
    pipe = MochiPipeline(**{k: v for k, v in parts.items() if k in takes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 6 text tokens, 4 of them valid (the negative keeps 2),
    13 frames of 32×48 (3×2×3 patches)."""
    call = masked_text(pipe, generator)
    call.update(guidance_scale=4.5 if guided else 1.0, num_frames=13, height=32, width=48)
    return call


SPEC = ModelSpec(
    "mochi",
    (MochiTransformer3DModel,),
    (Site("transformer_blocks", "attn1"),),
    {MochiAttnProcessor2_0: MochiAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    frame_counts="7, 13, ..., 85, ..., 163",
    config_keys=("max_sequence_length",),
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={"video_to_image": "Mochi has no image attention; its transformer sees text and video tokens only."},
    output_call=False,
)
