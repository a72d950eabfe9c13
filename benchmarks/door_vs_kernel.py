"""Where a gap between opdispatch and torch's SDPA on the same kernel comes from: the same call timed through
torch's SDPA, the aten kernel called directly with opdispatch's arguments, `opdispatch.plan` (the bound kernel,
no lookup), and `opdispatch.attention` (the front door), each timed per call (events around one call, the
device idle before it: host overhead shows) and back to back (events around `--batch` calls: the device's time
per call, as in a model whose host runs ahead). Interleaved rounds (side_by_side.interleaved_ms).

    python benchmarks/door_vs_kernel.py --out door_vs_kernel.json      # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402
from side_by_side import back_to_back_ms, interleaved_ms, ms_text, write_report  # noqa: E402

CELLS = {  # (batch, seqlen, heads_q, heads_kv, head_dim, causal)
    "dense causal GQA 4:1": (2, 4096, 32, 8, 128, True),
    "head_dim 72": (2, 4096, 16, 16, 72, True),
    "head_dim 64 MHA": (4, 2048, 16, 16, 64, True),
    "decode GQA 4:1": (8, 1, 32, 8, 128, False),
}


def ways(cell: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    b, s, hq, hkv, d, causal = cell
    sk = 4096
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = hq != hkv
    planned = opdispatch.plan(q, k, v, causal=causal)
    out = {
        "torch SDPA": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa),
        "opdispatch.attention": lambda: opdispatch.attention(q, k, v, causal=causal),
        "opdispatch.plan": lambda: planned(q, k, v),
    }
    if device.type == "cuda":
        out["aten cuDNN op"] = lambda: torch._scaled_dot_product_cudnn_attention(qt, kt, vt, None, False, 0.0,
                                                                                 causal, False)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--batch", type=int, default=20, help="calls per event pair, back to back")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, cell in CELLS.items():
        fns = ways(cell, device, dtype)
        per_call = interleaved_ms(fns, device, 3, args.reps)
        back = back_to_back_ms(fns, device, max(5, args.reps // args.batch), calls=args.batch)
        rows.append({"cell": name, "per_call_ms": per_call, "back_to_back_ms": back})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    env = environment(device)
    lines = ["# The same kernel through torch's SDPA, the aten op, opdispatch.plan and opdispatch.attention", "",
             f"{env['device']}; torch {env['torch']}; commit {env.get('commit')}; per call: events around one "
             f"call (host overhead shows); back to back: events around {args.batch} calls", "",
             "| cell | way | per call ms | back to back ms |", "|---|---|---:|---:|"]
    for row in rows:
        for way, ms in row["per_call_ms"].items():
            b2b = row["back_to_back_ms"][way]
            lines.append(f"| {row['cell']} | {way} | {ms_text(ms, 4)} | {ms_text(b2b, 4)} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    write_report(args.out, {"environment": env, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
