"""reference.math against torch's SDPA and an independent float64 loop; cpu.flash against reference.math.

All inputs are fresh random tensors; every feature is exercised.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import opdispatch
from tests.conftest import TOLERANCES, randn


def naive_attention(q, k, v, *, scale, causal=False, alignment="top_left", window=None, softcap=0.0, alibi=None,
                    mask=None, bias=None):
    """Row-by-row float64 attention over (b, h, s, d), written independently of the implementations."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    groups = hq // hkv
    out = torch.zeros(b, hq, sq, dv, dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    offset = sk - sq if alignment == "bottom_right" else 0
    for bi in range(b):
        for h in range(hq):
            kh = h // groups
            for i in range(sq):
                scores = (k[bi, kh] @ q[bi, h, i]) * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                j = torch.arange(sk)
                if alibi is not None:
                    slope = alibi[h] if alibi.dim() == 1 else alibi[bi, h]
                    scores = scores - slope.double() * (i + offset - j).abs()
                if bias is not None:
                    scores = scores + bias.double().expand(b, hq, sq, sk)[bi, h, i]
                keep = torch.ones(sk, dtype=torch.bool)
                if causal:
                    keep &= j <= i + offset
                if window is not None:
                    left, right = window
                    if left >= 0:
                        keep &= j >= i + offset - left
                    if right >= 0:
                        keep &= j <= i + offset + right
                if mask is not None:
                    keep &= mask.expand(b, hq, sq, sk)[bi, h, i]
                if not keep.any():
                    continue
                s = scores[keep]
                m = s.max()
                p = torch.exp(s - m)
                lse[bi, h, i] = m + torch.log(p.sum())
                out[bi, h, i] = (p / p.sum()) @ v[bi, kh][keep]
    return out, lse


def bhsd_inputs(b=2, hq=4, hkv=2, sq=7, sk=9, d=16, dv=None, dtype=torch.float64, gen=None, grad=False):
    dv = dv or d
    return (randn(b, hq, sq, d, dtype=dtype, gen=gen, requires_grad=grad),
            randn(b, hkv, sk, d, dtype=dtype, gen=gen, requires_grad=grad),
            randn(b, hkv, sk, dv, dtype=dtype, gen=gen, requires_grad=grad))


FEATURES = [
    dict(),
    dict(causal=True),
    dict(causal=True, causal_alignment="bottom_right"),
    dict(window=(3, 1)),
    dict(window=(2, 0), causal=True, causal_alignment="bottom_right"),
    dict(softcap=5.0),
    dict(alibi=True),
    dict(alibi=True, causal=True, causal_alignment="bottom_right"),
    dict(mask=True),
    dict(bias=True),
    dict(mask=True, bias=True, causal=True, softcap=3.0),
    dict(scale=0.05),
]


def _build(features, q, gen):
    b, hq, sq, _ = q.shape
    kw = {k: v for k, v in features.items() if k not in ("alibi", "mask", "bias")}
    sk = 9
    if features.get("alibi"):
        kw["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5
    if features.get("mask"):
        kw["attn_mask"] = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
    if features.get("bias"):
        kw["attn_bias"] = torch.randn(1, hq, sq, sk, generator=gen).double()
    return kw


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
def test_reference_matches_independent_float64_loop(manager, rng, features):
    q, k, v = bhsd_inputs(gen=rng)
    kw = _build(features, q, rng)
    out, lse = opdispatch.attention(q, k, v, layout="bhsd", return_lse=True, impl="reference.math", **kw)
    expected_out, expected_lse = naive_attention(
        q, k, v, scale=kw.get("scale", 1 / math.sqrt(16)), causal=kw.get("causal", False),
        alignment=kw.get("causal_alignment", "top_left"), window=kw.get("window"), softcap=kw.get("softcap", 0.0),
        alibi=kw.get("alibi_slopes"), mask=kw.get("attn_mask"), bias=kw.get("attn_bias"))
    torch.testing.assert_close(out, expected_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, expected_lse, atol=1e-10, rtol=1e-10)
    assert out.abs().max() > 0.05  # a real result, not zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_torch_sdpa(manager, rng, dtype, causal):
    q, k, v = bhsd_inputs(dtype=dtype, gen=rng, sq=9)
    mask = torch.rand(2, 4, 9, 9, generator=rng) > 0.2
    bias = torch.randn(9, 9, generator=rng).to(dtype)
    for kw, sdpa_kw in [
        (dict(causal=causal), dict(is_causal=causal)),
        (dict(attn_mask=mask), dict(attn_mask=mask)),
        (dict(attn_bias=bias, causal=causal), dict(attn_mask=bias + torch.zeros(9, 9, dtype=dtype).masked_fill(
            ~torch.ones(9, 9, dtype=torch.bool).tril(), -math.inf) if causal else bias)),
        (dict(scale=0.3, causal=causal), dict(scale=0.3, is_causal=causal)),
    ]:
        out = opdispatch.attention(q, k, v, layout="bhsd", impl="reference.math", **kw)
        expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **sdpa_kw)
        torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_reference_varlen_matches_per_sequence_dense(manager, rng):
    lengths_q, lengths_k = [3, 8, 1, 5], [6, 8, 4, 5]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(lengths_q), 4, 16, dtype=torch.float64, gen=rng)
    k = randn(sum(lengths_k), 2, 16, dtype=torch.float64, gen=rng)
    v = randn(sum(lengths_k), 2, 16, dtype=torch.float64, gen=rng)
    slopes = torch.rand(4, 4, generator=rng)
    out, lse = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                    causal_alignment="bottom_right", window=(2, 0), alibi_slopes=slopes,
                                    return_lse=True, impl="reference.math")
    assert out.shape == (sum(lengths_q), 4, 16) and lse.shape == (4, sum(lengths_q))
    for i in range(4):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1).unsqueeze(0)
        eo, el = naive_attention(qs, ks, vs, scale=0.25, causal=True, alignment="bottom_right", window=(2, 0),
                                 alibi=slopes[i:i + 1])
        torch.testing.assert_close(out[cu_q[i]:cu_q[i + 1]], eo[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, cu_q[i]:cu_q[i + 1]], el[0])


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse(manager, rng):
    # bottom-right causal with sq > sk: the first sq - sk queries see no key.
    q, k, v = bhsd_inputs(sq=6, sk=4, gen=rng, grad=True)
    out, lse = opdispatch.attention(q, k, v, layout="bhsd", causal=True, causal_alignment="bottom_right",
                                    return_lse=True, impl="reference.math")
    assert torch.all(out[:, :, :2] == 0) and torch.all(lse[:, :, :2] == -math.inf)
    assert torch.isfinite(lse[:, :, 2:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_reference_dropout_is_unbiased_and_seeded(manager, rng):
    q, k, v = bhsd_inputs(gen=rng, sq=8, sk=8)
    plain = opdispatch.attention(q, k, v, layout="bhsd", impl="reference.math")
    torch.manual_seed(7)
    a = opdispatch.attention(q, k, v, layout="bhsd", dropout_p=0.3, impl="reference.math")
    torch.manual_seed(7)
    b = opdispatch.attention(q, k, v, layout="bhsd", dropout_p=0.3, impl="reference.math")
    torch.testing.assert_close(a, b)
    assert (a - plain).abs().max() > 1e-3
    # Same seed, same mask: recompute by hand from the float64 probabilities.
    expected_probs = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0, dim=-1)
    torch.manual_seed(7)
    dropped = F.dropout(expected_probs, p=0.3, training=True)
    torch.testing.assert_close(a, dropped @ v.repeat_interleave(2, 1))
    mean = torch.stack([opdispatch.attention(q, k, v, layout="bhsd", dropout_p=0.3, impl="reference.math")
                        for _ in range(400)]).mean(0)
    assert (mean - plain).abs().mean() < 0.05


def test_reference_gradients_match_float64_autograd_of_torch_sdpa(manager, rng):
    q, k, v = bhsd_inputs(gen=rng, sq=6, sk=6, grad=True)
    bias = torch.randn(6, 6, generator=rng, dtype=torch.float64, requires_grad=True)
    out = opdispatch.attention(q, k, v, layout="bhsd", attn_bias=bias, impl="reference.math")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), g)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v, bias), g)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


# -- cpu.flash ---------------------------------------------------------------------------------------------

CPU_FLASH_CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, causal_alignment="bottom_right"),
    dict(window=(3, 2)),
    dict(window=(4, 0), causal=True, causal_alignment="bottom_right"),
    dict(mask=True),
    dict(bias=True),
    dict(mask=True, bias=True, causal=True),
    dict(alibi=True),
    dict(alibi=True, causal=True, causal_alignment="bottom_right"),
    dict(alibi=True, mask=True, window=(3, 1)),
]


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", CPU_FLASH_CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
def test_cpu_flash_matches_reference(manager, rng, layout, dtype, features):
    b, hq, hkv, sq, sk, d = 2, 4, 2, 7, 9, 32
    shape = {"bshd": lambda s, h: (b, s, h, d), "bhsd": lambda s, h: (b, h, s, d), "sbhd": lambda s, h: (s, b, h, d)}
    q = randn(*shape[layout](sq, hq), dtype=dtype, gen=rng)
    k = randn(*shape[layout](sk, hkv), dtype=dtype, gen=rng)
    v = randn(*shape[layout](sk, hkv), dtype=dtype, gen=rng)
    kw = {key: val for key, val in features.items() if key not in ("mask", "bias", "alibi")}
    if features.get("alibi"):
        kw["alibi_slopes"] = torch.rand(hq, generator=rng) + 0.25
    if features.get("mask"):
        kw["attn_mask"] = torch.rand(b, 1, sq, sk, generator=rng) > 0.3
    if features.get("bias"):
        kw["attn_bias"] = torch.randn(hq, sq, sk, generator=rng).to(dtype)
    decision = opdispatch.explain(q, k, v, layout=layout, **kw)
    assert decision.chosen_id == "cpu.flash", str(decision)
    out, lse = opdispatch.attention(q, k, v, layout=layout, return_lse=True, **kw)
    ref_out, ref_lse = opdispatch.attention(q, k, v, layout=layout, return_lse=True, impl="reference.math", **kw)
    assert out.shape == q.shape[:-1] + (d,)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert lse.dtype == ref_lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # ALiBi in bf16/fp16: the kernel takes the (row-shifted) bias rounded to the input dtype, the reference keeps
    # it in fp32 — the LSE differs by that rounding.
    lse_tol = 5e-3 if features.get("alibi") and dtype in (torch.bfloat16, torch.float16) else 1e-3
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=lse_tol, rtol=lse_tol)


@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(window=(3, 0), causal=True)])
def test_cpu_flash_gradients_match_reference(manager, rng, features):
    q, k, v = bhsd_inputs(dtype=torch.float32, gen=rng, sq=8, sk=8, grad=True)
    out = opdispatch.attention(q, k, v, layout="bhsd", **features)
    assert opdispatch.explain(q, k, v, layout="bhsd", **features).chosen_id == "cpu.flash"
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = opdispatch.attention(q, k, v, layout="bhsd", impl="reference.math", **features)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw,reason", [
    (dict(dropout_p=0.1), "dropout_p=0.1 not supported"),
    (dict(softcap=10.0), "softcap=10 not supported"),
])
def test_cpu_flash_declines_what_it_cannot_do_and_reference_takes_it(manager, rng, kw, reason):
    q, k, v = bhsd_inputs(dtype=torch.float32, gen=rng, dv=kw.pop("head_dim_v", None))
    decision = opdispatch.explain(q, k, v, layout="bhsd", **kw)
    assert decision.chosen_id == "reference.math"
    flash = decision.candidate("cpu.flash")
    assert flash.status == "rejected" and any(reason in r for r in flash.reasons), flash.reasons


def test_cpu_flash_alibi_keeps_bf16_precision_and_its_gradients(manager, rng):
    """Large ALiBi distances (sq > sk, bottom-right): the bias is row-shifted before rounding to bf16."""
    q, k, v = bhsd_inputs(b=2, hq=4, hkv=2, sq=96, sk=24, d=32, dtype=torch.float32, gen=rng)
    slopes = torch.tensor([0.9, 0.5, 0.25, 0.125])
    kw = dict(alibi_slopes=slopes, causal_alignment="bottom_right", layout="bhsd")
    assert opdispatch.explain(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).chosen_id == "cpu.flash"
    out = opdispatch.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    ref, _ = naive_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=32 ** -0.5, alignment="bottom_right",
                             alibi=slopes)
    assert (out.double() - ref).abs().max().item() < 0.02
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    got = opdispatch.attention(qg, kg, vg, return_lse=True, **kw)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = naive_attention(*leaves, scale=32 ** -0.5, alignment="bottom_right", alibi=slopes)
    torch.testing.assert_close(got[1].double(), want[1], atol=1e-4, rtol=1e-4)
    g = torch.randn(got[0].shape, generator=rng)
    for a, b in zip(torch.autograd.grad(got[0], (qg, kg, vg), g), torch.autograd.grad(want[0], leaves, g.double())):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def _head_dim_strided_views(gen):
    """(name, q) pairs of bshd (2, 6, 4, 8) float64 views whose head dim is not unit-stride."""
    base = torch.randn(2, 6, 4, 16, generator=gen, dtype=torch.float64)
    channels_last = torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    d_outer = torch.randn(2, 8, 6, 4, generator=gen, dtype=torch.float64).permute(0, 2, 3, 1)
    scalar = torch.tensor(0.75, dtype=torch.float64).expand(2, 6, 4, 8)
    return [("every_other", base[..., ::2]), ("channels_last", channels_last), ("head_dim_outermost", d_outer),
            ("expanded_scalar", scalar)]


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_takes_inputs_whose_head_dim_is_not_unit_stride(manager, causal):
    gen = torch.Generator().manual_seed(21)
    k, v = (torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    contiguous_q = torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64)
    opdispatch.attention(contiguous_q, k, v, causal=causal)  # warm the per-call fast path on contiguous inputs
    for name, q in _head_dim_strided_views(gen):
        assert q.stride(-1) != 1, name
        assert opdispatch.explain(q, k, v, causal=causal).chosen_id == "cpu.flash"
        want, _ = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=8 ** -0.5,
                                  causal=causal)
        for qq, kk, vv in ((q, k, v), (q, q, q)):
            got = opdispatch.attention(qq, kk, vv, causal=causal)
            if qq is q and kk is k:
                torch.testing.assert_close(got, want.transpose(1, 2), **TOLERANCES[torch.float64], msg=name)
            ref = opdispatch.attention(qq, kk, vv, causal=causal, impl="reference.math")
            torch.testing.assert_close(got, ref, **TOLERANCES[torch.float64], msg=name)


@pytest.mark.parametrize("impl", ["cpu.flash", "reference.math"])
def test_a_bias_row_of_minus_inf_gives_lse_minus_inf(basic_manager, impl):
    """A query whose every key the bias removes sees no key: out 0 and lse -inf, as with a boolean mask."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, s, 2, 8, generator=gen) for s in (4, 6, 6))
    bias = torch.randn(1, 2, 4, 6, generator=gen)
    bias[0, 0, 1, :] = float("-inf")
    for causal in (False, True):
        out, lse = opdispatch.attention(q, k, v, attn_bias=bias, return_lse=True, causal=causal, impl=impl)
        assert lse[0, 0, 1] == float("-inf") and torch.isfinite(lse[0, 1]).all()
        assert (out[0, 1, 0] == 0).all()
