"""Find plugins through Python entry points and load each one in isolation.

A plugin that fails to import or to register is recorded (stage, error, traceback, origin) instead of taking
the process down; the others keep working.
"""

from __future__ import annotations

import importlib.metadata
import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

ENTRY_POINT_GROUP = "opdispatch.plugins"
ENV_ALLOW = "OPDISPATCH_PLUGINS"
ENV_DENY = "OPDISPATCH_DISABLE_PLUGINS"


@dataclass
class PluginRecord:
    """What happened to one plugin: loaded, disabled by env, or failed (with the stage and traceback)."""

    name: str
    value: str
    distribution: str | None = None
    version: str | None = None
    status: str = "loaded"  # loaded | disabled | failed
    stage: str | None = None  # load | register | probe, where it failed
    error: str | None = None
    traceback: str | None = None
    impl_ids: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        dist = f" from {self.distribution} {self.version}" if self.distribution else ""
        return f"{self.name} = {self.value}{dist}"

    def fail(self, stage: str, exc: BaseException) -> None:
        self.status = "failed"
        self.stage = stage
        self.error = f"{type(exc).__name__}: {exc}"
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

    def describe(self) -> str:
        if self.status == "failed":
            return f"plugin {self.name!r} ({self.origin}) failed to {self.stage}: {self.error}"
        if self.status == "disabled":
            return f"plugin {self.name!r} ({self.origin}) is disabled: {self.error}"
        return f"plugin {self.name!r} ({self.origin}) loaded"


def _names(env_value: str | None) -> set[str] | None:
    if env_value is None or not env_value.strip():
        return None
    return {n.strip() for n in env_value.split(",") if n.strip()}


def load_entry_point_plugins(
    pm: pluggy.PluginManager, entry_points: Iterable[Any] | None = None,
    environ: dict[str, str] | os._Environ[str] | None = None,
) -> list[PluginRecord]:
    """Import every entry point of the ``opdispatch.plugins`` group and register it with `pm`.

    ``OPDISPATCH_PLUGINS=a,b`` keeps only the named plugins; ``OPDISPATCH_DISABLE_PLUGINS=c`` drops the named
    ones. Returns one record per entry point found, in a stable order.
    """
    environ = os.environ if environ is None else environ
    allow = _names(environ.get(ENV_ALLOW))
    deny = _names(environ.get(ENV_DENY)) or set()
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    records: list[PluginRecord] = []
    seen: set[str] = set()
    for ep in sorted(entry_points, key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        record = PluginRecord(name=ep.name, value=ep.value,
                              distribution=getattr(dist, "name", None), version=getattr(dist, "version", None))
        records.append(record)
        if ep.name in seen:
            record.status, record.error = "disabled", "another entry point already uses this name"
            continue
        seen.add(ep.name)
        if allow is not None and ep.name not in allow:
            record.status, record.error = "disabled", f"not listed in {ENV_ALLOW}={','.join(sorted(allow))}"
            continue
        if ep.name in deny:
            record.status, record.error = "disabled", f"listed in {ENV_DENY}"
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not break the others
            record.fail("load", exc)
    return records
