"""AMD ROCm attention: Composable Kernel through flash-attn and aiter, and AOTriton through torch's ROCm flash.

Every adapter is written against the vendor's public Python API, read from these sources (no AMD hardware ran
this code; see docs/vendors.md):

- `rocm.ck`: ROCm/flash-attention (CK backend), `flash_attn/flash_attn_interface.py` (`flash_attn_func`,
  `flash_attn_varlen_func`) and `csrc/flash_attn_ck/mha_fwd.cpp`, `mha_varlen_fwd.cpp` (the CK checks: fp16/bf16,
  head dim <= 256, heads_q % heads_kv == 0, the softcap argument ignored, the causal mask decoded as "b:" =
  bottom-right, varlen lse (heads, total_q)); snapshot tag v2.8.0-cktile.
- `rocm.aiter`: ROCm/aiter, `aiter/ops/mha.py` (`flash_attn_func`, `flash_attn_varlen_func`: keyword names stable
  from v0.1.3 to HEAD; return value `out` or a tuple `out, lse[, S_dmask]`; backward asserts `return_lse`),
  README "Supported Hardware" (gfx942, gfx950). Attention sinks (`caps.native_sinks`, forward only), read at
  ROCm/aiter e4048607a535ace3a2b51ded31b1c8c2d45c0879 (2026-08-22), aiter/ops/mha.py:
      flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1, 0), bias=None,
                      alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False,
                      how_v3_bf16_cvt=1, cu_seqlens_q=None, cu_seqlens_kv=None, sink_ptr=None, num_splits=0)
      flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                             dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                             window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                             return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                             out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None)
  `sink_ptr` (nhead_q,), cast to float32 (added by "Enable gptoss_sink", #1753): a logit per head in the scaled
  scores' units with no value (aiter/test_mha_common.py `attention_ref(sink=)`; window_size[2] is a different
  thing, StreamingLLM sink tokens). Three limits, so sinks go to the kernel only for calls without autograd, not
  returning the LSE, and not bf16 with head dims (128, 128) or (192, 128) (`native_sinks_limit`); every other call
  takes the shared epilogue, exact:
  1. Forward only: FlashAttnFunc/FlashAttnVarlenFunc.backward call `_flash_attn_*backward(..., sink=None,
     d_sink=None)` and return None for sink_ptr — the sink's gradient would be silently dropped (mha_bwd's own
     `sink`/`d_sink`, #2321, is not wired into autograd).
  2. gfx942/gfx950's ASM "fmha v3" forward ignores the sink: `can_impl_fmha_v3_fwd` does not look at sink_ptr and
     `fmha_v3_fwd`/`fmha_v3_varlen_fwd` take none; it runs bf16 (128, 128)/(192, 128) with no sliding window,
     alibi or dropout (dense: seqlen_q > 128). Routed away by dtype and head dims, a superset that does not
     depend on the window or the length heuristic.
  3. Whether the CK kernel's returned LSE includes the sink is not established from the sources read here, so a
     call returning the LSE takes the epilogue.
  No AMD machine ran this; tests/fakes/aiter.py mirrors the three.
  FP8 (forward), read at the same commit: `flash_attn_fp8_pertensor_func(q, k, v, q_descale, k_descale, v_descale,
  causal=False, window_size=(-1, -1, 0), softmax_scale=None)` (bshd; pads head dims to a multiple of 8; returns
  the output only, no LSE; no dropout, ALiBi, softcap or autograd). mha_fwd_kernels.cu takes float8_e4m3fn or
  e4m3fnuz, writes bfloat16 only ("only support bf16 out for fp8") and per-tensor descales only (`# [1]`,
  "only support per-tensor quantization for now"), so caps say e4m3fn, bf16 out, no per-head descales. The FP8
  kind a build reads is its arch's `aiter.dtypes.fp8` (aiter/utility/dtypes.py): float8_e4m3fnuz on gfx942
  (MI300X/MI325X), float8_e4m3fn on gfx950 (MI350/MI355X). opdispatch takes no fnuz, and e4m3fn bytes read as
  fnuz are a different number, so FP8 runs here on gfx950 only and gfx942 refuses it (`_aiter_fp8_reasons`).
- `rocm.aotriton`: pytorch/pytorch `aten/src/ATen/native/transformers/hip/flash_attn/flash_api.h` (`mha_fwd`
  dispatching to `mha_fwd_aot` or `mha_fwd_ck` on `getROCmFAPreferredBackend()`), `sdp_utils.cpp` (fp16/bf16,
  causal with seqlen_q != seqlen_k refused, `TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL`), `torch/backends/cuda/
  __init__.py` (`preferred_rocm_fa_library`), and ROCm/aotriton `v3src/util.cc` (the arch tables).
"""

from __future__ import annotations

import os
import sys
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import (alibi_alignment_reason, cache_as_pages, cache_as_pages_reason,
                                        cumulative_lengths, empty_rows_to_neg_inf, flash_attn_kv_cache, kernel_window,
                                        kv_cache_reasons, kv_lse_fix, pack_dense, packed_queries, pads_v_head_dim,
                                        unaccepted_keywords, unpack_kv_out, unpack_lse, unpack_out)

_HALF = frozenset({torch.float16, torch.bfloat16})
_AITER_V3_HEAD_DIMS = ((128, 128), (192, 128))  # (d, dv) of aiter's ASM fmha v3 bf16 forward, which has no sink
_AITER_FP8 = torch.float8_e4m3fn  # aiter.dtypes.fp8 on gfx950; gfx942's is e4m3fnuz, which the op does not take
_AITER_PAGE = 256  # keys a page of rocm.aiter's KV caches holds a multiple of (see RocmAiter.caps)
_ALL_LAYOUTS = frozenset({"bshd", "bhsd", "sbhd", "thd"})


def _split(result: Any, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(result, (tuple, list)):
        return result[0], (result[1] if with_lse else None)
    return result, None


# -- rocm.ck: ROCm/flash-attention built with its Composable Kernel backend ----------------------------------

class CkOptions(BaseModel):
    """Policy knobs of `rocm.ck` (`ops.attention.options."rocm.ck"` in the policy YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deterministic_backward: bool | None = Field(
        default=None, description="flash_attn's `deterministic` (backward only); None follows the call's "
                                  "deterministic flag")


AITER = Requirement(module="aiter", distribution="amd-aiter",
                    install_hint=("build AMD aiter: git clone --recursive https://github.com/ROCm/aiter && cd aiter && "
                                  "python3 setup.py develop (distribution amd-aiter; gfx942/gfx950)"))


@pads_v_head_dim
class RocmFlashAttnCK(AttentionImpl):
    vendor: ClassVar[str] = "rocm"
    name: ClassVar[str] = "ck"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = ("ROCm/flash-attention, Composable Kernel backend (flash_attn.flash_attn_func / "
                                  "flash_attn_varlen_func)")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"amd"})
    # setup.py validate_and_update_archs: the CK build accepts GPU_ARCHS gfx90a, gfx942, gfx950.
    archs: ClassVar[frozenset[str]] = frozenset({"gfx90a", "gfx942", "gfx950"})
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="flash_attn", distribution="flash_attn", verify_distribution=True,
        install_hint=("build ROCm's flash-attention with its CK backend: git clone --recursive "
                      "https://github.com/ROCm/flash-attention && cd flash-attention && "
                      "GPU_ARCHS=gfx942 python setup.py install (MI200/MI300, ROCm >= 6.0)")),)
    # The Python wrapper pads head dims to a multiple of 8 before the CK check (<= 256, % 8), so any head dim up
    # to 256 is accepted; v shares q's head dim (one head_size in mha_fwd.cpp). CK accepts a softcap argument
    # and ignores it, so softcap is not claimed. A dense KV cache goes through flash_attn_with_kvcache
    # (csrc/flash_attn_ck/flash_api.cpp mha_fwd_kvcache); paged caches are not claimed: the CK kernel's page-size
    # rule is not documented and no AMD machine was at hand to measure it.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=_HALF, head_dim_max=256, layouts=_ALL_LAYOUTS, causal_alignments=frozenset({"bottom_right"}),
        gqa=True, window=True, softcap=False, alibi=True, dropout=True, lse=True, backward=True,
        deterministic_backward=True,
        causal=True, deterministic_forward=True, kv_cache=True, kv_cache_alibi=True,
    )
    options_model: ClassVar[type[BaseModel]] = CkOptions

    # selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads only class features (flags, alignment, same_lengths, head_dim, options)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = [r for r in (alibi_alignment_reason(call),) if r] + kv_cache_reasons(call, "ROCm flash-attention")
        if call.kv_cache and call.varlen:
            reasons.append("packed queries over a KV cache (thd with seqused_k) are not supported: "
                           "flash_attn_with_kvcache takes dense queries")
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        # flash_attn_interface.py picks its backend at import time from this variable, exactly "TRUE".
        if os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE":
            return ("FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE makes flash_attn use its Triton AMD backend, not CK; "
                    "unset it to use rocm.ck")
        try:
            import flash_attn
        except Exception as exc:  # a broken build must not take dispatch down
            return f"importing flash_attn failed: {type(exc).__name__}: {exc}"
        if not all(hasattr(flash_attn, f) for f in ("flash_attn_func", "flash_attn_varlen_func")):
            return "flash_attn has no flash_attn_func/flash_attn_varlen_func (not a flash-attn 2.x build)"
        return None

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        import flash_attn

        if call.kv_cache:
            return flash_attn_kv_cache(flash_attn, call)  # type: ignore[no-any-return]
        deterministic = self.options.deterministic_backward
        if deterministic is None:
            deterministic = call.deterministic
        kwargs = dict(dropout_p=call.dropout_p, softmax_scale=call.scale, causal=call.causal,
                      window_size=kernel_window(call), softcap=0.0, alibi_slopes=call.alibi_slopes,
                      deterministic=deterministic, return_attn_probs=call.return_lse)
        if call.varlen:
            result = flash_attn.flash_attn_varlen_func(
                call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                call.max_seqlen_k, **kwargs)
            out, lse = _split(result, call.return_lse)  # (out, lse (heads, total_q), S_dmask)
        else:
            q, k, v = (call.bshd(t) for t in (call.q, call.k, call.v))
            result = flash_attn.flash_attn_func(q, k, v, **kwargs)
            out, lse = _split(result, call.return_lse)  # (out, lse (b, heads, sq), S_dmask)
            out = call.from_bshd(out)
        if not call.return_lse:
            return out
        assert lse is not None
        return out, empty_rows_to_neg_inf(lse)


# -- rocm.aiter: AMD's aiter (CK-tile and hand-written ASM "fmha v3" kernels) ---------------------------------

class AiterOptions(BaseModel):
    """Policy knobs of `rocm.aiter`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deterministic_backward: bool | None = Field(
        default=None, description="aiter's `deterministic` (backward only); None follows the call's flag")
    how_v3_bf16_cvt: int | None = Field(
        default=None, ge=0, description="aiter's `how_v3_bf16_cvt` (bf16 conversion variant of the gfx942 ASM v3 "
                                        "kernels; aiter >= 0.1.7, default 1); None leaves aiter's default")


class RocmAiter(AttentionImpl):
    vendor: ClassVar[str] = "rocm"
    name: ClassVar[str] = "aiter"
    priority: ClassVar[int] = 90
    description: ClassVar[str] = ("AMD aiter flash attention (aiter.flash_attn_func / flash_attn_varlen_func; CK-tile "
                                  "+ ASM)")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"amd"})
    # aiter README "Supported Hardware": MI300X/MI325X (gfx942) fully, MI350/MI355X (gfx950); RDNA experimental.
    archs: ClassVar[frozenset[str]] = frozenset({"gfx942", "gfx950"})
    requires: ClassVar[tuple[Requirement, ...]] = (AITER,)
    # mha_fwd_kernels.cu: fp16/bf16 (fp8 needs descales this call cannot carry), head dims <= 256 (the wrapper
    # pads to % 8), q and v head dims may differ, GQA. Softcap exists only on the varlen function
    # (`logits_soft_cap`); dense calls with softcap are packed into it. `bias` is a (seqlen_q, seqlen_k) tensor
    # only, so general attn_bias is not claimed. KV caches: the varlen function's `block_table` (flash-attn's paged
    # convention: page pools, cu_seqlens_k the keys' offsets; no seqused_k, no with_kvcache), a dense bshd cache
    # read as one page per sequence. The page sizes its CK-tile kernels accept are not documented and no AMD
    # machine was at hand: pages must hold a multiple of 256 keys, the strictest rule of the FlashAttention line
    # (flash-attn's CUDA kernels), so what is claimed holds under any smaller tile.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        # FP8: e4m3fn, bf16 out, one descale per tensor (module docstring); the rest of an FP8 call's limits:
        # `_aiter_fp8_reasons`.
        dtypes=_HALF | {_AITER_FP8}, fp8_out_dtypes=frozenset({torch.bfloat16}), fp8_descale_per_head=False,
        head_dim_max=256, head_dim_v_differs=True, layouts=_ALL_LAYOUTS,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, window=True, softcap=True, alibi=True,
        dropout=True, lse=True, backward=True, deterministic_backward=True,
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True, page_size_multiple=_AITER_PAGE,
        # sink_ptr is forward-only (module docstring): training calls with sinks take the shared epilogue.
        native_sinks=True, native_sinks_backward=False,
    )
    options_model: ClassVar[type[BaseModel]] = AiterOptions

    def native_sinks_limit(self, call: AttentionCall) -> str | None:
        if call.kv_cache:
            return "aiter's paged KV-cache entry is not read for sink_ptr here: the shared epilogue"
        if call.return_lse:
            return "whether aiter's returned LSE includes sink_ptr is not established: the shared epilogue"
        if call.dtype == torch.bfloat16 and (call.head_dim, call.head_dim_v) in _AITER_V3_HEAD_DIMS:
            return (f"aiter's ASM fmha v3 forward (bf16, head dims {call.head_dim}/{call.head_dim_v}) ignores "
                    f"sink_ptr: the shared epilogue")
        entry = "flash_attn_varlen_func" if call.varlen or call.softcap > 0 else "flash_attn_func"
        try:  # imported here, not read from sys.modules: availability never imports it, and the call runs on it
            import aiter
        except ImportError:
            aiter = None
        fn = getattr(aiter, entry, None)
        if fn is None or unaccepted_keywords(fn, ("sink_ptr",)):
            return f"this aiter's {entry} takes no sink_ptr (aiter >= the gptoss_sink change, #1753): the epilogue"
        return None

    # Of a dense call without a KV cache, selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        # Class features, and for a dense KV cache whether its length makes whole pages.
        return (call.kv_cache and call.seqlen_k % _AITER_PAGE == 0,)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = [r for r in (alibi_alignment_reason(call),) if r]
        if call.fp8:
            return reasons + _aiter_fp8_reasons(call, device)
        if call.kv_cache:
            reasons += kv_cache_reasons(call, "aiter") + _aiter_kv_cache_reasons(call)
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        try:
            import aiter
        except Exception as exc:
            return f"importing aiter failed: {type(exc).__name__}: {exc}"
        if not all(hasattr(aiter, f) for f in ("flash_attn_func", "flash_attn_varlen_func")):
            return "this aiter build has no flash_attn_func/flash_attn_varlen_func"
        return None

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        import aiter

        if call.fp8:
            return _aiter_fp8(aiter, call)
        if call.kv_cache:
            return _aiter_kv_cache(aiter, call)
        opts = self.options
        deterministic = opts.deterministic_backward if opts.deterministic_backward is not None else call.deterministic
        # aiter's autograd functions assert return_lse whenever a backward will run (v0.1.7 and later).
        want_lse = call.return_lse or call.requires_grad
        kwargs: dict[str, Any] = dict(
            dropout_p=call.dropout_p, softmax_scale=call.scale, causal=call.causal, window_size=kernel_window(call),
            alibi_slopes=call.alibi_slopes, deterministic=deterministic, return_lse=want_lse,
            return_attn_probs=False)
        if opts.how_v3_bf16_cvt is not None:
            kwargs["how_v3_bf16_cvt"] = opts.how_v3_bf16_cvt
        if call.sinks is not None:  # only calls takes_sinks_natively sends here (native_sinks_limit)
            kwargs["sink_ptr"] = call.sinks
        packed = not call.varlen and call.softcap > 0
        if call.varlen or packed:
            if packed:
                q, k, v, cu_q, cu_k, _, _ = pack_dense(call)
            else:
                q, k, v, cu_q, cu_k = call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k
            if call.softcap > 0:
                kwargs["logits_soft_cap"] = call.softcap
            # Keywords after max_seqlen_k: aiter inserts min_seqlen_q and logits_soft_cap where flash-attn has
            # dropout_p and causal, so positional calls would silently shift.
            result = aiter.flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, call.seqlen_q, call.seqlen_k, **kwargs)
            out, lse = _split(result, want_lse)
            if packed:
                out = unpack_out(call, out)
                lse = unpack_lse(call, lse) if lse is not None else None
        else:
            q, k, v = (call.bshd(t) for t in (call.q, call.k, call.v))
            result = aiter.flash_attn_func(q, k, v, **kwargs)
            out, lse = _split(result, want_lse)
            out = call.from_bshd(out)
        if not call.return_lse:
            return out
        assert lse is not None
        return out, empty_rows_to_neg_inf(lse)


def _aiter_fp8_reasons(call: AttentionCall, device: DeviceInfo) -> list[str]:
    """What aiter's FP8 entry cannot take of an FP8 call beyond caps (dtype, bf16 out, per-tensor descales)."""
    reasons = []
    if device.arch == "gfx942":
        reasons.append("aiter's FP8 attention on gfx942 reads float8_e4m3fnuz (aiter.dtypes.fp8), not these "
                       "float8_e4m3fn inputs, and opdispatch takes no fnuz; on MI300X/MI325X use bf16/fp16 q/k/v")
    aiter = sys.modules.get("aiter")  # availability imported it, if here
    if aiter is not None and not hasattr(aiter, "flash_attn_fp8_pertensor_func"):
        reasons.append("this aiter has no flash_attn_fp8_pertensor_func (FP8 attention needs a newer aiter)")
    unsupported = {
        "layout 'thd'": call.varlen, "a KV cache": call.kv_cache, "return_lse": call.return_lse,
        "alibi_slopes": call.alibi_slopes is not None, f"dropout_p={call.dropout_p:g}": call.dropout_p > 0,
        f"softcap={call.softcap:g}": call.softcap > 0,  # sinks: the op refuses them on FP8 calls
        f"head_dim_v {call.head_dim_v} != head_dim {call.head_dim}": call.head_dim_v != call.head_dim}
    for what, present in unsupported.items():
        if present:
            reasons.append(f"FP8 with {what} not supported: aiter's flash_attn_fp8_pertensor_func is dense bshd "
                           "with equal head dims, causal/window only, and returns no LSE; use bf16/fp16 inputs")
    return reasons


def _aiter_fp8(aiter: Any, call: AttentionCall) -> torch.Tensor:
    """An FP8 call on flash_attn_fp8_pertensor_func: bshd, the per-tensor descales as the (1,) the C++ reads."""
    q, k, v = (call.bshd(t) for t in (call.q, call.k, call.v))
    descales = (t.reshape(1) for t in (call.q_descale, call.k_descale, call.v_descale) if t is not None)
    out = aiter.flash_attn_fp8_pertensor_func(q, k, v, *descales, causal=call.causal,
                                              window_size=kernel_window(call), softmax_scale=call.scale)
    return call.from_bshd(out)


def _aiter_kv_cache_reasons(call: AttentionCall) -> list[str]:
    """What aiter's paged entry cannot take of a KV-cache call (the rest: kv_cache_reasons)."""
    reasons = []
    entry = getattr(sys.modules.get("aiter"), "flash_attn_varlen_func", None)  # availability imported it, if here
    if entry is not None and unaccepted_keywords(entry, ("block_table",)):
        reasons.append("this aiter's flash_attn_varlen_func takes no block_table (KV caches need a newer aiter)")
    if call.paged:
        return reasons
    if call.varlen:
        reasons.append("packed queries over an unpaged cache (thd with seqused_k) are not supported: aiter's "
                       "flash_attn_varlen_func takes block_table, not seqused_k (page it with block_table)")
        return reasons
    pages = cache_as_pages_reason(call, "aiter")
    if pages:
        reasons.append(pages)
    if call.seqlen_k % _AITER_PAGE:
        reasons.append(f"a dense KV cache of {call.seqlen_k} positions: aiter reads it as one page per sequence, "
                       f"and pages must hold a multiple of {_AITER_PAGE} keys (page it, or size the cache so)")
    return reasons


def _aiter_kv_cache(aiter: Any, call: AttentionCall) -> Any:
    """A KV-cache call through aiter.flash_attn_varlen_func(block_table=): queries packed, the cache's pages (a
    dense cache one page per sequence), cu_seqlens_k from seqused_k."""
    if call.sinks is not None:  # native_sinks_limit routes KV-cache calls with sinks to the epilogue
        raise RuntimeError("rocm.aiter: a KV-cache call with sinks reached the kernel; report it")
    queries = packed_queries(call)
    k, v, table = cache_as_pages(call)
    kwargs: dict[str, Any] = dict(softmax_scale=call.scale, causal=call.causal, window_size=kernel_window(call),
                                  return_lse=call.return_lse, return_attn_probs=False, block_table=table)
    if call.softcap > 0:
        kwargs["logits_soft_cap"] = call.softcap
    result = aiter.flash_attn_varlen_func(queries.q, k, v, queries.cu_seqlens_q, cumulative_lengths(call.seqused_k),
                                          queries.max_seqlen_q, call.seqlen_k, **kwargs)
    out, lse = _split(result, call.return_lse)
    out = unpack_kv_out(call, out)
    if not call.return_lse:
        return out
    assert lse is not None
    return out, kv_lse_fix(lse if call.varlen else unpack_lse(call, lse), call)


# -- rocm.aotriton: torch's ROCm flash attention (AOTriton, or torch's own CK when preferred) -----------------

# ROCm/aotriton v3src/util.cc (HEAD): archs AOTriton has kernels for, matched on gcnArchName before the first ':'.
AOTRITON_ARCHS = frozenset({"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150",
                            "gfx1151", "gfx1152", "gfx1153", "gfx1200", "gfx1201", "gfx1250"})
# isArchExperimentallySupported: torch's sdp_utils.cpp refuses them unless TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1.
AOTRITON_EXPERIMENTAL_ARCHS = frozenset({"gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1152", "gfx1153",
                                         "gfx1200"})
ENV_AOTRITON_EXPERIMENTAL = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"


class AOTritonOptions(BaseModel):
    """Policy knobs of `rocm.aotriton`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fa_library: Literal["aotriton", "ck", "default"] = Field(
        default="aotriton",
        description=("torch.backends.cuda.preferred_rocm_fa_library(): which library torch's ROCm flash attention "
                     "uses, forward and backward. 'ck' needs a torch built with USE_ROCM_CK_SDPA (torch falls back "
                     "otherwise); 'default' leaves the process-wide setting alone. The setting is process-wide: "
                     "it stays set after the call so that the backward uses the same library."))


@pads_v_head_dim
class RocmAOTriton(AttentionImpl):
    vendor: ClassVar[str] = "rocm"
    name: ClassVar[str] = "aotriton"
    priority: ClassVar[int] = 70
    description: ClassVar[str] = ("torch's ROCm flash attention (aten._flash_attention_forward), AOTriton kernels "
                                  "selected by preferred_rocm_fa_library")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"amd"})
    archs: ClassVar[frozenset[str]] = AOTRITON_ARCHS
    # preferred_rocm_fa_library arrived with pytorch/pytorch PR #143695 (torch 2.7; not checked against the tag).
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="torch", distribution="torch", min_version="2.7",
        install_hint="pip install torch --index-url https://download.pytorch.org/whl/rocm6.3 (a ROCm build of torch)"),)
    # sdp_utils.cpp (flash): fp16/bf16, q/k/v with one head dim <= 256 (512 only with AOTriton >= 0.9, whose
    # version torch does not expose), GQA, dropout, no mask. The kernels' causal alignment for seqlen_q !=
    # seqlen_k is not one torch relies on (check_flash_causal_non_square_seqlens refuses it), so no
    # alignment-dependent call is claimed; the ROCm kernels take window sizes but AOTriton's support for them is
    # not established, so windows are not claimed.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=_HALF, head_dim_max=256, layouts=_ALL_LAYOUTS, causal_alignments=frozenset(), gqa=True,
        window=False, softcap=False, alibi=False, dropout=True, lse=True, backward=True,
        deterministic_backward=False,
        causal=True, deterministic_forward=True,
    )
    options_model: ClassVar[type[BaseModel]] = AOTritonOptions

    # selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads only class features (flags, alignment, same_lengths, head_dim, options)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        if call.varlen and call.return_lse:
            reasons.append("return_lse with layout 'thd' not supported: torch's ROCm varlen flash returns the lse "
                           "padded per sequence (AOTriton) rather than as (heads, total_q)")
        if (self.options.fa_library != "ck" and device.arch in AOTRITON_EXPERIMENTAL_ARCHS
                and os.environ.get(ENV_AOTRITON_EXPERIMENTAL) != "1"):
            reasons.append(f"AOTriton support for {device.arch} is experimental: torch refuses it unless "
                           f"{ENV_AOTRITON_EXPERIMENTAL}=1")
        return reasons

    def extra_availability(self, device: DeviceInfo) -> str | None:
        if not getattr(torch.version, "hip", None):
            return f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this ROCm torch was built without flash attention (USE_FLASH_ATTENTION=0)"
        if self.options.fa_library != "default" and not hasattr(torch.backends.cuda, "preferred_rocm_fa_library"):
            return (f"torch {torch.__version__} has no torch.backends.cuda.preferred_rocm_fa_library; set "
                    f"fa_library: default for rocm.aotriton or upgrade torch")
        return None

    def _prefer_library(self) -> None:
        wanted = self.options.fa_library
        if wanted == "default":
            return
        select = torch.backends.cuda.preferred_rocm_fa_library
        current = select()
        if str(getattr(current, "name", current)).lower() != wanted:
            select(wanted)

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._prefer_library()
        if call.varlen:
            q, k, v = call.q, call.k, call.v
            cum_q, cum_k = call.cu_seqlens_q, call.cu_seqlens_k
        else:
            q, k, v = (call.bshd(t) for t in (call.q, call.k, call.v))
            cum_q = cum_k = None
        # aten::_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        #   is_causal, return_debug_mask, *, scale, window_size_left, window_size_right, ...)
        #   -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask); autograd via derivatives.yaml.
        out, lse, _rng, _unused, _debug = torch.ops.aten._flash_attention_forward(
            q, k, v, cum_q, cum_k, call.seqlen_q, call.seqlen_k, call.dropout_p, call.causal, False,
            scale=call.scale)
        if not call.varlen:
            out = call.from_bshd(out)
        if call.return_lse:
            return out, lse
        return out
