"""Fake `flash_attn` (FlashAttention-2 2.8): the real signatures; causal/window/ALiBi bottom-right; LSE +inf for
queries that see no key; `return_attn_probs=True` returns (out, softmax_lse, S_dmask)."""

from __future__ import annotations

from ._fa_math import attend, varlen

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

    out, lse = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, one)
    return (out, lse, None) if return_attn_probs else out
