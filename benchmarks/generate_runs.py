"""Pool several runs of benchmarks/generate_bench.py (their JSON files) into one table: per batch, each run's
opdispatch / sdpa tokens/s (ratio of medians), the median and range over the runs, and — over the runs that
recorded every call — the ratio of the pooled medians and of the fastest calls. One run on a shared host moves by
more than the difference measured (one generate() of the same model ranged 0.88-1.45 s in one H100 run), so the
README's figure is the runs' median with their range.

    python benchmarks/generate_runs.py benchmarks/results/h100-*/generate-h100.json --out generate-h100-runs.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def pool(paths: list[Path]) -> tuple[list[str], dict[int, dict[str, Any]]]:
    runs = [json.loads(p.read_text()) for p in paths]
    by_batch: dict[int, dict[str, Any]] = {}
    for run in runs:
        for row in run["rows"]:
            entry = by_batch.setdefault(row["batch"], {"ratios": [], "sdpa": [], "opdispatch": []})
            entry["ratios"].append(row["ratio"])
            if "sdpa_times_s" in row:
                entry["sdpa"] += row["sdpa_times_s"]
                entry["opdispatch"] += row["opdispatch_times_s"]
    devices = sorted({run["environment"].get("device", "?") for run in runs})
    return devices, by_batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="generate_bench JSON files")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    devices, by_batch = pool(args.runs)
    lines = ["# generate(): opdispatch vs sdpa over several runs", "",
             f"Devices: {', '.join(devices)}. Runs (in the order given): "
             + "; ".join(f"`{p}`" for p in args.runs) + ".", "",
             "| batch | each run's opdispatch / sdpa | median of the runs | range | pooled calls: ratio of medians | "
             "pooled calls: ratio of fastest |", "|---:|---|---:|---|---:|---:|"]
    for batch, e in sorted(by_batch.items()):
        ratios = e["ratios"]
        pooled = (f"{statistics.median(e['sdpa']) / statistics.median(e['opdispatch']):.2f}x "
                  f"({len(e['sdpa'])} calls each)" if e["sdpa"] else "-")
        fastest = f"{min(e['sdpa']) / min(e['opdispatch']):.2f}x" if e["sdpa"] else "-"
        lines.append(f"| {batch} | {' '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}x** | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {pooled} | {fastest} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
