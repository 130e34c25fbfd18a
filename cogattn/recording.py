"""Recording: follows a generation step by step and keeps the maps the options ask for.

``record(pipe, ...)`` is the one-line entry point: it builds a :class:`Recording`, installs cogattn's
processors on every attention layer, and on exit (also on an exception or KeyboardInterrupt) puts the
original processors back and removes its hook. A forward pre-hook on the transformer (no patching of
pipeline or block classes) tells the recording the step index, timestep, batch size and latent grid;
the processors hand it q and k of the captured layer calls (:class:`cogattn.processor.MapSink`).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from . import engine
from .attention import attention_joint_for, attention_with_lse
from .checks import SpotCheck, Verifier, probe_rows
from .layout import TokenLayout
from .models import EagerWhileRecording, find_transformer
from .options import CaptureOptions
from .planner import CapturePlan, ModelShape, TilePlan, plan_capture, plan_tiles
from .steps import StepTracker, WeakHook
from .store import MemoryStore, RunWriter, StoreError

__all__ = ["Recording", "record"]


class Recording:
    """Attention maps of one generation, keyed by ``(kind, step, layer)``.

    Building a recording checks the options against the model and registers its forward pre-hook; it
    installs no processors (see :func:`record`, or set :class:`CogVideoXAttnMapProcessor` yourself).
    Use it as a context manager or call :meth:`close`.

    Args:
        target: a CogVideoX pipeline (text-to-video or image-to-video) or a ``CogVideoXTransformer3DModel``.
        options (`CaptureOptions | None`): the options; keyword arguments (any field of
            :class:`CaptureOptions`) are applied on top.
    """

    def __init__(self, target, options: CaptureOptions | None = None, **kwargs):
        self.options = CaptureOptions.build(options, **kwargs)
        self.transformer, self.pipeline, self._spec = find_transformer(target)
        self._modules = self._spec.attention_modules(self.transformer)
        self._layer_of = {id(m): i for i, m in enumerate(self._modules)}
        heads = self._modules[0].heads
        self._shape = ModelShape(len(self._modules), heads, self._modules[0].inner_dim // heads, self.transformer.dtype)
        self.options.check_model(len(self._modules), heads)
        if self.options.batch in ("cond", "uncond") and self.pipeline is None:
            raise ValueError(
                f"batch={self.options.batch!r} needs a pipeline to know whether classifier-free guidance "
                "is on; with a bare transformer pass batch indices (under guidance the batch is "
                "[uncond..., cond...])."
            )
        self._steps = StepTracker(self.transformer, self.pipeline)
        self.plan: CapturePlan | None = None  # made at the first transformer call
        self._joint_indicator: torch.Tensor | None = None
        self._tiles: dict[tuple, TilePlan] = {}  # per (S, D, device type, copies, method) of the calls seen
        self._timed = engine.TimedChoice()
        self._verifier = Verifier(self.options.verify)
        self._originals: dict | None = None
        self._closed = False
        self._entered = False  # used as a context manager: a second generation raises instead of closing
        self._status = "running"
        if self.options.save_dir is None:
            self._store: MemoryStore | RunWriter = MemoryStore()
        else:
            self._store = RunWriter.create(
                self.options.save_dir, self.options.overwrite, self.options.storage_dtype, self._meta()
            )
        # The hook holds the recording weakly: a recording dropped without close() stops capturing and
        # its hook goes away with it, instead of outliving it in the transformer.
        self._hook = self.transformer.register_forward_pre_hook(WeakHook(self._on_forward), with_kwargs=True)
        self._eager = EagerWhileRecording(self.pipeline, self.transformer)
        self._finalizer = weakref.finalize(self, _abandon, self._hook, self._store, self._eager)

    # -- reading (the interface `cogattn.store.MapSource` shares with a loaded run) ----------------
    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """The float32 CPU result of ``kind`` at denoising step ``step`` and block ``layer`` (read back
        from disk when recording to ``save_dir``); `NotRecordedError` if there is none."""
        return self._store.get(kind, step, layer)

    def keys(self) -> list[tuple[str, int, int]]:
        """Every recorded ``(kind, step, layer)``, sorted."""
        return self._store.keys()

    def __contains__(self, key) -> bool:
        return key in self.keys()

    @property
    def layout(self) -> TokenLayout | None:
        """Token layout of the generation, `None` before its first transformer call."""
        return None if self.plan is None else self.plan.layout

    @property
    def info(self) -> dict:
        return self.options.info

    @property
    def head_ids(self) -> tuple[int, ...] | None:
        """The model head of each slot of the results' head axis; `None` when heads were averaged."""
        heads = self.options.heads
        return None if heads == "mean" else tuple(range(self._shape.num_heads)) if heads == "all" else heads

    block_size = property(lambda self: self.options.block_size, doc="Tokens per block of the ``block`` kind.")
    topk = property(lambda self: self.options.topk, doc="How many of each row's largest probabilities ``topk`` keeps.")

    @property
    def queries(self) -> tuple:
        """The ``query`` kind's queries as given: token indices or ``(frame, row, col)``."""
        return self.options.queries or ()

    @property
    def batch_items(self) -> tuple[int, ...] | None:
        """Transformer batch items of the results' batch axis, `None` before the first transformer call."""
        return None if self.plan is None else self.plan.resolved.batch

    @property
    def chosen_methods(self) -> dict[tuple, str]:
        """What ``method="auto"`` measured on CUDA with Triton: shape → ``"sdpa"`` or ``"triton"``."""
        return dict(self._timed.chosen)

    # -- step tracking -----------------------------------------------------------------------------
    @property
    def timesteps(self) -> list[float]:
        """Timestep value of each step so far."""
        return self._steps.timesteps

    @property
    def step(self) -> int | None:
        """Index of the denoising step now running (or last run), `None` before the first."""
        return self._steps.step

    def _on_forward(self, module, args, kwargs):
        seen = self._steps.observe(args, kwargs)
        if seen == "first":
            try:
                self._start(self._steps.layout, self._steps.batch_size, self._steps.device)
            except BaseException:
                self._steps.forget()  # refused before any block ran: as if the call never happened
                raise
        elif seen == "another":
            self._second_generation()

    def _second_generation(self) -> None:
        """A new generation began: one recording holds one generation, so it never mixes them. Inside a
        ``with`` block that is an error; a recording left open is finished and closed, with a warning,
        and the new generation runs as if cogattn were not there."""
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
        num_steps = self._steps.pipeline_attr("num_timesteps")
        self.plan = plan_capture(
            self.options,
            self._shape,
            layout,
            batch_size=batch_size,
            guidance=self._steps.guidance,
            num_steps=num_steps,
            device=device,
        )
        if self.options.layer_output == "joint":
            indicator = engine.multi_key_indicator(self.plan.reducers, layout.seq_len, device)
            # with no multi-key kinds there is nothing to widen the values with: the lse alone is reused
            self._joint_indicator = indicator if indicator.shape[1] else None
        if isinstance(self._store, RunWriter):
            self._store.check_space([(b, n) for _, _, b, n in self.plan.records(num_steps)])
            self._store.write_meta(self._meta())

    def _meta(self) -> dict:
        """What run.json says about this recording."""
        import diffusers

        from . import __version__

        res = None if self.plan is None else self.plan.resolved
        return {
            "status": self._status,
            "complete": self._status == "finished",
            "steps": len(self.timesteps),
            "layout": None if self.layout is None else dataclasses.asdict(self.layout),
            "timesteps": self.timesteps,
            "selection": {
                **self.options.selection_meta(),
                "batch_resolved": res and list(res.batch),
                "heads_resolved": res and list(res.heads),
            },
            "model": {
                "class": type(self.transformer).__name__,
                "config": dict(self.transformer.config),
                "dtype": str(self.transformer.dtype).removeprefix("torch."),
                "pipeline": None if self.pipeline is None else type(self.pipeline).__name__,
            },
            "layer_output": self.options.layer_output,
            "storage_dtype": self.options.storage_dtype,
            "info": self.options.info,
            "checks": [c.asdict() for c in self._verifier.checks],
            "versions": {"cogattn": __version__, "diffusers": diffusers.__version__, "torch": torch.__version__},
        }

    # -- called by the processors (cogattn.processor.MapSink) ---------------------------------------
    def layer_to_capture(self, attn) -> int | None:
        """Block index of ``attn`` when the current step and its layer are selected, else `None`."""
        try:
            layer = self._layer_of[id(attn)]
        except KeyError:
            raise ValueError("this processor serves an attention module outside the recorded transformer") from None
        wanted = not self._closed and self.plan is not None and self.step is not None
        wanted = wanted and self.options.wants_layer(layer) and self.options.wants_step(self.step)
        return layer if wanted else None

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The output call of a captured layer: `None` for the stock call, else ``(output, lse, sums)``.

        ``layer_output="lse"``: the flash kernel, which also returns the lse. ``"joint"``: one widened
        fused call for the captured batch items (:func:`cogattn.attention.attention_joint`), the stock
        call for the others. Spot-checked against the stock call on a few rows (:mod:`cogattn.checks`)."""
        mode = self.options.layer_output
        shape = (str(query.device), query.dtype, mode, tuple(query.shape[1:]))
        if mode == "stock" or shape in self._verifier.stock_output:
            return None
        if mode == "lse" or self._joint_indicator is None:  # no multi-key kinds: the lse alone is reused
            result = (*attention_with_lse(query, key, value), None)
        else:
            indicator = self._joint_indicator.to(query.device)
            result = attention_joint_for(query, key, value, indicator, self.plan.resolved.batch)
        if self._verifier.due(("output", *shape)):
            check = self._verifier.check_output(
                result[0], query, key, value, probe_rows(self.layout), self.step, layer, mode
            )
            if not check.passed:
                self._verifier.output_failed(check, shape)
                return None
        return result

    def capture(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        lse: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
    ) -> None:
        """Compute every selected kind for ``layer`` at the current step from ``query``, ``key``
        ``(B, H, S, D)`` (and the output call's log-sum-exp ``(B, H, S)`` and multi-key sums
        ``(B, H, S, C)`` when it gave them); spot-check the method that served them."""
        res, reducers = self.plan.resolved, self.plan.reducers
        B, H, S, D = query.shape
        if S != res.layout.seq_len:
            raise RuntimeError(f"sequence length {S} does not match the latent grid {res.layout} of this step")
        # The engine copies q and k per head chunk unless they already are contiguous float32 with every head.
        all_heads = res.heads == tuple(range(H))  # every head, in the model's order: no gather needed
        copies = query.dtype != torch.float32 or not all_heads or not query[0].is_contiguous()
        shape = (str(query.device), query.dtype, S, len(res.heads), D)
        method = "rows" if shape in self._verifier.rows_only else self.plan.tiles.method
        if method == "joint" and lse is None:  # the output call fell back to the stock one
            method = "auto"
        tiles = self._tiles_for(S, len(res.heads), D, query.device, copies, method, lse is not None)
        heads = None if all_heads else torch.tensor(res.heads, device=query.device)
        checked = tiles.method != "rows" and self._verifier.due((*shape[:2], tiles.method, shape[2:]))
        rows = probe_rows(res.layout) if checked else None
        args = (query, key, res.batch, reducers)
        outs, used, probes = engine.capture_items(*args, tiles, heads, lse, sums, self._timed, rows)
        if probes:
            what = used if lse is None or used == "joint" else f"{used}, lse of the output call"
            check = self._verifier.check_maps(probes, query, key, heads, reducers, self.step, layer, what, D**-0.5)
            if not check.passed:  # nothing wrong is stored: this call again, and later ones, on row tiles
                self._verifier.maps_failed(check, shape)
                rows_tiles = self._tiles_for(S, len(res.heads), D, query.device, copies, "rows")
                outs, _, _ = engine.capture_items(*args, rows_tiles, heads)
        for red, out in zip(reducers, outs):
            self._store.put(red.kind, self.step, layer, self.timesteps[-1], out)

    @property
    def checks(self) -> list[SpotCheck]:
        """The spot checks made so far (:mod:`cogattn.checks`): step, layer, method, device, dtype, rows,
        largest error against exact rows, tolerance, passed."""
        return list(self._verifier.checks)

    def _tiles_for(self, S: int, H: int, D: int, device, copies: bool, method: str, lse: bool = False) -> TilePlan:
        key = (S, D, torch.device(device).type, copies, method, lse)
        if key not in self._tiles:
            budget = self.options.memory_budget
            self._tiles[key] = plan_tiles(self.plan.reducers, S, H, D, budget, method, device, copies, lse)
        return self._tiles[key]

    # -- processors and cleanup --------------------------------------------------------------------
    def install_processors(self) -> None:
        """Replace the stock CogVideoX processors of every layer; :meth:`close` restores them."""
        current = self.transformer.attn_processors
        replacement = self._spec.map_processors(current, len(self._modules), self)
        self._originals = current
        self.transformer.set_attn_processor({**current, **replacement})

    @property
    def status(self) -> str:
        """``"running"`` until closed; then how the generation ended: ``"finished"``, ``"interrupted"``
        (the pipeline's interrupt flag, Ctrl-C) or ``"failed"`` (an exception)."""
        return self._status

    def close(self, status: str | None = None) -> None:
        """Remove the hook, restore the original processors, and finish writing (idempotent).

        Args:
            status (`str | None`): how the generation ended (``"failed"``, ``"interrupted"``); by default
                ``"finished"``, or ``"interrupted"`` when the pipeline's interrupt flag is set.

        Raises `StoreError` if a record or the metadata could not be written; the committed records stay
        readable."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._hook.remove()
        self._eager.restore()
        if self._originals is not None:
            self.transformer.set_attn_processor(self._originals)
            self._originals = None
        if status is None:
            status = "interrupted" if self._steps.pipeline_attr("interrupt") else "finished"
        self._status = status
        try:
            self._store.close(self._meta())
        finally:
            if isinstance(self._store, RunWriter) and self._store.committed == 0 and self._status != "finished":
                self._store.discard()  # nothing was captured (refused at the first step, say)
        self._warn_missing()
        steps = self.options.steps
        if self._status == "finished" and steps != "all" and max(steps) >= len(self.timesteps):
            missing = [s for s in steps if s >= len(self.timesteps)]
            warnings.warn(
                f"steps {missing} were selected but the generation ran {len(self.timesteps)} steps.", stacklevel=3
            )

    def _warn_missing(self) -> None:
        """Layers a cache (PAB, FasterCache, FirstBlockCache, ...) skipped produce no record: say so."""
        if self.plan is None or self._status != "finished":
            return
        opts = self.options
        steps = sum(1 for s in range(len(self.timesteps)) if opts.wants_step(s))
        expected = self.plan.layers_captured * steps * len(opts.kinds)
        have = len(self.keys()) if isinstance(self._store, MemoryStore) else self._store.committed
        if have < expected:
            warnings.warn(
                f"{expected - have} of {expected} selected records were not produced (attention skipped by a cache).",
                stacklevel=4,
            )

    def __enter__(self) -> Recording:
        if self._closed:
            raise RuntimeError("this recording is closed; start a new one with `cogattn.record(...)`.")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        status = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"
        try:  # an exception is on its way out: finish what can be finished, and never mask it
            self.close(status)
        except StoreError as err:
            warnings.warn(f"closing the recording after {exc_type.__name__} also failed: {err}", stacklevel=2)

    def __repr__(self) -> str:
        kinds, steps, records = list(self.options.kinds), len(self.timesteps), len(self.keys())
        return f"Recording(kinds={kinds}, steps={steps}, records={records}, {self._status}, layout={self.layout})"


def record(target, options: CaptureOptions | None = None, **kwargs) -> Recording:
    """Record exact attention maps of a CogVideoX pipeline or transformer while it runs.

    ```python
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond") as rec:
        pipe(prompt_embeds=..., num_inference_steps=4)
    rec.get("frame", step=0, layer=1)  # (B, H, G, G) float32 on CPU
    ```

    Args:
        target: a CogVideoX pipeline (text-to-video or image-to-video) or a ``CogVideoXTransformer3DModel``.
        options (`CaptureOptions | None`): the options as one object; keyword arguments (any field of
            :class:`cogattn.CaptureOptions`, which documents each) are applied on top.

    Returns:
        `Recording`: a context manager; on exit the original processors are back and the hook is gone.
    """
    rec = Recording(target, options, **kwargs)
    try:
        rec.install_processors()
    except BaseException:
        rec.close()
        raise
    return rec


def _abandon(hook, store, eager: EagerWhileRecording) -> None:
    """A recording was garbage-collected without close(): its hook goes, a compiled transformer is
    compiled again, its run is flushed (its run.json then reads "stopped")."""
    hook.remove()
    eager.restore()
    try:
        store.close(None)
    except StoreError:
        pass
