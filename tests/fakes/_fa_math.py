"""Float math shared by the fakes: attention over (batch, seq, heads, dim) with the kernels' conventions."""

from __future__ import annotations

import math

import torch


def attend(q, k, v, scale, causal, window, softcap, alibi, offset, additive=None, log2_lse=False,
           blind_lse=math.inf, literal_window=False, sink=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d) → out (b, sq, h, d), lse (b, h, sq) the way FA2-like kernels report.
    `literal_window`: both window bounds are applied as given, a negative one included (FlagGems' local mask).
    `sink` (h,): one more logit per row, in the scaled scores' units, with no value (the LSE includes it)."""
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    g = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2], s.shape[-1]
    rel = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1) - offset
    if alibi is not None:
        sl = alibi.double().view(1, -1, 1, 1) if alibi.dim() == 1 else alibi.double().view(*alibi.shape, 1, 1)
        s = s - sl * rel.abs()
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= rel <= 0
    if literal_window:
        allowed &= (rel >= -window[0]) & (rel <= window[1])
    elif window is not None and window != (-1, -1):
        if window[0] >= 0:
            allowed &= rel >= -window[0]
        if window[1] >= 0:
            allowed &= rel <= window[1]
    if additive is not None:
        s = s + additive.double()
    s = s.masked_fill(~allowed, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    blind = ~torch.isfinite(lse)
    p = torch.exp(s - torch.where(blind, 0.0, lse).unsqueeze(-1))[..., :sk]
    out = (p @ vf).transpose(1, 2).to(q.dtype)
    lse = lse.masked_fill(blind, blind_lse).float()
    if log2_lse:
        lse = lse / math.log(2.0)
    return out, lse


def varlen(q, k, v, cu_q, cu_k, fn):
    """Apply fn(q_i, k_i, v_i) -> (out (1,s,h,d), lse (1,h,s)) per sequence; pack as (total, h, d), (h, total)."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        o, l = fn(q[cq[i]:cq[i + 1]].unsqueeze(0), k[ck[i]:ck[i + 1]].unsqueeze(0), v[ck[i]:ck[i + 1]].unsqueeze(0), i)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def sequence_keys(pool, i, n, block_table=None, start=0):
    """Sequence i's first n keys: pages block_table[i, 0], [i, 1], … of a (pages, page_size, h, d) pool, or rows
    start.. of a (tokens, h, d) / (batch, seq, h, d) cache."""
    if block_table is None:
        return pool[i, :n] if pool.dim() == 4 else pool[start:start + n]
    size = pool.shape[1]
    pages = [pool[int(block_table[i, p])] for p in range(-(-n // size))]
    return torch.cat(pages)[:n] if pages else pool[0, :0]


def kv_cache(q_seqs, k_cache, v_cache, seqused_k, fn, block_table=None, cu_k=None):
    """fn over each sequence's queries (1, s, h, d) and its first seqused_k[i] keys; (outs, lses) per sequence."""
    outs, lses = [], []
    for i, qi in enumerate(q_seqs):
        n = int(seqused_k[i])
        start = int(cu_k[i]) if cu_k is not None else 0
        ki = sequence_keys(k_cache, i, n, block_table, start).unsqueeze(0)
        vi = sequence_keys(v_cache, i, n, block_table, start).unsqueeze(0)
        o, l = fn(qi.unsqueeze(0), ki, vi, i)
        outs.append(o[0])
        lses.append(l[0])
    return outs, lses
