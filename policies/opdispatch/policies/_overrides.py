"""Scoped overrides and the caller's module name, carried in ContextVars (safe across threads and asyncio tasks)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ._schema import check_impl_pattern, is_glob


@dataclass(frozen=True)
class Override:
    """One `policy_override(...)` scope. Hashable: the active stack is part of the decision cache key."""

    op: str | None
    prefer: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    require: tuple[str, ...] = ()
    pin: str | None = None
    where: str = "policy_override()"

    def applies_to(self, op: str) -> bool:
        return self.op is None or self.op == op


OVERRIDES: ContextVar[tuple[Override, ...]] = ContextVar("opdispatch_overrides", default=())
MODULE: ContextVar[str | None] = ContextVar("opdispatch_module", default=None)


def _patterns(name: str, values: Sequence[str] | str | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    out = []
    for value in values:
        try:
            out.append(check_impl_pattern(value))
        except ValueError as exc:
            raise ValueError(f"policy_override({name}=...): {exc}") from None
    return tuple(out)


def _caller() -> str:
    frame = sys._getframe(3)  # the `with` statement's frame (past contextmanager's __enter__ machinery)
    return f"policy_override() at {frame.f_code.co_filename}:{frame.f_lineno}"


@contextmanager
def policy_override(*, prefer: Sequence[str] | str | None = None, deny: Sequence[str] | str | None = None,
                    require: Sequence[str] | str | None = None, pin: str | None = None,
                    op: str | None = None) -> Iterator[Override | None]:
    """Change the policy inside a `with` block, for this thread or asyncio task only.

    Outranks env vars and YAML; the per-call ``impl=`` still outranks it. Nested scopes stack, the innermost
    first. ``op=None`` applies to every op.
    """
    if torch.compiler.is_dynamo_compiling():  # Dynamo cannot trace ContextVar.set: recorded instead (below)
        with traced_policy_override(prefer=prefer, deny=deny, require=require, pin=pin, op=op) as recorded:
            yield recorded
        return
    if pin is not None:
        (pin,) = _patterns("pin", [pin])
        if is_glob(pin):
            raise ValueError(f"policy_override(pin={pin!r}): a pin names exactly one implementation id, not a glob")
    override = Override(op=op, prefer=_patterns("prefer", prefer), deny=_patterns("deny", deny),
                        require=_patterns("require", require), pin=pin, where=_caller())
    token = OVERRIDES.set((override,) + OVERRIDES.get())
    try:
        yield override
    finally:
        OVERRIDES.reset(token)


@contextmanager
def scope(module: str) -> Iterator[str]:
    """Name the calling module (e.g. ``model.layers.3.self_attn``) so `when: {module: ...}` rules can target it."""
    if not isinstance(module, str) or not module:
        raise ValueError(f"scope(module={module!r}): give a non-empty dotted module name")
    if torch.compiler.is_dynamo_compiling():  # Dynamo cannot trace ContextVar.set: recorded instead (below)
        with traced_scope(module):
            yield module
        return
    token = MODULE.set(module)
    try:
        yield module
    finally:
        MODULE.reset(token)


# -- scope() and policy_override() inside a function torch.compile traces -------------------------------------

# Dynamo cannot trace ContextVar.set, so while it traces, `scope` and `policy_override` defer to these stand-ins,
# which record their arguments here (a plain list Dynamo tracks); each compiled op's call (core/opdispatch/compile/)
# passes the record to its decision and kernel, which enter the real context managers around it (`entered`).
TRACED_SCOPES: list[tuple[str, Any]] = []


@contextmanager
def traced_scope(module: str) -> Iterator[str]:
    """`scope` while Dynamo traces: recorded for the op calls traced inside it."""
    TRACED_SCOPES.append(("scope", module))
    try:
        yield module
    finally:
        TRACED_SCOPES.pop()


@contextmanager
def traced_policy_override(*, prefer: Any = None, deny: Any = None, require: Any = None, pin: Any = None,
                           op: Any = None) -> Iterator[None]:
    """`policy_override` while Dynamo traces: recorded for the op calls traced inside it. Its arguments are
    checked when a decision enters the real override; the ``as`` target is None here."""
    args = tuple((name, tuple(value) if isinstance(value, list) else value) for name, value in (
        ("prefer", prefer), ("deny", deny), ("require", require), ("pin", pin), ("op", op)))
    TRACED_SCOPES.append(("override", args))
    try:
        yield None
    finally:
        TRACED_SCOPES.pop()


@contextmanager
def entered(inner: tuple[Any, ...]) -> Iterator[None]:
    """Enter, for real, the scopes and overrides a traced function entered (as `TRACED_SCOPES` recorded them)."""
    with ExitStack() as stack:
        for kind, args in inner:
            stack.enter_context(scope(args) if kind == "scope" else policy_override(**dict(args)))
        yield
