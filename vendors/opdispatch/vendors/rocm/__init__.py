"""Built-in plugin `rocm`: AMD GPUs under a ROCm build of torch.

Detection uses only what the ROCm stack exposes through torch, which the caller has already imported:
`torch.version.hip` is a version string on ROCm builds and None elsewhere; Hygon DCUs run a HIP-derived torch
too and are told apart by `torch.__hcu_version__` (FlagGems `runtime/common.py` `_VENDOR_TORCH_ATTR`); the
architecture is `gcnArchName` up to the first ':' (`gfx942:sramecc+:xnack-` → `gfx942`, as AOTriton's
`gcnArchNameSansColon`). Library versions come from package metadata, never by importing the libraries.
"""

from __future__ import annotations

from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import installed_versions

from ._attention import RocmAiter, RocmAOTriton, RocmFlashAttnCK
from ._rms_norm import AiterRmsNorm

__all__ = ["AiterRmsNorm", "RocmAOTriton", "RocmAiter", "RocmFlashAttnCK", "probe_rocm_device"]

# Requirement key -> distribution whose version the probe reports.
_LIBRARIES = {"flash_attn": "flash_attn", "aiter": "amd-aiter"}


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [RocmAiter(), RocmFlashAttnCK(), RocmAOTriton(), AiterRmsNorm()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_rocm_device(device)


def is_rocm_torch(torch: Any) -> bool:
    return bool(getattr(getattr(torch, "version", None), "hip", None)) and not hasattr(torch, "__hcu_version__")


def probe_rocm_device(device: Any) -> DeviceInfo | None:
    """Describe `device` if it is an AMD GPU seen through a ROCm torch, else None (without touching the GPU)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # already imported by whoever made the torch.device

    if not is_rocm_torch(torch):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or "gfx"
    libraries = {"torch": torch.__version__.split("+")[0], "hip": str(torch.version.hip),
                 **installed_versions(_LIBRARIES)}
    return DeviceInfo(
        vendor="amd", type="cuda", arch=arch, name=str(props.name), index=index,
        capability=(int(props.major), int(props.minor)), memory_bytes=int(props.total_memory),
        multiprocessors=int(props.multi_processor_count), libraries=libraries,
    )
