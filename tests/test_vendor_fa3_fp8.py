"""FA3's FP8 forward (`nvidia.flash_attn3` over flash_attn_interface with q/k/v_descale) on CPU behind the fake of
its published signature (tests/fakes/flash_attn_interface.py, which checks flash_api.cpp's FP8 rules: e4m3 only,
descales (batch, num_heads_k), output bf16), against the independent float64 oracle of the dequantized inputs;
selection of e4m3 calls on a simulated H100 that has FA3 installed."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.vendors.nvidia import FlashAttn3

from tests._adapters_on_cpu import device_with_library, run_on_cpu, unbound_from_device
from tests.conftest import device_descriptor
from tests.fakes import flash_attn_interface as fake_fa3
from tests.test_fp8_attention import E5, F8, _factors, _oracle, _per_sequence_scale, _quantized, _to_layout


@pytest.fixture
def fa3(monkeypatch, basic_manager, tmp_path):
    return run_on_cpu(monkeypatch, basic_manager, tmp_path, {"flash_attn_interface": fake_fa3},
                      unbound_from_device(FlashAttn3, "fa3"))


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # float64 inside the fake; the only rounding is the bf16 output's (2**-8 relative)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("layout,causal,window,heads,per_head,return_lse", [
    ("bshd", False, None, (4, 4), False, False),
    ("bshd", True, None, (4, 2), True, True),
    ("bhsd", False, (3, 1), (4, 1), True, False),
    ("bhsd", True, (2, 0), (6, 3), False, True),
    ("bshd", False, (1, 2), (2, 1), True, True),
])
def test_dense_fp8_on_fa3_matches_the_dequantized_oracle(fa3, layout, causal, window, heads, per_head, return_lse):
    gen = torch.Generator().manual_seed(hash((layout, causal, heads, per_head)) % 2**31)
    b, sq, sk, d = 2, 5, 7, 16
    hq, hkv = heads
    q, k, v = (_quantized(shape, gen) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    qs, ks, vs = (_factors(b, hkv, per_head, gen) for _ in range(3))
    args = dict(layout=layout, causal=causal, causal_alignment="bottom_right", window=window, q_descale=qs,
                k_descale=ks, v_descale=vs, return_lse=return_lse)
    assert opdispatch.explain(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout),
                              **args).chosen_id == "test.fa3"
    res = opdispatch.attention(_to_layout(q, layout), _to_layout(k, layout), _to_layout(v, layout), **args)
    out = res[0] if return_lse else res
    assert out.dtype == torch.bfloat16
    got = out if layout == "bshd" else out.transpose(1, 2)
    for i in range(b):
        want = _oracle(_per_sequence_scale(q[i], qs, i, hq // hkv), _per_sequence_scale(k[i], ks, i, 1),
                       _per_sequence_scale(v[i], vs, i, 1), causal=causal, window=window, bottom_right=True)
        _assert_matches(got[i], want)
    if return_lse:  # the kernel folds q/k descales into the softmax scale: the LSE is the real scores'
        lse = res[1]
        assert lse.shape == (b, hq, sq) and torch.isfinite(lse).all()


def test_varlen_and_paged_fp8_on_fa3_match_the_oracle(fa3):
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 4, 2, 16
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 10], dtype=torch.int32)
    q, k, v = _quantized((8, hq, d), gen), _quantized((10, hkv, d), gen), _quantized((10, hkv, d), gen)
    for per_head in (False, True):
        qs, ks, vs = (_factors(2, hkv, per_head, gen) for _ in range(3))
        args = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                    causal_alignment="bottom_right", q_descale=qs, k_descale=ks, v_descale=vs)
        assert opdispatch.explain(q, k, v, **args).chosen_id == "test.fa3"
        out = opdispatch.attention(q, k, v, **args)
        for b in range(2):
            sl_q, sl_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            _assert_matches(out[sl_q], _oracle(_per_sequence_scale(q[sl_q], qs, b, 2),
                                               _per_sequence_scale(k[sl_k], ks, b, 1),
                                               _per_sequence_scale(v[sl_k], vs, b, 1), causal=True,
                                               bottom_right=True))

    # A paged cache through flash_attn_with_kvcache: pages two sequences share, each read with its own factors.
    page, pages = 2, 5
    pool_k, pool_v = _quantized((pages, page, hkv, d), gen), _quantized((pages, page, hkv, d), gen)
    table = torch.tensor([[4, 0, 2], [0, 3, 1]], dtype=torch.int32)
    used = torch.tensor([5, 6], dtype=torch.int32)
    qd = _quantized((2, 2, hq, d), gen)
    for per_head in (False, True):
        qs, ks, vs = (_factors(2, hkv, per_head, gen) for _ in range(3))
        args = dict(seqused_k=used, block_table=table, causal=True, causal_alignment="bottom_right",
                    q_descale=qs, k_descale=ks, v_descale=vs)
        assert opdispatch.explain(qd, pool_k, pool_v, **args).chosen_id == "test.fa3"
        out = opdispatch.attention(qd, pool_k, pool_v, **args)
        for b in range(2):
            n = int(used[b])
            keys = torch.cat([pool_k[p] for p in table[b].tolist()])[:n]
            values = torch.cat([pool_v[p] for p in table[b].tolist()])[:n]
            _assert_matches(out[b], _oracle(_per_sequence_scale(qd[b], qs, b, 2), _per_sequence_scale(keys, ks, b, 1),
                                            _per_sequence_scale(values, vs, b, 1), causal=True, bottom_right=True))


def test_fa3_passes_descales_in_its_own_form(fa3, monkeypatch):
    """Per-tensor factors reach flash_attn_func as (batch, heads_kv) views of the same factor; per-head ones as
    given; bf16 calls pass none."""
    seen = []
    real = fake_fa3.flash_attn_func
    monkeypatch.setattr(fake_fa3, "flash_attn_func", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(2)
    q, k, v = _quantized((3, 4, 4, 16), gen), _quantized((3, 4, 2, 16), gen), _quantized((3, 4, 2, 16), gen)
    one_each = torch.tensor(0.25), torch.tensor([0.5]), torch.tensor(2.0)
    opdispatch.attention(q, k, v, q_descale=one_each[0], k_descale=one_each[1], v_descale=one_each[2])
    for name, factor in zip(("q_descale", "k_descale", "v_descale"), one_each):
        assert seen[-1][name].shape == (3, 2) and (seen[-1][name] == factor).all()
    rows = torch.rand(3, 2, generator=gen) + 0.1
    opdispatch.attention(q, k, v, q_descale=rows, k_descale=rows, v_descale=rows)
    assert seen[-1]["q_descale"] is rows
    x = torch.randn(3, 4, 2, 16).bfloat16()
    opdispatch.attention(x, x, x)
    assert "q_descale" not in seen[-1]


def test_fa3_refuses_what_its_fp8_kernel_does_not_take(fa3):
    gen = torch.Generator().manual_seed(3)
    one = torch.ones(())
    scales = dict(q_descale=one, k_descale=one, v_descale=one)

    def fa3_reasons(q, k, v, **kw):
        d = opdispatch.explain(q, k, v, **scales, **kw)
        assert d.chosen_id != "test.fa3"
        return " | ".join(next(c for c in d.candidates if c.impl_id == "test.fa3").reasons)

    q8 = _quantized((1, 4, 2, 16), gen)
    assert "FP8 output dtype fp16 not supported (supported: bf16)" in fa3_reasons(q8, q8, q8,
                                                                                  out_dtype=torch.float16)
    e5 = _quantized((1, 4, 2, 16), gen, E5)
    assert "dtype fp8_e5m2 not supported" in fa3_reasons(e5, e5, e5)
    d8 = _quantized((1, 4, 2, 8), gen)
    assert "FP8 head_dim 8 is not a multiple of 16" in fa3_reasons(d8, d8, d8)
    # The bf16 output of the same e4m3 call is FA3's, and reference.math still takes the rest exactly.
    assert opdispatch.explain(q8, q8, q8, **scales).chosen_id == "test.fa3"
    out = opdispatch.attention(q8, q8, q8, **scales, out_dtype=torch.float16)
    assert out.dtype == torch.float16


def test_simulated_h100_with_fa3_picks_it_for_e4m3_and_says_why_not_the_others(manager, tmp_path):
    meta = dict(device="meta", dtype=F8)
    q, k, v = torch.empty(2, 1024, 16, 128, **meta), torch.empty(2, 1024, 4, 128, **meta), torch.empty(
        2, 1024, 4, 128, **meta)
    one = torch.ones((), device="meta")
    scales = dict(q_descale=one, k_descale=one, v_descale=one)
    with_fa3 = device_with_library(tmp_path, "h100", "flash_attn_3", "3.0.0")
    d = opdispatch.explain(q, k, v, causal=True, device=with_fa3, **scales)
    assert d.chosen_id == "nvidia.flash_attn3", str(d)
    reasons = {c.impl_id: " | ".join(c.reasons) for c in d.candidates}
    for impl_id in ("nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "torch.flex"):
        assert "dtype fp8_e4m3fn not supported" in reasons[impl_id], (impl_id, reasons[impl_id])
    assert "flash_attn_4" in reasons["nvidia.flash_attn4"]  # ahead in the order, not installed
    assert all(reasons[c.impl_id] for c in d.candidates if c.status not in ("chosen", "eligible")), str(d)
    # With the cuDNN frontend installed too, the default order decides: FA3 comes first (the frontend sits at '*');
    # an fp16 output, which FA3 does not write, goes to the frontend.
    both = tmp_path / "h100-fa3-cudnn-frontend.yaml"
    both.write_text(open(with_fa3).read().replace("libraries:\n", "libraries:\n  cudnn_frontend: \"1.32.0\"\n"))
    d = opdispatch.explain(q, k, v, causal=True, device=str(both), **scales)
    assert d.chosen_id == "nvidia.flash_attn3", str(d)
    assert next(c for c in d.candidates if c.impl_id == "nvidia.cudnn_frontend").status == "eligible", str(d)
    d = opdispatch.explain(q, k, v, causal=True, device=str(both), out_dtype=torch.float16, **scales)
    assert d.chosen_id == "nvidia.cudnn_frontend", str(d)
    # fp16 out, or e5m2: not FA3's (flash_api.cpp); the reference (or the cuDNN frontend where installed) takes it
    d = opdispatch.explain(q, k, v, causal=True, device=with_fa3, out_dtype=torch.float16, **scales)
    assert d.chosen_id != "nvidia.flash_attn3"
    fa3 = next(c for c in d.candidates if c.impl_id == "nvidia.flash_attn3")
    assert any("FP8 output dtype fp16 not supported" in r for r in fa3.reasons)
    # Without FA3 installed, the e4m3 call is not FA3's, and explain says it is missing.
    d = opdispatch.explain(q, k, v, causal=True, device=str(device_descriptor("h100")), **scales)
    assert d.chosen_id != "nvidia.flash_attn3"
    fa3 = next(c for c in d.candidates if c.impl_id == "nvidia.flash_attn3")
    assert any("flash_attn_3" in r or "flash_attn_interface" in r for r in fa3.reasons), fa3.reasons
    # A100 (sm80): FA3 is sm90 only, as is its FP8 ("FlashAttention on Ampere/Ada cards only supports fp16/bf16")
    with_fa3_a100 = device_with_library(tmp_path, "a100", "flash_attn_3", "3.0.0")
    assert opdispatch.explain(q, k, v, device=with_fa3_a100, **scales).chosen_id != "nvidia.flash_attn3"
