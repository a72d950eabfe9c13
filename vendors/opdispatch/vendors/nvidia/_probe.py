"""Device probe for NVIDIA GPUs: capability, arch, SM count, memory, and the library versions impls depend on.

Several vendors share torch's ``cuda`` device type (ROCm/HIP, Iluvatar CoreX, some KunLunXin and MetaX builds);
the probe answers None for those, fast, so their own plugins can claim the device.
"""

from __future__ import annotations

from typing import Any

from opdispatch import DeviceInfo
from opdispatch.plugins.toolkit import installed_versions

# Device-name fragments of non-NVIDIA hardware that torch may still expose as ``cuda``.
_FOREIGN_NAMES = ("iluvatar", "corex", "metax", "kunlun", "mthreads", "musa", "hygon", "dcu", "amd", "radeon",
                  "instinct", "moore")

# (distribution, library key) pairs reported in DeviceInfo.libraries when installed; read from package
# metadata only, never imported (flag_gems raises at import on machines without a GPU).
_DISTRIBUTIONS = (("flash-attn", "flash_attn"), ("flash_attn_3", "flash_attn_3"), ("flag-gems", "flag_gems"),
                  ("triton", "triton"))


def _cudnn_version(torch: Any) -> str | None:
    try:
        if not torch.backends.cudnn.is_available():
            return None
        v = torch.backends.cudnn.version()  # e.g. 91900 (cuDNN >= 9) or 8907 (cuDNN 8)
    except Exception:
        return None
    if not v:
        return None
    if v >= 10000:
        return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
    return f"{v // 1000}.{(v // 100) % 10}.{v % 100}"


def library_versions(torch: Any) -> dict[str, str]:
    libs = {"torch": torch.__version__.split("+")[0]}
    if torch.version.cuda:
        libs["cuda"] = str(torch.version.cuda)
    cudnn = _cudnn_version(torch)
    if cudnn:
        libs["cudnn"] = cudnn
    libs.update(installed_versions({key: dist for dist, key in _DISTRIBUTIONS}))
    return libs


def is_nvidia_torch(torch: Any) -> bool:
    """Whether this torch build drives NVIDIA hardware through CUDA (not ROCm, CoreX or another fork)."""
    if getattr(torch.version, "hip", None):
        return False
    if not getattr(torch.version, "cuda", None):
        return False
    if hasattr(torch, "corex") or "corex" in torch.__version__.lower():
        return False
    return True


def probe_nvidia(device: Any) -> DeviceInfo | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    if not is_nvidia_torch(torch) or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    name = props.name
    if any(frag in name.lower() for frag in _FOREIGN_NAMES):
        return None
    cap = (int(props.major), int(props.minor))
    return DeviceInfo(
        vendor="nvidia", type="cuda", arch=f"sm{cap[0]}{cap[1]}", name=name, index=index, capability=cap,
        memory_bytes=int(props.total_memory), multiprocessors=int(props.multi_processor_count),
        libraries=library_versions(torch),
    )
