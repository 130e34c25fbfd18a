"""The viewer's parameters: the JSON API's, checked in one place before a panel is asked (:func:`parse`), and the
sizes ``--export`` keeps by default (:data:`MAX_TOKENS`, :data:`MAX_STEPS`, :data:`MAX_SIDE`), which the command
line reads before anything heavy is imported.

Each endpoint names its parameters in :data:`ENDPOINTS`; a parameter is read by its entry of :data:`READERS` and
checked against the run where the run fixes its range (a batch slot of the recorded batch, a point on the latent
grid, a text token of the prompt). A request the run cannot answer as asked is a :class:`BadRequest`, which the
server answers with 400 and one line naming the parameter, its value and what it may be; what the run did not
record (a step, a layer, a head) is the panel's own answer, which says what was recorded.
"""

from __future__ import annotations

from ..items import pick_item
from ..runs.folder import MAX_INDEX

__all__ = ["ENDPOINTS", "MAX_SIDE", "MAX_STEPS", "MAX_TOKENS", "READERS", "BadRequest", "parse"]

MAX_TOKENS = 64  # text tokens of the word kinds an export keeps per step
MAX_STEPS = 10  # steps of the word kinds an export keeps: the first, the last, and evenly between
MAX_SIDE = 24  # patches a side an export keeps per frame of a word map (average pooling above it)
_SELECTION = ("step", "layer", "head")
ENDPOINTS = {  # each endpoint's parameters, in the order the view's method takes them
    "/api/summary": (),
    "/api/map": ("kind", *_SELECTION, "token", "item"),
    "/api/block": (*_SELECTION, "mask", "item"),
    "/api/tile": (*_SELECTION, "pattern", "item"),
    "/api/density": (*_SELECTION, "item"),
    "/api/decay": (*_SELECTION, "item"),
    "/api/track": (*_SELECTION, "frame", "row", "col", "item"),
    "/api/point": (*_SELECTION, "frame", "row", "col", "item"),
    "/api/heads": ("step", "column", "item"),
}
DEFAULTS = {"layer": "mean", "head": "mean", "token": None, "item": None}
DEFAULTS.update(mask="none", pattern="none", column="same_frame_mass")


class BadRequest(ValueError):
    """A parameter the request names wrongly: its one line is the answer (HTTP 400)."""


def _index(name: str, raw: str, words=()) -> int | str:
    """``raw`` as a whole number from 0 to :data:`MAX_INDEX`, or one of ``words``."""
    if raw in words:
        return raw
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 7 and int(raw) < MAX_INDEX):
        also = "".join(f" or {w!r}" for w in words)
        raise BadRequest(f"{name}={raw[:40]!r} is not a whole number from 0 to {MAX_INDEX - 1}{also}; pass one.")
    return int(raw)


def _word(name: str, raw: str) -> str:
    """A name the panel checks itself (a kind, a mask, a pattern, a column): at most 80 characters."""
    if len(raw) > 80:
        raise BadRequest(f"{name}={raw[:40]!r}... is longer than any {name}; pass one the page lists.")
    return raw


def _item(view, raw: str) -> int | str:
    """A slot of the recorded batch axis, or ``"cond"``/``"uncond"`` where a slot has that role."""
    roles = view.roles()
    item = raw if raw in ("cond", "uncond") else _index("item", raw)
    try:
        slot = pick_item(view.run, item)
    except (TypeError, ValueError) as err:
        raise BadRequest(f"item={item!r}: {err}") from None
    if not 0 <= slot < len(roles):
        raise BadRequest(
            f"item={item!r} is out of range: this run recorded {len(roles)} batch slot(s), 0 to {len(roles) - 1}; "
            "pass one of them (or leave item out: the first conditional item)."
        )
    return item


def _on_grid(name: str, axis: int):
    """A latent frame, patch row or patch column of the run's grid (any whole number where it has no layout:
    the panel says so)."""

    def read(view, raw: str) -> int:
        n, lay = _index(name, raw), view.run.layout
        if lay is not None and n >= lay.grid[axis]:
            grid = " × ".join(map(str, lay.grid))
            raise BadRequest(
                f"{name}={n} is out of range: the latent grid is {grid} (frames × rows × columns); pass 0 to "
                f"{lay.grid[axis] - 1}."
            )
        return n

    return read


def _token(view, raw: str) -> int:
    layout = view.run.layout  # checked when the run was opened (the batch tool's token names may be fewer)
    n, count = _index("token", raw), 0 if layout is None else layout.prompt_len
    if n >= count:
        raise BadRequest(f"token={n} is out of range: the run has {count} text token(s); pass 0 to {count - 1}.")
    return n


READERS = {  # name -> reader(view, raw text) -> value
    "kind": lambda view, raw: _word("kind", raw),
    "step": lambda view, raw: _index("step", raw),
    "layer": lambda view, raw: _index("layer", raw, ("mean",)),
    "head": lambda view, raw: _index("head", raw, ("mean",)),
    "token": _token,
    "item": _item,
    "frame": _on_grid("frame", 0),
    "row": _on_grid("row", 1),
    "col": _on_grid("col", 2),
    "mask": lambda view, raw: _word("mask", raw),
    "pattern": lambda view, raw: _word("pattern", raw),
    "column": lambda view, raw: _word("column", raw),
}


def parse(view, path: str, query: dict[str, str]) -> list:
    """The values of ``path``'s parameters (:data:`ENDPOINTS`) from ``query``, in order, each checked against the
    run of ``view``; a missing one takes its default (:data:`DEFAULTS`).

    Raises:
        BadRequest: a parameter missing without a default, or not one the run can answer.
    """
    values = []
    for name in ENDPOINTS[path]:
        raw = query.get(name)
        if raw is None or (raw == "" and name in DEFAULTS):
            if name not in DEFAULTS:
                raise BadRequest(f"missing parameter {name!r}; {path} takes {', '.join(ENDPOINTS[path])}.")
            values.append(DEFAULTS[name])
        else:
            values.append(READERS[name](view, raw))
    return values
