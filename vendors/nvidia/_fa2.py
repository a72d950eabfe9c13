"""FlashAttention-2 conventions shared by the kernels of that lineage (flash-attn, FlagGems' varlen kernel).

- A query that sees no key gets LSE +inf (or an arbitrary value) from the kernel; opdispatch's is -inf.
- With causal=True the kernel adds ALiBi as +slope·j (the row constant -slope·(i+o) cancels in the softmax), so
  the output is exact but the LSE is shifted by +slope·(i+o) (measured on flag_gems 5.0.2, H200).
"""

from __future__ import annotations

import math

import torch


def blind_rows(sq: int, sk: int, offset: int, causal: bool, window: tuple[int, int] | None,
               device: torch.device) -> torch.Tensor:
    """Bool (sq,): queries that may see no key under causal/window with alignment offset `offset`."""
    i = torch.arange(sq, device=device) + offset
    hi = torch.full_like(i, sk - 1)
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


def dense_lse_fix(lse: torch.Tensor, sq: int, sk: int, causal: bool, window: tuple[int, int] | None,
                  alibi: torch.Tensor | None) -> torch.Tensor:
    """Bring a bottom-right-aligned FA2 LSE of shape (batch, heads, sq) to opdispatch's convention."""
    offset = sk - sq
    if alibi is not None and causal:
        pos = (torch.arange(sq, device=lse.device) + offset).to(torch.float32)
        slopes = alibi.view(1, -1, 1) if alibi.dim() == 1 else alibi.unsqueeze(-1)
        lse = lse - slopes * pos
    if (causal or window is not None) and sq > 0:
        blind = blind_rows(sq, sk, offset, causal, window, lse.device)
        lse = lse.masked_fill(blind, -math.inf)
    return lse.masked_fill(lse == math.inf, -math.inf)


def varlen_lse_fix(lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool,
                   window: tuple[int, int] | None, alibi: torch.Tensor | None) -> torch.Tensor:
    """The same for a packed (heads, total_q) LSE; no host sync."""
    if alibi is None and not causal and window is None:
        return lse.masked_fill(lse == math.inf, -math.inf)
    total = lse.shape[1]
    tok = torch.arange(total, device=lse.device, dtype=cu_q.dtype)
    seq = torch.searchsorted(cu_q[1:].contiguous(), tok, right=True)
    len_q = (cu_q[1:] - cu_q[:-1])[seq]
    len_k = (cu_k[1:] - cu_k[:-1])[seq]
    i = tok - cu_q[seq] + (len_k - len_q)  # aligned position i + o
    if alibi is not None and causal:
        slopes = alibi.unsqueeze(1) if alibi.dim() == 1 else alibi[seq].transpose(0, 1)
        lse = lse - slopes * i.to(torch.float32)
    hi = len_k - 1
    lo = torch.zeros_like(i)
    if causal:
        hi = torch.minimum(hi, i)
    if window is not None:
        left, right = window
        if left >= 0:
            lo = torch.maximum(lo, i - left)
        if right >= 0:
            hi = torch.minimum(hi, i + right)
    lse = lse.masked_fill(lo > hi, -math.inf)
    return lse.masked_fill(lse == math.inf, -math.inf)
