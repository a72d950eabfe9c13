"""Attention as the vendor kernels define it, computed with opdispatch's reference math (fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from opdispatch.vendors.reference._attention import dense_attention


def bshd_attention(q, k, v, *, scale, causal, window, alignment, softcap=0.0, alibi=None):
    """(b, s, h, d) inputs → (out (b, sq, h, dv) in q's dtype, lse (b, h, sq) fp32), vendor window convention."""
    left, right = window
    spec = SimpleNamespace(scale=scale, softcap=softcap, causal=causal, causal_alignment=alignment,
                           window=None if (left, right) == (-1, -1) else (left, right), dropout_p=0.0)
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    out, lse = dense_attention(qf, kf, vf, spec, alibi=alibi)
    return out.transpose(1, 2).to(q.dtype), lse


def varlen_attention(q, k, v, cu_q, cu_k, **kw):
    """(total, h, d) packed inputs → (out (total_q, h, dv), lse (h, total_q))."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    alibi = kw.pop("alibi", None)
    for b in range(len(cq) - 1):
        a = alibi[b:b + 1] if alibi is not None and alibi.dim() == 2 else alibi
        o, l = bshd_attention(q[cq[b]:cq[b + 1]].unsqueeze(0), k[ck[b]:ck[b + 1]].unsqueeze(0),
                              v[ck[b]:ck[b + 1]].unsqueeze(0), alibi=a, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def fa2_lse(lse: torch.Tensor) -> torch.Tensor:
    """FA2 kernels report +inf for a query that sees no key."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))
