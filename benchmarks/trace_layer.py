"""Profile one training step of a small Llama-shaped transformer layer and see what opdispatch ran (issue 34).

The layer: RMSNorm (opdispatch.rms_norm), q/k/v projections, rotary (opdispatch.rotary_embedding), causal GQA
attention (opdispatch.attention), the output projection, RMSNorm fused with the residual add (opdispatch.rms_norm
with `residual=`) and a SwiGLU MLP of torch linear layers; bf16 on CUDA, fp32 on the CPU. After warm-up steps (the
decisions) it runs two steps under torch.profiler (CPU and CUDA activities, record_shapes): the first binds the
range-carrying fast path (a profiler's state is part of every fast-path key), the second is the profiled step. It
writes

- the Chrome trace of that step alone (`--trace`, gzipped when it ends in .gz): the host ops and opdispatch ranges of
  every thread within the step, the kernels, copies and memsets their launches caused, and the flows linking them
  (launch to kernel, forward op to its backward node); timestamps are µs from the step's start. It opens in
  Perfetto (ui.perfetto.dev) or chrome://tracing, and `benchmarks/render_trace.py` draws it as a PNG;
- a Markdown summary (`--summary`): each opdispatch range, its implementation, the kernels it launched forward and
  those its forward ops' backward nodes launched, with device times (on the CPU: the aten ops it ran, host times).

    python benchmarks/trace_layer.py --device cuda --trace trace-h100.json.gz --summary trace-h100.md
    python benchmarks/render_trace.py trace-h100.json.gz --out docs/images/trace-h100.png
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_trace import (  # noqa: E402
    BACKWARD_NODE,
    DEVICE_CATEGORIES,
    HOST_CATEGORIES,
    NEST_SLACK_US,
    analyse,
    short_kernel_name,
    write_trace,
)

BIND_STEP = "trace_layer.bind"
PROFILED_STEP = "trace_layer.step"
SIZES = {  # Llama-shaped: GQA 4:1, head dim 128, SwiGLU of ~2.7x the hidden size
    "cuda": dict(batch=1, seq=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632),
    "cpu": dict(batch=1, seq=256, heads=8, kv_heads=2, head_dim=64, ffn=1408),
}


class Layer:
    """A Llama decoder layer's weights and its forward through opdispatch's ops."""

    def __init__(self, *, heads: int, kv_heads: int, head_dim: int, ffn: int, max_seq: int, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        hidden = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
            return w.to(device=device, dtype=dtype).requires_grad_()

        self.attn_norm = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
        self.mlp_norm = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
        self.wqkv = weight((heads + 2 * kv_heads) * head_dim, hidden)
        self.wo = weight(hidden, hidden)
        self.w_gate_up = weight(2 * ffn, hidden)
        self.w_down = weight(hidden, ffn)
        # The rotary cache (NeoX pairs, base 10000): (max_seq, head_dim / 2).
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq)
        self.cos, self.sin = (t.to(device=device, dtype=dtype) for t in (angles.cos(), angles.sin()))

    def parameters(self) -> list[torch.Tensor]:
        return [self.attn_norm, self.mlp_norm, self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        h = opdispatch.rms_norm(x, self.attn_norm, eps=1e-5)
        q, k, v = F.linear(h, self.wqkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        q, k = opdispatch.rotary_embedding(q, k, self.cos, self.sin)
        attn = opdispatch.attention(q, k, v, causal=True).reshape(b, s, hidden)
        h, x = opdispatch.rms_norm(F.linear(attn, self.wo), self.mlp_norm, eps=1e-5, residual=x)
        gate, up = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down)


def trim(data: dict[str, Any], step_name: str = PROFILED_STEP) -> dict[str, Any]:
    """The trace of the last range named `step_name` alone: host slices of its process within it, the device
    slices its launches caused, their launch flows, the forward-backward flows within it, and the names of the
    processes and threads left; timestamps rebased to the step's start."""
    events = data["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == step_name
             and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"no {step_name!r} range in the trace: record the step inside "
                         f"torch.profiler.record_function({step_name!r})")
    step = max(steps, key=lambda e: e["ts"])
    lo, hi, pid = float(step["ts"]), float(step["ts"]) + float(step["dur"]), step["pid"]

    def within(e: dict[str, Any]) -> bool:
        return e["pid"] == pid and lo <= float(e["ts"]) <= hi

    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and within(e)
            and float(e["ts"]) + float(e.get("dur", 0)) <= hi + NEST_SLACK_US]
    correlations = {(e.get("args") or {}).get("correlation") for e in host} - {None}
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
              and (e.get("args") or {}).get("correlation") in correlations]
    kept = host + device
    if device:  # the step's and opdispatch's ranges as the GPU timeline shows them, over the kernels' span
        d_lo, d_hi = min(float(e["ts"]) for e in device), max(float(e["ts"]) + float(e["dur"]) for e in device)
        kept += [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"
                 and d_lo - 1 <= float(e["ts"]) and float(e["ts"]) + float(e["dur"]) <= d_hi + 1]
    # Launch flows start at a kept launch (their id is its correlation id in Kineto's traces; matched by position
    # too) and end on its kernel; forward-backward flows are kept when both ends lie within the step.
    launch_starts = {(e["pid"], e["tid"], e["ts"]) for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ac2g_ids = {e.get("id") for e in events if e.get("cat") == "ac2g" and e.get("ph") == "s"
                and (e.get("id") in correlations or (e["pid"], e["tid"], e["ts"]) in launch_starts)}
    fwdbwd = [e for e in events if e.get("cat") == "fwdbwd" and e.get("ph") in ("s", "f") and within(e)]
    fwdbwd_ids = [e.get("id") for e in fwdbwd]
    flows = [e for e in events if e.get("cat") == "ac2g" and e.get("ph") in ("s", "f") and e.get("id") in ac2g_ids]
    flows += [e for e in fwdbwd if fwdbwd_ids.count(e.get("id")) == 2]
    threads = {(e["pid"], e["tid"]) for e in kept}
    pids = {p for p, _ in threads}
    meta = [dict(e, ts=0) for e in events if e.get("ph") == "M" and e.get("pid") in pids
            and (e.get("name", "").startswith("process_") or (e["pid"], e.get("tid")) in threads)]
    out = [*meta, *(dict(e, ts=round(float(e["ts"]) - lo, 3)) for e in kept + flows)]
    head = {k: v for k, v in data.items() if k not in ("traceEvents", "traceName", "baseTimeNanoseconds")}
    return {**head, "traceEvents": out}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def summarise(data: dict[str, Any], header: list[str]) -> str:
    """Markdown: each opdispatch range of a trimmed trace with what it ran, forward and backward."""
    a = analyse(data)
    unit = "device µs" if a.on_gpu else "host µs"
    lines = [*header, ""]
    total = sum(float(k["dur"]) for k in a.device_slices)
    if a.on_gpu:
        in_ranges = sum(float(k["dur"]) for r in a.ranges for k in r.kernels + r.backward_kernels)
        lines += [f"Device time of the step: {total:.1f} µs in {len(a.device_slices)} kernels/copies; "
                  f"{in_ranges:.1f} µs ({in_ranges / total:.0%}) launched by opdispatch's ranges "
                  "(forward) or their forward ops' backward nodes.", ""]
    else:
        lines += ["No GPU: each range lists the aten ops directly under it and the autograd nodes of its backward, "
                  "with host times.", ""]
    lines += ["| # | range | op | implementation | host µs | forward: what ran | backward: what ran |",
              "|---|---|---|---|---|---|---|"]

    def listing(items: list[dict[str, Any]]) -> str:
        if not items:
            return "—"
        merged: dict[str, list[float]] = {}
        for e in items:
            name = str(e["name"]).removeprefix(BACKWARD_NODE)
            merged.setdefault(short_kernel_name(name, 60), []).append(float(e["dur"]))
        return "<br>".join(f"`{n}`{f' x{len(d)}' if len(d) > 1 else ''} {sum(d):.1f}" for n, d in merged.items())

    for i, r in enumerate(a.ranges, 1):
        fwd = r.kernels if a.on_gpu else r.top_ops
        bwd = r.backward_kernels if a.on_gpu else r.backward_nodes
        lines.append(f"| {i} | `{r.name}` | {r.op} | {r.impl} | {float(r.event['dur']):.1f} | {listing(fwd)} "
                     f"| {listing(bwd)} |")
    lines += ["", f"Times in {unit}; `name xN` is N launches (or calls) summed. Backward: the autograd nodes that "
              "torch.profiler's forward-backward flows link to the range's forward ops, and what they ran."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int, help="the MLP's intermediate size")
    ap.add_argument("--warmup", type=int, default=3, help="steps before profiling (the decisions; default 3)")
    ap.add_argument("--trace", required=True, help="the trimmed Chrome trace to write (.json, or .json.gz)")
    ap.add_argument("--summary", help="the Markdown summary to write (default: printed only)")
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in SIZES[args.device].items()}
    for k, v in sizes.items():
        if v < 1:
            ap.error(f"--{k.replace('_', '-')}={v}: must be a positive integer")
    if sizes["heads"] % sizes["kv_heads"]:
        ap.error(f"--heads={sizes['heads']} is not a multiple of --kv-heads={sizes['kv_heads']} (GQA needs one)")
    if sizes["head_dim"] % 2:
        ap.error(f"--head-dim={sizes['head_dim']}: rotary needs an even head dim")
    if args.warmup < 1:
        ap.error(f"--warmup={args.warmup}: at least one step must decide before profiling")
    if not (args.trace.endswith(".json") or args.trace.endswith(".json.gz")):
        ap.error(f"--trace={args.trace}: name it *.json or *.json.gz (gzipped)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = Layer(heads=sizes["heads"], kv_heads=sizes["kv_heads"], head_dim=sizes["head_dim"], ffn=sizes["ffn"],
                  max_seq=sizes["seq"], device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["heads"] * sizes["head_dim"], generator=gen)
    x = x.to(device=device, dtype=dtype).requires_grad_()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        for p in [x, *layer.parameters()]:
            p.grad = None
        layer(x).float().square().mean().backward()

    for _ in range(args.warmup):
        step()
    sync()
    decided = opdispatch.stats(reset=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for name in (BIND_STEP, PROFILED_STEP):
            if name == PROFILED_STEP:
                sync()
                opdispatch.stats(reset=True)
            with record_function(name):
                step()
            sync()
    in_step = opdispatch.stats()
    trace_path = Path(args.trace)
    raw = trace_path.with_name(trace_path.name.replace(".json", ".full.json"))
    prof.export_chrome_trace(str(raw))
    from render_trace import load_trace

    trimmed = trim(load_trace(raw))
    raw.unlink()
    sizes_text = (f"batch {sizes['batch']}, seq {sizes['seq']}, heads {sizes['heads']}/{sizes['kv_heads']}, "
                  f"head dim {sizes['head_dim']}, ffn {sizes['ffn']}, {str(dtype).removeprefix('torch.')}")
    title = f"one forward+backward step of a Llama-shaped layer on {_device_name(device)} ({sizes_text})"
    trimmed["otherData"] = {"title": title, "device": _device_name(device), "torch": torch.__version__,
                            "opdispatch_step": PROFILED_STEP, "ts": "µs from the profiled step's start"}
    written = write_trace(trimmed, trace_path)
    decisions = [f"- `{c.op}` → `{c.implementation}` for {c.decision_class}" for c in decided.classes
                 if c.decisions]
    calls = ", ".join(f"{u.op} {u.calls} calls ({u.fast_path_hits} fast-path hits)"
                      for u in in_step.ops.values())
    new_decisions = sum(c.decisions for c in in_step.classes)
    header = [f"# What opdispatch ran in one training step ({_device_name(device)})", "",
              f"torch {torch.__version__}; {sizes_text}; trace `{trace_path.name}` ({written / 1024:.0f} KiB).", "",
              "Decided in the warm-up steps:", *decisions, "",
              f"In the profiled step: {calls}; {new_decisions} decisions."]
    text = summarise(trimmed, header)
    print(text)
    if args.summary:
        Path(args.summary).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
