"""torch.compile (inductor) on CUDA through changing sequence lengths, with and without CUDA graphs (needs CUDA).

The CPU suite (tests/test_compile_dynamic.py) covers guards, recompiles and scopes with the eager backends; this
checks the same graphs lowered by inductor on a GPU: bf16 forward and backward against a float64 oracle, one
dynamic graph per decision class, and a scope change between calls taken by the kernel (no re-trace).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import opdispatch
from opdispatch.compile import _compile

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def oracle(q, k, v):
    """float64 causal attention of bshd tensors with GQA, independent of every implementation."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cudagraphs"])
def test_inductor_dynamic_seqlens_forward_backward(mode):
    def attend(q, k, v):
        return opdispatch.attention(q, k, v, causal=True)

    fn = torch.compile(attend, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, seqlen in [(3, 128), (5, 200), (3, 333), (6, 64), (3, 1000)]:
        q = torch.randn(batch, seqlen, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k, v = (torch.randn(batch, seqlen, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                .requires_grad_() for _ in range(2))
        out = fn(q, k, v)
        grad = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = oracle(qd, kd, vd)
        rq, rk, rv = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
        for got, exp in ((dq, rq), (dk, rk), (dv, rv)):
            torch.testing.assert_close(got.double(), exp, atol=5e-2, rtol=5e-2)
    assert sum(counters["graph_break"].values()) == 0
    print(f"mode={mode}: {counters['stats']['unique_graphs']} graphs for 5 shapes")


def test_scope_change_between_compiled_calls_on_cuda(monkeypatch):
    seen = []
    original = _compile._impl
    monkeypatch.setattr(_compile, "_impl", lambda impl_id: (seen.append(impl_id), original(impl_id))[1])
    fn = torch.compile(lambda q, k, v: opdispatch.attention(q, k, v, causal=True), fullgraph=True, dynamic=True)
    q, k, v = (torch.randn(2, 96, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn(q, k, v)
    with opdispatch.policy_override(pin="reference.math"):
        out = fn(q, k, v)
    torch.testing.assert_close(out.double(), oracle(q, k, v), atol=2e-2, rtol=2e-2)
    assert seen[1] == "reference.math" and seen[0] != "reference.math"
    assert counters["stats"]["unique_graphs"] == 1
