"""Probe cuDNN's packed varlen entry (aten _cudnn_attention_forward) and time the varlen and sliding-window rows.

1. What `_cudnn_attention_forward(q, k, v, None, cum_seq_q, cum_seq_k, max_q, max_k, ...)` does with packed
   (total, heads, dim) tensors: its schema, output and LSE shapes, accuracy against a float64 per-sequence
   reference (MHA, GQA, causal, per-sequence q/k lengths that differ: which causal alignment), autograd.
2. Forward timings (triton do_bench median): varlen 16k (uneven, and many short sequences) for cuDNN varlen,
   torch's FA2 varlen, flag_gems and torch SDPA looped per sequence; sliding window at 8k/16k, d64/d128 for
   torch's FA2 (nvidia.flash), flag_gems (flagos.triton) and torch SDPA with a boolean band mask.

Usage: python benchmarks/varlen_window.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import opdispatch
from opdispatch import validate_attention

DEV = "cuda"


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def reference(q, k, v, lens_q, lens_k, causal, alignment, scale):
    """Per-sequence float64 attention; returns out (total_q, hq, dv) and lse (hq, total_q)."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        qi = q[oq:oq + lq].double().transpose(0, 1)
        ki = k[ok:ok + lk].double().transpose(0, 1).repeat_interleave(g, 0)
        vi = v[ok:ok + lk].double().transpose(0, 1).repeat_interleave(g, 0)
        s = qi @ ki.transpose(-1, -2) * scale
        if causal:
            off = lk - lq if alignment == "bottom_right" else 0
            i = torch.arange(lq, device=DEV).unsqueeze(1)
            j = torch.arange(lk, device=DEV).unsqueeze(0)
            s = s.masked_fill(j > i + off, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append((p @ vi).transpose(0, 1))
        lses.append(lse)
        oq, ok = oq + lq, ok + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def probe():
    op = torch.ops.aten._cudnn_attention_forward.default
    res = {"schema": str(op._schema), "backward_schema": str(torch.ops.aten._cudnn_attention_backward.default._schema),
           "cases": []}
    cases = [
        ("mha_d64_noncausal", [37, 128, 5, 90], None, 4, 4, 64, False),
        ("gqa4_d128_causal", [37, 128, 5, 90], None, 8, 2, 128, True),
        ("gqa4_d128_q<k_causal", [20, 64, 1, 33], [50, 64, 17, 99], 8, 2, 128, True),
        ("gqa4_d128_q>k_causal", [50, 30, 70], [20, 30, 40], 8, 2, 128, True),
        ("gqa4_d128_q!=k_noncausal", [20, 64, 1, 33], [50, 64, 17, 99], 8, 2, 128, False),
        ("gqa4_d256_causal", [37, 128, 5, 90], None, 8, 2, 256, True),
        ("mqa_d128_causal", [300, 1000, 77], None, 16, 1, 128, True),
        ("dv64_d128", [37, 128, 5, 90], None, 8, 2, 128, False),
        ("empty_seq", [10, 0, 20], None, 4, 4, 64, True),
        ("klen1", [5, 1, 20], [1, 1, 20], 4, 4, 64, False),
    ]
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, lq, lk, hq, hkv, d, causal in cases:
        lk = lk or lq
        dv = 64 if name.startswith("dv64") else d
        q = torch.randn(sum(lq), hq, d, device=DEV, generator=gen).bfloat16()
        k = torch.randn(sum(lk), hkv, d, device=DEV, generator=gen).bfloat16()
        v = torch.randn(sum(lk), hkv, dv, device=DEV, generator=gen).bfloat16()
        scale = d ** -0.5
        rec = {"case": name}
        try:
            out = op(q, k, v, None, cu_of(lq), cu_of(lk), max(lq), max(lk), True, 0.0, causal, False, scale=scale)
            torch.cuda.synchronize()
            o, lse = out[0], out[1]
            rec.update(out_shape=list(o.shape), lse_shape=list(lse.shape), lse_dtype=str(lse.dtype),
                       lse_stride=list(lse.stride()))
            for align in ("top_left", "bottom_right"):
                ro, rl = reference(q, k, v, lq, lk, causal, align, scale)
                rec[f"rel_err_{align}"] = rel(o.float().nan_to_num(), ro)
                lse2 = lse[..., 0] if lse.dim() == 3 and lse.shape[-1] == 1 else lse
                if lse2.shape == (sum(lq), hq):
                    lse2 = lse2.t()
                if lse2.shape == rl.shape:
                    fin = torch.isfinite(rl)
                    rec[f"lse_err_{align}"] = (lse2.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0
                    rec[f"lse_err_log2_{align}"] = ((lse2.double()[fin] * math.log(2)) - rl[fin]).abs().max().item() \
                        if fin.any() else 0
                    rec["lse_nonfinite_rows"] = [str(x) for x in lse2.double()[~fin].unique().tolist()][:4]
            # opdispatch's own adapter
            impl = opdispatch.get_manager().registry.get("attention", "nvidia.cudnn").impl
            call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_of(lq), cu_seqlens_k=cu_of(lk),
                                      causal=causal, return_lse=True)
            rec["opdispatch_reasons"] = impl.not_supported_reasons(
                call, opdispatch.get_manager().device_info(torch.device(DEV)))
            ao, al = impl.run(call)
            ro, rl = reference(q, k, v, lq, lk, causal, "top_left", scale)
            fin = torch.isfinite(rl)
            rec["adapter_rel_err_tl"] = rel(ao.float(), ro)
            rec["adapter_lse_shape"] = list(al.shape)
            rec["adapter_lse_err_tl"] = (al.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0
            rec["adapter_lse_empty_rows"] = [str(x) for x in al[~fin].unique().tolist()][:4]
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        # autograd through the op
        try:
            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            o = op(qg, kg, vg, None, cu_of(lq), cu_of(lk), max(lq), max(lk), True, 0.0, causal, False,
                   scale=scale)[0]
            gout = torch.randn(o.shape, device=DEV, generator=gen).bfloat16()
            o.backward(gout)
            torch.cuda.synchronize()
            q6, k6, v6 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            ro, _ = reference(q6, k6, v6, lq, lk, causal, "top_left", scale)
            ro.backward(gout.double())
            rec["grad_rel_err"] = {n: rel(a.grad, b.grad) for n, a, b in
                                   (("dq", qg, q6), ("dk", kg, k6), ("dv", vg, v6))}
        except Exception as exc:
            rec["grad_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)
        res["cases"].append(rec)
    return res


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def causal_pairs(lens, window=None):
    total = 0.0
    for n in lens:
        i = torch.arange(n, dtype=torch.float64)
        lo = torch.clamp(i - window, min=0) if window else torch.zeros_like(i)
        total += float((i + 1 - lo).sum())
    return total


def timings():
    mgr = opdispatch.get_manager()
    impls = {i: mgr.registry.get("attention", i).impl for i in ("nvidia.cudnn", "nvidia.flash", "flagos.triton")}
    info = mgr.device_info(torch.device(DEV))
    rows = []
    varlen = [
        ("varlen 16k uneven gqa4 d128 causal", [3000, 512, 7000, 1200, 4700, 77], 32, 8, 128),
        ("varlen 16k 64x256 gqa4 d128 causal", [256] * 64, 32, 8, 128),
        ("varlen 16k 16x1024 gqa4 d128 causal", [1024] * 16, 32, 8, 128),
        ("varlen 16k uneven gqa4 d64 causal", [3000, 512, 7000, 1200, 4700, 77], 32, 8, 64),
    ]
    for name, lens, hq, hkv, d in varlen:
        torch.manual_seed(0)
        t = sum(lens)
        q = torch.randn(t, hq, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, hkv, d, device=DEV, dtype=torch.bfloat16)
        cu = cu_of(lens)
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                  causal=True)
        call = validate_attention(q, k, v, **kw)
        row = {"shape": name, "flop": 4 * hq * d * causal_pairs(lens), "ms": {}, "errors": {}}
        for iid, impl in impls.items():
            why = impl.not_supported_reasons(call, info)
            if why:
                row["errors"][iid] = "; ".join(why)
                continue
            try:
                row["ms"][iid] = bench(lambda impl=impl: impl.run(call))
            except Exception as exc:
                row["errors"][iid] = f"{type(exc).__name__}: {str(exc)[:200]}"
        cul = [0] + torch.tensor(lens).cumsum(0).tolist()

        def loop():
            outs = []
            for i in range(len(lens)):
                qi, ki, vi = (x[cul[i]:cul[i + 1]].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[0]
                            .transpose(0, 1))
            return torch.cat(outs)

        row["ms"]["torch_sdpa_loop"] = bench(loop)
        row["chosen"] = mgr.explain("attention", call, device=info).chosen_id
        row["ms"]["opdispatch.attention"] = bench(lambda: opdispatch.attention(q, k, v, **kw))
        print(json.dumps(row), flush=True)
        rows.append(row)
    window = [(s, d, w) for s in (8192, 16384) for d in (64, 128) for w in (1024,)] + [(16384, 128, 4096)]
    for sq, d, w in window:
        torch.manual_seed(0)
        hq, hkv = 32, 8
        q = torch.randn(1, sq, hq, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(1, sq, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(1, sq, hkv, d, device=DEV, dtype=torch.bfloat16)
        kw = dict(causal=True, window=(w, 0))
        call = validate_attention(q, k, v, **kw)
        row = {"shape": f"window {sq // 1024}k b1 gqa4 d{d} w{w}", "flop": 4 * hq * d * causal_pairs([sq], w),
               "ms": {}, "errors": {}}
        for iid in ("nvidia.flash", "flagos.triton"):
            try:
                row["ms"][iid] = bench(lambda impl=impls[iid]: impl.run(call))
            except Exception as exc:
                row["errors"][iid] = f"{type(exc).__name__}: {str(exc)[:200]}"
        i = torch.arange(sq, device=DEV).unsqueeze(1)
        j = torch.arange(sq, device=DEV).unsqueeze(0)
        mask = (j <= i) & (j >= i - w)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        try:
            row["ms"]["torch_sdpa_mask"] = bench(lambda: F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, enable_gqa=True))
        except Exception as exc:
            row["errors"]["torch_sdpa_mask"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["chosen"] = mgr.explain("attention", call, device=info).chosen_id
        row["ms"]["opdispatch.attention"] = bench(lambda: opdispatch.attention(q, k, v, **kw))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del mask
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="varlen_window.json")
    ap.add_argument("--skip-probe", action="store_true")
    args = ap.parse_args()
    mgr = opdispatch.get_manager()
    mgr.ensure_initialized()
    info = mgr.device_info(torch.device(DEV))
    import importlib.metadata as md

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": str(torch.backends.cudnn.version())}
    for dist in ("triton", "flag-gems"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    result = {"device": info.to_dict(), "versions": versions}
    print(json.dumps(result), flush=True)
    if not args.skip_probe:
        result["probe"] = probe()
    result["timings"] = timings()
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
