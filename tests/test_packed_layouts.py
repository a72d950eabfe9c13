"""Packed q/k/v layouts (`opdispatch.attention_packed`, `packed_views`): every name, against a float64 oracle that
reads the packed tensor itself, forward and gradients, no copies, and the errors."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from opdispatch import PACKED_LAYOUTS, attention_packed, packed_views

HEADS_Q, HEADS_KV, DIM = 4, 2, 8
LENGTHS = [3, 1, 6]  # thd sequences


def _take(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return t.narrow(dim, i, 1).squeeze(dim)


def _to_bshd(t: torch.Tensor, base: str) -> torch.Tensor:
    return t.transpose(0, 1) if base == "sbhd" else t


def _oracle_bshd(q, k, v, causal):
    """(b, s, h, d) float64 attention, GQA by repeating kv heads, causal top-left."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _oracle(layout, packed, kv, causal):
    """The expected output in the base layout, read from the packed tensors with narrow (not unbind)."""
    spec = PACKED_LAYOUTS[layout]
    if spec.tensors == 3:
        q, k, v = (_take(packed, spec.dim, i) for i in range(3))
    else:
        q, k, v = packed, _take(kv, spec.dim, 0), _take(kv, spec.dim, 1)
    if spec.base != "thd":
        out = _oracle_bshd(*(_to_bshd(t, spec.base) for t in (q, k, v)), causal)
        return _to_bshd(out, spec.base)
    outs, start = [], 0
    for n in LENGTHS:
        rows = slice(start, start + n)
        outs.append(_oracle_bshd(q[rows][None], k[rows][None], v[rows][None], causal)[0])
        start += n
    return torch.cat(outs)


def _packed_inputs(layout, gen):
    spec = PACKED_LAYOUTS[layout]
    seq = (sum(LENGTHS),) if spec.base == "thd" else ((2, 5) if spec.base == "bshd" else (5, 2))
    heads = HEADS_Q if spec.tensors == 3 else HEADS_KV
    inner = [heads, DIM]
    inner.insert(spec.dim - len(seq), spec.tensors)
    packed = torch.randn(*seq, *inner, generator=gen, dtype=torch.float64).float()
    if spec.tensors == 3:
        return packed, None
    return torch.randn(*seq, HEADS_Q, DIM, generator=gen).float(), packed


def _thd_kwargs(layout):
    if PACKED_LAYOUTS[layout].base != "thd":
        return {}
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENGTHS), max_seqlen_k=max(LENGTHS))


def test_the_names_are_transformer_engines_packed_layouts():
    assert sorted(PACKED_LAYOUTS) == sorted([
        "bs3hd", "bsh3d", "sb3hd", "sbh3d", "t3hd", "th3d",
        "bshd_bs2hd", "bshd_bsh2d", "sbhd_sb2hd", "sbhd_sbh2d", "thd_t2hd", "thd_th2d"])


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
def test_packed_layouts_match_the_oracle_forward_and_backward(layout, causal, manager):
    gen = torch.Generator().manual_seed(len(layout) * 3 + causal)
    packed, kv = _packed_inputs(layout, gen)
    leaves = [t.requires_grad_() for t in (packed, kv) if t is not None]
    out = attention_packed(packed, kv, layout=layout, causal=causal, **_thd_kwargs(layout))
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = _oracle(layout, leaves64[0], leaves64[1] if kv is not None else None, causal)
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, grad_out)
    want_grads = torch.autograd.grad(want, leaves64, grad_out.double())
    for g, w, leaf in zip(grads, want_grads, leaves):
        assert g.shape == leaf.shape  # one gradient for the packed tensor
        torch.testing.assert_close(g.double(), w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_views_share_the_packed_memory_and_the_kernel_reads_them_uncopied(layout, manager):
    gen = torch.Generator().manual_seed(7)
    packed, kv = _packed_inputs(layout, gen)
    q, k, v, base = packed_views(layout, packed, kv)
    assert base == PACKED_LAYOUTS[layout].base
    holder = packed if kv is None else kv
    for t in (k, v) if kv is not None else (q, k, v):
        assert t.untyped_storage().data_ptr() == holder.untyped_storage().data_ptr()
        assert t.stride(-1) == 1
    call = opdispatch.validate_attention(q, k, v, layout=base, **_thd_kwargs(layout))
    manager.ensure_initialized()
    decision = manager.explain("attention", call)
    impl = manager.registry.get("attention", decision.chosen_id).impl
    conformed = impl.conform(call)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip((conformed.q, conformed.k, conformed.v), (q, k, v))), \
        decision.chosen_id


def test_packed_attention_traces_without_graph_breaks(manager):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 6, 3, HEADS_Q, DIM, generator=gen)

    def f(t):
        return attention_packed(t, layout="bs3hd", causal=True)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(qkv).double(), _oracle("bs3hd", qkv, None, True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("args, layout, message", [
    ((torch.randn(2, 5, 3, 4, 8),), "bs4hd", r"packed layout 'bs4hd' is not known; allowed: bs3hd, .*thd_th2d"),
    ((torch.randn(2, 5, 3, 4, 8),), "bshd", r"plain layouts bshd, bhsd, sbhd, thd take q, k, v as separate"),
    ((torch.randn(2, 5, 4, 3, 8),), "bs3hd", r"qkv has 4 entries in dim 2 \(shape \(2, 5, 4, 3, 8\)\), where it "
                                             r"packs 3 tensors \(b, s, 3, h, d\)"),
    ((torch.randn(10, 3, 4, 8),), "bs3hd", r"qkv must be a 5-D tensor \(b, s, 3, h, d\), got \(10, 3, 4, 8\)"),
    ((torch.randn(2, 5, 4, 8),), "bshd_bs2hd", r"takes q and a tensor holding k and v: attention_packed\(q, kv"),
    ((torch.randn(2, 5, 3, 4, 8), torch.randn(2, 5, 2, 4, 8)), "bs3hd", r"pass it alone .* use 'bshd_bs2hd'"),
    ((torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 4, 8)), "bshd_bsh2d",
     r"kv has 4 entries in dim 3 .* packs 2 tensors \(b, s, h, 2, d\)"),
    ((torch.randn(5, 4, 8), torch.randn(2, 5, 2, 4, 8)), "bshd_bs2hd", r"q must be a 4-D bshd tensor, got \(5, 4, 8\)"),
])
def test_packed_layout_errors_name_the_value_and_what_is_allowed(args, layout, message):
    with pytest.raises(ValueError, match=message):
        attention_packed(*args, layout=layout)
