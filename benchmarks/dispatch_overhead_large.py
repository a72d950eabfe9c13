"""Does dispatch change the picture? opdispatch.attention vs the chosen kernel called directly, large shapes.

Interleaves the three ways of calling (raw aten op, the implementation's `run`, `opdispatch.attention`) over
several rounds so clock and power drift hit all three alike; reports the median of the per-round medians.
Usage: python benchmarks/dispatch_overhead_large.py --out DIR  (moved from dispatch_overhead.py when the perf branch
merged; the tiny-call overhead benchmark of issue 6 is benchmarks/dispatch_overhead.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton.testing

import opdispatch
from opdispatch import validate_attention

SHAPES = [  # name, b, s, hq, hkv, d, causal, train
    ("prefill 16k b1 gqa8 d128 causal", 1, 16384, 32, 4, 128, True, False),
    ("prefill 8k b1 gqa8 d128 causal", 1, 8192, 32, 4, 128, True, False),
    ("prefill 4k b2 mha d256", 2, 4096, 8, 8, 256, False, False),
    ("train 4k b2 gqa4 d128 causal", 2, 4096, 32, 8, 128, True, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    manager = opdispatch.get_manager()
    rows = []
    for name, b, s, hq, hkv, d, causal, train in SHAPES:
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=train)
        call = validate_attention(q, k, v, causal=causal)
        impl = manager.resolve("attention", call).chosen
        qb, kb, vb = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        raw = {"nvidia.cudnn": lambda: torch._scaled_dot_product_cudnn_attention(
                   qb, kb, vb, None, train, 0.0, causal, False, scale=d ** -0.5)[0],
               "nvidia.flash": lambda: torch._scaled_dot_product_flash_attention(
                   qb, kb, vb, 0.0, causal, False, scale=d ** -0.5)[0]}.get(impl.id)
        ways = {"raw aten op": raw, "impl.run": lambda: impl.run(call),
                "opdispatch.attention": lambda: opdispatch.attention(q, k, v, causal=causal)}
        grad = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

        def wrap(fn):
            if not train:
                return fn

            def step():
                out = fn()
                out.backward(grad if out.shape == grad.shape else grad.transpose(1, 2))
                q.grad = k.grad = v.grad = None
            return step

        samples = {w: [] for w, fn in ways.items() if fn is not None}
        for _ in range(args.rounds):
            for w in samples:
                samples[w].append(triton.testing.do_bench(wrap(ways[w]), warmup=25, rep=100, return_mode="median"))
        med = {w: statistics.median(x) for w, x in samples.items()}
        base = med.get("raw aten op", med["impl.run"])
        row = {"shape": name, "chosen": impl.id, "median_ms": med, "rounds": samples,
               "opdispatch_vs_direct": med["opdispatch.attention"] / base - 1}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    info = manager.device_info(torch.device("cuda"))
    result = {"device": info.to_dict(), "torch": torch.__version__, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dispatch_overhead.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    lines = [f"# Dispatch overhead at large shapes on {info.name}", "",
             "bf16; median over rounds of do_bench medians (ms); the raw aten op is the kernel opdispatch chose, "
             "called with no opdispatch code at all.", "",
             "| shape | chosen | raw aten op | impl.run | opdispatch.attention | opdispatch vs direct |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median_ms"]
        lines.append(f"| {r['shape']} | {r['chosen']} | {m.get('raw aten op', float('nan')):.3f} | "
                     f"{m['impl.run']:.3f} | {m['opdispatch.attention']:.3f} | {r['opdispatch_vs_direct'] * 100:+.2f}% |")
    with open(os.path.join(args.out, "dispatch_overhead.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
