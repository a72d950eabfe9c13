"""Shadow checks (OPDISPATCH_SHADOW, opdispatch.engine._shadow): sampled calls recomputed on the reference off the caller's
path. A plugin that drifts on causal calls only is caught — one WARNING, counted, quarantined for that class alone —
while a correct one never is; sampling is an exact count; bad settings are refused; with shadow off nothing wraps
the fast path. Every wait is `shadow_flush`: no test reads the clock."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch
import yaml

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl
from opdispatch.engine._shadow import QUEUE_SIZE, Sampler, Shadow
from opdispatch.policies import parse_policy
from opdispatch.policies._policy import read_quarantine_file
from tests.conftest import randn

OFFSET = 0.05  # the drift: far past fp32's forward tolerance (2e-3 relative), far below any real output's scale


class Drifting(AttentionImpl):
    """Attention in float64, written out here — plus OFFSET on every output of a causal call."""

    vendor: ClassVar[str] = "drift"
    name: ClassVar[str] = "kernel"
    caps: ClassVar[AttentionCaps] = AttentionCaps(
        dtypes=frozenset({torch.float32}), gqa=True, backward=True, layouts=frozenset({"bshd"}), causal=True,
        causal_alignments=frozenset({"top_left"}))

    def run(self, call):
        out = oracle(call.q, call.k, call.v, causal=call.causal)
        return out + OFFSET if call.causal else out


def oracle(q, k, v, causal=False):
    """bshd attention (GQA by repeating kv heads) in float64, top-left causal, returned in q's dtype."""
    qd, kd, vd = (t.detach().double().transpose(1, 2) for t in (q, k, v))
    groups = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2).to(q.dtype)


def use_drifting():
    """A fresh process-wide manager (it reads the OPDISPATCH_SHADOW* set so far) preferring the drifting kernel;
    the `basic_manager` fixture puts the previous one back."""
    fresh = opdispatch.OpManager()
    opdispatch.set_manager(fresh)
    fresh.register_impl(Drifting())
    fresh.set_policy(parse_policy("ops: {attention: {order: [drift.kernel, cpu.flash, reference.math]}}", "<p>"))
    return fresh


def rows(implementation):
    return [r for r in opdispatch.stats().classes if r.implementation == implementation]


def shadow_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "shadow" in r.getMessage()]


def test_a_drifting_plugin_is_caught_and_its_class_quarantined(basic_manager, door, monkeypatch, tmp_path, caplog):
    """Causal calls drift: the caller still gets the kernel's own result at once, one WARNING names the kernel,
    the call, the error and the tolerance, the stats count it, the quarantine file gets a rule for the causal class
    only, and from then on causal calls go to cpu.flash (here and in a new process reading that file) while
    non-causal ones stay on the kernel."""
    path = tmp_path / "shadow-quarantine.yaml"
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    monkeypatch.setenv("OPDISPATCH_SHADOW_QUARANTINE", str(path))
    use_drifting()
    caplog.set_level(logging.INFO, logger="opdispatch")
    gen = torch.Generator().manual_seed(7)

    def inputs(heads_kv=4):
        return randn(2, 9, 4, 16, gen=gen), randn(2, 9, heads_kv, 16, gen=gen), randn(2, 9, heads_kv, 16, gen=gen)

    for heads_kv in (4, 2, 4):  # MHA and GQA (two classes), each checked on every call
        q, k, v = inputs(heads_kv)
        torch.testing.assert_close(door(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
        assert opdispatch.shadow_flush(timeout=120)
    assert shadow_warnings(caplog) == [] and not path.exists()

    q, k, v = inputs()
    got = door(q, k, v, causal=True)  # the kernel's result, drift and all: the check runs behind the caller
    torch.testing.assert_close(got, oracle(q, k, v, causal=True) + OFFSET, atol=2e-5, rtol=1e-4)
    assert opdispatch.shadow_flush(timeout=120)
    [warning] = shadow_warnings(caplog)
    assert "attention: shadow check: drift.kernel drifted from reference.math on [layout=bshd q=(2, 9, 4, 16)" \
        in warning and "causal(top_left)" in warning and "> tolerance 0.002" in warning, warning
    assert "output 0 relative error" in warning and str(path) in warning, warning

    body = yaml.safe_load(path.read_text())
    [rule] = body["ops"]["attention"]["rules"]
    assert rule["deny"] == ["drift.kernel"] and "shadow check: output 0 relative error" in rule["reason"]
    when = rule["when"]
    assert when["causal"] is True and when["dtype"] == "fp32" and when["gqa_ratio"] == 1 and when["vendor"] == "cpu"
    assert when["libraries"] == {"torch": f"=={torch.__version__.split('+')[0]}"}
    assert not {"seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv"} & set(when)  # sizes are not the class's
    read_quarantine_file(path)  # a valid quarantine any policy can load

    for _ in range(3):  # causal: now cpu.flash, correct; non-causal: still the kernel
        q, k, v = inputs()
        torch.testing.assert_close(door(q, k, v, causal=True), oracle(q, k, v, causal=True), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(door(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert opdispatch.shadow_flush(timeout=120)
    causal = opdispatch.explain(q, k, v, causal=True)
    assert causal.chosen_id == "cpu.flash"
    assert causal.candidate("drift.kernel").reasons[0].startswith("quarantined by validate: shadow check:")
    assert opdispatch.explain(q, k, v).chosen_id == "drift.kernel"
    assert opdispatch.explain(*inputs(2), causal=True).chosen_id == "drift.kernel"  # GQA causal: another class
    assert len(shadow_warnings(caplog)) == 1

    kernel = sorted(((r.shadow_checks, r.shadow_drifts) for r in rows("drift.kernel") if r.shadow_checks))
    assert kernel == [(1, 0), (1, 1), (5, 0)]  # GQA once; causal once, drifted; MHA non-causal 2 + 3 times
    assert [(r.shadow_checks, r.shadow_drifts) for r in rows("cpu.flash") if r.shadow_checks] == [(3, 0)]

    monkeypatch.delenv("OPDISPATCH_SHADOW")
    monkeypatch.delenv("OPDISPATCH_SHADOW_QUARANTINE")
    monkeypatch.setenv("OPDISPATCH_QUARANTINE", str(path))
    later = opdispatch.OpManager()  # another process, reading the quarantine the shadow check wrote
    later.register_impl(Drifting())
    policy = tmp_path / "policy.yaml"
    policy.write_text("ops: {attention: {order: [drift.kernel, cpu.flash, reference.math]}}\n")
    later.set_policy(policy)  # a policy file: the quarantine files stack under it
    assert later.explain("attention", opdispatch.validate_attention(q, k, v, causal=True)).chosen_id == "cpu.flash"
    assert later.explain("attention", opdispatch.validate_attention(q, k, v)).chosen_id == "drift.kernel"


def test_without_a_quarantine_file_drift_is_logged_once_and_counted_each_time(basic_manager, door, monkeypatch,
                                                                             caplog):
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    use_drifting()
    caplog.set_level(logging.WARNING, logger="opdispatch")
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        q, k, v = (randn(1, 6, 2, 8, gen=gen) for _ in range(3))
        torch.testing.assert_close(door(q, k, v, causal=True), oracle(q, k, v, causal=True) + OFFSET, atol=2e-5,
                                   rtol=1e-4)
    assert opdispatch.shadow_flush(timeout=120)
    [warning] = shadow_warnings(caplog)
    assert "drift.kernel drifted" in warning and "OPDISPATCH_SHADOW_QUARANTINE=<file>" in warning
    [row] = [r for r in rows("drift.kernel") if r.shadow_checks]
    assert (row.shadow_checks, row.shadow_drifts, row.shadow_dropped) == (4, 4, 0)
    assert opdispatch.explain(q, k, v, causal=True).chosen_id == "drift.kernel"  # not quarantined


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_implementations_never_drift(basic_manager, monkeypatch, caplog, tmp_path, dtype):
    """cpu.flash, torch's rms_norm and the rotary reference's peers over several classes, forward and with
    inputs that require grad (compared forward, detached; the gradient still flows): checked, no drift."""
    path = tmp_path / "q.yaml"
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    monkeypatch.setenv("OPDISPATCH_SHADOW_QUARANTINE", str(path))
    caplog.set_level(logging.WARNING, logger="opdispatch")
    gen = torch.Generator().manual_seed(11)
    for causal, heads_kv, grad in ((False, 4, False), (True, 4, False), (True, 1, True), (False, 2, True)):
        q = randn(2, 12, 4, 32, dtype=dtype, gen=gen, requires_grad=grad)
        k, v = (randn(2, 12, heads_kv, 32, dtype=dtype, gen=gen, requires_grad=grad) for _ in range(2))
        out = opdispatch.attention(q, k, v, causal=causal)
        if grad:
            out.sum().backward()
            assert q.grad is not None and bool(torch.isfinite(q.grad).all())
    x, w = randn(5, 64, dtype=dtype, gen=gen), randn(64, dtype=dtype, gen=gen)
    opdispatch.rms_norm(x, w)
    opdispatch.rms_norm(x, w, residual=randn(5, 64, dtype=dtype, gen=gen))
    assert opdispatch.shadow_flush(timeout=120)
    assert shadow_warnings(caplog) == [] and not path.exists()
    checked = [r for r in opdispatch.stats().classes if r.shadow_checks]
    assert sum(r.shadow_checks for r in checked) == 6 and all(r.shadow_drifts == 0 for r in checked)
    assert {r.op for r in checked} == {"attention", "rms_norm"}


def test_rate_sampling_is_an_exact_count():
    for rate, calls, checked in ((1.0, 7, 7), (0.5, 10, 5), (0.25, 8, 2), (0.5, 9, 4), (0.1, 100, 10)):
        sample = Sampler(rate)
        assert sum(sample() for _ in range(calls)) == checked, (rate, calls)
    sample = Sampler(0.5)
    assert [sample() for _ in range(6)] == [False, True] * 3  # evenly spread


def test_rate_half_checks_exactly_half_of_the_calls(basic_manager, door, monkeypatch):
    monkeypatch.setenv("OPDISPATCH_SHADOW", "0.5")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 5, 2, 8, gen=gen) for _ in range(3))
    for _ in range(10):
        torch.testing.assert_close(door(q, k, v), oracle(q, k, v), atol=2e-5, rtol=1e-4)
    assert opdispatch.shadow_flush(timeout=120)
    assert sum(r.shadow_checks for r in opdispatch.stats().classes) == 5


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan", "inf", "half", "1e-400"])
def test_bad_shadow_rates_are_refused_at_first_use(basic_manager, monkeypatch, value):
    monkeypatch.setenv("OPDISPATCH_SHADOW", value)
    q = randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"OPDISPATCH_SHADOW=.* is not a sampling rate: use a number in \(0, 1\]") \
            as info:
        opdispatch.attention(q, q, q)
    assert repr(value) in str(info.value)


def test_bad_quarantine_settings_are_refused_before_anything_runs(basic_manager, monkeypatch, tmp_path):
    q = randn(1, 4, 2, 8)
    monkeypatch.setenv("OPDISPATCH_SHADOW_QUARANTINE", str(tmp_path / "q.yaml"))
    with pytest.raises(ValueError, match="OPDISPATCH_SHADOW_QUARANTINE=.* is set but OPDISPATCH_SHADOW is not"):
        opdispatch.attention(q, q, q)
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    monkeypatch.setenv("OPDISPATCH_SHADOW_QUARANTINE", str(tmp_path))
    opdispatch.set_manager(opdispatch.OpManager())
    with pytest.raises(ValueError, match="OPDISPATCH_SHADOW_QUARANTINE=.*not a regular file"):
        opdispatch.attention(q, q, q)
    broken = tmp_path / "broken.yaml"
    broken.write_text("ops: {attention: {order: [cpu.flash]}}\n")
    monkeypatch.setenv("OPDISPATCH_SHADOW_QUARANTINE", str(broken))
    opdispatch.set_manager(opdispatch.OpManager())
    with pytest.raises(ValueError, match="OPDISPATCH_SHADOW_QUARANTINE=.*deny rules only"):
        opdispatch.attention(q, q, q)
    assert broken.read_text() == "ops: {attention: {order: [cpu.flash]}}\n"  # untouched


def test_shadow_off_binds_no_wrapper_and_on_binds_one(basic_manager, door, monkeypatch):
    q = randn(1, 4, 2, 8)
    door(q, q, q)
    door(q, q, q)
    assert basic_manager.shadow is None
    assert basic_manager.fast and not any(getattr(fn, "shadowed", False) for fn in basic_manager.fast.values())
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    fresh = opdispatch.OpManager()
    opdispatch.set_manager(fresh)
    door(q, q, q)
    door(q, q, q)
    assert fresh.fast and all(getattr(fn, "shadowed", False) for fn in fresh.fast.values())
    assert opdispatch.shadow_flush(timeout=120)


def test_a_full_queue_drops_and_counts_and_a_failing_reference_is_logged_once(basic_manager, monkeypatch, caplog):
    monkeypatch.setenv("OPDISPATCH_SHADOW", "1")
    caplog.set_level(logging.WARNING, logger="opdispatch")
    monkeypatch.setattr(Shadow, "_ensure_worker", lambda self: None)  # nothing drains the queue yet
    q = randn(1, 4, 2, 8)
    for _ in range(QUEUE_SIZE + 3):
        torch.testing.assert_close(opdispatch.attention(q, q, q), oracle(q, q, q), atol=2e-5, rtol=1e-4)
    [row] = [r for r in rows("cpu.flash")]
    assert (row.shadow_checks, row.shadow_dropped) == (0, 3)

    reference = basic_manager.implementation("attention", "reference.math")

    def broken(call):
        raise RuntimeError("reference exploded")

    monkeypatch.setattr(type(reference), "run", lambda self, call: broken(call))
    _START(basic_manager.shadow)  # now the worker starts: every queued check fails on the reference
    assert opdispatch.shadow_flush(timeout=120)
    failures = [m for m in shadow_warnings(caplog) if "failed: RuntimeError: reference exploded" in m]
    assert len(failures) == 1 and "cpu.flash" in failures[0]
    assert [(r.shadow_checks, r.shadow_drifts) for r in rows("cpu.flash")] == [(0, 0)]


_START = Shadow._ensure_worker
