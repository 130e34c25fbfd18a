"""What a capture plan will cost, before anything runs: records, bytes on disk, peak extra memory.

``estimate`` needs only the transformer's config (read from a local folder, the hub cache, or a table
of the released CogVideoX shapes), never its weights, so ``dump_maps.py --dry-run`` can answer on a
laptop for a model it has not downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from .engine import TilePlan, check_output, joint_extra_bytes, plan_tiles
from .layout import TokenLayout
from .reducers import REDUCERS
from .selection import Selection
from .store import STORAGE_DTYPES, record_file_bytes

__all__ = ["Estimate", "estimate", "transformer_config", "layout_for", "KNOWN_MODELS"]

# Attention shapes of the released checkpoints (their transformer/config.json), for dry runs offline.
_BASE = {"attention_head_dim": 64, "patch_size": 2, "patch_size_t": None, "max_text_seq_length": 226}
KNOWN_MODELS: dict[str, dict] = {
    "THUDM/CogVideoX-2b": {**_BASE, "num_layers": 30, "num_attention_heads": 30},
    "THUDM/CogVideoX-5b": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX-5b-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48},
    "THUDM/CogVideoX1.5-5B": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
    "THUDM/CogVideoX1.5-5B-I2V": {**_BASE, "num_layers": 42, "num_attention_heads": 48, "patch_size_t": 2},
}
_VAE_SPATIAL, _VAE_TEMPORAL = 8, 4  # every CogVideoX VAE


def transformer_config(model) -> dict:
    """The transformer config of a pipeline, a transformer, ``"tiny"``, a local folder or a hub id."""
    transformer = getattr(model, "transformer", model)
    if hasattr(transformer, "config") and not isinstance(model, (str, os.PathLike)):
        return dict(transformer.config)
    name = str(model)
    if name == "tiny":
        from .testing import tiny_transformer

        return dict(tiny_transformer().config)
    folder = Path(name)
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if folder.exists():
        raise ValueError(f"{name!r} is a folder without transformer/config.json; is it a CogVideoX checkpoint?")
    try:  # from the hub cache, or the hub: the config only, never the weights
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(name, "transformer/config.json")).read_text())
    except Exception as err:  # noqa: BLE001 - offline, unknown id, ...
        if name in KNOWN_MODELS:
            return dict(KNOWN_MODELS[name])
        raise ValueError(
            f"cannot read the transformer config of {name!r} ({type(err).__name__}); pass a local folder, or "
            f"one of {list(KNOWN_MODELS)}."
        ) from None


def layout_for(config: dict, num_frames: int, height: int, width: int, text_len: int) -> TokenLayout:
    """The token layout a CogVideoX pipeline call will produce (latent frames padded for ``patch_size_t``)."""
    p, pt = int(config["patch_size"]), config.get("patch_size_t")
    latent_frames = (num_frames - 1) // _VAE_TEMPORAL + 1
    if pt:
        latent_frames += (-latent_frames) % pt
    lh, lw = height // _VAE_SPATIAL, width // _VAE_SPATIAL
    return TokenLayout.from_latents((1, latent_frames, 1, lh, lw), text_len, SimpleNamespace(patch_size=p, patch_size_t=pt))


@dataclass
class Estimate:
    """The cost of a capture plan.

    Args:
        layout (`TokenLayout`): the token layout of each generation.
        records (`list[tuple[str, tuple[int, ...], int, int]]`): per kind: shape, bytes per record file, count.
        plan (`TilePlan`): the tiles the engine will use.
        result_bytes_per_layer (`int`): the float32 results of one layer call, held while it runs.
        output_bytes (`int`): with ``output="joint"``, what the widened output call holds beyond the
            stock call (:func:`cogattn.engine.joint_extra_bytes`); 0 otherwise.
    """

    layout: TokenLayout
    records: list[tuple[str, tuple[int, ...], int, int]]
    plan: TilePlan
    result_bytes_per_layer: int
    output_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def num_records(self) -> int:
        return sum(n for *_, n in self.records)

    @property
    def record_bytes(self) -> int:
        """Bytes of all record files (what lands in ``records/``)."""
        return sum(b * n for _, _, b, n in self.records)

    @property
    def peak_extra_memory(self) -> int:
        """Predicted peak memory capture adds to a generation: the tile working set (or, with
        ``output="joint"``, the widened output call when it is larger) plus one layer's results."""
        return max(self.plan.peak_bytes, self.output_bytes) + self.result_bytes_per_layer

    def table(self) -> str:
        lay = self.layout
        lines = [
            f"layout: {lay.text_len} text + {lay.frames}×{lay.height}×{lay.width} video tokens, S = {lay.seq_len:,}",
            f"{'kind':>14}  {'shape':<28} {'bytes/record':>14} {'records':>8} {'bytes':>16}",
        ]
        for kind, shape, b, n in self.records:
            lines.append(f"{kind:>14}  {str(shape):<28} {b:>14,} {n:>8,} {b * n:>16,}")
        lines += [
            f"{'total':>14}  {'':<28} {'':>14} {self.num_records:>8,} {self.record_bytes:>16,}  "
            f"({self.record_bytes / 2**30:.2f} GiB)",
            f"predicted peak extra memory: {self.peak_extra_memory:,} bytes ({self.peak_extra_memory / 2**20:.1f} MiB; "
            f"path {self.plan.path})",
            *self.notes,
        ]
        return "\n".join(lines)


def estimate(
    model,
    *,
    num_frames: int,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float = 6.0,
    text_len: int | None = None,
    num_prompts: int = 1,
    kinds=("frame",),
    layers="all",
    steps="all",
    batch="all",
    heads="mean",
    queries=None,
    memory_budget="1GiB",
    path: str = "auto",
    output: str = "stock",
    storage_dtype: str = "float32",
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
) -> Estimate:
    """Predict records, bytes and peak extra memory of ``record(...)`` over ``num_prompts`` pipeline calls.

    Takes the arguments of a pipeline call and of :func:`cogattn.record`; raises the same `ValueError`
    a recording would for a selection that does not fit the model or the call.

    Args:
        model: a pipeline, a transformer, ``"tiny"``, a local checkpoint folder or a hub id.
        num_frames, height, width, num_inference_steps, guidance_scale: as in the pipeline call.
        text_len (`int | None`): text tokens (``max_sequence_length``); defaults to the model's.
        num_prompts (`int`, defaults to 1): pipeline calls (one prompt each).
        dtype: the model's dtype (a non-float32 model's q and k are copied to float32 tile by tile).
        device (`str`, defaults to ``"cpu"``): where capture runs (``"cuda"`` or ``"cpu"``).
        Other arguments: see :func:`cogattn.record`.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype={storage_dtype!r}; choose one of {list(STORAGE_DTYPES)}.")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cfg = transformer_config(model)
    num_layers, num_heads = int(cfg["num_layers"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg["attention_head_dim"])
    layout = layout_for(cfg, num_frames, height, width, text_len or int(cfg["max_text_seq_length"]))
    sel = Selection.build(kinds=kinds, layers=layers, steps=steps, batch=batch, heads=heads, queries=queries,
                          memory_budget=memory_budget, path=path, num_layers=num_layers, num_heads=num_heads)  # fmt: skip
    guidance = guidance_scale > 1
    res = sel.resolve(layout, 2 if guidance else 1, guidance, num_inference_steps, num_heads)
    reducers = [REDUCERS[k](layout, len(res.heads), res.mean_heads, res.queries) for k in sel.kinds]
    copies = dtype != torch.float32 or len(res.heads) != num_heads
    check_output(output, sel.path)
    path = "joint" if output == "joint" else sel.path
    plan = plan_tiles(reducers, layout.seq_len, len(res.heads), head_dim, sel.memory_budget, path, device, copies)
    n_cols = sum(r.key_groups.num_groups for r in reducers if r.key_groups is not None and not r.key_groups.single_keys)
    output_bytes = 0
    if output == "joint" and n_cols:
        elem = torch.empty((), dtype=dtype).element_size()
        output_bytes = joint_extra_bytes(len(res.batch), num_heads, layout.seq_len, head_dim, n_cols, elem)
    n_layers = num_layers if sel.layers == "all" else len(sel.layers)
    n_steps = num_inference_steps if sel.steps == "all" else len(sel.steps)
    store_dtype = STORAGE_DTYPES[storage_dtype]
    records = []
    for r in reducers:
        shape = r.shape(len(res.batch))
        records.append((r.kind, shape, record_file_bytes(shape, store_dtype), n_layers * n_steps * num_prompts))
    result_bytes = sum(r.nbytes(len(res.batch)) for r in reducers)
    return Estimate(layout, records, plan, result_bytes, output_bytes)
