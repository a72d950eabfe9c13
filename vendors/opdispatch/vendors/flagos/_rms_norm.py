"""`flagos.rms_norm`: FlagGems' Triton RMSNorm (`flag_gems.rms_norm`, an autograd Function).

Signature read from flag_gems 5.0.2: ``rms_norm(x, normalized_shape, weight, eps=1e-5)`` (weight required). With a
residual the adapter adds it first (``h = x + residual``) and normalises ``h``. FlagGems' fused
``fused_add_rms_norm(x, residual, normalized_shape, weight, eps)`` is not used: it writes both results into its
inputs **in place** and has no backward, so keeping the caller's tensors intact would take two copies — measured
slower on an H100 than the add plus the unfused kernel (benchmarks/results/op_bench-h100.md).
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
    description: ClassVar[str] = "FlagGems Triton RMSNorm (flag_gems.rms_norm), autograd"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    requires = (FLAG_GEMS,)
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), weight_optional=False, residual=True,
        backward=True)

    def run(self, call: RmsNormCall) -> Any:
        import flag_gems

        assert call.weight is not None
        h = call.x if call.residual is None else call.x + call.residual
        y = flag_gems.rms_norm(h, [call.hidden_size], call.weight, call.eps)
        return y if call.residual is None else (y, h)
