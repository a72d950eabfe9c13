"""`rocm.aiter_rms_norm`: AMD aiter's RMSNorm kernels (forward only).

Signatures read from ROCm/aiter `aiter/ops/rmsnorm.py` (HEAD 0bc300f), exported at the package top level:
``rms_norm(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor`` and
``rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, gemma_norm=False, ...)``, which
writes ``out = rmsnorm(input + residual_in) * weight`` and ``residual_out = input + residual_in`` into the given
buffers (fresh ones here, so the caller's tensors are never written). fp16/bf16 (fp32 only in newer releases), the
weight in the input's dtype and contiguous, inputs as contiguous rows (0.1.9 derives the row stride from the shape).
A call without weight passes ones.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RmsNormCall, RmsNormCaps, RmsNormImpl

from ._attention import AITER



class AiterRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "rocm"
    name: ClassVar[str] = "aiter_rms_norm"
    priority: ClassVar[int] = 15
    description: ClassVar[str] = "AMD aiter RMSNorm (aiter.rms_norm / rmsnorm2d_fwd_with_add), forward only"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"amd"})
    archs: ClassVar[frozenset[str]] = frozenset({"gfx942", "gfx950"})  # aiter's supported hardware
    requires = (AITER,)
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), weight_optional=True, residual=True,
        backward=False, weight_dtype_of_x=True)  # fp32: only newer aiter (the opus kernels), so not claimed


    def run(self, call: RmsNormCall) -> Any:
        import aiter

        # Contiguous rows: older aiter (0.1.9) derives the row stride from the shape, not from the tensor.
        x = call.x.reshape(-1, call.hidden_size).contiguous()
        weight = call.weight.contiguous() if call.weight is not None else torch.ones(
            call.hidden_size, dtype=call.dtype, device=call.device)
        if call.residual is None:
            return aiter.rms_norm(x, weight, call.eps).view(call.x.shape)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h = torch.empty_like(out)
        aiter.rmsnorm2d_fwd_with_add(out, x, call.residual.reshape(-1, call.hidden_size).contiguous(), h, weight,
                                     call.eps)
        return out.view(call.x.shape), h.view(call.x.shape)
