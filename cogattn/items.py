"""Which batch item a result slot holds, and which one a reader shows.

Under classifier-free guidance the transformer's batch is ``[uncond..., cond...]``: the negative prompt's
items, then the prompt's. A recording keeps each slot's role (``Recording.batch_roles``, ``run.json``'s
``selection.batch_roles``); every reader shows the first conditional item unless told otherwise, so a map
shown under the prompt's words is the prompt's, and figures name the item they show.

Two numbers meet here: a reader's ``batch=`` is a slot of the recorded batch axis (``rec.get(...)[slot]``), and a
figure names the item by its number in the transformer's batch, the one ``batch=[...]`` of ``record`` takes
(``Recording.batch_items``, ``Run.batch_items``): with ``batch="cond"`` of a guidance batch of two, slot 0 holds
``batch item 1``.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

__all__ = ["as_index", "item_label", "item_role", "pick_item", "table_source"]


def item_role(item: int, batch_size: int, guidance: bool | None) -> str | None:
    """What transformer batch item ``item`` is: ``"uncond"`` (the negative prompt's) or ``"cond"`` (the
    prompt's) in a guidance batch ``[uncond..., cond...]``; `None` without guidance, or where it is unknown
    (a bare transformer)."""
    if not guidance or batch_size < 2 or batch_size % 2:
        return None
    return "uncond" if item < batch_size // 2 else "cond"


def as_index(value):
    """An index (a step, layer, head or batch slot) given as any integer (NumPy's, a 0-d tensor's, read from a table)
    as an ``int``; a ``bool`` refused (`TypeError`: it is no index); anything else as it is."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not an index: pass an integer, or a list of them.")
    scalar = hasattr(value, "__index__") and getattr(value, "ndim", 0) == 0  # an array or tensor of several: a list
    return operator.index(value) if scalar and not isinstance(value, int) else value


def pick_item(source, batch: int | str | None = None) -> int:
    """The slot of ``source``'s batch axis (a `Recording` or a `Run`) that ``batch`` names: a slot index,
    ``"cond"`` or ``"uncond"`` (the first such item under guidance), or `None`: the first conditional item,
    else slot 0 (no guidance, or a run that does not say). So a map shown under a prompt's words is the
    prompt's, never the negative prompt's, unless asked for.

    Raises:
        ValueError: ``"cond"``/``"uncond"`` where no such item was recorded, or another word; a slot index the
            results do not hold.
        TypeError: ``batch`` is neither an integer, a word nor `None`.
    """
    roles = getattr(source, "batch_roles", None)
    if batch is None:
        return next((i for i, r in enumerate(roles or ()) if r != "uncond"), 0)
    if isinstance(batch, str):
        if batch not in ("cond", "uncond"):
            raise ValueError(f"batch={batch!r}; pass a recorded slot index, 'cond' or 'uncond'.")
        if not roles or batch not in roles:
            raise ValueError(
                f"batch={batch!r}, but the recorded items are {list(roles) if roles else 'not a guidance batch'}"
                " (batch='all' under guidance records both halves); pass a slot index."
            )
        return roles.index(batch)
    try:
        slot = operator.index(as_index(batch))
    except TypeError:
        raise TypeError(f"batch={batch!r}: pass a slot index, 'cond', 'uncond' or None.") from None
    slots = len(getattr(source, "batch_items", None) or roles or ())  # 0: the source does not say
    if slots and not 0 <= slot < slots:  # -1 would read the last slot under another item's label
        raise ValueError(
            f"batch={batch!r} is out of range: {slots} batch item(s) were recorded (slots 0..{slots - 1})."
        )
    return slot


def item_label(source, batch: int | str | None = None) -> str:
    """What slot ``batch`` (see :func:`pick_item`) of the results holds, for a figure's title: ``"batch item
    N"``, N its transformer batch item (``source.batch_items``; the slot where the source does not say), and under
    guidance ``", conditional: '<prompt>'"`` or ``", unconditional: '<negative prompt>'"`` (the texts from ``info``
    where the recording kept them)."""
    slot = pick_item(source, batch)
    roles = getattr(source, "batch_roles", None) or ()
    items = getattr(source, "batch_items", None) or ()
    item = items[slot] if 0 <= slot < len(items) else slot
    role = roles[slot] if 0 <= slot < len(roles) else None
    if role is None:
        return f"batch item {item}"
    name = f"batch item {item}, {'conditional' if role == 'cond' else 'unconditional'}"
    text = (getattr(source, "info", None) or {}).get("prompt" if role == "cond" else "negative_prompt")
    if not isinstance(text, str):
        return name
    text = " ".join(text.split())
    text = text if len(text) <= 48 else text[:47] + "…"
    return f"{name}: {text!r}" if text else f"{name}: the empty prompt"


def table_source(attrs: dict) -> SimpleNamespace:
    """What a table's ``attrs`` keep of its source's batch axis (``batch_roles``, ``batch_items``: the head, decay and
    pattern tables'), read as :func:`pick_item` and :func:`item_label` read a source."""
    return SimpleNamespace(batch_roles=attrs.get("batch_roles"), batch_items=attrs.get("batch_items"))
