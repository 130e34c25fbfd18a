"""Reading maps for plots: averaging over steps and layers, choosing heads, naming text tokens.

A *source* is anything with ``get(kind, step, layer)``, ``keys()``, ``timesteps`` and ``layout``: an
in-memory :class:`cogattn.Recording` or a run folder opened with :func:`cogattn.load`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

__all__ = ["aggregate", "text_tokens", "word_positions"]

KIND_DIMS = {  # names of a kind's per-item, per-head dimensions; a plot labels its axes with them
    "frame": ("query group", "key group"),
    "video_to_text": ("text token", "latent frame", "patch row", "patch column"),
    "text_to_video": ("text token", "latent frame", "patch row", "patch column"),
    "query": ("query", "key token"),
    "full": ("query token", "key token"),
}


def recorded(source, kind: str, what: str) -> list[int]:
    """Steps (``what="step"``) or layers (``"layer"``) recorded for ``kind``; raises if the kind is absent."""
    if kind not in KIND_DIMS:
        raise ValueError(f"unknown kind {kind!r}; the kinds are {list(KIND_DIMS)}.")
    keys = [k for k in source.keys() if k[0] == kind]
    if not keys:
        kinds = sorted({k[0] for k in source.keys()})
        raise KeyError(f"kind {kind!r} was not recorded; this source holds {kinds}. Add it to record(kinds=...).")
    return sorted({k[1] if what == "step" else k[2] for k in keys})


def choose(source, kind: str, what: str, value: str | int | Sequence[int]) -> list[int]:
    """Resolve a steps/layers selector (``"all"``, an index or a list) against what was recorded."""
    have = recorded(source, kind, what)
    if isinstance(value, str):
        if value != "all":
            raise ValueError(f"{what}s={value!r}; use 'all', an index, or a list of indices.")
        return have
    wanted = [value] if isinstance(value, int) else list(value)
    if not wanted:
        raise ValueError(f"{what}s is empty; recorded {what}s of {kind!r} are {have}.")
    for v in wanted:
        if v not in have:
            raise KeyError(f"{what} {v!r} of {kind!r} was not recorded; recorded {what}s are {have}.")
    return wanted


def recorded_heads(source) -> str | list[int]:
    """Model head indices held in a result's head axis, or ``"mean"`` when heads were averaged at record time."""
    sel = getattr(source, "selection", None)
    heads = sel.heads if sel is not None else (getattr(source, "meta", {}).get("selection") or {}).get("heads")
    if heads == "mean" or heads is None:
        return "mean"
    if heads == "all":
        return "all"
    return [int(h) for h in heads]


def recorded_queries(source) -> list[int | tuple[int, int, int]]:
    """Query tokens of the ``query`` kind as given to ``record``: token indices or (frame, row, col)."""
    sel = getattr(source, "selection", None)
    queries = sel.queries if sel is not None else (getattr(source, "meta", {}).get("selection") or {}).get("queries")
    return [q if isinstance(q, int) else tuple(q) for q in (queries or [])]


def source_prompt(source) -> str | None:
    """The prompt kept with a recording or run (``info={"prompt": ...}``), if any."""
    meta = getattr(source, "meta", None)  # a Run keeps it in run.json; a Recording in .info
    info = meta.get("info") if isinstance(meta, dict) else getattr(source, "info", None)
    return info.get("prompt") if isinstance(info, dict) else None


def head_positions(heads_held: str | list[int], num_slots: int, heads) -> list[int]:
    """Positions in a result's head axis (``num_slots`` long) of the model heads ``heads``."""
    if heads in ("all", "mean"):
        return list(range(num_slots))
    if isinstance(heads, str) or (not isinstance(heads, int) and not heads):
        raise ValueError(f"heads={heads!r}; use 'mean', 'all', a head index, or a list of head indices.")
    ids = list(range(num_slots)) if heads_held == "all" else heads_held
    if ids == "mean":
        raise ValueError(
            f"heads={heads!r}, but this source was recorded with heads='mean' and holds only the mean over "
            "heads; use heads='mean', or record with heads='all' (or a list) for single heads."
        )
    positions = []
    for h in [heads] if isinstance(heads, int) else list(heads):
        if h not in ids:
            raise ValueError(f"head {h!r} was not recorded; recorded heads are {ids}.")
        positions.append(ids.index(h))
    return positions


def aggregate(
    source,
    kind: str,
    *,
    steps: str | int | Sequence[int] = "all",
    layers: str | int | Sequence[int] = "all",
    heads: str | int | Sequence[int] = "mean",
    batch: int = 0,
) -> torch.Tensor:
    """One batch item's map, averaged over the chosen steps and layers, with heads chosen or averaged.

    Head selection reads like indexing: an int drops the head axis, a list or ``"all"`` keeps it, and
    ``"mean"`` averages it away. So ``aggregate(rec, "frame")`` is ``(G, G)`` and
    ``aggregate(rec, "frame", heads="all")`` is ``(H, G, G)``.

    Args:
        source: a `Recording` or a `Run` (anything with ``get``, ``keys``, ``layout``).
        kind (`str`): ``"frame"``, ``"video_to_text"``, ``"text_to_video"``, ``"query"`` or ``"full"``.
        steps (`"all" | int | Sequence[int]`, defaults to ``"all"``): steps to average (``"all"``: every
            recorded step of the kind).
        layers (`"all" | int | Sequence[int]`, defaults to ``"all"``): layers to average.
        heads (`"mean" | "all" | int | Sequence[int]`, defaults to ``"mean"``): model head indices.
        batch (`int`, defaults to 0): position among the recorded batch items.

    Returns:
        `torch.Tensor`: float32, the kind's shape without ``B`` (and without ``H`` unless kept).
    """
    step_list = choose(source, kind, "step", steps)
    layer_list = choose(source, kind, "layer", layers)
    total = None
    for s in step_list:
        for layer in layer_list:
            t = source.get(kind, s, layer)
            if not 0 <= batch < t.shape[0]:
                raise ValueError(f"batch={batch} is out of range: {t.shape[0]} batch item(s) were recorded.")
            t = t[batch].double()
            total = t if total is None else total + t
    mean = (total / (len(step_list) * len(layer_list))).float()
    positions = head_positions(recorded_heads(source), mean.shape[0], heads)
    if heads == "mean":
        return mean.mean(0)
    if isinstance(heads, int):
        return mean[positions[0]]
    return mean[positions]


# -- text tokens -----------------------------------------------------------------------------------
def _encode(tokenizer, prompt: str, text_len: int, offsets: bool) -> dict:
    # The pipelines' own call (CogVideoXPipeline._get_t5_prompt_embeds): positions then match the maps.
    kwargs = dict(padding="max_length", max_length=text_len, truncation=True, add_special_tokens=True)
    if offsets:
        kwargs["return_offsets_mapping"] = True
    return tokenizer(prompt, **kwargs)


def text_tokens(tokenizer, prompt: str, text_len: int) -> list[str]:
    """The ``text_len`` text tokens of ``prompt`` as the pipeline feeds them to the transformer.

    Args:
        tokenizer: the pipeline's tokenizer (``pipe.tokenizer``).
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout (``max_sequence_length`` of the call).
    """
    ids = _encode(tokenizer, prompt, text_len, offsets=False)["input_ids"]
    return [str(t) for t in tokenizer.convert_ids_to_tokens(list(ids))]


def _norm_word(text: str) -> str:
    return re.sub(r"[^\w]", "", text.replace("▁", "")).lower()


def word_positions(word: str, tokenizer, prompt: str, text_len: int) -> list[int]:
    """Text-token positions whose pieces form ``word`` in ``prompt``, for every occurrence of it.

    A word may be several sentencepiece pieces (``'▁fox', 'hound'``); all of them are returned. A fast
    tokenizer's character offsets give the exact pieces; otherwise pieces are grouped into words at
    the ``▁`` word-start marker.

    Args:
        word (`str`): one or more words of the prompt (case-insensitive).
        tokenizer: the pipeline's tokenizer.
        prompt (`str`): the prompt of the generation.
        text_len (`int`): text tokens T of the layout.

    Raises:
        ValueError: the word is not in the prompt, or was cut off at ``text_len`` tokens.
    """
    fast = bool(getattr(tokenizer, "is_fast", False))
    enc = _encode(tokenizer, prompt, text_len, offsets=fast)
    positions: list[int] = []
    if fast:
        spans = [tuple(o) for o in enc["offset_mapping"]]
        for m in re.finditer(r"(?<!\w)" + re.escape(word.strip()) + r"(?!\w)", prompt, re.IGNORECASE):
            a, b = m.span()
            positions += [i for i, (s, e) in enumerate(spans) if e > s and e > a and s < b]
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
        target = [_norm_word(w) for w in word.split()]
        for k in range(len(words) - len(target) + 1):
            if target and texts[k : k + len(target)] == target:
                # punctuation glued to a word ("fox" ",") and lone "▁" pieces are not part of it
                positions += [i for w in words[k : k + len(target)] for i in w if _norm_word(pieces[i])]
    if not positions:
        shown = [t for t in text_tokens(tokenizer, prompt, text_len)]
        raise ValueError(
            f"word {word!r} is not among the first {text_len} text tokens of the prompt {prompt!r}; its tokens "
            f"are {shown}. Pass a word of the prompt, or token indices 0..{text_len - 1}."
        )
    return sorted(set(positions))
