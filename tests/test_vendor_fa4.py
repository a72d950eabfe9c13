"""nvidia.flash_attn4 (FlashAttention-4, `flash_attn.cute`) against a fake of its published signatures: selection
on a simulated H100, and its native sinks path (the call goes to the kernel with its sinks, no shared epilogue)
checked against the float64 oracle of tests/test_attention_sinks.py, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from opdispatch.vendors.nvidia import FlashAttn4

from tests.conftest import device_descriptor
from tests.fakes import flash_attn_cute as fake_fa4
from tests._adapters_on_cpu import unbound_from_device, TOL, device_with_library, meta_qkv, run_on_cpu
from tests.test_attention_sinks import oracle



@pytest.fixture
def fa4(monkeypatch, basic_manager, tmp_path):
    fake_fa4.calls.clear()
    return run_on_cpu(monkeypatch, basic_manager, tmp_path, fake_fa4.fake_modules(), unbound_from_device(FlashAttn4, "fa4"))


def test_selected_on_an_h100_that_has_it_and_explained_otherwise(manager, tmp_path):
    sinks = torch.empty(16, device="meta", dtype=torch.float32, requires_grad=True)
    with_fa4 = device_with_library(tmp_path, "h100", "flash_attn_4", "4.0.0")
    for grad in (False, True):
        d = opdispatch.explain(*meta_qkv(grad=grad), causal=True, sinks=sinks, device=with_fa4)
        assert d.chosen_id == "nvidia.flash_attn4"
    d = opdispatch.explain(*meta_qkv(), causal=True, window=(128, 0), device=with_fa4)
    assert d.chosen_id == "nvidia.flash_attn4"
    # Without it installed: not chosen, and explain names the library and how to install it.
    d = opdispatch.explain(*meta_qkv(), causal=True, sinks=sinks, device=str(device_descriptor("h100")))
    assert d.chosen_id != "nvidia.flash_attn4"
    fa4 = next(c for c in d.candidates if c.impl_id == "nvidia.flash_attn4")
    assert any("flash_attn_4" in r for r in fa4.reasons)
    # Head dims it does not take on Hopper: another implementation, with the reason.
    d = opdispatch.explain(*meta_qkv(d=264), device=with_fa4)
    assert d.chosen_id != "nvidia.flash_attn4"


def test_blackwell_head_dim_256_kernel_refuses_what_it_lacks(tmp_path):
    caps_device = opdispatch.DeviceInfo(vendor="nvidia", type="cuda", arch="sm100", name="B200", index=0,
                                        capability=(10, 0))
    q, k, v = meta_qkv(d=256, grad=True)
    sinks = torch.zeros(16, device="meta", dtype=torch.float32)
    call = opdispatch.validate_attention(q, k, v, sinks=sinks, return_lse=True, softcap=5.0)
    reasons = FlashAttn4().extra_reasons(call, caps_device)
    assert len(reasons) == 3 and "learnable_sink" in reasons[0] and "softcap" in reasons[1]
    assert FlashAttn4().extra_reasons(opdispatch.validate_attention(*meta_qkv(d=192)), caps_device)
    assert not FlashAttn4().extra_reasons(opdispatch.validate_attention(*meta_qkv(d=192)),
                                          opdispatch.DeviceInfo(vendor="nvidia", type="cuda", arch="sm90",
                                                                name="H100", index=0, capability=(9, 0)))


def _inputs(gen, b, sq, sk, hq, hkv, d, dtype, layout="bshd"):
    q = torch.randn(b, sq, hq, d, generator=gen)
    k, v = torch.randn(b, sk, hkv, d, generator=gen), torch.randn(b, sk, hkv, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2
    return [t.to(dtype) for t in (q, k, v)], sinks


def _layout(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2)}[layout]


CASES = [  # (sq, sk, hq, hkv, causal, window, layout, dtype)
    (12, 12, 4, 4, False, None, "bshd", torch.bfloat16),
    (9, 17, 6, 2, True, None, "bhsd", torch.float16),     # GQA, causal bottom-right over more keys
    (17, 9, 4, 2, True, None, "bshd", torch.bfloat16),    # more queries than keys: blind rows → the sink
    (16, 16, 8, 2, True, (4, 0), "bshd", torch.float16),  # sliding window, GQA (GPT-OSS's combination)
    (10, 14, 4, 1, False, (3, 2), "bhsd", torch.bfloat16),  # two-sided window, MQA
]


@pytest.mark.parametrize("sq,sk,hq,hkv,causal,window,layout,dtype", CASES)
def test_native_sinks_forward_and_backward_match_the_oracle(fa4, sq, sk, hq, hkv, causal, window, layout, dtype):
    gen = torch.Generator().manual_seed(sq * 131 + sk)
    (q, k, v), sinks = _inputs(gen, 2, sq, sk, hq, hkv, 16, dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_()
    out, lse = opdispatch.attention(*(_layout(t, layout) for t in leaves), layout=layout, causal=causal,
                                    window=window, causal_alignment="bottom_right", sinks=sink_leaf,
                                    return_lse=True)
    # The kernel got the sinks (no epilogue around a call without them), once.
    assert len(fake_fa4.calls) == 1 and fake_fa4.calls[0]["learnable_sink"] is sink_leaf
    assert fake_fa4.calls[0]["window_size"] == ((None, None) if window is None else
                                                 tuple(None if w < 0 else w for w in window))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = oracle(*ref_leaves, scale=16 ** -0.5, causal=causal, window=window,
                              alignment="bottom_right")
    out = _layout(out, layout)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    # Training: the kernel's backward, the sink's gradient included, through the output and the LSE.
    gen_out = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    gen_lse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)
    ((out.double() * gen_out).sum() + (lse.double() * gen_lse).sum()).backward()
    ((ref_out * gen_out).sum() + (ref_lse * gen_lse).sum()).backward()
    for got, want in zip([*leaves, sink_leaf], ref_leaves):
        assert got.grad is not None
        scale = want.grad.abs().max().item() + 1e-6
        torch.testing.assert_close(got.grad.double() / scale, want.grad / scale, **TOL[dtype])
    assert len(fake_fa4.calls) == 1  # no recompute, no exact-LSE pass: the kernel's own backward


def test_native_sinks_output_only_training_and_inference(fa4):
    gen = torch.Generator().manual_seed(7)
    (q, k, v), sinks = _inputs(gen, 2, 11, 11, 4, 2, 32, torch.bfloat16)
    with torch.no_grad():
        out = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    ref_out, _ = oracle(q, k, v, sinks, scale=32 ** -0.5, causal=True)
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    assert fake_fa4.calls[-1]["learnable_sink"] is sinks and not fake_fa4.calls[-1]["return_lse"]
    # Only the sinks require grad (a frozen model with learned sinks): their gradient still comes back.
    sink_leaf = sinks.clone().requires_grad_()
    out = opdispatch.attention(q, k, v, causal=True, sinks=sink_leaf)
    ref_sink = sinks.double().requires_grad_()
    ref_out, _ = oracle(q, k, v, ref_sink, scale=32 ** -0.5, causal=True)
    weight = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    (out.double() * weight).sum().backward()
    (ref_out * weight).sum().backward()
    torch.testing.assert_close(sink_leaf.grad.double(), ref_sink.grad, atol=5e-2, rtol=2e-2)


def test_native_sinks_packed_varlen(fa4):
    gen = torch.Generator().manual_seed(3)
    lens = [5, 9, 1]
    q = torch.randn(sum(lens), 4, 16, generator=gen).to(torch.float16)
    k = torch.randn(sum(lens), 2, 16, generator=gen).to(torch.float16)
    v = torch.randn(sum(lens), 2, 16, generator=gen).to(torch.float16)
    sinks = torch.randn(4, generator=gen)
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    out, lse = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                    max_seqlen_k=9, causal=True, sinks=sinks, return_lse=True)
    assert fake_fa4.calls[-1]["fn"] == "flash_attn_varlen_func" and fake_fa4.calls[-1]["learnable_sink"] is sinks
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        ref_out, ref_lse = oracle(q[None, a:b], k[None, a:b], v[None, a:b], sinks, scale=0.25, causal=True)
        torch.testing.assert_close(out[a:b].double(), ref_out[0], **TOL[torch.float16])
        torch.testing.assert_close(lse[:, a:b].double(), ref_lse[0], atol=1e-4, rtol=1e-4)


def test_without_sinks_the_kernel_gets_none_and_the_epilogue_stays_for_others(fa4):
    gen = torch.Generator().manual_seed(11)
    (q, k, v), sinks = _inputs(gen, 1, 8, 8, 2, 2, 16, torch.bfloat16)
    opdispatch.attention(q, k, v)
    assert fake_fa4.calls[-1]["learnable_sink"] is None
    # Pinned to an implementation without native sinks: the shared epilogue, the same result.
    ref = opdispatch.attention(q.float(), k.float(), v.float(), sinks=sinks, impl="reference.math")
    fake_fa4.calls.clear()
    got = opdispatch.attention(q, k, v, sinks=sinks)
    assert len(fake_fa4.calls) == 1
    torch.testing.assert_close(got.float(), ref, **TOL[torch.bfloat16])


def test_the_fake_refuses_what_the_real_function_refuses(monkeypatch):
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        fake_fa4.flash_attn_func(q, q, q, s_aux=torch.zeros(2))  # vLLM's spelling is not FA4's
    with pytest.raises(AssertionError, match="float16, bfloat16"):
        fake_fa4.flash_attn_func(q.float(), q.float(), q.float())
    with pytest.raises(AssertionError):
        fake_fa4.flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    out, lse = fake_fa4.flash_attn_func(q, q, q)
    assert lse is None and out.dtype == torch.bfloat16
    assert math.isfinite(out.float().sum().item())
