"""Policy proof: re-measure the attention policy's picks against every eligible implementation on this device.

For each case (a shape, a mode — forward, or forward+backward — and a dtype) the script asks
`opdispatch.explain` which implementations are eligible and which one the policy picks (and which rule or order
entry decided it), then times every eligible implementation pinned (`impl=ID`) and the unpinned call the policy
dispatches. Regret is `pick_ms / best_ms - 1` over the pinned times (the same measurement for every
implementation; the unpinned call's time is reported beside it as `policy_ms`). A case FAILs when its pick loses
to an eligible implementation by more than 3% (`TOLERANCE`), or when the pick raises or its first call exceeds the
compile cap; the run then exits 1.

Cases: (a) for every timing rule (one with `prefer`/`pin`) of the attention section of the active policy, the
shape its reason claims and a neighbour on each side of any threshold it tests (`RULE_CASES`; a rule the script
has no shapes for is reported as such); (b) an extended matrix: dense causal GQA at head dims 64-256, softcap and
ALiBi (MHA and GQA), sliding window, varlen, decode and deterministic, forward and training, bf16 and fp16. Each
case is tagged with every rule whose `when:` matches it and names the rule that decided its pick; the report
gives every rule's verdict on the cases it decided ("backed": its pick within 3% of the best on all of them).

Timing: CUDA events, median over `--reps` calls taken in interleaved rounds over the implementations (so drift
hits them alike) after a warm-up; the first call of each implementation (compilation) runs under `--compile-cap`
seconds (SIGALRM): past it the case records "compile too slow" and that implementation is skipped for the rest of
the run (an interrupted compile leaves torch's compile state untrustworthy). reference.math is timed only when it
is the pick or the only eligible implementation.

Results are written after every case (`--out DIR`: policy_proof.json and policy_proof.md), so a run cut off by a
wall-clock limit still leaves a report; `--budget` stops starting work past that many seconds and `--resume`
continues a previous run in the same DIR. Exit status: 1 when a measured case FAILs, else 2 when cases are left
unmeasured (budget, errors of every implementation), else 0.

Usage (GPU): python benchmarks/policy_proof.py --out benchmarks/results/policy-proof-h100 [--quick] [--resume]
             [--cases 'rule:*,softcap*'] [--policy my.yaml] [--list]
CPU smoke:   python benchmarks/policy_proof.py --tiny --out /tmp/pp --cases 'dense*'

`--policy PATH` is loaded as the manager loads OPDISPATCH_POLICY: layered over the shipped default unless the file
says `extends: none` — so an edited full copy of configs/default.yaml must say `extends: none`, or the default's
rules still match beneath it (the script warns).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import opdispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import environment as _base_environment  # noqa: E402  (one environment block for every benchmark)
from side_by_side import samples_ms  # noqa: E402  (one timing loop for every benchmark)
from opdispatch.base._decision import _short_path
from opdispatch.policies._plan import rule_matches

KV_GROWTH = 2048  # decode forward cases: the kv lengths sk .. sk + KV_GROWTH - 1, one per call, then again
TOLERANCE = 0.03  # a pick losing to an eligible implementation by more than this fails the proof
SOFTCAP = 30.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELIGIBLE_STATUSES = ("chosen", "eligible")


# -- cases ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    family: str  # dense | softcap | alibi | window | varlen | decode | deterministic
    mode: str  # fwd | train (forward + backward)
    dtype: str  # bf16 | fp16 | fp32
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    causal: bool = True
    bottom_right: bool = False
    window: int | None = None
    lens: tuple[int, ...] | None = None  # varlen (packed thd): per-sequence lengths; b/sq/sk unused

    @property
    def name(self) -> str:
        if self.lens:
            shape = f"n{len(self.lens)}-t{sum(self.lens)}-max{max(self.lens)}"
        else:
            shape = f"b{self.b}-q{self.sq}-k{self.sk}"
        flags = ("-causal" if self.causal else "") + ("-br" if self.bottom_right else "")
        flags += f"-w{self.window}" if self.window else ""
        return f"{self.family}:{shape}-h{self.hq}/{self.hkv}-d{self.d}{flags}:{self.mode}:{self.dtype}"

    def kwargs(self, device: torch.device) -> dict[str, Any]:
        kw: dict[str, Any] = {"causal": self.causal}
        if self.bottom_right:
            kw["causal_alignment"] = "bottom_right"
        if self.window:
            kw["window"] = (self.window, 0)
        if self.family == "softcap":
            kw["softcap"] = SOFTCAP
        if self.family == "alibi":
            start = 2.0 ** (-8.0 / self.hq)  # the ALiBi paper's geometric slopes
            kw["alibi_slopes"] = torch.tensor([start ** (i + 1) for i in range(self.hq)], dtype=torch.float32,
                                              device=device)
        if self.family == "deterministic":
            kw["deterministic"] = True
        if self.lens:
            cu = torch.tensor([0, *torch.tensor(self.lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            kw.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(self.lens),
                      max_seqlen_k=max(self.lens))
        return kw

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """q, k and v's shapes as timed."""
        if self.lens:
            total = sum(self.lens)
            return (total, self.hq, self.d), (total, self.hkv, self.d), (total, self.hkv, self.d)
        sk = self.sk + (KV_GROWTH if self.grows else 0)  # room for a new kv length every call
        return (self.b, self.sq, self.hq, self.d), (self.b, sk, self.hkv, self.d), (self.b, sk, self.hkv, self.d)

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q, k, v on `device` (empty ones on "meta", where a decision needs only their metadata)."""
        gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(0)

        def t(shape: tuple[int, ...]) -> torch.Tensor:
            make = torch.empty if gen is None else functools.partial(torch.randn, generator=gen)
            return make(shape, device=device, dtype=DTYPES[self.dtype]).requires_grad_(self.mode == "train")

        q, k, v = self.shapes()
        return t(q), t(k), t(v)

    @property
    def grows(self) -> bool:
        """Decoding: every step sees one more key, so each forward call is timed at a new kv length (kernels that
        build a plan per shape, cuDNN's graphs, pay for it as a decode loop does)."""
        return self.family == "decode" and self.mode == "fwd" and not self.lens


def _c(family: str, mode: str = "fwd", dtype: str = "bf16", **shape: Any) -> Case:
    return Case(family=family, mode=mode, dtype=dtype, **shape)


# Sizes: about 8k tokens per call (16k where a rule's claim says so), 16-32 query heads: a few ms at most.
GQA = dict(b=2, sq=4096, sk=4096, hq=32, hkv=8, d=128)
MHA = dict(b=2, sq=4096, sk=4096, hq=16, hkv=16, d=128)
DECODE = dict(b=16, sq=1, sk=4096, hq=32, hkv=8, d=128, bottom_right=True)
WINDOW = dict(b=1, sq=8192, sk=8192, hq=32, hkv=8, d=128, window=1024)
WINDOW_MHA = dict(WINDOW, hq=16, hkv=16)  # side_by_side's window cell: torch's flex beat FA2 there (issue 29)
VARLEN_UNEVEN = dict(b=0, sq=0, sk=0, hq=32, hkv=8, d=128, lens=(1500, 512, 3000, 1200, 1900, 80))


def _varlen(lens: tuple[int, ...], mode: str = "fwd") -> Case:
    return _c("varlen", mode, **{**VARLEN_UNEVEN, "lens": lens})


# Per rule name: (case, in_quick) — the shape its reason claims first, then the neighbours across each threshold
# its `when:` tests. `--quick` keeps the claimed shapes and one neighbour.
RULE_CASES: dict[str, list[tuple[Case, bool]]] = {
    "decode-on-flash": [  # seqlen_q <= 16
        (_c("decode", **DECODE), True), (_c("decode", **{**DECODE, "sq": 16}), False),
        (_c("decode", **{**DECODE, "sq": 17}), True)],
    "flex-for-d64-window-inference": [  # window, head_dim 64, bf16, requires_grad false, seqlen_q > 16
        (_c("window", **{**WINDOW, "d": 64}), True), (_c("window", **{**WINDOW, "d": 64, "sq": 16384, "sk": 16384}),
                                                      False),
        (_c("window", "fwd", "fp16", **{**WINDOW, "d": 64}), True), (_c("window", **{**WINDOW, "d": 96}), True),
        (_c("window", "train", **{**WINDOW, "d": 64}), False)],
    "flex-for-softcap": [  # softcap; claimed 2 x 4096, 16/8 heads, forward and with its backward
        (_c("softcap", **{**GQA, "hq": 16}), True), (_c("softcap", "train", **{**GQA, "hq": 16}), True),
        (_c("dense", **{**GQA, "hq": 16}), False)],
    "cudnn-for-alibi-gqa-training": [  # alibi, gqa_ratio > 1, requires_grad
        (_c("alibi", "train", **GQA), True), (_c("alibi", **GQA), True), (_c("alibi", "train", **MHA), False)],
    "flex-for-alibi": [  # alibi: 16 heads fwd and fwd+bwd, 32/8 fwd
        (_c("alibi", **MHA), True), (_c("alibi", "train", **MHA), True), (_c("alibi", **GQA), True)],
    "flagos-for-d64-sliding-window-inference": [  # window, requires_grad false, head_dim 64
        (_c("window", **{**WINDOW, "d": 64}), True), (_c("window", **{**WINDOW, "d": 64, "sq": 16384, "sk": 16384}),
                                                      False),
        (_c("window", **WINDOW), True), (_c("window", **{**WINDOW, "d": 96}), False),
        (_c("window", "train", **{**WINDOW, "d": 64}), False)],
    "flagos-for-short-varlen-inference": [  # varlen, requires_grad false, seqlen_q (max_seqlen_q) <= 1024
        (_varlen((256,) * 64), True), (_varlen((1024,) * 16), True), (_varlen((1025,) + (1024,) * 15), True),
        (_varlen((1024,) * 16, "train"), False)],
}


def matrix_cases() -> list[Case]:
    """The extended matrix: every feature family in both modes and both half dtypes."""
    shapes = [("dense", {**GQA, "d": d}) for d in (64, 96, 128, 192, 256)]
    shapes += [("softcap", MHA), ("softcap", GQA), ("alibi", MHA), ("alibi", GQA), ("window", {**WINDOW, "d": 64}),
               ("window", WINDOW), ("window", WINDOW_MHA), ("varlen", VARLEN_UNEVEN), ("decode", DECODE),
               ("deterministic", GQA)]
    return [_c(family, mode, dtype, **shape) for dtype in ("bf16", "fp16") for family, shape in shapes
            for mode in ("fwd", "train")]


def shrink(case: Case) -> Case:
    """The CPU smoke size of `case` (fp32; decode keeps its query lengths, so its thresholds stay visible)."""
    def s(n: int) -> int:
        return n if n <= 32 else max(8, n // 64)

    ratio = case.hq // case.hkv
    return replace(case, dtype="fp32", b=min(case.b, 2), sq=s(case.sq), sk=s(case.sk), hq=4, hkv=max(1, 4 // ratio),
                   d=max(8, case.d // 8), window=case.window // 64 if case.window else None,
                   lens=tuple(max(1, n // 64) for n in case.lens) if case.lens else None)


def build_cases(rule_names: list[str], quick: bool, tiny: bool) -> tuple[list[Case], dict[str, list[str]]]:
    """Rule cases first (in the policy's rule order), then the matrix; identical cases merged, their tags joined."""
    ordered: dict[str, Case] = {}
    tags: dict[str, list[str]] = {}

    def add(case: Case, tag: str) -> None:
        if tiny:
            case = shrink(case)
        if quick and case.dtype == "fp16":
            return
        ordered.setdefault(case.name, case)
        if tag not in tags.setdefault(case.name, []):
            tags[case.name].append(tag)

    for rule in rule_names:
        for case, in_quick in RULE_CASES.get(rule, []):
            if in_quick or not quick:
                add(case, f"rule:{rule}")
    for rule in RULE_CASES:  # rules an earlier proof removed: their shapes stay measured (would they win now?)
        if rule not in rule_names:
            for case, in_quick in RULE_CASES[rule]:
                if in_quick or not quick:
                    add(case, f"former rule:{rule}")
    for case in matrix_cases():
        add(case, "matrix")
    return list(ordered.values()), tags


def select(cases: list[Case], tags: dict[str, list[str]], patterns: str | None) -> list[Case]:
    """The cases whose name or one of whose tags matches one of the comma-separated globs."""
    if not patterns:
        return cases
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in cases if any(fnmatch.fnmatchcase(n, g) for g in globs for n in (c.name, *tags[c.name]))]
    if not chosen:
        raise SystemExit(f"--cases {patterns!r} matches no case; names look like {cases[0].name!r} and tags like "
                         "'rule:decode-on-flash' or 'matrix' (globs, comma-separated); list them with --list")
    return chosen


# -- the policy's rules ----------------------------------------------------------------------------------------

def policy_rules(manager: Any) -> list[dict[str, Any]]:
    """Every rule of the attention section of every YAML layer of the active policy, highest layer first."""
    out = []
    for layer, policy_layer in manager.policy.yaml_layers:
        spec = policy_layer.op("attention")
        for i, rule in enumerate(spec.rules if spec is not None else ()):
            where = _short_path(policy_layer.where("ops", "attention", "rules", i))
            out.append({"name": rule.name, "layer": layer.name, "where": where,
                        "when": {k: str(v) for k, v in rule.when.conditions().items()},
                        "prefer": rule.prefer, "pin": rule.pin, "timing": bool(rule.prefer or rule.pin),
                        "reason": rule.reason, "has_cases": rule.name in RULE_CASES, "_rule": rule})
    return out


# -- timing --------------------------------------------------------------------------------------------------

class FirstCallTooSlow(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[dict[str, bool]]:
    """Raise FirstCallTooSlow in this (main) thread after `seconds`. The yielded flag says whether it fired, since
    torch's compiler may wrap the exception in its own."""
    fired = {"fired": False}
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield fired
        return

    def on_alarm(signum: int, frame: Any) -> None:
        fired["fired"] = True
        raise FirstCallTooSlow(f"first call exceeded {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any],
            impl: str | None) -> Callable[[], Any]:
    """One call of `opdispatch.attention` (pinned to `impl`, or the policy's when None); in training mode also its
    backward, with the gradients dropped so every call does the same work."""
    attention = opdispatch.attention
    if case.grows:
        step = [0]

        def decode_step() -> Any:
            n = case.sk + step[0] % KV_GROWTH
            step[0] += 1
            with torch.no_grad():
                return attention(q, k[:, :n], v[:, :n], impl=impl, **kw)

        return decode_step
    if case.mode == "fwd":
        def forward() -> Any:
            with torch.no_grad():
                return attention(q, k, v, impl=impl, **kw)

        return forward
    grad: list[torch.Tensor] = []

    def train() -> None:
        out = attention(q, k, v, impl=impl, **kw)
        if not grad:
            grad.append(torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1),
                                    device=out.device, dtype=out.dtype))
        out.backward(grad[0])
        q.grad = k.grad = v.grad = None

    return train


# -- verdicts --------------------------------------------------------------------------------------------------

def case_verdict(times_ms: dict[str, float], pick: str | None, errors: dict[str, str],
                 tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The pick against the fastest timed implementation: best, regret, and PASS / FAIL / UNMEASURED with why."""
    out: dict[str, Any] = {"best": None, "best_ms": None, "pick_ms": None, "regret": None}
    if times_ms:
        best = min(times_ms, key=lambda i: times_ms[i])
        out.update(best=best, best_ms=times_ms[best])
    if pick is None:
        return {**out, "verdict": "FAIL", "why": "the policy picks no implementation for this call"}
    if pick not in times_ms:
        if pick in errors:
            return {**out, "verdict": "FAIL", "why": f"the pick {pick} was not measurable: {errors[pick]}"}
        return {**out, "verdict": "UNMEASURED", "why": f"the pick {pick} was not timed (run cut short)"}
    regret = times_ms[pick] / times_ms[out["best"]] - 1
    out.update(pick_ms=times_ms[pick], regret=regret)
    if times_ms[pick] > out["best_ms"] * (1 + tolerance):  # not `regret > tolerance`: 1.03 / 1.0 - 1 > 0.03
        return {**out, "verdict": "FAIL", "why": f"{pick} {times_ms[pick]:.4g} ms loses to {out['best']} "
                                                 f"{out['best_ms']:.4g} ms by {regret:.1%} (> {tolerance:.0%})"}
    return {**out, "verdict": "PASS", "why": ""}


def summarize(records: list[dict[str, Any]], rules: list[dict[str, Any]],
              tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Geomean and worst regret over the measured cases, counts per verdict, and every rule's verdict on the cases
    it decided ("backed": all within `tolerance`; "contradicted": some not; "not exercised": none measured)."""
    measured = [r for r in records if r.get("regret") is not None]
    geomean = (math.exp(statistics.fmean(math.log1p(r["regret"]) for r in measured)) - 1) if measured else None
    worst = max(measured, key=lambda r: r["regret"]) if measured else None
    counts = {v: sum(r.get("verdict") == v for r in records) for v in ("PASS", "FAIL", "UNMEASURED")}
    per_rule = []
    for rule in rules:
        decided = [r for r in records if r.get("decided_by_rule") == rule["name"]]
        judged = [r for r in decided if r.get("verdict") in ("PASS", "FAIL")]
        against = [r["name"] for r in judged if r["verdict"] == "FAIL"]
        verdict = ("not exercised" if not judged else "contradicted" if against else "backed")
        worst_rule = max((r["regret"] for r in judged if r.get("regret") is not None), default=None)
        per_rule.append({"name": rule["name"], "layer": rule["layer"], "where": rule["where"],
                         "timing": rule["timing"], "has_cases": rule["has_cases"], "verdict": verdict,
                         "decided": [r["name"] for r in decided], "failing": against, "worst_regret": worst_rule,
                         "matched": [r["name"] for r in records if rule["name"] in r.get("matched_rules", [])]})
    return {"tolerance": tolerance, "measured": len(measured), "geomean_regret": geomean,
            "worst_regret": worst["regret"] if worst else None, "worst_case": worst["name"] if worst else None,
            "counts": counts, "rules": per_rule}


def exit_status(records: list[dict[str, Any]], selected: int) -> int:
    """1 when a case FAILs; else 2 when a selected case is left without a verdict of PASS; else 0."""
    if any(r.get("verdict") == "FAIL" for r in records):
        return 1
    done = sum(r.get("verdict") == "PASS" for r in records)
    return 2 if done < selected else 0


# -- one case ------------------------------------------------------------------------------------------------

class WarningLog(logging.Handler):
    """opdispatch's warnings during a case (a demotion, torch.flex falling back to unfused past dynamo's recompile
    limit): recorded with the case, since they change what its timings mean."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:400])


class Runner:
    def __init__(self, args: argparse.Namespace, device: torch.device, rules: list[dict[str, Any]]) -> None:
        self.args, self.device, self.rules = args, device, rules
        self.manager = opdispatch.get_manager()
        self.info = self.manager.device_info(device)
        self.start = time.monotonic()
        self.skipped: dict[str, str] = {}  # impl -> why it is skipped for the rest of the run

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.start) if self.args.budget > 0 else math.inf

    def run_case(self, case: Case, tags: list[str]) -> dict[str, Any]:
        log, logger = WarningLog(), logging.getLogger("opdispatch")
        logger.addHandler(log)
        try:
            record = self._run_case(case, tags)
        finally:
            logger.removeHandler(log)
        record["warnings"] = log.messages
        if any("recompile limit" in m for m in log.messages):
            # torch.flex ran unfused from some call on (it warns once per process): its times here, and from now
            # on, are not the compiled kernel's.
            why = "torch.flex fell back to unfused flex at dynamo's recompile limit; measure it with --resume in a " \
                  "fresh process"
            if record["times_ms"].pop("torch.flex", None) is not None:
                record["errors"]["torch.flex"] = why
                record.update(case_verdict(record["times_ms"], record["pick"], record["errors"], self.args.tolerance))
                record["complete"] = False  # left for a --resume run
            self.skipped["torch.flex"] = f"skipped: {why}"
        return record

    def _run_case(self, case: Case, tags: list[str]) -> dict[str, Any]:
        device = self.device
        q, k, v = case.inputs(device)
        kw = case.kwargs(device)
        call = opdispatch.validate_attention(q, k, v, **kw)
        decision = opdispatch.explain(q, k, v, **kw)
        by = decision.decided_by
        eligible = [c.impl_id for c in decision.candidates if c.status in ELIGIBLE_STATUSES]
        pick = decision.chosen_id
        timed = [i for i in eligible if i != "reference.math" or i == pick or len(eligible) == 1]
        record: dict[str, Any] = {
            "name": case.name, "tags": tags, "case": asdict(case), "mode": case.mode, "dtype": case.dtype,
            "call": str(decision.call), "pick": pick, "decided_by": by.short(pick) if by else None,
            "decided_by_rule": by.rule if by else None,
            "matched_rules": [r["name"] for r in self.rules if rule_matches(r["_rule"].when, call, self.info)],
            "eligible": eligible,
            "not_eligible": {c.impl_id: f"{c.status}: {'; '.join(c.reasons)}" for c in decision.candidates
                             if c.status not in ELIGIBLE_STATUSES and c.status != "unavailable"},
            "times_ms": {}, "first_call_s": {}, "errors": {}, "policy_ms": None, "complete": False}
        fns: dict[str, Callable[[], Any]] = {}
        for impl in [*timed, None]:  # None: the unpinned call, as the policy dispatches it
            label = impl or "policy"
            if impl in self.skipped:
                record["errors"][impl] = self.skipped[impl]
                continue
            cap = min(self.args.compile_cap or math.inf, self.remaining())
            if cap <= 0:
                record["errors"][label] = "not run: --budget reached"
                continue
            fn = step_fn(case, q, k, v, kw, impl)
            t0 = time.perf_counter()
            try:
                with time_limit(cap if math.isfinite(cap) else 0) as alarm:
                    fn()
                    sync(device)
            except Exception as exc:  # recorded per implementation; the others still run
                if alarm["fired"] and cap < (self.args.compile_cap or math.inf):
                    record["errors"][label] = "not run: --budget reached during its first call"
                elif alarm["fired"]:
                    why = f"compile too slow: first call exceeded --compile-cap {cap:.0f} s"
                    record["errors"][label] = why
                    if impl is not None:
                        self.skipped[impl] = f"skipped: {why} on {case.name}"
                else:
                    record["errors"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            record["first_call_s"][label] = time.perf_counter() - t0
            try:
                samples_ms(fn, device, self.args.warmup)
            except Exception as exc:
                record["errors"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            fns[label] = fn
        # Interleaved rounds: every implementation sees the same clocks and the same neighbours' cache state.
        rounds = max(1, min(self.args.rounds, self.args.reps))
        per_round = max(1, self.args.reps // rounds)
        collected: dict[str, list[float]] = {label: [] for label in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                if label in collected:
                    try:
                        collected[label] += samples_ms(fn, device, per_round)
                    except Exception as exc:
                        record["errors"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        del collected[label]
        for label, times in collected.items():
            if label == "policy":
                record["policy_ms"] = statistics.median(times)
            else:
                record["times_ms"][label] = statistics.median(times)
        # The pick after the run: the breaker may have demoted it for this call class meanwhile.
        record["pick_after"] = opdispatch.explain(q, k, v, **kw).chosen_id
        record.update(case_verdict(record["times_ms"], pick, record["errors"], self.args.tolerance))
        # Cut short by the budget, or missing an implementation only a fresh process can time: left for --resume.
        record["complete"] = not any(e.startswith("not run: --budget") or "fresh process" in e
                                     for e in record["errors"].values())
        del q, k, v, kw, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return record


# -- environment and reports -----------------------------------------------------------------------------------

def environment(device: torch.device) -> dict[str, Any]:
    """decode_loop's environment block (device, versions, commit), plus opdispatch's and the vendor packages'."""
    import importlib.metadata as md

    env = _base_environment(device)
    env["opdispatch"] = opdispatch.__version__
    for dist in ("flag-gems", "flash-attn", "flash-attn-3"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return env


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}" if value < 1 else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}" if value < 0 else f"{value:.1%}"


def write_reports(out: Path, result: dict[str, Any]) -> None:
    """policy_proof.json and policy_proof.md, each replaced atomically (a run killed mid-write leaves the last)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("policy_proof.json", json.dumps(result, indent=1, default=str)),
                       ("policy_proof.md", markdown(result))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def merge_reports(dirs: list[Path], out: Path) -> int:
    """One report from several runs' policy_proof.json (a full run, then runs of the cases a policy change
    touched): a case measured again replaces its earlier record, the rules are the last run's (the current
    policy's), and the verdicts and summary are computed over the union. Each source is named with its commit,
    device and the cases it contributed; runs on another device are refused."""
    runs = [(d, json.loads((d / "policy_proof.json").read_text())) for d in dirs]
    device = runs[-1][1]["environment"]["device"]
    cases: dict[str, dict[str, Any]] = {}
    origin: dict[str, Path] = {}
    for d, run in runs:
        if run["environment"]["device"] != device:
            raise SystemExit(f"--merge: {d} was measured on {run['environment']['device']}, not {device}")
        for record in run["cases"]:
            cases[record["name"]] = record
            origin[record["name"]] = d
    last = runs[-1][1]
    rules = last["rules"]
    records = list(cases.values())
    summary = summarize(records, rules)
    status = exit_status(records, len(records))
    sources = [{"dir": str(d), "commit": run["environment"].get("commit"),
                "fast_path": run["environment"].get("fast_path", "python"), "policy_hash": run["policy"]["hash"],
                "cases": sum(origin[n] == d for n in cases)} for d, run in runs]
    result = {"environment": last["environment"], "argv": ["benchmarks/policy_proof.py", "--merge",
                                                           *map(str, dirs), "--out", str(out)],
              "policy": last["policy"], "rules": last["rules"], "selected": len(records), "cases": records,
              "summary": summary, "left": [], "sources": sources,
              "verdict": {0: "PASS", 1: "FAIL", 2: "INCOMPLETE"}[status], "exit_status": status}
    write_reports(out, result)
    print(f"merged {len(records)} cases from {len(dirs)} runs: geomean regret {_pct(summary['geomean_regret'])}, "
          f"worst {_pct(summary['worst_regret'])} ({summary['worst_case']}); {summary['counts']}")
    return status


def markdown(result: dict[str, Any]) -> str:
    env, summary, policy = result["environment"], result["summary"], result["policy"]
    lines = ["# Attention policy proof", "",
             f"Device: **{env['device']}**; " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device") + ".",
             f"Policy: `{policy['source']}` (hash {policy['hash']}). Tolerance {summary['tolerance']:.0%}. "
             f"Command: `{' '.join(result['argv'])}`.", "",
             *([f"Merged from (a case measured again replaces its earlier record): " + "; ".join(
                 f"`{src['dir']}` (commit {src['commit']}, fast path {src['fast_path']}, policy {src['policy_hash']}:"
                 f" {src['cases']} cases)" for src in result["sources"]), ""] if result.get("sources") else []),
             f"Cases: {len(result['cases'])} of {result['selected']} measured; "
             + ", ".join(f"{v} {n}" for v, n in summary["counts"].items()) + ".",
             f"**Geomean regret: {_pct(summary['geomean_regret'])}; worst: {_pct(summary['worst_regret'])}"
             + (f" ({summary['worst_case']})" if summary["worst_case"] else "")
             + f".** Verdict: **{result['verdict']}**.",
             "", "## Rules", "", "| rule | where | verdict | cases decided | worst regret | failing |",
             "|---|---|---|---|---|---|"]
    for rule in summary["rules"]:
        note = "" if rule["has_cases"] or not rule["timing"] else " (no claimed shapes in this script)"
        verdict = rule["verdict"] + note if rule["timing"] else "not a timing rule"
        lines.append(f"| {rule['name']} | {rule['where']} | {verdict} | {len(rule['decided'])} | "
                     f"{_pct(rule['worst_regret'])} | {', '.join(rule['failing']) or '-'} |")
    lines += ["", "## Cases", "",
              "| case | mode | dtype | decided by | pick | pick ms | best | best ms | regret | verdict | others (ms) "
              "| policy ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        others = ", ".join(f"{i} {_ms(t)}" for i, t in sorted(r["times_ms"].items(), key=lambda x: x[1])
                           if i not in (r["pick"], r["best"]))
        lines.append(f"| {r['name']} | {r['mode']} | {r['dtype']} | {r['decided_by_rule'] or r['decided_by']} | "
                     f"{r['pick']} | {_ms(r['pick_ms'])} | {r['best']} | {_ms(r['best_ms'])} | {_pct(r['regret'])} | "
                     f"{r['verdict']} | {others or '-'} | {_ms(r['policy_ms'])} |")
    failing = [r for r in result["cases"] if r["verdict"] != "PASS"]
    if failing:
        lines += ["", "## Not passing", ""]
        lines += [f"- `{r['name']}` {r['verdict']} (decided by {r['decided_by']}): {r['why']}" for r in failing]
    errors = [(r["name"], i, e) for r in result["cases"] for i, e in r["errors"].items()]
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{n}` {i}: {e}" for n, i, e in errors]
    if result["left"]:
        lines += ["", "## Not measured yet", ""] + [f"- `{n}`" for n in result["left"]]
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="directory for policy_proof.json / .md (required unless "
                                                           "--list)")
    ap.add_argument("--quick", action="store_true", help="bf16 only; the rules' claimed shapes and one neighbour")
    ap.add_argument("--cases", default=None, help="comma-separated globs over case names and tags ('rule:NAME', "
                                                  "'matrix'), e.g. 'rule:*,softcap*'")
    ap.add_argument("--list", action="store_true", help="print the selected cases with their tags and exit")
    ap.add_argument("--policy", type=Path, default=None,
                    help="policy YAML to prove (default: the manager's, i.e. $OPDISPATCH_POLICY or the shipped "
                         "configs/default.yaml); layered over the shipped default unless it says `extends: none`")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny sizes, fp32, on the CPU")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per implementation (median)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds the reps are split into")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls after the first")
    ap.add_argument("--compile-cap", type=float, default=60.0,
                    help="seconds an implementation's first call (compilation) may take; 0: no cap")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds after which no more work starts (results so far are written); 0: no budget")
    ap.add_argument("--resume", action="store_true", help="keep the complete cases of DIR/policy_proof.json and "
                                                          "measure only the rest")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                    help="no measuring: merge these runs' reports into --out (later runs' cases replace earlier)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("reps", "rounds", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name} {getattr(args, name)} is out of range; give at least {0 if name == 'warmup' else 1}")
    if args.compile_cap < 0 or args.budget < 0:
        ap.error("--compile-cap and --budget take seconds >= 0 (0: no limit)")
    if args.out is None and not args.list:
        ap.error("--out DIR is required (where policy_proof.json and .md are written); or --list")
    if args.policy is not None and not args.policy.is_file():
        ap.error(f"--policy {args.policy}: no such file; give the path of a policy YAML")
    if args.tiny:
        args.reps, args.rounds, args.warmup = min(args.reps, 5), min(args.rounds, 1), min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge_reports(args.merge, args.out)
    manager = opdispatch.get_manager()
    if args.policy is not None:
        manager.set_policy(str(args.policy))
        user = [pl for layer, pl in manager.policy.yaml_layers if layer.name == "user"]
        if user and user[0].model.extends == "default":
            print(f"note: {args.policy} extends the shipped default: the default's rules still match beneath it "
                  "(write `extends: none` in a full copy)", file=sys.stderr)
    rules = policy_rules(manager)
    attention_rules = list(dict.fromkeys(r["name"] for r in rules if r["timing"]))
    cases, tags = build_cases(attention_rules, args.quick, args.tiny)
    cases = select(cases, tags, args.cases)
    if args.list:
        for case in cases:
            print(case.name, " ".join(tags[case.name]))
        return 0
    if args.tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: the policy proof times GPU kernels; run it on the GPU machine, or --tiny "
                         "for the CPU smoke test")
    out: Path = args.out
    previous: dict[str, dict[str, Any]] = {}
    env = environment(device)
    if args.resume and (out / "policy_proof.json").is_file():
        old = json.loads((out / "policy_proof.json").read_text())
        if old["environment"]["device"] != env["device"] or old["policy"]["hash"] != manager.policy.hash:
            raise SystemExit(f"--resume: {out}/policy_proof.json was measured on {old['environment']['device']} "
                             f"with policy hash {old['policy']['hash']}, not {env['device']} / {manager.policy.hash};"
                             " give another --out or drop --resume")
        previous = {r["name"]: r for r in old["cases"] if r.get("complete")}
    runner = Runner(args, device, rules)
    selected = [c.name for c in cases]
    records = [previous[n] for n in selected if n in previous]
    public_rules = [{k: v for k, v in r.items() if k != "_rule"} for r in rules]

    def report() -> int:
        done = {r["name"] for r in records}
        summary = summarize(records, rules, args.tolerance)
        status = exit_status(records, len(selected))
        result = {"environment": env, "argv": ["benchmarks/policy_proof.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])],
                  "policy": {"source": manager.policy.source, "hash": manager.policy.hash},
                  "rules": public_rules, "selected": len(selected), "cases": records, "summary": summary,
                  "left": [n for n in selected if n not in done],
                  "verdict": {0: "PASS", 1: "FAIL", 2: "INCOMPLETE"}[status], "exit_status": status}
        write_reports(out, result)
        return status

    status = report()
    for case in cases:
        if case.name in previous:
            continue
        if runner.remaining() <= 0:
            print(f"--budget {args.budget:.0f} s reached: {case.name} and later cases left (rerun with --resume)",
                  flush=True)
            break
        record = runner.run_case(case, tags[case.name])
        if record["complete"]:
            records.append(record)
        print(f"{record['verdict']:<10} {case.name}: pick {record['pick']} {_ms(record['pick_ms'])} ms, best "
              f"{record['best']} {_ms(record['best_ms'])} ms, regret {_pct(record['regret'])} "
              f"({record['decided_by']}) {record['why']}", flush=True)
        status = report()
    summary = summarize(records, rules, args.tolerance)
    print(f"geomean regret {_pct(summary['geomean_regret'])}, worst {_pct(summary['worst_regret'])} "
          f"({summary['worst_case']}); {summary['counts']}; report in {out}/policy_proof.md", flush=True)
    for rule in summary["rules"]:
        if rule["timing"]:
            print(f"  rule {rule['name']}: {rule['verdict']} on {len(rule['decided'])} case(s)"
                  + (f"; fails on {', '.join(rule['failing'])}" if rule["failing"] else ""), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
