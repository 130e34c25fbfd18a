"""``python -m cogattn.selftest``: check cogattn on this machine, with its own kernels.

Runs every kind with every method and every ``layer_output`` mode, on a synthetic attention layer and
on the tiny random pipelines (CogVideoX 1.0, 1.5 and image-to-video; and every other registered family's,
every method, and the tiny Wan under every attention backend installed), against the naive float64
reference (:mod:`cogattn.reference`); checks that the video is bit-identical to stock where that is
promised (the default output everywhere, the opt-in outputs on the CPU in float32:
:func:`cogattn.exact.checks.output_identical`); and times capture against the
stock layer. ``--quick``: the synthetic layer, the tiny CogVideoX 1.0 under every method and output mode,
and every other family's tiny pipelines under row tiles. A tiny pipeline that needs a package that is not
installed (none of cogattn's dependencies) is a skipped row naming it; ``--strict`` fails it instead
(every family runs on a plain ``pip install cogattn``, which CI checks with it). Prints a table and a
one-line verdict with the versions, and exits 0 when every row that ran passes, 1 otherwise. ``--json
PATH`` writes the same report, to attach to a bug report.

    python -m cogattn.selftest                       # cuda when available, else cpu; float32
    python -m cogattn.selftest --quick               # every family under row tiles, in less time
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
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .exact import kernels
from .exact.attention import attention_joint, attention_with_lse, fused_lse_supported
from .exact.checks import OUTPUT_RTOL, TOLERANCE, bound, made_from_output, output_identical
from .exact.engine import capture, multi_key_indicator
from .exact.planner import plan_tiles
from .exact.reducers import REDUCERS
from .layout import TokenLayout
from .models import FAMILIES
from .reference import kind_error, naive_lse, naive_probs
from .selftest_pipelines import (
    JOINT_KINDS,
    PATTERNS,
    PIPELINES,
    Row,
    backend_rows,
    family_rows,
    methods,
    pipeline_rows,
    timed,
)
from .version import __version__

__all__ = ["Row", "main", "run"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the kinds the fast methods serve (the others take row tiles: the kernels write them under triton), and those the
# output's lse serves
POOLED = ("frame", "video_to_text", "entropy", "received", "query_frame", "block", "tile")
FROM_LSE = ("video_to_text", "received")  # run from the output call's lse alone: no float32 pass gives one


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
    lse_ref = naive_lse(q.float().cpu()[None], k.float().cpu()[None])  # not the kernels' lse, which rows below test
    part = f"layer S={S:,}"
    stock, t_stock = timed(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None]), device)
    _, t_stock = timed(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None]), device)  # warm
    tol = TOLERANCE.get(dtype, 1e-5)

    sizes = dict(block_size=64, patterns=PATTERNS)
    v64 = v.double().cpu()[None]  # pattern_error's reference folds the values

    def error(kind: str, got: torch.Tensor) -> float:
        got = REDUCERS[kind].unpack(got.cpu()[None])
        return kind_error(got, P, kind, T, layout.grid, queries.tolist(), lse_ref, v=v64, **sizes)

    def run(kinds, method, lse=None, sums=None):
        reducers = [REDUCERS[kd](layout, heads, False, queries, **sizes) for kd in kinds]
        plan = plan_tiles(reducers, S, heads, head_dim, 2**30, method, device)
        outs = [torch.zeros(r.shape(1)[1:], device=device) for r in reducers]
        _, seconds = timed(lambda: capture(q, k, reducers, outs, plan, lse=lse, sums=sums, value=v), device)
        return outs, seconds

    rows = []
    for method, skipped in methods(device):
        kinds = list(JOINT_KINDS) if method in ("rows", "triton") else list(POOLED)  # triton: the kernels' rows too
        for kind in kinds:
            if skipped:
                rows.append(Row(part, kind, method, "stock", None, tol, None, None, None, skipped))
                continue
            (got,), seconds = run([kind], method)
            err = error(kind, got)
            rows.append(Row(part, kind, method, "stock", err, tol, None, seconds / t_stock, err <= tol))
    if fused_lse_supported(device):
        out, lse = attention_with_lse(q[None], k[None], v[None])
        if lse is None:  # no fused kernel returns it here (CUDA, float32): layer_output="lse" makes the stock call
            note = f"no fused kernel returns the lse for {str(dtype).removeprefix('torch.')} here: the stock call runs"
            rows.append(Row(part, "output", "-", "lse", None, None, None, None, None, note))
        else:
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
    promised = output_identical(mode, device, dtype)
    rows = [Row(part, "output", "-", mode, rel, rtol, same, None, rel <= rtol and (same or not promised))]
    method = "joint" if mode == "joint" else "sdpa"
    kinds = list(POOLED) if mode == "joint" else list(FROM_LSE)
    outs, seconds = run(kinds, method, lse=lse[0], sums=None if sums is None else sums[0])
    for kind, got in zip(kinds, outs):
        limit = bound(dtype, made_from_output(kind, mode, kinds, method))  # from the output call's, or not
        err = error(kind, got)
        rows.append(Row(part, kind, method, mode, err, limit, None, seconds / t_stock, err <= limit))
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


def run(
    device: str | None = None, dtype: str = "float32", seq_len: int = 1024, quick: bool = False, strict: bool = False
) -> dict:
    """The self-test as a report: ``{"rows": [...], "passed": bool, "versions": {...}, "seconds": float}``.

    Args:
        device (`str | None`): ``"cuda"``, ``"cpu"``, ``"cuda:1"``, ...; default cuda when available.
        dtype (`str`, defaults to ``"float32"``): the model's dtype, ``"bfloat16"`` or ``"float16"`` too.
        seq_len (`int`, defaults to 1024): about the sequence length of the synthetic layer.
        quick (`bool`, defaults to `False`): the synthetic layer, the CogVideoX 1.0 pipeline under every method,
            and every other family's tiny pipelines under row tiles only.
        strict (`bool`, defaults to `False`): a tiny pipeline that needs a package not installed fails
            instead of being skipped.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:  # an absent device fails here, before any part runs
        torch.empty(0, device=device)
    except AssertionError as err:  # a torch built without CUDA asserts
        raise RuntimeError(f"device {device} is not available here: {err}") from None
    dt = DTYPES[dtype]
    t0 = time.perf_counter()
    parts = [("layer", layer_rows, (device, dt, seq_len), {})]
    parts.append(("tiny cogvideox", pipeline_rows, (device, dt, PIPELINES[:1] if quick else PIPELINES), {}))
    for spec in [spec for spec in FAMILIES if spec.family != "cogvideox"]:
        parts.append((f"tiny {spec.family}", family_rows, (spec, device, dt), dict(quick=quick, strict=strict)))
    parts += [] if quick else [("backends", backend_rows, (device, dt), {})]
    rows = []
    with tqdm(parts, desc="selftest", unit="part", file=sys.stderr, disable=None) as bar:  # a terminal's alone
        for part, rows_of, args, kwargs in bar:
            bar.set_postfix_str(part)
            rows += _guarded(part, rows_of, *args, **kwargs)
    checked = [r for r in rows if r.passed is not None]  # the verdict is over what ran: a skip is no pass
    return {
        "rows": [asdict(r) for r in rows],
        "passed": bool(checked) and all(r.passed for r in checked),
        "versions": versions(device),
        "dtype": dtype,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _guarded(part: str, rows_of, *args, **kwargs) -> list[Row]:
    """``rows_of(*args, **kwargs)``, or where it raises, one failed row naming the error and the line of cogattn
    that raised it (the whole traceback on stderr): a broken part does not hide the others' results."""
    try:
        return rows_of(*args, **kwargs)
    except Exception as err:
        traceback.print_exc()
        frames = traceback.extract_tb(err.__traceback__)
        where = ([f for f in frames if "cogattn" in Path(f.filename).parts] or frames)[-1]
        note = f"{type(err).__name__}: {err} ({Path(where.filename).name}:{where.lineno})"
        return [Row(part, "-", "-", "-", None, None, None, None, False, note)]


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
    w = max([14] + [len(r["part"]) for r in report["rows"]])  # "tiny hunyuan_video_framepack i2v" is long
    head = (
        f"{'part':<{w}} {'kind':<14} {'method':<7} {'output':<7} {'max error':>10} {'tolerance':>10} "
        f"{'identical':>9} {'× stock':>8}  result"
    )
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        result = "skip" if r["passed"] is None else ("pass" if r["passed"] else "FAIL")
        cells = (
            f"{r['part']:<{w}} {r['kind']:<14} {r['method']:<7} {r['output']:<7} {_fmt(r['max_error'], 10, '.2e')} "
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
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the synthetic layer, CogVideoX 1.0 under every method, the other families under row tiles",
    )
    ap.add_argument(
        "--strict", action="store_true", help="fail, not skip, a tiny pipeline that needs a package not installed"
    )
    args = ap.parse_args(argv)
    if args.seq_len < 16:
        ap.error(f"--seq-len {args.seq_len} is too short; use at least 16.")
    try:
        report = run(args.device, args.dtype, args.seq_len, args.quick, args.strict)
    except (RuntimeError, ValueError) as err:  # an unknown or absent device
        print(f"selftest: {err}", file=sys.stderr)
        return 2
    print(table(report))
    v = report["versions"]
    failed = sum(1 for r in report["rows"] if r["passed"] is False)
    ran = sum(1 for r in report["rows"] if r["passed"] is not None)
    skipped = len(report["rows"]) - ran
    verdict = "all checks passed" if report["passed"] else f"{failed} check(s) FAILED"
    verdict += f" ({ran} checked, {skipped} skipped)"
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
