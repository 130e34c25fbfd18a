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
request gets an answer: its parameters are checked in one place (:mod:`cogattn.view.params`: a missing one, or
one out of the run's range, is a 400 with a one-line JSON ``error``); what a damaged record causes is a one-line
JSON ``error`` in its panel, and what a run did not record a ``hint`` saying what to record; a run that cannot
be opened is listed as unreadable with its one line, and the others are served; anything unexpected is a 500
with a one-line JSON ``error`` (logged once on stderr). Files are served only from inside the run's folder
(:meth:`cogattn.view.files.PromptFiles.file`); any other path is a 404.

The server listens, and the command prints its URL, before the viewer's reading side (torch, pandas, the
analysis: :mod:`cogattn.view.api`) is imported: this module is the HTTP server alone, and it answers the page's
own files (:mod:`cogattn.view.page`) at once while a thread imports the reading side and opens the runs; an API
request waits for them (:func:`main`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from ..errors import StoreError
from ..runs.folder import find_runs
from .page import page_file
from .params import MAX_SIDE, MAX_STEPS, MAX_TOKENS, BadRequest

__all__ = ["ViewServer", "main"]

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")  # the Host names a browser on this machine (or a tunnel) sends
HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]{1,5})?")  # a Host header: a name, then a port or none


class ViewServer:
    """The runs under ``path`` served on ``127.0.0.1:port`` (0: a free port), answering requests whose
    ``Host`` is exactly a loopback name, with any port (an SSH tunnel's) or none, or one of ``allow_hosts`` (a
    proxy's).

    It listens at once: the page's own files are answered before any run is read, while the runs are opened
    beside it (torch, the analysis and each run.json), and every API request waits for them. A run that cannot
    be opened is listed as unreadable (:attr:`unreadable`, :attr:`problems`).

    Raises `FileNotFoundError` for a path that holds no run, `OSError` for a port that cannot be bound,
    `TypeError`/`ValueError` for ``allow_hosts`` that are not host names."""

    def __init__(self, path: str | Path, port: int = 0, allow_hosts: tuple[str, ...] = ()):
        if isinstance(allow_hosts, str):
            raise TypeError(f"allow_hosts={allow_hosts!r}: pass a tuple of host names, e.g. ({allow_hosts!r},).")
        for host in allow_hosts:
            if not isinstance(host, str) or _hostname(host) is None:
                raise ValueError(f"allow_hosts: {host!r} is not a host name (hub.example, or hub.example:443).")
        hosts = {*LOOPBACK, *(_hostname(h) for h in allow_hosts)}  # a name given with a port: the name
        find_runs(path)  # no run there: refused before the server listens (the folders alone, no record read)
        self._problems: list[str] = []  # runs left out: one line each
        self._unreadable: dict[str, str] = {}  # name -> why, listed as unreadable
        self._runs: dict = {}
        self._api = None  # the reading side, once imported
        self._opened = threading.Event()
        self._failure: BaseException | None = None  # what stopped the runs from opening (none readable, a bug)
        server = self
        logged: set[str] = set()  # unexpected errors already on stderr: each once, however often asked

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the URL is all the terminal needs
                pass

            def do_GET(self):
                if _hostname(self.headers.get("Host", "")) not in hosts:  # a page of another site, by DNS rebinding
                    body = f"cogattn view answers requests for {sorted(hosts)}; see --allow-host.".encode()
                    self._send(403, body, "text/plain")
                    return
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                try:
                    if (page := page_file(unquote(url.path))) is not None:  # the page: before any run is open
                        status, body, kind = 200, *page
                    else:
                        api = server._wait_opened()
                        status, body, kind = api.answer(server._runs, server._unreadable, unquote(url.path), query)
                except BadRequest as err:  # a parameter missing, or out of the run's range
                    status, body, kind = 400, json.dumps({"error": str(err)}).encode(), "application/json"
                except (StoreError, OSError, ValueError) as err:  # a damaged record: that panel says so
                    status, body, kind = 200, json.dumps({"error": str(err)}).encode(), "application/json"
                except Exception as err:  # a bug, or a run value nothing checked: an answer all the same
                    line = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    if line not in logged:
                        logged.add(line)
                        print(f"cogattn view: GET {url.path} failed ({line})", file=sys.stderr, flush=True)
                    status, body, kind = 500, json.dumps({"error": line}).encode(), "application/json"
                self._send(status, body, kind)

            def _send(self, status: int, body: bytes, kind: str) -> None:
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
        threading.Thread(target=self._open, args=(path,), name="cogattn-view-open", daemon=True).start()

    def _open(self, path) -> None:
        """Open the runs (in a thread of its own: the server answers the page meanwhile)."""
        try:
            self._api = _reading_side("api")
            self._runs = self._api.open_runs(path, self._problems, self._unreadable)
        except BaseException as err:  # no run readable (FileNotFoundError), or a bug: main() reports it
            self._failure = err
        finally:
            self._opened.set()

    def _wait_opened(self):
        """The API, once the runs are open; raises what kept them from opening."""
        self._opened.wait()
        if self._failure is not None and not isinstance(self._failure, FileNotFoundError):
            raise self._failure  # a bug: every API request answers it (none readable lists the runs that are not)
        return self._api

    @property
    def runs(self) -> dict:
        """The runs served, by name (waits until they are open)."""
        self._opened.wait()
        return self._runs

    @property
    def problems(self) -> list[str]:
        """One line per run left out (waits until the runs are open)."""
        self._opened.wait()
        return self._problems

    @property
    def unreadable(self) -> dict[str, str]:
        """The runs listed as unreadable: name → why (waits until the runs are open)."""
        self._opened.wait()
        return self._unreadable

    def opened(self) -> BaseException | None:
        """Wait until the runs are open; what kept every run from opening (`FileNotFoundError` where none can be
        read), else `None`."""
        self._opened.wait()
        return self._failure

    def start(self) -> ViewServer:
        """Serve in a background thread (tests, notebooks); :meth:`stop` ends it."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _hostname(host: str) -> str | None:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` → ``[::1]``); `None` where the header is not
    exactly a name and a port or none (``localhost:80@evil.com``, ``" 127.0.0.1"``)."""
    match = HOST.fullmatch(host.lower())
    return None if match is None else match.group(1)


def _reading_side(name: str):
    """A module of the viewer's reading side (torch, pandas, the analysis: :mod:`cogattn.view.api`,
    :mod:`cogattn.view.report`), imported beside a listening server or for an export, so :func:`main` prints first."""
    return importlib.import_module(f"{__package__}.{name}")


def main(argv: list[str] | None = None) -> int:
    """``cogattn view PATH [--port N] [--export FILE]``: serve the runs under PATH until Ctrl-C, or write
    one self-contained HTML file. Bad input (no run there, a port in use) is one line and exit code 2; a run that
    cannot be read is one line on stderr, and the others are served or exported. Serving prints a line at once,
    before the reading side (torch, the analysis) is imported, and the URL once the server listens."""
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
            left_out: list[str] = []
            out = _reading_side("report").export(
                args.path, args.export, tokens=args.tokens, steps=args.steps, side=args.side, left_out=left_out
            )
            for line in left_out:
                print(f"cogattn view: not in the export: {line}", file=sys.stderr)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
            return 0
        server = ViewServer(args.path, args.port, tuple(args.allow_host)).start()
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
    # at once, while the runs open (torch and the analysis take seconds on a busy machine): the page answers already
    print(f"cogattn view: {server.url}  opening the runs under {args.path} ...", flush=True)
    try:
        failure = server.opened()
        if failure is not None and not isinstance(failure, FileNotFoundError):  # a bug, not a damaged run
            raise failure
        if not server.runs:  # one line, naming each run's problem
            print(f"cogattn view: {failure}", file=sys.stderr)
            return 2
        for problem in server.problems:
            print(f"cogattn view: {problem}", file=sys.stderr)
        print(f"cogattn view: {len(server.runs)} run(s) at {server.url}  (Ctrl-C stops)", flush=True)
        while server._thread.is_alive():
            server._thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
