"""The per-call fast path keeps bound functions, never the tensors of the calls that created them: inputs dropped
by the caller are freed (a serving loop over many sequence lengths must not pin their memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import opdispatch

from .test_manager import make_impl


def _alive_after(make, call, lengths=range(1, 41)) -> int:
    refs = []
    for s in lengths:
        tensors = make(s)
        call(*tensors)
        refs.extend(weakref.ref(t) for t in tensors)
        del tensors
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("layout, kwargs", [
    ("bshd", {}), ("bhsd", {}), ("sbhd", {"causal": True}), ("bshd", {"return_lse": True}),
    ("bshd", {"softcap": 20.0}),  # a reference implementation: the default bind
])
def test_attention_inputs_are_freed(basic_manager, layout, kwargs):
    def make(s):
        shape = {"bshd": (1, s, 4, 16), "bhsd": (1, 4, s, 16), "sbhd": (s, 1, 4, 16)}[layout]
        return [torch.randn(*shape) for _ in range(3)]

    assert _alive_after(make, lambda q, k, v: opdispatch.attention(q, k, v, layout=layout, **kwargs)) == 0
    assert len(basic_manager.fast) > 1  # the fast path did bind these signatures


def test_rms_norm_and_rotary_inputs_are_freed(basic_manager):
    assert _alive_after(lambda s: [torch.randn(s, 32), torch.randn(32), torch.randn(s, 32)],
                        lambda x, w, r: opdispatch.rms_norm(x, w, 1e-6, r)) == 0
    cos, sin = torch.randn(64, 8), torch.randn(64, 8)
    assert _alive_after(lambda s: [torch.randn(1, s, 4, 16), torch.randn(1, s, 2, 16)],
                        lambda q, k: opdispatch.rotary_embedding(q, k, cos, sin)) == 0
    assert len(basic_manager.fast) > 2


def test_the_fallback_wrapper_keeps_no_inputs(basic_manager, monkeypatch):
    """With fallback_on_error the bound function wraps the kernel; the wrapper keeps no tensor either."""
    from opdispatch.policies import parse_policy

    basic_manager.register_impl(make_impl("aaa", "first", priority=100))
    basic_manager.set_policy(parse_policy("settings:\n  fallback_on_error: true\n", "<t>"))
    assert _alive_after(lambda s: [torch.randn(1, s, 2, 8) for _ in range(3)],
                        lambda q, k, v: opdispatch.attention(q, k, v)) == 0
