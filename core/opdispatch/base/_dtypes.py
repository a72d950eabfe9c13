"""Dtype names and capability declarations as data: what every op (attention, rms_norm, rotary) and the policy
layer read — a base module, importing torch only.

- `dtype_name` / `dtype_from_name`: the short names policies, the CLI and messages use (fp16, bf16, fp32, fp64,
  fp8_e4m3fn, fp8_e5m2; aliases half, float, double, fp8_e4m3).
- `dtype_reason`: the sentence an implementation's unsupported dtype gives; `caps_problems` / `caps_as_dict`:
  a capability dataclass checked at registration and shown as plain data.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

_DTYPE_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_SHORT[getattr(torch, _name)] = _name.replace("float8_", "fp8_")


# The FP8 kinds attention takes (q/k/v with descales; `float8_e4m3fn` is what `fp8_e4m3` names in policies and the CLI).
FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
# What an FP8 call's output may be (its default: bfloat16, as FA3 and torch's quantized SDPA return).
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
_DTYPE_ALIASES = {"half": torch.float16, "float": torch.float32, "double": torch.float64}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_ALIASES["fp8_e4m3"] = torch.float8_e4m3fn


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def dtype_from_name(name: str) -> torch.dtype:
    """`bf16`, `bfloat16`, `torch.bfloat16` → torch.bfloat16 (ValueError listing the allowed names otherwise)."""
    key = name.strip().lower().replace("torch.", "")
    for dtype, short in _DTYPE_SHORT.items():
        if key in (short, str(dtype).replace("torch.", "")):
            return dtype
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    allowed = sorted(set(_DTYPE_SHORT.values()) | set(_DTYPE_ALIASES))
    raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(allowed)}")


def caps_problems(caps: Any, caps_type: type) -> list[str]:
    """What is wrong with an op's declared `caps` (any op whose capability dataclass has `dtypes`)."""
    if not isinstance(caps, caps_type):
        return [f"caps must be an opdispatch.{caps_type.__name__}, got {type(caps).__name__}"]
    dtypes = getattr(caps, "dtypes", None)
    if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
        return ["caps.dtypes must be a non-empty set of torch dtypes"]
    return []


def dtype_reason(dtype: torch.dtype, supported: frozenset[torch.dtype]) -> str | None:
    """The reason a call's dtype is not among an implementation's `supported` ones, or None."""
    if dtype in supported:
        return None
    return f"dtype {dtype_name(dtype)} not supported (supported: {', '.join(sorted(dtype_name(d) for d in supported))})"


def caps_as_dict(caps: Any) -> dict[str, Any]:
    """A capability dataclass (any op's) as plain data: dtypes by short name, sets sorted."""
    out: dict[str, Any] = {}
    for f in fields(caps):
        value = getattr(caps, f.name)
        if f.name == "dtypes":
            value = sorted(dtype_name(d) for d in value)
        elif f.name == "fp8_out_dtypes":
            value = sorted(dtype_name(d) for d in value)
        elif isinstance(value, frozenset):
            value = sorted(value)
        out[f.name] = value
    return out
