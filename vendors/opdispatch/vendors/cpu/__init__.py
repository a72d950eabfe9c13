"""Built-in plugin `cpu`: torch's fused CPU attention kernel."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import CpuFlashAttention

__all__ = ["CpuFlashAttention"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [CpuFlashAttention()]
