"""`reference.rms_norm` (composite torch ops in float32/float64, any device, autograd) and `torch.rms_norm`
(torch's own `torch.rms_norm`: one fused kernel on CUDA, autograd, any device)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RmsNormCall, RmsNormCaps, RmsNormImpl

_ALL = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_torch_rms_norm = torch.rms_norm  # the C++-bound functional: the cheapest entry


def _added(call: RmsNormCall) -> torch.Tensor:
    return call.x if call.residual is None else call.x + call.residual


class ReferenceRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "reference"
    name: ClassVar[str] = "rms_norm"
    priority: ClassVar[int] = -100
    reference_fallback: ClassVar[bool] = True
    description: ClassVar[str] = "RMSNorm from composite torch ops, statistics in float32 (float64 for float64)"
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(dtypes=_ALL, weight_optional=True, residual=True, backward=True)

    def run(self, call: RmsNormCall) -> Any:
        h = _added(call)
        wide = h.to(call.stats_dtype)
        y = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + call.eps)
        if call.weight is not None:
            y = y * call.weight.to(call.stats_dtype)
        y = y.to(call.dtype)
        return y if call.residual is None else (y, h)


class TorchRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "torch"
    name: ClassVar[str] = "rms_norm"
    priority: ClassVar[int] = 10
    description: ClassVar[str] = "torch.rms_norm (aten rms_norm: a fused kernel on CUDA, composite elsewhere)"
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(dtypes=_ALL, weight_optional=True, residual=True, backward=True)

    def extra_reasons(self, call: RmsNormCall, device: Any) -> list[str]:
        # aten rms_norm multiplies by a weight of x's dtype; a weight of another dtype would be promoted.
        if call.weight is not None and call.weight.dtype != call.dtype:
            return [f"weight dtype {call.weight.dtype} differs from x's {call.dtype} (torch.rms_norm wants one "
                    "dtype)"]
        return []

    def selection_key(self, call: RmsNormCall) -> Any:
        return call.weight is None or call.weight.dtype == call.dtype

    def run(self, call: RmsNormCall) -> Any:
        h = _added(call)
        y = _torch_rms_norm(h, (call.hidden_size,), call.weight, call.eps)
        return y if call.residual is None else (y, h)
