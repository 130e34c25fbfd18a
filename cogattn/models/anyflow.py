"""AnyFlow (any-step flow-map video model on Wan 2.1's backbone): its map processors, the facts of the family and
its tiny pipeline (docs/design.md, "The model seam").

``AnyFlowTransformer3DModel`` is Wan 2.1's DiT with a second timestep (the flow map's target ``r``): its blocks
have a self-attention over the video alone (``attn1``, 3D RoPE applied as complex numbers in float64) and a
cross-attention from the video to the text (``attn2``; 512 UMT5 tokens, and where the model has ``image_dim``
the image's tokens first, in the same softmax: it has no image projections of its own). Both are
``AnyFlowAttention`` modules, run by ``AnyFlowAttnProcessor`` and ``AnyFlowCrossAttnProcessor``;
:class:`AnyFlowAttnMapProcessor` and :class:`AnyFlowCrossAttnMapProcessor` are those processors line for line
plus the lines that hand q and k to the recording. The transformer takes its latents as ``(B, F, C, H, W)``
and a timestep per frame ``(B, F)`` (0 on the frames of a conditioning video): a step's timestep is its
largest (``StepTime``). ``AnyFlowPipeline`` batches classifier-free guidance in one call, ``[uncond, cond]``.

AnyFlow-FAR (``AnyFlowFARTransformer3DModel``) is refused: its self-attention's keys are spatially compressed
context frames (patches of 1×4×4, another grid) and a KV cache of earlier chunks, under a chunk-causal flex
BlockMask, so no map over one latent grid holds them.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from ..recorder.processor import MapSink, context_bias, query_key_mask
from .spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast

# Attention shapes of the released checkpoints (nvidia's AnyFlow collection), for plans made offline: the 14B's from
# its transformer/config.json, the 1.3B's from the Wan 2.1 T2V-1.3B its model card names as base model (AnyFlow
# keeps the backbone's shapes); the FAR ones' compressed patches and chunks are transformer_anyflow_far.py's defaults
_ANYFLOW = {"_class_name": "AnyFlowTransformer3DModel", "attention_head_dim": 128, "patch_size": [1, 2, 2]}
_ANYFLOW.update(in_channels=16, out_channels=16, text_dim=4096, gate_value=0.25, deltatime_type="r")
_FAR = {**_ANYFLOW, "_class_name": "AnyFlowFARTransformer3DModel", "compressed_patch_size": [1, 4, 4]}
_FAR.update(full_chunk_limit=3, chunk_partition=[1, 3, 3, 3, 3, 3, 3, 2])
_14B, _1_3B = {"num_layers": 40, "num_attention_heads": 40}, {"num_layers": 30, "num_attention_heads": 12}
KNOWN: dict[str, dict] = {
    "nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers": {**_ANYFLOW, **_14B, "ffn_dim": 13824},
    "nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers": {**_ANYFLOW, **_1_3B, "ffn_dim": 8960},
    "nvidia/AnyFlow-FAR-Wan2.1-14B-Diffusers": {**_FAR, **_14B, "ffn_dim": 13824},
    "nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers": {**_FAR, **_1_3B, "ffn_dim": 8960},
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_anyflow import (
        AnyFlowAttnProcessor,
        AnyFlowCrossAttnProcessor,
        AnyFlowTransformer3DModel,
        apply_rotary_emb,
    )
    from diffusers.models.transformers.transformer_anyflow_far import AnyFlowFARTransformer3DModel

    from . import wan
except ImportError as missing:
    raise Unavailable("anyflow", "AnyFlow needs diffusers >= 0.42 (transformer_anyflow)", KNOWN) from missing

__all__ = [
    "SPEC",
    "KNOWN",
    "FAR_REFUSAL",
    "AnyFlowAttnMapProcessor",
    "AnyFlowCrossAttnMapProcessor",
    "read_call",
    "layout_for_video",
    "tiny_pipeline",
    "tiny_transformer",
    "tiny_call",
]

FAR_REFUSAL = (
    "AnyFlow-FAR (AnyFlowFARTransformer3DModel) is not recorded: its self-attention's keys are spatially compressed "
    "context frames (1×4×4 patches, another grid) and a KV cache of earlier chunks under a chunk-causal flex "
    "BlockMask, so no map over one latent grid holds them; record the bidirectional AnyFlowTransformer3DModel "
    "(AnyFlowPipeline)."
)
_FAR_NAMES = ("AnyFlowFARTransformer3DModel",)


class AnyFlowAttnMapProcessor:
    """Drop-in for ``AnyFlowAttnProcessor`` (the bidirectional self-attention) that also feeds q, k to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer of each module.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask=None,
        rotary_emb: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Layout (B, H, L, D) for rotary application; transposed to (B, L, H, D) before dispatch.
        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        if rotary_emb is not None:
            query = apply_rotary_emb(query, rotary_emb["query"])
            key = apply_rotary_emb(key, rotary_emb["key"])

        layer = self.sink.layer_to_capture(attn)  # q, k are (B, H, S, D) here, as the recording takes them
        mask = None if layer is None else query_key_mask(attention_mask, query.shape[0], query.shape[2])
        fused = (
            None
            if layer is None or attention_mask is not None  # the opt-in output call takes no mask
            else self.sink.attention(layer, query, key, value)
        )
        if fused is None:
            hidden_states = dispatch_attention_fn(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            lse = sums = None
        else:
            hidden_states, lse, sums = fused
            hidden_states = hidden_states.transpose(1, 2)
        if layer is not None:
            self.sink.capture(layer, query, key, lse, sums, mask=mask, value=value if self.sink.wants_value else None)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class AnyFlowCrossAttnMapProcessor:
    """Drop-in for ``AnyFlowCrossAttnProcessor`` (video → image and text) that also feeds q, k to a recording:
    the keys are the image's tokens, where the model has ``image_dim``, then the text's, in one softmax.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # (B, L, H, D) layout for dispatch_attention_fn.
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        layer = self.sink.layer_to_capture(attn)
        if layer is not None:  # the image's columns, where they lead the text's, are read from this call too
            bias = context_bias(attention_mask, key.shape[0], key.shape[1])
            self.sink.capture_context(layer, query.transpose(1, 2), key.transpose(1, 2), "text", bias)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``AnyFlowTransformer3DModel`` call (latents
    ``(B, F, C, H, W)``, a timestep per frame ``(B, F)``; the image's tokens, where given, lead the text's)."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    t = call_argument(args, kwargs, 1, "timestep")
    text = call_argument(args, kwargs, 3, "encoder_hidden_states")
    image = call_argument(args, kwargs, 4, "encoder_hidden_states_image")
    # a timestep per frame, 0 on a conditioning video's frames: the step's is the largest
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    image_len = 0 if image is None else int(image.shape[1])
    batch, frames, channels, height, width = hidden.shape
    layout = TokenLayout.of_video_latents(
        (batch, channels, frames, height, width),
        config["patch_size"],
        context_len=int(text.shape[1]),
        image_len=image_len,
        image_joins_text=bool(image_len),  # no image projections of its own: one softmax over image and text
    )
    return layout, batch, t, hidden.device


def _is_far(config: dict) -> bool:
    return config.get("_class_name") in _FAR_NAMES or "compressed_patch_size" in config


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of an ``AnyFlowPipeline`` call for ``num_frames`` frames of ``height`` × ``width`` pixels: Wan
    2.1's (``wan.layout_for_video``; an ``image_dim`` model's image tokens lead the text's, in its softmax).
    Raises `ValueError` for an AnyFlow-FAR config (``FAR_REFUSAL``)."""
    if _is_far(config):
        raise ValueError(FAR_REFUSAL)
    return wan.layout_for_video(config, num_frames, height, width, text_len)


class AnyFlowSpec(ModelSpec):
    """AnyFlow's spec: an AnyFlow-FAR transformer is this family's by its name, and refused (``FAR_REFUSAL``)."""

    def matches(self, module) -> bool:
        if isinstance(module, AnyFlowFARTransformer3DModel):
            raise ValueError(FAR_REFUSAL)
        return super().matches(module)

    def matches_config(self, config: dict) -> bool:
        # a FAR config is the family's: its plans then refuse it in one line (layout_for_video, call_rules)
        return config.get("_class_name") in _FAR_NAMES or super().matches_config(config)


def call_rules(cfg, config: dict) -> None:
    """The batch tool's AnyFlow rule (``ModelSpec.call_rules``): an AnyFlow-FAR checkpoint is refused."""
    if _is_far(config):
        raise ValueError(f"model: {cfg.model}: {FAR_REFUSAL}")


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_IMAGE_DIM = 4  # width of the tiny image embeddings, where the transformer takes an image


def tiny_transformer(
    image_to_video: bool = False,
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``AnyFlowTransformer3DModel`` at toy size; with ``image_to_video`` one with ``image_dim`` (its
    image tokens then lead the text's in the cross-attention: call it with ``encoder_hidden_states_image``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AnyFlowTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=TEXT_DIM,
            freq_dim=256,
            ffn_dim=32,
            num_layers=num_layers,
            cross_attn_norm=True,
            image_dim=_IMAGE_DIM if image_to_video else None,
            rope_max_seq_len=32,
        )
    return cast(model, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 12,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``AnyFlowPipeline`` with real components at toy size (no download): the tiny Wan pipeline's
    tokenizer, text encoder and VAE (``wan.tiny_pipeline``), a tiny AnyFlow transformer and the flow-map Euler
    scheduler. Call it as a real one: ``height=32, width=48`` gives 2×3 patches per latent frame and
    ``num_frames=9`` 3 latent frames; the prompt is padded to 512 tokens.

    Args:
        task (`str`, defaults to ``"text-to-video"``): the pipeline's one task (a ``video=`` call conditions on
            its first latent frames).
        num_layers, num_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import AnyFlowPipeline, FlowMapEulerDiscreteScheduler

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; AnyFlowPipeline makes 'text-to-video' (a video= call continues a video).")
    size = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, dtype=dtype)
    base = wan.tiny_pipeline(seed=seed, **size)
    pipe = AnyFlowPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        transformer=tiny_transformer(seed=seed, **size),
        scheduler=FlowMapEulerDiscreteScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of random text embeddings (512 tokens), 9 frames of 32×48
    (3×2×3 patches); the negative embeddings under guidance alone (the pipeline joins any it is given to the
    batch)."""
    call = wan.tiny_call(pipe, "text-to-video", generator, guided)
    if not guided:
        del call["negative_prompt_embeds"]
    return call


SPEC = AnyFlowSpec(
    "anyflow",
    (AnyFlowTransformer3DModel,),
    (Site("blocks", "attn1", context="attn2"),),
    {AnyFlowAttnProcessor: AnyFlowAttnMapProcessor, AnyFlowCrossAttnProcessor: AnyFlowCrossAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=wan.TEXT_LEN,
    context_kinds={"video_to_text": "text", "video_to_image": "image"},
    refused={"text_to_video": text_never_queries("AnyFlow")},
    float32=("vae",),
    call_rules=call_rules,
)
