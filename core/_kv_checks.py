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
  (argument, index, value) is copied non-blocking into pinned host memory behind a CUDA event, and the next
  KV-cache call on that device — or `check_pending_errors` — raises it as `KvCacheIndexError`.

A path that runs every step (``flash_attn_with_kvcache``'s bound path) reports more cheaply with `defer_flag`:
only the verdict goes to the host, with copies of the call's indices taken in stream order (the caller may change
its ``cache_seqlens`` in place right after the call); the message is worked out from those copies on the host,
by the same host check, only once the verdict says the call was bad (that read is the one sync, on the error
path only).
"""

from __future__ import annotations

import os
import threading
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
    """Record a `device_verdict` report: its first bad (rule, position, value) is copied to the host behind an
    event, for `raise_pending` / `check_pending_errors` to raise."""
    _record(*report)


@dataclass
class _Pending:
    fn: str
    rules: list[Rule]
    host: torch.Tensor  # (4,) int64: flagged, rule index, position, value; or (1,) bool: flagged (`describe`)
    event: Any  # a torch.cuda.Event (None: the copy is done)
    describe: Callable[[], str] | None = None  # `defer_flag`'s message, worked out once flagged


def defer_flag(fn: str, bad: torch.Tensor, describe: Callable[[], str], device: torch.device) -> None:
    """Record a call's device-side verdict `bad` (a 0-d bool tensor, True when an index was out of range),
    copied to the host behind an event; once it reads True, `describe()` gives the error's message (it may read
    the device: it runs on the error path only). The cheap form of `defer` (see the module docstring)."""
    event = None
    if device.type == "cuda":
        host = torch.empty(1, dtype=torch.bool, pin_memory=True)
        host.copy_(bad.view(1), non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    else:
        host = bad.view(1).to("cpu", copy=True)
    with _lock:
        _pending.setdefault(_device_key(device), []).append(_Pending(fn, [], host, event, describe))


_pending: dict[torch.device, list[_Pending]] = {}
_lock = threading.Lock()


def _device_key(device: torch.device | str) -> torch.device:
    """One key per device: ``cuda`` is the current CUDA device (``torch.device("cuda") != torch.device("cuda:0")``,
    so a check recorded under cuda:0 would be missed by a look-up under cuda)."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _record(fn: str, rules: list[Rule], report: torch.Tensor, device: torch.device) -> None:
    event = None
    if device.type == "cuda":
        host = torch.empty(4, dtype=torch.long, pin_memory=True)
        host.copy_(report, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    else:
        host = report.to("cpu", copy=True)
    # Only what the message needs is kept: the rules' names and texts, not their (possibly large) tensors.
    kept = [_described(rule) for rule in rules]
    with _lock:
        _pending.setdefault(_device_key(device), []).append(_Pending(fn, kept, host, event))


def _described(rule: Rule) -> Rule:
    if isinstance(rule, Unique):
        return Unique(rule.name, rule.keys.new_empty(0), rule.allowed, rule.fix, rule.divisor)
    meta = rule.values.new_empty((0, rule.values.shape[1]) if rule.values.dim() > 1 else (0,))
    return Bound(rule.name, meta, 0, 0, rule.allowed, rule.fix)


def _take_flagged(device: torch.device | None, wait: bool) -> KvCacheIndexError | None:
    """The first flagged error among the finished checks (all of them with `wait`), dropping finished ones."""
    with _lock:
        devices = list(_pending) if device is None else [device]
        for dev in devices:
            keep, found = [], None
            for entry in _pending.get(dev, []):
                if entry.event is not None and not entry.event.query():
                    if not wait:
                        keep.append(entry)
                        continue
                    entry.event.synchronize()
                if found is None and int(entry.host[0]):
                    if entry.describe is not None:
                        message = entry.describe()
                    else:
                        rule = entry.rules[int(entry.host[1])]
                        message = rule.message(entry.fn, int(entry.host[2]), int(entry.host[3]))
                    found = KvCacheIndexError(f"an earlier KV-cache call on {dev} had a bad index, found on the "
                                              f"device (that call wrote nothing and returned NaN): {message}")
            if keep:
                _pending[dev] = keep
            else:
                _pending.pop(dev, None)
            if found is not None:
                return found
    return None


def raise_pending(device: torch.device) -> None:
    """Raise the error of an earlier call on `device` whose device-side check has finished and failed (no sync:
    checks still running stay pending). Called at the start of every KV-cache call."""
    if _pending:
        error = _take_flagged(_device_key(device), wait=False)
        if error is not None:
            raise error


def check_pending_errors(device: torch.device | str | None = None) -> None:
    """Wait for every pending device-side KV-cache index check (on `device`, or all) and raise the first failure
    as `KvCacheIndexError`; returns None when every checked call was valid."""
    if _pending:
        error = _take_flagged(_device_key(device) if device is not None else None, wait=True)
        if error is not None:
            raise error


def poisoned(result: Any, valid: torch.Tensor) -> Any:
    """`result` (a tensor or a tuple of them) NaN wherever the call was invalid (`valid` a 0-d bool tensor)."""
    if isinstance(result, torch.Tensor):
        return torch.where(valid, result, torch.full((), float("nan"), dtype=result.dtype, device=result.device))
    return type(result)(poisoned(r, valid) if isinstance(r, torch.Tensor) and r.is_floating_point() else r
                        for r in result)


__all__ = ["Bound", "KvCacheIndexError", "MODE_ENV", "SYNC_ENV", "Unique", "check_index_tensor",
           "check_pending_errors", "defer", "defer_flag", "device_verdict", "host_checks", "poisoned", "raise_first",
           "raise_pending", "sync_checks"]
