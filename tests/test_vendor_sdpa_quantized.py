"""torch 2.13's FP8 SDPA (`nvidia.sdpa_quantized` over torch.nn.attention.experimental.
_scaled_dot_product_attention_quantized, FA3 activated in torch) on CPU behind the fake of its published signature
(tests/fakes/torch_sdpa_quantized.py: torch's descale checks, its FA3 wrapper's and FA3's), against the independent
float64 oracle of the dequantized inputs; every refusal; availability on a real device (function missing, FA3 not
activated) and selection on a simulated H100."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import opdispatch
from opdispatch import DeviceInfo
from opdispatch.vendors.nvidia import QuantizedSdpa
from opdispatch.vendors.nvidia import _sdpa_quantized as adapter

from tests._adapters_on_cpu import run_on_cpu, unbound_from_device
from tests.conftest import device_descriptor
from tests.fakes import torch_sdpa_quantized as fake
from tests.test_fp8_attention import E5, F8, _factors, _oracle, _per_sequence_scale, _quantized, _to_layout

real_module = pytest.importorskip(adapter.QUANTIZED_MODULE, reason="needs torch >= 2.13")
IMPL = "test.sdpa_q"


class _Handle:
    def remove(self) -> None:
        pass


@pytest.fixture
def activated(monkeypatch):
    """FA3 activated in torch's SDPA, as activate_flash_attention_impl("FA3") leaves the registry."""
    monkeypatch.setattr(torch.nn.attention._registry, "_FLASH_ATTENTION_ACTIVE", ("FA3", _Handle()))


@pytest.fixture
def sdpa_q(monkeypatch, basic_manager, tmp_path, activated):
    monkeypatch.setattr(real_module, adapter.QUANTIZED_FUNCTION, fake._scaled_dot_product_attention_quantized)
    fake.calls.clear()
    return run_on_cpu(monkeypatch, basic_manager, tmp_path, {}, unbound_from_device(QuantizedSdpa, "sdpa_q"))


def test_the_fake_has_the_published_signature():
    real = inspect.signature(getattr(real_module, adapter.QUANTIZED_FUNCTION))
    mirrored = inspect.signature(fake._scaled_dot_product_attention_quantized)
    assert [(p.name, p.kind, p.default) for p in real.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in mirrored.parameters.values()]


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # float64 inside the fake; the only rounding is the bf16 output's (2**-8 relative)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def _from_layout(out: torch.Tensor, layout: str) -> torch.Tensor:
    return {"bshd": out, "bhsd": out.transpose(1, 2), "sbhd": out.transpose(0, 1)}[layout]


# (layout, (heads_q, heads_kv), (seqlen_q, seqlen_k), causal, descale forms of q/k/v: per head or per tensor)
CASES = [
    ("bshd", (4, 4), (5, 7), False, (False, False, False)),
    ("bshd", (4, 2), (5, 7), True, (True, True, True)),
    ("bhsd", (6, 3), (6, 6), True, (False, True, False)),   # mixed forms
    ("bhsd", (4, 1), (7, 4), True, (True, True, True)),     # MQA; bottom-right: the first 3 rows see no key
    ("sbhd", (4, 2), (3, 9), True, (False, False, False)),
    ("sbhd", (2, 2), (1, 6), True, (True, False, True)),    # one query row sees every key
    ("bhsd", (8, 2), (9, 5), False, (True, True, False)),
]


@pytest.mark.parametrize("layout,heads,lengths,causal,per_head", CASES)
def test_fp8_matches_the_dequantized_oracle(sdpa_q, layout, heads, lengths, causal, per_head):
    gen = torch.Generator().manual_seed(hash((layout, heads, lengths, causal, per_head)) % 2**31)
    b, d = 2, 32
    (hq, hkv), (sq, sk) = heads, lengths
    q, k, v = (_quantized(shape, gen) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    qs, ks, vs = (_factors(b, hkv, form, gen) for form in per_head)
    args = dict(layout=layout, causal=causal, causal_alignment="bottom_right", q_descale=qs, k_descale=ks,
                v_descale=vs)
    qa, ka, va = (_to_layout(t, layout) for t in (q, k, v))
    assert opdispatch.explain(qa, ka, va, **args).chosen_id == IMPL
    out = opdispatch.attention(qa, ka, va, **args)
    assert out.dtype == torch.bfloat16 and out.shape == qa.shape
    got = _from_layout(out, layout)
    for i in range(b):
        want = _oracle(_per_sequence_scale(q[i], qs, i, hq // hkv), _per_sequence_scale(k[i], ks, i, 1),
                       _per_sequence_scale(v[i], vs, i, 1), causal=causal, bottom_right=True)
        _assert_matches(got[i], want)
    if causal and sq > sk:  # keyless rows (bottom-right alignment): zeros, as the oracle's
        assert (got[:, : sq - sk] == 0).all()


def test_scale_views_and_descales_reach_torch_in_its_own_form(sdpa_q):
    """q/k/v go as (b, h, s, d) views of the caller's tensors (no copy); the output comes back as a view of torch's
    (allocated in q's memory order, so in the caller's layout with no copy); per-tensor descales as (batch, heads_kv)
    stride-0 views of the same factor, per-head ones as given; the call's scale as given."""
    gen = torch.Generator().manual_seed(5)
    b, sq, sk, hq, hkv, d = 3, 4, 6, 4, 2, 16
    q, k, v = _quantized((b, sq, hq, d), gen), _quantized((b, sk, hkv, d), gen), _quantized((b, sk, hkv, d), gen)
    one_each = torch.tensor(0.25), torch.tensor([0.5]), torch.tensor(2.0)
    out = opdispatch.attention(q, k, v, scale=0.3, q_descale=one_each[0], k_descale=one_each[1],
                               v_descale=one_each[2])
    seen = fake.calls[-1]
    assert seen["scale"] == pytest.approx(0.3) and seen["is_causal"] is False
    for name, factor in zip(("q_descale", "k_descale", "v_descale"), one_each):
        assert seen[name].shape == (b, hkv) and seen[name].stride() == (0, 0) and (seen[name] == factor).all()
    for name, given in (("query", q), ("key", k), ("value", v)):
        assert seen[name].shape == given.transpose(1, 2).shape and seen[name].data_ptr() == given.data_ptr()
    assert out.is_contiguous()  # bshd memory, as q's: torch's output viewed back, not copied
    # the softmax scale 0.3: the oracle scales by 1/sqrt(d), so q carries 0.3 * sqrt(d) into it
    for i in range(b):
        want = _oracle(q[i].double() * 0.25 * 0.3 * d ** 0.5, k[i].double() * 0.5, v[i].double() * 2.0)
        _assert_matches(out[i], want)
    rows = torch.rand(b, hkv, generator=gen) + 0.1
    opdispatch.attention(q, k, v, q_descale=rows, k_descale=rows, v_descale=rows)
    assert fake.calls[-1]["q_descale"] is rows


def _reasons(q, k, v, **kw) -> str:
    d = opdispatch.explain(q, k, v, **kw)
    assert d.chosen_id != IMPL, str(d)
    return " | ".join(next(c for c in d.candidates if c.impl_id == IMPL).reasons)


def test_refuses_what_torch_and_fa3_do_not_take_and_the_reference_computes_it(sdpa_q):
    gen = torch.Generator().manual_seed(3)
    one = torch.ones(())
    scales = dict(q_descale=one, k_descale=one, v_descale=one)
    q8, k8 = _quantized((1, 4, 2, 16), gen), _quantized((1, 6, 2, 16), gen)
    refused = {
        "FP8 output dtype fp16 not supported (supported: bf16)": (q8, q8, q8, dict(out_dtype=torch.float16)),
        "this kernel cannot produce an FP8 output": (q8, q8, q8, dict(out_dtype=F8, out_scale=one)),
        "out_amax": (q8, q8, q8, dict(out_amax=torch.zeros(()))),
        "dtype fp8_e5m2 not supported": tuple(_quantized((1, 4, 2, 16), gen, E5) for _ in range(3)) + ({},),
        "head_dim 8 outside the supported range 16..256": tuple(_quantized((1, 4, 2, 8), gen)
                                                               for _ in range(3)) + ({},),
        "head_dim 24 is not a multiple of 16": tuple(_quantized((1, 4, 2, 24), gen) for _ in range(3)) + ({},),
        "head_dim 272 outside": tuple(_quantized((1, 4, 2, 272), gen) for _ in range(3)) + ({},),
        "v head_dim 32 differs": (q8, q8, _quantized((1, 4, 2, 32), gen), {}),
        "causal_alignment 'top_left' with seqlen_q != seqlen_k not supported (supported: bottom_right)":
            (q8, k8, k8, dict(causal=True, causal_alignment="top_left")),
        "window": (q8, q8, q8, dict(causal=True, window=(2, 0))),
        "softcap": (q8, q8, q8, dict(softcap=20.0)),
        "lse": (q8, q8, q8, dict(return_lse=True)),
        "mask": (q8, q8, q8, dict(attn_mask=torch.ones(4, 4, dtype=torch.bool))),
    }
    for why, (q, k, v, kw) in refused.items():
        reasons = _reasons(q, k, v, **{**scales, **kw})
        assert why in reasons, (why, reasons)
    # packed varlen (thd) and a KV cache: not in the function's signature
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    t8 = _quantized((4, 2, 16), gen)
    assert "packed varlen (thd) not supported" in _reasons(t8, t8, t8, layout="thd", cu_seqlens_q=cu,
                                                           cu_seqlens_k=cu, **scales)
    assert "KV cache" in _reasons(q8, k8, k8, seqused_k=torch.tensor([5], dtype=torch.int32), **scales)
    # bf16 calls are not this implementation's
    x = torch.randn(1, 4, 2, 16).bfloat16()
    assert "dtype bf16 not supported (supported: fp8_e4m3fn)" in _reasons(x, x, x)
    # The refused top-left alignment is still honoured exactly, by the reference.
    q, k, v = _quantized((1, 3, 2, 16), gen), _quantized((1, 5, 2, 16), gen), _quantized((1, 5, 2, 16), gen)
    out = opdispatch.attention(q, k, v, causal=True, causal_alignment="top_left", **scales)
    _assert_matches(out[0], _oracle(q[0].double(), k[0].double(), v[0].double(), causal=True))


def test_fa3_restored_after_selection_raises_with_the_fix(sdpa_q, monkeypatch):
    """Availability is cached per device: a call after FA3 was restored (torch's FA2, which has no FP8 kernel,
    would take the op) is refused with the way back, never run elsewhere under a pin."""
    gen = torch.Generator().manual_seed(4)
    q = _quantized((1, 4, 2, 16), gen)
    one = torch.ones(())
    opdispatch.attention(q, q, q, q_descale=one, k_descale=one, v_descale=one, impl=IMPL)
    monkeypatch.setattr(torch.nn.attention._registry, "_FLASH_ATTENTION_ACTIVE", None)
    with pytest.raises(RuntimeError, match=r"FA3 is no longer activated.*activate_flash_attention_impl\(\"FA3\"\)"):
        opdispatch.attention(q, q, q, q_descale=one, k_descale=one, v_descale=one, impl=IMPL)


def _real_h100(version: str = "2.13.0") -> DeviceInfo:
    return DeviceInfo(vendor="nvidia", type="cuda", arch="sm90", name="NVIDIA H100 80GB HBM3", index=0,
                      capability=(9, 0), libraries={"torch": version})


def test_availability_on_a_real_device_says_what_is_missing(monkeypatch, activated):
    impl = QuantizedSdpa()
    assert impl.availability(_real_h100()) is None
    monkeypatch.setattr(torch.nn.attention._registry, "_FLASH_ATTENTION_ACTIVE", None)
    reason = impl.availability(_real_h100())
    assert "FA3 is not activated in torch's SDPA" in reason
    assert 'torch.nn.attention.activate_flash_attention_impl("FA3")' in reason and "clear_cache()" in reason
    monkeypatch.delattr(real_module, adapter.QUANTIZED_FUNCTION)  # torch older than 2.13
    reason = impl.availability(_real_h100("2.11.0"))
    assert "has no torch.nn.attention.experimental._scaled_dot_product_attention_quantized" in reason
    assert "pip install 'torch>=2.13.0'" in reason
    a100 = DeviceInfo(vendor="nvidia", type="cuda", arch="sm80", name="A100", capability=(8, 0))
    assert "needs compute capability >= 9.0" in impl.availability(a100)


def _descriptor(tmp_path: Path, device: str, torch_version: str, **libraries: str) -> str:
    text = device_descriptor(device).read_text()
    text = text.replace('torch: "2.11.0"', f'torch: "{torch_version}"')
    assert f'torch: "{torch_version}"' in text
    extra = "".join(f'  {key}: "{value}"\n' for key, value in libraries.items())
    path = tmp_path / f"{device}-{torch_version}-{'-'.join(libraries)}.yaml"
    path.write_text(text.replace("libraries:\n", "libraries:\n" + extra))
    return str(path)


def _candidate(d, impl_id):
    return next(c for c in d.candidates if c.impl_id == impl_id)


def test_simulated_h100_with_fa3_activated_picks_it_for_e4m3_and_says_why_not_the_others(manager, tmp_path):
    meta = dict(device="meta", dtype=F8)
    q, k, v = (torch.empty(2, 1024, h, 128, **meta) for h in (16, 4, 4))
    one = torch.ones((), device="meta")
    scales = dict(q_descale=one, k_descale=one, v_descale=one)
    activated = _descriptor(tmp_path, "h100", "2.13.0", torch_fa3="3.0.0")
    d = opdispatch.explain(q, k, v, causal=True, device=activated, **scales)
    assert d.chosen_id == "nvidia.sdpa_quantized", str(d)
    reasons = {c.impl_id: " | ".join(c.reasons) for c in d.candidates}
    for impl_id in ("nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "torch.flex"):
        assert "dtype fp8_e4m3fn not supported" in reasons[impl_id], (impl_id, reasons[impl_id])
    assert "flash_attn_3" in reasons["nvidia.flash_attn3"]
    assert all(reasons[c.impl_id] for c in d.candidates if c.status not in ("chosen", "eligible")), str(d)
    # Per-head descales and a decode (bottom-right causal, seqlen_q 1) too.
    rows = torch.ones(2, 4, device="meta")
    qd = torch.empty(2, 1, 16, 128, **meta)
    d = opdispatch.explain(qd, k, v, causal=True, causal_alignment="bottom_right", device=activated,
                           q_descale=rows, k_descale=rows, v_descale=rows)
    assert d.chosen_id == "nvidia.sdpa_quantized", str(d)
    # Top-left causal with unequal lengths: FA3's mask is bottom-right, so not this one (the reference takes it).
    d = opdispatch.explain(torch.empty(2, 512, 16, 128, **meta), k, v, causal=True, causal_alignment="top_left",
                           device=activated, **scales)
    assert d.chosen_id != "nvidia.sdpa_quantized"
    assert any("causal_alignment 'top_left'" in r for r in _candidate(d, "nvidia.sdpa_quantized").reasons)
    # FA3 installed as well: nvidia.flash_attn3 comes first (the same kernel, called directly); this one eligible.
    both = _descriptor(tmp_path, "h100", "2.13.0", torch_fa3="3.0.0", flash_attn_3="3.0.0")
    d = opdispatch.explain(q, k, v, causal=True, device=both, **scales)
    assert d.chosen_id == "nvidia.flash_attn3", str(d)
    assert _candidate(d, "nvidia.sdpa_quantized").status == "eligible", str(d)
    # torch 2.13 without FA3 activated: the reason says how to activate it.
    idle = _descriptor(tmp_path, "h100", "2.13.0")
    d = opdispatch.explain(q, k, v, causal=True, device=idle, **scales)
    assert d.chosen_id != "nvidia.sdpa_quantized"
    (reason,) = _candidate(d, "nvidia.sdpa_quantized").reasons
    assert "FA3 is not activated in torch's SDPA" in reason and "activate_flash_attention_impl" in reason
    assert "torch_fa3" in reason
    # The shipped H100 descriptor (torch 2.11): no such function.
    d = opdispatch.explain(q, k, v, causal=True, device=str(device_descriptor("h100")), **scales)
    (reason,) = _candidate(d, "nvidia.sdpa_quantized").reasons
    assert "torch 2.11.0" in reason and "added in torch 2.13.0" in reason
    # A100 (sm80) with everything declared: FA3 is sm90 only.
    a100 = _descriptor(tmp_path, "a100", "2.13.0", torch_fa3="3.0.0")
    d = opdispatch.explain(q, k, v, causal=True, device=a100, **scales)
    assert d.chosen_id != "nvidia.sdpa_quantized"
    assert any("compute capability" in r for r in _candidate(d, "nvidia.sdpa_quantized").reasons)
