"""rocm.aiter's attention sinks against a fake of aiter's published signatures (tests/fakes/aiter.py): `sink_ptr`
is taken natively only where aiter honours it (no autograd: its backward drops the sink's gradient; no returned
LSE; not bf16 head dims 128/128 or 192/128, where aiter's ASM v3 forward ignores it — the fake drops it there as
the real dispatch does); every other call goes through the shared epilogue. Values against the float64 oracle of
tests/test_attention_sinks.py."""

from __future__ import annotations


import pytest
import torch

import opdispatch
from opdispatch.ops._attention import takes_sinks_natively
from opdispatch.vendors.rocm import RocmAiter

from tests.conftest import device_descriptor
from tests.fakes import aiter as fake_aiter
from tests.fakes import install
from tests._adapters_on_cpu import unbound_from_device, TOL, run_on_cpu
from tests.test_attention_sinks import oracle



@pytest.fixture
def aiter(monkeypatch, basic_manager, tmp_path):
    calls: list = []
    run_on_cpu(monkeypatch, basic_manager, tmp_path, {"aiter": fake_aiter.make(calls)}, unbound_from_device(RocmAiter, "aiter"))
    return calls


def _inputs(gen, b, sq, sk, hq, hkv, d, dtype, dv=None):
    q = torch.randn(b, sq, hq, d, generator=gen)
    k, v = torch.randn(b, sk, hkv, d, generator=gen), torch.randn(b, sk, hkv, dv or d, generator=gen)
    return [t.to(dtype) for t in (q, k, v)], torch.randn(hq, generator=gen) * 2


def _sink_ptrs(calls):
    return [kw.get("sink_ptr") for _, _, kw in calls]


def test_mi300x_takes_sinks_natively_for_inference_only(manager, monkeypatch):
    def qkv(d=64, dtype=torch.bfloat16, grad=False):
        m = dict(device="meta", dtype=dtype)
        return (torch.empty(2, 256, 64, d, **m, requires_grad=grad), torch.empty(2, 256, 8, d, **m),
                torch.empty(2, 256, 8, d, **m))

    def sinks(grad=False):
        return torch.empty(64, device="meta", dtype=torch.float32, requires_grad=grad)

    device = str(device_descriptor("mi300x"))
    for grad in (False, True):
        d = opdispatch.explain(*qkv(), causal=True, window=(128, 0), sinks=sinks(grad), device=device)
        assert d.chosen_id == "rocm.aiter"  # GPT-OSS's shape: chosen either way, native or through the epilogue
    impl = RocmAiter()
    # Without aiter imported (or one without sink_ptr): the epilogue, with the reason.
    assert "sink_ptr" in impl.native_sinks_limit(opdispatch.validate_attention(*qkv(), sinks=sinks()))
    install(monkeypatch, {"aiter": fake_aiter.make([])})
    assert takes_sinks_natively(impl, opdispatch.validate_attention(*qkv(), causal=True, sinks=sinks()))
    assert takes_sinks_natively(impl, opdispatch.validate_attention(*qkv(128, torch.float16), sinks=sinks()))
    assert not takes_sinks_natively(impl, opdispatch.validate_attention(*qkv(), sinks=sinks(True)))
    assert not takes_sinks_natively(impl, opdispatch.validate_attention(*qkv(grad=True), sinks=sinks()))
    with_lse = opdispatch.validate_attention(*qkv(), sinks=sinks(), return_lse=True)
    assert "LSE" in impl.native_sinks_limit(with_lse)
    assert "fmha v3" in impl.native_sinks_limit(opdispatch.validate_attention(*qkv(128), sinks=sinks()))


CASES = [  # (sq, sk, hq, hkv, d, causal, window, dtype)
    (12, 12, 4, 4, 64, False, None, torch.bfloat16),
    (9, 17, 8, 2, 64, True, None, torch.float16),      # GQA, causal bottom-right over more keys
    (17, 9, 4, 2, 64, True, None, torch.bfloat16),     # more queries than keys: blind rows → 0
    (16, 16, 8, 2, 64, True, (4, 0), torch.float16),   # sliding window, GQA (GPT-OSS's combination)
    (140, 140, 4, 4, 128, True, None, torch.float16),  # fp16 head dim 128: CK, not the ASM v3 kernel
]


@pytest.mark.parametrize("sq,sk,hq,hkv,d,causal,window,dtype", CASES)
def test_inference_passes_sink_ptr_and_matches_the_oracle(aiter, sq, sk, hq, hkv, d, causal, window, dtype):
    gen = torch.Generator().manual_seed(sq * 131 + sk + d)
    (q, k, v), sinks = _inputs(gen, 2, sq, sk, hq, hkv, d, dtype)
    with torch.no_grad():
        out = opdispatch.attention(q, k, v, causal=causal, window=window, causal_alignment="bottom_right",
                                   sinks=sinks)
    assert len(aiter) == 1 and _sink_ptrs(aiter) == [sinks]  # the kernel got the sinks: no epilogue
    ref_out, _ = oracle(q, k, v, sinks, scale=d ** -0.5, causal=causal, window=window, alignment="bottom_right")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])


def test_packed_varlen_and_softcap_inference(aiter):
    gen = torch.Generator().manual_seed(3)
    lens = [5, 9, 1]
    q = torch.randn(sum(lens), 4, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(4, generator=gen)
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    with torch.no_grad():
        out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                   max_seqlen_k=9, causal=True, sinks=sinks)
    assert aiter[-1][0] == "flash_attn_varlen_func" and _sink_ptrs(aiter) == [sinks]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        ref_out, _ = oracle(q[None, a:b], k[None, a:b], v[None, a:b], sinks, scale=0.125, causal=True)
        torch.testing.assert_close(out[a:b].double(), ref_out[0], **TOL[torch.bfloat16])


@pytest.mark.parametrize("seq,d,dv", [(140, 128, 128), (20, 192, 128)])
def test_bf16_v3_head_dims_take_the_epilogue(aiter, seq, d, dv):
    # aiter's ASM v3 forward would drop sink_ptr here (the fake drops it too): passing it would be silently wrong.
    gen = torch.Generator().manual_seed(seq + d)
    (q, k, v), sinks = _inputs(gen, 1, seq, seq, 2, 2, d, torch.bfloat16, dv=dv)
    with torch.no_grad():
        out = opdispatch.attention(q, k, v, causal=True, sinks=sinks)  # no LSE: only the v3 limit routes it
        out_lse, lse = opdispatch.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert _sink_ptrs(aiter) == [None, None]
    ref_out, ref_lse = oracle(q, k, v, sinks, scale=d ** -0.5, causal=True)
    for got in (out, out_lse):
        torch.testing.assert_close(got.double(), ref_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grad_sinks", [True, False])
def test_training_goes_through_the_epilogue_with_every_gradient(aiter, grad_sinks):
    gen = torch.Generator().manual_seed(29)
    (q, k, v), sinks = _inputs(gen, 2, 13, 13, 4, 2, 64, torch.float16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_(grad_sinks)
    out = opdispatch.attention(*leaves, causal=True, window=(5, 0), sinks=sink_leaf)
    assert aiter and all(p is None for p in _sink_ptrs(aiter))  # aiter's backward has no sink gradient
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, _ = oracle(*ref, scale=0.125, causal=True, window=(5, 0), alignment="bottom_right")
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.float16])
    weight = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    (out.double() * weight).sum().backward()
    (ref_out * weight).sum().backward()
    for got, want in zip([*leaves, sink_leaf], ref):
        if got is sink_leaf and not grad_sinks:
            assert got.grad is None
            continue
        scale = want.grad.abs().max().item() + 1e-6
        torch.testing.assert_close(got.grad.double() / scale, want.grad / scale, atol=5e-3, rtol=5e-3)


def test_the_fake_follows_aiter(aiter):
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    mod = fake_aiter.make([])
    with pytest.raises(TypeError):
        mod.flash_attn_func(q, q, q, s_aux=torch.zeros(2))  # vLLM's spelling is not aiter's
    with pytest.raises(AssertionError, match="incorrect shape"):
        mod.flash_attn_func(q, q, q, sink_ptr=torch.zeros(3))
    # A sink of -inf is no sink; a very large one takes all the mass (out ~0).
    v = torch.randn(1, 4, 2, 64).to(torch.bfloat16)
    plain = mod.flash_attn_func(q, q, v)
    torch.testing.assert_close(mod.flash_attn_func(q, q, v, sink_ptr=torch.full((2,), -float("inf"))), plain)
    assert mod.flash_attn_func(q, q, v, sink_ptr=torch.full((2,), 80.0)).abs().max() < 1e-30
