"""flagos.triton on windowed KV-cache decode against a float64 oracle, on a GPU with flag_gems (issue 27).

Two parts, both over caches whose fill (seqused_k) is below their capacity, dense and paged, windows (0, 0),
(50, 0), (300, 0) and none, causal, seqlen_q 1 (decode) and 4 (chunked prefill), GQA:
1. flag_gems.flash_attn_varlen_func called directly with window (left, 0) and (left, -1), max_seqlen_k the
   capacity (diagnosis, independent of opdispatch). On an H100 (5.0.2): (left, 0) agrees (max |err| ~3e-4);
   (left, -1) — the canonical window of a causal decode — hides the diagonal key ((0, -1): no key at all, off by
   ~2.9): 5.0.2 applies a window only when left >= 0, and then both bounds literally. max_seqlen_k (capacity
   vs fill) changes nothing unless it is below the window (then the window is dropped).
2. opdispatch's adapter (FlagGemsAttention.run / not_supported_reasons) against reference.math: every call it
   accepts must agree; a refused call prints its reason.

Usage (repo root, GPU machine with flag_gems): python benchmarks/flagos_window_kv_check.py
Exit status 1 when an accepted call disagrees.
"""

from __future__ import annotations

import math
import sys

import torch

import opdispatch
from opdispatch import validate_attention

DEV = "cuda"
FILLS = [400, 130, 37]
CAPACITY, PAGE = 512, 64
HQ, HK, D = 8, 2, 64


def oracle(q, k, v, fills, seqlen_q, window, causal):
    """float64, per sequence, causal/window aligned bottom-right at the sequence's fill. q (b, sq, hq, d)."""
    g = HQ // HK
    outs = []
    for b, n in enumerate(fills):
        qi = q[b].double().transpose(0, 1)
        ki = k[b, :n].double().transpose(0, 1).repeat_interleave(g, 0)
        vi = v[b, :n].double().transpose(0, 1).repeat_interleave(g, 0)
        s = qi @ ki.transpose(-1, -2) * D ** -0.5
        rel = torch.arange(n, device=DEV)[None, :] - torch.arange(seqlen_q, device=DEV)[:, None] - (n - seqlen_q)
        allowed = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            allowed &= rel <= 0
        if window is not None:
            if window[0] >= 0:
                allowed &= rel >= -window[0]
            if window[1] >= 0:
                allowed &= rel <= window[1]
        p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        outs.append((p @ vi).transpose(0, 1))
    return torch.stack(outs)


def paged(k):
    """The dense cache (b, capacity, hk, d) as a shuffled page pool and its block table."""
    b, pages = k.shape[0], CAPACITY // PAGE
    order = torch.randperm(b * pages, device=DEV)
    pool = torch.empty(b * pages, PAGE, HK, D, dtype=k.dtype, device=DEV)
    pool[order] = k.reshape(b * pages, PAGE, HK, D)
    return pool, order.view(b, pages).to(torch.int32)


def main() -> int:
    import flag_gems

    from opdispatch.vendors.flagos import FlagGemsAttention

    torch.manual_seed(0)
    bad = 0
    impl = FlagGemsAttention()
    manager = opdispatch.get_manager()
    manager.ensure_initialized()
    device = manager.device_info(torch.device(DEV))
    b = len(FILLS)
    used = torch.tensor(FILLS, dtype=torch.int32, device=DEV)
    print(f"flag_gems {flag_gems.__version__} on {torch.cuda.get_device_name(0)}; fills {FILLS}, capacity {CAPACITY}")
    for seqlen_q in (1, 4):
        q = torch.randn(b, seqlen_q, HQ, D, dtype=torch.float16, device=DEV)
        k = torch.randn(b, CAPACITY, HK, D, dtype=torch.float16, device=DEV)
        v = torch.randn(b, CAPACITY, HK, D, dtype=torch.float16, device=DEV)
        kp, table = paged(k)
        vp = torch.empty_like(kp)
        vp[table.long().flatten()] = v.reshape(-1, PAGE, HK, D)
        for window in ((0, 0), (50, 0), (300, 0), None):
            ref = oracle(q, k, v, FILLS, seqlen_q, window, True)
            cu_q = torch.arange(0, (b + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=DEV)
            for given in ((window, (window[0], -1)) if window is not None else ((-1, -1),)):
                out = flag_gems.flash_attn_varlen_func(
                    q.reshape(-1, HQ, D), kp, vp, seqlen_q, cu_q, CAPACITY, None, seqused_k=used,
                    block_table=table, causal=True, window_size=given)
                err = (out.view_as(ref).double() - ref).abs().max().item()
                print(f"direct  sq={seqlen_q} window_size={given} (oracle {window}): max |err| {err:.3g}")
            for cache in ("dense", "paged"):
                kk, vv, bt = (k, v, None) if cache == "dense" else (kp, vp, table)
                call = validate_attention(q, kk, vv, causal=True, causal_alignment="bottom_right", window=window,
                                          seqused_k=used, block_table=bt, return_lse=True)
                reasons = impl.not_supported_reasons(call, device)
                if reasons:
                    print(f"adapter sq={seqlen_q} window={window} {cache}: refused: {reasons}")
                    continue
                out, lse = impl.run(call)
                ref_out, ref_lse = manager.registry.get("attention", "reference.math").impl.run(call)
                err = (out.double() - ref).abs().max().item()
                finite = torch.isfinite(ref_lse)
                lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
                ok = err < 2e-2 and lse_err < 1e-2 and bool((lse[~finite] == -math.inf).all())
                err = max(err, lse_err)
                bad += not ok
                print(f"adapter sq={seqlen_q} window={window} {cache}: max |err| {err:.3g} {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
