"""`opdispatch validate`: per-implementation worker processes, crash and hang isolation, the quarantine it writes,
and what the policy then does with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opdispatch
from opdispatch._validate import CaseResult, attention_cases, quarantine_yaml
from tests.conftest import REPO

FAKES = REPO / "tests" / "validate_fakes"


def installed_fakes(site: Path) -> Path:
    """The fakes as an installed distribution: the module plus a dist-info with its entry point."""
    site.mkdir(exist_ok=True)
    (site / "validate_fakes.py").write_text((FAKES / "validate_fakes.py").read_text())
    info = site / "validate_fakes-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: validate-fakes\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[opdispatch.plugins]\nvfake = validate_fakes\n")
    return site


@pytest.mark.slow
def test_validate_isolates_crashes_and_hangs_and_quarantines_exactly_the_failing_classes(tmp_path):
    site = installed_fakes(tmp_path / "site")
    quarantine, report = tmp_path / "quarantine.yaml", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", OPDISPATCH_PLUGINS="cpu,reference,vfake")
    impls = "vfake.right,vfake.shape,vfake.nan,vfake.corrupt,vfake.abort,vfake.hang,vfake.bottom,vfake.norm"
    result = subprocess.run([sys.executable, "-m", "opdispatch._cli", "validate", "--impl", impls, "--on", "cpu",
                             "--quick", "--timeout", "6", "--jobs", "2", "--quarantine", str(quarantine), "--json", str(report)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr  # failures found, the run itself finished
    cases = json.loads(report.read_text())["cases"]

    def statuses(impl):
        return {c["feature"]: c["status"] for c in cases[impl]}

    right = statuses("vfake.right")
    assert set(right.values()) <= {"pass", "not declared"} and right["causal_bottom_right"] == "pass"
    assert statuses("vfake.shape")["dense"] == "fail" and statuses("vfake.nan")["dense"] == "fail"
    assert statuses("vfake.corrupt")["dense"] == "fail"
    assert "changed its input(s) q" in next(c["detail"] for c in cases["vfake.corrupt"] if c["feature"] == "dense")
    abort = statuses("vfake.abort")
    assert abort["causal"] == "crashed" and abort["causal_bottom_right"] == "crashed" and abort["dense"] == "pass"
    assert abort["gqa"] == "pass"  # a fresh worker took the cases after the crash
    hang = statuses("vfake.hang")
    assert hang["gqa"] == "timeout" and hang["dense"] == "pass" and hang["lse"] != "timeout"
    bottom = statuses("vfake.bottom")
    assert bottom["causal_bottom_right"] == "fail" and bottom["causal"] == "pass" and bottom["dense"] == "pass"
    text = quarantine.read_text()
    assert "quarantine-vfake.bottom-causal_bottom_right" in text and "quarantine-vfake.right" not in text
    assert "quarantine-vfake.abort-causal" in text and "quarantine-vfake.hang-gqa" in text
    assert "quarantine-vfake.abort-dense" not in text
    norm = cases["vfake.norm"]  # another op: its tuning cases (no backward declared: those are not run)
    assert {c["status"] for c in norm if ("weight", False) in map(tuple, c["data"])} == {"pass", "not declared"}
    assert {c["status"] for c in norm if ("weight", True) in map(tuple, c["data"])} == {"fail", "not declared"}
    import yaml

    rules = yaml.safe_load(text)["ops"]["rms_norm"]["rules"]
    assert rules and all(r["deny"] == ["vfake.norm"] and r["when"].get("weight") is True for r in rules)

    # The quarantine now steers dispatch, in a process that reads it as a user would.
    check = """
        import json, torch, opdispatch
        from opdispatch.policies import parse_policy
        m = opdispatch.get_manager()
        m.set_policy(parse_policy("ops: {attention: {order: [vfake.bottom, vfake.right, cpu.flash]}}", "<p>",
                                  environ={"OPDISPATCH_QUARANTINE": %r}))
        q, k = torch.randn(1, 5, 2, 16), torch.randn(1, 9, 2, 16)
        br = opdispatch.explain(q, k, k, causal=True, causal_alignment="bottom_right")
        plain = opdispatch.explain(q, k, k)
        pinned = opdispatch.explain(q, k, k, causal=True, causal_alignment="bottom_right", impl="vfake.bottom")
        print(json.dumps(dict(chosen=br.chosen_id, reason=br.candidate("vfake.bottom").reasons[0],
                              plain=plain.chosen_id, pinned=pinned.chosen_id)))
    """ % str(quarantine)
    out = subprocess.run([sys.executable, "-c", __import__("textwrap").dedent(check)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["chosen"] == "vfake.right" and seen["plain"] == "vfake.bottom" and seen["pinned"] == "vfake.bottom"
    assert seen["reason"].startswith("quarantined by validate: fail: out error") and str(quarantine) in seen["reason"]


def test_a_quarantine_applies_on_its_device_and_versions_only(basic_manager, tmp_path):
    from opdispatch import load_device_descriptor
    from opdispatch.policies import parse_policy

    cpu = basic_manager.device_info("cpu")
    case = attention_cases(["fp32"], ["causal"])[0]
    failures = {"cpu.flash": [CaseResult(case, "fail", "out error 3.1 > 0.002")]}
    path = tmp_path / "q.yaml"
    path.write_text(quarantine_yaml(failures, cpu, lambda impl: {"torch": f"=={cpu.libraries['torch']}"}, "test"))
    policy = parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)})
    basic_manager.set_policy(policy)
    q = torch.randn(1, 6, 2, 16)
    causal = opdispatch.explain(q, q, q, causal=True)
    assert causal.chosen_id == "reference.math"
    assert causal.candidate("cpu.flash").reasons[0].startswith(
        "quarantined by validate: fail: out error 3.1 > 0.002 on [causal fp32")
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"  # another class
    k = torch.randn(1, 9, 2, 16)
    bottom = attention_cases(["fp32"], ["causal_bottom_right"])[0]
    path.write_text(quarantine_yaml({"cpu.flash": [CaseResult(bottom, "fail", "out error 2.0")]}, cpu,
                                    lambda impl: {}, "test"))
    basic_manager.set_policy(parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)}))
    assert opdispatch.explain(q, k, k, causal=True, causal_alignment="bottom_right").chosen_id == "reference.math"
    assert opdispatch.explain(q, k, k, causal=True).chosen_id == "cpu.flash"  # top-left causal: not quarantined
    basic_manager.set_policy(policy)
    assert opdispatch.explain(q.double(), q.double(), q.double(), causal=True).chosen_id == "cpu.flash"  # dtype
    other = load_device_descriptor(REPO / "configs" / "devices" / "cpu.yaml")  # a simulated CPU, another name
    assert opdispatch.explain(q, q, q, causal=True, device=other).chosen_id == "cpu.flash"
    torch.testing.assert_close(opdispatch.attention(q, q, q, causal=True, impl="cpu.flash"),
                               opdispatch.attention(q, q, q, causal=True), atol=1e-5, rtol=1e-5)


def test_a_quarantine_file_may_only_deny(tmp_path):
    from opdispatch._errors import PolicyError
    from opdispatch.policies import parse_policy

    path = tmp_path / "q.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: sneaky\n        prefer: [cpu.flash]\n")
    with pytest.raises(PolicyError, match=r"q.yaml:5: quarantine rule 'sneaky' must only deny"):
        parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)})


def test_the_shipped_quarantine_keeps_flag_gems_backward_off_hopper(manager):
    from opdispatch import load_device_descriptor

    h100 = load_device_descriptor(REPO / "configs" / "devices" / "h100.yaml")
    q = torch.randn(1, 64, 8, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    decision = opdispatch.explain(q, q, q, causal=True, device=h100)
    reason = decision.candidate("flagos.triton").reasons[0]
    assert reason.startswith("quarantined by validate: flag_gems 5.0.2 SDPA backward died") and "#3395" in reason
