"""`flagos.triton`: FlagGems' Triton attention kernels (FlagOS), forward only.

Two entries, chosen per call:
- dense calls → ``flag_gems.ops.attention.scaled_dot_product_attention_forward(query, key, value, attn_mask,
  dropout_p, is_causal, scale, enable_gqa) -> (o, M)`` on (batch, heads, seq, dim) views: causal top-left, GQA,
  a 4-D additive mask; M is a base-2 log-sum-exp (the Triton tutorial's), converted here to natural log.
- varlen, sliding window, softcap, ALiBi or bottom-right causal → ``flag_gems.flash_attn_varlen_func(q, k, v,
  max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, ...)`` (vLLM's argument order: max_seqlen_q comes
  before cu_seqlens_q); dense inputs are packed to (batch*seq, heads, dim) with uniform cu_seqlens. Causal,
  window and ALiBi are aligned bottom-right there (FlashAttention-2 semantics).
- KV caches → the same entry with ``seqused_k`` and ``block_table`` (it takes no ``cu_seqlens_k`` then). A dense
  cache is read as one page per sequence; the kernel addresses slot ``page * page_size + i`` with k's row
  stride, so that needs a bshd cache (rows of one sequence adjacent).
- Windows (`gems_window`): 5.0.2 applies a window only when its left bound is set and then takes both bounds
  literally, so an unbounded side is passed as max_seqlen_k - 1 (a causal decode's window (left, -1) hid the
  diagonal key: off by ~3 on an H100). One-query GQA calls without a window come back with a scrambled LSE
  (query groups swapped into the sequence dimension), put back in order by `unswap_lse`.

flag_gems is imported lazily: its import raises "No device were detected on your machine" without a GPU.

Forward only. Measured with flag_gems 5.0.2 on an H200 (torch 2.11, triton 3.6): the SDPA backward computes only
causal gradients, ignores the forward's attn_mask, and died with a CUDA illegal memory access on every config
tried, which leaves the CUDA context unusable; the varlen entry has no autograd at all. A call that needs
gradients is therefore rejected, and no path of the default policy reaches that backward.

Vendors (read from FlagGems 5.0.2, ``src/flag_gems/runtime``): FlagGems picks its backend by ``GEMS_VENDOR``, else a
torch attribute (``torch.mlu``/``musa``/``corex``/``npu``), else the first vendor tool that runs (``nvidia-smi``,
``rocm-smi``, ``ixsmi``, ``xpu-smi``, ``hy-smi``, ``mx-smi``, ``mthreads-gmi``, ``cnmon``, ``npu-smi``;
`runtime/backend/device.py`), and `runtime.replace_customized_ops` swaps the top-level ``flag_gems.<op>`` for a
``_<vendor>/ops`` one where that backend has its own. Cambricon, Hygon and KunLunXin carry their own
``scaled_dot_product_attention_forward`` and ``flash_attn_varlen_func`` (same signatures); the others run the
generic kernels through their Triton. So the entries are taken from the top-level ``flag_gems`` namespace, and on a
real device the plugin is available only where ``flag_gems.vendor_name`` is the device's vendor. Narrowed per vendor:
- KunLunXin: its SDPA forward is an autograd Function returning the output only (no LSE); its varlen entry and
  Hygon's are skipped by FlagGems' own tests ("RESULT TODOFIX", tests/test_flash_attn_varlen_func.py), so calls
  that need that entry (varlen, KV caches, windows, softcap, ALiBi, bottom-right causal) are refused there.
- NVIDIA: compute capability >= 8.0 (FlagGems' ``_nvidia`` ARCH_MAP: ampere, hopper).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import (alibi_alignment_reason, cache_as_pages, cache_as_pages_reason,
                                        causal_alibi_lse_reason, dense_lse_fix, kernel_window, kv_lse_fix, pack_dense,
                                        packed_queries, pads_v_head_dim, unpack_kv_out, unpack_lse, unpack_out,
                                        varlen_lse_fix)

_LN2 = math.log(2.0)
# v5.0.2 scaled_dot_product_attention_forward: `assert HEAD_DIM_K in {16, 32, 64, 128, 256}`.
SDPA_HEAD_DIMS = frozenset({16, 32, 64, 128, 256})
# A masked score: the kernel's own causal mask uses -1.0e6 (a finite value: an all -inf block gives NaN in its
# running max); its bool-mask conversion is inverted (True becomes -1e6), so masks are passed as float here.
_MASKED = -1.0e6

BACKWARD_REASON = ("flagos.triton is forward-only: flag_gems 5.0.2's SDPA backward computes only causal "
                   "gradients, drops attn_mask, and died with a CUDA illegal memory access (killing the CUDA "
                   "context) on every config measured on an H200; its varlen kernel has no backward. The "
                   "_cambricon backend's own scaled_dot_product_attention_backward (5.0.2) takes is_causal and "
                   "attn_mask without using them either; _ascend has attention ops only after 5.0.2")


# What every FlagGems implementation needs (attention and rms_norm).
FLAG_GEMS = Requirement(module="flag_gems", distribution="flag-gems", min_version="5.0.0", key="flag_gems",
                        install_hint="pip install 'flag-gems>=5.0' (needs triton; imports only where a GPU is visible)")


# opdispatch vendor name -> FlagGems' vendor name (runtime/common.py `vendors`, the `_<vendor>` backend folders).
GEMS_VENDORS: dict[str, str] = {
    "nvidia": "nvidia", "amd": "amd", "iluvatar": "iluvatar", "kunlunxin": "kunlunxin", "hygon": "hygon",
    "metax": "metax", "mthreads": "mthreads", "cambricon": "cambricon", "ascend": "ascend",
}
# FlagGems 5.0.2 skips flash_attn_varlen_func's tests on these backends ("RESULT TODOFIX").
VARLEN_UNVERIFIED = frozenset({"kunlunxin", "hygon"})
# Backends whose scaled_dot_product_attention_forward returns the output only (an autograd Function's result).
SDPA_NO_LSE = frozenset({"kunlunxin"})
# NVIDIA: FlagGems' _nvidia ARCH_MAP covers capability 8 (ampere) and 9 (hopper).
_NVIDIA_MIN_CAPABILITY = (8, 0)


def gems_vendor_mismatch(device: DeviceInfo) -> str | None:
    """Why flag_gems cannot serve `device` here (None when it can): it fails to import, or it detected another
    vendor, whose kernels and configs would then be used."""
    try:
        import flag_gems
    except Exception as exc:  # "No device were detected on your machine !" and friends
        return f"flag_gems failed to import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    detected = getattr(flag_gems, "vendor_name", None)
    if detected != GEMS_VENDORS.get(device.vendor):
        return (f"flag_gems detected vendor {detected!r}, but this device is {device.vendor!r}: its kernels and "
                f"configs would be the wrong backend's; set GEMS_VENDOR={GEMS_VENDORS.get(device.vendor)} "
                "(FlagGems' runtime/backend/device.py reads it first)")
    return None


def uses_varlen_kernel(call: AttentionCall) -> bool:
    """Whether the call goes to flash_attn_varlen_func (else to the dense SDPA kernel)."""
    return (call.varlen or call.kv_cache or call.positional_mask or call.softcap > 0
            or call.alibi_slopes is not None)


@pads_v_head_dim
class FlagGemsAttention(AttentionImpl):
    vendor: ClassVar[str] = "flagos"
    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 25
    description: ClassVar[str] = ("FlagGems (FlagOS) Triton attention: scaled_dot_product_attention_forward and "
                                  "flash_attn_varlen_func; forward only")
    # The torch device types of FlagGems' backends (VendorInfoBase.device_name): cuda (NVIDIA, AMD, Hygon,
    # Iluvatar, KunLunXin, MetaX), musa (Moore Threads), mlu (Cambricon), npu (Ascend).
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda", "musa", "mlu", "npu"})
    # FlagGems' backend folder names; measured by this project on NVIDIA only (H100, H200), the others are read
    # from FlagGems' source and its per-vendor test skips.
    device_vendors: ClassVar[frozenset[str]] = frozenset(GEMS_VENDORS)
    requires = (FLAG_GEMS,)
    # Union of the two kernels' checks; extra_reasons narrows per kernel. fp16/bf16 ("FlashAttention only
    # support fp16 and bf16 data type"), head_dim <= 256 and a multiple of 8, one head dim for q/k/v, GQA,
    # no dropout (SDPA asserts dropout_p == 0), bool masks on the dense kernel only. Contiguous inputs: on an H100,
    # `opdispatch validate` measured out error 1.3-1.4 (fp16/bf16) when q, k and v had different stride patterns
    # (q's head dim transposed, k sliced, v from bhsd storage) — the kernel reads k/v with q's strides
    # (benchmarks/results/validate-h100.md).
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_min=8, head_dim_max=256, head_dim_multiple=8,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), contiguous_inputs=True,
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True, softcap=True,
        alibi=True, dropout=False, attn_mask=True, attn_bias=False, lse=True, backward=False,
        causal=True, deterministic_forward=True, deterministic_backward=True, kv_cache=True, paged_kv=True,
        kv_cache_alibi=True,
    )

    def device_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = super().device_reasons(device)
        if reasons or device.vendor != "nvidia":
            return reasons
        if device.capability is None or device.capability < _NVIDIA_MIN_CAPABILITY:
            have = "none" if device.capability is None else "%d.%d" % device.capability
            reasons.append(f"needs compute capability >= 8.0 on NVIDIA (FlagGems' _nvidia backend: ampere, "
                           f"hopper), device has {have}")
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        return gems_vendor_mismatch(device)

    # Of a call without a window, selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        # extra_reasons reads class features (flags, alignment, same_lengths, head_dim, options) and, for a
        # left-only window, whether the queries outnumber the keys
        return (window_reason(call) is not None,)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        if call.requires_grad:
            reasons.append(BACKWARD_REASON)
        vendor = GEMS_VENDORS.get(getattr(device, "vendor", ""))  # some tests ask without a device
        if uses_varlen_kernel(call) and vendor in VARLEN_UNVERIFIED:
            reasons.append(f"varlen, KV caches, windows, softcap, ALiBi and bottom-right causal need FlagGems' "
                           f"flash_attn_varlen_func, whose tests flag_gems 5.0.2 skips on {vendor} "
                           "(\"RESULT TODOFIX\")")
        elif not uses_varlen_kernel(call) and vendor in SDPA_NO_LSE and call.return_lse:
            reasons.append(f"return_lse: FlagGems' {vendor} scaled_dot_product_attention_forward returns the output "
                           "only")
        if uses_varlen_kernel(call):
            why = causal_alibi_lse_reason(call)
            if why:
                reasons.append(why)
            if call.attn_mask is not None:
                reasons.append("attn_mask together with window/softcap/ALiBi/varlen/bottom-right causal is not "
                               "supported (flash_attn_varlen_func takes no mask)")
            if call.alignment_matters and call.causal_alignment == "top_left":
                reasons.append("causal/window with causal_alignment='top_left' and seqlen_q != seqlen_k: the "
                               "varlen kernel aligns bottom-right")
            alibi = alibi_alignment_reason(call, "flash_attn_varlen_func")
            if alibi:
                reasons.append(alibi)
            pages = cache_as_pages_reason(call, "flag_gems") if call.kv_cache else None
            if pages:
                reasons.append(pages)
            window = window_reason(call)
            if window:
                reasons.append(window)
        elif call.head_dim not in SDPA_HEAD_DIMS:
            reasons.append(f"head_dim {call.head_dim} not in {sorted(SDPA_HEAD_DIMS)} (flag_gems "
                           "scaled_dot_product_attention_forward)")
        return reasons

    def run(self, call: AttentionCall) -> Any:
        pools = capacity_pools(call)
        if pools is not None:
            return self._dense_over_capacity(call, *pools)
        if uses_varlen_kernel(call):
            return self._varlen(call)
        import flag_gems

        # The top-level name: flag_gems swaps in its vendor backend's own kernel there (replace_customized_ops).
        scaled_dot_product_attention_forward = flag_gems.scaled_dot_product_attention_forward
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        mask = blind = None
        if call.attn_mask is not None:
            allowed = call.attn_mask
            # -1e6 overflows float16 (masked_fill raised): half its lowest finite value masks as well there
            masked = max(_MASKED, torch.finfo(q.dtype).min / 2)
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, masked)
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(
                q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            # A row its mask blinds: the kernel averages the values (every score equally masked, a finite
            # softmax); opdispatch's answer is zeros and an LSE of -inf (validate on an H200: 0.16 off in bf16).
            if call.causal:  # a row the mask and the causal pattern together leave without a key is blind too
                sq, sk = q.shape[2], k.shape[2]
                offset = sk - sq if call.causal_alignment == "bottom_right" else 0
                allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(offset)
            blind = ~allowed.any(-1)
            blind = blind.reshape((1,) * (3 - blind.dim()) + tuple(blind.shape)).expand(
                q.shape[0], q.shape[1], q.shape[2])
        res = scaled_dot_product_attention_forward(q, k, v, mask, 0.0, call.causal, call.scale,
                                                   call.heads_q != call.heads_kv)
        if isinstance(res, torch.Tensor):  # a backend returning the output only (KunLunXin); return_lse refused
            out = res if blind is None else res.masked_fill(blind.unsqueeze(-1), 0.0)
            return call.from_bhsd(out)
        out, m = res
        lse = m * _LN2
        if blind is not None:
            out = out.masked_fill(blind.unsqueeze(-1), 0.0)
            lse = lse.masked_fill(blind, -math.inf)
        out = call.from_bhsd(out)
        if not call.return_lse:
            return out
        return out, lse

    def _dense_over_capacity(self, call: AttentionCall, k_pool: torch.Tensor, v_pool: torch.Tensor) -> Any:
        """A dense call whose k/v are the first seqlen_k rows of a longer buffer (a growing KV cache sliced per
        step), run as a KV-cache call over the whole buffer: one page per sequence of `capacity` keys, seqused_k =
        seqlen_k (bottom-right, the alignment of every call that gets here). The SDPA kernel autotunes and
        compiles per key length (5.0.2's ``_attn_fwd`` is tuned on ``key=["KV_CTX", "HEAD_DIM"]``): ~4 s per
        decode step on an H100; the packed varlen path copied the slice every step. The varlen kernel's
        constexprs here (page size = capacity, block-table stride 1, heads, head dim, flags, the window as
        `gems_window` states it against the capacity) stay fixed while the length grows, and its loads past
        seqused_k are masked (``load_from_kvcache``), so the rows beyond the slice are never read."""
        queries = packed_queries(call)
        batch, capacity = k_pool.shape[0], k_pool.shape[1]
        device = queries.q.device
        used = torch.full((batch,), call.seqlen_k, dtype=torch.int32, device=device)
        table = torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)
        res = _gems_varlen(call, queries.q, k_pool, v_pool, queries.max_seqlen_q, queries.cu_seqlens_q, capacity,
                           None, seqused_k=used, block_table=table)
        if not call.return_lse:
            return unpack_out(call, res)
        return unpack_out(call, res[0]), dense_lse_fix(unpack_lse(call, res[1]), call.seqlen_q, call.seqlen_k,
                                                       call.causal, call.window, call.alibi_slopes)

    def _varlen(self, call: AttentionCall) -> Any:
        if call.kv_cache:
            queries = packed_queries(call)
            k, v, table = cache_as_pages(call)
            res = _gems_varlen(call, queries.q, k, v, queries.max_seqlen_q, queries.cu_seqlens_q, call.seqlen_k,
                               None, seqused_k=call.seqused_k, block_table=table)
            if not call.return_lse:
                return unpack_kv_out(call, res)
            lse = res[1] if call.varlen else unpack_lse(call, res[1])
            return unpack_kv_out(call, res[0]), kv_lse_fix(lse, call)
        if call.varlen:
            res = _gems_varlen(call, call.q, call.k, call.v, call.max_seqlen_q, call.cu_seqlens_q,
                               call.max_seqlen_k, call.cu_seqlens_k)
            if not call.return_lse:
                return res
            return res[0], varlen_lse_fix(res[1], call.cu_seqlens_q, call.cu_seqlens_k, call.causal, call.window,
                                          call.alibi_slopes)
        packed = pack_dense(call)
        res = _gems_varlen(call, packed.q, packed.k, packed.v, packed.max_seqlen_q, packed.cu_seqlens_q,
                           packed.max_seqlen_k, packed.cu_seqlens_k)
        out = unpack_out(call, res[0] if call.return_lse else res)
        if not call.return_lse:
            return out
        return out, dense_lse_fix(unpack_lse(call, res[1]), call.seqlen_q, call.seqlen_k, call.causal, call.window,
                                  call.alibi_slopes)


def _gems_varlen(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_q: int,
                 cu_q: torch.Tensor, max_k: int, cu_k: torch.Tensor | None, **kv: Any) -> Any:
    """flag_gems.flash_attn_varlen_func with `call`'s options, the window as 5.0.2 must be told it, and the LSE of
    one-query GQA calls put back in order."""
    import flag_gems

    res = flag_gems.flash_attn_varlen_func(
        q, k, v, max_q, cu_q, max_k, cu_k, softmax_scale=call.scale, causal=call.causal,
        window_size=gems_window(call, max_q, max_k), softcap=call.softcap, alibi_slopes=call.alibi_slopes,
        return_softmax_lse=call.return_lse, **kv)
    if call.return_lse and lse_swapped(call, max_q, max_k):
        res = res[0], unswap_lse(res[1], call.heads_kv)
    return res


def capacity_pools(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor] | None:
    """k and v widened to the buffer they are slices of, (batch, capacity, heads_kv, dim) views, when a dense call
    can run as a KV-cache call over them (else None): no mask (the varlen entry takes none),
    causal aligned bottom-right where alignment matters (the varlen kernel's), k and v with the same bshd strides
    (one row stride addresses both), each sequence's rows adjacent, the buffer longer than seqlen_k (a contiguous
    k gains nothing: the page size would still follow the length), seqlen_q <= seqlen_k, and the widened views
    inside their storage."""
    if call.varlen or call.kv_cache or call.attn_mask is not None or call.attn_bias is not None:
        return None
    if call.alignment_matters and call.causal_alignment != "bottom_right":
        return None
    if call.seqlen_q > call.seqlen_k:  # decode and chunked prefill only: no query left without a key
        return None
    if call.alibi_slopes is not None and call.causal_alignment != "bottom_right" and call.seqlen_q != call.seqlen_k:
        return None  # the kernel's ALiBi distance is bottom-right aligned
    k, v = call.bshd(call.k), call.bshd(call.v)
    batch, length, heads, dim = k.shape
    row = heads * dim
    if (k.stride() != v.stride() or k.shape != v.shape or k.stride(3) != 1 or k.stride(2) != dim
            or k.stride(1) != row or k.stride(0) % row):
        return None
    capacity = k.stride(0) // row
    if capacity <= length:
        return None
    for t in (k, v):
        end = t.storage_offset() + (batch - 1) * t.stride(0) + capacity * row
        if end > t.untyped_storage().nbytes() // t.element_size():
            return None
    shape = (batch, capacity, heads, dim)
    return k.as_strided(shape, k.stride()), v.as_strided(shape, v.stride())


def varlen_lengths(call: AttentionCall) -> tuple[int, int]:
    """(max_seqlen_q, max_seqlen_k) the adapter hands flash_attn_varlen_func for `call` (a KV cache: its
    capacity; packed dense calls: their own lengths)."""
    if call.kv_cache:
        return (call.max_seqlen_q if call.varlen else call.seqlen_q), call.seqlen_k
    if call.varlen:
        return call.max_seqlen_q, call.max_seqlen_k
    return call.seqlen_q, call.seqlen_k


def gems_window(call: AttentionCall, max_q: int, max_k: int) -> tuple[int, int]:
    """The call's window as flag_gems 5.0.2 must be told it. Its mha_varlan_fwd applies a window only when the
    left bound is set (``is_local = window_size_left >= 0``) and then takes BOTH bounds literally: an unbounded
    right side (-1) hides the diagonal key (measured on an H100: windowed decode off by up to 3.0, because a causal
    decode's canonical window is (left, -1)), and a right bound alone is ignored. It drops bounds of max_seqlen_k or
    more to -1 first, so an unbounded or longer side becomes max_k - 1 here: a left bound that far reaches key 0
    for every query; a right bound that far reaches each sequence's last key when max_q <= max_k (else refused, see
    `window_reason`)."""
    left, right = kernel_window(call)
    if left < 0 and right < 0:
        return left, right
    # A bound of max_k or more would be dropped by the kernel, un-setting is_local with it (a non-causal (w, 0)
    # window would lose its right bound): max_k - 1 reaches as far.
    return (left if 0 <= left < max_k else max_k - 1), (right if 0 <= right < max_k else max_k - 1)


def window_reason(call: AttentionCall) -> str | None:
    """Why flag_gems cannot take the call's window (None when it can): a left-only window needs a right bound
    of max_seqlen_k - 1 to reach every sequence's last key, which falls short when a sequence has more queries
    than max_seqlen_k."""
    if call.window is None or call.window[0] < 0 or call.window[1] >= 0:
        return None
    max_q, max_k = varlen_lengths(call)
    if max_q <= max_k:
        return None
    return (f"a left-only window with more queries ({max_q}) than keys ({max_k}): flag_gems 5.0.2 applies both "
            "window bounds literally and drops bounds >= max_seqlen_k, so no right bound reaches every key")


def lse_swapped(call: AttentionCall, max_q: int, max_k: int) -> bool:
    """Whether flag_gems 5.0.2 ran the call with query groups swapped into the sequence dimension (one query per
    sequence, GQA, no window, ALiBi or dropout after its own rewrites): its LSE comes back scrambled then."""
    if max_q != 1 or call.alibi_slopes is not None or call.heads_q == call.heads_kv or call.dropout_p:
        return False
    # causal needs no look: mha_varlan_fwd drops it for one query without ALiBi
    return all(bound < 0 or bound >= max_k for bound in gems_window(call, max_q, max_k))


def unswap_lse(lse: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """The (heads, batch) LSE of a swapped decode in its right order: flag_gems returns the kernel's
    (heads_kv, batch * groups) buffer reshaped (heads_kv, batch, groups) -> (heads, batch) without the transpose."""
    heads, batch = lse.shape
    return lse.reshape(heads_kv, batch, heads // heads_kv).transpose(1, 2).reshape(heads, batch)


__all__ = ["BACKWARD_REASON", "FlagGemsAttention", "GEMS_VENDORS", "gems_vendor_mismatch", "SDPA_HEAD_DIMS",
           "capacity_pools", "gems_window", "uses_varlen_kernel"]
