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

Each implementation runs in a worker process (``python -m opdispatch.tools._validate WORKER_ARGS``) that reports each
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
import hashlib
import itertools
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..base._tolerance import RELATIVE_NORM
from ..ops._attention_case import AttentionCase
from opdispatch.policies._quarantine import (env_conditions, merge_quarantine, quarantine_text,
                                             read_existing_quarantine, rule_libraries, rule_name, write_quarantine)

__all__ = ["FACTORS", "TOLERANCE", "Case", "CaseResult", "attention_cases", "covering_rows", "merge_quarantine",
           "quarantine_rules", "quarantine_yaml", "run_case", "run_validation"]

# ‖out − ref‖ / ‖ref‖ per dtype: forward, gradients. LSE: max |Δ| over finite rows.
TOLERANCE = RELATIVE_NORM  # (forward, gradient) per dtype: the one table, `opdispatch.base._tolerance`
LSE_ATOL = 2e-2
STARTUP_S = 120.0  # a worker's start (imports, plugin loading) before its first case, beyond --timeout

# The conformance matrix of attention: factors whose values a case combines. Seeded pairwise covering arrays over
# them (`covering_rows`) make the cases, each kept only if the op accepts it and the implementation declares it;
# `EDGES` add the rows every implementation must pass. `lengths` and `dtype` are context: no `when:` key names them.
FACTORS: dict[str, tuple[str, ...]] = {
    "layout": ("bshd", "bhsd", "sbhd", "thd"),
    "causal": ("none", "top_left", "bottom_right"),
    "heads": ("mha", "gqa", "mqa"),
    "kv_cache": ("none", "dense", "paged"),
    "window": ("none", "window"),
    "term": ("none", "softcap", "alibi", "mask", "bias"),
    "lengths": ("equal", "q_shorter", "q_longer"),
    "lse": ("no", "yes"),
    "direction": ("forward", "backward"),
}
BASELINE = {"layout": "bshd", "causal": "none", "heads": "mha", "kv_cache": "none", "window": "none", "term": "none",
            "lengths": "equal", "lse": "no", "direction": "forward"}
CONTEXT = ("lengths", "dtype")
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
# (query, key) lengths per sequence: dense layouts take the first (batch 2); thd packs all three.
LENGTHS = {"equal": ((40, 40), (9, 9), (31, 31)), "q_shorter": ((19, 45), (5, 20), (12, 12)),
           "q_longer": ((45, 19), (20, 5), (12, 12))}
SEEDS_FULL = (0, 1, 2)  # the full matrix: three covering arrays (dtype a factor) — more combinations beyond pairs
SEED_QUICK = 0
# Edge rows: name -> (factor values over BASELINE, extra options, the `when:` a failure is quarantined with).
EDGES: dict[str, tuple[dict[str, str], dict[str, Any], dict[str, Any]]] = {
    "keyless_causal": ({"causal": "bottom_right", "lse": "yes"}, {"sq": 24, "sk": 9}, {"keyless_rows": True}),
    "keyless_causal_backward": ({"causal": "bottom_right", "direction": "backward"}, {"sq": 24, "sk": 9},
                                {"keyless_rows": True, "requires_grad": True}),
    "keyless_window": ({"window": "window", "lse": "yes"}, {"sq": 30, "sk": 9, "window_size": (2, 0)},
                       {"keyless_rows": True}),
    "keyless_mask": ({"term": "mask", "lse": "yes"}, {"blind_mask": True}, {"mask": True}),
    "seqlen_q_below_k": ({}, {"sq": 7, "sk": 61}, {}),
    "seqlen_q_above_k": ({}, {"sq": 61, "sk": 7}, {}),
    "decode": ({"causal": "bottom_right"}, {"sq": 1, "sk": 77}, {"seqlen_q": 1}),
    "head_dim_min": ({}, {"d": "min"}, {}),
    "head_dim_max": ({}, {"d": "max"}, {}),
    "strided": ({}, {"strided": True}, {}),
    "backward_twice": ({"causal": "top_left", "direction": "backward"}, {"twice": True}, {"requires_grad": True}),
    "lse_gradient": ({"causal": "top_left", "direction": "backward", "lse": "yes"}, {"lse_grad": True},
                     {"return_lse": True, "requires_grad": True}),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One cell of the matrix, as plain data (it travels to the worker as JSON): an attention call (`attention`,
    the op's one case record) or another op's tuning case (`data`, `TuningSpec.case.to_dict()`). An attention
    cell's `options` hold its factor values (`FACTORS`) and an edge row's extras — what only a conformance check
    varies (KV caches, masks, per-sequence lengths...); `feature` is ``pairwise``, an edge's name or ``isolate`` (a
    follow-up that tells which factors of a failing case fail together)."""

    index: int
    feature: str
    attention: AttentionCase | None = None
    options: tuple[tuple[str, Any], ...] = ()
    op: str = "attention"
    data: tuple[tuple[str, Any], ...] = ()

    @property
    def dtype(self) -> str:
        return self.call().dtype if self.op == "attention" else str(dict(self.data)["dtype"])

    def call(self) -> AttentionCase:
        """The attention call of an attention cell."""
        if self.attention is None:
            raise ValueError(f"validate: case {self.index} ({self.op} {self.feature}) is not an attention call")
        return self.attention

    def describe(self) -> str:
        if self.op != "attention":
            return f"{self.op} {self.feature}"
        a = self.call()
        opts = dict(self.options)
        shown = " ".join(f"{k}={v}" for k, v in opts.items() if BASELINE.get(k) != v and k != "page_size")
        return (f"{self.feature} {a.dtype} b={a.batch} sq={a.seqlen_q} sk={a.seqlen_k} heads={a.heads_q}/"
                f"{a.heads_kv} d={a.head_dim}" + (f" {shown}" if shown else ""))

    def to_json(self) -> dict[str, Any]:
        """The report's and the worker's flat form (the shape under validate's short names; null for other ops)."""
        a = self.attention
        return {"index": self.index, "feature": self.feature, "dtype": self.dtype,
                **{short: None if a is None else getattr(a, name) for short, name in _SHORT_NAMES.items()},
                "options": [list(item) for item in self.options], "op": self.op,
                "data": [list(item) for item in self.data]}

    def to_worker(self) -> dict[str, Any]:
        """`to_json` and the attention call whole: what the worker rebuilds the cell from (`from_worker`)."""
        return {**self.to_json(), "attention": None if self.attention is None else self.attention.to_dict()}

    @classmethod
    def from_worker(cls, c: dict[str, Any]) -> Case:
        return cls(c["index"], c["feature"],
                   None if c["attention"] is None else AttentionCase.from_dict(c["attention"]),
                   tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in c["options"]), c["op"],
                   tuple((k, v) for k, v in c["data"]))

    def factors(self) -> dict[str, Any]:
        """Its factor values as the op sees the call: bottom-right alignment over equal lengths is top-left."""
        opts = dict(self.options)
        factors = {**{k: opts.get(k, v) for k, v in BASELINE.items()}, "dtype": self.dtype}
        if factors["causal"] == "bottom_right" and factors["lengths"] == "equal" and factors["kv_cache"] == "none" \
                and "sq" not in opts and self.feature in ("pairwise", "isolate"):
            factors["causal"] = "top_left"
        return factors


# The report's names of an attention cell's sizes (kept from before the cell held an `AttentionCase`).
_SHORT_NAMES = {"b": "batch", "sq": "seqlen_q", "sk": "seqlen_k", "hq": "heads_q", "hkv": "heads_kv", "d": "head_dim"}


@dataclasses.dataclass
class CaseResult:
    case: Case
    status: str  # pass | fail | crashed | timeout | not declared
    detail: str = ""
    error: float | None = None


def make_case(index: int, feature: str, factors: dict[str, Any], extra: dict[str, Any] | None = None,
              caps: Any = None) -> Case:
    """A case from its factor values (and an edge's extras): the sizes they imply."""
    extra = dict(extra or {})
    hq, hkv = HEADS[factors["heads"]]
    (sq, sk), *_ = LENGTHS[factors["lengths"]]
    sq, sk = extra.pop("sq", sq), extra.pop("sk", sk)
    d: Any = extra.pop("d", 64)
    head_max = getattr(caps, "head_dim_max", None)
    multiple = getattr(caps, "head_dim_multiple", 1)
    if d == "min":
        d = max(getattr(caps, "head_dim_min", 1), multiple)
    elif d == "max":
        d = head_max if head_max is not None else 256
        d -= d % multiple
    elif head_max is not None and d > head_max:
        d = head_max - head_max % multiple
    elif d < getattr(caps, "head_dim_min", 1):  # an implementation of large head dims only: its smallest one
        d = getattr(caps, "head_dim_min", 1)
        d += -d % multiple
    options = {k: v for k, v in factors.items() if k != "dtype"}
    if factors["kv_cache"] == "paged":
        options["page_size"] = max(16, getattr(caps, "page_size_multiple", 1))
    options.update(extra)
    causal = factors["causal"]
    window = None
    if factors["window"] != "none":
        window = tuple(options.get("window_size", (16, 0) if causal != "none" else (16, 8)))
    call = AttentionCase(dtype=factors["dtype"], layout=factors["layout"], batch=3 if factors["layout"] == "thd" else 2,
                         seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d, causal=causal != "none",
                         causal_alignment=None if causal == "none" else causal, window=window,
                         softcap=20.0 if factors["term"] == "softcap" else 0.0,
                         requires_grad=factors["direction"] == "backward")
    return Case(index, feature, call, options=tuple(sorted(options.items())))


def covering_rows(factors: Mapping[str, Sequence[Any]], allowed: Callable[[dict[str, Any]], bool], seed: int,
                  tries: int = 40) -> list[dict[str, Any]]:
    """Rows (factor -> value) that cover every pair of values of two factors that some allowed row can hold.

    Greedy and seeded (AETG): for an uncovered pair, `tries` rows are built around it, each factor taking the value
    that covers most new pairs (ties and later tries random), and the allowed row covering most is kept; a pair no
    try fits into an allowed row is dropped as one the op or the implementation refuses. Hand-written rather than a
    covering-array library because `allowed` judges whole rows only (the op's own validation and the
    implementation's declared capabilities), and the result must depend on the seed alone.
    """
    import itertools
    import random

    rng = random.Random(seed)
    names = list(factors)

    def pairs(row: dict[str, Any]) -> set[tuple[Any, ...]]:
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in factors[a]
                 for vb in factors[b]}
    rows: list[dict[str, Any]] = []
    while uncovered:
        target = rng.choice(sorted(uncovered, key=repr))
        best: dict[str, Any] | None = None
        best_new: set[tuple[Any, ...]] = set()
        for attempt in range(tries):
            row = {target[0]: target[1], target[2]: target[3]}
            order = [n for n in names if n not in row]
            rng.shuffle(order)
            for name in order:
                values = list(factors[name])
                rng.shuffle(values)
                if attempt < tries // 2:
                    row[name] = max(values, key=lambda v: sum(
                        (a, row[a], name, v) in uncovered or (name, v, a, row[a]) in uncovered for a in row))
                else:  # greedy rows keep landing on refused combinations: explore
                    row[name] = values[0]
            new = pairs(row) & uncovered
            if len(new) > len(best_new) and allowed(row):
                best, best_new = row, new
        if best is None:
            uncovered.discard(target)
            continue
        rows.append(best)
        uncovered -= best_new
    return rows


def attention_cases(impl: Any, device: str, dtypes: Sequence[str], quick: bool,
                    device_info: Any = None) -> list[Case]:
    """`impl`'s attention matrix: seeded pairwise covering arrays over `FACTORS` (and the dtypes) restricted to
    calls the op accepts and `impl` declares, then the edge rows it declares. `--quick`: one covering array with
    the dtypes taking turns; the full matrix: dtype a factor, `SEEDS_FULL` arrays."""
    if not dtypes:  # none of its dtypes has a tolerance here: nothing to run (run_validation says so)
        return []
    caps = getattr(impl, "caps", None)
    checker = _Declared(impl, device, device_info)
    cases: list[Case] = []
    seen: set[Case] = set()

    def add(feature: str, factors: dict[str, Any], extra: dict[str, Any] | None = None) -> bool:
        case = make_case(len(cases), feature, factors, extra, caps)
        key = dataclasses.replace(case, index=0)
        if key in seen or not checker(case):
            return False
        seen.add(key)
        cases.append(case)
        return True

    # Values the implementation never takes (alone, over any lengths) leave the factors: the arrays cover pairs of
    # what it declares, and the greedy search does not spend its tries on refused rows.
    factors = {name: tuple(v for v in values if any(
        checker(make_case(0, "pairwise", {**BASELINE, name: v, "lengths": lengths, "dtype": dtypes[0]}, caps=caps))
        for lengths in LENGTHS)) for name, values in FACTORS.items()}
    factors = {name: values for name, values in factors.items() if values}
    if len(factors) < len(FACTORS):
        return []  # not even the baseline call is declared
    if quick:
        rows = covering_rows(factors, lambda r: checker(make_case(0, "pairwise", {**r, "dtype": dtypes[0]},
                                                                  caps=caps)), SEED_QUICK)
        for i, row in enumerate(rows):
            add("pairwise", {**row, "dtype": dtypes[i % len(dtypes)]}) or add("pairwise", {**row, "dtype": dtypes[0]})
    else:
        for seed in SEEDS_FULL:
            for row in covering_rows({**factors, "dtype": tuple(dtypes)},
                                     lambda r: checker(make_case(0, "pairwise", r, caps=caps)), seed):
                add("pairwise", row)
    for name, (edge, extra, _) in EDGES.items():
        for dtype in (dtypes[:1] if quick else dtypes):
            row = {**BASELINE, **edge, "dtype": dtype}
            # The LSE where declared: else the same row without it.
            add(name, row, extra) or (row["lse"] == "yes" and "lse_grad" not in extra
                                       and add(name, {**row, "lse": "no"}, extra))
    return cases


class _Declared:
    """Whether the op accepts a case and the implementation declares it (built on the device, never filled)."""

    def __init__(self, impl: Any, device: str, device_info: Any) -> None:
        self.impl, self.device, self.info = impl, device, device_info
        self.seen: dict[Case, bool] = {}

    def __call__(self, case: Case) -> bool:
        key = dataclasses.replace(case, index=0)
        if key not in self.seen:
            self.seen[key] = self._judge(case)
        return self.seen[key]

    def _judge(self, case: Case) -> bool:
        import opdispatch

        try:
            (q, k, v), kwargs = _tensors(case, self.device, fill=False)
            call = opdispatch.validate_attention(q, k, v, **kwargs)
        except (TypeError, ValueError):
            return False
        if case.feature != "decode" and call.rewrites:
            return False  # e.g. bottom-right over equal lengths is top-left: a row that means what it says
        if _builds_keyless_rows(case, call):
            return False  # only the keyless edge rows have rows without keys: a failure says which
        info = self.info if self.info is not None else opdispatch.get_manager().device_info(call.device)
        return not self.impl.not_supported_reasons(call, info)


def _builds_keyless_rows(case: Case, call: Any) -> bool:
    if case.feature.startswith("keyless"):
        return False
    if call.seqused_k is None and not call.varlen:
        return bool(call.keyless_rows)
    # Per-sequence lengths are ours: a query longer than its keys under a bottom-right diagonal or a window.
    longer = dict(case.options).get("lengths") == "q_longer"
    return longer and (call.causal_alignment == "bottom_right" or call.window is not None)


def op_cases(op: str, dtypes: Sequence[str]) -> list[Case]:
    """Another op's matrix: its tuning presets' cases (the CPU sizes: correctness, not speed) with each boolean
    field also flipped (weight, residual, interleaved, backward…), one case per combination, in each dtype."""
    import itertools

    from ..base._ops import op_spec

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
                                  op=op, data=tuple(sorted(data.items())), options=tuple(sorted(when.items()))))
    return cases


def _op_when(op: str, call: Any) -> dict[str, Any]:
    """A non-attention case's quarantine conditions: the call's boolean features that hold."""
    from ..base._ops import op_spec

    features = op_spec(op).call_features(call)
    return {k: True for k, v in sorted(features.items()) if v is True}


def run_op_case(impl_id: str, case: Case, device: str) -> CaseResult:
    """A case of an op other than attention: through its front door, pinned, against its reference in float64."""
    import torch

    import opdispatch

    from ..base._ops import op_spec

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

def _tensors(case: Case, device: str, fill: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """q, k, v and the keyword arguments of `case` (random, seeded by its index; `fill=False`: shapes only): the
    attention call's sizes and flags, and the matrix's options (KV cache, term, per-sequence lengths, extras)."""
    import torch

    from ..base._dtypes import dtype_from_name

    call = case.call()
    opts = dict(case.options)
    dtype = dtype_from_name(call.dtype)
    gen = torch.Generator().manual_seed(1000 + case.index)

    def rand(*shape: int) -> Any:
        if not fill:
            return torch.empty(*shape, dtype=dtype, device=device)
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    def index(values: list[int]) -> Any:
        return torch.tensor(values, dtype=torch.int32, device=device)

    kwargs: dict[str, Any] = {}
    if call.causal:
        kwargs.update(causal=True, causal_alignment=call.alignment())
    if call.window is not None:
        kwargs["window"] = call.window
    if opts.get("lse") == "yes":
        kwargs["return_lse"] = True
    term = opts.get("term", "none")
    if call.softcap:
        kwargs["softcap"] = call.softcap
    layout, cache = call.layout, opts.get("kv_cache", "none")
    b, sq, sk, hq, hkv, d = call.batch, call.seqlen_q, call.seqlen_k, call.heads_q, call.heads_kv, call.head_dim
    if layout == "thd":
        lengths = [(sq, sk), *LENGTHS[opts.get("lengths", "equal")][1:]][:b]
    else:
        lengths = [(sq, sk)] * b
    fills = [k - 3 * (i % 2) if cache != "none" and k > 3 + q else k for i, (q, k) in enumerate(lengths)]
    capacity = max(fills) + 8  # a cache holds more than it uses
    q_lens = [q for q, _ in lengths]
    if layout == "thd":
        q = rand(sum(q_lens), hq, d)
        cu_q = index([0, *itertools.accumulate(q_lens)])
        kwargs.update(layout="thd", cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens))
    else:
        q = _in_layout(rand(b, max(q_lens), hq, d), layout, fill)
        if layout != "bshd":
            kwargs["layout"] = layout
    if cache == "paged":
        size = int(opts["page_size"])
        per_seq = -(-capacity // size)
        pages = b * per_seq + 1
        k, v = rand(pages, size, hkv, d), rand(pages, size, hkv, d)
        order = torch.randperm(pages, generator=gen)[: b * per_seq] if fill else torch.arange(b * per_seq)
        kwargs.update(block_table=order.view(b, per_seq).to(torch.int32).to(device), seqused_k=index(fills))
    elif layout == "thd":
        spans = [capacity if cache == "dense" else k for k in fills]
        k, v = rand(sum(spans), hkv, d), rand(sum(spans), hkv, d)
        cu_k = index([0, *itertools.accumulate(spans)])
        kwargs.update(cu_seqlens_k=cu_q if spans == q_lens else cu_k, max_seqlen_k=max(spans))
        if cache == "dense":
            kwargs["seqused_k"] = index(fills)
    else:
        keys = capacity if cache == "dense" else sk
        k, v = (_in_layout(rand(b, keys, hkv, d), layout, fill) for _ in range(2))
        if cache == "dense":
            kwargs["seqused_k"] = index(fills)
    if opts.get("strided"):  # head dim not innermost, k sliced
        q = rand(b, d, sq, hq).permute(0, 2, 3, 1)
        k = rand(b, sk, hkv, 2 * d)[..., ::2]
        v = rand(b, hkv, sk, d).transpose(1, 2)
    if term == "alibi":
        kwargs["alibi_slopes"] = (torch.rand(hq, generator=gen) * 0.5).to(device)
    if term in ("mask", "bias") and layout != "thd" and cache == "none":
        if term == "mask":
            mask = torch.rand(b, hq, sq, sk, generator=gen) > 0.3
            # Each row keeps the key on its diagonal (inside any causal or window pattern) — but the blind-mask
            # edge, whose first row sees nothing.
            offset = sk - sq if call.causal and call.alignment() == "bottom_right" else 0
            rows = torch.arange(sq)
            mask[..., rows, (rows + offset).clamp(0, sk - 1)] = True
            if opts.get("blind_mask"):
                mask[..., 0, :] = False
            kwargs["attn_mask"] = mask.to(device)
        else:
            kwargs["attn_bias"] = torch.randn(b, hq, sq, sk, generator=gen).to(dtype).to(device)
    elif term in ("mask", "bias"):  # the op refuses them here: let it say so
        kwargs["attn_mask" if term == "mask" else "attn_bias"] = torch.ones(1, dtype=torch.bool, device=device)
    if call.requires_grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return (q, k, v), kwargs


def _in_layout(bshd: Any, layout: str, copy: bool = True) -> Any:
    """A (batch, seq, heads, dim) tensor as a contiguous tensor of `layout` (`copy=False`: a view, for shapes)."""
    if layout == "bshd":
        return bshd
    from ..ops._attention import bshd_views

    view = bshd_views(layout)[1](bshd)
    return view.contiguous() if copy else view


def _undeclared(manager: Any, case: Case, impl_id: str, call: Any) -> CaseResult | None:
    """The case's result when `impl_id` does not declare it (not registered, or a reason it cannot take it)."""
    impl = manager.implementation(case.op, impl_id)
    if impl is None:
        return CaseResult(case, "not declared", f"{impl_id} is not registered")
    reasons = impl.not_supported_reasons(call, manager.device_info(call.device))
    return CaseResult(case, "not declared", "; ".join(reasons)) if reasons else None


def _rel(a: Any, b: Any) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(impl_id: str, case: Case, device: str) -> CaseResult:
    """One case, in this process: the implementation through the op (pinned), then the float64 reference."""
    import torch

    import opdispatch

    (q, k, v), kwargs = _tensors(case, device)
    opts = dict(case.options)
    call = opdispatch.validate_attention(q, k, v, **kwargs)
    manager = opdispatch.get_manager()
    undeclared = _undeclared(manager, case, impl_id, call)
    if undeclared is not None:
        return undeclared
    weights: list[Any] = []

    def loss(out: Any, lse: Any) -> Any:
        if not weights:
            gen = torch.Generator().manual_seed(case.index)
            weights.extend(torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (out, lse)
                           if t is not None)
        total = (out * weights[0].to(out)).sum()
        return total + (lse * weights[1].to(lse)).sum() if opts.get("lse_grad") else total

    grads = again = None
    try:
        result = opdispatch.attention(q, k, v, impl=impl_id, **kwargs)
        out, lse = result if kwargs.get("return_lse") else (result, None)
        if q.requires_grad:
            objective = loss(out, lse)
            grads = torch.autograd.grad(objective, (q, k, v), retain_graph=bool(opts.get("twice")))
            if opts.get("twice"):  # a second backward through the same graph
                again = torch.autograd.grad(objective, (q, k, v))
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        return CaseResult(case, "fail", f"raised {type(exc).__name__}: {str(exc)[:300]}")
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    ref_kwargs = {key: (val.double() if key == "attn_bias" else val) for key, val in kwargs.items()}
    ref = opdispatch.attention(*ref_inputs, impl="reference.math", **ref_kwargs)
    ref_out, ref_lse = ref if kwargs.get("return_lse") else (ref, None)
    fwd_tol, grad_tol = TOLERANCE[case.dtype]
    err = _rel(out, ref_out)
    problems = [f"out error {err:.3g} > {fwd_tol:g}"] if not err <= fwd_tol else []
    if bool(torch.isnan(out).any()):
        problems.append(f"NaN in {int(torch.isnan(out).sum())} output value(s)")
    if lse is not None and ref_lse is not None:
        finite = torch.isfinite(ref_lse)
        lse_err = float((lse.double()[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
        if not lse_err <= LSE_ATOL or bool((lse[~finite] != -math.inf).any()):
            problems.append(f"lse error {lse_err:.3g} (or a row that sees no key not -inf)")
    if grads is not None:
        ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), ref_inputs)
        for name, g, rg in zip("qkv", grads, ref_grads):
            g_err = _rel(g, rg)
            if not g_err <= grad_tol:
                problems.append(f"d{name} error {g_err:.3g} > {grad_tol:g}")
        for name, g, g2 in zip("qkv", grads, again or ()):
            if not _rel(g2, g) <= grad_tol / 10:
                problems.append(f"second backward (retain_graph=True): d{name} differs from the first by "
                                f"{_rel(g2, g):.3g}")
    return CaseResult(case, "fail" if problems else "pass", "; ".join(problems), err)


def _worker(impl_id: str, device: str, cases_path: str, start: int, out: TextIO) -> None:
    os.environ["OPDISPATCH_CHECK_OUTPUTS"] = "1"  # structure, NaN and untouched inputs, every call
    cases = [Case.from_worker(c) for c in json.loads(Path(cases_path).read_text())]
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

NOT_RUN = "not run"  # the run's --budget ran out first: neither a pass nor a failure


def validate_impl(impl_id: str, device: str, cases: list[Case], timeout: float,
                  progress: Callable[[str, int, int, str], None], workdir: Path,
                  run_as: str | None = None, stop_at: float | None = None) -> list[CaseResult]:
    """Run `cases` for `impl_id` (progress shown under that name; `run_as`: the implementation they pin) in worker
    processes, restarting after a crash, a hang or a dead context. At `stop_at` (time.monotonic()) the worker is
    stopped and the case in flight and those left are `NOT_RUN`."""
    cases_path = workdir / f"cases-{impl_id}.json"
    cases_path.write_text(json.dumps([c.to_worker() for c in cases]))
    results: dict[int, CaseResult] = {}  # by position in `cases` (a share of a split run: not case.index)
    position = {c.index: i for i, c in enumerate(cases)}
    start = 0

    def out_of_budget(first: int) -> list[CaseResult]:
        for i in range(first, len(cases)):
            if i not in results:
                results[i] = CaseResult(cases[i], NOT_RUN, "the run's --budget ran out before it")
                progress(impl_id, len(results), len(cases), NOT_RUN)
        return [results[i] for i in range(len(cases)) if i in results]

    while start < len(cases):
        if stop_at is not None and time.monotonic() >= stop_at:
            return out_of_budget(start)
        proc = subprocess.Popen([sys.executable, "-m", "opdispatch.tools._validate", run_as or impl_id, device,
                                 str(cases_path),
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
            limit = deadline if stop_at is None else min(deadline, stop_at)
            try:
                line = lines.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:  # the case in flight hangs (or the worker never started), or the budget ran out
                proc.kill()
                proc.wait()
                if stop_at is not None and time.monotonic() >= stop_at and time.monotonic() < deadline:
                    return out_of_budget(start if current is None else current)
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
                current = position[message["start"]]
                deadline = time.monotonic() + timeout
                continue
            index = position[message["index"]]
            results[index] = CaseResult(cases[index], message["status"], message["detail"], message["error"])
            progress(impl_id, len(results), len(cases), message["status"])
    return [results[i] for i in range(len(cases)) if i in results]


def validate_split(label: str, device: str, cases: list[Case], timeout: float,
                   progress: Callable[[str, int, int, str], None], workdir: Path, run_as: str,
                   stop_at: float | None, split: int) -> list[CaseResult]:
    """`validate_impl` over `split` shares of `cases` at once (every split-th case each, so the slow first
    calls of each kind spread over the workers); progress is counted as one run of `label`."""
    shares = [cases[k::split] for k in range(min(split, len(cases)))]
    if len(shares) <= 1:
        return validate_impl(label, device, cases, timeout, progress, workdir, run_as=run_as, stop_at=stop_at)
    lock = threading.Lock()
    done = [0]

    def counted(_share: str, _done: int, _total: int, status: str) -> None:
        with lock:
            done[0] += 1
            progress(label, done[0], len(cases), status)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        futures = [pool.submit(validate_impl, f"{label}.{k}", device, share, timeout, counted, workdir,
                               run_as, stop_at) for k, share in enumerate(shares)]
        by_index = {r.case.index: r for f in futures for r in f.result()}
    return [by_index[c.index] for c in cases if c.index in by_index]


# -- from failures to quarantine rules ----------------------------------------------------------------------------

POLICY_FACTORS = tuple(f for f in FACTORS if f not in CONTEXT)
FAILED = ("fail", "crashed", "timeout")


def factor_when(name: str, value: str) -> dict[str, Any]:
    """The `when:` conditions that select exactly the calls of one factor value."""
    if name == "layout":
        return {"layout": value}
    if name == "causal":
        return {"causal": False} if value == "none" else {"causal": True, "causal_alignment": value}
    if name == "heads":
        return {"gqa_ratio": 1} if value == "mha" else {"gqa_ratio": ">1", "heads_kv": 1 if value == "mqa" else ">1"}
    if name == "kv_cache":
        return {"kv_cache": False} if value == "none" else {"kv_cache": True, "paged": value == "paged"}
    if name == "window":
        return {"window": value != "none"}
    if name == "term":
        terms = ("softcap", "alibi", "mask", "bias")
        return {t: False for t in terms} if value == "none" else {value: True}
    if name == "lse":
        return {"return_lse": value == "yes"}
    if name == "direction":
        return {"requires_grad": value == "backward"}
    return {}


def _items(case: Case) -> frozenset[tuple[str, str]]:
    factors = case.factors()
    return frozenset((n, factors[n]) for n in POLICY_FACTORS)


def _clearing(results: Sequence[CaseResult]) -> list[Case]:
    """The passing cases that clear factor values: the matrix's and the isolations' (an edge row's sizes change
    what its values mean: a decode row's bottom-right alignment hides no key)."""
    return [r.case for r in results if r.status == "pass" and r.case.feature in ("pairwise", "isolate")]


def suspects(failed: Case, passed: Sequence[Case]) -> list[frozenset[tuple[str, str]]]:
    """The smallest sets of `failed`'s factor values no passing case holds: single values if any, else pairs."""
    passing = [_items(c) for c in passed]
    items = sorted(_items(failed))
    singles = [frozenset({i}) for i in items if not any(i in p for p in passing)]
    if singles:
        return singles
    return [frozenset(pair) for pair in itertools.combinations(items, 2)
            if not any(set(pair) <= p for p in passing)]


def isolation_case(index: int, failed: Case, suspect: frozenset[tuple[str, str]], caps: Any = None) -> Case:
    """`failed` with every factor outside `suspect` back at its baseline (its lengths and dtype kept): does the
    suspect combination fail on its own?"""
    factors = {**BASELINE, **dict(suspect), "lengths": failed.factors()["lengths"], "dtype": failed.dtype}
    case = make_case(index, "isolate", factors, caps=caps)
    return dataclasses.replace(case, attention=dataclasses.replace(case.call(), batch=failed.call().batch))


def rule_conditions(failed: Case, results: Sequence[CaseResult],
                    isolations: dict[tuple[int, frozenset[tuple[str, str]]], str]) -> list[dict[str, Any]]:
    """The `when:` conditions (call features; dtype and device added later) that quarantine exactly what made
    `failed` fail: an edge row's own; else the suspect combinations its isolation confirmed (or could not clear);
    else — every pair of its values passed somewhere, so the failure needs more — all its factor values."""
    if failed.op != "attention":
        return [dict(failed.options)]
    if failed.feature in EDGES:
        edge = dict(EDGES[failed.feature][2])
        if failed.feature.startswith("head_dim"):
            edge["head_dim"] = failed.call().head_dim
        return [edge]
    passed = _clearing(results)
    confirmed = [s for s in suspects(failed, passed) if isolations.get((failed.index, s), "fail") != "pass"]
    confirmed = [s for s in confirmed if not any(o < s for o in confirmed)]
    sets = confirmed or [_items(failed)]
    out = []
    for suspect in sets:
        when: dict[str, Any] = {}
        for name, value in sorted(suspect):
            when.update(factor_when(name, value))
        out.append(when)
    return out


def quarantine_rules(impl_id: str, results: Sequence[CaseResult], env_when: dict[str, Any],
                     isolations: dict[tuple[int, frozenset[tuple[str, str]]], str]) -> dict[str, list[dict[str, Any]]]:
    """`impl_id`'s deny rules per op: one per distinct failing combination, its dtypes merged, then rules that
    differ in one name-valued condition (layout, causal_alignment) merged into one with the list."""
    groups: dict[tuple[str, str], tuple[dict[str, Any], list[CaseResult]]] = {}
    for r in results:
        if r.status not in FAILED or r.case.feature == "isolate":
            continue
        for when in rule_conditions(r.case, results, isolations):
            key = (r.case.op, json.dumps(when, sort_keys=True))
            groups.setdefault(key, (when, []))[1].append(r)
    merged: list[tuple[str, dict[str, Any], list[CaseResult]]] = [(op, w, bad) for (op, _), (w, bad) in
                                                                   groups.items()]
    changed = True
    while changed:
        changed = False
        for i, j in itertools.combinations(range(len(merged)), 2):
            (op_a, a, bad_a), (op_b, b, bad_b) = merged[i], merged[j]
            differ = [k for k in set(a) | set(b) if a.get(k) != b.get(k)]
            if (op_a == op_b and set(a) == set(b) and len(differ) == 1 and differ[0] in ("layout", "causal_alignment")
                    and {r.case.dtype for r in bad_a} == {r.case.dtype for r in bad_b}):
                name = differ[0]
                values = sorted({*_as_list(a[name]), *_as_list(b[name])})
                merged[i] = (op_a, {**a, name: values}, bad_a + bad_b)
                del merged[j]
                changed = True
                break
    rules: dict[str, list[dict[str, Any]]] = {}
    for op, when, bad in merged:
        full = {**env_when, **when, "dtype": sorted({r.case.dtype for r in bad})}
        first = bad[0]
        label = ",".join(f"{k}={v}" for k, v in sorted(when.items())) or "every-call"
        digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:6]
        rules.setdefault(op, []).append({
            "name": rule_name(impl_id, f"{label}-{digest}"), "when": full, "deny": [impl_id],
            "reason": f"{first.status}: {first.detail} on [{first.case.describe()}]"
                      + (f" (and {len(bad) - 1} more case(s))" if len(bad) > 1 else "")})
    return rules


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def quarantine_yaml(failures: dict[str, list[CaseResult]], device: Any, when_extra: Callable[[str], dict[str, Any]],
                    command: str) -> str:
    """A fresh quarantine file for `failures` (implementation id -> its cases; the failed ones become rules)."""
    new = {impl_id: quarantine_rules(impl_id, results, env_conditions(device, when_extra(impl_id)), {})
           for impl_id, results in sorted(failures.items())}
    return quarantine_text(merge_quarantine(None, new, {}), device, command)


Runner = Callable[[list[Case], str], list[CaseResult]]


def validate_one(impl: Any, device: str, info: Any, dtypes: list[str], quick: bool, runner: Runner
                 ) -> tuple[list[CaseResult], dict[tuple[int, frozenset[tuple[str, str]]], str]]:
    """`impl`'s matrix through `runner` (worker processes, or `in_process`), then — when a pairwise case failed —
    a second round that runs each failing case's suspect combinations alone. Returns every result and what each
    (failing case, suspect) isolation gave."""
    if impl.op != "attention":
        return runner(op_cases(impl.op, dtypes), impl.id), {}
    results = runner(attention_cases(impl, device, dtypes, quick, info), impl.id)
    if not any(r.status in FAILED for r in results):
        return results, {}
    passed = _clearing(results)
    checker = _Declared(impl, device, info)
    plan: list[tuple[int, frozenset[tuple[str, str]], Case]] = []
    seen: dict[Case, Case] = {}
    for r in results:
        if r.status not in FAILED or r.case.feature != "pairwise":
            continue
        for suspect in suspects(r.case, passed):
            case = isolation_case(len(seen), r.case, suspect, getattr(impl, "caps", None))
            key = dataclasses.replace(case, index=0)
            if key not in seen and checker(case):
                seen[key] = case
            if key in seen:
                plan.append((r.case.index, suspect, seen[key]))
    if not seen:
        return results, {}
    extra = runner(list(seen.values()), impl.id + ".isolate")
    by_index = {r.case.index: r.status for r in extra}
    return results + extra, {(i, s): by_index.get(c.index, "fail") for i, s, c in plan}


def in_process(impl_id: str, device: str) -> Runner:
    """A runner of cases in this process (tests; no crash isolation)."""
    def run(cases: list[Case], label: str) -> list[CaseResult]:
        return [run_case(impl_id, c, device) if c.op == "attention" else run_op_case(impl_id, c, device)
                for c in cases]
    return run


def run_validation(impl_ids: Sequence[str] | None, device: str, *, timeout: float, quick: bool,
                   quarantine_path: Path | None, report_md: Path | None, report_json: Path | None,
                   stream: TextIO, jobs: int = 1, replace: bool = False, budget: float | None = None,
                   split: int = 1) -> int:
    """The `opdispatch validate` command; returns its exit code (1 when an implementation failed a case, 2 when
    nothing could be validated).

    `split`: worker processes per implementation, each running a share of its cases (kernels that compile per
    new shape — Triton, torch.flex — spend most of a cold run compiling, one CPU core per worker).

    `budget`: seconds for the whole run. When they run out, the cases not yet run are reported as `NOT_RUN` and the
    reports are written with what ran: an implementation not validated to the end gets its new failures'
    rules added to the quarantine, and keeps its earlier rules (its unrun cases are no evidence either way)."""
    stop_at = None if budget is None else time.monotonic() + budget
    import tempfile

    import opdispatch

    from ..base._dtypes import dtype_name
    from ..base._ops import known_ops

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
        missing = [i for i in impl_ids if i not in {c.id for c in chosen}]
        for impl_id in missing:
            impl = next(i for i in everything if i.id == impl_id)
            stream.write(f"validate: {impl_id} is not available on {device}: {manager.availability(impl, info)}\n")
    else:  # the oracles are not validated against themselves
        chosen = [i for i in available if not getattr(i, "reference_fallback", False)]
    if not chosen:
        stream.write(f"validate: nothing to validate on {device} ({info.describe()}): no implementation named is "
                     "available here; nothing was written\n")
        return 2
    existing = None
    if quarantine_path is not None and not replace:
        existing = read_existing_quarantine(quarantine_path)  # before any case runs: a bad file stops us early
    tty = stream.isatty()
    lock = threading.Lock()
    counts: dict[str, collections.Counter[str]] = {}

    def progress(impl_id: str, done: int, total: int, status: str) -> None:
        with lock:
            tally = counts.setdefault(impl_id, collections.Counter())
            tally["error" if status in ("crashed", "timeout") else status] += 1
            width = 24
            bar = "#" * (width * done // max(total, 1))
            text = (f"{impl_id:24} [{bar:<{width}}] {done}/{total} pass {tally['pass']} fail {tally['fail']} "
                    f"error {tally['error']} not declared {tally['not declared']}"
                    + (f" not run {tally[NOT_RUN]}" if tally[NOT_RUN] else ""))
            stream.write(("\r" + text) if tty and jobs == 1 else (text + "\n") if done == total
                         or status not in ("pass", "not declared", NOT_RUN) else "")
            stream.flush()

    def dtypes_of(impl: Any) -> list[str]:
        dtypes = sorted(dtype_name(d) for d in getattr(impl, "caps").dtypes if dtype_name(d) in TOLERANCE)
        if info.type != "cpu":
            dtypes = [d for d in dtypes if d != "fp64"] or dtypes
        return dtypes

    isolations: dict[str, dict[tuple[int, frozenset[tuple[str, str]]], str]] = {}

    def one(impl: Any, tmp: str) -> list[CaseResult]:
        def runner(cases: list[Case], label: str) -> list[CaseResult]:
            results = validate_split(label, device, cases, timeout, progress, Path(tmp), impl.id, stop_at, split)
            if tty and jobs == 1:
                stream.write("\n")
            return results

        results, isolations[impl.id] = validate_one(impl, device, info, dtypes_of(impl), quick, runner)
        return results

    with tempfile.TemporaryDirectory() as tmp:
        # Implementations in parallel worker processes (--jobs): each still alone in its own process.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {impl.id: pool.submit(one, impl, tmp) for impl in chosen}
        all_results = {impl_id: future.result() for impl_id, future in futures.items()}
    empty = sorted(impl_id for impl_id, results in all_results.items()
                   if not any(r.status != "not declared" for r in results))
    if empty:
        stream.write(f"validate: {', '.join(empty)} declared none of the matrix's cases on {device} (dtypes with a "
                     f"tolerance here: {', '.join(TOLERANCE)}): nothing of {'them' if len(empty) > 1 else 'it'} "
                     "was checked\n")
    failures = {impl_id: [r for r in results if r.status in FAILED and r.case.feature != "isolate"]
                for impl_id, results in all_results.items()}
    failures = {k: v for k, v in failures.items() if v}

    def libraries(impl_id: str) -> dict[str, str]:
        return rule_libraries(next(i for i in everything if i.id == impl_id), info)

    command = "opdispatch validate" + (f" --impl {','.join(impl_ids)}" if impl_ids else "")
    unfinished = sorted(impl_id for impl_id, results in all_results.items()
                        if any(r.status == NOT_RUN for r in results))
    if unfinished:
        stream.write(f"validate: --budget {budget:g} s ran out before {', '.join(unfinished)} finished: their cases "
                     "not run are reported as such, and their earlier quarantine rules are kept\n")
    if quarantine_path is not None:
        envs = {impl_id: env_conditions(info, libraries(impl_id)) for impl_id in all_results}
        new = {impl_id: quarantine_rules(impl_id, results, envs[impl_id], isolations.get(impl_id, {}))
               for impl_id, results in all_results.items()}
        replaced = {impl_id: env for impl_id, env in envs.items() if impl_id not in unfinished}
        body = merge_quarantine(existing, new, replaced)
        write_quarantine(quarantine_path, quarantine_text(body, info, command))
        written = sum(len(rules) for impl_rules in new.values() for rules in impl_rules.values())
        stream.write(f"quarantine: {quarantine_path} ({written} rule(s) for {len(failures)} implementation(s) "
                     f"validated here; rules of other implementations and hosts kept)\n")
    summary = {impl_id: _summary(results) for impl_id, results in all_results.items()}
    if report_json is not None:
        report_json.write_text(json.dumps({"device": info.to_dict(), "implementations": summary,
                                           "cases": {k: [dict(r.case.to_json(), status=r.status,
                                                              detail=r.detail, error=r.error) for r in v]
                                                     for k, v in all_results.items()}}, indent=1))
    text = _markdown(info, summary, failures)
    if report_md is not None:
        report_md.write_text(text)
    stream.write(text)
    if failures:
        return 1
    return 2 if len(empty) == len(all_results) else 0  # validated nothing at all: as when nothing was available


def _summary(results: list[CaseResult]) -> dict[str, Any]:
    counts: dict[str, Any] = {s: 0 for s in ("pass", "fail", "crashed", "timeout", "not declared", NOT_RUN)}
    counts["isolation runs"] = 0
    worst: dict[str, float] = {}
    for r in results:
        if r.case.feature == "isolate":  # the second round re-runs a failure's suspects: not cases of the matrix
            counts["isolation runs"] += 1
            continue
        counts[r.status] = counts.get(r.status, 0) + 1
        if r.error is not None and r.status in ("pass", "fail"):
            worst[r.case.dtype] = max(worst.get(r.case.dtype, 0.0), r.error)
    counts["worst_out_error"] = {k: float(f"{v:.3g}") for k, v in sorted(worst.items())}
    counts["quarantined"] = sorted({r.case.feature for r in results if r.status in FAILED
                                    and r.case.feature != "isolate"})
    return counts


def _markdown(info: Any, summary: dict[str, Any], failures: dict[str, list[CaseResult]]) -> str:
    lines = [f"# opdispatch validate: {info.describe()}", "",
             "| implementation | pass | fail | crashed | timeout | not declared | not run | worst out error | "
             "quarantined |", "|---|--:|--:|--:|--:|--:|--:|---|---|"]
    for impl_id, s in summary.items():
        worst = ", ".join(f"{k} {v:.2g}" for k, v in s["worst_out_error"].items()) or "-"
        lines.append(f"| {impl_id} | {s['pass']} | {s['fail']} | {s['crashed']} | {s['timeout']} | "
                     f"{s['not declared']} | {s[NOT_RUN]} | {worst} | {', '.join(s['quarantined']) or '-'} |")
    for impl_id, bad in failures.items():
        lines += ["", f"## {impl_id}", ""] + [f"- {r.status}: {r.case.describe()}: {r.detail}" for r in bad]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the worker: python -m opdispatch.tools._validate IMPL DEVICE CASES_JSON START
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.stdout)
