"""CUDA graphs: a decision needed during stream capture must already be cached.

Deciding probes devices, may import vendor libraries and allocates Python state; inside
``torch.cuda.graph(...)`` capture that is at best invisible to replay and at worst an illegal host sync. The
rule is simple: run each call signature once eagerly (the usual warm-up before capture does this), then
capture. A decision that is missing during capture raises `CaptureError` saying exactly that.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base._errors import OpDispatchError

__all__ = ["CaptureError", "ensure_capture_safe", "is_capturing", "raise_if_capturing"]


class CaptureError(OpDispatchError, RuntimeError):
    """A decision was needed while a CUDA graph was being captured."""


def is_capturing(device: Any) -> bool:
    """Whether CUDA graph capture is under way on the current stream of `device` (a torch.device or its type).

    Cheap and safe everywhere: False for non-CUDA devices and on builds without CUDA, without touching CUDA.
    """
    device_type = device if isinstance(device, str) else getattr(device, "type", None)
    # Not `torch.cuda.is_available()`: it reads the environment on every call (~5 µs on an H100 host, paid by
    # each new signature of a decode loop). Capture needs an initialized CUDA context, so without one there is none.
    if device_type != "cuda" or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    return torch.cuda.is_current_stream_capturing()


def _capture_error(op: str, call: Any) -> CaptureError:
    describe = call.describe() if hasattr(call, "describe") else repr(call)
    return CaptureError(
        f"{op}: a call signature first seen while a CUDA graph is being captured; deciding or a kernel's first "
        f"call at a new shape during capture is not allowed (it probes devices and libraries, may build a "
        f"kernel plan, and may sync with the host).\n"
        f"call: {describe}\n"
        f"Fix: run the model once eagerly with the same shapes, dtypes and flags before capture (the usual "
        f"warm-up iterations on a side stream do this), or bind the call up front with opdispatch.plan(...).")


def raise_if_capturing(op: str, call: Any) -> None:
    """Call on a decision-cache miss, before deciding: raises CaptureError when capture is under way."""
    if is_capturing(call.device):
        raise _capture_error(op, call)


def ensure_capture_safe(manager: Any, op: str, call: Any, impl: str | None = None) -> None:
    """Raise CaptureError if `call` needs a decision that `manager` has not cached while capture is under way.

    Outside capture this returns at once. During capture it asks the manager whether the decision is cached,
    through ``manager.cached_decision(op, call, impl=impl)`` (a lookup that never decides).
    """
    if not is_capturing(call.device):
        return
    cached = manager.cached_decision(op, call, impl=impl)
    if cached is None:
        raise _capture_error(op, call)
