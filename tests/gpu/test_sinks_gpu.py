"""Attention sinks on a real GPU: every fused implementation that takes the call, pinned, forward and backward in
bf16 against the float64 oracle of tests/test_attention_sinks.py (the shared epilogue over the kernel's LSE,
and its LSE-gradient correction for kernels whose LSE is a side output)."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from tests.test_attention_sinks import oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

IMPLS = ["nvidia.flash_attn3", "nvidia.cudnn", "nvidia.flash", "nvidia.flash_attn", "nvidia.mem_efficient",
         "torch.flex", "reference.math"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pattern", ["causal", "window", "kv_cache_window"])
def test_sinks_on_fused_kernels_match_the_oracle(impl, pattern):
    gen = torch.Generator().manual_seed(0)
    b, sq, sk, hq, hk, d = 2, 64 if pattern != "kv_cache_window" else 3, 96, 8, 2, 64
    q0, k0, v0 = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
                  for n, h in ((sq, hq), (sk, hk), (sk, hk)))
    s0 = torch.randn(hq, generator=gen, dtype=torch.float64) * 3
    kw = dict(causal=True, causal_alignment="bottom_right")
    used = None
    if pattern != "causal":
        kw["window"] = (16, 0)
    if pattern == "kv_cache_window":
        used = [70, 9]
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q0, k0, v0))
    sinks = s0.float().cuda().requires_grad_()
    reasons = [c for c in opdispatch.explain(q, k, v, sinks=sinks, return_lse=True, **kw).candidates
               if c.impl_id == impl][0].reasons
    if reasons:
        pytest.skip(f"{impl}: {reasons}")
    out, lse = opdispatch.attention(q, k, v, sinks=sinks, return_lse=True, impl=impl, **kw)
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
    want_out, want_lse = oracle(qr, kr, vr, sr, scale=d ** -0.5, causal=True, window=kw.get("window"),
                                alignment="bottom_right", used=used)
    torch.testing.assert_close(out.double().cpu(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=2e-2, rtol=2e-2)
    g = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    ((out.double().cpu() * g).sum() + lse.double().cpu().sum()).backward()
    ((want_out * g).sum() + want_lse.sum()).backward()
    for got, want in ((q, qr), (k, kr), (v, vr), (sinks, sr)):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "torch.flex"])
@pytest.mark.parametrize("pattern", ["causal", "window"])
def test_sinks_training_on_the_output_alone_from_saved_results(impl, pattern):
    """GPT-OSS's training call (the output only): kernels with a backward of their own are differentiated from
    their saved results with the sink folded in (opdispatch.ops._sinks._SinksFromSaved); the others by autograd over
    the epilogue. Both against the float64 oracle, backward twice."""
    gen = torch.Generator().manual_seed(3)
    b, s, hq, hk, d = 2, 96, 8, 2, 64
    q0, k0, v0 = (torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for h in (hq, hk, hk))
    s0 = torch.randn(hq, generator=gen, dtype=torch.float64) * 2
    kw = dict(causal=True) if pattern == "causal" else dict(causal=True, window=(16, 0))
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q0, k0, v0))
    sinks = s0.float().cuda().requires_grad_()
    reasons = [c for c in opdispatch.explain(q, k, v, sinks=sinks, **kw).candidates if c.impl_id == impl][0].reasons
    if reasons:
        pytest.skip(f"{impl}: {reasons}")
    out = opdispatch.attention(q, k, v, sinks=sinks, impl=impl, **kw)
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q0, k0, v0, s0))
    want, _ = oracle(qr, kr, vr, sr, scale=d ** -0.5, causal=True, window=kw.get("window"))
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    loss = (out.double() * g.cuda()).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    (want * g).sum().backward()
    for name, got, ref in (("q", q, qr), ("k", k, kr), ("v", v, vr), ("sinks", sinks, sr)):
        torch.testing.assert_close(got.grad.double().cpu() / 2, ref.grad, atol=6e-2, rtol=6e-2, msg=name)
