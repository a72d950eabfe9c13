"""`rocm.aiter_rms_norm`: AMD aiter's RMSNorm kernels (forward only).

Signatures read from ROCm/aiter `aiter/ops/rmsnorm.py` (HEAD 0bc300f), exported at the package top level:
``rms_norm(input, weight, epsilon, use_model_sensitive_rmsnorm=0) -> Tensor`` and
``rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, gemma_norm=False, ...)``, which
writes ``out = rmsnorm(input + residual_in) * weight`` and ``residual_out = input + residual_in`` into the given
buffers (fresh ones here, so the caller's tensors are never written). fp16/bf16/fp32, the weight in the input's
dtype and contiguous, residuals contiguous; the input needs a unit last-dim stride (the kernel takes a row stride).
A call without weight passes ones.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import Requirement, RmsNormCall, RmsNormCaps, RmsNormImpl

AITER = Requirement(module="aiter", distribution="amd-aiter",
                    install_hint=("build AMD aiter: git clone --recursive https://github.com/ROCm/aiter && cd aiter && "
                                  "python3 setup.py develop (distribution amd-aiter; gfx942/gfx950)"))


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
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), weight_optional=True, residual=True,
        backward=False, weight_dtype_of_x=True)


    def run(self, call: RmsNormCall) -> Any:
        import aiter

        x = call.x.reshape(-1, call.hidden_size)
        if x.stride(-1) != 1:
            x = x.contiguous()
        weight = call.weight.contiguous() if call.weight is not None else torch.ones(
            call.hidden_size, dtype=call.dtype, device=call.device)
        if call.residual is None:
            return aiter.rms_norm(x, weight, call.eps).view(call.x.shape)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h = torch.empty_like(out)
        aiter.rmsnorm2d_fwd_with_add(out, x, call.residual.reshape(-1, call.hidden_size).contiguous(), h, weight,
                                     call.eps)
        return out.view(call.x.shape), h.view(call.x.shape)
