"""FlashAttention-2 conventions shared by the kernels of that lineage (flash-attn, FlagGems' varlen kernel).

- A query that sees no key gets LSE +inf (or an arbitrary value) from the kernel; opdispatch's is -inf.
- With causal=True and ALiBi the kernels add a row-dependent constant to the scores (FA2's alibi.h adds
  +slope·j instead of -slope·|i+o-j|; it cancels in the softmax): the output is exact but the LSE is not the
  canonical one (measured on flag_gems 5.0.2, H200: off by up to 37 on a 128-long sequence, and not by the
  slope·(i+o) that alibi.h suggests). Implementations refuse return_lse for causal ALiBi instead of guessing.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def blind_rows(sq: int, sk: int, offset: int, causal: bool, window: tuple[int, int] | None,
               device: torch.device) -> torch.Tensor:
    """Bool (sq,): queries that may see no key under causal/window with alignment offset `offset`."""
    i = torch.arange(sq, device=device) + offset
    return _sees_nothing(i, torch.full_like(i, sk - 1), causal, window)


def _sees_nothing(i: torch.Tensor, last_key: torch.Tensor, causal: bool,
                  window: tuple[int, int] | None) -> torch.Tensor:
    """For aligned query positions `i` (i + o) over keys 0..last_key: True where causal/window leave no key."""
    hi = last_key
    lo = torch.zeros_like(i)
    if causal:
        hi = torch.minimum(hi, i)
    if window is not None:
        left, right = window
        if left >= 0:
            lo = torch.maximum(lo, i - left)
        if right >= 0:
            hi = torch.minimum(hi, i + right)
    return lo > hi


def causal_alibi_lse_reason(call: Any) -> str | None:
    if call.return_lse and call.causal and call.alibi_slopes is not None:
        return ("return_lse with causal ALiBi not supported: the kernel's LSE carries a row-dependent ALiBi "
                "offset (output is exact)")
    return None


def dense_lse_fix(lse: torch.Tensor, sq: int, sk: int, causal: bool, window: tuple[int, int] | None,
                  alibi: torch.Tensor | None) -> torch.Tensor:
    """Bring a bottom-right-aligned FA2 LSE of shape (batch, heads, sq) to opdispatch's convention."""
    offset = sk - sq
    if (causal or window is not None) and sq > 0:
        blind = blind_rows(sq, sk, offset, causal, window, lse.device)
        lse = lse.masked_fill(blind, -math.inf)
    return lse.masked_fill(lse == math.inf, -math.inf)


def varlen_lse_fix(lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool,
                   window: tuple[int, int] | None, alibi: torch.Tensor | None) -> torch.Tensor:
    """The same for a packed (heads, total_q) LSE; no host sync."""
    if not causal and window is None:
        return lse.masked_fill(lse == math.inf, -math.inf)
    total = lse.shape[1]
    tok = torch.arange(total, device=lse.device, dtype=cu_q.dtype)
    seq = torch.searchsorted(cu_q[1:].contiguous(), tok, right=True)
    len_q = (cu_q[1:] - cu_q[:-1])[seq]
    len_k = (cu_k[1:] - cu_k[:-1])[seq]
    i = tok - cu_q[seq] + (len_k - len_q)  # aligned position i + o
    lse = lse.masked_fill(_sees_nothing(i, len_k - 1, causal, window), -math.inf)
    return lse.masked_fill(lse == math.inf, -math.inf)
