"""What the probes of PrivateUse1 devices (torch_npu's ``npu``, torch_mlu's ``mlu``, torch_musa's ``musa``) share."""

from __future__ import annotations

import sys
from typing import Any

from ._versions import installed_versions

__all__ = ["private_use1_backend"]


def private_use1_backend(device: Any, device_type: str, module: str, distribution: str
                         ) -> tuple[Any, int, dict[str, str]] | None:
    """For a `device_type` device whose torch extension `module` is already imported: (``torch.<device_type>``, the
    device index — its own or the current one —, the torch and `distribution` versions); else None. Imports
    nothing new: whoever made the device's tensor imported the extension, and a probe must not."""
    if getattr(device, "type", None) != device_type or module not in sys.modules:
        return None
    import torch  # already imported by whoever made the torch.device

    backend: Any = getattr(torch, device_type)  # the extension registered it when imported
    index = device.index if device.index is not None else int(backend.current_device())
    libraries = {"torch": torch.__version__.split("+")[0], **installed_versions({module: distribution})}
    return backend, index, libraries
