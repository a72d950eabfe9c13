"""Built-in plugin `nvidia`: torch's CUDA attention kernels (cuDNN, FlashAttention-2, memory-efficient), the
flash-attn package (FA2, FA3 on Hopper, FA4 `flash_attn.cute` on Hopper/Blackwell), vLLM's FlashAttention fork
(`vllm.vllm_flash_attn`, FA3 on Hopper, inference), cuDNN's SDPA through the cuDNN frontend's Python graph API
(`cudnn`, bf16/fp16 and FP8), torch's FP8 SDPA over FA3 activated in torch (`sdpa_quantized`), and the NVIDIA
device probe."""

from __future__ import annotations

from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl

from ._attention import CudnnAttention, FlashAttn2, FlashAttn3, MemEfficientAttention, TorchFlashAttention
from ._cudnn_frontend import CudnnFrontendAttention
from ._flash_attn4 import FlashAttn4
from ._vllm_flash_attn import VllmFlashAttn
from ._rms_norm import ApexRmsNorm
from ._sdpa_quantized import QuantizedSdpa
from ._probe import probe_nvidia
from ._rotary import FlashRotary

__all__ = ["ApexRmsNorm", "CudnnAttention",
           "CudnnFrontendAttention", "FlashAttn2", "FlashAttn3", "FlashAttn4", "FlashRotary",
           "MemEfficientAttention", "QuantizedSdpa",
           "TorchFlashAttention", "VllmFlashAttn", "probe_nvidia"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [CudnnAttention(), TorchFlashAttention(), MemEfficientAttention(), FlashAttn2(), FlashAttn3(), FlashAttn4(),
            VllmFlashAttn(), QuantizedSdpa(), CudnnFrontendAttention(), FlashRotary(),
            ApexRmsNorm()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_nvidia(device)
