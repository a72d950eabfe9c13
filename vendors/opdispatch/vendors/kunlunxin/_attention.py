"""KunLunXin XPU attention: `prefill_attention` of KunLunXin's op library (`kunlun_ops`, formerly `xtorch_ops`).

Source: baidu/vLLM-Kunlun `vllm_kunlun/v1/attention/backends/kunlun_attn.py` (HEAD 09869ee, the non-prefix-cache
branch of the prefill path), the vendor's own caller. Everything is passed by keyword, as there:

    kunlun_ops.prefill_attention(q=, k=, v=, out=, is_causal=, alpha=, context_qlen_lod_cpu=,
                                 context_qlen_lod_xpu=, alibi_slopes=, softmax_lse=, swa_left=, swa_right=)

- q/k/v are packed (tokens, heads, dim); k/v keep their kv heads (GQA is native); `out` is written in place.
- One LoD (int32 cu_seqlens) describes both q and k/v, given twice: on the CPU and on the device. Without a
  KV cache the kernel is self-attention prefill, so seqlen_q must equal seqlen_k per sequence.
- `alpha` is not the softmax scale: "prefill_attention kernel internally applies 1/sqrt(head_dim) and multiplies
  by alpha", so alpha = scale * sqrt(head_dim) (1.0 for the default scale).
- The return value is a status code in some versions (non-zero = error).

Not claimed, because no public caller pins their meaning down: sliding windows (vLLM-Kunlun passes the model's raw
`sliding_window` as `swa_left`, whose off-by-one convention is unverified), ALiBi (vLLM's slopes convention is
causal-only), the lse output (always None at the call sites), dropout and backward (inference kernels).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import pack_dense, pads_v_head_dim, unpack_out

FUNCTION = "prefill_attention"

_HINTS = {
    "kunlun_ops": ("install KunLunXin's kunlun_ops wheel with its XPyTorch (see baidu/vLLM-Kunlun "
                   "docs/source/installation.md, e.g. kunlun_ops-0.1.58+…-cp310-linux_x86_64.whl); not on PyPI"),
    "xtorch_ops": ("xtorch_ops is the pre-2026 name of KunLunXin's op library (now kunlun_ops); install it from "
                   "your KunLunXin XPyTorch release"),
}


def ops_requirement(module: str) -> Requirement:
    """KunLunXin's op library under its current (kunlun_ops) or older (xtorch_ops) name, with its install hint."""
    return Requirement(module=module, distribution=module, install_hint=_HINTS[module])


class KunlunOptions(BaseModel):
    """Policy knobs of `kunlunxin.prefill`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ops_module: Literal["kunlun_ops", "xtorch_ops"] = Field(
        default="kunlun_ops", description="KunLunXin's op library: kunlun_ops (current) or xtorch_ops (its name "
                                          "before baidu/vLLM-Kunlun commit bf9369f)")


@pads_v_head_dim
class KunlunxinPrefill(AttentionImpl):
    vendor: ClassVar[str] = "kunlunxin"
    name: ClassVar[str] = "prefill"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = "KunLunXin kunlun_ops.prefill_attention (self-attention prefill, packed varlen)"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"kunlunxin"})
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_max=256,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}),
        # seqlen_q == seqlen_k is enforced below, so both alignments are the same computation.
        causal_alignments=frozenset({"top_left", "bottom_right"}), gqa=True, window=False, softcap=False,
        alibi=False, dropout=False, lse=False, backward=False,
        causal=True, deterministic_forward=True, deterministic_backward=True,
    )
    options_model: ClassVar[type[BaseModel]] = KunlunOptions

    @property
    def requires(self) -> tuple[Requirement, ...]:  # type: ignore[override]
        return (ops_requirement(self.options.ops_module),)

    # selection_key reads no size (opdispatch.engine._classes).
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = {}

    def selection_key(self, call: AttentionCall) -> Any:
        return ()  # extra_reasons reads only class features (flags, alignment, same_lengths, head_dim, options)

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        if call.varlen:
            # Validation makes cu_seqlens_k the very tensor cu_seqlens_q when their values are equal.
            if not call.same_lengths:
                return ["cu_seqlens_q differs from cu_seqlens_k: prefill_attention without a KV cache takes one "
                        "LoD for q and k/v (self-attention prefill)"]
        elif call.seqlen_q != call.seqlen_k:
            return [f"seqlen_q {call.seqlen_q} != seqlen_k {call.seqlen_k}: prefill_attention without a KV cache "
                    "takes one LoD for q and k/v (self-attention prefill)"]
        return []

    def extra_availability(self, device: DeviceInfo) -> str | None:
        module = self.options.ops_module
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            return f"importing {module} failed: {type(exc).__name__}: {exc}"
        if not hasattr(mod, FUNCTION):
            return f"{module} has no {FUNCTION}"
        return None

    def run(self, call: AttentionCall) -> torch.Tensor:
        ops: Any = importlib.import_module(self.options.ops_module)
        if call.varlen:
            q, k, v, lod = call.q, call.k, call.v, call.cu_seqlens_q
        else:  # one LoD for q and k/v: dense calls here have seqlen_q == seqlen_k (extra_reasons)
            q, k, v, lod, _, _, _ = pack_dense(call)
        out = torch.empty(q.shape[0], q.shape[1], call.head_dim_v, dtype=q.dtype, device=q.device)
        status = getattr(ops, FUNCTION)(
            q=q, k=k, v=v, out=out, is_causal=call.causal, alpha=call.scale * math.sqrt(call.head_dim),
            context_qlen_lod_cpu=lod.to("cpu", torch.int32), context_qlen_lod_xpu=lod.to(q.device, torch.int32),
            alibi_slopes=None, softmax_lse=None, swa_left=-1, swa_right=-1)
        if isinstance(status, int) and not isinstance(status, bool) and status != 0:
            raise RuntimeError(f"{self.options.ops_module}.{FUNCTION} returned error code {status}")
        return out if call.varlen else unpack_out(call, out)
