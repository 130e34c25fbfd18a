"""A modular pipeline's guider: which branch each transformer call computes.

diffusers' modular pipelines (``WanModularPipeline``, ...) leave guidance to a guider component
(``pipe.guider``; Wan 2.2's second expert has ``guider_2``): each step, ``prepare_inputs`` (or
``prepare_inputs_from_block_state``) returns one batch per branch, each named by its identifier
(``"pred_cond"``, ``"pred_uncond"``, ``"pred_cond_skip"``, ...), and the loop calls ``prepare_models``
(counting the step's calls in ``_count_prepared``) before the transformer call of each. Guiders that add
calls perturb the model for them: skip-layer and perturbed-attention guidance skip blocks or attention
through hooks named ``SkipLayerGuidance_<i>``, auto-guidance its unconditional call through
``AutoGuidance_<i>``.

:class:`Branches` keeps each step's identifiers (it wraps the two methods on the guider object, and puts
them back on close) and tells a recording, at each transformer call, its branch and whether the model is
perturbed for it. A recording keeps the conditional and unconditional calls of the unperturbed model (the
results' batch ``[uncond..., cond...]``) and leaves perturbed calls out: their maps are not the model's.

A modular pipeline that declares no guider component (Cosmos 3's) keeps its guidance scale in its denoising
loop's block state: :class:`Branches` reads it there (it wraps each loop block's ``loop_step`` the same way),
and the pipeline guides where the scale is not 1, as that loop does.
"""

from __future__ import annotations

import math

__all__ = ["Branches"]

UNPERTURBED = ("pred_cond", "pred_uncond")
_PERTURBING = ("SkipLayerGuidance_", "AutoGuidance_", "SmoothedEnergyGuidance_")  # diffusers' guiders' hook names


class Branches:
    """The branches of the guiders of ``pipeline`` (none for a pipeline without one).

    Args:
        pipeline: the recorded pipeline, or `None`.
        experts (`tuple[str, ...]`): the pipeline attribute of each transformer followed; transformer ``i``
            is guided by ``guider`` (``i == 0``) or ``guider_2``.
    """

    def __init__(self, pipeline, experts: tuple[str, ...] = ("transformer",)):
        names = ("guider", "guider_2")[: len(experts)]
        found = [getattr(pipeline, name, None) if pipeline is not None else None for name in names]
        self.guiders = [g if hasattr(g, "prepare_inputs") and hasattr(g, "_count_prepared") else None for g in found]
        self._steps: dict[int, list] = {}  # id(guider) → the identifiers of its running step's batches
        self._wrapped: list[tuple[object, str]] = []
        for guider in filter(None, self.guiders):
            for name in ("prepare_inputs", "prepare_inputs_from_block_state"):
                self._wrap(guider, name)
        specs = getattr(pipeline, "_component_specs", None)  # a modular pipeline's declared components
        self.loops = _loops(getattr(pipeline, "_blocks", None)) if specs is not None and "guider" not in specs else []
        self.loop_scale: float | None = None  # the running loop's block state's guidance_scale
        for loop in self.loops:
            self._wrap_loop(loop)

    def __bool__(self) -> bool:
        return any(self.guiders) or bool(self.loops)

    def _wrap_loop(self, loop) -> None:
        real = loop.loop_step

        def keep(components, block_state, *args, **kwargs):
            scale = getattr(block_state, "guidance_scale", None)
            self.loop_scale = None if scale is None else float(scale)
            return real(components, block_state, *args, **kwargs)

        loop.loop_step = keep  # on the object, as the guiders' methods
        self._wrapped.append((loop, "loop_step"))

    def _wrap(self, guider, name: str) -> None:
        real = getattr(guider, name)

        def keep(*args, **kwargs):
            batches = real(*args, **kwargs)
            key = getattr(guider, "_identifier_key", "__guidance_identifier__")
            self._steps[id(guider)] = [_identifier(batch, key) for batch in batches]
            return batches

        setattr(guider, name, keep)  # on the object, over its class's method: deleting it restores that
        self._wrapped.append((guider, name))

    def restore(self) -> None:
        """Put the guiders' own methods back (idempotent)."""
        for guider, name in self._wrapped:
            guider.__dict__.pop(name, None)
        self._wrapped.clear()

    def _guider(self, expert: int):
        return self.guiders[min(expert, len(self.guiders) - 1)] if self.guiders else None

    def branch(self, expert: int) -> str | None:
        """The identifier of the running call of transformer ``expert`` (`None` without a guider)."""
        guider = self._guider(expert)
        ids = self._steps.get(id(guider)) if guider is not None else None
        n = getattr(guider, "_count_prepared", 0)
        return ids[n - 1] if ids and 0 < n <= len(ids) else None

    def guided(self, expert: int) -> bool | None:
        """Whether a guider runs an unconditional branch in this generation (`None` without a guider): any of the
        pipeline's (Wan 2.2's second expert may guide where the first does not; its steps without it leave the
        unconditional items out), each from its settings (enabled, a scale that guides), so a guidance that starts
        after step 0 counts, else from the running step's branches."""
        if not any(self.guiders):  # a loop's own guidance scale: it guides unless the scale is 1 (Cosmos 3's)
            return None if self.loop_scale is None else not math.isclose(self.loop_scale, 1.0)
        verdicts = [self._guides(guider) for guider in self.guiders if guider is not None]
        return True if True in verdicts else None if None in verdicts else False

    def _guides(self, guider) -> bool | None:
        """Whether ``guider`` runs an unconditional branch (`None`: it does not say, and no step of it ran yet)."""
        scale = getattr(guider, "guidance_scale", None)
        if scale is not None:
            neutral = 0.0 if getattr(guider, "use_original_formulation", False) else 1.0
            return bool(getattr(guider, "_enabled", True)) and not math.isclose(float(scale), neutral)
        ids = self._steps.get(id(guider))
        return None if ids is None else "pred_uncond" in ids

    def perturbed(self, transformer, expert: int) -> str | None:
        """The running call's branch where the model is perturbed for it (a branch of its own, or a
        guider's hooks on ``transformer``), else `None`."""
        branch = self.branch(expert)
        if branch is None:
            return None
        if branch not in UNPERTURBED:
            return branch
        prefixes = (*_PERTURBING, f"{type(self._guider(expert)).__name__}_")
        for module in transformer.modules():
            for name in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}):
                if name.startswith(prefixes):
                    return f"{branch} ({name})"
        return None


def _loops(blocks) -> list:
    """The denoising loops (blocks with a ``loop_step``: ``LoopSequentialPipelineBlocks``) among a modular pipeline's
    ``blocks`` and their sub-blocks, nested."""
    found, todo = [], [blocks] if blocks is not None else []
    while todo:
        block = todo.pop()
        found += [block] * callable(getattr(block, "loop_step", None))
        todo += list((getattr(block, "sub_blocks", None) or {}).values())
    return found


def _identifier(batch, key: str):
    """A guider batch's identifier: a ``BlockState`` attribute or a dict entry."""
    return batch.get(key) if isinstance(batch, dict) else getattr(batch, key, None)
