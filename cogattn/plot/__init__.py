"""Figures of attention maps: frame-to-frame heatmaps, word maps on the video, query maps, grids over
layers × steps, and animations.

Every function takes a *source* (a :class:`cogattn.run.MapSource`): an in-memory
:class:`cogattn.Recording` or a run opened with :func:`cogattn.load`, and returns a
``matplotlib.figure.Figure`` made without pyplot (no global backend or state): a notebook shows it when
it is a cell's value, ``fig.savefig(path)`` saves it, and ``fig=plt.figure()`` draws into a pyplot
figure instead. The numbers behind the figures are in :mod:`cogattn.analysis` (``aggregate``) and the
text tokens of a prompt in :mod:`cogattn.words`.

```python
from cogattn import plot
plot.frame_heatmap(rec, heads="all")                                   # (G × G) per head
plot.word_heatmap(rec, ["fox", "snow"], video, tokenizer=pipe.tokenizer, prompt=prompt)
plot.query_map(rec, (1, 1, 2), video, scale="log")
plot.animate(plot.word_heatmap, rec, "fox.gif", over="step", tokens="fox", video=video,
             tokenizer=pipe.tokenizer, prompt=prompt)
```

Modules: :mod:`~cogattn.plot.style` (colour scales, colour bars, titles, ticks),
:mod:`~cogattn.plot.frames` (frame heatmap, layers × steps grid), :mod:`~cogattn.plot.overlays` (word
and query maps on the video), :mod:`~cogattn.plot.video` (video arrays, upsampling to pixels, GIF and
MP4 files), :mod:`~cogattn.plot.animation` (animations and notebook sliders).
"""

from __future__ import annotations

from .animation import animate, explore
from .frames import frame_heatmap, layer_step_grid
from .overlays import query_map, word_heatmap
from .video import upsample_to_video

__all__ = [
    "animate",
    "explore",
    "frame_heatmap",
    "layer_step_grid",
    "query_map",
    "upsample_to_video",
    "word_heatmap",
]
