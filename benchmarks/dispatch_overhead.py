"""Per-call cost of opdispatch's dispatch: direct kernel vs dispatched vs planned, on tiny to small bhsd calls.

    python benchmarks/dispatch_overhead.py [--device cpu|cuda] [--repeat 61] [--out FILE.md]

Each front door runs compiled where `opdispatch build` has built the extension (the header says which); the
"(py)" columns call the same door's Python path in the same rounds.

Rows, for each size (batch, heads, seq, head_dim), all in layout ``bhsd`` and float32 (CPU) / bf16 (CUDA):
  direct     the chosen kernel called directly: the aten op the implementation binds (cpu.flash, nvidia.flash,
             nvidia.cudnn) with the fewest arguments that mean the call (defaults left out, as the binding does),
             else the implementation's run() on a call validated once up front
  floor      a do-nothing Python function with exactly `opdispatch.attention`'s signature that calls the plan:
             what merely entering a function with that signature costs, before any key is built
  impl.run   the chosen implementation's run() on a call validated once (adapter cost, no validation)
  pinned     opdispatch.attention(..., layout="bhsd", impl=<chosen>)
  policy     opdispatch.attention(..., layout="bhsd")  (the policy's choice, cached after the first call)
  plan       opdispatch.plan(q, k, v, layout="bhsd")(q, k, v)
Each figure is the median over `--repeat` rounds of the per-call time; a round runs enough calls of each variant
to last ~20 ms, the variants taking turns (round-robin) so a burst of load hits them all alike. Overheads are the
median over rounds of (variant - direct) within the same round, which cancels most of that load. On CUDA each
round ends with torch.cuda.synchronize(), so a figure is max(host, device) time per call.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch

import opdispatch
from opdispatch.base import _native

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
                     target: float = 0.02) -> dict[str, list[float]]:
    """Per-call seconds of each function in each of `repeat` rounds (round-robin within a round)."""
    runs = {name: _runner(fn, device) for name, fn in fns.items()}
    numbers = {name: _calibrate(run, target) for name, run in runs.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeat):
        names = list(runs) if i % 2 == 0 else list(runs)[::-1]  # alternate, so no variant always runs first
        for name in names:
            n = numbers[name]
            run = runs[name]
            samples[name].append(timeit.timeit(lambda: run(n), number=1) / n)
    return samples


def overheads(samples: dict[str, list[float]], base: str = "direct") -> dict[str, float]:
    """Median over rounds of (variant - base) measured in the same round."""
    return {name: statistics.median(a - b for a, b in zip(values, samples[base]))
            for name, values in samples.items()}


def signature_floor(target: Callable[..., Any]) -> Callable[..., Any]:
    """A function with exactly `opdispatch.attention`'s parameters (no annotations) whose body calls `target`."""
    sig = inspect.signature(opdispatch.attention)
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                        return_annotation=inspect.Signature.empty)
    namespace: dict[str, Any] = {"target": target}
    exec(f"def floor{plain}:\n    return target(q, k, v)\n", namespace)  # noqa: S102 - our own signature
    return namespace["floor"]  # type: ignore[no-any-return]


def direct_kernel(impl_id: str, call: Any) -> Callable[[], Any] | None:
    """The aten op a plain dense bhsd call of `impl_id` binds, called directly with the fewest arguments that mean
    the same call (trailing defaults and torch's own default scale left out, as the implementations bind it: each
    explicit argument costs torch's parser time); None for other implementations."""
    q, k, v, causal, scale = call.q, call.k, call.v, call.causal, call.scale
    own_scale = scale == 1.0 / math.sqrt(call.head_dim)
    if impl_id == "cpu.flash":
        cpu = torch._scaled_dot_product_flash_attention_for_cpu
        if own_scale:
            return (lambda: cpu(q, k, v, 0.0, True)[0]) if causal else (lambda: cpu(q, k, v)[0])
        return (lambda: cpu(q, k, v, 0.0, True, scale=scale)[0]) if causal else (lambda: cpu(q, k, v, scale=scale)[0])
    if impl_id == "nvidia.flash":
        flash = torch._scaled_dot_product_flash_attention
        if own_scale:
            return (lambda: flash(q, k, v, 0.0, True)[0]) if causal else (lambda: flash(q, k, v)[0])
        return ((lambda: flash(q, k, v, 0.0, True, scale=scale)[0]) if causal
                else (lambda: flash(q, k, v, scale=scale)[0]))
    if impl_id == "nvidia.cudnn":
        cudnn, need_lse = torch._scaled_dot_product_cudnn_attention, call.requires_grad
        if own_scale:
            return ((lambda: cudnn(q, k, v, None, need_lse, 0.0, True)[0]) if causal
                    else (lambda: cudnn(q, k, v, None, need_lse)[0]))
        return ((lambda: cudnn(q, k, v, None, need_lse, 0.0, True, scale=scale)[0]) if causal
                else (lambda: cudnn(q, k, v, None, need_lse, scale=scale)[0]))
    return None


def environment(device: torch.device) -> list[str]:
    info = opdispatch.get_manager().device_info(device)
    lines = [f"device: {info.describe()}", f"fast path: {_native.status().describe()}",
             f"opdispatch {opdispatch.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
             f"{platform.machine()}, torch threads {torch.get_num_threads()}, os.cpu_count() {os.cpu_count()}"]
    if device.type == "cuda":
        lines.append(f"CUDA {torch.version.cuda or torch.version.hip}, cuDNN {torch.backends.cudnn.version()}, "
                     f"{torch.cuda.get_device_name(device)}")
    if hasattr(os, "getloadavg"):
        lines.append("load average before the run: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return lines


def _inputs(size: tuple[int, int, int, int], device: torch.device) -> tuple[Any, ...]:
    """Seeded bhsd q, k, v of `size` (float32 on the CPU, bf16 elsewhere), their validated call and the plan."""
    b, h, s, d = size
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    return q, k, v, opdispatch.validate_attention(q, k, v, layout="bhsd"), opdispatch.plan(q, k, v, layout="bhsd")


def bench_size(size: tuple[int, int, int, int], device: torch.device, repeat: int) -> dict[str, Any]:
    """Per-call medians (seconds) and overheads over direct (seconds) of every variant for one size."""
    q, k, v, call, planned = _inputs(size, device)
    impl = planned.decision.chosen
    impl_id = impl.id
    attention = opdispatch.attention
    from opdispatch.compat import scaled_dot_product_attention as compat_sdpa, torch_sdpa
    from opdispatch.compat.flash_attn import flash_attn_func

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # flash-attn's (batch, seq, heads, dim), as views
    attention_py, compat_sdpa_py, flash_attn_func_py = (_native.python_of(f) for f in (attention, compat_sdpa,
                                                                                        flash_attn_func))

    floor = signature_floor(planned)
    fns: dict[str, Callable[[], Any]] = {
        "direct": direct_kernel(impl_id, call) or (lambda: impl.run(call)),
        "floor": lambda: floor(q, k, v, layout="bhsd", impl=impl_id),
        "impl.run": lambda: impl.run(call),
        "pinned": lambda: attention(q, k, v, layout="bhsd", impl=impl_id),
        "policy": lambda: attention(q, k, v, layout="bhsd"),
        "plan": lambda: planned(q, k, v),
        "compat.sdpa": lambda: compat_sdpa(q, k, v),
        "compat.flash_attn": lambda: flash_attn_func(qt, kt, vt),
        "policy bshd": lambda: attention(qt, kt, vt),  # the per-call path on flash_attn_func's very tensors
        "torch sdpa": lambda: torch_sdpa(q, k, v),
        # The Python front doors behind the compiled ones (the same functions where the extension is not built).
        "policy (py)": lambda: attention_py(q, k, v, layout="bhsd"),
        "compat.sdpa (py)": lambda: compat_sdpa_py(q, k, v),
        "compat.flash_attn (py)": lambda: flash_attn_func_py(qt, kt, vt),
    }
    samples = per_call_seconds(fns, device, repeat)
    return {"impl": impl_id, "median": {n: statistics.median(x) for n, x in samples.items()},
            "over": overheads(samples)}


# What each group of fields of the per-call key costs: a lookup keyed on the flags plus one group, against
# the same lookup on the flags alone. Reads as opdispatch.attention's fast path writes them.
KEY_GROUPS = {
    "flags only": "",
    "+ shapes": "q.shape, k.shape, v.shape, ",
    "+ dtypes": "q.dtype, k.dtype, v.dtype, ",
    "+ devices": "q.device, k.device, v.device, ",
    "+ grad": "grad() and (q.requires_grad or k.requires_grad or v.requires_grad), ",
}
_KEYED = """
def keyed(q, k, v, *, layout="bshd", causal=False, impl=None):
    try:
        fn = fast[{fields}layout, causal, impl]
    except KeyError:
        fn = fast[{fields}layout, causal, impl] = target
    return fn(q, k, v)
"""


def key_costs(size: tuple[int, int, int, int], device: torch.device, repeat: int) -> dict[str, float]:
    """Overhead over the direct kernel (seconds) of a keyed lookup on the flags plus each group of fields."""
    q, k, v, call, planned = _inputs(size, device)
    fns: dict[str, Callable[[], Any]] = {"direct": direct_kernel(planned.decision.chosen_id, call) or (
        lambda: planned(q, k, v))}
    for name, fields in KEY_GROUPS.items():
        namespace: dict[str, Any] = {"fast": {}, "target": planned, "grad": torch.is_grad_enabled}
        exec(_KEYED.format(fields=fields), namespace)  # noqa: S102 - our own code, one variant per group
        keyed = namespace["keyed"]
        fns[name] = (lambda f: lambda: f(q, k, v, layout="bhsd", impl=None))(keyed)
    return overheads(per_call_seconds(fns, device, repeat))


def key_costs_markdown(device: torch.device, size: tuple[int, int, int, int], repeat: int) -> str:
    over = key_costs(size, device, repeat)
    flags = over["flags only"]
    lines = ["", f"## What the per-call key costs, by group of fields ({device.type}, size {size})", "",
             "A function keyed on its flags, then on the flags plus one group of tensor fields, each calling the "
             "plan; overhead over the direct kernel, and the group's own share (minus `flags only`).", "",
             "| key | over direct | the group alone |", "|---|--:|--:|"]
    for name in KEY_GROUPS:
        share = "" if name == "flags only" else f"{(over[name] - flags) * 1e6:+.2f} µs"
        lines.append(f"| {name} | {over[name] * 1e6:+.2f} µs | {share} |")
    return "\n".join(lines) + "\n"


COLUMNS = ["direct", "floor", "impl.run", "pinned", "policy", "policy (py)", "plan", "compat.sdpa",
           "compat.sdpa (py)", "compat.flash_attn", "compat.flash_attn (py)", "policy bshd", "torch sdpa"]
OVERHEAD_COLUMNS = ["floor", "pinned", "policy", "policy (py)", "plan", "compat.sdpa", "compat.sdpa (py)",
                    "compat.flash_attn", "compat.flash_attn (py)", "policy bshd", "torch sdpa"]


def markdown(device: torch.device, sizes: list[tuple[int, int, int, int]], repeat: int) -> str:
    lines = [f"# opdispatch dispatch overhead ({device.type})", ""] + [f"- {x}" for x in environment(device)] + [
        f"- {repeat} round-robin rounds; per-call medians; layout bhsd, "
        f"{'float32' if device.type == 'cpu' else 'bfloat16'}; overhead = median over rounds of (variant - direct)",
        "- floor = a do-nothing function with `opdispatch.attention`'s exact signature calling the plan: the cost "
        "of entering any per-call Python API of that shape; compat.sdpa = `opdispatch.compat."
        "scaled_dot_product_attention` (the drop-in for torch's functional, policy-dispatched); torch sdpa = torch's "
        "own `F.scaled_dot_product_attention` (its own backend choice); compat.flash_attn = `opdispatch.compat."
        "flash_attn.flash_attn_func` on bshd views of the same tensors, and policy bshd = `opdispatch.attention` on "
        "those views (the kernel reads views slower than the contiguous tensors of `direct`: compare the two); "
        "(py) = the same front door's Python path (`opdispatch.base._native.python_of`), measured in the same rounds: "
        "without the compiled fast path every front door is that", "",
        "| size (b,h,s,d) | impl | " + " | ".join(f"{c} µs" for c in COLUMNS) + " | "
        + " | ".join(f"{c} - direct" for c in OVERHEAD_COLUMNS) + " |",
        "|---|---|" + "--:|" * (len(COLUMNS) + len(OVERHEAD_COLUMNS))]
    for size in sizes:
        r = bench_size(size, device, repeat)
        med, over = r["median"], r["over"]
        direct = med["direct"]
        lines.append(f"| {size} | {r['impl']} | " + " | ".join(f"{med[c] * 1e6:.2f}" for c in COLUMNS) + " | "
                     + " | ".join(f"{over[c] * 1e6:+.2f} µs ({over[c] / direct * 100:+.1f}%)"
                                  for c in OVERHEAD_COLUMNS) + " |")
        print(lines[-1], file=sys.stderr)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", action="append", default=None,
                        help="cpu and/or cuda (repeatable; default: cpu, plus cuda when available)")
    parser.add_argument("--repeat", type=int, default=61)
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
        sizes = SIZES_CUDA if device.type == "cuda" else SIZES_CPU
        parts.append(markdown(device, sizes, args.repeat) + key_costs_markdown(device, sizes[0], args.repeat))
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
