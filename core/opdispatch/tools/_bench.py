"""`opdispatch tune` and `opdispatch bench`: time an op's implementations on this device (``--op``, default
attention; any op whose `OpSpec` has a tuning description).

`tune` writes a tuned table (policies/opdispatch/policies/_tuned_table.py; measuring is
core/opdispatch/tools/_tuning.py); `bench` writes a markdown report and a PNG chart of TFLOP/s per implementation per
shape, with the policy's pick and its regret against the fastest.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..base._fingerprint import device_fingerprint, fingerprint_hash
from ._timing import NOISY_SPREAD
from ._tuning import Measurement, load_cases, measure, preset, preset_names, tuned_table, tuning_of

PLOT_HINT = "pip install 'opdispatch[bench]'  (or: pip install matplotlib)"


def _device(args: argparse.Namespace) -> torch.device:
    if getattr(args, "on", None):
        from ._timing import usable_device

        return usable_device(args.on)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _cases(args: argparse.Namespace, device: torch.device) -> list[Any]:
    """The cases to time: the --shapes file, else the --preset of --op; ValueError for a preset the op lacks."""
    if args.shapes:
        return load_cases(args.shapes, args.op)
    return preset(args.preset, device.type, args.op)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.2f} ms"


def timing_summary(results: list[Measurement]) -> list[str]:
    """Per case: the fastest implementation with its min/median/max and the pick; then the implementations that
    could run nowhere here (one line) and a WARNING when timings spread too widely to rank."""
    lines = []
    for m in results:
        if not m.seconds:
            lines.append(f"{m.case.describe()}: nothing timed" + (f" ({len(m.failed)} raised)" if m.failed else ""))
            continue
        fastest = m.fastest
        assert fastest is not None
        s = m.spreads[fastest]
        regret = f", pick {m.pick} +{m.regret * 100:.1f}%" if m.regret else f", pick {m.pick}"
        lines.append(f"{m.case.describe()}: fastest {fastest} {_us(s.median)} (min {_us(s.min)}, max {_us(s.max)})"
                     f"{regret}")
    everywhere = set.intersection(*(set(m.skipped) for m in results)) if results else set()
    if everywhere:
        lines.append(f"not timed, they cannot run here: {', '.join(sorted(everywhere))} (`opdispatch list` says "
                     "why)")
    noisy = [(m, impl_id) for m in results for impl_id in m.noisy()]
    if noisy:
        m, impl_id = max(noisy, key=lambda item: item[0].spreads[item[1]].iqr / item[0].spreads[item[1]].median)
        worst = m.spreads[impl_id]
        timed = sum(len(r.spreads) for r in results)
        lines.append(f"WARNING: {len(noisy)} of {timed} timings are noisy (interquartile range above "
                     f"{NOISY_SPREAD:.0%} of the median); worst: {impl_id} on {m.case.describe()}: median "
                     f"{_us(worst.median)}, min {_us(worst.min)}, max {_us(worst.max)}. Something else is using "
                     "this device or its clock is changing: rankings within the spread mean nothing. Re-run on an "
                     "idle machine, or with more --reps.")
    return lines


def print_summary(results: list[Measurement]) -> None:
    """`timing_summary` on stdout, its WARNING on stderr."""
    for line in timing_summary(results):
        print(line, file=sys.stderr if line.startswith("WARNING") else sys.stdout)


def geomean_regret(results: list[Measurement]) -> float | None:
    """Geometric mean of time(pick)/time(fastest), minus 1, over the shapes where the pick was timed."""
    ratios = [1.0 + m.regret for m in results if m.regret is not None]
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) - 1.0


def markdown_report(results: list[Measurement], device: Any, title: str = "opdispatch attention benchmark") -> str:
    impls = sorted({i for m in results for i in m.seconds} | {i for m in results for i in m.failed})
    fp = device_fingerprint(device)
    lines = [f"# {title}", "",
             f"device: {device.describe()}  ", "versions: " + ", ".join(
                 f"{k} {v}" for k, v in fp.items() if k not in ("vendor", "type", "arch", "name")) + "  ",
             f"fingerprint: {fingerprint_hash(fp)}", "",
             "TFLOP/s per implementation per shape (higher is better); **bold** = fastest, "
             "`*` = the policy's pick; regret = time(pick) / time(fastest) - 1. "
             "`-` = not eligible, `fail` = raised.", ""]
    head = ["shape", *impls, "pick", "regret"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["--:"] * len(impls) + ["---", "--:"]) + "|")
    for m in results:
        row = [m.case.describe()]
        for impl in impls:
            if impl in m.seconds:
                cell = f"{m.tflops(impl):.3g}"
                if impl == m.fastest:
                    cell = f"**{cell}**"
                if impl == m.pick:
                    cell += " *"
            elif impl in m.failed:
                cell = "fail"
            else:
                cell = "-"
            row.append(cell)
        row.append(m.pick or "none")
        row.append("n/a" if m.regret is None else f"{m.regret * 100:.1f}%")
        lines.append("| " + " | ".join(row) + " |")
    gm = geomean_regret(results)
    lines += ["", f"geometric-mean regret of the pick: {'n/a' if gm is None else f'{gm * 100:.2f}%'} over "
              f"{sum(m.regret is not None for m in results)} shapes", ""]
    failures = [(m, i, e) for m in results for i, e in m.failed.items()]
    if failures:
        lines += ["## Failures", ""] + [f"- {m.case.describe()}: {i}: {e}" for m, i, e in failures] + [""]
    lines += ["times per call, µs: median (min–max over the reps; `noisy`: interquartile range above "
              f"{NOISY_SPREAD:.0%} of the median):", ""]
    for m in results:
        times = []
        for i in m.ranking():
            spread = m.spreads[i]
            times.append(f"{i} {spread.median * 1e6:.1f} ({spread.min * 1e6:.1f}–{spread.max * 1e6:.1f}"
                         f"{', noisy' if spread.noisy else ''})")
        lines.append(f"- {m.case.describe()}: {', '.join(times) or 'nothing timed'}")
    return "\n".join(lines) + "\n"


def plot(results: list[Measurement], path: Path, device: Any, op: str = "attention") -> bool:
    """A grouped bar chart (TFLOP/s per impl per shape, the pick starred); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    impls = sorted({i for m in results for i in m.seconds})
    n, width = max(len(impls), 1), 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(results) + 2), 5.5))
    for j, impl in enumerate(impls):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(results))]
        ys = [m.tflops(impl) if impl in m.seconds else 0.0 for m in results]
        bars = ax.bar(xs, ys, width, label=impl)
        for x, y, m in zip(xs, ys, results):
            if m.pick == impl and y:
                ax.annotate("*", (x, y), ha="center", va="bottom", fontsize=14, color=bars.patches[0].get_facecolor())
    labels = []
    for m in results:
        regret = "" if m.regret is None else f"\nregret {m.regret * 100:.0f}%"
        labels.append(m.case.describe().replace(" ", "\n", 2) + regret)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("TFLOP/s")
    values = [m.tflops(i) for m in results for i in m.seconds]
    if values and min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")  # decode and prefill differ by orders of magnitude
    gm = geomean_regret(results)
    ax.set_title(f"{device.name} — {op} TFLOP/s per implementation (* = pick; geomean regret "
                 f"{'n/a' if gm is None else f'{gm * 100:.1f}%'})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- commands --------------------------------------------------------------------------------------------------

def _check_op_and_preset(args: argparse.Namespace) -> str | None:
    """Why --op/--preset cannot be timed (the message for stderr), or None."""
    try:
        tuning_of(args.op)
    except ValueError as exc:
        return str(exc)
    if not args.shapes and args.preset not in preset_names(args.op):
        return (f"--preset {args.preset} is not a preset of op {args.op!r}; its presets: "
                f"{', '.join(preset_names(args.op))}")
    return None


def cmd_tune(args: argparse.Namespace) -> int:
    problem = _check_op_and_preset(args)
    if problem:
        print(f"opdispatch tune: {problem}", file=sys.stderr)
        return 2
    from ..engine._agreement import torchrun_group

    # Under torchrun every rank measures on its own GPU and the group agrees on one table (agree_tuned_table: the
    # slowest rank's median per implementation); rank 0 writes it.
    with torchrun_group(os.environ) as rank:
        return _tune(args, rank)


def _tune(args: argparse.Namespace, rank: int | None) -> int:
    from ..engine._current import get_manager
    from ..engine._agreement import agree_tuned_table

    device = _device(args)
    cases = _cases(args, device)
    impls = args.impl or None
    if args.device_only:
        impls = _device_specific(device, impls, args.op)
        if not impls:
            print(f"opdispatch tune: no {args.op} implementation specific to this device type is registered",
                  file=sys.stderr)
            return 1
    manager = get_manager()
    results = measure(cases, op=args.op, manager=manager, device=device, impls=impls, warmup=args.warmup,
                      reps=args.reps, progress=not args.quiet and not rank)
    if not rank:
        print_summary(results)
    table = tuned_table(results, op=args.op, manager=manager, device=device, impls=impls, warmup=args.warmup,
                        reps=args.reps)
    if rank is not None:
        table = agree_tuned_table(table)
        if rank:
            return 0
        print(f"agreed across {table.settings['ranks']} ranks: each implementation's slowest rank's median")
    out = Path(args.out)
    table.save(out)
    print(f"wrote {out}: {args.op}, {len(table.entries)} buckets, fingerprint {table.hash} "
          f"({table.fingerprint.get('name')})")
    print(f"use it from a policy file with:  ops: {{{args.op}: {{autotune: {out.name}}}}}   (path relative to the "
          "policy file)")
    return 0


def _device_specific(device: torch.device, patterns: list[str] | None, op: str = "attention") -> list[str]:
    """Ids of `op`'s implementations made for this device type (not portable ones such as the references)."""
    import fnmatch

    from ..engine._current import get_manager

    manager = get_manager()
    manager.ensure_initialized()
    info = manager.device_info(device)
    return [r.impl.id for r in manager.registry.for_op(op)
            if r.impl.device_types and info.type in r.impl.device_types
            and (not patterns or any(fnmatch.fnmatchcase(r.impl.id, p) for p in patterns))]


def cmd_bench(args: argparse.Namespace) -> int:
    from ..engine._current import get_manager

    problem = _check_op_and_preset(args)
    if problem:
        print(f"opdispatch bench: {problem}", file=sys.stderr)
        return 2
    manager = get_manager()
    device = _device(args)
    info = manager.device_info(device)
    results = measure(_cases(args, device), op=args.op, manager=manager, device=device, impls=args.impl or None,
                      warmup=args.warmup, reps=args.reps, progress=not args.quiet)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.op}-{info.type}"
    md = out_dir / f"{stem}.md"
    png = out_dir / f"{stem}.png"
    text = markdown_report(results, info, title=f"opdispatch {args.op} benchmark")
    if plot(results, png, info, args.op):
        text = text.replace("\nTFLOP/s per", f"\n![TFLOP/s per implementation]({png.name})\n\nTFLOP/s per", 1)
        print(f"wrote {png}")
    else:
        print(f"no PNG: matplotlib is not installed; {PLOT_HINT}", file=sys.stderr)
    md.write_text(text, encoding="utf-8")
    print_summary(results)
    print(f"wrote {md}")
    gm = geomean_regret(results)
    print(f"geometric-mean regret of the pick: {'n/a' if gm is None else f'{gm * 100:.2f}%'}")
    return 0
