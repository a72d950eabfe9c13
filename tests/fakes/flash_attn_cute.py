"""Fake FlashAttention-4 `flash_attn.cute.interface` (Dao-AILab/flash-attention flash_attn/cute/interface.py,
commit 0251105a2fb19d2957484b7f023cd8c115286ced): the published signatures (an unknown keyword is a TypeError, as
for the real functions), the checks the real `_flash_attn_fwd` asserts for what opdispatch passes (SM90 rules: the
device checks are left out so it runs on CPU), and the math in float64 torch ops, differentiable by autograd —
the sink's gradient included — with the result in q's dtype.

Conventions: `learnable_sink` (num_heads,) is one more logit per row with no value (out = softmax over
[scores, sink] of the real keys' values; the LSE includes it); causal and window bottom-right, window_size
(left, right) with None unbounded and causal setting right to 0; a row that sees no key gets out 0 and LSE -inf,
or the sink. Both functions return (out, lse), lse None unless return_lse or an input requires grad.

Install with `tests.fakes.install(monkeypatch, fake_modules())`: `flash_attn`, `flash_attn.cute` and
`flash_attn.cute.interface` (the last two this module).
"""

from __future__ import annotations

import math
import types

import torch

calls: list[dict] = []
_LEARNABLE_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fake_modules() -> dict[str, types.ModuleType]:
    import sys

    this = sys.modules[__name__]
    parent = types.ModuleType("flash_attn")
    parent.__path__ = []  # a package: `flash_attn.cute` is found under it
    parent.cute = this
    this.interface = this
    return {"flash_attn": parent, "flash_attn.cute": this, "flash_attn.cute.interface": this}


def _attend(q, k, v, scale, causal, window_size, learnable_sink, softcap):
    """q (b, sq, h, d), k/v (b, sk, hk, d[v]) → out (b, sq, h, dv) float64, lse (b, h, sq) float64."""
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    group = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    rel = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1) - (sk - sq)  # bottom-right
    left, right = window_size
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        allowed &= rel >= -left
    if right is not None:
        allowed &= rel <= right
    s = s.masked_fill(~allowed, -math.inf)
    if learnable_sink is not None:
        sink = learnable_sink.double().view(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
        s = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(s, -1)
    blind = ~torch.isfinite(lse)
    p = torch.exp(s - torch.where(blind, 0.0, lse).unsqueeze(-1))[..., :sk]
    return (p @ vf).transpose(1, 2), lse


def _check(q, k, v, learnable_sink, num_head):
    assert v.dtype in [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], (
        "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2")
    assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
    if learnable_sink is not None:
        assert learnable_sink.shape == (num_head,)
        assert learnable_sink.dtype in _LEARNABLE_SINK_DTYPES, "learnable_sink must be float16, bfloat16, or float32"
    assert num_head % v.shape[-2] == 0, "num_head must be divisible by num_head_kv"
    d, dv = q.shape[-1], v.shape[-1]
    assert 8 <= d <= 256 and 8 <= dv <= 256 and d % 8 == 0 and dv % 8 == 0, (
        f"(head_dim, head_dim_v)=({d}, {dv}) is not supported on SM90.")


def _returned(out, lse, dtype, keep_lse):
    return out.to(dtype), (lse.float() if keep_lse else None)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False):
    assert qv is None and gather_kv_indices is None and score_mod is None and mask_mod is None, "not faked"
    assert block_sparse_tensors is None and aux_tensors is None, "not faked"
    calls.append(dict(fn="flash_attn_func", causal=causal, window_size=window_size, softcap=softcap,
                      learnable_sink=learnable_sink, return_lse=return_lse))
    b, sq, h, d = q.shape
    assert k.shape[:2] == (b, k.shape[1]) and v.shape[:3] == k.shape[:3]
    _check(q, k, v, learnable_sink, h)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out, lse = _attend(q, k, v, scale, causal, tuple(window_size), learnable_sink, softcap)
    requires_grad = any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    return _returned(out, lse, q.dtype, return_lse or requires_grad)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
    assert qv is None and seqused_q is None and seqused_k is None and page_table is None, "not faked"
    assert cu_seqlens_q is not None and cu_seqlens_k is not None, "not faked: packed q and k only"
    calls.append(dict(fn="flash_attn_varlen_func", causal=causal, window_size=window_size, softcap=softcap,
                      learnable_sink=learnable_sink, return_lse=return_lse))
    for t in (cu_seqlens_q, cu_seqlens_k):
        assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
    batch = cu_seqlens_q.shape[0] - 1
    assert cu_seqlens_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1,)"
    h = q.shape[1]
    _check(q, k, v, learnable_sink, h)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(batch):
        o, lse = _attend(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]], scale,
                         causal, tuple(window_size), learnable_sink, softcap)
        outs.append(o[0])
        lses.append(lse[0])
    requires_grad = any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    return _returned(torch.cat(outs), torch.cat(lses, dim=1), q.dtype, return_lse or requires_grad)
