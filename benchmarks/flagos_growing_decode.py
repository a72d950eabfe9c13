"""A growing decode through flagos.triton pinned, on a GPU with flag_gems (issue 35): per-step time and exactness.

The policy proof's decode case (batch 16, one query, 32/8 heads, head dim 128, bf16, keys from 4096 on) with k/v
sliced from a fixed buffer each step (``k_buf[:, :n]``). flagos.triton runs such a slice as a KV-cache call over the
whole buffer (seqused_k = n: the length is data), so the steps share one compiled kernel; before, the dense path went
to FlagGems' SDPA kernel, autotuned per key length (``_attn_fwd``, ``key=["KV_CTX", "HEAD_DIM"]``): ~4 s a step on
an H100. Three figures:
1. sliced: `--steps` steps, each at a new length, through the sliced (one-kernel) route;
2. contiguous: `--contiguous-steps` steps over contiguous copies (the SDPA kernel, a tune per length) for contrast;
3. exactness: every sliced step against torch's SDPA in float32 on the same slice (max |error|).

Usage (repo root, GPU machine with flag_gems): python benchmarks/flagos_growing_decode.py [--steps 64]
Exit status 1 when a step disagrees beyond bf16 tolerance (2e-2) or the sliced steps' median is not below 50 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import opdispatch

B, HQ, HKV, D = 16, 32, 8, 128


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--contiguous-steps", type=int, default=3)
    parser.add_argument("--start", type=int, default=4096)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    capacity = args.start + args.steps
    k_buf = torch.randn(B, capacity, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_buf = torch.randn(B, capacity, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    print(f"flag_gems {__import__('flag_gems').__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    sliced_ms, worst = [], 0.0
    with torch.no_grad():
        for i in range(args.steps):
            n = args.start + i
            k, v = k_buf[:, :n], v_buf[:, :n]
            out: list[torch.Tensor] = []
            sliced_ms.append(timed(lambda: out.append(opdispatch.attention(q, k, v, impl="flagos.triton"))))
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                enable_gqa=True).transpose(1, 2)
            worst = max(worst, (out[0].float() - ref).abs().max().item())
            print(f"step {i}: kv {n}, {sliced_ms[-1]:.1f} ms", flush=True)  # a run cut short still shows its steps
        contiguous_ms = []
        for i in range(args.contiguous_steps):
            n = args.start + i
            k, v = k_buf[:, :n].contiguous(), v_buf[:, :n].contiguous()
            contiguous_ms.append(timed(lambda: opdispatch.attention(q, k, v, impl="flagos.triton")))
            print(f"contiguous step {i}: kv {n}, {contiguous_ms[-1]:.1f} ms", flush=True)
    median = statistics.median(sliced_ms)
    print(f"sliced (one kernel): {args.steps} steps, first {sliced_ms[0]:.1f} ms, median {median:.3f} ms, "
          f"max {max(sliced_ms):.1f} ms; max |error| vs float32 SDPA {worst:.2e}")
    print("contiguous (SDPA kernel, tuned per length): " + ", ".join(f"{t:.1f}" for t in contiguous_ms) + " ms")
    ok = worst <= 2e-2 and median < 50.0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
