"""Dense <-> packed variable-length conversion for kernels that only take packed (``thd``) sequences."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class PackedCall(NamedTuple):
    """A dense call's q/k/v as packed (batch * seq, heads, dim) tensors with uniform int32 offsets.

    ``cu_seqlens_k`` is the very tensor ``cu_seqlens_q`` when the lengths are equal (kernels and opdispatch
    read that identity as "every sequence has as many queries as keys").
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device | str) -> torch.Tensor:
    """int32 (batch + 1,) offsets of `batch` sequences of `seqlen` tokens each: 0, seqlen, 2·seqlen, …"""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def pack_dense(call: Any) -> PackedCall:
    """A dense call's (bshd/bhsd/sbhd) q/k/v as packed thd tensors (a view when the input is bshd-contiguous,
    else one copy per tensor) with uniform cu_seqlens."""
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    q, k, v = (call.bshd(t) for t in (call.q, call.k, call.v))
    q = q.reshape(b * sq, q.shape[2], q.shape[3])
    k = k.reshape(b * sk, k.shape[2], k.shape[3])
    v = v.reshape(b * sk, v.shape[2], v.shape[3])
    cu_q = uniform_cu_seqlens(b, sq, q.device)
    cu_k = cu_q if sk == sq else uniform_cu_seqlens(b, sk, q.device)
    return PackedCall(q, k, v, cu_q, cu_k, sq, sk)


def unpack_out(call: Any, out: torch.Tensor) -> torch.Tensor:
    """A packed (batch * seqlen_q, heads, dim_v) output of a `pack_dense`-ed call back in the call's layout."""
    dense: torch.Tensor = call.from_bshd(out.reshape(call.batch, call.seqlen_q, out.shape[1], out.shape[2]))
    return dense


def unpack_lse(call: Any, lse: torch.Tensor) -> torch.Tensor:
    """A packed (heads, batch * seqlen_q) LSE of a `pack_dense`-ed call as (batch, heads, seqlen_q)."""
    return lse.reshape(lse.shape[0], call.batch, call.seqlen_q).transpose(0, 1)


def pack_padded_lse(lse: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """A varlen LSE padded per sequence, (batch, heads, max_seqlen_q) — what some varlen kernels write — as the
    packed (heads, total_q) opdispatch reports. Gathered on the device through cu_seqlens_q: no host sync."""
    tokens = torch.arange(total_q, device=lse.device, dtype=cu_seqlens_q.dtype)
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), tokens, right=True)
    position = (tokens - cu_seqlens_q[seq]).long()
    return lse[seq.long(), :, position].t()
