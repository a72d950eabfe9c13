"""CUDA-graph capture safety, checked on CPU by simulating capture (tests/gpu/ captures for real)."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch import _graphs
from opdispatch._graphs import CaptureError, ensure_capture_safe, is_capturing, raise_if_capturing


def _call(seq: int = 4) -> opdispatch.AttentionCall:
    q = torch.randn(1, seq, 2, 8)
    return opdispatch.validate_attention(q, q, q)


def test_not_capturing_on_cpu():
    assert is_capturing(torch.device("cpu")) is False
    assert is_capturing("cpu") is False
    ensure_capture_safe(opdispatch.get_manager(), "attention", _call())
    raise_if_capturing("attention", _call())


def test_uncached_decision_during_capture_raises(basic_manager, monkeypatch):
    monkeypatch.setattr(_graphs, "is_capturing", lambda device: True)
    call = _call(5)
    with pytest.raises(CaptureError, match="run the model once eagerly") as info:
        ensure_capture_safe(basic_manager, "attention", call)
    assert "q=(1, 5, 2, 8)" in str(info.value)
    assert isinstance(info.value, opdispatch.OpDispatchError)
    with pytest.raises(CaptureError):
        raise_if_capturing("attention", call)


def test_cached_decision_during_capture_passes(basic_manager, monkeypatch):
    call = _call(6)
    basic_manager.resolve("attention", call)
    monkeypatch.setattr(_graphs, "is_capturing", lambda device: True)
    ensure_capture_safe(basic_manager, "attention", call)
    with pytest.raises(CaptureError):  # a pin is another decision
        ensure_capture_safe(basic_manager, "attention", call, impl="reference.math")


def test_uses_the_managers_cache_peek_when_it_has_one(monkeypatch):
    class Manager:
        def __init__(self, hit):
            self.hit, self.asked = hit, []

        def cached_decision(self, op, call, impl=None):
            self.asked.append((op, impl))
            return object() if self.hit else None

    monkeypatch.setattr(_graphs, "is_capturing", lambda device: True)
    hit = Manager(True)
    ensure_capture_safe(hit, "attention", _call(), impl="cpu.flash")
    assert hit.asked == [("attention", "cpu.flash")]
    with pytest.raises(CaptureError):
        ensure_capture_safe(Manager(False), "attention", _call())
