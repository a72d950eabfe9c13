"""`opdispatch validate`: a conformance matrix per implementation (every op), each in its own process, and a
quarantine.

For every attention implementation available on the device (or those named), a matrix of calls — each feature
class its capabilities declare (causal in both alignments, window, softcap, ALiBi, masks, bias, GQA, varlen, LSE,
backward), in each dtype it declares, plus odd shapes and strided views — runs through the op, pinned to it, with
the output guard on (structure, NaN, inputs unchanged), and is compared with `reference.math` computing in float64
(an implementation is never compared with itself: the reference is not validated here; its own tests hold it to an
independent oracle). Tolerance per dtype (`TOLERANCE`). The other ops' implementations run their op's tuning
cases (`OpSpec.tuning`, CPU sizes) with every combination of the cases' boolean fields (weight, residual,
interleaved, backward…) against the op's reference implementation in float64 (`op_cases`).

Each implementation runs in a worker process (``python -m opdispatch._validate WORKER_ARGS``) that reports each
case as one JSON line when it ends. A case that kills its process (abort, segfault), hangs past ``--timeout``
or leaves the CUDA context dead is recorded as crashed or timed out, and a fresh worker takes the remaining cases:
a crash costs only that case. The failing (implementation, feature class) pairs are written as a quarantine file
— deny rules scoped by `when:` to the feature class, the failing dtypes, this device and these library versions,
with the evidence as the reason — that every policy loads (`opdispatch.policies._policy.quarantine_layers`), so
`explain()` says "quarantined by validate: …". A markdown and a JSON report say what ran.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["TOLERANCE", "Case", "CaseResult", "attention_cases", "quarantine_yaml", "run_validation"]

# ‖out − ref‖ / ‖ref‖ per dtype: forward, gradients. LSE: max |Δ| over finite rows.
TOLERANCE = {"fp16": (4e-3, 1.5e-2), "bf16": (2.5e-2, 5e-2), "fp32": (2e-3, 5e-3), "fp64": (1e-9, 1e-8)}
LSE_ATOL = 2e-2
STARTUP_S = 120.0  # a worker's start (imports, plugin loading) before its first case, beyond --timeout

# Feature class -> (the call's keyword arguments beyond q/k/v, shape changes, the `when:` conditions a quarantine
# of this class gets). Shapes: batch 2, 8 query heads, head dim 64 unless changed.
_FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "dense": ({}, {}, {}),
    "causal": ({"causal": True}, {}, {"causal": True}),
    "causal_bottom_right": ({"causal": True, "causal_alignment": "bottom_right"}, {"sq": 19, "sk": 45},
                            {"causal": True, "causal_alignment": "bottom_right"}),
    "window": ({"window": (16, 0), "causal": True}, {}, {"window": True}),
    "softcap": ({"softcap": 20.0}, {}, {"softcap": True}),
    "alibi": ({"alibi": True}, {}, {"alibi": True}),
    "mask": ({"mask": True}, {}, {"mask": True}),
    "bias": ({"bias": True}, {}, {"bias": True}),
    "gqa": ({}, {"hkv": 2}, {"gqa_ratio": ">1"}),
    "lse": ({"return_lse": True, "causal": True}, {}, {"return_lse": True}),
    "varlen": ({"varlen": True, "causal": True}, {}, {"varlen": True}),
    "odd_shapes": ({}, {"sq": 1, "sk": 37, "b": 3}, {"seqlen_q": 1}),
    "strided": ({"strided": True}, {}, {}),
    "backward": ({"grad": True, "causal": True}, {}, {"requires_grad": True}),
}
QUICK = ("dense", "causal", "causal_bottom_right", "gqa", "lse", "varlen", "strided", "backward")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the matrix, as plain data (it travels to the worker as JSON)."""

    index: int
    feature: str
    dtype: str
    b: int = 2
    sq: int = 48
    sk: int = 48
    hq: int = 8
    hkv: int = 8
    d: int = 64
    options: tuple[tuple[str, Any], ...] = ()
    op: str = "attention"
    data: tuple[tuple[str, Any], ...] = ()  # another op's tuning case (`TuningSpec.case.to_dict()`)

    def describe(self) -> str:
        if self.op != "attention":
            return f"{self.op} {self.feature}"
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return (f"{self.feature} {self.dtype} b={self.b} sq={self.sq} sk={self.sk} heads={self.hq}/{self.hkv} "
                f"d={self.d}" + (f" {opts}" if opts else ""))


@dataclasses.dataclass
class CaseResult:
    case: Case
    status: str  # pass | fail | crashed | timeout | not declared
    detail: str = ""
    error: float | None = None


def attention_cases(dtypes: Sequence[str], features: Sequence[str] | None = None) -> list[Case]:
    cases: list[Case] = []
    for feature in features or _FEATURES:
        options, shape, _ = _FEATURES[feature]
        for dtype in dtypes:
            cases.append(Case(len(cases), feature, dtype, options=tuple(sorted(options.items())), **shape))
    return cases


def op_cases(op: str, dtypes: Sequence[str]) -> list[Case]:
    """Another op's matrix: its tuning presets' cases (the CPU sizes: correctness, not speed) with each boolean
    field also flipped (weight, residual, interleaved, backward…), one case per combination, in each dtype."""
    import itertools

    from ._ops import op_spec

    tuning = op_spec(op).tuning
    if tuning is None:
        return []
    case_type: Any = tuning.case
    cases: list[Case] = []
    seen: set[tuple[Any, ...]] = set()
    for preset in tuning.presets:
        for case in tuning.preset(preset, "cpu"):
            base = case.to_dict()
            flags = [k for k, v in base.items() if isinstance(v, bool)]
            for values, dtype in itertools.product(itertools.product((False, True), repeat=len(flags)), dtypes):
                data = {**base, **dict(zip(flags, values)), "dtype": dtype}
                key = (dtype, *values)
                if key in seen:
                    continue
                seen.add(key)
                typed = case_type.from_dict(data)
                when = _op_when(op, tuning.validate(**typed.inputs("meta")))
                cases.append(Case(len(cases), typed.describe() + "".join(f" {k}={v}" for k, v in zip(flags, values)),
                                  dtype, op=op, data=tuple(sorted(data.items())), options=tuple(sorted(when.items()))))
    return cases


def _op_when(op: str, call: Any) -> dict[str, Any]:
    """A non-attention case's quarantine conditions: the call's boolean features that hold."""
    from ._ops import op_spec

    features = op_spec(op).call_features(call)
    return {k: True for k, v in sorted(features.items()) if v is True}


def run_op_case(impl_id: str, case: Case, device: str) -> CaseResult:
    """A case of an op other than attention: through its front door, pinned, against its reference in float64."""
    import torch

    import opdispatch

    from ._ops import op_spec

    spec = op_spec(case.op)
    assert spec.tuning is not None
    case_type: Any = spec.tuning.case
    inputs = case_type.from_dict(dict(case.data)).inputs(device, torch.Generator().manual_seed(case.index))
    call = spec.tuning.validate(**inputs)
    manager = opdispatch.get_manager()
    undeclared = _undeclared(manager, case, impl_id, call)
    if undeclared is not None:
        return undeclared
    reference = next(i.id for i in manager.implementations(case.op) if getattr(i, "reference_fallback", False))
    front_door = getattr(opdispatch, case.op)
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]

    def outputs(result: Any) -> list[Any]:
        return list(result) if isinstance(result, tuple) else [result]

    try:
        got = outputs(front_door(**inputs, impl=impl_id))
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(got)]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), leaves) if leaves else ()
    except Exception as exc:
        return CaseResult(case, "fail", f"raised {type(exc).__name__}: {str(exc)[:300]}")
    ref_inputs = {k: (v.detach().double().requires_grad_(v.requires_grad)
                      if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
    want = outputs(front_door(**ref_inputs, impl=reference))
    fwd_tol, grad_tol = TOLERANCE[case.dtype]
    errors = [_rel(g, w) for g, w in zip(got, want)]
    problems = [f"output {i} error {e:.3g} > {fwd_tol:g}" for i, e in enumerate(errors) if not e <= fwd_tol]
    if leaves:
        ref_leaves = [v for v in ref_inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        ref_grads = torch.autograd.grad(sum((o * w.double()).sum() for o, w in zip(want, weights)), ref_leaves)
        problems += [f"gradient {i} error {_rel(g, r):.3g} > {grad_tol:g}" for i, (g, r) in
                     enumerate(zip(grads, ref_grads)) if not _rel(g, r) <= grad_tol]
    return CaseResult(case, "fail" if problems else "pass", "; ".join(problems), max(errors, default=0.0))


# -- the worker: runs cases and reports each as a JSON line -----------------------------------------------------

def _tensors(case: Case, device: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    from ._attention import dtype_from_name

    opts = dict(case.options)
    dtype = dtype_from_name(case.dtype)
    gen = torch.Generator().manual_seed(1000 + case.index)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    kwargs: dict[str, Any] = {k: v for k, v in opts.items()
                              if k in ("causal", "causal_alignment", "window", "softcap", "return_lse")}
    if opts.get("varlen"):
        lengths = [case.sq - 9, 9, case.sq]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        total = sum(lengths)
        q, k, v = rand(total, case.hq, case.d), rand(total, case.hkv, case.d), rand(total, case.hkv, case.d)
        kwargs.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                      max_seqlen_k=max(lengths))
        return (q, k, v), kwargs
    if opts.get("strided"):  # head dim not innermost, k/v sliced
        q = rand(case.b, case.sq, case.d, case.hq).transpose(-1, -2)
        k = rand(case.b, case.sk, case.hkv, 2 * case.d)[..., ::2]
        v = rand(case.b, case.hkv, case.sk, case.d).transpose(1, 2)
    else:
        q, k, v = rand(case.b, case.sq, case.hq, case.d), rand(case.b, case.sk, case.hkv, case.d), \
            rand(case.b, case.sk, case.hkv, case.d)
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = (torch.rand(case.hq, generator=gen) * 0.5).to(device)
    if opts.get("mask"):
        mask = torch.rand(case.b, case.hq, case.sq, case.sk, generator=gen) > 0.3
        mask[..., 0] = True
        kwargs["attn_mask"] = mask.to(device)
    if opts.get("bias"):
        kwargs["attn_bias"] = (torch.randn(case.b, case.hq, case.sq, case.sk, generator=gen)).to(dtype).to(device)
    if opts.get("grad"):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return (q, k, v), kwargs


def _undeclared(manager: Any, case: Case, impl_id: str, call: Any) -> CaseResult | None:
    """The case's result when `impl_id` does not declare it (not registered, or a reason it cannot take it)."""
    impl = manager.implementation(case.op, impl_id)
    if impl is None:
        return CaseResult(case, "not declared", f"{impl_id} is not registered")
    reasons = impl.not_supported_reasons(call, manager.device_info(call.device))
    return CaseResult(case, "not declared", "; ".join(reasons)) if reasons else None


def _rel(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(impl_id: str, case: Case, device: str) -> CaseResult:
    """One case, in this process: the implementation through the op (pinned), then the float64 reference."""
    import torch

    import opdispatch

    (q, k, v), kwargs = _tensors(case, device)
    call = opdispatch.validate_attention(q, k, v, **kwargs)
    manager = opdispatch.get_manager()
    undeclared = _undeclared(manager, case, impl_id, call)
    if undeclared is not None:
        return undeclared
    try:
        result = opdispatch.attention(q, k, v, impl=impl_id, **kwargs)
        out, lse = result if kwargs.get("return_lse") else (result, None)
        grads = None
        if q.requires_grad:
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.index)).to(out)
            grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        return CaseResult(case, "fail", f"raised {type(exc).__name__}: {str(exc)[:300]}")
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    ref_kwargs = {key: (val.double() if hasattr(val, "is_floating_point") and val.is_floating_point()
                        and key == "attn_bias" else val) for key, val in kwargs.items()}
    ref = opdispatch.attention(*ref_inputs, impl="reference.math", **ref_kwargs)
    ref_out, ref_lse = ref if kwargs.get("return_lse") else (ref, None)
    fwd_tol, grad_tol = TOLERANCE[case.dtype]
    err = _rel(out, ref_out)
    problems = [f"out error {err:.3g} > {fwd_tol:g}"] if not err <= fwd_tol else []
    if lse is not None and ref_lse is not None:
        finite = torch.isfinite(ref_lse)
        lse_err = float((lse.double()[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
        if not lse_err <= LSE_ATOL or bool((lse[~finite] != -math.inf).any()):
            problems.append(f"lse error {lse_err:.3g} (or a blind row not -inf)")
    if grads is not None:
        ref_grads = torch.autograd.grad((ref_out * weight.double()).sum(), ref_inputs)
        for name, g, rg in zip("qkv", grads, ref_grads):
            g_err = _rel(g, rg)
            if not g_err <= grad_tol:
                problems.append(f"d{name} error {g_err:.3g} > {grad_tol:g}")
    return CaseResult(case, "fail" if problems else "pass", "; ".join(problems), err)


def _worker(impl_id: str, device: str, cases_path: str, start: int, out: TextIO) -> None:
    os.environ["OPDISPATCH_CHECK_OUTPUTS"] = "1"  # structure, NaN and untouched inputs, every call
    cases = [Case(**{**c, "options": tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in c["options"]),
                     "data": tuple((k, v) for k, v in c["data"])})
             for c in json.loads(Path(cases_path).read_text())]
    _warm_up(device)
    for case in cases[start:]:
        out.write(json.dumps({"start": case.index}) + "\n")
        out.flush()
        result = run_case(impl_id, case, device) if case.op == "attention" else run_op_case(impl_id, case, device)
        out.write(json.dumps({"index": case.index, "status": result.status, "detail": result.detail,
                              "error": result.error}) + "\n")
        out.flush()
        if result.status == "fail" and _context_may_be_dead(result.detail):
            return  # the parent starts a fresh worker for the rest


def _warm_up(device: str) -> None:
    """Load the plugins and run one reference call before the first case's clock starts.

    A worker's first dispatch pays for plugin loading, policy parsing and lazy imports; charged to the first case it
    turns a slow machine into a false timeout. This runs under the parent's startup allowance instead.
    """
    import torch

    import opdispatch

    opdispatch.get_manager()
    q = torch.randn(1, 2, 1, 8, device=device)
    opdispatch.attention(q, q, q, impl="reference.math")
    if q.is_cuda:
        torch.cuda.synchronize()


def _context_may_be_dead(detail: str) -> bool:
    return any(s in detail for s in ("CUDA error", "illegal memory access", "device-side assert", "HIP error"))


# -- the parent: workers, progress, results ---------------------------------------------------------------------

def validate_impl(impl_id: str, device: str, cases: list[Case], timeout: float,
                  progress: Callable[[str, int, int, str], None], workdir: Path) -> list[CaseResult]:
    """Run `cases` for `impl_id` in worker processes, restarting after a crash, a hang or a dead context."""
    cases_path = workdir / f"cases-{impl_id}.json"
    cases_path.write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
    results: dict[int, CaseResult] = {}
    start = 0
    while start < len(cases):
        proc = subprocess.Popen([sys.executable, "-m", "opdispatch._validate", impl_id, device, str(cases_path),
                                 str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        stderr_tail: collections.deque[str] = collections.deque(maxlen=50)  # the crash message comes last

        def pump(stream: Any, sink: Callable[[str], None]) -> None:
            for line in stream:
                sink(line)
            if stream is proc.stdout:
                lines.put(None)

        threading.Thread(target=pump, args=(proc.stdout, lines.put), daemon=True).start()
        threading.Thread(target=pump, args=(proc.stderr, stderr_tail.append), daemon=True).start()
        current: int | None = None
        deadline = time.monotonic() + timeout + STARTUP_S  # importing torch and the plugins is not the case's time
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # the case in flight hangs (or the worker never started)
                proc.kill()
                proc.wait()
                index = start if current is None else current
                results[index] = CaseResult(cases[index], "timeout", f"no result in {timeout:g} s; worker killed")
                progress(impl_id, len(results), len(cases), "timeout")
                start = index + 1
                break
            if line is None:  # the worker ended
                code = proc.wait()
                if current is not None and current not in results:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    tail = "".join(list(stderr_tail)[-5:]).strip().replace("\n", " | ")[-300:]
                    results[current] = CaseResult(cases[current], "crashed", f"the worker died ({how}): {tail}")
                    progress(impl_id, len(results), len(cases), "crashed")
                    start = current + 1
                elif current is None and code != 0:
                    tail = "".join(list(stderr_tail)[-5:]).strip()[-300:]
                    raise RuntimeError(f"validate: the worker for {impl_id} failed before any case ({code}): {tail}")
                else:
                    start = (current + 1) if current is not None else len(cases)
                break
            message = json.loads(line)
            if "start" in message:
                current = message["start"]
                deadline = time.monotonic() + timeout
                continue
            index = message["index"]
            results[index] = CaseResult(cases[index], message["status"], message["detail"], message["error"])
            progress(impl_id, len(results), len(cases), message["status"])
    return [results[c.index] for c in cases if c.index in results]


def quarantine_yaml(failures: dict[str, list[CaseResult]], device: Any, when_extra: Callable[[str], dict[str, Any]],
                    command: str) -> str:
    """The quarantine file for `failures` (implementation id -> its failed, crashed or timed-out cases)."""
    import yaml

    ops: dict[str, Any] = {}
    for impl_id, results in sorted(failures.items()):
        by_feature: dict[str, list[CaseResult]] = {}
        for r in results:
            by_feature.setdefault(r.case.feature, []).append(r)
        for feature, bad in by_feature.items():
            when: dict[str, Any] = {"vendor": device.vendor, "arch": device.arch,
                                    "device_name": "".join(f"[{c}]" if c in "[]*?" else c for c in device.name)}
            first = bad[0]
            when.update(_FEATURES[feature][2] if first.case.op == "attention" else dict(first.case.options))
            when["dtype"] = sorted({r.case.dtype for r in bad})
            libraries = when_extra(impl_id)
            if libraries:
                when["libraries"] = libraries
            rules = ops.setdefault(first.case.op, {"rules": []})["rules"]
            rules.append({"name": _rule_name(impl_id, feature), "when": when, "deny": [impl_id],
                          "reason": f"{first.status}: {first.detail} on [{first.case.describe()}]"
                                    + (f" (and {len(bad) - 1} more case(s) of this class)" if len(bad) > 1 else "")})
    header = (f"# Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} for {device.describe()}.\n"
              "# Deny rules only, each scoped to the feature class, dtypes, device and library versions it failed on.\n"
              "# Delete a rule (or the file) to try the implementation again; a pin still reaches it.\n")
    body = {"version": 1, "extends": "none", "ops": ops} if ops else {"version": 1, "extends": "none"}
    return header + yaml.safe_dump(body, sort_keys=False, width=120)


def _rule_name(impl_id: str, feature: str) -> str:
    """A policy rule name (letters, digits, ``_.:-``) for an implementation's failing feature class."""
    return "quarantine-" + "".join(c if c.isalnum() or c in "_.:-" else "-" for c in f"{impl_id}-{feature}")


def run_validation(impl_ids: Sequence[str] | None, device: str, *, timeout: float, quick: bool,
                   quarantine_path: Path | None, report_md: Path | None, report_json: Path | None,
                   stream: TextIO, jobs: int = 1) -> int:
    """The `opdispatch validate` command; returns its exit code (1 when an implementation failed a case)."""
    import tempfile

    import opdispatch

    from ._attention import dtype_name

    from ._ops import known_ops

    manager = opdispatch.get_manager()
    info = manager.device_info(device)
    everything = [i for op in known_ops() for i in manager.implementations(op)]
    available = [i for i in everything if manager.availability(i, info) is None]
    if impl_ids:
        known = {i.id for i in everything}
        unknown = [i for i in impl_ids if i not in known]
        if unknown:
            raise ValueError(f"validate: unknown implementation(s) {unknown}; registered: {', '.join(sorted(known))}")
        chosen = [i for i in available if i.id in impl_ids]
    else:  # the oracles are not validated against themselves
        chosen = [i for i in available if not getattr(i, "reference_fallback", False)]
    tty = stream.isatty()

    def progress(impl_id: str, done: int, total: int, status: str) -> None:
        width = 24
        bar = "#" * (width * done // max(total, 1))
        text = f"{impl_id:24} [{bar:<{width}}] {done}/{total} {status:<12}"
        stream.write(("\r" + text) if tty else (text + "\n") if done == total or status not in ("pass",
                                                                                                  "not declared")
                     else "")
        stream.flush()

    features = QUICK if quick else None
    lock = threading.Lock()

    def locked_progress(impl_id: str, done: int, total: int, status: str) -> None:
        with lock:
            progress(impl_id, done, total, status)

    def one(impl: Any, tmp: str) -> list[CaseResult]:
        dtypes = sorted(dtype_name(d) for d in getattr(impl, "caps").dtypes if dtype_name(d) in TOLERANCE)
        if info.type != "cpu":
            dtypes = [d for d in dtypes if d != "fp64"] or dtypes
        cases = attention_cases(dtypes, features) if impl.op == "attention" else op_cases(impl.op, dtypes)
        results = validate_impl(impl.id, device, cases, timeout,
                                locked_progress if jobs > 1 else progress, Path(tmp))
        if tty and jobs == 1:
            stream.write("\n")
        return results

    with tempfile.TemporaryDirectory() as tmp:
        # Implementations in parallel worker processes (--jobs): each still alone in its own process.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {impl.id: pool.submit(one, impl, tmp) for impl in chosen}
        all_results = {impl_id: future.result() for impl_id, future in futures.items()}
    failures = {impl_id: [r for r in results if r.status in ("fail", "crashed", "timeout")]
                for impl_id, results in all_results.items()}
    failures = {k: v for k, v in failures.items() if v}

    def libraries(impl_id: str) -> dict[str, str]:
        impl = next(i for i in everything if i.id == impl_id)
        keys = {"torch"} | {r.library_key for r in getattr(impl, "requires", ())}
        return {k: f"=={v}" for k, v in sorted(info.libraries.items()) if k in keys}

    command = "opdispatch validate" + (f" --impl {','.join(impl_ids)}" if impl_ids else "")
    if quarantine_path is not None:
        quarantine_path.parent.mkdir(parents=True, exist_ok=True)
        quarantine_path.write_text(quarantine_yaml(failures, info, libraries, command))
        stream.write(f"quarantine: {quarantine_path} ({sum(1 for v in failures.values() for _ in v)} failed case(s) "
                     f"in {len(failures)} implementation(s))\n")
    summary = {impl_id: _summary(results) for impl_id, results in all_results.items()}
    if report_json is not None:
        report_json.write_text(json.dumps({"device": info.to_dict(), "implementations": summary,
                                           "cases": {k: [dict(dataclasses.asdict(r.case), status=r.status,
                                                              detail=r.detail, error=r.error) for r in v]
                                                     for k, v in all_results.items()}}, indent=1))
    text = _markdown(info, summary, failures)
    if report_md is not None:
        report_md.write_text(text)
    stream.write(text)
    return 1 if failures else 0


def _summary(results: list[CaseResult]) -> dict[str, Any]:
    counts: dict[str, Any] = {s: 0 for s in ("pass", "fail", "crashed", "timeout", "not declared")}
    worst: dict[str, float] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
        if r.error is not None and r.status in ("pass", "fail"):
            worst[r.case.dtype] = max(worst.get(r.case.dtype, 0.0), r.error)
    counts["worst_out_error"] = {k: float(f"{v:.3g}") for k, v in sorted(worst.items())}
    counts["quarantined"] = sorted({r.case.feature for r in results if r.status in ("fail", "crashed", "timeout")})
    return counts


def _markdown(info: Any, summary: dict[str, Any], failures: dict[str, list[CaseResult]]) -> str:
    lines = [f"# opdispatch validate: {info.describe()}", "",
             "| implementation | pass | fail | crashed | timeout | not declared | worst out error | quarantined |",
             "|---|--:|--:|--:|--:|--:|---|---|"]
    for impl_id, s in summary.items():
        worst = ", ".join(f"{k} {v:.2g}" for k, v in s["worst_out_error"].items()) or "-"
        lines.append(f"| {impl_id} | {s['pass']} | {s['fail']} | {s['crashed']} | {s['timeout']} | "
                     f"{s['not declared']} | {worst} | {', '.join(s['quarantined']) or '-'} |")
    for impl_id, bad in failures.items():
        lines += ["", f"## {impl_id}", ""] + [f"- {r.status}: {r.case.describe()}: {r.detail}" for r in bad]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the worker: python -m opdispatch._validate IMPL DEVICE CASES_JSON START
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.stdout)
