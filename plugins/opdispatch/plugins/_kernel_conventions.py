"""Argument conventions of FlashAttention-style kernels (flash-attn, CK, AOTriton, FlagGems, vendor forks)."""

from __future__ import annotations

import math
from typing import Any

import torch

from opdispatch.base._native import kernel_call


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


def aten_sdpa_call(op: Any, *tail: Any, defaults: tuple[Any, ...], scale: float, head_dim: int,
                   index: int = 0) -> Any:
    """`kernel_call` of one of torch's SDPA aten ops with the fewest arguments that mean the same call.

    ``tail`` are the op's positionals after the tensors, ``defaults`` the schema's defaults of the last
    ``len(defaults)`` of them: trailing values equal to their default (same type) are left out, and ``scale`` is
    left out where it is the op's own default, 1/sqrt(head_dim) (the same double torch computes). torch's argument
    parser costs about 0.25-0.5 µs per explicit argument on a CPU, paid on every call."""
    kept = list(tail)
    start = len(tail) - len(defaults)
    if start < 0:
        raise ValueError(f"aten_sdpa_call: {len(defaults)} defaults for a tail of {len(tail)}")
    while len(kept) > start:
        value, default = kept[-1], defaults[len(kept) - 1 - start]
        if type(value) is not type(default) or value != default:
            break
        kept.pop()
    kwargs = {} if scale == 1.0 / math.sqrt(head_dim) else {"scale": scale}
    return kernel_call(op, *kept, index=index, **kwargs)
