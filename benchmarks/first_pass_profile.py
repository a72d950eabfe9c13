"""Where a growing decode loop's first pass spends its host time: every step a new kv length, so every call misses
the exact-signature cache and takes the size-generic template branch (issue 31: 1.9x a repeated signature on an
H100, 1.4x on a 2-core CPU). Times a first pass and a repeated signature without the profiler, then profiles a
second first pass (other new lengths) with cProfile and prints the hottest functions and the time per file.

    python benchmarks/first_pass_profile.py --device cuda --dtype bf16      # the H100 figure's loop
    python benchmarks/first_pass_profile.py --heads 8 --kv-heads 2 --head-dim 64   # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time
from collections import defaultdict

import torch

import opdispatch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--start", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    longest = args.start + 2 * args.steps
    cache_k = torch.randn(args.batch, longest, args.kv_heads, args.head_dim, device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    q = torch.randn(args.batch, 1, args.heads, args.head_dim, device=device, dtype=dtype)
    kw = dict(causal=True, causal_alignment="bottom_right")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(lengths: range) -> float:
        sync()
        t0 = time.perf_counter()
        for n in lengths:
            opdispatch.attention(q, cache_k[:, :n], cache_v[:, :n], **kw)
        sync()
        return (time.perf_counter() - t0) / len(lengths) * 1e6

    opdispatch.attention(q, cache_k[:, :args.start], cache_v[:, :args.start], **kw)  # decide and bind once
    gc.collect()
    first = run(range(args.start + 1, args.start + args.steps + 1))
    fixed = args.start + args.steps
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opdispatch.attention(q, cache_k[:, :fixed], cache_v[:, :fixed], **kw)
    sync()
    repeated = (time.perf_counter() - t0) / args.steps * 1e6
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"batch {args.batch}, heads {args.heads}/{args.kv_heads}, d{args.head_dim}, {args.dtype}")
    print(f"first pass {first:.1f} µs per call; repeated signature {repeated:.1f} µs per call; "
          f"ratio {first / repeated:.2f}x; per new length +{first - repeated:.1f} µs")
    gc.collect()
    profile = cProfile.Profile()
    profile.enable()
    run(range(args.start + args.steps + 1, longest + 1))
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    per_file: dict[str, float] = defaultdict(float)
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        per_file[filename] += tottime
    print("own time per file, µs per call:")
    for filename, total in sorted(per_file.items(), key=lambda item: -item[1])[:15]:
        print(f"  {total / args.steps * 1e6:8.2f}  {filename}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
