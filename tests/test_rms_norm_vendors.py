"""rms_norm adapters of apex (NVIDIA), aiter (AMD) and kunlun_ops (KunLunXin): contract tests against fakes that
mirror the real signatures, numerics against a float64 oracle, inputs never modified, selection per device."""

from __future__ import annotations

import zlib

import pytest
import torch

import opdispatch
from opdispatch import validate_rms_norm
from opdispatch.vendors.iluvatar import IxformerRmsNorm
from opdispatch.vendors.kunlunxin import KunlunRmsNorm
from opdispatch.vendors.nvidia import ApexRmsNorm
from opdispatch.vendors.rocm import AiterRmsNorm

from tests._vendor_helpers import real_device
from tests.conftest import TOLERANCES, device_descriptor
from tests.fakes import aiter as fake_aiter
from tests.fakes import apex as fake_apex
from tests.fakes import install
from tests.fakes import ixformer as fake_ixformer
from tests.fakes import kunlun_ops as fake_kunlun

IMPLS = {"apex": ApexRmsNorm, "aiter": AiterRmsNorm, "kunlun": KunlunRmsNorm, "ixformer": IxformerRmsNorm}


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, fake_apex.make(calls))
    install(monkeypatch, {"aiter": fake_aiter.make(calls), "kunlun_ops": fake_kunlun.make(calls)})
    install(monkeypatch, fake_ixformer.make(calls, functions=("ixformer.inference.functions",)))
    return calls


def oracle(x, weight, eps, residual=None):
    h = x.double() if residual is None else x.double() + residual.double()
    y = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = y if weight is None else y * weight.double()
    return y if residual is None else (y, h)


def make(shape, dtype, gen, *, strided=False):
    if strided:  # every other column of a wider buffer: a non-unit last-dim stride
        return torch.randn(*shape[:-1], shape[-1] * 2, generator=gen).to(dtype)[..., ::2]
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("name, dtype", [(name, dtype) for name in IMPLS
                                         for dtype in (torch.float32, torch.float16, torch.bfloat16)
                                         if dtype in IMPLS[name].caps.dtypes])
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 33), (64,)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_matches_float64_oracle_and_leaves_inputs_alone(fakes, name, dtype, shape, with_weight, with_residual,
                                                        strided):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, shape, with_weight, with_residual, strided)).encode()))
    x = make(shape, dtype, gen, strided=strided)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype) if with_weight else None
    residual = make(shape, dtype, gen) if with_residual else None
    before = [t.clone() for t in (x, weight, residual) if t is not None]
    call = validate_rms_norm(x, weight, 1e-5, residual)
    impl = IMPLS[name]()
    assert impl.not_supported_reasons(call, None) == []
    got = impl.run(call)
    want = oracle(x, weight, 1e-5, residual)
    tol = TOLERANCES[dtype]
    if with_residual:
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got[0].double(), want[0], **tol)
        torch.testing.assert_close(got[1].double(), want[1], **tol)
        assert got[1].shape == x.shape and got[1].dtype == dtype
    else:
        torch.testing.assert_close(got.double(), want, **tol)
    assert got[0].shape == x.shape if with_residual else got.shape == x.shape
    for kept, now in zip(before, (t for t in (x, weight, residual) if t is not None)):
        assert torch.equal(kept, now)  # the callers' tensors are never written
    assert fakes, "the vendor kernel was not called"


def test_each_adapter_calls_its_vendor_entry_point(fakes):
    gen = torch.Generator().manual_seed(1)
    x, w, r = make((4, 16), torch.float32, gen), torch.rand(16, generator=gen) + 0.5, make((4, 16), torch.float32, gen)
    ApexRmsNorm().run(validate_rms_norm(x, w, 1e-6))
    ApexRmsNorm().run(validate_rms_norm(x, None, 1e-6))
    AiterRmsNorm().run(validate_rms_norm(x, w, 1e-6, r))
    KunlunRmsNorm().run(validate_rms_norm(x, w, 1e-6))
    KunlunRmsNorm().run(validate_rms_norm(x, w, 1e-6, r))
    assert [c[0] for c in fakes] == ["fused_rms_norm_affine", "fused_rms_norm", "rmsnorm2d_fwd_with_add", "rmsnorm",
                                     "add_rmsnorm"]


def test_apex_gradients_match_float64_oracle(fakes):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 24, generator=gen, requires_grad=True)
    w = (1 + 0.1 * torch.randn(24, generator=gen)).requires_grad_()
    r = torch.randn(5, 24, generator=gen, requires_grad=True)
    y, h = ApexRmsNorm().run(validate_rms_norm(x, w, 1e-6, r))
    g_y, g_h = torch.randn(5, 24, generator=gen), torch.randn(5, 24, generator=gen)
    got = torch.autograd.grad((y, h), (x, w, r), (g_y, g_h))
    x64, w64, r64 = (t.detach().double().requires_grad_() for t in (x, w, r))
    want_y, want_h = oracle(x64, w64, 1e-6, r64)
    want = torch.autograd.grad((want_y, want_h), (x64, w64, r64), (g_y.double(), g_h.double()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_reasons_when_declined(fakes):
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    mixed = validate_rms_norm(x, torch.ones(8))  # fp32 weight for bf16 x
    for impl in (ApexRmsNorm(), AiterRmsNorm(), IxformerRmsNorm()):
        assert "weight dtype fp32 differs from x's bf16" in impl.not_supported_reasons(mixed, None)[0]
    assert KunlunRmsNorm().not_supported_reasons(mixed, None) == []
    grad = validate_rms_norm(x.float().requires_grad_(), torch.ones(8))
    for impl in (AiterRmsNorm(), KunlunRmsNorm(), IxformerRmsNorm()):
        assert "backward not supported (forward only)" in impl.not_supported_reasons(grad, None)
    assert ApexRmsNorm().not_supported_reasons(grad, None) == []
    f64 = validate_rms_norm(x.double())
    assert any("fp64" in r for r in KunlunRmsNorm().not_supported_reasons(f64, None))


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(grad)


def test_selection_on_each_vendors_device(manager, fakes):
    w = _meta(4096)
    mi300x = str(device_descriptor("mi300x"))
    d = opdispatch.explain_rms_norm(_meta(8, 4096), w, residual=_meta(8, 4096), device=mi300x)
    assert d.chosen_id == "rocm.aiter_rms_norm" and "aiter-rms-norm-on-amd" in str(d.decided_by)
    # training on AMD: aiter has no backward, torch's kernel takes it
    assert opdispatch.explain_rms_norm(_meta(8, 4096, grad=True), w, device=mi300x).chosen_id == "torch.rms_norm"
    bi_v150 = str(device_descriptor("bi-v150"))
    d = opdispatch.explain_rms_norm(_meta(8, 4096), w, residual=_meta(8, 4096), device=bi_v150)
    assert d.chosen_id == "iluvatar.ixformer_rms_norm" and "ixformer-rms-norm-on-iluvatar" in str(d.decided_by)
    p800 = str(device_descriptor("p800"))
    d = opdispatch.explain_rms_norm(_meta(8, 4096), w, device=p800)
    assert d.chosen_id == "kunlunxin.rms_norm" and "kunlun-rms-norm-on-kunlunxin" in str(d.decided_by)
    # NVIDIA: torch's fused kernel leads; apex is available where installed and takes what torch is denied
    h100_apex = real_device("nvidia", "sm90", "NVIDIA H100", apex="0.1", torch="2.11.0")
    d = opdispatch.explain_rms_norm(_meta(8, 4096), w, device=h100_apex)
    assert d.chosen_id == "torch.rms_norm"
    assert next(c for c in d.candidates if c.impl_id == "nvidia.apex_rms_norm").status == "eligible"
    with opdispatch.policy_override(deny=["torch.rms_norm"]):
        assert opdispatch.explain_rms_norm(_meta(8, 4096), w, device=h100_apex).chosen_id == "nvidia.apex_rms_norm"
    # without the library, the reason names the install command
    d = opdispatch.explain_rms_norm(_meta(8, 4096), w, device=str(device_descriptor("h100")))
    apex = next(c for c in d.candidates if c.impl_id == "nvidia.apex_rms_norm")
    assert apex.status == "unavailable" and "'apex' is not declared" in apex.reasons[0]
    # each vendor's kernel stays off the other vendors' hardware
    for impl_id in ("rocm.aiter_rms_norm", "kunlunxin.rms_norm", "iluvatar.ixformer_rms_norm"):
        assert next(c for c in d.candidates if c.impl_id == impl_id).status == "unavailable"


def test_a_decision_is_not_reused_across_weight_dtypes(manager, fakes):
    """apex takes a weight of x's dtype only: the decision for a bf16 weight must not serve a float32 one."""
    h100_apex = real_device("nvidia", "sm90", "NVIDIA H100", apex="0.1", torch="2.11.0")
    x = _meta(8, 256)
    with opdispatch.policy_override(deny=["torch.rms_norm", "flagos.*"]):
        same = manager.resolve("rms_norm", validate_rms_norm(x, _meta(256)), device=h100_apex)
        assert same.chosen_id == "nvidia.apex_rms_norm"
        mixed = manager.resolve("rms_norm", validate_rms_norm(x, _meta(256, dtype=torch.float32)), device=h100_apex)
        assert mixed.chosen_id == "reference.rms_norm"
        assert "weight dtype fp32 differs" in mixed.candidate("nvidia.apex_rms_norm").reasons[0]


@pytest.mark.parametrize("module", ["ixformer.inference.functions", "ixformer.functions"])
@pytest.mark.parametrize("residual_returns", [True, False])
def test_ixformer_modules_and_in_place_residual_kernel(monkeypatch, module, residual_returns):
    """ixformer's residual_rms_norm may write into its inputs and return nothing: the adapter gives it private
    copies and reads the results from them; either module of the public callers is found."""
    calls: list = []
    install(monkeypatch, fake_ixformer.make(calls, functions=(module,), residual_returns=residual_returns))
    gen = torch.Generator().manual_seed(5)
    x, r = make((3, 5, 64), torch.float16, gen, strided=True), make((3, 5, 64), torch.float16, gen)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).half()
    before = (x.clone(), r.clone())
    y, h = IxformerRmsNorm().run(validate_rms_norm(x, w, 1e-6, r))
    want_y, want_h = oracle(x, w, 1e-6, r)
    torch.testing.assert_close(y.double(), want_y, **TOLERANCES[torch.float16])
    torch.testing.assert_close(h.double(), want_h, **TOLERANCES[torch.float16])
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    assert [c[0] for c in calls] == ["residual_rms_norm"]


def test_apex_without_its_cuda_extension_is_unavailable_with_the_build_command(manager, monkeypatch):
    calls: list = []
    modules = fake_apex.make(calls)
    del modules["fused_layer_norm_cuda"]  # `pip install apex` without --cuda_ext: apex imports, the kernels don't
    install(monkeypatch, modules)
    monkeypatch.delitem(__import__("sys").modules, "fused_layer_norm_cuda", raising=False)
    h100_apex = real_device("nvidia", "sm90", "NVIDIA H100", torch="2.11.0")
    reason = manager.availability(ApexRmsNorm(), h100_apex)
    assert reason is not None and "'fused_layer_norm_cuda' is not installed" in reason and "cuda_ext" in reason
