"""cogattn: exact, memory-bounded attention maps from video diffusion transformers (CogVideoX, Wan,
HunyuanVideo, Mochi and their relatives: :mod:`cogattn.models`) with the model's output untouched.

```python
with cogattn.record(pipe, kinds=("frame", "video_to_text")) as rec:
    pipe(prompt=...)
rec.get("frame", step=0, layer=1)
```

The public names: :func:`record` and :class:`Recording` (capture), :class:`CaptureOptions` (every
option), :func:`load` and :class:`Run` (runs on disk), :func:`estimate` (costs before a run),
:class:`TokenLayout` (token order and frames), the processors for hand wiring, and the errors.
Figures are in :mod:`cogattn.plot`, the numbers behind them in :mod:`cogattn.analysis`.
"""

from .audio import AudioAxis
from .errors import NotRecordedError, StoreError
from .estimate import Estimate, estimate
from .exact.context import VideoToImageReducer  # noqa: F401  (registers the video_to_image kind)
from .exact.reducers import REDUCERS
from .layout import TokenLayout
from .models import wan as _wan
from .models.cogvideox import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor
from .options import CaptureOptions
from .recorder.recording import Recording, record
from .runs.run import Run, load
from .version import __version__

KINDS = tuple(REDUCERS)  # every kind; a family refuses those it has no attention for (cogattn.models)
WanAttnMapProcessor = None if _wan is None else _wan.WanAttnMapProcessor  # None: diffusers < 0.35

__all__ = [
    "AudioAxis",
    "KINDS",
    "CaptureOptions",
    "CogVideoXAttnMapProcessor",
    "Estimate",
    "FusedCogVideoXAttnMapProcessor",
    "NotRecordedError",
    "Recording",
    "Run",
    "StoreError",
    "TokenLayout",
    "WanAttnMapProcessor",
    "estimate",
    "load",
    "record",
    "__version__",
]
