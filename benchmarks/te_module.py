"""TransformerEngine-style calls through `opdispatch.compat.te.DotProductAttention`: which implementation each lands
on (and why: `explain`), and what the module costs over `opdispatch.attention` called directly on the same call.

Cells: TE's layouts (sbhd, bshd, thd) × mask types (causal, padding_causal with an attention mask, causal
bottom-right for cross lengths, no_mask) × GQA, bf16 on a GPU (fp32 tiny shapes on the CPU), forward and
forward+backward. The module and the direct call run the same kernel (checked: equal outputs); both are timed
interleaved per call (side_by_side.interleaved_ms: events around one call, so the ratio shows the module's host
cost while the device waits for it) and back to back (10 calls between two events: the device's time per call
when the host runs ahead, as in a model's step — what a host cost that is hidden there does not show).

    python benchmarks/te_module.py --out te_module-h100.json     # GPU
    python benchmarks/te_module.py --tiny                        # CPU smoke run
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
from opdispatch.compat.te import DotProductAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment  # noqa: E402
from side_by_side import back_to_back_ms, interleaved_ms, ms_text, write_report  # noqa: E402

# name: (qkv_format, attn_mask_type, batch, seqlen_q, seqlen_kv, heads, gqa groups, head dim)
CELLS: dict[str, tuple[str, str, int, int, int, int, int, int]] = {
    "sbhd causal GQA 4:1": ("sbhd", "causal", 2, 4096, 4096, 32, 8, 128),
    "bshd causal MHA": ("bshd", "causal", 2, 4096, 4096, 16, 16, 128),
    "bshd padding_causal GQA": ("bshd", "padding_causal", 4, 2048, 2048, 32, 8, 128),
    "bshd causal_bottom_right cross lengths": ("bshd", "causal_bottom_right", 2, 1024, 4096, 32, 8, 128),
    "bshd no_mask d64": ("bshd", "no_mask", 4, 2048, 2048, 16, 16, 64),
    "thd padding_causal packed": ("thd", "padding_causal", 6, 3000, 3000, 16, 4, 128),
}


def build(cell: tuple[str, str, int, int, int, int, int, int], device: torch.device, dtype: torch.dtype,
          grad: bool, tiny: bool) -> tuple[DotProductAttention, Callable[[], Any], Callable[[], Any], dict[str, Any]]:
    """The module, its forward, the same call through `opdispatch.attention`, and the module call's arguments."""
    fmt, mask_type, b, sq, sk, h, g, d = cell
    if tiny:
        b, sq, sk, h, g, d = min(b, 2), max(1, sq // 256), max(1, sk // 256), 4, (1 if g < h else 4), 16
    gen = torch.Generator(device=device).manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    module = DotProductAttention(h, d, num_gqa_groups=g, qkv_format=fmt, attn_mask_type=mask_type)
    kwargs: dict[str, Any] = {}
    query_rows: torch.Tensor | None = None
    direct: dict[str, Any] = {"causal": "causal" in mask_type}
    if "bottom_right" in mask_type:
        direct["causal_alignment"] = "bottom_right"
    if fmt == "thd":
        lens = [max(1, sq * (i + 2) // (b + 1)) for i in range(b)]  # unequal lengths, the longest about sq
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = t(total, h, d), t(total, g, d), t(total, g, d)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        direct.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                      max_seqlen_k=max(lens))
    else:
        shape_q = (sq, b, h, d) if fmt == "sbhd" else (b, sq, h, d)
        shape_k = (sk, b, g, d) if fmt == "sbhd" else (b, sk, g, d)
        q, k, v = t(*shape_q), t(*shape_k), t(*shape_k)
        direct["layout"] = fmt
        if mask_type.startswith("padding"):
            # TE's padding mask: True = masked out, (b, 1, 1, s); every other sequence ends a quarter early.
            keep = torch.ones(b, sk, dtype=torch.bool, device=device)
            keep[1::2, sk - sk // 4:] = False
            kwargs["attention_mask"] = ~keep[:, None, None, :]
            direct["attn_mask"] = keep[:, None, None, :].expand(b, 1, sq, sk) & torch.ones(
                sq, sk, dtype=torch.bool, device=device).tril()
            direct["causal"] = False
            query_rows = keep[:, :, None]  # TE zeroes a padded query's output: (b, s, 1)

    def via_module() -> torch.Tensor:
        return module(q, k, v, **kwargs)

    def via_op() -> torch.Tensor:
        out = opdispatch.attention(q, k, v, **direct)
        out = out.reshape(*out.shape[:-2], -1)
        return out if query_rows is None else out * query_rows

    return module, via_module, via_op, dict(kwargs, query_layer=q, key_layer=k, value_layer=v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (fp32)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, help="JSON here, markdown beside it")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = []
    for name, cell in CELLS.items():
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            row: dict[str, Any] = {"cell": name, "mode": mode}
            try:
                module, via_module, via_op, call = build(cell, device, dtype, grad, args.tiny)
                decision = module.explain(**call)
                row["pick"], row["decided_by"] = decision.chosen_id, str(decision.decided_by)
                with torch.no_grad():
                    row["max_abs_diff_module_vs_op"] = (via_module().float() - via_op().float()).abs().max().item()
                if not row["max_abs_diff_module_vs_op"] <= (1e-4 if dtype == torch.float32 else 2e-2):
                    raise AssertionError(f"the module and opdispatch.attention disagree by "
                                         f"{row['max_abs_diff_module_vs_op']:.3g} on the same call")
                fns: dict[str, Callable[[], Any]] = {"module": via_module, "opdispatch.attention": via_op}
                if grad:
                    fns = {n: (lambda fn=fn: fn().float().sum().backward()) for n, fn in fns.items()}
                row["ms"] = interleaved_ms(fns, device, args.warmup, args.reps)
                module_ms, op_ms = row["ms"]["module"], row["ms"]["opdispatch.attention"]
                if isinstance(module_ms, float) and isinstance(op_ms, float):
                    row["module_over_op"] = module_ms / op_ms
                row["back_to_back_ms"] = back_to_back_ms(fns, device, max(3, args.reps // 4))
                module_b2b, op_b2b = row["back_to_back_ms"]["module"], row["back_to_back_ms"]["opdispatch.attention"]
                if isinstance(module_b2b, float) and isinstance(op_b2b, float):
                    row["module_over_op_back_to_back"] = module_b2b / op_b2b
            except Exception as exc:  # one cell's failure is its row's
                row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
            print(json.dumps(row, default=str), file=sys.stderr, flush=True)
    env = environment(device)
    lines = ["# TransformerEngine's DotProductAttention through opdispatch.compat.te", "",
             f"{env['device']}; torch {env['torch']}; {str(dtype)[6:]}; commit {env.get('commit')}", "",
             "per call: events around one call; back to back: events around 10 calls (the host running ahead)", "",
             "| cell | mode | implementation (decided by) | module ms | opdispatch.attention ms | module / op | "
             "back to back: module / op ms | module / op | max |Δ| |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['cell']} | {r['mode']} | failed: {r['failed']} | | | | | | |")
            continue
        ms = r["ms"]
        ratio = f"{r['module_over_op']:.3f}" if "module_over_op" in r else "-"
        b2b = r["back_to_back_ms"]
        ratio_b2b = f"{r['module_over_op_back_to_back']:.3f}" if "module_over_op_back_to_back" in r else "-"
        lines.append(f"| {r['cell']} | {r['mode']} | {r['pick']} ({r['decided_by']}) | {ms_text(ms['module'])} | "
                     f"{ms_text(ms['opdispatch.attention'])} | {ratio} | {ms_text(b2b['module'])} / "
                     f"{ms_text(b2b['opdispatch.attention'])} | {ratio_b2b} | {r['max_abs_diff_module_vs_op']:.3g} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    write_report(args.out, {"environment": env, "rows": rows}, text)
    return 0 if not any("failed" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
