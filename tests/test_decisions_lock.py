"""The decision lockfile: export -> replay reproduces every decision; a changed policy, a missing implementation or
one that cannot take the call shows as drift (one WARNING, and `opdispatch decisions diff`); a replayed
implementation never takes a call it cannot take."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

import opdispatch
from opdispatch.tools._cli import main
from opdispatch.engine._current import diff_decisions
from opdispatch.engine._decisions_lock import LOCKFILE, load_lock
from opdispatch.base._errors import OpDispatchError
from tests.conftest import TOLERANCES


def calls(gen):
    """Calls of distinct classes on the CPU: dtypes, causal, GQA, head dims, softcap (only the reference has it)."""
    def t(b, s, h, d, dtype):
        return torch.randn(b, s, h, d, generator=gen).to(dtype)

    return [
        (t(1, 5, 2, 8, torch.float32),) * 3 + ({},),
        (t(2, 6, 4, 16, torch.float64), t(2, 9, 2, 16, torch.float64), t(2, 9, 2, 16, torch.float64),
         {"causal": True, "causal_alignment": "bottom_right"}),
        (t(1, 4, 2, 32, torch.bfloat16),) * 3 + ({},),
        (t(1, 5, 2, 8, torch.float32),) * 3 + ({"softcap": 5.0},),
    ]


def oracle(q, k, v, causal=False, causal_alignment="top_left", softcap=0.0):
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    if qd.shape[1] != kd.shape[1]:
        kd, vd = (x.repeat_interleave(qd.shape[1] // x.shape[1], 1) for x in (kd, vd))
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, sk = s.shape[-2:]
        shift = sk - sq if causal_alignment == "bottom_right" else 0
        keep = torch.arange(sk)[None] <= torch.arange(sq)[:, None] + shift
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)




def run_all(manager):
    """Run every call (checked against the oracle); each class's decision, by its class text."""
    gen = torch.Generator().manual_seed(0)
    chosen = {}
    for q, k, v, kw in calls(gen):
        out = opdispatch.attention(q, k, v, **kw)
        torch.testing.assert_close(out.double(), oracle(q, k, v, **kw), **TOLERANCES[q.dtype])
        call = opdispatch.validate_attention(q, k, v, **kw)
        decision = manager.cached_decision("attention", call)
        chosen[decision.call] = (decision.chosen_id, decision.decided_by)
    return chosen


@pytest.fixture
def recorded(basic_manager, tmp_path):
    run_all(basic_manager)
    path = tmp_path / "decisions.yaml"
    entries = opdispatch.export_decisions(path)
    assert len(entries) == 4
    return path, {e.example: e.implementation for e in entries}


def fresh(monkeypatch, path, **env):
    monkeypatch.setenv("OPDISPATCH_DECISIONS", str(path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    manager = opdispatch.OpManager()
    opdispatch.set_manager(manager)
    return manager


def test_the_file_holds_each_class_readably_with_versions_and_fingerprint(recorded):
    path, _ = recorded
    data = yaml.safe_load(path.read_text())
    assert data["fingerprint"]["type"] == "cpu" and data["fingerprint"]["torch"] == torch.__version__
    by_impl = {d["implementation"] for d in data["decisions"]}
    assert by_impl == {"cpu.flash", "reference.math"}
    entry = data["decisions"][0]
    assert entry["device_type"] == "cpu" and "float32" in entry["class"] and "bshd" in entry["class"]
    assert entry["versions"]["opdispatch"]


def test_replay_reproduces_every_decision_without_drift(recorded, monkeypatch, caplog):
    path, expected = recorded
    manager = fresh(monkeypatch, path, OPDISPATCH_PLUGINS="cpu,reference")
    caplog.set_level(logging.INFO, logger="opdispatch")
    replayed = run_all(manager)
    assert {call: impl for call, (impl, _) in replayed.items()} == expected
    assert all(by.kind == LOCKFILE for _, by in replayed.values())
    assert manager.lock.drift == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_changed_policy_replays_the_record_and_reports_drift_once(recorded, monkeypatch, caplog):
    path, expected = recorded
    # The policy would now take reference.math for every class: the file still decides, drift says so.
    manager = fresh(monkeypatch, path, OPDISPATCH_PLUGINS="cpu,reference", OPDISPATCH_PREFER="reference.math")
    caplog.set_level(logging.INFO, logger="opdispatch")
    replayed = run_all(manager)
    assert {call: impl for call, (impl, _) in replayed.items()} == expected
    flash_classes = sum(1 for impl in expected.values() if impl == "cpu.flash")
    assert len(manager.lock.drift) == flash_classes == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the policy would choose reference.math now" in warnings[0]
    drift = diff_decisions(path, manager)  # entries without a case: implementations only, all still there
    assert drift == []


def test_a_missing_implementation_is_drift_and_the_policy_decides(recorded, monkeypatch, caplog):
    path, _ = recorded
    manager = fresh(monkeypatch, path, OPDISPATCH_PLUGINS="reference")
    caplog.set_level(logging.WARNING, logger="opdispatch")
    replayed = run_all(manager)
    assert {impl for impl, _ in replayed.values()} == {"reference.math"}
    assert all(by.kind != LOCKFILE or impl == "reference.math" for impl, by in replayed.values())
    warnings = [r.getMessage() for r in caplog.records if "decision lockfile" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].count("cpu.flash is not registered now") == 3
    assert len(diff_decisions(path, manager)) == 3


def test_replay_never_takes_a_call_the_recorded_implementation_cannot_take(recorded, monkeypatch, caplog):
    path, _ = recorded
    data = yaml.safe_load(path.read_text())
    for entry in data["decisions"]:  # a hand-edited file: cpu.flash "recorded" for every class, softcap included
        entry["implementation"] = "cpu.flash"
    path.write_text(yaml.safe_dump(data))
    manager = fresh(monkeypatch, path, OPDISPATCH_PLUGINS="cpu,reference")
    caplog.set_level(logging.WARNING, logger="opdispatch")
    replayed = run_all(manager)  # the softcap call still computes softcap (the oracle checks it)
    softcap = [impl for call, (impl, _) in replayed.items() if "softcap" in call]
    assert softcap == ["reference.math"]
    assert any("cpu.flash is rejected now" in d.why for d in manager.lock.drift.values())


def test_a_deny_of_the_active_policy_wins_over_the_file(recorded, monkeypatch):
    path, _ = recorded
    manager = fresh(monkeypatch, path, OPDISPATCH_PLUGINS="cpu,reference", OPDISPATCH_DENY="cpu.flash")
    replayed = run_all(manager)
    assert {impl for impl, _ in replayed.values()} == {"reference.math"}
    assert all("denied" in d.why for d in manager.lock.drift.values()) and len(manager.lock.drift) == 3


def test_cli_export_and_diff_decide_the_recorded_cases_again(basic_manager, tmp_path, monkeypatch, capsys):
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("shapes:\n  - {dtype: fp32, batch: 1, seqlen_q: 16, heads_q: 2, heads_kv: 2, head_dim: 32}\n"
                      "  - {dtype: fp32, batch: 1, seqlen_q: 16, heads_q: 4, heads_kv: 2, head_dim: 64, "
                      "causal: true}\n")
    lock = tmp_path / "lock.yaml"
    assert main(["decisions", "export", str(lock), "--shapes", str(shapes), "--on", "cpu"]) == 0
    entries = load_lock(lock).entries
    assert len(entries) == 2 and all(e.case is not None for e in entries)
    assert main(["decisions", "diff", str(lock), "--on", "cpu"]) == 0
    assert "no drift" in capsys.readouterr().out
    monkeypatch.setenv("OPDISPATCH_PREFER", "reference.math")
    basic_manager.reload()
    assert main(["decisions", "diff", str(lock), "--on", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "2 class(es) drifted" in out and "the policy chooses reference.math now" in out


def test_a_bad_lockfile_is_refused_with_the_field(tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndecisions:\n  - {op: attention, class: x, device_type: cpu, implmentation: a}\n")
    with pytest.raises(OpDispatchError, match=r"decisions\[0\]: unknown fields \['implmentation'\]"):
        load_lock(bad)
    monkeypatch.setenv("OPDISPATCH_DECISIONS", str(tmp_path / "missing.yaml"))
    with pytest.raises(OpDispatchError, match="cannot read it"):
        opdispatch.OpManager().ensure_initialized()
    monkeypatch.delenv("OPDISPATCH_DECISIONS")
    with pytest.raises(ValueError, match="has decided no call class yet"):
        opdispatch.export_decisions(tmp_path / "x.yaml", manager=opdispatch.OpManager())
