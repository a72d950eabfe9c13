"""Usage statistics: what ran, how often, and how often the breaker, a quarantine or the reference stepped in.

``opdispatch.stats()`` is a snapshot of the process-wide manager's counters; ``stats(reset=True)`` returns it and
starts the counters over. With ``OPDISPATCH_STATS=1`` the snapshot's table is printed to stderr at exit (the only
way to see a running process's table from the command line: ``opdispatch stats`` prints its own process's).

What is counted, and where (the hit path stays as it was):

- **fast-path hits**, per op: the compiled front door counts its hits in C already (``door.__self__.stats()``);
  the Python front door counts a hit with one C-level ``itertools.count`` step. Hits are not attributed to a
  class or an implementation: that would cost a lookup on every call. A call the compiled door hands to the
  Python door is counted once, by whichever served it from the fast path.
- **slow-path calls**, per op x implementation x decision class: calls the manager decided or looked up and ran
  (`OpManager.call` / `run_bound`), counted where they succeed, on the implementation that returned.
- **decisions** (decision cache misses), **demotions** by the breaker (by scope: ``signature`` or ``class``),
  **quarantine denials** (decisions in which a quarantine rule of ``opdispatch validate`` denied the
  implementation) and **reference on accelerator** (slow-path calls of a ``reference_fallback`` implementation on
  a device that is not the CPU), each per op x implementation x class.
- **shadow checks** (``OPDISPATCH_SHADOW``, `opdispatch.engine._shadow`): calls recomputed on the reference, those whose
  result drifted past the op's tolerance, and those dropped because the check queue was full, per op x
  implementation x class (counted by the check's worker thread when it finishes a check).

Calls of a plan (``opdispatch.plan(...)``'s bound function) run no opdispatch code and are not counted.
Counters are updated under a lock (the slow path only) or by an atomic C step (the Python hit), so threads
never lose a count.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

# The Python front doors' hit counters live with the doors that make them (`opdispatch.base._arguments`).
from ..base._arguments import _hits_lock, _python_hits, python_hit_counter

__all__ = ["ENV_STATS", "ClassUsage", "OpUsage", "UsageCounters", "UsageSnapshot", "class_text",
           "python_hit_counter", "stats"]

ENV_STATS = "OPDISPATCH_STATS"

# What `stats(reset=True)` subtracts: C counters cannot be reset from here, so a reset records a baseline.
_python_baseline: dict[str, int] = {}
_door_baseline: dict[int, tuple[weakref.ref[Any], int]] = {}


def _count_value(counter: itertools.count[int]) -> int:
    """How many times `counter` was advanced, without advancing it (its repr is ``count(N)``)."""
    return int(repr(counter)[len("count("):-1])


def class_text(value: Any) -> str:
    """A decision class (or any part of one) as stable, readable text: dtypes by name, devices by type (a class
    holds on every device of that type), tuples in parentheses, everything else by its repr."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, tuple):
        inner = ", ".join(class_text(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, frozenset):
        return "{" + ", ".join(sorted(class_text(v) for v in value)) + "}"
    return repr(value)


def decision_class_text(cache_key: Any) -> str:
    """The readable class of a decision's cache key ``(op, class, device key, impl=, overrides)``: the class, and
    the `policy_override` scopes it was decided under (they can change the decision)."""
    text = class_text(cache_key[1])
    overrides = cache_key[4]
    if overrides:
        text += " under " + "; ".join(repr(o) for o in overrides)
    return text


@dataclass
class ClassUsage:
    """The counters of one op x implementation x decision class."""

    op: str
    implementation: str
    decision_class: str
    slow_calls: int = 0
    decisions: int = 0
    demotions: dict[str, int] = field(default_factory=dict)  # scope ("signature" | "class") -> count
    quarantine_denials: int = 0
    reference_on_accelerator: int = 0
    shadow_checks: int = 0
    shadow_drifts: int = 0
    shadow_dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "implementation": self.implementation, "class": self.decision_class,
                "slow_calls": self.slow_calls, "decisions": self.decisions, "demotions": dict(self.demotions),
                "quarantine_denials": self.quarantine_denials,
                "reference_on_accelerator": self.reference_on_accelerator, "shadow_checks": self.shadow_checks,
                "shadow_drifts": self.shadow_drifts, "shadow_dropped": self.shadow_dropped}


@dataclass
class OpUsage:
    """One op's totals: fast-path hits (not attributed to a class) and slow-path calls."""

    op: str
    compiled_hits: int = 0
    python_hits: int = 0
    slow_calls: int = 0

    @property
    def fast_path_hits(self) -> int:
        return self.compiled_hits + self.python_hits

    @property
    def calls(self) -> int:
        return self.fast_path_hits + self.slow_calls

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "calls": self.calls, "fast_path_hits": self.fast_path_hits,
                "compiled_hits": self.compiled_hits, "python_hits": self.python_hits, "slow_calls": self.slow_calls}


@dataclass
class UsageSnapshot:
    """`opdispatch.stats()`: per-op totals and per op x implementation x class counters, at one moment."""

    ops: dict[str, OpUsage]
    classes: list[ClassUsage]

    def row(self, op: str, implementation: str, decision_class: str | None = None) -> ClassUsage:
        """The counters of one implementation of `op` (summed over its classes when `decision_class` is None)."""
        rows = [r for r in self.classes if r.op == op and r.implementation == implementation
                and (decision_class is None or r.decision_class == decision_class)]
        total = ClassUsage(op, implementation, decision_class or "*")
        for r in rows:
            total.slow_calls += r.slow_calls
            total.decisions += r.decisions
            total.quarantine_denials += r.quarantine_denials
            total.reference_on_accelerator += r.reference_on_accelerator
            total.shadow_checks += r.shadow_checks
            total.shadow_drifts += r.shadow_drifts
            total.shadow_dropped += r.shadow_dropped
            for scope, n in r.demotions.items():
                total.demotions[scope] = total.demotions.get(scope, 0) + n
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"ops": [u.to_dict() for u in self.ops.values()], "classes": [c.to_dict() for c in self.classes]}

    def format(self, width: int | None = None) -> str:
        from ..base._table import format_table

        if not self.ops and not self.classes:
            return "opdispatch stats: no call was dispatched in this process"
        op_rows = [("op", "calls", "fast-path hits", "(compiled)", "(python)", "slow-path calls")]
        op_rows += [(u.op, str(u.calls), str(u.fast_path_hits), str(u.compiled_hits), str(u.python_hits),
                     str(u.slow_calls)) for u in self.ops.values()]
        class_rows = [("op", "implementation", "slow calls", "decisions", "demoted (sig/class)", "quarantined",
                       "reference on accel.", "shadow (checked/drift/dropped)", "class")]
        for c in self.classes:
            class_rows.append((c.op, c.implementation, str(c.slow_calls), str(c.decisions),
                               f"{c.demotions.get('signature', 0)}/{c.demotions.get('class', 0)}",
                               str(c.quarantine_denials), str(c.reference_on_accelerator),
                               f"{c.shadow_checks}/{c.shadow_drifts}/{c.shadow_dropped}", c.decision_class))
        return ("\n".join(format_table(op_rows, width=width, rule=True)) + "\n\n"
                + "\n".join(format_table(class_rows, width=width, rule=True)))

    def __str__(self) -> str:
        return self.format()


class UsageCounters:
    """One manager's slow-path counters (the fast-path hits are the front doors', process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (op, implementation id, decision cache key) -> ClassUsage with its class text filled in on snapshot
        self._rows: dict[tuple[str, str, Any], ClassUsage] = {}
        self._slow: dict[str, int] = {}
        # The row `called` counted last, with its decision: a decode loop's first pass counts each new length's
        # call on one decision, and the row's key hashes that decision's whole class key.
        self._last_called: tuple[Any, ClassUsage] | None = None

    def _row(self, op: str, impl_id: str, cache_key: Any) -> ClassUsage:
        key = (op, impl_id, cache_key)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = ClassUsage(op, impl_id, "")
        return row

    def called(self, decision: Any, *, reference_counted: bool = False) -> None:
        """A slow-path call ran on `decision.chosen` and returned (`reference_counted`: its bound function already
        counted it as a reference call on an accelerator, `reference_hit`)."""
        reference = (not reference_counted and getattr(decision.chosen, "reference_fallback", False)
                     and decision.device.type != "cpu")
        with self._lock:
            last = self._last_called
            if last is not None and last[0] is decision:
                row = last[1]
            else:
                row = self._row(decision.op, decision.chosen_id, decision.cache_key)
                self._last_called = (decision, row)
            row.slow_calls += 1
            if reference:
                row.reference_on_accelerator += 1
            self._slow[decision.op] = self._slow.get(decision.op, 0) + 1

    def reference_hit(self, decision: Any) -> None:
        """A call of a function bound to the reference on an accelerator returned (the per-call fast path included:
        every such call is counted, the performance cliff it is)."""
        with self._lock:
            self._row(decision.op, decision.chosen_id, decision.cache_key).reference_on_accelerator += 1

    def decided(self, decision: Any) -> None:
        """A decision was made (a cache miss); the quarantine's denials in it are counted with it."""
        quarantined = [c.impl_id for c in decision.candidates
                       if c.decided_by is not None and c.decided_by.kind == "quarantine" and c.status.startswith(
                           "denied")]
        with self._lock:
            self._row(decision.op, decision.chosen_id, decision.cache_key).decisions += 1
            for impl_id in quarantined:
                self._row(decision.op, impl_id, decision.cache_key).quarantine_denials += 1

    def demoted(self, decision: Any, scope: str) -> None:
        with self._lock:
            demotions = self._row(decision.op, decision.chosen_id, decision.cache_key).demotions
            demotions[scope] = demotions.get(scope, 0) + 1

    def shadow_checked(self, decision: Any, drifted: bool) -> None:
        """A shadow check of a call that `decision.chosen` ran has finished (`drifted`: past the op's tolerance)."""
        with self._lock:
            row = self._row(decision.op, decision.chosen_id, decision.cache_key)
            row.shadow_checks += 1
            if drifted:
                row.shadow_drifts += 1

    def shadow_dropped(self, decision: Any) -> None:
        """A sampled call was not checked: the shadow queue was full."""
        with self._lock:
            self._row(decision.op, decision.chosen_id, decision.cache_key).shadow_dropped += 1

    def snapshot(self, reset: bool = False) -> tuple[dict[str, int], list[ClassUsage]]:
        with self._lock:
            rows, slow = self._rows, self._slow
            if reset:
                self._rows, self._slow = {}, {}
                self._last_called = None  # its row is no longer counted
            else:
                rows, slow = dict(rows), dict(slow)
            out = []
            for (_, _, cache_key), row in rows.items():
                copy = ClassUsage(row.op, row.implementation, decision_class_text(cache_key) if cache_key else "-",
                                  row.slow_calls, row.decisions, dict(row.demotions), row.quarantine_denials,
                                  row.reference_on_accelerator, row.shadow_checks, row.shadow_drifts,
                                  row.shadow_dropped)
                out.append(copy)
        return slow, sorted(out, key=lambda r: (r.op, r.implementation, r.decision_class))


def _door_hits(reset: bool) -> dict[str, int]:
    """Compiled front doors' hits per op since the last reset (every live door of the process, twins included)."""
    from ..base import _native

    hits: dict[str, int] = {}
    with _hits_lock:
        for door in _native.front_doors():
            door_stats = door.__self__.stats()  # a size-generic entry's hit is a compiled hit too
            count = int(door_stats["hits"]) + int(door_stats.get("sized_hits", 0))
            ref, base = _door_baseline.get(id(door), (None, 0))
            if ref is None or ref() is not door:
                base = 0
            hits[door.__name__] = hits.get(door.__name__, 0) + count - base
            if reset:
                _door_baseline[id(door)] = (weakref.ref(door), count)
    return hits


def _python_door_hits(reset: bool) -> dict[str, int]:
    with _hits_lock:
        out = {}
        for op, counter in _python_hits.items():
            value = _count_value(counter)
            out[op] = value - _python_baseline.get(op, 0)
            if reset:
                _python_baseline[op] = value
    return out


def stats(reset: bool, manager: Any) -> UsageSnapshot:
    """`opdispatch.stats` for a given `manager` (the public one, whose default is the process-wide manager, is
    core/opdispatch/engine/_current.py's)."""
    if not isinstance(reset, bool):
        raise TypeError(f"stats(reset={reset!r}): reset must be True or False")
    slow, classes = manager.usage.snapshot(reset)
    compiled, python = _door_hits(reset), _python_door_hits(reset)
    ops: dict[str, OpUsage] = {}
    for op in sorted(set(slow) | {o for o, n in compiled.items() if n} | {o for o, n in python.items() if n}):
        ops[op] = OpUsage(op, compiled.get(op, 0), python.get(op, 0), slow.get(op, 0))
    return UsageSnapshot(ops, classes)


def stats_enabled(environ: Any = None) -> bool:
    """OPDISPATCH_STATS: 1/true/yes/on prints the usage table at exit; 0/false/no/off/empty does not."""
    value = (os.environ if environ is None else environ).get(ENV_STATS, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_STATS}={value!r} is not a switch; use 1 (print the usage table to stderr at exit) or 0")


_summary_registered = False


def register_exit_summary(environ: Any, manager: Any) -> None:
    """With OPDISPATCH_STATS=1: print `manager`'s `stats()` to stderr when the process exits (registered once, by
    the first manager to start with it on: the process-wide one, in a program that calls opdispatch's functions)."""
    global _summary_registered
    if _summary_registered or not stats_enabled(environ):
        return
    _summary_registered = True
    atexit.register(_print_summary, weakref.ref(manager))


def _print_summary(manager_ref: Any) -> None:
    try:
        manager = manager_ref()
        if manager is None:
            raise RuntimeError("the manager it counted for was deleted before exit")
        text = stats(False, manager).format()
    except Exception as exc:  # at exit: say what failed, never raise
        text = f"opdispatch stats: unavailable at exit ({type(exc).__name__}: {exc})"
    print("opdispatch usage (OPDISPATCH_STATS=1):\n" + text, file=sys.stderr)
