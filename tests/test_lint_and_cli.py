"""`opdispatch policy lint` and the other CLI commands, run through the real entry point function."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import opdispatch

from opdispatch.tools._cli import main
from opdispatch.policies._lint import lint_policy_file
from tests.conftest import REPO, device_descriptor

LINTME = """\
ops:
  attention:
    order: [cpu.flash, nvidia.cudnnx]
    deny: [reference.math]
    rules:
      - name: pin-long
        when: {seqlen_q: '>=1024'}
        pin: cpu.flash
      - name: long-causal
        when: {seqlen_q: '>=1024', causal: true}
        prefer: [reference.math]
      - name: impossible
        when: {layout: bshd, varlen: true}
        deny: [cpu.flash]
      - name: wrong-family
        when: {vendor: amd, arch: '>=sm80'}
        deny: [cpu.flash]
      - name: nvidia-only
        when: {vendor: nvidia}
        deny: [cpu.flash]
      - name: twice-a
        when: {dtype: bf16}
        prefer: [cpu.flash]
      - name: twice-b
        when: {dtype: bf16}
        prefer: [cpu.flash]
      - name: no-conditions
        deny: ['cpu.*']
"""


def test_lint_reports_each_problem_with_file_and_line(tmp_path, basic_manager):
    path = tmp_path / "p.yaml"
    path.write_text(LINTME)
    ids = {"attention": ["cpu.flash", "reference.math"]}
    from opdispatch import load_device_descriptor

    findings = [str(f) for f in lint_policy_file(path, ids, load_device_descriptor(device_descriptor("cpu")))]
    expected = [
        f"{path}:3: warning: order 'nvidia.cudnnx' matches no registered implementation",
        f"{path}:4: warning: reference.math is denied everywhere by deny 'reference.math'",
        f"{path}:9: warning: rule 'long-causal' is shadowed by rule 'pin-long' ({path}:6)",
        f"{path}:12: warning: rule 'impossible' can never match: varlen: true needs layout thd",
        f"{path}:15: warning: rule 'wrong-family' can never match: arch >=sm80",
        f"{path}:18: warning: rule 'nvidia-only' never matches on cpu",
        f"{path}:24: warning: rule 'twice-b' repeats rule 'twice-a' ({path}:21)",
        f"{path}:27: warning: cpu.flash is denied everywhere by rule 'no-conditions'",
    ]
    for want in expected:
        assert any(f.startswith(want) for f in findings), (want, findings)
    assert len(findings) == len(expected) + 1  # wrong-family also never matches on the CPU descriptor


def test_lint_schema_error_is_one_error_finding(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ops:\n  attention:\n    order: nope\n")
    (finding,) = lint_policy_file(path, {})
    assert finding.level == "error" and finding.where == f"{path}:3"
    assert "field ops.attention.order" in finding.message


SCHEMA_ERRORS = """\
ops:
  attention:
    order: nope
    deni: [cpu.flash]
    rules:
      - name: a
        when: {layout: bsdh}
        pinn: cpu.flash
      - name: b
        when: {causal: yes-please}
        prefer: 3
settings:
  strictt: true
"""


def test_lint_reports_every_schema_error_at_once_each_with_its_line(tmp_path, capsys, basic_manager):
    path = tmp_path / "bad.yaml"
    path.write_text(SCHEMA_ERRORS)
    findings = lint_policy_file(path, {})
    expected = [  # in line order, one per problem, each with the line of its key
        (3, "field ops.attention.order: must be a YAML list"),
        (4, "field ops.attention.deni: unknown key 'deni'; allowed keys here: order, deny, rules, options, "
            "autotune; did you mean 'deny'?"),
        (7, "field ops.attention.rules.0.when.layout: layout 'bsdh' is not one of"),
        (8, "field ops.attention.rules.0.pinn: unknown key 'pinn'"),
        (10, "field ops.attention.rules.1.when.causal"),
        (11, "field ops.attention.rules.1.prefer: must be a YAML list"),
        (13, "field settings.strictt: unknown key 'strictt'"),
    ]
    assert [f.level for f in findings] == ["error"] * len(expected)
    assert [f.where for f in findings] == [f"{path}:{line}" for line, _ in expected]
    for finding, (_, text) in zip(findings, expected):
        assert finding.message.startswith(text), (text, finding.message)
    assert "did you mean 'pin'?" in findings[3].message
    assert main(["policy", "lint", str(path)]) == 1
    assert capsys.readouterr().out.count(": error: ") == len(expected)
    # Loading stops at the first, and says how many more there are and how to see them.
    from opdispatch.policies._policy import read_policy_file

    with pytest.raises(opdispatch.PolicyError, match=rf"\(and {len(expected) - 1} more problem\(s\); `opdispatch "
                                                     rf"policy lint {path}` lists them all\)") as info:
        read_policy_file(path)
    assert len(info.value.problems) == len(expected)


def test_lint_reports_every_problem_the_schema_cannot_see(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ops:\n  attention:\n    rules:\n      - {name: a, when: {residual: true}, deny: [cpu.flash]}\n"
                    "      - {name: a, deny: [cpu.flash]}\n  rms_nrom:\n    order: [reference.rms_norm]\n")
    findings = [str(f) for f in lint_policy_file(path, {})]
    assert len(findings) == 3, findings
    assert findings[0].startswith(f"{path}:4: error: field ops.attention.rules.0.when.residual: 'residual' is not a "
                                  "feature of op 'attention'")
    assert findings[1].startswith(f"{path}:5: error: field ops.attention.rules.1.name: rule name 'a' is used twice")
    assert findings[2].startswith(f"{path}:6: error: field ops.rms_nrom: unknown op 'rms_nrom'")
    assert findings[2].endswith("did you mean 'rms_norm'?")


def test_lint_suggests_the_registered_id_a_misspelt_one_meant(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("ops:\n  attention:\n    order: [cpu.flsh, nvidia.*]\n    deny: [refrence.math]\n")
    findings = [str(f) for f in lint_policy_file(path, {"attention": ["cpu.flash", "reference.math"]})]
    assert findings == [
        f"{path}:3: warning: order 'cpu.flsh' matches no registered implementation of 'attention' (registered: "
        "cpu.flash, reference.math); did you mean 'cpu.flash'?",
        f"{path}:3: warning: order 'nvidia.*' matches no registered implementation of 'attention' (registered: "
        "cpu.flash, reference.math)",  # nothing close: no guess
        f"{path}:4: warning: deny 'refrence.math' matches no registered implementation of 'attention' "
        "(registered: cpu.flash, reference.math); did you mean 'reference.math'?",
    ]


def test_lint_cli_exit_codes(tmp_path, capsys, basic_manager):
    bad = tmp_path / "bad.yaml"
    bad.write_text(LINTME)
    assert main(["policy", "lint", str(bad)]) == 1
    assert f"{bad}:4: warning" in capsys.readouterr().out
    good = tmp_path / "good.yaml"
    good.write_text("ops:\n  attention:\n    order: [cpu.flash]\n")
    assert main(["policy", "lint", str(good)]) == 0
    assert f"{good}: ok" in capsys.readouterr().out


def test_shipped_default_policy_lints_clean_against_all_plugins(manager, capsys):
    assert main(["policy", "lint", str(REPO / "configs" / "default.yaml")]) == 0, capsys.readouterr().out


def test_list_shows_availability_and_origin(capsys, basic_manager):
    assert main(["list", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "cpu.flash" in out and "reference.math" in out and "plugin 'cpu' (module opdispatch.vendors.cpu" in out
    assert main(["list", "--device", str(device_descriptor("cpu")), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "simulated from" in out and "causal_alignments" in out


def _list_rows(out: str, op: str) -> list[tuple[str, str, str]]:
    """(id, rank, available) of each row of `op`'s table in `opdispatch list` output (COLUMNS wide: unwrapped)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{op}:"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        impl_id, rank, _priority, _origin, available = line.split(None, 4)
        rows.append((impl_id, rank, available))
    return rows


def test_list_shows_each_op_in_the_order_its_policy_ranks_it(tmp_path, capsys, monkeypatch, basic_manager):
    # The shipped order puts torch.flex before cpu.flash; a user policy reverses the registry's priority order.
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["list", "--op", "attention"]) == 0
    rows = _list_rows(capsys.readouterr().out, "attention")
    assert [r[0] for r in rows] == ["torch.flex", "cpu.flash", "reference.math"] or \
        [r[0] for r in rows] == ["cpu.flash", "reference.math"]  # torch.flex only where its plugin is loaded
    assert [r[1] for r in rows] == [str(n) for n in range(1, len(rows) + 1)]
    policy = tmp_path / "p.yaml"
    policy.write_text("ops:\n  attention:\n    order: [reference.math, '*']\n    rules:\n"
                      "      - {name: long, when: {seqlen_q: '>=1024'}, prefer: [cpu.flash]}\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(policy))
    monkeypatch.setenv("OPDISPATCH_DENY", "cpu.*")
    basic_manager.reload()
    assert main(["list", "--op", "attention"]) == 0
    rows = _list_rows(capsys.readouterr().out, "attention")
    # reference.math first (the user's order), cpu.flash last and denied by the env; the rule (a `when:`) is not
    # applied to a list without a call.
    assert rows[0][:2] == ("reference.math", "1") and rows[-1][:2] == ("cpu.flash", "-")
    assert rows[-1][2].startswith("denied by OPDISPATCH_DENY; yes")
    monkeypatch.setenv("OPDISPATCH_IMPL_ATTENTION", "cpu.flash")
    basic_manager.reload()
    assert main(["list", "--op", "attention"]) == 0
    rows = _list_rows(capsys.readouterr().out, "attention")
    assert rows[0][:2] == ("cpu.flash", "pin") and rows[0][2].startswith("pinned by OPDISPATCH_IMPL_ATTENTION")
    assert rows[1][:2] == ("reference.math", "1") and len({r[0] for r in rows}) == len(rows)


@pytest.mark.parametrize("command", [("explain",), ("list",), ("doctor",), ("demo",), ("policy", "lint")])
def test_help_explains_every_flag_with_its_values_and_default(command):
    parser = __import__("opdispatch.tools._cli", fromlist=["build_parser"]).build_parser()
    for name in command:
        parser = parser._subparsers._group_actions[0].choices[name]
    for action in parser._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        text = action.help or ""
        assert "default" in text or action.required, (command, action.option_strings, text)
        if action.choices:
            assert "%(choices)s" in text, action.option_strings


def test_explain_help_names_the_values_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    assert "fp16, bf16, fp32, fp64" in out and "top_left, bottom_right (default: top_left" in out


def test_explain_cli_on_a_simulated_device(capsys, basic_manager):
    code = main(["explain", "--shape", "2,128,8,64", "--kv-heads", "2", "--dtype", "fp32", "--causal",
                 "--device", str(device_descriptor("cpu"))])
    out = capsys.readouterr().out
    assert code == 0 and "chosen:  cpu.flash" in out and "simulated from" in out
    code = main(["explain", "--shape", "2,128,8,64", "--dtype", "fp32", "--dropout", "0.1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["chosen"] == "reference.math"
    flash = next(c for c in data["candidates"] if c["impl"] == "cpu.flash")
    assert flash["status"] == "rejected" and flash["reasons"] == ["dropout_p=0.1 not supported"]


def test_explain_cli_varlen_and_pins(capsys, basic_manager):
    assert main(["explain", "--shape", "3,40,4,32", "--dtype", "fp32", "--varlen", "--causal"]) == 0
    assert "chosen:  cpu.flash" in capsys.readouterr().out  # packed sequences, each through the kernel
    assert main(["explain", "--shape", "3,40,4,32", "--dtype", "fp32", "--varlen", "--causal",
                 "--impl", "reference.math"]) == 0
    assert "chosen:  reference.math" in capsys.readouterr().out
    assert main(["explain", "--shape", "1,8,2,16", "--dtype", "fp32", "--impl", "nope.x"]) == 2
    assert "'nope.x' pinned by impl= is not registered" in capsys.readouterr().err


def test_explain_cli_reports_bad_arguments(capsys):
    assert main(["explain", "--shape", "1,8,2", "--dtype", "fp32"]) == 2
    assert "--shape '1,8,2' needs 4 comma-separated integers" in capsys.readouterr().err
    assert main(["explain", "--shape", "1,8,2,16", "--dtype", "fp13"]) == 2
    assert "unknown dtype 'fp13'" in capsys.readouterr().err


def test_doctor(capsys, basic_manager):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "policy:" in out and "plugin 'cpu'" in out and "cpu.flash: available" in out


@pytest.mark.slow
def test_demo_runs_and_checks_results():
    result = subprocess.run([sys.executable, "-m", "opdispatch", "demo"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout and "PASS" in result.stdout and "FAIL " not in result.stdout
    assert "PASS  rms_norm + residual add" in result.stdout and "PASS  rotary_embedding" in result.stdout


def test_explain_any_op_from_the_command_line(capsys, manager):
    h100 = str(device_descriptor("h100"))
    assert main(["explain", "--op", "rms_norm", "--shape", "32768,4096", "--device", h100]) == 0
    out = capsys.readouterr().out
    assert "op:      rms_norm" in out and "chosen:  flagos.rms_norm" in out and "flagos-for-large-rms-norm" in out
    assert main(["explain", "--op", "rotary_embedding", "--shape", "2,128,32,128", "--kv-heads", "8",
                 "--rotary-dim", "64", "--grad", "--device", h100, "--wide"]) == 0
    out = capsys.readouterr().out
    assert "rotary_dim 64/128" in out and "partial rotary (rotary_dim 64 < head_dim 128) not supported" in out
    assert main(["explain", "--op", "rms_norm", "--shape", "4,8,16", "--device", h100]) == 2
    assert "--shape (TOKENS,HIDDEN for rms_norm) '4,8,16' needs 2 comma-separated integers" in capsys.readouterr().err


def test_list_names_missing_vendor_libraries_with_install_hints(capsys, manager):
    assert main(["list", "--wide"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("  rocm.aiter "))
    assert "library 'aiter' is not installed; install it with:" in line
    line = next(l for l in out.splitlines() if l.startswith("  cpu.flash "))
    assert line.endswith(" yes")


def test_lint_reports_unsatisfiable_require_and_missing_autotune(tmp_path, basic_manager):
    path = tmp_path / "p.yaml"
    path.write_text("""\
ops:
  attention:
    deny: [reference.math]
    autotune: tuned-missing.yaml
    rules:
      - name: only-denied
        when: {causal: true}
        require: [reference.math]
      - name: need-flash
        when: {seqlen_q: '>=128'}
        require: [cpu.flash]
      - name: need-reference-long
        when: {seqlen_q: '>=1024', dtype: fp32}
        require: ['reference.*', 'nvidia.*']
      - name: need-reference-short
        when: {seqlen_q: '<64'}
        require: ['reference.*', 'nvidia.*']
""")
    ids = {"attention": ["cpu.flash", "reference.math", "nvidia.cudnn"]}
    findings = [str(f) for f in lint_policy_file(path, ids)]
    assert any(f.startswith(f"{path}:8: error: rule 'only-denied' requires ['reference.math'], but no registered")
               for f in findings), findings
    # need-reference-long and need-flash can match one call (seqlen 2048 fp32) with disjoint lists; the short one
    # cannot match together with need-flash (seqlen < 64 and >= 128 exclude each other)
    clash = [f for f in findings if "a call matching both has no implementation" in f]
    assert len(clash) == 1 and clash[0].startswith(f"{path}:14: error: rule 'need-reference-long'"), findings
    assert "rule 'need-flash'" in clash[0]
    missing = [f for f in findings if "tuned-missing.yaml" in f]
    assert len(missing) == 1 and missing[0].startswith(f"{path}:4: error: autotune table 'tuned-missing.yaml'")
    assert "opdispatch tune --op attention" in missing[0]
    (tmp_path / "tuned-missing.yaml").write_text("format: nope\n")
    invalid = [str(f) for f in lint_policy_file(path, ids) if "tuned-missing.yaml" in str(f)]
    assert len(invalid) == 1 and "tuned table" in invalid[0] and ": error: " in invalid[0], invalid


def test_lint_checks_option_values_with_each_implementations_model(tmp_path, capsys, manager):
    path = tmp_path / "p.yaml"
    path.write_text("ops:\n  attention:\n    options:\n      rocm.aotriton: {fa_library: nope}\n")
    assert main(["policy", "lint", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:4: error: options for rocm.aotriton: fa_library: Input should be 'aotriton', 'ck' or " \
           "'default' (got 'nope')" in out


def test_doctor_reports_a_broken_policy_instead_of_dying(tmp_path, capsys, monkeypatch):
    path = tmp_path / "p.yaml"
    path.write_text("ops:\n  attention:\n    options:\n      rocm.aotriton: {fa_library: nope}\n")
    monkeypatch.setenv("OPDISPATCH_POLICY", str(path))
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    try:
        assert main(["doctor"]) == 1
    finally:
        opdispatch.set_manager(previous)
    out = capsys.readouterr().out
    assert f"policy:  BROKEN — {path}:4: field ops.attention.options.rocm.aotriton" in out
    assert "  - cpu.flash: available" in out  # the rest of the report still comes


@pytest.mark.parametrize("device", ["h100", "configs/devices/h100.yaml", "h100.yaml"])
def test_device_descriptors_resolve_by_name_and_documented_path(device, capsys, basic_manager, tmp_path,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: the shipped descriptors must be found in the package
    assert main(["list", "--device", device]) == 0
    assert "sm90 (capability 9.0), simulated from" in capsys.readouterr().out
    info = opdispatch.load_device_descriptor(device)
    assert info.arch == "sm90" and info.simulated


def test_cli_flags_are_validated(capsys, basic_manager):
    assert main(["list", "--op", "atention"]) == 2
    assert "--op 'atention' is not an op; known ops: attention, rms_norm, rotary_embedding" in capsys.readouterr().err
    for flag in ("--kv-heads", "--seqlen-k", "--head-dim-v"):
        with pytest.raises(SystemExit):
            main(["explain", "--shape", "1,8,2,16", flag, "0"])
        assert "must be at least 1" in capsys.readouterr().err
    assert main(["explain", "--shape", "1,8,2,16", "--causal", "--window", "-1,0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]
    assert main(["explain", "--shape", "1,8,2,16", "--window=4,0", "--causal", "--json"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("opdispatch ")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["tune", "--help"], ["explain"]])
def test_help_version_and_argument_errors_do_not_import_torch(argv):
    code = ("import sys\nfrom opdispatch.tools._cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'pydantic', 'yaml') if m in sys.modules)\n"
            "print('imported:', heavy)\n" % (argv,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "imported: []" in result.stdout, result.stdout + result.stderr


def test_tune_and_bench_need_an_explicit_output():
    with pytest.raises(SystemExit):
        main(["tune", "--preset", "decode"])
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "decode"])


def test_list_verbose_names_the_cudnn_requirement_not_torch(capsys):
    assert main(["list", "-v", "--device", "h100", "--op", "attention"]) == 0
    text = capsys.readouterr().out
    assert "cudnn>=9.0.0 (in the torch build)" in text and "torch>=9" not in text


@pytest.mark.parametrize("argv", [["list"], ["explain", "--shape", "1,1,8,64", "--seqlen-k", "512", "--causal",
                                             "--causal-alignment", "bottom_right", "--device", "h100"]])
def test_tables_fit_the_terminal_unless_wide(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    main(argv)
    narrow = capsys.readouterr().out.splitlines()
    assert narrow and max(map(len, narrow)) <= 100, max(narrow, key=len)  # the header lines wrap like the table
    main([*argv, "--wide"])
    wide = capsys.readouterr().out.splitlines()
    assert max(map(len, wide)) > 100  # nothing wrapped
    if argv[0] == "explain":
        row = next(line for line in narrow if " nvidia.cudnn " in line)
        assert "default.yaml:" in row and "rule 'decode-on-flash'" not in row  # short provenance, not the reason
        at = next(i for i, line in enumerate(narrow) if line.startswith("chosen:"))
        chosen = " ".join([narrow[at], *(line.strip() for line in narrow[at + 1:] if line.startswith(" " * 9))][:3])
        assert "rule 'decode-on-flash'" in chosen and "configs/default.yaml:" in chosen  # the why, in full


def test_format_table_wraps_only_the_last_column():
    from opdispatch.base._table import format_table

    rows = [("id", "reason"), ("a.b", "word " * 40), ("c.dd", "short")]
    lines = format_table(rows, width=50)
    assert all(len(line) <= 50 for line in lines)
    assert lines[1].startswith("a.b   word") and lines[2].startswith("      word") and lines[-1] == "c.dd  short"
    assert format_table(rows, width=None)[1] == "a.b   " + ("word " * 40).rstrip()


@pytest.mark.parametrize("argv,message", [
    (["explain", "--shape", "0,1,8,64"], "--shape '0,1,8,64': every value must be at least 1"),
    (["explain", "--op", "rms_norm", "--shape", "-4,64"], "every value must be at least 1"),
    (["explain", "--op", "rotary_embedding", "--shape", "1,1,8,64", "--rotary-dim", "0"], "0 must be at least 1"),
    (["explain", "--shape", "1,4,8,64", "--max-positions", "-5"], "-5 must be at least 1"),
    (["explain", "--shape", "1,4,8,64", "--softcap", "-1"], "softcap=-1.0 is out of range"),
    (["explain", "--shape", "1,4,8,64", "--dropout", "2"], "dropout_p=2.0 is out of range"),
    (["tune", "--reps", "0", "--out", "x.yaml"], "0 must be at least 1"),
    (["tune", "--warmup", "-1", "--out", "x.yaml"], "-1 must be at least 0"),
    (["validate", "--jobs", "0"], "0 must be at least 1"),
    (["demo", "--on", "cdua"], "--on 'cdua' is not a torch device"),
])
def test_every_flag_refuses_out_of_range_values_with_a_clean_error(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
