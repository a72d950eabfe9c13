"""The process-wide manager — created on first use, replaced by `set_manager` — and the public functions that act
on it by default (`stats`, `shadow_flush`, `export_decisions`, `diff_decisions`).

The top of the engine: it builds on `OpManager` (`_manager`) and the modules whose functions it wraps, and none of
them imports it. The front doors (core/opdispatch/doors/_api.py) read the manager as a module global of their own, kept
equal to this one through `on_manager_change`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from opdispatch import policies as _policies
from ..base import _native
from . import _decisions_lock, _shadow, _stats
from ._decisions_lock import Drift, LockEntry
from ._manager import OpManager

__all__ = ["diff_decisions", "export_decisions", "get_manager", "on_manager_change", "set_manager", "shadow_flush",
           "stats"]

_manager: OpManager | None = None
_manager_lock = threading.Lock()
_listeners: list[Callable[[OpManager | None], None]] = []


if hasattr(os, "register_at_fork"):  # a thread holding it at fork time does not exist in the child
    os.register_at_fork(after_in_child=lambda: globals().__setitem__("_manager_lock", threading.Lock()))


def get_manager() -> OpManager:
    """The process-wide OpManager (created on first use; plugins load lazily)."""
    manager = _manager
    if manager is None:
        with _manager_lock:
            if _manager is None:
                _install(OpManager())
            manager = _manager
            assert manager is not None
    return manager


def set_manager(manager: OpManager | None) -> OpManager | None:
    """Replace the process-wide manager (tests, embedding); returns the previous one."""
    with _manager_lock:
        previous = _manager
        _install(manager)
    _native.forget()  # the compiled front doors' entries hold the old manager's kernels
    return previous


def on_manager_change(listener: Callable[[OpManager | None], None]) -> None:
    """Call `listener(manager)` now and whenever the process-wide manager is created or replaced."""
    _listeners.append(listener)
    listener(_manager)


_policies._process_manager.append(lambda: _manager)  # opdispatch.policies.reload() reloads it


def _install(manager: OpManager | None) -> None:
    global _manager
    _manager = manager
    for listener in _listeners:
        listener(manager)


def stats(reset: bool = False, manager: OpManager | None = None) -> _stats.UsageSnapshot:
    """A snapshot of the usage counters of `manager` (default: the process-wide one) and of the front doors'
    fast-path hits; `reset=True` starts every counter over after taking it (see core/opdispatch/engine/_stats.py)."""
    return _stats.stats(reset, manager if manager is not None else get_manager())


def shadow_flush(timeout: float | None = None, manager: OpManager | None = None) -> bool:
    """Wait until the shadow checks queued so far have finished (``OPDISPATCH_SHADOW``), at most `timeout`
    seconds (None: as long as they take); returns whether all have. True at once when shadow checks are off."""
    return _shadow.shadow_flush(timeout, manager if manager is not None else get_manager())


def export_decisions(path: str | os.PathLike[str], manager: OpManager | None = None) -> list[LockEntry]:
    """Write every class this process decided (see `_decisions_lock.lock_entries`) to the lockfile `path`;
    returns the entries. ValueError when nothing was decided yet (an empty lockfile would replay nothing)."""
    return _decisions_lock.export_decisions(path, manager if manager is not None else get_manager())


def diff_decisions(path: str | os.PathLike[str], manager: OpManager | None = None,
                   device: Any = None) -> list[Drift]:
    """The drift of lockfile `path` against this process, without replaying it: recorded implementations that
    are gone, unavailable on `device` (a DeviceInfo or descriptor path; default: the local accelerator, else the
    CPU) or changed version, and — for entries with a recorded case — classes the policy decides differently now
    (or that fall into another class). Entries of another device type than `device`'s are not compared."""
    return _decisions_lock.diff_decisions(path, manager if manager is not None else get_manager(), device)
