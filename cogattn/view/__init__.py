"""``cogattn view``: see a run, or a folder of runs, in the browser (docs/design.md, "The viewer").

``cogattn view PATH`` serves a page on 127.0.0.1 (:mod:`cogattn.view.server`) over the runs under PATH
(:func:`cogattn.view.data.find_runs`); ``--export FILE`` writes the page as one self-contained HTML file
(:mod:`cogattn.view.export`). The numbers on the page come from :class:`cogattn.view.data.RunView`, which
reads them with :mod:`cogattn.analysis`, as the plots do.
"""

from __future__ import annotations

from .data import RunView, find_runs
from .export import export
from .server import ViewServer, main

__all__ = ["RunView", "ViewServer", "export", "find_runs", "main"]
