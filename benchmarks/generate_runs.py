"""Pool several runs of benchmarks/generate_bench.py (their JSON files) into one table: per batch, each run's
opdispatch / sdpa tokens/s (ratio of medians), the median and range over the runs, and — over the runs that
recorded every call — the ratio of the pooled medians and of the fastest calls. One run on a shared host moves by
more than the difference measured (one generate() of the same model ranged 0.88-1.45 s in one H100 run), so the
README's figure is the runs' median with their range.

Paired: each rep of generate_bench runs every copy of one implementation, then every copy of the other, back to
back (the order alternating by rep), so a rep's two sums were timed within seconds of each other. The ratio of
those sums, per rep, does not move with the host's speed drifting across a run (this CPU's generate() went from
0.13 to 0.095 s within one run), which a ratio of whole-run medians does; the table gives the median of the
paired ratios per run and over every rep of every run. It needs each row's `copies` (recorded since f8dca4c;
`--copies N` for older runs, whose README says how many).

    python benchmarks/generate_runs.py benchmarks/results/h100-*/generate-h100.json --out generate-h100-runs.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def paired_ratios(sdpa_times: list[float], opdispatch_times: list[float], copies: int) -> list[float]:
    """Per rep, sdpa's time over opdispatch's (= opdispatch / sdpa tokens/s), each the sum of the rep's `copies`
    calls (generate_bench appends a rep's calls of one implementation together)."""
    if copies < 1 or len(sdpa_times) != len(opdispatch_times) or len(sdpa_times) % copies:
        raise ValueError(f"cannot pair {len(sdpa_times)} and {len(opdispatch_times)} calls in reps of {copies}")
    return [sum(sdpa_times[i:i + copies]) / sum(opdispatch_times[i:i + copies])
            for i in range(0, len(sdpa_times), copies)]


def pool(paths: list[Path], copies: int | None = None) -> tuple[list[str], dict[int, dict[str, Any]]]:
    runs = [json.loads(p.read_text()) for p in paths]
    by_batch: dict[int, dict[str, Any]] = {}
    for run in runs:
        for row in run["rows"]:
            entry = by_batch.setdefault(row["batch"], {"ratios": [], "sdpa": [], "opdispatch": [], "paired": []})
            entry["ratios"].append(row["ratio"])
            if "sdpa_times_s" in row:
                entry["sdpa"] += row["sdpa_times_s"]
                entry["opdispatch"] += row["opdispatch_times_s"]
                n = row.get("copies", copies)
                if n is not None:
                    entry["paired"].append(paired_ratios(row["sdpa_times_s"], row["opdispatch_times_s"], n))
    devices = sorted({run["environment"].get("device", "?") for run in runs})
    return devices, by_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="generate_bench JSON files")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--copies", type=int, help="copies per implementation, for runs whose rows do not say")
    args = parser.parse_args(argv)
    devices, by_batch = pool(args.runs, args.copies)
    lines = ["# generate(): opdispatch vs sdpa over several runs", "",
             f"Devices: {', '.join(devices)}. Runs (in the order given): "
             + "; ".join(f"`{p}`" for p in args.runs) + ".", "",
             "| batch | each run's opdispatch / sdpa | median of the runs | range | pooled calls: ratio of medians | "
             "pooled calls: ratio of fastest | paired: each run's median | paired: median of every rep (range) |",
             "|---:|---|---:|---|---:|---:|---|---:|"]
    for batch, e in sorted(by_batch.items()):
        ratios = e["ratios"]
        pooled = (f"{statistics.median(e['sdpa']) / statistics.median(e['opdispatch']):.2f}x "
                  f"({len(e['sdpa'])} calls each)" if e["sdpa"] else "-")
        fastest = f"{min(e['sdpa']) / min(e['opdispatch']):.2f}x" if e["sdpa"] else "-"
        paired_runs = " ".join(f"{statistics.median(p):.3f}" for p in e["paired"]) or "-"
        reps = [r for p in e["paired"] for r in p]
        paired_all = (f"**{statistics.median(reps):.3f}x** ({min(reps):.2f}-{max(reps):.2f}, {len(reps)} reps)"
                      if reps else "-")
        lines.append(f"| {batch} | {' '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}x** | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {pooled} | {fastest} | {paired_runs} | {paired_all} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
