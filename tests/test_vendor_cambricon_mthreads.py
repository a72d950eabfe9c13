"""Cambricon `cambricon.sdpa` and Moore Threads `mthreads.sdpa`: torch's F.scaled_dot_product_attention on the
vendor's device. The adapters' calls run here on CPU tensors (F.sdpa exists on CPU) against an independent float64
oracle, forward and backward, across layout × causal/alignment × window × mask/bias × GQA × dtype; what F.sdpa is
handed is recorded; selection on the simulated MLU590 / MTT S4000; availability (arch, library version); probes."""

from __future__ import annotations

import types

import pytest
import torch

import opdispatch
from opdispatch.ops._attention import capability_reasons
from opdispatch.vendors import cambricon, mthreads
from opdispatch.vendors.cambricon import CambriconSdpa
from opdispatch.vendors.cambricon._attention import fused_gate
from opdispatch.vendors.mthreads import MthreadsSdpa

from tests._adapters_on_cpu import unbound_from_device
from tests._vendor_helpers import allowed_keys, dense_inputs, dense_oracle, to_bhsd
from tests.conftest import DEVICES_DIR, TOLERANCES
from tests.fakes import install

MLU = DEVICES_DIR / "cambricon-mlu590.yaml"
MUSA = DEVICES_DIR / "mthreads-s4000.yaml"
ADAPTERS = [CambriconSdpa, MthreadsSdpa]


def oracle(q, k, v, scale, allowed=None, bias=None):
    """The output of tests/_vendor_helpers.dense_oracle (F.sdpa, these adapters' kernel, returns no LSE)."""
    return dense_oracle(q, k, v, scale, allowed, bias=bias)[0]



def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def assert_close(got, want, dtype, what):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4, msg=what)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Record what F.sdpa is handed (and still run it)."""
    calls: list = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, **kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


# (layout, sq, sk, hq, hkv, dtype, kwargs, mask: None | "bool" | "bias", is_causal handed to F.sdpa)
CASES = [
    ("bshd", 16, 16, 4, 2, torch.bfloat16, {}, None, False),
    ("bhsd", 16, 16, 4, 4, torch.float16, dict(causal=True), None, True),
    ("sbhd", 16, 16, 4, 1, torch.bfloat16, dict(causal=True, scale=0.2), None, True),
    ("bshd", 12, 20, 4, 2, torch.float16, dict(causal=True), None, False),
    ("bhsd", 12, 20, 4, 2, torch.bfloat16, dict(causal=True, causal_alignment="bottom_right"), None, False),
    ("sbhd", 20, 12, 2, 2, torch.float16, dict(causal=True), None, False),
    ("bshd", 16, 16, 4, 2, torch.bfloat16, dict(window=(3, 2)), None, False),
    ("bhsd", 10, 18, 4, 2, torch.float16, dict(causal=True, window=(5, 0), causal_alignment="bottom_right"), None,
     False),
    ("bshd", 14, 14, 4, 2, torch.bfloat16, {}, "bool", False),
    ("sbhd", 10, 14, 4, 1, torch.float16, dict(causal=True), "bool", False),
    ("bhsd", 14, 14, 4, 2, torch.bfloat16, dict(causal=True), "bias", False),
    ("bshd", 10, 14, 2, 2, torch.float16, {}, "bias", False),
]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.vendor)
@pytest.mark.parametrize("layout,sq,sk,hq,hkv,dtype,kwargs,mask,is_causal", CASES)
def test_forward_and_backward_against_float64(sdpa_calls, rng, adapter, layout, sq, sk, hq, hkv, dtype, kwargs,
                                              mask, is_causal):
    impl = unbound_from_device(adapter, "sdpa")
    q, k, v = leaves(dense_inputs(layout, 2, sq, sk, hq, hkv, 64, dtype, rng))
    extra: dict = {}
    allowed_mask = bias = None
    if mask == "bool":
        allowed_mask = torch.rand(2, 1, sq, sk, generator=rng) > 0.3
        extra["attn_mask"] = allowed_mask
    elif mask == "bias":
        bias = torch.randn(1, hq, sq, sk, generator=rng).to(dtype)
        extra["attn_bias"] = bias
    call = opdispatch.validate_attention(q, k, v, layout=layout, **kwargs, **extra)
    assert not capability_reasons(adapter.caps, call)
    out = impl.run(call)
    (kw,) = sdpa_calls
    assert kw["is_causal"] is is_causal and kw["dropout_p"] == 0.0
    assert kw["k"][1] == hq and kw["v"][1] == hq  # GQA: k/v expanded to q's heads
    assert (kw["attn_mask"] is None) == (mask is None and not kwargs.get("window") and (sq == sk or not
                                                                                        kwargs.get("causal")))
    if adapter is MthreadsSdpa and "scale" not in kwargs:
        assert kw["scale"] is None  # the default scale left to the kernel (CheckScale, SDK < 4.2)
    else:
        assert kw["scale"] == call.scale
    assert out.shape == q.shape and out.dtype == dtype
    q64, k64, v64 = leaves(to_bhsd(t, layout).double() for t in (q, k, v))
    allowed = allowed_keys(sq, sk, call.causal, call.window, call.causal_alignment)
    if allowed_mask is not None:
        allowed = allowed_mask if allowed is None else allowed & allowed_mask
    want = oracle(q64, k64, v64, call.scale, allowed, None if bias is None else bias.double())
    got = to_bhsd(out, layout)
    assert_close(got, want, dtype, "out")
    grad = torch.randn(got.shape, generator=rng).to(dtype)
    (got.float() * grad.float()).sum().backward()
    (want * grad.double()).sum().backward()
    for name, g, w in zip("qkv", (q, k, v), (q64, k64, v64)):
        assert g.grad is not None and torch.isfinite(g.grad).all()
        assert_close(to_bhsd(g.grad, layout), w.grad, dtype, f"d{name}")


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.vendor)
def test_rows_without_keys_are_zero_with_finite_gradients(rng, adapter):
    """A mask that hides a whole row, and bottom-right causal with more queries than keys: those rows are zeros,
    and every gradient matches the oracle's (no NaN from a softmax over a row of -inf on a vendor kernel)."""
    dtype = torch.float16
    q, k, v = leaves(dense_inputs("bshd", 2, 12, 8, 4, 2, 64, dtype, rng))
    keep = torch.rand(2, 1, 12, 8, generator=rng) > 0.3
    keep[0, 0, 3] = False
    keep[1, 0, 7] = False
    for kwargs in (dict(attn_mask=keep), dict(causal=True, causal_alignment="bottom_right")):
        for t in (q, k, v):
            t.grad = None
        call = opdispatch.validate_attention(q, k, v, layout="bshd", **kwargs)
        out = unbound_from_device(adapter, "sdpa").run(call)
        q64, k64, v64 = leaves(t.transpose(1, 2).double() for t in (q, k, v))
        allowed = keep if "attn_mask" in kwargs else allowed_keys(12, 8, True, None, "bottom_right")
        want = oracle(q64, k64, v64, call.scale, allowed)
        blind = ~allowed.expand(2, 4, 12, 8).any(-1)
        assert blind.any() and (out.transpose(1, 2)[blind] == 0).all()
        assert_close(out.transpose(1, 2), want, dtype, "out")
        grad = torch.randn(out.shape, generator=rng).to(dtype)
        (out.float() * grad.float()).sum().backward()
        (want * grad.transpose(1, 2).double()).sum().backward()
        for g, w in zip((q, k, v), (q64, k64, v64)):
            assert_close(g.grad.transpose(1, 2), w.grad, dtype, "grad")


def test_dropout_reaches_sdpa(sdpa_calls, rng):
    q, k, v = dense_inputs("bshd", 2, 16, 16, 4, 2, 64, torch.bfloat16, rng)
    call = opdispatch.validate_attention(q, k, v, layout="bshd", causal=True, dropout_p=0.25)
    unbound_from_device(CambriconSdpa, "sdpa").run(call)
    assert sdpa_calls[0]["dropout_p"] == 0.25
    assert "dropout" in " ".join(capability_reasons(MthreadsSdpa.caps, call))


def test_fused_gate_mirrors_torch_mlu():
    """check_fused_kernel_mlu_support (torch_mlu 1.22.0): split > 12 and valid-data ratio >= 0.6."""
    assert fused_gate(2, 16, 2048, 2048) is None
    assert "more than 12" in fused_gate(1, 12, 512, 256)  # 12 * 1 = 12: not > 12
    assert fused_gate(1, 13, 512, 256) is None
    assert ">= 0.6" in fused_gate(2, 16, 1, 4096)  # decode: 1 * 4096 / (512 * 4096)
    assert fused_gate(2, 16, 308, 256) is None  # 308 / 512 = 0.6015625
    assert ">= 0.6" in fused_gate(2, 16, 307, 256)  # 307 / 512 = 0.5996
    assert "empty" in fused_gate(4, 16, 0, 1024)


# -- selection on the simulated devices ----------------------------------------------------------------------

def _meta(b=2, sq=2048, sk=2048, hq=16, hkv=16, d=128, grad=False, dtype=torch.bfloat16):
    kw = dict(device="meta", dtype=dtype, requires_grad=grad)
    return (torch.empty(b, sq, hq, d, **kw), torch.empty(b, sk, hkv, d, **kw), torch.empty(b, sk, hkv, d, **kw))


@pytest.mark.parametrize("device,adapter", [(MLU, "cambricon.sdpa"), (MUSA, "mthreads.sdpa")])
def test_training_cells_pick_the_adapter(manager, device, adapter):
    for kwargs in (dict(causal=True), {}, dict(window=(256, 0)), dict(causal=True, causal_alignment="bottom_right")):
        assert opdispatch.explain(*_meta(grad=True), device=device, **kwargs).chosen_id == adapter, kwargs
    assert opdispatch.explain(*_meta(hkv=4, grad=True), device=device, causal=True).chosen_id == adapter  # GQA
    mask = torch.ones(2, 1, 2048, 2048, dtype=torch.bool, device="meta")
    assert opdispatch.explain(*_meta(grad=True), device=device, attn_mask=mask).chosen_id == adapter
    d = opdispatch.explain(*_meta(grad=True), device=device, softcap=30.0)
    assert d.chosen_id != adapter and "softcap" in " ".join(d.candidate(adapter).reasons)


def test_refusals_say_why(manager):
    d = opdispatch.explain(*_meta(sq=1, sk=4096), device=MLU)  # a decode step: torch_mlu would run math
    assert d.chosen_id != "cambricon.sdpa" and ">= 0.6" in " ".join(d.candidate("cambricon.sdpa").reasons)
    d = opdispatch.explain(*_meta(d=32, grad=True), device=MLU, causal=True)
    assert "head_dim 32 outside the supported range 64..256" in d.candidate("cambricon.sdpa").reasons
    d = opdispatch.explain(*_meta(d=96, grad=True), device=MUSA, causal=True)
    assert d.chosen_id != "mthreads.sdpa"
    assert "(64, 128)" in " ".join(d.candidate("mthreads.sdpa").reasons)
    assert opdispatch.explain(*_meta(d=96), device=MUSA, causal=True).chosen_id == "mthreads.sdpa"  # forward
    d = opdispatch.explain(*_meta(d=256, grad=True), device=MUSA, causal=True)
    assert "head_dim 256" in " ".join(d.candidate("mthreads.sdpa").reasons)
    d = opdispatch.explain(*_meta(grad=True, dtype=torch.float32), device=MUSA, causal=True)
    assert "dtype fp32 not supported (supported: bf16, fp16)" in d.candidate("mthreads.sdpa").reasons


# -- availability and probes ---------------------------------------------------------------------------------

def _device(vendor, type_, arch, **libraries):
    return opdispatch.DeviceInfo(vendor=vendor, type=type_, arch=arch, name=arch, index=0, libraries=libraries)


def test_availability_arch_and_versions(monkeypatch):
    mlu, musa = CambriconSdpa(), MthreadsSdpa()
    assert mlu.availability(_device("cambricon", "mlu", "mlu590", torch_mlu="1.24.0")) is None
    assert "MLU500" in mlu.availability(_device("cambricon", "mlu", "mlu370", torch_mlu="1.24.0"))
    assert "1.22.0" in mlu.availability(_device("cambricon", "mlu", "mlu590", torch_mlu="1.21.0"))
    assert musa.availability(_device("mthreads", "musa", "mp22", torch_musa="2.0.0")) is None
    assert musa.availability(_device("mthreads", "musa", "mp31", torch_musa="1.3.0")) is None
    assert "2.2" in musa.availability(_device("mthreads", "musa", "mp21", torch_musa="2.0.0"))
    assert "1.3.0" in musa.availability(_device("mthreads", "musa", "mp22", torch_musa="1.2.1"))
    assert "'musa'" in mlu.availability(_device("mthreads", "musa", "mp22", torch_musa="2.0.0"))
    # a real (probed) device: the library is looked up on the path
    real = _device("cambricon", "mlu", "mlu590")
    assert "not installed" in mlu.availability(real)
    install(monkeypatch, {"torch_mlu": types.ModuleType("torch_mlu")}, {"torch_mlu": "1.24.0+torch2.5.0"})
    assert mlu.availability(real) is None


def test_probes(monkeypatch):
    assert cambricon.opdispatch_probe_device(torch.device("cpu")) is None
    assert mthreads.opdispatch_probe_device(types.SimpleNamespace(type="musa", index=0)) is None  # no torch_musa
    install(monkeypatch, {"torch_mlu": types.ModuleType("torch_mlu"), "torch_musa": types.ModuleType("torch_musa")})
    mlu = types.SimpleNamespace(current_device=lambda: 1, get_device_name=lambda index: "MLU590-M9")
    musa = types.SimpleNamespace(current_device=lambda: 0, get_device_properties=lambda index: types.SimpleNamespace(
        major=2, minor=2, name="MTT S4000", total_memory=48 << 30))
    monkeypatch.setattr(torch, "mlu", mlu, raising=False)
    monkeypatch.setattr(torch, "musa", musa, raising=False)
    info = cambricon.opdispatch_probe_device(types.SimpleNamespace(type="mlu", index=None))
    assert (info.vendor, info.type, info.arch, info.index) == ("cambricon", "mlu", "mlu590", 1)
    info = mthreads.opdispatch_probe_device(types.SimpleNamespace(type="musa", index=None))
    assert (info.vendor, info.type, info.arch, info.name) == ("mthreads", "musa", "mp22", "MTT S4000")
