"""Kandinsky 5.0 Video (text-to-video and image-to-video): the map processor, the family's facts and its tiny
pipelines (built in ``tiny.py``; docs/design.md, "The model seam").

The transformer first runs its text blocks (``text_transformer_blocks``: a self-attention over the Qwen2.5-VL text
alone, no capture site), then its visual blocks (``visual_transformer_blocks``), each a self-attention over the
video (``self_attention``: RMS norms per head, 3-D RoPE) and a cross-attention from the video to the text blocks'
output (``cross_attention``, no key mask: every token the pipeline encoded is attended, the padding of a batch of
prompts of different lengths too). Both are ``Kandinsky5Attention`` modules run by ``Kandinsky5AttnProcessor``;
:class:`Kandinsky5AttnMapProcessor` is that processor line for line, plus the lines that hand q and k to the
recording. The self-attention feeds the self-attention kinds, the cross-attention ``video_to_text``.

The latents are channels-last, ``(B, F, H, W, C)``; the patch embedding keeps the (frame, row, column) axes and
the dense mode flattens them in that order (``fractal_flatten`` without a block mask): the sequence is the
video's own raster order, video token ``f·Hp·Wp + y·Wp + x``. The text is not padded to a fixed length: the
cross-attention's T is the prompt's own tokens after the template's crop (at most ``max_sequence_length``), read
from each call; a step's two calls under guidance (the conditional one first, then the negative prompt's) may
differ in T, so ``video_to_text`` of both halves needs a negative prompt of the prompt's length (``batch="cond"``,
the default under guidance, records the prompt's alone).

The sparse mode (``attention_type="nabla"``, the 10 s Lite checkpoints; the pipelines make its ``sparse_params``)
reorders the tokens into 8×8 patches of each latent frame (``fractal_flatten`` with a block mask: 64-token blocks in
(f, y // 8, x // 8) order, each block in raster order) and runs flex attention under a ``BlockMask`` made per call
and per head from pooled q·k (``nablaT_v2``: the fewest key blocks reaching NABLA's mass P, or an STA window). The
processor hands the recording q, k and v put back in the video's order (:func:`video_order`, from the model's own
``fractal_flatten``; the cross-attention's queries too), so every kind reads as in the dense mode, and:

- the attention as the call computed it. Flex attention run eagerly (torch's unfused implementation, which runs
  without torch.compile; a recording runs a compiled transformer uncompiled) applies a ``BlockMask``'s ``mask_mod``
  alone, and NABLA's has none: the call computes dense attention (seen with torch 2.13 on a CPU), and the maps are
  dense. A kernel that skips the blocks the mask leaves out (compiled flex attention) computes the sparse
  attention: the maps then hold the masked pairs at exactly 0. Which one ran is read from the call's own output
  (:func:`mask_in_output`, a few rows recomputed both ways in float64); the mask goes to the recording as a
  per-head mask over the 64-token blocks (``processor.GroupMask``), which row tiles apply (every kind of such a
  call comes from row tiles).
- each captured call's ``"nabla_recall"``, float64 ``(B, H)``: the mean over queries of the dense attention's mass
  on the keys NABLA's mask keeps, ``exp(lse_kept − lse_all)`` per row (:func:`kept_mass`), whichever attention ran:
  how much of the dense attention the production sparse mask keeps. It lives in ``Recording.call_stats``
  (``(step, layer, "nabla_recall")`` → ``(slots, H)``, NaN for a slot whose call was not captured) and run.json's
  ``call_stats`` (null for NaN). It costs one more pass over q·kᵀ per captured layer, its tiles within
  ``memory_budget``. Under NABLA the layer's output call is always the stock one (``layer_output`` is not used).
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref

import torch
import torch.nn.functional as F

from ...layout import TokenLayout
from ...recorder.processor import GroupMask, MapSink
from ..prompt_text import in_template, kept, tokenize
from ..spec import ModelSpec, Site, Unavailable, call_argument, text_never_queries

# Attention shapes of the released checkpoints (the Kandinsky-5 repository's configs, which diffusers' conversion
# carries over), for plans made offline. The 10 s Lite checkpoints run NABLA sparse attention.
_K5 = {
    "_class_name": "Kandinsky5Transformer3DModel",
    "in_visual_dim": 16,
    "out_visual_dim": 16,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
    "patch_size": [1, 2, 2],
    "visual_cond": True,
}
_LITE = {**_K5, "time_dim": 512, "model_dim": 1792, "ff_dim": 7168, "num_text_blocks": 2, "num_visual_blocks": 32}
_LITE["axes_dims"] = [16, 24, 24]
_NABLA = {"attention_type": "nabla", "attention_P": 0.9, "attention_wT": 11, "attention_wH": 3, "attention_wW": 3}
_NABLA.update(attention_add_sta=True, attention_method="topcdf")
_PRO = {**_K5, "time_dim": 1024, "model_dim": 4096, "ff_dim": 16384, "num_text_blocks": 4, "num_visual_blocks": 60}
_PRO["axes_dims"] = [32, 48, 48]
KNOWN: dict[str, dict] = {
    **{
        f"kandinskylab/Kandinsky-5.0-T2V-Lite-{stage}-5s-Diffusers": {**_LITE, "attention_type": "regular"}
        for stage in ("sft", "nocfg", "distilled16steps", "pretrain")
    },
    **{
        f"kandinskylab/Kandinsky-5.0-T2V-Lite-{stage}-10s-Diffusers": {**_LITE, **_NABLA}
        for stage in ("sft", "nocfg", "distilled16steps", "pretrain")
    },
    "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers": _PRO,
    "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers": _PRO,
}

try:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_kandinsky import (
        Kandinsky5AttnProcessor,
        Kandinsky5Transformer3DModel,
        fractal_flatten,
        nablaT_v2,
    )
except ImportError:
    needs = "Kandinsky 5 needs diffusers >= 0.36 (Kandinsky5Transformer3DModel)"
    raise Unavailable("kandinsky5", needs, KNOWN) from None
from .tiny import TINY_TEXT_LEN, tiny_call, tiny_pipeline, tiny_transformer  # noqa: E402

__all__ = [
    "SPEC",
    "KNOWN",
    "Kandinsky5AttnMapProcessor",
    "TEXT_LEN",
    "TINY_TEXT_LEN",
    "head_shape",
    "kept_blocks",
    "kept_mass",
    "layout_for_video",
    "mask_in_output",
    "prompt_text",
    "read_call",
    "tiny_pipeline",
    "tiny_transformer",
    "video_order",
]

TEXT_LEN = 512  # the pipelines' max_sequence_length: the most Qwen tokens a prompt keeps after the crop
VAE_SPATIAL = 8  # HunyuanVideo's VAE: pixels per latent pixel, each way
VAE_TEMPORAL = 4  # pixel frames per latent frame after the first


NABLA_BLOCK = 64  # tokens of a NABLA block: an 8×8 patch of one latent frame
# per recording: the running call's video_order (None: dense), set by a block's self-attention for its cross-attention
_ORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=8)  # every visual block of every step asks for it
def video_order(visual_shape: tuple[int, int, int], device: str = "cpu") -> torch.Tensor:
    """``(S,)``: the sequence position, under NABLA, of each video token in the video's own order (f, y, x): the
    model's own ``fractal_flatten`` of the tokens' indices (``visual_shape`` ``(F, Hp, Wp)`` in patches)."""
    index = torch.arange(math.prod(visual_shape), device=device).view(1, *visual_shape, 1)
    flat, _ = fractal_flatten(index, index, (1, *visual_shape), block_mask=True)
    return flat.flatten().argsort()


def in_video_order(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(B, S, ...)`` with its tokens in the video's order (`None`: they are)."""
    return x if order is None else x.index_select(1, order)


def kept_blocks(block_mask) -> torch.Tensor:
    """Boolean ``(B, H, N, N)``: the key blocks each query block attends under NABLA's ``BlockMask`` (its full blocks
    and its partial ones, which with no ``mask_mod`` are attended whole), read from the mask the model runs."""
    mod = getattr(block_mask.mask_mod, "__name__", "noop_mask")  # None (no mask_mod) has no name
    if mod != "noop_mask" and block_mask.kv_num_blocks.any():
        raise ValueError("cogattn reads NABLA block masks of whole blocks; this one masks inside its blocks.")
    return block_mask.to_dense().bool()


def _block_rows(keep: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``(r, S)``: the keys one head's block mask ``keep`` ``(N, N)`` keeps for query blocks ``blocks``, by token."""
    return keep.index_select(0, blocks).repeat_interleave(NABLA_BLOCK, -1)


def kept_mass(query: torch.Tensor, key: torch.Tensor, keep: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """NABLA's recall, float64 ``(B, H)``: the mean over queries of the dense attention's mass on the keys the block
    mask ``keep`` ``(B, H, N, N)`` keeps, ``exp(lse_kept − lse_all)`` per query row, the float32 log-sum-exps of each
    row's scores over the kept keys and over all of them, from ``query``, ``key`` ``(B, S, H, D)`` in the model's
    token order, one head and ``rows`` query rows at a time: about ``2.25 · rows · S · 4`` bytes of tiles (216 MB
    at S = 93,696 and 256 rows), which the processor fits to the recording's ``memory_budget``."""
    B, S, H, D = query.shape
    scale, total = D**-0.5, torch.zeros(B, H, dtype=torch.float64, device=query.device)
    for b in range(B):
        for h in range(H):
            k = key[b, :, h].float()
            for r0 in range(0, S, rows):
                r1 = min(S, r0 + rows)
                scores = (query[b, r0:r1, h].float() @ k.T).mul_(scale)  # (r, S)
                blocks = torch.arange(r0, r1, device=query.device) // NABLA_BLOCK
                kept = _block_rows(keep[b, h], blocks)
                ratio = torch.logsumexp(scores.masked_fill(~kept, -torch.inf), -1) - torch.logsumexp(scores, -1)
                total[b, h] += ratio.exp().double().sum()  # on the device: no sync per tile
    return total.cpu() / S


def mask_in_output(query, key, value, out, keep: torch.Tensor) -> bool:
    """Whether the call's output ``out`` ``(B, S, H, D)`` is the softmax over the blocks NABLA keeps (a kernel that
    skips the others: compiled flex attention) rather than over every key (eager flex attention, which applies only
    a ``BlockMask``'s ``mask_mod``, and NABLA's has none): up to 4 query rows of the first item and head whose mask
    leaves a block out, recomputed both ways in float64 from that head's q, k, v; the closer one is the model's."""
    masked_any = (~keep).any(-1)  # (B, H, N): query blocks that leave a key block out
    if not bool(masked_any.any()):
        return False
    b, h = (int(i) for i in masked_any.any(-1).nonzero()[0])
    blocks = masked_any[b, h].nonzero().flatten()[:4]
    rows = blocks * NABLA_BLOCK
    k, v = key[b, :, h].double(), value[b, :, h].double()  # (S, D): one head's, not the call's whole q, k, v
    scores = query[b, rows, h].double() @ k.T / k.shape[-1] ** 0.5  # (r, S)
    got = out[b, rows, h].double()
    dense = torch.softmax(scores, -1) @ v
    masked = torch.softmax(scores.masked_fill(~_block_rows(keep[b, h], blocks), -torch.inf), -1) @ v
    return bool((masked - got).abs().max() < (dense - got).abs().max())


class Kandinsky5AttnMapProcessor:
    """Drop-in for ``Kandinsky5AttnProcessor`` (the visual blocks' self- and cross-attention) that also feeds q, k
    to a recording.

    Args:
        sink (`MapSink`): where maps go: a ``cogattn.Recording(pipe, ...)``, which knows the layer and the role
            (self- or cross-attention) of each module.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, sink: MapSink):
        if not hasattr(F, "scaled_dot_product_attention"):
            raise ImportError(f"{self.__class__.__name__} requires PyTorch 2.0. Please upgrade your pytorch version.")
        self.sink = sink

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        cross = encoder_hidden_states is not None
        # query, key, value = self.get_qkv(x)
        query = attn.to_query(hidden_states)

        if encoder_hidden_states is not None:
            key = attn.to_key(encoder_hidden_states)
            value = attn.to_value(encoder_hidden_states)

            shape, cond_shape = query.shape[:-1], key.shape[:-1]
            query = query.reshape(*shape, attn.num_heads, -1)
            key = key.reshape(*cond_shape, attn.num_heads, -1)
            value = value.reshape(*cond_shape, attn.num_heads, -1)

        else:
            key = attn.to_key(hidden_states)
            value = attn.to_value(hidden_states)

            shape = query.shape[:-1]
            query = query.reshape(*shape, attn.num_heads, -1)
            key = key.reshape(*shape, attn.num_heads, -1)
            value = value.reshape(*shape, attn.num_heads, -1)

        # query, key = self.norm_qk(query, key)
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)

        def apply_rotary(x, rope):
            x_ = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
            x_out = (rope * x_).sum(dim=-1)
            return x_out.reshape(*x.shape).to(torch.bfloat16)

        if rotary_emb is not None:
            query = apply_rotary(query, rotary_emb).type_as(query)
            key = apply_rotary(key, rotary_emb).type_as(key)

        if sparse_params is not None:
            attn_mask = nablaT_v2(
                query,
                key,
                sparse_params["sta_mask"],
                thr=sparse_params["P"],
            )

        else:
            attn_mask = None

        layer = self.sink.layer_to_capture(attn)
        if not cross:  # NABLA's tokens are in 8×8 patches, the block's cross-attention's queries too
            shape = None if sparse_params is None else tuple(int(n) for n in sparse_params["visual_shape"])
            _ORDERS[self.sink] = None if shape is None else video_order(shape, str(query.device))
        order = _ORDERS.get(self.sink)
        q = None if layer is None else in_video_order(query, order).transpose(1, 2)  # (B, H, S, D), video order
        fused = (
            None
            if layer is None or cross or attn_mask is not None  # the opt-in output call: the dense self-attention's
            else self.sink.attention(layer, q, key.transpose(1, 2), value.transpose(1, 2))
        )
        if fused is None:
            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attn_mask,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        else:
            hidden_states = fused[0].transpose(1, 2).to(query.dtype)
        if layer is not None and cross:
            self.sink.capture_context(layer, q, key.transpose(1, 2), "text")
        elif layer is not None:
            k = in_video_order(key, order).transpose(1, 2)
            v = in_video_order(value, order).transpose(1, 2) if self.sink.wants_value else None
            lse, sums = (None, None) if fused is None else fused[1:]
            mask = None
            if attn_mask is not None:  # the blocks NABLA keeps, where the kernel skipped the others
                keep = kept_blocks(attn_mask)
                rows = max(1, min(256, self.sink.options.memory_budget // (9 * query.shape[1])))  # 2.25·rows·S·4 B
                self.sink.capture_stat(layer, "nabla_recall", kept_mass(query, key, keep, rows))
                if mask_in_output(query, key, value, hidden_states, keep):
                    mask = GroupMask(keep, order // NABLA_BLOCK)
            self.sink.capture(layer, q, k, lse, sums, mask=mask, value=v)

        hidden_states = hidden_states.flatten(-2, -1)

        attn_out = attn.out_layer(hidden_states)
        return attn_out


def read_call(config, args: tuple, kwargs: dict):
    """``(layout, batch_size, timestep, device)`` of one ``Kandinsky5Transformer3DModel`` call: channels-last latents
    ``(B, F, H, W, C)`` in patches of ``patch_size`` (t, h, w), and the text of the cross-attention ``(B, T, C)``.
    Under NABLA (``sparse_params``) the grid must be the ``visual_shape`` the mask is made for; raises `ValueError`
    otherwise."""
    hidden = call_argument(args, kwargs, 0, "hidden_states")
    text = call_argument(args, kwargs, 1, "encoder_hidden_states")
    t = call_argument(args, kwargs, 2, "timestep")
    sparse = call_argument(args, kwargs, 7, "sparse_params")
    t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
    p_t, p_h, p_w = (int(p) for p in config["patch_size"])
    _, frames, height, width, _ = hidden.shape
    grid = (frames // p_t, height // p_h, width // p_w)
    if sparse is not None and (not sparse.get("to_fractal") or tuple(sparse.get("visual_shape", ())) != grid):
        raise ValueError(
            f"this Kandinsky 5 call runs NABLA with to_fractal={sparse.get('to_fractal')!r} and visual_shape="
            f"{sparse.get('visual_shape')!r}; cogattn records it on the call's own grid {grid} in 8×8 patches, as "
            "the pipelines' get_sparse_params makes them."
        )
    layout = TokenLayout(
        text_len=0,
        frames=frames // p_t,
        height=height // p_h,
        width=width // p_w,
        patch_size=p_h,
        patch_size_t=p_t if p_t > 1 else None,
        context_len=int(text.shape[1]),
        temporal_compression=VAE_TEMPORAL,
    )
    return layout, hidden.shape[0], t, hidden.device


def layout_for_video(config: dict, num_frames: int, height: int, width: int, text_len: int | None) -> TokenLayout:
    """The layout of a Kandinsky 5 pipeline call: ``(num_frames − 1) // 4 + 1`` latent frames of ``height / 16`` ×
    ``width / 16`` patches (an 8× VAE, patches of 2), and ``text_len`` text tokens in the cross-attention (its
    upper bound, the pipelines' ``max_sequence_length`` 512, when `None`: a prompt keeps its own length)."""
    p_t, p, _ = (int(x) for x in config.get("patch_size", (1, 2, 2)))
    return TokenLayout.for_video(
        num_frames,
        height,
        width,
        0,
        p,
        p_t if p_t > 1 else None,
        spatial_compression=VAE_SPATIAL,
        context_len=text_len or TEXT_LEN,
        temporal_compression=VAE_TEMPORAL,
    )


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False):
    """The ``length`` text tokens the transformer reads for ``prompt``, as Kandinsky 5's pipelines make them
    (``_encode_prompt_qwen``; ``ModelSpec.prompt_text``): the prompt cleaned (the pipeline module's
    ``prompt_clean``) in the pipeline's system template (``prompt_template``), its first
    ``prompt_template_encode_start_idx`` tokens cropped (128 with Qwen2.5-VL's tokenizer), then the prompt's tokens
    and the template's closing ``<|im_end|>``, padded on the right as a batch of longer prompts pads it.
    ``template`` is unused (the call takes none). Raises `ValueError` for a prompt the pipeline cut (longer than
    its ``max_sequence_length``): it cuts the template's text by characters, so its tokens are not named."""
    tokenizer = getattr(pipeline.tokenizer, "tokenizer", pipeline.tokenizer)  # a Qwen2VLProcessor's own tokenizer
    clean = getattr(inspect.getmodule(type(pipeline)), "prompt_clean", None)
    text = in_template(clean(prompt) if clean else prompt, pipeline.prompt_template.format)
    crop = int(pipeline.prompt_template_encode_start_idx)
    whole = len(tokenizer(text.text, add_special_tokens=True)["input_ids"])
    if whole > crop + length:
        raise ValueError(
            f"this prompt makes {whole - crop} text tokens after the template's {crop}, more than the {length} the "
            "transformer read: the pipeline cut it (max_sequence_length) by characters, whose tokens cogattn does "
            "not name; read the prompt's columns from the text axis, or pass a shorter prompt."
        )
    return kept(tokenize(tokenizer, text.text, crop + length, offsets), text, list(range(crop, crop + length)))


def head_shape(config: dict) -> tuple[int, int]:
    """``(heads, head dim)`` of a Kandinsky 5 transformer: heads of ``sum(axes_dims)`` channels over ``model_dim``."""
    head_dim = sum(int(a) for a in config["axes_dims"])
    return int(config["model_dim"]) // head_dim, head_dim


def call_rules(cfg, config: dict) -> None:
    """The batch tool's Kandinsky 5 rule (``ModelSpec.call_rules``): a NABLA checkpoint (the 10 s ones) runs only
    under flex attention, which the batch tool does not set up, so it is refused: record it from Python."""
    if config.get("attention_type") == "nabla":
        raise ValueError(
            f"model: {cfg.model} runs NABLA sparse attention, which needs flex attention; the batch tool runs the dense "
            'checkpoints: record it from Python (pipe.transformer.set_attention_backend("flex"), then cogattn.record).'
        )


SPEC = ModelSpec(
    "kandinsky5",
    (Kandinsky5Transformer3DModel,),
    (Site("visual_transformer_blocks", "self_attention", context="cross_attention", count_key="num_visual_blocks"),),
    {Kandinsky5AttnProcessor: Kandinsky5AttnMapProcessor},
    read_call,
    layout_for_video,
    tiny_pipeline=tiny_pipeline,
    tiny_transformer=tiny_transformer,
    tiny_call=tiny_call,
    tiny_tasks=("text-to-video", "image-to-video"),
    config_keys=("num_visual_blocks",),
    known=KNOWN,
    text_len=TEXT_LEN,
    context_kinds={"video_to_text": "text"},
    refused={
        "text_to_video": text_never_queries("Kandinsky 5"),
        "video_to_image": "Kandinsky 5 has no image attention: an image to animate is the video's first latent "
        "frame, on the latents' channels.",
    },
    guidance_calls=2,  # the conditional call, then the negative prompt's
    title="Kandinsky 5",
    group_masked=lambda config: config.get("attention_type") == "nabla",  # its mask, where a kernel applies it
    frame_counts="5, 9, ..., 121, ..., 241",
    pipelines={"text-to-video": "Kandinsky5T2VPipeline", "image-to-video": "Kandinsky5I2VPipeline"},
    head_shape=head_shape,
    prompt_text=prompt_text,
    call_rules=call_rules,
)
