"""What a recording says of its generation, read-only: the plan and layout, the heads, items and slots of its results'
axes, the steps, spot checks and skips (:class:`Facts`, which :class:`cogattn.recorder.recording.Recording` is)."""

from __future__ import annotations

from ..exact.checks import SpotCheck
from ..exact.planner import CapturePlan
from ..layout import TokenLayout
from ..runs.skips import Skips

__all__ = ["Facts"]


class Facts:
    """The read-only facts of a :class:`~cogattn.recorder.recording.Recording` (its ``options``, and what its capture,
    step tracker and transformers learnt of the generation)."""

    mesh = property(
        lambda self: self._capture.mesh,
        doc="The context-parallel mesh (:class:`cogattn.recorder.mesh.Mesh`: ``ring``, ``ulysses``, ``rank``, ``writer``)"
        " from the generation's first call, `None` without one; only its ``writer`` (rank 0) holds the results.",
    )

    @property
    def skipped(self) -> Skips:
        """The selected ``(step, layer, role)`` whose attention did not run (a cache reused an earlier output), and
        the cache (:class:`cogattn.runs.skips.Skips`); a step's known when the next starts, the last's at close."""
        return self._capture.skips

    @property
    def layout(self) -> TokenLayout | None:
        """Token layout of the generation, `None` before its first transformer call."""
        return None if self.plan is None else self.plan.layout

    info = property(lambda self: self.options.info, doc="Facts kept with the maps (``info=``).")

    @property
    def source_heads(self) -> dict[str, tuple[int, ...] | None]:
        """Source → the model head of each slot of the head axis of its attention's kinds (``"self"``: :attr:`head_ids`;
        LTX-2's audio sources: the audio heads); `None` each when heads were averaged. :meth:`head_ids_of`: a kind's."""
        heads, sources = self.options.heads, ["self", *self._sources.values()]
        own = {s: heads if isinstance(heads, tuple) else tuple(range(self._shape.heads_of(s))) for s in sources}
        return dict.fromkeys(own) if heads == "mean" else own

    head_ids = property(lambda self: self.source_heads["self"], doc="The self-attention's :attr:`source_heads`.")

    def head_ids_of(self, kind: str) -> tuple[int, ...] | None:
        """The model head of each slot of ``kind``'s head axis: its attention's (:attr:`source_heads`)."""
        return self.source_heads.get(self._sources.get(kind), self.head_ids)

    block_size = property(lambda self: self.options.block_size, doc="Tokens per block of the ``block`` kind.")
    topk = property(lambda self: self.options.topk, doc="How many of each row's largest probabilities ``topk`` keeps.")
    tile_shape = property(lambda self: self.options.tile_shape, doc="Latent frames × patch rows × columns of a tile.")
    queries = property(lambda self: tuple(self.options.queries or ()), doc="The ``query`` kind's queries as given.")
    batch_items = property(  # a CapturePlan is truthy
        lambda self: self.plan and self.plan.resolved.batch,
        doc="Transformer batch items of the results' batch axis, `None` before the first transformer call.",
    )
    batch_roles = property(
        lambda self: self.plan and self.plan.resolved.roles,
        doc="""Per slot of the results' batch axis, ``"cond"`` (the prompt's item) or ``"uncond"`` (the negative
        prompt's) under classifier-free guidance, `None` without it; `None` before the first transformer call.""",
    )

    chosen_methods = property(
        lambda self: dict(self._capture.kernel.chosen),
        doc='``method="auto"`` on CUDA, per shape: ``"triton"``, ``"sdpa"`` (failed to run) or ``"rows"`` (failed a check).',
    )

    # -- step tracking -----------------------------------------------------------------------------
    timesteps = property(lambda self: self._steps.timesteps, doc="Timestep value of each step so far.")
    step = property(lambda self: self._steps.step, doc="The step now running (or last run), `None` before the first.")

    family = property(lambda self: self._spec.family, doc='The model family: ``"cogvideox"``, ``"wan"``, ...')

    @property
    def experts(self) -> list[str]:
        """Per step, the pipeline attribute of the transformer that ran it (``"transformer"``, or Wan 2.2's
        low-noise ``"transformer_2"``); each step's layers are that transformer's blocks."""
        return [self._models.names[i] for i in self._steps.experts]

    @property
    def windows(self) -> list[int]:
        """Per step, its window of the pipeline call: 0 but in a long video made in windows (SkyReels-V2)."""
        return list(self._steps.windows)

    @property
    def plan(self) -> CapturePlan | None:
        """The capture plan, made at the generation's first transformer call (`None` before)."""
        return self._capture.plan

    @property
    def text_lengths(self) -> tuple[int, ...] | None:
        """Per slot of the results' batch axis, its valid text tokens where a key mask keeps fewer than T, the text
        of the sequence or of the cross-attention (LTX-Video's, where a mask is given: every slot's); `None`: all."""
        return self._capture.per_slot(self._capture.text_lengths, self.layout and self.layout.prompt_len)

    query_lengths = property(
        lambda self: self._capture.per_slot(self._capture.query_lengths, self.layout and self.layout.seq_len),
        doc="Per slot of the batch axis, the query rows the model forms where it forms fewer than S (`None`: all).",
    )

    @property
    def text_spans(self) -> tuple[dict[str, tuple[int, int]], ...] | None:
        """Per slot of the results' batch axis, its text's parts where they differ per item (HunyuanVideo 1.5)."""
        return self._capture.per_slot(self._capture.text_spans, self.layout and self.layout.spans())

    @property
    def checks(self) -> list[SpotCheck]:
        """The spot checks made so far (:mod:`cogattn.exact.checks`): step, layer, method, device, dtype, rows,
        largest error against exact rows, tolerance, passed."""
        return self._capture.checks
