"""The runtime breaker: a kernel that raises is demoted for its call class, the next one takes the call, and the
demoted one is retried a bounded number of times (opdispatch._breaker)."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl, NoImplementationError
from opdispatch._breaker import RETRY_AFTER_S
from opdispatch.policies import parse_policy
from tests.conftest import randn


class Flaky(AttentionImpl):
    """Raises while `failing` is set (counting its runs); otherwise computes attention itself, in float64."""

    vendor: ClassVar[str] = "flaky"
    name: ClassVar[str] = "kernel"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))
    runs = 0
    failing = True
    error: ClassVar[type[BaseException]] = RuntimeError

    def run(self, call):
        type(self).runs += 1
        if type(self).failing:
            raise type(self).error("CUDA error: misaligned address")
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        p = torch.softmax(q @ k.transpose(-1, -2) * call.scale, -1)
        return call.from_bhsd((p @ v).to(call.dtype))


@pytest.fixture
def flaky(basic_manager, monkeypatch):
    monkeypatch.setattr(Flaky, "runs", 0)
    monkeypatch.setattr(Flaky, "failing", True)
    basic_manager.register_impl(Flaky())
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [flaky.kernel, cpu.flash, reference.math]}}",
                                          "<p>"))
    return basic_manager


def oracle(q, k, v):
    """Non-causal bshd attention in float64, written out here."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2).float()


def test_a_raising_kernel_is_demoted_once_for_its_class_and_logged_once(flaky, caplog):
    gen = torch.Generator().manual_seed(0)
    caplog.set_level(logging.INFO, logger="opdispatch")
    for seqlen in (5, 6, 7) * 300:  # three signatures of one class, 900 calls
        q, k, v = (randn(2, seqlen, 4, 16, gen=gen) for _ in range(3))
        torch.testing.assert_close(opdispatch.attention(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert Flaky.runs == 1  # not retried per call (it was: 1000 failures in 1000 calls)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flaky.kernel raised RuntimeError: CUDA error: misaligned address" in \
        warnings[0].getMessage() and "retried in 60 s" in warnings[0].getMessage()
    decision = opdispatch.explain(q, k, v)
    assert decision.chosen_id == "cpu.flash"
    cand = decision.candidate("flaky.kernel")
    assert cand.status == "demoted after raising"
    assert "raised RuntimeError: CUDA error: misaligned address at run time (once" in cand.reasons[0]
    assert "pin it with impl=" in cand.reasons[0]


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


def test_the_retry_is_bounded(flaky, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    q = randn(1, 8, 2, 16)
    opdispatch.attention(q, q, q)
    assert Flaky.runs == 1
    now[0] += RETRY_AFTER_S[0] - 1
    opdispatch.attention(q, q, q)
    assert Flaky.runs == 1  # not yet
    now[0] += 2
    opdispatch.attention(q, q, q)  # the fast path's bound function notices the retry is due
    assert Flaky.runs == 2
    assert "(2 times" in opdispatch.explain(q, q, q).candidate("flaky.kernel").reasons[0]
    now[0] += RETRY_AFTER_S[1] + 1
    opdispatch.attention(q, q, q)
    assert Flaky.runs == 3
    reason = opdispatch.explain(q, q, q).candidate("flaky.kernel").reasons[0]
    assert "demoted for the rest of the process" in reason
    now[0] += 10 * RETRY_AFTER_S[1]
    opdispatch.attention(q, q, q)
    assert Flaky.runs == 3


def test_a_retry_that_succeeds_takes_the_class_back(flaky, monkeypatch):
    now = [50.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    q = randn(1, 8, 2, 16)
    opdispatch.attention(q, q, q)
    monkeypatch.setattr(Flaky, "failing", False)
    now[0] += RETRY_AFTER_S[0] + 1
    opdispatch.attention(q, q, q)
    assert opdispatch.explain(q, q, q).chosen_id == "flaky.kernel" and Flaky.runs == 2
    opdispatch.attention(q, q, q)
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
