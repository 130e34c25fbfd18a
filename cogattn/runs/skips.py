"""Attention calls that did not run: which (step, layer) a cache skipped, what skipped it, and what a
reader asking for one is told.

diffusers' caches (``transformer.enable_cache(...)``: First Block Cache, Pyramid Attention Broadcast,
FasterCache, TaylorSeer, MagCache, ...) reuse an earlier output instead of running an attention layer, or
a whole block. A skipped attention never reaches cogattn's processor, so it has no map: a recording
never stores a stale or invented one. At the end of each selected step the recording lists the selected
``(step, layer, role)`` that produced no record (``role``: ``"self"``, or ``"context"`` for a
cross-attention), and names the cache it found on the transformer. FasterCache also runs the whole
transformer on the conditional half of a ``[uncond, cond]`` batch at some steps (``halves``): the
conditional items are recorded, and a ``batch`` selection that needs an unconditional item has no record
at those steps.

:class:`Skips` is what a :class:`cogattn.Recording` keeps and ``run.json`` holds (``"skipped"``);
:func:`cache_in_use` reads the cache from the transformer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import NotRecordedError

__all__ = ["Skipped", "Skips", "cache_in_use", "role_of"]


class Skipped(NotRecordedError):
    """The `NotRecordedError` of an attention a cache skipped (an animation draws a gap for it)."""


# diffusers' hook names (diffusers/hooks/*.py) → the cache's name, for caches applied with apply_*(...)
# rather than enable_cache (which also sets transformer._cache_config).
_HOOKS = {
    "fbc_leader_block_hook": "FirstBlockCache",
    "pyramid_attention_broadcast": "PyramidAttentionBroadcast",
    "faster_cache_denoiser": "FasterCache",
    "faster_cache_block": "FasterCache",
    "taylorseer_cache": "TaylorSeerCache",
    "mag_cache_leader_block_hook": "MagCache",
    "sea_cache_root": "SeaCache",
    "sea_cache_leader_block": "SeaCache",
    "text_kv_cache_transformer": "TextKVCache",
}


def cache_in_use(transformer: torch.nn.Module) -> str | None:
    """The name of the cache on ``transformer`` (``"FirstBlockCache"``, ...), `None` when there is none:
    the config ``enable_cache`` keeps, else the hooks ``apply_*`` put on it or its modules."""
    config = getattr(transformer, "_cache_config", None)
    if config is not None:
        return type(config).__name__.removesuffix("Config")
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for name in getattr(registry, "hooks", {}):
            if name in _HOOKS:
                return _HOOKS[name]
    return None


def role_of(source: str) -> str:
    """The attention a kind comes from (``"self"`` or ``"context"``), from its source (``"self"``,
    ``"text"``, ``"image"``: ``ModelSpec.source``)."""
    return "self" if source == "self" else "context"


@dataclass
class Skips:
    """What did not run in a recording's selected steps.

    Attributes:
        by (`str | None`): the cache found on the transformer when one was, else `None`.
        calls (`set[tuple[int, int, str]]`): ``(step, layer, role)`` selected but never recorded.
        halves (`set[int]`): steps where the transformer ran on the conditional half of the batch only.
        partial (`set[tuple[int, int, str]]`): of ``calls``, those that ran in some of the step's calls (Wan's
            conditional call) and were skipped in another.
        perturbed (`set[int]`): steps with a call a guider perturbed the model for, which is left out.
    """

    by: str | None = None
    calls: set = field(default_factory=set)
    halves: set = field(default_factory=set)
    partial: set = field(default_factory=set)
    perturbed: set = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.calls)

    def reason(self, step: int, layer: int, role: str, batch: str | None = None) -> str | None:
        """Why ``(step, layer)``'s ``role`` attention has no record, or `None` when it was not skipped."""
        if (step, layer, role) not in self.calls:
            return None
        who = self.by or "the model"
        # without a cache the call itself left the block out (Latte's with enable_temporal_attentions=False)
        reused = "it reused an earlier output" if self.by else "no cache was found: the call did not run it"
        if step in self.halves and batch != "cond":
            return (
                f"{who} ran the transformer on the conditional half of the batch at step {step} (it reuses the "
                f"unconditional output), and batch={batch!r} needs an unconditional item (batch='cond' records these steps)"
            )
        what = "attention" if role == "self" else "cross-attention"
        if (step, layer, role) in self.partial and step in self.perturbed:
            return (
                f"at step {step} the guider perturbed the model for a call of the guidance batch (auto-guidance's "
                f"unconditional call), which is left out, and batch={batch!r} needs its items; batch='cond' has its map"
            )
        if (step, layer, role) in self.partial and self.by is None:
            return (
                f"step {step} made no transformer call for the unconditional items (guidance off at that step: "
                f"a guider's start or stop, or a callback), and batch={batch!r} needs them; batch='cond' has its map"
            )
        if (step, layer, role) in self.partial:
            return (
                f"{who} skipped this {what} in one of the calls of step {step} ({reused}), and "
                f"batch={batch!r} needs the items of every call; a batch of the calls that ran it has its map"
            )
        return f"{who} skipped this {what} at step {step} ({reused}): there is no map of it"

    def unexplained(self) -> str | None:
        """The warning a recording closes with where no cache explains these skips, else `None`."""
        if not self or self.by is not None:
            return None
        if self.perturbed:
            return (
                f"{len(self.calls)} selected attention calls (step, layer) have no map: the guider perturbed the "
                "model for calls the selected batch needs (left out: not the model's maps); rec.skipped lists them."
            )
        return (
            f"{len(self.calls)} selected attention calls (step, layer) did not run, and no cache was found on the "
            "transformer; rec.skipped lists them."
        )

    def error(self, kind: str, step: int, layer: int, source: str | None, batch, otherwise: str) -> NotRecordedError:
        """The `NotRecordedError` for a missing ``(kind, step, layer)`` (``source``: the kind's, as
        ``ModelSpec.source`` gives it): why, where it was skipped; else ``otherwise``."""
        why = self.reason(step, layer, role_of(source or "self"), batch)
        if why is None:
            return NotRecordedError(otherwise)
        return Skipped(f"no record ({kind!r}, step={step}, layer={layer}): {why}.")

    def asdict(self) -> dict:
        """What ``run.json`` holds under ``"skipped"``."""
        calls, partial = (sorted(list(c) for c in group) for group in (self.calls, self.partial))
        halves, perturbed = sorted(self.halves), sorted(self.perturbed)
        return {"by": self.by, "calls": calls, "halves": halves, "partial": partial, "perturbed": perturbed}

    @classmethod
    def from_meta(cls, meta: dict | None) -> Skips:
        """The skips ``run.json`` holds (none for a run written before they were kept)."""
        meta = meta or {}
        calls, partial = ({(int(s), int(n), str(r)) for s, n, r in meta.get(key, [])} for key in ("calls", "partial"))
        halves, perturbed = ({int(s) for s in meta.get(key, [])} for key in ("halves", "perturbed"))
        return cls(meta.get("by"), calls, halves, partial, perturbed)
