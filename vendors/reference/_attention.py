"""`reference.math`: attention in plain torch ops, every feature, on any device — the numerical oracle.

Low-precision inputs are computed in float32 (float64 stays float64) and the output cast back. Conventions
every other implementation is tested against:
- GQA: query head i uses kv head i // (heads_q / heads_kv).
- Alignment offset o = seqlen_k - seqlen_q for bottom_right, 0 for top_left; query i sees key j when
  j <= i + o (causal) and i + o - left <= j <= i + o + right (window, -1 = unbounded).
- ALiBi adds -slope * |i + o - j|; softcap applies softcap * tanh(s / softcap) before bias and masks.
- A query that may see no key returns zeros and lse = -inf.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl
from opdispatch.plugins.toolkit import alibi_bias, allowed_positions

_ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


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
        alibi=True, dropout=True, attn_mask=True, attn_bias=True, bias_grad=True, lse=True, backward=True,
        deterministic_backward=True, strided_inputs=True,
        causal=True, deterministic_forward=True,
    )

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        compute = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
        if call.varlen:
            out, lse = self._varlen(call, compute)
        else:
            q, k, v = (call.bhsd(t).to(compute) for t in (call.q, call.k, call.v))
            out, lse = dense_attention(q, k, v, call, alibi=call.alibi_slopes, mask=call.attn_mask,
                                       bias=call.attn_bias)
            out = call.from_bhsd(out.to(call.dtype))
        if call.return_lse:
            return out, lse.float() if compute != torch.float64 else lse
        return out

    def _varlen(self, call: AttentionCall, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert call.cu_seqlens_q is not None and call.cu_seqlens_k is not None
        cu_q = call.cu_seqlens_q.tolist()
        cu_k = call.cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(call.batch):
            # (t, h, d) -> (1, h, t, d)
            q = call.q[cu_q[b]:cu_q[b + 1]].transpose(0, 1).unsqueeze(0).to(compute)
            k = call.k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).unsqueeze(0).to(compute)
            v = call.v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).unsqueeze(0).to(compute)
            alibi = call.alibi_slopes
            if alibi is not None and alibi.dim() == 2:
                alibi = alibi[b:b + 1]
            out, lse = dense_attention(q, k, v, call, alibi=alibi)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs, dim=0).to(call.dtype), torch.cat(lses, dim=1)
