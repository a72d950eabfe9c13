"""Fake `flash_attn` (FlashAttention-2 2.8): the real signatures; causal/window/ALiBi bottom-right; LSE +inf for
queries that see no key; `return_attn_probs=True` returns (out, softmax_lse, S_dmask)."""

from __future__ import annotations

import torch

from ._fa_math import attend, kv_cache, varlen

__version__ = "2.8.3"
calls: list = []


def _check(q, k, v, softcap, dropout_p):
    assert q.dtype == k.dtype == v.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
    assert q.shape[-2] % k.shape[-2] == 0
    if softcap > 0:
        assert dropout_p == 0, "Softcapping does not support dropout for now"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    calls.append(("flash_attn_func", dict(causal=causal, window_size=window_size, softcap=softcap)))
    _check(q, k, v, softcap, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = attend(q, k, v, scale, causal, tuple(window_size), softcap, alibi_slopes, k.shape[1] - q.shape[1])
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    calls.append(("flash_attn_varlen_func", dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)))
    _check(q, k, v, softcap, dropout_p)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5

    def one(qi, ki, vi, i):
        sl = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, sl, ki.shape[1] - qi.shape[1])

    if block_table is not None:
        assert k.dim() == 4 and k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert block_table.dtype == torch.int32
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = kv_cache([q[cq[i]:cq[i + 1]] for i in range(len(cq) - 1)], k, v,
                              [b - a for a, b in zip(ck, ck[1:])], one, block_table)
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:
        out, lse = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, one)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of dense q (b, sq, h, d) over a dense cache (b, s, hk, d) or paged pools; forward only."""
    calls.append(("flash_attn_with_kvcache", dict(paged=block_table is not None, causal=causal)))
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    assert q.dim() == 4 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_table is None or k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert cache_seqlens.dtype == torch.int32
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5

    def one(qi, ki, vi, i):
        sl = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, sl, ki.shape[1] - qi.shape[1])

    outs, lses = kv_cache(list(q), k_cache, v_cache, cache_seqlens, one, block_table)
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out, lse) if return_softmax_lse else out
