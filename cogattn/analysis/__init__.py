"""The numbers behind the figures, no plotting (no matplotlib): :mod:`~cogattn.analysis.maps` (maps averaged
over steps, layers and heads, what a source recorded, which recorded row holds a query token; its names are
this package's), :mod:`~cogattn.analysis.words` (a prompt's text tokens and word positions),
:mod:`~cogattn.analysis.head_stats` (the head table and its labels), :mod:`~cogattn.analysis.decay` (decay over
time and space from ``offset``), :mod:`~cogattn.analysis.density` (the keys attention needs, from ``top_p``),
:mod:`~cogattn.analysis.masks` (block and tile masks and their recall), :mod:`~cogattn.analysis.pattern_heads`
(heads labelled by each pattern's output error) and :mod:`~cogattn.analysis.tracks` (correspondence from
``frame_max``).

```python
from cogattn.analysis import aggregate, head_stats
aggregate(rec, "frame")                  # (G, G): mean over recorded steps, layers, heads
head_stats.head_table(rec)               # one row per step, layer, head and item
```
"""

from . import maps
from .maps import *  # noqa: F403  (the package's names are maps's)

__all__ = maps.__all__
