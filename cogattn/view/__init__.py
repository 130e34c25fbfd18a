"""``cogattn view``: see a run, or a folder of runs, in the browser (docs/design.md, "The viewer").

``cogattn view PATH`` serves a page on 127.0.0.1 (:mod:`cogattn.view.server`) over the runs under PATH
(:func:`cogattn.runs.folder.find_runs`); ``--export FILE`` writes the page as one self-contained HTML file
(:func:`export`, :mod:`cogattn.view.report`). The numbers on the page come from
:class:`cogattn.view.data.RunView`, which reads them with :mod:`cogattn.analysis`, as the plots do.

The server and the run folders' names need neither torch nor the analysis, so ``cogattn view`` listens at once;
:class:`RunView` and :func:`export` are imported at their first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..runs.folder import find_runs
from .server import ViewServer, main

if TYPE_CHECKING:
    from .data import RunView
    from .report import export

__all__ = ["RunView", "ViewServer", "export", "find_runs", "main"]

_LAZY = {"RunView": "data", "export": "report"}  # name → the module of the reading side that defines it


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
