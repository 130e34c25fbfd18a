"""The page's own files (``index.html``, ``app.js``, ``style.css``) as the package ships them: what the server
answers before any run is open, and what the export inlines."""

from __future__ import annotations

from importlib import resources
from pathlib import PurePosixPath

__all__ = ["TYPES", "page_file", "static_file"]

TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
TYPES.update({".gif": "image/gif", ".png": "image/png", ".mp4": "video/mp4"})
ASSETS = ("app.js", "style.css")


def static_file(name: str) -> bytes:
    """An asset of the page (``index.html``, ``app.js``, ``style.css``), as the package ships it."""
    return resources.files("cogattn.view").joinpath("static", name).read_bytes()


def page_file(path: str) -> tuple[bytes, str] | None:
    """``(body, content type)`` of a request's path that is the page or one of its assets, else `None`."""
    if path in ("/", "/index.html"):
        return static_file("index.html"), TYPES[".html"]
    if path.startswith("/static/") and PurePosixPath(path).name in ASSETS and path.count("/") == 2:
        name = PurePosixPath(path).name
        return static_file(name), TYPES[PurePosixPath(name).suffix]
    return None
