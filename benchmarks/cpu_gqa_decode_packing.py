"""A GQA decode step on CPU: torch's fused CPU kernel with the query heads packed as each k/v head's queries
(cpu.flash's `_packed_kernel`, which every decode step under GQA takes) against the kernel's own GQA (one task per
query head), by key count.

    python benchmarks/cpu_gqa_decode_packing.py --out benchmarks/results/cpu_gqa_decode_packing-cpu.md
    python benchmarks/cpu_gqa_decode_packing.py --set-num-threads 2 --out ...-set-threads-cpu.md

`--set-num-threads N` calls torch.set_num_threads(N) first, as many serving scripts do: even at the thread count
torch already had, that call turns MKL's dynamic threading off (aten's set_num_threads), and the packed kernel
slows by 2-9 µs at short caches (measured on this CPU; see the two result files).

The query is a model's (batch, 1, heads, dim) projection seen as bhsd (a transposed view), as transformers passes
it; k/v contiguous (batch, kv heads, keys, dim), float32. Each cell: µs per call, the fastest of 7 repeats of 1000
calls after 200 warm-up calls, packed / not packed.
"""

from __future__ import annotations

import argparse
import os
import platform
import timeit

import torch

CONFIGS = [(1, 8, 2, 32), (4, 8, 2, 32), (1, 12, 4, 64), (1, 32, 8, 128)]  # (batch, heads, kv heads, head dim)
KEYS = (32, 64, 96, 128, 160, 192, 256, 384, 512, 1024)


def time_us(fn) -> float:
    for _ in range(200):
        fn()
    return min(timeit.repeat(fn, number=1000, repeat=7)) / 1000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table here as well")
    parser.add_argument("--set-num-threads", type=int, help="call torch.set_num_threads(N) first")
    args = parser.parse_args()
    if args.set_num_threads:
        torch.set_num_threads(args.set_num_threads)
    kernel = torch._scaled_dot_product_flash_attention_for_cpu
    lines = ["# GQA decode step on CPU: packed / the kernel's own GQA (µs per call)", "",
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
             f"threads{', set by torch.set_num_threads' if args.set_num_threads else ', as torch started'}), Python "
             f"{platform.python_version()}; float32, the query a transposed view.", "",
             "| batch, heads, kv heads, dim | " + " | ".join(f"{n} keys" for n in KEYS) + " |",
             "|---|" + "---|" * len(KEYS)]
    for b, hq, hkv, d in CONFIGS:
        cells = []
        for n in KEYS:
            q = torch.randn(b, 1, hq, d).transpose(1, 2)
            k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
            packed = time_us(lambda: kernel(q.view(b, hkv, hq // hkv, d), k, v)[0])
            own = time_us(lambda: kernel(q, k, v)[0])
            cells.append(f"{packed:.1f} / {own:.1f}" + (" *" if packed < own else ""))
        lines.append(f"| {b}, {hq}, {hkv}, {d} | " + " | ".join(cells) + " |")
    lines += ["", "`*`: packing is the faster."]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
