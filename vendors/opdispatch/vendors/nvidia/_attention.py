"""NVIDIA attention implementations: torch's own CUDA kernels (cuDNN, FlashAttention-2, memory-efficient) and the
flash-attn package (FA2, and FA3 on Hopper).

Every torch kernel is called through its aten op directly — never through `sdpa_kernel` or
`scaled_dot_product_attention` — so no backend-selection work and no context manager runs per call; autograd
knows each op's backward (derivatives.yaml). Capabilities are those the libraries check:
- torch: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (can_use_{flash,mem_efficient,cudnn}_attention);
- flash-attn: csrc/flash_attn/flash_api.cpp (FA2), hopper/flash_api.cpp (FA3).
What the checks leave open (causal alignment for seqlen_q != seqlen_k, LSE layout, masked-row conventions) was
measured on an H100/H200; see tests/gpu/ and benchmarks/results/.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import (additive_bias, alibi_alignment_reason, aten_sdpa_call, at_least, bind_dense,
                                        causal_alibi_lse_reason, cumulative_lengths, dense_lse_fix,
                                        empty_rows_to_neg_inf, flash_attn_kv_cache, gathered_pages, kernel_window,
                                        kv_cache_allowed, kv_cache_as_mask, kv_cache_reasons, kv_lse_fix,
                                        layout_views, mask_bias_values, pack_padded_lse, packed_queries,
                                        paged_as_dense, paged_gather_reason,
                                        shift_rows, size_generic, uniform_cu_seqlens, unpack_kv_out, unpack_lse,
                                        varlen_lse_fix, version_tuple)

_LOW = frozenset({torch.float16, torch.bfloat16})
_FA3_FP8 = torch.float8_e4m3fn  # FA3's one FP8 kind (hopper/flash_api.cpp)
_ALL_LAYOUTS = frozenset({"bshd", "bhsd", "sbhd", "thd"})
_DENSE = frozenset({"bshd", "bhsd", "sbhd"})

# The cheapest entries into C++: the generated Python bindings of the aten ops (no Python wrapper in between).
_cudnn_sdpa = torch._scaled_dot_product_cudnn_attention
_flash_sdpa = torch._scaled_dot_product_flash_attention
_efficient_sdpa = torch._scaled_dot_product_efficient_attention
# _flash_attention_forward has no torch.* binding; its OpOverload is the direct entry (window, ALiBi, varlen).
_flash_forward = torch.ops.aten._flash_attention_forward.default
_FLASH_FORWARD_ARGS = frozenset(a.name for a in _flash_forward._schema.arguments)
# Paged KV in torch's vendored FlashAttention-2: its flash_api.cpp keeps FA2's "Paged KV cache block size must be
# divisible by 256" (torch 2.11, the GPU machine's, has no block_table argument to measure it with).
_TORCH_PAGE = 256
# _cudnn_attention_forward: the cuDNN entry that takes packed (total, heads, dim) tensors with cumulative offsets
# (torch.nn.attention.varlen's cuDNN path). Absent from older torch builds.
_cudnn_forward = getattr(getattr(torch.ops.aten, "_cudnn_attention_forward", None), "default", None)
# The backward ops (no torch.* bindings), for `backward()` from a compiled forward's saved out and LSE: the ones
# autograd calls for the forwards above (derivatives.yaml). Philox seed/offset are unread without dropout.
_cudnn_sdpa_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
_flash_sdpa_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
_flash_backward = torch.ops.aten._flash_attention_backward.default


FLASH_ATTN = Requirement(module="flash_attn", distribution="flash-attn", min_version="2.6.0", key="flash_attn",
                         verify_distribution=True,
                         install_hint="pip install 'flash-attn>=2.6' --no-build-isolation")

class _TorchBuildRequirement(Requirement):
    """A capability of the torch build (cuDNN), read from the probe's `libraries` instead of pip metadata."""

    def describe(self) -> str:
        bound = f">={self.min_version}" if self.min_version else ""
        return f"{self.library_key}{bound} (in the {self.distribution} build)"

    def unmet_reason(self, device: DeviceInfo) -> str | None:
        version = device.libraries.get(self.library_key)
        if version is None:
            where = (f"the device descriptor {device.source} declares no `{self.library_key}:` under libraries"
                     if device.simulated else f"this torch build has no {self.library_key}")
            return f"{where}; {self.hint()}"
        if self.min_version and not at_least(version, self.min_version):
            return f"{self.library_key} {version} is older than the required {self.min_version}; {self.hint()}"
        return None


def _sm86_89_or_120_training_head_dim(call: AttentionCall, device: DeviceInfo) -> str | None:
    """sdp_utils check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120 (FA2's backward limits)."""
    cap = device.capability
    if not call.requires_grad or cap is None:
        return None
    if not ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)):
        return None
    d = call.head_dim
    if 192 < d <= 224:
        return (f"FlashAttention backward does not support head_dim {d} in (192, 224] on sm{cap[0]}{cap[1]} "
                "(needs sm80 or sm90)")
    if d > 224 and call.dropout_p > 0:
        return f"FlashAttention backward with dropout does not support head_dim {d} > 224 on sm{cap[0]}{cap[1]}"
    return None


def _aligned(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """torch's preprocess_mask: strides a multiple of `alignment` elements (padding the last dim if not)."""
    if t.stride(-1) == 1 and all(s % alignment == 0 for s in t.stride()[:-1]):
        return t
    sk = t.shape[-1]
    pad = (alignment - sk % alignment) % alignment
    padded = torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()
    return padded[..., :sk]


# -- torch: cuDNN --------------------------------------------------------------------------------------------

class CudnnOptions(BaseModel):
    """Policy knobs of `nvidia.cudnn` (`ops.attention.options."nvidia.cudnn"` in the policy YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    varlen: bool = Field(
        default=False, description="take packed varlen (thd) calls through aten _cudnn_attention_forward. Off by "
                                   "default: torch 2.11 rebuilds that cuDNN graph on every call (see _VARLEN_SLOW)")


class CudnnAttention(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "cudnn"
    priority: ClassVar[int] = 40
    description: ClassVar[str] = "cuDNN fused attention through aten _scaled_dot_product_cudnn_attention"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (8, 0)   # "cuDNN MHA only supports ... [sm80, sm121]"
    max_capability: ClassVar[tuple[int, int] | None] = (12, 1)
    options_model: ClassVar[type[BaseModel]] = CudnnOptions
    requires = (_TorchBuildRequirement(
        module="torch", distribution="torch", key="cudnn", min_version="9.0.0",
        install_hint="install a CUDA build of torch with cuDNN >= 9 (the pytorch.org CUDA wheels bundle it)"),)
    # sdp_utils can_use_cudnn_attention: fp16/bf16; d_qk and d_v multiples of 8 (d_v may differ); GQA with
    # hk == hv not required; attn_mask as an additive bias (no gradient for it: derivatives.yaml); dropout;
    # not deterministic. is_causal is the top-left mask (measured with seqlen_q != seqlen_k).
    # Varlen (thd) goes through aten _cudnn_attention_forward with cumulative offsets; what it takes is narrower
    # than the dense path and is declared in extra_reasons (see _VARLEN_* below).
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        # head dims: the kernel needs multiples of 8 up to 256; others are zero-padded up to one (_run_padded).
        dtypes=_LOW, head_dim_max=256, head_dim_v_differs=True,
        layouts=_ALL_LAYOUTS, causal_alignments=frozenset({"top_left"}), gqa=True, dropout=True, attn_mask=True,
        # ALiBi: dense only, as the prepared additive bias mem_efficient uses (rows shifted in fp32, _PreparedAlibi)
        attn_bias=True, bias_grad=False, alibi=True, lse=True, backward=True, deterministic_backward=False,
        # Measured on an H200: fp16 decode-like calls (sq 1, sk 239, d 160, batch 60) gave a different output in
        # 73 of 100 repeats — cuDNN picks split-KV plans per shape and reduces their partial results unordered.
        deterministic_forward=False,
        # A dense KV cache: the fill of each sequence folded into a boolean mask over the whole cache
        # (kv_cache_as_mask) — the cache keeps one shape, so cuDNN builds its graph once.
        causal=True, kv_cache=True,
    )

    binds_attn_mask: ClassVar[bool] = True  # a padded batch's decode: `_bind_cudnn_masked`

    def __init__(self) -> None:
        self._alibi = _PreparedAlibi()

    # Of a dense call, selection_key reads whether each length is 1 (sizes: opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {"seqlen_q": (2,), "seqlen_k": (2,)}

    def selection_key(self, call: AttentionCall) -> Any:
        return (call.seqlen_k == 1, call.seqlen_q == 1)  # the sizes extra_reasons reads

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        cudnn = version_tuple(device.libraries.get("cudnn"))
        d = max(call.head_dim, call.head_dim_v)
        if d > 128 and not (device.capability == (9, 0) and cudnn >= (9, 10)):
            reasons.append(f"head_dim {d} > 128 needs sm90 with cuDNN >= 9.10 (device: {device.arch}, cuDNN "
                           f"{device.libraries.get('cudnn')})")
        if call.varlen:
            reasons.extend(_cudnn_varlen_reasons(call, device, self.options.varlen))
            if call.alibi_slopes is not None:
                reasons.append("ALiBi with packed varlen (thd) is not supported (cuDNN's varlen op takes no bias)")
        if call.seqlen_k == 1:
            reasons.append("seqlen_k == 1 is rejected by cuDNN SDPA (check_cudnn_tensor_shapes)")
        if call.kv_cache and call.varlen:
            reasons.append("a KV cache under packed queries (thd) is not supported: cuDNN takes a dense cache, "
                           "its fill as a mask")
        if call.dropout_p > 0:
            if call.seqlen_q == 1:
                reasons.append("dropout with seqlen_q == 1 is rejected by cuDNN SDPA")
            if (9, 11) <= cudnn < (9, 14):
                reasons.append(f"cuDNN {device.libraries.get('cudnn')} has no dropout in SDPA (9.11 - 9.13)")
        return reasons

    def bind(self, call: AttentionCall) -> Any:
        if _binds_mask(call):
            return _bind_cudnn_masked(call)
        if (call.varlen or call.kv_cache or call.return_lse or call.dropout_p > 0 or call.attn_mask is not None
                or call.attn_bias is not None or call.positional_mask or call.alibi_slopes is not None
                or _needs_padding(call)):
            return super().bind(call)
        # Plain dense calls bind the aten op itself: no call object per call (the per-call fast path and plan()).
        # Sizes come from the tensors; what it keeps (flags, scale, layout) the decision class holds.
        kernel, need_lse, causal, scale = _cudnn_sdpa, call.requires_grad, call.causal, call.scale
        return size_generic(bind_dense(call, aten_sdpa_call(kernel, None, need_lse, 0.0, causal, False,
                                                            defaults=(0.0, False, False), scale=scale,
                                                            head_dim=call.head_dim)))

    def run(self, call: AttentionCall) -> Any:
        if call.kv_cache:
            call = kv_cache_as_mask(call)
        if _needs_padding(call):
            return _run_padded(self._run, call, same_v=False)
        return self._run(call)

    def backward(self, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        # Plain dense calls (causal or not, GQA, padded head dims); masks, biases, windows and caches recompute.
        if (call.varlen or call.kv_cache or call.dropout_p > 0 or call.attn_mask is not None
                or call.attn_bias is not None or call.positional_mask or call.alibi_slopes is not None):
            return None
        return _padded_backward(_cudnn_dense_backward, call, out, lse, grad_out, same_v=False)

    def _run(self, call: AttentionCall) -> Any:
        if call.varlen:
            return _cudnn_varlen(call)
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        bias, is_causal, shift = self._alibi.bias_for(call, q, k)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        need_lse = call.return_lse or call.requires_grad
        res = _cudnn_sdpa(q, k, v, bias, need_lse, call.dropout_p, is_causal, False, scale=call.scale)
        out = call.from_bhsd(res[0])
        if not call.return_lse:
            return out
        lse = res[1]
        if lse.dim() == 4:  # some versions report (b, h, s, 1)
            lse = lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])
        if shift is not None:
            lse = lse + shift[..., 0]
            blind = (bias == -math.inf).all(dim=-1)  # a query that sees no key: LSE -inf by convention
            lse = lse.masked_fill(blind, -math.inf)
        return out, lse


def _binds_mask(call: AttentionCall) -> bool:
    """Whether a boolean-masked call binds its kernel directly (`_bind_cudnn_masked`, `_bind_efficient_masked`):
    a dense call whose mask is the only pattern to fold — no bias, ALiBi, window or bottom-right causal, KV cache,
    dropout, LSE or padded head dims (those run() per call). A padded batch's decode and prefill, as transformers
    sends them."""
    return call.attn_mask is not None and not (
        call.varlen or call.kv_cache or call.return_lse or call.dropout_p > 0 or call.attn_bias is not None
        or call.positional_mask or call.alibi_slopes is not None or _needs_padding(call))


def _mask_bias_4d(attn_mask: torch.Tensor, zero: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """A boolean mask as run()'s additive bias (0 where kept, `blocked` elsewhere: `mask_bias_values`), with leading
    dims of 1 up to (b, h, sq, sk) — what the masked binds broadcast."""
    bias = torch.where(attn_mask, zero, blocked)
    return bias if bias.dim() == 4 else bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _bind_cudnn_masked(call: AttentionCall) -> Any:
    """A boolean-masked call (`_binds_mask`) bound to cuDNN's aten op: the mask turned into run()'s additive bias
    in one kernel (`mask_bias_values`: 0 / -inf in q's dtype, the values additive_bias writes) and broadcast to
    (b, hq, sq, sk) as run() passes it, so the same bits. It keeps the layout, the causal flag (top-left: cuDNN's
    own), the scale and whether the LSE is needed (grad) — what the decision class holds — and reads every size
    from its tensors, so it serves every length and batch of its decision (`size_generic`)."""
    zero, blocked = mask_bias_values(call.dtype, call.device)
    need_lse, causal, scale = call.requires_grad, call.causal, call.scale
    if call.layout == "bhsd":  # transformers' layout: no views per call
        def masked_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any,
                        attn_mask: torch.Tensor, sinks: Any) -> torch.Tensor:
            bias = _mask_bias_4d(attn_mask, zero, blocked)
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return _cudnn_sdpa(q, k, v, bias, need_lse, 0.0, causal, False, scale=scale)[0]  # type: ignore[no-any-return]
        return size_generic(masked_bhsd)
    to_bhsd, from_bhsd = layout_views(call.layout)

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any,
               attn_mask: torch.Tensor, sinks: Any) -> torch.Tensor:
        q, k, v = to_bhsd(q), to_bhsd(k), to_bhsd(v)
        bias = _mask_bias_4d(attn_mask, zero, blocked)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return from_bhsd(_cudnn_sdpa(q, k, v, bias, need_lse, 0.0, causal, False, scale=scale)[0])

    return size_generic(masked)


# What the varlen path of cuDNN (aten _cudnn_attention_forward with cum_seq_q/cum_seq_k) was verified to do,
# on an H200 with torch 2.11+cu130 and cuDNN 9.19 (benchmarks/varlen_window.py, tests/gpu/;
# benchmarks/results/varlen-window-h200.md): forward exact to bf16 (rel. err. <= 2.1e-3) for MHA, GQA 4:1,
# MQA 16:1, d64..d256, d_v != d_qk, empty sequences and k length 1; the causal mask is top-left per sequence
# (bottom-right gives rel. err. ~1 when q and k lengths differ); LSE is float32 natural log, (total_q, heads, 1).
# Autograd through the op runs but is wrong for MQA (16 q heads over 1 kv head: dq rel. err. 2.4), so backward
# is not declared. Dropout was not checked.
_VARLEN_CAPABILITY = ((9, 0), (10, 3))  # torch only routes nested tensors to cuDNN on sm9x / sm10x
_VARLEN_GQA = True
_VARLEN_BACKWARD = False
_VARLEN_DROPOUT = False
_VARLEN_LSE = True
# Causal mask alignment per sequence when a sequence's q and k lengths differ ("top_left" / "bottom_right").
_VARLEN_ALIGNMENT = "top_left"
# Why it is off by default: torch 2.11's run_cudnn_SDP_fprop_nestedtensor (aten/src/ATen/native/cudnn/MHA.cpp)
# builds the cuDNN graph on a cache miss into a local and never inserts it into the graph cache, so every call
# pays a graph build: 39-64 ms per call on the H200 against 0.33-2.1 ms for torch's FA2 varlen on 16k tokens.
_VARLEN_SLOW = ("packed varlen (thd) through cuDNN is off (options nvidia.cudnn: {varlen: true} turns it on): "
                "torch 2.11 rebuilds the cuDNN varlen graph on every call, 40-64 ms vs 2.1 ms for nvidia.flash "
                "on 16k tokens (H200)")


def _cudnn_varlen_reasons(call: AttentionCall, device: DeviceInfo, enabled: bool) -> list[str]:
    reasons = []
    if _cudnn_forward is None:
        return ["this torch has no aten._cudnn_attention_forward (cuDNN varlen)"]
    if not enabled:
        reasons.append(_VARLEN_SLOW)
    cap = device.capability
    lo, hi = _VARLEN_CAPABILITY
    if cap is None or not lo <= cap <= hi:
        reasons.append(f"packed varlen (thd) through cuDNN needs sm90..sm103 (device: {device.arch})")
    if call.requires_grad and not _VARLEN_BACKWARD:
        reasons.append("packed varlen (thd) through cuDNN is forward only: backward not supported")
    if call.dropout_p > 0 and not _VARLEN_DROPOUT:
        reasons.append("packed varlen (thd) through cuDNN: dropout not supported")
    if call.heads_q != call.heads_kv and not _VARLEN_GQA:
        reasons.append("packed varlen (thd) through cuDNN: grouped-query attention not supported")
    if call.return_lse and not _VARLEN_LSE:
        reasons.append("packed varlen (thd) through cuDNN: return_lse not supported")
    if call.alignment_matters and call.causal_alignment != _VARLEN_ALIGNMENT:
        reasons.append(f"packed varlen (thd) through cuDNN aligns causal masks {_VARLEN_ALIGNMENT.replace('_', '-')} "
                       f"per sequence; causal_alignment={call.causal_alignment!r} with cu_seqlens_q != "
                       "cu_seqlens_k not supported")
    return reasons


def _cudnn_varlen(call: AttentionCall) -> Any:
    need_lse = call.return_lse or call.requires_grad
    res = _cudnn_forward(call.q, call.k, call.v, None, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                         call.max_seqlen_k, need_lse, call.dropout_p, call.causal, False, scale=call.scale)
    out = res[0]
    if not call.return_lse:
        return out
    return out, _packed_lse(res[1], call)


def _packed_lse(lse: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """A varlen LSE as opdispatch's (heads_q, total_q) float32, from (total_q, heads_q[, 1]), (heads_q, total_q)
    or a padded (batch, heads_q, max_seqlen_q) — without reading cu_seqlens on the host."""
    total_q, hq = call.q.shape[0], call.heads_q
    if lse.dim() == 3 and lse.shape[-1] == 1:
        lse = lse[..., 0]
    if lse.dim() == 2:
        if lse.shape == (total_q, hq):
            return lse.t().float()
        if lse.shape == (hq, total_q):
            return lse.float()
    if lse.dim() == 3 and lse.shape[1] == hq:
        assert call.cu_seqlens_q is not None
        return pack_padded_lse(lse, call.cu_seqlens_q, total_q).float()
    raise RuntimeError(f"unexpected cuDNN varlen LSE shape {tuple(lse.shape)} for total_q={total_q}, heads={hq}")


# torch's FA2 and memory-efficient backwards are deterministic only while torch's global flag is set (aten reads
# it when the backward runs); a call asking deterministic=True without it is refused with this reason.
_DETERMINISTIC_NEEDS_TORCHS_FLAG = ("deterministic=True training: its backward is deterministic only under "
                                    "torch.use_deterministic_algorithms(True) (read when the backward runs); set it")


# -- torch: FlashAttention-2 built into torch ----------------------------------------------------------------

class TorchFlashAttention(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "flash"
    priority: ClassVar[int] = 30
    description: ClassVar[str] = ("FlashAttention-2 built into torch (aten _scaled_dot_product_flash_attention, "
                                  "_flash_attention_forward for varlen, window and ALiBi)")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (8, 0)   # "[sm80, sm121]"
    max_capability: ClassVar[tuple[int, int] | None] = (12, 1)
    # sdp_utils can_use_flash_attention + flash_api.cpp: fp16/bf16; q, k, v share one head dim <= 256, a
    # multiple of 8 (SDPA pads; the op itself requires it); GQA; no attn_mask; dropout; causal is FA2's
    # bottom-right mask (SDPA refuses causal with seqlen_q != seqlen_k for that reason); window (bottom-right
    # aligned) through _flash_attention_forward, whose backward receives it. No ALiBi: the schema has
    # alibi_slopes but torch's build raises "This flash attention build does not support alibi." (measured on
    # torch 2.11+cu130, H200).
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        # head dims: multiples of 8 up to 256 in the kernel; others are zero-padded up to one (_run_padded).
        dtypes=_LOW, head_dim_max=256, layouts=_ALL_LAYOUTS,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, window=True, dropout=True,
        # Deterministic only under torch.use_deterministic_algorithms(True): aten's _flash_attention_backward
        # reads the flag when it runs and then accumulates dq in a fixed order (FA2's deterministic backward);
        # extra_reasons asks for that flag, as for nvidia.mem_efficient.
        lse=True, backward=True, deterministic_backward=True,
        # KV caches through _flash_attention_forward's seqused_k/block_table (torch.nn.attention.varlen's path;
        # forward only: "Inference-only (not supported in backward)"), queries packed.
        # Paged caches of any page size: natively where torch's op takes block_table and the pages hold a multiple
        # of 256 keys, else their pages gathered into rows first (`gathered_pages`, bounded by
        # PAGED_GATHER_MAX_BYTES).
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True,
    )

    # Of a dense call without a KV cache (not paged), selection_key and extra_reasons read no size (the determinism
    # flag is the compiled door's context): opdispatch.engine._classes, `DecisionClasses.size_box`.
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        # torch's global determinism flag, which extra_reasons reads for deterministic training; for a paged call
        # whether its gather would pass the bound (sizes: a call class may hold both).
        gather_too_big = call.paged and not _native_pages(call) and paged_gather_reason(call, "") is not None
        return (call.deterministic and call.requires_grad and torch.are_deterministic_algorithms_enabled(),
                gather_too_big)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        why = _sm86_89_or_120_training_head_dim(call, device)
        if why:
            reasons.append(why)
        if call.deterministic and call.requires_grad and not torch.are_deterministic_algorithms_enabled():
            reasons.append(_DETERMINISTIC_NEEDS_TORCHS_FLAG)
        if call.window is not None and "window_size_left" not in _FLASH_FORWARD_ARGS:
            reasons.append("this torch's _flash_attention_forward has no window_size_left argument")
        if call.kv_cache:
            reasons += kv_cache_reasons(call, "torch's FlashAttention")
            if "seqused_k" not in _FLASH_FORWARD_ARGS:
                reasons.append("this torch's _flash_attention_forward has no seqused_k argument (torch 2.11 and "
                               "2.13 have it)")
            if call.paged and not _native_pages(call):
                why = paged_gather_reason(call, f"torch's FlashAttention (no block_table argument in this torch, or "
                                                f"pages of other than a multiple of {_TORCH_PAGE} keys)")
                if why:
                    reasons.append(why)
        return reasons

    def bind(self, call: AttentionCall) -> Any:
        if call.kv_cache or call.varlen or call.return_lse or call.dropout_p > 0 or _needs_padding(call):
            return super().bind(call)
        # Sizes come from the tensors; what it keeps (flags, scale, layout, window) the decision class holds.
        kernel, causal, scale = _flash_sdpa, call.causal, call.scale
        if call.window is not None:
            return size_generic(bind_dense(call, _windowed_flash(causal, scale, *call.window)))
        return size_generic(bind_dense(call, aten_sdpa_call(kernel, 0.0, causal, False, defaults=(0.0, False, False),
                                                            scale=scale, head_dim=call.head_dim)))

    def run(self, call: AttentionCall) -> Any:
        if _needs_padding(call):
            return _run_padded(self._run, call, same_v=True)
        return self._run(call)

    def _run(self, call: AttentionCall) -> Any:
        if call.kv_cache:
            return _torch_flash_kv_cache(call)
        if not call.varlen and call.window is None:
            q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
            res = _flash_sdpa(q, k, v, call.dropout_p, call.causal, False, scale=call.scale)
            out = call.from_bhsd(res[0])
            return (out, empty_rows_to_neg_inf(res[1])) if call.return_lse else out
        kwargs: dict[str, Any] = {"scale": call.scale}
        if call.window is not None:
            kwargs["window_size_left"], kwargs["window_size_right"] = call.window
        if call.varlen:
            res = _flash_forward(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                                 call.max_seqlen_k, call.dropout_p, call.causal, False, **kwargs)
            out, lse = res[0], res[1]
            if call.return_lse:
                return out, empty_rows_to_neg_inf(_varlen_lse(lse, call))
            return out
        q, k, v = call.bshd(call.q), call.bshd(call.k), call.bshd(call.v)
        res = _flash_forward(q, k, v, None, None, q.shape[1], k.shape[1], call.dropout_p, call.causal, False,
                             **kwargs)
        out = call.from_bshd(res[0])
        return (out, empty_rows_to_neg_inf(res[1])) if call.return_lse else out


    def backward(self, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        # Every call run() takes without dropout: dense, window (bottom-right), varlen, padded head dims.
        if call.dropout_p > 0 or (call.varlen and not _PACKED_VARLEN_LSE):
            return None
        return _padded_backward(_flash_backward_from_saved, call, out, lse, grad_out, same_v=True)


def _windowed_flash(causal: bool, scale: float, left: int, right: int) -> Any:
    """A dense windowed call as run() makes it, over (b, h, s, d) views: _flash_attention_forward takes bshd and
    reads the lengths it is given (no call record, so it serves every size of the class; bind's windowed path)."""

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = _flash_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[2],
                             k.shape[2], 0.0, causal, False, scale=scale, window_size_left=left,
                             window_size_right=right)[0]
        return out.transpose(1, 2)

    return kernel


def _native_pages(call: AttentionCall) -> bool:
    """Whether torch's op reads this call's pages itself: it takes block_table and the pages are FA2's size. Else
    they are gathered into rows first (`gathered_pages`; measured on an H100: FA2 over gathered pages 0.46-0.59 ms
    against 0.64-0.73 for flagos.triton's paged kernel, benchmarks/results/kv_cache-h100.md, paged varlen)."""
    return "block_table" in _FLASH_FORWARD_ARGS and call.page_size % _TORCH_PAGE == 0


def _torch_flash_kv_cache(call: AttentionCall) -> Any:
    """A KV-cache call through _flash_attention_forward's packed path: queries packed, the cache paged (the call's
    pages) or packed per sequence (a dense cache as (batch * capacity) rows: a view of a bshd cache)."""
    queries = packed_queries(call)
    kwargs: dict[str, Any] = {"scale": call.scale, "seqused_k": call.seqused_k}
    if call.window is not None:
        kwargs["window_size_left"], kwargs["window_size_right"] = call.window
    if call.paged and _native_pages(call):
        k, v, cu_k = call.k, call.v, cumulative_lengths(call.seqused_k)
        kwargs["block_table"] = call.block_table
    elif call.paged:
        k, v = (t.flatten(0, 1) for t in gathered_pages(call))
        cu_k = uniform_cu_seqlens(call.batch, call.block_table.shape[1] * call.page_size, k.device)
    elif call.varlen:
        k, v, cu_k = call.k, call.v, call.cu_seqlens_k
    else:
        k, v = (call.bshd(t) for t in (call.k, call.v))
        k = k.reshape(-1, k.shape[2], k.shape[3])
        v = v.reshape(-1, v.shape[2], v.shape[3])
        cu_k = uniform_cu_seqlens(call.batch, call.seqlen_k, k.device)
    res = _flash_forward(queries.q, k, v, queries.cu_seqlens_q, cu_k, queries.max_seqlen_q, call.seqlen_k, 0.0,
                         call.causal, False, **kwargs)
    out = unpack_kv_out(call, res[0])
    if not call.return_lse:
        return out
    lse = res[1]
    if call.varlen:
        lse = _varlen_lse(lse, call)
    elif lse.dim() == 3:  # older builds: padded per sequence, (batch, heads, max_seqlen_q), already dense
        lse = lse[:, :, :call.seqlen_q]
    else:
        lse = unpack_lse(call, lse)
    return out, kv_lse_fix(lse, call)


def _cudnn_dense_backward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                          grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    # cuDNN wants dO with O's strides: both contiguous in the call's layout, seen as bhsd.
    # cuDNN's Stats tensor is (b, h, s, 1) (its forward writes that; run() reports (b, h, s)).
    grads = _cudnn_sdpa_backward(call.bhsd(grad_out.contiguous()), q, k, v, call.bhsd(out.contiguous()),
                                 lse.contiguous().unsqueeze(-1),
                                 unused, unused, None, None, None, q.shape[2], k.shape[2], 0.0, call.causal,
                                 scale=call.scale)
    return call.from_bhsd(grads[0]), call.from_bhsd(grads[1]), call.from_bhsd(grads[2])


def _flash_backward_from_saved(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                          grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # run() reported a query that sees no key with LSE -inf; the kernel wrote (and its backward reads) +inf.
    lse = lse.masked_fill(lse == -math.inf, math.inf)
    grad_out, out = grad_out.contiguous(), out.contiguous()
    if not call.varlen and call.window is None:
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        unused = torch.zeros((), dtype=torch.int64, device=q.device)
        grads = _flash_sdpa_backward(call.bhsd(grad_out), q, k, v, call.bhsd(out), lse, None, None, q.shape[2],
                                     k.shape[2], 0.0, call.causal, unused, unused, scale=call.scale)
        return call.from_bhsd(grads[0]), call.from_bhsd(grads[1]), call.from_bhsd(grads[2])
    kwargs: dict[str, Any] = {"scale": call.scale}
    if call.window is not None:
        kwargs["window_size_left"], kwargs["window_size_right"] = call.window
    rng_state = torch.zeros(2, dtype=torch.int64, device=call.q.device)
    if call.varlen:
        return tuple(_flash_backward(grad_out, call.q, call.k, call.v, out, lse, call.cu_seqlens_q,  # type: ignore[return-value]
                                     call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k, 0.0, call.causal,
                                     rng_state, rng_state, **kwargs))
    q, k, v = call.bshd(call.q), call.bshd(call.k), call.bshd(call.v)
    grads = _flash_backward(call.bshd(grad_out), q, k, v, call.bshd(out), lse, None, None, q.shape[1], k.shape[1],
                            0.0, call.causal, rng_state, rng_state, **kwargs)
    return call.from_bshd(grads[0]), call.from_bshd(grads[1]), call.from_bshd(grads[2])


def _padded_backward(backward: Any, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                     grad_out: torch.Tensor, *, same_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`backward` on the zero-padded tensors `_run_padded` ran the forward on, gradients sliced back (exact: the
    padded columns of out and grad_out are zero and contribute nothing)."""
    if not _needs_padding(call):
        return backward(call, out, lse, grad_out)
    padded = _padded_call(call, same_v)
    dq, dk, dv_ = backward(padded, _pad_last(out, padded.head_dim_v), lse, _pad_last(grad_out, padded.head_dim_v))
    return dq[..., : call.head_dim], dk[..., : call.head_dim], dv_[..., : call.head_dim_v]


# Whether this torch's varlen FlashAttention reports the LSE packed, (heads_q, total_q), as its backward then
# reads it: `backward` hands it back only then (older builds pad it per sequence; their calls recompute).
_PACKED_VARLEN_LSE = False


def _varlen_lse(lse: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """Varlen LSE as (heads_q, total_q); older FlashAttention builds pad it to (batch, heads, max_seqlen_q)."""
    global _PACKED_VARLEN_LSE
    total_q = call.q.shape[0]
    if lse.dim() == 2 and lse.shape[1] == total_q:
        _PACKED_VARLEN_LSE = True
        return lse
    assert call.cu_seqlens_q is not None
    return pack_padded_lse(lse, call.cu_seqlens_q, total_q)  # on the device: no host sync


# -- torch: memory-efficient (CUTLASS) ------------------------------------------------------------------------

class MemEfficientAttention(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "mem_efficient"
    priority: ClassVar[int] = 20
    description: ClassVar[str] = ("torch's memory-efficient CUTLASS kernel (aten "
                                  "_scaled_dot_product_efficient_attention): masks and bias with gradient")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (5, 0)   # "[sm50, sm121]"
    max_capability: ClassVar[tuple[int, int] | None] = (12, 1)
    # sdp_utils can_use_mem_efficient_attention: fp16/fp32 (bf16 from sm80); d_qk and d_v aligned (checked in
    # extra_reasons, the alignment depends on arch and dtype), d_v may differ; no GQA; dropout; an additive bias
    # with gradient. Causal is top-left natively; windows, bottom-right causal, bool masks and ALiBi are folded
    # into the additive bias (materialised, batch x heads x seqlen_q x seqlen_k at most).
    # GQA (the kernel has none): where nothing depends on a query's position (no causal, window, ALiBi, mask, bias,
    # dropout) the query heads of a group are stacked as extra queries of their kv head — exact, and each kv head
    # is read once: decode (sq 1) and MLA absorbed decode (576/512, one kv head). Otherwise k/v heads are copied
    # per query head.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), head_dim_v_differs=True,
        layouts=_DENSE, causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True,
        alibi=True, dropout=True, attn_mask=True, attn_bias=True, bias_grad=True, lse=True, backward=True,
        # Deterministic only under torch.use_deterministic_algorithms(True), which the aten backward reads when it
        # runs (it then reduces dK/dV without atomics): extra_reasons asks for that flag.
        deterministic_backward=True,
        # A dense KV cache: the fill as an additive bias shared by every head, GQA folded (_run_kv_cache). The
        # kernel splits the key axis when the grid is small, which decode needs. A paged cache is read after
        # gathering its pages into a dense one (paged_as_dense): MLA's absorbed decode over 16-key pages (576/512,
        # one kv head), which no other kernel here takes.
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True,
    )

    # Of a dense call without a KV cache (not paged), selection_key and extra_reasons read no size (dtype, head
    # dims, the determinism flag: the compiled door's context): opdispatch.engine._classes.
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        # torch's global determinism flag, which extra_reasons reads for deterministic training; for a paged call
        # whether its gather passes the bound (sizes).
        return (call.deterministic and call.requires_grad and torch.are_deterministic_algorithms_enabled(),
                call.paged and paged_gather_reason(call, "") is not None)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = []
        cap = device.capability or (0, 0)
        if call.dtype == torch.bfloat16 and cap < (8, 0):
            reasons.append("bf16 needs sm80 or newer")
        # minimum_gemm_alignment: sm80+: 16 bytes / element size (8 for fp16/bf16, 4 for fp32); sm7x: 8 for
        # fp16, 1 for fp32; older: 1.
        if cap >= (8, 0):
            align = 4 if call.dtype == torch.float32 else 8
        elif cap >= (7, 0):
            align = 1 if call.dtype == torch.float32 else 8
        else:
            align = 1
        for what, d in (("head_dim", call.head_dim), ("v head_dim", call.head_dim_v)):
            if d % align:
                reasons.append(f"{what} {d} is not a multiple of {align} ({call.dtype} on {device.arch})")
        if call.deterministic and call.requires_grad and not torch.are_deterministic_algorithms_enabled():
            reasons.append(_DETERMINISTIC_NEEDS_TORCHS_FLAG)
        why = paged_gather_reason(call, "nvidia.mem_efficient") if call.paged else None
        if why:
            reasons.append(why)
        return reasons

    binds_attn_mask: ClassVar[bool] = True  # a padded batch's decode: `_bind_efficient_masked`

    def __init__(self) -> None:
        self._alibi = _PreparedAlibi()

    def bind(self, call: AttentionCall) -> Any:
        if _binds_mask(call):
            return _bind_efficient_masked(call)
        return super().bind(call)

    def run(self, call: AttentionCall) -> Any:
        if call.paged:
            call = paged_as_dense(call)
        if call.kv_cache:
            return _run_kv_cache(call)
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        if call.heads_q != call.heads_kv:
            if _gqa_folds(call):
                return _run_gqa_folded(call, q, k, v)
            if _mask_folds(call):  # a padding mask: the group's query heads stacked, the mask shared by them
                bias, _, _ = additive_bias(call, q, k, fold_causal=False, fold_alibi=False)
                folded, padded_lse = _efficient_folded(q, k, v, bias, call.return_lse or call.requires_grad,
                                                       call.scale)
                if not call.return_lse:
                    return call.from_bhsd(folded)
                out = call.from_bhsd(folded)
                lse = _unstacked_lse(padded_lse, q.shape[0], q.shape[1], q.shape[2])
                return out, lse.masked_fill((bias == -math.inf).all(dim=-1).expand(lse.shape), -math.inf)
            # Positional scores: every query head needs its kv head as a head of its own (a copy; autograd sums
            # the copies' gradients back).
            group = call.heads_q // call.heads_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        bias, is_causal, shift = self._alibi.bias_for(call, q, k)
        if bias is not None:
            bias = _aligned(bias, 8).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        need_lse = call.return_lse or call.requires_grad
        res = _efficient_sdpa(q, k, v, bias, need_lse, call.dropout_p, is_causal, scale=call.scale)
        out = call.from_bhsd(res[0])
        if not call.return_lse:
            return out
        lse = res[1][:, :, : q.shape[2]]  # the kernel pads LSE to a multiple of 32 queries
        if shift is not None:
            lse = lse + shift[..., 0]
        if bias is not None:
            # A query whose keys are all masked: the kernel's LSE is not -inf there (measured); the convention is.
            blind = (bias == -math.inf).all(dim=-1)
            lse = lse.masked_fill(blind, -math.inf)
        return out, lse


class _PreparedAlibi:
    """The ALiBi bias of the last calls, prepared for a kernel that takes an additive bias (fp32, rows shifted,
    rounded to the input dtype): building it costs more than the kernel at 4k (measured 7.9 vs 3.5 ms fwd+bwd).

    Keyed on the slopes tensor's identity and version — the entry holds the tensor, so its id cannot be reused
    while cached — and on everything else the bias reads. Two entries: each is heads x seqlen_q x seqlen_k in the
    input dtype (512 MiB at 16 x 4k x 4k x bf16).
    """

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()

    def bias_for(self, call: AttentionCall, q: torch.Tensor, k: torch.Tensor) -> tuple[Any, bool, Any]:
        """The additive bias a bias-taking kernel gets for `call` (bhsd q, k): (bias or None, is_causal left to the
        kernel, per-row shift to add to the LSE or None). ALiBi alone comes from the cache; ALiBi with a mask or
        bias is built and shifted per call; without ALiBi, the folded mask/bias as it is."""
        slopes = call.alibi_slopes
        if slopes is None:
            bias, is_causal, _ = additive_bias(call, q, k, fold_causal=False, fold_alibi=False)
            return bias, is_causal, None
        if call.attn_mask is not None or call.attn_bias is not None:
            bias, is_causal, _ = additive_bias(call, q, k, fold_causal=False, fold_alibi=True, dtype=torch.float32)
            bias, shift = shift_rows(bias, q.dtype)
            return bias, is_causal, shift
        key = (id(slopes), slopes._version, q.shape[2], k.shape[2], call.causal, call.window,
               call.causal_alignment, q.dtype, q.device)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is slopes:
            self._cache.move_to_end(key)
            return hit[1], hit[2], hit[3]
        bias, is_causal, _ = additive_bias(call, q, k, fold_causal=False, fold_alibi=True, dtype=torch.float32)
        bias, shift = shift_rows(bias, q.dtype)
        bias = _aligned(bias, 8)
        self._cache[key] = (slopes, bias, is_causal, shift)
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return bias, is_causal, shift


def _needs_padding(call: AttentionCall) -> bool:
    return bool(call.head_dim % 8 or call.head_dim_v % 8)


def _run_padded(run: Any, call: AttentionCall, *, same_v: bool) -> Any:
    """Run a kernel that needs head dims in multiples of 8 on zero-padded q/k/v, then slice the output back.

    Exact: zero columns add nothing to q·k (the scale stays the call's, from the original head dim) and padded v
    columns only produce output columns that are sliced off; the LSE is unchanged. Autograd flows through the pad
    and the slice. `same_v`: the kernel needs v's head dim equal to q/k's (FA2).
    """
    result = run(_padded_call(call, same_v))
    if call.return_lse:
        out, lse = result
        return out[..., : call.head_dim_v], lse
    return result[..., : call.head_dim_v]


def _padded_call(call: AttentionCall, same_v: bool) -> AttentionCall:
    """`call` with q/k/v zero-padded to head dims in multiples of 8 (v's equal to q/k's with `same_v`)."""
    d, dv = -(-call.head_dim // 8) * 8, -(-call.head_dim_v // 8) * 8
    if same_v:
        d = dv = max(d, dv)
    padded = call.with_tensors(_pad_last(call.q, d), _pad_last(call.k, d), _pad_last(call.v, dv))
    padded.head_dim, padded.head_dim_v = d, dv
    return padded


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def _gqa_folds(call: AttentionCall) -> bool:
    """Whether a GQA call can run as MHA over kv heads with the group's query heads stacked as queries: exact when
    no score depends on the query's position or head beyond the shared k/v."""
    return not (call.causal or call.window is not None or call.alibi_slopes is not None
                or call.attn_mask is not None or call.attn_bias is not None or call.dropout_p > 0)


def _mask_folds(call: AttentionCall) -> bool:
    """Whether a masked GQA call folds as `_gqa_folds` does: its mask is the only term and is shared by every
    query and head of a sequence (4-D shape (b or 1, 1, 1, sk): a padded batch's decode or prefill), so the stacked
    query rows of a group read one bias row."""
    mask = call.attn_mask
    if mask is None or call.causal or call.positional_mask or call.alibi_slopes is not None \
            or call.attn_bias is not None or call.dropout_p > 0:
        return False
    return all(n == 1 for n in mask.shape[-3:-1]) if mask.dim() >= 3 else mask.shape[0] == 1


def _efficient_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, need_lse: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The efficient kernel on bhsd GQA q/k/v whose 4-D additive `bias` is (b or 1, 1, 1, sk) (`_mask_folds`):
    (b, hq, sq, d) queries as (b, hkv, group * sq, d) (`_run_gqa_folded`), the bias aligned and broadcast over
    the stacked rows — each kv head read once, no k/v copy per query head. Returns (out as (b, hq, sq, dv), the
    kernel's LSE: `_unstacked_lse` gives it per query head); run() and the bound function (`_bind_efficient_masked`)
    both call it, so they agree bit for bit."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    rows = (hq // hkv) * sq
    bias = _aligned(bias, 8).expand(b, hkv, rows, k.shape[2])
    res = _efficient_sdpa(q.reshape(b, hkv, rows, d), k, v, bias, need_lse, 0.0, False, scale=scale)
    return res[0].reshape(b, hq, sq, v.shape[3]), res[1]


def _unstacked_lse(lse: torch.Tensor, b: int, hq: int, sq: int) -> torch.Tensor:
    """A folded call's LSE (b, hkv, rows padded to 32) as (b, hq, sq)."""
    return lse[:, :, : (hq // lse.shape[1]) * sq].reshape(b, hq, sq)


def _bind_efficient_masked(call: AttentionCall) -> Any:
    """A boolean-masked call (`_binds_mask`) bound to the efficient kernel as run() runs it — the bias made in one
    kernel (`mask_bias_values`, additive_bias's values), a padding mask under GQA folded (`_efficient_folded`),
    else k/v heads copied per query head and the bias aligned and broadcast — reading every size from its tensors
    (`size_generic`); it keeps the layout, causal flag (top-left, the kernel's own), scale and LSE need."""
    zero, blocked = mask_bias_values(call.dtype, call.device)
    need_lse, causal, scale = call.requires_grad, call.causal, call.scale
    to_bhsd, from_bhsd = layout_views(call.layout)

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any,
               attn_mask: torch.Tensor, sinks: Any) -> torch.Tensor:
        q, k, v = to_bhsd(q), to_bhsd(k), to_bhsd(v)
        bias = _mask_bias_4d(attn_mask, zero, blocked)
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv:
            if not causal and bias.shape[1] == 1 and bias.shape[2] == 1:  # `_mask_folds`
                return from_bhsd(_efficient_folded(q, k, v, bias, need_lse, scale)[0])
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        bias = _aligned(bias, 8).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return from_bhsd(_efficient_sdpa(q, k, v, bias, need_lse, 0.0, causal, scale=scale)[0])

    return size_generic(masked)


def _run_gqa_folded(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    """(b, hq, sq, d) queries as (b, hkv, group * sq, d): query head i uses kv head i // group, so the heads of a
    group are consecutive and stack in order (a view when sq == 1, a copy otherwise)."""
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    folded = q.reshape(b, hkv, (hq // hkv) * sq, q.shape[3])
    need_lse = call.return_lse or call.requires_grad
    res = _efficient_sdpa(folded, k, v, None, need_lse, 0.0, False, scale=call.scale)
    out = call.from_bhsd(res[0].reshape(b, hq, sq, v.shape[3]))
    if not call.return_lse:
        return out
    return out, res[1][:, :, : folded.shape[2]].reshape(b, hq, sq)  # the kernel pads LSE to 32 queries


def _run_kv_cache(call: AttentionCall) -> Any:
    """A dense KV cache through the efficient kernel: each sequence's fill (and causal/window aligned at it) as an
    additive bias over the whole cache, one row per query shared by every head; a GQA group's query heads stacked
    as queries of their kv head, so each kv head is read once (decode is bound by reading the cache)."""
    q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    allowed = kv_cache_allowed(call)
    bias = torch.zeros((b, 1, sq, k.shape[2]), dtype=q.dtype, device=q.device).masked_fill_(~allowed, -math.inf)
    if group > 1 and sq > 1:
        bias = bias.repeat(1, 1, group, 1)  # folded query g * sq + i is query i of head g of the group
    bias = _aligned(bias, 8).expand(b, hkv, group * sq, k.shape[2])
    need_lse = call.return_lse or call.requires_grad
    res = _efficient_sdpa(q.reshape(b, hkv, group * sq, d), k, v, bias, need_lse, 0.0, False, scale=call.scale)
    out = call.from_bhsd(res[0].reshape(b, hq, sq, v.shape[3]))
    if not call.return_lse:
        return out
    lse = res[1][:, :, :group * sq].reshape(b, hq, sq)
    return out, lse.masked_fill(~allowed.any(-1), -math.inf)  # the kernel's LSE is not -inf where no key is seen


# -- the flash-attn package -----------------------------------------------------------------------------------

class FlashAttn2(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "flash_attn"
    priority: ClassVar[int] = 35
    description: ClassVar[str] = "the flash-attn package (FlashAttention-2): flash_attn_func / flash_attn_varlen_func"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (8, 0)  # "FlashAttention only supports Ampere GPUs or newer."
    requires = (FLASH_ATTN,)
    # csrc/flash_attn/flash_api.cpp: fp16/bf16; head_dim <= 256 (the Python wrapper pads to a multiple of 8);
    # one head dim for q, k, v; GQA; causal and window aligned bottom-right; softcap (not with dropout); ALiBi
    # (fp32, (h,) or (b, h)); dropout; deterministic backward on request.
    # KV caches: flash_attn_with_kvcache (dense q; a dense or paged cache) and flash_attn_varlen_func(block_table=)
    # for packed queries over pages; "Paged KV cache block size must be divisible by 256" (flash_api.cpp).
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=_LOW, head_dim_max=256, layouts=_ALL_LAYOUTS, causal_alignments=frozenset({"bottom_right"}),
        gqa=True, window=True, softcap=True, alibi=True, dropout=True, lse=True, backward=True,
        deterministic_backward=True,
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True, page_size_multiple=256,
        kv_cache_alibi=True,
    )

    # Of a dense call without ALiBi or a KV cache, extra_reasons reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads head dims, flags, alignment and the device: no sizes

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = [r for r in (_sm86_89_or_120_training_head_dim(call, device), alibi_alignment_reason(call),
                               causal_alibi_lse_reason(call)) if r]
        if call.softcap > 0 and call.dropout_p > 0:
            reasons.append("softcap with dropout is not supported (\"Softcapping does not support dropout\")")
        reasons += kv_cache_reasons(call, "flash-attn")
        if call.varlen and call.kv_cache and not call.paged:
            reasons.append("packed queries over an unpaged cache (thd with seqused_k) are not supported: "
                           "flash-attn 2's flash_attn_varlen_func takes no seqused_k (page it with block_table)")
        return reasons

    def run(self, call: AttentionCall) -> Any:
        import flash_attn

        if call.kv_cache:
            return flash_attn_kv_cache(flash_attn, call)
        window = kernel_window(call)
        common = dict(dropout_p=call.dropout_p, softmax_scale=call.scale, causal=call.causal, window_size=window,
                      softcap=call.softcap, alibi_slopes=call.alibi_slopes, deterministic=call.deterministic,
                      return_attn_probs=call.return_lse)
        if call.varlen:
            res = flash_attn.flash_attn_varlen_func(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                                    call.max_seqlen_q, call.max_seqlen_k, **common)
            if not call.return_lse:
                return res
            return res[0], varlen_lse_fix(res[1], call.cu_seqlens_q, call.cu_seqlens_k, call.causal, call.window,
                                          call.alibi_slopes)
        res = flash_attn.flash_attn_func(call.bshd(call.q), call.bshd(call.k), call.bshd(call.v), **common)
        if not call.return_lse:
            return call.from_bshd(res)
        return call.from_bshd(res[0]), dense_lse_fix(res[1], call.seqlen_q, call.seqlen_k, call.causal,
                                                       call.window, call.alibi_slopes)


class FlashAttn3(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "flash_attn3"
    priority: ClassVar[int] = 45
    description: ClassVar[str] = "FlashAttention-3 (flash-attention/hopper, module flash_attn_interface) on Hopper"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    # FA3 kernels target sm90 (torch's own FA3 wrapper requires capability 9.0 exactly).
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    requires = (Requirement(module="flash_attn_interface", distribution="flash_attn_3", key="flash_attn_3",
                            install_hint="build FA3: git clone flash-attention && cd hopper && "
                                         "python setup.py install"),)
    # hopper/flash_api.cpp: fp16/bf16; head_dim <= 256, a multiple of 8; GQA; causal/window bottom-right;
    # softcap; no dropout, no ALiBi; deterministic backward on request. FP8 (forward; the op refuses grad on FP8
    # inputs): float8_e4m3fn only ("FlashAttention only supports fp16, bf16, and fp8_e4m3"), on sm90, head dims
    # a multiple of 16 (extra_reasons), output bf16 only ("For FP8 input, output must have dtype BF16"); each
    # descale float32 of shape (batch, num_heads_k) — `_fa3_descales` broadcasts a per-tensor factor there. The
    # kernel folds q_descale * k_descale into the softmax scale (so the LSE is the real scores') and v_descale
    # into the final row scale, in every entry: dense, varlen and with_kvcache (paged or not).
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=_LOW | {_FA3_FP8}, fp8_out_dtypes=frozenset({torch.bfloat16}), fp8_descale_per_head=True,
        head_dim_min=8, head_dim_max=256, head_dim_multiple=8, layouts=_ALL_LAYOUTS,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, window=True, softcap=True, lse=True,
        backward=True, deterministic_backward=True,
        # KV caches: flash_attn_with_kvcache (dense or packed q; a dense cache or a page_table of any page size)
        # and flash_attn_varlen_func(seqused_k=) for packed queries over an unpaged cache.
        causal=True, deterministic_forward=True, kv_cache=True, paged_kv=True,
    )

    # Of a dense call without a KV cache, extra_reasons reads nothing (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads flags and alignment: no sizes

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = kv_cache_reasons(call, "FlashAttention-3")
        if call.fp8 and call.head_dim % 16:
            reasons.append(f"FP8 head_dim {call.head_dim} is not a multiple of 16 (flash_api.cpp: float8_e4m3fn "
                           "needs \"head_size should be a multiple of 16\"); pad the head dim or use bf16/fp16")
        return reasons

    def run(self, call: AttentionCall) -> Any:
        import flash_attn_interface as fa3

        if call.kv_cache:
            return _fa3_kv_cache(fa3, call)

        window = kernel_window(call)
        common = dict(softmax_scale=call.scale, causal=call.causal, window_size=window, softcap=call.softcap,
                      deterministic=call.deterministic, return_attn_probs=call.return_lse, **_fa3_descales(call))
        if call.varlen:
            res = fa3.flash_attn_varlen_func(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                             call.max_seqlen_q, call.max_seqlen_k, **common)
            if not call.return_lse:
                return res
            return res[0], empty_rows_to_neg_inf(res[1])
        res = fa3.flash_attn_func(call.bshd(call.q), call.bshd(call.k), call.bshd(call.v), **common)
        if not call.return_lse:
            return call.from_bshd(res)
        return call.from_bshd(res[0]), empty_rows_to_neg_inf(res[1])


def _fa3_descales(call: AttentionCall) -> dict[str, torch.Tensor]:
    """FA3's q_descale/k_descale/v_descale of an FP8 call (none for others): flash_api.cpp checks each is
    (batch, num_heads_k) and reads it through its strides, so a per-tensor factor goes as a stride-0 expanded view
    of itself — the same factor at every (batch, kv head), no copy."""
    if not call.fp8:
        return {}
    shape = (call.batch, call.heads_kv)
    given = {"q_descale": call.q_descale, "k_descale": call.k_descale, "v_descale": call.v_descale}
    return {name: t if t.dim() == 2 else t.reshape(()).expand(shape)
            for name, t in given.items() if t is not None}


def _fa3_kv_cache(fa3: Any, call: AttentionCall) -> Any:
    common = dict(softmax_scale=call.scale, causal=call.causal, window_size=kernel_window(call), softcap=call.softcap,
                  **_fa3_descales(call))
    if call.varlen and not call.paged:
        res = fa3.flash_attn_varlen_func(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                         call.max_seqlen_q, call.max_seqlen_k, seqused_k=call.seqused_k,
                                         return_attn_probs=call.return_lse, **common)
        return (res[0], kv_lse_fix(res[1], call)) if call.return_lse else res
    cache = (call.k, call.v) if call.paged else (call.bshd(call.k), call.bshd(call.v))
    q = call.q if call.varlen else call.bshd(call.q)
    packed = dict(cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q) if call.varlen else {}
    res = fa3.flash_attn_with_kvcache(q, *cache, cache_seqlens=call.seqused_k, page_table=call.block_table,
                                      return_softmax_lse=call.return_lse, **packed, **common)
    if not call.return_lse:
        return res if call.varlen else call.from_bshd(res)
    out = res[0] if call.varlen else call.from_bshd(res[0])
    return out, kv_lse_fix(res[1], call)
