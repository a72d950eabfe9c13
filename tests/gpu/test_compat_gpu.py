"""opdispatch.compat.scaled_dot_product_attention on a GPU: torch's results through the fused kernels the policy
picks (bf16, GQA, masks, causal, training, decode), and routing a program's calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opdispatch
from opdispatch.compat import routed_sdpa, scaled_dot_product_attention, torch_sdpa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {
    "prefill causal GQA": (dict(q=(2, 16, 512, 128), k=(2, 4, 512, 128)), dict(is_causal=True, enable_gqa=True)),
    "decode, 1 query": (dict(q=(4, 32, 1, 128), k=(4, 8, 1024, 128)), dict(enable_gqa=True)),
    "bool padding mask": (dict(q=(2, 8, 128, 64), k=(2, 8, 160, 64)), dict(mask=(2, 1, 1, 160))),
    "float bias per head": (dict(q=(1, 8, 256, 64), k=(1, 8, 256, 64)), dict(bias=(8, 256, 256))),
    "3-D inputs": (dict(q=(16, 128, 64), k=(16, 128, 64)), dict()),
    "head dim 96, fp16": (dict(q=(2, 8, 200, 96), k=(2, 8, 200, 96)), dict(is_causal=True, dtype=torch.float16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_on_the_gpu(name):
    shapes, kw = CASES[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(*shapes["q"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(*shapes["k"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(*shapes["k"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    if "mask" in kw:
        mask = torch.rand(*kw.pop("mask"), device="cuda", generator=gen) > 0.2
        mask[..., 0] = True
        kw["attn_mask"] = mask
    if "bias" in kw:
        kw["attn_mask"] = torch.randn(*kw.pop("bias"), device="cuda", dtype=dtype, generator=gen)
    ours = scaled_dot_product_attention(q, k, v, **kw)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    wide_kw = {**kw, "attn_mask": kw["attn_mask"].double() if "attn_mask" in kw and kw["attn_mask"].is_floating_point()
               else kw.get("attn_mask")}
    oracle = torch_sdpa(*wide, **wide_kw)  # torch's math in float64 on the GPU: the reference
    theirs = torch_sdpa(q, k, v, **kw)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    err = (ours.double() - oracle).abs().max().item()
    torch_err = (theirs.double() - oracle).abs().max().item()
    assert err <= max(2 * torch_err, 2e-2), (err, torch_err)
    grad = torch.randn_like(ours)
    got = torch.autograd.grad(ours, (q, k, v), grad)
    want = torch.autograd.grad(oracle, wide, grad.double())
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max().item() <= 5e-2 * max(1.0, w.abs().max().item())


def test_routing_on_the_gpu_uses_the_policy_kernel():
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    before = opdispatch.get_manager().decisions_made
    with routed_sdpa():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert opdispatch.get_manager().decisions_made >= before
    decision = opdispatch.explain(q, q, q, layout="bhsd", causal=True)
    assert decision.chosen_id.startswith(("nvidia.", "flagos.", "torch."))
    torch.testing.assert_close(out, torch_sdpa(q, q, q, is_causal=True), atol=2e-2, rtol=2e-2)
