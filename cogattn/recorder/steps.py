"""Which denoising step is running, told by the transformer's own calls.

A recording registers a forward pre-hook on each transformer of the pipeline (Wan 2.2's two experts
take turns by step); every call passes through :meth:`StepTracker.observe`, which reads the latent
grid, the batch size and the timestep (as the model family's ``read_call`` says) and tells whether the
call starts the generation, continues it with the next step, is the step's second call (Wan's
unconditional call under guidance), or starts another generation. It asks the pipeline (when there is one)
for its guidance scale, its number of steps and its interrupt flag; a bare transformer tells none of them.
A forward hook after each call (:meth:`StepTracker.returned`) tells a block that runs outside the transformer's
forward: gradient checkpointing's recomputation during the backward pass, which is neither counted nor recorded.

A pipeline that makes a long video in windows (SkyReels-V2's diffusion forcing) runs a denoising loop per
window, its timesteps starting over: the family's ``window`` reader tells the call's next window from
another generation, and the steps are numbered on across windows, each step's window kept beside it.
"""

from __future__ import annotations

import weakref

import torch

from ..layout import TokenLayout
from ..models import ModelSpec
from ..models._call_frame import running_pipelines
from ..models.spec import StepTime
from .guiders import Branches

__all__ = ["StepTracker", "WeakHook"]


class WeakHook:
    """A forward hook (pre or post) calling a method of an object it holds weakly: an object dropped without
    cleaning up stops being called, instead of living on in the module's hooks."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, module, args, kwargs, *output):  # a forward hook's output: None where the forward raised
        method = self._method()
        if method is not None:
            method(module, args, kwargs, *output)


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
        self.windows: list[int] = []  # per step, the window of the pipeline call it belongs to
        self.window: int | None = None  # the window running (a window of another grid too, unrecorded)
        self.num_windows: int | None = None  # the windows of the pipeline call, `None` where it makes none
        self.off_grid: tuple | None = None  # the grid of a window of another grid: nothing from it is recorded
        self._window_start = 0  # the first step of the running window
        self._step_index: int | None = None  # the scheduler's step_index when the running step began
        self._schedule = None  # a weak reference to the scheduler's timesteps of the running loop (`_renewed`)
        self.told_steps: int | None = None  # the steps the pipeline said at the first call (`step_counts`)
        self.call = 0  # the call of the step now running: 0, or 1 for Wan's unconditional call
        self.layout: TokenLayout | None = None
        self.batch_size: int | None = None
        self.device: torch.device | None = None  # where the latents are (capture runs there)
        self._guidance: bool | None = None  # read once, at the first call (a family may walk the stack for it)
        self._guidance_read = False
        self._time: float | None = None  # the timestep of the last call, as read_call gave it (a StepTime too)
        self.spans: list[dict] | None = None  # per item of the running call, its text's parts (spec.text_spans)
        self.running = False  # a transformer's forward is running (see `returned`)
        self.training = False  # the running transformer is in training mode (`module.train()`)

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
        """Transformer calls each step makes: 2 for Wan under guidance (conditional, then unconditional), and under
        a modular pipeline's guider, which makes a call per branch (the conditional first) for every family."""
        guider = self.branches is not None and any(self.branches.guiders)
        return (2 if guider else self.spec.guidance_calls) if self.guidance else 1

    def read_window(self) -> tuple[int, int] | None:
        """``(index, count)`` of the window running in the pipeline's call, as the family's ``window`` reader
        tells it; `None` without a pipeline or a reader, or outside a windowed call."""
        if self.pipeline is None or self.spec.window is None:
            return None
        return self.spec.window(self.pipeline)

    def observe(self, module, expert: int, args: tuple, kwargs: dict) -> str:
        """Read one call of ``module`` (the pipeline's transformer number ``expert``): ``"first"`` (the
        generation starts; :attr:`layout`, :attr:`batch_size` and :attr:`device` are set), ``"next"`` (a
        later step, the first of the pipeline call's next window too; :attr:`timesteps` grows by one in both
        cases), ``"again"`` (the step's next call, as Wan's unconditional call under guidance),
        ``"reshaped"`` (the pipeline's generation goes on, at a later timestep or in its next window, with
        another latent grid or batch: nothing changes, and nothing after it is a step of this generation),
        or ``"another"`` (a new generation; nothing changes).
        A modular pipeline's guider (:class:`cogattn.recorder.guiders.Branches`) may add calls for which it perturbs
        the model (skip-layer guidance), and a pipeline its own (the family's ``extra_call``: LTX-2's spatio-temporal
        guidance): ``"extra"``, nothing changes and the call is not captured.
        Raises `RuntimeError` for another call at the timestep of the step before, which is not a
        denoising step of its own."""
        self.running, self.training = True, module.training
        self.left_out = self.branches.perturbed(module, expert) if self.branches else None
        if self.left_out is None and self.spec.extra_call is not None:  # a pipeline's own perturbed call (LTX-2)
            self.left_out = self.spec.extra_call(args, kwargs)
        if self.left_out is not None and self.timesteps:
            return "extra"
        layout, batch_size, time, device = self.spec.read_call(module.config, args, kwargs)
        self.spans = None if self.spec.text_spans is None else self.spec.text_spans(module.config, args, kwargs)
        t = float(time)
        window = self.read_window()
        if not self.timesteps:
            # another pipeline made from the recorded one's parts: its guidance and steps would be read wrong
            running = running_pipelines(module) if self.pipeline is not None else []
            if running and not any(p is self.pipeline for p in running):
                name = type(running[0]).__name__
                raise ValueError(
                    f"the transformer runs in a call of another pipeline ({name}) than the one recorded "
                    f"({type(self.pipeline).__name__}); record the pipeline you call: `cogattn.record(<your {name}>, ...)`."
                )
            self.layout, self.batch_size, self.device = layout, batch_size, device
            guided = self.branches.guided(expert) if self.branches else None
            self._guidance = self.spec.guidance_on(self.pipeline) if guided is None else guided
            self._guidance_read = True
            self.window, self.num_windows = window if window is not None else (0, None)
            self._schedule, self.told_steps = self._timesteps_ref(), self.step_counts()[0]
            self._append(t, expert, time)
            return "first"
        # A step's later call keeps the video and batch but may differ in its text (negative embeddings of another
        # length, Cosmos 3's unpadded negative prompt in the sequence); a new window or video differs in all of them.
        same_video = (layout.grid, batch_size) == (self.layout.grid, self.batch_size)
        same_call = same_video and layout.text_len == self.layout.text_len
        if window is not None and self.window is not None and window[0] > self.window:
            # the pipeline call's next window: a denoising loop of its own, its timesteps starting over
            self.window, self.call, self._time = window[0], 0, time
            if not same_call or self.off_grid:
                self.off_grid = self.off_grid or layout.grid
                return "reshaped"
            self._window_start, self._schedule = len(self.timesteps), self._timesteps_ref()
            self._append(t, expert, time)
            return "next"
        if self.off_grid and window is not None and window[0] == self.window:
            return "reshaped"  # a later call of the window of another grid
        if self._renewed() and (same_call or window is None):  # another pipeline call, whatever its timestep (a
            return "another"  # lower strength's) or size; a windowed call's next stage sets its own (Helios' pyramid)
        same_time = time.same_step(self._time) if isinstance(time, StepTime) else t == float(self._time)
        num_steps = self.pipeline_attr("num_timesteps")  # of the running window, in a windowed call
        # the scheduler stepped since this step began: a call at its timestep is the next step's (Heun's second
        # evaluation, UniPC's integer timesteps where they repeat), even after a step of one call (guidance off)
        stepped = self._scheduler_index() not in (None, self._step_index)
        if same_video and same_time and not stepped and self.call + 1 < self.calls_per_step:
            self.call += 1
            return "again"
        more_steps = num_steps is None or len(self.timesteps) - self._window_start < num_steps
        if not same_call and t < self.timesteps[-1] and more_steps and self.pipeline is not None:
            return "reshaped"  # the generation goes on with another video (ChronoEdit drops its reasoning frames)
        # a timestep above the last is another generation's where no schedule tells (a bare transformer); a pipeline's
        # own schedule may rise (custom timesteps or sigmas), its next call is told by the schedule set anew
        rises = t > self.timesteps[-1] and (self._schedule is None or self._schedule() is None)
        if not same_call or rises or not more_steps:
            return "another"
        if same_time and stepped:
            self._append(t, expert, time)
            return "next"
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
        self._append(t, expert, time)
        return "next"

    def returned(self) -> None:
        """A transformer's forward returned (or raised). Its blocks run again only outside one: gradient
        checkpointing recomputes each block's forward during the backward pass, which is neither a new call
        nor one to record again."""
        self.running = False

    def _timesteps(self) -> torch.Tensor | None:
        """The pipeline's scheduler's ``timesteps`` (a tensor each ``set_timesteps`` makes anew), `None` where there
        is none."""
        timesteps = getattr(self.pipeline_attr("scheduler"), "timesteps", None)
        return timesteps if isinstance(timesteps, torch.Tensor) else None

    def _timesteps_ref(self) -> weakref.ref | None:
        return None if (timesteps := self._timesteps()) is None else weakref.ref(timesteps)

    def _renewed(self) -> bool:
        """Whether the scheduler's timesteps were set again since the running loop began: another pipeline call,
        told at its first transformer call even where it starts at a lower timestep (video-to-video at a small
        strength) or at the timestep the last generation stopped at (one that failed at its first step)."""
        timesteps = self._timesteps()
        return self._schedule is not None and timesteps is not None and timesteps is not self._schedule()

    def _scheduler_index(self) -> int | None:
        """The pipeline's scheduler's ``step_index`` (how many of its steps have run; PNDM's ``counter``, whose
        timesteps repeat), `None` where it keeps neither."""
        scheduler = self.pipeline_attr("scheduler")
        index = getattr(scheduler, "step_index", None)
        index = getattr(scheduler, "counter", None) if index is None else index
        return index if isinstance(index, int) and not isinstance(index, bool) else None

    def _append(self, t: float, expert: int, time: float) -> None:
        """A step begins: its timestep, expert and window kept; its first call running."""
        self._step_index = self._scheduler_index()
        self.timesteps.append(t)
        self.experts.append(expert)
        self.windows.append(self.window)
        self.call, self._time = 0, time

    def forget(self) -> None:
        """Undo the first call (it was refused before any block ran)."""
        self.timesteps.clear()
        self.experts.clear()
        self.windows.clear()
        self.layout = self.batch_size = self.device = self._guidance = self._time = None
        self.window = self.num_windows = self.off_grid = None
        self._guidance_read, self._window_start, self._step_index, self._schedule = False, 0, None, None
        self.told_steps = None

    def step_counts(self) -> tuple[int | None, int | None]:
        """``(steps, at most)`` of the generation, told at its first call: the pipeline's ``num_timesteps``
        (`None` without a pipeline). A call made in windows runs a denoising loop per window, its steps
        numbered on across them: ``(None, the first window's times the windows)``, the first having the most
        (no overlap history is ready in it)."""
        num_steps = self.pipeline_attr("num_timesteps")
        if num_steps is None or (self.num_windows or 1) == 1:
            return num_steps, num_steps
        return None, num_steps * self.num_windows

    def went_on(self) -> str:
        """The warning for a generation that went on with another latent grid (``"reshaped"``)."""
        what, why = "another video", "ChronoEdit drops its temporal-reasoning frames part-way"
        if self.off_grid is not None:
            what = f"window {self.window} of {self.num_windows}, of the latent grid {self.off_grid},"
            why = "a long video's last window may hold fewer latent frames, a pyramid's next stage more pixels"
        return (
            f"the pipeline went on with {what} after {self.describe()} ({why}); the recording holds those steps, "
            "and later ones are not recorded."
        )

    def describe(self) -> str:
        """``"4 steps of a 2×(3, 3, 5) generation"``."""
        return f"{len(self.timesteps)} steps of a {self.batch_size}×{self.layout.grid} generation"
