"""The values of a run folder's files, checked before a reader uses them: a run folder may come from anyone.

:func:`checked_layout` builds run.json's ``layout`` field by field (whole numbers, positive where a size, the
text's position, no unknown field, an audio axis' counts and rates), refusing a bad one with a `StoreError` that
names run.json and the field (:func:`layout_json` writes it: no ``audio`` for a model without an audio stream);
:func:`line_problem` says why a manifest line's numbers or file cannot be a record (a step or layer out of
range, a negative shape, a file outside the run folder) and :func:`shape_problem` why its kind and shape cannot be
one of this run's (a kind this version does not know, an axis that run.json's layout, slots or heads do not give:
:class:`RecordShapes`), so :class:`cogattn.runs.run.Run` skips that line as it skips other damaged ones;
:func:`checked_call_stats` reads run.json's per-call statistics (Kandinsky 5's ``nabla_recall``) as tables of
numbers, :func:`checked_text_spans` each slot's text parts (HunyuanVideo 1.5) and :func:`checked_windows` each
step's window, refusing anything else. The types of run.json's other fields are :mod:`cogattn.runs.schema`'s.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch

from ..audio import AudioAxis
from ..errors import StoreError
from ..exact.reducers import CONTEXT_REDUCERS, REDUCERS
from ..layout import TokenLayout
from .folder import MAX_INDEX

__all__ = [
    "MAX_SLOTS",
    "MAX_TOKENS",
    "RecordShapes",
    "TEXT_PARTS",
    "checked_call_stats",
    "checked_layout",
    "checked_text_spans",
    "checked_windows",
    "layout_json",
    "line_problem",
    "shape_problem",
]

MAX_TOKENS = 2**24  # a layout's sequence: no attention is longer, and readers allocate per token
_MIN = {"text_len": 0, "frames": 1, "height": 1, "width": 1, "patch_size": 1, "patch_size_t": 1}
_MIN.update(context_len=0, image_len=0, temporal_compression=1, history_len=0, prompt_crop=0, grids=1)
_MIN.update(clip_latents=0)
# at most: a token count, or (a patch's and the VAE's factors, by which readers list frame counts) far above any model's
_MAX = {**dict.fromkeys(_MIN, MAX_TOKENS), "patch_size": 64, "patch_size_t": 64, "temporal_compression": 64}
TEXT_PARTS = ("image", "glyph", "prompt")  # the parts a packed text may name (layout.text_parts, text_spans)


def checked_layout(lay, meta_file: Path) -> TokenLayout | None:
    """run.json's ``layout`` as a `TokenLayout` (`None` where there is none), each value checked first.

    Raises:
        StoreError: a value a layout cannot have, one line naming ``meta_file`` and the field.
    """
    if not lay:
        return None

    def refuse(what: str) -> StoreError:
        return StoreError(f"{str(meta_file)!r}: {what}; the run's token layout cannot be used (fix or remove it).")

    if not isinstance(lay, dict):
        raise refuse(f"'layout' is {str(lay)[:60]}, not an object of layout fields")
    fields = {f.name for f in dataclasses.fields(TokenLayout)}
    lay = {name: value for name, value in lay.items() if name in fields}  # another's: a later version's, left alone
    for name, value in lay.items():
        shown = repr(value)[:60]
        if name == "text_position":
            if value not in ("start", "end"):
                raise refuse(f"layout.text_position = {shown}; the text sits at the 'start' or the 'end'")
        elif name in ("causal_vae", "image_joins_text"):
            if type(value) is not bool:
                raise refuse(f"layout.{name} = {shown}; it is true or false")
        elif name in ("text_parts", "audio"):
            continue  # checked whole below
        elif not (type(value) is int and _MIN[name] <= value <= _MAX[name]) and not (
            name == "patch_size_t" and value is None
        ):
            raise refuse(f"layout.{name} = {shown}; it is a whole number from {_MIN[name]} to {_MAX[name]}")
    for name in ("text_len", "frames", "height", "width"):
        if name not in lay:
            raise refuse(f"layout.{name} is missing")
    lay = {**lay, "text_parts": _checked_parts(lay.get("text_parts", []), lay["text_len"], refuse)}
    lay["audio"] = _checked_audio(lay.get("audio"), refuse)
    if lay["frames"] % lay.get("grids", 1):
        raise refuse(f"layout.frames = {lay['frames']} is not whole copies of layout.grids = {lay['grids']} grids")
    layout = TokenLayout(**lay)
    if layout.text_len and layout.image_len > layout.text_len:
        raise refuse(f"layout.image_len = {layout.image_len} is more than layout.text_len = {layout.text_len}")
    if layout.seq_len > MAX_TOKENS:
        raise refuse(f"layout.frames × height × width = {layout.seq_len - layout.text_len} tokens, over {MAX_TOKENS}")
    return layout


def checked_layer_layouts(layouts, meta_file: Path) -> dict[int, TokenLayout]:
    """run.json's ``layer_layouts`` (missing in a run written before them): layer → its own layout, each checked
    as :func:`checked_layout` checks the generation's."""
    if layouts is None:
        return {}
    if not isinstance(layouts, dict) or not all(isinstance(k, str) and re.fullmatch("[0-9]{1,6}", k) for k in layouts):
        shown = repr(layouts)[:60]
        raise StoreError(f"{str(meta_file)!r}: 'layer_layouts' is {shown}, not an object of layer number → layout")
    out = {int(n): checked_layout(lay, meta_file) for n, lay in layouts.items()}
    if None in out.values():
        raise StoreError(f"{str(meta_file)!r}: 'layer_layouts' holds an empty layout; each layer's is an object")
    return out


def layout_json(layout: TokenLayout | None) -> dict | None:
    """run.json's ``layout`` of ``layout``: its fields, each but the four it needs only where it is not its default
    (``audio`` where the model has an audio stream), so a reader that predates a field reads every run that does not
    use it."""
    if layout is None:
        return None
    out = dataclasses.asdict(layout)
    defaults = {f.name: f.default for f in dataclasses.fields(TokenLayout) if f.default is not dataclasses.MISSING}
    keep = ("text_len", "frames", "height", "width")
    return {k: v for k, v in out.items() if k in keep or k not in defaults or v != defaults[k]}


def _checked_audio(audio, refuse) -> AudioAxis | None:
    """run.json's ``layout.audio``: `None`, or ``{"tokens", "rate", "compression", "fps"}``, counts whole and positive
    (tokens at most :data:`MAX_TOKENS`), rates finite and positive."""
    if audio is None:
        return None
    shown = f"layout.audio = {repr(audio)[:80]}"
    if not isinstance(audio, dict) or set(audio) - {"tokens", "rate", "compression", "fps"} or "tokens" not in audio:
        raise refuse(f"{shown}; it is an object of tokens (and rate, compression, fps)")
    for name, value in audio.items():
        whole = name in ("tokens", "compression")
        ok = type(value) is int if whole else type(value) in (int, float) and math.isfinite(value)
        if not ok or not 0 < value <= (MAX_TOKENS if name == "tokens" else 1e6):
            what = "a whole number" if whole else "a finite number"
            raise refuse(f"{shown}; its {name} is {what} above 0 (at most {MAX_TOKENS if name == 'tokens' else 1e6:g})")
    return AudioAxis(**{k: v if k in ("tokens", "compression") else float(v) for k, v in audio.items()})


def _checked_parts(parts, text_len: int, refuse) -> tuple[tuple[str, int], ...]:
    """run.json's ``layout.text_parts``: ``[[name, size], ...]``, names of :data:`TEXT_PARTS` once each, whole sizes
    0 or more summing to ``text_len``."""
    shown = repr(parts)[:80]
    if not isinstance(parts, list) or not all(isinstance(p, list) and len(p) == 2 for p in parts):
        raise refuse(f"layout.text_parts = {shown}; it is a list of [name, size] pairs")
    names = [p[0] for p in parts]
    if any(n not in TEXT_PARTS for n in names) or len(set(names)) != len(names):
        raise refuse(f"layout.text_parts = {shown}; its names are {', '.join(TEXT_PARTS)}, each once")
    if not all(type(n) is int and n >= 0 for _, n in parts) or (parts and sum(n for _, n in parts) != text_len):
        raise refuse(f"layout.text_parts = {shown}; its sizes are whole numbers, 0 or more, summing to text_len")
    return tuple((str(name), int(n)) for name, n in parts)


def checked_text_spans(selection, layout: TokenLayout | None, meta_file: Path) -> tuple[dict, ...] | None:
    """run.json's ``selection.text_spans`` (`None` where there are none): per slot of the results' batch axis
    (``selection.batch_resolved``), a mapping of part names (:data:`TEXT_PARTS`) to ``(start, end)`` on the
    layout's text tokens, whole numbers in order within ``prompt_len``, one mapping per slot.

    Raises:
        StoreError: a value spans cannot have, one line naming ``meta_file`` and the field.
    """
    selection = selection if isinstance(selection, dict) else {}
    spans, batch = selection.get("text_spans"), selection.get("batch_resolved")
    slots = len(batch) if isinstance(batch, list) else None
    if spans is None:
        return None

    def refuse(what: str) -> StoreError:
        return StoreError(f"{str(meta_file)!r}: {what}; the run's text spans cannot be used (fix or remove them).")

    if layout is None:
        raise refuse("selection.text_spans is set, but run.json has no layout")
    if not isinstance(spans, list) or (slots is not None and len(spans) != slots):
        raise refuse(f"selection.text_spans = {repr(spans)[:60]}; it is a list of one object per recorded slot")
    T, out = layout.prompt_len, []
    for i, item in enumerate(spans):
        field = f"selection.text_spans[{i}]"
        if not isinstance(item, dict) or not item or any(k not in TEXT_PARTS for k in item):
            raise refuse(f"{field} = {repr(item)[:60]}; it is an object of {', '.join(TEXT_PARTS)} spans")
        end, kept = 0, {}
        for name in TEXT_PARTS:  # in packing order: each starts where the one before ends, or later
            if name not in item:
                continue
            span, shown = item[name], repr(item[name])[:40]
            if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)):
                raise refuse(f"{field}.{name} = {shown}; it is [start, end], whole numbers")
            if not end <= span[0] <= span[1] <= T:
                raise refuse(f"{field}.{name} = {shown}; it lies in order within the {T} text tokens")
            end, kept[name] = span[1], (span[0], span[1])
        out.append(kept)
    return tuple(out)


def line_problem(step: int, layer: int, shape: tuple[int, ...], nbytes: int, file: str) -> str | None:
    """Why a manifest line's values cannot be a record of this run, or `None` where they can."""
    for name, value in (("step", step), ("layer", layer)):
        if not 0 <= value < MAX_INDEX:
            return f"'{name}' is {value}; a record's {name} is from 0 to {MAX_INDEX - 1}"
    if any(n < 0 for n in shape) or nbytes < 0:
        return f"'shape' {list(shape)} or 'bytes' {nbytes} is negative"
    path = Path(file)
    if path.is_absolute() or ".." in path.parts or not path.parts:  # the run's files are named inside it
        return f"'file' {file!r} is outside the run folder; a record's file is a path inside it"
    return None


def checked_call_stats(raw) -> dict:
    """run.json's ``call_stats`` (a list of ``{"step", "layer", "name", "values"}``, ``values`` a table of numbers or
    null per batch slot and head) as ``(step, layer, name)`` → float64 ``(B, H)``, null read as NaN; `StoreError`
    naming the entry where one is not of that form."""
    tables = {}
    for n, entry in enumerate(raw if isinstance(raw, list) else [None]):
        ok = isinstance(entry, dict) and set(entry) == {"step", "layer", "name", "values"}
        rows = entry.get("values") if ok else None
        ok = ok and all(type(entry[k]) is int and 0 <= entry[k] < MAX_INDEX for k in ("step", "layer"))
        ok = ok and isinstance(entry["name"], str) and isinstance(rows, list) and len(rows) > 0
        ok = ok and all(isinstance(r, list) and len(r) == len(rows[0]) > 0 for r in rows)
        numbers = [[x for x in r if x is not None] for r in rows] if ok else []
        if not ok or not all(type(x) in (int, float) and math.isfinite(x) for r in numbers for x in r):
            raise StoreError(
                f"run.json's call_stats entry {n} is {str(entry)[:80]}; it should be {{step, layer, name, values}} "
                "with a table of numbers (null for a slot not captured). Fix or remove the field."
            )
        values = [[math.nan if x is None else float(x) for x in r] for r in rows]
        tables[(entry["step"], entry["layer"], entry["name"])] = torch.tensor(values, dtype=torch.float64)
    return tables


def checked_windows(windows) -> list[int]:
    """run.json's ``windows``, one window index per step (SkyReels-V2's windows, Helios's chunks); `ValueError` where it
    is not such a list."""
    if not isinstance(windows, list) or not all(type(w) is int and w >= 0 for w in windows):
        fix = "Fix or remove the field (without it every step reads as window 0)."
        raise ValueError(f"run.json's windows is {str(windows)[:80]}; it should be one window index per step. {fix}")
    return list(windows)


MAX_SLOTS = 2**12  # a record's batch axis where run.json does not name the recorded slots (a run from before)
_AXES = {  # each kind's axes (its reducer's `dims`) whose size the layout fixes
    "query token": lambda lay: lay.seq_len,
    "key token": lambda lay: lay.seq_len,
    "query group": lambda lay: lay.num_groups,
    "key group": lambda lay: lay.num_groups,
    "latent frame": lambda lay: lay.frames,
    "patch row": lambda lay: lay.height,
    "patch column": lambda lay: lay.width,
    "frame offset": lambda lay: 2 * lay.frames - 1,
    "row offset": lambda lay: 2 * lay.height - 1,
    "column offset": lambda lay: 2 * lay.width - 1,
    "value, key token": lambda lay: 2,
    "audio bin": lambda lay: 0 if lay.audio is None else lay.audio.tokens,
    "audio query bin": lambda lay: 0 if lay.audio is None else lay.audio.tokens,
    "audio key bin": lambda lay: 0 if lay.audio is None else lay.audio.tokens,
}


@dataclasses.dataclass(frozen=True)
class RecordShapes:
    """What run.json says a record of each kind holds, for :func:`shape_problem`: the kinds this version knows
    (``dims``: each kind's axes after B and H), the recorded slots of the batch axis, and the head axis of each attention (``heads``: source → its heads, 1 where
    heads were averaged; a source run.json does not name is bounded only)."""

    dims: dict[str, tuple[str, ...]]
    layout: TokenLayout | None = None
    slots: int | None = None
    sources: dict = dataclasses.field(default_factory=dict)
    heads: dict = dataclasses.field(default_factory=dict)
    layer_layouts: dict = dataclasses.field(default_factory=dict)  # layer → its own layout (run.json's)

    def layout_of(self, layer: int | None) -> TokenLayout | None:
        """The layout of ``layer``'s records: its own, or the generation's."""
        return self.layer_layouts.get(layer, self.layout)

    @classmethod
    def of(cls, meta: dict, layout: TokenLayout | None, layer_layouts: dict | None = None) -> RecordShapes:
        """The shapes of a run whose run.json (checked: :func:`cogattn.runs.schema.check_meta`) is ``meta``."""
        dims = {kind: cls.dims for kind, cls in (REDUCERS | CONTEXT_REDUCERS).items()}
        sel = meta.get("selection") or {}
        roles, items = sel.get("batch_roles"), sel.get("batch_resolved")
        slots = len(roles) if isinstance(roles, list) else len(items) if isinstance(items, list) else None
        if sel.get("heads") == "mean":
            heads = {None: 1}  # every attention's heads averaged into one slot
        else:
            heads = dict(sel.get("source_heads") or {})
            heads.setdefault("self", sel.get("heads_resolved"))
            heads = {src: len(ids) for src, ids in heads.items() if isinstance(ids, list)}
            config = (meta.get("model") or {}).get("config") or {}
            if sel.get("heads") == "all" and "self" not in heads and type(config.get("num_attention_heads")) is int:
                heads["self"] = config["num_attention_heads"]  # a run that did not list the heads: the model's
        return cls(dims, layout, slots, dict(meta.get("sources") or {}), heads, dict(layer_layouts or {}))


def shape_problem(kind: str, shape: tuple[int, ...], expected: RecordShapes, layer: int | None = None) -> str | None:
    """Why a manifest line's ``kind`` and ``shape`` cannot be a record of the run ``expected`` describes (a kind this
    version does not know, an axis the layout, the recorded slots or heads do not give), or `None` where they can.
    Every size is checked before anything is made from it: a reader lists a record's batch slots."""
    dims = expected.dims.get(kind)
    if dims is None:
        return f"kind {kind[:40]!r} is not a kind this version of cogattn knows (a later version's, or damage)"
    names = ("batch slot", "head", *dims)
    if len(shape) != len(names):
        return (
            f"a {kind} record has {len(names)} axes ({', '.join(names)}), not the {len(shape)} of 'shape' {list(shape)}"
        )
    heads = expected.heads.get(None, expected.heads.get(expected.sources.get(kind, "self")))
    lay = expected.layout_of(layer)
    want = [expected.slots, heads, *(_AXES[n](lay) if lay is not None and n in _AXES else None for n in names[2:])]
    for name, n, size in zip(names, shape, want):
        most = MAX_SLOTS if name == "batch slot" else MAX_TOKENS
        if (size is not None and n != size) or not 0 <= n <= most:
            told = f"run.json gives {size}" if size is not None else f"at most {most}"
            return f"'shape' {list(shape)} has {n} along the {name} axis of a {kind!r} record; {told}"
    return None
