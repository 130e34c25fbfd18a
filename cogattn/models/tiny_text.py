"""Tiny tokenizers and encoders the families' tiny pipelines share: built in code, no download.

Each family module builds its tiny pipeline (``cogvideox.tiny_pipeline``, ``wan.tiny_pipeline``, ...) from a
config at toy size, with these for its text: a word-level tokenizer and a 1-layer T5 encoder whose
embeddings have ``TEXT_DIM`` channels; for the families whose text encoder is Qwen2.5-VL (HunyuanVideo 1.5,
Kandinsky 5, Cosmos 2.5), its text model's config (:func:`qwen_text_config`); and, for the families that read an
image with SigLIP (FramePack, HunyuanVideo 1.5), a 1-layer SigLIP vision tower (:func:`tiny_siglip`).
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "TEXT_DIM",
    "TINY_TEXT_LEN",
    "cast",
    "masked_text",
    "qwen_text_config",
    "tiny_clip_text",
    "tiny_qwen_vl",
    "tiny_siglip",
    "tiny_text_encoder",
    "tiny_tokenizer",
]

TINY_TEXT_LEN = 8  # text tokens (max_sequence_length) of the tiny CogVideoX pipeline; pass it to its call
TEXT_DIM = 16
_VOCAB = (
    "a an the of and in on with at to is are red green blue white black small big tiny fox cat dog bird "
    "fish horse car boat tree river sky sea forest city street night day sun snow rain running flying "
    "swimming walking jumping sitting under over slowly quickly camera pan zoom video"
).split()


def cast(model, dtype: torch.dtype):
    """``model`` in ``dtype``, in eval mode (a float32 model is left as built: no cast, no cast warning)."""
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def masked_text(pipe, generator, length: int = 6, kept: int = 4, negative_kept: int = 2) -> dict:
    """A tiny call's text for one video under a text mask (the self-test's): ``length`` random embeddings, the
    prompt's first ``kept`` valid, the negative's (their opposite) first ``negative_kept``, and
    ``max_sequence_length``."""
    device, dtype = pipe._execution_device, pipe.transformer.dtype
    emb = torch.randn(1, length, TEXT_DIM, generator=generator).to(device, dtype)
    keep = torch.arange(length, device=device)[None]
    return dict(
        prompt_embeds=emb,
        prompt_attention_mask=(keep < kept).long(),
        negative_prompt_embeds=-emb,
        negative_prompt_attention_mask=(keep < negative_kept).long(),
        max_sequence_length=length,
    )


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


def qwen_text_config(tokenizer, num_layers: int, positions: int) -> dict:
    """The keyword arguments of a ``Qwen2_5_VLTextConfig`` at toy size over ``tokenizer`` (its chat tokens
    added): ``num_layers`` layers of ``TEXT_DIM`` channels in two 8-wide heads, multimodal RoPE sections (1, 1, 2),
    ``positions`` positions; transformers 5 spells the RoPE options ``rope_parameters``, 4 ``rope_scaling``."""
    from transformers import Qwen2_5_VLTextConfig

    if hasattr(Qwen2_5_VLTextConfig, "rope_parameters"):
        rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]})
    else:
        rope = dict(rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=1e6)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        **rope,
    )


def tiny_text_encoder(
    seed: int = 0, dtype: torch.dtype = torch.float32, vocab_size: int | None = None, width: int = TEXT_DIM
):
    """A random 1-layer ``T5EncoderModel`` whose embeddings have the tiny transformer's text width (or ``width``),
    over the tiny tokenizer's vocabulary (or ``vocab_size`` ids: ByT5's bytes)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size or 3 + len(_VOCAB),
        d_model=width,
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


def tiny_siglip(seed: int, dtype: torch.dtype, dim: int = 12, side: int = 16):
    """A random 1-layer SigLIP vision tower, ``side`` px images in 4 × 4 patches of ``side / 4`` px (16 tokens of
    ``dim`` channels), and its image processor (the PIL one where torchvision is absent)."""
    import transformers
    from transformers import SiglipVisionConfig, SiglipVisionModel

    # without torchvision transformers 5 takes its PIL processor, with a warning: ask for that one
    name = "SiglipImageProcessor" if importlib.util.find_spec("torchvision") else "SiglipImageProcessorPil"
    processor = getattr(transformers, name, None) or transformers.SiglipImageProcessor
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = SiglipVisionConfig(
            hidden_size=dim,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=side,
            patch_size=side // 4,
        )
        encoder = SiglipVisionModel(config)
    return cast(encoder, dtype), processor(size={"height": side, "width": side})


def tiny_qwen_vl(tokenizer):
    """A random ``Qwen2_5_VLForConditionalGeneration`` (Kandinsky 5's and 6's text encoder): a 2-layer text model of
    the tiny text width (:func:`qwen_text_config`) and a 1-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = qwen_text_config(tokenizer, 2, 512)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    vision.update(fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    ids = {name: len(tokenizer) - 1 for name in ("image_token_id", "video_token_id", "vision_start_token_id")}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))


def tiny_clip_text(tokenizer, width: int):
    """A random 1-layer ``CLIPTextModel`` of ``width`` (its pooled output's too), pooling at the tiny tokenizer's
    ``</s>`` (Kandinsky 5's and 6's second text encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=width,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,  # the tiny tokenizer has none; CLIP's default id is past its vocabulary
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(config)
