"""Plans for the layers of another layout: where some layers of a family attend over another sequence than the
generation's (``ModelSpec.layer_layouts``: Motif-Video's decoder layers, over two copies of the grid), each such
layout gets a :class:`cogattn.exact.planner.CapturePlan` of its own, of the selected kinds it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..layout import TokenLayout
from .reducers import REDUCERS

__all__ = ["kinds_at", "layer_plans", "records"]


def kinds_at(options, layout: TokenLayout, other: TokenLayout, sources: dict[str, str]) -> tuple[str, ...]:
    """The selected self-attention kinds a layer of layout ``other`` holds: not a cross-attention's (``sources``),
    no kind of the text where ``other`` has none, and ``query`` only where each chosen token is the same video token
    in both layouts (a text token of ``layout`` is none of ``other``'s)."""

    def same(q) -> bool:
        if not isinstance(q, int):  # (frame, row, column) on the grid: its token in every layout of that grid
            return True
        where = layout.coordinates(q)
        return where is not None and other.token_index(*where) == q

    texts = {kind for kind, cls in REDUCERS.items() if "text token" in cls.dims}
    return tuple(
        kind
        for kind in options.kinds
        if kind not in sources
        and (other.text_len or kind not in texts)
        and (kind != "query" or all(map(same, options.queries or ())))
    )


def layer_plans(plan, planned: Callable, layouts: dict[int, TokenLayout], sources: dict[str, str]) -> dict:
    """Layer → the plan of its own layout (`None` where it holds no selected kind), for the layers of ``layouts``;
    ``planned(options, layout)`` plans one layout as ``plan`` (the generation's) was planned."""
    made: dict[TokenLayout, object] = {}
    for other in set(layouts.values()):
        kinds = kinds_at(plan.options, plan.layout, other, sources)
        made[other] = planned(dataclasses.replace(plan.options, kinds=kinds), other) if kinds else None
    return {layer: made[other] for layer, other in layouts.items()}


def records(plan, plans: dict, num_layers: int, num_steps: int | None) -> list[tuple[str, tuple[int, ...], int, int]]:
    """:meth:`CapturePlan.records` of a generation whose layers ``plans`` have plans of their own: each plan's
    records, counted over the selected layers it serves."""
    out = []
    for served in [plan, *{id(p): p for p in plans.values() if p is not None}.values()]:
        layers = [n for n in range(num_layers) if plans.get(n, plan) is served and plan.options.wants_layer(n)]
        steps = served.steps_captured(num_steps)
        out += [(kind, shape, size, len(layers) * steps) for kind, shape, size, _ in served.records(num_steps)]
    return out
