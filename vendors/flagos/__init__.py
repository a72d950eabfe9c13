"""Built-in plugin `flagos`: FlagGems (FlagOS) Triton attention kernels, forward only."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import FlagGemsAttention

__all__ = ["FlagGemsAttention"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [FlagGemsAttention()]
