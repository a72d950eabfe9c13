"""`torch.flex` on the CPU: the real adapter (block masks, score mods, layouts, LSE, GQA, varlen, backward) running
torch's flex_attention eagerly (option compile=False), against a float64 oracle written here, loop by loop.

Flex's eager path computes the same math as the fused kernel from the same mask_mod/score_mod and block mask, so
everything the adapter builds is exercised; the fused kernel itself is checked by tests/gpu/test_flex_gpu.py.
torch refuses CPU inputs that require grad in flex_attention's public entry (`_validate_device`) although the
eager math under it differentiates fine, so the backward tests lift that one check (fixture `cpu_backward`).
"""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from opdispatch import validate_attention
from opdispatch.vendors.torch_flex import TorchFlexAttention
from tests.conftest import DEVICES_DIR

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# -- oracle: float64, one (batch, head) at a time, positions written out -----------------------------------

def oracle(q, k, v, *, scale, causal=False, alignment="top_left", window=None, softcap=0.0, slopes=None,
           mask=None, bias=None):
    """(b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv) float64 -> out (b, hq, sq, dv), lse (b, hq, sq)."""
    b, hq, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    offset = sk - sq if alignment == "bottom_right" else 0
    i = torch.arange(sq, dtype=torch.float64).unsqueeze(1) + offset   # aligned query positions
    j = torch.arange(sk, dtype=torch.float64).unsqueeze(0)
    mask4 = None if mask is None else mask.expand(b, hq, sq, sk)
    bias4 = None if bias is None else bias.to(torch.float64).expand(b, hq, sq, sk)
    outs, lses = [], []
    for bi in range(b):
        for h in range(hq):
            kh = h // group
            s = (q[bi, h] @ k[bi, kh].T) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if slopes is not None:
                slope = slopes[h] if slopes.dim() == 1 else slopes[bi, h]
                s = s - slope.double() * (i - j).abs()
            if bias4 is not None:
                s = s + bias4[bi, h]
            ok = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                ok &= j <= i
            if window is not None:
                left, right = window
                if left >= 0:
                    ok &= j >= i - left
                if right >= 0:
                    ok &= j <= i + right
            if mask4 is not None:
                ok &= mask4[bi, h]
            s = s.masked_fill(~ok, -math.inf)
            row_max = s.amax(-1, keepdim=True)
            seen = torch.isfinite(row_max)
            p = torch.exp(s - torch.where(seen, row_max, torch.zeros_like(row_max)))
            total = p.sum(-1, keepdim=True)
            p = p / torch.where(seen, total, torch.ones_like(total))
            outs.append(p @ v[bi, kh])
            lse = torch.where(seen, row_max + torch.log(torch.where(seen, total, torch.ones_like(total))),
                              torch.full_like(row_max, -math.inf))
            lses.append(lse.squeeze(-1))
    return torch.stack(outs).reshape(b, hq, sq, dv), torch.stack(lses).reshape(b, hq, sq)


def varlen_oracle(q, k, v, cu_q, cu_k, *, slopes=None, **kw):
    """(total, h, d) packed -> out (total_q, hq, dv), lse (hq, total_q), one sequence at a time."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for n in range(len(cq) - 1):
        sl = slopes if slopes is None or slopes.dim() == 1 else slopes[n:n + 1]
        qs = q[cq[n]:cq[n + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[n]:ck[n + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[n]:ck[n + 1]].transpose(0, 1).unsqueeze(0)
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:  # no keys at all: zeros, -inf
            outs.append(torch.zeros(qs.shape[2], qs.shape[1], vs.shape[3], dtype=q.dtype))
            lses.append(torch.full((qs.shape[1], qs.shape[2]), -math.inf, dtype=q.dtype))
            continue
        o, l = oracle(qs, ks, vs, slopes=sl, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# -- helpers ------------------------------------------------------------------------------------------------

def flex_impl(**options) -> TorchFlexAttention:
    return TorchFlexAttention().with_options({"compile": False, "cpu": True, **options})


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def to_bhsd(t, layout):
    return {"bshd": lambda x: x.transpose(1, 2), "bhsd": lambda x: x, "sbhd": lambda x: x.permute(1, 2, 0, 3)}[layout](t)


def make_dense(layout, b, sq, sk, hq, hkv, d, dv, dtype=torch.float32, gen=None, strided=False):
    """q/k/v in `layout`; `strided` takes every other element of a wider last dim and a slice of a longer
    sequence, so none of them is contiguous."""
    def one(s, h, dim):
        if layout == "bshd":
            shape = (b, s, h, dim)
        elif layout == "bhsd":
            shape = (b, h, s, dim)
        else:
            shape = (s, b, h, dim)
        if not strided:
            return rand(*shape, dtype=dtype, gen=gen)
        wide = list(shape)
        wide[-1] *= 2
        seq_axis = {"bshd": 1, "bhsd": 2, "sbhd": 0}[layout]
        wide[seq_axis] += 3
        t = rand(*wide, dtype=dtype, gen=gen)[..., ::2].narrow(seq_axis, 2, s)
        assert not t.is_contiguous()
        return t
    return one(sq, hq, d), one(sk, hkv, d), one(sk, hkv, dv)


def assert_close(got, want, dtype, what):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    got = got.double()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: finite pattern differs"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    assert err <= tol * max(1.0, scale), f"{what}: max |err| {err:.3g} > {tol:g} (scale {scale:.3g})"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20240607)


@pytest.fixture(autouse=True)
def _fresh_limit_read(monkeypatch):
    """Tests that fake the graph count must not leave torch.flex's cached read of dynamo's limit behind."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    monkeypatch.setattr(flex_module, "_limit_read", [-1, 0])


@pytest.fixture
def untraced_flex(monkeypatch):
    """Run flex's eager path without dynamo tracing each new variant (torch's own debug switch): the same mods,
    block mask and dense math, about 10x faster per new shape. Backward (which needs the traced path) and
    test_dispatch_through_dynamo_eager keep the traced path, so mods are traced by dynamo there."""
    from torch.nn.attention import flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


@pytest.fixture
def cpu_backward(monkeypatch):
    """Lift flex_attention's refusal of CPU inputs that require grad (see the module docstring)."""
    from torch.nn.attention import flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)


DENSE_CASES = [
    # name, layout, b, sq, sk, hq, hkv, d, dv, kwargs
    ("plain_sq<sk", "bshd", 2, 37, 53, 4, 4, 64, 64, {}),
    ("causal_top_left_sq<sk", "bshd", 2, 37, 53, 4, 2, 64, 64, dict(causal=True)),
    ("causal_bottom_right_sq>sk_blind_rows", "bhsd", 2, 53, 37, 4, 2, 72, 72,
     dict(causal=True, causal_alignment="bottom_right")),
    ("decode_sq1_bottom_right_gqa4", "bshd", 3, 1, 97, 8, 2, 64, 64, dict(causal=True, causal_alignment="bottom_right")),
    ("window_both_sides", "sbhd", 2, 41, 41, 2, 2, 32, 32, dict(window=(5, 3))),
    ("window_causal_bottom_right", "bshd", 1, 29, 70, 4, 1, 100, 100,
     dict(causal=True, window=(9, 0), causal_alignment="bottom_right")),
    ("window_left_only_top_left", "bhsd", 2, 60, 45, 2, 2, 16, 16, dict(window=(4, -1))),
    ("softcap_causal_gqa", "bshd", 2, 48, 48, 6, 2, 72, 40, dict(causal=True, softcap=5.0)),
    ("alibi_heads_gqa", "bshd", 2, 33, 50, 4, 2, 32, 32, dict(alibi="h")),
    ("alibi_batch_heads_bottom_right", "sbhd", 2, 33, 50, 4, 4, 32, 32,
     dict(alibi="bh", causal=True, causal_alignment="bottom_right")),
    ("softcap_alibi_window_scale", "bhsd", 1, 40, 40, 4, 2, 48, 48,
     dict(softcap=3.0, alibi="h", window=(6, 2), scale=0.3)),
    ("dv_differs_d100", "bshd", 2, 19, 27, 2, 1, 100, 24, dict(causal=True)),
]


def _alibi(kind, b, hq, gen):
    if kind is None:
        return None
    shape = (hq,) if kind == "h" else (b, hq)
    return (torch.rand(*shape, generator=gen) * 0.5 + 0.05).float()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_dense_forward_and_lse_match_oracle(case, strided, gen, untraced_flex):
    name, layout, b, sq, sk, hq, hkv, d, dv, kw = case
    kw = dict(kw)
    slopes = _alibi(kw.pop("alibi", None), b, hq, gen)
    q, k, v = make_dense(layout, b, sq, sk, hq, hkv, d, dv, gen=gen, strided=strided)
    call = validate_attention(q, k, v, layout=layout, alibi_slopes=slopes, return_lse=True, **kw)
    out, lse = flex_impl().run(call)
    assert out.shape == (q.shape[:-1] + (dv,)) and out.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    want_out, want_lse = oracle(*(to_bhsd(t, layout).double() for t in (q, k, v)), scale=call.scale,
                                causal=kw.get("causal", False), alignment=kw.get("causal_alignment", "top_left"),
                                window=call.window, softcap=kw.get("softcap", 0.0), slopes=slopes)
    assert_close(to_bhsd(out, layout), want_out, torch.float32, f"{name} out")
    assert_close(lse, want_lse, torch.float32, f"{name} lse")
    if name.endswith("blind_rows"):
        blind = ~torch.isfinite(want_lse)
        assert blind.any()
        assert torch.all(to_bhsd(out, layout)[blind] == 0), "queries that see no key must give zeros"
        assert torch.all(lse[blind] == -math.inf)


def test_lse_is_natural_log(gen, untraced_flex):
    # one key per query (window 0,0): lse is exactly the scaled score, natural log — log2 would differ by ln 2
    q, k, v = make_dense("bshd", 1, 8, 8, 2, 2, 16, 16, gen=gen)
    out, lse = flex_impl().run(validate_attention(q, k, v, window=(0, 0), return_lse=True))
    want = (q.transpose(1, 2).double() * k.transpose(1, 2).double()).sum(-1) / 4.0
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, v, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward(dtype, gen, untraced_flex):
    q, k, v = make_dense("bshd", 2, 40, 64, 4, 2, 72, 72, dtype=dtype, gen=gen)
    out = flex_impl().run(validate_attention(q, k, v, causal=True, causal_alignment="bottom_right", softcap=4.0))
    assert out.dtype == dtype
    want, _ = oracle(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=1 / math.sqrt(72), causal=True,
                     alignment="bottom_right", softcap=4.0)
    assert_close(out.transpose(1, 2), want, dtype, "low precision out")


def test_mask_and_bias(gen, untraced_flex):
    b, sq, sk, hq, hkv, d = 2, 30, 44, 4, 2, 32
    q, k, v = make_dense("bshd", b, sq, sk, hq, hkv, d, d, gen=gen)
    mask = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
    mask[0, 0, 3] = False  # one query that sees nothing
    bias = rand(hq, sq, sk, gen=gen)
    call = validate_attention(q, k, v, attn_mask=mask, attn_bias=bias, causal=True,
                              causal_alignment="bottom_right", return_lse=True)
    out, lse = flex_impl().run(call)
    want_out, want_lse = oracle(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=call.scale, causal=True,
                                alignment="bottom_right", mask=mask, bias=bias)
    assert_close(out.transpose(1, 2), want_out, torch.float32, "mask+bias out")
    assert_close(lse, want_lse, torch.float32, "mask+bias lse")
    assert torch.all(lse[0, :, 3] == -math.inf) and torch.all(out[0, 3] == 0)
    # a 2-D mask that broadcasts over batch and heads, no positional pattern
    mask2 = torch.rand(sq, sk, generator=gen) > 0.5
    out2 = flex_impl().run(validate_attention(q, k, v, attn_mask=mask2))
    want2, _ = oracle(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=call.scale, mask=mask2)
    assert_close(out2.transpose(1, 2), want2, torch.float32, "2-D mask out")


def _packed(lens_q, lens_k, hq, hkv, d, dv, gen, dtype=torch.float32):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(int(cu_q[-1]), hq, d, dtype=dtype, gen=gen)
    k = rand(int(cu_k[-1]), hkv, d, dtype=dtype, gen=gen)
    v = rand(int(cu_k[-1]), hkv, dv, dtype=dtype, gen=gen)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [
    ("same_lengths_causal", (13, 40, 7), None, dict(causal=True)),
    ("uneven_bottom_right_window", (5, 31, 1, 12), (20, 31, 9, 3),
     dict(causal=True, causal_alignment="bottom_right", window=(6, 0))),
    ("top_left_sq>sk_blind", (9, 14), (4, 20), dict(causal=True)),
    ("alibi_per_sequence_softcap", (17, 3, 26), (17, 30, 26), dict(alibi="bh", softcap=2.5)),
    ("empty_sequence", (6, 0, 11), (6, 5, 11), dict(window=(3, 3))),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_matches_per_sequence_oracle(case, gen, untraced_flex):
    name, lens_q, lens_k, kw = case
    kw = dict(kw)
    lens_k = lens_k or lens_q
    hq, hkv = 4, 2
    slopes = _alibi(kw.pop("alibi", None), len(lens_q), hq, gen)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hkv, 24, 40, gen)
    if lens_k == lens_q:
        cu_k = cu_q  # the same tensor: validation then knows alignment does not matter
    call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes,
                              return_lse=True, **kw)
    out, lse = flex_impl().run(call)
    assert out.shape == (q.shape[0], hq, 40) and lse.shape == (hq, q.shape[0])
    want_out, want_lse = varlen_oracle(q.double(), k.double(), v.double(), cu_q, cu_k, slopes=slopes,
                                       scale=call.scale, causal=kw.get("causal", False),
                                       alignment=kw.get("causal_alignment", "top_left"), window=call.window,
                                       softcap=kw.get("softcap", 0.0))
    assert_close(out, want_out, torch.float32, f"{name} out")
    assert_close(lse, want_lse, torch.float32, f"{name} lse")


# -- backward -----------------------------------------------------------------------------------------------

def _grads(fn, tensors, grad_out):
    out = fn(*tensors)
    return torch.autograd.grad(out, tensors, grad_out)


BACKWARD_CASES = [
    ("causal_bottom_right_gqa_d72", "bshd", 2, 24, 40, 4, 2, 72, 72,
     dict(causal=True, causal_alignment="bottom_right")),
    ("softcap_alibi_window", "bhsd", 1, 33, 33, 4, 1, 32, 48, dict(softcap=3.0, alibi="h", window=(5, 2))),
    ("alibi_bh_sbhd_decode", "sbhd", 2, 1, 30, 4, 2, 16, 16, dict(alibi="bh", causal=True,
                                                                   causal_alignment="bottom_right")),
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_dense_backward_matches_oracle(case, gen, cpu_backward):
    name, layout, b, sq, sk, hq, hkv, d, dv, kw = case
    kw = dict(kw)
    slopes = _alibi(kw.pop("alibi", None), b, hq, gen)
    q, k, v = (t.requires_grad_() for t in make_dense(layout, b, sq, sk, hq, hkv, d, dv, gen=gen))
    impl = flex_impl()
    call = validate_attention(q, k, v, layout=layout, alibi_slopes=slopes, **kw)
    assert call.requires_grad
    grad_out = rand(*(q.shape[:-1] + (dv,)), gen=gen)
    got = _grads(lambda q_, k_, v_: impl.run(call.with_tensors(q_, k_, v_)), (q, k, v), grad_out)

    def ref(q_, k_, v_):
        out, _ = oracle(*(to_bhsd(t, layout) for t in (q_, k_, v_)), scale=call.scale,
                        causal=kw.get("causal", False), alignment=kw.get("causal_alignment", "top_left"),
                        window=call.window, softcap=kw.get("softcap", 0.0), slopes=slopes)
        return {"bshd": lambda x: x.transpose(1, 2), "bhsd": lambda x: x,
                "sbhd": lambda x: x.permute(2, 0, 1, 3)}[layout](out)

    want = _grads(ref, tuple(t.detach().double().requires_grad_() for t in (q, k, v)), grad_out.double())
    for name_, g, w in zip("qkv", got, want):
        assert_close(g, w, torch.float32, f"{name} d{name_}")


def test_bias_gradient_and_varlen_backward(gen, cpu_backward):
    b, sq, sk, hq, d = 1, 20, 26, 2, 16
    q, k, v = (t.requires_grad_() for t in make_dense("bshd", b, sq, sk, hq, hq, d, d, gen=gen))
    bias = rand(hq, sq, sk, gen=gen).requires_grad_()
    call = validate_attention(q, k, v, attn_bias=bias, causal=True)
    grad_out = rand(b, sq, hq, d, gen=gen)
    got = _grads(lambda *t: flex_impl().run(call.with_tensors(*t[:3])), (q, k, v, bias), grad_out)

    def ref(q_, k_, v_, bias_):
        out, _ = oracle(*(t.transpose(1, 2) for t in (q_, k_, v_)), scale=call.scale, causal=True, bias=bias_)
        return out.transpose(1, 2)

    want = _grads(ref, tuple(t.detach().double().requires_grad_() for t in (q, k, v, bias)), grad_out.double())
    for what, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(g, w, torch.float32, what)

    q, k, v, cu_q, cu_k = _packed((7, 19, 4), (12, 19, 9), 4, 2, 16, 16, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                              causal_alignment="bottom_right", softcap=2.0)
    grad_out = rand(q.shape[0], 4, 16, gen=gen)
    got = _grads(lambda *t: flex_impl().run(call.with_tensors(*t)), (q, k, v), grad_out)
    want = _grads(lambda *t: varlen_oracle(*t, cu_q, cu_k, scale=call.scale, causal=True,
                                           alignment="bottom_right", softcap=2.0)[0],
                  tuple(t.detach().double().requires_grad_() for t in (q, k, v)), grad_out.double())
    for what, g, w in zip(("varlen dq", "varlen dk", "varlen dv"), got, want):
        assert_close(g, w, torch.float32, what)


# -- block-mask cache, dispatch, declarations --------------------------------------------------------------

def test_block_mask_cache_is_keyed_and_bounded(gen, untraced_flex):
    impl = flex_impl(block_mask_cache=2)
    q, k, v = make_dense("bshd", 1, 20, 30, 2, 2, 16, 16, gen=gen)
    impl.run(validate_attention(q, k, v, causal=True))
    impl.run(validate_attention(q, k, v, causal=True))
    assert len(impl._masks) == 1  # same pattern: reused
    first = next(iter(impl._masks._entries.values())).block_mask
    impl.run(validate_attention(q, k, v, causal=True, causal_alignment="bottom_right"))
    impl.run(validate_attention(q, k, v, causal=True, window=(4, 0)))
    assert len(impl._masks) == 2  # bounded: the oldest (top-left causal) was evicted
    assert all(p.block_mask is not first for p in impl._masks._entries.values())
    keys = list(impl._masks._entries)
    assert keys[0][3] == 10 and keys[1][1] == 4  # bottom-right offset sk - sq; window left
    assert len(flex_impl(block_mask_cache=0)._masks) == 0
    # the block mask does not depend on batch or heads
    pattern = next(iter(impl._masks._entries.values())).block_mask
    assert pattern.kv_num_blocks.shape[:2] == (1, 1)


def _explain(device, *shape_q, kv=None, grad=False, **kw):
    q = torch.empty(*shape_q, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    kv_shape = kv or shape_q
    k = torch.empty(*kv_shape, dtype=torch.bfloat16, device="meta", requires_grad=grad)
    v = torch.empty(*kv_shape[:-1], kw.pop("dv", kv_shape[-1]), dtype=torch.bfloat16, device="meta",
                    requires_grad=grad)
    return opdispatch.explain(q, k, v, device=DEVICES_DIR / f"{device}.yaml", **kw)


def _flex_candidate(decision):
    return next(c for c in decision.candidates if c.impl_id == "torch.flex")


def test_selection_on_simulated_devices(manager):
    # the cases: softcap training and ALiBi + GQA training left only reference.math before
    d = _explain("h100", 2, 1024, 16, 128, grad=True, causal=True, softcap=30.0)
    assert d.chosen_id == "torch.flex"
    # ALiBi + GQA training: cuDNN with the prepared ALiBi bias and native GQA (measured 6.7 ms for torch's own
    # SDPA + bias vs 131 ms for flex's backward on an H100), flex behind it
    d = _explain("h100", 2, 512, 16, 72, kv=(2, 512, 4, 72), grad=True,
                 alibi_slopes=torch.ones(16, device="meta"))
    assert d.chosen_id == "nvidia.cudnn" and _flex_candidate(d).status == "eligible"
    # fused vendor kernels stay first where they can take the call
    assert _explain("h100", 2, 1024, 16, 128, causal=True).chosen_id == "nvidia.cudnn"
    # MLA absorbed decode: above the default max_head_dim, with a reason that says how to raise it
    d = _explain("h100", 4, 1, 128, 576, kv=(4, 2048, 1, 576), dv=512, causal=True)
    assert any("max_head_dim=256" in r for r in _flex_candidate(d).reasons)
    # a vendor torch new enough for flex (2.7.1 on MI300X) with its Triton: flex runs; non-power-of-two head dims
    # wait for the torch they were verified on, with the reason
    assert _flex_candidate(_explain("mi300x", 1, 64, 4, 64)).status == "eligible"
    reasons = _flex_candidate(_explain("mi300x", 1, 64, 4, 96)).reasons
    assert any("torch 2.7.1 < 2.11: head_dim 96/96" in r for r in reasons), reasons
    reasons = _flex_candidate(_explain("mi300x", 1, 64, 4, 64, dv=32)).reasons
    assert any("head_dim 64/32" in r for r in reasons), reasons
    assert not any("< 2.11" in r for r in _flex_candidate(_explain("h100", 1, 64, 4, 96)).reasons)
    # dropout and tiny head dims: declined with reasons
    reasons = _flex_candidate(_explain("h100", 1, 64, 4, 64, dropout_p=0.1)).reasons
    assert any("dropout_p=0.1 not supported" in r for r in reasons)
    assert any("head_dim 8 outside" in r for r in _flex_candidate(_explain("h100", 1, 64, 4, 8)).reasons)
    reasons = _flex_candidate(_explain("h100", 1, 64, 4, 64, dv=8)).reasons
    assert any("v head_dim 8 below 16" in r for r in reasons)


def test_dispatch_through_dynamo_eager(manager, tmp_path, monkeypatch, gen):
    q, k, v = make_dense("bshd", 1, 20, 20, 2, 2, 16, 16, gen=gen)
    d = opdispatch.explain(q, k, v, softcap=5.0)
    assert d.chosen_id == "reference.math"
    assert any("off on the CPU" in r for r in _flex_candidate(d).reasons)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                      "      torch.flex: {cpu: true, compile: false}\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    opdispatch.get_manager().reload()
    d = opdispatch.explain(q, k, v, softcap=5.0)
    assert d.chosen_id == "torch.flex"
    out = opdispatch.attention(q, k, v, softcap=5.0)
    want, _ = oracle(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=0.25, softcap=5.0)
    assert_close(out.transpose(1, 2), want, torch.float32, "dispatched out")
    # opted in, it comes before cpu.flash in the default order; training calls go back to cpu.flash because
    # flex has no backward on the CPU, declined with the reason
    assert opdispatch.explain(q, k, v, causal=True).chosen_id == "torch.flex"
    d = opdispatch.explain(q.clone().requires_grad_(), k, v, causal=True)
    assert d.chosen_id == "cpu.flash"
    assert any("no backward on the CPU" in r for r in _flex_candidate(d).reasons)


def test_declarations_and_options():
    impl = TorchFlexAttention()
    assert impl.id == "torch.flex" and impl.check_declaration() == []
    with pytest.raises(ValueError):
        impl.with_options({"compiled": True})
    with pytest.raises(ValueError):
        impl.with_options({"max_head_dim": 8})
    q = torch.empty(1, 8, 2, 32, device="meta", requires_grad=True)
    bias = torch.empty(8, 8, device="meta", requires_grad=True)
    call = validate_attention(q, q, q, attn_bias=bias, deterministic=True)
    from opdispatch import load_device_descriptor

    reasons = impl.extra_reasons(call, load_device_descriptor(DEVICES_DIR / "h100.yaml"))
    assert any("atomic adds" in r for r in reasons)
    # extra_reasons reads no sizes: two calls of different lengths share one selection key
    other = validate_attention(torch.empty(3, 99, 2, 32, device="meta"), torch.empty(3, 7, 2, 32, device="meta"),
                               torch.empty(3, 7, 2, 32, device="meta"))
    plain = validate_attention(torch.empty(1, 8, 2, 32, device="meta"), torch.empty(1, 8, 2, 32, device="meta"),
                               torch.empty(1, 8, 2, 32, device="meta"))
    assert impl.selection_key(other) == impl.selection_key(plain) != impl.selection_key(call)


def test_compiled_flex_retries_with_the_regular_kernel_when_decoding_has_no_valid_choice(monkeypatch):
    from opdispatch.vendors.torch_flex import _attention as flex_module

    seen = []

    def fake_compiled(q, k, v, kwargs, entry=None):
        seen.append(kwargs.get("kernel_options"))
        if not kwargs.get("kernel_options"):
            raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select")
        return "out"

    monkeypatch.setattr(flex_module, "_call_compiled", fake_compiled)
    impl = flex_module.TorchFlexAttention()
    q, k = torch.empty(2, 8, 100, 128), torch.empty(2, 2, 333, 128)
    assert impl._run_compiled(q, k, k, {}) == "out"
    assert impl._run_compiled(q, k, k, {}) == "out"  # remembered: straight to the regular kernel
    assert seen == [None, {"FORCE_USE_FLEX_ATTENTION": True}, {"FORCE_USE_FLEX_ATTENTION": True}]

    def other_failure(q, k, v, kwargs, entry=None):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(flex_module, "_call_compiled", other_failure)
    with pytest.raises(RuntimeError, match="out of memory"):
        flex_module.TorchFlexAttention()._run_compiled(q, k, k, {})


def test_compiled_flex_past_the_recompile_limit_runs_unfused_with_one_warning(monkeypatch, caplog):
    from types import SimpleNamespace

    from opdispatch.vendors.torch_flex import _attention as flex_module

    config = torch._dynamo.config
    before = config.recompile_limit, config.fail_on_recompile_limit_hit
    seen_config = []

    def compiled(q, k, v, **kwargs):
        seen_config.append((config.recompile_limit, config.fail_on_recompile_limit_hit))
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")

    monkeypatch.setattr(flex_module, "_compiled_flex", lambda: compiled)
    monkeypatch.setattr(flex_module, "_flex_api", lambda: SimpleNamespace(flex_attention=lambda q, k, v, **kw: "eager"))
    monkeypatch.setattr(flex_module, "_warned_unfused", False)
    monkeypatch.setattr(flex_module, "_graphs_compiled", lambda: before[0] - 1)  # the next graph could hit it
    q = torch.empty(1, 2, 4, 8)
    with caplog.at_level("WARNING", logger="opdispatch"):
        assert flex_module._call_compiled(q, q, q, {}) == "eager"
        assert flex_module._call_compiled(q, q, q, {}) == "eager"
    assert seen_config == [(max(before[0], flex_module._RECOMPILE_LIMIT), True)] * 2
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before  # restored
    warnings = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1 and "run flex unfused" in warnings[0] and "torch._dynamo.reset()" in warnings[0]


def test_compiled_flex_far_from_the_recompile_limit_leaves_dynamos_config_alone(monkeypatch):
    """With room for another graph under the user's limit a call cannot reach it: no config is written (the
    scope's writes were most of torch.flex's host time per call beyond torch's own compiled flex)."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    config = torch._dynamo.config
    before = config.recompile_limit, config.fail_on_recompile_limit_hit
    seen = []
    monkeypatch.setattr(flex_module, "_compiled_flex", lambda: lambda q, k, v, **kw: seen.append(
        (config.recompile_limit, config.fail_on_recompile_limit_hit)) or "compiled")
    monkeypatch.setattr(flex_module, "_graphs_compiled", lambda: before[0] - 2)
    q = torch.empty(1, 2, 4, 8)
    assert flex_module._call_compiled(q, q, q, {}) == "compiled"
    assert seen == [before]
    monkeypatch.setattr(flex_module, "_graphs_compiled", lambda: before[0] - 1)
    assert flex_module._call_compiled(q, q, q, {}) == "compiled"
    assert seen[1] == (max(before[0], flex_module._RECOMPILE_LIMIT), True)
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


def test_graphs_compiled_reads_dynamos_cache_of_the_compiled_flex(monkeypatch):
    """The count comes from dynamo's cache entries on the compiled function's code, read through the C function
    itself (this torch has it: not the 'assume the limit is near' fallback), and follows them."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    reader = flex_module._cache_entry_reader()
    assert reader is torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    assert 0 <= flex_module._graphs_compiled() < 1 << 30
    seen = []
    monkeypatch.setattr(flex_module, "_cache_entry_reader", lambda: lambda code: seen.append(code) or [1, 2, 3])
    assert flex_module._graphs_compiled() == 3 and seen == [flex_module._flex_entry.__code__]
    monkeypatch.setattr(flex_module, "_cache_entry_reader", lambda: None)
    assert flex_module._graphs_compiled() == 1 << 30  # no reader: the limit counts as near


def test_the_recompile_limit_is_read_again_when_the_graph_count_changes(monkeypatch):
    """torch's config is read once per graph count, not per call (~1 µs each): a limit the user lowers takes
    effect at the next new graph, the point where a call could compile one more."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    config = torch._dynamo.config
    monkeypatch.setattr(flex_module, "_limit_read", [-1, 0])
    scoped = []
    monkeypatch.setattr(flex_module, "_compiled_flex", lambda: lambda q, k, v, **kw: scoped.append(
        config.recompile_limit) or "compiled")
    graphs = [3]
    monkeypatch.setattr(flex_module, "_graphs_compiled", lambda: graphs[0])
    q = torch.empty(1, 2, 4, 8)
    with config.patch(recompile_limit=8):  # config.patch restores torch's config (monkeypatch would hide it)
        flex_module._call_compiled(q, q, q, {})
        assert scoped == [8] and flex_module._limit_read == [3, 8]  # room: no scope
        config.recompile_limit = 4
        flex_module._call_compiled(q, q, q, {})
        assert scoped[-1] == 4 and flex_module._limit_read == [3, 8]  # same count: the limit is not read again
        graphs[0] = 4
        flex_module._call_compiled(q, q, q, {})
        assert flex_module._limit_read == [4, 4]
        assert scoped[-1] == flex_module._RECOMPILE_LIMIT  # near the lowered limit: the raised-limit scope


def test_flex_needs_torch_2_5_and_a_triton_backend(manager, tmp_path):
    """The requirement is what flex needs: torch >= 2.5 (flex_attention with GQA and backward) and Triton for the
    device — not a blanket version; each shortfall is its own explain reason."""
    base = (DEVICES_DIR / "mi300x.yaml").read_text()
    old = tmp_path / "old.yaml"
    old.write_text(base.replace('torch: "2.7.1"', 'torch: "2.4.1"'))
    reason = _flex_candidate(opdispatch.explain(*(torch.empty(1, 64, 4, 64, device="meta") for _ in range(3)),
                                                device=old)).reasons[0]
    assert "'torch' 2.4.1 is older than the required 2.5" in reason
    no_triton = tmp_path / "no_triton.yaml"
    no_triton.write_text("\n".join(line for line in base.splitlines() if "triton:" not in line) + "\n")
    reason = _flex_candidate(opdispatch.explain(*(torch.empty(1, 64, 4, 64, device="meta") for _ in range(3)),
                                                device=no_triton)).reasons[0]
    assert "library 'triton' is not declared" in reason
    # PrivateUse1 device types: flex_attention's own device check refuses them whatever their torch and Triton
    # (the descriptors declare triton-ascend, triton-mlu, triton-musa builds), and the reason says so
    for device, type_, vendor_word in [("ascend-910b", "npu", "npu_fusion_attention"),
                                       ("cambricon-mlu590", "mlu", "torch_mlu"), ("mthreads-s4000", "musa", "torch_musa")]:
        decision = _explain(device, 1, 64, 4, 64)
        reason = _flex_candidate(decision).reasons[0]
        assert f"refuses '{type_}' tensors" in reason and "_validate_device" in reason and vendor_word in reason
        assert decision.chosen_id != "torch.flex"


@pytest.mark.slow
def test_a_sweep_of_new_lengths_compiles_a_bounded_number_of_graphs(manager, tmp_path, monkeypatch, gen):
    """Compiled flex (on the CPU here: the same dynamo and inductor path) over eight new sequence lengths: the
    first length compiles static, the second goes dynamic over lengths, and the rest reuse those graphs — at most
    one more where the block count crosses a tile (at 128 tokens). Each result matches the float64 oracle."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nextends: default\nops:\n  attention:\n    options:\n"
                      "      torch.flex: {cpu: true}\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    opdispatch.get_manager().reload()
    torch._dynamo.reset()
    graphs = []
    for length in (64, 80, 96, 112, 128, 160, 200, 256):
        q, k, v = make_dense("bshd", 1, length, length, 4, 2, 16, 16, gen=gen)
        out = opdispatch.attention(q, k, v, causal=True, softcap=30.0, impl="torch.flex")
        want, _ = oracle(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=0.25, causal=True, softcap=30.0)
        assert_close(out.transpose(1, 2), want, torch.float32, f"length {length}")
        # bshd calls bound after their first call run through the bshd entry: its graphs count too
        graphs.append(flex_module._graphs_compiled()
                      + flex_module._graphs_compiled(flex_module._flex_entry_bshd.__code__))
    assert graphs[-1] <= 3, f"graphs held after each new length: {graphs}"
    assert graphs[2:5] == [graphs[1]] * 3, f"lengths after the second compiled again: {graphs}"


@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_bound_compiled_call_equals_run_and_the_oracle(case, gen, untraced_flex, monkeypatch):
    """bind() makes the compiled kernel's block mask, score_mod and arguments once per signature (run() makes them
    per call): for every dense case, fresh tensors of the signature through the bound function give run()'s
    result bit for bit and the float64 oracle's, the kernel sees the same argument objects on every call, and
    the bound function keeps none of the bound call's tensors. The compiled kernel is flex's eager path here (the
    same mods and block mask; compiling is the slow tier's), so a call that falls back to run() is equal too."""
    import weakref

    from opdispatch.vendors.torch_flex import _attention as flex_module

    seen = []

    def eager_kernel(q, k, v, kwargs, entry=None):
        seen.append(kwargs)
        # A bshd call is bound through an entry of its own (its transposes inside the compiled graph): its
        # uncompiled function, here.
        return (flex_module._flex_api().flex_attention if entry is None else entry[2])(q, k, v, **kwargs)

    monkeypatch.setattr(flex_module, "_call_compiled", eager_kernel)
    name, layout, b, sq, sk, hq, hkv, d, dv, kw = case
    kw = dict(kw)
    slopes = _alibi(kw.pop("alibi", None), b, hq, gen)
    impl = flex_impl(compile=True)
    first = make_dense(layout, b, sq, sk, hq, hkv, d, dv, gen=gen)
    bound = impl.bind(validate_attention(*first, layout=layout, alibi_slopes=slopes, **kw))
    alive = weakref.ref(first[0])
    del first
    assert alive() is None, "the bound function keeps the bound call's q alive"
    for round_ in range(2):
        q, k, v = make_dense(layout, b, sq, sk, hq, hkv, d, dv, gen=gen, strided=round_ == 1)
        call = validate_attention(q, k, v, layout=layout, alibi_slopes=slopes, **kw)
        got = bound(q, k, v)
        assert torch.equal(got, impl.run(call)), f"{name}: bound differs from run()"
        want, _ = oracle(*(to_bhsd(t, layout).double() for t in (q, k, v)), scale=call.scale,
                         causal=kw.get("causal", False), alignment=kw.get("causal_alignment", "top_left"),
                         window=call.window, softcap=kw.get("softcap", 0.0), slopes=slopes)
        assert_close(to_bhsd(got, layout), want, torch.float32, name)
    bound_calls = seen[0::2]  # bound, run, bound, run
    if slopes is None:  # bound directly: the same block mask and score_mod every call
        assert bound_calls[0] is bound_calls[1]
    else:  # ALiBi slopes are per-call values: run() each time, with its own arguments
        assert bound_calls[0] is not bound_calls[1]


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_a_bound_call_with_room_under_the_recompile_limit_calls_its_compiled_entry_directly(layout, gen,
                                                                                             untraced_flex, monkeypatch):
    """The bound function's one-frame path: with the graph count as last seen and room under dynamo's limit it
    calls the compiled entry itself — bshd tensors as they are (the entry transposes inside its graph), other
    layouts as bhsd views — and gives run()'s result; a new graph count, or a shape family moved to the regular
    kernel, goes through `_run_compiled` (which reads the limit again)."""
    from opdispatch.vendors.torch_flex import _attention as flex_module

    direct, slow = [], []

    def entry_of(eager, code):
        def compiled(q, k, v, **kwargs):
            direct.append((code, tuple(q.shape)))
            return eager(q, k, v, **kwargs)
        return compiled

    bshd_code, bhsd_code = flex_module._flex_entry_bshd.__code__, flex_module._flex_entry.__code__
    monkeypatch.setattr(flex_module, "_compiled_flex_bshd", lambda: (
        entry_of(flex_module._flex_entry_bshd, bshd_code), bshd_code, flex_module._flex_entry_bshd))
    monkeypatch.setattr(flex_module, "_compiled_flex", lambda: entry_of(flex_module._flex_entry, bhsd_code))
    counts = {bshd_code: [1, 2], bhsd_code: [1, 2, 3]}
    monkeypatch.setattr(flex_module, "_cache_entry_reader", lambda: lambda code: counts[code])
    original_call = flex_module._call_compiled
    monkeypatch.setattr(flex_module, "_call_compiled", lambda *a: slow.append(a[4] is not None) or original_call(*a))
    impl = flex_impl(compile=True)
    q, k, v = make_dense(layout, 2, 24, 40, 4, 2, 16, 16, gen=gen)
    call = validate_attention(q, k, v, layout=layout, causal=True, causal_alignment="bottom_right", softcap=20.0)
    bound = impl.bind(call)
    want = impl.run(call)
    code = bshd_code if layout == "bshd" else bhsd_code
    monkeypatch.setattr(flex_module, "_limit_read", [len(counts[code]), 8])  # as the last call left it
    direct.clear(), slow.clear()  # (run() went through _call_compiled)
    assert torch.equal(bound(q, k, v), want) and slow == []
    assert direct == [(code, tuple(q.shape) if layout == "bshd" else (2, 4, 24, 16))]
    counts[code].append(4)  # a graph more since the limit was read: the slow path, which reads it again
    assert torch.equal(bound(q, k, v), want) and slow == [layout == "bshd"]
    assert flex_module._limit_read[0] == len(counts[code])
    assert torch.equal(bound(q, k, v), want) and len(slow) == 1  # read: direct again
    impl._regular_kernel.add(("some", "family"))  # a family moved to the regular kernel: checked on the slow path
    assert torch.equal(bound(q, k, v), want) and len(slow) == 2


# -- KV caches: dense (seqused_k) and paged (block_table) -------------------------------------------------------

def kv_oracle(q, k, v, used, *, slopes=None, **kw):
    """q (b, hq, sq, d), a dense cache k/v (b, hkv, capacity, d) float64 and each sequence's fill `used` -> out
    (b, hq, sq, dv), lse (b, hq, sq): each sequence through `oracle` over its first used[b] keys only (so ALiBi
    distances and the bottom-right alignment count from its own fill); an empty cache gives zeros and -inf."""
    outs, lses = [], []
    for b, n in enumerate(used.tolist()):
        if n == 0:
            outs.append(torch.zeros(q.shape[1], q.shape[2], v.shape[3], dtype=q.dtype))
            lses.append(torch.full((q.shape[1], q.shape[2]), -math.inf, dtype=q.dtype))
            continue
        sl = slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]
        o, l = oracle(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], slopes=sl, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.stack(outs), torch.stack(lses)


def paged_cache(used, page_size, hkv, dims, gen, shared_pages=0):
    """Page pools holding sequences of `used` keys, and their block table: pages in shuffled pool order, sequence
    1 sharing sequence 0's first `shared_pages` pages (a common prefix), spare pool pages, one unused table entry
    per row past the used pages, the unused entries junk (an out-of-range index, never read), and the table a
    non-contiguous view (every other column of a wider tensor). Returns (k pool, v pool, table, k dense, v dense):
    the dense cache (b, max_pages * page_size, hkv, dim) holds each sequence's keys at the same positions, and
    other random values past its fill."""
    needed = [-(-n // page_size) for n in used]
    max_pages = max(needed) + 1
    fresh = sum(needed) - min(shared_pages, needed[1]) + 3
    order = torch.randperm(fresh, generator=gen).tolist()
    wide = torch.full((len(used), 2 * max_pages), 10**6, dtype=torch.int32)
    table = wide[:, ::2]
    for b, count in enumerate(needed):
        for p in range(count):
            table[b, p] = table[0, p] if b == 1 and p < shared_pages else order.pop()
    pools = [rand(fresh, page_size, hkv, dim, gen=gen) for dim in dims]
    capacity = max_pages * page_size
    dense = []
    for pool in pools:
        rows = rand(len(used), capacity, hkv, pool.shape[3], gen=gen)
        for b, (n, count) in enumerate(zip(used, needed)):
            if count:
                rows[b, :n] = pool[table[b, :count].long()].reshape(-1, hkv, pool.shape[3])[:n]
        dense.append(rows)
    assert not table.is_contiguous()
    return pools[0], pools[1], table, dense[0], dense[1]


PAGED_CASES = [
    # name, hq, hkv, kwargs: all bottom-right (a decode step / a chunked prefill over the cache)
    ("causal_gqa2", 4, 2, dict(causal=True)),
    ("window_softcap_alibi_gqa4", 4, 1, dict(causal=True, window=(7, 0), softcap=4.0, alibi="bh")),
    ("window_both_sides_no_causal", 2, 2, dict(window=(5, 2))),
]


@pytest.mark.parametrize("seqlen_q", [1, 5], ids=["decode", "chunked_prefill"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_cache_matches_oracle_and_the_dense_cache_its_pages_hold(case, page_size, seqlen_q, gen,
                                                                      untraced_flex):
    name, hq, hkv, kw = case
    kw = dict(kw, causal_alignment="bottom_right")
    used = [37 + 2 * page_size, 20 + page_size, 0, 3]  # an empty cache; fewer keys than queries (blind rows)
    b, d, dv = len(used), 32, 24
    slopes = _alibi(kw.pop("alibi", None), b, hq, gen)
    k_pool, v_pool, table, k_dense, v_dense = paged_cache(used, page_size, hkv, (d, dv), gen,
                                                         shared_pages=max(1, 16 // page_size))
    seqused = torch.tensor(used, dtype=torch.int32)
    q = rand(b, seqlen_q, hq, d, gen=gen)
    impl = flex_impl()
    paged = validate_attention(q, k_pool, v_pool, seqused_k=seqused, block_table=table, alibi_slopes=slopes,
                               return_lse=True, **kw)
    cpu = opdispatch.DeviceInfo(vendor="cpu", type="cpu", arch="x86_64", name="cpu")
    assert impl.not_supported_reasons(paged, cpu) == []
    out, lse = impl.run(paged)
    assert out.shape == (b, seqlen_q, hq, dv) and lse.shape == (b, hq, seqlen_q)
    want_out, want_lse = kv_oracle(q.transpose(1, 2).double(), k_dense.transpose(1, 2).double(),
                                   v_dense.transpose(1, 2).double(), seqused, slopes=slopes, scale=paged.scale,
                                   causal=kw.get("causal", False), alignment="bottom_right", window=paged.window,
                                   softcap=kw.get("softcap", 0.0))
    assert_close(out.transpose(1, 2), want_out, torch.float32, f"{name} out")
    assert_close(lse, want_lse, torch.float32, f"{name} lse")
    assert torch.all(out[2] == 0) and torch.all(lse[2] == -math.inf), "an empty cache: zeros and -inf"
    # the same call over the dense cache the pages hold (other values past each fill): the same numbers
    dense = validate_attention(q, k_dense, v_dense, seqused_k=seqused, alibi_slopes=slopes, return_lse=True, **kw)
    dense_out, dense_lse = impl.run(dense)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)


@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_kv_cache_in_other_layouts_and_top_left(layout, gen, untraced_flex):
    """A dense cache in bhsd/sbhd, and top-left alignment (each sequence's queries at its cache's start)."""
    used = torch.tensor([9, 0, 30], dtype=torch.int32)
    q, k, v = make_dense(layout, 3, 6, 30, 4, 2, 16, 16, gen=gen)
    for alignment in ("bottom_right", "top_left"):
        call = validate_attention(q, k, v, layout=layout, seqused_k=used, causal=True, causal_alignment=alignment,
                                  return_lse=True)
        out, lse = flex_impl().run(call)
        want_out, want_lse = kv_oracle(*(to_bhsd(t, layout).double() for t in (q, k, v)), used, scale=call.scale,
                                       causal=True, alignment=alignment)
        assert_close(to_bhsd(out, layout), want_out, torch.float32, f"{layout} {alignment} out")
        assert_close(lse, want_lse, torch.float32, f"{layout} {alignment} lse")


def test_packed_queries_over_paged_and_dense_caches(gen, untraced_flex):
    """thd queries (one sequence without queries) over 16-key pages, and over a packed dense cache whose
    sequences use the first seqused_k keys of their cu_seqlens_k spans."""
    used, lens_q, hq, hkv, d = [40, 21, 0, 17], [3, 1, 2, 0], 4, 2, 32
    slopes = _alibi("bh", 4, hq, gen)
    k_pool, v_pool, table, k_dense, v_dense = paged_cache(used, 16, hkv, (d, d), gen, shared_pages=1)
    cu_q = torch.tensor([0, 3, 4, 6, 6], dtype=torch.int32)
    q = rand(6, hq, d, gen=gen)
    seqused = torch.tensor(used, dtype=torch.int32)
    # no causal and a right window side: keys past each sequence's fill are only hidden by its length
    kw = dict(causal_alignment="bottom_right", window=(9, 3), alibi_slopes=slopes, return_lse=True)
    call = validate_attention(q, k_pool, v_pool, layout="thd", cu_seqlens_q=cu_q, max_seqlen_q=3,
                              seqused_k=seqused, block_table=table, **kw)
    out, lse = flex_impl().run(call)
    outs, lses = [], []
    for b, (start, n_q) in enumerate(zip(cu_q.tolist(), lens_q)):
        o, l = kv_oracle(q[start:start + n_q].transpose(0, 1).unsqueeze(0).double(),
                         k_dense[b:b + 1].transpose(1, 2).double(), v_dense[b:b + 1].transpose(1, 2).double(),
                         seqused[b:b + 1], slopes=slopes[b:b + 1], scale=call.scale, alignment="bottom_right",
                         window=(9, 3))
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    want_out, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    assert_close(out, want_out, torch.float32, "paged thd out")
    assert_close(lse, want_lse, torch.float32, "paged thd lse")
    # the same sequences as a packed dense cache: spans of capacity 48, each using its first seqused_k keys
    capacity = k_dense.shape[1]
    cu_k = torch.arange(5, dtype=torch.int32) * capacity
    packed = validate_attention(q, k_dense.flatten(0, 1), v_dense.flatten(0, 1), layout="thd", cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=capacity, seqused_k=seqused, **kw)
    packed_out, packed_lse = flex_impl().run(packed)
    assert_close(packed_out, want_out, torch.float32, "packed dense cache out")
    assert_close(packed_lse, want_lse, torch.float32, "packed dense cache lse")


def test_paged_backward_reaches_shared_pages(gen, cpu_backward):
    """Gradients flow through the gather into the page pools: a page two sequences share (their common prefix)
    gets both sequences' gradients, pages no sequence uses get zeros."""
    used, page_size, hq, hkv, d = [21, 13, 0], 4, 4, 2, 16
    k_pool, v_pool, table, _, _ = paged_cache(used, page_size, hkv, (d, d), gen, shared_pages=2)
    seqused = torch.tensor(used, dtype=torch.int32)
    q = rand(3, 3, hq, d, gen=gen).requires_grad_()
    k_pool.requires_grad_()
    v_pool.requires_grad_()
    kw = dict(causal=True, causal_alignment="bottom_right", softcap=3.0)
    call = validate_attention(q, k_pool, v_pool, seqused_k=seqused, block_table=table, **kw)
    assert call.requires_grad
    impl = flex_impl()
    grad_out = rand(3, 3, hq, d, gen=gen)
    got = _grads(lambda q_, k_, v_: impl.run(call.with_tensors(q_, k_, v_)), (q, k_pool, v_pool), grad_out)

    def ref(q_, k_, v_):
        rows = table.clamp(0, k_.shape[0] - 1).long()
        kd, vd = (t[rows].reshape(3, -1, hkv, d).transpose(1, 2) for t in (k_, v_))
        out, _ = kv_oracle(q_.transpose(1, 2), kd, vd, seqused, scale=call.scale, causal=True,
                           alignment="bottom_right", softcap=3.0)
        return out.transpose(1, 2)

    want = _grads(ref, tuple(t.detach().double().requires_grad_() for t in (q, k_pool, v_pool)), grad_out.double())
    for name_, g, w in zip("qkv", got, want):
        assert_close(g, w, torch.float32, f"paged d{name_}")
    shared = table[0, :2].long()
    assert torch.equal(table[1, :2].long(), shared) and got[1][shared].abs().sum() > 0
    named = {int(p) for b, n in enumerate(used) for p in table[b, : -(-n // page_size)].tolist()}
    unused = [p for p in range(k_pool.shape[0]) if p not in named]
    assert unused and torch.all(got[1][unused] == 0) and torch.all(got[2][unused] == 0)


def test_paged_selection_on_simulated_devices(manager, monkeypatch):
    """vLLM's 16-key pages: torch.flex is chosen on Hygon K100 and KunLunXin P800 (no fused paged kernel there);
    a block table whose gather would pass the bound is declined with the gather's reason."""
    def paged(device, pages_per_seq, grad=False):
        q = torch.empty(4, 1, 16, 128, dtype=torch.bfloat16, device="meta", requires_grad=grad)
        k = torch.empty(1024, 16, 2, 128, dtype=torch.bfloat16, device="meta", requires_grad=grad)
        v = torch.empty(1024, 16, 2, 128, dtype=torch.bfloat16, device="meta", requires_grad=grad)
        return opdispatch.explain(q, k, v, device=DEVICES_DIR / f"{device}.yaml", causal=True,
                                  causal_alignment="bottom_right",
                                  seqused_k=torch.empty(4, dtype=torch.int32, device="meta"),
                                  block_table=torch.empty(4, pages_per_seq, dtype=torch.int32, device="meta"))

    for device in ("hygon-k100", "p800"):
        d = paged(device, 256)
        assert d.chosen_id == "torch.flex", (device, [(c.impl_id, c.reasons) for c in d.candidates])
    # 4 x 65536 pages of 16 keys, 2 heads x (128 + 128) bf16: 4 GiB of gather
    reasons = _flex_candidate(paged("p800", 65536)).reasons
    assert any("paged cache: torch.flex" in r and "4096 MiB" in r and "1024 MiB bound" in r for r in reasons), reasons
    # NVIDIA: torch.flex's compiled KV-cache path passed on the H100 (tests/gpu/test_flex_gpu.py -k
    # paged_cache_compiled), so no rule denies it any more; FA2's paged kernel stays ahead of it by order for
    # inference, mem_efficient for a paged call with a gradient (FA2's paged path takes none); flex stays eligible
    inference = paged("h100", 256)
    assert inference.chosen_id == "nvidia.flash" and _flex_candidate(inference).status == "eligible", \
        [(c.impl_id, c.status, c.reasons) for c in inference.candidates]
    training = paged("h100", 256, grad=True)
    assert training.chosen_id == "nvidia.mem_efficient" and _flex_candidate(training).status == "eligible", \
        [(c.impl_id, c.status, c.reasons) for c in training.candidates]
