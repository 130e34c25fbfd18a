"""HunyuanVideo 1.5's texts of a prompt, as its pipelines make them: the Qwen2.5-VL tokens of the prompt in the
pipeline's chat template, the template's first ``prompt_template_encode_start_idx`` tokens cropped
(``_get_mllm_prompt_embeds``), and the ByT5 bytes of the prompt's quoted words (``_get_byt5_prompt_embeds``).
Where each item's tokens sit in the transformer's packed context is the recording's (``text_spans``)."""

from __future__ import annotations

from ..prompt_text import PromptText, in_template, kept, tokenize

__all__ = ["glyph_text", "prompt_crop", "prompt_text"]


def prompt_crop(pipeline) -> int:
    """The template tokens the pipeline crops before the prompt (its ``prompt_template_encode_start_idx``; 0
    where it has none)."""
    crop = getattr(pipeline, "prompt_template_encode_start_idx", None)
    return max(int(crop), 0) if isinstance(crop, int) else 0


def prompt_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The ``length`` Qwen2.5-VL tokens the transformer reads for ``prompt`` (``ModelSpec.prompt_text``): the
    pipeline's ``format_text_input`` (its ``system_message``, an empty prompt made ``" "``) in the tokenizer's
    chat template with the generation prompt, tokenized to the crop + ``length`` tokens, the crop's first
    tokens dropped. ``template`` is unused: the pipelines take no template argument."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    tokenizer, system, crop = pipeline.tokenizer, pipeline.system_message, prompt_crop(pipeline)

    def fill(p: str) -> str:
        chat = format_text_input([p], system)[0]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    text = in_template(prompt or " ", fill)  # the pipeline's own stand-in for an empty prompt
    enc = tokenize(tokenizer, text.text, length + crop, offsets, add_special_tokens=False)
    return kept(enc, text, list(range(crop, crop + length)))


def glyph_text(pipeline, prompt: str, length: int, offsets: bool = False) -> PromptText:
    """The first ``length`` ByT5 tokens of ``prompt``'s quoted words (``ModelSpec.glyph_text``): the pipeline's
    ``extract_glyph_texts`` (``Text "x". Text "y". ``), one token a byte and an end token; no quoted word: none.
    With ``offsets``, each byte's character in that text (the end token has none)."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    glyph = extract_glyph_texts(prompt or "")
    if glyph is None or length <= 0:
        return PromptText([], glyph or "", (0, len(glyph or "")), [] if offsets else None)
    enc = pipeline.tokenizer_2(glyph, padding="max_length", max_length=length, truncation=True)
    ids = [int(i) for i in enc["input_ids"]][:length]
    spans = None
    if offsets:  # ByT5 reads UTF-8 bytes: each byte's token belongs to its character
        chars = [(i, i + 1) for i, c in enumerate(glyph) for _ in c.encode("utf-8")]
        spans = [chars[k] if k < len(chars) else (0, 0) for k in range(len(ids))]
    return PromptText(ids, glyph, (0, len(glyph)), spans)
