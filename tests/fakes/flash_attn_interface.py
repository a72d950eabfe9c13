"""Fake FA3 `flash_attn_interface`: no dropout, no ALiBi; return_attn_probs=True returns (out, softmax_lse)."""

from __future__ import annotations

from ._fa_math import attend, varlen


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = attend(q, k, v, scale, causal, tuple(window_size), softcap, None, k.shape[1] - q.shape[1])
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda qi, ki, vi, i: attend(
        qi, ki, vi, scale, causal, tuple(window_size), softcap, None, ki.shape[1] - qi.shape[1]))
    return (out, lse) if return_attn_probs else out
