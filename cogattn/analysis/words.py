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
the bare prompt: right for those T5 families only, and refused, given ``family=`` (the plots pass the
recording's), for a family whose pipeline makes its text its own way (``ModelSpec.prompt_text``).

The text length is the T of ``video_to_text``: ``layout.prompt_len`` (226 in CogVideoX, whose text is in
the sequence; Wan's ``context_len``, 512, whose text is in a separate cross-attention). Where image tokens
lead the text (HunyuanVideo image-to-video, FramePack), ``prompt_start=layout.prompt_start`` skips them:
they are named ``"<image>"`` and are never a word. Where the model packs each item's text on its own
(HunyuanVideo 1.5: ``[image | glyph | prompt | padding]``, ``TokenLayout.text_parts``), ``spans=`` places the
words at that item's spans (``Recording.text_spans``; :func:`item_spans` picks a slot's): the image tokens
named ``"<image>"``, the glyph tokens as the second tokenizer names them (ByT5's bytes of the quoted words;
``word_positions(..., glyph=True)`` finds a quoted word there), the prompt's tokens at the prompt span, and
the padding after them named as the tokenizer's padding. A fast tokenizer's character offsets find a word
exactly, in the prompt only (never in its template); the pieces of a slow sentencepiece one (T5, UMT5) rebuild
the text it read (``▁`` a space), where a word is found the same way. A word the text length cuts off (only its first
tokens kept) is refused.
"""

from __future__ import annotations

import importlib
import inspect
import re

from ..items import pick_item
from ..models import TABLE, spec_for_module
from ..models import family as family_spec
from ..models.prompt_text import PromptText, pipeline_text, plain_text

__all__ = [
    "IMAGE_TOKEN",
    "PAD_TOKEN",
    "PromptFormat",
    "PromptText",
    "clean_prompt",
    "cleans_prompt",
    "item_spans",
    "pad_name",
    "text_tokens",
    "word_positions",
]

IMAGE_TOKEN = "<image>"  # the name of an image token that leads the text (HunyuanVideo image-to-video)
PAD_TOKEN = "<pad>"  # the name of a packed text's padding where the tokenizer has no padding token of its own
_SEP = "\x01"  # a slow tokenizer's special (and unknown) tokens in its rebuilt text: no part of a word


def clean_prompt(prompt: str) -> str:
    """The prompt as Wan's pipelines tokenize it: diffusers' own ``prompt_clean`` (ftfy, HTML entities
    unescaped twice, runs of white space made one space)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(prompt)


def cleans_prompt(family: str | None) -> bool | None:
    """Whether ``family``'s pipelines clean the prompt before tokenizing it, as Wan's do (their diffusers module has a
    ``prompt_clean``: Wan, SkyReels-V2, ChronoEdit, AnyFlow, Helios, ...; not LTX-Video's or CogVideoX's): the ``clean``
    of a tokenizer alone for a recording of that family. `None` for a family cogattn does not know."""
    try:
        spec = family_spec(family) if family in TABLE else None
    except ValueError:  # a family this diffusers lacks
        return None
    if spec is None:
        return None
    diffusers = importlib.import_module("diffusers")
    classes = [getattr(diffusers, name, None) for name in spec.pipelines.values()]
    return any(hasattr(inspect.getmodule(cls), "prompt_clean") for cls in classes if cls is not None)


class PromptFormat:
    """How a pipeline makes the transformer's text of a prompt: its tokenizer and its family's template and
    crop (``ModelSpec.prompt_text``). Pass it where a tokenizer is asked for (:func:`text_tokens`,
    :func:`word_positions`, the plots' ``tokenizer=``) for a call that passed its own ``prompt_template`` (or, for
    Cosmos 3, whose metadata sentences depend on the call, its arguments); the pipeline itself stands for its default.

    Args:
        pipeline: the diffusers pipeline of the generation.
        template (`dict`, *optional*): the call's ``prompt_template`` (HunyuanVideo), or its arguments of
            ``tokenize_prompt`` (Cosmos 3: ``num_frames``, ``height``, ``width``, ``fps``); left out: the pipeline's
            default.
    """

    def __init__(self, pipeline, template: dict | None = None):
        tokenizer = getattr(pipeline, "tokenizer", None) or getattr(pipeline, "text_tokenizer", None)  # Cosmos 3's
        if tokenizer is None:
            raise TypeError(f"{type(pipeline).__name__} has no tokenizer; pass a pipeline or a tokenizer.")
        spec = spec_for_module(getattr(pipeline, "transformer", None))
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's (Qwen2VLProcessor: Kandinsky 5)
        self.pipeline, self.tokenizer, self.template = pipeline, tokenizer, template
        self._text = (spec.prompt_text if spec is not None else None) or pipeline_text
        self._glyph = None if spec is None else spec.glyph_text

    @property
    def pad_token(self):
        """The tokenizer's padding token."""
        return getattr(self.tokenizer, "pad_token", None)

    def encode(self, prompt: str, length: int, offsets: bool = False) -> PromptText:
        """The ``length`` text tokens of ``prompt`` the transformer reads (with character offsets)."""
        return self._text(self.pipeline, prompt, length, self.template, offsets)

    def glyph(self, prompt: str, length: int, offsets: bool = False) -> PromptText | None:
        """The first ``length`` tokens of the text's glyph part for ``prompt`` (``ModelSpec.glyph_text``:
        HunyuanVideo 1.5's ByT5 bytes of the quoted words); `None` for a family without one."""
        return None if self._glyph is None else self._glyph(self.pipeline, prompt, length, offsets)

    def glyph_names(self, ids: list[int]) -> list[str]:
        """The glyph tokens' names, as the pipeline's second tokenizer names them."""
        return [str(t) for t in self.pipeline.tokenizer_2.convert_ids_to_tokens(ids)]


def item_spans(source, batch=None) -> dict[str, tuple[int, int]]:
    """Where each part of the text of ``source``'s batch slot ``batch`` sits (``Recording.text_spans``,
    run.json's; ``batch`` as :func:`cogattn.items.pick_item` takes it), or every item's, ``layout.spans()``,
    where the source keeps none."""
    spans = getattr(source, "text_spans", None)
    slot = pick_item(source, batch)
    if spans and 0 <= slot < len(spans):
        return dict(spans[slot])
    return source.layout.spans()


class _Bare:
    """A tokenizer passed alone: the bare prompt (cleaned as Wan does with ``clean``)."""

    def __init__(self, tokenizer, clean: bool):
        self.tokenizer, self.clean = tokenizer, clean

    def encode(self, prompt: str, length: int, offsets: bool = False) -> PromptText:
        return plain_text(self.tokenizer, prompt, length, offsets, clean_prompt if self.clean else None)


def _format(source, clean: bool, family: str | None = None):
    if isinstance(source, (PromptFormat, _Bare)):
        return source
    if hasattr(source, "convert_ids_to_tokens"):
        spec = family_spec(family) if family in TABLE else None  # imports that family's module alone
        if spec is not None and spec.prompt_text is not None:  # the bare prompt is not the transformer's text
            raise ValueError(
                f"a tokenizer alone ({type(source).__name__}) reads the bare prompt, but {spec.title}'s pipeline "
                "makes the transformer's text its own way (a template, a crop or cleaning), so the positions would name "
                "other tokens; pass the pipeline, tokenizer=pipe (or PromptFormat(pipe, prompt_template) for a call's "
                "own)."
            )
        return _Bare(source, clean)
    if getattr(source, "tokenizer", None) is not None or getattr(source, "text_tokenizer", None) is not None:
        return PromptFormat(source)
    raise TypeError(f"{type(source).__name__} is not a pipeline, a PromptFormat or a tokenizer; pass `pipe`.")


def pad_name(tokenizer, *, clean: bool = False, family: str | None = None) -> str:
    """The name :func:`text_tokens` gives a padding token: the tokenizer's own padding token, or ``"<pad>"``; the
    same for a pipeline, its :class:`PromptFormat` and its tokenizer (``tokenizer``, ``clean`` and ``family`` as
    :func:`text_tokens` takes them)."""
    return getattr(_format(tokenizer, clean, family).tokenizer, "pad_token", None) or PAD_TOKEN


def text_tokens(
    tokenizer,
    prompt: str,
    text_len: int,
    *,
    clean: bool = False,
    prompt_start: int = 0,
    spans: dict | None = None,
    family: str | None = None,
) -> list[str]:
    """The ``text_len`` text tokens of ``prompt`` as the pipeline feeds them to the transformer.

    Args:
        tokenizer: the pipeline (``pipe``: its family's template and crop apply), a :class:`PromptFormat`
            (a call's own ``prompt_template``), or a tokenizer alone (``pipe.tokenizer``: the bare prompt,
            right for the T5 families only).
        prompt (`str`): the prompt of the generation (the negative prompt for an unconditional item).
        text_len (`int`): text tokens T of the layout, ``layout.prompt_len`` (``max_sequence_length`` of
            the call).
        clean (`bool`, defaults to `False`): with a tokenizer alone, tokenize :func:`clean_prompt` of the
            prompt, as Wan does (a pipeline cleans it where its own pipeline does).
        prompt_start (`int`, defaults to 0): image tokens before the prompt's, ``layout.prompt_start``
            (HunyuanVideo image-to-video), each named ``"<image>"``.
        spans (`dict`, *optional*): one item's text spans (:func:`item_spans`), for a text the model packs per
            item (HunyuanVideo 1.5); they replace ``prompt_start``.
        family (`str`, *optional*): the recording's family (``rec.family``): a tokenizer alone is refused for a
            family whose pipeline makes the text its own way (``ModelSpec.prompt_text``), saying to pass ``pipe``.

    Returns:
        `list[str]`: ``text_len`` token strings, the template's kept tokens and padding included.
    """
    fmt = _format(tokenizer, clean, family)
    spans = _spans(spans, prompt_start, text_len)
    names = [pad_name(fmt)] * text_len
    a, b = spans.get("image", (0, 0))
    names[a:b] = [IMAGE_TOKEN] * (b - a)
    a, b = spans.get("glyph", (0, 0))
    if b > a:
        glyph = fmt.glyph(prompt, b - a) if isinstance(fmt, PromptFormat) else None
        got = fmt.glyph_names(glyph.ids) if glyph is not None else []
        names[a:b] = (got + ["<glyph>"] * (b - a))[: b - a]
    a, b = spans["prompt"]
    ids = fmt.encode(prompt, b - a).ids if b > a else []
    names[a:b] = [str(t) for t in fmt.tokenizer.convert_ids_to_tokens(ids)]
    return names


def _spans(spans: dict | None, prompt_start: int, text_len: int) -> dict[str, tuple[int, int]]:
    """One item's spans, checked against ``text_len``; `None`: the image's ``prompt_start`` tokens, then the
    prompt's to the end."""
    if spans is None:
        start = _start(prompt_start, text_len)
        return {"image": (0, start), "prompt": (start, int(text_len))}
    out = {name: (int(a), int(b)) for name, (a, b) in spans.items()}
    for name, (a, b) in out.items():
        if not 0 <= a <= b <= text_len:
            raise ValueError(f"spans[{name!r}] = {(a, b)}; an item's text spans lie within its {text_len} tokens.")
    if "prompt" not in out:
        raise ValueError(f"spans = {out}; an item's spans name where its 'prompt' sits.")
    return out


def _start(prompt_start: int, text_len: int) -> int:
    if not 0 <= int(prompt_start) <= int(text_len):
        raise ValueError(f"prompt_start={prompt_start}; the prompt's tokens start in 0..{text_len} of the text.")
    return int(prompt_start)


def _piece_text(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text a slow sentencepiece tokenizer read, rebuilt from the pieces of ``ids`` (``▁`` a space), and each
    piece's characters in it: a special token (the unknown one too) ends a word, as the pieces' grouping did."""
    special = set(getattr(tokenizer, "all_special_tokens", []))
    text, spans = "", []
    for piece in map(str, tokenizer.convert_ids_to_tokens(ids)):
        part = _SEP if piece in special else piece.replace("▁", " ")
        spans.append((len(text), len(text) + len(part)))
        text += part
    return text, spans


def word_positions(
    word: str,
    tokenizer,
    prompt: str,
    text_len: int,
    *,
    clean: bool = False,
    prompt_start: int = 0,
    spans: dict | None = None,
    glyph: bool = False,
    family: str | None = None,
) -> list[int]:
    """Text-token positions whose pieces form ``word`` in ``prompt``, for every occurrence of it.

    A word may be several sentencepiece pieces (``'▁fox', 'hound'``); all of them are returned. A fast
    tokenizer's character offsets give the exact pieces of the prompt (never of its template); a slow
    sentencepiece tokenizer's pieces rebuild the text it read (``▁`` a space), searched the same way: a word
    ends at a space or at punctuation (``red-fox``, ``fox,dog``).

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
        spans (`dict`, *optional*): one item's text spans (:func:`item_spans`), for a text the model packs per
            item (HunyuanVideo 1.5): the word is found at the item's ``prompt`` span (they replace
            ``prompt_start``).
        glyph (`bool`, defaults to `False`): find a quoted word's tokens in the item's ``glyph`` span instead
            (HunyuanVideo 1.5's ByT5 bytes; the pipeline passes a :class:`PromptFormat` or itself).
        family (`str`, *optional*): the recording's family, as for :func:`text_tokens`.

    Returns:
        `list[int]`: sorted token positions in ``0 .. text_len - 1``.

    Raises:
        ValueError: the word is not in the prompt (or not quoted, with ``glyph``), or was cut off (an occurrence
            whose first tokens are among the ``text_len`` but not its last); a tokenizer alone for a ``family`` whose
            pipeline makes its text its own way.
    """
    core = re.sub(r"^\W+|\W+$", "", word)  # "Fox," means the word fox: punctuation is not part of a word
    if not core:
        raise ValueError(f"word {word!r} has no letters or digits; pass a word of the prompt.")
    fmt = _format(tokenizer, clean, family)
    spans = _spans(spans, prompt_start, text_len)
    if glyph:
        return _glyph_positions(core, word, fmt, prompt, spans)
    skip, end = spans["prompt"]
    length = end - skip
    fast = bool(getattr(fmt.tokenizer, "is_fast", False))
    enc = fmt.encode(prompt, length, offsets=fast) if length > 0 else PromptText([], "", (0, 0), [])
    if fast:
        text, window, marks, count = enc.text, enc.prompt, enc.spans, len(enc.ids)
    else:  # no offsets: the untruncated pieces rebuild the text, and the kept ones are those the two share
        full = fmt.encode(prompt, length + 4 * len(prompt) + 16) if enc.ids else enc  # ≤ 4 pieces a character
        count = next((i for i, (x, y) in enumerate(zip(enc.ids, full.ids)) if x != y), len(enc.ids))
        text, marks = _piece_text(fmt.tokenizer, full.ids)
        window = (0, len(text))
    kept = max((e for s, e in marks[:count] if e > s), default=0)  # past this character the text was cut off
    pattern = r"(?<!\w)" + r"\s+".join(map(re.escape, core.split())) + r"(?!\w)"  # whole words, any spacing
    positions: list[int] = []
    for m in re.finditer(pattern, text[window[0] : window[1]], re.IGNORECASE):
        a, b = window[0] + m.start(), window[0] + m.end()
        if a >= kept:  # cut away whole: not among the tokens
            continue
        if b > kept:  # its first tokens kept, not its last: the positions would name part of it
            raise ValueError(
                f"word {word!r} is cut off at the {length} prompt tokens: only its start {text[a:kept]!r} is among "
                f"them (the text is truncated at max_sequence_length). Pass a word the text holds whole, or token "
                f"indices 0..{text_len - 1}."
            )
        positions += [i for i, (s, e) in enumerate(marks) if e > s and e > a and s < b and re.search(r"\w", text[s:e])]
    if not positions:
        shown = text_tokens(fmt, prompt, length)
        pad, n = getattr(fmt.tokenizer, "pad_token", None), len(shown)
        while n and pad is not None and shown[n - 1] == pad:  # 512 tokens of Wan are mostly padding
            n -= 1
        tail = f" then {len(shown) - n} × {pad!r}" if n < len(shown) else ""
        where = f"{length} prompt tokens from text token {skip}" if skip else f"first {length} text tokens"
        said = enc.text[enc.prompt[0] : enc.prompt[1]] if enc.text else prompt
        raise ValueError(
            f"word {word!r} is not among the {where} of the prompt {said!r}; its tokens "
            f"are {shown[:n]}{tail}. Pass a word of the prompt, or token indices 0..{text_len - 1}."
        )
    return sorted({skip + i for i in positions})


def _glyph_positions(core: str, word: str, fmt, prompt: str, spans: dict) -> list[int]:
    """The positions of a quoted word's tokens in the item's glyph span (only inside the quotes: never the
    glyph text's own ``Text``)."""
    a0, b0 = spans.get("glyph", (0, 0))
    enc = fmt.glyph(prompt, b0 - a0, offsets=True) if isinstance(fmt, PromptFormat) and b0 > a0 else None
    positions: list[int] = []
    if enc is not None:
        for quoted in re.finditer(r'"(.*?)"', enc.text):
            inner = quoted.group(1)
            for m in re.finditer(r"(?<!\w)" + re.escape(core) + r"(?!\w)", inner, re.IGNORECASE):
                a, b = quoted.start(1) + m.start(), quoted.start(1) + m.end()
                positions += [i for i, (s, e) in enumerate(enc.spans) if e > s and e > a and s < b]
    if not positions:
        held = f"its {b0 - a0} glyph tokens read {enc.text!r}" if enc is not None else "it has no glyph tokens"
        raise ValueError(
            f"word {word!r} is not a quoted word of this item's prompt {prompt!r} ({held}); pass a word in quotes, "
            "or leave glyph out to find it among the prompt's tokens."
        )
    return sorted({a0 + i for i in positions})
