"""What ``storage_dtype`` does to each kind: the worst error of a record kept in float16 or bfloat16 against the
float32 result it was made from (docs/streaming.md's table).

Captures every self-attention kind of one synthetic layer (random q and k scaled ×2, peaked rows like trained
attention; 2 heads of 64, text and a latent grid) with the engine, then stores each result as a run folder would
(the kind's ``stored_dtype``) and reads it back. Per kind and dtype it prints the dtype kept, the largest relative
error over entries at or above float16's smallest normal number 2⁻¹⁴ ≈ 6.1e-5 and over those from 1e-6 to it
(float16's subnormals: absolute steps of 6e-8), the share of nonzero entries that became 0, and, for a kind kept
in another dtype, what the storage dtype itself would have done (``top_p``: the counts it moves and by how many
keys, ``topk``'s and ``frame_max``'s key indices alike; else the largest relative error).

    python benchmarks/storage_error.py                     # S = 32 + 5·16·24 = 1,952
    python benchmarks/storage_error.py --frames 3 --height 8 --width 12   # smaller
"""

from __future__ import annotations

import argparse

import torch

from cogattn.exact.engine import capture
from cogattn.exact.planner import plan_tiles
from cogattn.exact.reducers import REDUCERS
from cogattn.layout import TokenLayout
from cogattn.models.cogvideox import SPEC

SMALLEST_NORMAL = 2.0**-14  # float16's; below it, float16 rounds to multiples of 2⁻²⁴


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    layout = TokenLayout(args.text, args.frames, args.height, args.width)
    H, S, D = 2, layout.seq_len, 64
    q, k, v = (torch.randn(H, S, D) * 2 for _ in range(3))
    sizes = dict(block_size=128, topk=8, tile_shape=(2, 4, 4), top_p=(0.5, 0.9, 0.99, 1.0))
    sizes["patterns"] = ("spatial", "temporal", "window:1")
    kinds = [k for k in SPEC.kinds() if k != "query"]
    reducers = [REDUCERS[kd](layout, H, False, **sizes) for kd in kinds]
    outs = [torch.zeros(r.shape(1)[1:]) for r in reducers]
    capture(q, k, reducers, outs, plan_tiles(reducers, S, H, D, 2**30, "rows", "cpu"), value=v)
    print(f"S = {S}: error of each kind's record against its float32 result")
    print("| kind | storage | kept as | rel. error ≥ 6.1e-5 | 1e-6 to 6.1e-5 | nonzero → 0 | in the storage dtype |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r, x in zip(reducers, outs):
        for storage in (torch.float16, torch.bfloat16):
            kept = r.stored_dtype(storage, r.mean_heads)
            back = x.to(kept).float()
            err = ((back - x).abs() / x.abs()).nan_to_num(0.0)
            big, small = x.abs() >= SMALLEST_NORMAL, (x.abs() >= 1e-6) & (x.abs() < SMALLEST_NORMAL)
            worst = [f"{err[m].max().item():.2g}" if m.any() else "–" for m in (big, small)]
            lost = ((back == 0) & (x != 0)).sum().item() / max(1, (x != 0).sum().item())
            name, instead = str(kept).removeprefix("torch."), ""
            if kept != storage:  # what keeping it in the storage dtype would do
                plain = x.to(storage).float()
                if r.kind in ("top_p", "topk", "frame_max"):  # counts; key indices
                    a, b = (x, plain) if r.kind == "top_p" else (x[..., 1], plain[..., 1])
                    what = "counts" if r.kind == "top_p" else "key indices"
                    moved = (a != b).double().mean().item()
                    instead = f"{moved:.0%} of {what} moved, by up to {(a - b).abs().max():g}"
                else:
                    instead = f"{((plain - x).abs() / x.abs()).nan_to_num(0.0).max().item():.2g}"
            print(f"| {r.kind} | {str(storage)[6:]} | {name} | {worst[0]} | {worst[1]} | {lost:.1%} | {instead} |")


if __name__ == "__main__":
    main()
