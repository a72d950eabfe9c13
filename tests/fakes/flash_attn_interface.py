"""Fake FA3 `flash_attn_interface`: no dropout, no ALiBi; return_attn_probs=True returns (out, softmax_lse).

FP8 as Dao-AILab/flash-attention hopper/flash_api.cpp (mha_fwd, @0251105a) takes it: q/k/v all float8_e4m3fn (e5m2
refused), head dims a multiple of 16, q_descale/k_descale/v_descale None (factor 1) or float32 of shape
(batch, num_heads_k) on q's device, read through their strides; the output is bfloat16. Computed in float64 from
the dequantized inputs (query head h uses kv head h // (heads_q / heads_kv)'s factors).
"""

from __future__ import annotations

import torch

from ._fa_math import attend, kv_cache, varlen

_E4M3 = torch.float8_e4m3fn


def _fp8_checked(q, k, v, batch, descales):
    """flash_api.cpp's FP8 checks; None for other q (descales ignored, as the kernel ignores them; float32 is let
    through for the CPU contract tests of the bf16/fp16 path)."""
    if q.dtype.itemsize == 1 and q.dtype != _E4M3:
        raise RuntimeError("FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if q.dtype != _E4M3:
        return None
    if q.shape[-1] % 16 or v.shape[-1] % 16:
        raise RuntimeError("head_size should be a multiple of 16")
    shape = (batch, k.shape[-2])
    for t in descales:
        if t is not None and (tuple(t.shape) != shape or t.device != q.device or t.dtype != torch.float32):
            raise RuntimeError(f"descale must have shape {shape} (float32), got {tuple(t.shape)} {t.dtype}")
    return descales


def _dequantized(t, descale, sequences):
    """t (n, s, h, d) of FP8 sequences `sequences` (n indices) → float64 times descale[b, h // group]."""
    if descale is None:
        return t.double()
    heads = torch.arange(t.shape[2]) // (t.shape[2] // descale.shape[1])
    return t.double() * descale.double()[sequences][:, heads].view(len(sequences), 1, t.shape[2], 1)


def _fp8_one(fn, descales):
    """Wrap a per-sequence fn(q_i, k_i, v_i, i) to dequantize with sequence i's factors and return bf16."""
    if descales is None:
        return fn

    def one(qi, ki, vi, i):
        seq = torch.tensor([i])
        out, lse = fn(*(_dequantized(t, d, seq) for t, d in zip((qi, ki, vi), descales)), i)
        return out.to(torch.bfloat16), lse

    return one


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    descales = _fp8_checked(q, k, v, q.shape[0], (q_descale, k_descale, v_descale))
    if descales is not None:
        seqs = torch.arange(q.shape[0])
        q, k, v = (_dequantized(t, d, seqs) for t, d in zip((q, k, v), descales))
    out, lse = attend(q, k, v, scale, causal, tuple(window_size), softcap, None, k.shape[1] - q.shape[1])
    if descales is not None:
        out = out.to(torch.bfloat16)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    descales = _fp8_checked(q, k, v, len(cu_seqlens_q) - 1, (q_descale, k_descale, v_descale))

    def attend_one(qi, ki, vi, i):
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, None, ki.shape[1] - qi.shape[1])

    one = _fp8_one(attend_one, descales)
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
    batch = q.shape[0] if cu_seqlens_q is None else len(cu_seqlens_q) - 1
    descales = _fp8_checked(q, k_cache, v_cache, batch, (q_descale, k_descale, v_descale))

    def attend_one(qi, ki, vi, i):
        return attend(qi, ki, vi, scale, causal, tuple(window_size), softcap, None, ki.shape[1] - qi.shape[1])

    one = _fp8_one(attend_one, descales)
    if cu_seqlens_q is None:
        outs, lses = kv_cache(list(q), k_cache, v_cache, cache_seqlens, one, page_table)
        out, lse = torch.stack(outs), torch.stack(lses)
    else:
        cq = cu_seqlens_q.tolist()
        outs, lses = kv_cache([q[cq[i]:cq[i + 1]] for i in range(len(cq) - 1)], k_cache, v_cache, cache_seqlens,
                              one, page_table)
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse, None, None) if return_softmax_lse else out
