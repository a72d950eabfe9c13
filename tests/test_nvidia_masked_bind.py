"""Masked calls bound to torch's CUDA kernels (nvidia.cudnn, nvidia.mem_efficient), on CPU against fakes of their aten
ops: the bound function is size-generic (one function for every length and batch of a padded decode), gives what
`run` gives bit for bit — the kernel sees the same bias, shape, strides and dtype — and the float64 oracle's
result; calls it does not cover keep `run`."""

from __future__ import annotations

import math

import pytest
import torch

from opdispatch import validate_attention
from opdispatch.vendors.nvidia import _attention as nv
from tests.test_numerics import naive_attention

TO_BHSD = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}


def _bias_record(bias):
    return None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype, bias.contiguous().clone())


def _scores(q, k, bias, is_causal, scale):
    """float64 scores of bhsd q/k (k with q's heads) with the kernel's bias and top-left causal mask."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.double()
    if is_causal:
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None]
        scores = scores.masked_fill(j > i, -math.inf)
    return scores


def _softmax_out(scores, v, dtype):
    """The kernels' convention for a row that sees no key: zeros (its LSE is not -inf: run() fixes it)."""
    blind = torch.isneginf(scores).all(-1, keepdim=True)
    probs = scores.masked_fill(blind, 0.0).softmax(-1).masked_fill(blind, 0.0)
    lse = scores.masked_fill(blind, 0.0).logsumexp(-1)
    return (probs @ v.double()).to(dtype), lse.float()


def fake_cudnn(seen):
    """aten _scaled_dot_product_cudnn_attention: GQA native (kv heads divide q heads), an additive bias."""
    def kernel(q, k, v, bias, need_lse, dropout_p, is_causal, return_debug_mask, scale=None):
        seen.append(dict(q=tuple(q.shape), k=tuple(k.shape), bias=_bias_record(bias), causal=is_causal,
                         need_lse=need_lse, scale=scale))
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out, lse = _softmax_out(_scores(q, kk, bias, is_causal, scale or q.shape[-1] ** -0.5), vv, q.dtype)
        return out, lse, None, None
    return kernel


def fake_efficient(seen):
    """aten _scaled_dot_product_efficient_attention: no GQA (equal heads), an additive bias whose strides are
    multiples of 8 (bar broadcast dims), the LSE padded to a multiple of 32 queries."""
    def kernel(q, k, v, bias, need_lse, dropout_p, is_causal, scale=None):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the efficient kernel has no GQA"
        if bias is not None:
            assert all(s % 8 == 0 for s in bias.stride()[:-1]), bias.stride()
        seen.append(dict(q=tuple(q.shape), k=tuple(k.shape), bias=_bias_record(bias), causal=is_causal,
                         need_lse=need_lse, scale=scale))
        out, lse = _softmax_out(_scores(q, k, bias, is_causal, scale or q.shape[-1] ** -0.5), v, q.dtype)
        padded = -(-q.shape[2] // 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - q.shape[2]), value=123.0)
        return out, lse, None, None
    return kernel


@pytest.fixture
def kernels(monkeypatch):
    seen = []
    monkeypatch.setattr(nv, "_cudnn_sdpa", fake_cudnn(seen))
    monkeypatch.setattr(nv, "_efficient_sdpa", fake_efficient(seen))
    return seen


def make(layout, b, s, h, d, gen, dtype):
    shape = {"bshd": (b, s, h, d), "bhsd": (b, h, s, d), "sbhd": (s, b, h, d)}[layout]
    return torch.randn(*shape, generator=gen).to(dtype)


def mask_of(kind, b, hq, sq, sk, gen):
    shape = {"b11k": (b, 1, 1, sk), "b1qk": (b, 1, sq, sk), "bhqk": (b, hq, sq, sk), "qk": (sq, sk),
             "11k": (1, 1, sk), "bh1k": (b, hq, 1, sk)}[kind]
    mask = torch.rand(*shape, generator=gen) < 0.6
    mask[..., 0] = True
    if b > 1 and kind in ("b11k", "b1qk", "bhqk", "bh1k"):
        mask[1] = False  # a sequence that sees no key (all padding): the kernel's zeros, as run() gives them
    return mask


IMPLS = {"cudnn": nv.CudnnAttention, "mem_efficient": nv.MemEfficientAttention}
CASES = [
    # impl, layout, dtype, (batch, sq, hq, hkv, d), mask kind, later (batch, sk), options
    ("cudnn", "bhsd", torch.bfloat16, (4, 1, 8, 2, 64), "b11k", [(4, 130), (4, 131), (2, 200), (6, 9)], {}),
    ("cudnn", "bshd", torch.float16, (2, 3, 4, 4, 16), "b1qk", [(2, 5), (3, 17)], dict(causal=True)),
    ("cudnn", "sbhd", torch.bfloat16, (3, 2, 6, 3, 8), "qk", [(3, 7), (1, 12)], {}),
    ("cudnn", "bhsd", torch.bfloat16, (2, 1, 4, 1, 32), "11k", [(2, 9), (5, 33)], dict(requires_grad=True)),
    ("mem_efficient", "bhsd", torch.bfloat16, (4, 1, 8, 2, 64), "b11k", [(4, 130), (4, 131), (2, 200)], {}),
    ("mem_efficient", "bshd", torch.float32, (2, 3, 8, 2, 16), "b11k", [(2, 5), (3, 17)], {}),  # prefill, folded
    ("mem_efficient", "bshd", torch.float32, (2, 3, 4, 2, 16), "b1qk", [(2, 5), (3, 17)], {}),  # k/v repeated
    ("mem_efficient", "bhsd", torch.bfloat16, (2, 1, 4, 2, 8), "bh1k", [(2, 9), (2, 10)], {}),  # per head: repeated
    ("mem_efficient", "sbhd", torch.float32, (3, 2, 4, 4, 8), "qk", [(3, 7), (1, 12)], dict(causal=True)),
    ("mem_efficient", "bshd", torch.float16, (2, 1, 4, 2, 8), "11k", [(2, 9), (4, 15)], dict(requires_grad=True)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_masked_call_binds_size_generic_and_equals_run_and_the_oracle(kernels, case):
    name, layout, dtype, (b, sq, hq, hkv, d), kind, later, options = CASES[case]
    options = dict(options)
    grad = options.pop("requires_grad", False)
    gen = torch.Generator().manual_seed(700 + case)
    impl = IMPLS[name]()
    fn = None
    for bb, sk in [(b, sq + 4)] + later:
        q = make(layout, bb, sq, hq, d, gen, dtype).requires_grad_(grad)
        k, v = (make(layout, bb, sk, hkv, d, gen, dtype).requires_grad_(grad) for _ in range(2))
        mask = mask_of(kind, bb, hq, sq, sk, gen)
        call = validate_attention(q, k, v, layout=layout, attn_mask=mask, **options)
        if fn is None:  # bound once, from the first call: every later length and batch reuses it
            fn = impl.bound_function(call)
            assert getattr(fn, "size_generic", False), "a masked call must bind its kernel, not run() per call"
        kernels.clear()
        got = fn(q, k, v, None, None, mask, None)
        bound_seen = list(kernels)
        kernels.clear()
        want = impl.run(call)
        assert torch.equal(got, want), "the bound function differs from run()"
        assert len(bound_seen) == len(kernels) == 1
        for a, w in zip(bound_seen, kernels):  # the kernel got the same bias (values, shape, strides, dtype)
            ab, wb = a.pop("bias"), w.pop("bias")
            assert a == w and ab[:3] == wb[:3] and torch.equal(ab[3], wb[3])
        if name == "mem_efficient" and hq != hkv and kind in ("b11k", "11k") and not options.get("causal"):
            # a padding mask under GQA: query heads stacked per kv head, k/v read as they are (no copy per head)
            assert bound_seen[0]["k"][1] == hkv and bound_seen[0]["q"][2] == (hq // hkv) * sq
        order = TO_BHSD[layout]
        full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(bb, hq, sq, sk)
        ref, _ = naive_attention(*(t.detach().permute(order) for t in (q, k, v)), scale=d ** -0.5, mask=full,
                                 causal=options.get("causal", False))
        seen = full.any(-1)
        if options.get("causal"):
            seen = (full & torch.ones(sq, sk, dtype=torch.bool).tril()).any(-1)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.detach().permute(order).double()[seen], ref[seen], **tol)
        assert torch.equal(got.detach().permute(order)[~seen], torch.zeros_like(ref[~seen], dtype=dtype))
        if grad:
            g = torch.randn(got.shape, generator=gen).to(dtype)
            for a, w in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
                assert torch.equal(a, w), "gradients through the bound function differ from run()'s"


@pytest.mark.parametrize("name", sorted(IMPLS))
@pytest.mark.parametrize("options", [dict(causal=True, causal_alignment="bottom_right"), dict(return_lse=True),
                                     dict(window=(2, 0)), dict(dropout_p=0.1)])
def test_masked_calls_the_bound_function_does_not_cover_run_per_call(kernels, name, options):
    gen = torch.Generator().manual_seed(5)
    q = make("bshd", 2, 3, 4, 16, gen, torch.bfloat16)
    k, v = (make("bshd", 2, 7, 4, 16, gen, torch.bfloat16) for _ in range(2))
    call = validate_attention(q, k, v, attn_mask=mask_of("b1qk", 2, 4, 3, 7, gen), **options)
    fn = IMPLS[name]().bound_function(call)
    assert not getattr(fn, "size_generic", False)


def test_mem_efficient_folded_padding_mask_lse_is_the_oracles_with_minus_inf_for_blind_rows(kernels):
    """run() with return_lse on a padding mask under GQA (folded): the kernel's padded LSE cut to the stacked rows,
    unstacked per query head, -inf where a sequence sees no key."""
    gen = torch.Generator().manual_seed(11)
    b, sq, hq, hkv, d, sk = 3, 2, 8, 2, 16, 9
    q = make("bhsd", b, sq, hq, d, gen, torch.float32)
    k, v = (make("bhsd", b, sk, hkv, d, gen, torch.float32) for _ in range(2))
    mask = mask_of("b11k", b, hq, sq, sk, gen)
    out, lse = nv.MemEfficientAttention().run(validate_attention(q, k, v, layout="bhsd", attn_mask=mask,
                                                                 return_lse=True))
    assert kernels[0]["k"] == (b, hkv, sk, d) and kernels[0]["q"] == (b, hkv, (hq // hkv) * sq, d)
    ref, ref_lse = naive_attention(q, k, v, scale=d ** -0.5, mask=mask.expand(b, hq, sq, sk))
    assert torch.isneginf(lse[1]).all() and not torch.isinf(lse[0]).any()
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0].double(), ref[0], atol=1e-5, rtol=1e-5)


def test_a_bound_mask_turns_into_the_bias_in_one_op(kernels):
    """The hit path's work besides the kernel: one `where` (a launch on a GPU) and views — not run()'s full,
    masked_fill_ and call record."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    q = make("bhsd", 2, 1, 8, 16, gen, torch.bfloat16)
    # 24 keys: a bias row the efficient kernel takes as it is (another length is padded to 8, as torch's SDPA pads)
    k, v = (make("bhsd", 2, 24, 2, 16, gen, torch.bfloat16) for _ in range(2))
    mask = mask_of("b11k", 2, 8, 1, 24, gen)
    for name in sorted(IMPLS):
        fn = IMPLS[name]().bound_function(validate_attention(q, k, v, layout="bhsd", attn_mask=mask))
        kernel = nv._cudnn_sdpa if name == "cudnn" else nv._efficient_sdpa
        try:  # the fake kernel's own ops are not the bound function's
            setattr(nv, "_cudnn_sdpa" if name == "cudnn" else "_efficient_sdpa",
                    lambda *a, _k=kernel, **kw: _outside(_k, *a, **kw))
            with Ops() as ops:
                fn(q, k, v, None, None, mask, None)
        finally:
            setattr(nv, "_cudnn_sdpa" if name == "cudnn" else "_efficient_sdpa", kernel)
        computing = [n for n in ops.names if n not in ("expand", "view", "reshape", "_reshape_alias", "alias",
                                                       "detach", "_unsafe_view", "slice")]
        assert computing == ["where"], (name, ops.names)


def _outside(kernel, *args, **kwargs):
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return kernel(*args, **kwargs)
