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

Each name is imported at its first use (``import cogattn`` imports neither torch nor diffusers), so the command
line answers at once; a processor's family imports diffusers' model code only then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:  # what the names are, for readers of the code and the documentation's builder
    from .audio import AudioAxis
    from .costs import Estimate, estimate
    from .errors import NotRecordedError, StoreError
    from .layout import TokenLayout
    from .models.cogvideox import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor
    from .models.wan import WanAttnMapProcessor
    from .options import CaptureOptions
    from .recorder.recording import Recording, record
    from .runs.run import Run, load

# name → the module that defines it
_WHERE = {
    "AudioAxis": "audio",
    "CaptureOptions": "options",
    "Estimate": "costs",
    "NotRecordedError": "errors",
    "Recording": "recorder.recording",
    "Run": "runs.run",
    "StoreError": "errors",
    "TokenLayout": "layout",
    "estimate": "costs",
    "load": "runs.run",
    "record": "recorder.recording",
}
# the processors for hand wiring → their family, whose module imports diffusers' model code
_PROCESSORS = {
    "CogVideoXAttnMapProcessor": "cogvideox",
    "FusedCogVideoXAttnMapProcessor": "cogvideox",
    "WanAttnMapProcessor": "wan",  # None where this diffusers lacks Wan (< 0.35)
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name in _PROCESSORS:
        module = getattr(importlib.import_module(".models", __name__), _PROCESSORS[name])  # None: diffusers lacks it
        return None if module is None else getattr(module, name)
    elif name == "KINDS":  # every kind; a family refuses those it has no attention for (cogattn.models)
        value = tuple(importlib.import_module(".exact.reducers", __name__).REDUCERS)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
