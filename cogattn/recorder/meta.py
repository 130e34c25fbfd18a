"""run.json's content for a recording: what the recording is, as it stands (its status, layout, selection, model,
checks, skips, the context-parallel mesh), written when the plan is made and again when the recording closes."""

from __future__ import annotations

import torch

from ..runs.run_values import layout_json
from ..version import __version__

__all__ = ["call_stats", "run_meta"]


def run_meta(rec) -> dict:
    """What run.json says about the recording ``rec`` (a :class:`cogattn.Recording`), as it stands."""
    import diffusers  # imported by the model this records; `import cogattn` does not need it

    res = None if rec.plan is None else rec.plan.resolved
    return {
        "status": rec._status,
        "complete": rec._status == "finished",
        "steps": len(rec.timesteps),
        "layout": layout_json(rec.layout),
        "layer_layouts": {str(n): layout_json(lay) for n, lay in rec._capture.layer_layouts.items()},
        "timesteps": rec.timesteps,
        "windows": rec.windows,
        "selection": {
            **rec.options.selection_meta(),
            "batch_resolved": res and list(res.batch),
            "batch_roles": res and list(res.roles),
            "heads_resolved": res and list(res.heads),
            "source_heads": {src: ids and list(ids) for src, ids in rec.source_heads.items()},
            "text_lengths": None if rec.text_lengths is None else list(rec.text_lengths),
            "query_lengths": None if rec.query_lengths is None else list(rec.query_lengths),
            "text_spans": rec.text_spans and [{k: list(v) for k, v in s.items()} for s in rec.text_spans],
        },
        "model": {
            "family": rec._spec.family,
            "class": type(rec.transformer).__name__,
            "experts": list(rec._models.names),
            "layer_names": list(rec.layer_names),
            "step_experts": rec.experts,
            "config": dict(rec.transformer.config),
            "dtype": str(rec.transformer.dtype).removeprefix("torch."),
            "pipeline": None if rec.pipeline is None else type(rec.pipeline).__name__,
        },
        "mesh": None if rec._capture.mesh is None else rec._capture.mesh.asdict(),
        "call_stats": [  # NaN (a slot whose call was not captured) as null
            dict(step=step, layer=layer, name=name, values=[[x if x == x else None for x in r] for r in t.tolist()])
            for (step, layer, name), t in call_stats(rec._capture).items()
        ],
        "sources": rec._sources,
        "layer_output": rec.options.layer_output,
        "storage_dtype": rec.options.storage_dtype,
        "info": rec.options.info,
        "checks": [c.asdict() for c in rec._capture.verifier.checks],
        "skipped": rec.skipped.asdict(),
        "versions": {"cogattn": __version__, "diffusers": diffusers.__version__, "torch": torch.__version__},
    }


def call_stats(capture) -> dict:
    """The per-call statistics a :class:`~cogattn.recorder.capture.Capture` kept (``capture_stat``), ``(step, layer,
    name)`` → float64 ``(B, H)`` over the results' batch slots and every head, NaN for a slot whose call was not
    captured (Kandinsky 5's ``"nabla_recall"``: the mean over queries of the dense attention's mass its sparse mask
    keeps)."""
    num_slots, tables = len(capture.plan.resolved.batch) if capture.plan else 0, {}
    for key, slots in capture.stats.items():
        table = torch.full((num_slots, len(next(iter(slots.values())))), float("nan"), dtype=torch.float64)
        for slot, values in slots.items():
            table[slot] = torch.tensor(values, dtype=torch.float64)
        tables[key] = table
    return tables
