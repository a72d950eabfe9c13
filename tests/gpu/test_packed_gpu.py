"""Packed q/k/v on a real GPU: the chosen kernel reads the packed views uncopied and matches the reference."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch import attention_packed, packed_views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("layout", ["bs3hd", "bsh3d", "sb3hd", "bshd_bs2hd"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_layouts_on_the_gpu(layout, causal):
    gen = torch.Generator().manual_seed(0)
    seq = (2, 256) if layout.startswith("b") else (256, 2)
    if layout == "bshd_bs2hd":
        packed = (torch.randn(*seq, 8, 128, generator=gen), torch.randn(*seq, 2, 2, 128, generator=gen))
    elif layout == "bsh3d":
        packed = (torch.randn(*seq, 8, 3, 128, generator=gen), None)
    else:
        packed = (torch.randn(*seq, 3, 8, 128, generator=gen), None)
    packed = tuple(None if t is None else t.to("cuda", torch.bfloat16).requires_grad_() for t in packed)
    q, k, v, base = packed_views(layout, *packed)
    decision = opdispatch.explain(q, k, v, layout=base, causal=causal)
    impl = opdispatch.get_manager().registry.get("attention", decision.chosen_id).impl
    conformed = impl.conform(opdispatch.validate_attention(q, k, v, layout=base, causal=causal))
    copied = [n for n, a, b in zip("qkv", (conformed.q, conformed.k, conformed.v), (q, k, v))
              if a.data_ptr() != b.data_ptr()]
    if not impl.caps.contiguous_inputs:  # a kernel that takes strided views reads the packed memory itself
        assert copied == [], (decision.chosen_id, copied)
    out = attention_packed(*packed, layout=layout, causal=causal)
    leaves = [t for t in packed if t is not None]
    grad_out = torch.randn(out.shape, generator=gen).cuda()
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    want = attention_packed(*f32, *([None] if len(f32) == 1 else []), layout=layout, causal=causal,
                            impl="reference.math")
    want_grads = torch.autograd.grad(want, f32, grad_out)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w, atol=5e-2, rtol=5e-2)
