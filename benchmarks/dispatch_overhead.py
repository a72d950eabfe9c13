"""Per-call cost of opdispatch's dispatch: direct kernel vs dispatched vs planned, on tiny to small bhsd calls.

    python benchmarks/dispatch_overhead.py [--device cpu|cuda] [--repeat 21] [--out FILE.md]

Rows, for each size (batch, heads, seq, head_dim), all in layout ``bhsd`` and float32 (CPU) / bf16 (CUDA):
  direct     the chosen kernel called directly: on the CPU torch._scaled_dot_product_flash_attention_for_cpu,
             on CUDA the chosen implementation's run() on a call validated once up front
  impl.run   the chosen implementation's run() on a call validated once (adapter cost, no validation)
  pinned     opdispatch.attention(..., layout="bhsd", impl=<chosen>)
  policy     opdispatch.attention(..., layout="bhsd")  (the policy's choice, cached after the first call)
  plan       opdispatch.plan(q, k, v, layout="bhsd")(q, k, v), when opdispatch has plan()
Each figure is the median over `--repeat` timeit repeats of the per-call time; a repeat runs enough calls to last
~20 ms, and the variants take turns within each repeat. On CUDA each repeat ends with torch.cuda.synchronize(), so a figure is max(host, device) time per call.
Overhead = figure - direct.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch

import opdispatch

SIZES_CPU = [(1, 1, 1, 8), (1, 1, 16, 32), (1, 8, 64, 64), (2, 8, 256, 64)]
SIZES_CUDA = [(1, 1, 1, 64), (1, 8, 128, 64), (4, 16, 1024, 128), (8, 32, 4096, 128)]


def _runner(fn: Callable[[], Any], device: torch.device) -> Callable[[int], None]:
    cuda = device.type == "cuda"

    def run(n: int) -> None:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize(device)

    return run


def _calibrate(run: Callable[[int], None], target: float) -> int:
    """Calls per repeat so that one repeat lasts about `target` seconds."""
    run(20)
    number = 1
    while True:
        elapsed = timeit.timeit(lambda: run(number), number=1)
        if elapsed >= target or number >= 1_000_000:
            return number
        number = max(number * 2, int(number * target / max(elapsed, 1e-9)))


def per_call_seconds(fns: dict[str, Callable[[], Any]], device: torch.device, repeat: int,
                     target: float = 0.02) -> dict[str, float]:
    """Median per-call seconds of each function over `repeat` repeats.

    The functions take turns within every repeat (round-robin), so a burst of load on a shared machine hits
    them all alike rather than one of them.
    """
    runs = {name: _runner(fn, device) for name, fn in fns.items()}
    numbers = {name: _calibrate(run, target) for name, run in runs.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, run in runs.items():
            n = numbers[name]
            samples[name].append(timeit.timeit(lambda: run(n), number=1) / n)
    return {name: statistics.median(values) for name, values in samples.items()}


def environment(device: torch.device) -> list[str]:
    info = opdispatch.get_manager().device_info(device)
    lines = [f"device: {info.describe()}",
             f"opdispatch {opdispatch.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
             f"{platform.machine()}, torch threads {torch.get_num_threads()}, os.cpu_count() {os.cpu_count()}"]
    if device.type == "cuda":
        lines.append(f"CUDA {torch.version.cuda or torch.version.hip}, cuDNN {torch.backends.cudnn.version()}, "
                     f"{torch.cuda.get_device_name(device)}")
    lines.append(f"opdispatch.plan: {'available' if hasattr(opdispatch, 'plan') else 'not available yet'}")
    if hasattr(os, "getloadavg"):
        lines.append("load average before the run: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return lines


def bench_size(size: tuple[int, int, int, int], device: torch.device, repeat: int) -> dict[str, float]:
    b, h, s, d = size
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    decision = opdispatch.explain(q, k, v, layout="bhsd")
    impl = decision.chosen
    assert impl is not None, str(decision)
    call = opdispatch.validate_attention(q, k, v, layout="bhsd")
    scale = call.scale
    fns: dict[str, Callable[[], Any]] = {}
    if device.type == "cpu" and impl.id == "cpu.flash":
        kernel = torch._scaled_dot_product_flash_attention_for_cpu
        fns["direct"] = lambda: kernel(q, k, v, 0.0, False, scale=scale)
    else:
        fns["direct"] = lambda: impl.run(call)
    fns["impl.run"] = lambda: impl.run(call)
    impl_id = impl.id
    attention = opdispatch.attention
    fns["pinned"] = lambda: attention(q, k, v, layout="bhsd", impl=impl_id)
    fns["policy"] = lambda: attention(q, k, v, layout="bhsd")
    if hasattr(opdispatch, "plan"):
        planned = opdispatch.plan(q, k, v, layout="bhsd")
        fns["plan"] = lambda: planned(q, k, v)
    out = per_call_seconds(fns, device, repeat)
    out["impl"] = impl_id  # type: ignore[assignment]
    return out


def markdown(device: torch.device, sizes: list[tuple[int, int, int, int]], repeat: int) -> str:
    cols = ["direct", "impl.run", "pinned", "policy", "plan"]
    lines = [f"# opdispatch dispatch overhead ({device.type})", ""] + [f"- {x}" for x in environment(device)] + [
        f"- median of {repeat} timeit repeats, per call; layout bhsd, "
        f"{'float32' if device.type == 'cpu' else 'bfloat16'}; overhead = time - direct", "",
        "| size (b,h,s,d) | impl | " + " | ".join(f"{c} µs" for c in cols)
        + " | pinned - direct | policy - direct | plan - direct |",
        "|---|---|" + "--:|" * (len(cols) + 3)]
    for size in sizes:
        r = bench_size(size, device, repeat)
        direct = r["direct"]

        def us(name: str) -> str:
            return f"{r[name] * 1e6:.2f}" if name in r else "n/a"

        def over(name: str) -> str:
            if name not in r:
                return "n/a"
            delta = (r[name] - direct) * 1e6
            return f"{delta:+.2f} µs ({(r[name] / direct - 1) * 100:+.1f}%)"

        lines.append(f"| {size} | {r['impl']} | " + " | ".join(us(c) for c in cols)
                     + f" | {over('pinned')} | {over('policy')} | {over('plan')} |")
        print(lines[-1], file=sys.stderr)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", action="append", default=None,
                        help="cpu and/or cuda (repeatable; default: cpu, plus cuda when available)")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--out", default=None, help="also write the markdown here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: dispatch cost is single-threaded, and a thread pool "
                        "waking up on a busy machine drowns microseconds in noise; 0 keeps torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    parts = []
    for name in devices:
        device = torch.device(name)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        parts.append(markdown(device, SIZES_CUDA if device.type == "cuda" else SIZES_CPU, args.repeat))
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
