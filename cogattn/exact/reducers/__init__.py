"""Reducers: each folds exact attention-probability tiles of one layer call into one small result.

A reducer asks the engine for one of two things:

* ``rows``: exact probability rows ``P[i, :]`` for the query tokens ``i`` it lists, delivered to
  :meth:`Reducer.fold_rows` as tiles ``(h, r, S)``;
* ``key_groups``: for every query token, the sums of ``P[i, j]`` over keys ``j`` in each of its key
  groups, delivered to :meth:`Reducer.fold_pooled` as tiles ``(h, r, C)``. Key-pooled sums are what the
  engine can compute without forming P (attention applied to an indicator matrix, see docs/design.md);
* ``stat``: a row statistic, ``"entropy"`` (per query, delivered to :meth:`Reducer.fold_pooled` as
  ``(h, r, 1)``) or ``"received"`` (per key, column sums over every query, delivered to
  :meth:`Reducer.fold_received` as ``(h, S)`` partial sums), which the engine computes from row tiles
  or from fused passes with other value matrices (docs/design.md says why each is exact).

Every result is float32 with shape ``(B, H, ...)``; ``H`` is 1 when heads are averaged. To add a kind,
subclass :class:`Reducer`, give it its ``kind``, ``dims`` and ``unit``, implement ``shape`` and one
``fold_*`` method, and register it in ``REDUCERS``; plots, the store and ``estimate`` read the rest from
the class.
"""

from __future__ import annotations

from ..key_groups import KeyGroups
from .audio import AUDIO_REDUCERS
from .base import Reducer
from .context import ContextReducer, VideoToImageReducer
from .offsets import OffsetReducer
from .patterns import PatternErrorReducer, PatternRecallReducer
from .pooled import BlockReducer, FrameReducer, QueryFrameReducer, TileReducer, VideoToTextReducer
from .ranked import FrameMax, FrameMaxReducer, TopPReducer
from .rows import FullReducer, QueryReducer, TextToVideoReducer, TopK, TopKReducer
from .stats import EntropyReducer, ReceivedReducer

__all__ = [
    "KeyGroups",
    "Reducer",
    "FullReducer",
    "FrameReducer",
    "VideoToTextReducer",
    "TextToVideoReducer",
    "QueryReducer",
    "QueryFrameReducer",
    "BlockReducer",
    "TileReducer",
    "EntropyReducer",
    "ReceivedReducer",
    "TopK",
    "TopKReducer",
    "OffsetReducer",
    "PatternRecallReducer",
    "PatternErrorReducer",
    "TopPReducer",
    "FrameMax",
    "FrameMaxReducer",
    "ContextReducer",
    "VideoToImageReducer",
    "CONTEXT_REDUCERS",
    "REDUCERS",
]


REDUCERS: dict[str, type[Reducer]] = {
    cls.kind: cls
    for cls in (
        FullReducer,
        FrameReducer,
        VideoToTextReducer,
        TextToVideoReducer,
        QueryReducer,
        EntropyReducer,
        ReceivedReducer,
        QueryFrameReducer,
        BlockReducer,
        TileReducer,
        TopKReducer,
        TopPReducer,
        FrameMaxReducer,
        OffsetReducer,
        PatternRecallReducer,
        PatternErrorReducer,
    )
}
# The kinds of the attentions beside the self-attention, by kind (``video_to_text`` is the cross-attention's here)
CONTEXT_REDUCERS = {cls.kind: cls for cls in (ContextReducer, VideoToImageReducer)} | AUDIO_REDUCERS
# Every kind the options, the store and the plots know: the self-attention's, and the other attentions' own kinds
REDUCERS |= {kind: cls for kind, cls in CONTEXT_REDUCERS.items() if kind not in REDUCERS}
