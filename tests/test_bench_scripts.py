"""benchmarks/decode_loop.py and benchmarks/side_by_side.py on the CPU with tiny sizes: every variant and cell is
timed, the figures are finite and positive, a decode loop makes one decision, and the JSON carries the device."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import pytest

from .conftest import REPO


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_loop_times_every_variant_and_makes_one_decision(basic_manager, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert load("decode_loop").main(["--device", "cpu", "--steps", "40", "--start", "8", "--heads", "4",
                                     "--kv-heads", "2", "--head-dim", "16", "--repeat", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["per_call_us"]) == {
        "growing, attention(causal bottom-right)", "growing, attention(not causal)",
        "repeated signature, attention(causal bottom-right)", "growing, kernels bound before the loop (floor)",
        "growing, torch SDPA"}
    assert all(math.isfinite(v) and v > 0 for v in result["per_call_us"].values())
    assert result["decisions_in_loop"] == 1 and result["info_log_lines_in_loop"] == 1
    assert result["info"]["decision"] == "cpu.flash" and result["environment"]["torch"]
    text = capsys.readouterr().out
    assert "growing / repeated signature: **" in text and (tmp_path / "decode.md").read_text() == text


def test_side_by_side_reports_every_cell_with_torchs_best_way(basic_manager, tmp_path, capsys):
    out = tmp_path / "sbs.json"
    script = load("side_by_side")
    assert script.main(["--tiny", "--cells", "window,alibi,varlen,mla", "--reps", "1", "--warmup", "1",
                        "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cell"], r["mode"]) for r in rows] == [
        ("sliding window 1024", "fwd"), ("sliding window 1024", "fwd+bwd"), ("ALiBi MHA", "fwd"),
        ("ALiBi MHA", "fwd+bwd"), ("varlen causal", "fwd"), ("varlen causal", "fwd+bwd"), ("MLA decode 576/512", "fwd")]
    for row in rows:
        assert "failed" not in row, row
        assert row["opdispatch_ms"] > 0 and row["torch_best_ms"] > 0 and row["pick"]
        # both answers agree with reference.math on the first batch row
        assert row["errors"]["opdispatch"] < 1e-5 and row["errors"]["torch"] < 1e-5, row
    # Every way torch offers was timed (which one wins on this CPU is timing, not behaviour: not asserted).
    assert {"SDPA + boolean mask", "flex_attention"} <= set(rows[0]["torch_ms"])
    assert all(w.startswith("SDPA") for w in rows[4]["torch_ms"])
    assert "| sliding window 1024 | fwd |" in capsys.readouterr().out


def test_side_by_side_rejects_unknown_cells():
    with pytest.raises(SystemExit):
        load("side_by_side").main(["--tiny", "--cells", "nope"])


@pytest.mark.slow
def test_compiled_training_counts_one_forward_per_step_with_the_kernels_backward(basic_manager, tmp_path):
    out = tmp_path / "compiled.json"
    assert load("compiled_training").main(["--tiny", "--reps", "2", "--inner", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["pick"] == "cpu.flash" and row["saves_for_backward"]
    assert row["opdispatch forwards per step"] == 1
    assert row["opdispatch (backward recomputes) forwards per step"] == 2
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in row if k.endswith(" ms"))


def test_op_bench_times_both_ops_and_says_why_a_pin_cannot_run(manager, tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert load("op_bench").main(["--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["op"] for r in rows} == {"rms_norm", "rotary_embedding"} and result["versions"]["device"] == "cpu"
    timed = [r for r in rows if r["us"] is not None]
    assert all(math.isfinite(r["us"]) and r["us"] > 0 for r in timed)
    assert {r["variant"] for r in timed} >= {"opdispatch policy", "opdispatch torch.rms_norm", "torch F.rms_norm",
                                             "opdispatch reference.rotary_embedding", "torch eager rotate_half"}
    # the CPU has neither vendor kernel: each pinned row says why instead of a time
    flagos = [r for r in rows if r["variant"] == "opdispatch flagos.rms_norm"]
    assert flagos and all(r["us"] is None and "runs on device type 'cuda'" in r["note"] for r in flagos)
    assert {r["chosen"] for r in rows if r["variant"] == "opdispatch policy"} == {
        "torch.rms_norm", "reference.rotary_embedding"}


def test_reliability_report_counts_no_silent_wrong_answer(tmp_path):
    """benchmarks/reliability.py, small: its tables are parsed back and the counts that must be zero are."""
    import subprocess
    import sys

    out = tmp_path / "reliability.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "reliability.py"), "--calls", "8", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    text = out.read_text()

    def row(title):
        header, _, values = text.split(f"## {title}")[1].strip().splitlines()[:3]
        return dict(zip(header.strip("| ").split(" | "), map(int, values.strip("| ").split(" | "))))

    inputs = row("Bad inputs (cold and warm)")
    assert inputs["tried"] >= 100 and inputs["clear error"] == inputs["tried"] and inputs["wrong-silent"] == 0
    unusual = row("Valid-but-unusual calls vs a float64 oracle")
    assert unusual["tried"] > 0 and unusual["right"] == unusual["tried"]
    policies = row("Malformed policy files")
    assert policies["tried"] >= 200 and policies["accepted"] == 0 and policies["other error"] == 0
    guard_rows = [line for line in text.splitlines() if line.startswith("| guard on |")]
    assert len(guard_rows) == 9 and not any("WRONG" in line for line in guard_rows)
    assert "Survived: 9 of 9." in text  # plugin faults


@pytest.mark.slow
def test_context_parallel_benchmark_smoke(tmp_path):
    """benchmarks/context_parallel.py --smoke (CPU, gloo, 2 spawned ranks): every method has a row, opdispatch's
    modes are timed and match the single-device result, torch's CP either ran or says why not."""
    import subprocess
    import sys

    out = tmp_path / "cp.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "context_parallel.py"), "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"single GPU (unsharded)", "opdispatch ring", "opdispatch allgather", "torch CP allgather",
                         "torch CP alltoall"}
    for mode in ("opdispatch ring", "opdispatch allgather"):
        r = rows[mode]
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms"))
        assert max(r[k] for k in ("err_out", "err_dq", "err_dk", "err_dv")) < 1e-5
    for rotate in ("allgather", "alltoall"):
        r = rows[f"torch CP {rotate}"]
        assert "fwd_ms" in r or r["note"].startswith("did not run: ")
    assert "| 96 | opdispatch ring |" in out.read_text()


@pytest.mark.slow
def test_agreement_benchmark_smoke(tmp_path):
    """benchmarks/agreement_nccl.py --smoke (CPU, gloo, 2 spawned ranks): agreed, rank 0's choice over a diverging
    rank, and AgreementError on both ranks where rank 0's choice cannot run on rank 1 (the first GPU run's version
    of that case made a new decision on one rank only and waited for the group's timeout)."""
    import subprocess
    import sys

    out = tmp_path / "agreement.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agreement_nccl.py"), "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "checks: pass" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2 and all("rank 1 chose reference.math, overridden by rank 0's cpu.flash" in r for r in rows)
    assert all("rank 0's choice (cpu.flash) cannot run on every rank" in r for r in rows)


@pytest.mark.slow
def test_context_parallel_agreement_benchmark_smoke(tmp_path):
    """benchmarks/context_parallel_agreement.py --smoke (CPU, gloo, 2 spawned ranks): both passes timed with and
    without the per-call agreement, and ranks with shards of other lengths raise one error on both ranks."""
    import subprocess
    import sys

    out = tmp_path / "cpa.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "context_parallel_agreement.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "| 64 | forward |" in text and "| 64 | forward+backward |" in text
    assert "the same AgreementError on every rank: yes" in text
    assert "  q.shape: (1, 32, 4, 16) on rank 0; (1, 16, 4, 16) on rank 1" in text


@pytest.mark.slow
def test_te_module_lands_every_te_call_and_matches_the_direct_op(basic_manager, tmp_path):
    """benchmarks/te_module.py --tiny: every TE layout x mask type cell runs through compat.te's module and through
    opdispatch.attention on the same call, with equal outputs (the script fails a cell otherwise) and a named
    implementation and reason for each."""
    out = tmp_path / "te.json"
    assert load("te_module").main(["--tiny", "--reps", "2", "--warmup", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and not any("failed" in r for r in rows)
    assert all(r["pick"] and r["decided_by"] and r["max_abs_diff_module_vs_op"] <= 1e-4 for r in rows)


def test_the_gpu_scripts_import_what_exists():
    """Every `from opdispatch… import …` and `python3 -m opdispatch…` in the GPU and CI shell scripts names a module
    and attribute that exist: after the layer refactor `_gpu_setup.sh` still imported the CLI under its old path,
    `opdispatch build` failed on the GPU machine, and a run measured the Python door without saying so."""
    import importlib
    import re

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    scripts = sorted(root.glob("benchmarks/*.sh")) + sorted((root / ".ci").glob("*"))
    seen = 0
    for script in scripts:
        text = script.read_text()
        for module, names in re.findall(r"from (opdispatch[\w.]*) import ([\w, ]+)", text):
            imported = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}") is not None, (
                    f"{script.name}: from {module} import {name}")
                seen += 1
        for module in re.findall(r"python3? -m (opdispatch[\w.]*)", text):
            assert importlib.util.find_spec(module) is not None, f"{script.name}: python -m {module}"
            seen += 1
    assert seen >= 3  # the setup's build and status lines, at least


def _generate_row(batch, sdpa_times, opdispatch_times):
    return {"batch": batch, "ratio": statistics.median(sdpa_times) / statistics.median(opdispatch_times),
            "sdpa_times_s": sdpa_times, "opdispatch_times_s": opdispatch_times}


def test_generate_runs_pools_each_runs_ratio_and_every_call(tmp_path, capsys):
    """The README's generate() figure is the runs' median: each run's ratio listed, the median and range, and over
    the runs that kept every call the ratio of the pooled medians and of the fastest calls."""
    paths = []
    for i, (s, o) in enumerate([([1.0, 1.2, 1.1], [1.0, 1.0, 1.0]), ([2.0, 2.0, 2.0], [2.5, 2.5, 2.5]),
                                ([1.0, 1.0, 1.0], [0.9, 0.9, 0.9])]):
        path = tmp_path / f"r{i}" / "generate.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"environment": {"device": "cpu", "commit": f"c{i}"},
                                    "rows": [_generate_row(1, s, o)]}))
        paths.append(str(path))
    assert load("generate_runs").main([*paths, "--out", str(tmp_path / "pooled.md")]) == 0
    line = next(li for li in (tmp_path / "pooled.md").read_text().splitlines() if li.startswith("| 1 |"))
    # runs 1.10, 0.80, 1.11: median 1.10, range 0.80-1.11; pooled medians sdpa 1.1 / opdispatch 1.0; fastest 1.0/0.9;
    # no row says its copies (and no --copies): nothing paired
    assert line == "| 1 | 1.10 0.80 1.11 | **1.10x** | 0.80-1.11 | 1.10x (9 calls each) | 1.11x | - | - |"


def test_paired_ratios_divide_each_reps_back_to_back_sums(tmp_path):
    """A host that slows down across a run: each rep's two implementations were timed back to back, so their
    ratio holds where the whole-run medians' does not (here opdispatch is 1.25x faster in every rep, but its calls
    fall in the slow half of the run more often: the medians say 1.00x)."""
    runs = load("generate_runs")
    sdpa = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # 4 reps of 2 copies; the host halves its speed at rep 3
    opdispatch = [0.8, 0.8, 0.8, 0.8, 1.6, 1.6, 1.6, 1.6]
    assert runs.paired_ratios(sdpa, opdispatch, 2) == pytest.approx([1.25] * 4)
    with pytest.raises(ValueError, match="cannot pair 8 and 8 calls in reps of 3"):
        runs.paired_ratios(sdpa, opdispatch, 3)
    row = dict(_generate_row(1, sdpa, opdispatch), copies=2)
    path = tmp_path / "generate.json"
    path.write_text(json.dumps({"environment": {"device": "cpu"}, "rows": [row]}))
    assert runs.main([str(path), "--out", str(tmp_path / "pooled.md")]) == 0
    line = next(li for li in (tmp_path / "pooled.md").read_text().splitlines() if li.startswith("| 1 |"))
    assert line.endswith("| 1.250 | **1.250x** (1.25-1.25, 4 reps) |")


def test_generate_bench_explains_differing_tokens_or_says_it_cannot(basic_manager):
    """A forged token where the model is decided (sdpa's top two logits 0.05 apart, its error against float32
    0.01) is reported where it parts and as NOT rounding — the run then fails rather than calling it noise."""
    import torch

    script = load("generate_bench")
    import opdispatch.compat.hf  # noqa: F401
    dev = torch.device("cpu")
    copies = {attn: [script.build("tiny", attn, dev, torch.bfloat16)] for attn in ("sdpa", "opdispatch")}
    ids, mask = script.prompts(1, 16, script.SIZES["tiny"]["vocab_size"], dev)
    with torch.no_grad():
        out = copies["sdpa"][0].generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                         do_sample=False)
    forged = out.clone()
    forged[0, 18] = (forged[0, 18] + 1) % script.SIZES["tiny"]["vocab_size"]
    report = script.divergence(ids, {"sdpa": [out], "opdispatch": [forged]}, copies, "tiny", dev)
    assert report["first_difference"] == 2 and report["sequence"] == 0
    assert set(report["max_logit_error_vs_float32"]) == {"sdpa", "opdispatch"}
    gap, err = report["sdpa_top2_gap"], report["max_logit_error_vs_float32"]["sdpa"]
    assert 0 < err < gap / 2 and report["rounding"] is False


def test_generate_bench_reports_the_build_order_and_paired_ratios(basic_manager, tmp_path):
    """The report names the order the copies were built in (it once printed the last rep's run order instead) and
    records what generate_runs pairs by: copies, reps and each rep's back-to-back ratio."""
    script = load("generate_bench")
    out = tmp_path / "g.md"
    assert script.main(["--size", "tiny", "--batches", "1", "--prompt", "8", "--new", "2", "--reps", "2",
                        "--copies", "2", "--out", str(out)]) == 0
    assert "(built sdpa, opdispatch, opdispatch, sdpa)" in out.read_text()
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert (row["copies"], row["reps"]) == (2, 2) and len(row["sdpa_times_s"]) == 4
    want = statistics.median(load("generate_runs").paired_ratios(row["sdpa_times_s"], row["opdispatch_times_s"], 2))
    assert row["paired_ratio"] == want
