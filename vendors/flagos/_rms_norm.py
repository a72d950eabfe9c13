"""`flagos.rms_norm`: FlagGems' Triton RMSNorm (`flag_gems.rms_norm`, with autograd) and fused add + RMSNorm
(`flag_gems.fused_add_rms_norm`, forward only).

Signatures read from flag_gems 5.0.2: ``rms_norm(x, normalized_shape, weight, eps=1e-5)`` (an autograd Function;
weight required) and ``fused_add_rms_norm(x, residual, normalized_shape, weight, eps=1e-5)``, which writes the
normalised result into ``x`` and ``x + residual`` into ``residual`` **in place** and returns them. The adapter
hands it copies, so the caller's tensors are never modified.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RmsNormCall, RmsNormCaps, RmsNormImpl

from ._attention import FLAG_GEMS


class FlagGemsRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "flagos"
    name: ClassVar[str] = "rms_norm"
    priority: ClassVar[int] = 20
    description: ClassVar[str] = "FlagGems Triton RMSNorm (flag_gems.rms_norm / fused_add_rms_norm)"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    requires = (FLAG_GEMS,)
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), weight_optional=False, residual=True,
        backward=True)

    def extra_reasons(self, call: RmsNormCall, device: Any) -> list[str]:
        if call.residual is not None and call.requires_grad:
            return ["fused_add_rms_norm has no backward (it works in place); training with a residual is not "
                    "supported"]
        return []

    def selection_key(self, call: RmsNormCall) -> Any:
        return ()  # extra_reasons reads flags only

    def run(self, call: RmsNormCall) -> Any:
        import flag_gems

        assert call.weight is not None
        shape = [call.hidden_size]
        if call.residual is None:
            return flag_gems.rms_norm(call.x, shape, call.weight, call.eps)
        y, h = flag_gems.fused_add_rms_norm(call.x.clone(), call.residual.clone(), shape, call.weight, call.eps)
        return y, h
