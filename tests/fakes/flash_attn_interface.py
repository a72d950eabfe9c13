"""Fake FA3 `flash_attn_interface`: no dropout, no ALiBi; return_attn_probs=True returns (out, softmax_lse)."""

from __future__ import annotations

import torch

from ._fa_math import attend, kv_cache, varlen


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

    def one(qi, ki, vi, i):
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, None, ki.shape[1] - qi.shape[1])

    if seqused_k is not None:
        cq = cu_seqlens_q.tolist()
        outs, lses = kv_cache([q[cq[i]:cq[i + 1]] for i in range(len(cq) - 1)], k, v, seqused_k, one,
                              cu_k=cu_seqlens_k.tolist())
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:
        out, lse = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, one)
    return (out, lse) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """Dense q (b, sq, h, d) or packed q with cu_seqlens_q, over a dense cache or a page_table (any page size);
    return_softmax_lse=True returns (out, softmax_lse, *rest) as the real one does."""
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cache_seqlens.dtype == torch.int32
    assert (cu_seqlens_q is None) == (q.dim() == 4) and (cu_seqlens_q is None) == (max_seqlen_q is None)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5

    def one(qi, ki, vi, i):
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, None, ki.shape[1] - qi.shape[1])

    if cu_seqlens_q is None:
        outs, lses = kv_cache(list(q), k_cache, v_cache, cache_seqlens, one, page_table)
        out, lse = torch.stack(outs), torch.stack(lses)
    else:
        cq = cu_seqlens_q.tolist()
        outs, lses = kv_cache([q[cq[i]:cq[i + 1]] for i in range(len(cq) - 1)], k_cache, v_cache, cache_seqlens,
                              one, page_table)
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse, None, None) if return_softmax_lse else out
