"""Shared by the contract tests of adapters whose library exists only on accelerators (FA4, vLLM's fork, aiter):
the adapter runs on CPU behind a fake of its library, first in the policy order; selection is checked on simulated
devices that declare the library."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import torch

from tests.conftest import device_descriptor
from tests.conftest import TOLERANCES
from tests.fakes import install

# Low-precision agreement with the float64 oracle (the fakes compute in float64, then round to the dtype): the
# suite's one elementwise table (opdispatch.base._tolerance.ELEMENTWISE, through the conftest).
TOL = TOLERANCES


def unbound_from_device(adapter: type, name: str) -> Any:
    """The adapter itself as vendor 'test' named `name`, unbound from its hardware (no device type, vendor, arch
    or capability, no library requirement) so its fake runs it on CPU; device checks are the simulated tests'."""
    return type(f"Cpu_{name}", (adapter,), dict(
        vendor="test", name=name, device_types=frozenset(), device_vendors=frozenset(), archs=frozenset(),
        min_capability=None, max_capability=None, requires=(),
        __doc__=f"{adapter.__name__} unbound from its hardware (tests/_adapters_on_cpu.py)."))()


def run_on_cpu(monkeypatch: Any, manager: Any, tmp_path: Path, modules: dict[str, Any], impl: Any,
               options: dict[str, Any] | None = None) -> Any:
    """Install the fake `modules`, register `impl` (a CPU-bound subclass of the adapter, vendor 'test') and put
    it first in the attention order, with `options` (the policy's `options` for it) when given."""
    install(monkeypatch, modules)
    manager.register_impl(impl)
    path = tmp_path / "order.yaml"
    text = "version: 1\nops:\n  attention:\n    order: ['test.*', cpu.flash, reference.math]\n"
    if options:
        text += f"    options:\n      {impl.id}: {json.dumps(options)}\n"
    path.write_text(text)
    manager.set_policy(path)
    return manager


def device_with_library(tmp_path: Path, device: str, library: str, version: str) -> str:
    """A copy of a shipped device descriptor that also declares `library` installed at `version`."""
    text = device_descriptor(device).read_text().replace("libraries:\n", f"libraries:\n  {library}: \"{version}\"\n")
    path = tmp_path / f"{device}-{library}.yaml"
    path.write_text(text)
    return str(path)


def meta_qkv(b: int = 2, sq: int = 256, sk: int = 256, hq: int = 16, hkv: int = 4, d: int = 128,
             grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bshd bf16 q/k/v on the meta device (selection only)."""
    meta: dict[str, Any] = dict(device="meta", dtype=torch.bfloat16, requires_grad=grad)
    return (torch.empty(b, sq, hq, d, **meta), torch.empty(b, sk, hkv, d, **meta),
            torch.empty(b, sk, hkv, d, **meta))
