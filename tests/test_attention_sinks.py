"""Attention sinks (`sinks=`): the shared epilogue over every CPU implementation, forward and backward.

The oracle is independent of the code under test: per sequence, float64 scores with the call's pattern masked
to -inf, one more column holding the head's sink, a softmax over both, the out from the real keys' columns and
the LSE over all of them — differentiated by autograd in float64.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import opdispatch
from tests.conftest import TOLERANCES

IMPLS = ("reference.math", "cpu.flash")
TOLERANCE = TOLERANCES  # the suite's one elementwise table


def oracle(q, k, v, sinks, *, scale, causal=False, window=None, alignment="top_left", used=None):
    """q (b, sq, hq, d), k/v (b, sk, hkv, d[v]) → out (b, sq, hq, dv), lse (b, hq, sq), float64; `used[b]` keys
    of sequence b (a KV cache's fill; alignment counted from there)."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    b, sq, hq, _ = q.shape
    group = hq // k.shape[2]
    outs, lses = [], []
    for i in range(b):
        n = k.shape[1] if used is None else used[i]
        qb = q[i].transpose(0, 1)  # (hq, sq, d)
        kb = k[i, :n].transpose(0, 1).repeat_interleave(group, 0)
        vb = v[i, :n].transpose(0, 1).repeat_interleave(group, 0)
        scores = qb @ kb.transpose(1, 2) * scale  # (hq, sq, n)
        offset = n - sq if alignment == "bottom_right" else 0
        rel = torch.arange(n)[None, :] - torch.arange(sq)[:, None] - offset
        allowed = torch.ones(sq, n, dtype=torch.bool)
        if causal:
            allowed &= rel <= 0
        if window is not None:
            if window[0] >= 0:
                allowed &= rel >= -window[0]
            if window[1] >= 0:
                allowed &= rel <= window[1]
        scores = scores.masked_fill(~allowed, -math.inf)
        full = torch.cat([scores, sinks.view(hq, 1, 1).expand(hq, sq, 1)], dim=-1)
        p = torch.softmax(full, dim=-1)
        outs.append((p[..., :n] @ vb).transpose(0, 1))
        lses.append(torch.logsumexp(full, dim=-1))
    return torch.stack(outs), torch.stack(lses)


def to_layout(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout].contiguous()


def from_layout(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout]


def leaves(*tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def check_against_oracle(impl, layout, dtype, *, heads=(4, 2), sq=5, sk=7, causal=False, window=None,
                         alignment="top_left", used=None, backward=True, seed=0, sink_scale=1.0,
                         return_lse=True, twice=False):
    gen = torch.Generator().manual_seed(seed)
    b, (hq, hkv), d = 2, heads, 8
    q0 = torch.randn(b, sq, hq, d, generator=gen, dtype=torch.float64)
    k0 = torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64)
    v0 = torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64)
    s0 = torch.randn(hq, generator=gen, dtype=torch.float64) * sink_scale
    scale = 0.4
    kwargs = dict(scale=scale, causal=causal, window=window, causal_alignment=alignment)
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    decision = opdispatch.explain(to_layout(q0, layout).to(dtype), to_layout(k0, layout).to(dtype),
                                  to_layout(v0, layout).to(dtype), layout=layout, seqused_k=seqused,
                                  sinks=s0.float(), **kwargs)
    mine = [c for c in decision.candidates if c.impl_id == impl][0]
    assert not any("sink" in r for r in mine.reasons), mine.reasons
    if mine.reasons:
        pytest.skip(f"{impl} does not take this call: {mine.reasons}")

    q, k, v = leaves(*(to_layout(t, layout) for t in (q0, k0, v0)), dtype=dtype)
    sinks = s0.float().detach().requires_grad_()
    result = opdispatch.attention(q, k, v, layout=layout, sinks=sinks, return_lse=return_lse, impl=impl,
                                  seqused_k=seqused, **kwargs)
    out, lse = result if return_lse else (result, None)
    qr, kr, vr, sr = leaves(q0, k0, v0, s0, dtype=torch.float64)
    want_out, want_lse = oracle(qr, kr, vr, sr, scale=scale, causal=causal, window=window, alignment=alignment,
                                used=used)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(from_layout(out, layout).double(), want_out, **tol)
    if return_lse:
        torch.testing.assert_close(lse.double(), want_lse, **tol)
    if not backward:
        return out
    gen_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    gen_lse = torch.randn(want_lse.shape, generator=gen, dtype=torch.float64) if return_lse else 0 * want_lse
    got_loss = (from_layout(out, layout).double() * gen_out).sum() + (
        (lse.double() * gen_lse).sum() if return_lse else 0)
    got_loss.backward(retain_graph=twice)
    if twice:  # a second backward over the same graph gives the same gradients again: accumulated, doubled
        got_loss.backward()
        for t in (q, k, v, sinks):
            t.grad /= 2
    ((want_out * gen_out).sum() + (want_lse * gen_lse).sum()).backward()
    grad_tol = TOLERANCE[dtype] if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    for got, want in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(from_layout(got.grad, layout).double(), want.grad, **grad_tol)
    torch.testing.assert_close(sinks.grad.double(), sr.grad, **grad_tol)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,heads,pattern", list(itertools.product(
    ("bshd", "bhsd", "sbhd"), ((4, 4), (4, 2), (4, 1)),
    ("none", "causal", "window", "causal_bottom_right"))))
def test_sinks_match_the_oracle_forward_and_backward(basic_manager, impl, layout, heads, pattern):
    options = {"none": {}, "causal": dict(causal=True), "window": dict(window=(2, 1)),
               "causal_bottom_right": dict(causal=True, window=(3, 0), alignment="bottom_right")}[pattern]
    check_against_oracle(impl, layout, torch.float32, heads=heads, **options)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout,heads,pattern,dtype", [
    (layout, heads, pattern, dtype) for layout, heads, pattern, dtype in itertools.product(
        ("bshd", "bhsd", "sbhd"), ((4, 4), (4, 2), (4, 1)), ("none", "causal", "window", "blind"),
        (torch.float32, torch.bfloat16)) if dtype == torch.float32 or (layout == "bshd" and heads == (4, 2))])
def test_sinks_output_only_gradients_from_the_kernels_saved_results(basic_manager, impl, layout, heads, pattern,
                                                                   dtype):
    """GPT-OSS's call (the output only, no LSE): an implementation with a backward of its own (cpu.flash) is
    differentiated from its saved (out, LSE) with the sink folded in — no autograd over the epilogue, no extra
    attention pass for the LSE's gradient — and gives the oracle's gradients, a second backward (retain_graph)
    included; calls its backward does not cover (windows here) recompute, as exactly."""
    options = {"none": {}, "causal": dict(causal=True), "window": dict(window=(2, 1)),
               "blind": dict(causal=True, alignment="bottom_right", sq=7, sk=4)}[pattern]  # 3 rows see no key
    out = check_against_oracle(impl, layout, dtype, heads=heads, return_lse=False, twice=True, **options)
    from_saved = impl == "cpu.flash"
    assert (type(out.grad_fn).__name__ == "_SinksFromSavedBackward") == from_saved, out.grad_fn


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ("bshd", "sbhd"))
def test_sinks_in_bf16(basic_manager, impl, layout):
    check_against_oracle(impl, layout, torch.bfloat16, causal=True, sq=6, sk=6)


@pytest.mark.parametrize("impl", IMPLS)
def test_blind_rows_give_zeros_and_the_sink_as_lse(basic_manager, impl):
    # bottom-right causal with more queries than keys: the first two queries see no key.
    check_against_oracle(impl, "bshd", torch.float32, sq=6, sk=4, causal=True, alignment="bottom_right")
    q = torch.randn(1, 6, 2, 8)
    k = v = torch.randn(1, 4, 2, 8)
    sinks = torch.tensor([0.5, -2.0])
    out, lse = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", sinks=sinks,
                                    return_lse=True, impl=impl)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    torch.testing.assert_close(lse[:, :, :2], sinks.view(1, 2, 1).expand(1, 2, 2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ("bshd", "bhsd"))
def test_sinks_over_a_kv_cache_with_a_sliding_window(basic_manager, impl, layout):
    # GPT-OSS's combination: sinks, a sliding window, GQA and a cache filled to different lengths (one empty).
    for used in ([7, 3], [0, 5], [2, 7]):
        check_against_oracle(impl, layout, torch.float32, heads=(4, 2), sq=2, sk=7, causal=True, window=(3, 0),
                             alignment="bottom_right", used=used, sink_scale=3.0)


@pytest.mark.parametrize("impl", ["reference.math"])  # cpu.flash takes no thd
def test_packed_varlen_sinks(basic_manager, impl):
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 5]
    q = torch.randn(8, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(8, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(8, 2, 8, generator=gen, requires_grad=True)
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, lse = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                    sinks=sinks, return_lse=True, impl=impl)
    (out.sum() + lse.sum()).backward()
    qr, kr, vr, sr = leaves(q, k, v, sinks, dtype=torch.float64)
    outs, lses, start = [], [], 0
    for n in lengths:
        o, l_ = oracle(qr[None, start:start + n], kr[None, start:start + n], vr[None, start:start + n], sr,
                       scale=1 / math.sqrt(8), causal=True)
        outs.append(o[0])
        lses.append(l_[0])
        start += n
    want_out, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    torch.testing.assert_close(out.double(), want_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(lse.double(), want_lse, **TOLERANCE[torch.float32])
    (want_out.sum() + want_lse.sum()).backward()
    for got, want in ((q, qr), (k, kr), (v, vr), (sinks, sr)):
        torch.testing.assert_close(got.grad.double(), want.grad, **TOLERANCE[torch.float32])


def test_without_return_lse_and_sinks_only_requiring_grad(basic_manager):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 2, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen, requires_grad=True)
    for impl in IMPLS:
        out = opdispatch.attention(q, k, v, causal=True, sinks=sinks, impl=impl)
        want, _ = oracle(q, k, v, sinks.detach(), scale=1 / math.sqrt(8), causal=True)
        torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
        (grad,) = torch.autograd.grad(out.sum(), sinks)
        sr = sinks.detach().double().requires_grad_()
        want, _ = oracle(q, k, v, sr, scale=1 / math.sqrt(8), causal=True)
        (want_grad,) = torch.autograd.grad(want.sum(), sr)
        torch.testing.assert_close(grad.double(), want_grad, **TOLERANCE[torch.float32])


def test_sinks_are_validated_with_clear_errors(basic_manager):
    q = k = v = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\); allowed: \(4,\)"):
        opdispatch.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be float32"):
        opdispatch.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        opdispatch.attention(q, k, v, sinks=[0.0] * 4)


def test_capability_reasons_name_sinks(basic_manager):
    from opdispatch.ops._attention import AttentionCaps, capability_reasons

    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    sinks = torch.zeros(2)
    base = dict(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd"}), softcap=True, backward=True)
    softcapped = opdispatch.validate_attention(q, q, q, softcap=5.0, sinks=sinks)
    assert capability_reasons(AttentionCaps(**base), softcapped) == [
        "attention sinks need the implementation's LSE (caps.lse) for the shared sink epilogue"]
    # An LSE without its own gradient: the epilogue's correction covers scores linear in q.k, not softcap.
    assert capability_reasons(AttentionCaps(**base, lse=True), softcapped) == [
        "attention sinks with softcap and autograd need a differentiable LSE (caps.lse_grad)"]
    assert capability_reasons(AttentionCaps(**base, lse=True, lse_grad=True), softcapped) == []
    with torch.no_grad():  # no backward: any LSE will do
        assert capability_reasons(AttentionCaps(**base, lse=True),
                                  opdispatch.validate_attention(q, q, q, softcap=5.0, sinks=sinks)) == []
    assert opdispatch.explain(q, q, q, softcap=5.0, sinks=sinks).chosen_id == "reference.math"
    flash = [c for c in opdispatch.explain(q, q, q, sinks=sinks, causal=True).candidates
             if c.impl_id == "cpu.flash"][0]
    assert flash.reasons == []
    assert "sinks" in opdispatch.explain(q, q, q, sinks=sinks).call


def test_fast_path_plan_and_compiled_door_agree_with_the_slow_path(basic_manager):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen)
    first = opdispatch.attention(q, k, v, causal=True)  # a fast-path entry for the call without sinks
    with_sinks = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    assert not torch.allclose(first, with_sinks)  # the entry without sinks is never hit by a call with them
    again = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(with_sinks, again)
    assert torch.equal(opdispatch.attention(q, k, v, causal=True), first)
    planned = opdispatch.plan(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(planned(q, k, v), with_sinks)
    want, _ = oracle(q, k, v, sinks, scale=1 / math.sqrt(8), causal=True)
    torch.testing.assert_close(with_sinks.double(), want, **TOLERANCE[torch.float32])


def test_policy_rule_on_sinks_routes_the_call(basic_manager):
    from opdispatch.policies import parse_policy

    q = torch.randn(1, 3, 2, 8)
    sinks = torch.zeros(2)
    basic_manager.set_policy(parse_policy(
        "ops:\n  attention:\n    order: [cpu.flash, reference.math]\n    rules:\n      - name: sinks-on-reference\n"
        "        when: {sinks: true}\n        prefer: [reference.math]\n", "<test>"))
    assert opdispatch.explain(q, q, q, sinks=sinks).chosen_id == "reference.math"
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"
    out = opdispatch.attention(q, q, q, sinks=sinks)
    want, _ = oracle(q, q, q, sinks, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph_matches_eager(basic_manager, impl):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    q0, k0, v0 = (torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3))
    s0 = torch.randn(2, generator=gen)

    def f(q, k, v, sinks):
        out, lse = opdispatch.attention(q, k, v, causal=True, window=(3, 0), sinks=sinks, return_lse=True,
                                        impl=impl)
        return out.sum() * 0.5 + (out * out).sum() + lse.sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        tensors = [t.clone().requires_grad_() for t in (q0, k0, v0, s0)]
        value = fn(*tensors)
        value.backward()
        grads.append((value.detach(), [t.grad for t in tensors]))
    (eager, eager_grads), (compiled, compiled_grads) = grads
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_a_kv_cache_plan_with_sinks_takes_each_steps_lengths():
    """A plan is called as fn(q, k, v, seqused_k, block_table): with sinks it took three tensors only (a TypeError
    with the cache's lengths, or the first call's lengths reused silently)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    cache = torch.randn(2, 32, 4, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)
    first, later = torch.tensor([5, 9], dtype=torch.int32), torch.tensor([17, 3], dtype=torch.int32)
    run = opdispatch.plan(q, cache, cache, seqused_k=first, sinks=sinks)
    for lengths in (first, later):
        got = run(q, cache, cache, lengths, None)
        want = opdispatch.attention(q, cache, cache, seqused_k=lengths, sinks=sinks)
        torch.testing.assert_close(got, want)
    assert not torch.allclose(run(q, cache, cache, first, None), run(q, cache, cache, later, None))


def test_a_kernel_that_raises_fails_over_with_sinks_too(manager, monkeypatch):
    """A call with sinks runs its implementation pinned (the inner call must not be decided again without its
    sinks): a kernel that raised there never fell back although fallback_on_error is on."""
    from opdispatch.vendors.cpu._attention import CpuFlashAttention

    def broken(self, call):
        raise RuntimeError("injected kernel fault")

    monkeypatch.setattr(CpuFlashAttention, "run", broken)
    monkeypatch.setattr(CpuFlashAttention, "bind", lambda self, call: (lambda *t: broken(self, call)))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen)
    got = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    want = opdispatch.attention(q, k, v, causal=True, sinks=sinks, impl="reference.math")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("grad", [False, True])
def test_sinks_calls_take_the_fast_path_with_their_values_per_call(basic_manager, grad, monkeypatch):
    """Sinks are keyed by shape, dtype and device: a decode or training loop validates its signature once, and
    each later call's sinks (a trained parameter whose values change) reach the result and get their gradient."""
    from opdispatch.doors import _api

    validations = []
    validate = _api.validate_attention
    monkeypatch.setattr(_api, "validate_attention", lambda *a, **kw: validations.append(1) or validate(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    for step in range(4):
        q0, k0, v0 = (torch.randn(2, 5, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        s0 = torch.randn(4, generator=gen, dtype=torch.float64) * 2
        q, k, v = leaves(q0, k0, v0, dtype=torch.float32) if grad else (t.float() for t in (q0, k0, v0))
        sinks = s0.float().requires_grad_(grad)
        out = opdispatch.attention(q, k, v, causal=True, sinks=sinks, scale=0.4)
        qr, kr, vr, sr = leaves(q0, k0, v0, s0, dtype=torch.float64)
        want, _ = oracle(qr, kr, vr, sr, scale=0.4, causal=True)
        torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])
        if grad:
            g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            (out.double() * g).sum().backward()
            (want * g).sum().backward()
            torch.testing.assert_close(sinks.grad.double(), sr.grad, **TOLERANCE[torch.float32])
            torch.testing.assert_close(q.grad.double(), qr.grad, **TOLERANCE[torch.float32])
    assert len(validations) == 1, f"{len(validations)} validations for one signature with sinks"


def test_a_sinks_fast_path_function_is_forgotten_when_its_kernel_is_demoted(manager, monkeypatch):
    """The remembered function of a sinks signature carries its decision: a kernel failing on a later call fails
    over (the next implementation computes the same math) and the stale function is not used again."""
    from opdispatch.vendors.cpu._attention import CpuFlashAttention

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen)
    first = opdispatch.attention(q, k, v, causal=True, sinks=sinks)  # remembered on cpu.flash
    assert opdispatch.explain(q, k, v, causal=True, sinks=sinks).chosen_id == "cpu.flash"

    def broken(self, call):
        raise RuntimeError("injected kernel fault")

    monkeypatch.setattr(CpuFlashAttention, "run", broken)
    sinks2 = torch.randn(2, generator=gen)
    got = opdispatch.attention(q, k, v, causal=True, sinks=sinks2)  # a fast-path hit whose kernel raises
    want = opdispatch.attention(q, k, v, causal=True, sinks=sinks2, impl="reference.math")
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, first)
    assert opdispatch.explain(q, k, v, causal=True, sinks=sinks).chosen_id != "cpu.flash"
