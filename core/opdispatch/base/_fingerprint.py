"""The fingerprint a tuned table is valid for: the device, its driver and the library versions that time it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from typing import Any

import torch

__all__ = ["device_fingerprint", "fingerprint_hash"]

_DISTRIBUTIONS = {"flash_attn": "flash-attn", "flag_gems": "flag-gems", "flash_attn_3": "flash-attn-3",
                  "aiter": "aiter", "triton": "triton"}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version(device_type: str) -> str | None:
    if device_type != "cuda":
        return None
    if torch.version.hip:
        return None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            first = fh.readline()
        for token in first.split():
            if token.count(".") >= 1 and token.replace(".", "").isdigit():
                return token
    except OSError:
        pass
    return None


def device_fingerprint(device: Any) -> dict[str, str]:
    """What a tuned table is valid for: device, driver and library versions (a DeviceInfo in, text out).

    For a real device the versions are read from this process (torch, CUDA/HIP, cuDNN, driver, flash_attn,
    flag_gems, aiter, triton where installed); for a simulated one (a YAML descriptor) from its `libraries`.
    """
    fp: dict[str, str] = {"vendor": device.vendor, "type": device.type, "arch": device.arch, "name": device.name}
    if device.capability:
        fp["capability"] = f"{device.capability[0]}.{device.capability[1]}"
    libs = {str(k): str(v) for k, v in device.libraries.items()}
    if not device.simulated:
        libs["torch"] = str(torch.__version__)
        if device.type != "cpu":
            if torch.version.cuda:
                libs["cuda"] = str(torch.version.cuda)
            if torch.version.hip:
                libs["hip"] = str(torch.version.hip)
            if torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
                libs["cudnn"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
            driver = _driver_version(device.type)
            if driver:
                libs["driver"] = driver
            for key, dist in _DISTRIBUTIONS.items():
                version = _dist_version(dist)
                if version:
                    libs[key] = version
    for key in sorted(libs):
        fp[key] = libs[key]
    return fp


def fingerprint_hash(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
