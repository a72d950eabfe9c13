"""`reference.math`: attention in plain torch ops, every feature, on any device — the numerical oracle.

Low-precision inputs are computed in float32 (float64 stays float64) and the output cast back. Conventions
every other implementation is tested against:
- GQA: query head i uses kv head i // (heads_q / heads_kv).
- Alignment offset o = seqlen_k - seqlen_q for bottom_right, 0 for top_left; query i sees key j when
  j <= i + o (causal) and i + o - left <= j <= i + o + right (window, -1 = unbounded).
- ALiBi adds -slope * |i + o - j|; softcap applies softcap * tanh(s / softcap) before bias and masks.
- A query that may see no key returns zeros and lse = -inf.
- FP8 q/k/v are dequantized to float32 first (real = fp8 * descale; a (batch, heads_kv) descale scales sequence
  b's kv head h, and q's query heads of group h) and the output returned in `out_dtype`; an FP8 `out_dtype` is
  quantized as cuDNN's sdpa_fp8 writes its output (NVIDIA/cudnn-frontend test/python/sdpa/fp8_ref.py: the float32
  output times scale_o, converted with saturation to the largest finite, as Hopper's cvt.satfinite does), and
  `out_amax` gets max|output| of the float32 output, before any scaling (the reference's o_amax, cuDNN's Amax_O).
- A KV cache (seqused_k): sequence b attends to its first seqused_k[b] keys — of its cache rows (dense), of its
  cu_seqlens_k span (thd), or of its pages in block_table order (paged) — as if they were all its keys.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl
from opdispatch.plugins.toolkit import (FP8_DTYPES, FP8_OUT_DTYPES, LAYOUT_DIMS, alibi_bias, allowed_positions,
                                        sequence_keys)

_ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}) | FP8_DTYPES


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, *,
                    alibi: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over (batch, heads, seq, dim) tensors already in the compute dtype. Returns (out, lse)."""
    sq, sk = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * call.scale
    if call.softcap > 0:
        scores = call.softcap * torch.tanh(scores / call.softcap)
    offset = sk - sq if call.causal_alignment == "bottom_right" else 0
    if alibi is not None:
        scores = scores + alibi_bias(alibi, sq, sk, offset, scores.dtype)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    allowed = allowed_positions(sq, sk, call.causal, call.window, offset, q.device)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see no key: lse is -inf; subtracting 0 instead keeps exp() at 0 rather than NaN.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    if call.dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, p=call.dropout_p, training=True)
    return torch.matmul(probs, v), lse


class ReferenceAttention(AttentionImpl):
    """Plain-torch attention with every feature; slow, memory-hungry (materialises the score matrix), exact."""

    vendor: ClassVar[str] = "reference"
    name: ClassVar[str] = "math"
    priority: ClassVar[int] = -100  # the oracle runs anywhere but is never fast: last unless the policy says
    description: ClassVar[str] = "pure torch math; every feature, any device; the numerical oracle"
    reference_fallback: ClassVar[bool] = True
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=_ALL_DTYPES, head_dim_v_differs=True, layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}),
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True, softcap=True,
        alibi=True, dropout=True, attn_mask=True, attn_bias=True, bias_grad=True, lse=True, lse_grad=True,
        backward=True, deterministic_backward=True, strided_inputs=True,
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True, kv_cache_alibi=True,
        fp8_out_dtypes=frozenset(FP8_OUT_DTYPES) | FP8_DTYPES, fp8_descale_per_head=True, fp8_out_amax=True,
    )

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if call.fp8:
            out_scale, out_amax, out_dtype = call.out_scale, call.out_amax, call.out_dtype
            if out_scale is None and out_amax is None:
                return self._run(dequantized(call))
            real = dequantized(call)
            real.dtype = real.out_dtype = torch.float32  # the float32 output, quantized below
            result = self._run(real)
            out, lse = result if isinstance(result, tuple) else (result, None)
            if out_amax is not None:
                out_amax.copy_(out.abs().amax().reshape(out_amax.shape))
            out = out.to(out_dtype) if out_scale is None else quantize_fp8(out, out_scale, out_dtype)
            return out if lse is None else (out, lse)
        return self._run(call)

    def _run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        compute = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
        if call.varlen or call.kv_cache:
            out, lse = self._per_sequence(call, compute)
        else:
            q, k, v = (call.bhsd(t).to(compute) for t in (call.q, call.k, call.v))
            out, lse = dense_attention(q, k, v, call, alibi=call.alibi_slopes, mask=call.attn_mask,
                                       bias=call.attn_bias)
            out = call.from_bhsd(out.to(call.dtype))
        if call.return_lse:
            return out, lse.float() if compute != torch.float64 else lse
        return out

    def _per_sequence(self, call: AttentionCall, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed sequences and KV caches: each sequence on its own, with its own keys (one host read of the
        lengths)."""
        cu_q = call.cu_seqlens_q.tolist() if call.cu_seqlens_q is not None else None
        cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None
        used = call.seqused_k.tolist() if call.seqused_k is not None else None
        queries = call.q if call.varlen else call.bshd(call.q)
        outs, lses = [], []
        for b in range(call.batch):
            q = queries[cu_q[b]:cu_q[b + 1]] if cu_q is not None else queries[b]  # (s, h, d)
            k, v = (sequence_keys(call, t, b, cu_k, used) for t in (call.k, call.v))
            alibi = call.alibi_slopes
            if alibi is not None and alibi.dim() == 2:
                alibi = alibi[b:b + 1]
            # (s, h, d) -> (1, h, s, d)
            q, k, v = (t.transpose(0, 1).unsqueeze(0).to(compute) for t in (q, k, v))
            out, lse = dense_attention(q, k, v, call, alibi=alibi)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        if call.varlen:
            return torch.cat(outs, dim=0).to(call.dtype), torch.cat(lses, dim=1)
        return call.from_bshd(torch.stack(outs).to(call.dtype)), torch.stack(lses)


def quantize_fp8(real: torch.Tensor, scale: torch.Tensor, kind: torch.dtype) -> torch.Tensor:
    """saturate(real * scale) in the FP8 `kind`: rounded to nearest, magnitudes beyond the largest finite (and
    infinities) clamped to it, NaN kept (torch's cast alone turns an e4m3fn overflow into NaN)."""
    fp8_max = torch.finfo(kind).max
    return (real.float() * scale.reshape(())).clamp(-fp8_max, fp8_max).to(kind)


def dequantized(call: AttentionCall) -> AttentionCall:
    """An FP8 call as the float32 call it stands for: q/k/v times their descales, output in `out_dtype` — what the
    reference computes, then rounds to the output dtype. A paged call with per-sequence descales gets pools of its
    own (each sequence's pages gathered and scaled by its factors; a page two sequences share is read by each with
    its own factor, as FA3 reads it)."""
    ratio = call.heads_q // call.heads_kv
    assert call.q_descale is not None and call.k_descale is not None and call.v_descale is not None
    q = call.q.float() * _factors(call, call.q, call.cu_seqlens_q, call.q_descale, ratio)
    table = call.block_table
    if table is not None and call.descale_per_head:
        k, v = (_own_pages(t, table, descale) for t, descale in ((call.k, call.k_descale), (call.v, call.v_descale)))
        pages = table.shape[0] * table.shape[1]
        table = torch.arange(pages, dtype=torch.int32, device=table.device).view(table.shape)
    else:
        k, v = (t.float() * _factors(call, t, call.cu_seqlens_k, descale, 1)
                for t, descale in ((call.k, call.k_descale), (call.v, call.v_descale)))
    out = call.with_tensors(q, k, v, call.seqused_k, table)
    out.q_descale = out.k_descale = out.v_descale = out.out_scale = out.out_amax = None
    out.dtype = out.out_dtype = call.out_dtype
    return out


def _factors(call: AttentionCall, t: torch.Tensor, cu: torch.Tensor | None, descale: torch.Tensor,
             ratio: int) -> torch.Tensor:
    """`descale` shaped to multiply `t` (q, k or v of a dense layout or packed thd): one factor, or one per
    (sequence, kv head) — the query heads of a group take their kv head's (`ratio`)."""
    if descale.dim() < 2:
        return descale.reshape(())
    per_head = descale.repeat_interleave(ratio, dim=1)  # (batch, heads of t)
    if call.varlen:
        assert cu is not None
        return per_head.repeat_interleave((cu[1:] - cu[:-1]).long(), dim=0).unsqueeze(-1)  # (tokens, heads, 1)
    batch_dim, _, head_dim, _ = LAYOUT_DIMS[call.layout]  # batch_dim < head_dim in every dense layout
    shape = [1, 1, 1, 1]
    shape[batch_dim], shape[head_dim] = per_head.shape
    return per_head.reshape(shape)


def _own_pages(pool: torch.Tensor, table: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """Each sequence's pages (table rows; unused entries may name any page) copied and scaled by its factors: a
    pool of batch * max_pages pages in table order."""
    pages = table.long().clamp(0, pool.shape[0] - 1)
    own = pool[pages].float() * descale[:, None, None, :, None]  # (batch, max_pages, page, heads, dim)
    return own.reshape(-1, *pool.shape[1:])
