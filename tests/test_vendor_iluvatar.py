"""Iluvatar plugin: contract tests against a fake ixformer; selection on BI-V150; availability; device probe."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

import opdispatch
from opdispatch.vendors import iluvatar
from opdispatch.vendors.iluvatar import IluvatarIxformer

from tests._vendor_helpers import (assert_matches_reference, dense_inputs, fake_cuda, gpu_props, real_device,
                             varlen_inputs)
from tests.conftest import device_descriptor
from tests.fakes import install
from tests.fakes import ixformer as fake_ixformer

BI_V150 = device_descriptor("bi-v150")


@pytest.fixture
def ix_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, fake_ixformer.make(calls))
    return calls


@pytest.mark.parametrize("layout,sq,sk,hq,hkv,kwargs", [
    ("bshd", 16, 16, 8, 2, dict(causal=True)),
    ("bhsd", 8, 20, 4, 4, dict(causal=True, causal_alignment="bottom_right", scale=0.25)),
    ("sbhd", 12, 12, 4, 1, {}),
])
def test_dense_packed_into_varlen(ix_calls, rng, layout, sq, sk, hq, hkv, kwargs):
    q, k, v = dense_inputs(layout, 2, sq, sk, hq, hkv, 64, torch.float16, rng)
    call = opdispatch.validate_attention(q, k, v, layout=layout, **kwargs)
    out = IluvatarIxformer().run(call)
    (_, args, kw), = ix_calls
    assert args == ()  # keywords only: vLLM's positional order differs from flash-attn's
    assert kw["q"].shape == (2 * sq, hq, 64) and kw["k"].shape == (2 * sk, hkv, 64)
    assert kw["cu_seqlens_q"].tolist() == [0, sq, 2 * sq] and kw["cu_seqlens_k"].tolist() == [0, sk, 2 * sk]
    assert kw["cu_seqlens_q"].dtype == torch.int32
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (sq, sk)
    assert kw["softmax_scale"] == call.scale and kw["causal"] is call.causal
    assert out.shape == call.q.shape
    assert_matches_reference(call, out)


def test_varlen_passes_cu_seqlens_through(ix_calls, rng):
    t = varlen_inputs([3, 11, 6], [3, 11, 6], 4, 2, 128, torch.bfloat16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True)
    out = IluvatarIxformer().run(call)
    kw = ix_calls[-1][2]
    assert kw["q"] is call.q and kw["cu_seqlens_q"] is call.cu_seqlens_q and kw["cu_seqlens_k"] is call.cu_seqlens_k
    assert kw["max_seqlen_q"] == 11
    assert_matches_reference(call, out)


def test_module_option_and_toplevel_fallback(monkeypatch, rng):
    calls: list = []
    install(monkeypatch, fake_ixformer.make(calls, toplevel_only=True))
    monkeypatch.delitem(sys.modules, "ixformer.contrib", raising=False)
    monkeypatch.delitem(sys.modules, "ixformer.contrib.vllm_flash_attn", raising=False)
    impl = IluvatarIxformer()
    dev = real_device("iluvatar", "ivcore11", "Iluvatar BI-V150", torch="2.7.1")
    assert impl.availability(dev) is None  # auto: contrib shim absent, top-level ixformer has it
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 64, torch.float16, rng)
    impl.run(opdispatch.validate_attention(q, k, v))
    assert len(calls) == 1
    impl = impl.with_options({"module": "ixformer.contrib.vllm_flash_attn"})
    assert "no usable flash_attn_varlen_func" in impl.availability(dev)


def test_signature_without_our_keywords_is_unavailable(monkeypatch):
    mod = types.ModuleType("ixformer")
    mod.__path__ = []
    mod.flash_attn_varlen_func = lambda q, k, v, cu_q, cu_k, max_q, max_k, causal=False: None  # positional names
    install(monkeypatch, {"ixformer": mod})
    monkeypatch.delitem(sys.modules, "ixformer.contrib", raising=False)
    dev = real_device("iluvatar", "ivcore11", "Iluvatar BI-V150", torch="2.7.1")
    reason = IluvatarIxformer().availability(dev)
    assert "does not accept the keywords" in reason and "cu_seqlens_q" in reason


def test_rejects_what_it_does_not_claim(rng):
    impl, dev = IluvatarIxformer(), opdispatch.load_device_descriptor(BI_V150)
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 60, torch.float16, rng)
    call = opdispatch.validate_attention(q, k, v, window=(4, 4), return_lse=True)
    reasons = "; ".join(impl.not_supported_reasons(call, dev))
    assert "multiple of 8" in reasons and "sliding window" in reasons and "return_lse" in reasons


def _meta(sq=256, sk=256, dtype=torch.bfloat16):
    return (torch.empty(1, sq, 16, 128, dtype=dtype, device="meta"),
            torch.empty(1, sk, 4, 128, dtype=dtype, device="meta"),
            torch.empty(1, sk, 4, 128, dtype=dtype, device="meta"))


def test_bi_v150_selection(manager):
    d = opdispatch.explain(*_meta(), device=str(BI_V150), causal=True)
    assert d.chosen_id == "iluvatar.ixformer"
    for impl_id in ("rocm.aiter", "rocm.ck", "rocm.aotriton", "kunlunxin.prefill"):
        c = d.candidate(impl_id)
        assert c.status == "unavailable" and "not vendor 'iluvatar'" in c.reasons[0]
    d = opdispatch.explain(*_meta(), device=str(BI_V150), causal=True, window=(32, 0))
    # ixformer has no window; FlagGems' varlen kernel (its generic Triton, run on Iluvatar) takes it (issue 35)
    assert d.chosen_id == "flagos.triton"
    assert d.candidate("iluvatar.ixformer").reasons == ["sliding window (32, 0) not supported"]


def test_absent_library_and_absent_device(manager, monkeypatch, ix_calls):
    dev = real_device("iluvatar", "ivcore11", "Iluvatar BI-V150", torch="2.7.1")
    assert IluvatarIxformer().availability(dev) is None
    assert "runs on device type 'cuda', not 'cpu'" == IluvatarIxformer().availability(manager.device_info("cpu"))
    assert "supports 'iluvatar' hardware, not vendor 'amd'" in IluvatarIxformer().availability(
        real_device("amd", "gfx942", "MI300X", torch="2.7.1"))
    for name in ("ixformer", "ixformer.contrib", "ixformer.contrib.vllm_flash_attn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    reason = IluvatarIxformer().availability(dev)
    assert "'ixformer' is not installed" in reason and "CoreX" in reason


def test_probe(monkeypatch):
    start = time.perf_counter()
    assert iluvatar.opdispatch_probe_device(torch.device("cuda", 0)) is None
    assert iluvatar.opdispatch_probe_device(torch.device("cpu")) is None
    assert time.perf_counter() - start < 0.05
    fake_cuda(monkeypatch, gpu_props("Iluvatar BI-V150", major=7, minor=1, sms=16, memory_gib=64))
    monkeypatch.setattr(torch, "__version__", "2.7.1+corex.4.4.0")
    info = iluvatar.opdispatch_probe_device(torch.device("cuda", 0))
    assert (info.vendor, info.arch, info.capability, info.name) == ("iluvatar", "ivcore11", (7, 1), "Iluvatar BI-V150")
    assert info.libraries["torch"] == "2.7.1"
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    assert iluvatar.opdispatch_probe_device(torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch, "corex", types.SimpleNamespace(), raising=False)  # FlagGems' signal
    assert iluvatar.opdispatch_probe_device(torch.device("cuda", 0)).vendor == "iluvatar"
    # ROCm's probe does not claim it.
    from opdispatch.vendors import rocm
    assert rocm.opdispatch_probe_device(torch.device("cuda", 0)) is None
