"""KunLunXin plugin: contract tests against a fake kunlun_ops; selection on P800; availability; device probe."""

from __future__ import annotations

import math
import sys
import time
import types

import pytest
import torch

import opdispatch
from opdispatch.vendors import kunlunxin
from opdispatch.vendors.kunlunxin import KunlunxinPrefill

from tests._vendor_helpers import (assert_matches_reference, dense_inputs, fake_cuda, gpu_props, real_device,
                             varlen_inputs)
from tests.conftest import device_descriptor
from tests.fakes import install
from tests.fakes import kunlun_ops as fake_kunlun

P800 = device_descriptor("p800")


@pytest.fixture
def klx_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, {"kunlun_ops": fake_kunlun.make(calls)})
    return calls


@pytest.mark.parametrize("layout,hq,hkv,kwargs", [
    ("bshd", 8, 2, dict(causal=True)),
    ("bhsd", 4, 4, dict(scale=0.05)),
    ("sbhd", 4, 1, dict(causal=True, scale=0.3)),
])
def test_dense_contract(klx_calls, rng, layout, hq, hkv, kwargs):
    q, k, v = dense_inputs(layout, 3, 10, 10, hq, hkv, 64, torch.bfloat16, rng)
    call = opdispatch.validate_attention(q, k, v, layout=layout, **kwargs)
    out = KunlunxinPrefill().run(call)
    (_, args, kw), = klx_calls
    assert kw["q"].shape == (30, hq, 64) and kw["k"].shape == (30, hkv, 64)  # packed, kv heads kept (GQA)
    assert kw["alpha"] == pytest.approx(call.scale * math.sqrt(64))  # the kernel applies 1/sqrt(d) itself
    assert kw["is_causal"] is call.causal and kw["is_prefix_cache"] is False
    assert kw["context_qlen_lod_cpu"].tolist() == [0, 10, 20, 30]
    assert kw["context_qlen_lod_xpu"].device == call.q.device
    assert (kw["swa_left"], kw["swa_right"], kw["alibi_slopes"], kw["softmax_lse"]) == (-1, -1, None, None)
    assert out.shape == call.q.shape
    assert_matches_reference(call, out)


def test_varlen_contract(klx_calls, rng):
    t = varlen_inputs([5, 13, 2], [5, 13, 2], 8, 4, 128, torch.float16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True)
    out = KunlunxinPrefill().run(call)
    kw = klx_calls[-1][2]
    assert kw["q"] is call.q and kw["context_qlen_lod_cpu"].tolist() == call.cu_seqlens_q.tolist()
    assert kw["alpha"] == pytest.approx(1.0)  # default scale 1/sqrt(d) → alpha 1
    assert_matches_reference(call, out)


def test_error_status_raises(monkeypatch, rng):
    mod = types.ModuleType("kunlun_ops")
    mod.prefill_attention = lambda **kw: 3
    install(monkeypatch, {"kunlun_ops": mod})
    q, k, v = dense_inputs("bshd", 1, 4, 4, 2, 2, 64, torch.float16, rng)
    with pytest.raises(RuntimeError, match="error code 3"):
        KunlunxinPrefill().run(opdispatch.validate_attention(q, k, v))


def test_xtorch_ops_option(monkeypatch, rng):
    calls: list = []
    install(monkeypatch, {"xtorch_ops": fake_kunlun.make(calls, "xtorch_ops")})
    monkeypatch.delitem(sys.modules, "kunlun_ops", raising=False)
    impl = KunlunxinPrefill()
    dev = real_device("kunlunxin", "xpu3", "P800", torch="2.5.1")
    assert "'kunlun_ops' is not installed" in impl.availability(dev)
    impl = impl.with_options({"ops_module": "xtorch_ops"})
    assert impl.requires[0].module == "xtorch_ops" and impl.availability(dev) is None
    q, k, v = dense_inputs("bshd", 1, 6, 6, 2, 2, 64, torch.float16, rng)
    impl.run(opdispatch.validate_attention(q, k, v))
    assert len(calls) == 1


def test_rejects_cross_attention_and_unclaimed_features(rng):
    impl, dev = KunlunxinPrefill(), opdispatch.load_device_descriptor(P800)
    q, k, v = dense_inputs("bshd", 1, 4, 8, 2, 2, 64, torch.float16, rng)
    assert "seqlen_q 4 != seqlen_k 8" in impl.not_supported_reasons(opdispatch.validate_attention(q, k, v), dev)[0]
    t = varlen_inputs([3, 5], [4, 4], 2, 2, 64, torch.float16, rng)
    call = opdispatch.validate_attention(**t, layout="thd")
    assert "cu_seqlens_q differs" in impl.not_supported_reasons(call, dev)[0]
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 64, torch.float16, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True, window=(4, 0), return_lse=True)
    reasons = "; ".join(impl.not_supported_reasons(call, dev))
    assert "sliding window" in reasons and "return_lse" in reasons


def test_p800_selection(manager):
    q = torch.empty(2, 512, 32, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 512, 8, 128, dtype=torch.bfloat16, device="meta")
    d = opdispatch.explain(q, kv, kv, device=str(P800), causal=True)
    assert d.chosen_id == "kunlunxin.prefill"
    for impl_id in ("rocm.aiter", "iluvatar.ixformer", "cpu.flash"):
        assert d.candidate(impl_id).status == "unavailable"
    assert "not vendor 'kunlunxin'" in d.candidate("iluvatar.ixformer").reasons[0]
    short_q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16, device="meta")  # a decode step
    d = opdispatch.explain(short_q, kv, kv, device=str(P800), causal=True, causal_alignment="bottom_right")
    # FlagGems' dense kernel takes the decode step on KunLunXin (issue 35)
    assert d.chosen_id == "flagos.triton" and "seqlen_q 1 != seqlen_k 512" in d.candidate("kunlunxin.prefill").reasons[0]


def test_availability_absent_library_and_device(manager, monkeypatch, klx_calls):
    dev = real_device("kunlunxin", "xpu3", "P800", torch="2.5.1")
    assert KunlunxinPrefill().availability(dev) is None
    assert "runs on device type 'cuda', not 'cpu'" == KunlunxinPrefill().availability(manager.device_info("cpu"))
    monkeypatch.delitem(sys.modules, "kunlun_ops")
    reason = KunlunxinPrefill().availability(dev)
    assert "'kunlun_ops' is not installed" in reason and "vLLM-Kunlun" in reason


def test_probe(monkeypatch):
    start = time.perf_counter()
    assert kunlunxin.opdispatch_probe_device(torch.device("cuda", 0)) is None
    assert time.perf_counter() - start < 0.05
    fake_cuda(monkeypatch, gpu_props("P800 OAM", sms=64, memory_gib=96))
    xmlir = types.ModuleType("torch_xmlir")
    install(monkeypatch, {"torch_xmlir": xmlir})
    info = kunlunxin.opdispatch_probe_device(torch.device("cuda", 0))
    assert (info.vendor, info.type, info.arch, info.name) == ("kunlunxin", "cuda", "xpu3", "P800 OAM")
    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm torch is AMD's, even with torch_xmlir around
    assert kunlunxin.opdispatch_probe_device(torch.device("cuda", 0)) is None
