"""The output guard: a kernel's result must be the op's result for the call — structure always (on the slow path
and each signature's first call), values and inputs under OPDISPATCH_CHECK_OUTPUTS (opdispatch.engine._output_guard)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl
from opdispatch.engine._output_guard import ImplementationOutputError, same_bits, structure_problems, value_problems
from opdispatch.policies import parse_policy
from tests.conftest import randn

FAULTS = {
    "none": (lambda call: None, "returned NoneType; expected a Tensor"),
    "list": (lambda call: [call.q], "returned a list of 1; expected a Tensor"),
    "shape": (lambda call: call.q[..., :3].clone(), "returned a Tensor (1, 6, 2, 3) torch.float32 on cpu; expected "
                                                  "(1, 6, 2, 16)"),
    "dtype": (lambda call: call.q.double(), "torch.float64 on cpu; expected (1, 6, 2, 16) torch.float32"),
    "no lse": (lambda call: call.q.clone(), "expected a tuple of 2 Tensors"),
}


def oracle(q, k, v):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    p = torch.softmax(qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
    return (p @ vd).transpose(1, 2).float()


def faulty(manager, fault):
    class Faulty(AttentionImpl):
        vendor: ClassVar[str] = "faulty"
        name: ClassVar[str] = "kernel"
        caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), lse=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))
        runs = 0

        def run(self, call):
            type(self).runs += 1
            return fault(call)

    manager.register_impl(Faulty())
    manager.set_policy(parse_policy("ops: {attention: {order: [faulty.kernel, cpu.flash]}}", "<p>"))
    return Faulty


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_result_of_the_wrong_structure_is_a_kernel_failure(basic_manager, name):
    fault, message = FAULTS[name]
    cls = faulty(basic_manager, fault)
    q, k, v = (randn(1, 6, 2, 16) for _ in range(3))
    kw = {"return_lse": True} if name == "no lse" else {}
    for _ in range(3):  # the first call catches it, the class then goes to cpu.flash
        result = opdispatch.attention(q, k, v, **kw)
        out = result[0] if kw else result
        torch.testing.assert_close(out, oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert cls.runs == 1
    reason = opdispatch.explain(q, k, v, **kw).candidate("faulty.kernel").reasons[0]
    assert "ImplementationOutputError" in reason and message in reason, reason
    with pytest.raises(ImplementationOutputError) as info:
        opdispatch.attention(q, k, v, impl="faulty.kernel", **kw)  # a pin gets the error, never another kernel
    assert str(info.value).startswith("attention: faulty.kernel returned") and message in str(info.value)


def test_structure_of_each_op(basic_manager):
    x = randn(3, 8)
    call = opdispatch.validate_rms_norm(x, None, eps=1e-6, residual=randn(3, 8))
    assert structure_problems("rms_norm", call, x) == ["returned a Tensor (3, 8) torch.float32 on cpu; expected a "
                                                       "tuple of 2 Tensors"]
    assert structure_problems("rms_norm", call, (x, x)) == []
    assert structure_problems("rms_norm", call, (x, x[:, :4])) == [
        "output 1: returned a Tensor (3, 4) torch.float32 on cpu; expected (3, 8) torch.float32 on cpu"]


def test_the_debug_flag_checks_values_and_restores_inputs(monkeypatch, rng):
    monkeypatch.setenv("OPDISPATCH_PLUGINS", "cpu,reference")
    monkeypatch.setenv("OPDISPATCH_CHECK_OUTPUTS", "1")
    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    try:
        def corrupt_then_raise(call):
            call.q.mul_(0.0)
            raise RuntimeError("late failure")

        for fault in (lambda call: torch.full_like(call.q, float("nan")), corrupt_then_raise):
            faulty(manager, fault)
            q, k, v = (randn(1, 5, 2, 16, gen=rng) for _ in range(3))
            want = oracle(q, k, v)
            for _ in range(2):
                torch.testing.assert_close(opdispatch.attention(q, k, v), want, atol=2e-5, rtol=1e-4)
            reason = opdispatch.explain(q, k, v).candidate("faulty.kernel").reasons[0]
            assert "holds NaN" in reason or "changed its input(s) q and then raised RuntimeError" in reason, reason
            manager.registry._by_op["attention"].pop("faulty.kernel")
            manager.clear_cache()
            manager.breaker.clear()
    finally:
        opdispatch.set_manager(previous)


def test_without_the_flag_a_fast_path_hit_is_not_checked(basic_manager):
    """The structure is checked once per signature; a kernel that changes its answer on a later call of the same
    signature is only caught under OPDISPATCH_CHECK_OUTPUTS (documented: values and later calls cost a check)."""
    answers = iter([None, None])

    def right_then_none(call):
        return call.q.clone() if next(answers, "done") is None else None

    faulty(basic_manager, right_then_none)
    q = randn(1, 4, 2, 16)
    assert isinstance(opdispatch.attention(q, q, q), torch.Tensor)
    assert isinstance(opdispatch.attention(q, q, q), torch.Tensor)
    assert opdispatch.attention(q, q, q) is None


@pytest.fixture
def checking(monkeypatch):
    """A fresh cpu+reference manager with OPDISPATCH_CHECK_OUTPUTS=1."""
    monkeypatch.setenv("OPDISPATCH_PLUGINS", "cpu,reference")
    monkeypatch.setenv("OPDISPATCH_CHECK_OUTPUTS", "1")
    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    try:
        yield manager
    finally:
        opdispatch.set_manager(previous)


def masked_oracle(q, k, v, attn_bias=None):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if attn_bias is not None:
        scores = scores + attn_bias.double()
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2).float()


@pytest.mark.parametrize("where", ["q", "k", "v", "attn_bias"])
def test_nan_given_in_an_input_demotes_nothing(checking, rng, where):
    """A NaN the caller passes in equals itself in the input check and reaches the output without any fault of
    the kernel: nothing is demoted, the NaN rows are the oracle's, and the next clean call works."""
    q, k, v = (randn(2, 6, 2, 16, gen=rng) for _ in range(3))
    bias = randn(2, 2, 6, 6, gen=rng) if where == "attn_bias" else None  # the slow path: checked every call
    given = dict(q=q, k=k, v=v, attn_bias=bias)
    poisoned = {n: (t.clone() if t is not None else None) for n, t in given.items()}
    poisoned[where][1, 1, 0, 3] = float("nan")
    snapshot = {n: t.clone() for n, t in poisoned.items() if t is not None}
    want = masked_oracle(**poisoned)
    clean = ~torch.isnan(want)  # the oracle's NaN: what a NaN given reaches (kernels differ there: cpu.flash
    assert clean.any() and not clean.all()  # answers 0 for a query row holding NaN)
    for _ in range(3):  # the first call decides and binds, the later ones hit the fast path (no bias)
        out = opdispatch.attention(**poisoned)
        torch.testing.assert_close(out[clean], want[clean], atol=2e-5, rtol=1e-4)
    for n, t in snapshot.items():  # left as given, NaN included
        assert torch.equal(torch.isnan(poisoned[n]), torch.isnan(t)) and torch.equal(poisoned[n].nan_to_num(), t.nan_to_num())
    assert not checking.breaker
    decision = opdispatch.explain(**given)
    assert all(c.status != "demoted after raising" for c in decision.candidates)
    torch.testing.assert_close(opdispatch.attention(**given), masked_oracle(**given), atol=2e-5, rtol=1e-4)


def test_a_kernel_writing_into_a_nan_input_is_still_caught(checking, rng):
    def scribble(call):
        out = call.q.clone()
        call.k.add_(1.0)  # a write into k, which holds the caller's NaN
        return out

    cls = faulty(checking, scribble)
    q, k, v = (randn(1, 5, 2, 16, gen=rng) for _ in range(3))
    k[0, 2, 1, 4] = float("nan")
    k_given = k.clone()
    out = opdispatch.attention(q, k, v)
    want = masked_oracle(q, k_given, v)
    clean = ~torch.isnan(want)
    assert clean.any()
    torch.testing.assert_close(out[clean], want[clean], atol=2e-5, rtol=1e-4)  # cpu.flash's answer
    assert torch.equal(k.nan_to_num(), k_given.nan_to_num()) and torch.equal(k.isnan(), k_given.isnan())  # restored
    assert cls.runs == 1
    reason = opdispatch.explain(q, k, v).candidate("faulty.kernel").reasons[0]
    assert "changed its input(s) k (restored)" in reason, reason


def test_a_kernel_making_nan_from_finite_inputs_is_still_caught(checking, rng):
    def nan_row(call):
        out = torch.zeros_like(call.q)
        out[0, 0, 0, 0] = float("nan")
        return out

    cls = faulty(checking, nan_row)
    q, k, v = (randn(1, 5, 2, 16, gen=rng) for _ in range(3))
    for _ in range(2):
        torch.testing.assert_close(opdispatch.attention(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert cls.runs == 1
    assert "output 0 holds NaN" in opdispatch.explain(q, k, v).candidate("faulty.kernel").reasons[0]
    q2 = q.clone()
    q2[0, 1, 0, 0] = float("inf")  # a non-finite input: NaN may come from inf - inf, so it is not blamed
    assert value_problems(torch.full((2,), float("nan")), [q2]) == []
    assert value_problems(torch.full((2,), float("nan")), [q]) == ["output 0 holds NaN"]


def test_inputs_compare_bit_for_bit():
    nan = float("nan")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        a = torch.tensor([1.0, nan, 0.0], dtype=dtype)
        assert same_bits(a, a.clone())
        assert not same_bits(a, torch.tensor([1.0, nan, -0.0], dtype=dtype))  # a write of -0.0 is a write
        assert not same_bits(a, torch.tensor([2.0, nan, 0.0], dtype=dtype))
    c = torch.tensor([complex(nan, 1.0)])
    assert same_bits(c, c.clone()) and not same_bits(c, torch.tensor([complex(nan, 2.0)]))
    strided = torch.tensor([[1.0, nan], [3.0, 4.0]]).t()
    assert same_bits(strided, strided.clone()) and not same_bits(strided, strided.contiguous().mul(2))
    assert same_bits(torch.tensor([1, 2]), torch.tensor([1, 2])) and not same_bits(torch.tensor([1]), torch.tensor([2]))
