"""Every bad input is rejected before any implementation sees it, with a message naming the argument, the value
and what is allowed."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch import validate_attention


def qkv(b=2, s=8, h=4, d=16, hkv=None, sk=None, dv=None, dtype=torch.float32):
    hkv = hkv or h
    sk = sk or s
    dv = dv or d
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, dv, dtype=dtype))


def varlen(lengths=(3, 5), h=4, d=16):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(total, h, d), torch.randn(total, h, d), torch.randn(total, h, d), cu


BAD_CASES = [
    # (description, builder -> (args, kwargs), exception type, regex the message must match)
    ("q not a tensor", lambda: ((None, *qkv()[1:]), {}), TypeError, r"q must be a torch\.Tensor, got NoneType"),
    ("k is a list", lambda: ((qkv()[0], [1, 2], qkv()[2]), {}), TypeError, r"k must be a torch\.Tensor, got list"),
    ("unknown layout", lambda: (qkv(), {"layout": "bsdh"}), ValueError,
     r"layout='bsdh' is not supported; allowed: bshd, bhsd, sbhd, thd"),
    ("3-d q for bshd", lambda: ((torch.randn(2, 8, 16), *qkv()[1:]), {}), ValueError,
     r"q has shape \(2, 8, 16\) \(3 dims\) but layout 'bshd' needs 4 dims"),
    ("integer dtype", lambda: (tuple(t.to(torch.int32) for t in qkv()), {}), TypeError,
     r"q has dtype torch\.int32; attention needs a floating-point dtype"),
    ("mixed dtypes", lambda: ((qkv()[0].double(), *qkv()[1:]), {}), TypeError,
     r"q, k and v must share one dtype, got q=torch\.float64, k=torch\.float32"),
    ("empty dim", lambda: ((torch.randn(2, 0, 4, 16), *qkv()[1:]), {}), ValueError,
     r"q has an empty dimension, shape \(2, 0, 4, 16\)"),
    ("batch mismatch", lambda: ((torch.randn(3, 8, 4, 16), *qkv()[1:]), {}), ValueError,
     r"batch sizes differ: q 3, k 2, v 2"),
    ("k/v seqlen mismatch", lambda: ((qkv()[0], qkv()[1], qkv(sk=9)[2]), {}), ValueError,
     r"k and v sequence lengths differ: k 8, v 9"),
    ("k/v heads mismatch", lambda: ((qkv()[0], qkv(hkv=2)[1], qkv()[2]), {}), ValueError,
     r"k and v head counts differ: k 2, v 4"),
    ("q/k head dim mismatch", lambda: ((qkv()[0], torch.randn(2, 8, 4, 32), torch.randn(2, 8, 4, 32)), {}),
     ValueError, r"q and k head dims differ: q 16, k 32"),
    ("heads not divisible", lambda: ((torch.randn(2, 8, 6, 16), *qkv(hkv=4)[1:]), {}), ValueError,
     r"q heads \(6\) must be a multiple of k/v heads \(4\).*allowed k/v head counts: 1, 2, 3, 6"),
    ("causal not bool", lambda: (qkv(), {"causal": 1}), TypeError, r"causal must be True or False, got 1"),
    ("bad alignment", lambda: (qkv(), {"causal_alignment": "bottom"}), ValueError,
     r"causal_alignment='bottom' is not supported; allowed: 'top_left'.*'bottom_right'"),
    ("window not a pair", lambda: (qkv(), {"window": 5}), TypeError, r"window must be None or a pair of ints"),
    ("window float", lambda: (qkv(), {"window": (1.5, 0)}), TypeError, r"window must be None or a pair of ints"),
    ("window below -1", lambda: (qkv(), {"window": (-2, 0)}), ValueError, r"window=\(-2, 0\) has a side below -1"),
    ("window looks ahead under causal", lambda: (qkv(), {"window": (4, 2), "causal": True}), ValueError,
     r"window=\(4, 2\) looks 2 keys ahead but causal=True forbids that"),
    ("scale zero", lambda: (qkv(), {"scale": 0.0}), ValueError, r"scale=0\.0 is out of range; allowed: 0 < scale <= 1048576"),
    ("scale overflowing float32 scores", lambda: (qkv(), {"scale": 1e38}), ValueError,
     r"scale=1e\+38 is out of range; allowed: 0 < scale <= 1048576 .*overflow"),
    ("scale nan", lambda: (qkv(), {"scale": float("nan")}), ValueError, r"scale=nan is out of range"),
    ("scale string", lambda: (qkv(), {"scale": "0.1"}), TypeError, r"scale must be a float or None, got '0\.1'"),
    ("dropout 1", lambda: (qkv(), {"dropout_p": 1.0}), ValueError, r"dropout_p=1\.0 is out of range; allowed: 0 <= dropout_p < 1"),
    ("dropout negative", lambda: (qkv(), {"dropout_p": -0.1}), ValueError, r"dropout_p=-0\.1 is out of range"),
    ("softcap negative", lambda: (qkv(), {"softcap": -1.0}), ValueError, r"softcap=-1\.0 is out of range; allowed: a finite softcap >= 0"),
    ("softcap inf", lambda: (qkv(), {"softcap": float("inf")}), ValueError, r"softcap=inf is out of range"),
    ("return_lse not bool", lambda: (qkv(), {"return_lse": "yes"}), TypeError, r"return_lse must be True or False"),
    ("alibi wrong dtype", lambda: (qkv(), {"alibi_slopes": torch.ones(4, dtype=torch.float64)}), TypeError,
     r"alibi_slopes must be float32, got torch\.float64"),
    ("alibi wrong shape", lambda: (qkv(), {"alibi_slopes": torch.ones(3)}), ValueError,
     r"alibi_slopes has shape \(3,\); allowed: \(4,\) or \(2, 4\)"),
    ("mask not bool", lambda: (qkv(), {"attn_mask": torch.zeros(8, 8)}), TypeError,
     r"attn_mask must be a bool tensor \(True = attend\), got torch\.float32; pass additive float masks as attn_bias"),
    ("mask not broadcastable", lambda: (qkv(), {"attn_mask": torch.ones(7, 8, dtype=torch.bool)}), ValueError,
     r"attn_mask shape \(7, 8\) does not broadcast to \(batch, heads_q, seqlen_q, seqlen_k\) = \(2, 4, 8, 8\)"),
    ("bias is bool", lambda: (qkv(), {"attn_bias": torch.ones(8, 8, dtype=torch.bool)}), TypeError,
     r"attn_bias must be a floating-point tensor"),
    ("bias too many dims", lambda: (qkv(), {"attn_bias": torch.ones(1, 2, 4, 8, 8)}), ValueError,
     r"attn_bias shape \(1, 2, 4, 8, 8\) does not broadcast"),
    ("cu_seqlens with dense", lambda: (qkv(), {"cu_seqlens_q": torch.tensor([0, 8], dtype=torch.int32)}),
     ValueError, r"cu_seqlens_q is only meaningful with layout='thd'"),
    ("thd without cu_seqlens", lambda: (varlen()[:3], {"layout": "thd"}), ValueError,
     r"layout='thd' needs cu_seqlens_q: an int32 tensor of cumulative sequence lengths"),
    ("cu_seqlens int64", lambda: (varlen()[:3], {"layout": "thd", "cu_seqlens_q": varlen()[3].long(),
                                                 "cu_seqlens_k": varlen()[3]}), TypeError,
     r"cu_seqlens_q must be int32, got torch\.int64"),
    ("cu_seqlens not starting at 0", lambda: (varlen()[:3], {"layout": "thd",
                                                             "cu_seqlens_q": torch.tensor([1, 3, 8], dtype=torch.int32),
                                                             "cu_seqlens_k": varlen()[3]}), ValueError,
     r"cu_seqlens_q must start at 0, got 1"),
    ("cu_seqlens decreasing", lambda: (varlen()[:3], {"layout": "thd",
                                                      "cu_seqlens_q": torch.tensor([0, 5, 3, 8], dtype=torch.int32),
                                                      "cu_seqlens_k": torch.tensor([0, 3, 5, 8], dtype=torch.int32)}),
     ValueError, r"cu_seqlens_q must be non-decreasing, got \[0, 5, 3, 8\]"),
    ("cu_seqlens wrong total", lambda: (varlen()[:3], {"layout": "thd",
                                                       "cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32),
                                                       "cu_seqlens_k": varlen()[3]}), ValueError,
     r"cu_seqlens_q ends at 7 but q has 8 tokens"),
    ("cu_seqlens count mismatch", lambda: (varlen()[:3], {"layout": "thd", "cu_seqlens_q": varlen()[3],
                                                          "cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}),
     ValueError, r"cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    ("max_seqlen too small", lambda: (varlen()[:3], {"layout": "thd", "cu_seqlens_q": varlen()[3],
                                                     "cu_seqlens_k": varlen()[3], "max_seqlen_q": 4}), ValueError,
     r"max_seqlen_q=4 is smaller than the longest sequence \(5\)"),
    ("mask with thd", lambda: (varlen()[:3], {"layout": "thd", "cu_seqlens_q": varlen()[3], "cu_seqlens_k": varlen()[3],
                                              "attn_mask": torch.ones(8, 8, dtype=torch.bool)}), ValueError,
     r"attn_mask is not supported with layout='thd'"),
]


@pytest.mark.parametrize("description,build,exc_type,pattern", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_rejected_with_a_precise_message(description, build, exc_type, pattern):
    args, kwargs = build()
    with pytest.raises(exc_type, match=pattern):
        validate_attention(*args, **kwargs)


def test_bad_input_never_reaches_an_implementation(manager):
    calls = []

    class Spy(opdispatch.AttentionImpl):
        vendor, name, priority = "spy", "impl", 1000
        caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            calls.append(call)
            return call.q

    manager.register_impl(Spy())
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        opdispatch.attention(q, k, v, dropout_p=2.0, impl="spy.impl")
    assert calls == []
    opdispatch.attention(q, k, v, impl="spy.impl")
    assert len(calls) == 1


def test_window_is_normalised():
    q, k, v = qkv()
    assert validate_attention(q, k, v, window=(-1, -1)).window is None
    assert validate_attention(q, k, v, window=(4, -1), causal=True).window == (4, 0)
    assert validate_attention(q, k, v, window=(-1, 0), causal=True).window is None
    assert validate_attention(q, k, v, window=[3, 2]).window == (3, 2)


def test_derived_sizes_for_every_layout():
    b, s, sk, h, hkv, d, dv = 2, 5, 7, 6, 3, 16, 8
    base = dict(bshd=lambda s_, h_, d_: (b, s_, h_, d_), bhsd=lambda s_, h_, d_: (b, h_, s_, d_),
                sbhd=lambda s_, h_, d_: (s_, b, h_, d_))
    for layout, shape in base.items():
        call = validate_attention(torch.randn(shape(s, h, d)), torch.randn(shape(sk, hkv, d)),
                                  torch.randn(shape(sk, hkv, dv)), layout=layout)
        assert (call.batch, call.seqlen_q, call.seqlen_k, call.heads_q, call.heads_kv, call.head_dim,
                call.head_dim_v) == (b, s, sk, h, hkv, d, dv), layout
        assert call.bhsd(call.q).shape == (b, h, s, d)
        assert call.from_bhsd(call.bhsd(call.q)).shape == call.q.shape
    q, k, v, cu = varlen((3, 6, 1))
    call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert (call.batch, call.seqlen_q, call.seqlen_k) == (3, 6, 6)


def test_requires_grad_follows_grad_mode():
    q, k, v = qkv()
    q.requires_grad_()
    assert validate_attention(q, k, v).requires_grad
    with torch.no_grad():
        assert not validate_attention(q, k, v).requires_grad
