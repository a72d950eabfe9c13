"""Helpers for writing attention implementations — the public toolkit of vendor plugins.

Built-in vendors use exactly this module (and the names exported by ``opdispatch``), nothing private, so a
third-party plugin can do everything they do. Each function's docstring is its documentation.

Masks and biases (opdispatch's conventions: causal/window aligned ``top_left`` or ``bottom_right`` by an
``offset`` = seqlen_k - seqlen_q for bottom-right; ALiBi adds ``-slope * |i + offset - j|``):

- `allowed_positions(sq, sk, causal, window, offset, device)`: the bool (sq, sk) matrix of keys each query sees.
- `alibi_bias(slopes, sq, sk, offset, dtype)`: the (heads, sq, sk) ALiBi bias.
- `additive_bias(call, q, k, fold_causal=..., ...)`: one additive float bias for a call's mask, bias, ALiBi and
  (optionally) causal/window — for kernels that take a bias instead of flags.
- `shift_rows(bias, dtype)`: subtract each row's maximum so a large bias survives a low-precision dtype; returns
  the shifted bias and the per-row shift (add it back to the LSE).

Binding:

- `bind_dense(call, kernel)`: wrap ``kernel(q, k, v)`` over (batch, heads, seq, dim) tensors into a function of
  the call's own dense layout (views only) — the building block of ``AttentionImpl.bind``.

FlashAttention-2 conventions (kernels of that lineage: flash-attn, FlagGems' varlen kernel):

- `blind_rows(sq, sk, offset, causal, window, device)`: queries that see no key.
- `dense_lse_fix(lse, ...)` / `varlen_lse_fix(lse, ...)`: turn such rows' LSE (+inf or arbitrary in the kernel)
  into opdispatch's -inf, for dense (batch, heads, sq) and packed (heads, total_q) LSEs.
- `causal_alibi_lse_reason(call)`: the reason to decline ``return_lse`` with causal ALiBi (the kernels' LSE is
  shifted by a row-dependent constant there).
"""

from __future__ import annotations

from opdispatch._attention import additive_bias, alibi_bias, allowed_positions, bind_dense, shift_rows

from ._fa2_conventions import blind_rows, causal_alibi_lse_reason, dense_lse_fix, varlen_lse_fix

__all__ = ["additive_bias", "alibi_bias", "allowed_positions", "bind_dense", "blind_rows", "causal_alibi_lse_reason",
           "dense_lse_fix", "shift_rows", "varlen_lse_fix"]
