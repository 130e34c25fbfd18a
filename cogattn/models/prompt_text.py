"""The transformer's text tokens of a prompt as a family's pipeline makes them: the tokenizer's call the
pipelines share, a template's text with the prompt's characters in it, and the tokens a pipeline keeps. The
families' ``prompt_text`` (``ModelSpec.prompt_text``) are built from these; :mod:`cogattn.analysis.words` reads them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

__all__ = ["PromptText", "in_template", "kept", "pipeline_text", "plain_text", "tokenize"]


@dataclass(frozen=True)
class PromptText:
    """The transformer's text tokens of one prompt, as its pipeline makes them (image tokens not included).

    Args:
        ids (`list[int]`): the tokens' ids, in the transformer's order (the pipeline's crops made).
        text (`str`): the string the tokenizer read: the prompt in the pipeline's template.
        prompt (`tuple[int, int]`): the prompt's characters in ``text``, ``(start, end)``.
        spans (`list[tuple[int, int]] | None`): each token's characters in ``text`` (a fast tokenizer's
            offsets; special and padding tokens have none); `None` where they were not asked for.
    """

    ids: list[int]
    text: str
    prompt: tuple[int, int]
    spans: list[tuple[int, int]] | None = None


def tokenize(tokenizer, text: str, length: int, offsets: bool, **kwargs) -> dict:
    """The pipelines' tokenizer call (``_get_t5_prompt_embeds``, ``_get_llama_prompt_embeds``,
    ``encode_prompt``): ``text`` padded and truncated to ``length`` tokens, special tokens added."""
    kwargs = {"padding": "max_length", "max_length": length, "truncation": True, "add_special_tokens": True, **kwargs}
    if offsets:
        kwargs["return_offsets_mapping"] = True
    return tokenizer(text, **kwargs)


def in_template(prompt: str, fill) -> PromptText:
    """``PromptText`` without tokens of ``prompt`` put in a template by ``fill`` (``str.format``, a chat
    template): its text and where the prompt is in it."""
    text, marked = fill(prompt), fill("\x00")
    start = marked.find("\x00")
    if start < 0 or text[start : start + len(prompt)] != prompt:  # a template that changes its text
        start = max(text.find(prompt), 0)
    return PromptText([], text, (start, start + len(prompt)))


def kept(enc: dict, text: PromptText, keep: list[int] | None = None) -> PromptText:
    """``text`` with the tokens of the tokenizer's output ``enc`` at ``keep`` (all: `None`), the ones the
    transformer reads."""
    ids = list(enc["input_ids"])
    keep = range(len(ids)) if keep is None else keep
    spans = [tuple(enc["offset_mapping"][i]) for i in keep] if "offset_mapping" in enc else None
    return PromptText([int(ids[i]) for i in keep], text.text, text.prompt, spans)


def plain_text(tokenizer, prompt: str, length: int, offsets: bool, clean=None) -> PromptText:
    # The T5 families' call (CogVideoXPipeline, WanPipeline._get_t5_prompt_embeds): the prompt alone.
    prompt = clean(prompt) if clean is not None else prompt
    return kept(tokenize(tokenizer, prompt, length, offsets), PromptText([], prompt, (0, len(prompt))))


def pipeline_text(pipeline, prompt: str, length: int, template=None, offsets: bool = False) -> PromptText:
    """The transformer's text of a family that puts its prompt in no template (``ModelSpec.prompt_text``'s
    default): the pipeline's tokenizer on the prompt, cleaned first where the pipeline's module has a
    ``prompt_clean`` (Wan and the pipelines made from it), as its ``_get_t5_prompt_embeds`` does."""
    module = inspect.getmodule(type(pipeline))
    return plain_text(pipeline.tokenizer, prompt, length, offsets, getattr(module, "prompt_clean", None))
