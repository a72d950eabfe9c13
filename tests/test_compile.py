"""torch.compile support: the opdispatch::attention custom op, its fake kernel, autograd, trace-time decision."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.compile import _compile
from opdispatch.compile._compile import attention_for_compile, fake_outputs

from .conftest import TOLERANCES, randn


@pytest.fixture(autouse=True)
def _fresh_dynamo(basic_manager: opdispatch.OpManager):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def resolve_calls(basic_manager: opdispatch.OpManager, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every resolve() of the manager, by chosen implementation id."""
    seen: list[str] = []
    original = basic_manager.resolve

    def counting(op, call, **kwargs):
        decision = original(op, call, **kwargs)
        seen.append(decision.chosen_id)
        return decision

    monkeypatch.setattr(basic_manager, "resolve", counting)
    return seen


class Block(torch.nn.Module):
    """A projection, attention through opdispatch, and an output projection."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, **attn_kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)
        self.attn_kwargs = attn_kwargs

    def forward(self, x: torch.Tensor, attend=attention_for_compile) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        o = attend(q, k, v, **self.attn_kwargs)
        return self.out(o.reshape(b, s, -1))


def _eager(q, k, v, **kwargs):
    return opdispatch.attention(q, k, v, **kwargs)


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(), dict(causal=True, window=(4, 0))],
                         ids=["causal", "full", "window"])
def test_compiled_block_matches_eager_forward_and_backward(kwargs, resolve_calls):
    model = Block(**kwargs)
    x = randn(2, 16, 32, gen=torch.Generator().manual_seed(0))
    expected = model(x, attend=_eager)
    expected_grads = _grads(model, expected.square().mean())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    resolve_calls.clear()
    for _ in range(3):
        got = compiled(x)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    for g, e in zip(_grads(model, compiled(x).square().mean()), expected_grads):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float32])
    # One decision, made while tracing; calls and the backward never ask the manager again.
    assert resolve_calls == ["cpu.flash"]


def test_no_graph_break():
    model = Block(causal=True)
    x = randn(2, 8, 32)
    report = torch._dynamo.explain(model)(x)
    assert report.graph_break_count == 0
    assert report.graph_count == 1


def test_decision_is_a_graph_constant():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    q = randn(1, 8, 2, 16)
    fn = torch.compile(lambda q: attention_for_compile(q, q, q, layout="bshd"), backend=backend, fullgraph=True)
    fn(q)
    code = graphs[0].code
    assert "torch.ops.opdispatch.attention" in code
    assert "'cpu.flash'" in code


def test_pin_is_baked_in(resolve_calls):
    q, k, v = (randn(1, 8, 2, 16) for _ in range(3))
    fn = torch.compile(lambda q, k, v: attention_for_compile(q, k, v, impl="reference.math"), backend="aot_eager",
                       fullgraph=True)
    got = fn(q, k, v)
    assert resolve_calls == ["reference.math"]
    torch.testing.assert_close(got, _eager(q, k, v, impl="reference.math"))


def test_invalidate_makes_graphs_redecide(resolve_calls):
    q = randn(1, 8, 2, 16)
    fn = torch.compile(lambda q: attention_for_compile(q, q, q), backend="aot_eager", fullgraph=True)
    fn(q)
    fn(q)
    assert len(resolve_calls) == 1
    _compile.invalidate_compiled_decisions()
    fn(q)
    assert len(resolve_calls) == 2


def test_new_shape_is_a_new_decision(resolve_calls):
    fn = torch.compile(lambda q: attention_for_compile(q, q, q), backend="aot_eager", fullgraph=True, dynamic=False)
    fn(randn(1, 8, 2, 16))
    fn(randn(1, 8, 2, 16))
    fn(randn(2, 12, 2, 16))
    assert len(resolve_calls) == 2


def _optional_cases():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(2, 6, 4, 8, gen=gen) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6, generator=gen) > 0.3
    mask[..., 0] = True
    lengths = [3, 5, 4]
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    tq, tk, tv = (randn(12, 4, 8, gen=gen) for _ in range(3))
    return {
        "mask": ((q, k, v), dict(attn_mask=mask)),
        "bias": ((q, k, v), dict(attn_bias=randn(6, 6, gen=gen))),
        "alibi": ((q, k, v), dict(alibi_slopes=torch.rand(4, generator=gen), causal=True)),
        "softcap+lse": ((q, k, v), dict(softcap=5.0, return_lse=True)),
        "bhsd+lse": ((q, k, v), dict(layout="bhsd", return_lse=True, causal=True)),
        "sbhd+lse": ((q, k, v), dict(layout="sbhd", return_lse=True)),
        "thd+lse": ((tq, tk, tv), dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                       max_seqlen_k=max(lengths), causal=True, return_lse=True)),
    }


@pytest.mark.parametrize("case", list(_optional_cases()))
def test_optional_tensors_and_layouts(case):
    (q, k, v), kwargs = _optional_cases()[case]
    expected = _eager(q, k, v, **kwargs)
    fn = torch.compile(lambda q, k, v: attention_for_compile(q, k, v, **kwargs), backend="aot_eager",
                       fullgraph=True)
    got = fn(q, k, v)
    if kwargs.get("return_lse"):
        assert got[1].shape == expected[1].shape and got[1].dtype == torch.float32
        torch.testing.assert_close(got[1], expected[1], **TOLERANCES[torch.float32])
        got, expected = got[0], expected[0]
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_bias_gradient_flows_through_the_op():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 5, 2, 8, gen=gen, requires_grad=True) for _ in range(3))
    bias = randn(5, 5, gen=gen, requires_grad=True)
    out = attention_for_compile(q, k, v, attn_bias=bias)  # eager: the custom op's own autograd
    grads = torch.autograd.grad(out.sum(), [q, k, v, bias])
    ref = torch.autograd.grad(_eager(q, k, v, attn_bias=bias).sum(), [q, k, v, bias])
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, **TOLERANCES[torch.float32])


def test_lse_gradient_flows_through_the_op():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn(1, 5, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kwargs = dict(return_lse=True, causal=True, impl="reference.math")
    out, lse = attention_for_compile(q, k, v, **kwargs)
    assert lse.dtype == torch.float64
    grads = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v])
    rout, rlse = _eager(q, k, v, **kwargs)
    ref = torch.autograd.grad(rout.sum() + rlse.sum(), [q, k, v])
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, **TOLERANCES[torch.float64])


@pytest.mark.parametrize("layout,shape", [("bshd", (2, 7, 4, 8)), ("bhsd", (2, 4, 7, 8)), ("sbhd", (7, 2, 4, 8)),
                                          ("thd", (14, 4, 8))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fake_outputs_match_real_results(layout, shape, dtype):
    q = randn(*shape, dtype=dtype)
    v = randn(*shape[:-1], 16, dtype=dtype)
    kwargs: dict = dict(layout=layout, return_lse=True)
    if layout == "thd":
        cu = torch.tensor([0, 7, 14], dtype=torch.int32)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    out, lse = _eager(q, q, v, impl="reference.math", **kwargs)
    fake_out, fake_lse = fake_outputs(q.to("meta"), v.to("meta"), layout, True)
    assert (fake_out.shape, fake_out.dtype) == (out.shape, out.dtype)
    assert (fake_lse.shape, fake_lse.dtype) == (lse.shape, lse.dtype)
    got_out, got_lse = attention_for_compile(q, q, v, max_seqlen_q=7 if layout == "thd" else None,
                                             max_seqlen_k=7 if layout == "thd" else None, **kwargs)
    assert (got_lse.shape, got_lse.dtype) == (lse.shape, lse.dtype)
    assert got_out.is_contiguous() and got_out.shape == out.shape
    assert fake_outputs(q.to("meta"), v.to("meta"), layout, False)[1].shape == (0,)


def test_errors_are_raised_while_tracing():
    q = randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="causal_alignment"):
        attention_for_compile(q, q, q, causal_alignment="middle")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    t = randn(4, 2, 8)
    with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k"):
        attention_for_compile(t, t, t, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    g = randn(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="dropout"):
        attention_for_compile(g, g, g, dropout_p=0.1)


@pytest.mark.slow
def test_inductor_fullgraph_matches_eager():
    model = Block(causal=True)
    x = randn(2, 16, 32, gen=torch.Generator().manual_seed(1))
    expected = model(x, attend=_eager)
    expected_grads = _grads(model, expected.square().mean())
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    for g, e in zip(_grads(model, compiled(x).square().mean()), expected_grads):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float32])


# -- the compiled backward: the implementation's own backward, or a recompute ----------------------------------

@pytest.fixture
def cpu_flash_calls(basic_manager: opdispatch.OpManager, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often cpu.flash's run() and backward() are entered (wrapping the real ones)."""
    from opdispatch.vendors.cpu._attention import CpuFlashAttention

    counts = {"run": 0, "backward": 0, "backward_used": 0}
    run, backward = CpuFlashAttention.run, CpuFlashAttention.backward

    def counting_run(self, call):
        counts["run"] += 1
        return run(self, call)

    def counting_backward(self, call, out, lse, grad_out):
        counts["backward"] += 1
        grads = backward(self, call, out, lse, grad_out)
        counts["backward_used"] += grads is not None
        return grads

    monkeypatch.setattr(CpuFlashAttention, "run", counting_run)
    monkeypatch.setattr(CpuFlashAttention, "backward", counting_backward)
    return counts


def _oracle_grads(q, k, v, grad_out, layout, causal=False, mask=None):
    """float64 gradients of the oracle (naive row-by-row attention) for tensors in `layout`."""
    from .test_numerics import naive_attention

    to_bhsd = {"bshd": lambda t: t.transpose(1, 2), "bhsd": lambda t: t,
               "sbhd": lambda t: t.permute(1, 2, 0, 3)}[layout]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = naive_attention(*(to_bhsd(t) for t in leaves), scale=q.shape[-1] ** -0.5, causal=causal, mask=mask)
    return torch.autograd.grad(out, leaves, to_bhsd(grad_out.double()))


@pytest.mark.parametrize("layout,shape,kv_heads", [("bshd", (2, 7, 4, 8), 2), ("bhsd", (1, 4, 6, 16), 4),
                                                   ("sbhd", (5, 2, 4, 8), 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_op", "compiled"])
def test_backward_uses_the_implementations_own_backward(layout, shape, kv_heads, causal, compiled,
                                                        cpu_flash_calls):
    gen = torch.Generator().manual_seed(11)
    heads_dim = {"bshd": 2, "bhsd": 1, "sbhd": 2}[layout]
    kv_shape = list(shape)
    kv_shape[heads_dim] = kv_heads
    # Strided inputs: each tensor is a slice of a wider one.
    q = randn(*shape[:-1], 2 * shape[-1], gen=gen, dtype=torch.float64)[..., ::2].requires_grad_()
    k, v = (randn(*kv_shape, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = randn(*shape, gen=gen, dtype=torch.float64)
    fn = lambda q, k, v: attention_for_compile(q, k, v, layout=layout, causal=causal)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    # One forward: the backward came from cpu.flash's own backward, not from running the forward again.
    assert cpu_flash_calls == {"run": 1, "backward": 1, "backward_used": 1}
    for got, want in zip(grads, _oracle_grads(q, k, v, grad_out, layout, causal=causal)):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64])


def test_a_declined_backward_recomputes_the_forward(cpu_flash_calls):
    gen = torch.Generator().manual_seed(12)
    q, k, v = (randn(1, 6, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(6, 6, generator=gen) > 0.3
    mask[:, 0] = True  # every query sees a key
    grad_out = randn(1, 6, 2, 8, gen=gen, dtype=torch.float64)
    out = attention_for_compile(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    # cpu.flash declines masked calls (its LSE is adjusted there): the backward ran the forward again.
    assert cpu_flash_calls == {"run": 2, "backward": 1, "backward_used": 0}
    for got, want in zip(grads, _oracle_grads(q, k, v, grad_out, "bshd", mask=mask)):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64])


def test_a_call_returning_its_lse_recomputes_the_forward(cpu_flash_calls):
    gen = torch.Generator().manual_seed(13)
    q, k, v = (randn(1, 5, 2, 8, gen=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad_out = randn(1, 5, 2, 8, gen=gen, dtype=torch.float64)
    out, _lse = attention_for_compile(q, k, v, return_lse=True, causal=True)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    # The caller holds the LSE: an implementation's own backward (which takes no LSE gradient) is not used.
    assert cpu_flash_calls["backward"] == 0 and cpu_flash_calls["run"] == 2
    for got, want in zip(grads, _oracle_grads(q, k, v, grad_out, "bshd", causal=True)):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float64])


def test_a_backward_returning_the_wrong_shapes_is_a_clear_error(basic_manager, monkeypatch):
    from opdispatch.vendors.cpu._attention import CpuFlashAttention

    monkeypatch.setattr(CpuFlashAttention, "backward", lambda self, call, out, lse, grad_out: (grad_out,))
    q, k, v = (randn(1, 5, 2, 8, requires_grad=True) for _ in range(3))
    out = attention_for_compile(q, k, v)
    with pytest.raises(RuntimeError, match=r"cpu\.flash\.backward must return \(dq, dk, dv\)"):
        out.sum().backward()


def test_constant_result_marks_functions_as_torch_does():
    """opdispatch marks its trace-time constants without importing Dynamo; the marker must be torch's own."""
    from opdispatch.compile._compile_ops import constant_result

    def by_torch():
        return 0

    def by_opdispatch():
        return 0

    torch.compiler.assume_constant_result(by_torch)
    constant_result(by_opdispatch)
    marks = {k: v for k, v in vars(by_torch).items()}
    assert marks and marks == {k: v for k, v in vars(by_opdispatch).items()}
