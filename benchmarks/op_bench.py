"""rms_norm and rotary_embedding through opdispatch, per implementation (pinned with impl=) and as the policy picks,
next to torch baselines, forward and forward+backward, for a decode step and a prefill.

Prints a markdown table with device and versions (and writes it as JSON with --out). Times are medians of CUDA-event
timed loops (each loop runs the call `--inner` times back to back, so launch and dispatch costs count as users feel
them). `--tiny` runs a few small cases on the CPU (the script's own test).

    python benchmarks/op_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import opdispatch


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "flag_gems", "flash_attn"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception as exc:  # not installed, or no device for it
            out[name] = f"absent ({type(exc).__name__})"
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["cuda"] = str(torch.version.cuda)
    else:
        out["device"] = "cpu"
    return out


def timed(fn: Callable[[], Any], reps: int, inner: int, device: torch.device) -> float:
    """Median microseconds per call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / inner)
    return statistics.median(samples)


def _grad_step(fn: Callable[[], Any], leaves: list[torch.Tensor]) -> Callable[[], Any]:
    def step() -> None:
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for leaf in leaves:
            leaf.grad = None
    return step


def _compiled_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def _rms_variants(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None,
                  compiled: Callable[..., Any] | None) -> dict[str, Callable[[], Any]]:
    """The timed variants of one rms_norm case (a function of its own, so every closure sees this case's tensors)."""
    hidden = x.shape[-1]
    variants: dict[str, Callable[[], Any]] = {}
    for impl in ("policy", "torch.rms_norm", "flagos.rms_norm", "reference.rms_norm"):
        pin = None if impl == "policy" else impl
        variants[f"opdispatch {impl}"] = lambda pin=pin: opdispatch.rms_norm(x, w, 1e-6, r, impl=pin)
    if r is None:
        variants["torch F.rms_norm"] = lambda: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6)
        if compiled is not None:
            variants["torch.compile F.rms_norm"] = lambda: compiled(x, w, 1e-6)
    else:
        variants["torch add + F.rms_norm"] = lambda: (torch.nn.functional.rms_norm(x + r, (hidden,), w, 1e-6), x + r)
    return variants


def rms_cases(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict[str, Any]]:
    hidden = 256 if tiny else 4096
    shapes = {"decode": (64, hidden), "batch": (1024, hidden), "chunk": (8192, hidden),
              "prefill": (8 * (64 if tiny else 4096), hidden)}
    if tiny:
        shapes = {"decode": (64, hidden), "prefill": (512, hidden)}
    compiled = None if tiny else torch.compile(_compiled_rms, dynamic=False)
    rows = []
    for shape_name, shape in shapes.items():
        for residual in (False, True):
            for grad in (False, True):
                x = torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
                w = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=grad)
                r = torch.randn(shape, device=device, dtype=dtype) if residual else None
                rows.append(dict(op="rms_norm", shape=f"{shape_name} {shape[0]}x{shape[1]}",
                                 residual=residual, grad=grad, variants=_rms_variants(x, w, r, compiled),
                                 leaves=[x, w] if grad else [],
                                 chosen=lambda x=x, w=w, r=r: opdispatch.explain_rms_norm(x, w, 1e-6, r).chosen_id))
    return rows


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The Hugging Face formulation (rotate_half on full-width cos/sin), the common eager baseline."""
    c = torch.cat((cos[pos], cos[pos]), dim=-1).unsqueeze(-2).to(x.dtype)
    s = torch.cat((sin[pos], sin[pos]), dim=-1).unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def _rope_variants(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offsets: int,
                   pos: torch.Tensor) -> dict[str, Callable[[], Any]]:
    variants: dict[str, Callable[[], Any]] = {}
    for impl in ("policy", "flagos.rotary_embedding", "nvidia.flash_rotary", "reference.rotary_embedding"):
        pin = None if impl == "policy" else impl
        variants[f"opdispatch {impl}"] = (
            lambda pin=pin: opdispatch.rotary_embedding(q, k, cos, sin, seqlen_offsets=offsets, impl=pin))
    variants["torch eager rotate_half"] = lambda: (_torch_rope(q, cos, sin, pos), _torch_rope(k, cos, sin, pos))
    return variants


def rotary_cases(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict[str, Any]]:
    d, hq, hk = (32, 4, 2) if tiny else (128, 32, 8)
    shapes = {"decode": (64, 1), "prefill": (8, 64 if tiny else 4096)}
    theta = torch.arange(8192, device=device, dtype=torch.float32)[:, None] * (
        1e4 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    cos, sin = theta.cos(), theta.sin()
    rows = []
    for shape_name, (b, s) in shapes.items():
        for grad in (False, True):
            q = torch.randn(b, s, hq, d, device=device, dtype=dtype, requires_grad=grad)
            k = torch.randn(b, s, hk, d, device=device, dtype=dtype, requires_grad=grad)
            offsets = 100 if s == 1 else 0  # a decode step sits after a prompt
            pos = torch.arange(s, device=device).expand(b, s) + offsets
            rows.append(dict(op="rotary_embedding", shape=f"{shape_name} {b}x{s}x{hq}/{hk}x{d}", residual=False,
                             grad=grad, variants=_rope_variants(q, k, cos, sin, offsets, pos),
                             leaves=[q, k] if grad else [],
                             chosen=lambda q=q, k=k, offsets=offsets: opdispatch.explain_rotary_embedding(
                                 q, k, cos, sin, seqlen_offsets=offsets).chosen_id))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few small CPU cases (the script's own test)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    reps, inner = (3, 2) if args.tiny else (args.reps, args.inner)
    info = versions()
    print(f"device: {info['device']}; " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "device"))
    print()
    print("| op | shape | residual | pass | implementation | µs/call | chosen by policy |")
    print("|---|---|---|---|---|---:|---|")
    results = []
    for row in rms_cases(device, dtype, args.tiny) + rotary_cases(device, dtype, args.tiny):
        for label, fn in row["variants"].items():
            step = _grad_step(fn, row["leaves"]) if row["grad"] else fn
            chosen = row["chosen"]() if label == "opdispatch policy" else ""
            try:
                us = timed(step, reps, inner, device)
                text = f"{us:.1f}"
            except Exception as exc:  # an implementation that cannot take the case says why, in the table
                us, text = None, "n/a: " + _why(exc)
            print(f"| {row['op']} | {row['shape']} | {'yes' if row['residual'] else 'no'} | "
                  f"{'fwd+bwd' if row['grad'] else 'fwd'} | {label} | {text} | {chosen} |", flush=True)
            results.append(dict(op=row["op"], shape=row["shape"], residual=row["residual"], grad=row["grad"],
                                variant=label, us=us, note=None if us is not None else text, chosen=chosen))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"versions": info, "rows": results}, f, indent=1)
    return 0


def _why(exc: Exception) -> str:
    """The short reason a variant could not run: a pinned implementation's reasons, else the exception's line."""
    text = str(exc)
    if "It is " in text:  # PinnedImplementationError: "... It is <status>: <reasons>."
        return text.split("It is ", 1)[1].splitlines()[0][:110]
    return f"{type(exc).__name__}: {text.splitlines()[0][:100]}" if text else type(exc).__name__


if __name__ == "__main__":
    raise SystemExit(main())
