"""The self-test's rows on the tiny pipelines: every kind, method and output mode of CogVideoX 1.0, 1.5
and image-to-video (:func:`pipeline_rows`), and every method of every other registered family's tiny
pipelines (:func:`family_rows`), against the naive float64 reference of the q and k (and the key and
query counts) the processors handed over, with the video against the stock one. A tiny pipeline whose
parts need a package that is not installed (none of cogattn's dependencies) is one skipped row naming it.
``python -m cogattn.selftest`` (:mod:`cogattn.selftest`) runs them and reports.
"""

from __future__ import annotations

import importlib.util
import re
import time
from dataclasses import dataclass

import torch

from .exact.attention import fused_lse_supported
from .exact.checks import TOLERANCE, bound, made_from_output, output_identical
from .exact.kernels import available as triton_available
from .exact.reducers.audio import AUDIO_KINDS
from .models import FAMILIES, cogvideox, transformer_config
from .recorder.recording import record
from .reference import kind_error, naive_audio, naive_context, naive_kind, naive_lse, naive_probs, select, worst

__all__ = [
    "JOINT_KINDS",
    "PIPELINES",
    "Row",
    "backend_rows",
    "family_rows",
    "methods",
    "missing_package",
    "pipeline_rows",
    "task_label",
    "timed",
]

JOINT_KINDS = cogvideox.SPEC.kinds()  # the kinds of CogVideoX's joint attention
# several blocks and tiles, the last ones smaller; top_p's p = 1 counts every key with attention
SIZES = dict(block_size=7, topk=4, tile_shape=(2, 2, 3), top_p=(0.5, 0.9, 0.99, 1.0))
PATTERNS = ("spatial", "temporal", "window:1", "sta:1,1,3", "radial")  # pattern_recall's and pattern_error's


def _sizes(kinds) -> dict:
    """The size options of a recording of ``kinds``: the patterns only where a kind takes them."""
    return {**SIZES, **({"patterns": PATTERNS} if {"pattern_recall", "pattern_error"} & set(kinds) else {})}


@dataclass
class Row:
    """One line of the report."""

    part: str  # "layer S=…" or the tiny pipeline
    kind: str
    method: str
    output: str
    max_error: float | None
    tolerance: float | None
    bit_identical: bool | None  # the layer's or the video's output against stock (None: not compared)
    time_x_stock: float | None
    passed: bool | None  # None: skipped
    note: str = ""


def task_label(task: str) -> str:
    """A tiny pipeline's task in a row's part: ``"t2v"``, ``"i2v"``, ``"v2v"``."""
    return {"text-to-video": "t2v", "image-to-video": "i2v", "video-to-video": "v2v"}.get(task, task)


def timed(fn, device: torch.device):
    """``(fn(), seconds)``, the device synchronized around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


def missing_package(err: ImportError) -> str | None:
    """The skip note for ``err`` where it says a package is not installed, else `None` (then it is a bug).

    diffusers' placeholder classes (``ConsisIDPipeline`` without OpenCV, ...) raise an `ImportError` that
    names the library and often its pip package; a plain ``import`` names the module; a name missing from a
    library the tiny pipelines import (an older transformers without ``T5Gemma2Encoder``) asks for a newer one. A
    name missing from cogattn, diffusers or torch is a bug.
    """
    text = " ".join(str(err).split())
    library = re.search(r"requires the (.+?) library", text)
    if library:
        pip = re.search(r"`pip install ([^`]+)`", text)
        return f"needs {library.group(1)}, not installed" + (f" (pip install {pip.group(1)})" if pip else "")
    top = (err.name or "").split(".")[0]
    if top and importlib.util.find_spec(top) is None:  # an installed module's failing import is no skip
        return f"needs {top}, not installed"
    name = re.search(r"cannot import name '(\w+)' from '(\w+)", text)
    if name and name.group(2) == top and top not in ("cogattn", "diffusers", "torch"):  # an older release of a
        return f"needs a newer {top} (with {name.group(1)}: pip install -U {top})"  # library the pipeline imports
    return None


def methods(device: torch.device) -> list[tuple[str, str]]:
    """``(method, why skipped or "")`` for every method."""
    triton = "" if triton_available(device) else "needs Triton on CUDA (or TRITON_INTERPRET=1)"
    sdpa = "" if fused_lse_supported(device) else f"no fused attention kernel with lse on {device.type}"
    return [("rows", ""), ("sdpa", sdpa), ("triton", triton)]


# -- the tiny pipelines --------------------------------------------------------------------------------
PIPELINES = [("text-to-video", "1.0"), ("text-to-video", "1.5"), ("image-to-video", "1.0")]


def pipeline_rows(device: torch.device, dtype: torch.dtype, configs=PIPELINES) -> list[Row]:
    """Every method and output mode recording every kind of a 2-step generation of each tiny pipeline."""
    tiny_pipeline, TINY_TEXT_LEN = cogvideox.tiny_pipeline, cogvideox.TINY_TEXT_LEN
    rows = []
    for task, version in configs:
        pipe = tiny_pipeline(task, version, dtype=dtype, num_heads=3).to(device)
        part = f"tiny {version} {'i2v' if task == 'image-to-video' else 't2v'}"
        gen = torch.Generator().manual_seed(0)
        emb = torch.randn(1, TINY_TEXT_LEN, 16, generator=gen).to(device, dtype)
        call = dict(
            prompt_embeds=emb,
            negative_prompt_embeds=-emb,
            num_frames=9,
            num_inference_steps=2,
            max_sequence_length=TINY_TEXT_LEN,
            output_type="pt",
        )
        if task == "image-to-video":
            call["image"] = torch.rand(3, 48, 80, generator=gen)

        def generate(pipe=pipe, call=call):
            return pipe(generator=torch.Generator(device).manual_seed(1), **call).frames

        generate()  # warm up
        stock, t_stock = timed(generate, device)
        combos = [(m, "stock", why) for m, why in methods(device)]
        combos += [
            ("auto", mode, "" if fused_lse_supported(device) else "no fused kernel") for mode in ("lse", "joint")
        ]
        for method, output, skipped in combos:
            if skipped:
                rows.append(Row(part, "all", method, output, None, None, None, None, None, skipped))
                continue
            rec = record(
                pipe,
                kinds=tuple(JOINT_KINDS),
                queries=[0, (1, 1, 2)],
                batch="cond",
                heads="all",
                method=method,
                layer_output=output,
                verify=False,
                patterns=PATTERNS,
                **SIZES,
            )
            calls, inner = [], rec.capture

            def spy(layer, query, key, *rest, inner=inner, rec=rec, calls=calls, **named):
                v = named.get("value")  # handed over for pattern_error
                v = None if v is None else v.detach().float().cpu()
                calls.append((rec.step, layer, query.detach().float().cpu(), key.detach().float().cpu(), v))
                inner(layer, query, key, *rest, **named)

            rec.capture = spy
            with rec:
                video, seconds = timed(generate, device)
            largest, limit_of_largest, passed = 0.0, TOLERANCE.get(dtype, 1e-5), True
            for step, layer, q, k, v in calls:
                P, lse = (x[list(rec.batch_items)] for x in (naive_probs(q, k), naive_lse(q, k)))
                v = None if v is None else v[list(rec.batch_items)].double()
                for kind in JOINT_KINDS:
                    limit = bound(dtype, made_from_output(kind, output, JOINT_KINDS, rec.plan.tiles.method))
                    tokens = [0, rec.layout.token_index(1, 1, 2)]
                    lay = rec.layout
                    got = rec.get(kind, step, layer)
                    err = kind_error(got, P, kind, lay.text_len, lay.grid, tokens, lse, patterns=PATTERNS, v=v, **SIZES)
                    passed &= err <= limit
                    if not err / limit < largest / limit_of_largest:  # NaN too
                        largest, limit_of_largest = err, limit
            same = bool(torch.equal(video, stock))
            promised = output_identical(output, device, dtype)
            note = "" if promised else "not the stock call: its last bits may differ"
            unchecked = _unchecked(rec, {(step, layer) for step, layer, *_ in calls})
            passed, note = (False, unchecked) if unchecked else (passed, note)
            rows.append(
                Row(
                    part,
                    "all",
                    method,
                    output,
                    largest,
                    limit_of_largest,
                    same,
                    seconds / t_stock,
                    passed and (same or not promised),
                    note,
                )
            )
    return rows


def _spying(rec, inner, context: bool, calls: dict):
    """``inner`` (a recording's ``capture`` or ``capture_context``), keeping each call's q, k and key counts (a
    cross-attention's: its key mask, added to the scores), values and query-key mask in ``calls``."""

    def spy(layer, query, key, *rest, **named):
        mask = named.get("mask")
        if mask is not None and not hasattr(mask, "keep") and getattr(mask, "additive", False):
            raise RuntimeError("the self-test's reference takes no additive query-key mask")
        if mask is not None:  # boolean (B, 1 or H, S, S): a GroupMask per head (Cosmos 3's causal text) made dense
            dense = mask.keep[..., mask.group, :][..., mask.group] if hasattr(mask, "keep") else mask[:, None]
            mask = dense.detach().cpu()
        counts = (rest[2] if len(rest) > 2 else None, rest[3] if len(rest) > 3 else None)
        v = None if named.get("value") is None else named["value"].detach().float().cpu()  # for pattern_error
        bias = rest[1] if len(rest) > 1 else named.get("bias")  # a cross-attention's key mask (LTX-Video's)
        keep = (bias.detach().cpu() if bias is not None else None) if context else counts
        qk = (query.detach().float().cpu(), key.detach().float().cpu(), keep, v, mask)
        calls.setdefault((rec.step, layer, rest[0] if context else "self"), []).append(qk)
        inner(layer, query, key, *rest, **named)

    return spy


def backend_rows(device: torch.device, dtype: torch.dtype) -> list[Row]:
    """:func:`family_rows` of the tiny Wan under every attention backend whose requirements are installed
    (diffusers' ``AttentionBackendName``; Wan's processors dispatch to it), the process-wide active backend
    put back after."""
    spec = next((s for s in FAMILIES if s.family == "wan"), None)
    if spec is None:  # a diffusers without Wan's attention modules
        return []
    from diffusers.models import attention_dispatch as dispatch

    active, rows = dispatch._AttentionBackendRegistry._active_backend, []
    try:
        for backend in dispatch.AttentionBackendName:
            try:
                dispatch._check_attention_backend_requirements(backend)
            except (RuntimeError, ImportError):
                continue  # not installed here
            rows += family_rows(spec, device, dtype, backend.value)
    finally:
        dispatch._AttentionBackendRegistry._active_backend = active
    return rows


def _item_counts(counts, batch: int) -> list[tuple[int | None, int | None]]:
    """``(kept keys, formed queries)`` of each item of a call (`None`: all)."""
    keys, queries = counts
    return [
        (None if keys is None else int(keys[b]), None if queries is None else int(queries[b])) for b in range(batch)
    ]


def _item_error(rec, kind: str, step: int, layer: int, b: int, P, lse, queries: int | None, v=None) -> float:
    """Error of item ``b``'s recorded ``kind`` against its reference ``P`` ``(1, H, S_b, S)`` (``S_b`` the
    formed query rows, whose text is as much shorter), in the units of the bounds; rows never formed
    must hold exactly 0."""
    lay = rec.layout_of(layer)  # a layer of its own layout (Motif-Video's decoder): its tokens
    got = rec.get(kind, step, layer)
    paired = kind in ("topk", "frame_max")  # values and key tokens, read back as a pair
    got = type(got)(*(x[b : b + 1] for x in got)) if paired else got[b : b + 1]
    if queries is None or queries == lay.seq_len:
        tokens, end = [0, lay.token_index(1, 1, 2)], lay.text_position == "end"
        return kind_error(got, P, kind, lay.text_len, lay.grid, tokens, lse, end, patterns=PATTERNS, v=v, **SIZES)
    S, n = lay.seq_len, queries  # the model attends over the first n tokens alone: so does the reference
    P, T = P[..., :n], lay.text_len - (S - n)
    v = None if v is None else v[..., :n, :]
    tokens = [0, lay.token_index(1, 1, 2)]
    if paired:
        inside = type(got)(*(x[:, :, :n] for x in got))
        return worst(
            kind_error(inside, P, kind, T, lay.grid, tokens, lse, True, patterns=PATTERNS, v=v, **SIZES),
            got.values[:, :, n:].abs().max().item(),
        )
    want = naive_kind(P, kind, T, lay.grid, tokens, text_at_end=True, patterns=PATTERNS, v=v, **SIZES)
    corner = tuple(slice(0, m) for m in want.shape)
    err = kind_error(got[corner], P, kind, T, lay.grid, tokens, lse, True, patterns=PATTERNS, v=v, **SIZES)
    outside = got.clone()
    outside[corner] = 0
    return worst(err, outside.abs().max().item())


def _unchecked(rec, checked: set) -> str:
    """Why a recording's rows cannot pass on what was checked: no call handed over, a selected call that did not
    run (``rec.skipped``), or a (step, layer) recorded that the reference never saw; empty where all was checked."""
    recorded = {(step, layer) for _, step, layer in rec.keys()}
    if not checked:
        return "no attention call was handed to the recording"
    if rec.skipped:
        return f"{len(rec.skipped.calls)} selected attention calls were not recorded"
    if recorded - checked:
        return f"{len(recorded - checked)} recorded (step, layer) pairs were never checked"
    return ""


def _missing_row(part: str, err: ImportError, strict: bool) -> Row:
    """The row of a tiny pipeline that could not run for a package not installed: skipped, or with
    ``strict`` failed; ``err`` raised again where no package is missing (a bug, not an install)."""
    if (missing := missing_package(err)) is None:
        raise err
    return Row(part, "all", "-", "stock", None, None, None, None, False if strict else None, missing)


def family_rows(
    spec,
    device: torch.device,
    dtype: torch.dtype,
    backend: str | None = None,
    quick: bool = False,
    strict: bool = False,
) -> list[Row]:
    """Every method recording every kind of a family (all but CogVideoX, whose rows also cover the output
    modes) in a 2-step guided generation of each of its tiny pipelines: the self-attention kinds (under the
    family's key mask) and the cross-attention's, against the reference of the q and k the processors
    handed over, and the video against the stock one. ``backend``: the first tiny pipeline under that
    attention backend (``set_attention_backend``), row tiles only; ``quick``: row tiles only. A tiny
    pipeline that needs a package not installed is one skipped row naming it (failed with ``strict``)."""
    self_kinds = spec.kinds("self")
    rows = []
    for task in spec.tiny_tasks[:1] if backend else spec.tiny_tasks:
        part = f"tiny {spec.family} {task_label(task)}"
        try:
            pipe = spec.tiny_pipeline(task, dtype=dtype, num_heads=3, head_dim=16).to(device)  # Triton: D ≥ 16
        except ImportError as err:  # a part that needs an optional package (diffusers' placeholder classes)
            rows.append(_missing_row(part, err, strict))
            continue
        if backend:
            part += f", {backend} backend"
            try:  # a Hub kernel's backend downloads it here: out of reach, the backend does not run here
                pipe.transformer.set_attention_backend(backend)
            except Exception as err:
                why = " ".join(str(err).split())[:120]
                rows.append(
                    Row(part, "all", "rows", "stock", None, None, None, None, None, f"does not run here: {why}")
                )
                continue
        call = spec.tiny_call(pipe, task, torch.Generator().manual_seed(0), True)
        # the image kinds where the transformer has an image context (Wan 2.1 image-to-video, Cosmos Transfer2.5);
        # the audio kinds of an audio stream (LTX-2)
        image = spec.layout_for_video(transformer_config(pipe.transformer), 1, 4096, 4096, 1).image_len > 0
        context = [k for k in spec.context_kinds if spec.context_kinds[k] != "image" or image]

        def generate(pipe=pipe, call=call):
            gen = torch.Generator(device).manual_seed(1)
            out = pipe(generator=gen, num_inference_steps=2, output_type="pt", **call)
            return out.frames if hasattr(out, "frames") else out.video  # Cosmos 3's output names it `video`

        try:
            generate()  # warm up
        except RuntimeError as err:  # a backend with no kernel for this device or dtype: skipped; else a failure
            why = str(err).strip().splitlines()[0][:120]
            note = f"does not run here: {why}" if backend else f"the stock call failed: {why}"
            rows.append(Row(part, "all", "rows", "stock", None, None, None, None, None if backend else False, note))
            continue
        except ImportError as err:  # a package the call itself imports
            rows.append(_missing_row(part, err, strict))
            continue
        stock, t_stock = timed(generate, device)
        for method, skipped in [("rows", "")] if backend or quick else methods(device):
            if skipped:
                rows.append(Row(part, "all", method, "stock", None, None, None, None, None, skipped))
                continue
            kinds = self_kinds + tuple(context)
            rec = record(
                pipe,
                kinds=kinds,
                queries=[0, (1, 1, 2)] if "query" in kinds else None,  # refused with its self-attention (SANA-Video)
                batch="all",
                heads="all",
                method=method,
                **_sizes(kinds),
            )
            calls: dict = {}  # (step, layer, source) → [(q, k, counts) of each call]: as the family calls them
            for name in ("capture", "capture_context"):
                setattr(rec, name, _spying(rec, getattr(rec, name), name == "capture_context", calls))
            with rec:
                video, seconds = timed(generate, device)
            limit, error, lay = TOLERANCE.get(dtype, 1e-5), 0.0, rec.layout
            for (step, layer, source), found in calls.items():
                found = found[::-1]  # the guidance batch [uncond..., cond...]: a step's later call first
                q, k = torch.cat([x[0] for x in found]), torch.cat([x[1] for x in found])
                v = None if any(x[3] is None for x in found) else torch.cat([x[3] for x in found]).double()
                if source != "self":
                    biases = [x[2] for x in found]
                    bias = None if any(b is None for b in biases) else torch.cat(biases)
                    P = naive_probs(q, k, key_mask=bias)
                    for kind in [c for c in context if spec.source(c) == source]:
                        made = naive_audio(P, kind, lay.grid) if kind in AUDIO_KINDS else naive_context(P, lay.grid)
                        ref = select(made, rec.batch_items, "all")
                        error = worst(error, (rec.get(kind, step, layer).double() - ref).abs().max().item())
                    continue
                items = [n for x in found for n in _item_counts(x[2], len(x[0]))]
                masks = [None if x[4] is None else x[4][min(i, len(x[4]) - 1)] for x in found for i in range(len(x[0]))]
                for b, (keys, queries) in enumerate(items):
                    qb, kb = q[b : b + 1, :, :queries], k[b : b + 1]
                    keep = (torch.arange(k.shape[2]) < (k.shape[2] if keys is None else keys))[None]
                    P, lse = naive_probs(qb, kb, key_mask=keep), naive_lse(qb, kb, key_mask=keep)
                    if masks[b] is not None:  # a query-key mask: masked scores at -inf
                        scores = (qb.double() @ kb.double().transpose(-1, -2)) * qb.shape[-1] ** -0.5
                        scores = scores.masked_fill(~masks[b][None, :, : qb.shape[2]], float("-inf"))
                        P, lse = scores.softmax(-1), scores.logsumexp(-1)
                    held = {k for k, s, n in rec.keys() if (s, n) == (step, layer)}  # no text kind without text
                    for kind in [k for k in self_kinds if k in held or rec.layout_of(layer) == rec.layout]:
                        vb = None if v is None else v[b : b + 1]
                        error = worst(error, _item_error(rec, kind, step, layer, b, P, lse, queries, vb))
            same, unchecked = bool(torch.equal(video, stock)), _unchecked(rec, {(s, n) for s, n, _ in calls})
            passed = error <= limit and same and not unchecked  # NaN fails
            rows.append(Row(part, "all", method, "stock", error, limit, same, seconds / t_stock, passed, unchecked))
    return rows
