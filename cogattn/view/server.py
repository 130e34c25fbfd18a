"""``cogattn view PATH``: a local web app over a run or a folder of runs.

The server is the standard library's ``ThreadingHTTPServer`` on 127.0.0.1: nothing to install, nothing
reachable from outside the machine (through SSH, forward the port). It answers only requests whose ``Host``
is a loopback name (or one given with ``--allow-host``), so a web page elsewhere cannot read it through DNS
rebinding; the page asks for relative paths, so it also works under a proxy's prefix. It serves the page and its assets from
the package (``static/``, no CDN) and a small JSON API that :class:`cogattn.view.data.RunView` answers:

    GET /api/runs                              the runs: name, prompt, status, whether a thumbnail exists
    GET /api/summary?run=NAME                  kinds, steps, layers, heads, layout, tokens, metadata
    GET /api/map?run=&kind=&step=&layer=&head=[&token=]    one map
    GET /api/point?run=&step=&layer=&head=&frame=&row=&col= where a video point attends
    GET /api/heads?run=&step=&column=          the head atlas: a head_table column per layer and head
    GET /api/block?run=&step=&layer=&head=&mask=  the block map, a mask's kept blocks and its recall
    GET /api/tile?run=&step=&layer=&head=&pattern= the tile map, a pattern's tile mask and its recall
    GET /api/density?run=&step=&layer=&head=    top_p's share of keys a video query needs per mass p
    GET /api/decay?run=&step=&layer=&head=      offset's mass against |Δt| and spatial distance, and the fits
    GET /api/track?run=&step=&layer=&head=&frame=&row=&col=  a video point's frame_max track
    (all but summary take &item=SLOT, a slot of the recorded batch; by default the first conditional item
    under guidance; the sparse-attention panels are answered by :mod:`cogattn.view.sparse`)
    GET /file/NAME/video | /file/NAME/thumbnail             the batch tool's video and frame preview
    GET /file/NAME/frame/I                     the video's frame I, a PNG (for the maps over the video)

Each request re-reads the run's manifest, so a run still being written shows what is committed. Every
request gets an answer: what a damaged run causes is a one-line JSON ``error`` in its panel, anything
unexpected a 500 with a one-line JSON ``error`` (logged once on stderr); files are served only from inside
the run's folder (:meth:`cogattn.view.files.PromptFiles.file`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from ..errors import StoreError
from .data import RunView, open_runs
from .export import MAX_SIDE, MAX_STEPS, MAX_TOKENS, export, static_file
from .files import finite, prompt_of
from .sparse import decay, density, tile, track

__all__ = ["ViewServer", "main"]

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")  # the Host names a browser on this machine (or a tunnel) sends
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
_TYPES.update({".gif": "image/gif", ".png": "image/png", ".mp4": "video/mp4"})


class ViewServer:
    """The runs under ``path`` served on ``127.0.0.1:port`` (0: a free port), answering requests whose
    ``Host`` is a loopback name, at any port (an SSH tunnel's), or one of ``allow_hosts`` (a proxy's).

    Raises `FileNotFoundError` for a path with no run, `OSError` for a port that cannot be bound."""

    def __init__(self, path: str | Path, port: int = 0, allow_hosts: tuple[str, ...] = ()):
        self.problems: list[str] = []  # runs left out: one line each
        self.runs = open_runs(path, self.problems)
        views = self.runs
        if isinstance(allow_hosts, str):
            raise TypeError(f"allow_hosts={allow_hosts!r}: pass a tuple of host names, e.g. ({allow_hosts!r},).")
        hosts = {*LOOPBACK, *(_hostname(h) for h in allow_hosts)}  # a name given with a port: the name
        logged: set[str] = set()  # unexpected errors already on stderr: each once, however often asked

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the URL is all the terminal needs
                pass

            def do_GET(self):
                if _hostname(self.headers.get("Host", "")) not in hosts:  # a page of another site, by DNS rebinding
                    body = f"cogattn view answers requests for {sorted(hosts)}; see --allow-host.".encode()
                    self.send_response(403)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    status, body, kind = _answer(views, unquote(url.path), query)
                except KeyError as err:  # a request without a parameter it needs
                    status, body, kind = (
                        400,
                        json.dumps({"error": f"missing parameter {err}"}).encode(),
                        "application/json",
                    )
                except (StoreError, OSError, ValueError) as err:  # a damaged record: that panel says so
                    status, body, kind = 200, json.dumps({"error": str(err)}).encode(), "application/json"
                except Exception as err:  # a bug, or a run value nothing checked: an answer all the same
                    line = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    if line not in logged:
                        logged.add(line)
                        print(f"cogattn view: GET {url.path} failed ({line})", file=sys.stderr, flush=True)
                    status, body, kind = 500, json.dumps({"error": line}).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self._thread: threading.Thread | None = None

    def start(self) -> ViewServer:
        """Serve in a background thread (tests, notebooks); :meth:`stop` ends it."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _hostname(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` → ``[::1]``)."""
    host = host.strip().lower()
    return host if host.endswith("]") else host.rsplit(":", 1)[0]


def _answer(views: dict[str, RunView], path: str, query: dict) -> tuple[int, bytes, str]:
    """``(status, body, content type)`` of one GET."""
    if path in ("/", "/index.html"):
        return 200, static_file("index.html"), _TYPES[".html"]
    if path.startswith("/static/") and Path(path).name in ("app.js", "style.css"):
        return 200, static_file(Path(path).name), _TYPES[Path(path).suffix]
    if path == "/api/runs":
        rows = [
            {
                "name": n,
                "prompt": prompt_of(v.run),
                "status": v.run.status,
                "thumbnail": v.files.thumbnail is not None,
            }
            for n, v in views.items()
        ]
        return 200, json.dumps(finite(rows)).encode(), "application/json"
    if path.startswith("/file/"):
        _, _, name, what = path.split("/", 3)
        view = views.get(name)
        if view is not None and what.startswith("frame/") and what[6:].isdigit():  # one video frame, a PNG
            png = view.files.frame_png(int(what[6:]))
            return (200, png, _TYPES[".png"]) if png is not None else (404, b"not found", "text/plain")
        file = None if view is None else view.files.file(what)
        if file is None:
            return 404, b"not found", "text/plain"
        return 200, file.read_bytes(), _TYPES.get(file.suffix, "application/octet-stream")
    view = views.get(query.get("run", next(iter(views))))
    if view is None or not path.startswith("/api/"):
        return 404, json.dumps({"error": f"no such page or run: {path}"}).encode(), "application/json"
    view.refresh()
    item = query.get("item") or None  # a batch slot; none: the first conditional item
    item = int(item) if item is not None and item.isdigit() else item  # "cond"/"uncond" pass as words
    if path == "/api/summary":
        body = view.summary()
    elif path == "/api/map":
        token = query.get("token")
        args = (query["kind"], int(query["step"]), query.get("layer", "mean"), query.get("head", "mean"))
        body = view.map(*args, None if token is None else int(token), item=item)
    elif path == "/api/block":
        args = (int(query["step"]), query.get("layer", "mean"), query.get("head", "mean"), query.get("mask", "none"))
        body = view.block(*args, item=item)
    elif path in ("/api/tile", "/api/density", "/api/decay"):
        sel = (int(query["step"]), query.get("layer", "mean"), query.get("head", "mean"))
        if path == "/api/tile":
            body = tile(view, *sel, query.get("pattern", "none"), item=item)
        else:
            body = (density if path == "/api/density" else decay)(view, *sel, item=item)
    elif path == "/api/track":
        where = (int(query[k]) for k in ("frame", "row", "col"))
        body = track(view, int(query["step"]), query.get("layer", "mean"), query.get("head", "mean"), *where, item=item)
    elif path == "/api/heads":
        body = view.heads(int(query["step"]), query.get("column", "same_frame_mass"), item=item)
    elif path == "/api/point":
        where = (int(query[k]) for k in ("frame", "row", "col"))
        body = view.point(int(query["step"]), query.get("layer", "mean"), query.get("head", "mean"), *where, item=item)
    else:
        return 404, json.dumps({"error": f"no such page: {path}"}).encode(), "application/json"
    return 200, json.dumps(finite(body)).encode(), "application/json"


def main(argv: list[str] | None = None) -> int:
    """``cogattn view PATH [--port N] [--export FILE]``: serve the runs under PATH until Ctrl-C, or write
    one self-contained HTML file. Bad input (no run there, a port in use) is one line and exit code 2."""
    ap = argparse.ArgumentParser(prog="cogattn view", description="See a run, or a folder of runs, in the browser.")
    ap.add_argument("path", help="a run folder, a batch prompt's folder, or a folder of them")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests naming this host (a proxy in front of the server); repeatable",
    )
    ap.add_argument("--export", metavar="FILE", help="write one self-contained HTML file instead of serving")
    sizes = ap.add_argument_group("what --export keeps of the word kinds (a larger file for more)")
    sizes.add_argument("--tokens", type=int, default=MAX_TOKENS, help=f"text tokens per step (default {MAX_TOKENS})")
    sizes.add_argument("--steps", type=int, default=MAX_STEPS, help=f"steps: the first, the last, evenly between (default {MAX_STEPS})")  # fmt: skip
    sizes.add_argument("--side", type=int, default=MAX_SIDE, help=f"patches on a frame's longer side (default {MAX_SIDE})")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.export:
            out = export(args.path, args.export, tokens=args.tokens, steps=args.steps, side=args.side)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
            return 0
        server = ViewServer(args.path, args.port, tuple(args.allow_host))
    except (FileNotFoundError, StoreError, ValueError) as err:  # no run there, or a run that cannot be read
        print(f"cogattn view: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        where = f"port {args.port} on 127.0.0.1 cannot be used"
        if args.export:  # the file that failed: the report's, or one of a run's
            failed = getattr(err, "filename", None)
            ours = failed is not None and Path(failed).resolve() == Path(args.export).resolve()
            where = f"{args.export!r} cannot be written" if ours else f"{str(failed or 'a run file')!r} cannot be read"
        print(f"cogattn view: {where} ({err.strerror or err}).", file=sys.stderr)
        return 2
    for problem in server.problems:
        print(f"cogattn view: {problem}", file=sys.stderr)
    print(f"cogattn view: {len(server.runs)} run(s) at {server.url}  (Ctrl-C stops)", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0
