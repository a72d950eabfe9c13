"""vLLM's FlashAttention fork (vllm-project/flash-attention, bundled in vLLM as `vllm.vllm_flash_attn`) through
its FA3 kernels on Hopper, inference only, with attention sinks taken natively as its `s_aux` (`caps.native_sinks`).

Read from vllm-project/flash-attention at commit 617264c1c7955c9e84817654ebeedff069f3c5f1 (2026-08-06, "feat(cute):
add SM90 FP8 KV support with in-kernel dequantization (#164)"), vllm_flash_attn/flash_attn_interface.py, which
`vllm_flash_attn/__init__.py` re-exports (vLLM imports it as `from vllm.vllm_flash_attn import
flash_attn_varlen_func`, vllm/v1/attention/backends/fa_utils.py):

    flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, return_softmax_lse=False, out=None, scheduler_metadata=None,
                           q_descale=None, k_descale=None, v_descale=None, num_splits=0,
                           fa_version=DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1, cp_rank=0,
                           cp_tot_seqused_k=None)

It returns `out` (total_q, h, dv) in q's dtype, or `(out, softmax_lse)` with return_softmax_lse, lse float32
(h, total_q). There is no dense entry (q is always packed: dense calls are packed into it here) and no backward
(the fork's README: "we compile out the backward pass kernels"): forward only, no autograd.
- `fa_version=2` (the default) raises NotImplementedError for `s_aux`; `fa_version=3` runs `torch.ops._vllm_fa3_C.fwd`
  (hopper/flash_api.cpp `mha_fwd`), built for sm90 only (CMakeLists.txt FA3_ARCHS "9.0a";
  `_is_fa3_supported`: capability 9.x): this adapter always passes fa_version=3, and vLLM itself offers sinks only
  with FA3 (`flash_attn_supports_sinks`: `get_flash_attn_version() == 3`).
- mha_fwd: q/k/v fp16 or bf16 (fp8 e4m3 with descales, not offered); head_dim <= 256 and a multiple of 8;
  heads_q % heads_kv == 0 (GQA); ALiBi asserted off in FA3; causal and window (left, right) bottom-right, -1
  unbounded, causal setting right to 0; softcap; cu_seqlens int32; no dropout in FA3.
- `s_aux`: "S aux is currently only supported for Hopper GPUs", "query heads <= 64", "hdim != hdim_v" refused,
  dtype bfloat16 only, shape (num_heads,), contiguous. softmax.h `finalize_aux` adds exp(s_aux) to each row's sum
  in the units of the scaled (and softcapped) scores, natural log: out = softmax over [scores, sink] without a
  value for the sink, and the LSE includes it; with a split-KV launch only split 0 adds it, so the combine counts
  it once.

What this adapter therefore does with sinks (`native_sinks_limit`; every other call with sinks goes through the
shared epilogue over this kernel's LSE, which is exact):
- natively only where the float32 sinks are exactly bfloat16 values (GPT-OSS's bf16 `sinks`, widened), since
  s_aux is read as bf16 and any other value would be rounded; checking it reads the sinks (one device sync per
  sinks tensor and version — a decode loop's parameter is read once; while a CUDA graph is captured it cannot,
  so those calls take the epilogue);
- not where the LSE is returned: a tile of rows that sees no key is written by `store_zero` with LSE -inf (the
  sink left out), and a sink more than ~88 above a row's largest scaled score overflows that row's sum to an LSE
  of +inf (its output is then 0, where the exact one is below e^-88 of the values: within float32's underflow);
- not with more than 64 query heads; not on a build whose flash_attn_varlen_func has no `s_aux` (older vLLM).

Not offered: the paged KV cache (block_table with seqused_k) and seqused_k over a dense cache, fp8, q_v, context
parallel (cp_*), ALiBi (FA2 path only). Not installed on the project's GPU machine: tests/fakes/vllm_flash_attn.py
holds the contract tests' fake; nothing here is measured.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, Requirement
from opdispatch.plugins.toolkit import (empty_rows_to_neg_inf, kernel_window, pack_dense, unaccepted_keywords,
                                        unpack_lse, unpack_out)

VLLM_FLASH_ATTN = Requirement(module="vllm.vllm_flash_attn", distribution="vllm", key="vllm_flash_attn",
                              verify_distribution=True,
                              install_hint="pip install vllm (it bundles vllm-project/flash-attention as "
                                           "vllm.vllm_flash_attn, with FA3 kernels for sm90)")

_FA3 = 3
_S_AUX_MAX_HEADS = 64  # hopper/flash_api.cpp: "We only support query heads <= 64 with S aux"


class VllmFlashAttn(AttentionImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "vllm_flash_attn"
    priority: ClassVar[int] = 44
    description: ClassVar[str] = ("vLLM's FlashAttention fork (vllm.vllm_flash_attn, FA3 on Hopper), forward only; "
                                  "takes attention sinks natively (s_aux)")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    min_capability: ClassVar[tuple[int, int] | None] = (9, 0)  # FA3_ARCHS "9.0a"
    max_capability: ClassVar[tuple[int, int] | None] = (9, 0)
    requires = (VLLM_FLASH_ATTN,)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_min=8, head_dim_max=256, head_dim_multiple=8,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), causal=True,
        causal_alignments=frozenset({"bottom_right"}), gqa=True, window=True, softcap=True, lse=True,
        # The backward kernels are compiled out of the fork: inference only, so sinks never need a backward here.
        backward=False, native_sinks=True, native_sinks_backward=False,
    )

    # selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # the capabilities read flags and head dims only; per-call sink routes are native_sinks_limit's

    def native_sinks_limit(self, call: AttentionCall) -> str | None:
        if call.return_lse:
            return ("vLLM's FA3 writes LSE -inf (without s_aux) for a tile of rows that sees no key, and +inf where "
                    "a sink overflows a row's sum: the shared epilogue")
        if call.heads_q > _S_AUX_MAX_HEADS:
            return f"vLLM's FA3 takes s_aux with at most {_S_AUX_MAX_HEADS} query heads, not {call.heads_q}"
        # Imported here, not read from sys.modules: availability never imports it, and the call runs on it next.
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        if unaccepted_keywords(flash_attn_varlen_func, ("s_aux", "fa_version")):
            return "this vllm.vllm_flash_attn's flash_attn_varlen_func takes no s_aux: the shared epilogue"
        sinks = call.sinks
        assert sinks is not None  # only asked for calls with sinks
        if sinks.is_cuda and torch.cuda.is_current_stream_capturing():
            return ("whether the sinks are bfloat16 values (what s_aux holds) cannot be read while a CUDA graph is "
                    "captured: the shared epilogue")
        if not _bf16_valued(sinks):
            return "vLLM's FA3 reads s_aux as bfloat16 and these float32 sinks are not bfloat16 values: the epilogue"
        return None

    def run(self, call: AttentionCall) -> Any:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        if call.varlen:
            q, k, v = call.q, call.k, call.v
            cu_q, cu_k, max_q, max_k = call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k
        else:
            q, k, v, cu_q, cu_k, max_q, max_k = pack_dense(call)
        kwargs: dict[str, Any] = {}
        if call.sinks is not None:  # only calls native_sinks_limit accepted: bfloat16 values, so the cast is exact
            kwargs["s_aux"] = call.sinks.to(torch.bfloat16).contiguous()
        res = flash_attn_varlen_func(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                                     cu_seqlens_k=cu_k, softmax_scale=call.scale, causal=call.causal,
                                     window_size=list(kernel_window(call)), softcap=call.softcap,
                                     return_softmax_lse=call.return_lse, fa_version=_FA3, **kwargs)
        out, lse = res if call.return_lse else (res, None)
        if not call.varlen:
            out = unpack_out(call, out)
        if lse is None:
            return out
        lse = empty_rows_to_neg_inf(lse)
        return out, (lse if call.varlen else unpack_lse(call, lse))


# Whether a sinks tensor holds bfloat16 values, per live tensor object and its version: reading it is a device
# sync, and a decode loop passes the same parameter every step (its version moves only when it is written). Keyed by
# id() with a finalizer dropping the entry when the tensor dies, so a reused id never answers for another tensor.
_BF16_VALUED: dict[int, tuple[int, bool]] = {}


def _bf16_valued(sinks: torch.Tensor) -> bool:
    known = _BF16_VALUED.get(id(sinks))
    if known is not None and known[0] == sinks._version:
        return known[1]
    answer = bool(torch.equal(sinks, sinks.to(torch.bfloat16).to(sinks.dtype)))
    if known is None:
        weakref.finalize(sinks, _BF16_VALUED.pop, id(sinks), None)
    _BF16_VALUED[id(sinks)] = (sinks._version, answer)
    return answer
