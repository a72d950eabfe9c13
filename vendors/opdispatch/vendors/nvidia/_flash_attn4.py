"""FlashAttention-4 (`flash_attn.cute`, CuTe DSL; pip distribution `flash-attn-4`) on Hopper and Blackwell, with
its learnable sink taken natively (`caps.native_sinks`).

Read from Dao-AILab/flash-attention, flash_attn/cute/interface.py at commit 0251105a2fb19d2957484b7f023cd8c115286ced
(2026-08-15, "[CuTe] Relax CUTLASS DSL requirement"); `flash_attn.cute` exports both functions:

    flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False)
    flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False)

Both always return the tuple (out, lse): out (b, sq, h, dv) / (total_q, h, dv) in q's dtype; lse float32
(b, h, sq) / (h, total_q) when return_lse or any input requires grad, else None. What this adapter relies on:
- dtypes fp16/bf16 for q/k/v (fp8 is forward-only, not offered); `learnable_sink` (num_heads,) of fp16, bf16 or
  float32 (opdispatch's sinks are float32), a logit in the units of the scaled scores (softmax.py `finalize` adds
  exp(sink) to each row's sum), so out = softmax over [scores, sink] without a value for the sink and the LSE
  includes the sink; a row that sees no key gets out 0, LSE = sink (-inf without a sink), matching opdispatch.
- The returned LSE carries a gradient (FlashAttnFunc.backward passes dlse to `_flash_attn_bwd`), and the
  backward with `learnable_sink` returns the sink's gradient (dsink) on SM90 and SM100/SM110 ("Learnable sink
  backward is supported on SM90 and SM100/SM110"); SM120's backward has none, so SM12x is not declared.
- Head dims (`_validate_head_dims`, alignment 16 bytes = 8 fp16/bf16 elements): SM90 any d, dv in [8, 256];
  SM100/SM110 d = dv <= 128, (192, 128), or (256, 256) through a dedicated kernel that has no learnable_sink,
  softcap, seqused or LSE gradient (asserts in `_flash_attn_fwd`/`_flash_attn_bwd`).
- causal and window bottom-right (FlashAttention's convention); window_size (left, right) with None unbounded
  (`_resolve_causal_local_window`; causal sets right to 0); GQA when heads_q % heads_kv == 0; softcap.

Not read from here: upstream FA3 (hopper/flash_attn_interface.py, same commit) has no sink argument; vLLM's
fork (vllm-project/flash-attention, vllm_flash_attn/flash_attn_interface.py) has `s_aux` on its own FA3 build's
flash_attn_varlen_func, forward only — not this package. FA4 is not installed on the project's GPU machine:
its numbers are not measured here; tests/fakes/flash_attn_cute.py holds the contract tests' fake.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement

FLASH_ATTN_4 = Requirement(module="flash_attn.cute", distribution="flash-attn-4", key="flash_attn_4",
                           verify_distribution=True,
                           install_hint="pip install flash-attn-4 (CUDA 13: pip install 'flash-attn-4[cu13]')")

_BLACKWELL = ((10, 0), (11, 9))  # SM100/SM103/SM110: the head dims of _validate_head_dims' Blackwell branch


def _window(call: AttentionCall) -> tuple[int | None, int | None]:
    """opdispatch's window (-1 unbounded on a side) as FA4's window_size (None unbounded)."""
    if call.window is None:
        return None, None
    left, right = call.window
    return (None if left < 0 else left), (None if right < 0 else right)


class FlashAttn4(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "flash_attn4"
    priority: ClassVar[int] = 46
    description: ClassVar[str] = ("FlashAttention-4 (flash-attention/flash_attn/cute, CuTe DSL) on Hopper and "
                                  "Blackwell; takes attention sinks natively (learnable_sink)")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    # The sink's backward exists on SM90 and SM100/SM110 only; SM8x has FA2, SM12x no sink backward.
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    max_capability: ClassVar[tuple[int, int] | None] = (11, 9)
    requires = (FLASH_ATTN_4,)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_min=8, head_dim_max=256, head_dim_multiple=8,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), causal=True,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, window=True, softcap=True, lse=True,
        lse_grad=True, backward=True, native_sinks=True, native_sinks_backward=True,
        # Not measured: FA4 is not installed on the GPU machine, so neither determinism is claimed.
        deterministic_forward=False, deterministic_backward=False,
    )

    # extra_reasons reads no size of any call (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads head dims, flags and the device: no sizes

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        cap = device.capability
        if cap is None or not _BLACKWELL[0] <= cap <= _BLACKWELL[1]:
            return []
        d = call.head_dim
        if d <= 128:
            return []
        if d != 256:
            return [f"FlashAttention-4 on sm{cap[0]}{cap[1]} takes head_dim <= 128 or 256, not {d}"]
        reasons = []
        label = f"FlashAttention-4's sm{cap[0]}{cap[1]} head_dim 256 kernel"
        if call.sinks is not None:
            reasons.append(f"{label} has no learnable_sink")
        if call.softcap > 0:
            reasons.append(f"{label} has no softcap")
        if call.return_lse and call.requires_grad:
            reasons.append(f"{label} takes no LSE gradient (return_lse=True under autograd)")
        return reasons

    def run(self, call: AttentionCall) -> Any:
        from flash_attn.cute import interface as fa4

        common = dict(softmax_scale=call.scale, causal=call.causal, window_size=_window(call),
                      learnable_sink=call.sinks, softcap=call.softcap, deterministic=call.deterministic,
                      return_lse=call.return_lse)
        if call.varlen:
            out, lse = fa4.flash_attn_varlen_func(call.q, call.k, call.v, cu_seqlens_q=call.cu_seqlens_q,
                                                  cu_seqlens_k=call.cu_seqlens_k, max_seqlen_q=call.max_seqlen_q,
                                                  max_seqlen_k=call.max_seqlen_k, **common)
            return (out, lse) if call.return_lse else out
        out, lse = fa4.flash_attn_func(call.bshd(call.q), call.bshd(call.k), call.bshd(call.v), **common)
        return (call.from_bshd(out), lse) if call.return_lse else call.from_bshd(out)
