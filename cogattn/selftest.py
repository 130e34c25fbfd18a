"""``python -m cogattn.selftest``: check cogattn on this machine, with its own kernels.

Runs every kind with every method and every ``layer_output`` mode, on a synthetic attention layer and
on the tiny random pipelines (CogVideoX 1.0, 1.5 and image-to-video; and every other registered family's,
every method, unless ``--quick``), against the naive float64 reference (:mod:`cogattn.reference`); checks that the video is bit-identical to stock where that is
promised (the default output everywhere, the opt-in outputs on the CPU); and times capture against the
stock layer. Prints a table and a one-line verdict with the versions, and exits 0 when every row
passes, 1 otherwise. ``--json PATH`` writes the same report, to attach to a bug report.

    python -m cogattn.selftest                       # cuda when available, else cpu; float32
    python -m cogattn.selftest --dtype bfloat16 --seq-len 4096 --json selftest.json

The spot checks are off here (``verify=False``): the self-test measures the methods themselves.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .attention import attention_joint, attention_with_lse, fused_lse_supported
from .checks import OUTPUT_RTOL, TOLERANCE, bound, made_from_output
from .engine import capture, multi_key_indicator
from .layout import TokenLayout
from .models import FAMILIES, cogvideox
from .planner import plan_tiles
from .recording import record
from .reducers import REDUCERS
from .reference import kind_error, naive_context, naive_lse, naive_probs, select
from .version import __version__

__all__ = ["Row", "main", "run"]

JOINT_KINDS = cogvideox.SPEC.kinds()  # the kinds of CogVideoX's joint attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the kinds the fast methods serve (the others always take row tiles), and those the output's lse serves
POOLED = ("frame", "video_to_text", "entropy", "received", "query_frame", "block")
FROM_LSE = ("video_to_text", "received")  # run from the output call's lse alone: no float32 pass gives one
SIZES = dict(block_size=7, topk=4)  # several blocks, the last one shorter, on the tiny pipelines


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


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


def _methods(device: torch.device) -> list[tuple[str, str]]:
    """``(method, why skipped or "")`` for every method."""
    triton = "" if kernels.available(device) else "needs Triton on CUDA (or TRITON_INTERPRET=1)"
    sdpa = "" if fused_lse_supported(device) else f"no fused attention kernel with lse on {device.type}"
    return [("rows", ""), ("sdpa", sdpa), ("triton", triton)]


# -- a synthetic layer ---------------------------------------------------------------------------------
def synthetic_layout(seq_len: int) -> TokenLayout:
    """A layout of about ``seq_len`` tokens: an eighth text (at most 226), 4 latent frames of a square grid."""
    text = max(2, min(226, seq_len // 8))
    side = max(1, round(math.sqrt(max(4, seq_len - text) / 4)))
    return TokenLayout(text, 4, side, side + 1)


def layer_rows(device: torch.device, dtype: torch.dtype, seq_len: int, heads: int = 4, head_dim: int = 64) -> list[Row]:
    """Every kind × method and the opt-in outputs on random q, k, v of one layer, against float64 softmax."""
    layout = synthetic_layout(seq_len)
    S, T = layout.seq_len, layout.text_len
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(heads, S, head_dim, generator=gen) * 1.5 for _ in range(3))
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    queries = torch.tensor([0, T, S // 2, S - 1])
    P = naive_probs(q.float().cpu()[None], k.float().cpu()[None])
    lse = naive_lse(q.float().cpu()[None], k.float().cpu()[None])
    part = f"layer S={S:,}"
    stock, t_stock = _timed(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None]), device)
    _, t_stock = _timed(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None]), device)  # warm
    tol = TOLERANCE.get(dtype, 1e-5)

    def error(kind: str, got: torch.Tensor) -> float:
        got = REDUCERS[kind].unpack(got.cpu()[None])
        return kind_error(got, P, kind, T, layout.grid, queries.tolist(), lse, block_size=64)

    def run(kinds, method, lse=None, sums=None):
        reducers = [REDUCERS[kd](layout, heads, False, queries, block_size=64) for kd in kinds]
        plan = plan_tiles(reducers, S, heads, head_dim, 2**30, method, device)
        outs = [torch.zeros(r.shape(1)[1:], device=device) for r in reducers]
        _, seconds = _timed(lambda: capture(q, k, reducers, outs, plan, lse=lse, sums=sums), device)
        return outs, seconds

    rows = []
    for method, skipped in _methods(device):
        kinds = list(JOINT_KINDS) if method == "rows" else list(POOLED)
        for kind in kinds:
            if skipped:
                rows.append(Row(part, kind, method, "stock", None, tol, None, None, None, skipped))
                continue
            (got,), seconds = run([kind], method)
            err = error(kind, got)
            rows.append(Row(part, kind, method, "stock", err, tol, None, seconds / t_stock, err <= tol))
    if fused_lse_supported(device):
        out, lse = attention_with_lse(q[None], k[None], v[None])
        rows += _output_rows(part, "lse", out, stock, lse, None, dtype, device, run, error, t_stock, tol)
        reducers = [REDUCERS[kd](layout, heads, False, block_size=64) for kd in POOLED]
        out, lse, sums = attention_joint(q[None], k[None], v[None], multi_key_indicator(reducers, S, device))
        rows += _output_rows(part, "joint", out, stock, lse, sums, dtype, device, run, error, t_stock, tol)
    return rows


def _output_rows(part, mode, out, stock, lse, sums, dtype, device, run, error, t_stock, tol) -> list[Row]:
    """Rows of an opt-in output call: its output against stock, and the maps made from what it brought."""
    same = bool(torch.equal(out, stock))
    rel = (out.float() - stock.float()).abs().max().item() / max(stock.float().abs().max().item(), 1e-6)
    rtol = OUTPUT_RTOL.get(dtype, 1e-5)
    rows = [Row(part, "output", "-", mode, rel, rtol, same, None, rel <= rtol and (same or device.type != "cpu"))]
    method = "joint" if mode == "joint" else "sdpa"
    kinds = list(POOLED) if mode == "joint" else list(FROM_LSE)
    outs, seconds = run(kinds, method, lse=lse[0], sums=None if sums is None else sums[0])
    for kind, got in zip(kinds, outs):
        limit = bound(dtype, made_from_output(kind, mode, kinds, method))  # from the output call's, or not
        err = error(kind, got)
        rows.append(Row(part, kind, method, mode, err, limit, None, seconds / t_stock, err <= limit))
    return rows


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
        stock, t_stock = _timed(generate, device)
        combos = [(m, "stock", why) for m, why in _methods(device)]
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
                **SIZES,
            )
            calls, inner = [], rec.capture

            def spy(layer, query, key, lse=None, sums=None, inner=inner, rec=rec, calls=calls):
                calls.append((rec.step, layer, query.detach().float().cpu(), key.detach().float().cpu()))
                inner(layer, query, key, lse, sums)

            rec.capture = spy
            with rec:
                video, seconds = _timed(generate, device)
            worst, limit_of_worst, passed = 0.0, TOLERANCE.get(dtype, 1e-5), True
            for step, layer, q, k in calls:
                P, lse = (x[list(rec.batch_items)] for x in (naive_probs(q, k), naive_lse(q, k)))
                for kind in JOINT_KINDS:
                    limit = bound(dtype, made_from_output(kind, output, JOINT_KINDS, rec.plan.tiles.method))
                    tokens = [0, rec.layout.token_index(1, 1, 2)]
                    lay = rec.layout
                    got = rec.get(kind, step, layer)
                    err = kind_error(got, P, kind, lay.text_len, lay.grid, tokens, lse, **SIZES)
                    passed &= err <= limit
                    if err / limit >= worst / limit_of_worst:
                        worst, limit_of_worst = err, limit
            same = bool(torch.equal(video, stock))
            promised = output == "stock" or device.type == "cpu"
            note = "" if promised else "another kernel than SDPA's on CUDA: last bits may differ"
            rows.append(
                Row(
                    part,
                    "all",
                    method,
                    output,
                    worst,
                    limit_of_worst,
                    same,
                    seconds / t_stock,
                    passed and (same or not promised),
                    note,
                )
            )
    return rows


def _spying(rec, inner, context: bool, calls: dict):
    """``inner`` (a recording's ``capture`` or ``capture_context``), keeping each call's q, k and key counts
    in ``calls``."""

    def spy(layer, query, key, *rest):
        counts = rest[2] if not context and len(rest) > 2 else None
        qk = (query.detach().float().cpu(), key.detach().float().cpu(), counts)
        calls.setdefault((rec.step, layer, rest[0] if context else "self"), []).append(qk)
        inner(layer, query, key, *rest)

    return spy


def _key_mask(counts, batch: int, keys: int):
    """``(B, S)`` kept keys from per-item counts (all kept when there are none)."""
    if counts is None:
        return torch.ones(batch, keys, dtype=torch.bool)
    return torch.arange(keys)[None] < torch.as_tensor(counts)[:, None]


def family_rows(spec, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Every method recording every kind of a family (all but CogVideoX, whose rows also cover the output
    modes) in a 2-step guided generation of each of its tiny pipelines: the self-attention kinds (under the
    family's key mask) and the cross-attention's, against the reference of the q and k the processors
    handed over, and the video against the stock one."""
    self_kinds = spec.kinds("self")
    rows = []
    for task in spec.tiny_tasks:
        pipe = spec.tiny_pipeline(task, dtype=dtype, num_heads=3, head_dim=16).to(device)  # Triton: D ≥ 16
        part = f"tiny {spec.family} {'i2v' if task == 'image-to-video' else 't2v'}"
        call = spec.tiny_call(pipe, task, torch.Generator().manual_seed(0), True)
        context = [k for k in spec.context_kinds if spec.context_kinds[k] == "text" or task == "image-to-video"]

        def generate(pipe=pipe, call=call):
            gen = torch.Generator(device).manual_seed(1)
            return pipe(generator=gen, num_inference_steps=2, output_type="pt", **call).frames

        generate()  # warm up
        stock, t_stock = _timed(generate, device)
        for method, skipped in _methods(device):
            if skipped:
                rows.append(Row(part, "all", method, "stock", None, None, None, None, None, skipped))
                continue
            kinds = self_kinds + tuple(context)
            rec = record(pipe, kinds=kinds, queries=[0, (1, 1, 2)], batch="all", heads="all", method=method, **SIZES)
            calls: dict = {}  # (step, layer, source) → [(q, k, counts) of each call]: as the family calls them
            for name in ("capture", "capture_context"):
                setattr(rec, name, _spying(rec, getattr(rec, name), name == "capture_context", calls))
            with rec:
                video, seconds = _timed(generate, device)
            limit, worst, lay = TOLERANCE.get(dtype, 1e-5), 0.0, rec.layout
            for (step, layer, source), found in calls.items():
                found = found[::-1]  # the guidance batch [uncond..., cond...]: a step's later call first
                q, k = torch.cat([q for q, _, _ in found]), torch.cat([k for _, k, _ in found])
                keep = torch.cat([_key_mask(n, len(q_), k.shape[2]) for q_, _, n in found])
                P, lse = naive_probs(q, k, key_mask=keep), naive_lse(q, k, key_mask=keep)
                for kind in self_kinds if source == "self" else [c for c in context if spec.source(c) == source]:
                    if source == "self":
                        tokens, end = [0, lay.token_index(1, 1, 2)], lay.text_position == "end"
                        got = rec.get(kind, step, layer)
                        err = kind_error(got, P, kind, lay.text_len, lay.grid, tokens, lse, end, **SIZES)
                    else:
                        ref = select(naive_context(P, lay.grid), rec.batch_items, "all")
                        err = (rec.get(kind, step, layer).double() - ref).abs().max().item()
                    worst = max(worst, err)
            same = bool(torch.equal(video, stock))
            rows.append(
                Row(part, "all", method, "stock", worst, limit, same, seconds / t_stock, worst <= limit and same)
            )
    return rows


# -- the report -----------------------------------------------------------------------------------------
def versions(device: torch.device) -> dict:
    import diffusers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "cogattn": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "triton": getattr(kernels.triton, "__version__", "not installed") if kernels.triton else "not installed",
        "python": platform.python_version(),
        "device": f"{device} ({name})",
    }


def run(device: str | None = None, dtype: str = "float32", seq_len: int = 1024, quick: bool = False) -> dict:
    """The self-test as a report: ``{"rows": [...], "passed": bool, "versions": {...}, "seconds": float}``.

    Args:
        device (`str | None`): ``"cuda"``, ``"cpu"``, ``"cuda:1"``, ...; default cuda when available.
        dtype (`str`, defaults to ``"float32"``): the model's dtype, ``"bfloat16"`` or ``"float16"`` too.
        seq_len (`int`, defaults to 1024): about the sequence length of the synthetic layer.
        quick (`bool`, defaults to `False`): the synthetic layer and the CogVideoX 1.0 pipeline only.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = DTYPES[dtype]
    t0 = time.perf_counter()
    rows = layer_rows(device, dt, seq_len) + pipeline_rows(device, dt, PIPELINES[:1] if quick else PIPELINES)
    if not quick:
        rows += [row for spec in FAMILIES if spec.family != "cogvideox" for row in family_rows(spec, device, dt)]
    checked = [r for r in rows if r.passed is not None]
    return {
        "rows": [asdict(r) for r in rows],
        "passed": bool(checked) and all(r.passed for r in checked),
        "versions": versions(device),
        "dtype": dtype,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _fmt(value, width: int, spec: str = "") -> str:
    if value is None:
        text = "-"
    elif isinstance(value, bool):
        text = "yes" if value else "NO"
    else:
        text = format(value, spec)
    return text.rjust(width)


def table(report: dict) -> str:
    """The report as a fixed-width table, one line per row."""
    head = (
        f"{'part':<14} {'kind':<14} {'method':<7} {'output':<7} {'max error':>10} {'tolerance':>10} "
        f"{'identical':>9} {'× stock':>8}  result"
    )
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        result = "skip" if r["passed"] is None else ("pass" if r["passed"] else "FAIL")
        cells = (
            f"{r['part']:<14} {r['kind']:<14} {r['method']:<7} {r['output']:<7} {_fmt(r['max_error'], 10, '.2e')} "
            f"{_fmt(r['tolerance'], 10, '.1e')} {_fmt(r['bit_identical'], 9)} {_fmt(r['time_x_stock'], 8, '.2f')}"
        )
        lines.append(f"{cells}  {result}{'  ' + r['note'] if r['note'] else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cogattn.selftest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the model's dtype (default float32)")
    ap.add_argument("--seq-len", type=int, default=1024, help="about the synthetic layer's sequence length")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--quick", action="store_true", help="the synthetic layer and one tiny pipeline only")
    args = ap.parse_args(argv)
    if args.seq_len < 16:
        ap.error(f"--seq-len {args.seq_len} is too short; use at least 16.")
    try:
        report = run(args.device, args.dtype, args.seq_len, args.quick)
    except (RuntimeError, ValueError) as err:  # an unknown or absent device
        print(f"selftest: {err}", file=sys.stderr)
        return 2
    print(table(report))
    v = report["versions"]
    failed = sum(1 for r in report["rows"] if r["passed"] is False)
    verdict = "all checks passed" if report["passed"] else f"{failed} check(s) FAILED"
    print(
        f"\ncogattn {v['cogattn']}, torch {v['torch']}, diffusers {v['diffusers']}, triton {v['triton']}, "
        f"{v['device']}, {report['dtype']}: {verdict} in {report['seconds']} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
