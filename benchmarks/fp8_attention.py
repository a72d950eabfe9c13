"""FP8 attention forward against the best bf16 kernel (GPU): TFLOP/s at 2k-16k, causal and not, d128, GQA 4:1, with
the FP8 result's error against the float32 reference and the bound it is held to.

Each cell times, by one method for every variant (side_by_side.back_to_back_ms: device time per call over
`PROFILED_CALLS` back-to-back calls between one pair of CUDA events, interleaved rounds): bf16 q/k/v through
nvidia.cudnn and nvidia.flash pinned (the best bf16 kernel is the faster; the policy's pick too where it is
neither), and e4m3 q/k/v quantized per tensor (current scaling: descale = amax / 448) through
`nvidia.cudnn_frontend` pinned, twice: a bf16 output (FP8 SDPA with an FP8 output, v's amax and the scale, then
dequantized by the op: all inside the time) and an FP8 output (`out_dtype=e4m3`, `out_scale` = 448 / the amax the
first call wrote into `out_amax`: delayed scaling, as TransformerEngine's fp8_mha keeps FP8 across attention; no
amax, no dequantization). Error: max |out - ref| / max |ref|, the FP8 output divided by its scale first, ref =
float32 attention of the *dequantized* FP8 inputs (what FP8 can be asked to match), and of the original bf16 inputs
(what quantizing costs); the bound held is `BOUND` (e4m3 has a 3-bit mantissa: 2**-4 per rounding, P and O each
rounded once). A cell fails (exit 1) when an error exceeds the bound. The summary table: op TFLOP/s and the ratio
to the best bf16 kernel per length, causal and not.

Where the time goes: each variant is also run `PROFILED_CALLS` times back to back under torch.profiler (CUDA
activity), with CUDA events around the same calls: the kernels per call — the attention kernel (the longest)
against every other (for FP8: max|v|, scale_o, the dequantization) — and the op's time *of that run*, whose
difference is the GPU's idle time between the call's kernels (`idle_us`). Before this, the op's time came from
`interleaved_ms` — a synchronize after every call, so each sample also held the host's validation and its four
launches (three through Triton's Python launcher) while the GPU waited, and the median of 20 such samples —
while the kernels came from 10 unsynchronized calls under the profiler, summed without the gaps: two methods, two
moments of the GPU's clock, and a gap (703 against ~800 TFLOP/s at 4k) that neither could attribute.

First call: `fp8_first_call_s` is the wall time of the cell's first FP8 call (a new signature: the cuDNN graph's
build, and with the adapter's `autotune` option — on by default, `--autotune off` turns it off through a policy
layered on the default — every plan's build and timing), synchronized; run once per setting to read what autotuning
costs and what it buys (`tflops`).

    bash -c 'source benchmarks/_gpu_setup.sh "$OUT"; python3 $repo/benchmarks/fp8_attention.py --out $out/fp8.json'

`--backward`: forward+backward instead (training, bf16 q/k/v that require grad): every bf16 implementation the
policy finds eligible (the best named) against `nvidia.cudnn_frontend` with its `fp8_dpa` option (bf16 in and out,
cast to e4m3 inside, FP8 forward and backward; set through a policy over the default), TFLOP/s counting the
backward as 2.5 forwards; the error of dq/dk/dv (max |Δ| / max |ref|) against float32 autograd on the dequantized
inputs and dO (the same current scaling), held to `BACKWARD_BOUND`.

    bash -c 'source benchmarks/_gpu_setup.sh "$OUT"; python3 $repo/benchmarks/fp8_attention.py --backward \
             --out $out/fp8-backward.json'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _impl_options import use_attention_options  # noqa: E402
from decode_loop import environment  # noqa: E402
from side_by_side import back_to_back_ms, interleaved_ms  # noqa: E402

PROFILED_CALLS = 10
BOUND = 0.08  # max-abs error relative to the output's max, against the float32 reference of the same inputs
SEQLENS = (2048, 4096, 8192, 16384)
# dq/dk/dv: e4m3's 2**-4 rounding of dO, of the output the backward reads (in D = rowsum(dO o)) and of dP enter
# dS = P (dP - D), where dP - D cancels; then each gradient's own FP8 rounding. Max-abs error over the max.
BACKWARD_BOUND = 0.25


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


def kernel_breakdown(fn: Any, calls: int) -> tuple[list[dict[str, Any]], float]:
    """The GPU kernels (and memsets/copies) `fn` launches, per call: name, launches and microseconds per call,
    longest first, and the op's own microseconds per call *of the same run*: `calls` back-to-back calls between
    one pair of CUDA events inside the profiled region (torch.profiler with CUDA activity, after one warm call) —
    the method `back_to_back_ms` times every variant with, so op time minus the kernels' sum is the GPU's idle
    time between the call's kernels, nothing else."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
    launches: dict[str, list[float]] = {}
    for event in prof.events():  # (device events only: kernels, memsets, copies, each with its GPU interval)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            launches.setdefault(event.name, []).append(event.time_range.elapsed_us())
    kernels = [{"kernel": name, "launches_per_call": len(us) / calls, "us_per_call": sum(us) / calls}
               for name, us in launches.items()]
    return sorted(kernels, key=lambda k: -k["us_per_call"]), start.elapsed_time(end) * 1e3 / calls


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
    lines += ["", "| variant | op TFLOP/s | attention kernel TFLOP/s | other kernels µs/call | op µs/call (profiled "
                  "run) | idle between kernels µs/call |", "|---|---:|---:|---:|---:|---:|"]
    for variant in row.get("kernels", {}):
        other = row.get("other_kernels_us", {}).get(variant)
        profiled, idle = row.get("op_us_profiled", {}).get(variant), row.get("idle_us", {}).get(variant)
        lines.append(f"| {variant} | {op.get(variant, float('nan')):.0f} | {raw.get(variant, float('nan')):.0f} | "
                     f"{other if other is None else round(other, 1)} | "
                     f"{profiled if profiled is None else round(profiled, 1)} | "
                     f"{idle if idle is None else round(idle, 1)} |")
    return "\n".join(lines) + "\n"


FP8_BF16_OUT = "fp8 e4m3 -> bf16 out (nvidia.cudnn_frontend)"
FP8_FP8_OUT = "fp8 e4m3 -> e4m3 out (nvidia.cudnn_frontend, out_scale)"
BF16_KERNELS = ("nvidia.cudnn", "nvidia.flash")  # the best bf16 kernel: the larger TFLOP/s of these


def cell(seqlen: int, causal: bool, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    batch, hq, hkv, d = max(1, 32768 // seqlen), 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(seqlen + causal)
    q, k, v = (torch.randn(batch, seqlen, h, d, generator=gen, device=device, dtype=torch.bfloat16)
               for h in (hq, hkv, hkv))
    kind = torch.float8_e4m3fn
    (q8, qs), (k8, ks), (v8, vs) = (quantize(t, kind) for t in (q, k, v))
    bf16_pick = opdispatch.explain(q, k, v, causal=causal).chosen_id
    fp8 = dict(causal=causal, q_descale=qs, k_descale=ks, v_descale=vs, impl="nvidia.cudnn_frontend")
    out_amax = torch.zeros((), dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    opdispatch.attention(q8, k8, v8, **fp8, out_amax=out_amax)  # the signature's first call; writes the amax
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    # The FP8 output's scale from the last call's amax (delayed scaling, as TransformerEngine's fp8_mha keeps it):
    # a device tensor, no host read.
    out_scale = torch.finfo(kind).max / out_amax.clamp(min=1e-12)
    fns = {f"bf16 ({impl})": (lambda impl=impl: opdispatch.attention(q, k, v, causal=causal, impl=impl))
           for impl in BF16_KERNELS}
    if bf16_pick not in BF16_KERNELS:
        fns[f"bf16 ({bf16_pick})"] = lambda: opdispatch.attention(q, k, v, causal=causal)
    fns[FP8_BF16_OUT] = lambda: opdispatch.attention(q8, k8, v8, **fp8)
    fns[FP8_FP8_OUT] = lambda: opdispatch.attention(q8, k8, v8, **fp8, out_dtype=kind, out_scale=out_scale)
    # Every variant by one method: device time per call, `PROFILED_CALLS` back-to-back calls per event pair (the
    # host runs ahead, as in a model), interleaved rounds; the breakdown below times the same way.
    ms = back_to_back_ms(fns, device, args.reps, PROFILED_CALLS)
    flops = 4 * batch * hq * seqlen * seqlen * d * (0.5 if causal else 1.0)
    tflops = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items() if isinstance(t, float)}
    row: dict[str, Any] = {"seqlen": seqlen, "batch": batch, "heads": f"{hq}/{hkv}", "head_dim": d,
                           "causal": causal, "ms": ms, "autotune": args.autotune, "bf16_pick": bf16_pick,
                           "fp8_first_call_s": first_call_s, "tflops": tflops}
    bf16 = {n: t for n, t in tflops.items() if n.startswith("bf16 (") and n[6:-1] in BF16_KERNELS}
    if bf16:
        best = max(bf16, key=bf16.__getitem__)
        row["best_bf16"], row["best_bf16_tflops"] = best, bf16[best]
        row["ratio_vs_best_bf16"] = {n: tflops[n] / bf16[best] for n in (FP8_BF16_OUT, FP8_FP8_OUT) if n in tflops}
    row["kernels"], row["attention_kernel_tflops"], row["other_kernels_us"] = {}, {}, {}
    row["op_us_profiled"], row["idle_us"] = {}, {}
    for name, fn in fns.items():
        try:
            kernels, op_us = kernel_breakdown(fn, PROFILED_CALLS)
        except Exception as exc:  # noqa: BLE001 - reported in the row, as a failed timing is
            row["kernels"][name] = f"{type(exc).__name__}: {exc}"
            continue
        row["kernels"][name] = kernels
        row["op_us_profiled"][name] = op_us
        if kernels:
            row["attention_kernel_tflops"][name] = flops / (kernels[0]["us_per_call"] * 1e-6) / 1e12
            row["other_kernels_us"][name] = sum(k["us_per_call"] for k in kernels[1:])
            row["idle_us"][name] = op_us - sum(k["us_per_call"] for k in kernels)
    try:
        ref_deq = reference(q8.float() * qs, k8.float() * ks, v8.float() * vs, causal)
        ref_bf16 = reference(q, k, v, causal)
        peak = ref_deq.abs().max()
        outs = {FP8_BF16_OUT: opdispatch.attention(q8, k8, v8, **fp8).float(),
                FP8_FP8_OUT: opdispatch.attention(q8, k8, v8, **fp8, out_dtype=kind,
                                                  out_scale=out_scale).float() / out_scale}
        row["error_vs_dequantized_fp32"] = {n: float((o - ref_deq).abs().max() / peak) for n, o in outs.items()}
        row["error_vs_bf16_inputs_fp32"] = {n: float((o - ref_bf16).abs().max() / ref_bf16.abs().max())
                                            for n, o in outs.items()}
        row["out_amax_vs_fp32"] = float((out_amax - peak).abs() / peak)
        row["bound"] = BOUND
        row["within_bound"] = all(e <= BOUND for e in row["error_vs_dequantized_fp32"].values())
    except Exception as exc:  # noqa: BLE001 - reported in the row: a cell cuDNN refuses still shows bf16's time
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """Per length and masking: each FP8 variant's op TFLOP/s, its ratio to the best bf16 kernel, its error."""
    lines = ["## FP8 forward against the best bf16 kernel (op TFLOP/s, device time, back-to-back calls)", "",
             "| variant | seqlen | causal | op TFLOP/s | best bf16 | bf16 TFLOP/s | ratio | error vs fp32 | bound |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for name in (FP8_BF16_OUT, FP8_FP8_OUT):
            tflops = row["tflops"].get(name)
            error = row.get("error_vs_dequantized_fp32", {}).get(name)
            lines.append(f"| {name} | {row['seqlen']} | {'yes' if row['causal'] else 'no'} | "
                         f"{tflops if tflops is None else round(tflops)} | {row.get('best_bf16', '?')} | "
                         f"{round(row.get('best_bf16_tflops', float('nan')))} | "
                         f"{row.get('ratio_vs_best_bf16', {}).get(name, float('nan')):.2f}x | "
                         f"{error if error is None else f'{error:.4f}'} | {row.get('bound', BOUND)} |")
    return "\n".join(lines) + "\n"


def backward_cell(seqlen: int, causal: bool, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    batch, hq, hkv, d = max(1, 32768 // seqlen), 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(seqlen + causal)
    q, k, v = (torch.randn(batch, seqlen, h, d, generator=gen, device=device, dtype=torch.bfloat16)
               .requires_grad_() for h in (hq, hkv, hkv))
    d_o = torch.randn(batch, seqlen, hq, d, generator=gen, device=device, dtype=torch.bfloat16)
    decision = opdispatch.explain(q, k, v, causal=causal)
    bf16_ids = [c.impl_id for c in decision.candidates if c.status in ("chosen", "eligible")
                and c.impl_id != "nvidia.cudnn_frontend" and c.impl_id.split(".")[0] not in ("reference", "cpu")]

    def step(impl: str) -> Any:
        def fn() -> None:
            for t in (q, k, v):
                t.grad = None
            opdispatch.attention(q, k, v, causal=causal, impl=impl).backward(d_o)
        return fn

    fp8_name = "fp8 e4m3 fwd+bwd (nvidia.cudnn_frontend, fp8_dpa)"
    fns = {f"bf16 fwd+bwd ({i})": step(i) for i in bf16_ids}
    fns[fp8_name] = step("nvidia.cudnn_frontend")
    torch.cuda.synchronize()
    start = time.perf_counter()
    fns[fp8_name]()  # the signature's first call: forward and backward graph builds (and autotuning)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    ms = interleaved_ms(fns, device, args.warmup, args.reps)
    flops = 3.5 * 4 * batch * hq * seqlen * seqlen * d * (0.5 if causal else 1.0)  # backward: 2.5 forwards
    tflops = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items() if isinstance(t, float)}
    row: dict[str, Any] = {"seqlen": seqlen, "batch": batch, "heads": f"{hq}/{hkv}", "head_dim": d,
                           "causal": causal, "ms": ms, "tflops": tflops, "autotune": args.autotune,
                           "fp8_first_call_s": first_call_s, "bf16_pick": decision.chosen_id}
    bf16 = {n: t for n, t in tflops.items() if n != fp8_name}
    if bf16 and fp8_name in tflops:
        best = max(bf16, key=bf16.__getitem__)
        row["best_bf16"], row["fp8_speedup_vs_best_bf16"] = best, tflops[fp8_name] / bf16[best]
    try:
        fns[fp8_name]()
        got = [t.grad.float() for t in (q, k, v)]
        kind = torch.float8_e4m3fn
        leaves = [(t8.float() * s).requires_grad_() for t8, s in (quantize(t.detach(), kind) for t in (q, k, v))]
        d_o8, d_os = quantize(d_o, kind)
        reference(*leaves, causal).backward(d_o8.float() * d_os)
        errors = {name: float((g - ref.grad).abs().max() / ref.grad.abs().max())
                  for name, g, ref in zip(("dq", "dk", "dv"), got, leaves, strict=True)}
        row["grad_error_vs_dequantized_fp32"] = errors
        row["bound"] = BACKWARD_BOUND
        row["within_bound"] = all(e <= BACKWARD_BOUND for e in errors.values())
    except Exception as exc:  # noqa: BLE001 - reported in the row: a cell cuDNN refuses still shows bf16's times
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20,
                        help=f"timed samples per variant (forward: each of {PROFILED_CALLS} back-to-back calls)")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--autotune", choices=("on", "off"), default="on",
                        help="nvidia.cudnn_frontend's autotune option (off: a policy over the default sets it)")
    parser.add_argument("--backward", action="store_true",
                        help="forward+backward of bf16 calls: the bf16 kernels against the frontend's fp8_dpa")
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment(device)
    options = {"autotune": args.autotune == "on", "fp8_dpa": args.backward}
    if options != {"autotune": True, "fp8_dpa": False}:
        use_attention_options("nvidia.cudnn_frontend", options)
    try:
        import cudnn

        env["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        env["cudnn_backend"] = cudnn.backend_version()
    except ImportError as exc:
        print(f"nvidia-cudnn-frontend is not installed ({exc}); carry its wheel", file=sys.stderr)
        return 2
    if args.backward:
        rows = []
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            for causal in (False, True):
                rows.append(backward_cell(seqlen, causal, device, args))
                print(json.dumps(rows[-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
        return 0 if all(r.get("within_bound", False) for r in rows) else 1
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
    markdown.append(summary_markdown(rows))
    print(markdown[-1], flush=True)
    result = {"environment": env, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text("\n".join(markdown))
    return 0 if all(r.get("within_bound", False) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
