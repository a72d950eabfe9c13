"""Shadow checks: a sampled fraction of dispatched calls recomputed on the op's reference, off the critical path.

``OPDISPATCH_SHADOW=<rate>`` (a number in (0, 1]) turns them on. Sampling is a per-manager counter, deterministic:
of N calls, exactly floor(N x rate) are checked (rate 1: every call). A sampled call's inputs and result are cloned
(detached: forward values only) before the caller gets its result, and a single background thread recomputes the
call on the op's reference implementation (``reference_fallback``; attention: ``reference.math``) in float64 and
compares each output with the op's forward tolerance (`opdispatch.base._tolerance.RELATIVE_NORM`, the bound `opdispatch
validate` applies): ``‖got − want‖ / ‖want‖``. The queue is bounded (`QUEUE_SIZE`): a sampled call that finds it
full is dropped and counted. Calls traced by torch.compile, captured in a CUDA graph, or run by the reference itself
are not checked. The shadow path never raises into the caller: a check that fails is logged once.

A drift is logged once per (implementation, call class) as a WARNING naming the implementation, the call, the error
and the tolerance, and counted in `opdispatch.stats()` (``shadow_checks`` / ``shadow_drifts`` / ``shadow_dropped``).
With ``OPDISPATCH_SHADOW_QUARANTINE=<path>`` the class is also quarantined as `opdispatch validate` does it: a deny
rule scoped to the call's features (its class, sizes aside), dtype, device and library versions is merged into that
file, and the manager adds the file to its policy (`OpManager.add_quarantine`), so from then on this process — and
every later one whose policy reads that file (``OPDISPATCH_QUARANTINE``) — decides that class without it.

Without ``OPDISPATCH_SHADOW`` nothing here runs: the manager binds no wrapper (see `OpManager._bound`).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._graphs import is_capturing

__all__ = ["ENV_SHADOW", "ENV_SHADOW_QUARANTINE", "QUEUE_SIZE", "Sampler", "Shadow", "shadow_flush",
           "shadow_from_environ"]

log = logging.getLogger("opdispatch")

ENV_SHADOW = "OPDISPATCH_SHADOW"
ENV_SHADOW_QUARANTINE = "OPDISPATCH_SHADOW_QUARANTINE"
QUEUE_SIZE = 16  # sampled calls waiting for their check: each holds a copy of its inputs and result


def shadow_rate(environ: Any) -> float | None:
    """OPDISPATCH_SHADOW as a sampling rate in (0, 1]; None when unset or empty."""
    raw = environ.get(ENV_SHADOW)
    if raw is None or not raw.strip():
        return None
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if not 0.0 < rate <= 1.0:  # NaN fails too
        raise ValueError(
            f"{ENV_SHADOW}={raw!r} is not a sampling rate: use a number in (0, 1] — the fraction of dispatched calls "
            f"recomputed on the reference (e.g. 0.01; 1 checks every call) — or unset {ENV_SHADOW} to turn shadow "
            "checks off")
    return rate


def shadow_from_environ(manager: Any, environ: Any) -> Shadow | None:
    """The manager's shadow checker as OPDISPATCH_SHADOW and OPDISPATCH_SHADOW_QUARANTINE say (None: off).
    Both are checked here, before anything runs or is written."""
    rate = shadow_rate(environ)
    raw_path = environ.get(ENV_SHADOW_QUARANTINE) or None
    if raw_path is not None and rate is None:
        raise ValueError(f"{ENV_SHADOW_QUARANTINE}={raw_path!r} is set but {ENV_SHADOW} is not: without shadow checks "
                         f"nothing is quarantined; set {ENV_SHADOW} to a rate in (0, 1], or unset "
                         f"{ENV_SHADOW_QUARANTINE}")
    if rate is None:
        return None
    path = None
    if raw_path is not None:
        from opdispatch.policies._quarantine import read_existing_quarantine

        path = Path(raw_path)
        try:
            read_existing_quarantine(path)  # a file there must be a quarantine: its rules are merged, never lost
        except ValueError as exc:  # PolicyError is one
            raise ValueError(f"{ENV_SHADOW_QUARANTINE}={raw_path!r}: {exc}") from None
    return Shadow(manager, rate, path)


class Sampler:
    """Which calls are checked: call n (from 0) is when floor((n + 1) x rate) > floor(n x rate) — exactly
    floor(N x rate) of N calls, spread evenly, whatever the threads (one C-level counter step per call)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._count = itertools.count()

    def __call__(self) -> bool:
        n = next(self._count)
        return math.floor((n + 1) * self.rate) > math.floor(n * self.rate)


@dataclass
class _Job:
    decision: Any
    arguments: dict[str, Any]  # the op's arguments (bar `impl`), tensors detached clones
    outputs: list[Any]  # the result's tensors, detached clones
    features: dict[str, Any]  # the call's `when:` features (for a quarantine rule)
    dtype: Any
    event: Any  # CUDA: recorded after the clones on the caller's stream


class Shadow:
    """One manager's shadow checks: the sampler, the bounded queue and its worker thread (started on first use)."""

    def __init__(self, manager: Any, rate: float, quarantine: Path | None) -> None:
        self.manager = manager
        self.rate = rate
        self.quarantine = quarantine
        self.sample = Sampler(rate)
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=QUEUE_SIZE)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._reported: set[tuple[Any, ...]] = set()  # what was logged once (and the classes quarantined)

    # -- the caller's side ---------------------------------------------------------------------------------
    def wrap(self, fn: Any, decision: Any, rebuild: Any) -> Any:
        """`fn` (a bound function) that also offers each of its calls — `rebuild(*tensors)` is the call — for a
        check; `.shadowed` is True on it."""
        offer = self.offer

        def shadowed(*tensors: Any) -> Any:
            result = fn(*tensors)
            offer(decision, rebuild, tensors, result)
            return result

        shadowed.shadowed = True  # type: ignore[attr-defined]
        return shadowed

    def offer(self, decision: Any, call: Any, tensors: Any, result: Any) -> None:
        """Queue a check of one call (`call`, or `call(*tensors)` when `tensors` is not None) if it is sampled and
        can be checked; never raises."""
        if torch.compiler.is_compiling() or not self.sample():
            return
        try:
            if tensors is not None:
                call = call(*tensors)
            if is_capturing(call.device):
                return
            job = self._job(decision, call, result)
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.manager.usage.shadow_dropped(decision)
                return
            self._ensure_worker()
        except Exception as exc:  # the caller has its result: a check that cannot be queued is only logged
            self._once(("queue", decision.chosen_id, decision.cache_key), logging.WARNING,
                       "%s: shadow check of %s on [%s] could not be queued: %s: %s", decision.op, decision.chosen_id,
                       decision.call, type(exc).__name__, exc)

    def _job(self, decision: Any, call: Any, result: Any) -> _Job:
        from ..base._ops import op_spec

        spec = op_spec(decision.op)
        names = [n for n in (spec.arguments.names if spec.arguments is not None else ()) if n != "impl"]
        arguments = {n: _clone(getattr(call, n, None)) for n in names}
        outputs = [_clone(t) for t in (result if isinstance(result, (tuple, list)) else (result,))]
        event = None
        if call.device.type == "cuda":  # the worker's stream waits for the clones
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        return _Job(decision, arguments, outputs, spec.call_features(call), call.dtype, event)

    # -- the worker's side ---------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is not None:
            return
        with self._lock:
            if self._worker is None:
                worker = threading.Thread(target=self._work, name="opdispatch-shadow", daemon=True)
                worker.start()
                self._worker = worker

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._check(job)
            except Exception as exc:  # a reference that fails, a quarantine that cannot be written: logged once
                decision = job.decision
                self._once(("check", decision.chosen_id, decision.cache_key), logging.WARNING,
                           "%s: shadow check of %s on [%s] failed: %s: %s (later failures of this class are not "
                           "logged)", decision.op, decision.chosen_id, decision.call, type(exc).__name__, exc)
            finally:
                del job
                self._queue.task_done()

    def _check(self, job: _Job) -> None:
        from ..base._dtypes import dtype_name
        from ..base._ops import op_spec
        from ..base._tolerance import RELATIVE_NORM

        decision = job.decision
        tolerance = RELATIVE_NORM.get(dtype_name(job.dtype))
        if tolerance is None:
            raise ValueError(f"no tolerance for dtype {dtype_name(job.dtype)} (opdispatch.base._tolerance has "
                             f"{', '.join(RELATIVE_NORM)}): not checked")
        manager = self.manager
        reference = next((i for i in manager.implementations(decision.op)
                          if getattr(i, "reference_fallback", False)), None)
        if reference is None:
            raise LookupError(f"no reference implementation of {decision.op} is registered")
        device = next((v.device for v in job.arguments.values() if isinstance(v, torch.Tensor)), None)
        if job.event is not None:
            with torch.cuda.device(device):
                torch.cuda.current_stream().wait_event(job.event)
        arguments = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                     for n, v in job.arguments.items()}
        if isinstance(arguments.get("out_dtype"), torch.dtype):
            # In float64 the output is float64. (An FP8 call's q/k/v become float64 here too, and the validator
            # refuses their descales: FP8 calls are reported as not checked.)
            arguments["out_dtype"] = None
        with torch.no_grad():
            call = op_spec(decision.op).validator(**arguments)  # type: ignore[misc]
            reasons = list(reference.not_supported_reasons(call, manager.device_info(call.device)))
            if reasons:
                raise ValueError(f"{reference.id} cannot take the call in float64: {'; '.join(reasons)}")
            result = reference.run(reference.conform(call))
        wanted = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(wanted) != len(job.outputs):
            raise ValueError(f"{reference.id} returned {len(wanted)} outputs, {decision.chosen_id} {len(job.outputs)}")
        limit = tolerance[0]
        errors = [(i, relative_error(got, want)) for i, (got, want) in enumerate(zip(job.outputs, wanted))
                  if isinstance(got, torch.Tensor) and got.is_floating_point()]
        drifts = [(i, e) for i, e in errors if not e <= limit]
        manager.usage.shadow_checked(decision, bool(drifts))
        if drifts:
            self._drifted(job, reference.id, drifts, limit)

    def _drifted(self, job: _Job, reference_id: str, drifts: list[tuple[int, float]], limit: float) -> None:
        decision = job.decision
        once = ("drift", decision.chosen_id, decision.cache_key)
        with self._lock:
            if once in self._reported:
                return
            self._reported.add(once)
        error = "; ".join(f"output {i} relative error {e:.3g}" for i, e in drifts)
        if self.quarantine is not None:
            self._quarantine(job, reference_id, error, limit)
            then = (f" The class is quarantined for it in {self.quarantine} ({ENV_SHADOW_QUARANTINE}): it is "
                    "decided again without it.")
        else:
            then = f" Set {ENV_SHADOW_QUARANTINE}=<file> to quarantine such a class."
        log.warning("%s: shadow check: %s drifted from %s on [%s]: %s > tolerance %g (‖got − want‖ / ‖want‖ for "
                    "%s). Later drifts of this class are counted in opdispatch.stats() only.%s", decision.op,
                    decision.chosen_id, reference_id, decision.call, error, limit, dtype_name_of(job.dtype), then)

    def _quarantine(self, job: _Job, reference_id: str, error: str, limit: float) -> None:
        """Merge a deny rule for this class into the quarantine file, then into the manager's policy."""
        import hashlib
        import json

        from opdispatch.policies._quarantine import (env_conditions, merge_quarantine, quarantine_text,
                                                     read_existing_quarantine, rule_libraries, rule_name,
                                                     write_quarantine)

        assert self.quarantine is not None
        decision = job.decision
        impl_id = decision.chosen_id
        when = {**env_conditions(decision.device, rule_libraries(decision.chosen, decision.device)),
                **class_conditions(job.features)}
        digest = hashlib.sha256(json.dumps(when, sort_keys=True, default=str).encode()).hexdigest()[:6]
        rule = {"name": rule_name(impl_id, f"shadow-{digest}"), "when": when, "deny": [impl_id],
                "reason": f"shadow check: {error} > {limit:g} against {reference_id} on [{decision.call}]"}
        with self._lock:  # one writer per process (a rule of another process written meanwhile is kept)
            existing = read_existing_quarantine(self.quarantine)
            body = merge_quarantine(existing, {impl_id: {decision.op: [rule]}}, {})
            write_quarantine(self.quarantine, quarantine_text(body, decision.device,
                                                              f"{ENV_SHADOW}={self.rate:g} (shadow check)"))
        self.manager.add_quarantine(self.quarantine)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued check has finished (at most `timeout` seconds); whether they all have."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"shadow_flush(timeout={timeout!r}): the timeout must be a number of seconds >= 0, or "
                             "None to wait until every check has finished")
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                done.wait(remaining)
        return True

    def _once(self, key: tuple[Any, ...], level: int, message: str, *args: Any) -> None:
        with self._lock:
            if key in self._reported:
                return
            self._reported.add(key)
        log.log(level, message, *args)


def dtype_name_of(dtype: Any) -> str:
    from ..base._dtypes import dtype_name

    return dtype_name(dtype)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in float64, over the finite values of `want`; equal values (-inf LSE rows of
    keyless queries included) count as no error, and a non-finite value where the reference has none as an
    infinite (or NaN) error: never within tolerance."""
    if tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"the result's shape {tuple(got.shape)} differs from the reference's {tuple(want.shape)}")
    got, want = got.double(), want.double().to(got.device)
    diff = torch.where(got == want, torch.zeros_like(got), got - want)
    scale = torch.where(torch.isfinite(want), want, torch.zeros_like(want)).norm().clamp_min(1e-30)
    return float(diff.norm() / scale)


# Sizes are not part of a class's features (a class holds for every size within its policy's thresholds), as a
# rule of `opdispatch validate` is not scoped to lengths.
_SIZE_FEATURES = frozenset({"seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv", "tokens"})


def class_conditions(features: dict[str, Any]) -> dict[str, Any]:
    """The `when:` conditions that select a call's class: its features but the sizes, dtypes by name."""
    when: dict[str, Any] = {}
    for key, value in sorted(features.items()):
        if key in _SIZE_FEATURES or value is None:
            continue
        when[key] = dtype_name_of(value) if isinstance(value, torch.dtype) else value
    return when


def shadow_flush(timeout: float | None, manager: Any) -> bool:
    """`opdispatch.shadow_flush` for a given `manager` (the public one, whose default is the process-wide manager,
    is core/opdispatch/engine/_current.py's)."""
    shadow: Shadow | None = manager.shadow
    return True if shadow is None else shadow.flush(timeout)
