"""run.json's schema: the type and range of every field a reader uses, checked once when a run is opened.

A run folder may come from anyone, so :class:`cogattn.runs.run.Run` checks its ``run.json`` as a whole before
anything reads it (:func:`read_meta`: the layout, :func:`check_meta`, the text spans): a value of the wrong type or out of range is a `StoreError` of one line
naming run.json and the field (``'…/run.json': selection.heads is 5; it must be 'all' or 'mean' or a list of
items, each a whole number from 0 to 1048575``), so a damaged run is refused when it is opened, not by whichever
property meets the value first. The schema is the table :data:`RUN_JSON`, made of a few value types (:class:`Value`, :class:`ListOf`,
:class:`Fields`, :class:`AnyOf`); a field the table does not name is left alone (a later version's), and a
field may be missing (a run written before it existed). The layout is checked field by field by
:func:`cogattn.runs.run_values.checked_layout`, and the text spans by
:func:`cogattn.runs.run_values.checked_text_spans`, each with what it builds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from .folder import FORMAT, MAX_INDEX
from .run_values import MAX_TOKENS, RecordShapes, checked_layer_layouts, checked_layout, checked_text_spans

if TYPE_CHECKING:
    from ..layout import TokenLayout

__all__ = ["RUN_JSON", "STATUSES", "AnyOf", "Fields", "ListOf", "Value", "check_meta", "read_meta"]

STATUSES = ("running", "finished", "interrupted", "failed", "stopped")


@dataclass(frozen=True)
class Value:
    """A value of one JSON type, in a range: ``words`` say what it is (the refusal quotes them)."""

    words: str
    test: Callable[[object], bool]

    def problem(self, value, path: str) -> tuple[str, object, str] | None:
        """``(path, value, words)`` of the first value that does not fit, or `None`."""
        return None if self.test(value) else (path, value, self.words)


@dataclass(frozen=True)
class ListOf:
    """A list of at most ``most`` values of ``item`` (exactly ``most`` where ``exact``)."""

    item: Value | ListOf | Fields | AnyOf
    most: int = MAX_INDEX
    exact: bool = False

    @property
    def words(self) -> str:
        size = f"{self.most} " if self.exact else ""
        return f"a list of {size}items, each {self.item.words}"

    def problem(self, value, path: str):
        if not isinstance(value, list) or len(value) > self.most or (self.exact and len(value) != self.most):
            return path, value, self.words + ("" if self.exact or self.most == MAX_INDEX else f" (at most {self.most})")
        return next(filter(None, (self.item.problem(v, f"{path}[{i}]") for i, v in enumerate(value))), None)


@dataclass(frozen=True)
class Fields:
    """An object; each field it names that is present is checked (``words``: what the object is)."""

    words: str
    fields: dict

    def problem(self, value, path: str):
        if not isinstance(value, dict):
            return path, value, self.words
        inner = (s.problem(value[k], f"{path}.{k}" if path else k) for k, s in self.fields.items() if k in value)
        return next(filter(None, inner), None)


@dataclass(frozen=True)
class AnyOf:
    """One of ``options``; a value that fits none is named as a whole."""

    options: tuple

    @property
    def words(self) -> str:
        words = [o.words for o in self.options]
        return ", ".join(words[:-1]) + " or " + words[-1]

    def problem(self, value, path: str):
        fits = any(o.problem(value, path) is None for o in self.options)
        return None if fits else (path, value, self.words)


def _whole(value, low: int = 0, high: int = MAX_INDEX - 1) -> bool:
    return type(value) is int and low <= value <= high


def _number(value) -> bool:
    if type(value) is int:  # JSON's integers have any length: one past a float's range is no number a reader takes
        try:
            float(value)
        except OverflowError:
            return False
    return type(value) in (int, float)


def whole(low: int = 0, high: int = MAX_INDEX - 1) -> Value:
    """A whole number from ``low`` to ``high``."""
    return Value(f"a whole number from {low} to {high}", lambda v: _whole(v, low, high))


def word(*words: str) -> Value:
    """One of ``words``."""
    shown = [repr(w) for w in words]
    return Value(", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0], words.__contains__)


TEXT = Value("a string", lambda v: isinstance(v, str))
NULL = Value("null", lambda v: v is None)
FLAG = Value("true or false", lambda v: type(v) is bool)
NUMBER = Value("a number", _number)  # NaN and infinities too: a timestep or an error a page shows as blank
FINITE = Value("a finite number", lambda v: _number(v) and math.isfinite(v))
OBJECT = Value("an object", lambda v: isinstance(v, dict))
INDEX = whole()  # a step, layer, head or batch slot
INDICES = ListOf(INDEX)
POSITIVE = whole(1, MAX_TOKENS)
MASS = Value("a number above 0 and at most 1", lambda v: _number(v) and 0 < v <= 1)
TRIPLE = Value(
    "[step, layer, role] (two whole numbers and a string)",
    lambda v: isinstance(v, list) and len(v) == 3 and _whole(v[0]) and _whole(v[1]) and isinstance(v[2], str),
)
POINT = Value(
    "a token index or [frame, row, column], whole numbers 0 or more",
    lambda v: (
        _whole(v, 0, MAX_TOKENS) or (isinstance(v, list) and len(v) == 3 and all(_whole(n, 0, MAX_TOKENS) for n in v))
    ),
)
ROLE = AnyOf((word("cond", "uncond"), NULL))
NAMES = Value(  # run.json's sources: each kind's attention ("self", "text", "image", "audio")
    "an object of strings", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
)

SELECTION = Fields(
    "an object of the capture options",
    {
        "kinds": ListOf(TEXT),
        "layers": AnyOf((word("all"), ListOf(AnyOf((INDEX, TEXT))))),
        "steps": AnyOf((word("all"), INDICES)),
        "batch": AnyOf((word("auto", "all", "cond", "uncond"), INDICES)),
        "heads": AnyOf((word("all", "mean"), INDICES)),
        "queries": AnyOf((NULL, ListOf(POINT))),
        "block_size": POSITIVE,
        "tile_shape": ListOf(POSITIVE, most=3, exact=True),
        "topk": POSITIVE,
        "top_p": ListOf(MASS),
        "patterns": ListOf(TEXT),
        "memory_budget": AnyOf((whole(0, 2**62), TEXT)),
        "method": TEXT,
        "batch_resolved": AnyOf((NULL, INDICES)),
        "batch_roles": AnyOf((NULL, ListOf(ROLE))),
        "heads_resolved": AnyOf((NULL, INDICES)),
        "source_heads": Value(  # each attention's heads (LTX-2's audio has its own): a list, or null for a mean
            "an object of attentions and their heads (lists of whole numbers 0 or more, or null)",
            lambda v: isinstance(v, dict) and all(x is None or INDICES.problem(x, "") is None for x in v.values()),
        ),
        "text_lengths": AnyOf((NULL, ListOf(whole(0, MAX_TOKENS)))),
        "query_lengths": AnyOf((NULL, ListOf(whole(0, MAX_TOKENS)))),
        # text_spans: checked_text_spans, against the layout
    },
)
MODEL = Fields(
    "an object of the model's facts",
    {
        "family": TEXT,
        "class": AnyOf((TEXT, NULL)),
        "experts": ListOf(TEXT),
        "layer_names": AnyOf((NULL, ListOf(TEXT))),
        "step_experts": AnyOf((NULL, ListOf(TEXT))),
        "config": Fields("an object of the transformer's config", {"num_attention_heads": whole(1, MAX_INDEX)}),
        "dtype": AnyOf((TEXT, NULL)),
        "pipeline": AnyOf((TEXT, NULL)),
    },
)
CHECK = Fields(
    "an object of a spot check's facts",
    {
        "step": INDEX,
        "layer": INDEX,
        "what": TEXT,
        "device": TEXT,
        "dtype": TEXT,
        "rows": whole(0, MAX_TOKENS),
        "max_error": AnyOf((NUMBER, NULL)),
        "tolerance": AnyOf((NUMBER, NULL)),
        "passed": FLAG,
    },
)
SKIPPED = Fields(
    "an object of what a cache skipped",
    {
        "by": AnyOf((TEXT, NULL)),
        "calls": ListOf(TRIPLE),
        "partial": ListOf(TRIPLE),
        "halves": INDICES,
        "perturbed": INDICES,
    },
)
CALL_STAT = Fields(
    "an object of step, layer, name and values",
    {"step": INDEX, "layer": INDEX, "name": TEXT, "values": ListOf(ListOf(AnyOf((FINITE, NULL))))},
)

RUN_JSON = Fields(
    "an object",
    {
        "format": TEXT,
        "status": word(*STATUSES),
        "complete": FLAG,
        "steps": INDEX,
        "timesteps": ListOf(AnyOf((NUMBER, NULL))),
        "windows": INDICES,
        "selection": SELECTION,
        "model": MODEL,
        "call_stats": ListOf(CALL_STAT),
        "sources": NAMES,
        "layer_output": TEXT,
        "storage_dtype": TEXT,
        "info": OBJECT,
        "checks": ListOf(CHECK),
        "skipped": SKIPPED,
        "versions": OBJECT,
    },
)
"""Every field of run.json a reader uses, with its type and range (``layout``: ``checked_layout``)."""


def read_meta(meta: dict, meta_file: Path) -> tuple[TokenLayout | None, tuple[dict, ...] | None, RecordShapes]:
    """run.json's values, every one checked as a run is opened: its layout (:func:`checked_layout`), every other
    field (:func:`check_meta`), the text spans (:func:`checked_text_spans`), and what run.json says each record
    holds (:class:`RecordShapes`, for the manifest's lines).

    Raises:
        StoreError: one line naming ``meta_file`` and the first field that cannot be read.
    """
    layout = checked_layout(meta.get("layout"), meta_file)
    check_meta(meta, meta_file, layout)
    own = checked_layer_layouts(meta.get("layer_layouts"), meta_file)
    return layout, checked_text_spans(meta.get("selection"), layout, meta_file), RecordShapes.of(meta, layout, own)


def check_meta(meta: dict, meta_file: Path, layout: TokenLayout | None = None) -> None:
    """Check run.json's values against :data:`RUN_JSON`, and the fields that name the layout's tokens against
    ``layout`` (the recorded queries on its grid and sequence, one role per recorded slot).

    Raises:
        StoreError: one line naming ``meta_file``, the field (``selection.heads``, ``checks[2].passed``), its value
            and what it must be.
    """
    written = meta.get("format", FORMAT) if isinstance(meta, dict) else FORMAT
    if written != FORMAT:  # a later format: its fields may mean other things than these
        shown = repr(written) if len(repr(written)) <= 60 else repr(written)[:57] + "..."
        raise StoreError(
            f"{str(meta_file)!r}: format is {shown}, not {FORMAT!r}, the run format this version of cogattn reads; "
            "read it with the cogattn that wrote it (or a later one)."
        )
    found = RUN_JSON.problem(meta, "") or _across(meta, layout)
    if found is not None:
        path, value, words = found
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise StoreError(
            f"{str(meta_file)!r}: {path or 'the file'} is {shown}; it must be {words}. The run cannot be read "
            "(fix or remove the field)."
        )


def _across(meta: dict, layout: TokenLayout | None) -> tuple[str, object, str] | None:
    """What one field says that another does not allow (a query beyond the layout, a role per slot, the heads of
    ``heads="all"``), or `None`."""
    selection = meta.get("selection") or {}
    resolved, roles = selection.get("batch_resolved"), selection.get("batch_roles")
    if isinstance(resolved, list) and isinstance(roles, list) and len(roles) != len(resolved):
        return "selection.batch_roles", roles, f"one role per recorded slot ({len(resolved)}, batch_resolved's)"
    config = (meta.get("model") or {}).get("config") or {}
    if (
        selection.get("heads") == "all"
        and selection.get("heads_resolved") is None
        and "num_attention_heads" not in config
    ):
        return "selection.heads_resolved", None, "the heads of heads='all' (or model.config's num_attention_heads)"
    if layout is None:
        return None
    for i, q in enumerate(selection.get("queries") or ()):
        on_grid = isinstance(q, list) and all(n < m for n, m in zip(q, layout.grid))
        if not (on_grid or (isinstance(q, int) and q < layout.seq_len)):
            words = f"a token below {layout.seq_len} or a [frame, row, column] on the grid {list(layout.grid)}"
            return f"selection.queries[{i}]", q, words
    return None
