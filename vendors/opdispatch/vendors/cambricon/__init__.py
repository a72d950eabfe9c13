"""Built-in plugin `cambricon`: Cambricon MLUs (MLU590…) under torch_mlu (Cambricon MLU Extension for PyTorch).

torch_mlu registers the PrivateUse1 backend as device type ``mlu``, so an ``mlu`` device is a Cambricon one: the
probe claims exactly those, without importing anything (torch_mlu is imported by whoever made an mlu tensor). The
name comes from `torch.mlu.get_device_name` (e.g. ``MLU590``); the architecture is that name lower-cased
(``mlu590``), the product whose generation torch_mlu's fused-kernel check reads.
"""

from __future__ import annotations

import re
from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import private_use1_backend

from ._attention import CambriconSdpa

__all__ = ["CambriconSdpa", "arch_from_name", "probe_cambricon_device"]

_ARCH_RE = re.compile(r"mlu\s*-?(\d{3})", re.IGNORECASE)


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [CambriconSdpa()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_cambricon_device(device)


def arch_from_name(name: str) -> str:
    """``MLU590-M9`` → ``mlu590``; ``mlu`` when the name says no product."""
    match = _ARCH_RE.search(name)
    return f"mlu{match.group(1)}" if match else "mlu"


def probe_cambricon_device(device: Any) -> DeviceInfo | None:
    found = private_use1_backend(device, "mlu", "torch_mlu", "torch_mlu")
    if found is None:
        return None
    mlu, index, libraries = found
    name = str(mlu.get_device_name(index))
    return DeviceInfo(vendor="cambricon", type="mlu", arch=arch_from_name(name), name=name, index=index,
                      libraries=libraries)
