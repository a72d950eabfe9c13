"""Masked batched decode: what a padded batch's decode step costs per call through `opdispatch.attention`, against
torch's SDPA with the same boolean mask.

A batch of `--batch` sequences, every other one left-padded by `--pad` keys, decodes with one query per sequence
over a growing KV cache (bhsd slices of a preallocated cache, as transformers' DynamicCache hands them) and a
(batch, 1, 1, length) boolean mask each step, as transformers sends it. Variants run round-robin `--repeat` times;
each figure is the median of the per-round means (µs per call, the device synchronised at the ends of a round):

- first pass: every length new to the fast path (its exact-signature entries forgotten before each round; the
  decision and the size-generic template stay, as in a generate() of a new prompt length);
- repeated lengths: the same lengths again (every call a fast-path hit);
- torch SDPA with the same mask and `enable_gqa`;
- with ``--pin ID`` (repeatable), both opdispatch variants again with that implementation pinned (``impl=ID``:
  keyed, decided and bound as its own signature), to compare kernels the policy does not choose in one run.

    python benchmarks/masked_decode.py                      # CUDA if present (bf16), else CPU (fp32)
    python benchmarks/masked_decode.py --device cpu --batch 4 --heads 8 --kv-heads 2 --head-dim 64
    python benchmarks/masked_decode.py --batch 32 --pin nvidia.cudnn --pin nvidia.mem_efficient   # H100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402  (one environment block for every benchmark)

import opdispatch  # noqa: E402
from opdispatch.base import _native  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--start", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--pad", type=int, default=16, help="keys of padding at the front of every other sequence")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pin", action="append", default=[], metavar="ID",
                   help="also time both variants with this implementation pinned (impl=ID); repeatable")
    p.add_argument("--out", type=Path, help="JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    gen = torch.Generator(device=device).manual_seed(0)
    longest = args.start + args.steps
    cache_k = torch.randn(args.batch, args.kv_heads, longest, args.head_dim, generator=gen, device=device, dtype=dtype)
    cache_v = torch.randn(args.batch, args.kv_heads, longest, args.head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(args.batch, args.heads, 1, args.head_dim, generator=gen, device=device, dtype=dtype)
    mask = torch.ones(args.batch, 1, 1, longest, dtype=torch.bool, device=device)
    mask[1::2, :, :, : args.pad] = False
    lengths = range(args.start + 1, longest + 1)
    attention, manager = opdispatch.attention, opdispatch.get_manager()
    gqa = args.heads != args.kv_heads

    def decode(impl: str | None = None) -> Callable[[], None]:
        def ours() -> None:
            for n in lengths:
                attention(q, cache_k[:, :, :n], cache_v[:, :, :n], layout="bhsd", attn_mask=mask[..., :n], impl=impl)
        return ours

    def new_lengths(ours: Callable[[], None]) -> Callable[[], None]:
        def first_pass() -> None:
            manager.fast.clear()  # the exact signatures only: decisions and size-generic templates stay
            _native.forget()
            ours()
        return first_pass

    def sdpa() -> None:
        for n in lengths:
            F.scaled_dot_product_attention(q, cache_k[:, :, :n], cache_v[:, :, :n], attn_mask=mask[..., :n],
                                           enable_gqa=gqa)

    ours = decode()
    variants = {"first pass (every length new)": new_lengths(ours), "repeated lengths (fast-path hits)": ours}
    for impl in args.pin:
        pinned = decode(impl)
        variants[f"{impl} pinned: first pass"] = new_lengths(pinned)
        variants[f"{impl} pinned: repeated lengths"] = pinned
    variants["torch SDPA, same mask"] = sdpa
    for fn in variants.values():  # warm-up: decisions, templates, kernels' plans
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples[name].append((time.perf_counter() - start) / len(lengths) * 1e6)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    explained = opdispatch.explain(q, cache_k[:, :, :longest], cache_v[:, :, :longest], layout="bhsd",
                                   attn_mask=mask)
    for impl in [None, *args.pin]:  # a first pass cleared the others' entries: one call each to read them back
        attention(q, cache_k, cache_v, layout="bhsd", attn_mask=mask, impl=impl)
    bound = {getattr(getattr(fn, "decision", None), "chosen_id", None): fn
             for key, fn in manager.fast.items() if key and key[0] == "attention"}
    env = environment(device)
    sdpa_us = medians["torch SDPA, same mask"]
    lines = [f"# Masked batched decode: batch {args.batch}, {args.heads}/{args.kv_heads} heads, d{args.head_dim}, "
             f"{str(dtype)[6:]}, lengths {args.start + 1}-{longest}, every other sequence padded by {args.pad}", "",
             f"{env['device']}; torch {env['torch']}; commit {env.get('commit')}; decision: {explained.chosen_id}; "
             f"bound function size-generic: {getattr(bound.get(explained.chosen_id), 'size_generic', None)}"
             + "".join(f"; {impl} bound size-generic: {getattr(bound.get(impl), 'size_generic', None)}"
                       for impl in args.pin), "",
             "| variant | µs per call | / torch SDPA |", "|---|---:|---:|"]
    for name, value in medians.items():
        lines.append(f"| {name} | {value:.1f} | {value / sdpa_us:.2f}x |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "args": vars(args) | {"out": str(args.out)},
                                        "per_call_us": medians, "samples_us": samples,
                                        "decision": explained.chosen_id}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
