"""`consistent()` and `local()`: turn agreement of new decisions across a torch.distributed group on and off for
the process-wide manager (or a given one). The rule itself is the engine's (core/opdispatch/engine/_agreement.py).
"""

from __future__ import annotations

from typing import Any

from ..engine._agreement import AgreementError, GroupAgreement, forget_local
from ..engine._current import get_manager
from ..engine._manager import OpManager

__all__ = ["consistent", "local"]


class _Switch:
    """What `consistent()`/`local()` return: the setting is on at once; as a context manager it is undone on
    exit."""

    def __init__(self, manager: OpManager, previous: GroupAgreement | None) -> None:
        self._manager, self._previous = manager, previous

    @property
    def agreement(self) -> GroupAgreement | None:
        agreement: GroupAgreement | None = self._manager.agreement
        return agreement

    def __enter__(self) -> GroupAgreement | None:
        return self.agreement

    def __exit__(self, *exc: object) -> None:
        self._manager.agreement = self._previous
        if self._previous is not None:
            forget_local(self._manager)


def consistent(group: Any = None, *, manager: OpManager | None = None) -> _Switch:
    """Agree every new decision of this process's manager across `group` (None: the default group) from now on
    — or inside ``with consistent(...):``. Call it on every rank of the group: agreement is collective (every
    rank must make the same new decisions in the same order). Also ``OPDISPATCH_DISTRIBUTED=consistent``.

    Decisions made before (or inside `local()`) are decided again, collectively, at their class's next call;
    plans (`opdispatch.plan`, `opdispatch.Attention`) bound before keep their kernel. Raises AgreementError when
    torch.distributed is not initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise AgreementError("opdispatch.distributed.consistent(): torch.distributed is not initialised in this "
                             "process. Fix: call torch.distributed.init_process_group(...) first (or launch with "
                             "torchrun)")
    manager = manager if manager is not None else get_manager()
    previous = manager.agreement
    manager.agreement = GroupAgreement(group)
    forget_local(manager)
    return _Switch(manager, previous)


def local(*, manager: OpManager | None = None) -> _Switch:
    """Decide on this rank alone from now on, or inside ``with local():`` (rank-specific code: evaluation on
    rank 0, ...). What is decided there stays out of the group's decisions: on leaving the block (or at the next
    `consistent()`) those classes are decided again, collectively, at their next call."""
    manager = manager if manager is not None else get_manager()
    switch = _Switch(manager, manager.agreement)
    manager.agreement = None
    return switch
