"""`cpu.flash`: torch's fused (flash-style) CPU attention kernel, called through its C++ binding directly.

No `sdpa_kernel` context is entered per call: `torch._scaled_dot_product_flash_attention_for_cpu` is the
kernel itself, bound to the cheapest entry into C++, and autograd knows its backward. Sliding windows,
bottom-right alignment and boolean masks are folded into the additive mask the kernel takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, validate_attention
from opdispatch.plugins.toolkit import (additive_bias, aten_sdpa_call, kv_cache_as_mask, layout_views, paged_as_dense,
                                        sequence_keys, shift_rows, size_generic)

_aten_kernel = torch._scaled_dot_product_flash_attention_for_cpu
# Its backward has no torch.* binding; the OpOverload is the direct entry (called once per compiled backward).
_kernel_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool,
            **kwargs: Any) -> Any:
    # q/k/v have a unit-stride head dim: the op makes them so (caps.strided_inputs is False); the aten kernels
    # read rows as if they were (max error 2-4 measured on channels-last views, slices and expanded tensors).
    return _aten_kernel(q, k, v, dropout_p, is_causal, **kwargs)


def _one_query_gqa(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> bool:
    """Whether a (bhsd) call is a decode step under grouped-query attention without a causal flag for the kernel:
    its query heads of one k/v head are then run as that head's queries (`_packed_kernel`)."""
    return not is_causal and q.shape[2] == 1 and q.shape[1] != k.shape[1]


def _packed_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on a decode step under GQA (`_one_query_gqa`), as transformers' sdpa path packs it: q (b, hq, 1,
    d) viewed as (b, hkv, hq / hkv, d), so each k/v head is read once for all its query heads rather than once per
    query head: 1.5-1.9x faster on CPU at 1024 keys, ahead from ~64 keys on as torch starts
    (benchmarks/results/cpu_gqa_decode_packing-cpu.md); once a program calls torch.set_num_threads (which turns
    MKL's dynamic threading off) slower below ~200 keys (cpu_gqa_decode_packing-set-threads-cpu.md), a state this
    cannot read. The one query position's additive mask (4-D, (b', 1 or hq, 1, sk)) broadcasts over the packed
    rows, a per-head one split like q. Returns out and lse as the unpacked call's shapes: (b, hq, 1, dv),
    (b, hq, 1)."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if bias is not None and bias.shape[1] != 1:
        bias = bias.reshape(bias.shape[0], hkv, hq // hkv, bias.shape[3])
    out, lse = _kernel(q.reshape(b, hkv, hq // hkv, d), k, v, 0.0, False, attn_mask=bias, scale=scale)[:2]
    return out.reshape(b, hq, 1, out.shape[3]), lse.reshape(b, hq, 1)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, bias: torch.Tensor | None,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernel on bhsd views, a GQA decode step packed: every path of this implementation (run,
    bound, backward) computes a call the same way, so they agree bit for bit."""
    if _one_query_gqa(q, k, is_causal):
        return _packed_kernel(q, k, v, bias, scale)
    out, lse = _kernel(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)[:2]
    return out, lse


class CpuFlashAttention(AttentionImpl):
    vendor: ClassVar[str] = "cpu"
    name: ClassVar[str] = "flash"
    priority: ClassVar[int] = 10
    description: ClassVar[str] = "torch's fused CPU attention kernel (aten _scaled_dot_product_flash_attention_for_cpu)"
    device_types: ClassVar[frozenset[str]] = frozenset({"cpu"})
    # Limits read from aten/src/ATen/native/transformers/sdp_utils_cpp.cpp (use_flash_attention_cpp) and checked
    # on torch 2.13: 4-D inputs, equal q/k/v head dims, no dropout, masks of the query's dtype without grad,
    # kv heads dividing q heads, causal aligned top-left.
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=True, alibi=True, attn_mask=True,
        attn_bias=True, bias_grad=False, lse=True, backward=True, deterministic_backward=True,
        # thd: each packed sequence through the kernel on its own (`_run_varlen`: its lengths are host values on
        # the CPU, read without a sync). A v head dim other than q/k's: the smaller side zero-padded (`_run_padded`).
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), head_dim_v_differs=True,
        causal=True, deterministic_forward=True,
        # A dense cache, its fill folded into the mask (kv_cache_as_mask); a paged one read after gathering its
        # pages into a dense cache (paged_as_dense: vLLM's 16-key pages on CPU). Unbounded here, unlike the CUDA
        # kernels' PAGED_GATHER_MAX_BYTES: a bound reads sizes (a selection key), and any selection key makes a
        # torch.compile'd model re-check its decision on every call (opdispatch.compile._compile.size_predicates); on
        # CPU the copy is host memory, as large as the block table the caller sized.
        kv_cache=True, paged_kv=True,
    )

    binds_attn_mask: ClassVar[bool] = True  # a padded batch's decode: `_bind_masked`

    def bind(self, call: AttentionCall) -> Callable[..., Any]:
        if call.varlen or call.head_dim_v != call.head_dim:
            return super().bind(call)  # run() per call: per sequence, or padded
        if call.attn_mask is not None and not (call.kv_cache or call.causal or call.positional_mask
                                               or call.attn_bias is not None or call.alibi_slopes is not None
                                               or call.return_lse):
            return _bind_masked(call)
        if (call.kv_cache or call.positional_mask or call.attn_mask is not None or call.attn_bias is not None
                or call.alibi_slopes is not None):
            return super().bind(call)
        # The common case binds the kernel itself: no call object, no branches per call. Every function below
        # reads the sizes from its tensors and keeps only the layout, causal flag and scale — what the decision
        # class holds — so it serves calls of other sizes of its decision (`size_generic`).
        kernel, causal, scale = _kernel, call.causal, call.scale
        if call.gqa_ratio > 1 and not causal:  # a decode step packs its query heads (`_packed_kernel`), per call
            return _bind_flash(call)
        if call.layout == "bhsd":
            if call.return_lse:
                return size_generic(lambda q, k, v: tuple(kernel(q, k, v, 0.0, causal, scale=scale)))
            # The aten op itself, as one C call where opdispatch's extension is built (_kernel's frame is gone),
            # with default arguments left out (torch's parser charges for each explicit one).
            return size_generic(aten_sdpa_call(_aten_kernel, 0.0, causal, defaults=(0.0, False), scale=scale,
                                               head_dim=call.head_dim))
        to_bhsd, from_bhsd = layout_views(call.layout)  # views that hold nothing of the call
        if call.return_lse:
            def bound_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
                out, lse = kernel(to_bhsd(q), to_bhsd(k), to_bhsd(v), 0.0, causal, scale=scale)
                return from_bhsd(out), lse
            return size_generic(bound_lse)
        return size_generic(
            lambda q, k, v: from_bhsd(kernel(to_bhsd(q), to_bhsd(k), to_bhsd(v), 0.0, causal, scale=scale)[0]))

    def backward(self, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        # The kernel's own backward from the saved out and LSE; calls with a folded mask (whose LSE run() adjusts)
        # recompute instead.
        if (call.kv_cache or call.positional_mask or call.attn_mask is not None or call.attn_bias is not None
                or call.alibi_slopes is not None or call.varlen or call.head_dim_v != call.head_dim):
            return None
        to_bhsd, from_bhsd = call.bhsd, call.from_bhsd
        q, k, v = (to_bhsd(t) for t in (call.q, call.k, call.v))
        grad, out = to_bhsd(grad_out).contiguous(), to_bhsd(out)
        if _one_query_gqa(q, k, call.causal):  # as autograd differentiates the packed forward (`_packed_kernel`)
            b, hq, _, d = q.shape
            packed = (b, k.shape[1], hq // k.shape[1])
            grads = _kernel_backward(grad.reshape(*packed, grad.shape[3]), q.reshape(*packed, d), k, v,
                                     out.reshape(*packed, out.shape[3]), lse.reshape(packed), 0.0, False,
                                     scale=call.scale)
            return from_bhsd(grads[0].reshape(q.shape)), from_bhsd(grads[1]), from_bhsd(grads[2])
        grads = _kernel_backward(grad, q, k, v, out, lse, 0.0, call.causal, scale=call.scale)
        return from_bhsd(grads[0]), from_bhsd(grads[1]), from_bhsd(grads[2])

    def run(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if call.varlen:
            return self._run_varlen(call)
        if call.paged:
            call = paged_as_dense(call)
        if call.kv_cache:
            call = kv_cache_as_mask(call)
        q, k, v = call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)
        dv = v.shape[3]
        if q.shape[3] != dv:  # the kernel takes one head dim: zero columns change no score and no kept output
            width = max(q.shape[3], dv)
            q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[3])) for t in (q, k, v))
        alibi = call.alibi_slopes is not None
        # The kernel takes is_causal or a mask, not both: with a mask, bias or ALiBi, causal is folded into it too.
        additive, is_causal, _ = additive_bias(
            call, q, k, fold_causal=call.attn_mask is not None or call.attn_bias is not None or alibi,
            fold_alibi=True, dtype=torch.promote_types(q.dtype, torch.float32) if alibi else None)
        shift = None
        if alibi:
            additive, shift = shift_rows(additive, q.dtype)
        out, lse = _flash(q, k, v, is_causal, additive, call.scale)
        out = call.from_bhsd(out[..., :dv] if out.shape[3] != dv else out)
        if not call.return_lse:
            return out
        if shift is not None:
            lse = lse + shift[..., 0]
        if additive is not None:
            # The kernel reports lse 0 for a query that sees no key; the convention is -inf. Read from the final
            # additive mask, so a bias row of -inf counts as well as a boolean mask or a window.
            blind = torch.isneginf(additive).all(dim=-1)
            if blind.any():
                lse = lse.masked_fill(blind.expand(lse.shape), float("-inf"))
        return out, lse


    def _run_varlen(self, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Packed sequences, each as a dense (1, s, h, d) call through `run` with the call's flags, alignment,
        window, scale and its own ALiBi row: the kernel has no varlen entry, and on the CPU the offsets are host
        values (no sync). Outputs and LSEs concatenated back in the packed order; an empty sequence adds none."""
        assert call.cu_seqlens_q is not None
        cu_q = call.cu_seqlens_q.tolist()
        cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None
        used = call.seqused_k.tolist() if call.seqused_k is not None else None
        slopes = call.alibi_slopes
        lse_dtype = torch.float64 if call.dtype == torch.float64 else torch.float32
        outs, lses = [], []
        for b in range(len(cu_q) - 1):
            q = call.q[cu_q[b]:cu_q[b + 1]].unsqueeze(0)
            k, v = (sequence_keys(call, t, b, cu_k, used).unsqueeze(0) for t in (call.k, call.v))
            if q.shape[1] == 0:
                continue
            row = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
            if k.shape[1] == 0:  # a sequence without keys: every query sees none (zeros, LSE -inf)
                outs.append(q.new_zeros(q.shape[1], q.shape[2], call.head_dim_v))
                lses.append(torch.full((q.shape[2], q.shape[1]), float("-inf"), dtype=lse_dtype))
                continue
            one = validate_attention(q, k, v, causal=call.causal, causal_alignment=call.causal_alignment,
                                     window=call.window, scale=call.scale, alibi_slopes=row,
                                     dropout_p=call.dropout_p, return_lse=call.return_lse,
                                     deterministic=call.deterministic)
            result = self.run(one)
            out, lse = result if call.return_lse else (result, None)
            outs.append(out[0])
            if lse is not None:
                lses.append(lse[0])
        out = torch.cat(outs) if outs else call.q.new_zeros(call.q.shape[0], call.heads_q, call.head_dim_v)
        if not call.return_lse:
            return out
        lse = (torch.cat(lses, dim=1) if lses
               else torch.full((call.heads_q, call.q.shape[0]), float("-inf"), dtype=lse_dtype))
        return out, lse


# The additive mask `run` builds from a boolean one (`additive_bias`: 0 where True, -inf where False), as one op
# from two 0-dim tensors of the kernel's dtype: the same values, so the same result bit for bit.
_MASK_VALUES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = _MASK_VALUES.get((dtype, device))
    if values is None:
        values = _MASK_VALUES[dtype, device] = (torch.zeros((), dtype=dtype, device=device),
                                                torch.full((), float("-inf"), dtype=dtype, device=device))
    return values


def _bind_masked(call: AttentionCall) -> Callable[..., Any]:
    """A boolean-masked call without causal pattern, window, bias, ALiBi, KV cache or LSE (a padded batch's decode
    and prefill, as transformers sends them): the mask folded per call as `run` folds it, then the kernel. Keeps
    the layout, scale and dtype only — what the decision class holds — so it serves every size (`size_generic`);
    the mask's broadcast pattern is in the class too."""
    scale = call.scale
    zero, blocked = _mask_values(call.dtype, call.device)
    where = torch.where
    to_bhsd, from_bhsd = layout_views(call.layout)
    if call.layout == "bhsd":  # transformers' layout
        def masked_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any,
                        attn_mask: torch.Tensor, sinks: Any) -> torch.Tensor:
            bias = where(attn_mask, zero, blocked)
            if bias.dim() < 4:
                bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            if q.shape[2] == 1 and q.shape[1] != k.shape[1]:  # `_flash` inlined: the same kernel calls
                b, hq, _, d = q.shape
                hkv = k.shape[1]
                if bias.shape[1] != 1:
                    bias = bias.reshape(bias.shape[0], hkv, hq // hkv, bias.shape[3])
                out = _aten_kernel(q.reshape(b, hkv, hq // hkv, d), k, v, 0.0, False, attn_mask=bias, scale=scale)[0]
                return out.reshape(b, hq, 1, out.shape[3])
            return _aten_kernel(q, k, v, 0.0, False, attn_mask=bias, scale=scale)[0]
        return size_generic(masked_bhsd)

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any,
               attn_mask: torch.Tensor, sinks: Any) -> torch.Tensor:
        bias = where(attn_mask, zero, blocked)
        if bias.dim() < 4:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        return from_bhsd(_flash(to_bhsd(q), to_bhsd(k), to_bhsd(v), False, bias, scale)[0])

    return size_generic(masked)


def _bind_flash(call: AttentionCall) -> Callable[..., Any]:
    """A call under GQA without causal flag, mask or bias: a decode step's query heads packed per call
    (`_flash`), every other size as it is. Keeps the layout and scale only (`size_generic`)."""
    scale = call.scale
    to_bhsd, from_bhsd = layout_views(call.layout)
    if call.return_lse:
        def bound_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            out, lse = _flash(to_bhsd(q), to_bhsd(k), to_bhsd(v), False, None, scale)
            return from_bhsd(out), lse
        return size_generic(bound_lse)

    if call.layout == "bhsd":
        # The kernel's output with the fewest arguments (dropout 0, not causal and its own default scale left out).
        kernel = aten_sdpa_call(_aten_kernel, 0.0, False, defaults=(0.0, False), scale=scale, head_dim=call.head_dim)

        def bound_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # `_flash` inlined, with views for reshapes: a decode step's host cost is the point. The same kernel
            # calls, the same bits.
            if q.shape[2] == 1:
                b, hq, _, d = q.shape
                hkv = k.shape[1]
                out = kernel(q.view(b, hkv, hq // hkv, d), k, v)  # contiguous (b, hkv, hq/hkv, dv)
                return out.view(b, hq, 1, out.shape[3])
            return kernel(q, k, v)
        return size_generic(bound_bhsd)

    def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return from_bhsd(_flash(to_bhsd(q), to_bhsd(k), to_bhsd(v), False, None, scale)[0])

    return size_generic(bound)
