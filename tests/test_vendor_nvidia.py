"""NVIDIA plugin on CPU: selection on simulated devices, the probe, and the flash-attn adapters against fakes."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import opdispatch
from opdispatch import validate_attention
from opdispatch.vendors.nvidia import FlashAttn2, FlashAttn3, probe_nvidia
from opdispatch.plugins.toolkit import blind_rows
from opdispatch.vendors.nvidia._probe import is_nvidia_torch
from opdispatch.ops._attention import allowed_positions

from tests.conftest import device_descriptor, randn
from tests.fakes import _fa_math as fa_math
from tests.fakes import flash_attn as fake_fa2
from tests.fakes import flash_attn_interface as fake_fa3
from tests.test_nvidia_masked_bind import _scores

META = dict(device="meta", dtype=torch.bfloat16)


def qkv(b=2, sq=1024, sk=None, hq=16, hkv=4, d=128, dv=None, grad=False):
    sk = sk or sq
    q = torch.empty(b, sq, hq, d, **META, requires_grad=grad)
    k = torch.empty(b, sk, hkv, d, **META, requires_grad=grad)
    v = torch.empty(b, sk, hkv, dv or d, **META, requires_grad=grad)
    return q, k, v


def chosen(device, *args, **kw):
    return opdispatch.explain(*args, device=str(device_descriptor(device)), **kw)


@pytest.mark.parametrize("device", ["h100", "h200", "a100", "l40s"])
def test_dense_prefill_goes_to_cudnn(manager, device):
    assert chosen(device, *qkv(), causal=True).chosen_id == "nvidia.cudnn"


def test_features_route_to_the_kernels_that_have_them(manager):
    q, k, v = qkv()
    assert chosen("h100", q, k, v, causal=True, window=(256, 0)).chosen_id == "nvidia.flash"
    assert chosen("h100", q, k, v, causal=True, softcap=30.0).chosen_id == "torch.flex"  # measured faster
    assert chosen("a100", q, k, v, causal=True, softcap=30.0).chosen_id == "nvidia.flash_attn"
    # bottom-right causal with sq != sk: cuDNN's mask is top-left → FlashAttention-2.
    q2, k2, v2 = qkv(sq=128, sk=1024)
    assert chosen("h100", q2, k2, v2, causal=True, causal_alignment="bottom_right").chosen_id == "nvidia.flash"
    assert chosen("h100", q2, k2, v2, causal=True).chosen_id == "nvidia.cudnn"
    # masks with GQA: cuDNN; masks without GQA and with a bias gradient: mem_efficient.
    mask = torch.empty(2, 1, 1024, 1024, device="meta", dtype=torch.bool)
    assert chosen("h100", q, k, v, attn_mask=mask).chosen_id == "nvidia.cudnn"
    qm, km, vm = qkv(hkv=16, grad=True)
    bias = torch.empty(1, 16, 1024, 1024, **META, requires_grad=True)
    assert chosen("h100", qm, km, vm, attn_bias=bias).chosen_id == "nvidia.mem_efficient"


def test_varlen_on_h100_is_torch_flash(manager):
    q = torch.empty(3000, 16, 128, **META)
    k = torch.empty(3000, 4, 128, **META)
    cu = torch.tensor([0, 1000, 3000], dtype=torch.int32, device="meta")
    d = chosen("h100", q, k, k, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2000,
               max_seqlen_k=2000, causal=True)
    assert d.chosen_id == "nvidia.flash"


def test_cudnn_head_dim_256_needs_sm90_and_cudnn_9_10(manager):
    q, k, v = qkv(d=256)
    assert chosen("h100", q, k, v).chosen_id == "nvidia.cudnn"
    d = chosen("a100", q, k, v)
    assert d.chosen_id == "nvidia.flash"
    cudnn = next(c for c in d.candidates if c.impl_id == "nvidia.cudnn")
    assert "head_dim 256 > 128 needs sm90" in cudnn.reasons[0]


def test_flash_training_head_dim_limit_on_sm89(manager):
    q, k, v = qkv(d=200, grad=True)
    d = chosen("l40s", q, k, v, causal=True)
    flash = next(c for c in d.candidates if c.impl_id == "nvidia.flash")
    assert any("(192, 224]" in r for r in flash.reasons)
    assert chosen("h100", q, k, v, causal=True).chosen_id == "nvidia.cudnn"  # d <= 256 on sm90, cuDNN 9.19


def test_flagos_never_takes_gradients(manager):
    q, k, v = qkv(grad=True)
    d = chosen("h100", q, k, v, causal=True, softcap=30.0)
    assert d.chosen_id == "torch.flex"  # the fused fallback (reference.math before torch.flex existed)
    fg = next(c for c in d.candidates if c.impl_id == "flagos.triton")
    assert any("illegal memory access" in r for r in fg.reasons)


def test_probe_ignores_other_devices():
    assert probe_nvidia(torch.device("cpu")) is None
    fake = types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2", cuda=None), __version__="2.5.0+rocm6.2")
    assert not is_nvidia_torch(fake)
    corex = types.SimpleNamespace(version=types.SimpleNamespace(hip=None, cuda="11.8"), corex=object(),
                                  __version__="2.1.0+corex.4.1")
    assert not is_nvidia_torch(corex)
    nv = types.SimpleNamespace(version=types.SimpleNamespace(hip=None, cuda="13.0"), __version__="2.11.0+cu130")
    assert is_nvidia_torch(nv)


def test_blind_rows_match_allowed_positions():
    for sq, sk, causal, window in [(160, 64, True, None), (64, 160, True, (8, 0)), (50, 50, False, (3, 2)),
                                   (10, 40, False, (2, -1)), (40, 10, False, (-1, 1))]:
        expected = ~allowed_positions(sq, sk, causal, window, sk - sq, torch.device("cpu")).any(-1)
        assert torch.equal(blind_rows(sq, sk, sk - sq, causal, window, torch.device("cpu")), expected)


# -- flash-attn adapters against fakes (CPU, numerics vs reference.math) ------------------------------------

@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3)


def _compare(manager, impl, rng, *, layout="bshd", varlen=False, **kw):
    manager.ensure_initialized()
    ref = manager.registry.get("attention", "reference.math").impl
    if varlen:
        lens_q, lens_k = kw.pop("lens_q"), kw.pop("lens_k")
        q = randn(sum(lens_q), 8, 32, gen=rng)
        k, v = randn(sum(lens_k), 2, 32, gen=rng), randn(sum(lens_k), 2, 32, gen=rng)
        cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
        cu_k = cu_q if lens_k is lens_q else torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(),
                                                          dtype=torch.int32)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        layout = "thd"
    else:
        sq, sk = kw.pop("sq", 24), kw.pop("sk", 24)
        shape = {"bshd": lambda s, h: (2, s, h, 32), "bhsd": lambda s, h: (2, h, s, 32)}[layout]
        q, k, v = randn(*shape(sq, 8), gen=rng), randn(*shape(sk, 2), gen=rng), randn(*shape(sk, 2), gen=rng)
    call = validate_attention(q, k, v, layout=layout, return_lse=True, **kw)
    out, lse = impl.run(call)
    ref_out, ref_lse = ref.run(call)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    assert (lse[~finite] == -math.inf).all()


@pytest.mark.parametrize("impl_cls", [FlashAttn2, FlashAttn3])
def test_flash_attn_packages_match_reference(manager, fakes, rng, impl_cls):
    impl = impl_cls()
    br = dict(causal_alignment="bottom_right")
    _compare(manager, impl, rng)
    _compare(manager, impl, rng, causal=True, layout="bhsd")
    _compare(manager, impl, rng, sq=40, sk=16, causal=True, **br)  # queries that see no key: lse -inf
    _compare(manager, impl, rng, causal=True, window=(5, 0), softcap=10.0)
    _compare(manager, impl, rng, varlen=True, lens_q=[7, 1, 30], lens_k=[9, 12, 30], causal=True, **br)
    if impl_cls is FlashAttn2:
        _compare(manager, impl, rng, alibi_slopes=torch.rand(8) * 0.3)


def test_flash_attn_capabilities_on_a100(manager):
    q, k, v = qkv(sq=64, sk=256)
    d = chosen("a100", q, k, v, causal=True, causal_alignment="bottom_right", softcap=5.0)
    assert d.chosen_id == "nvidia.flash_attn"
    alibi = torch.empty(16, device="meta", dtype=torch.float32)
    d = chosen("a100", q, k, v, causal=True, alibi_slopes=alibi, return_lse=True)
    fa = next(c for c in d.candidates if c.impl_id == "nvidia.flash_attn")
    assert any("ALiBi" in r for r in fa.reasons)


# -- cuDNN varlen (thd) through aten _cudnn_attention_forward: opt-in ----------------------------------------

def _thd(lens_q=(1000, 2000), lens_k=None, hq=16, hkv=4, d=128, grad=False):
    lens_k = lens_k or lens_q
    q = torch.empty(sum(lens_q), hq, d, **META, requires_grad=grad)
    k = torch.empty(sum(lens_k), hkv, d, **META, requires_grad=grad)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="meta")
    cu_k = cu_q if lens_k is lens_q else torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()],
                                                      dtype=torch.int32, device="meta")
    return q, k, k, dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                         max_seqlen_k=max(lens_k))


def _cudnn_reasons(manager, device, *args, **kw):
    manager.ensure_initialized()
    impl = manager.registry.get("attention", "nvidia.cudnn").impl
    d = chosen(device, *args, **kw)
    return d, next(c for c in d.candidates if c.impl_id == "nvidia.cudnn"), impl


def test_cudnn_varlen_is_off_by_default(manager):
    q, k, v, kw = _thd()
    d, cudnn, _ = _cudnn_reasons(manager, "h100", q, k, v, causal=True, **kw)
    assert d.chosen_id == "nvidia.flash"
    assert any("rebuilds the cuDNN varlen graph on every call" in r for r in cudnn.reasons)


@pytest.fixture
def cudnn_varlen(manager, tmp_path, monkeypatch):
    """The opt-in, the way a user sets it: a policy layered over the default."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                      "      nvidia.cudnn: {varlen: true}\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    return manager


def test_cudnn_varlen_opt_in_takes_forward_gqa(manager, cudnn_varlen):
    q, k, v, kw = _thd()
    assert chosen("h100", q, k, v, causal=True, return_lse=True, **kw).chosen_id == "nvidia.cudnn"
    assert chosen("h200", q, k, v, **kw).chosen_id == "nvidia.cudnn"
    # per-sequence q/k lengths that differ: cuDNN's causal mask is top-left per sequence (measured)
    q2, k2, v2, kw2 = _thd(lens_q=(100, 300), lens_k=(400, 500))
    assert chosen("h100", q2, k2, v2, causal=True, **kw2).chosen_id == "nvidia.cudnn"
    d, cudnn, _ = _cudnn_reasons(manager, "h100", q2, k2, v2, causal=True, causal_alignment="bottom_right", **kw2)
    assert d.chosen_id == "nvidia.flash"  # torch's FA2: the H100 policy proof removed the short-varlen flagos rule
    assert any("top-left per sequence" in r for r in cudnn.reasons)


def test_cudnn_varlen_opt_in_limits(manager, cudnn_varlen):
    q, k, v, kw = _thd(grad=True)
    d, cudnn, _ = _cudnn_reasons(manager, "h100", q, k, v, causal=True, **kw)
    assert d.chosen_id == "nvidia.flash"
    assert any("forward only" in r for r in cudnn.reasons)
    q, k, v, kw = _thd()
    d, cudnn, _ = _cudnn_reasons(manager, "a100", q, k, v, causal=True, **kw)
    assert d.chosen_id == "nvidia.flash"
    assert any("needs sm90..sm103" in r for r in cudnn.reasons)
    d, cudnn, _ = _cudnn_reasons(manager, "h100", q, k, v, dropout_p=0.1, **kw)
    assert any("dropout not supported" in r for r in cudnn.reasons)


def test_cudnn_options_reject_unknown_keys(manager):
    manager.ensure_initialized()
    impl = manager.registry.get("attention", "nvidia.cudnn").impl
    with pytest.raises(ValueError):
        impl.with_options({"ragged": True})
    assert impl.with_options(None) is impl


def test_packed_lse_conversions():
    from opdispatch.vendors.nvidia._attention import _packed_lse

    lens = [3, 0, 5]
    q = torch.zeros(8, 2, 8)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    call = validate_attention(q, q, q, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    want = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    assert torch.equal(_packed_lse(want.t().unsqueeze(-1).contiguous(), call), want)  # cuDNN: (total, h, 1)
    assert torch.equal(_packed_lse(want.t().contiguous(), call), want)
    assert torch.equal(_packed_lse(want, call), want)
    padded = torch.full((3, 2, 5), float("nan"))
    start = 0
    for b, n in enumerate(lens):
        padded[b, :, :n] = want[:, start:start + n]
        start += n
    assert torch.equal(_packed_lse(padded, call), want)


def test_sliding_windows_go_where_the_h100_proof_measured_them(manager):
    """flex-for-d64-window-inference: bf16 windowed forwards at head dim 64 go to torch.flex (0.330 vs 0.513 ms for
    FA2 at 8k, policy-proof-h100-window); FA2 keeps head dim 128, fp16, training and decode-length queries."""
    q, k, v = qkv(b=1, sq=8192, hq=32, hkv=8, d=64)
    d = chosen("h100", q, k, v, causal=True, window=(1024, 0))
    assert d.chosen_id == "torch.flex" and d.decided_by.rule == "flex-for-d64-window-inference"
    assert chosen("h100", *(t.half() for t in (q, k, v)), causal=True, window=(1024, 0)).chosen_id == "nvidia.flash"
    q, k, v = qkv(b=1, sq=8192, hq=32, hkv=8, d=128)
    assert chosen("h100", q, k, v, causal=True, window=(1024, 0)).chosen_id == "nvidia.flash"
    q, k, v = qkv(b=1, sq=8192, hq=32, hkv=8, d=64, grad=True)
    assert chosen("h100", q, k, v, causal=True, window=(1024, 0)).chosen_id == "nvidia.flash"
    q, k, v = qkv(b=4, sq=16, sk=8192, hq=32, hkv=8, d=64)
    assert chosen("h100", q, k, v, causal=True, window=(1024, 0),
                  causal_alignment="bottom_right").chosen_id == "nvidia.flash"


def _fake_efficient_sdpa(calls):
    """torch's _scaled_dot_product_efficient_attention signature, computed in float64 by this test (no GQA: the
    kernel refuses unequal head counts; LSE padded to a multiple of 32 queries, as the kernel does)."""
    def fake(q, k, v, bias, need_lse, dropout_p, is_causal, scale=None):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the kernel has no GQA"
        assert bias is None and not is_causal and dropout_p == 0.0
        calls.append(tuple(q.shape))
        scores = (q.double() @ k.double().transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores, -1)
        out = (torch.softmax(scores, -1) @ v.double()).to(q.dtype)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"), dtype=torch.float32)
        padded[:, :, : lse.shape[2]] = lse
        return out, padded if need_lse else torch.empty(0), None, None
    return fake


@pytest.mark.parametrize("sq,hq,hkv,d,dv", [(1, 8, 2, 16, 16), (3, 6, 3, 8, 24), (1, 16, 1, 72, 64)])
def test_mem_efficient_folds_gqa_groups_into_queries(monkeypatch, rng, sq, hq, hkv, d, dv):
    from opdispatch.vendors.nvidia import _attention as nv

    calls = []
    monkeypatch.setattr(nv, "_efficient_sdpa", _fake_efficient_sdpa(calls))
    q = randn(2, sq, hq, d, gen=rng)
    k, v = randn(2, 11, hkv, d, gen=rng), randn(2, 11, hkv, dv, gen=rng)
    call = validate_attention(q, k, v, return_lse=True, causal=sq == 1, causal_alignment="bottom_right")
    out, lse = nv.MemEfficientAttention().run(call)
    assert calls == [(2, hkv, (hq // hkv) * sq, d)]  # one MHA call over kv heads, the group stacked as queries
    # Independent float64 oracle: every q head against its own kv head.
    kx = k.double().repeat_interleave(hq // hkv, 2)
    vx = v.double().repeat_interleave(hq // hkv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kx) * d ** -0.5
    torch.testing.assert_close(out.double(), torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vx),
                               atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


def test_mem_efficient_takes_mla_absorbed_decode_and_prefill(manager):
    mla = qkv(b=4, sq=1, sk=4096, hq=128, hkv=1, d=576, dv=512)
    assert chosen("h100", *mla, causal=True, causal_alignment="bottom_right").chosen_id == "nvidia.mem_efficient"
    prefill = chosen("h100", *qkv(b=1, sq=64, sk=4096, hq=128, hkv=1, d=576, dv=512), causal=True,
                     causal_alignment="bottom_right")
    assert prefill.chosen_id == "nvidia.mem_efficient"  # positional: k/v heads copied per query head


def test_mem_efficient_positional_gqa_and_the_cached_alibi_bias(monkeypatch, rng):
    from opdispatch.vendors.nvidia import _attention as nv
    from tests.test_numerics import naive_attention

    monkeypatch.setattr(nv, "_efficient_sdpa", _fake_efficient_with_bias)
    impl = nv.MemEfficientAttention()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    q = randn(2, 20, 4, 16, gen=rng, requires_grad=True)
    k, v = randn(2, 20, 2, 16, gen=rng, requires_grad=True), randn(2, 20, 2, 16, gen=rng, requires_grad=True)
    outs = []
    for _ in range(2):  # the second call reuses the prepared bias
        call = validate_attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
        outs.append(impl.run(call))
    assert len(impl._alibi._cache) == 1
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*(t.transpose(1, 2) for t in leaves), scale=0.25, causal=True, alibi=slopes)
    out, lse = outs[1]
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    got = torch.autograd.grad(out.double(), (q, k, v), g)
    want = torch.autograd.grad(ref.transpose(1, 2), leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    slopes.mul_(2)  # in place: a new version of the slopes is a new bias
    impl.run(validate_attention(q, k, v, causal=True, alibi_slopes=slopes))
    assert len(impl._alibi._cache) == 2


def _fake_efficient_with_bias(q, k, v, bias, need_lse, dropout_p, is_causal, scale=None):
    """The kernel's contract in float64: scores + the bias exactly as given (already rounded to q's dtype)."""
    scores = _scores(q, k, bias, is_causal, scale)
    lse = torch.logsumexp(scores, -1)
    padded = torch.zeros((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), dtype=torch.float32)
    padded[:, :, : lse.shape[2]] = lse
    return (torch.softmax(scores, -1) @ v.double()).to(q.dtype), padded, None, None


def test_mem_efficient_alibi_keeps_bf16_precision(monkeypatch, rng):
    from opdispatch.vendors.nvidia import _attention as nv
    from opdispatch.ops._attention import additive_bias
    from tests.test_numerics import naive_attention

    monkeypatch.setattr(nv, "_efficient_sdpa", _fake_efficient_with_bias)
    q, k, v = randn(2, 96, 4, 32, gen=rng), randn(2, 24, 4, 32, gen=rng), randn(2, 24, 4, 32, gen=rng)
    slopes = torch.tensor([0.9, 0.5, 0.25, 0.125])
    call = validate_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), alibi_slopes=slopes,
                              causal_alignment="bottom_right", return_lse=True)
    out, lse = nv.MemEfficientAttention().run(call)
    ref_out, ref_lse = naive_attention(*(call.bhsd(t).double() for t in (call.q, call.k, call.v)),
                                       scale=32 ** -0.5, alignment="bottom_right", alibi=slopes)
    err = (call.bhsd(out).double() - ref_out).abs().max().item()
    assert err < 0.02, err  # bf16 rounding of the output itself is ~0.008
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=0)
    # The same bias rounded to bf16 without the row shift loses the visible keys' differences.
    qb, kb, vb = (call.bhsd(t) for t in (call.q, call.k, call.v))
    bias, _, _ = additive_bias(call, qb, kb, fold_causal=False, fold_alibi=True)
    naive = _fake_efficient_with_bias(qb, kb, vb, bias, False, 0.0, False, scale=call.scale)[0]
    assert (naive.double() - ref_out).abs().max().item() > 0.1


def _fake_kernel(calls, *, same_v):
    """cuDNN's / FA2's aten ops as the adapters call them, in float64: head dims must be multiples of 8."""
    def attention(q, k, v, causal, scale):
        assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0, "the kernel needs head dims in multiples of 8"
        assert not same_v or v.shape[-1] == q.shape[-1]
        calls.append((q.shape[-1], v.shape[-1]))
        scores = (q.double() @ k.double().transpose(-1, -2)) * scale
        if causal:
            i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None]
            scores = scores.masked_fill(j > i, -math.inf)
        return (scores.softmax(-1) @ v.double()).to(q.dtype), scores.logsumexp(-1).float()

    def cudnn(q, k, v, bias, need_lse, dropout_p, is_causal, return_debug, scale=None):
        out, lse = attention(q, k, v, is_causal, scale)
        return out, lse, None, None

    def flash(q, k, v, dropout_p, is_causal, return_debug, scale=None):
        out, lse = attention(q, k, v, is_causal, scale)
        return out, lse, None, None
    return cudnn if not same_v else flash


@pytest.mark.parametrize("impl_name,attr,same_v", [("CudnnAttention", "_cudnn_sdpa", False),
                                                    ("TorchFlashAttention", "_flash_sdpa", True)])
@pytest.mark.parametrize("d,dv", [(100, 100), (20, 36), (4, 4), (130, 130)])
def test_head_dims_off_the_kernels_grid_are_padded_exactly(monkeypatch, rng, impl_name, attr, same_v, d, dv):
    from opdispatch.vendors.nvidia import _attention as nv
    from tests.test_numerics import naive_attention

    if same_v and d != dv:
        pytest.skip("FA2 takes one head dim for q/k and v")
    calls = []
    monkeypatch.setattr(nv, attr, _fake_kernel(calls, same_v=same_v))
    impl = getattr(nv, impl_name)()
    q = randn(2, 9, 4, d, gen=rng, requires_grad=True)
    k, v = randn(2, 9, 4, d, gen=rng, requires_grad=True), randn(2, 9, 4, dv, gen=rng, requires_grad=True)
    call = validate_attention(q, k, v, causal=True, return_lse=True)
    out, lse = impl.run(call)
    pad = -(-d // 8) * 8
    assert calls == [(max(pad, -(-dv // 8) * 8) if same_v else pad, -(-dv // 8) * 8 if not same_v else
                      max(pad, -(-dv // 8) * 8))]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_attention(*(t.transpose(1, 2) for t in leaves), scale=d ** -0.5, causal=True)
    assert out.shape == (2, 9, 4, dv)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out.double(), (q, k, v), g),
                    torch.autograd.grad(ref.transpose(1, 2), leaves, g)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    fn = impl.bind(validate_attention(q.detach(), k.detach(), v.detach(), causal=True))
    torch.testing.assert_close(fn(q.detach(), k.detach(), v.detach()).double(), ref.transpose(1, 2).detach(),
                               atol=1e-5, rtol=1e-5)


def test_head_dim_100_reaches_cudnn_not_a_fallback(manager):
    assert chosen("h100", *qkv(d=100), causal=True).chosen_id == "nvidia.cudnn"
    assert chosen("h100", *qkv(d=100, grad=True), causal=True).chosen_id == "nvidia.cudnn"


def test_deterministic_training_takes_torchs_fused_kernels_only_under_torchs_flag(manager):
    """torch's FA2 and memory-efficient backwards are deterministic only while torch's global flag is set: without
    it, deterministic=True training refuses both (saying to set it) and takes torch.flex; with it, FA2 takes it
    (the order's next after cuDNN, whose backward is never deterministic). A window with it too."""
    q, k, v = qkv(b=2, sq=2048, hq=16, hkv=16, grad=True)
    for kw in (dict(causal=True), dict(causal=True, window=(256, 0))):
        plain = chosen("h100", q, k, v, deterministic=True, **kw)
        assert plain.chosen_id == "torch.flex"
        for impl in ("nvidia.flash", "nvidia.mem_efficient"):
            assert "torch.use_deterministic_algorithms(True)" in "; ".join(plain.candidate(impl).reasons)
        assert plain.candidate("nvidia.cudnn").status == "rejected"
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            flagged = chosen("h100", q, k, v, **kw)
            assert flagged.chosen_id == "nvidia.flash"
            assert flagged.candidate("nvidia.mem_efficient").status == "eligible"
            assert flagged.candidate("nvidia.cudnn").status == "rejected"
        finally:
            torch.use_deterministic_algorithms(previous)
    # Inference needs no flag: FA2's forward is deterministic as it is (cuDNN's split-KV plans are not).
    inference = chosen("h100", q.detach(), k.detach(), v.detach(), causal=True, deterministic=True)
    assert inference.chosen_id == "nvidia.flash"
    assert inference.candidate("nvidia.cudnn").status == "rejected"


# -- backward() from the saved out and LSE (the compiled path), against fake aten backward ops ----------------

def _explicit_backward(grad_out, q, k, v, out, lse, *, causal, scale, bottom_right, window=None):
    """FlashAttention's backward written out over (b, h, s, d) float64 tensors, from the given LSE (not from
    autograd): P = exp(S - lse) with masked scores at -inf, dS = P * (dP - rowsum(dO * O))."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    offset = sk - sq if bottom_right else 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i + offset
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i + offset - left
        if right >= 0:
            keep &= j <= i + offset + right
    scores = (q @ kk.transpose(-1, -2) * scale).masked_fill(~keep, -math.inf)
    p = torch.exp(scores - lse[..., None])  # a blind row needs lse +inf here (the kernels' convention)
    d_v = p.transpose(-1, -2) @ grad_out
    d_s = p * (grad_out @ vv.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    d_q = d_s @ kk * scale
    d_k = d_s.transpose(-1, -2) @ q * scale
    b, hk = k.shape[:2]
    return d_q, d_k.view(b, hk, group, sk, -1).sum(2), d_v.view(b, hk, group, sk, -1).sum(2)


def _fake_sdpa_backward(seen, bottom_right, stats_4d=False):
    def fake(grad_out, q, k, v, out, lse, *args, scale):
        is_causal = next(a for a in args if isinstance(a, bool))
        seen.append(q.shape)
        if stats_4d:  # cuDNN: "The dim for input_names::Stats is invalid" unless (b, h, s, 1)
            assert lse.shape == (*q.shape[:3], 1), lse.shape
            lse = lse[..., 0]
        return _explicit_backward(grad_out, q, k, v, out, lse, causal=is_causal, scale=scale,
                                  bottom_right=bottom_right)
    return fake


def _fake_flash_backward(seen):
    def fake(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng, unused, *, scale,
             window_size_left=-1, window_size_right=-1):
        seen.append(q.shape)
        window = (window_size_left, window_size_right)
        if cu_q is None:  # dense bshd
            grads = _explicit_backward(grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), out.transpose(1, 2), lse, causal=causal, scale=scale,
                                       bottom_right=True, window=window)
            return tuple(g.transpose(1, 2) for g in grads)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for b in range(len(cu_q) - 1):
            sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            one = [t[None].transpose(1, 2) for t in (grad_out[sq], q[sq], k[sk], v[sk], out[sq])]
            part = _explicit_backward(*one[:4], one[4], lse[None, :, sq], causal=causal, scale=scale,
                                      bottom_right=True, window=window)
            for g, x, rows in zip(grads, part, (sq, sk, sk)):
                g[rows] = x[0].transpose(0, 1)
        return tuple(grads)
    return fake


def _oracle_forward_and_grads(q, k, v, grad_out, **kw):
    """(out, lse, (dq, dk, dv)) of the float64 oracle over bhsd tensors; autograd through the oracle."""
    from tests.test_numerics import naive_attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = naive_attention(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), lse, grads


@pytest.mark.parametrize("impl_name,kw", [
    ("cudnn", dict(causal=True, hkv=2, d=16)),
    ("cudnn", dict(causal=False, hkv=4, d=20, dv=12)),  # head dims padded to 24 / 16
    ("flash", dict(causal=True, hkv=2, d=16, sq=9, sk=5)),  # bottom-right: the first 4 queries see no key
    ("flash", dict(causal=False, hkv=1, d=12)),
    ("flash", dict(causal=True, hkv=2, d=16, window=(2, 0))),
], ids=["cudnn-causal-gqa", "cudnn-padded", "flash-blind-rows", "flash-padded-mqa", "flash-window"])
def test_nvidia_backward_from_saved_out_and_lse(monkeypatch, rng, impl_name, kw):
    import opdispatch.vendors.nvidia._attention as nv

    seen: list = []
    monkeypatch.setattr(nv, "_cudnn_sdpa_backward", _fake_sdpa_backward(seen, bottom_right=False, stats_4d=True))
    monkeypatch.setattr(nv, "_flash_sdpa_backward", _fake_sdpa_backward(seen, bottom_right=True))
    monkeypatch.setattr(nv, "_flash_backward", _fake_flash_backward(seen))
    b, hq, sq, sk = 2, 4, kw.get("sq", 6), kw.get("sk", kw.get("sq", 6))
    d, dv = kw["d"], kw.get("dv", kw["d"])
    q = torch.randn(b, sq, hq, d, generator=rng, dtype=torch.float64)
    k = torch.randn(b, sk, kw["hkv"], d, generator=rng, dtype=torch.float64)
    v = torch.randn(b, sk, kw["hkv"], dv, generator=rng, dtype=torch.float64)
    grad_out = torch.randn(b, sq, hq, dv, generator=rng, dtype=torch.float64)
    alignment = "bottom_right" if impl_name == "flash" else "top_left"
    call = validate_attention(q, k, v, causal=kw["causal"], causal_alignment=alignment, window=kw.get("window"),
                              return_lse=True)
    out, lse, want = _oracle_forward_and_grads(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), grad_out.transpose(1, 2), scale=d ** -0.5,
        causal=kw["causal"], alignment=call.causal_alignment, window=kw.get("window"))
    impl = {"cudnn": nv.CudnnAttention, "flash": nv.TorchFlashAttention}[impl_name]()
    assert impl.saves_for_backward
    grads = impl.backward(call, out.transpose(1, 2).contiguous(), lse, grad_out)
    assert len(seen) == 1  # the backward op, once; no forward
    for got, w, x in zip(grads, want, (q, k, v)):
        assert got.shape == x.shape
        torch.testing.assert_close(got, w.transpose(1, 2), atol=1e-10, rtol=1e-10)


def test_flash_varlen_backward_from_saved_out_and_lse(monkeypatch, rng):
    import opdispatch.vendors.nvidia._attention as nv

    seen: list = []
    monkeypatch.setattr(nv, "_flash_backward", _fake_flash_backward(seen))
    monkeypatch.setattr(nv, "_PACKED_VARLEN_LSE", True)
    lengths_q, lengths_k = [3, 5], [4, 7]
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 11], dtype=torch.int32)
    q = torch.randn(8, 4, 16, generator=rng, dtype=torch.float64)
    k, v = (torch.randn(11, 2, 16, generator=rng, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(8, 4, 16, generator=rng, dtype=torch.float64)
    call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                              max_seqlen_k=7, causal=True, causal_alignment="bottom_right", return_lse=True)
    outs, lses, want = [], [], [[], [], []]
    for b in range(2):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        out, lse, grads = _oracle_forward_and_grads(
            *(t[None].transpose(1, 2) for t in (q[rq], k[rk], v[rk], grad_out[rq])), scale=0.25, causal=True,
            alignment="bottom_right")
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
        for acc, g in zip(want, grads):
            acc.append(g[0].transpose(0, 1))
    grads = nv.TorchFlashAttention().backward(call, torch.cat(outs), torch.cat(lses, dim=1), grad_out)
    assert len(seen) == 1 and lengths_q and lengths_k
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, torch.cat(w), atol=1e-10, rtol=1e-10)


def test_nvidia_backward_declines_what_it_does_not_cover(rng):
    import opdispatch.vendors.nvidia._attention as nv

    q = torch.randn(1, 4, 2, 8, generator=rng)
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert nv.CudnnAttention().backward(validate_attention(q, q, q, attn_mask=mask, return_lse=True), q, q, q) is None
    assert nv.CudnnAttention().backward(validate_attention(q, q, q, window=(1, 0), causal=True, return_lse=True),
                                        q, q, q) is None
    assert nv.TorchFlashAttention().backward(validate_attention(q, q, q, dropout_p=0.1, return_lse=True),
                                             q, q, q) is None
    assert not nv.MemEfficientAttention().saves_for_backward


def test_alibi_routes_to_cudnn_forward_and_training(manager):
    # The H100 policy proof: cuDNN with the prepared bias beats torch.flex on ALiBi MHA and GQA, forward and
    # training (benchmarks/results/policy-proof-h100/policy_proof.md); the flex rules are gone.
    slopes = torch.empty(16, device="meta", dtype=torch.float32)
    for grad, hkv, want in ((False, 16, "nvidia.cudnn"), (True, 16, "nvidia.cudnn"), (False, 4, "nvidia.cudnn"),
                            (True, 4, "nvidia.cudnn")):
        q, k, v = qkv(sq=4096, hq=16, hkv=hkv, grad=grad)
        d = chosen("h100", q, k, v, causal=True, alibi_slopes=slopes)
        assert d.chosen_id == want, (grad, hkv, str(d))
    q, k, v = qkv(sq=1, sk=4096, hq=16, hkv=4)
    assert chosen("h100", q, k, v, alibi_slopes=slopes).chosen_id != "reference.math"


def _fake_dense_flash_forward(seen):
    """aten._flash_attention_forward on dense bshd tensors (cu_seqlens None), through the fakes' shared math
    (`tests.fakes._fa_math.attend`): causal and the window aligned bottom-right, as FlashAttention aligns them;
    returns (out, lse, ...)."""
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug, *, scale,
             window_size_left=-1, window_size_right=-1):
        assert cu_q is None and cu_k is None and dropout_p == 0.0 and not return_debug
        assert (max_q, max_k) == (q.shape[1], k.shape[1])
        seen.append((q.stride(-1), k.stride(-1), window_size_left, window_size_right, causal, scale))
        out, lse = fa_math.attend(q, k, v, scale, causal, (window_size_left, window_size_right), 0.0, None,
                                  k.shape[1] - q.shape[1], blind_lse=-math.inf)
        return out, lse, None, None, None, None, None, None, None
    return fake


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("kw", [dict(causal=True, window=(3, 0)), dict(window=(2, 1)),
                                dict(causal=True, window=(4, 0), scale=0.3)],
                         ids=["causal-left", "both-sides", "causal-scale"])
def test_flash_window_binds_size_generic_and_equals_run(monkeypatch, rng, layout, kw):
    """A dense windowed call binds _flash_attention_forward directly (no call record per call): one bound function
    serves new lengths both ways (queries that see no key included) and new batch sizes, bit for bit with run()
    and within float32 rounding of the float64 oracle; strided q/k/v too."""
    import opdispatch.vendors.nvidia._attention as nv
    from opdispatch.ops._attention import layout_views
    from tests.test_numerics import naive_attention

    seen = []
    monkeypatch.setattr(nv, "_flash_forward", _fake_dense_flash_forward(seen))
    impl = nv.TorchFlashAttention()
    to_bhsd, from_bhsd = layout_views(layout)

    def make(b, sq, sk, hq=4, hkv=2, d=16, strided=False):
        def one(s, h):
            t = torch.randn(b, h, s, 2 * d if strided else d, generator=rng)
            return from_bhsd(t[..., :d] if strided else t)
        return one(sq, hq), one(sk, hkv), one(sk, hkv)

    bound = impl.bind(validate_attention(*make(2, 7, 11), layout=layout, **kw))
    assert getattr(bound, "size_generic", False), "the windowed bind reads sizes from its tensors"
    for b, sq, sk, strided in [(2, 7, 11, False), (1, 12, 5, False), (3, 1, 9, True), (2, 9, 9, True)]:
        q, k, v = make(b, sq, sk, strided=strided)
        call = validate_attention(q, k, v, layout=layout, **kw)
        got = bound(q, k, v)
        assert torch.equal(got, impl.run(call)), f"b{b} sq{sq} sk{sk}: bound differs from run()"
        want, _ = naive_attention(*(to_bhsd(t) for t in (q, k, v)), scale=call.scale, causal=kw.get("causal", False),
                                  alignment="bottom_right", window=call.window)
        torch.testing.assert_close(to_bhsd(got).double(), want, atol=1e-5, rtol=1e-5)
    window = kw["window"]
    assert {(s[2], s[3]) for s in seen} == {window} and {s[5] for s in seen} == {kw.get("scale", 16 ** -0.5)}
