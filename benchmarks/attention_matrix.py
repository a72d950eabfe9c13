"""Attention shape matrix × every available implementation, torch's default SDPA, and opdispatch's choice.

For each shape: median time (triton.testing.do_bench: warm-up, then median of repeats) of every implementation
that is eligible on this device, of torch's default `scaled_dot_product_attention` (the same semantics, written
the way a user would without opdispatch: masks for windows/ALiBi, eager math for softcap, a loop over sequences
for varlen), of `opdispatch.attention` end to end, and of the chosen implementation's `run` called directly.
TFLOP/s counts 4·b·hq·sq·sk·d (halved when causal; windows count the attended band); training rows count
fwd + bwd as 3.5× the forward.

Writes attention_matrix.md / .json / .png into --out. Usage: python benchmarks/attention_matrix.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import opdispatch
from opdispatch import validate_attention

SHAPES = [
    # name, b, sq, sk, hq, hkv, d, extra kwargs
    ("decode b16 s8k gqa4 d128", 16, 1, 8192, 32, 8, 128, {}),
    ("decode b32 s4k gqa8 d128", 32, 1, 4096, 32, 4, 128, {}),
    ("prefill 512 b8 mha d64", 8, 512, 512, 16, 16, 64, {}),
    ("prefill 2k b4 gqa4 d128 causal", 4, 2048, 2048, 32, 8, 128, {"causal": True}),
    ("prefill 4k b2 gqa8 d128 causal", 2, 4096, 4096, 32, 4, 128, {"causal": True}),
    ("prefill 4k b2 gqa4 d64", 2, 4096, 4096, 32, 8, 64, {}),
    ("prefill 8k b1 gqa8 d128 causal", 1, 8192, 8192, 32, 4, 128, {"causal": True}),
    ("prefill 16k b1 gqa8 d128 causal", 1, 16384, 16384, 32, 4, 128, {"causal": True}),
    ("prefill 2k b2 mha d256 causal", 2, 2048, 2048, 16, 16, 256, {"causal": True}),
    ("prefill 4k b2 mha d256", 2, 4096, 4096, 8, 8, 256, {}),
    ("window 8k b1 gqa4 d128 w1024", 1, 8192, 8192, 32, 8, 128, {"causal": True, "window": (1024, 0)}),
    ("softcap 4k b2 gqa4 d128 causal", 2, 4096, 4096, 32, 8, 128, {"causal": True, "softcap": 50.0}),
    ("alibi 4k b2 mha d128 causal", 2, 4096, 4096, 16, 16, 128, {"causal": True, "alibi": True}),
    ("varlen 16k uneven gqa4 d128 causal", 0, 0, 0, 32, 8, 128,
     {"causal": True, "lens": [3000, 512, 7000, 1200, 4700, 77]}),
    ("train 4k b2 gqa4 d128 causal", 2, 4096, 4096, 32, 8, 128, {"causal": True, "train": True}),
    ("train 2k b4 mha d64 causal", 4, 2048, 2048, 16, 16, 64, {"causal": True, "train": True}),
]


def bench(fn, warmup=10, rep=40):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def flops(b, sq, sk, hq, d, kw, lens=None):
    """4·hq·d per attended (query, key) pair, counted exactly for causal (top-left) and windows."""
    def pairs(sq, sk):
        if not kw.get("causal") and not kw.get("window"):
            return sq * sk
        i = torch.arange(sq, dtype=torch.float64)
        hi = torch.clamp(i + 1, max=sk) if kw.get("causal") else torch.full_like(i, sk)
        lo = torch.clamp(i - kw["window"][0], min=0) if kw.get("window") else torch.zeros_like(i)
        return float((hi - lo).clamp(min=0).sum())

    total = sum(pairs(n, n) for n in lens) if lens else b * pairs(sq, sk)
    return 4 * hq * d * total * (3.5 if kw.get("train") else 1.0)


def make(shape, device):
    name, b, sq, sk, hq, hkv, d, kw = shape
    kw = dict(kw)
    train = kw.pop("train", False)
    lens = kw.pop("lens", None)
    dtype = torch.bfloat16
    extra = {}
    if lens:
        t = sum(lens)
        q = torch.randn(t, hq, d, device=device, dtype=dtype)
        k = torch.randn(t, hkv, d, device=device, dtype=dtype)
        v = torch.randn(t, hkv, d, device=device, dtype=dtype)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        extra.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        q = torch.randn(b, sq, hq, d, device=device, dtype=dtype)
        k = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
        v = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
    if kw.pop("alibi", False):
        extra["alibi_slopes"] = torch.tensor([2 ** (-8 * (i + 1) / hq) for i in range(hq)], device=device)
    if train:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, {**kw, **extra}, train, lens


def torch_default(q, k, v, kw, lens):
    """What a user writes with torch alone for the same semantics (torch picks the backend)."""
    causal = kw.get("causal", False)
    window, softcap, alibi = kw.get("window"), kw.get("softcap", 0.0), kw.get("alibi_slopes")
    if lens:
        cu = [0] + torch.tensor(lens).cumsum(0).tolist()
        outs = []
        for i in range(len(lens)):
            qi, ki, vi = (t[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=True)[0]
                        .transpose(0, 1))
        return torch.cat(outs)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sq, sk = qt.shape[2], kt.shape[2]
    if softcap:
        g = qt.shape[1] // kt.shape[1]
        kk, vv = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
        s = (qt @ kk.transpose(-1, -2)) * (qt.shape[-1] ** -0.5)
        s = softcap * torch.tanh(s / softcap)
        if causal:
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (s.softmax(-1) @ vv).transpose(1, 2)
    mask = None
    if window is not None or alibi is not None:
        i = torch.arange(sq, device=q.device).unsqueeze(1)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        if window is not None:
            allowed = (j <= i) & (j >= i - window[0])
            mask = allowed
        if alibi is not None:
            bias = -alibi.view(1, -1, 1, 1) * (i - j).abs().to(torch.float32)
            bias = bias.masked_fill(j > i, float("-inf")).to(q.dtype)
            mask = bias
        causal = False
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True).transpose(1, 2)


def timed(fn, train, q, k, v):
    if not train:
        return bench(fn)
    grad = None

    def step():
        nonlocal grad
        out = fn()
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None

    return bench(step)


def versions():
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": str(torch.backends.cudnn.version()), "opdispatch": opdispatch.__version__}
    for dist in ("triton", "flag-gems", "flash-attn"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def host_overhead(device):
    """Per-call host cost on a tiny shape (µs): the launch-bound regime where dispatch overhead shows."""
    q = torch.randn(1, 16, 8, 64, device=device, dtype=torch.bfloat16)
    qb = q.transpose(1, 2)
    fns = {
        "opdispatch.attention": lambda: opdispatch.attention(q, q, q),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(qb, qb, qb),
        "torch._scaled_dot_product_cudnn_attention": lambda: torch._scaled_dot_product_cudnn_attention(
            qb, qb, qb, None, False, 0.0, False, False),
    }
    res = {}
    for name, fn in fns.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / 1000 * 1e6)
        res[name] = statistics.median(samples)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", default=None, help="substring filter on shape names (comma-separated: any of them)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    manager = opdispatch.get_manager()
    manager.ensure_initialized()
    info = manager.device_info(device)
    impls = {r.impl.id: r.impl for r in manager.registry.for_op("attention")}
    rows = []
    for shape in SHAPES:
        if args.only and not any(part in shape[0] for part in args.only.split(",")):
            continue
        torch.manual_seed(0)
        q, k, v, kw, train, lens = make(shape, device)
        call = validate_attention(q, k, v, **kw)
        decision = manager.explain("attention", call, device=info)
        row = {"shape": shape[0], "flop": flops(shape[1], shape[2], shape[3], shape[4], shape[6], {**shape[7]},
                                                 lens), "train": train, "times_ms": {}, "errors": {},
               "chosen": decision.chosen_id}
        for cand in decision.candidates:
            if cand.status not in ("eligible", "chosen") or cand.impl_id == "reference.math":
                continue
            impl = impls[cand.impl_id]
            try:
                row["times_ms"][cand.impl_id] = timed(lambda impl=impl: impl.run(call), train, q, k, v)
            except Exception as exc:  # record and go on
                row["errors"][cand.impl_id] = f"{type(exc).__name__}: {str(exc)[:200]}"
            sys.stdout.flush()
        try:
            row["torch_sdpa_ms"] = timed(lambda: torch_default(q, k, v, kw, lens), train, q, k, v)
        except Exception as exc:
            row["errors"]["torch_sdpa"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["opdispatch_ms"] = timed(lambda: opdispatch.attention(q, k, v, **kw), train, q, k, v)
        times = row["times_ms"]
        if times:
            best = min(times, key=times.get)
            row["fastest"] = best
            if row["chosen"] in times:
                row["regret"] = times[row["chosen"]] / times[best] - 1
                row["dispatch_overhead"] = row["opdispatch_ms"] / times[row["chosen"]] - 1
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    overhead = host_overhead(device)
    result = {"device": info.to_dict(), "versions": versions(), "rows": rows, "host_overhead_us": overhead}
    with open(os.path.join(args.out, "attention_matrix.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    write_markdown(result, os.path.join(args.out, "attention_matrix.md"))
    try:
        plot(result, os.path.join(args.out, "attention_matrix.png"))
    except Exception as exc:
        print("plot failed:", exc)


def write_markdown(result, path):
    rows = result["rows"]
    impl_ids = sorted({i for r in rows for i in r["times_ms"]})
    dev = result["device"]
    lines = [f"# Attention matrix on {dev['name']} ({dev['arch']}, {dev['multiprocessors']} SMs)", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             "bf16; median ms (TFLOP/s); `train` rows time forward + backward. `pick` = opdispatch's default "
             "policy; regret = pick / fastest eligible − 1; dispatch = opdispatch.attention / pick's run − 1.", "",
             "| shape | " + " | ".join(impl_ids) + " | torch SDPA | pick | regret | opdispatch vs torch | dispatch |",
             "|---" * (len(impl_ids) + 6) + "|"]
    ratios = []
    for r in rows:
        cells = []
        for i in impl_ids:
            t = r["times_ms"].get(i)
            cells.append("—" if t is None else f"{t:.3f} ({r['flop'] / t / 1e9:.0f})")
        ts = r.get("torch_sdpa_ms")
        tsc = "—" if ts is None else f"{ts:.3f} ({r['flop'] / ts / 1e9:.0f})"
        regret = r.get("regret")
        if regret is not None:
            ratios.append(1 + regret)
        speed = f"{ts / r['opdispatch_ms']:.2f}×" if ts else "—"
        disp = r.get("dispatch_overhead")
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {tsc} | {r['chosen']} | "
                     + ("—" if regret is None else f"{regret * 100:.1f}%") + f" | {speed} | "
                     + ("—" if disp is None else f"{disp * 100:+.1f}%") + " |")
    if ratios:
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) - 1
        lines += ["", f"Default-policy regret, geometric mean over {len(ratios)} shapes: {gm * 100:.2f}%"]
    lines += ["", "Host cost per call on a tiny shape (1×16×8×64 bf16), µs: " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["host_overhead_us"].items())]
    errors = [(r["shape"], i, e) for r in rows for i, e in r["errors"].items()]
    if errors:
        lines += ["", "Errors:"] + [f"- {s}: {i}: {e}" for s, i, e in errors]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    impl_ids = sorted({i for r in rows for i in r["times_ms"]}) + ["torch SDPA"]
    fig, ax = plt.subplots(figsize=(14, 6))
    width = 0.8 / len(impl_ids)
    for n, impl in enumerate(impl_ids):
        xs, ys = [], []
        for x, r in enumerate(rows):
            t = r.get("torch_sdpa_ms") if impl == "torch SDPA" else r["times_ms"].get(impl)
            if t:
                xs.append(x + n * width)
                ys.append(r["flop"] / t / 1e9)
        ax.bar(xs, ys, width, label=impl)
    for x, r in enumerate(rows):
        ax.annotate("▼", (x + impl_ids.index(r["chosen"]) * width if r["chosen"] in impl_ids else x, 0),
                    ha="center", va="top", fontsize=8)
    ax.set_xticks([x + 0.4 for x in range(len(rows))])
    ax.set_xticklabels([r["shape"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_yscale("log")
    ax.set_title(f"Attention on {result['device']['name']} — ▼ marks opdispatch's default pick")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
