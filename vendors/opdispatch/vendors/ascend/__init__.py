"""Built-in plugin `ascend`: Huawei Ascend NPUs (910B…) under torch_npu (Ascend Extension for PyTorch).

torch_npu registers the PrivateUse1 backend as device type ``npu``, so an ``npu`` device is an Ascend one: the
probe claims exactly those, without importing anything (torch_npu is imported by whoever made an npu tensor). The
device name comes from `torch.npu.get_device_name` (e.g. ``Ascend910B2``); the architecture is that name
lower-cased up to the product generation (``ascend910b``), as FlagGems' and vLLM-Ascend's SoC checks read it.
"""

from __future__ import annotations

import re
from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import private_use1_backend

from ._attention import AscendFusionAttention

__all__ = ["AscendFusionAttention", "arch_from_name", "probe_ascend_device"]

_ARCH_RE = re.compile(r"ascend\s*(\d{3}[a-z]?)", re.IGNORECASE)


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [AscendFusionAttention()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_ascend_device(device)


def arch_from_name(name: str) -> str:
    """``Ascend910B2`` → ``ascend910b``; ``ascend`` when the name says no generation."""
    match = _ARCH_RE.search(name)
    return f"ascend{match.group(1).lower()}" if match else "ascend"


def probe_ascend_device(device: Any) -> DeviceInfo | None:
    found = private_use1_backend(device, "npu", "torch_npu", "torch-npu")
    if found is None:
        return None
    npu, index, libraries = found
    name = str(npu.get_device_name(index))
    return DeviceInfo(vendor="ascend", type="npu", arch=arch_from_name(name), name=name, index=index,
                      libraries=libraries)
