"""Built-in plugin `iluvatar`: Iluvatar CoreX GPUs (BI-V100, BI-V150, MR-V100…) under CoreX's torch build.

CoreX GPUs appear as torch device type ``cuda``. Detection uses the signals the CoreX stack itself gives, in this
order, all without touching the GPU or importing anything new:

- the CoreX torch build exposes `torch.corex` (FlagGems `runtime/common.py` `_VENDOR_TORCH_ATTR["iluvatar"] =
  "corex"`), and its version carries a `+corex` local tag (e.g. `2.7.1+corex.4.4.0`);
- not a ROCm build (`torch.version.hip` unset).

The device name (`Iluvatar BI-V150`) comes from torch; the architecture from the product name (BI-V150 is
`ivcore11`, BI-V100/MR-V100 `ivcore10`: the CoreX compiler's targets), else `corex`.
"""

from __future__ import annotations

from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import installed_versions

from ._attention import IluvatarIxformer
from ._rms_norm import IxformerRmsNorm

__all__ = ["IluvatarIxformer", "IxformerRmsNorm", "is_corex_torch", "probe_iluvatar_device"]

_ARCH_BY_PRODUCT = (("BI-V150", "ivcore11"), ("BI-V100", "ivcore10"), ("MR-V100", "ivcore10"))


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [IluvatarIxformer(), IxformerRmsNorm()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_iluvatar_device(device)


def is_corex_torch(torch: Any) -> bool:
    if getattr(getattr(torch, "version", None), "hip", None):
        return False
    return hasattr(torch, "corex") or "corex" in str(getattr(torch, "__version__", ""))


def arch_from_name(name: str) -> str:
    upper = name.upper()
    for product, arch in _ARCH_BY_PRODUCT:
        if product in upper:
            return arch
    return "corex"


def probe_iluvatar_device(device: Any) -> DeviceInfo | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # already imported by whoever made the torch.device

    if not is_corex_torch(torch):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    libraries = {"torch": torch.__version__.split("+")[0], **installed_versions(("ixformer",))}
    return DeviceInfo(
        vendor="iluvatar", type="cuda", arch=arch_from_name(str(props.name)), name=str(props.name), index=index,
        capability=(int(props.major), int(props.minor)), memory_bytes=int(props.total_memory),
        multiprocessors=int(props.multi_processor_count), libraries=libraries,
    )
