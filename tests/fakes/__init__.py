"""Fake vendor libraries for contract tests: real signatures, real attention math, every call recorded."""

from __future__ import annotations

import importlib.machinery
import types

import pytest


def install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType]) -> None:
    """Put fake modules into sys.modules (with a spec, so importlib.util.find_spec finds them)."""
    for name, mod in modules.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=hasattr(mod, "__path__"))
        monkeypatch.setitem(__import__("sys").modules, name, mod)
