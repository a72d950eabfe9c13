"""Fake NVIDIA `apex.normalization.fused_layer_norm` (NVIDIA/apex HEAD 3c53cf8).

Signatures as there: ``fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False)``,
``fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False)``; autograd flows (apex's are autograd
Functions); the input is made contiguous inside; the output has the input's dtype.
"""

from __future__ import annotations

import types

from ._norm import rms_norm_f32


def make(calls: list) -> dict[str, types.ModuleType]:
    apex = types.ModuleType("apex")
    apex.__path__ = []  # a package
    apex.__version__ = "0.1"
    normalization = types.ModuleType("apex.normalization")
    normalization.__path__ = []
    mod = types.ModuleType("apex.normalization.fused_layer_norm")

    def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append(("fused_rms_norm_affine", tuple(normalized_shape), eps))
        assert tuple(normalized_shape) == (input.shape[-1],) and weight.dtype == input.dtype
        return rms_norm_f32(input.contiguous(), weight, eps)

    def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append(("fused_rms_norm", tuple(normalized_shape), eps))
        assert tuple(normalized_shape) == (input.shape[-1],)
        return rms_norm_f32(input.contiguous(), None, eps)

    mod.fused_rms_norm_affine = fused_rms_norm_affine
    mod.fused_rms_norm = fused_rms_norm
    normalization.fused_layer_norm = mod
    apex.normalization = normalization
    extension = types.ModuleType("fused_layer_norm_cuda")  # apex's compiled extension (built with --cuda_ext)
    return {"apex": apex, "apex.normalization": normalization, "apex.normalization.fused_layer_norm": mod,
            "fused_layer_norm_cuda": extension}
