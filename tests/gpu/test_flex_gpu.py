"""`torch.flex` on CUDA: the compiled flex kernel against a float64 oracle (tests/test_vendor_torch_flex.py's, run on
the CPU), forward with LSE and backward, bf16 and fp16; paged KV caches (gathered pages, forward and backward into the
pools, equal to the dense cache the pages hold); bitwise repeats for the determinism it declares; that a
long call stays fused (no score matrix in memory); and that the dispatcher picks it for softcap training.

Skipped without CUDA. Run: pytest -q -rxXs tests/gpu/test_flex_gpu.py
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import opdispatch
from opdispatch import validate_attention
from opdispatch.vendors.torch_flex import TorchFlexAttention
from tests.test_vendor_torch_flex import kv_oracle, oracle, paged_cache, varlen_oracle

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning")]

# ‖out − ref‖ / ‖ref‖ (forward, gradients) per dtype; LSE: max |Δ| over rows that see a key.
TOL = {torch.bfloat16: (2.5e-2, 5e-2), torch.float16: (5e-3, 1.5e-2)}
LSE_ATOL = 2e-2


def _case(name, b=2, sq=256, sk=256, hq=8, hkv=2, d=128, dv=None, layout="bshd", **kw):
    return dict(name=name, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv or d, layout=layout, kw=kw)


CASES = [
    _case("causal", causal=True),
    _case("causal_mha_bhsd", hq=4, hkv=4, layout="bhsd", causal=True),
    _case("bottom_right_sq<sk", sq=100, sk=333, causal=True, causal_alignment="bottom_right"),
    _case("bottom_right_sq>sk_blind_rows", sq=300, sk=120, causal=True, causal_alignment="bottom_right"),
    _case("top_left_sq<sk_sbhd", sq=77, sk=300, layout="sbhd", causal=True),
    _case("window_causal", sq=512, sk=512, causal=True, window=(64, 0)),
    _case("window_both_sides", sq=300, sk=300, window=(32, 16)),
    _case("window_bottom_right_softcap", sq=200, sk=450, causal=True, window=(50, 0),
          causal_alignment="bottom_right", softcap=30.0),
    _case("softcap_gqa4", causal=True, softcap=30.0),
    _case("alibi_mha", hq=8, hkv=8, causal=True, alibi="h"),
    _case("alibi_gqa4_per_batch", causal=True, alibi="bh"),
    _case("alibi_gqa_noncausal_sq<sk", sq=64, sk=200, alibi="h"),
    _case("decode_gqa4", b=4, sq=1, sk=700, hq=16, hkv=4, causal=True, causal_alignment="bottom_right"),
    _case("decode_gqa3_softcap", b=3, sq=1, sk=513, hq=12, hkv=4, causal=True, causal_alignment="bottom_right",
          softcap=30.0),
    _case("d72", d=72, causal=True),
    _case("d96_alibi", d=96, causal=True, alibi="h"),
    _case("d100_softcap", d=100, softcap=20.0),
    _case("dv_differs_192_128", d=192, dv=128, causal=True),
    _case("attn_mask_gqa", mask=True, causal=True),
    _case("attn_bias", bias=True),
    _case("varlen_causal", layout="thd", lens_q=[37, 300, 5, 129], hq=8, hkv=2, causal=True),
    _case("varlen_bottom_right_window_alibi", layout="thd", lens_q=[20, 64, 1, 33], lens_k=[50, 64, 17, 99],
          causal=True, causal_alignment="bottom_right", window=(24, 0), alibi="bh"),
    _case("varlen_softcap_d72", layout="thd", lens_q=[70, 128, 9], d=72, causal=True, softcap=30.0),
]
MLA = _case("mla_absorbed_decode_576_512", b=2, sq=1, sk=1024, hq=16, hkv=1, d=576, dv=512, causal=True,
            causal_alignment="bottom_right")
MLA_PREFILL = _case("mla_576_512_sq64", b=1, sq=64, sk=1024, hq=16, hkv=1, d=576, dv=512, causal=True,
                    causal_alignment="bottom_right")


def _make(case, dtype, gen):
    kw = dict(case["kw"])
    b, sq, sk, hq, hkv, d, dv, layout = (case[k] for k in ("b", "sq", "sk", "hq", "hkv", "d", "dv", "layout"))
    extra = {}

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    if layout == "thd":
        lens_q = kw.pop("lens_q")
        lens_k = kw.pop("lens_k", None)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = cu_q if lens_k is None else torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()],
                                                        dtype=torch.int32, device="cuda")
        q, k, v = rnd(int(cu_q[-1]), hq, d), rnd(int(cu_k[-1]), hkv, d), rnd(int(cu_k[-1]), hkv, dv)
        extra.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        b = len(lens_q)
    else:
        shape = {"bshd": lambda s, h, x: (b, s, h, x), "bhsd": lambda s, h, x: (b, h, s, x),
                 "sbhd": lambda s, h, x: (s, b, h, x)}[layout]
        q, k, v = rnd(*shape(sq, hq, d)), rnd(*shape(sk, hkv, d)), rnd(*shape(sk, hkv, dv))
    alibi = kw.pop("alibi", None)
    if alibi:
        shape = (hq,) if alibi == "h" else (b, hq)
        extra["alibi_slopes"] = torch.rand(*shape, generator=gen, device="cuda") * 0.3 + 0.01
    if kw.pop("mask", False):
        m = torch.rand(b, 1, sq, sk, generator=gen, device="cuda") > 0.3
        m[..., 0] = True
        extra["attn_mask"] = m
    if kw.pop("bias", False):
        extra["attn_bias"] = (torch.randn(1, hq, sq, sk, generator=gen, device="cuda") * 0.5).to(dtype)
    return q, k, v, {**kw, **extra}


def _to_bhsd(t, layout):
    return {"bshd": lambda x: x.transpose(1, 2), "bhsd": lambda x: x, "sbhd": lambda x: x.permute(1, 2, 0, 3)}[layout](t)


def _from_bhsd(t, layout):
    return {"bshd": lambda x: x.transpose(1, 2), "bhsd": lambda x: x, "sbhd": lambda x: x.permute(2, 0, 1, 3)}[layout](t)


def _reference(case, call, q, k, v, kw):
    """float64 on the CPU: (out in the call's layout, lse)."""
    q, k, v = (t.detach().cpu().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    common = dict(scale=call.scale, causal=call.causal, alignment=call.causal_alignment, window=call.window,
                  softcap=call.softcap)
    slopes = kw.get("alibi_slopes")
    slopes = None if slopes is None else slopes.cpu()
    if case["layout"] == "thd":
        out, lse = varlen_oracle(q, k, v, kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), slopes=slopes,
                                 **common)
        return (q, k, v), out, lse
    mask = kw.get("attn_mask")
    bias = kw.get("attn_bias")
    out, lse = oracle(*(_to_bhsd(t, case["layout"]) for t in (q, k, v)), slopes=slopes,
                      mask=None if mask is None else mask.cpu(), bias=None if bias is None else bias.cpu().double(),
                      **common)
    return (q, k, v), _from_bhsd(out, case["layout"]), lse


def _rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _impl(**options):
    return TorchFlexAttention().with_options(options or None)


def _check(case, dtype, impl, *, require_declared=True):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case['name']}/{dtype}".encode()))
    q, k, v, kw = _make(case, dtype, gen)
    device = opdispatch.get_manager().device_info(torch.device("cuda"))
    tol_out, tol_grad = TOL[dtype]
    # forward with LSE
    call = validate_attention(q, k, v, layout=case["layout"], return_lse=True, **kw)
    if require_declared:
        assert impl.not_supported_reasons(call, device) == [], "torch.flex declines a case this test expects"
    out, lse = impl.run(call)
    _, ref_out, ref_lse = _reference(case, call, q, k, v, kw)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    err = _rel(out, ref_out)
    assert err <= tol_out, f"forward rel err {err:.3g} > {tol_out}"
    seen = torch.isfinite(ref_lse)
    lse_cpu = lse.cpu().double()
    lse_err = (lse_cpu[seen] - ref_lse[seen]).abs().max().item()
    assert lse_err <= LSE_ATOL, f"lse max err {lse_err:.3g} (natural log expected)"
    blind = ~seen
    if blind.any():
        assert torch.all(lse_cpu[blind] == -math.inf), "queries that see no key need lse -inf"
        # out as (batch, heads, seq, dv) — or (heads, total, dv) for thd — to index it with the lse's shape
        out_by_row = out.transpose(0, 1) if case["layout"] == "thd" else _to_bhsd(out, case["layout"])
        assert torch.all(out_by_row.cpu()[blind] == 0), "queries that see no key need zero output"
    # backward
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    call = validate_attention(qg, kg, vg, layout=case["layout"], **kw)
    if require_declared:
        assert impl.not_supported_reasons(call, device) == []
    out = impl.run(call)
    grad_out = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    grads = torch.autograd.grad(out, (qg, kg, vg), grad_out)
    leaves, ref_out, _ = _reference(case, call, qg, kg, vg, kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad_out.cpu().double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        e = _rel(g, r)
        assert e <= tol_grad, f"{name} rel err {e:.3g} > {tol_grad}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_flex_matches_float64_oracle(case, dtype):
    _check(case, dtype, _impl())


@pytest.mark.parametrize("case", [MLA, MLA_PREFILL], ids=[MLA["name"], MLA_PREFILL["name"]])
def test_mla_576_512_one_kv_head(case):
    """Above the default max_head_dim (256): tells whether the option can be raised for MLA on this GPU.
    XFAIL with the kernel's error if flex cannot compile or launch it (shared memory)."""
    impl = _impl(max_head_dim=576)
    try:
        _check(case, torch.bfloat16, impl)
    except AssertionError:
        raise
    except Exception as exc:  # triton OutOfResources, inductor lowering errors
        pytest.xfail(f"flex could not run {case['name']}: {type(exc).__name__}: {str(exc)[:300]}")


DETERMINISM_CASES = [c for c in CASES if c["name"] in (
    "causal", "bottom_right_sq>sk_blind_rows", "alibi_gqa4_per_batch", "decode_gqa4", "decode_gqa3_softcap",
    "window_bottom_right_softcap", "varlen_causal", "varlen_bottom_right_window_alibi")]


@pytest.mark.parametrize("case", DETERMINISM_CASES, ids=[c["name"] for c in DETERMINISM_CASES])
def test_forward_and_backward_are_bitwise_repeatable(case):
    impl = _impl()
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, kw = _make(case, torch.bfloat16, gen)
    grad_out = None
    runs = []
    for _ in range(3):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        call = validate_attention(qg, kg, vg, layout=case["layout"], deterministic=True, **kw)
        device = opdispatch.get_manager().device_info(torch.device("cuda"))
        assert impl.not_supported_reasons(call, device) == []
        out = impl.run(call)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
        runs.append((out.detach(), *torch.autograd.grad(out, (qg, kg, vg), grad_out)))
    for other in runs[1:]:
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between identical runs"


def test_long_call_stays_fused():
    """16k softcap causal: the scores alone would be 8 heads x 16k x 16k fp32 = 8.6 GB; the fused kernel needs
    the inputs and outputs only. A fall back to flex's unfused path would blow this bound."""
    impl = _impl()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 16384, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = validate_attention(q, k, v, causal=True, softcap=30.0)
    torch._dynamo.reset()  # the graphs of earlier tests in this process count toward dynamo's recompile limit
    impl.run(call)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    impl.run(call)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 512 * 2**20, f"peak extra memory {extra / 2**20:.0f} MiB: not fused?"


def test_dispatch_picks_flex_for_softcap_and_cudnn_for_alibi_training():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 1024, 16, 128, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    assert opdispatch.explain(q, k, v, causal=True, softcap=30.0).chosen_id == "torch.flex"
    kv = torch.randn(2, 1024, 4, 128, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    slopes = torch.rand(16, device="cuda")
    # ALiBi goes to cuDNN with a prepared bias by the order (the H100 policy proof: faster than flex forward and
    # training, MHA and GQA), and without cuDNN to flex.
    gqa = opdispatch.explain(q, kv, kv, causal=True, alibi_slopes=slopes)
    assert gqa.chosen_id == "nvidia.cudnn" and gqa.decided_by.rule is None
    with opdispatch.policy_override(deny=["nvidia.cudnn"]):
        assert opdispatch.explain(q, kv, kv, causal=True, alibi_slopes=slopes).chosen_id == "torch.flex"
    out = opdispatch.attention(q, k, v, causal=True, softcap=30.0)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("seqlen_q", [1, 64], ids=["decode", "chunked_prefill"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_cache_compiled_forward_and_backward(page_size, seqlen_q):
    """The compiled kernel over a paged cache (its pages gathered, a block mask of each sequence's fill): GQA 4,
    a window, an empty cache and a prefix page shared by two sequences; forward and LSE against the float64
    oracle, the same numbers as over the dense cache the pages hold, and gradients into q and the page pools."""
    dtype, hq, hkv, d = torch.bfloat16, 16, 4, 128
    gen = torch.Generator().manual_seed(1000 * page_size + seqlen_q)
    used = [700, 333, 0, 65]
    pools_and_dense = paged_cache(used, page_size, hkv, (d, d), gen, shared_pages=max(1, 32 // page_size))
    k_pool, v_pool, k_dense, v_dense = (t.to("cuda", dtype) for t in (pools_and_dense[i] for i in (0, 1, 3, 4)))
    table, seqused = pools_and_dense[2].cuda(), torch.tensor(used, dtype=torch.int32, device="cuda")
    q = torch.randn(len(used), seqlen_q, hq, d, generator=gen).to("cuda", dtype)
    kw = dict(causal=True, causal_alignment="bottom_right", window=(256, 0))
    impl = _impl()
    device = opdispatch.get_manager().device_info(torch.device("cuda"))
    call = validate_attention(q, k_pool, v_pool, seqused_k=seqused, block_table=table, return_lse=True, **kw)
    assert impl.not_supported_reasons(call, device) == []
    out, lse = impl.run(call)
    ref_out, ref_lse = kv_oracle(*(t.cpu().double().transpose(1, 2) for t in (q, k_dense, v_dense)), seqused.cpu(),
                                 scale=call.scale, causal=True, alignment="bottom_right", window=(256, 0))
    err = _rel(out.transpose(1, 2), ref_out)
    assert err <= TOL[dtype][0], f"forward rel err {err:.3g}"
    seen = torch.isfinite(ref_lse)
    assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max().item() <= LSE_ATOL
    assert torch.all(lse.cpu()[~seen] == -math.inf) and torch.all(out[2] == 0)
    dense_out, dense_lse = impl.run(validate_attention(q, k_dense, v_dense, seqused_k=seqused, return_lse=True, **kw))
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)
    # backward: through the gather into the pools
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k_pool, v_pool))
    grad_out = torch.randn(out.shape, generator=gen).to("cuda", dtype)
    got = torch.autograd.grad(impl.run(validate_attention(qg, kg, vg, seqused_k=seqused, block_table=table, **kw)),
                              (qg, kg, vg), grad_out)
    leaves = tuple(t.detach().cpu().double().requires_grad_() for t in (q, k_pool, v_pool))
    rows = table.cpu().clamp(0, k_pool.shape[0] - 1).long()
    kd, vd = (t[rows].reshape(len(used), -1, hkv, d).transpose(1, 2) for t in leaves[1:])
    ref, _ = kv_oracle(leaves[0].transpose(1, 2), kd, vd, seqused.cpu(), scale=call.scale, causal=True,
                       alignment="bottom_right", window=(256, 0))
    want = torch.autograd.grad(ref.transpose(1, 2), leaves, grad_out.cpu().double())
    for name, g, w in zip(("dq", "dk_pool", "dv_pool"), got, want):
        e = _rel(g, w)
        assert e <= TOL[dtype][1], f"{name} rel err {e:.3g}"
