"""Bound plans (the per-call fast path and opdispatch.plan) compute exactly what the implementation's run() does."""

from __future__ import annotations

import pytest
import torch

import opdispatch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.flash"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_plan_equals_run_and_reference(impl, layout, causal, grad):
    b, s, hq, hkv, d = 2, 256, 8, 2, 64
    shape = {"bshd": lambda h: (b, s, h, d), "bhsd": lambda h: (b, h, s, d), "sbhd": lambda h: (s, b, h, d)}[layout]
    q, k, v = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for h in (hq, hkv, hkv))
    bound = opdispatch.plan(q, k, v, layout=layout, causal=causal, impl=impl)
    out = bound(q, k, v)
    implementation = opdispatch.get_manager().registry.get("attention", impl).impl
    via_run = implementation.run(opdispatch.validate_attention(q, k, v, layout=layout, causal=causal))
    torch.testing.assert_close(out, via_run, atol=0, rtol=0)
    leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref = opdispatch.attention(*leaves, layout=layout, causal=causal, impl="reference.math")
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    if grad:
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref_grads = torch.autograd.grad(ref, leaves, g.double())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
