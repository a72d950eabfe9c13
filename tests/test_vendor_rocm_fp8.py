"""aiter's FP8 forward (`rocm.aiter` over `flash_attn_fp8_pertensor_func`) on CPU behind the fake of its published
signature (tests/fakes/aiter.py, which checks mha_fwd_kernels.cu's FP8 rules: e4m3, the three descales per tensor
as (1,), bf16 out), against the independent float64 oracle of the dequantized inputs; selection of e4m3 calls on
simulated MI300X (gfx942, whose aiter reads e4m3fnuz: refused) and MI355X (gfx950: chosen)."""

from __future__ import annotations

import sys

import pytest
import torch

import opdispatch
from opdispatch.vendors.rocm import RocmAiter

from tests._adapters_on_cpu import run_on_cpu, unbound_from_device
from tests.conftest import device_descriptor
from tests.fakes import aiter as fake_aiter
from tests.test_fp8_attention import E5, F8, _factors, _oracle, _quantized, _to_layout


@pytest.fixture
def aiter_fp8(monkeypatch, basic_manager, tmp_path):
    calls: list = []
    run_on_cpu(monkeypatch, basic_manager, tmp_path, {"aiter": fake_aiter.make(calls)},
               unbound_from_device(RocmAiter, "aiter"))
    return calls


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # float64 inside the fake; the only rounding is the bf16 output's (2**-8 relative)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("layout,causal,window,heads,d,sq,sk", [
    ("bshd", False, None, (4, 4), 16, 5, 7),
    ("bshd", True, None, (4, 2), 12, 6, 6),     # GQA; head dim padded to 16 inside aiter's wrapper
    ("bhsd", False, (3, 1), (4, 1), 8, 5, 9),   # MQA with a window
    ("sbhd", True, (2, 0), (6, 3), 20, 4, 7),   # causal bottom-right (sq < sk) with a window, padded head dim
    ("bhsd", True, None, (2, 2), 16, 8, 3),     # sq > sk: rows that see no key give zeros
])
def test_dense_fp8_on_aiter_matches_the_dequantized_oracle(aiter_fp8, layout, causal, window, heads, d, sq, sk):
    gen = torch.Generator().manual_seed(hash((layout, causal, heads, d)) % 2**31)
    b = 2
    hq, hkv = heads
    q, k, v = (_quantized(shape, gen) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    qs, ks, vs = (_factors(b, hkv, False, gen) for _ in range(3))
    if layout == "bshd":
        qs, ks = qs.reshape(1), ks.reshape(1)  # (1,) as well as (): both per tensor
    args = dict(layout=layout, causal=causal, causal_alignment="bottom_right", window=window, q_descale=qs,
                k_descale=ks, v_descale=vs)
    assert opdispatch.explain(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout),
                              **args).chosen_id == "test.aiter"
    out = opdispatch.attention(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout), **args)
    name, _, kw = aiter_fp8[-1]
    assert name == "flash_attn_fp8_pertensor_func" and kw["q_descale"].shape == (1,)
    assert kw["window_size"] == (window or (-1, -1)) and kw["causal"] == causal
    assert out.dtype == torch.bfloat16 and out.shape == _to_layout(q, layout).shape
    got = _to_layout(out, layout) if layout == "bshd" else (out.transpose(1, 2) if layout == "bhsd"
                                                            else out.transpose(0, 1))
    for i in range(b):
        want = _oracle(q[i].double() * qs.double(), k[i].double() * ks.double(), v[i].double() * vs.double(),
                       causal=causal, window=window, bottom_right=True)
        _assert_matches(got[i], want)


def test_aiter_refuses_what_its_fp8_entry_does_not_take(aiter_fp8):
    gen = torch.Generator().manual_seed(3)
    one = torch.ones(())
    scales = dict(q_descale=one, k_descale=one, v_descale=one)

    def aiter_reasons(q, k, v, **kw):
        kw = {**scales, **kw}
        d = opdispatch.explain(q, k, v, **kw)
        assert d.chosen_id != "test.aiter"
        return " | ".join(next(c for c in d.candidates if c.impl_id == "test.aiter").reasons)

    q8 = _quantized((2, 4, 2, 16), gen)
    assert "FP8 output dtype fp16 not supported (supported: bf16)" in aiter_reasons(q8, q8, q8,
                                                                                    out_dtype=torch.float16)
    rows = torch.rand(2, 2, generator=gen) + 0.1
    assert "FP8 descales per (batch, kv head) not supported" in aiter_reasons(
        q8, q8, q8, q_descale=rows, k_descale=rows, v_descale=rows)
    e5 = _quantized((2, 4, 2, 16), gen, E5)
    assert "dtype fp8_e5m2 not supported" in aiter_reasons(e5, e5, e5)
    assert "FP8 with return_lse not supported" in aiter_reasons(q8, q8, q8, return_lse=True)
    assert "FP8 with softcap=30 not supported" in aiter_reasons(q8, q8, q8, softcap=30.0)
    assert "FP8 with alibi_slopes not supported" in aiter_reasons(
        q8, q8, q8, alibi_slopes=torch.rand(2), causal=True, causal_alignment="bottom_right")
    v8 = _quantized((2, 4, 2, 8), gen)
    assert "FP8 with head_dim_v 8 != head_dim 16 not supported" in aiter_reasons(q8, q8, v8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    t8 = _quantized((8, 2, 16), gen)
    assert "FP8 with layout 'thd' not supported" in aiter_reasons(t8, t8, t8, layout="thd", cu_seqlens_q=cu,
                                                                   cu_seqlens_k=cu)
    # An aiter without the FP8 entry says so (a bf16 call still runs on it).
    del sys.modules["aiter"].flash_attn_fp8_pertensor_func
    assert "no flash_attn_fp8_pertensor_func" in aiter_reasons(q8, q8, q8)
    x = torch.randn(2, 4, 2, 16).bfloat16()
    assert opdispatch.explain(x, x, x).chosen_id == "test.aiter"


def _mi355x(tmp_path) -> str:
    """The shipped MI300X descriptor as an MI355X (gfx950, CDNA4): the same libraries."""
    text = device_descriptor("mi300x").read_text().replace("arch: gfx942", "arch: gfx950").replace(
        "name: AMD Instinct MI300X", "name: AMD Instinct MI355X").replace("capability: [9, 4]", "capability: [9, 5]")
    path = tmp_path / "mi355x.yaml"
    path.write_text(text)
    return str(path)


def test_simulated_mi355x_picks_aiter_for_e4m3_and_mi300x_says_why_not(manager, tmp_path):
    meta = dict(device="meta", dtype=F8)
    q, k, v = (torch.empty(2, 1024, h, 128, **meta) for h in (16, 4, 4))
    one = torch.ones((), device="meta")
    scales = dict(q_descale=one, k_descale=one, v_descale=one)
    d = opdispatch.explain(q, k, v, causal=True, device=_mi355x(tmp_path), **scales)
    assert d.chosen_id == "rocm.aiter", str(d)
    reasons = {c.impl_id: " | ".join(c.reasons) for c in d.candidates}
    for impl_id in ("rocm.ck", "rocm.aotriton"):
        assert "dtype fp8_e4m3fn not supported" in reasons[impl_id], (impl_id, reasons[impl_id])
    assert all(reasons[c.impl_id] for c in d.candidates if c.status not in ("chosen", "eligible")), str(d)
    # Per-head descales or an fp16 output: not aiter's, with the reason.
    rows = torch.ones(2, 4, device="meta")
    d = opdispatch.explain(q, k, v, causal=True, device=_mi355x(tmp_path), q_descale=rows, k_descale=rows,
                           v_descale=rows)
    assert d.chosen_id != "rocm.aiter"
    assert any("per (batch, kv head)" in r for r in d.candidate("rocm.aiter").reasons)
    # MI300X (gfx942): aiter reads e4m3fnuz there, so the e4m3fn call is refused, not converted.
    d = opdispatch.explain(q, k, v, causal=True, device=str(device_descriptor("mi300x")), **scales)
    assert d.chosen_id != "rocm.aiter"
    assert any("float8_e4m3fnuz" in r for r in d.candidate("rocm.aiter").reasons), str(d)
    # bf16 on both is unchanged: aiter.
    qb, kb, vb = (torch.empty(2, 1024, h, 128, device="meta", dtype=torch.bfloat16) for h in (16, 4, 4))
    for device in (_mi355x(tmp_path), str(device_descriptor("mi300x"))):
        assert opdispatch.explain(qb, kb, vb, causal=True, device=device).chosen_id == "rocm.aiter"
