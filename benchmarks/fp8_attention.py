"""FP8 attention forward against the best bf16 kernel (GPU): TFLOP/s at 2k-16k, causal and not, d128, GQA 4:1, with
the FP8 result's error against the float32 reference and the bound it is held to.

Each cell times, interleaved (side_by_side.interleaved_ms): `opdispatch.attention` on bf16 q/k/v (the policy's
pick, named in the output), and on e4m3 q/k/v quantized per tensor (current scaling: descale = amax / 448) through
`nvidia.cudnn_frontend` (impl pinned: FP8 SDPA, FP8 output with scale_o, dequantized to bf16 by the op; the
op's amax, scale and dequantize steps are inside the FP8 time). Error: max |out_fp8 - ref| / max |ref|, ref =
float32 attention of the *dequantized* FP8 inputs (what FP8 can be asked to match), and of the original bf16
inputs (what quantizing costs); the bound held is `BOUND` (e4m3 has a 3-bit mantissa: 2**-4 per rounding, P and O
each rounded once). A cell fails (exit 1) when the error exceeds the bound.

Where the time goes: each variant is also run `PROFILED_CALLS` times under torch.profiler (CUDA activity) and its
kernels are listed per call — the attention kernel (the call's longest kernel) against every other kernel the
call launches (for FP8: max|v|, scale_o, the dequantization; layout copies, if any) — in the row
(`kernels`, `attention_kernel_tflops`: the raw kernel's TFLOP/s, apart from the op's `tflops`) and as a markdown
table (`--out` with suffix .md, also printed).

First call: `fp8_first_call_s` is the wall time of the cell's first FP8 call (a new signature: the cuDNN graph's
build, and with the adapter's `autotune` option — on by default, `--autotune off` turns it off through a policy
layered on the default — every plan's build and timing), synchronized; run once per setting to read what autotuning
costs and what it buys (`tflops`).

    bash -c 'source benchmarks/_gpu_setup.sh "$OUT"; python3 $repo/benchmarks/fp8_attention.py --out $out/fp8.json'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402
from side_by_side import interleaved_ms  # noqa: E402

PROFILED_CALLS = 10
BOUND = 0.08  # max-abs error relative to the output's max, against the float32 reference of the same inputs
SEQLENS = (2048, 4096, 8192, 16384)


def quantize(t: torch.Tensor, kind: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling: (fp8 tensor, float32 descale) with t ~ fp8 * descale."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    descale = amax / torch.finfo(kind).max
    return (t.float() / descale).to(kind), descale


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """float32 attention (bshd in and out), torch's math via SDPA on float32 with GQA expanded."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


def kernel_breakdown(fn: Any, calls: int) -> list[dict[str, Any]]:
    """The GPU kernels (and memsets/copies) `fn` launches, per call: name, launches and microseconds per call,
    longest first (torch.profiler with CUDA activity, after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    launches: dict[str, list[float]] = {}
    for event in prof.events():  # (device events only: kernels, memsets, copies, each with its GPU interval)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches.setdefault(event.name, []).append(event.time_range.elapsed_us())
    kernels = [{"kernel": name, "launches_per_call": len(us) / calls, "us_per_call": sum(us) / calls}
               for name, us in launches.items()]
    return sorted(kernels, key=lambda k: -k["us_per_call"])


def breakdown_markdown(row: dict[str, Any]) -> str:
    lines = [f"### seqlen {row['seqlen']}, batch {row['batch']}, heads {row['heads']}, d{row['head_dim']}, "
             f"{'causal' if row['causal'] else 'not causal'}", "",
             "| variant | kernel | launches/call | µs/call | share |", "|---|---|---:|---:|---:|"]
    for variant, kernels in row.get("kernels", {}).items():
        if isinstance(kernels, str):
            lines.append(f"| {variant} | (profile failed: {kernels}) | | | |")
            continue
        total = sum(k["us_per_call"] for k in kernels) or 1.0
        for i, k in enumerate(kernels):
            name = k["kernel"] if len(k["kernel"]) <= 90 else k["kernel"][:87] + "..."
            tag = "**attention** " if i == 0 else ""
            lines.append(f"| {variant} | {tag}`{name}` | {k['launches_per_call']:g} | {k['us_per_call']:.1f} | "
                         f"{k['us_per_call'] / total:.0%} |")
        lines.append(f"| {variant} | all kernels | | {total:.1f} | |")
    op = row.get("tflops", {})
    raw = row.get("attention_kernel_tflops", {})
    if "fp8_first_call_s" in row:
        lines += ["", f"FP8 first call (graph build{' and autotuning' if row.get('autotune') == 'on' else ''}): "
                      f"{row['fp8_first_call_s']:.3f} s"]
    lines += ["", "| variant | op TFLOP/s | attention kernel TFLOP/s | other kernels µs/call |", "|---|---:|---:|---:|"]
    for variant in row.get("kernels", {}):
        other = row.get("other_kernels_us", {}).get(variant)
        lines.append(f"| {variant} | {op.get(variant, float('nan')):.0f} | {raw.get(variant, float('nan')):.0f} | "
                     f"{other if other is None else round(other, 1)} |")
    return "\n".join(lines) + "\n"


def cell(seqlen: int, causal: bool, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    batch, hq, hkv, d = max(1, 32768 // seqlen), 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(seqlen + causal)
    q, k, v = (torch.randn(batch, seqlen, h, d, generator=gen, device=device, dtype=torch.bfloat16)
               for h in (hq, hkv, hkv))
    kind = torch.float8_e4m3fn
    (q8, qs), (k8, ks), (v8, vs) = (quantize(t, kind) for t in (q, k, v))
    bf16_pick = opdispatch.explain(q, k, v, causal=causal).chosen_id
    torch.cuda.synchronize()
    start = time.perf_counter()
    opdispatch.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs,
                         impl="nvidia.cudnn_frontend")
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    fns = {
        f"bf16 ({bf16_pick})": lambda: opdispatch.attention(q, k, v, causal=causal),
        "fp8 e4m3 (nvidia.cudnn_frontend)": lambda: opdispatch.attention(
            q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs, impl="nvidia.cudnn_frontend"),
    }
    ms = interleaved_ms(fns, device, args.warmup, args.reps)
    flops = 4 * batch * hq * seqlen * seqlen * d * (0.5 if causal else 1.0)
    row: dict[str, Any] = {"seqlen": seqlen, "batch": batch, "heads": f"{hq}/{hkv}", "head_dim": d,
                           "causal": causal, "ms": ms, "autotune": args.autotune,
                           "fp8_first_call_s": first_call_s,
                           "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items() if isinstance(t, float)}}
    times = [t for t in ms.values() if isinstance(t, float)]
    if len(times) == 2:
        row["fp8_speedup"] = times[0] / times[1]
    row["kernels"], row["attention_kernel_tflops"], row["other_kernels_us"] = {}, {}, {}
    for name, fn in fns.items():
        try:
            kernels = kernel_breakdown(fn, PROFILED_CALLS)
        except Exception as exc:  # noqa: BLE001 - reported in the row, as a failed timing is
            row["kernels"][name] = f"{type(exc).__name__}: {exc}"
            continue
        row["kernels"][name] = kernels
        if kernels:
            row["attention_kernel_tflops"][name] = flops / (kernels[0]["us_per_call"] * 1e-6) / 1e12
            row["other_kernels_us"][name] = sum(k["us_per_call"] for k in kernels[1:])
    if len(row["attention_kernel_tflops"]) == 2:
        bf16_raw, fp8_raw = row["attention_kernel_tflops"].values()
        row["fp8_attention_kernel_speedup"] = fp8_raw / bf16_raw
    try:
        out8 = opdispatch.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs,
                                    impl="nvidia.cudnn_frontend").float()
        ref_deq = reference(q8.float() * qs, k8.float() * ks, v8.float() * vs, causal)
        ref_bf16 = reference(q, k, v, causal)
        row["error_vs_dequantized_fp32"] = float((out8 - ref_deq).abs().max() / ref_deq.abs().max())
        row["error_vs_bf16_inputs_fp32"] = float((out8 - ref_bf16).abs().max() / ref_bf16.abs().max())
        row["bound"] = BOUND
        row["within_bound"] = row["error_vs_dequantized_fp32"] <= BOUND
    except Exception as exc:  # noqa: BLE001 - reported in the row: a cell cuDNN refuses still shows bf16's time
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--autotune", choices=("on", "off"), default="on",
                        help="nvidia.cudnn_frontend's autotune option (off: a policy over the default sets it)")
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment(device)
    if args.autotune == "off":
        policy = Path(tempfile.mkdtemp()) / "autotune-off.yaml"
        policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                          "      nvidia.cudnn_frontend: {autotune: false}\n")
        opdispatch.get_manager().set_policy(str(policy))
    try:
        import cudnn

        env["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        env["cudnn_backend"] = cudnn.backend_version()
    except ImportError as exc:
        print(f"nvidia-cudnn-frontend is not installed ({exc}); carry its wheel", file=sys.stderr)
        return 2
    rows = []
    markdown = [f"# FP8 attention forward: kernel breakdown ({env.get('device', '?')}, cuDNN frontend "
                f"{env['cudnn_frontend']}, cuDNN {env['cudnn_backend']}, autotune {args.autotune})", ""]
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for causal in (False, True):
            row = cell(seqlen, causal, device, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            markdown.append(breakdown_markdown(row))
            print(markdown[-1], flush=True)
    result = {"environment": env, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text("\n".join(markdown))
    return 0 if all(r.get("within_bound", False) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
