"""What the first call at a new shape costs per implementation, against a repeated call of that shape.

Some kernels build a plan per shape on first sight (torch's cuDNN attention caches one cuDNN graph per
(batch, heads, seqlen_q, seqlen_k, strides…)), which is invisible in fixed-shape benchmarks and decisive for
decode loops and serving with varying prompt lengths. For each implementation this calls `--count` shapes it has
never seen (lengths `base + i * step`), timing each first call and then a second call of the same shape (CUDA
events around the whole call, host work included), and prints medians.

    python benchmarks/new_shape_cost.py --impl nvidia.cudnn --impl nvidia.flash --impl torch.flex
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402


def first_and_repeat(impl: str, shapes: list[tuple[int, int]], args: argparse.Namespace,
                     device: torch.device) -> dict[str, Any]:
    firsts, repeats = [], []
    for sq, sk in shapes:
        q = torch.randn(args.batch, sq, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(args.batch, sk, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kw = dict(causal=True, causal_alignment="bottom_right")
        for bucket in (firsts, repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            opdispatch.attention(q, k, v, impl=impl, **kw)
            torch.cuda.synchronize(device)
            bucket.append((time.perf_counter() - start) * 1e3)
    return {"first_ms": statistics.median(firsts), "repeat_ms": statistics.median(repeats),
            "first_max_ms": max(firsts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", action="append", default=None)
    p.add_argument("--count", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    impls = args.impl or ["nvidia.cudnn", "nvidia.flash"]
    device = torch.device("cuda")
    kinds = {"decode (sq 1, sk 1000 + 8i)": [(1, 1000 + 8 * i) for i in range(args.count)],
             "prefill (sq = sk = 2000 + 8i)": [(2000 + 8 * i, 2000 + 8 * i) for i in range(args.count)]}
    rows = []
    for impl in impls:
        for kind, shapes in kinds.items():
            # the shapes of each (impl, kind) are new to that implementation: offset per impl
            offset = 4 * impls.index(impl)
            shifted = [(sq if sq == 1 else sq + offset, sk + offset) for sq, sk in shapes]
            try:
                row = {"impl": impl, "kind": kind, **first_and_repeat(impl, shifted, args, device)}
            except Exception as exc:  # not eligible here: reported in the row
                row = {"impl": impl, "kind": kind, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            rows.append(row)
    env = environment(device)
    lines = ["# First call at a new shape vs a repeated call", "",
             f"{env['device']}; torch {env['torch']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}; bf16, "
             f"batch {args.batch}, {args.heads}/{args.kv_heads} heads, d {args.head_dim}, causal bottom-right; "
             f"median of {args.count} new shapes; commit {env.get('commit')}", "",
             "| implementation | calls | first call at a new shape, ms (max) | repeated call, ms |", "|---|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['kind']} | {r['error'][:100]} | |")
        else:
            lines.append(f"| {r['impl']} | {r['kind']} | {r['first_ms']:.3f} ({r['first_max_ms']:.3f}) | "
                         f"{r['repeat_ms']:.3f} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
