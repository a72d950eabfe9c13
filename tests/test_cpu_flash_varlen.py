"""cpu.flash on packed sequences (thd, each sequence through the kernel on its own) and with a v head dim other
than q/k's (zero-padded), against reference.math in float64 (the pure-torch oracle): outputs, LSE and gradients,
over causal alignments, windows, GQA, ALiBi, empty sequences and sequences without keys, and KV caches of packed
queries (spans and pages)."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch


def _packed(lens_q, lens_k, hq, hkv, d, dv, gen, dtype):
    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), hkv, dv, generator=gen).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


def _oracle(q, k, v, **kw):
    """reference.math in float64 on the same call."""
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    return leaves, opdispatch.attention(*leaves, impl="reference.math", **kw)  # ALiBi slopes stay float32


CASES = [
    # lens_q, lens_k, heads q/kv, d, dv, kwargs
    ([3, 0, 7, 1], [3, 0, 7, 1], 4, 2, 16, 16, dict(causal=True)),
    ([2, 5, 1], [6, 5, 9], 4, 1, 16, 8, dict(causal=True, causal_alignment="bottom_right")),
    ([4, 3], [2, 7], 6, 3, 8, 24, dict(causal=True, causal_alignment="top_left")),  # rows that see no key
    ([5, 6], [5, 6], 2, 2, 16, 16, dict(window=(2, 1))),
    ([3, 4], [6, 0], 4, 2, 16, 16, dict()),  # a sequence without keys
    ([4, 2], [4, 2], 4, 4, 16, 16, dict(causal=True, alibi="heads")),
    ([3, 5], [7, 5], 4, 2, 16, 16, dict(causal=True, causal_alignment="bottom_right", window=(3, 0),
                                        alibi="batch")),
]


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_packed_sequences_match_the_oracle(case, dtype, grad, basic_manager):
    lens_q, lens_k, hq, hkv, d, dv, kw = case
    kw = dict(kw)
    gen = torch.Generator().manual_seed(sum(lens_q) * 7 + d + dv)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hkv, d, dv, gen, dtype)
    alibi = kw.pop("alibi", None)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5 + 0.05
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(len(lens_q), hq, generator=gen) * 0.5 + 0.05
    kw.update(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=not grad)
    for t in (q, k, v):
        t.requires_grad_(grad)
    assert opdispatch.explain(q, k, v, **kw).chosen_id == "cpu.flash"
    got = opdispatch.attention(q, k, v, **kw)
    leaves, want = _oracle(q, k, v, **kw)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if not grad:
        (out, lse), (want_out, want_lse) = got, want
        torch.testing.assert_close(out.double(), want_out, **tol)
        finite = torch.isfinite(want_lse)
        assert (lse[~finite] == -math.inf).all(), "queries that see no key: LSE -inf"
        assert (out.double()[(~finite).T] == 0).all(), "queries that see no key: zeros"
        torch.testing.assert_close(lse[finite].double(), want_lse[finite], **tol)
        return
    torch.testing.assert_close(got.double(), want, **tol)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(got, (q, k, v), g)
    want_grads = torch.autograd.grad(want, leaves, g.double())
    for name, a, b in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a.double(), b, **(tol if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)),
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("d, dv", [(24, 8), (8, 24)], ids=["dv<d", "dv>d"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_v_head_dim_other_than_qks_is_zero_padded_exactly(layout, d, dv, causal, basic_manager):
    gen = torch.Generator().manual_seed(d * 3 + dv + causal)
    b, sq, sk, hq, hkv = 2, 5, 7, 4, 2
    shape = {"bshd": lambda s, h, e: (b, s, h, e), "bhsd": lambda s, h, e: (b, h, s, e),
             "sbhd": lambda s, h, e: (s, b, h, e)}[layout]
    q = torch.randn(shape(sq, hq, d), generator=gen).requires_grad_()
    k = torch.randn(shape(sk, hkv, d), generator=gen).requires_grad_()
    v = torch.randn(shape(sk, hkv, dv), generator=gen).requires_grad_()
    kw = dict(layout=layout, causal=causal, causal_alignment="bottom_right")
    assert opdispatch.explain(q, k, v, **kw).chosen_id == "cpu.flash"
    out, lse = opdispatch.attention(q, k, v, return_lse=True, **kw)
    assert out.shape[-1] == dv
    leaves, (want, want_lse) = _oracle(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    for a, w in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, leaves, g.double())):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["spans", "pages"])
def test_packed_queries_over_a_kv_cache(paged, basic_manager):
    """Packed queries over a KV cache: each sequence's first seqused_k keys of its span, or of its pages."""
    gen = torch.Generator().manual_seed(11 + paged)
    hq, hkv, d = 4, 2, 16
    lens_q, used = [2, 1, 3], [5, 0, 9]
    q = torch.randn(sum(lens_q), hq, d, generator=gen)
    cu_q = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    kw = dict(layout="thd", cu_seqlens_q=cu_q, seqused_k=torch.tensor(used, dtype=torch.int32), causal=True,
              causal_alignment="bottom_right", return_lse=True)
    if paged:
        page = 4
        k = torch.randn(8, page, hkv, d, generator=gen)
        v = torch.randn(8, page, hkv, d, generator=gen)
        kw["block_table"] = torch.tensor([[3, 1, 99], [0, 99, 99], [5, 2, 7]], dtype=torch.int32)  # 99: unused
    else:
        spans = [6, 2, 10]
        k = torch.randn(sum(spans), hkv, d, generator=gen)
        v = torch.randn(sum(spans), hkv, d, generator=gen)
        kw["cu_seqlens_k"] = torch.tensor([0, 6, 8, 18], dtype=torch.int32)
    assert opdispatch.explain(q, k, v, **kw).chosen_id == "cpu.flash"
    out, lse = opdispatch.attention(q, k, v, **kw)
    want, want_lse = opdispatch.attention(q.double(), k.double(), v.double(), impl="reference.math", **kw)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite].double(), want_lse[finite], atol=1e-5, rtol=1e-5)
    assert (lse[~finite] == -math.inf).all()
