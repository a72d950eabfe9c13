"""Thread-safe registry of implementations per op, each remembered with where it came from."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ..base._errors import RegistrationError
from ..base._impl import Impl
from ..base._ops import known_ops, op_spec
from opdispatch.plugins.hookspec import PLUGIN_API_CHANGES, PLUGIN_API_VERSION


@dataclass(frozen=True)
class Origin:
    """Where an implementation was registered from: the plugin (entry-point name) and the Python module."""

    plugin: str
    module: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} (module {self.module})"


@dataclass(frozen=True)
class Registered:
    impl: Impl
    origin: Origin


class Registry:
    """Implementations per op. Registering an id twice is an error that names both origins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_op: dict[str, dict[str, Registered]] = {}

    def register(self, impl: Impl, origin: Origin) -> None:
        self.register_all([(impl, origin)])

    def register_all(self, entries: list[tuple[Impl, Origin]]) -> None:
        """Register every entry or none: one refused implementation (an invalid declaration, an id registered
        before or twice in `entries`) raises RegistrationError and leaves the registry as it was."""
        for impl, origin in entries:
            self._check(impl, origin)
        with self._lock:
            pending: dict[tuple[str, str], Origin] = {}
            for impl, origin in entries:
                existing = self._by_op.get(impl.op, {}).get(impl.id)
                first = existing.origin if existing is not None else pending.get((impl.op, impl.id))
                if first is not None:
                    raise RegistrationError(
                        f"implementation id {impl.id!r} for op {impl.op!r} is registered twice: first by "
                        f"{first}, again by {origin}; give one of them another vendor or name, or disable "
                        "one plugin with OPDISPATCH_DISABLE_PLUGINS", impl=impl)
                pending[(impl.op, impl.id)] = origin
            for impl, origin in entries:
                self._by_op.setdefault(impl.op, {})[impl.id] = Registered(impl, origin)

    def _check(self, impl: Impl, origin: Origin) -> None:
        if not isinstance(impl, Impl):
            raise RegistrationError(
                f"{origin} registered {impl!r} ({type(impl).__name__}), which is not an opdispatch.Impl instance; "
                "subclass the op's base class (opdispatch.AttentionImpl, opdispatch.RmsNormImpl, …) and register an "
                "instance", impl=impl)
        problems = impl.check_declaration()
        op = str(getattr(impl, "op", ""))
        if not problems and op not in known_ops():
            problems = [f"op={op!r} is not a known op; known ops: {', '.join(known_ops())}"]
        elif not problems and not isinstance(impl, op_spec(op).impl_base):
            base = op_spec(op).impl_base
            problems = [f"an implementation of op {op!r} must subclass opdispatch.{base.__name__}"]
        if problems:
            raise RegistrationError(
                f"{origin} registered {type(impl).__module__}.{type(impl).__qualname__} with an invalid "
                "declaration: " + "; ".join(problems) + _undeclared_api_hint(impl), impl=impl)

    def get(self, op: str, impl_id: str) -> Registered | None:
        return self._by_op.get(op, {}).get(impl_id)

    def for_op(self, op: str) -> list[Registered]:
        """Snapshot of the implementations of `op`, highest priority first, then by id."""
        with self._lock:
            items = list(self._by_op.get(op, {}).values())
        items.sort(key=lambda r: (-r.impl.priority, r.impl.id))
        return items

    def ops(self) -> list[str]:
        with self._lock:
            return sorted(self._by_op)

    def __iter__(self) -> Iterator[Registered]:
        for op in self.ops():
            yield from self.for_op(op)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_op.values())


def _undeclared_api_hint(impl: Impl) -> str:
    """A plugin module that states no `OPDISPATCH_PLUGIN_API` is held to the current plugin API, so a plugin
    written for an older one fails here rather than at the version check: name what changed since, which is
    usually why its declaration is now invalid."""
    module_name = type(impl).__module__
    module = sys.modules.get(module_name)
    if module is None or hasattr(module, "OPDISPATCH_PLUGIN_API") or module_name.startswith("opdispatch."):
        return ""
    changes = "; ".join(f"API {version}: {text}" for version, text in sorted(PLUGIN_API_CHANGES.items()))
    return (f". ({module_name} declares no OPDISPATCH_PLUGIN_API, so it is held to the current plugin API "
            f"{PLUGIN_API_VERSION}; if it was written for an older one, what changed since: {changes}. Update it "
            f"and declare OPDISPATCH_PLUGIN_API = {PLUGIN_API_VERSION}; docs/plugins.md)")
