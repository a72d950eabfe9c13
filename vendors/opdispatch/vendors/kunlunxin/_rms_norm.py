"""`kunlunxin.rms_norm`: KunLunXin's RMSNorm kernels (`kunlun_ops.rmsnorm` / `add_rmsnorm`), forward only.

Calling convention from the vendor's own callers, baidu/vLLM-Kunlun `vllm_kunlun/ops/layernorm.py` and
`vllm_kunlun/vllm_utils_wrapper.py`: ``rmsnorm(x, weight, out, eps)`` writes ``out``;
``add_rmsnorm(x, residual, residual_output=, weight=, eps=, output=)`` writes ``output = rmsnorm(x + residual) *
weight`` and ``residual_output = x + residual`` (the callers pass x and residual themselves as outputs, in place;
fresh buffers here keep the caller's tensors intact). "Kunlun does not support non-contiguous input": inputs are
made contiguous. Older releases (xtorch_ops) took ``rmsnorm(x, weight_fp32, eps, out=)`` — not supported.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

from opdispatch import RmsNormCall, RmsNormCaps, RmsNormImpl

from ._attention import ops_requirement



class KunlunRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "kunlunxin"
    name: ClassVar[str] = "rms_norm"
    priority: ClassVar[int] = 15
    description: ClassVar[str] = "KunLunXin kunlun_ops.rmsnorm / add_rmsnorm, forward only"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"kunlunxin"})
    requires = (ops_requirement("kunlun_ops"),)
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), weight_optional=True, residual=True,
        backward=False)

    def run(self, call: RmsNormCall) -> Any:
        ops: Any = importlib.import_module("kunlun_ops")
        x = call.x.contiguous()
        weight = call.weight.contiguous() if call.weight is not None else torch.ones(
            call.hidden_size, dtype=call.dtype, device=call.device)
        out = torch.empty_like(x)
        if call.residual is None:
            ops.rmsnorm(x, weight, out, call.eps)
            return out
        h = torch.empty_like(x)
        ops.add_rmsnorm(x, call.residual.contiguous(), residual_output=h, weight=weight, eps=call.eps, output=out)
        return out, h
