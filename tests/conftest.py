"""Shared fixtures: a fresh OpManager per test, random inputs, and tolerances per dtype."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton kernels (the fused KV-cache append) run on CPU tensors only through Triton's interpreter, which has to be
# chosen before Triton is first imported: on a machine without a GPU the suite runs them there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import opdispatch  # noqa: E402
from opdispatch.base import _native  # noqa: E402
from opdispatch.base._dtypes import dtype_from_name  # noqa: E402
from opdispatch.base._errors import OpDispatchError  # noqa: E402
from opdispatch.base._tolerance import ELEMENTWISE  # noqa: E402


def _build_the_compiled_fast_path() -> str | None:
    """Build opdispatch's compiled fast path before any front door is made (cached: only a first run compiles, ~30
    s), so the suite runs on it, as a user who ran `opdispatch build` does; tests/test_native.py compares it with
    the Python path case by case. OPDISPATCH_FAST_PATH=python runs the whole suite on the Python path. Returns why
    it did not build, or None."""
    if os.environ.get(_native.ENV, "auto").strip().lower() == "python":
        return None
    try:
        _native.build()
    except OpDispatchError as exc:
        return str(exc)
    _native.reset_status()
    return None


NATIVE_BUILD_ERROR = _build_the_compiled_fast_path()

REPO = Path(__file__).resolve().parents[1]
DEVICES_DIR = REPO / "configs" / "devices"

# Elementwise tolerances of an implementation against reference.math, by torch dtype: the library's one table
# (`opdispatch.base._tolerance`, beside the relative-norm bounds `opdispatch validate` applies).
TOLERANCES = {dtype_from_name(name): dict(tol) for name, tol in ELEMENTWISE.items()}


@pytest.fixture(params=["compiled", "python"])
def door(request):
    """opdispatch.attention through the compiled front door, and through the Python one
    (OPDISPATCH_FAST_PATH=python runs the latter everywhere)."""
    if request.param == "python":
        return _native.python_of(opdispatch.attention)
    if _native.native_module() is None:
        pytest.skip(f"the compiled fast path is not loaded: {NATIVE_BUILD_ERROR or _native.status().reason}")
    return _native.twin(opdispatch.attention)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests start from the shipped default policy and every plugin, whatever the developer's shell says.
    for name in list(__import__("os").environ):
        if name.startswith("OPDISPATCH_"):
            monkeypatch.delenv(name, raising=False)
    # Nor a quarantine `opdispatch validate` wrote on this machine: only the shipped one.
    monkeypatch.setenv("OPDISPATCH_QUARANTINE", "/nonexistent/opdispatch-test-quarantine.yaml")


@pytest.fixture
def manager() -> Iterator[opdispatch.OpManager]:
    """A fresh process-wide manager (entry points loaded anew) for one test."""
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    try:
        yield fresh
    finally:
        opdispatch.set_manager(previous)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def randn(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator | None = None,
          requires_grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
    return t.requires_grad_(requires_grad)


def device_descriptor(name: str) -> Path:
    return DEVICES_DIR / f"{name}.yaml"


@pytest.fixture
def basic_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[opdispatch.OpManager]:
    """A fresh manager with only the built-in `cpu` and `reference` plugins (through OPDISPATCH_PLUGINS)."""
    monkeypatch.setenv("OPDISPATCH_PLUGINS", "cpu,reference")
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    try:
        yield fresh
    finally:
        opdispatch.set_manager(previous)


@pytest.fixture
def resolves(basic_manager: opdispatch.OpManager, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The op of every decision `basic_manager` makes (its resolve() calls): a fast-path hit makes none."""
    seen: list[str] = []
    original = basic_manager.resolve

    def counting(op: str, call: Any, **kwargs: Any) -> Any:
        seen.append(op)
        return original(op, call, **kwargs)

    monkeypatch.setattr(basic_manager, "resolve", counting)
    return seen

