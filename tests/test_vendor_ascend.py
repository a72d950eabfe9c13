"""Ascend plugin: `ascend.fusion_attention` against a fake torch_npu (its published npu_fusion_attention) and an
independent float64 oracle, forward and backward; selection on the simulated Ascend 910B; availability; probe."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import opdispatch
from opdispatch.vendors import ascend
from opdispatch.vendors.ascend import AscendFusionAttention
from opdispatch.vendors.ascend._attention import COMPRESSED_MASK_SIZE, INT32_MAX

from tests._vendor_helpers import allowed_keys, dense_inputs, real_device, to_bhsd, varlen_inputs
from tests._vendor_helpers import dense_oracle as oracle
from tests.conftest import DEVICES_DIR, TOLERANCES
from tests.fakes import install
from tests.fakes import torch_npu as fake_npu

ASCEND = DEVICES_DIR / "ascend-910b.yaml"


@pytest.fixture
def npu_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    install(monkeypatch, fake_npu.make(calls))
    return calls


def assert_close(got, want, dtype, what):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4, msg=what)


def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_grads(out, inputs, want_out, want_inputs, dtype, gen, view=lambda t: t):
    """Backward through the adapter (the fake's autograd) vs the float64 oracle's, with one random grad_out;
    `view` brings an input's gradient to the oracle's layout."""
    grad_out = torch.randn(out.shape, generator=gen).to(dtype)  # exactly representable in both
    (out.float() * grad_out.float()).sum().backward()
    (want_out * grad_out.double()).sum().backward()
    for name, got, want in zip("qkv", inputs, want_inputs):
        assert got.grad is not None and got.grad.dtype == dtype
        assert_close(view(got.grad), want.grad, dtype, f"d{name}")


# -- dense layouts -------------------------------------------------------------------------------------------

# (layout, sq, sk, hq, hkv, dtype, kwargs, sparse_mode, pre_tockens, next_tockens)
DENSE = [
    ("bshd", 16, 16, 4, 2, torch.bfloat16, {}, None, INT32_MAX, INT32_MAX),
    ("bhsd", 16, 16, 4, 4, torch.float16, dict(causal=True), 2, INT32_MAX, 0),
    ("sbhd", 12, 20, 4, 1, torch.bfloat16, dict(causal=True), 2, INT32_MAX, 0),
    ("bshd", 12, 20, 4, 2, torch.float16, dict(causal=True, causal_alignment="bottom_right"), 3, INT32_MAX, 0),
    ("bhsd", 20, 12, 2, 2, torch.bfloat16, dict(causal=True, scale=0.2), 2, INT32_MAX, 0),
    ("sbhd", 16, 16, 4, 2, torch.float16, dict(window=(3, 2)), 4, 3, 2),
    ("bshd", 16, 16, 4, 1, torch.bfloat16, dict(causal=True, window=(5, 0)), 4, 5, 0),
    ("bhsd", 16, 16, 2, 2, torch.float16, dict(window=(-1, 1)), 4, INT32_MAX, 1),
    # unequal lengths with a window: the explicit mask under sparse_mode 0, either alignment
    ("bshd", 10, 18, 4, 2, torch.bfloat16, dict(window=(4, 3), causal_alignment="bottom_right"), 0, INT32_MAX,
     INT32_MAX),
    ("sbhd", 10, 18, 4, 4, torch.float16, dict(causal=True, window=(6, 0), causal_alignment="bottom_right"), 0,
     INT32_MAX, INT32_MAX),
    ("bhsd", 12, 16, 4, 2, torch.bfloat16, dict(window=(2, 5)), 0, INT32_MAX, INT32_MAX),
]


@pytest.mark.parametrize("layout,sq,sk,hq,hkv,dtype,kwargs,mode,pre,nxt", DENSE)
def test_dense_forward_and_backward(npu_calls, rng, layout, sq, sk, hq, hkv, dtype, kwargs, mode, pre, nxt):
    q, k, v = leaves(dense_inputs(layout, 2, sq, sk, hq, hkv, 32, dtype, rng))
    call = opdispatch.validate_attention(q, k, v, layout=layout, **kwargs)
    assert not AscendFusionAttention().not_supported_reasons(call, opdispatch.load_device_descriptor(ASCEND))
    out = AscendFusionAttention().run(call)
    (kw,) = npu_calls
    assert kw["input_layout"] == {"bshd": "BSND", "bhsd": "BNSD", "sbhd": "SBH"}[layout]
    assert kw["head_num"] == hq and kw["scale"] == call.scale and kw["keep_prob"] == 1.0
    if mode is None:
        assert kw["atten_mask"] is None and kw["sparse_mode"] == 0
    else:
        assert (kw["sparse_mode"], kw["pre_tockens"], kw["next_tockens"]) == (mode, pre, nxt)
        if mode in (2, 3, 4):
            assert tuple(kw["atten_mask"].shape) == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    assert out.shape == call.q.shape[:-1] + (32,) and out.dtype == dtype
    q64, k64, v64 = leaves(to_bhsd(t, layout).double() for t in (q, k, v))
    allowed = allowed_keys(sq, sk, call.causal, call.window, call.causal_alignment)
    want, _ = oracle(q64, k64, v64, call.scale, allowed)
    assert_close(to_bhsd(out, layout), want, dtype, "out")
    check_grads(to_bhsd(out, layout), (q, k, v), want, (q64, k64, v64), dtype, rng,
                lambda t: to_bhsd(t, layout))


def test_swapped_alignment_or_mask_convention_would_fail(npu_calls, rng):
    """The fake computes what the op does with what it is given: a bottom-right call sent as sparse_mode 2, or a
    mask passed as opdispatch's True = attend, gives a different answer (these tests can fail)."""
    q, k, v = dense_inputs("bshd", 1, 8, 14, 2, 2, 16, torch.float16, rng)
    mod = sys.modules["torch_npu"]
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    right = mod.npu_fusion_attention(*bhsd, 2, "BNSD", atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                                     scale=0.25, sparse_mode=3)[0]
    left = mod.npu_fusion_attention(*bhsd, 2, "BNSD", atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
                                    scale=0.25, sparse_mode=2)[0]
    assert (right - left).abs().max() > 0.05
    keep = allowed_keys(8, 14, True, None, "bottom_right")
    as_masked = mod.npu_fusion_attention(*bhsd, 2, "BNSD", atten_mask=~keep, scale=0.25, sparse_mode=0)[0]
    as_kept = mod.npu_fusion_attention(*bhsd, 2, "BNSD", atten_mask=keep, scale=0.25, sparse_mode=0)[0]
    torch.testing.assert_close(as_masked, right)
    assert (as_kept - right).abs().max() > 0.05
    no_mask = mod.npu_fusion_attention(*bhsd, 2, "BNSD", scale=0.25, sparse_mode=3)[0]  # mask None: full
    assert (no_mask - right).abs().max() > 0.05


@pytest.mark.parametrize("layout,dtype,causal", [("bshd", torch.bfloat16, True), ("bhsd", torch.float16, False)])
def test_lse_from_softmax_max_and_sum(npu_calls, rng, layout, dtype, causal):
    q, k, v = dense_inputs(layout, 2, 12, 12, 4, 2, 64, dtype, rng)
    call = opdispatch.validate_attention(q, k, v, layout=layout, causal=causal, return_lse=True)
    out, lse = AscendFusionAttention().run(call)
    want, want_lse = oracle(*(to_bhsd(t, layout).double() for t in (q, k, v)), call.scale,
                            allowed_keys(12, 12, causal, None, "top_left"))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 12)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert_close(to_bhsd(out, layout), want, dtype, "out")


@pytest.mark.parametrize("mask_shape,causal", [((2, 1, 10, 14), True), ((1, 4, 10, 14), False), ((10, 14), True)])
def test_attn_mask_inverted_and_blind_rows_zero(npu_calls, rng, mask_shape, causal):
    """opdispatch's attn_mask (True = attend) goes in inverted (True = masked) as BNSS/B1SS/SS, combined with the
    causal pattern; rows it leaves without a key are zeros with LSE -inf (the op would average the values), and
    their gradients are zero."""
    dtype = torch.bfloat16
    q, k, v = leaves(dense_inputs("bshd", 2, 10, 14, 4, 2, 32, dtype, rng))
    mask = torch.rand(mask_shape, generator=rng) > 0.3
    mask[..., 3, :] = False  # a blind row
    call = opdispatch.validate_attention(q, k, v, attn_mask=mask, causal=causal, causal_alignment="bottom_right",
                                         return_lse=True)
    out, lse = AscendFusionAttention().run(call)
    (kw,) = npu_calls
    assert kw["sparse_mode"] == 0 and (kw["pre_tockens"], kw["next_tockens"]) == (INT32_MAX, INT32_MAX)
    assert kw["atten_mask"].dtype == torch.bool and kw["atten_mask"].dim() == 4
    allowed = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if causal:
        allowed = allowed & allowed_keys(10, 14, True, None, "bottom_right")
    q64, k64, v64 = leaves(t.transpose(1, 2).double() for t in (q, k, v))
    want, want_lse = oracle(q64, k64, v64, call.scale, allowed)
    assert (out[:, 3] == 0).all() and torch.isneginf(lse[:, :, 3]).all()
    assert_close(out.transpose(1, 2), want, dtype, "out")
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isfinite(lse), finite)
    check_grads(out.transpose(1, 2), (q, k, v), want, (q64, k64, v64), dtype, rng, lambda t: t.transpose(1, 2))


# -- packed varlen (TND) -------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens_q,lens_k,kwargs,mode,dtype", [
    ([5, 9, 3], [5, 9, 3], dict(causal=True), 2, torch.bfloat16),
    ([4, 7, 2], [6, 7, 5], dict(causal=True), 2, torch.float16),  # top-left per sequence
    ([6, 11], [6, 11], dict(window=(2, 1)), 4, torch.float16),
    ([6, 11], [6, 11], dict(causal=True, window=(3, 0)), 4, torch.bfloat16),
    ([3, 8, 5], [9, 2, 5], {}, None, torch.bfloat16),
])
def test_varlen_tnd(npu_calls, rng, lens_q, lens_k, kwargs, mode, dtype):
    t = varlen_inputs(lens_q, lens_k, 4, 2, 32, dtype, rng)
    q, k, v = leaves((t["q"], t["k"], t["v"]))
    call = opdispatch.validate_attention(q, k, v, cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
                                         layout="thd", **kwargs)
    assert not AscendFusionAttention().not_supported_reasons(call, opdispatch.load_device_descriptor(ASCEND))
    out = AscendFusionAttention().run(call)
    (kw,) = npu_calls
    assert kw["input_layout"] == "TND" and kw["head_num"] == 4
    assert kw["actual_seq_qlen"] == torch.tensor(lens_q).cumsum(0).tolist()
    assert kw["actual_seq_kvlen"] == torch.tensor(lens_k).cumsum(0).tolist()
    assert kw["sparse_mode"] == (mode if mode is not None else 0)
    assert (kw["atten_mask"] is None) == (mode is None)
    cq, ck = [0, *torch.tensor(lens_q).cumsum(0).tolist()], [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    q64, k64, v64 = leaves(x.double() for x in (q, k, v))
    wants = []
    for i in range(len(lens_q)):
        qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0) for x, a, b in
                      ((q64, cq[i], cq[i + 1]), (k64, ck[i], ck[i + 1]), (v64, ck[i], ck[i + 1])))
        o, _ = oracle(qi, ki, vi, call.scale, allowed_keys(lens_q[i], lens_k[i], call.causal, call.window, "top_left"))
        wants.append(o[0].transpose(0, 1))
    want = torch.cat(wants)
    assert_close(out, want, dtype, "out")
    check_grads(out, (q, k, v), want, (q64, k64, v64), dtype, rng)


# -- dropout -------------------------------------------------------------------------------------------------

def test_dropout_keep_prob(npu_calls, rng):
    q, k, v = leaves(dense_inputs("bhsd", 1, 8, 8, 2, 2, 16, torch.float16, rng))
    call = opdispatch.validate_attention(q, k, v, layout="bhsd", causal=True, dropout_p=0.25)
    out = AscendFusionAttention().run(call)
    (kw,) = npu_calls
    assert kw["keep_prob"] == pytest.approx(0.75)
    drop = torch.stack([d for d in kw["drop"]])  # the fake's kept positions, per batch row
    q64, k64, v64 = leaves(t.double() for t in (q, k, v))
    want, _ = oracle(q64, k64, v64, call.scale, allowed_keys(8, 8, True, None, "top_left"), drop=drop, keep=0.75)
    assert_close(out, want, torch.float16, "out")
    check_grads(out, (q, k, v), want, (q64, k64, v64), torch.float16, rng)


# -- refusals ------------------------------------------------------------------------------------------------

def test_refuses_what_it_cannot_honour(rng):
    impl, dev = AscendFusionAttention(), opdispatch.load_device_descriptor(ASCEND)
    q, k, v = dense_inputs("bshd", 1, 16, 8, 2, 2, 64, torch.bfloat16, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right", softcap=30.0)
    reasons = "; ".join(impl.not_supported_reasons(call, dev))
    assert "softcap" in reasons and "invalid row" in reasons  # sq > sk bottom-right: blind rows
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 72, torch.bfloat16, rng)
    call = opdispatch.validate_attention(q, k, v, attn_bias=torch.zeros(8, 8),
                                         alibi_slopes=torch.ones(2, dtype=torch.float32))
    reasons = "; ".join(impl.not_supported_reasons(call, dev))
    assert "multiple of 16" in reasons and "attn_bias" in reasons and "ALiBi" in reasons
    t = varlen_inputs([3, 5], [3, 5], 2, 2, 64, torch.float16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", return_lse=True)
    assert any("return_lse with layout 'thd'" in r for r in impl.not_supported_reasons(call, dev))
    t = varlen_inputs([3, 5], [4, 5], 2, 2, 64, torch.float16, rng)
    call = opdispatch.validate_attention(**t, layout="thd", causal=True, causal_alignment="bottom_right")
    assert any("invalid row" in r for r in impl.not_supported_reasons(call, dev))
    q, k, v = dense_inputs("bshd", 1, 8, 8, 2, 2, 64, torch.float32, rng)
    assert any("dtype fp32 not supported" in r for r in impl.not_supported_reasons(opdispatch.validate_attention(q, k, v), dev))


# -- selection on the simulated Ascend 910B ------------------------------------------------------------------

def _meta(sq=2048, sk=2048, hq=16, hkv=16, d=128, grad=False, b=2):
    kw = dict(device="meta", dtype=torch.bfloat16, requires_grad=grad)
    return torch.empty(b, sq, hq, d, **kw), torch.empty(b, sk, hkv, d, **kw), torch.empty(b, sk, hkv, d, **kw)


def test_ascend_910b_selection(manager):
    # training: the fused op with its backward, not reference.math
    for kwargs in (dict(causal=True), {}, dict(causal=True, window=(256, 0)), dict(dropout_p=0.1)):
        d = opdispatch.explain(*_meta(grad=True), device=ASCEND, **kwargs)
        assert d.chosen_id == "ascend.fusion_attention", str(d)
        assert "forward-only" in " ".join(d.candidate("flagos.triton").reasons)
    d = opdispatch.explain(*_meta(hkv=4, grad=True), device=ASCEND, causal=True)  # GQA
    assert d.chosen_id == "ascend.fusion_attention"
    mask = torch.ones(2, 1, 2048, 2048, dtype=torch.bool, device="meta")
    assert opdispatch.explain(*_meta(grad=True), device=ASCEND, attn_mask=mask).chosen_id == "ascend.fusion_attention"
    # forward: FlagGems' kernel stays first where it runs (Ascend documents this op for training)
    assert opdispatch.explain(*_meta(), device=ASCEND, causal=True).chosen_id == "flagos.triton"
    # what it refuses, it says why
    d = opdispatch.explain(*_meta(grad=True), device=ASCEND, softcap=30.0)
    assert d.chosen_id == "reference.math"
    assert any("softcap" in r for r in d.candidate("ascend.fusion_attention").reasons)
    q, k, v = _meta(grad=True, d=192)
    d = opdispatch.explain(q, k, v[..., :128], device=ASCEND, causal=True)  # MLA head dims: v zero-padded
    assert d.chosen_id == "ascend.fusion_attention"
    q, k, v = _meta(grad=True, d=256)
    d = opdispatch.explain(q[..., :128], k[..., :128], v, device=ASCEND, causal=True)  # v wider than q/k
    assert d.chosen_id == "reference.math"
    assert any("v head_dim 256 above q/k head_dim 128" in r for r in d.candidate("ascend.fusion_attention").reasons)
    # not on other hardware
    d = opdispatch.explain(*_meta(grad=True), device=DEVICES_DIR / "bi-v150.yaml", causal=True)
    c = d.candidate("ascend.fusion_attention")
    assert c.status == "unavailable" and "runs on device type 'npu', not 'cuda'" in c.reasons[0]


# -- availability and probe ----------------------------------------------------------------------------------

def test_availability(manager, monkeypatch):
    dev = opdispatch.DeviceInfo(vendor="ascend", type="npu", arch="ascend910b", name="Ascend910B2", index=0,
                                libraries={"torch": "2.5.1", "torch_npu": "2.5.1"})
    calls: list = []
    install(monkeypatch, fake_npu.make(calls))
    assert AscendFusionAttention().availability(dev) is None
    install(monkeypatch, fake_npu.make(calls, old_signature=True))
    reason = AscendFusionAttention().availability(dev)
    assert "does not accept the keywords" in reason and "sparse_mode" in reason
    monkeypatch.delitem(sys.modules, "torch_npu")
    missing = opdispatch.DeviceInfo(vendor="ascend", type="npu", arch="ascend910b", name="Ascend910B2", index=0)
    reason = AscendFusionAttention().availability(missing)
    assert "'torch_npu' is not installed" in reason and "torch-npu" in reason
    assert "runs on device type 'npu', not 'cuda'" == AscendFusionAttention().availability(
        real_device("amd", "gfx942", "MI300X", torch="2.7.1"))
    other_npu = opdispatch.DeviceInfo(vendor="npu", type="npu", arch="npu", name="npu", index=0)  # unprobed
    assert "supports 'ascend' hardware, not vendor 'npu'" in AscendFusionAttention().availability(other_npu)


def test_probe(monkeypatch):
    assert ascend.opdispatch_probe_device(torch.device("cpu")) is None
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert ascend.opdispatch_probe_device(types.SimpleNamespace(type="npu", index=0)) is None
    install(monkeypatch, fake_npu.make([]))
    npu = types.SimpleNamespace(current_device=lambda: 1, get_device_name=lambda index: f"Ascend910B{index + 2}")
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    info = ascend.opdispatch_probe_device(types.SimpleNamespace(type="npu", index=None))
    assert (info.vendor, info.type, info.arch, info.name, info.index) == ("ascend", "npu", "ascend910b",
                                                                         "Ascend910B3", 1)
    assert ascend.arch_from_name("Ascend 310P3") == "ascend310p" and ascend.arch_from_name("npu") == "ascend"
