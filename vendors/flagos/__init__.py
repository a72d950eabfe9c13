"""Built-in plugin `flagos`: FlagGems (FlagOS) Triton attention kernels, forward only."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import FlagGemsAttention
from ._rms_norm import FlagGemsRmsNorm

__all__ = ["FlagGemsAttention", "FlagGemsRmsNorm"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [FlagGemsAttention(), FlagGemsRmsNorm()]
