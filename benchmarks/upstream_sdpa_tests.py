"""PyTorch's own SDPA tests (``test/test_transformers.py``) on CPU, plain and routed through opdispatch.

    python benchmarks/upstream_sdpa_tests.py [--all] [--only plain|routed] [--source TEXT] [--out FILE.md]
                                             PATH/test_transformers.py [extra pytest args...]

PATH is a copy of PyTorch's ``test/test_transformers.py`` kept outside this repo (PyTorch's code is not ours to
commit). pytest runs it twice, CPU only, in fresh processes:

  plain    torch's own ``F.scaled_dot_product_attention``
  routed   the same tests after ``opdispatch.compat.route_sdpa()``, called when pytest configures, before the test
           module is imported: its ``from torch.nn.functional import scaled_dot_product_attention`` binds the
           routed function too, and ``nn.MultiheadAttention``'s slow path (``F.multi_head_attention_forward``)
           looks the name up per call. The run counts the calls that reached ``opdispatch.attention`` and the
           ones handed to torch's function (nested tensors, tensor subclasses such as ``CausalBias``), per test,
           so the summary shows that routing happened and which tests it touched.

Then it prints, per run, passed / failed / skipped / errors, and every test that passes plain but fails routed,
with its one-line reason and, where a known cause is listed below (`BY_CONSTRUCTION`), why it cannot pass through
any drop-in. Extra arguments go to both pytest runs (``-k``, ``-x``, ``--maxfail`` ...).

Selection (CPU only: ``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` and no visible CUDA device, so the file instantiates
its CPU classes only; ``TestSDPACudaOnly``/``TestSDPAXpuOnly`` are never generated):
  TestSDPAFailureModesCPU, TestSDPACPU, TestSDPACpuOnlyCPU, TestAttnBiasCPU: the functional itself, its errors,
      masks, GQA, NaN/inf propagation, CausalBias masks, torch.compile over it.
  TestTransformersCPU: nn.MultiheadAttention / TransformerEncoder(Decoder) whose slow path calls the functional,
      and ``test_scaled_dot_product_attention`` (3-D/4-D inputs, bool masks, dropout, gradcheck).
  ``test_scaled_dot_product_fused_attention_mask_vs_math_cpu`` is 3,072 cases, mostly the same code path at sizes
      that cost ~2 s each on 2 cores: by default every dtype / mask / causal / train combination runs at
      q_seq_len 11, kv_seq_len 17 (512 cases), plus one slice past the CPU kernel's block sizes (q 1030, kv 514,
      batch 2, 3 heads, float32, 2-D masks: 16 cases). ``--all`` runs all of them (hours on 2 cores).
Tests that never call the functional (torchscript, fast-path mocks, backend-choice queries) run too: they cost
little and show that routing leaves them alone; the per-test call counts tell them apart.

This file is also the pytest plugin (``-p upstream_sdpa_tests``) that does the routing, counting and recording.
"""

from __future__ import annotations

import argparse
import hashlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# -- known causes: tests that cannot pass through a drop-in, whatever it computes ------------------------------

# test-name pattern -> why. Matched (re.search) against the test function's name, parametrization included.
# Empty with torch 2.13 and the file of 2026 (benchmarks/results/upstream_sdpa_tests-cpu.md): every test that
# passes plain passes routed. A test that asserts which torch kernel ran, inspects torch-internal ops, matches a
# torch warning's text or a kernel-specific tolerance would be listed here with its reason.
BY_CONSTRUCTION: dict[str, str] = {}

# Tests that compare two torch backends picked with `sdpa_kernel`: routed, both calls reach opdispatch (routing
# does not honour `sdpa_kernel`), so they check opdispatch against itself (finite outputs, matching gradients),
# not against torch. tests/test_compat_sdpa.py compares with torch's function and a float64 oracle instead.
SELF_COMPARED = r"_vs_math_cpu|^test_sdpa_with_inf|^test_sdpa_backward_with_gradient"

_MODE_ENV = "UPSTREAM_SDPA_MODE"      # plain | routed
_REPORT_ENV = "UPSTREAM_SDPA_REPORT"  # where the plugin writes its JSON
_SELECT_ENV = "UPSTREAM_SDPA_SELECT"  # default | all

_MASK_VS_MATH = "test_scaled_dot_product_fused_attention_mask_vs_math_cpu"
_SMALL = "_q_seq_len_11_kv_seq_len_17_"
_LARGE = ("_batch_size_2_q_seq_len_1030_kv_seq_len_514_n_head_3_", "_mask_dim_2_", "_cpu_float32")


def _selected(name: str) -> bool:
    """The default selection (see the module docstring): everything but most of the mask-vs-math product."""
    if not name.startswith(_MASK_VS_MATH):
        return True
    return _SMALL in name or all(part in name for part in _LARGE)


# -- the pytest plugin ----------------------------------------------------------------------------------------

_counts = {"dispatched": 0, "to_torch": 0}
_results: dict[str, dict[str, Any]] = {}
_at_start: dict[str, tuple[int, int]] = {}


def pytest_configure(config: Any) -> None:
    if os.environ.get(_MODE_ENV) != "routed":
        return
    # Route before the test module is imported (collection comes after configure), so its module-level
    # `from torch.nn.functional import scaled_dot_product_attention` binds the routed function.
    from opdispatch.compat import _sdpa, route_sdpa

    front_door, to_torch = _sdpa.scaled_dot_product_attention, _sdpa.torch_sdpa

    @functools.wraps(front_door)  # the routed function keeps the drop-in's name and module
    def counted_front_door(*args: Any, **kwargs: Any) -> Any:
        handed_over = _counts["to_torch"]
        out = front_door(*args, **kwargs)
        if _counts["to_torch"] == handed_over:
            _counts["dispatched"] += 1  # returned without torch's function: opdispatch answered it
        return out

    def counted_torch(*args: Any, **kwargs: Any) -> Any:
        _counts["to_torch"] += 1
        return to_torch(*args, **kwargs)

    # The module looks these names up per call (route_sdpa installs the module's `scaled_dot_product_attention`,
    # and the drop-in compares the routed function with it), so the counting wrapper is what gets routed. Fast-path
    # hits call the bound kernel directly: only the front door sees every call.
    _sdpa.scaled_dot_product_attention, _sdpa.torch_sdpa = counted_front_door, counted_torch
    route_sdpa()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if os.environ.get(_SELECT_ENV, "default") == "all":
        return
    keep = [item for item in items if _selected(item.name)]
    dropped = [item for item in items if not _selected(item.name)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _at_start[nodeid] = (_counts["dispatched"], _counts["to_torch"])


def _reason(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = str(crash.message)
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


def pytest_runtest_logreport(report: Any) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "reason": ""})
    if report.when == "call" and hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        if report.when == "call" and entry["outcome"] != "error":
            entry["outcome"], entry["reason"] = "failed", _reason(report)
        elif entry["outcome"] != "failed":  # setup or teardown
            entry["outcome"], entry["reason"] = "error", _reason(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"], entry["reason"] = "skipped", _reason(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    start = _at_start.pop(nodeid, (0, 0))
    entry = _results.setdefault(nodeid, {"outcome": "passed", "reason": ""})
    entry["dispatched"] = _counts["dispatched"] - start[0]
    entry["to_torch"] = _counts["to_torch"] - start[1]


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(_REPORT_ENV)
    if not path:
        return
    import torch

    Path(path).write_text(json.dumps({
        "mode": os.environ.get(_MODE_ENV, "plain"), "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", "?"), "exitstatus": int(exitstatus),
        "counts": _counts, "results": _results,
    }))


# -- the runner -----------------------------------------------------------------------------------------------

def _run(mode: str, test_file: Path, extra: list[str], select: str, workdir: Path) -> dict[str, Any]:
    report, log = workdir / f"{mode}.json", workdir / f"{mode}.log"
    env = dict(os.environ)
    env.update({_MODE_ENV: mode, _REPORT_ENV: str(report), _SELECT_ENV: select,
                "PYTORCH_TESTING_DEVICE_ONLY_FOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent)]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # The test file's own directory is pytest's rootdir (no ini file of ours applies), caches off.
    cmd = [sys.executable, "-m", "pytest", "-p", "upstream_sdpa_tests", "-p", "no:cacheprovider", "-q",
           "--rootdir", str(test_file.parent), str(test_file), *extra]
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=test_file.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    if not report.exists():
        tail = log.read_text().splitlines()[-20:]
        raise SystemExit(f"upstream_sdpa_tests: the {mode} run wrote no report (pytest exit {proc.returncode}); "
                         f"its log ({log}) ends:\n" + "\n".join(tail))
    data: dict[str, Any] = json.loads(report.read_text())
    data["seconds"], data["log"] = seconds, str(log)
    return data


def _tally(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error", "xfailed", "xpassed")}
    for entry in results.values():
        counts[entry["outcome"]] += 1
    return counts


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def _known(nodeid: str) -> str | None:
    name = nodeid.rsplit("::", 1)[-1]
    for pattern, why in BY_CONSTRUCTION.items():
        if re.search(pattern, name):
            return why
    return None


def _file_version(test_file: Path, source: str | None) -> str:
    digest = hashlib.sha256(test_file.read_bytes()).hexdigest()[:16]
    text = f"`{test_file.name}`, sha256 {digest}…, {len(test_file.read_text(encoding='utf-8'))} characters"
    try:
        commit = subprocess.run(["git", "-C", str(test_file.parent), "log", "-1", "--format=%H %cs", "--",
                                 test_file.name], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if commit:
        text += f", git {commit}"
    if source:
        text += f"; source: {source}"
    return text


def _summary(runs: dict[str, dict[str, Any]], test_file: Path, source: str | None, extra: list[str],
             select: str) -> str:
    first = next(iter(runs.values()))
    lines = ["# PyTorch's test_transformers.py on CPU, plain and routed through opdispatch", "",
             f"- torch {first['torch']} (git {first['torch_git'][:12]}), Python {sys.version.split()[0]}, "
             f"{os.cpu_count()} CPU cores",
             f"- upstream file: {_file_version(test_file, source)}",
             f"- selection: {'every CPU test' if select == 'all' else 'default (see the runner docstring)'}"
             + (f"; extra pytest args: `{' '.join(extra)}`" if extra else ""), "",
             "| run | passed | failed | skipped | errors | xfailed | xpassed | seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, data in runs.items():
        t = _tally(data["results"])
        lines.append(f"| {mode} | {t['passed']} | {t['failed']} | {t['skipped']} | {t['error']} | {t['xfailed']} "
                     f"| {t['xpassed']} | {data['seconds']:.0f} |")
    if "routed" in runs:
        routed = runs["routed"]["results"]
        touched = [n for n, e in routed.items() if e.get("dispatched", 0)]
        handed = [n for n, e in routed.items() if e.get("to_torch", 0)]
        counts = runs["routed"]["counts"]
        self_compared = [n for n, e in routed.items()
                         if e["outcome"] == "passed" and re.search(SELF_COMPARED, n.rsplit("::", 1)[-1])]
        lines += ["", f"Routed run: {counts['dispatched']} calls answered by opdispatch (the drop-in, not torch's "
                  "function) in "
                  f"{len(touched)} tests; {counts['to_torch']} calls handed to torch's function (nested tensors, "
                  f"tensor subclasses, re-entrant calls) in {len(handed)} tests. {len(self_compared)} of its passes "
                  "compare two torch backends chosen with `sdpa_kernel` (the mask/GQA `_vs_math_cpu` tests, "
                  "`test_sdpa_with_inf`, `test_sdpa_backward_with_gradient`): routed, both sides are opdispatch, "
                  "so they check it against itself, not against torch."]
    if "plain" in runs and "routed" in runs:
        plain, routed = runs["plain"]["results"], runs["routed"]["results"]
        regressions = sorted(n for n, e in routed.items()
                             if e["outcome"] in ("failed", "error") and plain.get(n, {}).get("outcome") == "passed")
        lines += ["", f"## Pass plain, fail routed: {len(regressions)}", ""]
        if not regressions:
            lines.append("None: every test that passes with torch's own function passes routed.")
        else:
            lines += ["| test | opdispatch calls | reason | known cause |", "| --- | ---: | --- | --- |"]
            for n in regressions:
                e = routed[n]
                reason = e["reason"].replace("|", "\\|")
                lines.append(f"| `{_short(n)}` | {e.get('dispatched', 0)} | {reason} | "
                             f"{_known(n) or 'UNCLASSIFIED: look into it'} |")
        fixed = sorted(n for n, e in routed.items()
                       if e["outcome"] == "passed" and plain.get(n, {}).get("outcome") in ("failed", "error"))
        plain_failures = sorted(n for n, e in plain.items() if e["outcome"] in ("failed", "error"))
        lines += ["", f"## Fail plain (torch's own function): {len(plain_failures)}", ""]
        for n in plain_failures:
            lines.append(f"- `{_short(n)}`: {plain[n]['reason']}"
                         + (" (passes routed)" if n in fixed else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true",
                        help="every CPU test, the full mask-vs-math product included (hours on 2 cores)")
    parser.add_argument("--only", choices=("plain", "routed"), help="one run instead of both")
    parser.add_argument("--source", help="where the upstream file came from (printed with the results)")
    parser.add_argument("--out", type=Path, help="also write the summary (markdown) to this file")
    parser.add_argument("test_file", type=Path, help="a copy of PyTorch's test/test_transformers.py")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed to both pytest runs")
    args = parser.parse_args(argv)
    test_file = args.test_file.resolve()
    if not test_file.is_file():
        parser.error(f"test_file {str(args.test_file)!r} is not a file; pass the path of a copy of PyTorch's "
                     "test/test_transformers.py (kept outside this repo)")
    select = "all" if args.all else "default"
    modes = [args.only] if args.only else ["plain", "routed"]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="upstream_sdpa_") as tmp:
        workdir = Path(os.environ.get("UPSTREAM_SDPA_WORKDIR", tmp))
        workdir.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            print(f"[{mode}] pytest {test_file.name} {' '.join(args.pytest_args)} (log: {workdir / mode}.log)",
                  flush=True)
            runs[mode] = _run(mode, test_file, args.pytest_args, select, workdir)
            t = _tally(runs[mode]["results"])
            print(f"[{mode}] {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['error']} errors "
                  f"in {runs[mode]['seconds']:.0f} s", flush=True)
    text = _summary(runs, test_file, args.source, args.pytest_args, select)
    print()
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
