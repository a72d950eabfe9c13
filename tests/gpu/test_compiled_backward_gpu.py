"""The compiled backward on CUDA calls the chosen kernel's own backward from the saved out and LSE (needs CUDA).

For each call kind the NVIDIA implementations cover: gradients through ``opdispatch::attention`` (the custom op's
autograd, as a compiled graph runs it) against eager autograd through the same implementation and a float64
oracle, and the forward entered once per step (no recompute).
"""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.compile._compile import attention_for_compile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _oracle(q, k, v, *, causal, bottom_right, window=None):
    """float64 attention over bshd tensors with GQA, independent of every implementation."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq if bottom_right else 0)
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


CASES = {
    "cudnn-causal-gqa-d128": ("nvidia.cudnn", dict(sq=512, hkv=2, d=128), dict(causal=True)),
    "cudnn-d100-padded": ("nvidia.cudnn", dict(sq=256, hkv=8, d=100), dict(causal=True)),
    "flash-causal-gqa": ("nvidia.flash", dict(sq=512, hkv=2, d=128), dict(causal=True)),
    "flash-bottom-right-blind-rows": ("nvidia.flash", dict(sq=300, sk=200, hkv=8, d=64),
                                      dict(causal=True, causal_alignment="bottom_right")),
    "flash-window": ("nvidia.flash", dict(sq=512, hkv=2, d=64), dict(causal=True, window=(64, 0))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_backward_uses_the_kernels_backward(case, monkeypatch):
    impl_id, shape, kw = CASES[case]
    manager = opdispatch.get_manager()
    manager.ensure_initialized()
    impl = manager.registry.get("attention", impl_id).impl
    runs = []
    original_run = type(impl).run
    monkeypatch.setattr(type(impl), "run", lambda self, call: runs.append(1) or original_run(self, call))
    gen = torch.Generator(device="cuda").manual_seed(0)
    sq, sk, hq, hkv, d = shape["sq"], shape.get("sk", shape["sq"]), 8, shape["hkv"], shape["d"]

    def make(s, h):
        return torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = make(sq, hq), make(sk, hkv), make(sk, hkv)
    grad_out = torch.randn(2, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = attention_for_compile(q, k, v, impl=impl_id, **kw)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    assert len(runs) == 1, f"{impl_id}: forward ran {len(runs)} times for one step (recomputed in the backward)"
    eager = opdispatch.attention(q, k, v, impl=impl_id, **kw)
    eager_grads = torch.autograd.grad(eager, [q, k, v], grad_out)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    bottom_right = kw.get("causal_alignment") == "bottom_right"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _oracle(*leaves, causal=kw["causal"], bottom_right=bottom_right, window=kw.get("window"))
    oracle_grads = torch.autograd.grad(want, leaves, grad_out.double())
    for name, got, same_kernel, exact in zip("qkv", grads, eager_grads, oracle_grads):
        assert torch.isfinite(got).all(), f"d{name} has non-finite values"
        # the same kernel's backward as eager autograd (atomics in dq make it not bitwise)
        torch.testing.assert_close(got.float(), same_kernel.float(), atol=2e-2, rtol=2e-2)
        scale = exact.abs().max().item()
        err = (got.double() - exact).abs().max().item()
        assert err <= 2e-2 * max(scale, 1.0), f"d{name}: max error {err:.3g} vs float64 oracle (scale {scale:.3g})"


def test_compiled_varlen_backward_uses_flash_backward(monkeypatch):
    manager = opdispatch.get_manager()
    manager.ensure_initialized()
    impl = manager.registry.get("attention", "nvidia.flash").impl
    runs = []
    original_run = type(impl).run
    monkeypatch.setattr(type(impl), "run", lambda self, call: runs.append(1) or original_run(self, call))
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [100, 300, 37]
    cu = torch.tensor([0, 100, 400, 437], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(437, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (8, 2, 2))
    grad_out = torch.randn(437, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300, causal=True)
    out = attention_for_compile(q, k, v, impl="nvidia.flash", **kw)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    assert len(runs) == 1
    eager_grads = torch.autograd.grad(opdispatch.attention(q, k, v, impl="nvidia.flash", **kw), [q, k, v], grad_out)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        leaves = [t[rows].detach().double()[None].requires_grad_() for t in (q, k, v)]
        want = _oracle(*leaves, causal=True, bottom_right=False)
        exact = torch.autograd.grad(want, leaves, grad_out[rows].double()[None])
        for got, e in zip(grads, exact):
            err = (got[rows].double() - e[0]).abs().max().item()
            assert err <= 2e-2 * max(e.abs().max().item(), 1.0)
        start += n
