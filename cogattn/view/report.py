"""``cogattn view PATH --export report.html``: the page as one file that opens anywhere, with no server
and no network.

The page's script, style and the answers it would fetch are written into the HTML: per run, the summary,
``frame`` at every recorded step and layer (and their mean), and the word kinds at every step as the mean
over layers for the prompt's tokens (at most :data:`MAX_TOKENS`, at :data:`MAX_STEPS` steps), each frame pooled down to at most
:data:`MAX_SIDE` patches on its longer side, every value to 4 significant digits. The batch tool's video goes in as a data URL. What was kept is stated on
the page (``summary["export"]``); a video point's row needs the full map, so the export leaves it out.
The sparse-attention panels go in too: ``tile`` at the mean over layers and heads with every pattern's mask
and recall (a map of at most :data:`MAX_TILE_GROUPS` groups a side), ``top_p``'s density and ``offset``'s decay
at every step and layer and their mean, of the heads' mean; a point's ``frame_max`` track is one per video
point, head and layer, so it is live only, and the page says so.

What the runs hold is embedded as data, never as markup: every ``<`` in it (and U+2028, U+2029) is written
as a JSON escape, so no prompt can close or comment out the script it sits in. Only files inside a run's
folder are embedded (:meth:`cogattn.view.files.PromptFiles.file`), and the report is never written into a run
folder it reads. A run that cannot be read costs itself only: the page lists it as unreadable with its one line
(``left_out``), and the others are written.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import torch

from ..analysis.head_stats import TABLE_KINDS
from ..analysis.maps import aggregate
from ..analysis.words import item_spans
from ..errors import NotRecordedError, StoreError
from ..exact.reducers.audio import AUDIO_KINDS
from .data import HEAD_COLUMNS, MASKS, WORD_KINDS, RunView, open_runs
from .files import finite, prompt_of
from .labels import one_line
from .page import static_file
from .params import MAX_SIDE, MAX_STEPS, MAX_TOKENS
from .sparse import decay, density, tile

__all__ = ["MAX_SIDE", "MAX_STEPS", "MAX_TOKENS", "export"]

MAX_VIDEO = 32 * 2**20  # bytes of video embedded
MAX_TILE_GROUPS = 256  # groups a side of a tile map kept (a larger one is left out, and the page says so)


def _kept(m: torch.Tensor, side: int = MAX_SIDE) -> dict:
    """A map as the export keeps it: a ``(F, h, w)`` map average-pooled to at most ``side`` patches on its
    longer side (the aspect kept), values to 4 significant digits, NaN as `None`."""
    if m.dim() == 3 and max(m.shape[1:]) > side:
        scale = side / max(m.shape[1:])
        size = tuple(max(1, round(n * scale)) for n in m.shape[1:])
        m = torch.nn.functional.adaptive_avg_pool2d(m[:, None].double(), size)[:, 0]
    values = [None if not math.isfinite(v) else float(f"{v:.4g}") for v in m.double().flatten().tolist()]
    return {"shape": list(m.shape), "values": values}


def _spread(values: list[int], most: int) -> list[int]:
    """At most ``most`` of ``values``: the first, the last, and evenly between (``most=1``: the last)."""
    if len(values) <= most:
        return list(values)
    if most == 1:
        return [values[-1]]
    return sorted({values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)})


def _rounded(make, *args) -> dict:
    """The map ``make(*args)`` answers, kept to the export's digits; an error (or a failure nothing checked) costs
    this map alone, as its ``error``, not the run."""
    try:
        payload = make(*args)
    except Exception as err:
        return {"error": one_line(err)}
    if "error" in payload:
        return payload
    values = torch.tensor([math.nan if v is None else v for v in payload["values"]]).reshape(payload["shape"])
    return {**payload, **_kept(values)}


def _answers(view: RunView, most_tokens: int, most_steps: int, side: int) -> tuple[dict, dict]:
    """The summary (with what the export kept) and the maps, keyed as the page asks for them."""
    summary, maps = view.summary(), {}
    for step in summary["steps"].get("frame", []):
        for layer in ["mean", *summary["layers"]["frame"]]:
            maps[f"frame|{step}|{layer}|mean|"] = _rounded(view.map, "frame", step, layer)
    lay = view.run.layout
    # the exported item's text after its image tokens (HunyuanVideo image-to-video; 1.5: its own spans)
    start = 0 if lay is None else item_spans(view.run, summary["item"]).get("image", (0, 0))[1]
    tokens = list(range(start, len(summary["tokens"])))[:most_tokens]
    word_steps = {}
    for kind in WORD_KINDS:
        word_steps[kind] = _spread(summary["steps"].get(kind, []), most_steps)
        for step in word_steps[kind]:
            if not tokens:
                continue
            rows = slice(tokens[0], tokens[-1] + 1)  # once per step, reading the kept tokens' rows only
            try:
                m = aggregate(view.run, kind, steps=step, layers=view.layers_at(kind, step, "mean"), row=rows)
            except (NotRecordedError, StoreError, ValueError) as err:  # a damaged record: its panels say so
                maps.update({f"{kind}|{step}|mean|mean|{token}": {"error": str(err)} for token in tokens})
                continue
            for i, token in enumerate(tokens):
                maps[f"{kind}|{step}|mean|mean|{token}"] = _kept(m[i], side)
    for kind in AUDIO_KINDS:  # LTX-2's audio stream: the mean over layers at each step
        for step in summary["steps"].get(kind, []):
            maps[f"{kind}|{step}|mean|mean|"] = _rounded(view.map, kind, step, "mean")
    for step in summary["steps"].get("block", []):
        for mask in MASKS:
            maps[f"block|{step}|mean|mean|{mask}"] = _rounded(view.block, step, "mean", "mean", mask)
    if summary["head_atlas"]:
        for step in sorted({s for k in TABLE_KINDS for s in summary["steps"].get(k, [])}):
            for column in HEAD_COLUMNS:
                maps[f"heads|{step}|{column}"] = _rounded(view.heads, step, column)
    summary["items"] = [it for it in summary["items"] if it["slot"] == summary["item"]]  # the one exported
    summary["export"] = {
        "item": summary["items"][0]["label"] if summary["items"] else "batch item 0",
        "layers": "frame: every layer and their mean; word kinds, audio kinds and block: the mean over layers",
        "heads": "the mean over heads",
        "tokens": len(tokens),
        "word_steps": word_steps,
        "max_side": side,
        "digits": 4,
        "points": "not kept: open the run with `cogattn view` to click video points",
        "tracks": "not kept: a track is one per video point, layer and head; open the run with `cogattn view`",
        "sparse": f"tile: the mean over layers and heads, maps of at most {MAX_TILE_GROUPS} groups a side; "
        "density and decay: every layer and their mean, the mean over heads",
    }
    maps.update(_sparse(view, summary))
    return summary, maps


def _sparse(view: RunView, summary: dict) -> dict:
    """The sparse-attention panels' answers, keyed as the page asks for them (:data:`MAX_TILE_GROUPS`)."""
    maps = {}
    for step in summary["steps"].get("tile", []):
        large = tile(view, step, "mean", "mean").get("shape", [0])[0] > MAX_TILE_GROUPS  # before any mask is made
        for pattern in ["none", *summary["sparse"]["patterns"]]:
            too_large = {"error": summary["export"]["sparse"]}
            maps[f"tile|{step}|mean|mean|{pattern}"] = (
                too_large if large else _rounded(tile, view, step, "mean", "mean", pattern)
            )
    for name, answer in (("top_p", density), ("offset", decay)):
        for step in summary["steps"].get(name, []):
            for layer in ["mean", *summary["layers"][name]]:
                maps[f"{name}|{step}|{layer}|mean"] = answer(view, step, layer, "mean")
    return maps


def export(
    path: str | Path,
    out: str | Path,
    *,
    tokens: int = MAX_TOKENS,
    steps: int = MAX_STEPS,
    side: int = MAX_SIDE,
    left_out: list[str] | None = None,
) -> Path:
    """Write the runs under ``path`` as one self-contained HTML file ``out``; returns its path. A run that cannot be
    read (a damaged run.json, a record that cannot be read) is left out, listed on the page as unreadable with
    its one line, and the others are written.

    Args:
        path (`str | Path`): a run, a batch prompt's folder, or a folder of them.
        out (`str | Path`): the HTML file to write.
        tokens (`int`, defaults to :data:`MAX_TOKENS`): text tokens of the word kinds kept per step.
        steps (`int`, defaults to :data:`MAX_STEPS`): steps of the word kinds kept (the first, the last,
            evenly between).
        side (`int`, defaults to :data:`MAX_SIDE`): patches kept on the longer side of a word map's frame.
        left_out (`list[str]`, *optional*): gets one line for each run left out.

    Raises:
        ValueError: a size below 1, or ``out`` inside a run folder it reads.
        FileNotFoundError: no run under ``path`` can be read.
    """
    for name, value in (("tokens", tokens), ("steps", steps), ("side", side)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: the export keeps at least 1; pass a positive whole number.")
    out = Path(out)
    left_out = [] if left_out is None else left_out
    unreadable: dict[str, str] = {}
    views = open_runs(path, left_out, unreadable)
    for view in views.values():  # before anything is written: a report over a run's own files destroys them
        if (where := out.resolve()).is_relative_to(folder := view.files.folder.resolve()):
            raise ValueError(
                f"the report {str(out)!r} would be inside the run folder {str(folder)!r} it reads (as "
                f"{str(where)!r}); write it outside the runs."
            )
    data = {"runs": [], "summaries": {}, "maps": {}, "files": {}}
    for name, view in views.items():
        try:
            summary, maps = _answers(view, tokens, steps, side)
            row = {"name": name, "prompt": prompt_of(view.run), "status": view.run.status}
            video = view.files.file("video")  # after the summary: a video that does not decode is dropped there
            if video is not None and video.stat().st_size <= MAX_VIDEO:
                mime = "image/gif" if video.suffix == ".gif" else "video/mp4"
                data["files"][f"{name}/video"] = f"data:{mime};base64,{base64.b64encode(video.read_bytes()).decode()}"
        except Exception as err:  # a damaged run (or a value of it nothing checked) costs itself only
            left_out.append(f"{name}: left out ({one_line(err)})")
            unreadable[name] = one_line(err)
            continue
        data["runs"].append(row)
        data["summaries"][name] = summary
        data["maps"].update({f"{name}|{key}": value for key, value in maps.items()})
    data["runs"] += [{"name": n, "prompt": None, "status": "unreadable", "error": why} for n, why in unreadable.items()]
    data["left_out"] = list(left_out)  # the page lists these runs as unreadable, each with its line
    page = static_file("index.html").decode()
    embedded = script_json(data)
    style = f"<style>{static_file('style.css').decode()}</style>"
    script = (
        f"<script>window.COGATTN_EMBEDDED = {embedded};</script>\n<script>{static_file('app.js').decode()}</script>"
    )
    page = page.replace('<link rel="stylesheet" href="static/style.css">', style)
    page = page.replace('<script src="static/app.js"></script>', script)
    out.write_text(page)
    return out


def script_json(data) -> str:
    """``data`` as a JavaScript literal safe inside a ``<script>`` element: every ``<`` escaped (no
    ``</script>``, ``<!--`` or ``<script`` can end or hide the element), and the line separators U+2028 and
    U+2029 too (older parsers end a string at them); NaN and infinities as ``null``."""
    text = json.dumps(finite(data))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
