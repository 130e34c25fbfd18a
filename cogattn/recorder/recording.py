"""Recording: follows a generation step by step and keeps the maps the options ask for.

``record(pipe, ...)`` is the one-line entry point: it builds a :class:`Recording`, installs cogattn's
processors on every attention layer, and on exit (also on an exception or KeyboardInterrupt) puts the
original processors back and removes its hook. A forward pre-hook on the transformer (no patching of
pipeline or block classes) tells the recording the step index, timestep, batch size and latent grid;
the processors hand it q and k of the captured layer calls (:class:`cogattn.recorder.processor.MapSink`).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..errors import NotRecordedError
from ..exact import engine
from ..exact.layer_plans import layer_plans, records
from ..exact.planner import ModelShape, plan_capture
from ..layout import TokenLayout
from ..options import CaptureOptions
from ..runs.skips import cache_in_use
from ..runs.store import MemoryStore, RunWriter, StoreError
from .capture import Capture
from .facts import Facts
from .guiders import Branches
from .mesh import ElsewhereStore, distributed
from .meta import call_stats, run_meta
from .sites import SinkRef, Transformers, find_transformer
from .steps import StepTracker, WeakHook

__all__ = ["Recording", "record"]


class Recording(Facts):
    """Attention maps of one generation, keyed by ``(kind, step, layer)``.

    Building a recording checks the options against the model and registers its forward pre-hook; it
    installs no processors (see :func:`record`, or set :class:`CogVideoXAttnMapProcessor` yourself).
    Use it as a context manager or call :meth:`close`.

    Args:
        target: a pipeline of a supported family (CogVideoX, Wan, HunyuanVideo; Wan 2.2's two experts are
            both followed) or its transformer.
        options (`CaptureOptions | None`): the options; keyword arguments (any field of
            :class:`CaptureOptions`) are applied on top.

    Attributes:
        layer_names (`tuple[str, ...]`): each layer's stable name, in layer order (``layers=`` takes them):
            ``"transformer_blocks.3.attn1"``; HunyuanVideo's single-stream blocks follow its dual-stream ones.
    """

    def __init__(self, target, options: CaptureOptions | None = None, **kwargs):
        self.options = CaptureOptions.build(options, **kwargs)
        self.transformer, self.pipeline, self._spec = find_transformer(target)
        self._spec.check_kinds(self.options.kinds)
        self._spec.check_options(self.options, self.transformer.config)
        modules = self._spec.attention_modules(self.transformer)
        heads, head_dim = self._spec.module_shape(self.transformer)
        config = self.transformer.config
        self._shape = ModelShape(len(modules), heads, head_dim, self.transformer.dtype, self._spec.shapes(config))
        self.layer_names = self._spec.layer_names(self.transformer)
        self._sources = {k: self._spec.source(k) for k in self.options.kinds}
        heads = {k: self._shape.heads_of(source) for k, source in self._sources.items()}  # each attention's own
        self.options.check_model(len(modules), heads, self.layer_names)
        if self.options.batch in ("cond", "uncond") and self.pipeline is None:
            raise ValueError(
                f"batch={self.options.batch!r} needs a pipeline to know whether classifier-free guidance "
                "is on; with a bare transformer pass batch indices (under guidance the batch is "
                "[uncond..., cond...])."
            )
        self._models = Transformers(self.pipeline, self.transformer, self._spec)
        self._branches = Branches(self.pipeline, self._models.names)  # a modular pipeline's guider
        self._steps = StepTracker(self._spec, self.pipeline, self._branches)
        self._capture = Capture(self.options, self._steps, self._models.roles)  # the store follows
        self._closed = False
        self._entered = False  # used as a context manager: a second generation raises instead of closing
        self._status, self._raising = "running", False  # _raising: closed on an exception's way out (__exit__)
        # In a torch.distributed process the run folder waits for the first call: rank 0 of a context-parallel mesh
        # alone makes it, and that mesh is known then (enable_parallelism may come after record)
        self._deferred = self.options.save_dir is not None and distributed()
        self._store: MemoryStore | RunWriter | ElsewhereStore = MemoryStore()
        if self.options.save_dir is not None and not self._deferred:
            self._store = RunWriter.create(self.options, self._meta())
        self._capture.store = self._store
        # The hooks hold the recording weakly: a recording dropped without close() stops capturing and
        # its hooks go away with it, instead of outliving it in the transformer.
        self._hooks = self._models.hook(WeakHook(self._on_forward), WeakHook(self._after_forward))
        self._models.run_eager()
        self._finalizer = weakref.finalize(self, _abandon, self._hooks, self._store, self._models, self._branches)

    # -- reading (the interface `cogattn.runs.run.MapSource` shares with a loaded run) ------------------
    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """The float32 CPU result of ``kind`` at denoising step ``step`` and block ``layer`` (read back
        from disk when recording to ``save_dir``); `NotRecordedError` if there is none, saying so where a
        cache skipped that attention (:attr:`skipped`)."""
        try:
            return self._store.get(kind, step, layer)
        except NotRecordedError as err:
            raise self.skipped.error(kind, step, layer, self._sources.get(kind), self.options.batch, str(err)) from None

    def keys(self) -> list[tuple[str, int, int]]:
        """Every recorded ``(kind, step, layer)``, sorted."""
        return self._store.keys()

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def _on_forward(self, module, args, kwargs):
        seen = self._steps.observe(module, self._models.index[id(module)], args, kwargs)
        if seen == "next":
            self._capture.end_step(self._steps.step - 1)
        elif seen == "extra":  # a guider's perturbed call: not the model's maps, left out
            self._capture.skips.perturbed.add(self._steps.step)
        elif seen == "first":
            try:
                self._start(self._steps.layout, self._steps.batch_size, self._steps.device)
            except BaseException:
                self._steps.forget()  # refused before any block ran: as if the call never happened
                raise
        elif seen == "another":
            self._second_generation()
        elif seen == "reshaped" and not self._capture.stopped:
            self._capture.stopped = True  # its maps would not fit this generation's layout: none are mixed in
            warnings.warn(self._steps.went_on(), stacklevel=4)

    def _after_forward(self, module, args, kwargs, output=None):
        self._steps.returned()  # a block run after this is a recomputation (gradient checkpointing), not captured
        if output is not None and self._capture.mesh is not None:  # a call every rank returned from
            self._settle("could not capture or write this call")

    def _settle(self, what: str, error: Exception | None = None) -> None:
        """A rank's error (``error``, or one a call kept: rank 0's store, a rank's capture) raised on every rank of the
        mesh (`Mesh.settle`)."""
        error, self._capture.latched = error or self._capture.latched, None
        self._capture.mesh.settle(error, what)

    def _second_generation(self) -> None:
        """A new generation began: one recording holds one generation. Inside a ``with`` block that is an error; a
        recording left open is finished and closed, with a warning, and the new generation runs unrecorded."""
        held = self._steps.describe()
        if self._entered:
            raise RuntimeError(
                f"a second generation started inside one recording (it already holds {held}); use one "
                "`cogattn.record(...)` per pipeline call so results are never mixed."
            )
        self.close()
        warnings.warn(
            f"a second generation started while a recording was still open; the recording was closed with its "
            f"{held}, and this generation is not recorded. Use `with cogattn.record(...)` around each pipeline call.",
            stacklevel=4,
        )

    def _start(self, layout: TokenLayout, batch_size: int, device: torch.device) -> None:
        """First call of the generation: plan the capture (errors before any block runs)."""
        mesh = self._capture.mesh = self._models.mesh()
        if mesh is not None and self.options.layer_output != "stock":
            raise ValueError(
                f"layer_output={self.options.layer_output!r} makes the layer's output in cogattn's own call, past "
                f"diffusers' context-parallel dispatch (ring {mesh.ring} × ulysses {mesh.ulysses}): use 'stock'."
            )
        failed = None  # under a mesh, what one rank alone met (its folder, disk, plan): raised on every rank (settle)
        if self._deferred or (mesh is not None and not mesh.writer):
            self._deferred = False
            writes = self.options.save_dir is not None and (mesh is None or mesh.writer)
            try:
                self._store = self._capture.store = (
                    ElsewhereStore(mesh.rank)
                    if mesh is not None and not mesh.writer
                    else RunWriter.create(self.options, self._meta())
                    if writes
                    else self._store
                )
            except Exception as err:
                failed = _alone(err, mesh)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _abandon, self._hooks, self._store, self._models, self._branches)
        try:
            plan, most_steps = self._plan(layout, batch_size, device, mesh)
        except Exception as err:  # under a mesh a rank may refuse alone (its host's memory)
            failed, plan = failed or _alone(err, mesh), None
        if isinstance(self._store, RunWriter) and plan is not None:
            planned = records(plan, self._capture.layer_plans, self._shape.num_layers, most_steps)
            try:
                self._store.check_space([(b, n) for _, _, b, n in planned])
                self._store.write_meta(self._meta())
            except Exception as err:
                failed = _alone(err, mesh)
        if mesh is not None:
            mesh.settle(failed, "could not start the run")

    def _plan(self, layout: TokenLayout, batch_size: int, device: torch.device, mesh):
        """Plan the capture of this generation (its plan and its most steps); raises what refuses it."""
        num_steps, most_steps = self._steps.step_counts()

        calls, common = self._steps.calls_per_step, dict(guidance=self._steps.guidance, num_steps=num_steps)
        common.update(device=device, sources=self._spec.context_kinds, calls_per_step=calls)
        common.update(mask_cost=self._spec.mask_cost(self.transformer.config))  # row tiles under a family's mask

        def planned(options, lay=layout):  # Wan's guidance batch spans two calls
            return plan_capture(options, self._shape, lay, batch_size=batch_size * calls, **common)

        plan = planned(self.options)
        if mesh is not None:  # the exchanged q and k of this rank's heads count in its budget
            plan = planned(mesh.budget_less_exchange(self.options, plan, self._shape, self._steps.calls_per_step))
        layouts = self._capture.layer_layouts = self._spec.layer_layouts(self.transformer.config, layout)
        self._capture.layer_plans = layer_plans(plan, planned, layouts, self._spec.context_kinds)
        self._capture.plan = plan
        self._capture.skips.by = next(filter(None, map(cache_in_use, self._models.modules)), None)
        if self.options.layer_output == "joint":
            indicator = engine.multi_key_indicator(plan.reducers, layout.seq_len, device)
            # with no multi-key kinds there is nothing to widen the values with: the lse alone is reused
            self._capture.joint_indicator = indicator if indicator.shape[1] else None
        return plan, most_steps

    def _meta(self) -> dict:
        """What run.json says about this recording (:func:`cogattn.recorder.meta.run_meta`)."""
        return run_meta(self)

    # -- the processors' calls (cogattn.recorder.processor.MapSink), handed to the capture side ---------
    # the MapSink calls, cogattn.recorder.capture.Capture's (capture and capture_context are methods: the self-test
    # wraps them on the instance)
    layout_of = property(lambda self: self._capture.layout_of, doc="A layer's layout: its own or :attr:`layout`.")
    layer_to_capture = property(lambda self: self._capture.layer_to_capture, doc=":meth:`.Capture.layer_to_capture`.")
    attention = property(lambda self: self._capture.attention, doc=":meth:`.capture.Capture.attention`.")
    wants_value = property(lambda self: self._capture.wants_value, doc=":attr:`.capture.Capture.wants_value`.")
    capture_stat = property(lambda self: self._capture.capture_stat, doc=":meth:`.capture.Capture.capture_stat`.")
    call_stats = property(lambda self: call_stats(self._capture), doc=":func:`cogattn.recorder.meta.call_stats`.")

    def capture(self, *args, **kwargs) -> None:
        self._capture.capture(*args, **kwargs)

    def capture_context(self, layer, query, key, context, bias=None) -> None:
        self._capture.capture_context(layer, query, key, context, bias)

    # -- processors and cleanup --------------------------------------------------------------------
    def install_processors(self) -> None:
        """Replace the stock processors of every captured attention module (of every expert);
        :meth:`close` restores them. They hold a recording of results in memory alone weakly (`SinkRef`)."""
        self._models.install(self if self.options.save_dir is not None else SinkRef(self))

    @property
    def status(self) -> str:
        """``"running"`` until closed; then how the generation ended: ``"finished"``, ``"interrupted"``
        (the pipeline's interrupt flag, Ctrl-C) or ``"failed"`` (an exception)."""
        return self._status

    def close(self, status: str | None = None) -> None:
        """Remove the hook, restore the original processors, and finish writing (idempotent).

        Args:
            status (`str | None`): how the generation ended (``"failed"``, ``"interrupted"``); by default
                ``"finished"``, or ``"interrupted"`` when the pipeline's interrupt flag is set or the generation ran
                fewer steps than its pipeline said at its first call (a Ctrl-C in a recording left open).

        Raises `StoreError` if a record or the metadata could not be written; the committed records stay
        readable."""
        if self._closed:
            return
        self._closed = self._capture.closed = True
        self._finalizer.detach()
        for hook in self._hooks:
            hook.remove()
        self._models.restore()
        self._branches.restore()
        if status is None:  # closed by hand: a generation short of the steps its pipeline said was cut short
            short = 0 < len(self.timesteps) < (self._steps.told_steps or 0) and not self._capture.stopped  # (went on)
            status = "interrupted" if short or self._steps.pipeline_attr("interrupt") else "finished"
        self._status = status
        if status == "finished" and self.step is not None:  # an interrupted last step is not a skipped one
            self._capture.end_step(self.step)
        error = None
        try:
            self._store.close(self._meta())
        except StoreError as err:
            self._status = "failed" if getattr(self._store, "failed", False) else self._status  # a record is missing
            error = _alone(err, None if self._raising else self._capture.mesh)
        except KeyboardInterrupt:  # while the queue drained: what was queued is dropped, the run says interrupted
            self._status = "interrupted"
            raise
        finally:
            if isinstance(self._store, RunWriter) and self._store.committed == 0 and self._status != "finished":
                self._store.discard()  # nothing was captured (refused at the first step, say)
        if self._capture.mesh is not None and not self._raising:  # every rank closes here, as it returned
            self._settle("could not finish writing the run", error)
        if (why := self.skipped.unexplained()) is not None:  # a cache's skips are expected: rec.skipped lists them
            warnings.warn(why, stacklevel=3)
        steps = self.options.steps
        if self._status == "finished" and steps != "all" and max(steps) >= len(self.timesteps):
            missing = [s for s in steps if s >= len(self.timesteps)]
            warnings.warn(
                f"steps {missing} were selected but the generation ran {len(self.timesteps)} steps.", stacklevel=3
            )

    def __enter__(self) -> Recording:
        if self._closed:
            raise RuntimeError("this recording is closed; start a new one with `cogattn.record(...)`.")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:  # the pipeline returned: finished, or stopped by its interrupt flag
            self.close("interrupted" if self._steps.pipeline_attr("interrupt") else "finished")
            return
        status, self._raising = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed", True
        try:  # an exception is on its way out: finish what can be finished, and never mask it
            self.close(status)
        except StoreError as err:
            warnings.warn(f"closing the recording after {exc_type.__name__} also failed: {err}", stacklevel=2)

    def __repr__(self) -> str:
        kinds, steps, records = list(self.options.kinds), len(self.timesteps), len(self.keys())
        return f"Recording(kinds={kinds}, steps={steps}, records={records}, {self._status}, layout={self.layout})"


def record(target, options: CaptureOptions | None = None, **kwargs) -> Recording:
    """Record exact attention maps of a pipeline or transformer of a supported family while it runs.

    ```python
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond") as rec:
        pipe(prompt_embeds=..., num_inference_steps=4)
    rec.get("frame", step=0, layer=1)  # (B, H, G, G) float32 on CPU
    ```

    Args:
        target: a pipeline of a supported family (``cogattn.models.FAMILIES``: CogVideoX, Wan, HunyuanVideo,
            Mochi and their relatives; Wan 2.2's two experts are both followed) or its transformer.
        options (`CaptureOptions | None`): the options as one object; keyword arguments (any field of
            :class:`cogattn.CaptureOptions`, which documents each) are applied on top.

    Returns:
        `Recording`: a context manager; on exit the original processors are back and the hook is gone.
    """
    transformer, pipeline, spec = find_transformer(target)
    Transformers(pipeline, transformer, spec).check_install()  # refused before `save_dir` is touched
    rec = Recording(target, options, **kwargs)
    try:
        rec.install_processors()
    except BaseException:
        rec.close("failed")  # refused after all (processors changed since the check): the run is discarded
        raise
    return rec


def _alone(error: Exception, mesh) -> Exception:
    """``error``, met by this rank alone, kept to be raised on every rank of ``mesh`` (`Mesh.settle`); raised now
    without one."""
    if mesh is None:
        raise error
    return error


def _abandon(hooks, store, models: Transformers, branches: Branches) -> None:
    """A recording was garbage-collected without close(): its hooks go, a compiled transformer is
    compiled again, a guider gets its methods back, its run is flushed (its run.json then reads "stopped")."""
    for hook in hooks:
        hook.remove()
    models.restore()
    branches.restore()
    try:
        store.close(None)
    except StoreError:
        pass
