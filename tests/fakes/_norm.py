"""RMSNorm math for the fake vendor kernels, in float32 — written independently of opdispatch's reference."""

from __future__ import annotations

import torch


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    inv = torch.rsqrt(xf.square().sum(-1, keepdim=True) / x.shape[-1] + eps)
    y = xf * inv
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
