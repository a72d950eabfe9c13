"""Built-in plugin `kunlunxin`: KunLunXin XPUs (P800, R200…) under KunLunXin's torch stack.

KunLunXin devices appear as torch device type ``cuda``: "Kunlunxin hardware masquerades as a CUDA device via
torch_xmlir" (flagos-ai/vllm-plugin-FL `vendor/kunlunxin/kunlunxin.py`, which detects it by `import torch_xmlir`
succeeding while CUDA devices exist; baidu/vLLM-Kunlun's platform likewise uses device_type "cuda"). This probe
uses the same signal without importing anything: `torch_xmlir` already imported or findable on the path, on a
torch that is neither ROCm (`torch.version.hip`) nor CoreX (`torch.corex`). Architecture from the product name
(P800 is KunLunXin's third generation, `xpu3`; R200/R300 the second, `xpu2`), else `kunlunxin`.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from opdispatch import DeviceInfo, Impl, hookimpl
from opdispatch.plugins.toolkit import installed_versions

from ._attention import KunlunxinPrefill
from ._rms_norm import KunlunRmsNorm

__all__ = ["KunlunRmsNorm", "KunlunxinPrefill", "has_torch_xmlir", "probe_kunlunxin_device"]

_ARCH_BY_PRODUCT = (("P800", "xpu3"), ("R200", "xpu2"), ("R300", "xpu2"))


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [KunlunxinPrefill(), KunlunRmsNorm()]


@hookimpl
def opdispatch_probe_device(device: Any) -> DeviceInfo | None:
    return probe_kunlunxin_device(device)


def has_torch_xmlir() -> bool:
    if "torch_xmlir" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_xmlir") is not None
    except (ImportError, ValueError):
        return False


def arch_from_name(name: str) -> str:
    upper = name.upper()
    for product, arch in _ARCH_BY_PRODUCT:
        if product in upper:
            return arch
    return "kunlunxin"


def probe_kunlunxin_device(device: Any) -> DeviceInfo | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # already imported by whoever made the torch.device

    if getattr(torch.version, "hip", None) or hasattr(torch, "corex") or not has_torch_xmlir():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    libraries = {"torch": torch.__version__.split("+")[0],
                 **installed_versions(("torch_xmlir", "kunlun_ops", "xtorch_ops"))}
    return DeviceInfo(
        vendor="kunlunxin", type="cuda", arch=arch_from_name(str(props.name)), name=str(props.name), index=index,
        capability=None, memory_bytes=int(props.total_memory),
        multiprocessors=int(getattr(props, "multi_processor_count", 0)) or None, libraries=libraries,
    )
