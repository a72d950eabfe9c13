"""benchmarks/policy_proof.py: the verdict arithmetic on hand-made timings, and a `--tiny` CPU run in a subprocess
under a policy with a rule of its own, whose report must carry every timing, name the rule that decided each pick,
and compute regret, verdicts and the exit status from the recorded times."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

import torch

import opdispatch

from .conftest import DEVICES_DIR, REPO


def load():
    spec = importlib.util.spec_from_file_location("policy_proof", REPO / "benchmarks" / "policy_proof.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


proof = load()


# -- the arithmetic, on hand-made timings --------------------------------------------------------------------

@pytest.mark.parametrize("times, pick, verdict, regret", [
    ({"a": 1.0, "b": 1.5}, "a", "PASS", 0.0),
    ({"a": 1.02, "b": 1.0}, "a", "PASS", 0.02),  # within 3%
    ({"a": 1.03, "b": 1.0}, "a", "PASS", 0.03),  # exactly 3% is not a loss "by more than 3%"
    ({"a": 1.05, "b": 1.0, "c": 2.0}, "a", "FAIL", 0.05),
    ({"a": 3.0, "b": 1.0}, "a", "FAIL", 2.0),
])
def test_case_verdict_regret_against_the_fastest(times, pick, verdict, regret):
    out = proof.case_verdict(times, pick, {})
    assert out["verdict"] == verdict and out["regret"] == pytest.approx(regret)
    assert out["best"] == min(times, key=times.get) and out["pick_ms"] == times[pick]
    if verdict == "FAIL":
        assert f"{regret:.1%}" in out["why"] and out["best"] in out["why"] and "> 3%" in out["why"]


def test_case_verdict_when_the_pick_has_no_time():
    # The pick raised (or its compile exceeded the cap): a failed proof, not a pass on the others' times.
    failed = proof.case_verdict({"b": 1.0}, "a", {"a": "compile too slow: first call exceeded --compile-cap 60 s"})
    assert failed["verdict"] == "FAIL" and "compile too slow" in failed["why"] and failed["regret"] is None
    # Not timed for want of time: no verdict either way.
    assert proof.case_verdict({"b": 1.0}, "a", {})["verdict"] == "UNMEASURED"
    assert proof.case_verdict({"b": 1.0}, None, {})["verdict"] == "FAIL"


def _record(name, times, pick, rule=None, matched=()):
    return {"name": name, "decided_by_rule": rule, "matched_rules": list(matched), "pick": pick,
            **proof.case_verdict(times, pick, {})}


def test_summary_geomean_worst_and_rule_verdicts():
    rules = [{"name": name, "layer": "default", "where": "x.yaml:1", "timing": True, "has_cases": True}
             for name in ("fast-rule", "slow-rule", "idle-rule")]
    records = [
        _record("c1", {"a": 1.0, "b": 1.2}, "a", "fast-rule", ["fast-rule"]),
        _record("c2", {"a": 1.01, "b": 1.0}, "a", "fast-rule", ["fast-rule", "idle-rule"]),
        _record("c3", {"a": 1.10, "b": 1.0}, "a", "slow-rule", ["slow-rule"]),
        _record("c4", {"a": 1.0}, "a"),  # decided by the order
    ]
    summary = proof.summarize(records, rules)
    regrets = [0.0, 0.01, 0.10, 0.0]
    assert summary["geomean_regret"] == pytest.approx(math.prod(1 + r for r in regrets) ** 0.25 - 1)
    assert summary["worst_regret"] == pytest.approx(0.10) and summary["worst_case"] == "c3"
    assert summary["counts"] == {"PASS": 3, "FAIL": 1, "UNMEASURED": 0}
    by_name = {r["name"]: r for r in summary["rules"]}
    assert by_name["fast-rule"]["verdict"] == "backed" and by_name["fast-rule"]["decided"] == ["c1", "c2"]
    assert by_name["fast-rule"]["worst_regret"] == pytest.approx(0.01)
    assert by_name["slow-rule"]["verdict"] == "contradicted" and by_name["slow-rule"]["failing"] == ["c3"]
    assert by_name["idle-rule"]["verdict"] == "not exercised" and by_name["idle-rule"]["matched"] == ["c2"]
    assert proof.exit_status(records, 4) == 1
    assert proof.exit_status(records[:2], 2) == 0
    assert proof.exit_status(records[:2], 3) == 2  # a selected case left unmeasured


def test_case_selection_by_name_and_rule_tag():
    cases, tags = proof.build_cases(list(proof.RULE_CASES), quick=True, tiny=False)
    assert all(c.dtype == "bf16" for c in cases)
    decode = proof.select(cases, tags, "rule:decode-on-flash")
    # the claimed decode shape and the neighbour across seqlen_q <= 16 (--quick drops q16)
    assert [c.sq for c in decode] == [1, 17]
    full, full_tags = proof.build_cases(list(proof.RULE_CASES), quick=False, tiny=False)
    assert {c.sq for c in proof.select(full, full_tags, "rule:decode-on-flash")} == {1, 16, 17}
    assert {c.dtype for c in full} == {"bf16", "fp16"} and len({c.name for c in full}) == len(full)
    assert {c.d for c in full if c.family == "dense"} == {64, 96, 128, 192, 256}
    varlen = proof.select(full, full_tags, "rule:flagos-for-short-varlen-inference")
    assert sorted({max(c.lens) for c in varlen}) == [256, 1024, 1025] and {c.mode for c in varlen} == {"fwd", "train"}
    with pytest.raises(SystemExit, match="matches no case"):
        proof.select(cases, tags, "nope*")
    # A rule the policy no longer has keeps its shapes measured, tagged as a former rule.
    now, now_tags = proof.build_cases(["decode-on-flash"], quick=True, tiny=False)
    former = proof.select(now, now_tags, "former rule:flagos-for-short-varlen-inference")
    assert sorted({max(c.lens) for c in former}) == [256, 1024, 1025]
    assert not any(t.startswith("rule:flagos") for n in now_tags.values() for t in n)


def test_time_limit_interrupts_a_long_first_call():
    with pytest.raises(proof.FirstCallTooSlow), proof.time_limit(0.05) as alarm:
        for _ in range(400):  # interrupted long before it ends
            time.sleep(0.05)
    assert alarm["fired"]
    with proof.time_limit(30) as alarm:
        pass
    assert not alarm["fired"]


def test_flex_past_the_recompile_limit_is_not_timed_as_flex(basic_manager, monkeypatch):
    # torch.flex warns once when dynamo's recompile limit sends it unfused: that case's flex time is dropped, the
    # case left for a fresh process (--resume), and flex skipped for the rest of the run.
    runner = proof.Runner(proof.parse_args(["--tiny", "--out", "x"]), proof.torch.device("cpu"), [])

    def measured(case, tags):
        proof.logging.getLogger("opdispatch").warning("torch.flex: ... reached dynamo's recompile limit (64 graphs)")
        times = {"torch.flex": 1.0, "cpu.flash": 2.0}
        return {"name": case.name, "pick": "cpu.flash", "times_ms": times, "errors": {}, "complete": True,
                **proof.case_verdict(times, "cpu.flash", {})}

    monkeypatch.setattr(runner, "_run_case", measured)
    record = runner.run_case(proof._c("dense", **proof.GQA), [])
    assert record["times_ms"] == {"cpu.flash": 2.0} and "recompile limit" in record["errors"]["torch.flex"]
    assert record["verdict"] == "PASS" and record["regret"] == 0 and not record["complete"]
    assert "recompile limit" in record["warnings"][0] and "torch.flex" in runner.skipped


@pytest.mark.parametrize("argv, message", [
    (["--tiny"], "--out DIR is required"),
    (["--tiny", "--out", "x", "--policy", "/nonexistent/policy.yaml"], "no such file"),
    (["--tiny", "--out", "x", "--reps", "0"], "--reps 0 is out of range"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        proof.parse_args(argv)
    assert message in capsys.readouterr().err


# -- a tiny run end to end -------------------------------------------------------------------------------------

POLICY = """\
version: 1
ops:
  attention:
    rules:
      - name: test-math-for-alibi
        when: {device_type: cpu, alibi: true}
        prefer: [reference.math]
        reason: a rule of this test, so one pick is decided by a rule and timed against cpu.flash
"""

ALIBI = "alibi:b2-q64-k64-h4/4-d16-causal:fwd:fp32"
DENSE_TRAIN = "dense:b2-q64-k64-h4/1-d16-causal:train:fp32"


def test_tiny_run_reports_every_timing_and_its_regret(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "proof"
    env = {**os.environ, "OPDISPATCH_PLUGINS": "cpu,reference"}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "policy_proof.py"), "--tiny", "--out", str(out),
                          "--policy", str(policy), "--cases", f"{ALIBI},{DENSE_TRAIN}"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    result = json.loads((out / "policy_proof.json").read_text())
    assert run.returncode == result["exit_status"], run.stderr
    assert "extends the shipped default" in run.stderr  # the rules of the default still apply beneath this file
    assert result["environment"]["device"] and result["environment"]["torch"] and "commit" in result["environment"]
    assert str(policy) in result["policy"]["source"] and result["policy"]["hash"]
    rules = {r["name"]: r for r in result["rules"]}
    assert rules["test-math-for-alibi"]["layer"] == "user" and "flex-for-softcap" in rules
    cases = {r["name"]: r for r in result["cases"]}
    assert set(cases) == {ALIBI, DENSE_TRAIN} and result["left"] == []

    alibi, dense = cases[ALIBI], cases[DENSE_TRAIN]
    assert alibi["pick"] == "reference.math" and alibi["decided_by_rule"] == "test-math-for-alibi"
    assert "test-math-for-alibi" in alibi["matched_rules"]
    assert set(alibi["times_ms"]) == {"reference.math", "cpu.flash"}  # the pick, against every eligible kernel
    assert dense["pick"] == "cpu.flash" and dense["decided_by_rule"] is None and "order" in dense["decided_by"]
    assert "reference.math" not in dense["times_ms"] and dense["mode"] == "train"

    fails = 0
    for case in (alibi, dense):
        times = case["times_ms"]
        assert times and all(math.isfinite(t) and t > 0 for t in times.values()) and case["policy_ms"] > 0
        assert case["best"] == min(times, key=times.get) and case["best_ms"] == times[case["best"]]
        regret = times[case["pick"]] / min(times.values()) - 1
        assert case["regret"] == pytest.approx(regret)
        assert case["verdict"] == ("FAIL" if times[case["pick"]] > min(times.values()) * 1.03 else "PASS")
        fails += case["verdict"] == "FAIL"
    summary = result["summary"]
    assert summary["geomean_regret"] == pytest.approx(
        math.sqrt((1 + alibi["regret"]) * (1 + dense["regret"])) - 1)
    assert summary["worst_regret"] == pytest.approx(max(alibi["regret"], dense["regret"]))
    rule = {r["name"]: r for r in summary["rules"]}["test-math-for-alibi"]
    assert rule["decided"] == [ALIBI]
    assert rule["verdict"] == ("contradicted" if alibi["verdict"] == "FAIL" else "backed")
    assert result["verdict"] == ("FAIL" if fails else "PASS") and run.returncode == (1 if fails else 0)
    report = (out / "policy_proof.md").read_text()
    assert "test-math-for-alibi" in report and f"| {ALIBI} | fwd | fp32 | test-math-for-alibi |" in report

    # --resume keeps the complete cases of the report as they are, and measures only what is left
    again = subprocess.run(run.args + ["--resume"], capture_output=True, text=True, env=env, timeout=120, check=False)
    resumed = json.loads((out / "policy_proof.json").read_text())
    assert again.returncode == run.returncode, again.stderr
    assert [c["times_ms"] for c in resumed["cases"]] == [c["times_ms"] for c in result["cases"]]


def _run_json(tmp_path, name, device, cases, rules=()):
    d = tmp_path / name
    d.mkdir()
    records = [dict(_record(n, times, pick), times_ms=times, mode="fwd", dtype="bf16", decided_by="order",
                    policy_ms=None, errors={}, first_call_s={}) for n, times, pick in cases]
    (d / "policy_proof.json").write_text(json.dumps({
        "environment": {"device": device, "commit": name}, "policy": {"source": "x.yaml", "hash": name},
        "rules": list(rules), "cases": records, "argv": []}))
    return d


def test_merge_keeps_the_latest_record_of_each_case_and_recomputes_the_verdict(tmp_path):
    """A later run's case replaces the earlier record (a rule changed and its cases were measured again); the
    summary and verdict come from the union; the sources are named; another device's run is refused."""
    rule = {"name": "r", "layer": "default", "where": "x.yaml:1", "timing": True, "has_cases": True}
    full = _run_json(tmp_path, "full", "H100", [("a", {"x": 1.0, "y": 1.5}, "x"), ("b", {"x": 1.2, "y": 1.0}, "x")])
    again = _run_json(tmp_path, "again", "H100", [("b", {"x": 1.2, "y": 1.0}, "y")], [rule])
    out = tmp_path / "merged"
    assert proof.merge_reports([full, again], out) == 0
    merged = json.loads((out / "policy_proof.json").read_text())
    assert {c["name"]: c["pick"] for c in merged["cases"]} == {"a": "x", "b": "y"}
    assert merged["verdict"] == "PASS" and merged["summary"]["worst_regret"] == 0.0
    assert [(s["commit"], s["cases"]) for s in merged["sources"]] == [("full", 1), ("again", 1)]
    assert "Merged from" in (out / "policy_proof.md").read_text()
    assert proof.merge_reports([again, full], tmp_path / "stale") == 1  # the older record wins when given last
    other = _run_json(tmp_path, "other", "H200", [("a", {"x": 1.0}, "x")])
    with pytest.raises(SystemExit, match="H200"):
        proof.merge_reports([full, other], tmp_path / "mixed")


# -- the committed H100 proof still describes the policy in this checkout ------------------------------------

# The full H100 run merged with the runs of the cases later policy changes touched (`--merge`).
H100_PROOF = REPO / "benchmarks" / "results" / "policy-proof-h100-merged" / "policy_proof.json"


def _proof_records() -> list[dict]:
    return json.loads(H100_PROOF.read_text())["cases"]


@pytest.mark.parametrize("record", _proof_records(), ids=lambda r: r["name"])
def test_the_committed_h100_proof_picks_are_the_current_policys(manager, record):
    """The proof timed every case under the policy of its day; a policy edit since (a rule, the order, a
    capability) that changes any pick on the H100 makes that report stale. Each case is re-decided here on the
    simulated H100 (configs/devices/h100.yaml: the libraries the GPU machine had) and must land on the pick, and
    the rule, the report measured — else re-run benchmarks/gpu_policy_proof.sh."""
    fields = dict(record["case"])
    fields["lens"] = tuple(fields["lens"]) if fields["lens"] else None
    case = proof.Case(**fields)
    meta = torch.device("meta")
    q, k, v = case.inputs(meta)
    decision = opdispatch.explain(q, k, v, device=DEVICES_DIR / "h100.yaml", **case.kwargs(meta))
    by = decision.decided_by
    assert (decision.chosen_id, by.rule if by else None) == (record["pick"], record["decided_by_rule"]), (
        f"{record['name']}: the H100 proof measured {record['pick']} ({record['decided_by']}); the policy now picks "
        f"{decision.chosen_id} ({by.short(decision.chosen_id) if by else None}): re-run benchmarks/gpu_policy_proof.sh")
