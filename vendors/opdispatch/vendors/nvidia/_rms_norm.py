"""`nvidia.apex_rms_norm`: NVIDIA apex's fused RMSNorm CUDA kernels (`apex.normalization.fused_layer_norm`).

Signatures read from NVIDIA/apex `apex/normalization/fused_layer_norm.py` (HEAD 3c53cf8):
``fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False)`` and
``fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False)`` — autograd Functions (or custom ops
with an autograd formula), input made contiguous inside, the output in the input's dtype. The weight must have
the input's dtype here (apex's ``mixed_dtype_*`` variants return the weight's dtype instead, which this op does
not promise). With a residual the adapter adds it first (``h = x + residual``), as apex has no fused add.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import Requirement, RmsNormCall, RmsNormCaps, RmsNormImpl

# apex imports without its CUDA extensions (a plain `pip install apex` builds none): require the compiled module
# the fused norms load, so an apex without it is "unavailable" with the build command, not a failure at run time.
APEX = Requirement(module="fused_layer_norm_cuda", distribution="apex", key="apex",
                   install_hint=("build NVIDIA apex with its CUDA extensions: git clone https://github.com/NVIDIA/apex "
                                 "&& cd apex && pip install -v --no-build-isolation --config-settings "
                                 "'--build-option=--cpp_ext' --config-settings '--build-option=--cuda_ext' ."))


class ApexRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "apex_rms_norm"
    priority: ClassVar[int] = 15
    description: ClassVar[str] = "NVIDIA apex fused RMSNorm (fused_rms_norm_affine / fused_rms_norm), autograd"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    requires = (APEX,)
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), weight_optional=True, residual=True,
        backward=True, weight_dtype_of_x=True)


    def run(self, call: RmsNormCall) -> Any:
        from apex.normalization import fused_layer_norm as apex_norm

        h = call.x if call.residual is None else call.x + call.residual
        shape = [call.hidden_size]
        if call.weight is None:
            y = apex_norm.fused_rms_norm(h, shape, call.eps)
        else:
            y = apex_norm.fused_rms_norm_affine(h, call.weight, shape, call.eps)
        return y if call.residual is None else (y, h)
