"""Built-in plugin `reference`: pure-torch implementations that run anywhere and serve as numerical oracles."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import ReferenceAttention
from ._rms_norm import ReferenceRmsNorm, TorchRmsNorm

__all__ = ["ReferenceAttention", "ReferenceRmsNorm", "TorchRmsNorm"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [ReferenceAttention(), ReferenceRmsNorm(), TorchRmsNorm()]
