"""``cogattn view PATH --export report.html``: the page as one file that opens anywhere, with no server
and no network.

The page's script, style and the answers it would fetch are written into the HTML: per run, the summary,
``frame`` at every recorded step and layer (and their mean), and the word kinds at every step as the mean
over layers for the prompt's tokens (at most :data:`MAX_TOKENS`), each frame pooled down to at most
:data:`MAX_SIDE` patches a side. The batch tool's video goes in as a data URL. What was kept is stated on
the page (``summary["export"]``); a video point's row needs the full map, so the export leaves it out.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

import torch

from ..head_stats import TABLE_KINDS
from .data import HEAD_COLUMNS, MASKS, WORD_KINDS, RunView, find_runs

__all__ = ["MAX_SIDE", "MAX_TOKENS", "export", "static_file"]

MAX_TOKENS = 64  # text tokens of the word kinds kept per step
MAX_SIDE = 24  # patches a side kept per frame of a word map (average pooling above it)
MAX_VIDEO = 32 * 2**20  # bytes of video embedded


def static_file(name: str) -> bytes:
    """An asset of the page (``index.html``, ``app.js``, ``style.css``), as the package ships it."""
    return resources.files("cogattn.view").joinpath("static", name).read_bytes()


def _pooled(payload: dict) -> dict:
    """A ``(F, h, w)`` map average-pooled to at most :data:`MAX_SIDE` patches a side."""
    if "error" in payload or max(payload["shape"][1:]) <= MAX_SIDE:
        return payload
    m = torch.tensor([float("nan") if v is None else v for v in payload["values"]]).reshape(payload["shape"])
    size = tuple(min(MAX_SIDE, n) for n in m.shape[1:])
    pooled = torch.nn.functional.adaptive_avg_pool2d(m[:, None], size)[:, 0]
    return {"shape": list(pooled.shape), "values": pooled.flatten().tolist()}


def _answers(view: RunView) -> tuple[dict, dict]:
    """The summary (with what the export kept) and the maps, keyed as the page asks for them."""
    summary, maps = view.summary(), {}
    for step in summary["steps"].get("frame", []):
        for layer in ["mean", *summary["layers"]["frame"]]:
            maps[f"frame|{step}|{layer}|mean|"] = view.map("frame", step, layer)
    tokens = [i for i, t in enumerate(summary["tokens"])][:MAX_TOKENS]
    for kind in WORD_KINDS:
        for step in summary["steps"].get(kind, []):
            for token in tokens:
                maps[f"{kind}|{step}|mean|mean|{token}"] = _pooled(view.map(kind, step, "mean", "mean", token))
    for step in summary["steps"].get("block", []):
        for mask in MASKS:
            maps[f"block|{step}|mean|mean|{mask}"] = view.block(step, "mean", "mean", mask)
    if summary["head_atlas"]:
        for step in sorted({s for k in TABLE_KINDS for s in summary["steps"].get(k, [])}):
            for column in HEAD_COLUMNS:
                maps[f"heads|{step}|{column}"] = view.heads(step, column)
    summary["export"] = {
        "layers": "frame: every layer and their mean; word kinds and block: the mean over layers",
        "heads": "the mean over heads",
        "tokens": len(tokens),
        "max_side": MAX_SIDE,
        "points": "not kept: open the run with `cogattn view` to click video points",
    }
    return summary, maps


def export(path: str | Path, out: str | Path) -> Path:
    """Write the runs under ``path`` as one self-contained HTML file ``out``; returns its path."""
    runs = find_runs(path)
    data = {"runs": [], "summaries": {}, "maps": {}, "files": {}}
    for name, run_path in runs.items():
        view = RunView(run_path)
        summary, maps = _answers(view)
        data["runs"].append({"name": name, "prompt": view.run.info.get("prompt"), "status": view.run.status})
        data["summaries"][name] = summary
        data["maps"].update({f"{name}|{key}": value for key, value in maps.items()})
        if view.video is not None and view.video.stat().st_size <= MAX_VIDEO:
            kind = "gif" if view.video.suffix == ".gif" else "mp4"
            mime = f"image/{kind}" if kind == "gif" else "video/mp4"
            data["files"][f"{name}/video"] = f"data:{mime};base64,{base64.b64encode(view.video.read_bytes()).decode()}"
    page = static_file("index.html").decode()
    embedded = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script
    style = f"<style>{static_file('style.css').decode()}</style>"
    script = (
        f"<script>window.COGATTN_EMBEDDED = {embedded};</script>\n<script>{static_file('app.js').decode()}</script>"
    )
    page = page.replace('<link rel="stylesheet" href="static/style.css">', style)
    page = page.replace('<script src="static/app.js"></script>', script)
    out = Path(out)
    out.write_text(page)
    return out
