"""Fake vendor libraries for contract tests: real signatures, real attention math, every call recorded."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import types

import pytest


def install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType],
            distributions: dict[str, str] | None = None) -> None:
    """Put fake modules into sys.modules (with a spec, so importlib.util.find_spec finds them), and answer
    `importlib.metadata.version` for the pip `distributions` ({name: version}) installing them would bring."""
    for name, mod in modules.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=hasattr(mod, "__path__"))
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    if distributions:
        def canonical(name: str) -> str:
            return name.replace("-", "_").lower()

        fake = {canonical(n): v for n, v in distributions.items()}
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name: fake[canonical(name)] if canonical(name) in fake else real(name))
