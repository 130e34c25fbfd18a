"""Cosmos 3 (``Cosmos3OmniTransformer``, ``Cosmos3OmniPipeline``): the map processor, the family's facts and its tiny
pipeline (docs/design.md, "The model seam").

The transformer is a Mixture-of-Transformers over one packed sequence without a batch axis, ``[text | video]``
(sound and action tokens, where a call has them, follow the video). Each decoder layer's ``self_attn``
(``Cosmos3PackedMoTAttention``, run by ``Cosmos3AttnProcessor``) makes two attention calls with projections of their
own: the text's causal self-attention (the "understanding" pathway), and the video's attention to every text and
video key (the "generation" pathway), both with grouped key/value heads and 3-axis multimodal RoPE.
:class:`Cosmos3AttnMapProcessor` is that processor line for line, plus the lines that hand the recording the
S × S attention the two calls make: q of the text then the video, k of the text then the video (each key/value head
repeated for its query heads, ``repeat_interleave`` as ``enable_gqa`` does), and a mask over token groups
(:class:`~cogattn.recorder.processor.GroupMask`: each text token a group, the video one) keeping the causal text
rows on the text keys and every key for the video rows. So ``full``'s text rows are the causal call's (0 on the
video keys) and its video rows the second call's; the video kinds are the video rows'.

The pipeline makes one call per guidance branch, the prompt's first, then the negative prompt's; a recording
numbers them as the guidance batch ``[uncond, cond]`` (one video a call). The two texts need not have one length:
``batch="cond"``, the default under guidance, records the prompt's alone; the negative prompt's item needs a
negative prompt of the prompt's token count.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from ..layout import VAE_TEMPORAL, TokenLayout
from ..recorder.processor import GroupMask, MapSink
from .prompt_text import in_template, kept, tokenize
from .spec import ModelSpec, Site, Unavailable, call_argument
from .tiny_text import cast, tiny_tokenizer

# The released transformer's attention shapes: Cosmos3OmniTransformer's defaults, the config diffusers' docs load as
# nvidia/Cosmos3-Nano (transformer/config.json; the 16× Wan 2.2 VAE's 48 latent channels), for plans made offline.
_NANO = {"_class_name": "Cosmos3OmniTransformer", "hidden_size": 4096, "num_hidden_layers": 36, "head_dim": 128}
_NANO.update(num_attention_heads=32, num_key_value_heads=8, latent_channel=48, latent_patch_size=2)
KNOWN: dict[str, dict] = {"nvidia/Cosmos3-Nano": _NANO}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_cosmos3 import (
        Cosmos3AttnProcessor,
        Cosmos3OmniTransformer,
        _rotate_half,
    )
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _SYSTEM_PROMPT_IMAGE, _SYSTEM_PROMPT_VIDEO
except ImportError as missing:
    raise Unavailable("cosmos3", "Cosmos 3 needs diffusers >= 0.42 (Cosmos3OmniTransformer)", KNOWN) from missing

__all__ = ["SPEC", "Cosmos3AttnMapProcessor", "KNOWN", "read_call", "layout_for_video", "tiny_pipeline"]

SYSTEM_PROMPT = {False: _SYSTEM_PROMPT_VIDEO, True: _SYSTEM_PROMPT_IMAGE}  # by whether the call makes an image
TEXT_LEN = 256  # a typical prompt's tokens in the chat template (the text is not padded: pass text_len=)
_NO_SOUND = (
    "cogattn records Cosmos 3's text and video tokens; this call also has {what} tokens after the video, of no "
    "frame of the video grid. Record a call without them (enable_sound=False, no action)."
)


def causal_text_mask(text_len: int, seq_len: int, heads: int, device) -> GroupMask:
    """The mask of the two calls as one: text token i (a group of its own) keeps text keys 0..i, the video (one
    group) keeps every key; ``keep`` ``(1, heads, T + 1, T + 1)``, the same for every head."""
    n = text_len + 1
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    keep[text_len] = True
    group = torch.arange(seq_len, device=device).clamp_(max=text_len)
    return GroupMask(keep.expand(1, heads, n, n), group)


class Cosmos3AttnMapProcessor:
    """Drop-in for ``Cosmos3AttnProcessor`` that also hands the recording the layer's S × S attention.

    Args:
        sink (`MapSink`): where maps go (a ``cogattn.Recording``); one instance serves every layer.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        self.sink = sink

    def __call__(
        self,
        attn,
        und_seq: torch.Tensor,
        gen_seq: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Per-pathway projections
        q_und = attn.to_q(und_seq).view(-1, attn.num_attention_heads, attn.head_dim)
        k_und = attn.to_k(und_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        v_und = attn.to_v(und_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        q_gen = attn.add_q_proj(gen_seq).view(-1, attn.num_attention_heads, attn.head_dim)
        k_gen = attn.add_k_proj(gen_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        v_gen = attn.add_v_proj(gen_seq).view(-1, attn.num_key_value_heads, attn.head_dim)

        q_und = attn.norm_q(q_und)
        k_und = attn.norm_k(k_und)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(q_gen)
        k_gen = attn.norm_added_k(k_gen)

        # Apply rotary position embeddings per pathway
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        cos_und = cos_und.unsqueeze(1)
        sin_und = sin_und.unsqueeze(1)
        q_und = q_und * cos_und + _rotate_half(q_und) * sin_und
        k_und = k_und * cos_und + _rotate_half(k_und) * sin_und
        k_und_for_gen = k_und_for_gen * cos_und + _rotate_half(k_und_for_gen) * sin_und
        cos_gen = cos_gen.unsqueeze(1)
        sin_gen = sin_gen.unsqueeze(1)
        q_gen = q_gen * cos_gen + _rotate_half(q_gen) * sin_gen
        k_gen = k_gen * cos_gen + _rotate_half(k_gen) * sin_gen

        # Causal pathway (understanding): und tokens self-attend with causal masking.
        causal_out = dispatch_attention_fn(
            q_und.unsqueeze(0),
            k_und.unsqueeze(0),
            v_und.unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        causal_out = causal_out.squeeze(0).flatten(-2, -1)

        # Full pathway (generation): gen tokens cross-attend to all (und + gen) keys/values.
        all_k = torch.cat([k_und_for_gen, k_gen], dim=0)
        all_v = torch.cat([v_und, v_gen], dim=0)
        full_out = dispatch_attention_fn(
            q_gen.unsqueeze(0),
            all_k.unsqueeze(0),
            all_v.unsqueeze(0),
            is_causal=False,
            enable_gqa=True,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        full_out = full_out.squeeze(0).flatten(-2, -1)

        layer = self.sink.layer_to_capture(attn)
        if layer is not None:
            self._capture(layer, attn, torch.cat([q_und, q_gen]), all_k, all_v, len(q_und))

        # Per-pathway output projection
        und_out = attn.to_out(causal_out)
        gen_out = attn.to_add_out(full_out)
        return und_out, gen_out

    def _capture(self, layer: int, attn, query, key, value, text_len: int) -> None:
        """Hand the recording q, k ``(1, H, S, D)`` (k and v per query head) and the causal text mask."""
        layout = self.sink.layout
        if layout is not None and query.shape[0] != layout.seq_len:
            raise ValueError(
                f"this Cosmos 3 call has {text_len} text tokens, the recorded generation's first call "
                f"{layout.text_len}: the negative prompt's item (batch 'all' or 'uncond') needs a negative prompt of "
                "the prompt's token count; record batch='cond' (the default under guidance) otherwise."
            )
        groups = attn.num_key_value_groups

        def heads_first(x):  # (S, H, D) → (1, H, S, D)
            return x.transpose(0, 1).unsqueeze(0)

        q = heads_first(query)
        k = heads_first(key.repeat_interleave(groups, dim=1))
        v = heads_first(value.repeat_interleave(groups, dim=1)) if self.sink.wants_value else None
        mask = causal_text_mask(text_len, q.shape[2], q.shape[1], q.device)
        self.sink.capture(layer, q, k, None, None, mask=mask, value=v)


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``Cosmos3OmniTransformer`` call: the text's ``und_len``
    tokens, then one video of ``vision_token_shapes`` patches. Raises `ValueError` for a call cogattn cannot record
    exactly (sound or action tokens, several videos, a token order other than text then video)."""

    def arg(index, name):
        return call_argument(args, kwargs, index, name)

    for what, tokens, indexes in (("sound", 11, 13), ("action", 17, 19)):
        if arg(tokens, f"{what}_tokens") is not None and arg(indexes, f"{what}_sequence_indexes") is not None:
            raise ValueError(_NO_SOUND.format(what=what))
    if config.get("use_und_k_norm_for_gen") and not config.get("qk_norm_for_text", True):
        raise ValueError(
            "this Cosmos 3 transformer keys the video's attention to the text with keys of their own "
            "(use_und_k_norm_for_gen): no one q·kᵀ holds both calls, so cogattn does not record it."
        )
    shapes, text_len = arg(6, "vision_token_shapes"), int(arg(3, "und_len"))
    if len(shapes) != 1:
        raise ValueError(f"this Cosmos 3 call packs {len(shapes)} videos; cogattn records calls of one video.")
    frames, height, width = (int(n) for n in shapes[0])
    video = frames * height * width
    where = arg(7, "vision_sequence_indexes")
    in_order = int(arg(4, "sequence_length")) == text_len + video and torch.equal(
        where.cpu(), torch.arange(text_len, text_len + video)
    )
    if not in_order:
        raise ValueError("cogattn records Cosmos 3 calls whose sequence is the text, then the video, and no more.")
    p = int(config["latent_patch_size"])
    layout = TokenLayout(text_len=text_len, frames=frames, height=height, width=width, patch_size=p)
    t = arg(9, "vision_timesteps")  # per noisy video token, the step's
    time = float(t.max()) if isinstance(t, torch.Tensor) and t.numel() else float(t or 0.0)
    return layout, 1, time, where.device


def _spatial(config: dict) -> int:
    """Pixels per latent pixel: the Wan 2.2 VAE's 16 for its 48 channels, else the Wan 2.1 VAE's 8."""
    return 16 if int(config.get("latent_channel", 48)) == 48 else 8


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a ``Cosmos3OmniPipeline`` call: ``(num_frames - 1) // 4 + 1`` latent frames, the latent grid
    padded to whole patches (the transformer's ceil), ``text_len`` text tokens (the prompt's, in the template)."""
    p, s = int(config["latent_patch_size"]), _spatial(config)
    return TokenLayout(
        text_len=int(text_len or TEXT_LEN),
        frames=(int(num_frames) - 1) // VAE_TEMPORAL + 1,
        height=math.ceil(int(height) // s / p),
        width=math.ceil(int(width) // s / p),
        patch_size=p,
    )


def guidance_on(pipeline) -> bool:
    """Whether the running call guides: the pipeline's ``guidance_scale != 1`` (a scale below 1 guides too)."""
    scale = getattr(pipeline, "_guidance_scale", None)
    return scale is not None and float(scale) != 1.0


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The ``length`` text tokens the transformer reads for ``prompt`` (``ModelSpec.prompt_text``), as the pipeline's
    ``tokenize_prompt`` makes them: the system turn (video or image), the prompt as the user's turn with the metadata
    sentences the call appends (its duration and fps, its size) in the tokenizer's chat template with its generation
    prompt, then its end and vision-start tokens; checked against that method's own ids.

    ``template``: the call's arguments of ``tokenize_prompt`` (``num_frames``, ``height``, ``width``, ``fps``,
    ``add_resolution_template``, ``add_duration_template``, ...; the batch tool passes them), ``negative=True`` for the
    negative prompt (the inverse sentences); left out: a video call without the sentences (an image's system turn
    differs: pass ``num_frames=1``), and a text of another length (a call with them, the pipeline's default) is
    refused in one line, naming what to pass."""
    tokenizer = pipeline.text_tokenizer
    call = dict(template or {})
    negative = bool(call.pop("negative", False))
    defaults = inspect.signature(pipeline.tokenize_prompt).parameters
    args = {name: p.default for name, p in defaults.items() if p.default is not inspect.Parameter.empty}
    args.pop("negative_prompt", None)
    args.update(call if template is not None else {"add_resolution_template": False, "add_duration_template": False})
    image = args["num_frames"] == 1
    system = args["use_system_prompt"]
    system = pipeline.config.default_use_system_prompt if system is None else system
    sentences = []
    if not image and args["add_duration_template"]:
        form = pipeline.inverse_duration_template if negative else pipeline.duration_template
        sentences.append(form.format(duration=args["num_frames"] / args["fps"], fps=args["fps"]))
    if args["add_resolution_template"]:
        form = f"{'inverse_' * negative}{'image' if image else 'video'}_resolution_template"
        sentences.append(getattr(pipeline, form).format(height=args["height"], width=args["width"]))

    def chat(text: str) -> str:
        for sentence in sentences:  # tokenize_prompt's _append
            text = f"{text.rstrip('.')}. {sentence}" if text.rstrip(".") else sentence
        turns = [{"role": "user", "content": text}]
        turns = [{"role": "system", "content": SYSTEM_PROMPT[image]}] * bool(system) + turns
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, add_vision_id=False)

    text = in_template(prompt, chat)
    text = dataclasses.replace(text, text=text.text + tokenizer.eos_token + "<|vision_start|>")  # _add_special_tokens
    own = pipeline.tokenize_prompt(*(("", prompt) if negative else (prompt, None)), **args)[negative]  # its ids
    if len(own) != length and template is None:
        raise ValueError(
            f"this Cosmos 3 text has {length} tokens, {len(own)} without the metadata sentences the pipeline appends "
            "by default (add_resolution_template, add_duration_template): name its words with "
            "cogattn.analysis.words.PromptFormat(pipe, dict(num_frames=..., height=..., width=..., fps=...)), the "
            "call's arguments."
        )
    enc = tokenize(tokenizer, text.text, length, offsets, add_special_tokens=False, padding_side="right")
    if list(enc["input_ids"][: len(own)]) != list(own)[:length]:  # the pipeline's own tokens, or no labels
        raise ValueError(f"cogattn's Cosmos 3 text differs from {type(pipeline).__name__}.tokenize_prompt's tokens.")
    return kept(enc, text)


# -- the tiny pipeline (tests, notebook, batch tool) ------------------------------------------------
_CHANNELS = 4  # latent channels of the tiny VAE (released: the Wan 2.2 VAE's 48)
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def tiny_tokenizer_with_chat():
    """The tiny word-level tokenizer with Qwen's chat and vision-start tokens and a tiny chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "<|vision_start|>"], special_tokens=True)
    tokenizer.add_tokens(["system", "user", "assistant"])
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_transformer(
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 8,
    vocab_size: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``Cosmos3OmniTransformer`` at toy size: ``num_heads`` query heads over ``kv_heads`` key/value heads,
    3-axis RoPE sections (head_dim / 4, head_dim / 8, head_dim / 8), the tiny VAE's 4 latent channels; ``kv_heads``
    `None`: half the query heads, one for an odd count."""
    kv_heads = kv_heads or (num_heads // 2 if num_heads % 2 == 0 else 1)
    axes = (head_dim // 4, head_dim // 8, head_dim // 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Cosmos3OmniTransformer(
            head_dim=head_dim,
            hidden_size=32,
            intermediate_size=48,
            latent_channel=_CHANNELS,
            num_attention_heads=num_heads,
            num_hidden_layers=num_layers,
            num_key_value_heads=kv_heads,
            patch_latent_dim=4 * _CHANNELS,
            vocab_size=vocab_size,
            rope_axes_dim=axes,
        )
    return cast(model, dtype)


def tiny_pipeline(
    task: str = "text-to-video",
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A random ``Cosmos3OmniPipeline`` with real components at toy size (no download, no safety checker): call it
    with a prompt; ``num_frames=9, height=32, width=48`` give 3 latent frames of 2×3 patches.

    Args:
        task (`str`, defaults to ``"text-to-video"``): the only task of the tiny pipeline.
        num_layers, num_heads, kv_heads, head_dim (`int`): transformer size.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of every component.
        seed (`int`, defaults to 0): seed of the random weights.
    """
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler

    if task != "text-to-video":
        raise ValueError(f"task={task!r}; the tiny Cosmos 3 pipeline makes 'text-to-video'.")
    tokenizer = tiny_tokenizer_with_chat()
    size = dict(num_layers=num_layers, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=_CHANNELS,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * _CHANNELS,
            latents_std=[1.0] * _CHANNELS,
        )
    pipe = Cosmos3OmniPipeline(
        transformer=tiny_transformer(**size, vocab_size=len(tokenizer), dtype=dtype, seed=seed),
        text_tokenizer=tokenizer,
        vae=cast(vae, dtype),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        enable_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_call(pipe, task: str, generator: torch.Generator, guided: bool) -> dict:
    """A call of the tiny pipeline: one video of 9 frames of 32×48 (3×2×3 patches), a prompt and a negative prompt of
    as many tokens (both items recorded under guidance), without the call's metadata sentences."""
    words = "fox cat dog bird fish horse car boat tree river".split()
    pick = torch.randint(0, len(words), (4,), generator=generator).tolist()
    call = dict(prompt=f"a {words[pick[0]]} {words[pick[1]]}", negative_prompt=f"a {words[pick[2]]} {words[pick[3]]}")
    call.update(num_frames=9, height=32, width=48, guidance_scale=6.0 if guided else 1.0)
    return {**call, "add_resolution_template": False, "add_duration_template": False, "enable_safety_check": False}


SPEC = ModelSpec(
    "cosmos3",
    (Cosmos3OmniTransformer,),
    (Site("layers", "self_attn", count_key="num_hidden_layers"),),
    {Cosmos3AttnProcessor: Cosmos3AttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    known=KNOWN,
    text_len=TEXT_LEN,
    refused={
        "text_to_video": "Cosmos 3's text queries attend only earlier text (its causal call): their probabilities on "
        "the video are 0 by construction. Use 'video_to_text'.",
        "video_to_image": "Cosmos 3 has no image attention; a conditioning image is the video's first latent frame.",
    },
    guidance_calls=2,  # the prompt's call, then the negative prompt's
    guidance=guidance_on,
    head_shape=lambda config: (int(config["num_attention_heads"]), int(config["head_dim"])),
    output_call=False,  # two calls, one causal, with grouped key/value heads: the layer keeps the stock calls
    title="Cosmos 3",
    group_masked=lambda config: True,  # the text rows causal
    frame_counts="1, 5, 9, ..., 189",
    pipelines={"text-to-video": "Cosmos3OmniPipeline"},
    prompt_text=prompt_text,
    negative_template={"negative": True},  # the inverse metadata sentences (prompt_text)
)
