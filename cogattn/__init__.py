"""cogattn: exact, memory-bounded attention maps from CogVideoX with the model's output untouched."""

from .layout import TokenLayout
from .processor import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor
from .recording import Recording, record
from .reducers import REDUCERS
from .store import Run, StoreError, load

__version__ = "0.1.0"
KINDS = tuple(REDUCERS)

__all__ = [
    "KINDS",
    "CogVideoXAttnMapProcessor",
    "FusedCogVideoXAttnMapProcessor",
    "Recording",
    "Run",
    "StoreError",
    "TokenLayout",
    "load",
    "record",
    "__version__",
]
