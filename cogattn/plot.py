"""Figures of attention maps: frame-to-frame heatmaps, word maps on the video, query maps, grids over
layers × steps, and animations.

Every function takes a *source*: an in-memory :class:`cogattn.Recording` or a run opened with
:func:`cogattn.load`, and returns a ``matplotlib.figure.Figure`` made without pyplot (no global backend
or state): a notebook shows it when it is a cell's value, ``fig.savefig(path)`` saves it, and
``fig=plt.figure()`` draws into a pyplot figure instead.

```python
from cogattn import plot
plot.frame_heatmap(rec, heads="all")                                   # (G × G) per head
plot.word_heatmap(rec, ["fox", "snow"], video, tokenizer=pipe.tokenizer, prompt=prompt)
plot.query_map(rec, (1, 1, 2), video, scale="log")
plot.animate(plot.word_heatmap, rec, "fox.gif", over="step", tokens="fox", video=video,
             tokenizer=pipe.tokenizer, prompt=prompt)
```
"""

from __future__ import annotations

from .plot_animate import animate, explore
from .plot_frames import frame_heatmap, layer_step_grid
from .plot_maps import aggregate, text_tokens, word_positions
from .plot_overlays import query_map, word_heatmap
from .plot_video import pixel_frames, upsample_to_video

__all__ = [
    "aggregate",
    "animate",
    "explore",
    "frame_heatmap",
    "layer_step_grid",
    "pixel_frames",
    "query_map",
    "text_tokens",
    "upsample_to_video",
    "word_heatmap",
    "word_positions",
]
