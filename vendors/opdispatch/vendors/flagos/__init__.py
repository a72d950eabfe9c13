"""Built-in plugin `flagos`: FlagGems (FlagOS) Triton kernels (attention, rms_norm, rotary_embedding)."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import FlagGemsAttention
from ._flash_mla import FlagGemsFlashMLA
from ._rms_norm import FlagGemsRmsNorm
from ._rotary import FlagGemsRotary

__all__ = ["FlagGemsAttention", "FlagGemsFlashMLA", "FlagGemsRmsNorm", "FlagGemsRotary"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [FlagGemsAttention(), FlagGemsFlashMLA(), FlagGemsRmsNorm(), FlagGemsRotary()]
