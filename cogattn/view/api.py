"""The viewer's JSON API: which function answers each request (:func:`answer`), each reading the run with
:class:`cogattn.view.data.RunView` and :mod:`cogattn.view.sparse`, and the batch tool's files (the server answers
the page and its assets itself, before any run is open: :mod:`cogattn.view.page`).

Every parameter is checked before a panel is asked (:func:`cogattn.view.params.parse`); a run that cannot be
opened answers its one line on every endpoint; ``/file/`` answers only ``NAME/video``, ``NAME/thumbnail`` and
``NAME/frame/I`` from inside the run's folder (:meth:`cogattn.view.files.PromptFiles.file`), a 404 otherwise.
:mod:`cogattn.view.server` serves these answers over HTTP.
"""

from __future__ import annotations

import json

from .data import RunView, open_runs
from .files import finite, prompt_of
from .labels import one_line
from .page import TYPES
from .params import ENDPOINTS, parse
from .sparse import decay, density, tile, track

__all__ = ["HANDLERS", "answer", "open_runs"]

HANDLERS = {  # endpoint -> the function answering it, its parameters those ENDPOINTS names (the item by keyword)
    "/api/summary": lambda view, item: view.summary(),
    "/api/map": lambda view, *args, item: view.map(*args, item=item),
    "/api/block": lambda view, *args, item: view.block(*args, item=item),
    "/api/tile": tile,
    "/api/density": density,
    "/api/decay": decay,
    "/api/track": track,
    "/api/point": lambda view, *args, item: view.point(*args, item=item),
    "/api/heads": lambda view, *args, item: view.heads(*args, item=item),
}


def _json(status: int, body) -> tuple[int, bytes, str]:
    return status, json.dumps(finite(body)).encode(), "application/json"


def answer(views: dict[str, RunView], unreadable: dict[str, str], path: str, query: dict) -> tuple[int, bytes, str]:
    """``(status, body, content type)`` of one GET of ``path`` with ``query`` (its parameters, one value each) over
    the runs ``views`` (``unreadable``: the runs that cannot be opened, and why).

    Raises:
        cogattn.view.params.BadRequest: a parameter missing, or out of the run's range (the server answers 400).
    """
    if path == "/api/runs":
        rows, failed = [], dict(unreadable)
        for n, v in views.items():
            try:
                rows.append({"name": n, "prompt": prompt_of(v.run), "status": v.run.status, "thumbnail": v.files.thumbnail is not None})  # fmt: skip
            except Exception as err:  # a value of the run nothing checked: that row says so, the others are listed
                failed[n] = one_line(err)
        rows += [{"name": n, "prompt": None, "status": "unreadable", "thumbnail": False, "error": why}
                 for n, why in failed.items()]  # fmt: skip
        return _json(200, rows)
    if path.startswith("/file/"):
        parts = path.split("/", 3)
        if len(parts) != 4:  # /file/NAME/WHAT only
            return 404, b"not found", "text/plain"
        name, what = parts[2], parts[3]
        view = views.get(name)
        if (
            view is not None and what.startswith("frame/") and what[6:].isascii() and what[6:].isdigit()
        ):  # one video frame, a PNG
            png = view.files.frame_png(int(what[6:]))
            return (200, png, TYPES[".png"]) if png is not None else (404, b"not found", "text/plain")
        file = None if view is None else view.files.file(what)
        if file is None:
            return 404, b"not found", "text/plain"
        return 200, file.read_bytes(), TYPES.get(file.suffix, "application/octet-stream")
    name = query.get("run") or next(iter(views), None) or next(iter(unreadable), "")
    if name in unreadable:
        return _json(200, {"error": unreadable[name]})  # its one line on every endpoint, as a damaged record's
    view = views.get(name)
    if view is None or path not in ENDPOINTS:
        return _json(404, {"error": f"no such page or run: {path[:80]}"})
    view.refresh()
    *args, item = parse(view, path, query) or [None]  # every parameter checked here; the last is the item
    return _json(200, HANDLERS[path](view, *args, item=item))
