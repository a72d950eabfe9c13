"""Built-in plugin `reference`: pure-torch implementations that run anywhere and serve as numerical oracles."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import ReferenceAttention
from ._rms_norm import ReferenceRmsNorm, TorchRmsNorm
from ._rotary import ReferenceRotary

__all__ = ["ReferenceAttention", "ReferenceRmsNorm", "ReferenceRotary", "TorchRmsNorm"]

OPDISPATCH_NAMESPACES = ("torch",)  # torch.rms_norm: torch's own kernel, beside the references


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [ReferenceAttention(), ReferenceRmsNorm(), TorchRmsNorm(), ReferenceRotary()]
