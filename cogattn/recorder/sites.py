"""The capture sites of a recording: the transformers it follows, their attention modules, and the
processors it swaps in and restores.

:func:`find_transformer` finds the transformer (and pipeline) of what ``record`` is given and its family;
:class:`Transformers` knows the layer and role of every captured attention module of the pipeline's
transformers (Wan 2.2's two experts take turns), installs cogattn's processors and puts the stock ones
back; :class:`EagerWhileRecording` runs a compiled transformer eagerly while a recording is open.
"""

from __future__ import annotations

import warnings
import weakref

from .. import models
from ..models import ModelSpec, spec_for_module
from .mesh import CHECKED_FAMILIES, find_mesh

__all__ = ["EagerWhileRecording", "SinkRef", "Transformers", "find_transformer", "uncompiled"]


class SinkRef:
    """The processors' weak hold on a recording whose results live in memory alone: one dropped without close()
    is collected (its finalizer puts the stock processors back) instead of living on in the processors, recording
    the next generation where no one can read it. Attributes are the recording's."""

    __slots__ = ("_sink", "__weakref__")

    def __init__(self, sink):
        self._sink = weakref.ref(sink)

    def __getattr__(self, name: str):
        sink = self._sink()
        if sink is None:
            raise ReferenceError("the recording these processors fed is gone")
        return getattr(sink, name)


def find_transformer(target) -> tuple[object, object | None, ModelSpec]:
    """``(transformer, pipeline or None, spec)`` for a pipeline or a bare transformer; a transformer compiled
    with ``torch.compile`` gives the module inside the compiled wrapper."""
    pipeline = None
    transformer = target
    if spec_for_module(uncompiled(target)) is None and hasattr(target, "transformer"):
        pipeline, transformer = target, target.transformer
    if pipeline is not None and transformer is None:
        raise TypeError(
            f"this {type(target).__name__} has no `transformer` (it is None); cogattn records a pipeline's "
            "`transformer` and the experts that take turns with it (`transformer_2`): load the pipeline with both."
        )
    inner = uncompiled(transformer)
    spec = spec_for_module(inner)
    if spec is not None:
        if inner is not transformer and pipeline is None:
            raise TypeError(
                "this transformer is compiled with torch.compile, whose graph cannot call cogattn at every "
                "layer; record the module inside it, `cogattn.record(compiled._orig_mod, ...)`, and call that "
                "module for the generation you record (or record the pipeline that holds it)."
            )
        return inner, pipeline, spec
    if (name := type(inner).__name__) in models.REFUSED:  # a video transformer cogattn does not record: why
        raise TypeError(models.REFUSED[name])
    known = ", ".join(c.__name__ for spec in models.FAMILIES for c in spec.transformers)  # imports every family
    missing = "".join(f"; {why}" for why in models.UNAVAILABLE.values())
    raise TypeError(
        f"{type(target).__name__} is not a pipeline or transformer cogattn supports; cogattn supports "
        f"transformers of class {known} (or pipelines holding one as `.transformer`, compiled or not){missing}."
    )


def uncompiled(module):
    """The module inside a ``torch.compile`` wrapper, or ``module``."""
    return getattr(module, "_orig_mod", module)  # torch.compile(module) wraps it as `_orig_mod`


class EagerWhileRecording:
    """Runs a compiled transformer eagerly while a recording is open, and compiled again after.

    ``pipe.transformer = torch.compile(pipe.transformer)`` (the pipeline then holds the module inside the
    wrapper for the recording), ``pipe.transformer.compile()`` and compiled blocks
    (``compile_repeated_blocks()``, diffusers' usual way to compile Wan: each compiled call is set aside)
    are undone by :meth:`restore`. Capture runs cogattn's code at every layer, which a compiled
    graph cannot call; the output is then the uncompiled model's, and a warning says so."""

    def __init__(self, pipeline, transformer, attr: str = "transformer", stacklevel: int = 4):
        self._undo = []
        if pipeline is not None and getattr(pipeline, attr) is not transformer:
            wrapper = getattr(pipeline, attr)
            setattr(pipeline, attr, transformer)
            self._undo.append(lambda: setattr(pipeline, attr, wrapper))
        for module in transformer.modules():  # the transformer itself, or its blocks
            compiled_call = getattr(module, "_compiled_call_impl", None)
            if compiled_call is not None:
                module._compiled_call_impl = None
                self._undo.append(lambda m=module, c=compiled_call: setattr(m, "_compiled_call_impl", c))
        if self._undo:
            warnings.warn(
                "the transformer is compiled with torch.compile; while this recording is open it runs uncompiled "
                "(cogattn's code runs at every layer, which a compiled graph cannot call), so the output is the "
                "uncompiled model's. It is compiled again when the recording closes.",
                stacklevel=stacklevel,
            )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class Transformers:
    """The transformers a recording follows: the pipeline's ``transformer`` and the experts that take
    turns with it (Wan 2.2's ``transformer_2``), with the block and role of each attention module.

    Args:
        pipeline: the pipeline, or `None` for a bare transformer.
        transformer: the (uncompiled) main transformer.
        spec (`ModelSpec`): the family.
    """

    def __init__(self, pipeline, transformer, spec: ModelSpec):
        self.spec = spec
        self.modules, attrs = [transformer], [spec.experts[0]]
        for name in spec.experts[1:]:
            other = getattr(pipeline, name, None) if pipeline is not None else None
            if other is not None:
                self.modules.append(uncompiled(other))
                attrs.append(name)
        self.names = tuple(attrs)
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.roles: dict[int, tuple[int, str]] = {}
        for m in self.modules:
            self.roles.update(spec.roles(m))
        self._pipeline, self._attrs = pipeline, attrs
        self._eager: list[EagerWhileRecording] = []
        self._originals: list[dict] | None = None

    def run_eager(self) -> None:
        """Run compiled transformers uncompiled until :meth:`restore` (:class:`EagerWhileRecording`)."""
        self._eager = [EagerWhileRecording(self._pipeline, m, a, 5) for m, a in zip(self.modules, self._attrs)]

    def hook(self, before, after) -> list:
        """Register the forward pre-hook ``before`` and the forward hook ``after`` (run when the forward raises
        too) on every transformer; returns the handles."""
        pre = [m.register_forward_pre_hook(before, with_kwargs=True) for m in self.modules]
        return pre + [m.register_forward_hook(after, with_kwargs=True, always_call=True) for m in self.modules]

    def check_install(self) -> None:
        """Raise what :meth:`install` would raise (a processor that is not stock, another recording's),
        changing nothing."""
        for m in self.modules:
            self.spec.map_processors(m, None)

    def install(self, sink) -> None:
        """Replace the stock processors of every captured module with cogattn's, feeding ``sink``."""
        self._originals = []  # filled as each is replaced: a refusal restores those replaced before it
        for m in self.modules:
            modules = self.spec.site_modules(m)
            replacement = self.spec.map_processors(m, sink)
            self._originals.append({name: modules[name].processor for name in replacement})
            for name, proc in replacement.items():
                _set_processor(modules[name], proc)

    def mesh(self):
        """The context-parallel :class:`cogattn.recorder.mesh.Mesh` of the recorded transformers (diffusers'
        ``enable_parallelism`` with a ring or Ulysses degree above 1, before or after recording started), `None`
        without one; `ValueError` for a transformer without a context-parallel plan of its own (``_cp_plan``), whose
        split cogattn cannot know. Called before any block runs."""
        for m in self.modules:
            configs = [getattr(m, "_parallel_config", None)]
            configs += [getattr(a.processor, "_parallel_config", None) for a in self.spec.site_modules(m).values()]
            found = find_mesh(configs)
            if found is not None and getattr(type(m), "_cp_plan", None) is None:
                raise ValueError(
                    f"{type(m).__name__} has no context-parallel plan (_cp_plan) in this diffusers; cogattn records "
                    "context parallelism as diffusers' plan of a family splits it: record without it."
                )
            if found is not None and self.spec.family not in CHECKED_FAMILIES:
                raise ValueError(
                    f"cogattn does not record {self.spec.family} under context parallelism yet (checked: "
                    f"{', '.join(CHECKED_FAMILIES)}; docs/many-gpus.md says why): record without enable_parallelism."
                )
            if found is not None:
                return found
        return None

    def restore(self) -> None:
        """Put the original processors back and compile again what was compiled (idempotent)."""
        if self._originals is not None:
            for m, original in zip(self.modules, self._originals):
                modules = self.spec.site_modules(m)
                for name, proc in original.items():
                    for attr in ("_attention_backend", "_parallel_config"):  # set while recording: kept
                        if hasattr(proc, attr) and hasattr(modules[name].processor, attr):
                            setattr(proc, attr, getattr(modules[name].processor, attr))
                    _set_processor(modules[name], proc)
            self._originals = None
        for eager in self._eager:
            eager.restore()


def _set_processor(module, processor) -> None:
    """Set an attention module's processor as diffusers does (``set_processor`` where the module has it;
    Mochi's attention has a plain ``processor`` attribute)."""
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor
