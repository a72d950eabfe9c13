"""Argument conventions of FlashAttention-style kernels (flash-attn, CK, AOTriton, FlagGems, vendor forks)."""

from __future__ import annotations

import math
from typing import Any

import torch


def kernel_window(call: Any) -> tuple[int, int]:
    """The call's window as such kernels' ``window_size=(left, right)``: -1 unbounded on a side, (-1, -1) none.

    opdispatch's window already uses -1 for unbounded, and causal is passed separately (the kernels combine
    them the same way), so this only fills in the absent window."""
    window: tuple[int, int] | None = call.window
    return window if window is not None else (-1, -1)


def alibi_alignment_reason(call: Any, kernel: str = "this kernel") -> str | None:
    """Why a kernel whose ALiBi distance is |i + seqlen_k - seqlen_q - j| (bottom-right aligned, causal or not)
    cannot take the call, or None: ALiBi with ``causal_alignment='top_left'`` where the lengths differ."""
    if call.alibi_slopes is None or call.causal_alignment == "bottom_right":
        return None
    differs = call.cu_seqlens_q is not call.cu_seqlens_k if call.varlen else call.seqlen_q != call.seqlen_k
    if not differs:
        return None
    return (f"ALiBi is aligned bottom-right by {kernel} (distance |i + seqlen_k - seqlen_q - j|); "
            "causal_alignment='top_left' with seqlen_q != seqlen_k not supported (pass "
            "causal_alignment='bottom_right')")


def empty_rows_to_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """FA2-family kernels report +inf as the LSE of a query that sees no key; opdispatch's convention is -inf."""
    return lse.masked_fill(lse == math.inf, -math.inf)
