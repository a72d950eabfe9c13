"""`pads_v_head_dim` (plugins/opdispatch/plugins/_head_dim_padding.py): adapters whose kernels need one head dim for q/k/v take MLA
calls (q/k 192, v 128) by zero-padding v, exactly. Each opted-in adapter runs on CPU behind its vendor fake against
an independent float64 oracle — forward, LSE where returned, backward where it trains — over MHA/GQA ×
causal/not × layouts; the kernel must be handed v as wide as q/k; equal head dims pass v through untouched; the
refusals (wider v, KV caches, mthreads' head dims) say why; overridden bind/backward are padded too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl
from opdispatch.ops._attention import capability_reasons
from opdispatch.plugins.toolkit import V_PADDING_COST, bind_dense, pads_v_head_dim, size_generic
from opdispatch.vendors.ascend import AscendFusionAttention
from opdispatch.vendors.cambricon import CambriconSdpa
from opdispatch.vendors.flagos import FlagGemsAttention
from opdispatch.vendors.iluvatar import IluvatarIxformer
from opdispatch.vendors.kunlunxin import KunlunxinPrefill
from opdispatch.vendors.mthreads import MthreadsSdpa
from opdispatch.vendors.rocm import RocmAOTriton, RocmFlashAttnCK

from tests._vendor_helpers import allowed_keys, dense_inputs, to_bhsd
from tests._vendor_helpers import dense_oracle as oracle
from tests.conftest import DEVICES_DIR, TOLERANCES
from tests.fakes import flag_gems as fake_flag_gems
from tests.fakes import flash_attn_rocm as fake_fa
from tests.fakes import install
from tests.fakes import ixformer as fake_ixformer
from tests.fakes import kunlun_ops as fake_kunlun
from tests.fakes import torch_npu as fake_npu


@dataclass
class Adapter:
    cls: type
    install: Callable[[Any, list], None]
    v_width: Callable[[list], int]  # the head dim of the v the kernel was handed, from the fake's record
    v_given: Callable[[list], torch.Tensor | None]  # that v itself where the fake records it
    dims: tuple[int, int] = (192, 128)
    train: bool = False
    lse: bool = False
    same_lengths: bool = False  # kunlunxin: self-attention prefill only


def _spy_sdpa(monkeypatch, calls):
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(v)
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def _gems(monkeypatch, calls):
    module = fake_flag_gems.install(monkeypatch)
    for entry in ("scaled_dot_product_attention_forward", "flash_attn_varlen_func"):
        real = getattr(module, entry)

        def spy(q, k, v, *args, _real=real, **kw):
            calls.append(v)
            return _real(q, k, v, *args, **kw)

        monkeypatch.setattr(module, entry, spy)


ADAPTERS = {
    "ascend": Adapter(AscendFusionAttention, lambda mp, c: install(mp, fake_npu.make(c)),
                      lambda c: c[-1]["value"].shape[-1], lambda c: c[-1]["value"], train=True, lse=True),
    "cambricon": Adapter(CambriconSdpa, _spy_sdpa, lambda c: c[-1].shape[-1], lambda c: None, train=True),
    # torch_musa's kernels take head dims up to 128: MLA's 192 stays refused there (test below)
    "mthreads": Adapter(MthreadsSdpa, _spy_sdpa, lambda c: c[-1].shape[-1], lambda c: None, dims=(128, 64),
                        train=True),
    "iluvatar": Adapter(IluvatarIxformer, lambda mp, c: install(mp, fake_ixformer.make(c)),
                        lambda c: c[-1][2]["v"].shape[-1], lambda c: None),
    "kunlunxin": Adapter(KunlunxinPrefill, lambda mp, c: install(mp, {"kunlun_ops": fake_kunlun.make(c)}),
                         lambda c: c[-1][2]["v"].shape[-1], lambda c: None, same_lengths=True),
    "rocm.ck": Adapter(RocmFlashAttnCK, lambda mp, c: install(mp, {"flash_attn": fake_fa.make(c)},
                                                              distributions={"flash_attn": "2.8.3"}),
                       lambda c: c[-1][1][2].shape[-1], lambda c: c[-1][1][2], train=True, lse=True),
    # FlagGems' dense kernel takes head dims {16, 32, 64, 128, 256} and asserts one for q/k/v
    "flagos": Adapter(FlagGemsAttention, _gems, lambda c: c[-1].shape[-1], lambda c: c[-1], dims=(128, 64),
                      lse=True),
}

# (layout, sq, sk, hq, hkv, dtype, kwargs)
CASES = [
    ("bshd", 16, 16, 4, 4, torch.bfloat16, {}),
    ("bhsd", 16, 16, 4, 2, torch.float16, dict(causal=True)),
    ("bshd", 12, 20, 4, 1, torch.bfloat16, dict(causal=True, causal_alignment="bottom_right", scale=0.07)),
    ("bhsd", 20, 20, 4, 2, torch.bfloat16, dict(causal=True, scale=0.11)),
]


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _close(got, want, dtype, what):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4, msg=what)


@pytest.mark.parametrize("name", list(ADAPTERS))
@pytest.mark.parametrize("layout,sq,sk,hq,hkv,dtype,kwargs", CASES)
def test_narrow_v_against_float64(monkeypatch, rng, name, layout, sq, sk, hq, hkv, dtype, kwargs):
    spec = ADAPTERS[name]
    if spec.same_lengths and sq != sk:
        pytest.skip("prefill_attention takes one LoD for q and k/v")
    calls: list = []
    spec.install(monkeypatch, calls)
    d, dv = spec.dims
    q, k, v = _leaves(dense_inputs(layout, 2, sq, sk, hq, hkv, d, dtype, rng, dv=dv))
    grad = spec.train
    if not grad:
        q, k, v = (t.detach() for t in (q, k, v))
    call = opdispatch.validate_attention(q, k, v, layout=layout, return_lse=spec.lse, **kwargs)
    assert call.head_dim == d and call.head_dim_v == dv
    assert not capability_reasons(spec.cls.caps, call)
    result = spec.cls().run(call)
    assert spec.v_width(calls) == d  # the kernel saw one head dim for q/k/v
    out, lse = result if spec.lse else (result, None)
    assert out.shape == call.q.shape[:-1] + (dv,) and out.dtype == dtype
    q64, k64, v64 = _leaves(to_bhsd(t, layout).double() for t in (q, k, v))
    allowed = allowed_keys(sq, sk, call.causal, call.window, call.causal_alignment)
    want, want_lse = oracle(q64, k64, v64, call.scale, allowed)
    _close(to_bhsd(out, layout), want, dtype, "out")
    if lse is not None:
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)
    if grad:
        grad_out = torch.randn(out.shape, generator=rng).to(dtype)
        (out.float() * grad_out.float()).sum().backward()
        (want * to_bhsd(grad_out, layout).double()).sum().backward()
        for what, got, ref in zip("qkv", (q, k, v), (q64, k64, v64)):
            assert got.grad is not None and got.grad.shape == got.shape
            _close(to_bhsd(got.grad, layout), ref.grad, dtype, f"d{what}")


@pytest.mark.parametrize("name", [n for n, s in ADAPTERS.items()])
def test_equal_head_dims_pass_v_untouched(monkeypatch, rng, name):
    spec = ADAPTERS[name]
    calls: list = []
    spec.install(monkeypatch, calls)
    d = spec.dims[0]
    q, k, v = dense_inputs("bshd", 2, 16, 16, 4, 2, d, torch.bfloat16, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True)
    pads = []
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **kw: pads.append(a) or torch.constant_pad_nd(*a))
    out = spec.cls().run(call)
    assert not pads and spec.v_width(calls) == d
    seen = spec.v_given(calls)
    if seen is not None:  # the very tensor (or a view of its storage): no copy
        assert seen.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    want, _ = oracle(*(to_bhsd(t, "bshd").double() for t in (q, k, v)), call.scale,
                     allowed_keys(16, 16, True, None, call.causal_alignment))
    _close(to_bhsd(out, "bshd"), want, torch.bfloat16, "out")


@pytest.mark.parametrize("cls", [AscendFusionAttention, CambriconSdpa, FlagGemsAttention, IluvatarIxformer,
                                 KunlunxinPrefill, MthreadsSdpa, RocmAOTriton, RocmFlashAttnCK])
def test_refusals_say_why(rng, cls):
    device = opdispatch.load_device_descriptor(DEVICES_DIR / "ascend-910b.yaml")
    q, k, v = dense_inputs("bshd", 2, 16, 16, 4, 4, 64, torch.bfloat16, rng, dv=128)
    wider = cls().not_supported_reasons(opdispatch.validate_attention(q, k, v), device)
    assert any("v head_dim 128 above q/k head_dim 64" in r and "pads only a narrower v" in r for r in wider)
    assert cls.caps.head_dim_v_differs
    assert cls().describe_capabilities()["head_dim_v_padded"] == V_PADDING_COST


def test_kv_cache_with_narrow_v_is_refused(rng):
    q = torch.randn(2, 1, 4, 128, generator=rng).bfloat16()
    k = torch.randn(2, 32, 4, 128, generator=rng).bfloat16()
    v = torch.randn(2, 32, 4, 64, generator=rng).bfloat16()
    call = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right",
                                         seqused_k=torch.tensor([5, 32], dtype=torch.int32))
    device = opdispatch.load_device_descriptor(DEVICES_DIR / "mi250x.yaml")
    reasons = RocmFlashAttnCK().not_supported_reasons(call, device)
    assert any("with a KV cache" in r and "copy the whole cache" in r for r in reasons)


def test_mla_selection_on_simulated_devices(manager):
    meta = dict(device="meta", dtype=torch.bfloat16)

    def chosen(device, grad):
        q = torch.empty(2, 2048, 16, 192, **meta, requires_grad=grad)
        k = torch.empty(2, 2048, 16, 192, **meta, requires_grad=grad)
        v = torch.empty(2, 2048, 16, 128, **meta, requires_grad=grad)
        return opdispatch.explain(q, k, v, causal=True, device=DEVICES_DIR / f"{device}.yaml")

    assert chosen("ascend-910b", True).chosen_id == "ascend.fusion_attention"
    assert chosen("cambricon-mlu590", True).chosen_id == "cambricon.sdpa"
    assert chosen("mi250x", True).chosen_id == "rocm.ck"
    assert chosen("bi-v150", False).chosen_id == "iluvatar.ixformer"
    assert chosen("p800", False).chosen_id == "kunlunxin.prefill"
    musa = chosen("mthreads-s4000", True).candidate("mthreads.sdpa")
    assert musa.reasons[0] == "head_dim 192 outside the supported range 1..128"  # 192 stays refused there


def test_decorator_refuses_a_kernel_that_already_takes_unequal_dims():
    class Wide(AttentionImpl):
        vendor, name = "test", "wide"
        caps = AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd"}), head_dim_v_differs=True)

        def run(self, call):
            raise AssertionError

    with pytest.raises(TypeError, match="already declare head_dim_v_differs"):
        pads_v_head_dim(Wide)


# -- an implementation overriding bind and backward: both go through the padding too ------------------------

def _equal_dims_kernel(q, k, v, scale):
    """(b, h, s, d) float attention that, like the vendor kernels, takes one head dim."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, v.shape)
    p = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * scale, -1)
    return p @ v


@pads_v_head_dim
class _BoundKernel(AttentionImpl):
    vendor, name = "test", "bound"
    caps = AttentionCaps(dtypes=frozenset({torch.float64}), layouts=frozenset({"bshd", "bhsd"}), lse=True,
                         backward=True)
    backward_calls: list = []

    def run(self, call):
        q, k, v = (call.bhsd(t) for t in (call.q, call.k, call.v))
        out = call.from_bhsd(_equal_dims_kernel(q, k, v, call.scale))
        if call.return_lse:
            lse = torch.logsumexp(torch.einsum("bhqd,bhkd->bhqk", q, k) * call.scale, -1)
            return out, lse
        return out

    def bind(self, call):
        scale = call.scale
        return size_generic(bind_dense(call, lambda q, k, v: _equal_dims_kernel(q, k, v, scale)))

    def backward(self, call, out, lse, grad_out):
        type(self).backward_calls.append(call.v.shape[-1])
        q, k, v = (call.bhsd(t) for t in (call.q, call.k, call.v))
        o, do = call.bhsd(out), call.bhsd(grad_out)
        assert v.shape[-1] == q.shape[-1] == o.shape[-1] == do.shape[-1]
        p = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q, k) * call.scale - lse.unsqueeze(-1))
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True)) * call.scale
        return call.from_bhsd(ds @ k), call.from_bhsd(ds.transpose(-1, -2) @ q), call.from_bhsd(dv)


def test_overridden_bind_and_backward_are_padded(rng):
    q, k, v = (torch.randn(2, 12, 3, d, generator=rng, dtype=torch.float64) for d in (48, 48, 32))
    call = opdispatch.validate_attention(q, k, v)
    impl = _BoundKernel()
    fn = impl.bind(call)
    assert getattr(fn, "size_generic", False)
    want, want_lse = oracle(*(t.transpose(1, 2) for t in (q, k, v)), call.scale, None)
    torch.testing.assert_close(fn(q, k, v).transpose(1, 2), want)
    lse_call = opdispatch.validate_attention(q, k, v, return_lse=True)
    out, lse = impl.run(lse_call)
    torch.testing.assert_close(lse, want_lse)
    grad_out = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    dq, dk, dv = impl.backward(lse_call, out, lse, grad_out)
    assert _BoundKernel.backward_calls[-1] == 48 and dv.shape == v.shape
    q64, k64, v64 = _leaves(t.transpose(1, 2) for t in (q, k, v))
    ref, _ = oracle(q64, k64, v64, call.scale, None)
    (ref * grad_out.transpose(1, 2)).sum().backward()
    for got, leaf in zip((dq, dk, dv), (q64, k64, v64)):
        torch.testing.assert_close(got.transpose(1, 2), leaf.grad)
