"""Profiler ranges: while a profiler records, each dispatched call is a range ``opdispatch.<op>[<implementation>]``.

`torch.profiler` (and the legacy autograd profiler) sees a `record_function` range; with ``OPDISPATCH_NVTX=1`` a CUDA
call is also an NVTX range (Nsight Systems shows it around the kernels). `profiling()` joins every front door's
fast-path key, so a function bound while no profiler records carries no range and costs nothing more, and one bound
while it records is used only then. The range's metadata is the call's class (its decision's call description).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["call_range", "profiling", "range_name", "ranged"]

_profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled
_NVTX = os.environ.get("OPDISPATCH_NVTX") == "1"


def _always() -> bool:
    return True


# Whether calls are recorded as ranges now (a front door's fast-path key context: True or False). torch's own
# builtin where it can be: the compiled door calls it on every call.
profiling: Callable[[], bool] = _always if _NVTX else _profiler_enabled


def range_name(op: str, impl_id: str) -> str:
    return f"opdispatch.{op}[{impl_id}]"


@functools.cache
def _nvtx_on() -> bool:
    return _NVTX and torch.cuda.is_available()


@contextlib.contextmanager
def call_range(name: str, described: str) -> Iterator[None]:
    """A range `name` (see `range_name`) with `described` (the call's class) as its metadata: a torch.profiler
    range, and an NVTX range too with OPDISPATCH_NVTX=1 on CUDA."""
    with torch.autograd.profiler.record_function(name, described):
        if not _nvtx_on():
            yield
            return
        nvtx: Any = torch.cuda.nvtx
        nvtx.range_push(name)
        try:
            yield
        finally:
            nvtx.range_pop()


def ranged(fn: Callable[..., Any], op: str, impl_id: str, described: str) -> Callable[..., Any]:
    """`fn` inside a range named for `op` and `impl_id`, with `described` (the call's class) as its metadata."""
    name = range_name(op, impl_id)

    def in_range(*tensors: Any) -> Any:
        with call_range(name, described):
            return fn(*tensors)

    return in_range
