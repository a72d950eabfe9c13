"""KV-cache calls (``seqused_k``, ``block_table``) in the forms FlashAttention-lineage kernels take them."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ._fa2_conventions import _sees_nothing
from ._packing import uniform_cu_seqlens


class KvQueries(NamedTuple):
    """A KV-cache call's queries packed as (total_q, heads, dim) with int32 offsets (a view when q is
    bshd-contiguous or already packed)."""

    q: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int


def packed_queries(call: Any) -> KvQueries:
    """The call's q as packed sequences: its own for ``thd``, else (batch * seqlen_q) rows with uniform offsets."""
    if call.varlen:
        return KvQueries(call.q, call.cu_seqlens_q, call.max_seqlen_q)
    q = call.bshd(call.q)
    return KvQueries(q.reshape(call.batch * call.seqlen_q, q.shape[2], q.shape[3]),
                     uniform_cu_seqlens(call.batch, call.seqlen_q, q.device), call.seqlen_q)


def unpack_kv_out(call: Any, out: torch.Tensor) -> torch.Tensor:
    """A packed output of `packed_queries` back in the call's layout (unchanged for ``thd``)."""
    if call.varlen:
        return out
    dense: torch.Tensor = call.from_bshd(out.reshape(call.batch, call.seqlen_q, out.shape[1], out.shape[2]))
    return dense


def cache_as_pages(call: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k pool, v pool, block table): a paged call's own, or a dense cache (batch, capacity, heads, dim) read as
    `batch` pages of `capacity` keys — page b is sequence b's row, so the block table is [[0], [1], …]. Pages
    are views of the cache (no copy)."""
    if call.block_table is not None:
        return call.k, call.v, call.block_table
    k, v = call.bshd(call.k), call.bshd(call.v)
    table = torch.arange(call.batch, dtype=torch.int32, device=k.device).unsqueeze(1)
    return k, v, table


def cache_as_pages_reason(call: Any, kernel: str) -> str | None:
    """Why `cache_as_pages` cannot hand `kernel` a call's dense cache as pages (None when it can): a kernel that
    addresses slot ``page * page_size + i`` with k's row stride needs a sequence's rows adjacent, i.e. bshd."""
    if call.paged or call.layout == "bshd":
        return None
    return (f"a dense KV cache in layout {call.layout!r}: {kernel} reads it as pages of adjacent rows, which needs "
            "layout 'bshd' (or page it with block_table)")


def cumulative_lengths(seqused_k: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,) offsets [0, n_0, n_0 + n_1, …] of per-sequence key counts, on their device (no sync)."""
    return torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))


def kv_lse_fix(lse: torch.Tensor, call: Any) -> torch.Tensor:
    """A bottom-right-aligned FlashAttention-lineage LSE of a KV-cache call in opdispatch's convention: -inf for
    every query that sees no key (an empty cache, or causal/window leaving none of its sequence's
    ``seqused_k`` keys), whatever the kernel wrote there. Dense LSEs are (batch, heads, seqlen_q), packed ones
    (heads, total_q); computed on the device (no host sync)."""
    used = call.seqused_k.to(torch.int64)
    if call.varlen:
        cu_q = call.cu_seqlens_q
        tokens = torch.arange(lse.shape[1], device=lse.device, dtype=cu_q.dtype)
        seq = torch.searchsorted(cu_q[1:].contiguous(), tokens, right=True)
        length_q = (cu_q[1:] - cu_q[:-1])[seq].to(torch.int64)
        position = (tokens - cu_q[seq]).to(torch.int64) + used[seq] - length_q
        blind = _sees_nothing(position, used[seq] - 1, call.causal, call.window)
        lse = lse.masked_fill(blind.unsqueeze(0), -math.inf)
    else:
        position = torch.arange(call.seqlen_q, device=lse.device).unsqueeze(0) + (used - call.seqlen_q).unsqueeze(1)
        blind = _sees_nothing(position, (used - 1).unsqueeze(1).expand_as(position), call.causal, call.window)
        lse = lse.masked_fill(blind.unsqueeze(1), -math.inf)
    return lse.masked_fill(lse == math.inf, -math.inf)


def kv_cache_reasons(call: Any, kernel: str) -> list[str]:
    """What FlashAttention-lineage KV-cache entries share: forward only, bottom-right alignment, no dropout."""
    if call.seqused_k is None:
        return []
    reasons = []
    if call.requires_grad:
        reasons.append(f"KV-cache calls have no backward in {kernel} (inference only)")
    if call.dropout_p > 0:
        reasons.append(f"dropout with a KV cache is not supported by {kernel}")
    if call.alignment_matters and call.causal_alignment == "top_left":
        reasons.append(f"causal/window with causal_alignment='top_left' over a KV cache: {kernel} aligns to the "
                       "end of each sequence's keys (bottom_right)")
    return reasons


def kv_cache_allowed(call: Any) -> torch.Tensor:
    """Bool (batch, 1, seqlen_q, capacity) of a dense KV-cache call: query i of sequence b sees key j when
    j < seqused_k[b] and the causal/window pattern, aligned at that sequence's fill, allows it. Built on the
    device (no host sync); one query aligned bottom-right needs the fill alone (causal hides nothing more)."""
    used = call.seqused_k.long()
    device = call.q.device
    keys = torch.arange(call.seqlen_k, device=device).view(1, 1, -1)
    allowed = keys < used.view(-1, 1, 1)
    decode = call.seqlen_q == 1 and call.causal_alignment == "bottom_right" and call.window is None
    if (call.causal or call.window is not None) and not decode:
        queries = torch.arange(call.seqlen_q, device=device).view(1, -1, 1)
        offset = (used - call.seqlen_q).view(-1, 1, 1) if call.causal_alignment == "bottom_right" else 0
        rel = keys - queries - offset  # j - (i + o)
        if call.causal:
            allowed = allowed & (rel <= 0)
        if call.window is not None:
            left, right = call.window
            if left >= 0:
                allowed = allowed & (rel >= -left)
            if right >= 0:
                allowed = allowed & (rel <= right)
    mask: torch.Tensor = allowed.expand(-1, call.seqlen_q, -1).unsqueeze(1)
    return mask


# A paged call a kernel reads after gathering its pages copies its block table's pages each call; past this it is
# declined (a table sized for the model's longest context, most of it unused, would copy gigabytes per call).
PAGED_GATHER_MAX_BYTES = 1 << 30


def gathered_bytes(call: Any) -> int:
    """What `gathered_pages` copies for a paged `call`: every page its block table names, k and v."""
    rows = call.batch * call.block_table.shape[1] * call.page_size
    return int(rows * call.heads_kv * (call.head_dim + call.head_dim_v) * call.k.element_size())


def paged_gather_reason(call: Any, kernel: str) -> str | None:
    """Why a paged `call` is not taken by gathering its pages for `kernel`: the copy would pass the bound."""
    if call.block_table is None or gathered_bytes(call) <= PAGED_GATHER_MAX_BYTES:
        return None
    return (f"paged cache: {kernel} reads a paged cache by gathering its pages per call, which here would copy "
            f"{gathered_bytes(call) / 2**20:.0f} MiB (the block table's {call.block_table.shape[1]} pages per "
            f"sequence) — over the {PAGED_GATHER_MAX_BYTES >> 20} MiB bound; narrow the block table to the pages "
            "in use")


def gathered_pages(call: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v of the pages each sequence's block table names, in order: (batch, max_pages * page_size, heads_kv,
    dim) — a dense cache of max_pages * page_size keys per sequence, for kernels that read dense caches with
    per-sequence lengths. Entries past a sequence's used pages are whatever the caller left there: clamped into
    the pool (their keys lie beyond seqused_k and are never read); the used ones are the caller's to get right,
    as for a kernel reading pages natively (attention() checks them on the host on CPU, or with
    OPDISPATCH_SYNC_CHECKS=1)."""
    table = call.block_table.clamp(0, call.k.shape[0] - 1).long()
    batch = table.shape[0]
    k = call.k[table].reshape(batch, -1, call.k.shape[2], call.k.shape[3])
    v = call.v[table].reshape(batch, -1, call.v.shape[2], call.v.shape[3])
    return k, v


def paged_as_dense(call: Any) -> Any:
    """A paged call with dense queries as the same call over a dense cache (`gathered_pages`, in the call's
    layout): for kernels that take dense caches only."""
    k, v = gathered_pages(call)
    dense = call.with_tensors(call.q, call.from_bshd(k), call.from_bshd(v))
    dense.block_table = None
    return dense


def sequence_keys(call: Any, pool: torch.Tensor, b: int, cu_k: list[int] | None,
                  used: list[int] | None) -> torch.Tensor:
    """Sequence b's keys (or values) of `pool` (call.k or call.v) as (n, heads_kv, dim), for kernels that run one
    sequence at a time: its block table's used pages, its cu_seqlens_k span (cut to seqused_k over a KV cache), or
    its row of a dense cache. `cu_k` and `used` are cu_seqlens_k and seqused_k read once per call as lists (a host
    read: CPU calls, or kernels that need the lengths on the host anyway)."""
    if call.block_table is not None:
        assert used is not None
        n, size = used[b], call.page_size
        pages = call.block_table[b, : (n + size - 1) // size].long()
        return pool[pages].reshape(-1, pool.shape[2], pool.shape[3])[:n]
    if cu_k is not None:
        start, end = cu_k[b], cu_k[b + 1]
        return pool[start:start + used[b] if used is not None else end]
    keys: torch.Tensor = call.bshd(pool)[b]
    return keys[: used[b]] if used is not None else keys


def kv_cache_as_mask(call: Any) -> Any:
    """A dense KV-cache call as the same computation over the whole cache with the boolean mask of
    `kv_cache_allowed`, for kernels that take masks but no per-sequence lengths. ALiBi is not folded (its distance
    needs the same offsets)."""
    masked = call.with_tensors(call.q, call.k, call.v)
    masked.attn_mask = kv_cache_allowed(call)
    masked.seqused_k = None
    masked.causal, masked.window, masked.causal_alignment = False, None, "top_left"
    return masked


def flash_attn_kv_cache(flash_attn: Any, call: Any) -> Any:
    """A KV-cache call through a module with flash-attn 2's Python API (flash-attn, ROCm's flash-attention):
    ``flash_attn_with_kvcache`` for dense queries over a dense or paged cache, ``flash_attn_varlen_func(...,
    block_table=)`` for packed queries over pages (its cu_seqlens_k made from seqused_k)."""
    window: tuple[int, int] = call.window if call.window is not None else (-1, -1)
    common = dict(softmax_scale=call.scale, causal=call.causal, window_size=window, softcap=call.softcap,
                  alibi_slopes=call.alibi_slopes)
    if call.varlen:
        res = flash_attn.flash_attn_varlen_func(
            call.q, call.k, call.v, call.cu_seqlens_q, cumulative_lengths(call.seqused_k), call.max_seqlen_q,
            call.seqlen_k, block_table=call.block_table, return_attn_probs=call.return_lse, **common)
        return (res[0], kv_lse_fix(res[1], call)) if call.return_lse else res
    cache = (call.k, call.v) if call.block_table is not None else (call.bshd(call.k), call.bshd(call.v))
    res = flash_attn.flash_attn_with_kvcache(call.bshd(call.q), *cache, cache_seqlens=call.seqused_k,
                                             block_table=call.block_table, return_softmax_lse=call.return_lse,
                                             **common)
    if not call.return_lse:
        return call.from_bshd(res)
    return call.from_bshd(res[0]), kv_lse_fix(res[1], call)
