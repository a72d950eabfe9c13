"""A compiled training step through opdispatch: the kernel's own backward vs recomputing the forward, vs torch.

Times forward+backward of `torch.compile(fullgraph=True)` over one attention call (bshd bf16, the default policy
picks the kernel) in three ways: opdispatch as shipped (the chosen implementation's `backward` from the saved out
and LSE), opdispatch with that backward declined (the compiled backward recomputes the forward: what every
implementation without a `backward` gets), and torch's own `F.scaled_dot_product_attention` compiled the same way.
Also counts how often the implementation's forward runs per step. Two timings, CUDA events, median of `--reps`,
compilation and warm-up excluded: one step synchronised on its own (host overhead before the first kernel shows),
and `--inner` steps back to back (as a training loop runs: the host queues ahead of the GPU).

    python benchmarks/compiled_training.py --out compiled_training.json     # GPU
    python benchmarks/compiled_training.py --tiny                           # CPU smoke run (cpu.flash, fp32)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402
from side_by_side import timed  # noqa: E402

CELLS: dict[str, dict[str, Any]] = {
    "dense causal GQA 4:1 d128": dict(b=2, s=4096, hq=32, hkv=8, d=128, kw=dict(causal=True)),
    "dense causal MHA d64": dict(b=4, s=2048, hq=16, hkv=16, d=64, kw=dict(causal=True)),
    "head_dim 100 (padded)": dict(b=2, s=4096, hq=16, hkv=16, d=100, kw=dict(causal=True)),
    "sliding window 1024": dict(b=1, s=8192, hq=16, hkv=16, d=128, kw=dict(causal=True, window=(1024, 0))),
}
TINY = {"dense causal GQA 4:1": dict(b=2, s=64, hq=4, hkv=2, d=16, kw=dict(causal=True))}


def step_fn(attend: Any) -> Any:
    """A training step as users write it: the compiled forward, then autograd (AOTAutograd's compiled backward)."""
    compiled = torch.compile(attend, fullgraph=True)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Any:
        return torch.autograd.grad(compiled(q, k, v), (q, k, v), grad)
    return step


def measure(name: str, cell: dict[str, Any], device: torch.device, dtype: torch.dtype, reps: int,
            inner: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    b, s, hq, hkv, d = cell["b"], cell["s"], cell["hq"], cell["hkv"], cell["d"]
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    k, v = (torch.randn(b, s, hkv, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(2))
    grad = torch.randn(b, s, hq, d, device=device, dtype=dtype, generator=gen)
    kw = cell["kw"]
    decision = opdispatch.explain(q, k, v, **kw)
    impl = decision.chosen_id
    registered = opdispatch.get_manager().registry.get("attention", impl).impl
    cls = type(registered)
    runs = [0]
    original_run = cls.run

    def counting_run(self: Any, call: Any) -> Any:
        runs[0] += 1
        return original_run(self, call)

    row: dict[str, Any] = {"cell": name, "pick": impl, "saves_for_backward": registered.saves_for_backward}
    ways = {"opdispatch": None, "opdispatch (backward recomputes)": "recompute", "torch SDPA compiled": "torch"}
    for way, kind in ways.items():
        torch._dynamo.reset()
        if kind == "torch":
            if kw.get("window"):
                continue  # SDPA has no window (side_by_side.py compares flex there)
            fn = step_fn(lambda q, k, v: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=kw.get("causal", False),
                enable_gqa=hq != hkv).transpose(1, 2))
        else:
            fn = step_fn(lambda q, k, v: opdispatch.attention(q, k, v, **kw))
        saved_backward = cls.backward
        cls.run = counting_run
        if kind == "recompute":
            cls.backward = lambda self, *a: None  # declined: the compiled backward runs the forward again
        try:
            fn(q, k, v, grad)
            runs[0] = 0
            fn(q, k, v, grad)
            row[f"{way} forwards per step"] = runs[0] if kind != "torch" else None
            row[f"{way} ms"] = timed(lambda: fn(q, k, v, grad), device, warmup=2, reps=reps)

            def steps() -> None:
                for _ in range(inner):
                    fn(q, k, v, grad)
            row[f"{way} ms back to back"] = timed(steps, device, warmup=1, reps=reps) / inner
        finally:
            cls.run = original_run
            cls.backward = saved_backward
    base = row.get("opdispatch ms")
    for way in ways:
        if f"{way} ms" in row and base:
            row[f"{way} / opdispatch"] = row[f"{way} ms"] / base
    return row


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], inner: int) -> str:
    lines = [f"# Compiled training step (fwd+bwd, torch.compile fullgraph) — {env['device']}", "",
             f"torch {env['torch']}, cuda {env.get('cuda')}, cuDNN {env.get('cudnn')}, triton {env.get('triton')}, "
             f"commit {env.get('commit')}", "",
             f"ms per step: one step synchronised / {inner} steps back to back.", "",
             "| cell | pick | opdispatch ms (forwards/step) | backward recomputes ms (forwards/step) | torch SDPA compiled ms |",
             "|---|---|---|---|---|"]
    def ms(r: dict[str, Any], way: str) -> str:
        if f"{way} ms" not in r:
            return "–"
        return f"{r[f'{way} ms']:.3f} / {r[f'{way} ms back to back']:.3f}"

    for r in rows:
        recompute = "opdispatch (backward recomputes)"
        lines.append(
            f"| {r['cell']} | {r['pick']} | {ms(r, 'opdispatch')} ({r['opdispatch forwards per step']}) | "
            f"{ms(r, recompute)} ({r[f'{recompute} forwards per step']}) | {ms(r, 'torch SDPA compiled')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cells", default="")
    parser.add_argument("--inner", type=int, default=10, help="steps per timing in the back-to-back figure")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cells = TINY if args.tiny else CELLS
    if args.cells:
        cells = {k: v for k, v in cells.items() if any(c in k for c in args.cells.split(","))}
    env = environment(device)
    rows = []
    for name, cell in cells.items():
        try:
            rows.append(measure(name, cell, device, dtype, args.reps, args.inner))
            print(json.dumps(rows[-1]), flush=True)
        except Exception as exc:  # one failing cell must not hide the others
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    text = markdown(rows, env, args.inner)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
