"""Built-in plugin `torch_flex`: torch's FlexAttention, compiled, as the fused fallback for calls the vendor
kernels cannot take (implementation `torch.flex`)."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import FlexOptions, TorchFlexAttention

__all__ = ["FlexOptions", "TorchFlexAttention"]

OPDISPATCH_NAMESPACES = ("torch",)  # torch.flex: torch's own FlexAttention


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [TorchFlexAttention()]
