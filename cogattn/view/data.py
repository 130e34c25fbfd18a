"""What the viewer shows, read from a run with the same code as the plots (:mod:`cogattn.analysis`).

:func:`cogattn.runs.folder.find_runs` turns a path into the runs it holds: a run folder (``manifest.jsonl``), a folder the batch
tool wrote for one prompt (``maps/`` beside ``prompt.json`` and the video), or a folder of those. A
:class:`RunView` answers the page's questions as JSON-ready dicts: the run's summary, and one map at a
time (``frame`` at a step, layer and head; a word's ``video_to_text`` or ``text_to_video`` over the video;
a video point's row), each averaged by :func:`cogattn.analysis.aggregate`. Records are read when asked for,
through the run's lazy reader, so a large run opens at once and the server holds one map at a time.

A run folder may come from anyone, so nothing in it is trusted: the files beside the records are read by
:mod:`cogattn.view.files` (paths inside the folder only), a run whose run.json cannot be read is left out with
its line (:func:`open_runs`), and a record that does not fit the layout is an ``error`` in its panel. What a run
did not record, or a choice a panel needs (one layer, one head), is a ``hint``: what to record or choose.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..analysis.head_stats import TABLE_KINDS, head_table
from ..analysis.layouts import of_generation
from ..analysis.maps import aggregate, head_positions, locate_query, recorded, recorded_kinds, skipped_pairs
from ..analysis.masks import mask_recall, same_frame_mask, spatial_window_mask, temporal_window_mask
from ..errors import NotRecordedError, StoreError
from ..exact.reducers import REDUCERS
from ..items import item_label, pick_item
from ..runs.folder import MANIFEST, find_runs
from ..runs.run import Run
from .files import PromptFiles, info
from .labels import MAX_LABELS, audio_seconds, one_line, run_names, token_labels
from .sparse import options as sparse_options

__all__ = ["RunView", "colormap", "open_runs"]

WORD_KINDS = ("video_to_text", "text_to_video")
STAT_KINDS = ("entropy", "received")  # per token: a query's entropy, the mass a key receives
MASKS = {  # the block-sparse masks the block panel outlines (window 1 latent frame, radius 1 patch)
    "none": None,
    "same_frame": same_frame_mask,
    "temporal_window": lambda layout, size: temporal_window_mask(layout, size, 1),
    "spatial_window": lambda layout, size: spatial_window_mask(layout, size, 1),
}
HEAD_COLUMNS = ("same_frame_mass", "text_mass", "entropy_mean", "sink_share")  # the head atlas's colourings
MAX_MASK_CELLS = 2**26  # a block mask's work, N × (F + Hp·Wp): 10 times a 720p HunyuanVideo's at block_size 64
POINT_HINT = "To see where a video point attends, record 'full', 'query', 'topk' or 'query_frame'."  # not an error


def colormap(name: str = "viridis", n: int = 256) -> list[list[int]]:
    """The page's colours: ``n`` RGB triples of a matplotlib colormap (the plots' default)."""
    from matplotlib import colormaps  # slow to import: only where the page asks for its colours

    return (np.asarray(colormaps[name](np.linspace(0, 1, n)))[:, :3] * 255).round().astype(int).tolist()


def open_runs(path: str | Path, problems: list[str], unreadable: dict[str, str] | None = None) -> dict[str, RunView]:
    """:class:`RunView` of each run under ``path``, by a name that is valid text (:func:`~cogattn.view.labels.run_names`);
    a run that cannot be opened (a damaged ``run.json``, or any error reading it) is left out with one line in
    ``problems`` (and ``unreadable``: name → why). Raises `FileNotFoundError` when none is left."""
    views = {}
    found = find_runs(path)
    for name, run in zip(run_names(found), found.values()):
        try:
            views[name] = RunView(run)
        except Exception as err:  # whatever a run's files cause (a bug too), it costs that run only
            problems.append(f"{name}: left out ({one_line(err)})")
            if unreadable is not None:
                unreadable[name] = one_line(err)
    if not views:
        raise FileNotFoundError(f"no run under {str(path)!r} can be read: {'; '.join(problems)}")
    return views


class RunView:
    """The page's view of one run.

    Args:
        path (`Path`): the run folder (its parent may hold the batch tool's ``prompt.json`` and video).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        stat = (self.path / MANIFEST).stat()
        self.run, self._manifest = Run(self.path), (stat.st_size, stat.st_mtime_ns)
        self.files = PromptFiles(self.path, self.run.layout)  # prompt.json, the video, the preview

    def refresh(self) -> None:
        """Read the manifest again where it changed: a run still being written shows its newly committed
        records, and a finished one is not parsed again for every request."""
        stat = (self.path / MANIFEST).stat()
        if (stat.st_size, stat.st_mtime_ns) != self._manifest:
            self.run, self._manifest = Run(self.path), (stat.st_size, stat.st_mtime_ns)

    def roles(self) -> list[str | None]:
        """Each slot's role of the run's batch axis (`None` each where the run does not say), one per slot."""
        return _roles(self.run)

    def tokens(self, key: str = "tokens") -> list[str]:
        """A label for each text token the records hold, at most :data:`~cogattn.view.labels.MAX_LABELS`
        (:func:`~cogattn.view.labels.token_labels`): the batch tool's token strings where it kept them
        (``"negative_tokens"``: the negative prompt's), else each token's index, named by its part."""
        return token_labels(self.run, self.files.prompt.get(key), key)

    def summary(self) -> dict:
        """What the page needs first: the kinds, steps, layers and heads held, the layout, the metadata."""
        run, meta = self.run, self.run.meta
        kinds = recorded_kinds(run)
        layout = run.layout
        skipped = run.skipped
        checks = [c for c in meta.get("checks") or [] if isinstance(c, dict)]
        files = self.files
        frames = files.frame_count()  # first: a video that does not decode is dropped
        return {
            "kinds": kinds,
            "steps": {k: recorded(run, k, "step") for k in kinds},
            "layers": {k: recorded(run, k, "layer") for k in kinds},
            "layer_names": run.layer_names,
            "timesteps": run.timesteps,
            "heads": None if run.head_ids is None else list(run.head_ids),
            "layout": None
            if layout is None
            else {"frames": layout.frames, "height": layout.height, "width": layout.width},
            "audio_seconds": audio_seconds(run),  # each audio bin's [start, end) in seconds, at most MAX_LABELS
            "groups": _group_names(layout),
            "tokens": self.tokens(),
            "video": None if files.video is None else files.video.suffix.lstrip("."),
            "video_frames": frames,
            "video_note": files.video_note(),
            "latent_of_pixel": layout.latent_of_pixel(frames) if layout is not None and frames else [],
            "status": run.status,
            "info": info(run),
            "model": {k: (meta.get("model") or {}).get(k) for k in ("family", "class", "pipeline", "dtype")},
            "selection": meta.get("selection") or {},
            "checks": {
                "count": len(checks),
                "failed": sum(1 for c in checks if not c.get("passed", True)),
                "largest_error": max((_number(c.get("max_error")) for c in checks), default=None),
            },
            "skipped": {"by": skipped.by, "count": len(skipped.calls), "calls": sorted(list(c) for c in skipped.calls)},
            "gaps": {k: self._gaps(k) for k in kinds},
            "colormap": colormap(),
            "head_atlas": bool(set(kinds) & set(TABLE_KINDS)),
            "head_columns": list(HEAD_COLUMNS),
            "masks": list(MASKS),
            "sparse": sparse_options(run),  # tile_shape, top_p's masses, the patterns a tile mask outlines
            "units": {k: REDUCERS[k].unit for k in kinds if k in REDUCERS},  # what a value is, per kind
            "items": [{"slot": i, "label": item_label(run, i), "role": role} for i, role in enumerate(_roles(run))],
            "negative_tokens": self.tokens("negative_tokens"),
            "text_spans": None
            if run.text_spans is None
            else [{k: list(v) for k, v in s.items()} for s in run.text_spans],
            "item": pick_item(run),
            "points": self.points(),
        }

    def points(self) -> list[list[int]]:
        """The recorded queries that are video points, as ``[frame, row, col]`` (the page's first point where the
        run holds no ``full`` row: one it can show)."""
        lay, out = self.run.layout, []
        for q in self.run.queries if lay is not None else ():
            where = lay.coordinates(q) if isinstance(q, int) else tuple(q)
            if where is not None and list(where) not in out:
                out.append(list(where))
        return out

    def _gaps(self, kind: str) -> dict[int, list[int]]:
        """The layers of ``kind`` with no record at each step because a cache skipped their attention
        (:func:`cogattn.analysis.skipped_pairs`), by step, including steps where it skipped every layer."""
        calls = self.run.skipped.calls
        if not calls:
            return {}
        steps = sorted(set(recorded(self.run, kind, "step")) | {s for s, _, _ in calls})
        layers = sorted(set(recorded(self.run, kind, "layer")) | {n for _, n, _ in calls})
        gaps: dict[int, list[int]] = {}
        for s, n in sorted(skipped_pairs(self.run, kind, steps, layers)):
            gaps.setdefault(s, []).append(n)
        return gaps

    def map(
        self, kind: str, step: int, layer: int | str, head: int | str = "mean", token: int | None = None, item=None
    ) -> dict:
        """One map of the page: ``kind`` at ``step`` and ``layer`` (``"mean"``: over the recorded layers),
        one head or their mean; a word kind at text token ``token`` (its map over the video); of batch slot
        ``item`` (`None`: the first conditional item, :func:`cogattn.items.pick_item`).

        Returns:
            `dict`: ``shape`` and row-major ``values`` (`None` where nothing is there), or ``error`` saying why.
        """
        heads = head if head == "mean" else int(head)
        if kind in WORD_KINDS and token is None:
            return {"error": f"{kind} is one map per text token: choose a token."}
        row = None if kind not in WORD_KINDS else int(token)  # one token's map: only its rows are read
        try:
            layers = self.layers_at(kind, step, layer)
            m = aggregate(self.run, kind, steps=int(step), layers=layers, heads=heads, batch=item, row=row)
        except (NotRecordedError, StoreError, ValueError) as err:
            return {"error": str(err)}
        if kind in STAT_KINDS:  # one value per token: the video's, on its grid
            try:
                m = _on_grid(m, self.run.layout, kind)
            except StoreError as err:
                return {"error": str(err)}
        return _payload(m)

    def heads(self, step: int, column: str = "same_frame_mass", item=None) -> dict:
        """The head atlas at ``step``: ``column`` of :func:`cogattn.analysis.head_stats.head_table` (of batch slot
        ``item``, by default the first conditional item) and each head's label, as a layers × heads grid."""
        try:
            table = head_table(self.run, steps=int(step))
            slot = pick_item(self.run, item)
        except (NotRecordedError, StoreError, ValueError) as err:
            return {"error": str(err)}
        if column not in HEAD_COLUMNS:
            return {"error": f"column={column!r}; choose one of {list(HEAD_COLUMNS)}."}
        table = table[table["item"] == slot]
        layers, heads = sorted(set(table["layer"])), list(dict.fromkeys(table["head"]))
        grid = table.pivot(index="layer", columns="head", values=column).reindex(index=layers, columns=heads)
        labels = table.pivot(index="layer", columns="head", values="label").reindex(index=layers, columns=heads)
        return {
            **_payload(torch.tensor(np.ascontiguousarray(grid.to_numpy(dtype=float)))),  # reindexed: any strides
            "layers": [int(x) for x in layers],
            "heads": [h if isinstance(h, str) else int(h) for h in heads],
            "labels": labels.fillna("").to_numpy().tolist(),
            "column": column,
        }

    def layers_at(self, kind: str, step: int, layer: int | str) -> list[int] | int:
        """``layer``, or for ``"mean"`` the layers held at ``step`` (a step still being written has fewer)."""
        step = int(step)
        if layer != "mean":
            if (kind, step, int(layer)) not in self.run:
                self.run.record_info(kind, step, int(layer))  # raises, saying why (a cache skipped it, ...)
            if (own := self.run.layout_of(int(layer))) != self.run.layout:  # Motif-Video's decoder layers
                raise ValueError(
                    f"layer {layer} attends over its own sequence ({own.frames} latent frames, {own.grids} copies of "
                    "the grid); this page draws the generation's layout: plot it with cogattn.plot (layers=layer)."
                )
            return int(layer)
        held = of_generation(self.run, sorted({n for k, s, n in self.run.keys() if k == kind and s == step}))
        if not held and (gone := sorted(n for s, n, _ in self.run.skipped.calls if s == step)):
            self.run.record_info(kind, step, gone[0])  # a cache skipped the whole step: its error says so
        return held or "all"  # none: aggregate says what was recorded

    def block(self, step: int, layer: int | str, head: int | str, mask: str = "none", item=None) -> dict:
        """The ``block`` map, with a block-sparse mask of :mod:`cogattn.analysis.masks` (``mask``: one of
        :data:`MASKS`, window 1) and its recall (:func:`cogattn.analysis.masks.mask_recall`, of batch slot ``item``,
        the head or every head's mean), as :func:`cogattn.plot.block_map` draws them."""
        if mask not in MASKS:
            return {"error": f"mask={mask!r}; choose one of {list(MASKS)}."}
        payload = self.map("block", step, layer, head, item=item)
        if "error" in payload or mask == "none":
            return payload
        lay, size = self.run.layout, self.run.block_size
        if (why := _block_misfit(payload["shape"], lay, size)) is not None:  # before any mask is made of the layout
            return {"error": why}
        keep = MASKS[mask](lay, size)
        layers = self.layers_at("block", step, layer)
        table = mask_recall(self.run, keep, steps=[int(step)], layers=layers if isinstance(layers, list) else [layers])
        table = table[table["item"] == pick_item(self.run, item)]
        if head != "mean":
            table = table[table["head"] == int(head)]
        return {**payload, "mask": keep.flatten().tolist(), "recall": float(table["recall"].mean())}

    def point(self, step: int, layer: int | str, head: int | str, frame: int, row: int, col: int, item=None) -> dict:
        """Where one video point attends, from whichever kind holds its row: a recorded ``query`` at that
        point or ``full`` (its row over the video, ``frames × height × width``); else ``topk`` (its k
        largest over the video, the rest `None`; one layer, one head or a head mean recorded as such); else
        ``query_frame`` (its mass to each key group); of batch slot ``item``. Only that row is read. Where none
        of them holds it, ``hint`` says what to record or choose (not an error: nothing went wrong)."""
        lay = self.run.layout
        if lay is None:
            return {"error": "run.json has no layout, so a video point cannot be located."}
        try:
            token = lay.token_index(int(frame), int(row), int(col))
            kind, index, _ = locate_query(self.run, (int(frame), int(row), int(col)))
        except ValueError as err:
            return {"error": str(err)}
        except NotRecordedError as err:
            kinds = recorded_kinds(self.run)
            refusal = self._topk_refusal(layer, head) if "topk" in kinds else None
            if "topk" in kinds and refusal is None:
                answer = self._point_topk(step, layer, head, token, item)
                if "error" not in answer or "query_frame" not in kinds:
                    return answer
            if "query_frame" in kinds:
                return self._point_groups(step, layer, head, token, item)
            if refusal is not None:  # a layer or a head to choose
                return {"hint": refusal}
            return {"hint": str(err) if "query" in kinds else POINT_HINT}  # the recorded queries, or what to record
        heads = head if head == "mean" else int(head)
        try:
            layers = self.layers_at(kind, step, layer)
            m = aggregate(self.run, kind, steps=int(step), layers=layers, heads=heads, batch=item, row=index)
            m = _on_grid(m, lay, kind)
        except (NotRecordedError, StoreError, ValueError) as err:
            return {"error": str(err)}
        return {**_payload(m), "kind": kind}

    def _topk_refusal(self, layer: int | str, head: int | str) -> str | None:
        """Why ``topk`` cannot show a point's row for this choice (a mean of k-largest lists), or `None`."""
        if layer == "mean" and len(recorded(self.run, "topk", "layer")) != 1:
            return "only 'topk' holds this point's row, and each layer keeps its own k largest keys: choose a layer."
        ids = self.run.head_ids
        if head == "mean" and ids is not None and len(ids) > 1:
            return (
                "only 'topk' holds this point's row, and each head keeps its own k largest keys: choose a head "
                "(or record topk with heads='mean')."
            )
        return None

    def _point_topk(self, step: int, layer: int | str, head: int | str, token: int, item) -> dict:
        """A point's ``topk`` row over the video: its k largest probabilities where they fall, the rest `None`."""
        ids = self.run.head_ids
        try:
            if layer == "mean":  # a run holding one layer of topk: that layer (refused above otherwise)
                layer = recorded(self.run, "topk", "layer")[0]
            self.layers_at("topk", step, layer)  # a layer a cache skipped: its error says so
            top = self.run.get("topk", int(step), int(layer), index=(pick_item(self.run, item), slice(None), token))
            slot = 0 if head == "mean" else head_positions(ids, top.values.shape[0], int(head))[0]
            lay = self.run.layout
            if top.indices.numel() and not 0 <= int(top.indices.min()) <= int(top.indices.max()) < lay.seq_len:
                raise StoreError(_misfit("topk", "key indices beyond", lay))
        except (NotRecordedError, StoreError, ValueError) as err:
            return {"error": str(err)}
        row = torch.full((lay.seq_len,), math.nan)
        row[top.indices[slot]] = top.values[slot]
        video = row[lay.grid_tokens]
        k, kept = top.values.shape[-1], float(top.values[slot].sum())
        on_video = float(video.nan_to_num().sum())
        note = (
            f"topk: the {k} largest of this row, {kept:.4f} of its mass ({on_video:.4f} on the video, "
            f"{kept - on_video:.4f} on other tokens); the rest was not recorded (blank)"
        )
        return {**_payload(video.reshape(lay.frames, lay.height, lay.width)), "kind": "topk", "note": note}

    def _point_groups(self, step: int, layer: int | str, head: int | str, token: int, item) -> dict:
        """A point's ``query_frame`` row: its attention mass to each key group (the text's, each latent frame)."""
        heads = head if head == "mean" else int(head)
        try:
            layers = self.layers_at("query_frame", step, layer)
            m = aggregate(self.run, "query_frame", steps=int(step), layers=layers, heads=heads, batch=item, row=token)
        except (NotRecordedError, StoreError, ValueError) as err:
            return {"error": str(err)}
        note = "query_frame: this point's attention mass to each key group; record 'full' for its row per patch"
        if "topk" in recorded_kinds(self.run):
            note += " (or choose one layer and one head: its topk)"
        return {**_payload(m[None]), "kind": "query_frame", "groups": _group_names(self.run.layout), "note": note}


def _roles(run: Run) -> list[str | None]:
    """Each slot's role of the run's batch axis (``None`` each where the run does not say), one per slot."""
    slots = next((r.shape[0] for r in run.records() if r.shape), 1)
    roles = list(run.batch_roles or [])
    return roles if len(roles) == slots else [None] * slots


def _misfit(kind: str, what: str, lay) -> str:
    return (
        f"the {kind} record holds {what} the {lay.seq_len} tokens of run.json's layout ({lay.text_len} text, "
        f"{lay.video_len} video on the grid {lay.grid}): the run's files do not agree"
    )


def _on_grid(m: torch.Tensor, lay, kind: str) -> torch.Tensor:
    """A per-token vector ``(S,)`` as the video's ``(F, Hp, Wp)``; `StoreError` where the record's tokens are
    not the layout's (a damaged or edited run)."""
    if lay is None or m.dim() != 1 or m.shape[0] != lay.seq_len:
        if lay is None:
            raise StoreError(f"run.json has no layout, so the {kind} record cannot be laid on the video grid")
        raise StoreError(_misfit(kind, f"{m.shape[-1] if m.dim() else 0} tokens, not", lay))
    return m[lay.grid_tokens].reshape(lay.frames, lay.height, lay.width)


def _block_misfit(shape: list[int], lay, size: int) -> str | None:
    """Why a block mask of run.json's layout cannot be laid over a block map of ``shape``, or `None`: the map must be
    N × N with N = ⌈S / block_size⌉, and the mask's work (N × (F + Hp·Wp) cells) at most :data:`MAX_MASK_CELLS`."""
    if lay is None:
        return "run.json has no layout, so no block mask can be made for the block map; choose mask 'none'."
    n = -(-lay.seq_len // size)
    if shape != [n, n]:
        return (
            f"the block map is {' × '.join(map(str, shape))} blocks, but run.json's layout ({lay.seq_len} tokens) and "
            f"block_size {size} give {n} × {n}: the run's files do not agree; choose mask 'none' to see the map."
        )
    if n * (lay.frames + lay.height * lay.width) > MAX_MASK_CELLS:
        return (
            f"a block mask over {n} blocks of a {lay.frames} × {lay.height} × {lay.width} grid is more than this page "
            "draws; choose mask 'none', or plot it with cogattn.plot.block_map."
        )
    return None


def _number(value) -> float:
    """A check's error as a number (0 where run.json holds something else)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _payload(m: torch.Tensor) -> dict:
    values = [None if not math.isfinite(v) else v for v in m.double().flatten().tolist()]
    return {"shape": list(m.shape), "values": values}


def _group_names(layout) -> list[str]:
    """The ``frame`` kind's group labels: the text's groups, then each latent frame; none (the page numbers them)
    past :data:`~cogattn.view.labels.MAX_LABELS` groups (no record holds a map so large: one number of run.json's)."""
    if layout is None or layout.num_groups > MAX_LABELS:
        return []
    frames = [f"f{f}" for f in range(layout.num_groups - layout.text_groups)]
    return ["text"] * layout.text_groups + frames  # the text's group is first wherever the text sits
