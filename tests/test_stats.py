"""opdispatch.stats(): fast-path hits, slow-path calls, decisions, breaker demotions (by scope), quarantine denials
and reference fallbacks on accelerators, counted exactly — on the compiled front door and on the Python one."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl, DeviceInfo
from opdispatch.base import _native
from opdispatch.policies import parse_policy
from tests.conftest import NATIVE_BUILD_ERROR, REPO


class Counting(AttentionImpl):
    """Attention in float64 (the oracle's own formula is written separately below); raises on the key lengths in
    `failing_lengths`."""

    vendor: ClassVar[str] = "fake"
    name: ClassVar[str] = "kernel"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True,
                                                  layouts=frozenset({"bshd"}), causal=True,
                                                  causal_alignments=frozenset({"top_left"}))
    failing_lengths: ClassVar[frozenset[int]] = frozenset()

    def run(self, call):
        if call.seqlen_k in type(self).failing_lengths:
            raise RuntimeError("CUDA error: misaligned address")
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        p = torch.softmax(q @ k.transpose(-1, -2) * call.scale, -1)
        return call.from_bhsd((p @ v).to(call.dtype))


def oracle(q, k, v):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    w = torch.softmax(qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
    return (w @ vd).transpose(1, 2)


@pytest.fixture
def fake(basic_manager, monkeypatch):
    monkeypatch.setattr(Counting, "failing_lengths", frozenset())
    basic_manager.register_impl(Counting())
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [fake.kernel, cpu.flash, reference.math]}}",
                                          "<p>"))
    opdispatch.stats(reset=True)
    return basic_manager


def qkv(seqlen, gen, batch=1, heads=2, dim=8):
    return [torch.randn(batch, seqlen, heads, dim, generator=gen) for _ in range(3)]


def test_hits_slow_calls_and_decisions_are_counted_exactly(fake, door):
    gen = torch.Generator().manual_seed(0)
    signatures = [qkv(5, gen), qkv(7, gen), qkv(5, gen, batch=3)]  # one class: no size rule splits them
    for q, k, v in signatures:
        for _ in range(6):
            torch.testing.assert_close(door(q, k, v).double(), oracle(q, k, v), atol=1e-6, rtol=1e-6)
    snap = opdispatch.stats()
    usage = snap.ops["attention"]
    # One slow call per signature (its first), every other call a hit of the compiled or the Python door.
    assert usage.slow_calls == 3
    assert usage.fast_path_hits == 3 * 5
    assert usage.calls == 18
    row = snap.row("attention", "fake.kernel")
    assert (row.slow_calls, row.decisions, row.demotions, row.quarantine_denials,
            row.reference_on_accelerator) == (3, 1, {}, 0, 0)
    assert [r.implementation for r in snap.classes] == ["fake.kernel"]
    assert "float32" in snap.classes[0].decision_class and "bshd" in snap.classes[0].decision_class
    # reset: the snapshot taken, every counter starts over.
    assert opdispatch.stats(reset=True).ops["attention"].calls == 18
    q, k, v = signatures[0]
    door(q, k, v)
    after = opdispatch.stats()
    assert (after.ops["attention"].fast_path_hits, after.ops["attention"].slow_calls, after.classes) == (1, 0, [])


def test_the_compiled_door_counts_its_hits_in_c_and_the_python_door_its_own(fake):
    if _native.native_module() is None:
        pytest.skip(f"the compiled fast path is not loaded: {NATIVE_BUILD_ERROR or _native.status().reason}")
    door = _native.twin(opdispatch.attention)
    q, k, v = qkv(4, torch.Generator().manual_seed(1))
    for _ in range(10):
        door(q, k, v)
    usage = opdispatch.stats().ops["attention"]
    # call 1: slow; call 2: C miss, the Python door's hit (then the entry is read back); calls 3..10: C hits.
    assert (usage.slow_calls, usage.python_hits, usage.compiled_hits) == (1, 1, 8)


def test_breaker_demotions_by_scope_and_decisions_after_them(fake, door):
    Counting.failing_lengths = frozenset({6, 9})
    gen = torch.Generator().manual_seed(2)
    for seqlen in (6, 9, 4):
        q, k, v = qkv(seqlen, gen)
        for _ in range(3):
            torch.testing.assert_close(door(q, k, v).double(), oracle(q, k, v), atol=1e-5, rtol=1e-5)
    snap = opdispatch.stats()
    fake_row = snap.row("attention", "fake.kernel")
    # seqlen 6: demoted for its signature; seqlen 9: a second signature of the class demotes the class.
    assert fake_row.demotions == {"signature": 1, "class": 1}
    assert fake_row.slow_calls == 0 and fake_row.decisions == 1
    flash = snap.row("attention", "cpu.flash")
    # cpu.flash decides for seqlen 6's signature, then for 9's (the demotion holds for that signature too), then
    # for the class (seqlen 4: the class's decision was dropped by the class demotion); each first call is slow.
    assert (flash.decisions, flash.slow_calls) == (3, 3)
    assert snap.ops["attention"].calls == 9 and snap.ops["attention"].fast_path_hits == 6


def test_reference_on_an_accelerator_and_quarantine_denials(basic_manager, tmp_path, monkeypatch):
    quarantine = tmp_path / "quarantine.yaml"
    quarantine.write_text("version: 1\nextends: none\nops:\n  attention:\n    rules:\n"
                          "      - name: q-flash\n        when: {dtype: float32}\n        deny: [cpu.flash]\n"
                          "        reason: test\n")
    monkeypatch.setenv("OPDISPATCH_QUARANTINE", str(quarantine))
    basic_manager.reload()
    gen = torch.Generator().manual_seed(3)
    q, k, v = qkv(5, gen)
    mask = torch.rand(1, 1, 5, 5, generator=gen) > 0.2
    mask[..., 0] = True
    opdispatch.stats(reset=True)
    for _ in range(4):  # a mask is keyed by shape: one slow call (the decision), then the fast path
        out = opdispatch.attention(q, k, v, attn_mask=mask)
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = (qd @ kd.transpose(-1, -2)) / 8 ** 0.5
    expected = (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vd).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    row = opdispatch.stats().row("attention", "reference.math")
    assert (row.slow_calls, row.decisions, row.reference_on_accelerator) == (1, 1, 0)  # the CPU: no cliff
    assert opdispatch.stats().ops["attention"].fast_path_hits == 3
    assert opdispatch.stats().row("attention", "cpu.flash").quarantine_denials == 1
    # The same math on a (simulated) accelerator, as an additive bias (validated every call: the slow path):
    # every reference call counts. (Fast-path hits are counted per op, not per implementation.)
    basic_manager.clear_cache()
    basic_manager._devices[torch.device("cpu")] = DeviceInfo("nvidia", "cuda", "sm90", "H100", capability=(9, 0))
    opdispatch.stats(reset=True)
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    for _ in range(3):
        out = opdispatch.attention(q, k, v, attn_bias=bias)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    row = opdispatch.stats().row("attention", "reference.math")
    assert (row.slow_calls, row.decisions, row.reference_on_accelerator) == (3, 1, 3)
    # Masked calls take the per-call fast path after their first: each reference call is still counted.
    basic_manager.clear_cache()
    opdispatch.stats(reset=True)
    for _ in range(4):
        opdispatch.attention(q, k, v, attn_mask=mask)
    row = opdispatch.stats().row("attention", "reference.math")
    assert (row.slow_calls, row.decisions, row.reference_on_accelerator) == (1, 1, 4)
    assert opdispatch.stats().ops["attention"].fast_path_hits == 3


def test_counters_lose_nothing_across_threads(fake):
    gen = torch.Generator().manual_seed(4)
    q, k, v = qkv(3, gen)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    opdispatch.attention(q, k, v, attn_mask=mask)  # decided once up front
    opdispatch.stats(reset=True)
    errors = []

    def work():
        try:
            for _ in range(50):
                opdispatch.attention(q, k, v, attn_mask=mask)
                opdispatch.attention(q, k, v)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    usage = opdispatch.stats().ops["attention"]
    assert usage.calls == 400
    # The masked signature was decided up front; the unmasked one's first call races in up to four threads.
    assert 1 <= usage.slow_calls <= 4 and usage.fast_path_hits == 400 - usage.slow_calls


def test_stats_rejects_a_non_bool_reset():
    with pytest.raises(TypeError, match="reset must be True or False"):
        opdispatch.stats(reset=1)


def test_stats_at_exit_and_the_command(tmp_path):
    script = ("import torch, opdispatch\nq = torch.randn(1, 4, 2, 8)\n"
              "for _ in range(3): opdispatch.attention(q, q, q)\n")
    env = {"OPDISPATCH_STATS": "1", "OPDISPATCH_FAST_PATH": "python", "PATH": "/usr/bin:/bin",
           "OPDISPATCH_QUARANTINE": "/nonexistent/q.yaml"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert "opdispatch usage (OPDISPATCH_STATS=1)" in done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("attention "))
    assert line.split()[:5] == ["attention", "3", "2", "0", "2"]
    bad = subprocess.run([sys.executable, "-c", script], env={**env, "OPDISPATCH_STATS": "maybe"},
                         capture_output=True, text=True, cwd=REPO, timeout=240)
    assert bad.returncode != 0 and "OPDISPATCH_STATS='maybe' is not a switch" in bad.stderr
