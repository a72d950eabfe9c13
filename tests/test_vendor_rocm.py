"""ROCm plugin: contract tests against fakes of flash_attn (CK), aiter and torch's ROCm flash op; selection on
the MI300X/MI250X descriptors; availability; device probe."""

from __future__ import annotations

import sys
import time

import pytest
import torch

import opdispatch
from opdispatch.vendors import rocm
from opdispatch.vendors.rocm import RocmAiter, RocmAOTriton, RocmFlashAttnCK

from tests._vendor_helpers import (assert_matches_reference, dense_inputs, fake_cuda, gpu_props, real_device,
                             varlen_inputs)
from tests.conftest import device_descriptor
from tests.fakes import aiter as fake_aiter
from tests.fakes import flash_attn_rocm as fake_fa
from tests.fakes import install

BF16 = torch.bfloat16
MI300X = device_descriptor("mi300x")
MI250X = device_descriptor("mi250x")


@pytest.fixture
def fa_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, {"flash_attn": fake_fa.make(calls)}, distributions={"flash_attn": "2.8.3"})
    return calls


@pytest.fixture
def aiter_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, {"aiter": fake_aiter.make(calls)})
    return calls


DENSE_CASES = [
    # layout, sq, sk, hq, hkv, d, kwargs
    ("bshd", 16, 16, 4, 4, 64, dict(causal=True)),
    ("bhsd", 8, 24, 8, 2, 64, dict(causal=True, causal_alignment="bottom_right")),  # GQA, sq < sk
    ("sbhd", 24, 8, 4, 1, 32, dict(causal=True, causal_alignment="bottom_right", return_lse=True)),  # blind rows
    ("bshd", 16, 16, 4, 2, 64, dict(window=(3, 2), scale=0.3, return_lse=True)),
    ("bshd", 12, 20, 4, 4, 40, dict(causal=True, causal_alignment="bottom_right", window=(5, 0))),
    ("bhsd", 10, 10, 4, 4, 64, dict(alibi_slopes=torch.linspace(0.1, 0.8, 4), return_lse=True)),
]


def _call(layout, sq, sk, hq, hkv, d, kwargs, gen, dtype=BF16):
    q, k, v = dense_inputs(layout, 2, sq, sk, hq, hkv, d, dtype, gen)
    return opdispatch.validate_attention(q, k, v, layout=layout, **kwargs)


def _expected_window(call):
    return call.window if call.window is not None else (-1, -1)


@pytest.mark.parametrize("layout,sq,sk,hq,hkv,d,kwargs", DENSE_CASES)
def test_ck_dense_contract(fa_calls, rng, layout, sq, sk, hq, hkv, d, kwargs):
    call = _call(layout, sq, sk, hq, hkv, d, kwargs, rng)
    result = RocmFlashAttnCK().run(call)
    (name, args, kw), = fa_calls
    assert name == "flash_attn_func"
    q, k, v = args
    assert q.shape == (2, sq, hq, d) and k.shape == (2, sk, hkv, d) and v.shape == (2, sk, hkv, d)  # bshd
    assert torch.equal(q, call.bhsd(call.q).transpose(1, 2))
    assert kw["softmax_scale"] == call.scale and kw["causal"] is call.causal
    assert kw["window_size"] == _expected_window(call) and kw["softcap"] == 0.0
    assert kw["alibi_slopes"] is call.alibi_slopes and kw["dropout_p"] == 0.0
    assert kw["return_attn_probs"] is call.return_lse and kw["deterministic"] is False
    assert_matches_reference(call, result)
    if call.return_lse:
        assert result[1].shape == (2, hq, sq)


def test_ck_varlen_contract(fa_calls, rng):
    t = varlen_inputs([5, 9, 3], [7, 9, 12], 4, 2, 64, BF16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True, causal_alignment="bottom_right",
                                         return_lse=True, deterministic=True)
    out, lse = RocmFlashAttnCK().run(call)
    (name, args, kw), = fa_calls
    assert name == "flash_attn_varlen_func"
    assert args[0] is call.q and args[3] is call.cu_seqlens_q and args[4] is call.cu_seqlens_k
    assert args[5:] == (9, 12) and kw["deterministic"] is True and kw["block_table"] is None
    assert lse.shape == (4, 17)  # (heads_q, total_q)
    assert_matches_reference(call, (out, lse))


def test_ck_deterministic_option(fa_calls, rng):
    impl = RocmFlashAttnCK().with_options({"deterministic_backward": True})
    impl.run(_call("bshd", 8, 8, 2, 2, 64, {}, rng))
    assert fa_calls[-1][2]["deterministic"] is True
    with pytest.raises(ValueError):
        impl.with_options({"deterministic": True})  # unknown option name


def test_ck_rejects_what_ck_cannot_do(rng):
    impl, dev = RocmFlashAttnCK(), opdispatch.load_device_descriptor(MI300X)
    top_left = _call("bshd", 8, 16, 2, 2, 64, dict(causal=True), rng)
    assert any("causal_alignment 'top_left'" in r for r in impl.not_supported_reasons(top_left, dev))
    capped = _call("bshd", 8, 8, 2, 2, 64, dict(softcap=30.0), rng)
    assert any("softcap" in r for r in impl.not_supported_reasons(capped, dev))
    alibi = _call("bshd", 8, 16, 2, 2, 64, dict(alibi_slopes=torch.ones(2)), rng)
    assert any("ALiBi" in r for r in impl.not_supported_reasons(alibi, dev))
    assert any("head_dim 320" in r for r in impl.not_supported_reasons(_call("bshd", 4, 4, 2, 2, 320, {}, rng), dev))


@pytest.mark.parametrize("layout,sq,sk,hq,hkv,d,kwargs", DENSE_CASES)
def test_aiter_dense_contract(aiter_calls, rng, layout, sq, sk, hq, hkv, d, kwargs):
    call = _call(layout, sq, sk, hq, hkv, d, kwargs, rng)
    result = RocmAiter().run(call)
    (name, args, kw), = aiter_calls
    assert name == "flash_attn_func"
    assert args[0].shape == (2, sq, hq, d)
    assert kw["softmax_scale"] == call.scale and kw["causal"] is call.causal
    assert kw["window_size"] == _expected_window(call) and kw["return_lse"] is call.return_lse
    assert kw["return_attn_probs"] is False and kw["bias"] is None and kw["how_v3_bf16_cvt"] == 1
    assert_matches_reference(call, result)


def test_aiter_softcap_dense_goes_through_varlen(aiter_calls, rng):
    call = _call("bhsd", 12, 12, 4, 2, 64, dict(causal=True, softcap=5.0, return_lse=True), rng)
    out, lse = RocmAiter().run(call)
    (name, args, kw), = aiter_calls
    assert name == "flash_attn_varlen_func" and kw["logits_soft_cap"] == 5.0
    assert args[0].shape == (24, 4, 64) and args[3].tolist() == [0, 12, 24] and args[5:] == (12, 12)
    assert out.shape == call.q.shape and lse.shape == (2, 4, 12)
    assert_matches_reference(call, (out, lse))


def test_aiter_varlen_contract_and_options(aiter_calls, rng):
    t = varlen_inputs([6, 2], [6, 2], 4, 4, 64, BF16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True, return_lse=True)
    impl = RocmAiter().with_options({"how_v3_bf16_cvt": 2, "deterministic_backward": True})
    out, lse = impl.run(call)
    (name, args, kw), = aiter_calls
    assert name == "flash_attn_varlen_func" and args[3] is call.cu_seqlens_q and args[4] is call.cu_seqlens_k
    assert kw["how_v3_bf16_cvt"] == 2 and kw["deterministic"] is True and kw["logits_soft_cap"] == 0.0
    assert kw["min_seqlen_q"] == 0 and lse.shape == (4, 8)
    assert_matches_reference(call, (out, lse))


def test_aiter_training_asks_for_lse(aiter_calls, rng):
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 64, BF16, rng)
    call = opdispatch.validate_attention(q.requires_grad_(), k, v, causal=True)
    out = RocmAiter().run(call)
    assert aiter_calls[-1][2]["return_lse"] is True  # aiter asserts it when a backward will run
    assert isinstance(out, torch.Tensor)


# -- rocm.aotriton: torch's ROCm flash op, faked with a CPU kernel for the real aten schema ----------------------

@pytest.fixture
def aten_flash(monkeypatch: pytest.MonkeyPatch):
    calls: list = []
    preference = {"value": "default", "sets": []}

    def kernel(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
               scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
               block_table=None, num_splits=None):
        calls.append(dict(query=query, key=key, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k, max_q=max_q,
                          max_k=max_k, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          window_size_left=window_size_left, return_debug_mask=return_debug_mask))
        from tests.fakes import _math
        kw = dict(scale=scale, causal=is_causal, window=(-1, -1), alignment="top_left")
        if cum_seq_q is None:
            out, lse = _math.bshd_attention(query, key, value, **kw)
        else:
            out, lse = _math.varlen_attention(query, key, value, cum_seq_q, cum_seq_k, **kw)
        empty = torch.empty(0)
        return out, lse, empty, empty, empty

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", kernel, "CPU")

    def select(backend=None):
        if backend is None:
            return preference["value"]
        preference["sets"].append(backend)
        preference["value"] = backend
        return backend

    monkeypatch.setattr(torch.backends.cuda, "preferred_rocm_fa_library", select)
    yield calls, preference
    lib._destroy()


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_aotriton_dense_contract(aten_flash, rng, layout):
    calls, preference = aten_flash
    call = _call(layout, 16, 16, 8, 2, 64, dict(causal=True, return_lse=True, scale=0.2), rng)
    out, lse = RocmAOTriton().run(call)
    (c,) = calls
    assert c["query"].shape == (2, 16, 8, 64) and c["cum_seq_q"] is None and (c["max_q"], c["max_k"]) == (16, 16)
    assert c["is_causal"] is True and c["scale"] == 0.2 and c["return_debug_mask"] is False
    assert c["window_size_left"] is None
    assert preference["sets"] == ["aotriton"]  # torch's ROCm flash told to use AOTriton
    assert lse.shape == (2, 8, 16)
    assert_matches_reference(call, (out, lse))


def test_aotriton_varlen_and_library_option(aten_flash, rng):
    calls, preference = aten_flash
    t = varlen_inputs([4, 7], [4, 7], 4, 4, 64, torch.float16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True)
    impl = RocmAOTriton().with_options({"fa_library": "ck"})
    out = impl.run(call)
    assert calls[-1]["cum_seq_q"] is call.cu_seqlens_q and (calls[-1]["max_q"], calls[-1]["max_k"]) == (7, 7)
    assert preference["sets"] == ["ck"]
    assert_matches_reference(call, out)
    impl = impl.with_options({"fa_library": "default"})
    impl.run(call)
    assert preference["sets"] == ["ck"]  # 'default' leaves torch's setting alone
    with pytest.raises(ValueError):
        impl.with_options({"fa_library": "triton"})


def test_aotriton_rejections(rng, monkeypatch):
    impl, dev = RocmAOTriton(), opdispatch.load_device_descriptor(MI300X)
    non_square = _call("bshd", 8, 16, 2, 2, 64, dict(causal=True, causal_alignment="bottom_right"), rng)
    assert any("causal_alignment" in r for r in impl.not_supported_reasons(non_square, dev))
    t = varlen_inputs([4, 7], [4, 7], 4, 4, 64, BF16, rng)
    lse_thd = opdispatch.validate_attention(**t, layout="thd", return_lse=True)
    assert any("return_lse with layout 'thd'" in r for r in impl.not_supported_reasons(lse_thd, dev))
    gfx1200 = opdispatch.DeviceInfo(vendor="amd", type="cuda", arch="gfx1200", name="Radeon", simulated=True,
                                    libraries={"torch": "2.8.0"})
    plain = _call("bshd", 8, 8, 2, 2, 64, {}, rng)
    assert any("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in r for r in impl.not_supported_reasons(plain, gfx1200))
    monkeypatch.setenv("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1")
    assert impl.not_supported_reasons(plain, gfx1200) == []


# -- selection on the simulated descriptors ----------------------------------------------------------------------

def _meta(layout="bshd", b=2, sq=128, sk=128, hq=8, hkv=2, d=128, dtype=BF16):
    shape = {"bshd": lambda s, h: (b, s, h, d), "bhsd": lambda s, h: (b, h, s, d)}[layout]
    return (torch.empty(shape(sq, hq), dtype=dtype, device="meta"),
            torch.empty(shape(sk, hkv), dtype=dtype, device="meta"),
            torch.empty(shape(sk, hkv), dtype=dtype, device="meta"))


def _status(decision, impl_id):
    c = decision.candidate(impl_id)
    return c.status, "; ".join(c.reasons)


def test_mi300x_picks_aiter_and_explains_the_rest(manager):
    d = opdispatch.explain(*_meta(), device=str(MI300X), causal=True)
    assert d.chosen_id == "rocm.aiter"
    assert _status(d, "rocm.ck")[0] == "eligible" and _status(d, "rocm.aotriton")[0] == "eligible"
    assert "not 'cuda'" in _status(d, "cpu.flash")[1]
    assert "not vendor 'amd'" in _status(d, "iluvatar.ixformer")[1]
    assert "not vendor 'amd'" in _status(d, "kunlunxin.prefill")[1]


def test_mi300x_softcap_only_aiter(manager):
    d = opdispatch.explain(*_meta(), device=str(MI300X), causal=True, softcap=30.0)
    assert d.chosen_id == "rocm.aiter"
    assert _status(d, "rocm.ck") == ("rejected", "softcap=30 not supported")
    assert "softcap" in _status(d, "rocm.aotriton")[1]


def test_mi300x_thd_lse_and_top_left(manager):
    q, k, v = (torch.empty(64, h, 128, dtype=BF16, device="meta") for h in (8, 2, 2))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    d = opdispatch.explain(q, k, v, device=str(MI300X), layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=40, max_seqlen_k=40, causal=True, return_lse=True)
    assert d.chosen_id == "rocm.aiter"
    assert "return_lse with layout 'thd'" in _status(d, "rocm.aotriton")[1]
    # causal top-left with sq != sk: no ROCm flash-style kernel aligns it that way; FlagGems' dense SDPA kernel
    # (causal top-left) takes it there since issue 35.
    d = opdispatch.explain(*_meta(sq=64), device=str(MI300X), causal=True)
    assert d.chosen_id == "flagos.triton"
    for impl_id in ("rocm.aiter", "rocm.ck", "rocm.aotriton"):
        assert "causal_alignment 'top_left'" in _status(d, impl_id)[1]


def test_mi300x_fp32_falls_back(manager):
    d = opdispatch.explain(*_meta(dtype=torch.float32), device=str(MI300X))
    assert d.chosen_id == "torch.flex"  # fp32: flex's Triton kernel on ROCm torch 2.7.1 (issue 35)
    assert "dtype fp32 not supported" in _status(d, "rocm.aiter")[1]


def test_mi250x_picks_ck(manager):
    d = opdispatch.explain(*_meta(), device=str(MI250X), causal=True, window=(64, 0))
    assert d.chosen_id == "rocm.ck"
    assert _status(d, "rocm.aiter") == ("unavailable", "supports arch {'gfx942', 'gfx950'}, not 'gfx90a'")
    assert "sliding window" in _status(d, "rocm.aotriton")[1]


def test_policy_order_can_prefer_aotriton(manager, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nops:\n  attention:\n    order: [rocm.aotriton, rocm.*]\n")
    manager.set_policy(str(policy))
    d = opdispatch.explain(*_meta(), device=str(MI300X), causal=True)
    assert d.chosen_id == "rocm.aotriton"


# -- availability -----------------------------------------------------------------------------------------------

def test_absent_library_names_the_install_hint(manager, monkeypatch):
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    amd = real_device("amd", "gfx942", "AMD Instinct MI300X", torch="2.7.1")
    manager.ensure_initialized()
    reason = manager.availability(manager.registry.get("attention", "rocm.ck").impl, amd)
    assert "'flash_attn' is not installed" in reason and "github.com/ROCm/flash-attention" in reason
    reason = RocmAiter().availability(amd)
    assert "'aiter' is not installed" in reason and "github.com/ROCm/aiter" in reason
    # torch here is a CPU build: the AOTriton path says so instead of failing at run time.
    assert "not a ROCm build" in RocmAOTriton().availability(amd)


def test_present_library_but_no_amd_device(fa_calls, aiter_calls, manager, monkeypatch):
    cpu = manager.device_info("cpu")
    reason = RocmFlashAttnCK().availability(cpu)
    assert reason == "runs on device type 'cuda', not 'cpu'"
    nvidia = real_device("nvidia", "sm90", "NVIDIA H100", torch="2.7.1")
    assert "supports 'amd' hardware, not vendor 'nvidia'" in RocmAiter().availability(nvidia)
    amd = real_device("amd", "gfx942", "AMD Instinct MI300X", torch="2.7.1")
    assert RocmFlashAttnCK().availability(amd) is None and RocmAiter().availability(amd) is None
    monkeypatch.setenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")
    assert "Triton AMD backend" in RocmFlashAttnCK().availability(amd)
    # A CPU call through the manager: every ROCm implementation says why it is out.
    q, k, v = dense_inputs("bshd", 1, 4, 4, 2, 2, 16, BF16, torch.Generator().manual_seed(0))
    d = opdispatch.explain(q, k, v)
    for impl_id in ("rocm.aiter", "rocm.ck", "rocm.aotriton"):
        status, reasons = _status(d, impl_id)
        assert status == "unavailable" and "not 'cpu'" in reasons


# -- device probe -----------------------------------------------------------------------------------------------

def test_probe_returns_none_fast_without_rocm():
    heavy = {"flash_attn", "aiter"} - set(sys.modules)
    start = time.perf_counter()
    for dev in (torch.device("cuda", 0), torch.device("cpu"), torch.device("meta")):
        assert rocm.opdispatch_probe_device(dev) is None
    assert time.perf_counter() - start < 0.05
    assert not (heavy & set(sys.modules))


def test_probe_describes_an_amd_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    fake_cuda(monkeypatch, gpu_props("AMD Instinct MI300X", arch="gfx942:sramecc+:xnack-"))
    info = rocm.opdispatch_probe_device(torch.device("cuda", 0))
    assert (info.vendor, info.type, info.arch, info.capability) == ("amd", "cuda", "gfx942", (9, 4))
    assert info.name == "AMD Instinct MI300X" and info.multiprocessors == 304 and not info.simulated
    assert info.libraries["hip"] == "6.4.43482" and info.libraries["torch"] == torch.__version__.split("+")[0]
    # Hygon DCUs run a HIP torch too; they are not AMD.
    monkeypatch.setattr(torch, "__hcu_version__", "1.0", raising=False)
    assert rocm.opdispatch_probe_device(torch.device("cuda", 0)) is None


def test_probe_through_the_manager(manager, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    fake_cuda(monkeypatch, gpu_props("AMD Instinct MI250X", arch="gfx90a:sramecc+:xnack-", major=9, minor=0))
    info = manager.device_info(torch.device("cuda", 0))
    assert info.vendor == "amd" and info.arch == "gfx90a"
