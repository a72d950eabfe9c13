"""Fake `flash_attn` (ROCm/flash-attention v2.8.0-cktile, CK backend).

Signatures copied from ROCm/flash-attention `flash_attn/flash_attn_interface.py` @ b3ae4966 (tag
v2.8.0-cktile): `flash_attn_func` L1135, `flash_attn_varlen_func` L1370. Return value (FlashAttnFunc.forward):
`out if not return_softmax else (out, softmax_lse, S_dmask)`. Causal and window are bottom-right aligned
(docstring; CK decodes the mask as "b:left,right"); lse (b, h, sq) dense, (h, total_q) varlen
(`csrc/flash_attn_ck/mha_varlen_fwd.cpp`: torch::empty({num_heads, total_q})). CK ignores softcap.
"""

from __future__ import annotations

import types

import torch

from . import _math

__version__ = "2.8.0.post2"


def make(calls: list) -> types.ModuleType:
    mod = types.ModuleType("flash_attn")
    mod.__version__ = __version__

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        calls.append(("flash_attn_func", (q, k, v), dict(
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            return_attn_probs=return_attn_probs)))
        assert q.dim() == 4 and q.stride(-1) == 1  # CK: "Input tensor must have contiguous last dimension"
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse = _math.bshd_attention(q, k, v, scale=scale, causal=causal, window=tuple(window_size),
                                        alignment="bottom_right", alibi=alibi_slopes)
        return out if not return_attn_probs else (out, _math.fa2_lse(lse), torch.empty(0))

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):
        calls.append(("flash_attn_varlen_func", (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                      dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           deterministic=deterministic, return_attn_probs=return_attn_probs,
                           block_table=block_table)))
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                                          window=tuple(window_size), alignment="bottom_right", alibi=alibi_slopes)
        return out if not return_attn_probs else (out, _math.fa2_lse(lse), torch.empty(0))

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        calls.append(("flash_attn_with_kvcache", (q, k_cache, v_cache), dict(cache_seqlens=cache_seqlens,
                                                                             causal=causal)))
        assert block_table is None and k is None and cache_batch_idx is None
        assert q.dim() == 4 and k_cache.stride(-1) == 1 and cache_seqlens.dtype == torch.int32
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        outs, lses = [], []
        for i, n in enumerate(cache_seqlens.tolist()):
            a = alibi_slopes[i:i + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
            o, l = _math.bshd_attention(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], scale=scale,
                                        causal=causal, window=tuple(window_size), alignment="bottom_right", alibi=a)
            outs.append(o[0])
            lses.append(l[0])
        out, lse = torch.stack(outs), torch.stack(lses)
        return (out, _math.fa2_lse(lse)) if return_softmax_lse else out

    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod
