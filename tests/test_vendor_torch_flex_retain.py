"""`retainable` (vendors/opdispatch/vendors/torch_flex/_attention.py), the wrapper that lets torch.flex's compiled graph be
backpropagated with ``retain_graph=True`` (issue 27), checked on the CPU with an ordinary ``torch.compile``d
attention (flex itself has no CPU backward; tests/gpu/test_flex_retain_graph_gpu.py runs the real kernel).

The function compiled here saves intermediates for its backward (the softcapped scores), which is what makes
AOTAutograd donate buffers; without the wrapper the same sequence raises, so these tests can fail. Every compiled
function is a fresh code object: dynamo shares graphs between torch.compile objects of one code object.
"""

from __future__ import annotations

import pytest
import torch

from opdispatch.vendors.torch_flex._attention import retainable

SOFTCAP = 3.0
SCALE = 0.25


def _make_attention():
    """A new code object per call (see the module docstring): softcapped attention returning (out, lse)."""

    def attention(q, k, v, bias):
        scores = SOFTCAP * torch.tanh(q @ k.transpose(-1, -2) * SCALE / SOFTCAP) + bias
        lse = torch.logsumexp(scores, -1)
        return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse

    return attention


def _inputs(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 7, 16, generator=gen, dtype=dtype) for _ in range(3))
    bias = torch.randn(1, 3, 7, 7, generator=gen, dtype=dtype)
    grad_out = torch.randn(2, 3, 7, 16, generator=gen, dtype=dtype)
    grad_lse = torch.randn(2, 3, 7, generator=gen, dtype=dtype)
    return (q, k, v, bias), grad_out, grad_lse


def _leaves(tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["out_grad", "out_and_lse_grad"])
def test_backward_once_then_retained_twice_match_float64_oracle(with_lse_grad):
    tensors, grad_out, grad_lse = _inputs(27 + with_lse_grad)
    fn = retainable(torch.compile(_make_attention()))

    def grads(leaves, **kw):
        out, lse = fn(*leaves)
        outputs, upstream = ((out, lse), (grad_out, grad_lse)) if with_lse_grad else ((out,), (grad_out,))
        return torch.autograd.grad(outputs, leaves, upstream, **kw), (out, lse)

    once, _ = grads(_leaves(tensors))  # an ordinary training step first: the backward compiles
    leaves = _leaves(tensors)
    out, lse = fn(*leaves)
    outputs, upstream = ((out, lse), (grad_out, grad_lse)) if with_lse_grad else ((out,), (grad_out,))
    first = torch.autograd.grad(outputs, leaves, upstream, retain_graph=True)
    second = torch.autograd.grad(outputs, leaves, upstream, retain_graph=True)
    last = torch.autograd.grad(outputs, leaves, upstream)

    oracle = _leaves(t.double() for t in tensors)
    ref_out, ref_lse = _make_attention()(*oracle)
    ref_outputs = (ref_out, ref_lse) if with_lse_grad else (ref_out,)
    ref = torch.autograd.grad(ref_outputs, oracle, tuple(g.double() for g in upstream))
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5
    for name, a, b, c, d, r in zip(("dq", "dk", "dv", "dbias"), once, first, second, last, ref):
        assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d), f"{name}: a retained backward differs"
        assert _rel(b, r) < 1e-5, f"{name}: rel err {_rel(b, r):.3g} against the float64 oracle"


def test_without_the_wrapper_the_same_sequence_raises():
    """The failure `retainable` exists for (torch 2.13 AOTAutograd, `_backward_impl`): if torch stops raising,
    this test says so and the wrapper may be dropped."""
    tensors, grad_out, _ = _inputs(5)
    bare = torch.compile(_make_attention())
    leaves = _leaves(tensors)
    torch.autograd.grad(bare(*leaves)[0], leaves, grad_out)
    leaves = _leaves(tensors)
    out, _ = bare(*leaves)
    with pytest.raises(RuntimeError, match="donated"):
        torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def test_only_requested_inputs_get_gradients_and_a_freed_graph_says_so():
    tensors, grad_out, _ = _inputs(11)
    fn = retainable(torch.compile(_make_attention()))
    q, k, v = _leaves(tensors[:3])
    bias = tensors[3]  # a constant: no gradient asked for
    out, lse = fn(q, k, v, bias)
    assert out.requires_grad and lse.requires_grad
    dq, dv = torch.autograd.grad(out, (q, v), grad_out)
    ref_q, ref_k, ref_v = _leaves(t.double() for t in tensors[:3])
    ref_out, _ = _make_attention()(ref_q, ref_k, ref_v, bias.double())
    ref_dq, ref_dv = torch.autograd.grad(ref_out, (ref_q, ref_v), grad_out.double())
    assert _rel(dq, ref_dq) < 1e-5 and _rel(dv, ref_dv) < 1e-5
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        torch.autograd.grad(out, (q,), grad_out)


def test_without_gradients_it_is_the_function_itself():
    tensors, _, _ = _inputs(3)
    attention = _make_attention()
    with torch.no_grad():
        out, lse = retainable(torch.compile(attention))(*tensors)
    ref_out, ref_lse = attention(*(t.double() for t in tensors))
    assert not out.requires_grad and _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5
