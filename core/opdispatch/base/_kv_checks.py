"""KV-cache indices checked before anything is written or read through them (issue 27).

A KV-cache call names cache slots by integers the caller computes — ``cache_seqlens``, ``cache_batch_idx``,
``cache_leftpad``, ``block_table`` pages, ``seqused_k`` — and a wrong one writes into another sequence's slots, or
makes a kernel read out of bounds (on a GPU: a device-side assert or illegal access that kills the CUDA context).
Each call states its indices as `Bound` rules (argument, values, inclusive range, which entries count) and
checks them in one of two ways:

- **on the host** (CPU tensors, or any device with ``OPDISPATCH_SYNC_CHECKS=1``): the values are read and the
  first bad one raises ``ValueError`` naming the argument, the index and value, what is allowed and how to fix
  it — before anything is written. On an accelerator that read is a host sync per call, hence opt-in.
- **on the device** (accelerators by default; ``OPDISPATCH_KV_CHECKS=device`` forces it on CPU, for tests): the
  verdict is computed on the device without a sync and never as a device assert. The call goes on with every
  index clamped into range (so no kernel reads or writes out of bounds), its writes are all-or-nothing
  (``torch.where(valid, new, old)``: an invalid call changes no slot) and its output is NaN. The first bad
  (argument, index, value) is copied non-blocking into a row of a preallocated host ring (pinned memory, one
  reused CUDA event per row: no allocation per call), and the next KV-cache call on that device whose check has
  finished by then — or `check_pending_errors`, which waits — raises it as `KvCacheIndexError`. A call asks only
  the oldest report's event (events of one stream complete in order); a row is written again only after the host
  read it, so a host a whole ring ahead of the device waits for the oldest copy rather than overwrite it.

A path that runs every step (``flash_attn_with_kvcache``'s bound path) reports more cheaply with `defer_report`:
one row holding its verdict and its indices as given, copied in stream order (the caller may change its
``cache_seqlens`` in place right after the call); the message is worked out from that host copy, by the same host
check, only once the verdict says the call was bad — no device read, no device copy of the indices. Its fused
kernels (core/opdispatch/compat/_kv_append.py) skip even that copy: `report_row` hands out a ring row, which the verdict
kernel writes directly (a CUDA device addresses pinned host memory), and `defer_written` records it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SYNC_ENV = "OPDISPATCH_SYNC_CHECKS"  # "1": check on the host (raise in the same call) on every device
MODE_ENV = "OPDISPATCH_KV_CHECKS"  # "device": the device-side path on CPU tensors too (tests)


class KvCacheIndexError(ValueError):
    """A KV-cache index was out of range in an earlier call on an accelerator, found by the device-side check:
    that call wrote nothing and returned NaN. Raised by the next KV-cache call on the device or by
    `check_pending_errors`."""


def sync_checks() -> bool:
    """Whether ``OPDISPATCH_SYNC_CHECKS`` asks for host checks on every device (a sync per call)."""
    return os.environ.get(SYNC_ENV, "") not in ("", "0")


def host_checks(device: torch.device) -> bool:
    """Whether a call on `device` checks its indices on the host (see the module docstring)."""
    if sync_checks():
        return True
    return device.type == "cpu" and os.environ.get(MODE_ENV, "") != "device"


def check_index_tensor(fn: str, name: str, value: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`value` as an index tensor: int32 (what flash-attn 2.8's mha_fwd_kvcache takes — ``TORCH_CHECK(...dtype()
    == torch::kInt32)``; int64 is refused rather than narrowed, where 2**32 + 5 would become 5), of `shape`, on
    `device`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 tensor, got {type(value).__name__}")
    if value.dtype != torch.int32:
        hint = ("check the values fit, then .to(torch.int32)" if not value.dtype.is_floating_point
                and value.dtype != torch.bool else "pass integer indices as torch.int32")
        raise TypeError(f"{fn}: {name} must be torch.int32 (as in flash-attn), got {value.dtype}; {hint}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{fn}: {name} is on {value.device} but q is on {device}; move it to {device}")
    return value


@dataclass
class Bound:
    """`values` must lie in [low, high] (inclusive; ints or tensors broadcasting with `values`) wherever `where`
    holds (None: everywhere). `allowed` says the range in words, `fix` how to get there."""

    name: str
    values: torch.Tensor
    low: Any
    high: Any
    allowed: str
    fix: str
    where: torch.Tensor | None = None

    def bad(self) -> torch.Tensor:
        values = self.values.long()
        bad: torch.Tensor = (values < self.low) | (values > self.high)
        return bad & self.where if self.where is not None else bad

    def clamped(self) -> torch.Tensor:
        """The values clamped into range, in their dtype (entries outside `where` unchanged; an empty range
        clamps to its low end). Built on the device: no host value is copied over."""
        values, low, high = self.values, self.low, self.high
        if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
            low = low.to(values.dtype) if isinstance(low, torch.Tensor) else torch.full_like(values, low)
            high = high.to(values.dtype) if isinstance(high, torch.Tensor) else torch.full_like(values, high)
            clamped = torch.minimum(torch.maximum(values, low), torch.maximum(high, low))
        else:
            clamped = values.clamp(min=low, max=max(high, low))
        return torch.where(self.where, clamped, values) if self.where is not None else clamped

    def message(self, fn: str, position: int, value: int) -> str:
        index = (f"[{position}]" if self.values.dim() <= 1
                 else f"[{position // self.values.shape[1]}, {position % self.values.shape[1]}]")
        return f"{fn}: {self.name}{index}={value} is out of range; allowed: {self.allowed}; {self.fix}"


@dataclass
class Unique:
    """The integers `keys` (any shape) must be distinct: two writes to one cache slot race. `name` and
    `describe(key)` say which argument made them collide and how."""

    name: str
    keys: torch.Tensor
    allowed: str
    fix: str
    divisor: int = 1  # the reported value: key // divisor (a slot's page or row)

    def bad(self) -> torch.Tensor:
        keys, _ = self.keys.flatten().long().sort()
        dup = keys[1:] == keys[:-1]
        return torch.cat([dup.new_zeros(min(1, keys.numel())), dup])  # aligned with the sorted keys: True at a repeat

    def reported(self) -> torch.Tensor:
        keys, _ = self.keys.flatten().long().sort()
        return keys // self.divisor

    def message(self, fn: str, position: int, value: int) -> str:
        del position
        return f"{fn}: {self.name} makes two sequences write the same slot (at {value}); allowed: {self.allowed}; " \
               f"{self.fix}"


Rule = Bound | Unique


def raise_first(fn: str, rules: list[Rule]) -> None:
    """Host check: raise ValueError for the first bad entry of the first rule that has one (reads the values)."""
    for rule in rules:
        flat = rule.bad().flatten()
        if flat.numel() and bool(flat.any()):
            position = int(flat.nonzero()[0, 0])
            source = rule.reported() if isinstance(rule, Unique) else rule.values.flatten()
            raise ValueError(rule.message(fn, position, int(source[position])))


def device_verdict(fn: str, rules: list[Rule], device: torch.device) -> tuple[torch.Tensor, Any]:
    """Device check: (a 0-d bool tensor, True when every rule holds, computed without a host sync; the report to
    hand `defer` once the call's work is queued — so that the call itself does not raise its own error)."""
    rows = []
    for rule in rules:
        flat = rule.bad().flatten()
        source = (rule.reported() if isinstance(rule, Unique) else rule.values.flatten().long())
        if flat.numel() == 0 or source.numel() == 0:  # nothing to check (a batch of 0)
            rows.append(torch.zeros(3, dtype=torch.long, device=device))
            continue
        # The first True (argmax of a 0/1 vector returns the first); gather/index_select, not t[0-d tensor],
        # which could read the index on the host.
        position = flat.to(torch.int32).argmax().view(1)
        rows.append(torch.cat([flat.any().long().view(1), position, source.gather(0, position)]))
    table = torch.stack(rows)  # (rules, 3): any, position, value
    rule_index = table[:, 0].argmax().view(1)
    report = torch.cat([table[:, 0].any().long().view(1), rule_index, table.index_select(0, rule_index)[0, 1:]])
    valid: torch.Tensor = report[0] == 0
    return valid, (fn, rules, report, device)


def defer(report: Any) -> None:
    """Record a `device_verdict` report: its first bad (rule, position, value) is copied to the host (a ring row,
    behind an event), for `raise_pending` / `check_pending_errors` to raise."""
    fn, rules, values, device = report
    # Only what the message needs is kept: the rules' names and texts, not their (possibly large) tensors.
    defer_report(device, values, _RuleMessage(fn, [_described(rule) for rule in rules]))


def defer_report(device: torch.device, values: torch.Tensor, describe: Callable[[torch.Tensor], str]) -> None:
    """Record a call's device-side report `values` (a 1-D integer tensor on `device`, its first entry nonzero
    when the call had a bad index; the rest what `describe` needs): copied in stream order, without a sync, into
    a preallocated host row (`_Ring`); once the copy is done and the row reads bad, `describe(row)` (a CPU copy
    of the row) gives the error's message. Never raises: a failure is raised by `raise_pending` or
    `check_pending_errors`."""
    row = report_row(device, values.shape[0], values.dtype)
    row.tensor.copy_(values, non_blocking=True)
    defer_written(row, describe)


class ReportRow:
    """A ring row handed out by `report_row`: `tensor` (a host row, pinned on CUDA) for the caller to write in
    stream order, then `defer_written` once that write is queued (or `release_row` if nothing was queued)."""

    __slots__ = ("state", "ring", "slot", "tensor")

    def __init__(self, state: _Verdicts, ring: _Ring, slot: int) -> None:
        self.state, self.ring, self.slot, self.tensor = state, ring, slot, ring.rows[slot]


def report_row(device: torch.device, width: int, dtype: torch.dtype) -> ReportRow:
    """A host row of `width` `dtype` entries for one report on `device`, taken until `defer_written` or
    `release_row`. A kernel on a CUDA device may write it directly (pinned memory is mapped into the device's
    address space); the write must be queued before `defer_written` records the row's event."""
    state = _states.get(device) or _state(device)
    with _lock:
        ring = state.rings.get((width, dtype)) or state.ring(width, dtype)
        slot, skipped = ring.next, 0
        while ring.taken[slot]:
            if state.pending:  # the host is a whole ring ahead of the device: wait for the oldest report's copy
                state.settle(wait=True, limit=1)
            elif skipped < len(ring.rows):  # taken by a caller between its two calls (another thread): the next
                slot, skipped = (slot + 1 if slot + 1 < len(ring.rows) else 0), skipped + 1
            else:  # every row held by callers in flight (a ring's worth of threads): a fresh ring
                ring, slot = state.ring(width, dtype), 0
        ring.taken[slot] = True
        ring.next = slot + 1 if slot + 1 < len(ring.rows) else 0
        row = ring.handles[slot]
        if row is None:  # the slot's handle, made at its first use and handed out again with the slot
            row = ring.handles[slot] = ReportRow(state, ring, slot)
        return row


def defer_written(row: ReportRow, describe: Callable[[torch.Tensor], str], stream: Any = None) -> None:
    """Record `row` (from `report_row`, its write queued on `stream` — None: the current stream) as a report,
    read like `defer_report`'s once its event completed. Never raises."""
    ring, slot = row.ring, row.slot
    event = ring.events[slot]
    if event is None:
        event = ring.events[slot] = _event_for(row.state.device)
    if event is not None:
        if stream is None:
            event.record()
        else:
            event.record(stream)  # the caller's stream object: `record()` would look the current one up
    with _lock:
        row.state.pending.append((ring, slot, describe))


def release_row(row: ReportRow) -> None:
    """Hand `row` back unwritten (nothing that writes it was queued)."""
    with _lock:
        row.ring.taken[row.slot] = False


RING_ROWS = 256  # reports in flight per (device, row width): the host rarely runs further ahead of a GPU


def _event_for(device: torch.device) -> Any:
    """An event to record after a row's copy (None: the copy is synchronous, as on CPU)."""
    return torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]


class _Ring:
    """Host rows that reports are copied into (pinned on CUDA, so the copy does not sync), handed out round-robin:
    a row is handed out again only after the host read it, which it does once its copy finished (its event
    completed). Its events are made once per row and recorded again at each use: no allocation per call."""

    __slots__ = ("host", "rows", "events", "taken", "next", "words", "width", "handles")

    def __init__(self, device: torch.device, width: int, dtype: torch.dtype) -> None:
        self.host = torch.zeros(RING_ROWS, width, dtype=dtype, pin_memory=device.type == "cuda")
        self.rows = list(self.host.unbind(0))  # the rows' views, made once
        self.events: list[Any] = [None] * RING_ROWS
        self.taken = [False] * RING_ROWS
        self.handles: list[ReportRow | None] = [None] * RING_ROWS  # `report_row`'s, one per row
        self.next = 0
        # Each row's first entry (the verdict) read straight from host memory: a tensor read costs two ops.
        word = ctypes.c_int32 if dtype == torch.int32 else ctypes.c_int64
        self.words = (word * (RING_ROWS * width)).from_address(self.host.data_ptr())
        self.width = width

    def bad(self, slot: int) -> bool:
        """Whether the report in row `slot` (copied: its event completed) says its call was bad."""
        return bool(self.words[slot * self.width])


class _Verdicts:
    """One device's rings, its reports in flight (oldest first) and the first failure found, not yet raised."""

    __slots__ = ("device", "rings", "pending", "failed")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rings: dict[tuple[int, torch.dtype], _Ring] = {}
        self.pending: deque[tuple[_Ring, int, Callable[[torch.Tensor], str]]] = deque()
        self.failed: KvCacheIndexError | None = None

    def ring(self, width: int, dtype: torch.dtype) -> _Ring:
        ring = self.rings[width, dtype] = _Ring(self.device, width, dtype)
        return ring

    def settle(self, wait: bool, limit: int = -1) -> None:
        """Read the finished reports, oldest first (up to `limit`), stopping at one still in flight (`wait`: waiting
        for it); keep the first failure. Events of one stream complete in order: only the oldest is asked."""
        while self.pending and limit:
            ring, slot, describe = self.pending[0]
            event = ring.events[slot]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self.pending.popleft()
            if self.failed is None and ring.bad(slot):
                message = describe(ring.rows[slot].clone())
                self.failed = KvCacheIndexError(f"an earlier KV-cache call on {self.device} had a bad index, found "
                                                f"on the device (that call wrote nothing and returned NaN): {message}")
            ring.taken[slot] = False  # read: the row may be written again
            limit -= 1

    def take_failure(self, wait: bool) -> KvCacheIndexError | None:
        """The first failure among the finished reports (all of them with `wait`), once."""
        with _lock:
            self.settle(wait)
            failed, self.failed = self.failed, None
            return failed


class _RuleMessage:
    """`defer`'s message: the rule (row[1]) with its position (row[2]) and value (row[3])."""

    __slots__ = ("fn", "rules")

    def __init__(self, fn: str, rules: list[Rule]) -> None:
        self.fn, self.rules = fn, rules

    def __call__(self, row: torch.Tensor) -> str:
        _, rule, position, value = (int(x) for x in row)
        return self.rules[rule].message(self.fn, position, value)


_states: dict[torch.device, _Verdicts] = {}
_lock = threading.Lock()


def _device_key(device: torch.device | str) -> torch.device:
    """One key per device: ``cuda`` is the current CUDA device (``torch.device("cuda") != torch.device("cuda:0")``,
    so a check recorded under cuda:0 would be missed by a look-up under cuda)."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _state(device: torch.device) -> _Verdicts:
    """`device`'s verdicts, made at its first report."""
    key = _device_key(device)
    with _lock:
        state = _states.get(key) or _Verdicts(key)
        _states[key] = state
    return state


def _described(rule: Rule) -> Rule:
    if isinstance(rule, Unique):
        return Unique(rule.name, rule.keys.new_empty(0), rule.allowed, rule.fix, rule.divisor)
    meta = rule.values.new_empty((0, rule.values.shape[1]) if rule.values.dim() > 1 else (0,))
    return Bound(rule.name, meta, 0, 0, rule.allowed, rule.fix)


def raise_pending(device: torch.device) -> None:
    """Raise the error of an earlier call on `device` whose device-side check has finished and failed (no sync:
    checks still running stay pending). Called at the start of every KV-cache call."""
    state = _states.get(device)
    if state is None:
        if not _states:
            return
        state = _states.get(_device_key(device))
        if state is None:
            return
    if state.pending or state.failed is not None:
        error = state.take_failure(wait=False)
        if error is not None:
            raise error


def check_pending_errors(device: torch.device | str | None = None) -> None:
    """Wait for every pending device-side KV-cache index check (on `device`, or all) and raise the first failure
    as `KvCacheIndexError`; returns None when every checked call was valid."""
    states = list(_states.values()) if device is None else [s for s in (_states.get(_device_key(device)),) if s]
    for state in states:
        error = state.take_failure(wait=True)
        if error is not None:
            raise error


def poisoned(result: Any, valid: torch.Tensor) -> Any:
    """`result` (a tensor or a tuple of them) NaN wherever the call was invalid (`valid` a 0-d bool tensor)."""
    if isinstance(result, torch.Tensor):
        return torch.where(valid, result, torch.full((), float("nan"), dtype=result.dtype, device=result.device))
    return type(result)(poisoned(r, valid) if isinstance(r, torch.Tensor) and r.is_floating_point() else r
                        for r in result)


__all__ = ["Bound", "KvCacheIndexError", "MODE_ENV", "ReportRow", "SYNC_ENV", "Unique", "check_index_tensor",
           "check_pending_errors", "defer", "defer_report", "defer_written", "device_verdict", "host_checks",
           "poisoned", "raise_first", "raise_pending", "release_row", "report_row", "sync_checks"]
