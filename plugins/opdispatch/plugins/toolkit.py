"""Helpers for writing attention implementations — the public toolkit of vendor plugins.

Built-in vendors use exactly this module (and the names exported by ``opdispatch``), nothing private, so a
third-party plugin can do everything they do. Each function's docstring is its documentation.

Masks and biases (opdispatch's conventions: causal/window aligned ``top_left`` or ``bottom_right`` by an
``offset`` = seqlen_k - seqlen_q for bottom-right; ALiBi adds ``-slope * |i + offset - j|``):

- `allowed_positions(sq, sk, causal, window, offset, device)`: the bool (sq, sk) matrix of keys each query sees.
- `alibi_bias(slopes, sq, sk, offset, dtype)`: the (heads, sq, sk) ALiBi bias.
- `additive_bias(call, q, k, fold_causal=..., ...)`: one additive float bias for a call's mask, bias, ALiBi and
  (optionally) causal/window — for kernels that take a bias instead of flags.
- `mask_bias_values(dtype, device)`: (zero, blocked) 0-dim tensors, so a bound function turns a boolean mask into
  additive_bias's bias in one kernel, ``torch.where(mask, zero, blocked)`` (same values, same bits).
- `shift_rows(bias, dtype)`: subtract each row's maximum so a large bias survives a low-precision dtype; returns
  the shifted bias and the per-row shift (add it back to the LSE).

Calling torch's own SDPA on a vendor device:

- `functional_sdpa_call(call, sdpa, scale)`: `F.scaled_dot_product_attention` on a call — GQA expanded, every
  pattern but equal-length causal folded into one additive mask, rows without a key zeroed — for vendors whose
  torch build routes it to fused kernels with a backward (torch_mlu, torch_musa).

Unequal head dims on kernels that need one (`opdispatch.plugins._head_dim_padding`'s doc says why it is exact):

- `pads_v_head_dim(cls)`: class decorator for an `AttentionImpl` whose kernel needs one head dim for q/k/v: it
  declares ``head_dim_v_differs`` and runs calls whose v is narrower than q/k on v zero-padded to q/k's head dim,
  the output sliced back (the LSE and gradients exact). Cost, per such call: one padded copy of v and an output
  q/k's head dim wide (`V_PADDING_COST`, shown by ``opdispatch list -v``); equal head dims run unchanged. A wider
  v and KV-cache calls are refused with the reason (`v_padding_reason`).
- `padded_v_call(call)`, `sliced_result(head_dim_v, result)`, `pad_last(t, size)`: its steps, for adapters that pad
  inside their own code.

Binding:

- `bind_dense(call, kernel)`: wrap ``kernel(q, k, v)`` over (batch, heads, seq, dim) tensors into a function of
  the call's own dense layout (views only) — the building block of ``AttentionImpl.bind``.
- `size_generic(fn)`: declare that a bound function reads every size from its tensors, so the per-call fast path
  reuses it for calls that differ only in sizes within the same decision class.
- `kernel_call(kernel, *tail, index=None, **kwargs)`: ``fn(q, k, v) = kernel(q, k, v, *tail, **kwargs)[index]``
  as one C call where opdispatch's compiled fast path is built (else a Python function): bind the aten op or
  vendor function itself, with no Python frame per call.
- `aten_sdpa_call(op, *tail, defaults=..., scale=..., head_dim=..., index=0)`: `kernel_call` of a torch SDPA aten
  op with trailing default arguments and torch's own default scale left out (each explicit argument costs torch's
  parser about 0.25-0.5 µs per call on a CPU).

FlashAttention-2 conventions (kernels of that lineage: flash-attn, FlagGems' varlen kernel):

- `blind_rows(sq, sk, offset, causal, window, device)`: queries that see no key.
- `dense_lse_fix(lse, ...)` / `varlen_lse_fix(lse, ...)`: turn such rows' LSE (+inf or arbitrary in the kernel)
  into opdispatch's -inf, for dense (batch, heads, sq) and packed (heads, total_q) LSEs.
- `causal_alibi_lse_reason(call)`: the reason to decline ``return_lse`` with causal ALiBi (the kernels' LSE is
  shifted by a row-dependent constant there).
- `kernel_window(call)`: the call's window as ``window_size=(left, right)`` (-1 unbounded; (-1, -1) for none).
- `alibi_alignment_reason(call, kernel)`: the reason a bottom-right-ALiBi kernel declines a top-left call whose
  lengths differ, or None.
- `empty_rows_to_neg_inf(lse)`: the +inf LSE such kernels give a query that sees no key, as -inf.

Dense ↔ packed varlen (for kernels that take only packed ``thd`` sequences):

- `pack_dense(call)` → `PackedCall(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`: a dense
  call's tensors as (batch * seq, heads, dim) with uniform int32 offsets (`uniform_cu_seqlens(batch, seqlen,
  device)`); `unpack_out(call, out)` and `unpack_lse(call, lse)` bring the results back.
- `pack_padded_lse(lse, cu_seqlens_q, total_q)`: a per-sequence padded (batch, heads, max_seqlen_q) varlen LSE as
  the packed (heads, total_q), gathered on the device (no host sync).

KV caches (calls with ``seqused_k``, and ``block_table`` when paged), for FlashAttention-lineage kernels:

- `packed_queries(call)` → `KvQueries(q, cu_seqlens_q, max_seqlen_q)` and `unpack_kv_out(call, out)`: the queries
  as packed sequences and the output back.
- `cache_as_pages(call)` → (k pool, v pool, block table): a paged call's own, or a dense cache read as one page
  per sequence (views, no copy); `cache_as_pages_reason(call, kernel)`: why not (a dense cache not in bshd).
- `cumulative_lengths(seqused_k)`: int32 offsets of the key counts, for kernels that want ``cu_seqlens_k``.
- `kv_lse_fix(lse, call)`: -inf for the queries of a KV-cache call that see no key.
- `kv_cache_reasons(call, kernel)`: the limits such entries share (forward only, bottom-right, no dropout).
- `flash_attn_kv_cache(module, call)`: the call through a module with flash-attn 2's Python API
  (``flash_attn_with_kvcache``, or ``flash_attn_varlen_func(block_table=)`` for packed queries).
- `kv_cache_allowed(call)`: the keys each query of a dense KV-cache call sees, as a boolean (batch, 1, seqlen_q,
  capacity) mask; `kv_cache_as_mask(call)`: the call as a masked call over the whole cache, for kernels that take
  boolean masks but no per-sequence lengths.
- Paged caches for kernels that read dense ones: `gathered_pages(call)` (k and v of the pages each block table
  names, as (batch, max_pages * page_size, heads_kv, dim)), `paged_as_dense(call)` (the call over that dense cache,
  in its layout), `gathered_bytes(call)` and `paged_gather_reason(call, kernel)` (declined past
  `PAGED_GATHER_MAX_BYTES`, 1 GiB per call, with the size and the fix).
- One sequence at a time: `sequence_keys(call, pool, b, cu_k, used)` — sequence b's keys (or values) from its
  block table's used pages, its cu_seqlens_k span or its dense-cache row, the lengths read once as lists.

Layouts: the call record converts views itself — ``call.bhsd(t)``/``call.from_bhsd(t)`` and
``call.bshd(t)``/``call.from_bshd(t)`` (see `opdispatch.AttentionCall`); in a bound function use
`layout_views(layout)` → ``(to_bhsd, from_bhsd)``, which keep no call (and no tensor) alive.

FP8: `FP8_DTYPES` (the FP8 kinds attention takes), `FP8_OUT_DTYPES` (what an FP8 call may return), and
`LAYOUT_DIMS` (where batch, sequence, heads and dim sit in each dense layout — a (batch, heads_kv) descale's place).

Library versions (device probes, version checks):

- `version_tuple(text)`: the numeric release of a version string ("2.7.0.post2" → (2, 7, 0)).
- `at_least(version, minimum)`: whether a (possibly unknown) version is new enough.
- `installed_versions({key: distribution})`: versions of installed pip distributions, without importing them.
- `private_use1_backend(device, type, module, distribution)`: a PrivateUse1 device probe's common part
  (``torch.<type>``, the index, the library versions), or None when the device is not one.
- `unaccepted_keywords(fn, keywords)`: the keywords a vendor function would refuse (readable signatures only);
  `unaccepted_keywords_reason(fn, keywords, name)`: that as an availability reason, with the signature.
"""

from __future__ import annotations

from opdispatch.ops._attention import (LAYOUT_DIMS, additive_bias, alibi_bias, allowed_positions, bind_dense,
                                   layout_views, mask_bias_values, shift_rows, size_generic)
from opdispatch.base._dtypes import FP8_DTYPES, FP8_OUT_DTYPES
from opdispatch.base._native import kernel_call

from ._functional_sdpa import functional_sdpa_call
from ._head_dim_padding import (V_PADDING_COST, pad_last, padded_v_call, pads_v_head_dim, sliced_result,
                                v_padding_reason)
from ._fa2_conventions import blind_rows, causal_alibi_lse_reason, dense_lse_fix, varlen_lse_fix
from ._kernel_conventions import alibi_alignment_reason, aten_sdpa_call, empty_rows_to_neg_inf, kernel_window
from ._kv_cache import (PAGED_GATHER_MAX_BYTES, KvQueries, cache_as_pages, cache_as_pages_reason, cumulative_lengths,
                        flash_attn_kv_cache, gathered_bytes, gathered_pages, kv_cache_allowed, kv_cache_as_mask,
                        kv_cache_reasons, kv_lse_fix, packed_queries, paged_as_dense, paged_gather_reason,
                        sequence_keys,
                        unpack_kv_out)
from ._private_use1 import private_use1_backend
from ._packing import PackedCall, pack_dense, pack_padded_lse, uniform_cu_seqlens, unpack_lse, unpack_out
from ._signatures import unaccepted_keywords, unaccepted_keywords_reason
from ._versions import at_least, installed_versions, version_tuple

__all__ = ["FP8_DTYPES", "FP8_OUT_DTYPES", "LAYOUT_DIMS", "KvQueries", "PackedCall", "V_PADDING_COST",
           "pad_last", "padded_v_call", "pads_v_head_dim", "sliced_result", "v_padding_reason",
           "additive_bias", "alibi_alignment_reason", "alibi_bias", "allowed_positions",
           "at_least", "aten_sdpa_call", "bind_dense", "blind_rows", "cache_as_pages", "cache_as_pages_reason",
           "causal_alibi_lse_reason", "cumulative_lengths", "dense_lse_fix", "empty_rows_to_neg_inf",
           "flash_attn_kv_cache", "functional_sdpa_call", "installed_versions", "kernel_call", "kernel_window",
           "kv_cache_allowed",
           "kv_cache_as_mask", "kv_cache_reasons", "PAGED_GATHER_MAX_BYTES", "gathered_bytes", "gathered_pages",
           "paged_as_dense", "paged_gather_reason", "private_use1_backend", "sequence_keys", "kv_lse_fix",
           "layout_views", "mask_bias_values", "pack_dense",
           "pack_padded_lse",
           "packed_queries", "shift_rows", "size_generic", "unaccepted_keywords",
           "unaccepted_keywords_reason", "uniform_cu_seqlens",
           "unpack_kv_out", "unpack_lse",
           "unpack_out", "varlen_lse_fix", "version_tuple"]
