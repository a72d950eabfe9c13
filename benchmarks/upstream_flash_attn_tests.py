"""flash-attn's own ``tests/test_flash_attn.py`` run through ``opdispatch.compat.flash_attn`` on a CPU.

Usage::

    python benchmarks/upstream_flash_attn_tests.py PATH/TO/test_flash_attn.py [--sample N] [--seed S]
        [--max-work W] [--pin IMPL] [--label TEXT] [--report results.md] [--keep] [pytest args, e.g. -k kvcache]

PATH is flash-attn's test file (Dao-AILab/flash-attention, ``tests/test_flash_attn.py``, v2.8.x), obtained
separately: nothing of flash-attn is part of this repository. The runner builds, in a temporary directory:

- a ``flash_attn`` package whose functions are ``opdispatch.compat.flash_attn``'s; ``flash_attn.bert_padding`` is
  ``opdispatch.compat``'s ``unpad_input``/``pad_input``; ``flash_attn.flash_attn_interface._get_block_size_n``
  raises (it describes the CUDA kernel's tiles, used only to decode ``S_dmask`` in dropout cases, which are
  deselected); ``flash_attn.layers.rotary.apply_rotary_emb`` is a small float32 implementation written here, not
  opdispatch's rotary op, so the KV-cache tests compare the front door's rotary against an independent one;
- a copy of the test file with its CUDA assumptions rewritten in the text (the module runs CUDA calls at import
  time and names ``"cuda"`` inside test bodies, so patching attributes after import cannot work):
  ``torch.cuda.get_device_capability("cuda")`` -> ``(9, 0)`` (an sm90 GPU: both fp16 and bf16 are tested and
  every backward check is kept), ``torch.cuda.get_device_properties("cuda").total_memory`` -> this host's memory,
  and every remaining ``"cuda"`` string -> ``"cpu"``; each rewrite must match or the runner stops;
- a pytest plugin (``-p``) that deselects the cases that cannot pass by construction (with the reason) and those
  the upstream test would skip itself, then keeps a reproducible sample: per test function (after ``-k``/``-m``),
  the ``--sample`` cases whose sha256(seed:node id) is smallest among those within ``--max-work`` (at most 2 of
  ``test_flash_attn_race_condition``, whose every case costs 30-110 s here), and records each outcome.
  ``--pin reference.math`` runs every attention call on opdispatch's pure-torch reference: a case that fails by
  default but passes pinned points at the kernel chosen, not at the front door.

It prints torch's version, the test file's sha256 and git blob id (compare with ``git ls-tree`` of a flash-attn
tag), the sample and seed, per test function passed/failed/skipped/deselected counts, and every failure with a
one-line reason. Needs ``einops`` (the upstream tests import it). opdispatch runs with its default plugins (on a
CPU: torch's CPU flash kernel and the pure-torch reference); fp16/bf16 are meaningful there, as the upstream
tests bound the error relative to a PyTorch fp16/bf16 reference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

# Cases deselected because the assertion is about the CUDA kernel itself, not about the math: (test functions,
# predicate on the case's parameters, reason).
_S_DMASK_TESTS = ("test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked", "test_flash_attn_output",
                  "test_flash_attn_varlen_output")
BY_CONSTRUCTION = [
    (_S_DMASK_TESTS, lambda p: p.get("dropout_p", 0.0) > 0.0,
     "dropout_p > 0: asserts on the dropout mask and probabilities decoded from S_dmask (the CUDA kernel's "
     "return_attn_probs matrix, in its tile layout: _get_block_size_n); opdispatch returns None for it"),
    # The upstream test's own pytest.skip() conditions, mirrored so that the sample is spent on cases that run.
    (("test_flash_attn_kvcache",), lambda p: (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"])
     or (not p["new_kv"] and p["rotary_fraction"] > 0.0)
     or ((p["has_batch_idx"] or p["has_leftpad"]) and p["paged_kv_block_size"] is not None),
     "the upstream test skips it itself (its pytest.skip() conditions, mirrored)"),
]

# At most this many cases of these tests per sample: each case repeats 250 forward and backward calls of batch 60
# (a hunt for races between CUDA thread blocks) and takes 30-110 s here.
SAMPLE_CAP = {"test_flash_attn_race_condition": 2}

# batch * heads of each test, to estimate a case's work (batch * heads * seqlen_q * seqlen_k * head_dim).
_BATCH_HEADS = {
    "test_flash_attn_qkvpacked": 4 * 9, "test_flash_attn_varlen_qkvpacked": 5 * 6, "test_flash_attn_output": 4 * 6,
    "test_flash_attn_varlen_output": 4 * 6, "test_flash_attn_causal": 8 * 9, "test_flash_attn_varlen_causal": 8 * 9,
    "test_flash_attn_splitkv": 1 * 12, "test_flash_attn_kvcache": 2 * 6, "test_flash_attn_race_condition": 60 * 4 * 250,
    "test_flash_attn_bwd_overflow": 2 * 5, "test_flash_attn_bwd_transpose": 5 * 2,
    "test_flash_attn_bwd_varlen_overflow": 5, "test_flash_attn_deterministic": 4 * 9 * 10,
    "test_flash_attn_varlen_deterministic": 2 * 9 * 10,
}  # race_condition repeats its forward and backward 250 times, the deterministic tests their backward 50: weighted


SHIM = {
    "flash_attn/__init__.py": '''
        """flash-attn's public functions, served by opdispatch.compat.flash_attn (a test shim)."""
        from opdispatch.compat.flash_attn import (flash_attn_func, flash_attn_kvpacked_func,
            flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
            flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
        __version__ = "2.8.3+opdispatch-shim"
    ''',
    "flash_attn/flash_attn_interface.py": '''
        from opdispatch.compat.flash_attn import *  # noqa: F403
        from opdispatch.compat.flash_attn import __all__


        def _get_block_size_n(device, head_dim, is_dropout, is_causal):
            raise NotImplementedError("_get_block_size_n describes flash-attn's CUDA kernel tiles (to decode "
                                      "S_dmask); opdispatch has no such matrix")
    ''',
    "flash_attn/bert_padding.py": '''
        from opdispatch.compat import pad_input, unpad_input
    ''',
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": '''
        """apply_rotary_emb with flash-attn's signature, written independently of opdispatch's rotary op."""
        import torch


        def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                             max_seqlen=None):
            """x (batch, seqlen, heads, dim); cos/sin (positions, rotary_dim / 2); token s of sequence b is at
            position s + seqlen_offsets[b]. Computed in float32, returned in x's dtype."""
            if cu_seqlens is not None:
                raise NotImplementedError("the shim's apply_rotary_emb does not take cu_seqlens")
            batch, seqlen = x.shape[:2]
            half = cos.shape[-1]
            offsets = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1, 1)
            pos = (offsets + torch.arange(seqlen, device=x.device)).expand(batch, seqlen)
            c = cos.float()[pos].unsqueeze(2)  # (batch, seqlen, 1, half)
            s = sin.float()[pos].unsqueeze(2)
            xf = x.float()
            if interleaved:
                a, b = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
                rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
            else:
                a, b = xf[..., :half], xf[..., half:2 * half]
                rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
            out = torch.cat((rot, xf[..., 2 * half:]), dim=-1).to(x.dtype)
            if inplace:
                x.copy_(out)
                return x
            return out
    ''',
    "pytest.ini": '''
        [pytest]
        addopts = -p no:cacheprovider
    ''',
}


PLUGIN = '''
"""Deselects the cases that cannot pass by construction, samples the rest, records outcomes (see the runner)."""
import hashlib
import json
import os

import pytest

from _opdispatch_rules import BATCH_HEADS, BY_CONSTRUCTION, SAMPLE_CAP

SAMPLE = int(os.environ["OPDISPATCH_UPSTREAM_SAMPLE"])
SEED = os.environ["OPDISPATCH_UPSTREAM_SEED"]
MAX_WORK = float(os.environ["OPDISPATCH_UPSTREAM_MAX_WORK"])
OUT = os.environ["OPDISPATCH_UPSTREAM_SUMMARY"]
_summary = {"collected": {}, "deselected": {}, "results": []}


def _params(item):
    spec = getattr(item, "callspec", None)
    return dict(spec.params) if spec is not None else {}


def _work(name, p):
    sq = p.get("seqlen_q", p.get("seqlen", 256))
    sk = p.get("seqlen_k", p.get("seqlen", 256))
    return BATCH_HEADS.get(name, 1) * sq * sk * p.get("d", 64)


@pytest.hookimpl(trylast=True)  # after -k/-m: the sample is drawn from what they kept
def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    by_test = {}
    for item in items:
        name = item.originalname or item.name
        _summary["collected"][name] = _summary["collected"].get(name, 0) + 1
        p = _params(item)
        reason = next((why for tests, pred, why in BY_CONSTRUCTION if name in tests and pred(p)), None)
        if reason is None and _work(name, p) > MAX_WORK:
            reason = f"over --max-work (batch*heads*seqlen_q*seqlen_k*d > {MAX_WORK:g}): too slow for this CPU run"
        if reason is not None:
            drop.append(item)
            _summary["deselected"].setdefault(name, {}).setdefault(reason, 0)
            _summary["deselected"][name][reason] += 1
            continue
        by_test.setdefault(name, []).append(item)
    for name, group in by_test.items():
        ranked = sorted(group, key=lambda it: hashlib.sha256(f"{SEED}:{it.nodeid}".encode()).hexdigest())
        size = min(SAMPLE, SAMPLE_CAP.get(name, SAMPLE)) if SAMPLE > 0 else len(ranked)
        chosen = set(id(it) for it in ranked[:size])
        for it in group:
            (keep if id(it) in chosen else drop).append(it)
        left = len(group) - len(chosen)
        if left:
            why = f"not in this sample (--sample {size}, --seed {SEED})"
            _summary["deselected"].setdefault(name, {})[why] = left
    order = {id(it): i for i, it in enumerate(items)}
    keep.sort(key=lambda it: order[id(it)])
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _reason(report):
    """The failing line of the upstream file and the exception's first line (values filled in)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "?")
    where = ""
    if crash is not None:  # the innermost frame: the upstream assert, or where opdispatch raised
        where = f"{os.path.basename(crash.path)}:{crash.lineno}: "
        if crash.path.endswith("test_flash_attn.py"):
            with open(crash.path) as f:
                where = f"line {crash.lineno} `{f.read().splitlines()[crash.lineno - 1].strip()}`: "
    return (where + first)[:400]


PIN = os.environ.get("OPDISPATCH_UPSTREAM_PIN")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not PIN:
        yield
        return
    import opdispatch
    with opdispatch.policy_override(pin=PIN, op="attention"):  # backward runs the forward's choice
        yield


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        item_name = report.nodeid.split("::")[-1].split("[")[0]
        outcome = report.outcome
        reason = ""
        if outcome == "failed":
            reason = _reason(report)
        elif outcome == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        _summary["results"].append({"test": item_name, "nodeid": report.nodeid, "outcome": outcome,
                                    "reason": reason, "seconds": round(report.duration, 2)})


def pytest_sessionfinish(session, exitstatus):
    with open(OUT, "w") as f:
        json.dump(_summary, f, indent=1)
'''


def _rewrite(text: str) -> str:
    """The upstream test file with its CUDA assumptions replaced (see the module docstring)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rules = [
        ('torch.cuda.get_device_capability("cuda")', "(9, 0)"),
        ('torch.cuda.get_device_properties("cuda").total_memory', str(memory)),
        ('"cuda"', '"cpu"'),
    ]
    for old, new in rules:
        if old not in text:
            raise SystemExit(f"upstream_flash_attn_tests: expected {old!r} in the upstream test file, found none: "
                             "is it flash-attn 2.x's tests/test_flash_attn.py? Update the rewrite rules if it moved")
        text = text.replace(old, new)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    left = [line for line in code if "torch.cuda" in line or "cuda" in line.replace("cudnn", "")]
    if left:
        raise SystemExit("upstream_flash_attn_tests: CUDA references left after the rewrite: " + "; ".join(left[:3]))
    return text


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _build(tmp: Path, upstream: Path) -> None:
    for rel, body in SHIM.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip())
    (tmp / "test_flash_attn.py").write_text(_rewrite(upstream.read_text()))
    (tmp / "_opdispatch_upstream.py").write_text(PLUGIN)
    # The rules live in this file; the plugin imports them from a module written next to it.
    rules = Path(__file__).read_text()
    start, end = rules.index("_S_DMASK_TESTS = "), rules.index("\n\n\nSHIM = ")
    (tmp / "_opdispatch_rules.py").write_text(rules[start:end] + "\nBATCH_HEADS = _BATCH_HEADS\n")


def _summarise(summary: dict, header: list[str], markdown: bool) -> str:
    by_test: dict[str, dict[str, int]] = {}
    for r in summary["results"]:
        counts = by_test.setdefault(r["test"], {"passed": 0, "failed": 0, "skipped": 0})
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    out = list(header)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    rows = []
    for name in summary["collected"]:
        c = by_test.get(name, {"passed": 0, "failed": 0, "skipped": 0})
        for key in total:
            total[key] += c.get(key, 0)
        desel = sum(summary["deselected"].get(name, {}).values())
        rows.append((name, summary["collected"][name], c["passed"], c["failed"], c["skipped"], desel))
    if markdown:
        out += ["", "| test | collected | passed | failed | skipped | deselected |",
                "| --- | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {n} | {a} | {p} | {f} | {s} | {d} |" for n, a, p, f, s, d in rows]
    else:
        out += ["", f"{'test':40} {'collected':>9} {'passed':>7} {'failed':>7} {'skipped':>8} {'deselected':>10}"]
        out += [f"{n:40} {a:9} {p:7} {f:7} {s:8} {d:10}" for n, a, p, f, s, d in rows]
    out += ["", f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"]
    reasons: dict[str, int] = {}
    for name, per in summary["deselected"].items():
        for why, n in per.items():
            if not why.startswith("not in this sample"):
                reasons[f"{name}: {why}"] = reasons.get(f"{name}: {why}", 0) + n
    if reasons:
        out += ["", "Deselected (count x test: reason; the rest of each test's cases are outside the sample):"]
        out += [f"- {n} x {why}" for why, n in reasons.items()]
    skips: dict[str, int] = {}
    for r in summary["results"]:
        if r["outcome"] == "skipped":
            key = f"{r['test']}: {r['reason'] or '(no reason given)'}"
            skips[key] = skips.get(key, 0) + 1
    if skips:
        out += ["", "Skipped by the upstream test itself:"]
        out += [f"- {n} x {why}" for why, n in skips.items()]
    failures = [r for r in summary["results"] if r["outcome"] == "failed"]
    out += ["", f"Failures ({len(failures)}):" if failures else "Failures: none"]
    out += [f"- {r['nodeid'].split('::')[-1]}: {r['reason']}" for r in failures]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("upstream", type=Path, help="flash-attn's tests/test_flash_attn.py")
    parser.add_argument("--sample", type=int, default=10,
                        help="cases per test function (0: all; race_condition at most 2); default 10")
    parser.add_argument("--seed", default="0", help="sampling seed (any string); default 0")
    parser.add_argument("--max-work", type=float, default=3e9,
                        help="skip cases with batch*heads*seqlen_q*seqlen_k*head_dim above this; default 3e9")
    parser.add_argument("--label", default="", help="where the test file came from, e.g. 'flash-attn v2.8.3 "
                        "(060c9188)': printed in the header (the file itself names no version)")
    parser.add_argument("--pin", default="", help="run every attention call on this implementation id (e.g. "
                        "reference.math), to tell a kernel's numerics from the front door's semantics")
    parser.add_argument("--report", type=Path, help="also write the summary as markdown to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    args, pytest_args = parser.parse_known_args(argv)
    upstream = args.upstream.resolve()
    if not upstream.is_file():
        parser.error(f"{upstream} is not a file: pass the path of flash-attn's tests/test_flash_attn.py")
    try:
        import einops  # noqa: F401
    except ImportError:
        parser.error("the upstream tests import einops: pip install einops")
    import torch

    data = upstream.read_bytes()
    header = [
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()} "
        f"({os.cpu_count()} cores), opdispatch at {_ROOT}",
        f"upstream: {args.label + ', ' if args.label else ''}{upstream.name} sha256 "
        f"{hashlib.sha256(data).hexdigest()[:16]} git blob {_blob_id(data)}",
        f"sample: {args.sample or 'all'} case(s) per test function, seed {args.seed!r}, max work {args.max_work:g}; "
        f"pin: {args.pin or '(none: the default policy)'}; pytest args: {' '.join(pytest_args) or '(none)'}",
    ]
    tmp_ctx = tempfile.TemporaryDirectory(prefix="upstream_flash_attn_")
    tmp = Path(tmp_ctx.name)
    try:
        _build(tmp, upstream)
        summary_path = tmp / "summary.json"
        env = dict(os.environ, OPDISPATCH_UPSTREAM_SAMPLE=str(args.sample), OPDISPATCH_UPSTREAM_SEED=args.seed,
                   OPDISPATCH_UPSTREAM_MAX_WORK=str(args.max_work), OPDISPATCH_UPSTREAM_PIN=args.pin,
                   OPDISPATCH_UPSTREAM_SUMMARY=str(summary_path),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tmp), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "pytest", "test_flash_attn.py", "-p", "_opdispatch_upstream", "-q",
               "--rootdir", str(tmp), "--tb=no", "-o", "console_output_style=count", *pytest_args]
        start = time.monotonic()
        print("\n".join(header), flush=True)
        proc = subprocess.run(cmd, cwd=tmp, env=env)  # its progress shows as it runs; the summary follows
        elapsed = time.monotonic() - start
        if not summary_path.exists():
            print(f"upstream_flash_attn_tests: pytest exited {proc.returncode} without a summary (see above)")
            return proc.returncode or 1
        summary = json.loads(summary_path.read_text())
        header.append(f"pytest exit {proc.returncode}, {elapsed:.0f} s wall")
        print(_summarise(summary, header[-1:], markdown=False))
        if args.report:
            args.report.write_text("\n".join(["```", *header, "```"]) + "\n" +
                                   _summarise(summary, [], markdown=True) + "\n")
        if args.keep:
            print(f"kept {tmp}")
        failed = any(r["outcome"] == "failed" for r in summary["results"])
        return 1 if failed else 0
    finally:
        if args.keep:
            tmp_ctx._finalizer.detach()  # type: ignore[attr-defined]
        else:
            tmp_ctx.cleanup()


if __name__ == "__main__":
    sys.exit(main())
