"""What `compat.flash_attn.flash_attn_with_kvcache` costs per decode step against the raw kernel with its append.

A decode loop over a preallocated cache: each step appends one key/value per sequence at `cache_seqlens` and
attends over the grown cache, then the caller advances `cache_seqlens` in place (as flash-attn's own decode loops
do). Variants, the same work per step:

- ``flash_attn_with_kvcache``: our drop-in (its bound path after the first step);
- ``raw kernel + index_put_``: the implementation opdispatch picks for that call, bound before the loop
  (`opdispatch.plan`, called directly with its lengths), after an append by hand (`index_put_` of k and v);
- ``reference path``: our drop-in with every step validated and decided (what each step cost before the bound
  path), for comparison.

Variants run round-robin `--repeat` times over a loop of `--steps` steps from `--start` keys; each figure is the
median of the per-round means in µs per step (wall clock, the device synchronised at the ends of a round; on a GPU
the host runs ahead within a round, as a serving loop does).

    python benchmarks/kvcache_decode.py                                   # CPU, host-side index checks
    python benchmarks/kvcache_decode.py --kv-checks device                # CPU, the accelerators' device-side checks
    python benchmarks/kvcache_decode.py --device cuda --dtype bf16 --batch 8 --capacity 4096 --start 2048 \\
        --out kvcache_decode-h100.json                                    # the H100 figure
    python benchmarks/kvcache_decode.py --paged 256 ...                   # a paged cache (256 keys per page)

On a GPU the device-side check and the append run as one Triton kernel (two for a block table of more than
4096 entries), and a bad step's output is made NaN by another (core/opdispatch/compat/_kv_append.py);
``OPDISPATCH_KV_APPEND=torch`` measures the same check written with torch ops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import _sync, environment  # noqa: E402  (a sibling script)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    """The variants (each runs one decode loop of `args.steps` steps and resets its lengths) and what was picked."""
    import opdispatch
    from opdispatch.compat import flash_attn as fa

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    b, hq, hk, d, cap = args.batch, args.heads, args.heads_k, args.dim, args.capacity

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    if args.paged:
        per_seq = cap // args.paged
        k_cache, v_cache = randn(b * per_seq, args.paged, hk, d), randn(b * per_seq, args.paged, hk, d)
        table = torch.randperm(b * per_seq, device=device, generator=gen).view(b, per_seq).to(torch.int32)
        index_args: dict[str, Any] = {"block_table": table}
    else:
        k_cache, v_cache = randn(b, cap, hk, d), randn(b, cap, hk, d)
        table, index_args = None, {}
    qs = [randn(b, 1, hq, d) for _ in range(4)]  # a few distinct inputs, reused round-robin
    ks = [randn(b, 1, hk, d) for _ in range(4)]
    vs = [randn(b, 1, hk, d) for _ in range(4)]
    lens = torch.full((b,), args.start, dtype=torch.int32, device=device)
    start = lens.clone()
    rows = torch.arange(b, device=device).unsqueeze(1)
    step = torch.arange(1, device=device)
    kernel = opdispatch.plan(qs[0], k_cache, v_cache, seqused_k=lens + 1, block_table=table, causal=True,
                             causal_alignment="bottom_right")
    picked = {"implementation": kernel.decision.chosen_id}

    def ours() -> None:
        lens.copy_(start)
        for i in range(args.steps):
            j = i % 4
            fa.flash_attn_with_kvcache(qs[j], k_cache, v_cache, ks[j], vs[j], cache_seqlens=lens, causal=True,
                                       **index_args)
            lens.add_(1)

    def raw() -> None:
        lens.copy_(start)
        for i in range(args.steps):
            j = i % 4
            positions = lens.unsqueeze(1) + step
            if table is None:
                index = (rows, positions)
            else:
                index = (table.gather(1, positions // args.paged), positions % args.paged)
            k_cache.index_put_(index, ks[j])
            v_cache.index_put_(index, vs[j])
            kernel(qs[j], k_cache, v_cache, lens + 1, table)
            lens.add_(1)

    def reference() -> None:
        lens.copy_(start)
        for i in range(args.steps):
            j = i % 4
            fa._kvcache_reference(None, qs[j], k_cache, v_cache, ks[j], vs[j], None, None, lens, None, None, table,
                                  None, True, (-1, -1), 0.0, True, None, False)
            lens.add_(1)

    variants = {"flash_attn_with_kvcache": ours, "raw kernel + index_put_": raw}
    if not args.no_reference:
        variants["reference path"] = reference
    return variants, picked


def measure(variants: dict[str, Callable[[], None]], device: torch.device, repeat: int,
            steps: int) -> dict[str, float]:
    """Median over `repeat` round-robin rounds of each variant's µs per step (one warm-up round first)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeat + 1):
        for name, loop in variants.items():
            _sync(device)
            began = time.perf_counter()
            loop()
            _sync(device)
            if round_:
                times[name].append((time.perf_counter() - began) / steps * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def profile_loops(variants: dict[str, Callable[[], None]], device: torch.device, out: Path) -> None:
    """cProfile of one loop of each variant, the top functions by own time: where a step's host time goes."""
    import cProfile
    import io
    import pstats

    texts = []
    for name, loop in variants.items():
        _sync(device)
        profile = cProfile.Profile()
        profile.enable()
        loop()
        _sync(device)
        profile.disable()
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(25)
        texts.append(f"## {name}\n\n{stream.getvalue()}")
    out.write_text("\n".join(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 else")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=1024, help="keys per sequence the cache holds")
    parser.add_argument("--start", type=int, default=256, help="keys in each sequence when the loop starts")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--paged", type=int, default=0, help="keys per page (0: a dense cache)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--kv-checks", choices=("default", "device"), default="default",
                        help="device: the accelerators' device-side index checks on CPU too")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference-path variant")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, help="write the results as JSON, and a Markdown table beside it")
    parser.add_argument("--profile", type=Path, help="write a cProfile table of one loop of each variant here")
    args = parser.parse_args()
    if args.kv_checks == "device":
        os.environ["OPDISPATCH_KV_CHECKS"] = "device"
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("fp32" if device.type == "cpu" else "bf16")
    if args.start + args.steps > args.capacity or (args.paged and args.capacity % args.paged):
        parser.error("--start + --steps must fit --capacity, and --capacity be a multiple of --paged")
    variants, picked = build(args, device)
    result = measure(variants, device, args.repeat, args.steps)
    if args.profile:
        profile_loops(variants, device, args.profile)
    from opdispatch.compat.flash_attn import check_pending_errors

    check_pending_errors()  # every step was valid
    raw = result["raw kernel + index_put_"]
    checks = "device-side" if args.kv_checks == "device" or device.type != "cpu" else "host"
    if checks == "device-side":
        from opdispatch.compat import _kv_append

        width = args.capacity // args.paged if args.paged else 0
        fused = _kv_append.available(device, args.batch, 1, width, False)
        single = args.batch * width <= _kv_append.SINGLE_MAX_TABLE
        checks += (", torch ops" if not fused else ", fused with the append into one Triton kernel" if single
                   else ", fused with the append into two Triton kernels")
        checks += ", a bad step made NaN by another" if fused else ""
    shape = (f"batch {args.batch}, heads {args.heads}/{args.heads_k}, dim {args.dim}, "
             f"{'paged ' + str(args.paged) + ' keys/page' if args.paged else 'dense'} cache of {args.capacity}, "
             f"keys {args.start}..{args.start + args.steps}, {args.dtype}")
    lines = [f"# flash_attn_with_kvcache decode step vs the raw kernel with its append ({args.device})", "",
             f"{shape}; {args.steps} steps, median of {args.repeat} rounds; index checks: {checks}; "
             f"kernel: {picked['implementation']}", "",
             "| variant | µs per step | vs raw kernel + index_put_ |", "|---|---|---|"]
    lines += [f"| {name} | {us:.1f} | {us / raw:.2f}x |" for name, us in result.items()]
    env = environment(device)
    lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "checks": checks, "picked": picked, "us_per_step": result,
                                        "ratio_to_raw": {k: v / raw for k, v in result.items()},
                                        "environment": env}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
