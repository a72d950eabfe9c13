"""Calling `torch.nn.functional.scaled_dot_product_attention` as a vendor's torch build exposes it on its own
(PrivateUse1) device, whose extension routes it to the vendor's fused kernels and autograd to their backward
(Cambricon torch_mlu, Moore Threads torch_musa). What such an adapter passes, and why (each vendor's module says
which of it its kernels take):

- q/k/v viewed as (batch, heads, seq, dim) — F.sdpa's layout — and the output viewed back: no copy.
- GQA: k/v expanded to q's head count (`expand` + `reshape`, each k/v head repeated for its query group). Exact,
  differentiable (autograd sums the repeated heads' gradients back), and independent of whether the vendor's torch
  build has `enable_gqa` (torch >= 2.5) or its kernels take unequal head counts.
- causal: `is_causal=True` only with equal lengths and nothing else to mask, where top-left and bottom-right are
  the same computation; everything else — unequal lengths under either alignment, a window, a boolean mask, an
  additive bias — is folded into one additive mask of q's dtype (`additive_bias`: 0 where allowed, -inf where
  not, plus the bias), so the kernel's own causal alignment is never relied on.
- rows that mask leaves without a key: opdispatch's answer is zeros, and a softmax over a row of -inf is NaN in
  the forward and in every gradient through it. Such rows are unmasked (0) before the call and their outputs
  zeroed after; their grad_out is then zero, so they add nothing to dq/dk/dv.
- scale: as the vendor needs it passed; dropout_p: the call's.
- no LSE: F.sdpa returns none.
"""


from __future__ import annotations

from typing import Any

import torch

from opdispatch.ops._attention import AttentionCall, additive_bias


def expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """(b, hkv, s, d) -> (b, heads_q, s, d), kv head j serving query heads j*g .. j*g+g-1 (g = heads_q / hkv)."""
    b, hkv, s, d = t.shape
    if hkv == heads_q:
        return t
    return t[:, :, None].expand(b, hkv, heads_q // hkv, s, d).reshape(b, heads_q, s, d)


def needs_mask(call: AttentionCall) -> bool:
    """Whether the call goes to F.sdpa with an explicit additive mask rather than `is_causal` alone."""
    return (call.attn_mask is not None or call.attn_bias is not None or call.positional_mask
            or (call.causal and call.seqlen_q != call.seqlen_k))


def functional_sdpa_call(call: AttentionCall, sdpa: Any, scale: float | None) -> torch.Tensor:
    """`sdpa` (F.scaled_dot_product_attention as the vendor's torch exposes it) on `call`, as the module doc says;
    `scale` as the vendor needs it passed (None: the kernel's default 1/sqrt(head_dim))."""
    q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
    k, v = expand_kv(k, call.heads_q), expand_kv(v, call.heads_q)
    bias, blind = None, None
    is_causal = call.causal
    if needs_mask(call):
        bias, is_causal, _ = additive_bias(call, q, k, fold_causal=True, fold_alibi=False)
        assert bias is not None
        blind = torch.isneginf(bias).all(dim=-1, keepdim=True)
        bias = bias.masked_fill(blind, 0.0)
    out = sdpa(q, k, v, attn_mask=bias, dropout_p=call.dropout_p, is_causal=is_causal, scale=scale)
    if blind is not None:
        out = out.masked_fill(blind, 0.0)
    return call.from_bhsd(out)
