"""Find plugins through Python entry points and load each one in isolation.

A plugin that fails to import or to register is recorded (stage, error, traceback, origin) and logged once as a
WARNING instead of taking the process down; the others keep working. The built-in vendors (entry points of the
`opdispatch` distribution itself) load first, and their namespaces are reserved: see `PluginRecord.namespaces`.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
import threading
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from opdispatch.base._entry_points import ENTRY_POINT_GROUP

from .hookspec import PLUGIN_API_CHANGES, PLUGIN_API_VERSION
ENV_ALLOW = "OPDISPATCH_PLUGINS"
ENV_DENY = "OPDISPATCH_DISABLE_PLUGINS"
ENV_TIMEOUT = "OPDISPATCH_PLUGIN_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
BUILTIN_DISTRIBUTION = "opdispatch"

log = logging.getLogger("opdispatch")


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
    builtin: bool = False
    # The vendor prefixes this plugin's implementation ids may use: its name, plus the plugin module's
    # OPDISPATCH_NAMESPACES (plugins/opdispatch/plugins/hookspec.py). A built-in plugin's namespaces are its own.
    namespaces: tuple[str, ...] = ()

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


def _is_builtin(ep: Any) -> bool:
    return getattr(getattr(ep, "dist", None), "name", None) == BUILTIN_DISTRIBUTION


def _timeout(environ: Any) -> float:
    raw = environ.get(ENV_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a positive number of seconds; e.g. {ENV_TIMEOUT}=30")
    return value


def _load_bounded(ep: Any, timeout: float) -> Any:
    """`ep.load()` in a daemon thread: a plugin whose import hangs (a driver probe at import time, a network
    mount) fails this plugin after `timeout` seconds instead of blocking the first op call forever."""
    result: dict[str, Any] = {}

    def load() -> None:
        try:
            result["plugin"] = ep.load()
        except BaseException as exc:  # noqa: BLE001 — handed to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=load, name=f"opdispatch-load-{ep.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"importing {ep.value!r} did not finish in {timeout:g} s (a hang at import time?); "
                           f"the import goes on in the background, unused. Raise {ENV_TIMEOUT} if it is only slow, "
                           f"or disable the plugin with {ENV_DENY}={ep.name}")
    if "error" in result:
        raise result["error"]
    return result["plugin"]


def check_plugin_api(plugin: Any, name: str) -> None:
    """A plugin may say which plugin API it was written for (`OPDISPATCH_PLUGIN_API`); missing means the current."""
    version = getattr(plugin, "OPDISPATCH_PLUGIN_API", PLUGIN_API_VERSION)
    if type(version) is int and version == PLUGIN_API_VERSION:
        return
    message = (f"plugin {name!r} declares OPDISPATCH_PLUGIN_API = {version!r}, but this opdispatch implements plugin "
               f"API {PLUGIN_API_VERSION}")
    if type(version) is int and 1 <= version < PLUGIN_API_VERSION:
        changes = "; ".join(f"API {v}: {PLUGIN_API_CHANGES[v]}" for v in range(version + 1, PLUGIN_API_VERSION + 1))
        raise ValueError(f"{message}, which changed since: {changes}. Update the plugin to API {PLUGIN_API_VERSION} "
                         f"(then set OPDISPATCH_PLUGIN_API = {PLUGIN_API_VERSION}; docs/plugins.md), or install the "
                         "opdispatch version it was written for")
    raise ValueError(f"{message}; install the opdispatch version the plugin was written for, or a plugin release "
                     "for this one")


def check_hooks(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """pluggy's `check_pending`: a hook implementation that matches no opdispatch hook (a misspelt name) fails
    its plugin here, with the names it could have meant, instead of loading as a plugin of 0 implementations."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        pm.unregister(plugin)
        known = [n for n in dir(pm.hook) if n.startswith("opdispatch_") and getattr(pm.hook, n).spec is not None]
        unknown = [n for n in dir(plugin) if n.startswith("opdispatch") and callable(getattr(plugin, n))
                   and n not in known and pm.parse_hookimpl_opts(plugin, n) is not None]
        hints = "; ".join(f"{n!r}: did you mean {difflib.get_close_matches(n, known, n=1) or known}?"
                          for n in unknown)
        raise ValueError(f"plugin {name!r} implements hook(s) opdispatch does not define ({hints or exc}); the "
                         f"hooks are {', '.join(known)} (plugins/opdispatch/plugins/hookspec.py)") from exc


def plugin_namespaces(plugin: Any, name: str) -> tuple[str, ...]:
    extra = getattr(plugin, "OPDISPATCH_NAMESPACES", ())
    if isinstance(extra, str) or not all(isinstance(n, str) and n for n in extra):
        raise ValueError(f"plugin {name!r}: OPDISPATCH_NAMESPACES must be a tuple of vendor names, got {extra!r}")
    return tuple(dict.fromkeys((name, *extra)))


def load_entry_point_plugins(
    pm: pluggy.PluginManager, entry_points: Iterable[Any] | None = None,
    environ: dict[str, str] | os._Environ[str] | None = None,
) -> list[PluginRecord]:
    """Import every entry point of the ``opdispatch.plugins`` group and register it with `pm`.

    ``OPDISPATCH_PLUGINS=a,b`` keeps only the named plugins; ``OPDISPATCH_DISABLE_PLUGINS=c`` drops the named
    ones (a name that matches no installed plugin is warned about, with the names there are). Returns one record
    per entry point found: the built-ins first, then the others, each by name.
    """
    environ = os.environ if environ is None else environ
    allow = _names(environ.get(ENV_ALLOW))
    deny = _names(environ.get(ENV_DENY)) or set()
    timeout = _timeout(environ)
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    entry_points = sorted(entry_points, key=lambda e: (not _is_builtin(e), e.name))
    installed = {ep.name for ep in entry_points}
    for env_name, names in ((ENV_ALLOW, allow or set()), (ENV_DENY, deny)):
        for unknown in sorted(names - installed):
            close = difflib.get_close_matches(unknown, sorted(installed), n=1)
            log.warning("%s names %r, which is no installed plugin%s; installed plugins: %s", env_name, unknown,
                        f" (did you mean {close[0]!r}?)" if close else "", ", ".join(sorted(installed)))
    records: list[PluginRecord] = []
    seen: set[str] = set()
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        record = PluginRecord(name=ep.name, value=ep.value, distribution=getattr(dist, "name", None),
                              version=getattr(dist, "version", None), builtin=_is_builtin(ep))
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
            plugin = _load_bounded(ep, timeout)
            check_plugin_api(plugin, ep.name)
            record.namespaces = plugin_namespaces(plugin, ep.name)
            pm.register(plugin, name=ep.name)
            check_hooks(pm, plugin, ep.name)
        except Exception as exc:  # a broken plugin must not break the others
            record.fail("load", exc)
            log.warning("%s", record.describe())
    return records
