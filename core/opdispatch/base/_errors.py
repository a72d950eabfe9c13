"""Exceptions raised by opdispatch.

Every error carries the offending object and says what failed, the bad value, what is allowed and how to fix it.
The two that carry a `Decision` (`NoImplementationError`, `PinnedImplementationError`) live beside it, in
`_decision.py`: this module, at the bottom of the layers, imports nothing of opdispatch.
"""

from __future__ import annotations

from typing import Any


class OpDispatchError(Exception):
    """Base class of every error opdispatch raises on purpose."""


class RegistrationError(OpDispatchError, ValueError):
    """An implementation could not be registered (bad declaration, duplicate id)."""

    def __init__(self, message: str, *, impl: Any = None) -> None:
        super().__init__(message)
        self.impl = impl


class PolicyError(OpDispatchError, ValueError):
    """A policy file is malformed: the message names the file, the line and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None, problems: tuple[PolicyError, ...] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field
        # Every problem found in the file (this error names the first): `opdispatch policy lint` reports them all.
        self.problems = problems or (self,)


class DeviceDescriptorError(OpDispatchError, ValueError):
    """A device descriptor YAML file is malformed."""


class PluginLoadError(OpDispatchError, RuntimeError):
    """A plugin failed to load or register; kept with its traceback and origin."""
