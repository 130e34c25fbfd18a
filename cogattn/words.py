"""Text tokens of a prompt as the pipeline feeds them to the transformer, and the token positions of a
word of it: what names the text axis of a map and finds a word in it (no plotting here).

```python
from cogattn.words import text_tokens, word_positions
text_tokens(pipe.tokenizer, prompt, 226)[:5]                 # ['▁a', '▁red', '▁fox', ...]
word_positions("fox", pipe.tokenizer, prompt, 226)           # [2]: rows of video_to_text for "fox"
word_positions("fox", wan.tokenizer, prompt, 512, clean=True)  # Wan: its 512 UMT5 tokens, cleaned prompt
```

The text length is the T of ``video_to_text``: ``layout.prompt_len`` (226 in CogVideoX, whose text is in
the sequence; Wan's ``context_len``, 512, whose text is in a separate cross-attention). Where image tokens
lead the text (HunyuanVideo image-to-video), ``prompt_start=layout.prompt_start`` skips them: they are
named ``"<image>"`` and are never a word. Any tokenizer
with the ``transformers`` call works: a fast one's character offsets find a word exactly, and pieces of
a slow sentencepiece one (T5, UMT5) are grouped at their ``▁`` word-start marker.
"""

from __future__ import annotations

import re

__all__ = ["IMAGE_TOKEN", "clean_prompt", "text_tokens", "word_positions"]

IMAGE_TOKEN = "<image>"  # the name of an image token that leads the text (HunyuanVideo image-to-video)


def clean_prompt(prompt: str) -> str:
    """The prompt as Wan's pipelines tokenize it: diffusers' own ``prompt_clean`` (ftfy, HTML entities
    unescaped twice, runs of white space made one space)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(prompt)


def _encode(tokenizer, prompt: str, text_len: int, offsets: bool) -> dict:
    # The pipelines' own call (CogVideoXPipeline and WanPipeline._get_t5_prompt_embeds): positions then
    # match the maps.
    kwargs = {"padding": "max_length", "max_length": text_len, "truncation": True, "add_special_tokens": True}
    if offsets:
        kwargs["return_offsets_mapping"] = True
    return tokenizer(prompt, **kwargs)


def text_tokens(tokenizer, prompt: str, text_len: int, *, clean: bool = False, prompt_start: int = 0) -> list[str]:
    """The ``text_len`` text tokens of ``prompt`` as the pipeline feeds them to the transformer.

    Args:
        tokenizer: the pipeline's tokenizer (``pipe.tokenizer``).
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout, ``layout.prompt_len`` (``max_sequence_length`` of
            the call).
        clean (`bool`, defaults to `False`): tokenize :func:`clean_prompt` of the prompt, as Wan does.
        prompt_start (`int`, defaults to 0): image tokens before the prompt's, ``layout.prompt_start``
            (HunyuanVideo image-to-video), each named ``"<image>"``.

    Returns:
        `list[str]`: ``text_len`` token strings, padding included.
    """
    prompt = clean_prompt(prompt) if clean else prompt
    skip = _start(prompt_start, text_len)
    ids = _encode(tokenizer, prompt, text_len - skip, offsets=False)["input_ids"] if text_len > skip else []
    return [IMAGE_TOKEN] * skip + [str(t) for t in tokenizer.convert_ids_to_tokens(list(ids))]


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
    tokenizer's character offsets give the exact pieces; otherwise pieces are grouped into words at
    the ``▁`` word-start marker.

    Args:
        word (`str`): one or more words of the prompt (case-insensitive).
        tokenizer: the pipeline's tokenizer.
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout, ``layout.prompt_len``.
        clean (`bool`, defaults to `False`): find the word in :func:`clean_prompt` of the prompt, the text
            Wan tokenizes.
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
    prompt = clean_prompt(prompt) if clean else prompt
    skip = _start(prompt_start, text_len)
    fast = bool(getattr(tokenizer, "is_fast", False))
    none = {"input_ids": [], "offset_mapping": []}  # all the text is image tokens
    enc = _encode(tokenizer, prompt, text_len - skip, offsets=fast) if text_len > skip else none
    positions: list[int] = []
    if fast:
        spans = [tuple(o) for o in enc["offset_mapping"]]
        for m in re.finditer(r"(?<!\w)" + re.escape(core) + r"(?!\w)", prompt, re.IGNORECASE):
            a, b = m.span()
            positions += [
                i for i, (s, e) in enumerate(spans) if e > s and e > a and s < b and re.search(r"\w", prompt[s:e])
            ]
    else:
        pieces = tokenizer.convert_ids_to_tokens(list(enc["input_ids"]))
        special = set(getattr(tokenizer, "all_special_tokens", []))
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
        shown = text_tokens(tokenizer, prompt, text_len - skip)
        pad, n = getattr(tokenizer, "pad_token", None), len(shown)
        while n and pad is not None and shown[n - 1] == pad:  # 512 tokens of Wan are mostly padding
            n -= 1
        tail = f" then {len(shown) - n} × {pad!r}" if n < len(shown) else ""
        where = f"{text_len - skip} text tokens after {skip} image tokens" if skip else f"first {text_len} text tokens"
        raise ValueError(
            f"word {word!r} is not among the {where} of the prompt {prompt!r}; its tokens "
            f"are {shown[:n]}{tail}. Pass a word of the prompt, or token indices 0..{text_len - 1}."
        )
    return sorted({skip + i for i in positions})
