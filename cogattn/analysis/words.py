"""Text tokens of a prompt as the pipeline feeds them to the transformer, and the token positions of a
word of it: what names the text axis of a map and finds a word in it (no plotting here).

```python
from cogattn.analysis.words import PromptFormat, text_tokens, word_positions
text_tokens(pipe, prompt, 226)[:5]                           # ['▁a', '▁red', '▁fox', ...]
word_positions("fox", pipe, prompt, 226)                     # [2]: rows of video_to_text for "fox"
word_positions("fox", hunyuan, prompt, 256)                  # its LLaMA template cropped: 'a' is token 0
word_positions("fox", PromptFormat(hunyuan, template), prompt, 256)  # a call that passed prompt_template=
```

Pass the pipeline: its family says how its pipeline makes the transformer's text of a prompt
(:class:`PromptFormat`; ``ModelSpec.prompt_text``), so that token ``i`` of the labels is token ``i`` of
the text the transformer reads. HunyuanVideo puts the prompt in its LLaMA template and crops the
template's ``crop_start`` tokens (the BOS among them; image-to-video also the assistant header after the
prompt); EasyAnimate puts it in its tokenizer's chat template (Qwen2-VL's system and role tokens come
before it, in the text); Wan's pipelines clean the prompt first (:func:`clean_prompt`); the T5 families
(CogVideoX, ConsisID, Mochi) tokenize it as it is. A tokenizer passed alone (``pipe.tokenizer``) reads
the bare prompt: right for those T5 families only.

The text length is the T of ``video_to_text``: ``layout.prompt_len`` (226 in CogVideoX, whose text is in
the sequence; Wan's ``context_len``, 512, whose text is in a separate cross-attention). Where image tokens
lead the text (HunyuanVideo image-to-video, FramePack), ``prompt_start=layout.prompt_start`` skips them:
they are named ``"<image>"`` and are never a word. A fast tokenizer's character offsets find a word
exactly, in the prompt only (never in its template); pieces of a slow sentencepiece one (T5, UMT5) are
grouped at their ``▁`` word-start marker.
"""

from __future__ import annotations

import re

from ..models import spec_for_module
from ..models.prompt_text import PromptText, pipeline_text, plain_text

__all__ = ["IMAGE_TOKEN", "PromptFormat", "PromptText", "clean_prompt", "text_tokens", "word_positions"]

IMAGE_TOKEN = "<image>"  # the name of an image token that leads the text (HunyuanVideo image-to-video)


def clean_prompt(prompt: str) -> str:
    """The prompt as Wan's pipelines tokenize it: diffusers' own ``prompt_clean`` (ftfy, HTML entities
    unescaped twice, runs of white space made one space)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(prompt)


class PromptFormat:
    """How a pipeline makes the transformer's text of a prompt: its tokenizer and its family's template and
    crop (``ModelSpec.prompt_text``). Pass it where a tokenizer is asked for (:func:`text_tokens`,
    :func:`word_positions`, the plots' ``tokenizer=``) for a call that passed its own ``prompt_template``;
    the pipeline itself stands for its default one.

    Args:
        pipeline: the diffusers pipeline of the generation.
        template (`dict`, *optional*): the call's ``prompt_template`` (HunyuanVideo); left out: the
            pipeline's default.
    """

    def __init__(self, pipeline, template: dict | None = None):
        tokenizer = getattr(pipeline, "tokenizer", None)
        if tokenizer is None:
            raise TypeError(f"{type(pipeline).__name__} has no tokenizer; pass a pipeline or a tokenizer.")
        spec = spec_for_module(getattr(pipeline, "transformer", None))
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's (Qwen2VLProcessor: Kandinsky 5)
        self.pipeline, self.tokenizer, self.template = pipeline, tokenizer, template
        self._text = (spec.prompt_text if spec is not None else None) or pipeline_text

    @property
    def pad_token(self):
        """The tokenizer's padding token."""
        return getattr(self.tokenizer, "pad_token", None)

    def encode(self, prompt: str, length: int, offsets: bool = False) -> PromptText:
        """The ``length`` text tokens of ``prompt`` the transformer reads (with character offsets)."""
        return self._text(self.pipeline, prompt, length, self.template, offsets)


class _Bare:
    """A tokenizer passed alone: the bare prompt (cleaned as Wan does with ``clean``)."""

    def __init__(self, tokenizer, clean: bool):
        self.tokenizer, self.clean = tokenizer, clean

    def encode(self, prompt: str, length: int, offsets: bool = False) -> PromptText:
        return plain_text(self.tokenizer, prompt, length, offsets, clean_prompt if self.clean else None)


def _format(source, clean: bool):
    if isinstance(source, PromptFormat):
        return source
    if hasattr(source, "convert_ids_to_tokens"):
        return _Bare(source, clean)
    if getattr(source, "tokenizer", None) is not None:
        return PromptFormat(source)
    raise TypeError(f"{type(source).__name__} is not a pipeline, a PromptFormat or a tokenizer; pass `pipe`.")


def text_tokens(tokenizer, prompt: str, text_len: int, *, clean: bool = False, prompt_start: int = 0) -> list[str]:
    """The ``text_len`` text tokens of ``prompt`` as the pipeline feeds them to the transformer.

    Args:
        tokenizer: the pipeline (``pipe``: its family's template and crop apply), a :class:`PromptFormat`
            (a call's own ``prompt_template``), or a tokenizer alone (``pipe.tokenizer``: the bare prompt,
            right for the T5 families only).
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout, ``layout.prompt_len`` (``max_sequence_length`` of
            the call).
        clean (`bool`, defaults to `False`): with a tokenizer alone, tokenize :func:`clean_prompt` of the
            prompt, as Wan does (a pipeline cleans it where its own pipeline does).
        prompt_start (`int`, defaults to 0): image tokens before the prompt's, ``layout.prompt_start``
            (HunyuanVideo image-to-video), each named ``"<image>"``.

    Returns:
        `list[str]`: ``text_len`` token strings, the template's kept tokens and padding included.
    """
    fmt = _format(tokenizer, clean)
    skip = _start(prompt_start, text_len)
    ids = fmt.encode(prompt, text_len - skip).ids if text_len > skip else []
    return [IMAGE_TOKEN] * skip + [str(t) for t in fmt.tokenizer.convert_ids_to_tokens(ids)]


def _start(prompt_start: int, text_len: int) -> int:
    if not 0 <= int(prompt_start) <= int(text_len):
        raise ValueError(f"prompt_start={prompt_start}; the prompt's tokens start in 0..{text_len} of the text.")
    return int(prompt_start)


def _norm_word(text: str) -> str:
    return re.sub(r"[^\w]", "", text.replace("▁", "")).lower()


def word_positions(
    word: str, tokenizer, prompt: str, text_len: int, *, clean: bool = False, prompt_start: int = 0
) -> list[int]:
    """Text-token positions whose pieces form ``word`` in ``prompt``, for every occurrence of it.

    A word may be several sentencepiece pieces (``'▁fox', 'hound'``); all of them are returned. A fast
    tokenizer's character offsets give the exact pieces of the prompt (never of its template);
    otherwise pieces are grouped into words at the ``▁`` word-start marker.

    Args:
        word (`str`): one or more words of the prompt (case-insensitive).
        tokenizer: the pipeline (``pipe``), a :class:`PromptFormat`, or a tokenizer alone (the bare
            prompt), as for :func:`text_tokens`.
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout, ``layout.prompt_len``.
        clean (`bool`, defaults to `False`): with a tokenizer alone, find the word in :func:`clean_prompt`
            of the prompt, the text Wan tokenizes.
        prompt_start (`int`, defaults to 0): image tokens before the prompt's, ``layout.prompt_start``
            (HunyuanVideo image-to-video): the positions count them, and none of them is a word.

    Returns:
        `list[int]`: sorted token positions in ``prompt_start .. text_len - 1``.

    Raises:
        ValueError: the word is not in the prompt, or was cut off at ``text_len`` tokens.
    """
    core = re.sub(r"^\W+|\W+$", "", word)  # "Fox," means the word fox: punctuation is not part of a word
    if not core:
        raise ValueError(f"word {word!r} has no letters or digits; pass a word of the prompt.")
    fmt = _format(tokenizer, clean)
    skip = _start(prompt_start, text_len)
    fast = bool(getattr(fmt.tokenizer, "is_fast", False))
    enc = fmt.encode(prompt, text_len - skip, offsets=fast) if text_len > skip else PromptText([], "", (0, 0), [])
    positions: list[int] = []
    if fast:
        text, (a0, b0) = enc.text, enc.prompt
        for m in re.finditer(r"(?<!\w)" + re.escape(core) + r"(?!\w)", text[a0:b0], re.IGNORECASE):
            a, b = a0 + m.start(), a0 + m.end()
            positions += [
                i for i, (s, e) in enumerate(enc.spans) if e > s and e > a and s < b and re.search(r"\w", text[s:e])
            ]
    else:
        pieces = fmt.tokenizer.convert_ids_to_tokens(enc.ids)
        special = set(getattr(fmt.tokenizer, "all_special_tokens", []))
        words: list[list[int]] = []  # token positions of each word, in order
        for i, piece in enumerate(pieces):
            if piece in special:
                continue
            if not words or piece.startswith("▁") or (i > 0 and pieces[i - 1] in special):
                words.append([])
            words[-1].append(i)
        texts = [_norm_word("".join(pieces[i] for i in w)) for w in words]
        target = [_norm_word(w) for w in core.split()]
        for k in range(len(words) - len(target) + 1):
            if target and texts[k : k + len(target)] == target:
                # punctuation glued to a word ("fox" ",") and lone "▁" pieces are not part of it
                positions += [i for w in words[k : k + len(target)] for i in w if _norm_word(pieces[i])]
    if not positions:
        shown = text_tokens(fmt, prompt, text_len - skip)
        pad, n = getattr(fmt.tokenizer, "pad_token", None), len(shown)
        while n and pad is not None and shown[n - 1] == pad:  # 512 tokens of Wan are mostly padding
            n -= 1
        tail = f" then {len(shown) - n} × {pad!r}" if n < len(shown) else ""
        where = f"{text_len - skip} text tokens after {skip} image tokens" if skip else f"first {text_len} text tokens"
        said = enc.text[enc.prompt[0] : enc.prompt[1]] if enc.text else prompt
        raise ValueError(
            f"word {word!r} is not among the {where} of the prompt {said!r}; its tokens "
            f"are {shown[:n]}{tail}. Pass a word of the prompt, or token indices 0..{text_len - 1}."
        )
    return sorted({skip + i for i in positions})
