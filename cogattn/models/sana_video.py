"""SANA-Video: the map processor, the family's facts and its tiny pipeline (docs/design.md, "The model seam").

Each of SANA-Video's blocks has a self-attention over the video (``attn1``) and a cross-attention from the video to
the Gemma-2 text (``attn2``, 300 tokens). The self-attention is linear attention (``SanaLinearAttnProcessor3_0``:
ReLU feature maps, 3-D RoPE on the numerator alone): it forms no softmax, so it has no attention probabilities, and
every kind of the self-attention is refused. The cross-attention is a softmax one under a key mask: the transformer
turns the pipeline's 0/1 text mask into a bias, 0 on the prompt's tokens and −10000 on the padding, which the
attention adds to every score. :class:`SanaVideoAttnMapProcessor` is its processor, ``SanaAttnProcessor2_0``, line
for line, plus the lines that hand q, k and that bias to the recording: ``video_to_text`` is what SANA-Video records.
Its sites name the cross-attention as both the attention and the context (``Site``), so a layer is
``transformer_blocks.N.attn2`` and the linear self-attention keeps its stock processor.

The sequence is the video's latents in patches (1 × 2 × 2 behind the Wan VAE of the 480p checkpoint; 1 × 1 × 1
behind the LTX-2 VAE, 32 pixels and 8 frames per latent pixel, of the 720p one). The pipelines make one transformer
call per step, ``[uncond..., cond...]`` under guidance; image-to-video gives a timestep per token (0 on the image's
latent frame). Their prompt goes in a long instruction template (``complex_human_instruction``), of which the
transformer reads the first token and the last before the prompt (:func:`prompt_text`).
"""

from __future__ import annotations

import inspect

import torch

from ..exact.reducers import REDUCERS
from ..exact.reducers.audio import AUDIO_KINDS
from ..layout import VAE_SPATIAL, VAE_TEMPORAL, TokenLayout
from ..recorder.processor import MapSink, context_bias
from .prompt_text import PromptText, kept, tokenize
from .spec import ModelSpec, Site, StepTime, Unavailable, call_argument, text_never_queries
from .tiny_text import TEXT_DIM, cast, masked_text, tiny_text_encoder, tiny_tokenizer

# Attention shapes of the released checkpoints, from diffusers' scripts/convert_sana_video_to_diffusers.py (its
# transformer_kwargs: 20 layers of 20 heads × 112, cross-attention alike; 480p: sample_size 30, patch 1 × 2 × 2;
# 720p: sample_size 22, patch 1 × 1 × 1), the 720p one on the 128 latent channels of the LTX-2 VAE its pipeline takes.
_SANA = {
    "_class_name": "SanaVideoTransformer3DModel",
    "num_layers": 20,
    "num_attention_heads": 20,
    "attention_head_dim": 112,
    "num_cross_attention_heads": 20,
    "cross_attention_head_dim": 112,
    "cross_attention_dim": 2240,
    "caption_channels": 2304,
}
KNOWN: dict[str, dict] = {
    "Efficient-Large-Model/SANA-Video_2B_480p_diffusers": {
        **_SANA, "in_channels": 16, "out_channels": 16, "sample_size": 30, "patch_size": [1, 2, 2]
    },
    "Efficient-Large-Model/SANA-Video_2B_720p_diffusers": {
        **_SANA, "in_channels": 128, "out_channels": 128, "sample_size": 22, "patch_size": [1, 1, 1]
    },
}  # fmt: skip

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_sana_video import (
        SanaAttnProcessor2_0,
        SanaVideoTransformer3DModel,
    )
except ImportError as missing:
    needs = "SANA-Video needs diffusers >= 0.36 (SanaVideoTransformer3DModel)"
    raise Unavailable("sana_video", needs, KNOWN) from missing

__all__ = [
    "SPEC",
    "KNOWN",
    "SanaVideoAttnMapProcessor",
    "TEXT_LEN",
    "layout_for_video",
    "prompt_text",
    "read_call",
    "tiny_call",
    "tiny_pipeline",
    "tiny_transformer",
]

TEXT_LEN = 300  # Gemma-2 tokens the transformer reads (the pipelines' max_sequence_length)
_LTX2_CHANNELS = 128  # latent channels of the LTX-2 VAE (32 pixels, 8 frames per latent pixel): the 720p checkpoint's
_PARALLEL = "parallel_config" in inspect.signature(dispatch_attention_fn).parameters


class SanaVideoAttnMapProcessor:
    """Drop-in for ``SanaAttnProcessor2_0`` (SANA-Video's cross-attention) that also feeds q, k and the text's key
    mask to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer of each module.
            One instance serves every module.
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
        cross = encoder_hidden_states is not None
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # scaled_dot_product_attention expects attention_mask shape to be
            # (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None and not cross:  # SANA-Video's blocks always give attn2 the text
            raise ValueError("cogattn captures SANA-Video's cross-attention to the text; this call gives it no text.")

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        parallel = {"parallel_config": self._parallel_config} if _PARALLEL else {}
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            **parallel,
        )
        if layer is not None:  # the bias the attention added: 0 on the prompt's tokens, −10000 on the padding
            bias = context_bias(attention_mask, batch_size, key.shape[1])
            self.sink.capture_context(layer, query.transpose(1, 2), key.transpose(1, 2), "text", bias)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states


def _compression(config: dict) -> tuple[int, int]:
    """``(pixels, frames)`` per latent pixel of the VAE a transformer with ``config`` runs behind: the LTX-2 VAE's
    (32, 8) for 128 latent channels (720p), the Wan VAE's (8, 4) otherwise."""
    return (32, 8) if int(config.get("in_channels", 16)) == _LTX2_CHANNELS else (VAE_SPATIAL, VAE_TEMPORAL)


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``SanaVideoTransformer3DModel`` call: latents ``(B, C, F,
    H, W)``, the text as the cross-attention's context."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 1, "encoder_hidden_states")
    t = call_argument(args, kwargs, 2, "timestep")
    # a timestep per item, and image-to-video's per token (0 on the image's latent frame): the step's is the largest
    t = StepTime(t) if isinstance(t, torch.Tensor) and t.numel() > 1 else float(t)
    layout = TokenLayout.of_video_latents(
        hidden.shape,
        config["patch_size"],
        context_len=int(text.shape[1]),
        temporal_compression=_compression(config)[1],
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a SANA-Video pipeline call (its ``frames``, ``height`` and ``width``): ``(frames − 1) // 4 +
    1`` latent frames of ``height / 8`` × ``width / 8`` latent pixels in 2 × 2 patches (720p: ``// 8``, ``/ 32``, no
    patches), and ``text_len`` (300) text tokens in the cross-attention."""
    p_t, p_h, _ = (int(p) for p in config.get("patch_size", (1, 2, 2)))
    spatial, temporal = _compression(config)
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p_h,
        p_t if p_t > 1 else None,
        spatial_compression=spatial,
        context_len=text_len or TEXT_LEN,
        temporal_compression=temporal,
    )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The ``length`` text tokens the transformer reads for ``prompt``, as SANA-Video's pipelines make them
    (``_get_gemma_prompt_embeds`` and ``encode_prompt``; ``ModelSpec.prompt_text``).

    The prompt, lower-cased and stripped, follows ``template`` (the call's ``complex_human_instruction``, its lines
    joined by newlines; `None`: the default of the pipeline's call; empty: none), is tokenized to the template's
    tokens + ``length`` − 2, and the transformer reads the first token and the last ``length`` − 1 (Gemma's tokenizer,
    a BOS and no EOS: the BOS, the template's last token, then the prompt's). The pipelines put the negative prompt
    in no template: pass ``template=[]`` for its tokens.
    """
    tokenizer = pipeline.tokenizer
    if template is None:
        default = inspect.signature(pipeline.__call__).parameters.get("complex_human_instruction")
        template = None if default is None else default.default
    words = pipeline._text_preprocessing(prompt, clean_caption=False)[0]  # the call's default: lower().strip()
    lead = "\n".join(template) if template else ""
    text = PromptText([], lead + words, (len(lead), len(lead) + len(words)))
    total = len(tokenizer.encode(lead)) + length - 2 if template else length
    enc = tokenize(tokenizer, text.text, total, offsets, padding_side="right")  # the side the pipeline sets
    return kept(enc, text, [0, *range(total - length + 1, total)])


def call_rules(cfg, config: dict) -> None:
    """The batch tool's SANA-Video rule (``ModelSpec.call_rules``): the size is one of the checkpoint's aspect-ratio
    bins, as the pipelines' resolution binning (on by default) would make it."""
    from diffusers.pipelines.sana_video import pipeline_sana_video as module

    bins = {30: module.ASPECT_RATIO_480_BIN, 22: module.ASPECT_RATIO_720_BIN}.get(int(config.get("sample_size", 0)))
    sizes = [(int(h), int(w)) for h, w in (bins or {}).values()]
    if sizes and (cfg.height, cfg.width) not in sizes:
        raise ValueError(
            f"height, width: {cfg.height}, {cfg.width}; SANA-Video's pipeline bins the size to its aspect ratios "
            f"(height, width): {sizes}; set one of them."
        )


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
def tiny_transformer(*, num_layers: int = 2, num_heads: int = 2, head_dim: int = 12, dtype=torch.float32, seed=0):
    """A random ``SanaVideoTransformer3DModel`` at toy size (its released config's kinds of layers; text width 16,
    patches 1 × 2 × 2)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SanaVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=num_heads,
            attention_head_dim=head_dim,
            num_layers=num_layers,
            num_cross_attention_heads=num_heads,
            cross_attention_head_dim=head_dim,
            cross_attention_dim=num_heads * head_dim,
            caption_channels=TEXT_DIM,
            mlp_ratio=2.5,
            sample_size=8,
            patch_size=(1, 2, 2),
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
    return cast(model, dtype)


def tiny_pipeline(task: str = "text-to-video", *, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A random SANA-Video pipeline at toy size (no download), behind a tiny Wan VAE (8 pixels, 4 frames per latent
    pixel, as the 480p checkpoint's): ``frames=9, height=32, width=64`` gives 3 latent frames of 2 × 4 patches. Call
    it with ``use_resolution_binning=False`` (its sizes are no released bin).

    Args:
        task (`str`, defaults to ``"text-to-video"``): or ``"image-to-video"`` (``SanaImageToVideoPipeline``; pass
            ``image=`` a PIL image).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
        size: ``num_layers``, ``num_heads``, ``head_dim`` of the transformer.
    """
    from diffusers import AutoencoderKLWan, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    if task not in ("text-to-video", "image-to-video"):
        raise ValueError(f"task={task!r}; choose 'text-to-video' or 'image-to-video'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    i2v = task == "image-to-video"
    scheduler = (  # the conversion script's: flow DPM-Solver for text-to-video, flow Euler for image-to-video
        FlowMatchEulerDiscreteScheduler(shift=8.0)
        if i2v
        else DPMSolverMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    )
    parts = dict(
        tokenizer=tiny_tokenizer(),
        text_encoder=tiny_text_encoder(seed, dtype),
        vae=cast(vae, dtype),
        transformer=tiny_transformer(dtype=dtype, seed=seed, **size),
        scheduler=scheduler,
    )
    if i2v:
        from diffusers import SanaImageToVideoPipeline as cls
    else:
        from diffusers import SanaVideoPipeline as cls
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 6 text tokens, 4 of them the prompt's (the negative's 2), 9 frames
    of 32×64 (3×2×4 patches), and for image-to-video a random image."""
    call = masked_text(pipe, generator)
    call.update(guidance_scale=6.0 if guided else 1.0, frames=9, height=32, width=64)
    call.update(negative_prompt=None, use_resolution_binning=False)  # embeddings given; no released size bin
    if task == "image-to-video":
        import PIL.Image

        pixels = torch.randint(0, 256, (32, 64, 3), generator=generator, dtype=torch.uint8).numpy()
        call["image"] = PIL.Image.fromarray(pixels)
    return call


_LINEAR = (
    "SANA-Video's self-attention is linear attention (ReLU feature maps, RoPE on the numerator alone): it forms no "
    "softmax, so it has no attention probabilities to record; 'video_to_text' records its softmax cross-attention."
)

SPEC = ModelSpec(
    "sana_video",
    (SanaVideoTransformer3DModel,),
    # the cross-attention is the site's attention and its context: the linear self-attention is no capture site
    (Site("transformer_blocks", "attn2", context="attn2"),),
    {SanaAttnProcessor2_0: SanaVideoAttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        **{kind: _LINEAR for kind in REDUCERS if kind not in ("video_to_text", *AUDIO_KINDS)},
        "text_to_video": text_never_queries("SANA-Video"),
        "video_to_image": "SANA-Video has no image attention: an image to animate is the video's first latent frame.",
    },
    output_call=False,  # the opt-in output call is a self-attention's, and this one has no softmax
    title="SANA-Video",
    frame_counts="5, 9, ..., 81",
    pipelines={"text-to-video": "SanaVideoPipeline", "image-to-video": "SanaImageToVideoPipeline"},
    float32=("vae",),
    call_rules=call_rules,
    tiny_prompt_arguments={"use_resolution_binning": False},  # the tiny sizes are no released bin
    negative_template=[],  # its pipelines put the negative prompt in no template
    empty_negative=True,  # under guidance its pipelines lower-case the negative prompt: "" where none is given
    prompt_text=prompt_text,
    head_shape=lambda config: (int(config["num_cross_attention_heads"]), int(config["cross_attention_head_dim"])),
)
