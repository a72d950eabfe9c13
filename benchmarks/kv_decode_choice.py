"""Which kernel should decode over a dense KV cache: nvidia.flash (seqused_k) or nvidia.cudnn (the fill as a mask)?

Run on the GPU machine (see benchmarks/gpu_tests.sh for the setup): ``python3 benchmarks/kv_decode_choice.py``.
For each batch and cache capacity (caches half to fully filled, bf16, 32/8 heads, d128, one query, bottom-right
causal), both implementations pinned through ``opdispatch.attention`` (the per-call fast path), in alternating
rounds: the median ms per call of 100 calls issued back to back (what a decode loop sustains) and of one
synchronised call, plus what the default policy chooses.
"""

from __future__ import annotations

import statistics

import torch

import opdispatch
from kv_cache import loop_ms, step_ms  # this folder's kv_cache.py (scripts run from here)

IMPLS = ("nvidia.flash", "nvidia.cudnn")


def main():
    print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| cuDNN",
          torch.backends.cudnn.version())
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("\n| batch | capacity | chosen | nvidia.flash loop ms | nvidia.cudnn loop ms | flash step ms | "
          "cudnn step ms |\n|---|---|---|---|---|---|---|")
    for batch in (1, 8, 32):
        for cap in (1024, 4096, 16384):
            kw = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, 1, 32, 128, generator=gen, **kw)
            k = torch.randn(batch, cap, 8, 128, generator=gen, **kw)
            v = torch.randn(batch, cap, 8, 128, generator=gen, **kw)
            used = torch.randint(cap // 2, cap + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
            args = dict(causal=True, causal_alignment="bottom_right", seqused_k=used)
            chosen = opdispatch.explain(q, k, v, **args).chosen_id
            fns = {i: (lambda i=i: opdispatch.attention(q, k, v, impl=i, **args)) for i in IMPLS}
            for fn in fns.values():
                for _ in range(10):
                    fn()
            loops: dict[str, list[float]] = {i: [] for i in IMPLS}
            steps: dict[str, list[float]] = {i: [] for i in IMPLS}
            for _ in range(7):  # alternating rounds: drift hits both alike
                for i, fn in fns.items():
                    loops[i].append(loop_ms(fn))
                    steps[i].append(statistics.median(step_ms(fn) for _ in range(20)))
            m = {i: (statistics.median(loops[i]), statistics.median(steps[i])) for i in IMPLS}
            print(f"| {batch} | {cap} | {chosen} | {m['nvidia.flash'][0]:.3f} | {m['nvidia.cudnn'][0]:.3f} | "
                  f"{m['nvidia.flash'][1]:.3f} | {m['nvidia.cudnn'][1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
