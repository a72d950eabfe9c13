"""The gradient through a returned LSE on each of torch's fused CUDA kernels, pinned (the validate matrix's
`lse_gradient` row, split by which loss term carries the gradient): out only, LSE only, both. Against the float64
oracle of tests/test_attention_sinks.py (sinks of -inf: no sink)."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from tests.test_attention_sinks import oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient"])
@pytest.mark.parametrize("terms", ["out", "lse", "out+lse"])
@pytest.mark.parametrize("sq", [40, 128])
def test_gradient_through_a_returned_lse(impl, terms, sq):
    gen = torch.Generator().manual_seed(1)
    b, h, d = 2, 8, 64
    q0, k0, v0 = (torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q0, k0, v0))
    out, lse = opdispatch.attention(q, k, v, causal=True, return_lse=True, impl=impl)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q0, k0, v0))
    want_out, want_lse = oracle(qr, kr, vr, torch.full((h,), -math.inf, dtype=torch.float64), scale=d ** -0.5,
                                causal=True)
    g_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(want_lse.shape, generator=gen, dtype=torch.float64)

    def loss(o, s):
        return ((o * g_out).sum() if "out" in terms else 0) + ((s * g_lse).sum() if "lse" in terms else 0)

    loss(out.double().cpu(), lse.double().cpu()).backward()
    loss(want_out, want_lse).backward()
    for name, got, want in (("dq", q, qr), ("dk", k, kr), ("dv", v, vr)):
        if want.grad is None or not want.grad.abs().sum():
            assert got.grad is None or not got.grad.abs().sum(), name
            continue
        err = ((got.grad.double().cpu() - want.grad).abs().max() / want.grad.abs().max()).item()
        assert err < 0.05, f"{impl} {terms} sq={sq}: {name} relative error {err:.3g}"
