"""Recording: follows a generation step by step and keeps the maps the selection asks for.

``record(pipe, ...)`` is the one-line entry point: it builds a :class:`Recording`, installs cogattn's
processors on every attention layer, and on exit (also on an exception or KeyboardInterrupt) puts the
original processors back and removes its hook. A forward pre-hook on the transformer (no patching of
pipeline or block classes) tells the recording the step index, timestep, batch size and latent grid.
"""

from __future__ import annotations

import warnings
import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import torch

import torch.nn.functional as F

from .engine import TilePlan, check_output, attention_joint, attention_with_lse, capture, multi_key_indicator, plan_tiles
from .layout import TokenLayout
from .models import find_transformer
from .processor import CogVideoXAttnMapProcessor, FusedCogVideoXAttnMapProcessor
from .reducers import REDUCERS, Reducer
from .selection import Resolved, Selection
from .store import STORAGE_DTYPES, MemoryStore, RunWriter, StoreError, prepare_folder, record_file_bytes, remove_run

__all__ = ["Recording", "record"]


@contextlib.contextmanager
def _full_fp32_matmul():
    """Maps are exact float32: no TF32 in capture's matmuls, whatever the script set for the model."""
    precision, tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = tf32


class Recording:
    """Attention maps of one generation, keyed by ``(kind, step, layer)``.

    Building a recording validates the selection against the model and registers its forward
    pre-hook; it installs no processors (see :func:`record`, or set
    :class:`CogVideoXAttnMapProcessor` yourself). Use it as a context manager or call :meth:`close`.

    Args: see :func:`record`.
    """

    def __init__(
        self,
        target,
        *,
        kinds: Sequence[str] | str = ("frame",),
        layers: str | Sequence[int] = "all",
        steps: str | Sequence[int] = "all",
        batch: str | Sequence[int] = "auto",
        heads: str | Sequence[int] = "mean",
        queries: Sequence[int | tuple[int, int, int]] | None = None,
        memory_budget: int | str = "1GiB",
        path: str = "auto",
        out: str | os.PathLike | None = None,
        overwrite: bool = False,
        storage_dtype: str = "float32",
        info: dict | None = None,
        output: str = "stock",
    ):
        self.transformer, self.pipeline, self._spec = find_transformer(target)
        self._modules = self._spec.attention_modules(self.transformer)
        self._layer_of = {id(m): i for i, m in enumerate(self._modules)}
        num_heads = self._modules[0].heads
        self.selection = Selection.build(
            kinds=kinds, layers=layers, steps=steps, batch=batch, heads=heads, queries=queries,
            memory_budget=memory_budget, path=path, num_layers=len(self._modules), num_heads=num_heads,
        )  # fmt: skip
        if self.selection.batch in ("cond", "uncond") and self.pipeline is None:
            raise ValueError(
                f"batch={self.selection.batch!r} needs a pipeline to know whether classifier-free guidance "
                "is on; with a bare transformer pass batch indices (under guidance the batch is "
                "[uncond..., cond...])."
            )
        self.timesteps: list[float] = []
        self.layout: TokenLayout | None = None
        self.out = None if out is None else Path(out)
        self.info = dict(info or {})
        check_output(output, self.selection.path)
        self.output = output
        self._joint_indicator: torch.Tensor | None = None
        self._resolved: Resolved | None = None
        self._reducers: list[Reducer] = []
        self._plans: dict[tuple[int, int, str], TilePlan] = {}
        self._batch_size: int | None = None
        self._originals: dict | None = None
        self._closed = False
        if self.out is None:
            self._store: MemoryStore | RunWriter = MemoryStore()
        else:
            if storage_dtype not in STORAGE_DTYPES:
                raise ValueError(f"storage_dtype={storage_dtype!r}; choose one of {list(STORAGE_DTYPES)}.")
            self._store = RunWriter(prepare_folder(self.out, overwrite), storage_dtype)
            self._store.write_meta(self._meta(complete=False))
        self._hook = self.transformer.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    # -- results ---------------------------------------------------------------------------------
    def get(self, kind: str, step: int, layer: int) -> torch.Tensor:
        """The float32 CPU result of ``kind`` at denoising step ``step`` and block ``layer`` (read back
        from disk when recording to ``out``)."""
        return self._store.get(kind, step, layer)

    def keys(self) -> list[tuple[str, int, int]]:
        """Every recorded ``(kind, step, layer)``, sorted."""
        return self._store.keys()

    def __contains__(self, key) -> bool:
        return key in self.keys()

    # -- step tracking -----------------------------------------------------------------------------
    @property
    def step(self) -> int | None:
        """Index of the denoising step now running (or last run), `None` before the first."""
        return len(self.timesteps) - 1 if self.timesteps else None

    def _on_forward(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        text = kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1]
        t = kwargs["timestep"] if "timestep" in kwargs else args[2]
        t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
        layout = TokenLayout.from_latents(tuple(hidden.shape), text.shape[1], self.transformer.config)
        batch_size = hidden.shape[0]
        if self.timesteps:
            num_steps = self._pipeline_attr("num_timesteps")
            same = layout == self.layout and batch_size == self._batch_size and t <= self.timesteps[-1]
            if not same or (num_steps is not None and len(self.timesteps) >= num_steps):
                raise RuntimeError(
                    f"a second generation started inside one recording (it already holds "
                    f"{len(self.timesteps)} steps of a {self._batch_size}×{self.layout.grid} generation); "
                    "use one `cogattn.record(...)` per pipeline call so results are never mixed."
                )
        else:
            self._start(layout, batch_size, hidden.device)
        self.timesteps.append(t)

    def _pipeline_attr(self, name: str):
        try:
            return getattr(self.pipeline, name) if self.pipeline is not None else None
        except AttributeError:
            return None

    def _start(self, layout: TokenLayout, batch_size: int, device: torch.device) -> None:
        """First call of the generation: make the selection concrete and plan tiles (errors before any block runs)."""
        guidance = None
        if self.pipeline is not None:
            scale = self._pipeline_attr("guidance_scale")
            guidance = bool(scale is not None and scale > 1)
        num_heads = self._modules[0].heads
        resolved = self.selection.resolve(layout, batch_size, guidance, self._pipeline_attr("num_timesteps"), num_heads)
        reducers = [
            REDUCERS[k](layout, len(resolved.heads), resolved.mean_heads, resolved.queries)
            for k in self.selection.kinds
        ]
        head_dim = self._modules[0].inner_dim // num_heads
        # Fail now, not inside the first block, when the budget cannot fit one tile or the disk.
        copies = self.transformer.dtype != torch.float32 or len(resolved.heads) != num_heads
        self._plan(reducers, layout.seq_len, len(resolved.heads), head_dim, device, copies)
        self.layout, self._batch_size, self._resolved, self._reducers = layout, batch_size, resolved, reducers
        if self.output == "joint":
            indicator = multi_key_indicator(reducers, layout.seq_len, device)
            # with no multi-key kinds there is nothing to widen the values with: the lse alone is reused
            self._joint_indicator = indicator if indicator.shape[1] else None
        if isinstance(self._store, RunWriter):
            self._store.check_space(self.expected_bytes(self._pipeline_attr("num_timesteps")))
            self._store.write_meta(self._meta(complete=False))

    def expected_bytes(self, num_steps: int | None) -> int:
        """Bytes of record files this generation writes (all selected steps of ``num_steps``; one step
        when the number of steps is unknown, as with a bare transformer)."""
        sel = self.selection
        layers = len(self._modules) if sel.layers == "all" else len(sel.layers)
        if sel.steps == "all":
            steps = num_steps or 1
        else:
            steps = len([s for s in sel.steps if num_steps is None or s < num_steps])
        dtype = getattr(self._store, "dtype", torch.float32)
        per_step = sum(record_file_bytes(r.shape(len(self._resolved.batch)), dtype) for r in self._reducers)
        return per_step * layers * steps

    def _meta(self, complete: bool) -> dict:
        """What run.json says about this recording."""
        import diffusers

        from . import __version__

        sel, res = self.selection, self._resolved
        return {
            "complete": complete,
            "layout": None if self.layout is None else dataclasses.asdict(self.layout),
            "timesteps": self.timesteps,
            "selection": {**dataclasses.asdict(sel), "batch_resolved": res and list(res.batch),
                          "heads_resolved": res and list(res.heads)},  # fmt: skip
            "model": {"class": type(self.transformer).__name__, "config": dict(self.transformer.config),
                      "dtype": str(self.transformer.dtype).removeprefix("torch."),
                      "pipeline": None if self.pipeline is None else type(self.pipeline).__name__},  # fmt: skip
            "output": self.output,
            "storage_dtype": str(getattr(self._store, "dtype", torch.float32)).removeprefix("torch."),
            "info": self.info,
            "versions": {"cogattn": __version__, "diffusers": diffusers.__version__, "torch": torch.__version__},
        }

    def _plan(self, reducers, S, H, D, device, copies: bool = True) -> TilePlan:
        key = (S, D, torch.device(device).type, copies)
        if key not in self._plans:
            sel = self.selection
            path = "joint" if self.output == "joint" else sel.path
            self._plans[key] = plan_tiles(reducers, S, H, D, sel.memory_budget, path, device, copies)
        return self._plans[key]

    # -- called by the processors ------------------------------------------------------------------
    def layer_of(self, attn) -> int:
        """Block index of an attention module of this transformer."""
        try:
            return self._layer_of[id(attn)]
        except KeyError:
            raise ValueError("this processor serves an attention module outside the recorded transformer") from None

    def wants(self, layer: int) -> bool:
        """Whether the current step and ``layer`` are selected."""
        return (
            not self._closed
            and self.step is not None
            and self.selection.wants_layer(layer)
            and self.selection.wants_step(self.step)
        )

    def joint_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """``output="joint"``: the attention output ``(B, H, S, D)``, with the lse ``(B, H, S)`` and the
        multi-key sums ``(B, H, S, C)`` of the captured batch items from one widened fused call
        (:func:`cogattn.engine.attention_joint`); batch items not captured take the stock call."""
        if self._joint_indicator is None:  # no multi-key kinds: reuse the lse alone
            out, lse = attention_with_lse(query, key, value)
            return out, lse, None
        indicator = self._joint_indicator.to(query.device)
        B = query.shape[0]
        items = list(self._resolved.batch)
        if items == list(range(B)):
            return attention_joint(query, key, value, indicator)
        pick = _batch_index(items)
        out, lse_c, sums_c = attention_joint(query[pick], key[pick], value[pick], indicator)
        rest = _batch_index([b for b in range(B) if b not in items])
        full = torch.empty_like(query)
        full[rest] = F.scaled_dot_product_attention(query[rest], key[rest], value[rest], dropout_p=0.0, is_causal=False)
        full[pick] = out
        lse = torch.zeros(query.shape[:3], dtype=torch.float32, device=query.device)
        lse[pick] = lse_c
        sums = query.new_zeros(*query.shape[:3], indicator.shape[1])
        sums[pick] = sums_c
        return full, lse, sums

    def capture(self, layer: int, query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor | None = None,
                sums: torch.Tensor | None = None) -> None:  # fmt: skip
        """Compute every selected kind for ``layer`` at the current step from ``query``, ``key``
        ``(B, H, S, D)`` (and the output call's log-sum-exp ``(B, H, S)`` and multi-key sums
        ``(B, H, S, C)`` when it gave them)."""
        res = self._resolved
        B, H, S, D = query.shape
        if S != res.layout.seq_len:
            raise RuntimeError(f"sequence length {S} does not match the latent grid {res.layout} of this step")
        # The engine copies q and k per head chunk unless they already are contiguous float32 with every head.
        copies = query.dtype != torch.float32 or len(res.heads) != H or not query[0].is_contiguous()
        plan = self._plan(self._reducers, S, len(res.heads), D, query.device, copies)
        outs = [torch.zeros(r.shape(len(res.batch)), device=query.device) for r in self._reducers]
        heads = None if len(res.heads) == H else torch.tensor(res.heads)
        with _full_fp32_matmul():
            for i, b in enumerate(res.batch):
                capture(query[b], key[b], self._reducers, [o[i] for o in outs], plan, heads,
                        lse=None if lse is None else lse[b], sums=None if sums is None else sums[b])  # fmt: skip
        for red, out in zip(self._reducers, outs):
            self._store.put(red.kind, self.step, layer, self.timesteps[-1], out)

    # -- processors and cleanup --------------------------------------------------------------------
    def install_processors(self) -> None:
        """Replace the stock CogVideoX processors of every layer; :meth:`close` restores them."""
        current = self.transformer.attn_processors
        replacement = {}
        for i in range(len(self._modules)):
            name = self._spec.processor_name(i)
            proc = current[name]
            if isinstance(proc, CogVideoXAttnMapProcessor):
                raise ValueError(f"{name} already runs a cogattn processor; close the other recording first.")
            if type(proc) is self._spec.fused:
                replacement[name] = FusedCogVideoXAttnMapProcessor(self, layer=i)
            elif type(proc) is self._spec.plain:
                replacement[name] = CogVideoXAttnMapProcessor(self, layer=i)
            else:
                raise TypeError(
                    f"{name} is a {type(proc).__name__}; cogattn captures through the stock "
                    f"{self._spec.plain.__name__} or {self._spec.fused.__name__}. Reset with "
                    f"`transformer.set_attn_processor({self._spec.plain.__name__}())`."
                )
        self._originals = current
        self.transformer.set_attn_processor({**current, **replacement})

    def close(self, complete: bool = True) -> None:
        """Remove the hook, restore the original processors, and finish writing (idempotent).

        Raises `StoreError` if a record could not be written; the committed ones stay readable."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        if self._originals is not None:
            self.transformer.set_attn_processor(self._originals)
            self._originals = None
        complete = complete and bool(self.timesteps)
        self._store.close(self._meta(complete=complete))
        if isinstance(self._store, RunWriter) and not complete and self._store.committed == 0:
            remove_run(self.out)  # nothing was captured (refused at the first step, say): leave no run behind
        self._warn_missing()
        steps = self.selection.steps
        if self.timesteps and steps != "all" and max(steps) >= len(self.timesteps):
            missing = [s for s in steps if s >= len(self.timesteps)]
            warnings.warn(f"steps {missing} were selected but the generation ran {len(self.timesteps)} steps.")

    def _warn_missing(self) -> None:
        """Layers a cache (PAB, FasterCache, FirstBlockCache, ...) skipped produce no record: say so."""
        if self._resolved is None:
            return
        sel = self.selection
        layers = len(self._modules) if sel.layers == "all" else len(sel.layers)
        steps = sum(1 for s in range(len(self.timesteps)) if sel.wants_step(s))
        expected = layers * steps * len(sel.kinds)
        have = len(self.keys()) if isinstance(self._store, MemoryStore) else self._store.committed
        if have < expected:
            warnings.warn(f"{expected - have} of {expected} selected records were not produced (attention "
                          "skipped by a cache, or the generation stopped early).")  # fmt: skip

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way out: finish what can be finished, and let it through
            self.close(complete=False)
        except StoreError:
            pass

    def __repr__(self) -> str:
        sel = self.selection
        return (
            f"Recording(kinds={list(sel.kinds)}, steps={len(self.timesteps)}, records={len(self.keys())}, "
            f"layout={self.layout})"
        )


def record(
    target,
    *,
    kinds: Sequence[str] | str = ("frame",),
    layers: str | Sequence[int] = "all",
    steps: str | Sequence[int] = "all",
    batch: str | Sequence[int] = "auto",
    heads: str | Sequence[int] = "mean",
    queries: Sequence[int | tuple[int, int, int]] | None = None,
    memory_budget: int | str = "1GiB",
    path: str = "auto",
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    storage_dtype: str = "float32",
    info: dict | None = None,
    output: str = "stock",
) -> Recording:
    """Record exact attention maps of a CogVideoX pipeline or transformer while it runs.

    ```python
    with cogattn.record(pipe, kinds=("frame", "video_to_text"), batch="cond") as rec:
        pipe(prompt_embeds=..., num_inference_steps=4)
    rec.get("frame", step=0, layer=1)  # (B, H, G, G) float32 on CPU
    ```

    Args:
        target: a CogVideoX pipeline (text-to-video or image-to-video) or a ``CogVideoXTransformer3DModel``.
        kinds (`str | Sequence[str]`, defaults to ``("frame",)``): any of ``"full"``, ``"frame"``,
            ``"video_to_text"``, ``"text_to_video"``, ``"query"`` (shapes in DESIGN.md / the README).
        layers (`"all" | Sequence[int]`, defaults to ``"all"``): 0-based block indices.
        steps (`"all" | Sequence[int]`, defaults to ``"all"``): 0-based denoising-step indices.
        batch (`"auto" | "all" | "cond" | "uncond" | Sequence[int]`, defaults to ``"auto"``): transformer
            batch items. Under classifier-free guidance the batch is ``[uncond..., cond...]``; ``"auto"``
            is ``"cond"`` when a pipeline runs with guidance and ``"all"`` otherwise; ``"cond"`` and
            ``"uncond"`` need a pipeline target.
        heads (`"all" | "mean" | Sequence[int]`, defaults to ``"mean"``): ``"mean"`` averages all heads
            into one head slot.
        queries (`Sequence[int | tuple[int, int, int]] | None`): for ``"query"``: token indices or
            video coordinates ``(frame, row, col)`` on the latent patch grid.
        memory_budget (`int | str`, defaults to ``"1GiB"``): bound on the transient working memory of
            capture (results excluded), e.g. ``"512MiB"``.
        path (`"auto" | "rows" | "sdpa"`, defaults to ``"auto"``): how key-pooled kinds (``frame``,
            ``video_to_text``) are computed: ``"sdpa"`` through a fused attention call on an indicator
            matrix, ``"rows"`` from row tiles of P. Both are exact; ``"auto"`` picks the faster.
        out (`str | os.PathLike | None`, defaults to `None`): a folder to stream every record to as soon
            as it exists (see ``cogattn.load``); `None` keeps results in memory.
        overwrite (`bool`, defaults to `False`): replace a cogattn run already in ``out``; a non-empty
            ``out`` is refused otherwise.
        storage_dtype (`str`, defaults to ``"float32"``): on-disk dtype, ``"float16"`` or ``"bfloat16"``
            halve the size.
        info (`dict | None`): JSON-able facts to keep in ``run.json`` (prompt, seed, ...).
        output (`"stock" | "lse" | "joint"`, defaults to ``"stock"``): how captured layers compute their
            attention output (layers not captured always run the stock call).

            * ``"stock"``: diffusers' own ``F.scaled_dot_product_attention`` call; the video is
              bit-identical to a run without cogattn.
            * ``"lse"`` (opt-in): the flash kernel that SDPA dispatches to (CPU; CUDA for fp16/bf16),
              called directly so it also returns each row's log-sum-exp, which ``video_to_text`` then
              reuses instead of an attention pass of its own.
            * ``"joint"`` (opt-in, the fastest): one fused call on values widened with the key-group
              indicator columns (q and k zero-padded to the same head dim, the original softmax scale)
              returns the output, the lse and the ``frame`` sums together; capture then needs no
              attention pass at all. The sums carry the model dtype's rounding (about 3 significant
              digits per query row in bf16, before the mean over queries and heads) and need
              ``path="auto"``.

            On the CPU both opt-in modes gave bit-identical videos in the tests (fp32 and bf16); on CUDA
            they run another kernel than SDPA may choose, so the output can differ in the last bits.

    Returns:
        `Recording`: a context manager; on exit the original processors are back and the hook is gone.
    """
    rec = Recording(
        target, kinds=kinds, layers=layers, steps=steps, batch=batch, heads=heads, queries=queries,
        memory_budget=memory_budget, path=path, out=out, overwrite=overwrite, storage_dtype=storage_dtype,
        info=info, output=output,
    )  # fmt: skip
    try:
        rec.install_processors()
    except BaseException:
        rec.close()
        raise
    return rec


def _batch_index(items: list[int]):
    """An index for batch ``items``: a slice (a view) when they are consecutive, else a tensor."""
    if items == list(range(items[0], items[-1] + 1)):
        return slice(items[0], items[-1] + 1)
    return torch.tensor(items)
