"""Built-in plugin `mthreads`: Moore Threads GPUs (MTT S4000…) under torch_musa.

torch_musa registers the PrivateUse1 backend as device type ``musa``, so a ``musa`` device is a Moore Threads one:
the probe claims exactly those, without importing anything (torch_musa is imported by whoever made a musa
tensor). The architecture is the device's mp version from `torch.musa.get_device_properties` (major.minor 2.2 →
``mp22``), what torch_musa's flash check (`check_musa_arch`) reads.
"""

from __future__ import annotations

from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import private_use1_backend

from ._attention import MthreadsSdpa

__all__ = ["MthreadsSdpa", "probe_mthreads_device"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [MthreadsSdpa()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_mthreads_device(device)


def probe_mthreads_device(device: Any) -> DeviceInfo | None:
    found = private_use1_backend(device, "musa", "torch_musa", "torch_musa")
    if found is None:
        return None
    musa, index, libraries = found
    props = musa.get_device_properties(index)
    return DeviceInfo(vendor="mthreads", type="musa", arch=f"mp{int(props.major)}{int(props.minor)}",
                      name=str(props.name), index=index, memory_bytes=int(props.total_memory), libraries=libraries)
