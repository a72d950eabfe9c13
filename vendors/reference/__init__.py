"""Built-in plugin `reference`: pure-torch implementations that run anywhere and serve as numerical oracles."""

from __future__ import annotations

from opdispatch import Impl, hookimpl

from ._attention import ReferenceAttention

__all__ = ["ReferenceAttention"]


@hookimpl
def opdispatch_impls() -> list[Impl]:
    return [ReferenceAttention()]
