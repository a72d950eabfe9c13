"""benchmarks/dispatch_overhead.py runs (with and without opdispatch.plan) and prints a markdown table."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import opdispatch

from .conftest import REPO


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("dispatch_overhead", REPO / "benchmarks" / "dispatch_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_markdown_row_per_size(script, basic_manager):
    text = script.markdown(torch.device("cpu"), [(1, 1, 1, 8)], repeat=1)
    assert "| (1, 1, 1, 8) | cpu.flash |" in text
    assert "plan: not available yet" in text or "plan: available" in text


def test_plan_column_when_plan_exists(script, basic_manager, monkeypatch):
    def plan(q, k, v, **kwargs):
        return lambda q, k, v: opdispatch.attention(q, k, v, **kwargs)

    monkeypatch.setattr(opdispatch, "plan", plan, raising=False)
    result = script.bench_size((1, 1, 1, 8), torch.device("cpu"), repeat=1)
    assert set(result) == {"direct", "impl.run", "pinned", "policy", "plan", "impl"}
