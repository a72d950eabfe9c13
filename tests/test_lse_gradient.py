"""A returned LSE is differentiable, exactly, on every implementation: a loss that reads the LSE (a merged
context-parallel block, a logsumexp term of one's own) gets its gradient with respect to q and k, also from kernels
whose LSE is a side output without one (`caps.lse_grad` False: cpu.flash here, torch's CUDA kernels on GPUs),
through `OpSpec.result_fix` — the bound fast path and the slow path alike. Before it, such gradients silently
lacked the LSE's term (validate measured dq/dk 17% off on cpu.flash and on nvidia.flash/cudnn/mem_efficient)."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from tests.test_numerics import naive_attention

CASES = {
    "bshd causal": dict(layout="bshd", causal=True),
    "bhsd dense": dict(layout="bhsd"),
    "sbhd GQA 4:2 causal": dict(layout="sbhd", causal=True, hkv=2),
    "bshd window": dict(layout="bshd", causal=True, window=(5, 0)),
    "bshd q shorter, bottom-right": dict(layout="bshd", causal=True, causal_alignment="bottom_right", sq=9),
    "bshd mask": dict(layout="bshd", mask=True),
}


def _inputs(case, gen):
    b, s, h, d = 2, 17, 4, 16
    sq, hkv = case.get("sq", s), case.get("hkv", h)
    shapes = {"bshd": lambda n, hh: (b, n, hh, d), "bhsd": lambda n, hh: (b, hh, n, d),
              "sbhd": lambda n, hh: (n, b, hh, d)}[case["layout"]]
    q = torch.randn(*shapes(sq, h), generator=gen)
    k, v = (torch.randn(*shapes(s, hkv), generator=gen) for _ in range(2))
    kw = {key: case[key] for key in ("layout", "causal", "window", "causal_alignment") if key in case}
    if case.get("mask"):
        kw["attn_mask"] = torch.rand(b, 1, sq, s, generator=gen) > 0.3
    return q, k, v, kw


def _to_bhsd(t, layout):
    return {"bshd": lambda x: x.transpose(1, 2), "bhsd": lambda x: x, "sbhd": lambda x: x.permute(1, 2, 0, 3)}[layout](t)


@pytest.mark.parametrize("impl", ["cpu.flash", None], ids=["cpu.flash", "default policy"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradient_through_the_returned_lse_matches_the_float64_oracle(name, impl):
    case = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    q, k, v, kw = _inputs(case, gen)
    manager = opdispatch.get_manager()
    call = opdispatch.validate_attention(*(t.requires_grad_() for t in (q, k, v)), return_lse=True, **kw)
    if impl is not None and manager.implementation("attention", impl).not_supported_reasons(
            call, manager.device_info("cpu")):
        pytest.skip(f"{impl} does not take {name}")
    # the oracle: float64 attention written out, autograd through its own logsumexp
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    layout = kw["layout"]
    mask = kw.get("attn_mask")
    ref_out, ref_lse = naive_attention(_to_bhsd(qd, layout), _to_bhsd(kd, layout), _to_bhsd(vd, layout),
                                       scale=q.shape[-1] ** -0.5, causal=kw.get("causal", False),
                                       alignment=kw.get("causal_alignment", "top_left"), window=kw.get("window"),
                                       mask=mask)
    w_out = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((ref_out * w_out).sum() + (ref_lse * w_lse).sum(), (qd, kd, vd))
    for _ in range(3):  # the slow path, then the bound fast path
        out, lse = opdispatch.attention(q, k, v, return_lse=True, impl=impl, **kw)
        out_bhsd = _to_bhsd(out, layout)
        got = torch.autograd.grad((out_bhsd * w_out.float()).sum() + (lse * w_lse.float()).sum(), (q, k, v))
        for gname, g, w in zip("qkv", got, want):
            err = float((g.double() - w).norm() / w.norm())
            assert err < 1e-5, f"d{gname} relative error {err:.3g} against the float64 oracle ({name}, {impl})"


def test_softcap_with_a_differentiated_lse_goes_where_the_lse_is_differentiable():
    """The exact LSE gradient reads scores as scale * q.k: with softcap the call is refused by kernels whose LSE
    has none (a capability reason), and served by one whose LSE is differentiable."""
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    call = opdispatch.validate_attention(q, q, q, softcap=20.0, return_lse=True)
    reasons = opdispatch.get_manager().implementation("attention", "cpu.flash").not_supported_reasons(
        call, opdispatch.get_manager().device_info("cpu"))
    assert any("caps.lse_grad" in r or "softcap" in r for r in reasons), reasons
    out, lse = opdispatch.attention(q, q, q, softcap=20.0, return_lse=True)
    assert lse.requires_grad
