"""Figures of attention maps: frame-to-frame heatmaps, word maps on the video, query maps, grids over
layers × steps, what each head does (atlas, decay with frame distance), per-token entropy and attention
sinks on the video, block maps with sparse-attention masks, and animations.

Every function takes a *source* (a :class:`cogattn.runs.run.MapSource`): an in-memory
:class:`cogattn.Recording` or a run opened with :func:`cogattn.load`, and returns a
``matplotlib.figure.Figure`` made without pyplot (no global backend or state): a notebook shows it when
it is a cell's value, ``fig.savefig(path)`` saves it, and ``fig=plt.figure()`` draws into a pyplot
figure instead. The numbers behind the figures are in :mod:`cogattn.analysis` (``aggregate``) and the
text tokens of a prompt in :mod:`cogattn.analysis.words`; the head table in :mod:`cogattn.analysis.head_stats` and block masks
in :mod:`cogattn.analysis.masks`.

```python
from cogattn.analysis import masks
from cogattn import plot
plot.frame_heatmap(rec, heads="all")                                   # (G × G) per head
plot.word_heatmap(rec, ["fox", "snow"], video, tokenizer=pipe, prompt=prompt)  # pipe: its template
plot.query_map(rec, (1, 1, 2), video, scale="log")
plot.word_heatmap(rec, [0, 5], video, kind="video_to_image")          # Wan 2.1 I2V: image tokens
plot.animate(plot.word_heatmap, rec, "fox.gif", over="step", tokens="fox", video=video,
             tokenizer=pipe, prompt=prompt)
plot.head_atlas(rec)                                                   # layers × heads, by label
plot.token_stat(rec, "received", video)                                # attention sinks on the video
plot.block_map(rec, masks.same_frame_mask(rec.layout, rec.block_size), scale="log")
```

Modules: :mod:`~cogattn.plot.style` (colour scales, colour bars, titles, ticks),
:mod:`~cogattn.plot.frames` (frame heatmap, layers × steps grid), :mod:`~cogattn.plot.overlays` (word
and query maps on the video), :mod:`~cogattn.plot.video` (video arrays, upsampling to pixels, GIF and
MP4 files), :mod:`~cogattn.plot.animation` (animations and notebook sliders), :mod:`~cogattn.plot.heads`
(head atlas and decay curves from the head table), :mod:`~cogattn.plot.stats` (per-token entropy and
received attention on the video, block maps with a mask's outline and recall), :mod:`~cogattn.plot.decay`
(the ``offset`` map per latent-frame offset, and the decay with temporal and spatial distance with its fit),
:mod:`~cogattn.plot.density` (keys needed against mass p, from ``top_p``), :mod:`~cogattn.plot.tracks` (a
point's track on the video and the motion field between two frames, from ``frame_max``), :mod:`~cogattn.plot.audio`
(LTX-2's audio ↔ video maps, latent frames × audio bins in seconds).
"""

from __future__ import annotations

from .animation import animate, explore
from .audio import audio_sync
from .decay import distance_decay, offset_map
from .density import density_curves
from .frames import frame_heatmap, layer_step_grid
from .heads import LABEL_COLORS, decay_curves, head_atlas
from .overlays import query_map, word_heatmap
from .stats import block_map, mask_outline, token_stat
from .tracks import motion_figure, track_figure
from .video import upsample_to_video

__all__ = [
    "LABEL_COLORS",
    "animate",
    "audio_sync",
    "block_map",
    "decay_curves",
    "density_curves",
    "distance_decay",
    "explore",
    "frame_heatmap",
    "head_atlas",
    "layer_step_grid",
    "mask_outline",
    "motion_figure",
    "offset_map",
    "query_map",
    "token_stat",
    "track_figure",
    "upsample_to_video",
    "word_heatmap",
]
