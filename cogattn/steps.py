"""Which denoising step is running, told by the transformer's own calls.

A recording registers one forward pre-hook on each transformer of the pipeline (Wan 2.2's two experts
take turns by step); every call passes through :meth:`StepTracker.observe`, which reads the latent
grid, the batch size and the timestep (as the model family's ``read_call`` says) and tells whether the
call starts the generation, continues it with the next step, is the step's second call (Wan's
unconditional call under guidance), or starts another generation. It asks the pipeline (when there is one) for its guidance scale, its number of steps and
its interrupt flag; a bare transformer tells none of them.
"""

from __future__ import annotations

import weakref

import torch

from .guiders import Branches
from .layout import TokenLayout
from .models import ModelSpec
from .models.spec import StepTime

__all__ = ["StepTracker", "WeakHook"]


class WeakHook:
    """A forward pre-hook calling a method of an object it holds weakly: an object dropped without cleaning
    up stops being called, instead of living on in the module's hooks."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, module, args, kwargs):
        method = self._method()
        if method is not None:
            method(module, args, kwargs)


class StepTracker:
    """The steps of one generation.

    Args:
        spec (`ModelSpec`): the model family (how a call tells its layout, and how many calls a step makes).
        pipeline: the pipeline running it, or `None` for a bare transformer.
    """

    def __init__(self, spec: ModelSpec, pipeline=None, branches: Branches | None = None):
        self.spec, self.pipeline, self.branches = spec, pipeline, branches
        self.left_out: str | None = None  # the running call's branch, where a guider perturbs the model for it
        self.timesteps: list[float] = []
        self.experts: list[int] = []  # per step, which of the pipeline's transformers ran it
        self.call = 0  # the call of the step now running: 0, or 1 for Wan's unconditional call
        self.layout: TokenLayout | None = None
        self.batch_size: int | None = None
        self.device: torch.device | None = None  # where the latents are (capture runs there)
        self._guidance: bool | None = None  # read once, at the first call (a family may walk the stack for it)
        self._guidance_read = False
        self._time: float | None = None  # the timestep of the last call, as read_call gave it (a StepTime too)

    @property
    def step(self) -> int | None:
        """Index of the denoising step now running (or last run), `None` before the first."""
        return len(self.timesteps) - 1 if self.timesteps else None

    def pipeline_attr(self, name: str):
        """An attribute of the pipeline (``guidance_scale``, ``num_timesteps``, ``interrupt``), `None` when
        there is no pipeline or it has not set it yet."""
        try:
            return getattr(self.pipeline, name) if self.pipeline is not None else None
        except AttributeError:
            return None

    @property
    def guidance(self) -> bool | None:
        """Whether classifier-free guidance is on (as the family tells it at the generation's first call);
        `None` when no pipeline tells."""
        return self._guidance if self._guidance_read else self.spec.guidance_on(self.pipeline)

    @property
    def calls_per_step(self) -> int:
        """Transformer calls each step makes: 2 for Wan under guidance (conditional, then unconditional)."""
        return self.spec.guidance_calls if self.guidance else 1

    def observe(self, module, expert: int, args: tuple, kwargs: dict) -> str:
        """Read one call of ``module`` (the pipeline's transformer number ``expert``): ``"first"`` (the
        generation starts; :attr:`layout`, :attr:`batch_size` and :attr:`device` are set), ``"next"`` (a
        later step; :attr:`timesteps` grows by one in both cases), ``"again"`` (the step's next call, as
        Wan's unconditional call under guidance), ``"reshaped"`` (the pipeline's generation goes on, at a later
        timestep, with another latent grid or batch: nothing changes), or ``"another"`` (a new generation;
        nothing changes).
        A modular pipeline's guider (:class:`cogattn.guiders.Branches`) may add calls for which it perturbs
        the model (skip-layer guidance): ``"extra"``, nothing changes and the call is not captured.
        Raises `RuntimeError` for another call at the timestep of the step before, which is not a
        denoising step of its own."""
        self.left_out = self.branches.perturbed(module, expert) if self.branches else None
        if self.left_out is not None and self.timesteps:
            return "extra"
        layout, batch_size, time, device = self.spec.read_call(module.config, args, kwargs)
        t = float(time)
        if not self.timesteps:
            self.layout, self.batch_size, self.device = layout, batch_size, device
            guided = self.branches.guided(expert) if self.branches else None
            self._guidance = self.spec.guidance_on(self.pipeline) if guided is None else guided
            self._guidance_read = True
            self.timesteps.append(t)
            self.experts.append(expert)
            self.call, self._time = 0, time
            return "first"
        # The same video and batch (a step's calls may differ in their text: negative embeddings of another length)
        same_call = (layout.grid, layout.text_len, batch_size) == (
            self.layout.grid,
            self.layout.text_len,
            self.batch_size,
        )
        same_time = time.same_step(self._time) if isinstance(time, StepTime) else t == float(self._time)
        num_steps = self.pipeline_attr("num_timesteps")
        if same_call and same_time and self.call + 1 < self.calls_per_step:
            self.call += 1
            return "again"
        more_steps = num_steps is None or len(self.timesteps) < num_steps
        if not same_call and t < self.timesteps[-1] and more_steps and self.pipeline is not None:
            return "reshaped"  # the generation goes on with another video (ChronoEdit drops its reasoning frames)
        if not same_call or t > self.timesteps[-1] or not more_steps:
            return "another"
        if same_time:
            if self.spec.guidance_calls > 1 and self.pipeline is None:
                raise RuntimeError(
                    f"the transformer was called again at timestep {t:g} (step {self.step}): under guidance "
                    f"{self.spec.family}'s pipelines call it twice per step (conditional, then unconditional), "
                    "which only a recording of the pipeline knows; record the pipeline, `cogattn.record(pipe, ...)`."
                )
            raise RuntimeError(
                f"the transformer was called again at timestep {t:g} (step {self.step}); a recording counts "
                "one transformer call per denoising step. Batch such calls as the pipelines do "
                "([uncond..., cond...]), or use one recording per call."
            )
        self.timesteps.append(t)
        self.experts.append(expert)
        self.call, self._time = 0, time
        return "next"

    def forget(self) -> None:
        """Undo the first call (it was refused before any block ran)."""
        self.timesteps.clear()
        self.experts.clear()
        self.layout = self.batch_size = self.device = self._guidance = self._time = None
        self._guidance_read = False

    def describe(self) -> str:
        """``"4 steps of a 2×(3, 3, 5) generation"``."""
        return f"{len(self.timesteps)} steps of a {self.batch_size}×{self.layout.grid} generation"
