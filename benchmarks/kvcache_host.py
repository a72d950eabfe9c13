"""Host time of `flash_attn_with_kvcache`'s bound decode step on CPU, without the GPU: what OUR Python adds per step.

On a GPU a decode step is host-bound (benchmarks/kvcache_decode.py: ~235 µs per step for the raw kernel and its
`index_put_` on the H100/H200 hosts), so the drop-in's overhead is the host work it does beyond the raw step. This
runs the GPU's bound path — the device-side check (``OPDISPATCH_KV_CHECKS=device``), the fused Triton check and
append (``OPDISPATCH_KV_APPEND=triton``, compiled once through Triton's interpreter) — on CPU tensors, then replaces
the Triton launches and the attention kernel (shared with the raw step) by no-ops, so the time left is the Python
around them; the raw step gets the same no-op kernel and its real (CPU) `index_put_` append. Not a test: a
measurement; Triton's launch gate runs as on a GPU (`_triton_direct.stream_for`, faked C getters), but CUDA events
(record, query) are not in it.

    python benchmarks/kvcache_host.py                    # µs per step, ours and raw, median of --repeat rounds
    python benchmarks/kvcache_host.py --profile          # and cProfile call counts of one loop of ours
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OPDISPATCH_KV_CHECKS", "device")
os.environ.setdefault("OPDISPATCH_KV_APPEND", "triton")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from opdispatch.compat import _triton_direct
    from opdispatch.compat import flash_attn as fa
    from opdispatch.doors import _api

    b, hq, hk, d, cap = args.batch, 8, 2, 64, args.capacity
    k_cache, v_cache = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
    qs = [torch.randn(b, 1, hq, d) for _ in range(4)]
    ks = [torch.randn(b, 1, hk, d) for _ in range(4)]
    vs = [torch.randn(b, 1, hk, d) for _ in range(4)]
    lens = torch.full((b,), 16, dtype=torch.int32)
    start = lens.clone()
    for j in range(2):  # the reference path, then the bound path's first call (compiles the kernels, interpreted)
        fa.flash_attn_with_kvcache(qs[j], k_cache, v_cache, ks[j], vs[j], cache_seqlens=lens, causal=True)
    fa.check_pending_errors()
    manager = _api._manager or _api.get_manager()
    bound = next(v for v in manager.fast.values() if isinstance(v, fa._KvcacheBound))
    assert bound.fused is not None, "the fused append did not take the call"
    out = torch.empty(b, 1, hq, d)

    def kernel(q, k_cache, v_cache, lens, table):  # the attention kernel both sides call: not measured
        return out

    bound.fn = kernel
    # The Triton launches, not measured: a direct launch (the steady state on a GPU) taken, or a jit one a no-op.
    _triton_direct.DirectKernel.launch_direct = lambda self, *a: True  # type: ignore[method-assign]
    _triton_direct.DirectKernel.launch = lambda self, *a: None  # type: ignore[method-assign]
    # A GPU's launch gate (`_triton_direct.stream_for`'s checks, with Triton's real knobs), as if the tensors were on
    # CUDA device 0 and a kernel had been captured: its device and stream getters are the C calls of a GPU.
    from types import SimpleNamespace

    from triton import knobs

    active = object()
    _triton_direct._gate = SimpleNamespace(  # type: ignore[assignment]
        drivers=SimpleNamespace(_active=active), active=active, knobs=knobs, runtime=knobs.runtime,
        compilation=knobs.compilation, debug=knobs.runtime.debug,
        instrumentation=knobs.compilation.instrumentation_mode, get_device=int, get_stream=abs)
    bound.fused.index = 0
    rows, step = torch.arange(b).unsqueeze(1), torch.arange(1)

    def ours() -> None:
        lens.copy_(start)
        for i in range(args.steps):
            j = i & 3
            fa.flash_attn_with_kvcache(qs[j], k_cache, v_cache, ks[j], vs[j], cache_seqlens=lens, causal=True)
            lens.add_(1)

    def raw() -> None:
        lens.copy_(start)
        for i in range(args.steps):
            j = i & 3
            index = (rows, lens.unsqueeze(1) + step)
            k_cache.index_put_(index, ks[j])
            v_cache.index_put_(index, vs[j])
            kernel(qs[j], k_cache, v_cache, lens + 1, None)
            lens.add_(1)

    def loop_only() -> None:  # the loop and the caller's `lens.add_`: in both, subtracted
        lens.copy_(start)
        for i in range(args.steps):
            j = i & 3
            kernel(qs[j], k_cache, v_cache, lens, None)
            lens.add_(1)

    times: dict[str, list[float]] = {"ours": [], "raw": [], "loop": []}
    for round_ in range(args.repeat + 1):
        for name, loop in (("ours", ours), ("raw", raw), ("loop", loop_only)):
            began = time.perf_counter()
            loop()
            if round_:
                times[name].append((time.perf_counter() - began) / args.steps * 1e6)
    fa.check_pending_errors()
    # The fastest round: the least disturbed by other processes on a shared host.
    best = {name: min(t) - (min(times["loop"]) if name != "loop" else 0) for name, t in times.items()}
    print(f"dense b{b} cap{cap}, µs per step beyond the loop (fastest of {args.repeat} rounds of {args.steps}): "
          f"ours {best['ours']:.2f} (Triton launches and kernel no-ops), raw {best['raw']:.2f} (its CPU index_put_ "
          f"append, kernel no-op); loop {best['loop']:.2f}")
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        ours()
        profile.disable()
        stats = pstats.Stats(profile)
        print(f"ours: {stats.total_calls} function calls in one loop of {args.steps} steps "  # type: ignore[attr-defined]
              f"({stats.total_calls / args.steps:.1f} per step)")  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
