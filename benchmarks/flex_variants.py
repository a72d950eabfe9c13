"""opdispatch's torch.flex against torch's own compiled flex_attention on the same call, and what the difference
is made of: the softcap written as a Python float (a constant inductor folds), as a captured tensor divided by
(how torch.flex captures it, so a new softcap value does not recompile), or as a captured reciprocal multiplied
by; and torch's flex as a caller holding bshd tensors writes it (the transposes in each call, beside the
variants given bhsd views made once). Two cells (GQA softcap; a causal window), forward and forward+backward,
interleaved CUDA-event timing (side_by_side.interleaved_ms), with each variant's host time per call.

    python benchmarks/flex_variants.py --out flex_variants.json        # GPU
    python benchmarks/flex_variants.py --tiny                          # CPU smoke run (eager flex, fp32)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402
from side_by_side import back_to_back_ms, interleaved_ms, ms_text, write_report  # noqa: E402

SOFTCAP = 30.0


def variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compile_flex: bool) -> dict[str, Callable[[], Any]]:
    """torch's own flex_attention over bhsd views of the bshd inputs, one softcap spelling each."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flex = torch.compile(flex_attention) if compile_flex else flex_attention
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, qt.shape[2], kt.shape[2],
                                   device=q.device, _compile=compile_flex)
    cap = torch.tensor(SOFTCAP, device=q.device)
    inverse = torch.tensor(1.0 / SOFTCAP, device=q.device)
    mods = {
        "flex, softcap a Python float": lambda s, b, h, i, j: SOFTCAP * torch.tanh(s / SOFTCAP),
        "flex, softcap a tensor (divide)": lambda s, b, h, i, j: cap * torch.tanh(s / cap),
        "flex, softcap a tensor (reciprocal)": lambda s, b, h, i, j: cap * torch.tanh(s * inverse),
    }
    gqa = qt.shape[1] != kt.shape[1]

    def bound(mod: Callable[..., Any]) -> Callable[[], Any]:
        return lambda: flex(qt, kt, vt, score_mod=mod, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)

    out = {name: bound(mod) for name, mod in mods.items()}
    reciprocal = mods["flex, softcap a tensor (reciprocal)"]
    out["flex, reciprocal, transposed per call"] = lambda: flex(  # what a caller with bshd tensors writes
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=reciprocal, block_mask=block_mask,
        enable_gqa=gqa).transpose(1, 2)
    return out


def window_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                    compile_flex: bool) -> dict[str, Callable[[], Any]]:
    """torch's own flex_attention for a causal sliding window: the window and the alignment offset as Python ints
    (constants in the kernel) or as captured tensors (how torch.flex captures them, so new lengths and windows do
    not recompile)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flex = torch.compile(flex_attention) if compile_flex else flex_attention
    offset_t = torch.tensor(0, dtype=torch.int32, device=q.device)
    left_t = torch.tensor(window, dtype=torch.int32, device=q.device)
    mods = {
        "flex, window and offset Python ints": lambda b, h, i, j: (j <= i) & (j >= i - window),
        "flex, window and offset tensors": lambda b, h, i, j: (((j - i - offset_t) <= 0)
                                                               & ((j - i - offset_t) >= -left_t)),
    }
    gqa = qt.shape[1] != kt.shape[1]
    out = {}
    for name, mod in mods.items():
        mask = create_block_mask(mod, None, None, qt.shape[2], kt.shape[2], device=q.device, _compile=compile_flex)
        out[name] = (lambda mask=mask: flex(qt, kt, vt, block_mask=mask, enable_gqa=gqa).transpose(1, 2))
    out["flex, tensors, transposed per call"] = (  # what a caller with bshd tensors writes
        lambda mask=mask: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                               enable_gqa=gqa).transpose(1, 2))
    return out


def host_us(fns: dict[str, Callable[[], Any]], device: torch.device, calls: int = 20,
            samples: int = 15) -> dict[str, float]:
    """Host microseconds per call of each callable: the time to issue `calls` calls after a sync, without waiting
    for the device (its queue holds them), median over `samples` interleaved runs. Per-call timing counts this
    time; back-to-back timing hides it behind the device."""
    import statistics
    import time

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            began = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - began) / calls * 1e6)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return {name: statistics.median(t) for name, t in times.items()}


def host_profile(fns: dict[str, Callable[[], Any]], out: Path, calls: int = 200) -> None:
    """cProfile of `calls` calls of each callable (the device synchronised after each batch), the top functions
    by own time, written to `out`: where host time goes, variant by variant."""
    import cProfile
    import io
    import pstats

    texts = []
    for name, fn in fns.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(30)
        texts.append(f"## {name}: {calls} calls\n\n{stream.getvalue()}")
    out.write_text("\n".join(texts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (eager flex, fp32)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, help="JSON here, markdown beside it")
    p.add_argument("--profile", type=Path, help="write cProfile tables of each forward cell's variants here")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b, s, hq, hkv, d = (1, 64, 4, 2, 16) if device.type == "cpu" else (2, 4096, 16, 8, 128)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    cells = {"softcap 30": (b, s, hq, hkv, d, None),
             "window 1024": (1, 64, 4, 4, 16, 8) if device.type == "cpu" else (1, 8192, 16, 16, 128, 1024)}
    for cell, (cb, cs, chq, chkv, cd, window) in cells.items():
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            if grad and device.type == "cpu":
                continue  # flex has no CPU backward
            q = torch.randn(cb, cs, chq, cd, generator=gen, device=device, dtype=dtype).requires_grad_(grad)
            k, v = (torch.randn(cb, cs, chkv, cd, generator=gen, device=device, dtype=dtype).requires_grad_(grad)
                    for _ in range(2))
            kw: dict[str, Any] = dict(causal=True, softcap=SOFTCAP) if window is None else dict(
                causal=True, window=(window, 0))
            fns = {"opdispatch torch.flex": lambda q=q, k=k, v=v, kw=kw: opdispatch.attention(
                q, k, v, impl="torch.flex", **kw)}
            fns.update(variants(q, k, v, compile_flex=device.type == "cuda") if window is None
                       else window_variants(q, k, v, window, compile_flex=device.type == "cuda"))
            if grad:
                g = torch.randn(cb, cs, chq, cd, generator=gen, device=device, dtype=dtype)
                fns = {name: (lambda fn=fn: fn().backward(g)) for name, fn in fns.items()}
            times = interleaved_ms(fns, device, args.warmup, args.reps)
            back = back_to_back_ms(fns, device, 10)
            host = host_us(fns, device)
            if args.profile and not grad:
                args.profile.mkdir(parents=True, exist_ok=True)
                host_profile(fns, args.profile / f"{cell.split()[0]}-{mode}.txt")
            rows.append({"cell": cell, "mode": mode, "ms": times, "back_to_back_ms": back, "host_us": host})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    env = environment(device)
    lines = ["# torch.flex vs torch's own compiled flex_attention, by how the call's numbers are captured", "",
             f"{env['device']}; torch {env['torch']}, triton {env.get('triton')}; {str(dtype)[6:]}; softcap cell "
             f"b{b} s{s} heads {hq}/{hkv} d{d}; window cell b1 s8192 heads 16/16 d128; commit {env.get('commit')}",
             "", "per call: events around one call; back to back: events around 10 calls; host: µs to issue one call "
             "(20 issued after a sync, the device not waited for)", "",
             "| cell | mode | variant | per call ms | back to back ms | host µs |", "|---|---|---|---:|---:|---:|"]
    for row in rows:
        for name, ms in row["ms"].items():
            b2b = row["back_to_back_ms"].get(name)
            host = row["host_us"].get(name)
            lines.append(f"| {row['cell']} | {row['mode']} | {name} | {ms_text(ms)} | {ms_text(b2b)} | "
                         f"{ms_text(host, 1)} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    write_report(args.out, {"environment": env, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
