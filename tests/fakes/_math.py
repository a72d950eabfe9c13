"""Attention as the vendor kernels define it, in float64 with the fakes' own math (`_fa_math.attend`), never
with opdispatch's reference implementation (the one they are compared to)."""

from __future__ import annotations

import math

import torch

from ._fa_math import attend


def bshd_attention(q, k, v, *, scale, causal, window, alignment, softcap=0.0, alibi=None, sink=None):
    """(b, s, h, d) inputs → (out (b, sq, h, dv) in q's dtype, lse (b, h, sq) fp32, -inf where a query sees no
    key), vendor window convention ((-1, -1): none); `sink` (h,) a per-head logit without a value."""
    offset = k.shape[1] - q.shape[1] if alignment == "bottom_right" else 0
    return attend(q, k, v, scale, causal, tuple(window), softcap, alibi, offset, blind_lse=-math.inf, sink=sink)


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
