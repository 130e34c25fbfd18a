"""Layers of another token layout in one source: where some layers attend over another sequence than the
generation's (``source.layout_of(layer)``: Motif-Video's decoder layers, over two copies of the grid), a selection of
``layers="all"`` means the generation's layers, a mean never mixes layouts, and a figure of other layers reads their
own (:func:`for_layers`)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence

from ..layout import TokenLayout

__all__ = ["check_one_layout", "for_layers", "layers_view", "layout_of", "of_generation"]


def layout_of(source, layer: int) -> TokenLayout | None:
    """The token layout of ``layer``'s records in ``source``: its own, or the generation's (``source.layout``)."""
    own = getattr(source, "layout_of", None)
    return own(layer) if own is not None else source.layout


def of_generation(source, layers: Sequence[int]) -> list[int]:
    """Those of ``layers`` on the generation's layout; all of them where none is (a selection of other layers only)."""
    main = [n for n in layers if layout_of(source, n) == source.layout]
    return main or list(layers)


def check_one_layout(source, layers: Sequence[int], what: str) -> TokenLayout | None:
    """The one layout of ``layers``; `ValueError` naming two that differ (``what``: what would have mixed them)."""
    found = {n: layout_of(source, n) for n in layers}
    first = next(iter(found.values()), source.layout)
    other = next((n for n, lay in found.items() if lay != first), None)
    if other is not None:
        mine = next(iter(found))
        raise ValueError(
            f"{what} would mix token layouts: layer {mine} attends over {_tokens(first)}, layer {other} over "
            f"{_tokens(found[other])}; choose layers of one layout (source.layout_of(layer) tells each)."
        )
    return first


def _tokens(layout: TokenLayout | None) -> str:
    if layout is None:
        return "an unknown sequence"
    copies = f" ({layout.grids} copies of the grid)" if layout.grids > 1 else ""
    return f"{layout.frames} latent frames{copies} and {layout.text_len} text tokens"


class _OwnLayout:
    """``source`` with the ``layout`` of some of its layers: what a figure of those layers reads."""

    def __init__(self, source, layout: TokenLayout):
        self._source, self.layout = source, layout

    def __getattr__(self, name: str):
        return getattr(self._source, name)


def for_layers(source, kind: str, layers, what: str = "a figure"):
    """``source`` as a figure of ``kind`` at ``layers`` (``"all"``, a layer, or a list, as
    :func:`cogattn.analysis.maps.choose` takes them) reads it: itself where they are the generation's layers, else a
    view of it whose ``layout`` is theirs; a `ValueError` where the chosen layers mix layouts. A selector it cannot
    read is left to the figure's own reading, which refuses it in its words."""
    if isinstance(layers, str):
        chosen = of_generation(source, sorted({n for k, _, n in source.keys() if k == kind})) if layers == "all" else []
    elif isinstance(layers, Iterator):  # read once, by the figure's own selection
        return source
    else:
        try:
            chosen = [operator.index(n) for n in (layers if isinstance(layers, Iterable) else [layers])]
        except TypeError:
            chosen = []
    if not chosen:
        return source
    return layers_view(source, chosen, f"{what} of {kind!r} at layers={layers!r}")


def layers_view(source, layers: Sequence[int], what: str):
    """``source`` as a reader of the chosen ``layers`` sees it: itself on the generation's layout, else a view whose
    ``layout`` is theirs; a `ValueError` where they mix layouts (``what``: the reader)."""
    layout = check_one_layout(source, layers, what)
    return source if layout == source.layout else _OwnLayout(source, layout)
