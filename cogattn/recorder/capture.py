"""What a captured attention call does: the :class:`cogattn.recorder.processor.MapSink` side of a recording.

:class:`Capture` is the object a :class:`cogattn.Recording` holds for its processors' calls (the recording
hands them on): whether a call is captured, the opt-in output call, and the capture of a self-attention
(:func:`cogattn.exact.engine.capture_items`, spot-checked) or a cross-attention
(:func:`cogattn.exact.context.context_pass`) into the store. It owns what these calls need: the plan once the
recording has made it, the tile plans, the measured method choices, the spot checks, and the parts of a
result that wait for a step's second call; it reads the step tracker and the transformers it is given.

Capture stays out of autograd, so a training forward records as an inference one does and its gradients are
stock's: its passes run under ``torch.no_grad()``, a captured call's output is the stock call's wherever its
inputs require grad, and a block that runs outside the transformer's forward (gradient checkpointing recomputes
it during the backward pass) is not captured again.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import StoreError
from ..exact import engine, passes
from ..exact.attention import attention_joint_for, attention_with_lse
from ..exact.checks import Verifier, probe_rows
from ..exact.context import context_pass
from ..exact.planner import CapturePlan, TilePlan, plan_tiles
from ..runs.skips import Skips
from .mesh import Mesh, no_context_heads, no_heads
from .processor import kept_count

__all__ = ["Capture"]


class Capture:
    """The processors' side of a recording (docs/design.md, "Data flow").

    Args:
        options (`CaptureOptions`): the recording's options.
        steps (`StepTracker`): which step and call is running.
        roles (`dict[int, tuple[int, str]]`): ``id(module)`` → ``(layer, "self" or "context")``.
        store: where results go (a ``MemoryStore`` or ``RunWriter``; the recording sets it once made).
    """

    def __init__(self, options, steps, roles: dict, store=None):
        self.options, self.steps, self.roles, self.store = options, steps, roles, store
        self.plan: CapturePlan | None = None  # set by the recording at the generation's first call
        self.layer_layouts: dict = {}  # layer → its own TokenLayout, where it is not the generation's
        self.layer_plans: dict[int, CapturePlan | None] = {}  # the plan of such a layer (None: no kind selected)
        self.closed = False
        self.stopped = False  # the generation went on with another video: later calls are not captured
        self.joint_indicator: torch.Tensor | None = None
        self.tiles: dict[tuple, TilePlan] = {}  # per (S, D, device type, copies, method, lse) of the calls seen
        self.kernel = engine.KernelChoice()
        self.mesh: Mesh | None = None  # the context-parallel mesh, found at the generation's first call
        self.latched: Exception | None = (
            None  # under a mesh, a rank's capture or store error until every rank raises it
        )
        self.verifier = Verifier(options.verify)
        self.pending: dict[tuple, list] = {}  # (kind, layer) → [step, (slots, part)...] across a step's calls
        self.text_lengths: dict[int, int] = {}  # result slot → its valid text tokens, where a mask says
        self.query_lengths: dict[int, int] = {}  # result slot → the query rows the model forms, where it forms fewer
        self.text_spans: dict[int, dict] = {}  # result slot → its text's parts, where the family packs them per item
        self.skips = Skips()  # selected attention calls that did not run (a cache skipped them)
        self.stats: dict[tuple[int, int, str], dict[int, list[float]]] = {}  # (step, layer, name) → slot → per head
        self._stored: set[tuple[int, int, str]] = set()  # (step, layer, role) of the records of the running step

    @property
    def step(self) -> int | None:
        return self.steps.step

    def plan_of(self, layer: int) -> CapturePlan | None:
        """The plan of ``layer``: the generation's, or that of the layer's own layout (:mod:`.exact.layer_plans`)."""
        return self.layer_plans.get(layer, self.plan)

    def layout_of(self, layer: int):
        """The token layout of ``layer``'s attention (`None` before the plan)."""
        return None if self.plan is None else self.layer_layouts.get(layer, self.plan.layout)

    # -- called by the processors (cogattn.recorder.processor.MapSink) ---------------------------------------
    def layer_to_capture(self, attn) -> int | None:
        """Block index of ``attn`` when the current step, its layer, a kind of its attention (self or
        cross) and an item of the current call are selected, else `None`."""
        try:
            layer, role = self.roles[id(attn)]
        except KeyError:
            raise ValueError("this processor serves an attention module outside the recorded transformer") from None
        plan = self.plan_of(layer)
        wanted = not self.closed and not self.stopped and plan is not None and self.step is not None
        wanted = wanted and self.steps.running  # not a block's recomputation in the backward pass
        wanted = wanted and self.steps.left_out is None  # a guider's perturbed call: not the model's maps
        wanted = wanted and self.options.wants_layer(layer) and self.options.wants_step(self.step)
        wanted = wanted and bool(plan.reducers if role == "self" else plan.context)
        return layer if wanted and self._call_items()[0] else None

    def per_slot(self, values: dict[int, object], default) -> tuple | None:
        """``values`` per slot of the results' batch axis, ``default`` for a slot without one; `None` where there are
        none (or before the plan)."""
        if not values or self.plan is None:
            return None
        return tuple(values.get(i, default) for i in range(len(self.plan.resolved.batch)))

    def _call_items(self, batch_size: int | None = None) -> tuple[list[int], list[int]]:
        """The selected items of the current call, as indices of its batch and as slots of the results'
        batch axis. The results' batch is the guidance batch ``[uncond..., cond...]``; a family whose
        pipelines make one call per half (Wan: the conditional call first) gives each call its half.
        ``batch_size``: the batch the attention got, where it may be the conditional half of the call's
        (FasterCache skips the unconditional half of a ``[uncond, cond]`` batch at some steps)."""
        B, calls = self.steps.batch_size, self.steps.calls_per_step
        offset = B * (calls - 1 - self.steps.call)
        slots = [i for i, b in enumerate(self.plan.resolved.batch) if offset <= b < offset + B]
        items = [self.plan.resolved.batch[i] - offset for i in slots]
        if batch_size is None or batch_size == B:
            return items, slots
        if calls == 1 and (self.steps.guidance or self.skips.by == "FasterCache") and 2 * batch_size == B:
            self.skips.halves.add(self.step)
            kept = [(b - batch_size, s) for b, s in zip(items, slots) if b >= batch_size]
            return [b for b, _ in kept], [s for _, s in kept]
        raise RuntimeError(
            f"an attention layer got a batch of {batch_size} in a transformer call of batch {B}; cogattn follows "
            "the pipeline's batch, or its conditional half under guidance (FasterCache), and nothing else."
        )

    def _whole(self, batch_size: int) -> tuple[list[int], list[int]] | None:
        """The call's items and slots for an attention of batch ``batch_size``, `None` where some selected
        item is not in it (the conditional half of a one-call step, and an unconditional item selected):
        nothing is captured, and :meth:`end_step` lists the layer as skipped."""
        items, slots = self._call_items(batch_size)
        if self.steps.calls_per_step == 1 and len(slots) < len(self.plan.resolved.batch):
            return None
        return items, slots

    def _put(self, kind: str, layer: int, out: torch.Tensor, slots: list[int], role: str) -> None:
        """Store ``out`` (the items ``slots`` of a result of the ``role`` attention); a result split over a
        step's calls when whole. Until then the parts wait in host memory, each its own size (Wan runs every
        block for one call before the next call starts; :attr:`CapturePlan.waiting_bytes` counts them)."""
        n = len(self.plan.resolved.batch)
        if len(slots) == n:
            self._store(kind, layer, out, role)
            return
        key = (kind, layer)
        if key not in self.pending or self.pending[key][0] != self.step:
            self.pending[key] = [self.step]
        (parts := self.pending[key]).append((slots, out.cpu()))
        if sum(len(s) for s, _ in parts[1:]) == n:
            del self.pending[key]
            whole = torch.empty((n, *out.shape[1:]), dtype=out.dtype)
            for s, part in parts[1:]:
                whole[s] = part
            del parts
            self._store(kind, layer, whole, role)

    def _store(self, kind: str, layer: int, out: torch.Tensor, role: str) -> None:
        """``store.put``; under a mesh its `StoreError` is kept and raised on every rank at once (`Mesh.settle`)."""
        try:
            self.store.put(kind, self.step, layer, self.steps.timesteps[-1], out)
        except StoreError as err:
            if self.mesh is None:
                raise
            self.latched = self.latched or err
            return
        self._stored.add((self.step, layer, role))

    def end_step(self, step: int) -> None:
        """After ``step``: list the selected ``(layer, role)`` that stored no record (a cache skipped the
        attention, in a call that holds selected items) in :attr:`skips`, and drop parts of results that
        wait for a call that never came."""
        context = {r.kind for r in self.plan.context} if self.plan is not None else set()
        for kind, layer in [key for key, parts in self.pending.items() if parts[0] == step]:
            del self.pending[(kind, layer)]  # another of the step's calls skipped it
            self.skips.partial.add((step, layer, "context" if kind in context else "self"))
        elsewhere = self.mesh is not None and not self.mesh.writer  # a rank that stores nothing: rank 0's are the run's
        if self.plan is None or self.stopped or not self.options.wants_step(step) or elsewhere:
            return
        for layer, role in set(self.roles.values()):
            plan = self.plan_of(layer)
            if (
                plan is not None
                and bool(plan.reducers if role == "self" else plan.context)
                and self.options.wants_layer(layer)
                and (step, layer, role) not in self._stored
            ):
                self.skips.calls.add((step, layer, role))
        self._stored = {key for key in self._stored if key[0] != step}

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The output call of a captured layer: `None` for the stock call, else ``(output, lse, sums)``.

        ``layer_output="lse"``: the flash kernel, which also returns the lse. ``"joint"``: one widened
        fused call for the captured batch items (:func:`cogattn.exact.attention.attention_joint`), the stock
        call for the others. Spot-checked against the stock call on a few rows (:mod:`cogattn.exact.checks`)."""
        mode = self.options.layer_output
        shape = (str(query.device), query.dtype, mode, tuple(query.shape[1:]))
        if mode == "stock" or shape in self.verifier.stock_output or query.shape[0] != self.steps.batch_size:
            return None  # the stock call; also for a batch's conditional half (FasterCache)
        if self.steps.training or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))):
            return None  # the stock call, whose backward gives stock gradients (and reentrant checkpointing's no-grad
            # forward keeps its values, which the backward's recomputation does not redo: it must be stock's)
        if mode == "lse" or self.joint_indicator is None:  # no multi-key kinds: the lse alone is reused
            result = (*attention_with_lse(query, key, value), None)
        else:
            indicator = self.joint_indicator.to(query.device)
            result = attention_joint_for(query, key, value, indicator, self._call_items()[0])
        if self.verifier.due(("output", *shape)):
            check = self.verifier.check_output(
                result[0], query, key, value, probe_rows(self.layout_of(layer)), self.step, layer, mode
            )
            if not check.passed:
                self.verifier.output_failed(check, shape)
                return None
        return result

    @torch.no_grad()
    def capture(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        lse: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
        key_counts: torch.Tensor | None = None,
        query_counts: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> None:
        """Compute every selected kind for ``layer`` at the current step from ``query``, ``key``
        ``(B, H, S, D)`` (and the output call's log-sum-exp ``(B, H, S)`` and multi-key sums
        ``(B, H, S, C)`` when it gave them); spot-check the method that served them. ``key_counts``
        ``(B,)``: a key mask keeping each item's first keys (padded text at the end), their number;
        ``query_counts`` ``(B,)``: where the model forms only each item's first query rows (Mochi), their
        number; ``mask`` ``(B or 1, S, S)``: any other mask (``processor.query_key_mask``), or an additive one
        (``processor.QueryKeyBias``), which row tiles apply, whatever the method; ``value`` ``(B, H, S, D)``: the values, for the kinds that need them."""
        plan = self.plan_of(layer)
        res, reducers = plan.resolved, plan.reducers
        if value is None and self.wants_value:
            raise RuntimeError("pattern_error needs the attention's values; this family's processor hands over none.")
        if (whole := self._whole(query.shape[0])) is None:
            return
        items, slots = whole
        if self.mesh is not None:
            self._sharded(plan, layer, query, key, value, key_counts, query_counts, mask, items, slots)
            return
        args = (lse, sums, key_counts, query_counts, mask, value, items, slots)
        outs = self._outs(plan, layer, query, key, reducers, res.heads, *args)
        for red, out in zip(reducers, outs):
            self._put(red.kind, layer, out, slots, "self")

    def _sharded(self, plan, layer, query, key, value, key_counts, query_counts, mask, items, slots) -> None:
        """:meth:`capture` under context parallelism (:mod:`cogattn.recorder.mesh`): this rank's part of the heads
        over every token, its kinds by the engine, put together on rank 0 (kinds of the head-mean row: all heads
        on rank 0)."""
        res, mesh, S = plan.resolved, self.mesh, plan.resolved.layout.seq_len
        if mask is not None:
            raise RuntimeError("a query-key mask under context parallelism: cogattn cannot put its split together.")
        for whole in (False, True):
            group = [r for r in plan.reducers if r.mean_rows == whole]
            if not group:
                continue
            parts = mesh.parts(res.heads, whole)
            q, k = mesh.exchange(query, parts, S), mesh.exchange(key, parts, S)
            v = None if value is None or not self.wants_value else mesh.exchange(value, parts, S)
            h = len(parts[mesh.rank])
            local = [mesh.local(r, h) for r in group]
            args = (tuple(range(h)), None, None, key_counts, query_counts, None, v, items, slots)
            compute = self._outs if h else no_heads  # a rank of no heads sends zeros: it takes part all the same
            outs, failed = mesh.guarded(q.device, compute, plan, layer, q, k, local, *args)
            if outs is None:  # a rank's capture failed: no rank captures more, and every rank raises it (settle)
                self.latched, self.stopped = self.latched or failed, True
                return
            for red, out in zip(group, outs):
                if (full := mesh.combine(out.float(), red, parts)) is not None:
                    self._put(red.kind, layer, full, slots, "self")

    def _outs(
        self, plan, layer, query, key, reducers, chosen, lse, sums, key_counts, query_counts, mask, value, items, slots
    ):
        """The engine's results of ``reducers`` for the heads ``chosen`` of ``query`` and ``key`` ``(B, H, S, D)``,
        spot-checked (a shape that fails goes back to row tiles)."""
        res = plan.resolved
        B, H, S, D = query.shape
        if S != res.layout.seq_len:
            raise RuntimeError(f"sequence length {S} does not match the latent grid {res.layout} of this step")
        # The engine copies q and k per head chunk unless they already are contiguous float32 with every head.
        all_heads = chosen == tuple(range(H))  # every head, in the model's order: no gather needed
        copies = query.dtype != torch.float32 or not all_heads or not query[0].is_contiguous()
        shape = (str(query.device), query.dtype, S, len(chosen), D)
        method = "rows" if shape in self.verifier.rows_only else plan.tiles.method
        method = "auto" if method == "joint" and lse is None else method  # the output call fell back to the stock one
        method = "rows" if mask is not None else method  # the fused passes take no mask: row tiles apply it
        cost = passes.mask_cost(mask)  # the mask's rows of a tile count in the budget
        tiles = self._tiles_for(plan, S, len(chosen), D, query.device, copies, method, lse is not None, cost)
        # the row tiles of every row by the kernels as planned for the method asked (a shape back on rows: torch's)
        tiled = passes.tiled(reducers, S, tiles.method)
        kernel_tiles = plan.tiles.kernel_tiles and bool(tiled) and mask is None and shape not in self.verifier.rows_only
        tiles = replace(tiles, kernel_tiles=kernel_tiles)
        heads = None if all_heads else torch.tensor(chosen, device=query.device)
        # checked: a fast method's kinds, and every kind folded from the kernels' row tiles ("triton tiles")
        what = "triton tiles" if tiles.method == "rows" and kernel_tiles else tiles.method
        kinds = tuple(r.kind for r in reducers if kernel_tiles and r in tiled or r.rows is None)  # the pooled, stats
        checked = what != "rows" and self.verifier.due((*shape[:2], what, shape[2:]), kinds)
        rows = probe_rows(res.layout) if checked else None
        counts = None if key_counts is None else [int(n) for n in key_counts]
        formed = None if query_counts is None else [int(n) for n in query_counts]
        kept = counts if counts is not None else getattr(mask, "kept", None)  # a key mask's, whichever keys it keeps
        for slot, b in zip(slots, items):  # each item's valid text, as the mask keeps it, and its parts
            if kept is not None and int(kept[b]) < res.layout.seq_len:
                self.text_lengths.setdefault(slot, res.layout.text_kept(int(kept[b])))
            if formed is not None and formed[b] < res.layout.seq_len:  # Mochi's padded text: rows never formed
                self.query_lengths.setdefault(slot, formed[b])
            if self.steps.spans is not None:
                self.text_spans.setdefault(slot, self.steps.spans[b])
        value = value if self.wants_value else None
        choice = self.kernel if self.options.method == "auto" else None
        outs, used, probes = engine.capture_items(
            query, key, items, reducers, tiles, heads, lse, sums, choice, rows, counts, formed, mask, value
        )
        if probes:
            lse_of_output = ", lse of the output call" if lse is not None and used not in ("rows", "joint") else ""
            what, at = (what if used == "rows" else used) + lse_of_output, (self.step, layer)
            check = self.verifier.check_maps(probes, query, key, heads, reducers, *at, what, D**-0.5, counts)
            if not check.passed:  # nothing wrong is stored: this call again, and later ones, on torch's row tiles
                self.verifier.maps_failed(check, shape)
                if shape in self.kernel.chosen:  # rec.chosen_methods: no longer the kernel's
                    self.kernel.chosen[shape] = "rows"
                rows_tiles = self._tiles_for(plan, S, len(chosen), D, query.device, copies, "rows")
                outs, _, _ = engine.capture_items(
                    query, key, items, reducers, rows_tiles, heads, key_counts=counts, query_counts=formed, value=value
                )
        return outs

    @torch.no_grad()
    def capture_context(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, context: str, bias: torch.Tensor | None = None
    ) -> None:
        """Compute the kinds of the attention ``context`` (a cross-attention's ``"text"`` or ``"image"``, an audio
        stream's ``"audio"``, ``"audio_text"``, ``"a2v"``, ``"v2a"``) for ``layer`` from its queries ``query``
        ``(B, H, Q, D)`` (video queries: the grid's, or every video token's: the history's, off the grid, are left
        out) and keys ``key`` ``(B, H, C, D)``, with the key mask ``bias`` ``(B, C)`` added to the scores
        (:func:`cogattn.recorder.processor.context_bias`)."""
        plan = self.plan_of(layer)
        layout, res = plan.layout, plan.resolved
        # where the image tokens join the text's softmax (layout.image_joins_text), both kinds come from its keys
        sources = ("text", "image") if context == "text" and layout.image_joins_text else (context,)
        reducers = [r for r in plan.context if r.source in sources]
        if not reducers:
            return
        red = reducers[0]
        chosen = plan.context_heads.get(red.source, res.heads)
        if self.mesh is not None:  # this rank's part of the heads over every query (and key) token
            parts = self.mesh.parts(chosen)
            lengths = (red.query_len, layout.video_len, layout.seq_len)
            query = self.mesh.exchange(query, parts, self.mesh.full_length(query.shape[2], lengths))
            if bias is not None and self.mesh.sharded(key, red.context_len):
                bias = self.mesh.gather_tokens(bias, red.context_len)
            key = self.mesh.exchange(key, parts, red.context_len)
            reducers = [self.mesh.local(r, len(parts[self.mesh.rank])) for r in reducers]
        if red.video_queries and layout.history_len and query.shape[2] == layout.video_len:  # no (f, y, x)
            query = query[:, :, layout.history_len :]
        if query.shape[2] != red.query_len or key.shape[2] != red.context_len:
            raise RuntimeError(
                f"the {context} attention has {query.shape[2]} queries and {key.shape[2]} keys, but the "
                f"layout {layout} of this generation says {red.query_len} and {red.context_len}; the "
                f"{context} kinds need the same {context} length in every call (prompt_embeds and "
                "negative_prompt_embeds of one length)."
            )
        if key.shape[0] != query.shape[0]:  # a context given once for all videos, as attention broadcasts it
            key = key.expand(query.shape[0], -1, -1, -1)
        if (whole := self._whole(query.shape[0])) is None:
            return
        items, slots = whole
        if context == "text" and bias is not None and not self.text_lengths.keys() >= set(slots):  # read once a slot
            kept = kept_count(bias)  # each item's valid text (LTX-Video's); a self-attention's mask tells it first
            self.text_lengths.update({s: self.text_lengths.get(s, kept[b]) for s, b in zip(slots, items)})
        if self.mesh is not None:
            h, tiles = len(parts[self.mesh.rank]), plan.context_tiles[red.source]
            compute = context_pass if h else no_context_heads
            outs, failed = self.mesh.guarded(query.device, compute, query, key, items, reducers, None, tiles, bias)
            if outs is None:  # a rank's capture failed (as above)
                self.latched, self.stopped = self.latched or failed, True
                return
            for red, out in zip(reducers, outs):  # the whole result on rank 0
                if (full := self.mesh.combine(out.float(), red, parts)) is not None:
                    self._put(red.kind, layer, full, slots, "context")
            return
        heads = None if chosen == tuple(range(query.shape[1])) else torch.tensor(chosen, device=query.device)
        outs = context_pass(query, key, items, reducers, heads, plan.context_tiles[red.source], bias)
        for red, out in zip(reducers, outs):
            self._put(red.kind, layer, out, slots, "context")

    @torch.no_grad()
    def capture_stat(self, layer: int, name: str, values: torch.Tensor) -> None:
        """Keep a statistic of ``layer``'s captured call, ``values`` ``(B, H)`` per batch item of the call and head
        (every head), for the selected items' slots (:class:`cogattn.recorder.processor.MapSink`; their tables:
        :func:`cogattn.recorder.meta.call_stats`)."""
        items, slots = self._call_items(values.shape[0])
        kept = self.stats.setdefault((self.step, layer, name), {})
        for slot, b in zip(slots, items):
            kept[slot] = [float(x) for x in values[b]]

    @property
    def wants_value(self) -> bool:
        """Whether a selected kind needs the attention's values V (``pattern_error``): processors hand ``value``
        to :meth:`capture` only then."""
        plans = [self.plan, *self.layer_plans.values()] if self.plan is not None else []
        return any(r.needs_value for p in plans if p is not None for r in p.reducers)

    checks = property(lambda self: list(self.verifier.checks), doc="The spot checks made so far.")

    def _tiles_for(
        self, plan, S: int, H: int, D: int, device, copies: bool, method: str, lse: bool = False, mask_cost=(0, 0)
    ) -> TilePlan:
        key = (plan.layout, S, H, D, torch.device(device).type, copies, method, lse, mask_cost)  # H: a rank's heads
        if key not in self.tiles:
            budget = plan.tile_budget  # memory_budget less the results waiting for a step's last call
            self.tiles[key] = plan_tiles(plan.reducers, S, H, D, budget, method, device, copies, lse, mask_cost)
        return self.tiles[key]
