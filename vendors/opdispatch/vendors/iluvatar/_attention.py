"""Iluvatar CoreX attention: ixformer's flash-attention varlen kernel.

ixformer ships as a closed wheel inside Iluvatar's CoreX images; no public source gives its full signatures. What
public code does show (see docs/vendors.md):

- callers import `flash_attn_varlen_func` from `ixformer.contrib.vllm_flash_attn` and call it with the keywords
  `q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal` (plus
  `return_softmax_lse=False`) on packed (total, heads, dim) fp16/bf16 tensors: the vLLM `vllm_flash_attn`
  keyword set;
- CoreX setup scripts create that module as a shim re-exporting `flash_attn_varlen_func` from top-level
  `ixformer`, so either location may hold it.

The adapter therefore passes only those keywords, never positions (vLLM's flash-attn orders `max_seqlen_q` before
`cu_seqlens_q`), checks them against `inspect.signature` before use, and claims only what those call sites
exercise: causal (bottom-right, the flash-attn convention) or none, GQA, head dims up to 256 in multiples of 8,
forward only, no lse. Dense layouts are packed into the varlen call. KV caches (seqused_k, block_table) are not
claimed: no public call site shows ixformer taking them, and no Iluvatar machine was at hand to check.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import AttentionCall, AttentionCaps, AttentionImpl, DeviceInfo, Requirement
from opdispatch.plugins.toolkit import pack_dense, pads_v_head_dim, unaccepted_keywords_reason, unpack_out

MODULES = ("ixformer.contrib.vllm_flash_attn", "ixformer")
FUNCTION = "flash_attn_varlen_func"
KEYWORDS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
            "causal")


class IxformerOptions(BaseModel):
    """Policy knobs of `iluvatar.ixformer`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: Literal["auto", "ixformer.contrib.vllm_flash_attn", "ixformer"] = Field(
        default="auto", description="where to take flash_attn_varlen_func from; auto tries the vLLM-style "
                                    "contrib module, then top-level ixformer")


def find_functions(candidates: tuple[str, ...], functions: tuple[str, ...]) -> tuple[Any, str]:
    """(module, its name): the first of `candidates` that imports and has every one of `functions` (ixformer
    moves them between releases); ImportError naming what each candidate lacks."""
    errors = []
    for name in candidates:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        missing = [f for f in functions if not callable(getattr(mod, f, None))]
        if not missing:
            return mod, name
        errors.append(f"{name} has no {', '.join(missing)}")
    raise ImportError("; ".join(errors))


def resolve_varlen(module: str) -> tuple[Any, str]:
    """(function, where) for the configured module; raises ImportError naming what is missing."""
    mod, name = find_functions(MODULES if module == "auto" else (module,), (FUNCTION,))
    return getattr(mod, FUNCTION), f"{name}.{FUNCTION}"


@pads_v_head_dim
class IluvatarIxformer(AttentionImpl):
    vendor: ClassVar[str] = "iluvatar"
    name: ClassVar[str] = "ixformer"
    priority: ClassVar[int] = 80
    description: ClassVar[str] = "Iluvatar ixformer flash_attn_varlen_func (vLLM flash-attn API on CoreX)"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"iluvatar"})
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement(
        module="ixformer", distribution="ixformer",
        install_hint=("ixformer is not on PyPI: install the ixformer wheel of your CoreX SDK release (it ships in "
                      "Iluvatar's CoreX container images, next to the +corex torch)")),)
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), head_dim_max=256, head_dim_multiple=8,
        layouts=frozenset({"bshd", "bhsd", "sbhd", "thd"}), causal_alignments=frozenset({"bottom_right"}),
        gqa=True, window=False, softcap=False, alibi=False, dropout=False, lse=False, backward=False,
        causal=True, deterministic_forward=True, deterministic_backward=True,
    )
    options_model: ClassVar[type[BaseModel]] = IxformerOptions

    def extra_availability(self, device: DeviceInfo) -> str | None:
        try:
            fn, where = resolve_varlen(self.options.module)
        except Exception as exc:
            return f"ixformer is installed but has no usable {FUNCTION}: {exc}"
        return unaccepted_keywords_reason(fn, KEYWORDS, where)

    def run(self, call: AttentionCall) -> torch.Tensor:
        fn, _ = resolve_varlen(self.options.module)
        if call.varlen:
            q, k, v, cu_q, cu_k = call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k
        else:
            q, k, v, cu_q, cu_k, _, _ = pack_dense(call)
        out = fn(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=call.seqlen_q,
                 max_seqlen_k=call.seqlen_k, softmax_scale=call.scale, causal=call.causal)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out if call.varlen else unpack_out(call, out)
