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
from opdispatch.tools._validate import CaseResult, attention_cases, covering_rows, quarantine_rules, quarantine_yaml
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
    quarantine.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: keep-me-other-host\n"
                          "        when: {device_name: 'another host'}\n        deny: [cpu.flash]\n")
    result = subprocess.run([sys.executable, "-m", "opdispatch.tools._cli", "validate", "--impl", impls, "--on", "cpu",
                             "--quick", "--timeout", "6", "--jobs", "2", "--quarantine", str(quarantine), "--json", str(report)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr  # failures found, the run itself finished
    cases = json.loads(report.read_text())["cases"]

    def by(impl, status):
        return [c for c in cases[impl] if c["status"] == status]

    def options(c):
        return dict(map(tuple, c["options"]))

    assert cases["vfake.right"] and not [c for c in cases["vfake.right"] if c["status"] not in ("pass",)]
    assert all(c["status"] == "fail" for impl in ("vfake.shape", "vfake.nan") for c in cases[impl]
               if c["d"] > 1)  # out[..., :1] is all of a head dim of 1
    assert "changed its input(s) q" in by("vfake.corrupt", "fail")[0]["detail"]
    crashed, passed = by("vfake.abort", "crashed"), by("vfake.abort", "pass")
    assert crashed and all(options(c)["heads"] == "mqa" and options(c)["causal"] != "none" for c in crashed)
    assert any(options(c)["heads"] == "mqa" for c in passed)  # a fresh worker took the cases after a crash
    hung = by("vfake.hang", "timeout")
    assert hung and all(options(c)["heads"] == "mqa" for c in hung) and by("vfake.hang", "pass")
    bottom = by("vfake.bottom", "fail")
    assert bottom and all(options(c)["causal"] == "bottom_right" for c in bottom)
    text = quarantine.read_text()
    assert "quarantine-vfake.right" not in text and "quarantine-vfake.abort-" in text
    assert "quarantine-vfake.hang-" in text and "quarantine-vfake.bottom-causal-True-causal_alignment-bottom_right" in text
    assert " pass " in result.stdout and " error " in result.stdout  # progress counts, not the last status
    assert "keep-me-other-host" in text  # merged: another host's rule survives
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


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A fresh manager with the fakes loaded through their entry point (a dist-info on sys.path)."""
    site = installed_fakes(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("OPDISPATCH_PLUGINS", "cpu,reference,vfake")
    monkeypatch.setenv("OPDISPATCH_CHECK_OUTPUTS", "1")
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    yield fresh
    opdispatch.set_manager(previous)


def test_covering_rows_cover_every_allowed_pair_and_depend_on_the_seed_alone():
    import itertools

    factors = {"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False), "d": (0, 1, 2, 3)}

    def allowed(row):
        return not (row["a"] == 2 and row["b"] == "y")  # a pair no row may hold

    rows = covering_rows(factors, allowed, seed=7)
    assert rows == covering_rows(factors, allowed, seed=7) and all(allowed(r) for r in rows)
    for (f, g) in itertools.combinations(factors, 2):
        for vf, vg in itertools.product(factors[f], factors[g]):
            feasible = any(allowed({**dict.fromkeys(factors, 0), "b": "x", f: vf, g: vg}) for _ in [0]) or \
                {f: vf, g: vg} != {"a": 2, "b": "y"}
            covered = any(r[f] == vf and r[g] == vg for r in rows)
            assert covered == ({f: vf, g: vg} != {"a": 2, "b": "y"}), (f, vf, g, vg, feasible)
    assert len(rows) < 3 * 2 * 2 * 4  # pairs, not the product


def test_the_matrix_combines_declared_features_and_adds_the_edge_rows(fakes):
    import itertools

    from opdispatch.tools._validate import BASELINE, FACTORS

    info = fakes.device_info("cpu")
    reference = fakes.implementation("attention", "reference.math")
    cases = attention_cases(reference, "cpu", ["fp32", "fp64"], True, info)
    assert cases == attention_cases(reference, "cpu", ["fp32", "fp64"], True, info)  # seeded
    pairwise = [c for c in cases if c.feature == "pairwise"]
    for f, g in itertools.combinations([f for f in FACTORS if f != "lengths"], 2):
        for vf, vg in itertools.product(FACTORS[f], FACTORS[g]):
            if {f: vf, g: vg} in ({"layout": "thd", "term": "mask"}, {"layout": "thd", "term": "bias"}) or (
                    {f, g} == {"kv_cache", "term"} and vg in ("mask", "bias") and vf != "none"):
                continue  # the op refuses these
            assert any(c.factors()[f] == vf and c.factors()[g] == vg for c in pairwise), (f, vf, g, vg)
    edges = {c.feature for c in cases} - {"pairwise"}
    assert edges == {"keyless_causal", "keyless_causal_backward", "keyless_window", "keyless_mask", "decode",
                     "seqlen_q_below_k", "seqlen_q_above_k", "head_dim_min", "head_dim_max", "strided",
                     "backward_twice", "lse_gradient"}
    # An implementation gets only what it declares: vfake.right has no thd, window, KV cache, backward.
    right = attention_cases(fakes.implementation("attention", "vfake.right"), "cpu", ["fp32"], True, info)
    assert right and all(c.factors()["layout"] != "thd" and c.factors()["direction"] == "forward" for c in right)
    assert {c.factors()["heads"] for c in right} == {"mha", "gqa", "mqa"}
    assert BASELINE["layout"] == "bshd"


def test_validate_quarantines_exactly_the_three_combination_bugs_of_a_plugin(fakes, tmp_path, monkeypatch):
    """The done-when: thd bottom-right, GQA backward, NaN on a row that sees no key — each caught and denied for
    exactly its calls; other calls still reach the plugin."""
    from opdispatch.tools._validate import env_conditions, in_process, merge_quarantine, quarantine_text, validate_one
    from opdispatch.policies import parse_policy

    info = fakes.device_info("cpu")
    impl = fakes.implementation("attention", "vfake.combo")
    results, isolations = validate_one(impl, "cpu", info, ["fp32"], True, in_process(impl.id, "cpu"))
    failed = {r.case.describe(): r.detail for r in results if r.status == "fail" and r.case.feature != "isolate"}
    assert any("layout=thd" in d and "causal=bottom_right" in d for d in failed)
    assert any("heads=gqa" in d and "direction=backward" in d for d in failed)
    assert any(d.startswith("keyless_causal ") for d in failed)
    rules = quarantine_rules(impl.id, results, env_conditions(info, {}), isolations)["attention"]
    path = tmp_path / "q.yaml"
    path.write_text(quarantine_text(merge_quarantine(None, {impl.id: {"attention": rules}}, {}), info, "test"))
    monkeypatch.setenv("OPDISPATCH_QUARANTINE", str(path))
    fakes.set_policy(parse_policy("ops: {attention: {order: [vfake.combo, reference.math]}}", "<p>",
                                  environ={"OPDISPATCH_QUARANTINE": str(path)}))

    def chosen(q, k, v, **kw):
        decision = opdispatch.explain(q, k, v, **kw)
        if decision.chosen_id != "vfake.combo":
            assert decision.candidate("vfake.combo").reasons[0].startswith("quarantined by validate")
        return decision.chosen_id

    q, k, kv2 = torch.randn(2, 19, 8, 32), torch.randn(2, 45, 8, 32), torch.randn(2, 45, 2, 32)
    assert chosen(q, k, k, causal=True, causal_alignment="bottom_right") == "vfake.combo"  # dense: right
    assert chosen(q, kv2, kv2) == "vfake.combo"  # GQA forward: right
    grad = q.clone().requires_grad_()
    assert chosen(grad, k, k, causal=True) == "vfake.combo"  # MHA backward: right
    assert chosen(grad, kv2, kv2) == "reference.math"  # (b) GQA backward
    blind = torch.randn(2, 60, 8, 32)
    assert chosen(blind, k, k, causal=True, causal_alignment="bottom_right") == "reference.math"  # (c)
    assert chosen(blind, k, k, causal=True) == "vfake.combo"  # top-left: every row sees a key
    cu_q = torch.tensor([0, 5, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 45], dtype=torch.int32)
    tq, tk = torch.randn(19, 8, 32), torch.randn(45, 8, 32)
    packed = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=14, max_seqlen_k=25)
    assert chosen(tq, tk, tk, causal=True, causal_alignment="bottom_right", **packed) == "reference.math"  # (a)
    assert chosen(tq, tk, tk, causal=True, **packed) == "vfake.combo"  # thd top-left: right
    # What reaches the plugin is right, and what it would get wrong is served right by another.
    out = opdispatch.attention(tq, tk, tk, causal=True, causal_alignment="bottom_right", **packed)
    want = opdispatch.attention(tq.double(), tk.double(), tk.double(), causal=True, causal_alignment="bottom_right",
                                impl="reference.math", **packed)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_quarantine_applies_on_its_device_and_versions_only(basic_manager, tmp_path):
    from opdispatch import load_device_descriptor
    from opdispatch.tools._validate import BASELINE, make_case
    from opdispatch.policies import parse_policy

    cpu = basic_manager.device_info("cpu")
    case = make_case(0, "pairwise", {**BASELINE, "causal": "top_left", "dtype": "fp32"})
    other = make_case(1, "pairwise", {**BASELINE, "dtype": "fp32"})
    results = [CaseResult(case, "fail", "out error 3.1 > 0.002"), CaseResult(other, "pass")]
    path = tmp_path / "q.yaml"
    path.write_text(quarantine_yaml({"cpu.flash": results}, cpu, lambda impl: {"torch": f"=={cpu.libraries['torch']}"},
                                    "test"))
    policy = parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)})
    basic_manager.set_policy(policy)
    q = torch.randn(1, 6, 2, 16)
    causal = opdispatch.explain(q, q, q, causal=True)
    assert causal.chosen_id == "reference.math"
    assert causal.candidate("cpu.flash").reasons[0].startswith(
        "quarantined by validate: fail: out error 3.1 > 0.002 on [pairwise fp32")
    assert opdispatch.explain(q, q, q).chosen_id == "cpu.flash"  # another class
    assert opdispatch.explain(q.double(), q.double(), q.double(), causal=True).chosen_id == "cpu.flash"  # dtype
    device = load_device_descriptor(REPO / "configs" / "devices" / "cpu.yaml")  # a simulated CPU, another name
    assert opdispatch.explain(q, q, q, causal=True, device=device).chosen_id == "cpu.flash"


def test_quarantine_files_are_merged_never_replaced(basic_manager):
    from opdispatch.tools._validate import merge_quarantine

    def rule(name, impl, host):
        return {"name": name, "when": {"vendor": "cpu", "arch": "x86_64", "device_name": host}, "deny": [impl]}

    existing = {"version": 1, "ops": {"attention": {"rules": [
        rule("a-here", "cpu.flash", "here"), rule("a-there", "cpu.flash", "there"), rule("b-here", "other.x", "here")]},
        "rms_norm": {"rules": [rule("n", "other.norm", "here")]}}}
    env = {"vendor": "cpu", "arch": "x86_64", "device_name": "here"}
    new = {"cpu.flash": {"attention": [rule("a-here", "cpu.flash", "here") | {"reason": "new"}]}}
    body = merge_quarantine(existing, new, {"cpu.flash": env})
    names = [(r["name"], r.get("reason")) for r in body["ops"]["attention"]["rules"]]
    assert names == [("a-there", None), ("b-here", None), ("a-here", "new")]  # only cpu.flash here rewritten
    assert body["ops"]["rms_norm"]["rules"][0]["name"] == "n"
    assert "ops" not in merge_quarantine(None, {}, {"cpu.flash": env})  # nothing failed, nothing kept


def test_a_bad_quarantine_file_is_a_warning_and_is_skipped(tmp_path, caplog):
    from opdispatch.policies import parse_policy

    path = tmp_path / "q.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: sneaky\n        prefer: [cpu.flash]\n")
    with caplog.at_level("WARNING", logger="opdispatch"):
        policy = parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)})
    assert str(path) not in [layer.source for layer in policy.layers]
    assert f"{path}:5: quarantine rule 'sneaky' must only deny" in caplog.text
    path.write_text("version: 1\nops: [\n")
    with caplog.at_level("WARNING", logger="opdispatch"):
        parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(path)})
    assert f"{path}:" in caplog.text and "invalid YAML" in caplog.text
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block forever: it must never be opened
    caplog.clear()
    with caplog.at_level("WARNING", logger="opdispatch"):
        policy = parse_policy("ops: {}", "<p>", environ={"OPDISPATCH_QUARANTINE": str(fifo)})
    assert "not a regular file" in caplog.text and str(fifo) not in [layer.source for layer in policy.layers]
    q = torch.randn(1, 4, 2, 8)
    opdispatch.get_manager().set_policy(policy)
    assert opdispatch.attention(q, q, q).shape == q.shape  # dispatch goes on


def test_validating_nothing_exits_non_zero_and_writes_nothing(fakes, tmp_path):
    import io

    from opdispatch.tools._validate import run_validation

    target = tmp_path / "q.yaml"
    target.write_text("version: 1\n")
    out = io.StringIO()
    code = run_validation(["vfake.elsewhere"], "cpu", timeout=5, quick=True, quarantine_path=target, report_md=None,
                          report_json=None, stream=out)
    assert code == 2, out.getvalue()
    assert "vfake.elsewhere is not available on cpu: needs an accelerator" in out.getvalue()
    assert "nothing to validate" in out.getvalue() and target.read_text() == "version: 1\n"


def test_the_shipped_quarantine_keeps_flag_gems_backward_off_hopper(manager):
    from opdispatch import load_device_descriptor

    h100 = load_device_descriptor(REPO / "configs" / "devices" / "h100.yaml")
    q = torch.randn(1, 64, 8, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    decision = opdispatch.explain(q, q, q, causal=True, device=h100)
    reason = decision.candidate("flagos.triton").reasons[0]
    assert reason.startswith("quarantined by validate: flag_gems 5.0.2 SDPA backward died") and "#3395" in reason


@pytest.mark.slow
def test_a_budget_writes_the_reports_and_keeps_an_unfinished_implementations_rules(tmp_path):
    """--budget: a hang that would hold the run past a job runner's limit (the first H100 runs were killed before
    any report was written) instead ends the run on time: the cases left are 'not run', the reports and the
    quarantine are written, and the unfinished implementation's earlier rules are kept (no evidence either way)."""
    site = installed_fakes(tmp_path / "site")
    quarantine, report, md = tmp_path / "quarantine.yaml", tmp_path / "report.json", tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", OPDISPATCH_PLUGINS="cpu,reference,vfake")
    earlier = ("version: 1\nops:\n  attention:\n    rules:\n      - name: earlier-hang-rule\n"
               "        when: {vendor: cpu}\n        deny: [vfake.hang]\n        reason: an earlier run\n")
    quarantine.write_text(earlier)
    result = subprocess.run([sys.executable, "-m", "opdispatch.tools._cli", "validate", "--impl", "vfake.hang", "--on", "cpu",
                             "--quick", "--timeout", "300", "--budget", "20", "--quarantine", str(quarantine),
                             "--json", str(report), "--report", str(md)],
                            env=env, capture_output=True, text=True, timeout=280)
    assert "--budget 20 s ran out before vfake.hang finished" in result.stdout, result.stdout + result.stderr
    statuses = [c["status"] for c in json.loads(report.read_text())["cases"]["vfake.hang"]]
    assert "not run" in statuses and "timeout" not in statuses  # the hang was cut by the budget, not --timeout
    assert "| not run |" in md.read_text()
    assert "earlier-hang-rule" in quarantine.read_text()


@pytest.mark.slow
def test_a_split_run_gives_every_case_the_result_of_a_single_worker_run(tmp_path):
    """--split: one implementation's cases over several workers (what a cold Triton or torch.flex matrix needs on a
    GPU) report every case once, with the statuses one worker gives (the test above) — crashes only on MQA causal
    cases, each share restarting its own worker and going on; failures only on bottom-right ones — and progress
    counts the implementation's cases as one run."""
    site = installed_fakes(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", OPDISPATCH_PLUGINS="cpu,reference,vfake")
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "opdispatch.tools._cli", "validate", "--impl", "vfake.abort,vfake.bottom",
                             "--on", "cpu", "--quick", "--timeout", "120", "--split", "3", "--no-quarantine",
                             "--json", str(report)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    cases = json.loads(report.read_text())["cases"]

    def options(c):
        return dict(map(tuple, c["options"]))

    matrix = {impl: [c for c in cases[impl] if c["feature"] != "isolate"] for impl in cases}
    crashed = [c for c in matrix["vfake.abort"] if c["status"] == "crashed"]
    assert crashed and all(options(c)["heads"] == "mqa" and options(c)["causal"] != "none" for c in crashed)
    assert {c["status"] for c in matrix["vfake.abort"]} == {"crashed", "pass"}  # shares went on after crashes
    failed = [c for c in matrix["vfake.bottom"] if c["status"] == "fail"]
    assert failed and all(options(c)["causal"] == "bottom_right" for c in failed)
    assert sorted(c["index"] for c in matrix["vfake.abort"]) == list(range(len(matrix["vfake.abort"])))
    import re

    out = result.stdout
    assert re.search(r"^vfake\.abort +\[#{24}\] (\d+)/\1 pass", out, re.M), out  # counted as one run, to the end
    assert "vfake.abort.1" not in out
