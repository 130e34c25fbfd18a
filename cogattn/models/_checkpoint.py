"""What a checkpoint says of itself before anything loads: the pipeline its folder's ``model_index.json`` names
(the families' batch-tool rules, ``ModelSpec.call_rules``, refuse the pipelines the batch tool does not run)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["pipeline_name"]


def pipeline_name(model: str) -> str:
    """The ``_class_name`` of ``model``'s ``model_index.json`` when ``model`` is a folder with one, else ``model``
    itself (a hub id, read offline: the rules then match its name)."""
    index = Path(model) / "model_index.json"
    return json.loads(index.read_text()).get("_class_name", "") if index.is_file() else model
