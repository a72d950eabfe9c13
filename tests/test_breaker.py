"""The runtime breaker: a kernel that raises is demoted for the failing call's signature, then for its call class
once it failed on two distinct signatures; the next one takes the call, and the demoted one is retried a bounded
number of times (opdispatch.engine._breaker). Time is the breaker's injected clock: no test reads the wall clock."""

from __future__ import annotations

import logging
import types
from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl, NoImplementationError
from opdispatch.engine._breaker import CLASS, RETRY_AFTER_S, SIGNATURE, Breaker
from opdispatch.policies import parse_policy
from tests.conftest import randn


class FakeClock:
    """The breaker's clock in tests: time moves only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Flaky(AttentionImpl):
    """Raises while `failing` is set — at every length, or at the key lengths in `failing_lengths` — counting its
    runs; otherwise computes attention itself, in float64."""

    vendor: ClassVar[str] = "flaky"
    name: ClassVar[str] = "kernel"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))
    runs = 0
    failing = True
    failing_lengths: ClassVar[frozenset[int] | None] = None
    error: ClassVar[type[BaseException]] = RuntimeError

    def run(self, call):
        type(self).runs += 1
        lengths = type(self).failing_lengths
        if type(self).failing and (lengths is None or call.seqlen_k in lengths):
            raise type(self).error("CUDA error: misaligned address")
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        p = torch.softmax(q @ k.transpose(-1, -2) * call.scale, -1)
        return call.from_bhsd((p @ v).to(call.dtype))


@pytest.fixture
def clock(basic_manager):
    fake = FakeClock()
    basic_manager.breaker.clock = fake
    return fake


@pytest.fixture
def flaky(basic_manager, clock, monkeypatch):
    monkeypatch.setattr(Flaky, "runs", 0)
    monkeypatch.setattr(Flaky, "failing", True)
    monkeypatch.setattr(Flaky, "failing_lengths", None)
    basic_manager.register_impl(Flaky())
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [flaky.kernel, cpu.flash, reference.math]}}",
                                          "<p>"))
    return basic_manager


def oracle(q, k, v):
    """Non-causal bshd attention in float64, written out here."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2).float()


def test_one_failing_signature_is_demoted_alone_and_two_demote_the_class(flaky, door, caplog, monkeypatch):
    """The kernel fails at seqlen 6 only: the other lengths of the class keep it; a second failing length (9)
    demotes the whole class, and each WARNING names the failing call, the scope and the retry."""
    monkeypatch.setattr(Flaky, "failing_lengths", frozenset({6, 9}))
    gen = torch.Generator().manual_seed(0)
    caplog.set_level(logging.INFO, logger="opdispatch")

    def run(seqlen, calls=3):
        for _ in range(calls):
            q, k, v = (randn(2, seqlen, 4, 16, gen=gen) for _ in range(3))
            torch.testing.assert_close(door(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
        return q, k, v

    run(5)  # the class's first call: the kernel takes it
    assert Flaky.runs == 3
    six = run(6, calls=50)  # fails once, then cpu.flash takes seqlen 6 (not retried per call)
    assert Flaky.runs == 4
    five = run(5)
    seven = run(7)
    assert Flaky.runs == 10  # every other length of the class still runs on the kernel
    assert opdispatch.explain(*five).chosen_id == "flaky.kernel" == opdispatch.explain(*seven).chosen_id
    decision = opdispatch.explain(*six)
    assert decision.chosen_id == "cpu.flash"
    reason = decision.candidate("flaky.kernel").reasons[0]
    assert decision.candidate("flaky.kernel").status == "demoted after raising"
    assert "raised RuntimeError: CUDA error: misaligned address at run time (once; last on [layout=bshd " \
        "q=(2, 6, 4, 16)" in reason and "for this call signature" in reason and "retried in 60 s" in reason, reason
    assert "pin it with impl=" in reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "q=(2, 6, 4, 16)" in warnings[0] and "q=(2, 5, 4, 16)" not in warnings[0]
    assert "demoted for this call signature" in warnings[0] and "retried in 60 s" in warnings[0]

    nine = run(9, calls=10)  # a second distinct failing signature: the whole class goes
    assert Flaky.runs == 11
    run(5)
    run(7)
    run(8)
    assert Flaky.runs == 11  # no length of the class runs on it now
    for call in (five, seven, nine):
        decision = opdispatch.explain(*call)
        assert decision.chosen_id == "cpu.flash"
        reason = decision.candidate("flaky.kernel").reasons[0]
        assert "for its whole call class" in reason and "last on [layout=bshd q=(2, 9, 4, 16)" in reason, reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "q=(2, 9, 4, 16)" in warnings[1] and "whole call class" in warnings[1]
    assert "retried in 60 s" in warnings[1]
    # Another class (causal) is untouched by either demotion.
    q = randn(1, 5, 2, 16)
    door(q, q, q, causal=True)
    assert Flaky.runs == 12 and opdispatch.explain(q, q, q, causal=True).chosen_id == "flaky.kernel"


def test_a_pin_never_falls_back_after_a_signature_demotion(flaky, door):
    q = randn(1, 8, 2, 16)
    door(q, q, q)
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="misaligned address"):
            door(q, q, q, impl="flaky.kernel")
    assert opdispatch.explain(q, q, q, impl="flaky.kernel").chosen_id == "flaky.kernel"
    assert Flaky.runs == 3


def test_the_breaker_reads_only_its_clock():
    """Demotions and retries are measured on the injected clock alone (monotonic by default)."""
    import time

    assert Breaker().clock is time.monotonic
    clock = FakeClock(5.0)
    breaker = Breaker(clock=clock)
    demotion, loud = breaker.record("class", ("sig", 1), "a.kernel", RuntimeError("boom"), "q=(1, 1)")
    assert loud and demotion.scope == SIGNATURE and demotion.retry_at == 5.0 + RETRY_AFTER_S[0]
    assert breaker.active("class", ("sig", 1), "a.kernel", clock()) is demotion
    assert breaker.active("class", ("sig", 2), "a.kernel", clock()) is None  # another signature: not demoted
    assert breaker.holds_for_signature("class", ("sig", 1), clock())
    clock.advance(RETRY_AFTER_S[0])
    assert breaker.active("class", ("sig", 1), "a.kernel", clock()) is None  # its retry is due
    demotion, loud = breaker.record("class", ("sig", 1), "a.kernel", RuntimeError("boom"), "q=(1, 1)")
    assert not loud and demotion.failures == 2 and demotion.retry_at == clock() + RETRY_AFTER_S[1]
    demotion, loud = breaker.record("class", ("sig", 2), "a.kernel", RuntimeError("bang"), "q=(1, 2)")
    assert loud and demotion.scope == CLASS and demotion.failures == 1 and demotion.call == "q=(1, 2)"
    assert breaker.active("class", None, "a.kernel", clock()) is demotion
    assert breaker.active("other class", ("sig", 2), "a.kernel", clock()) is None


def test_another_class_still_tries_the_kernel_and_a_pin_never_falls_back(flaky):
    q = randn(1, 8, 2, 16)
    opdispatch.attention(q, q, q)
    assert Flaky.runs == 1
    opdispatch.attention(q, q, q, causal=True)  # another class: its own try, its own demotion
    assert Flaky.runs == 2
    with pytest.raises(RuntimeError, match="misaligned address"):
        opdispatch.attention(q, q, q, impl="flaky.kernel")
    flaky.set_policy(parse_policy("ops: {attention: {rules: [{name: p, pin: flaky.kernel}]}}", "<p>"))
    with pytest.raises(RuntimeError, match="misaligned address"):
        opdispatch.attention(q, q, q)


def test_off_raises_and_out_of_memory_is_never_a_fallback(flaky, monkeypatch):
    q = randn(1, 8, 2, 16)
    monkeypatch.setattr(Flaky, "error", torch.OutOfMemoryError)
    with pytest.raises(torch.OutOfMemoryError):
        opdispatch.attention(q, q, q)
    monkeypatch.setattr(Flaky, "error", RuntimeError)
    flaky.set_policy(parse_policy("settings: {fallback_on_error: false}\n"
                                  "ops: {attention: {order: [flaky.kernel, cpu.flash]}}", "<p>"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="misaligned address"):
            opdispatch.attention(q, q, q)
    assert Flaky.runs == 3


def test_a_fast_path_hit_that_starts_failing_falls_over(flaky, monkeypatch):
    monkeypatch.setattr(Flaky, "failing", False)
    q, k, v = (randn(1, 9, 2, 16) for _ in range(3))
    for _ in range(3):
        opdispatch.attention(q, k, v)
    assert Flaky.runs == 3 and opdispatch.explain(q, k, v).chosen_id == "flaky.kernel"
    monkeypatch.setattr(Flaky, "failing", True)  # e.g. a library that broke after a driver event
    for _ in range(5):
        torch.testing.assert_close(opdispatch.attention(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert Flaky.runs == 4


def test_plans_fail_over_once_and_rebind(flaky):
    q, k, v = (randn(1, 7, 2, 16) for _ in range(3))
    fn = opdispatch.plan(q, k, v)
    for _ in range(50):
        torch.testing.assert_close(fn(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert Flaky.runs == 1


def test_every_candidate_raising_lists_each_error(basic_manager, monkeypatch):
    monkeypatch.setattr(Flaky, "runs", 0)
    monkeypatch.setattr(Flaky, "failing", True)

    class Flaky2(Flaky):
        name: ClassVar[str] = "other"

    basic_manager.register_impl(Flaky())
    basic_manager.register_impl(Flaky2())
    basic_manager.set_policy(parse_policy(
        "ops: {attention: {rules: [{name: only-flaky, require: ['flaky.*']}]}}", "<p>"))
    q = randn(1, 8, 2, 16)
    with pytest.raises(NoImplementationError) as info:
        opdispatch.attention(q, q, q)
    text = str(info.value)
    assert text.count("demoted after raising") == 2 and text.count("misaligned address") == 2
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_retry_of_a_signature_is_bounded(flaky, clock, door):
    q = randn(1, 8, 2, 16)
    door(q, q, q)
    assert Flaky.runs == 1
    clock.advance(RETRY_AFTER_S[0] - 1)
    door(q, q, q)
    assert Flaky.runs == 1  # not yet
    clock.advance(2)
    door(q, q, q)  # the fast path's bound function notices the retry is due
    assert Flaky.runs == 2
    reason = opdispatch.explain(q, q, q).candidate("flaky.kernel").reasons[0]
    assert "(2 times" in reason and "for this call signature" in reason and "retried in 600 s" in reason, reason
    clock.advance(RETRY_AFTER_S[1] + 1)
    door(q, q, q)
    assert Flaky.runs == 3
    reason = opdispatch.explain(q, q, q).candidate("flaky.kernel").reasons[0]
    assert "demoted for this call signature" in reason and "for the rest of the process" in reason, reason
    clock.advance(10 * RETRY_AFTER_S[1])
    door(q, q, q)
    assert Flaky.runs == 3
    assert opdispatch.explain(*(randn(1, 9, 2, 16),) * 3).chosen_id == "flaky.kernel"  # one signature only


def test_the_retry_of_a_class_is_bounded(flaky, clock, door):
    calls = [(randn(1, n, 2, 16),) * 3 for n in (4, 5, 6, 7)]
    door(*calls[0])
    door(*calls[1])  # a second signature: the class is demoted
    assert Flaky.runs == 2
    for call in calls:
        door(*call)
    assert Flaky.runs == 2
    clock.advance(RETRY_AFTER_S[0] + 1)  # both signatures' and the class's retries are due
    door(*calls[2])
    assert Flaky.runs == 3  # retried once for the class, and demoted for it again
    for call in calls:
        door(*call)
    assert Flaky.runs == 3
    reason = opdispatch.explain(*calls[3]).candidate("flaky.kernel").reasons[0]
    assert "(2 times; last on [layout=bshd q=(1, 6, 2, 16)" in reason and "whole call class" in reason, reason
    clock.advance(RETRY_AFTER_S[1] + 1)
    door(*calls[3])
    assert Flaky.runs == 4
    assert "for the rest of the process" in opdispatch.explain(*calls[0]).candidate("flaky.kernel").reasons[0]
    clock.advance(100 * RETRY_AFTER_S[1])
    for call in calls:
        door(*call)
    assert Flaky.runs == 4


def test_a_retry_that_succeeds_takes_the_signature_back(flaky, clock, door):
    q = randn(1, 8, 2, 16)
    door(q, q, q)
    Flaky.failing = False
    clock.advance(RETRY_AFTER_S[0] + 1)
    torch.testing.assert_close(door(q, q, q), oracle(q, q, q), atol=2e-5, rtol=1e-4)
    assert opdispatch.explain(q, q, q).chosen_id == "flaky.kernel" and Flaky.runs == 2
    door(q, q, q)
    assert Flaky.runs == 3


def test_other_ops_fail_over_through_their_generated_front_door(basic_manager, monkeypatch):
    from opdispatch import RmsNormCaps, RmsNormImpl

    runs = []

    class BrokenNorm(RmsNormImpl):
        vendor: ClassVar[str] = "flaky"
        name: ClassVar[str] = "norm"
        caps: ClassVar[RmsNormCaps] = RmsNormCaps(dtypes=frozenset({torch.float32}))

        def run(self, call):
            runs.append(1)
            raise RuntimeError("no kernel image is available")

    basic_manager.register_impl(BrokenNorm())
    basic_manager.set_policy(parse_policy("ops: {rms_norm: {order: [flaky.norm]}}", "<p>"))
    x, w = randn(3, 32), randn(32)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    for _ in range(4):
        torch.testing.assert_close(opdispatch.rms_norm(x, w, eps=1e-6), want.float(), atol=1e-5, rtol=1e-5)
    assert len(runs) == 1


def test_turning_fallback_off_forgets_demotions_for_new_decisions(flaky):
    q = randn(1, 8, 2, 16)
    opdispatch.attention(q, q, q)
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"
    flaky.set_policy(parse_policy("settings: {fallback_on_error: false}\n"
                                  "ops: {attention: {order: [flaky.kernel, cpu.flash]}}", "<p>"))
    assert opdispatch.explain(q, q, q).chosen_id == "flaky.kernel"  # off means: the error reaches the caller
    with pytest.raises(RuntimeError, match="misaligned address"):
        opdispatch.plan(q, q, q)(q, q, q)


class BindFails(AttentionImpl):
    """A third-party kernel whose `bind` raises (e.g. a JIT that cannot build for this shape); its `run` would
    answer, which the breaker must not be fooled into retrying per call."""

    vendor: ClassVar[str] = "bindfail"
    name: ClassVar[str] = "kernel"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))
    binds = 0
    runs = 0

    def run(self, call):
        type(self).runs += 1
        raise AssertionError("the slow path must not run a kernel whose bind failed")

    def bind(self, call):
        type(self).binds += 1
        raise RuntimeError("cannot build a kernel for this shape")


def _bind_failing_plugin(manager, monkeypatch):
    monkeypatch.setattr(BindFails, "binds", 0)
    monkeypatch.setattr(BindFails, "runs", 0)
    module = types.ModuleType("bindfail_plugin")

    @opdispatch.hookimpl
    def opdispatch_impls():
        return [BindFails()]

    module.opdispatch_impls = opdispatch_impls
    assert manager.register_plugin(module, name="bindfail").status == "loaded"
    manager.set_policy(parse_policy("ops: {attention: {order: [bindfail.kernel, cpu.flash]}}", "<p>"))


def test_a_bind_that_raises_fails_over_like_a_kernel(basic_manager, clock, door, monkeypatch, caplog):
    _bind_failing_plugin(basic_manager, monkeypatch)
    caplog.set_level(logging.WARNING, logger="opdispatch")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(2, 7, 4, 16, gen=gen) for _ in range(3))
    for _ in range(5):
        torch.testing.assert_close(door(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert BindFails.binds == 1 and BindFails.runs == 0  # recorded once; the next candidate serves the signature
    decision = opdispatch.explain(q, k, v)
    assert decision.chosen_id == "cpu.flash"
    cand = decision.candidate("bindfail.kernel")
    assert cand.status == "demoted after raising" and "cannot build a kernel for this shape" in cand.reasons[0]
    assert "for this call signature" in cand.reasons[0]
    assert any("bindfail.kernel raised RuntimeError: cannot build" in r.getMessage() for r in caplog.records)
    q2, k2, v2 = (randn(2, 9, 4, 16, gen=gen) for _ in range(3))  # a second signature: the class goes
    torch.testing.assert_close(door(q2, k2, v2), oracle(q2, k2, v2), atol=2e-5, rtol=1e-4)
    assert BindFails.binds == 2
    assert "whole call class" in opdispatch.explain(*(randn(2, 11, 4, 16),) * 3).candidate(
        "bindfail.kernel").reasons[0]
    with pytest.raises(RuntimeError, match="cannot build a kernel"):  # a pin never falls back
        door(q, k, v, impl="bindfail.kernel")


def test_a_plan_whose_bind_raises_binds_the_next_candidate(basic_manager, clock, monkeypatch):
    _bind_failing_plugin(basic_manager, monkeypatch)
    q, k, v = (randn(1, 6, 2, 16) for _ in range(3))
    fn = opdispatch.plan(q, k, v)
    assert fn.decision.chosen_id == "cpu.flash" and BindFails.binds == 1
    for _ in range(3):
        torch.testing.assert_close(fn(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert BindFails.binds == 1
    with pytest.raises(RuntimeError, match="cannot build a kernel"):
        opdispatch.plan(q, k, v, impl="bindfail.kernel")


def test_checkpoints_early_stop_is_not_a_kernel_failure():
    """torch.utils.checkpoint stops a recomputation by raising through the kernel once it has what the backward
    needs: that must reach the checkpoint, not demote the kernel (a fail-over ran the next implementation inside
    a stopped recomputation: compat.te's checkpoint_core_attention with cpu.flash on packed sequences)."""
    from torch.utils import checkpoint

    from opdispatch.engine._breaker import may_fail_over

    assert may_fail_over(RuntimeError("a kernel refused"))
    assert not may_fail_over(checkpoint._StopRecomputationError())
    assert not may_fail_over(torch.OutOfMemoryError("out of memory"))
