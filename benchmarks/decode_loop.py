"""What a decode loop costs per call: a growing KV cache through `opdispatch.attention`, side by side with the
same call at a repeated signature, the kernels bound before the loop (the floor), and torch's own SDPA.

A model decoding `--steps` tokens calls attention with one query and a KV cache one key longer each step (k/v
are slices of a preallocated cache, as real caches are). Every variant runs the same number of calls; the
repeated-signature variant uses the loop's mean length, so kernel time is the same on average. Variants run
round-robin `--repeat` times; each figure is the median of the per-round means (µs per call, wall clock with the
device synchronised at the ends of a round: on a GPU machine with a small cache this is the host's launch cost).
Every pass starts after a full garbage collection: a full collection walks every object in the process (~100 ms
with torch imported) and is triggered by how many objects survived since the last one, so without it the first
pass to run pays for the objects the set-up left (the floor's 2000 plans), whichever variant that is. Collections
the loops' own allocations trigger stay in the figures; the first pass's full ones are counted and reported.

    python benchmarks/decode_loop.py                       # CUDA if present, else CPU
    python benchmarks/decode_loop.py --device cpu --steps 500 --out decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import opdispatch


class _CountDecisions(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "chose" in record.getMessage():
            self.lines += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else platform.processor() or platform.machine(),
                           "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    from opdispatch.base import _native

    env["fast_path"] = "compiled" if _native.status().active else "python"  # `opdispatch build` ran, or not
    # The GPU machine's copy of the repo may carry a stale .git: the caller can name the commit it sent.
    env["commit"] = os.environ.get("BENCH_COMMIT")
    if env["commit"]:
        return env
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent, check=False).stdout.strip() or None
    except OSError:
        env["commit"] = None
    return env


def build_variants(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Callable[[float], int]], dict]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    longest = args.start + args.steps
    cache_k = torch.randn(args.batch, longest, args.kv_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    cache_v = torch.randn(args.batch, longest, args.kv_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(args.batch, 1, args.heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    lengths = range(args.start + 1, longest + 1)
    mean = args.start + (args.steps + 1) // 2
    attention = opdispatch.attention
    decode = dict(causal=True, causal_alignment="bottom_right")
    info: dict[str, Any] = {}

    # Each loop stops at `deadline` (checked every 64 steps) and returns how many steps it ran: a variant that
    # is pathologically slow (a kernel that rebuilds a plan for every new length) is reported, not waited for.
    def grow(**kw: Any) -> Callable[[float], int]:
        def loop(deadline: float) -> int:
            for i, n in enumerate(lengths):
                attention(q, cache_k[:, :n], cache_v[:, :n], **kw)
                if i % 64 == 63 and time.perf_counter() > deadline:
                    return i + 1
            return len(lengths)
        return loop

    def fixed(**kw: Any) -> Callable[[float], int]:
        def loop(deadline: float) -> int:
            for _ in lengths:  # the same per-step views as the growing loop, of one length
                attention(q, cache_k[:, :mean], cache_v[:, :mean], **kw)
            return len(lengths)
        return loop

    def prebound(impl: str | None) -> Callable[[float], int]:
        # The floor: the same kernels with every length bound before the loop (no validation, no lookup), on the
        # same per-step views of the cache as the growing loop takes (a slice costs ~6 µs on a 2-core CPU's host:
        # views made before the loop would put that cost on the dispatch side of the comparison).
        plans = [opdispatch.plan(q, cache_k[:, :n], cache_v[:, :n], impl=impl, **decode) for n in lengths]
        info[f"prebound {impl or 'policy'}"] = plans[0].decision.chosen_id

        def loop(deadline: float) -> int:
            for i, (fn, n) in enumerate(zip(plans, lengths)):
                fn(q, cache_k[:, :n], cache_v[:, :n])
                if i % 64 == 63 and time.perf_counter() > deadline:
                    return i + 1
            return len(plans)
        return loop

    qt = q.transpose(1, 2)
    kts = [cache_k[:, :n].transpose(1, 2) for n in lengths]
    vts = [cache_v[:, :n].transpose(1, 2) for n in lengths]

    def torch_sdpa(deadline: float) -> int:
        for i, (k, v) in enumerate(zip(kts, vts)):
            F.scaled_dot_product_attention(qt, k, v, enable_gqa=args.heads != args.kv_heads)
            if i % 64 == 63 and time.perf_counter() > deadline:
                return i + 1
        return len(kts)

    variants: dict[str, Callable[[float], int]] = {
        "growing, attention(causal bottom-right)": grow(**decode),
        "growing, attention(not causal)": grow(),
        "repeated signature, attention(causal bottom-right)": fixed(**decode),
        "growing, kernels bound before the loop (floor)": prebound(None),
        "growing, torch SDPA": torch_sdpa,
    }
    if device.type == "cuda":
        for impl in args.pin:
            try:
                variants[f"growing, {impl} bound before the loop"] = prebound(impl)
            except Exception as exc:  # not eligible on this device: say so in the output, keep going
                info[f"prebound {impl}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    info["decision"] = opdispatch.explain(q, cache_k[:, :mean], cache_v[:, :mean], **decode).chosen_id
    return variants, info


def measure(variants: dict[str, Callable[[float], int]], device: torch.device, repeat: int,
            budget: float, before_round: Callable[[], None] | None = None) -> tuple[dict[str, list[float]],
                                                                                  dict[str, int]]:
    """Per-call µs of each variant per round; a round stops after `budget` seconds (steps run are recorded).
    `before_round` runs at the start of each round (the growing loops' fresh first passes)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    ran: dict[str, int] = {}
    for _ in range(repeat):
        if before_round is not None:
            before_round()
        for name, loop in variants.items():
            samples[name].append(_timed_pass(loop, device, budget, ran, name))
    return samples, ran


def _timed_pass(loop: Callable[[float], int], device: torch.device, budget: float, ran: dict[str, int],
                name: str, full_collections: dict[str, int] | None = None) -> float:
    """µs per call of one pass of `loop`, after a full collection (see the module docstring); the full
    collections the pass itself triggered are added to `full_collections[name]`."""
    gc.collect()
    collected = gc.get_stats()[2]["collections"]
    _sync(device)
    start = time.perf_counter()
    steps = loop(start + budget)
    _sync(device)
    elapsed = time.perf_counter() - start
    ran[name] = min(ran.get(name, steps), steps)
    if full_collections is not None:
        full_collections[name] = full_collections.get(name, 0) + gc.get_stats()[2]["collections"] - collected
    return elapsed / steps * 1e6


def _fresh_signatures(manager: Any) -> None:
    """Forget every exact signature and size template the per-call fast path remembered (the Python path's and the
    compiled front doors'), keeping the decisions: the next pass of a growing loop meets every length anew."""
    from opdispatch.base import _native

    manager.fast.clear()
    manager.size_generic.clear()
    _native.forget()


@contextlib.contextmanager
def _path_counts() -> Iterator[dict[str, int]]:
    """Counts, while open, of the slow path's branches a call takes once the exact-signature fast path missed:
    full validations, size-generic template hits (`_sized_reuse`), and binds (`_run_and_remember`: every full
    path and every template hit whose function could not be reused). A diagnosis of a first pass's cost."""
    from opdispatch.doors import _api

    counts = {"full validations": 0, "template hits": 0, "binds": 0}
    originals = {name: getattr(_api, name) for name in ("validate_attention", "_sized_reuse", "_run_and_remember")}
    labels = {"validate_attention": "full validations", "_sized_reuse": "template hits", "_run_and_remember": "binds"}

    def counting(name: str) -> Callable[..., Any]:
        original = originals[name]

        def counted(*a: Any, **kw: Any) -> Any:
            counts[labels[name]] += 1
            return original(*a, **kw)
        return counted

    for name in originals:
        setattr(_api, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(_api, name, original)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    manager = opdispatch.get_manager()
    variants, info = build_variants(args, device)
    # The first pass of every variant (the warm-up: decisions, kernel caches, per-length plans built on first
    # sight, within budget); the growing loops' first pass again at the start of every round, with every length
    # new to the per-call caches (`_fresh_signatures`; decisions kept, as after a warm-up at other sizes), then
    # once more untimed so the round's own passes stay later passes. One pass is one sample of a shared machine's
    # noise, and a round's samples are taken together: the median over the rounds is reported, with every sample.
    first_samples: dict[str, list[float]] = {}
    first_ran: dict[str, int] = {}
    full_collections: dict[str, int] = {}
    growing_attention = [name for name in variants if name.startswith("growing, attention")]

    def first_passes(names: list[str]) -> None:
        for name in names:
            first_samples.setdefault(name, []).append(
                _timed_pass(variants[name], device, args.budget, first_ran, name, full_collections))

    def fresh_first_passes() -> None:
        _fresh_signatures(manager)
        first_passes(growing_attention)
        for name in growing_attention:
            variants[name](math.inf)

    first_passes(list(variants))
    counter = _CountDecisions()
    log = logging.getLogger("opdispatch")
    log.addHandler(counter)
    previous = log.level
    log.setLevel(logging.INFO)
    opdispatch.get_manager().clear_cache()  # the counted loop starts with no decision cached
    made = manager.decisions_made
    with _path_counts() as paths:  # which path each new length took in this first pass
        variants["growing, attention(causal bottom-right)"](math.inf)
    decisions, lines = manager.decisions_made - made, counter.lines
    log.removeHandler(counter)
    log.setLevel(previous)
    samples, ran = measure(variants, device, args.repeat, args.budget, fresh_first_passes)
    first_pass = {name: (statistics.median(values), first_ran[name]) for name, values in first_samples.items()}
    medians = {name: statistics.median(values) for name, values in samples.items()}
    growing = medians["growing, attention(causal bottom-right)"]
    repeated = medians["repeated signature, attention(causal bottom-right)"]
    return {
        "environment": environment(device), "args": vars(args), "info": info,
        "per_call_us": medians, "samples_us": samples, "steps_run": ran, "first_pass_us_steps": first_pass,
        "first_pass_samples_us": first_samples,
        "growing_over_repeated": growing / repeated,
        "overhead_over_floor_us": growing - medians["growing, kernels bound before the loop (floor)"],
        "decisions_in_loop": decisions, "info_log_lines_in_loop": lines, "first_pass_paths": paths,
        "first_pass_over_repeated": {name: first_pass[name][0] / repeated for name in first_pass
                                     if name.startswith("growing, attention")},
        "first_pass_full_collections": full_collections,
    }


def markdown(result: dict[str, Any]) -> str:
    env, args = result["environment"], result["args"]
    lines = [f"# Decode loop: {args['steps']} steps, growing KV from {args['start']}",
             "",
             f"{env['device']}; torch {env['torch']}" + (f", CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}"
                                                         if "cuda" in env else "")
             + (f", triton {env['triton']}" if "triton" in env else "") + f"; fast path {env.get('fast_path')}"
             + f"; commit {env.get('commit')}",
             f"batch {args['batch']}, {args['heads']} q heads / {args['kv_heads']} kv heads, head_dim "
             f"{args['head_dim']}, {args['dtype']}; median of {args['repeat']} rounds",
             f"decision: {result['info']['decision']}; "
             + "; ".join(f"{k}: {v}" for k, v in result["info"].items() if k != "decision"),
             "",
             "| variant | µs per call | first pass (every length new), µs per call |", "|---|---:|---:|"]
    for name, value in result["per_call_us"].items():
        ran = result["steps_run"][name]
        note = "" if ran >= args["steps"] else f" (stopped after {ran} steps: over the {args['budget']:g} s budget)"
        first, first_steps = result["first_pass_us_steps"][name]
        first_note = "" if first_steps >= args["steps"] else f" ({first_steps} steps)"
        lines.append(f"| {name} | {value:.1f}{note} | {first:.1f}{first_note} |")
    lines += ["",
              f"- growing / repeated signature: **{result['growing_over_repeated']:.2f}x** (target <= 1.5x)",
              f"- growing, over the floor (kernels bound before the loop): {result['overhead_over_floor_us']:+.1f} µs",
              f"- decisions made in the {args['steps']}-step loop: **{result['decisions_in_loop']}**; INFO log "
              f"lines: {result['info_log_lines_in_loop']}",
              "- that loop's first pass, by path (opdispatch.doors._api): " + ", ".join(
                  f"{k} {v}" for k, v in result.get("first_pass_paths", {}).items())]
    if "first_pass_over_repeated" in result:
        lines.append(f"- first pass (every length new; median of {args['repeat'] + 1} first passes) / "
                     "repeated signature: " + "; ".join(
            f"{name.removeprefix('growing, ')}: **{ratio:.2f}x**"
            for name, ratio in result["first_pass_over_repeated"].items()) + " (target <= 1.3x)")
        lines.append("- full garbage collections during the first passes (each walks the whole heap): " + (", ".join(
            f"{name} {n}" for name, n in result["first_pass_full_collections"].items() if n) or "none"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--start", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--budget", type=float, default=4.0, help="seconds a variant's round may take before it stops")
    p.add_argument("--pin", action="append", default=None,
                   help="also time this implementation bound before the loop (CUDA; default nvidia.flash and "
                        "nvidia.cudnn)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here (and markdown beside it)")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.pin is None:
        args.pin = ["nvidia.flash", "nvidia.cudnn"]
    result = run(args)
    text = markdown(result)
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
