"""CUDA-graph capture safety, checked on CPU by simulating capture (tests/gpu/ captures for real)."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.engine import _graphs
from opdispatch.engine._graphs import CaptureError, ensure_capture_safe, is_capturing, raise_if_capturing


def _call(seq: int = 4) -> opdispatch.AttentionCall:
    q = torch.randn(1, seq, 2, 8)
    return opdispatch.validate_attention(q, q, q)


def test_not_capturing_on_cpu():
    assert is_capturing(torch.device("cpu")) is False
    assert is_capturing("cpu") is False
    ensure_capture_safe(opdispatch.get_manager(), "attention", _call())
    raise_if_capturing("attention", _call())


def test_capture_is_asked_only_of_an_initialized_cuda(monkeypatch):
    """A "cuda" device with no CUDA context cannot be capturing (no query, no environment read); with one, the
    current stream is asked."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert is_capturing("cuda") is False and asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert is_capturing(torch.device("cuda", 0)) is True and asked == [1]


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


def test_a_new_signature_inside_capture_raises_even_when_its_class_is_decided(basic_manager, monkeypatch):
    from opdispatch.engine import _graphs as graphs

    q = torch.randn(1, 6, 2, 8)
    opdispatch.attention(q, q, q)  # warm-up: this exact signature is bound, its class decided
    q2 = torch.randn(1, 7, 2, 8)  # same class, new shape: a kernel may build a plan on its first call
    assert basic_manager.cached_decision("attention", opdispatch.validate_attention(q2, q2, q2)) is not None
    expected = opdispatch.attention(q, q, q, impl="reference.math")
    monkeypatch.setattr(graphs, "is_capturing", lambda device: True)
    out = opdispatch.attention(q, q, q)  # the warmed signature runs from the per-call cache
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(CaptureError, match="a call signature first seen while a CUDA graph is being captured"):
        opdispatch.attention(q2, q2, q2)
