"""A decision lockfile: record which implementation every call class got, replay it, and report drift.

``opdispatch decisions export FILE`` (or ``opdispatch.export_decisions(FILE)`` for the classes this process
decided) writes YAML: per decided class its op, its class key as text, an example call, the implementation, that
implementation's versions (its plugin's distribution and the libraries it requires), what decided it, and — for
the command, which decides the cases of a ``--preset``/``--shapes`` set — the case, so that ``diff`` can decide it
again. The file's head holds the device fingerprint and library versions (`opdispatch.base._fingerprint`).

``OPDISPATCH_DECISIONS=FILE`` replays it. Precedence, for a class the file records:

1. a **pin** (``impl=``, ``OPDISPATCH_IMPL_<OP>``, a policy or scope pin) wins: the file is not consulted;
2. a **deny** of the active policy (a quarantine included) wins: a denied implementation is never replayed;
3. the recorded implementation is chosen while it **can take the call** — registered, available on the device,
   no capability reason against the call, not demoted by the breaker — with provenance ``lockfile FILE``;
4. otherwise the policy decides as it would without the file.

Drift — a recorded implementation that is gone, changed version, cannot take the call or is denied now, a class
that would decide differently without the file — is logged in one WARNING per process (at the first drift,
listing every drifting class known then: those found by checking the file's implementations against this
process, and the class being decided); later drifts log at INFO. ``lock.drift`` holds them all, and
``opdispatch decisions diff FILE`` lists them (deciding the recorded cases again). A class the file does not
record decides as usual.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..base._decision import CHOSEN, DEMOTED, ELIGIBLE, Provenance
from ..base._errors import OpDispatchError
from ._stats import decision_class_text

__all__ = ["ENV_DECISIONS", "DecisionLock", "Drift", "LockEntry", "diff_decisions", "export_decisions", "impl_versions",
           "load_lock", "lock_entries", "write_lock"]

log = logging.getLogger("opdispatch")

ENV_DECISIONS = "OPDISPATCH_DECISIONS"
LOCK_VERSION = 1
LOCKFILE = "lockfile"  # the Provenance kind of a replayed decision


@dataclass(frozen=True)
class LockEntry:
    """One recorded class: what decided it, and enough to recognise (and, with `case`, rebuild) it."""

    op: str
    decision_class: str
    device_type: str
    implementation: str
    versions: dict[str, str]
    example: str = ""
    decided_by: str = ""
    case: dict[str, Any] | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.device_type, self.decision_class)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "class": self.decision_class, "device_type": self.device_type,
                               "implementation": self.implementation, "versions": dict(self.versions),
                               "example": self.example, "decided_by": self.decided_by}
        if self.case is not None:
            out["case"] = dict(self.case)
        return out


@dataclass(frozen=True)
class Drift:
    """One class that does not decide as recorded (or whose implementation changed)."""

    op: str
    decision_class: str
    recorded: str
    now: str | None  # what decides it now (None: unknown without a call, or nothing can)
    why: str

    def describe(self) -> str:
        now = f" -> {self.now}" if self.now is not None and self.now != self.recorded else ""
        return f"{self.op} [{self.decision_class}]: recorded {self.recorded}{now}: {self.why}"


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def impl_versions(impl: Any, device: Any) -> dict[str, str]:
    """What a change of `impl` shows in: the version of the distribution its module comes from, and of each
    library it requires (a simulated device's `libraries` for those; absent: ``not installed``)."""
    versions: dict[str, str] = {}
    top = (type(impl).__module__ or "").split(".")[0]
    for dist in _distributions().get(top, []):
        version = _dist_version(dist)
        if version is not None:
            versions[dist] = version
    for requirement in getattr(impl, "requires", ()):
        key = requirement.library_key
        if device.simulated:
            found = device.libraries.get(key)
        else:
            found = _dist_version(requirement.distribution)
        versions[key] = str(found) if found is not None else "not installed"
    return versions


def lock_entries(manager: Any) -> list[LockEntry]:
    """Every class `manager`'s installed state decided (not those of an ``impl=`` argument, nor a decision that
    stands for one signature while the breaker demotes another kernel there), first decided first."""
    entries: dict[tuple[str, str, str], LockEntry] = {}
    for decision in list(manager.state.decisions.values()):
        key = decision.cache_key
        if decision.chosen is None or key is None or key[3] is not None or decision.signature is not None:
            continue
        entry = _entry(decision)
        entries.setdefault(entry.key, entry)
    return list(entries.values())


def _entry(decision: Any, case: dict[str, Any] | None = None) -> LockEntry:
    return LockEntry(decision.op, decision_class_text(decision.cache_key), decision.device.type,
                     decision.chosen_id, impl_versions(decision.chosen, decision.device), decision.call,
                     str(decision.decided_by) if decision.decided_by else "", case)


def write_lock(path: str | os.PathLike[str], entries: list[LockEntry], device: Any, policy: Any) -> Path:
    """Write `entries` as a lockfile at `path` (the file is written whole, after everything is known)."""
    from ..base._fingerprint import device_fingerprint

    data = {"version": LOCK_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "fingerprint": device_fingerprint(device) if device is not None else {},
            "policy": {"source": policy.source, "hash": policy.hash},
            "decisions": [e.to_dict() for e in entries]}
    target = Path(path)
    text = ("# opdispatch decisions lockfile: replay with OPDISPATCH_DECISIONS=<this file>, compare with "
            "`opdispatch decisions diff <this file>`\n" + yaml.safe_dump(data, sort_keys=False, width=120))
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target


def export_decisions(path: str | os.PathLike[str], manager: Any) -> list[LockEntry]:
    """`opdispatch.export_decisions` for a given `manager` (the public one, whose default is the process-wide
    manager, is core/opdispatch/engine/_current.py's)."""
    entries = lock_entries(manager)
    if not entries:
        raise ValueError(f"export_decisions({str(path)!r}): this process has decided no call class yet; run the "
                         "model (or `opdispatch decisions export FILE --preset ...`) first")
    devices = {d.device.key: d.device for d in manager.state.decisions.values()}
    write_lock(path, entries, next(iter(devices.values())), manager.policy)
    return entries


_ENTRY_FIELDS = {"op", "class", "device_type", "implementation", "versions", "example", "decided_by", "case"}


def load_lock(path: str | os.PathLike[str]) -> DecisionLock:
    """Read a lockfile; OpDispatchError naming the file, the entry and the field when it is not one."""
    where = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise OpDispatchError(f"decision lockfile {where}: cannot read it ({exc.strerror}); write one with "
                              "`opdispatch decisions export FILE`") from exc
    except yaml.YAMLError as exc:
        raise OpDispatchError(f"decision lockfile {where}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict) or data.get("version") != LOCK_VERSION or not isinstance(
            data.get("decisions"), list):
        raise OpDispatchError(f"decision lockfile {where}: expected a mapping with version: {LOCK_VERSION} and a "
                              "`decisions:` list (what `opdispatch decisions export` writes)")
    entries = []
    for i, item in enumerate(data["decisions"]):
        if not isinstance(item, dict):
            raise OpDispatchError(f"decision lockfile {where}: decisions[{i}] is {type(item).__name__}, not a mapping")
        unknown = set(item) - _ENTRY_FIELDS
        missing = {"op", "class", "device_type", "implementation"} - set(item)
        if unknown or missing:
            raise OpDispatchError(f"decision lockfile {where}: decisions[{i}]: "
                                  + (f"unknown fields {sorted(unknown)}; " if unknown else "")
                                  + (f"missing fields {sorted(missing)}; " if missing else "")
                                  + f"allowed: {', '.join(sorted(_ENTRY_FIELDS))}")
        strings = [item[k] for k in ("op", "class", "device_type", "implementation")]
        versions = item.get("versions") or {}
        case = item.get("case")
        if not all(isinstance(s, str) for s in strings) or not isinstance(versions, dict) or not (
                case is None or isinstance(case, dict)):
            raise OpDispatchError(f"decision lockfile {where}: decisions[{i}]: op, class, device_type and "
                                  "implementation must be strings, versions and case mappings")
        op, decision_class, device_type, implementation = strings
        entries.append(LockEntry(op, decision_class, device_type, implementation,
                                 {str(k): str(v) for k, v in versions.items()}, str(item.get("example", "")),
                                 str(item.get("decided_by", "")), case))
    fingerprint = data.get("fingerprint") or {}
    return DecisionLock(where, entries, {str(k): str(v) for k, v in dict(fingerprint).items()})


@dataclass
class DecisionLock:
    """A loaded lockfile, replayed by the manager's decisions (`steer`), with the drift it found."""

    source: str
    entries: list[LockEntry]
    fingerprint: dict[str, str] = field(default_factory=dict)
    drift: dict[tuple[str, str, str], Drift] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], LockEntry] = {}
        for entry in self.entries:
            self._by_key.setdefault(entry.key, entry)
        self._lock = threading.Lock()
        self._warned = False
        self._checked: set[Any] = set()  # device keys whose implementations were checked against the file

    def entry(self, op: str, device_type: str, decision_class: str) -> LockEntry | None:
        return self._by_key.get((op, device_type, decision_class))

    def check_implementations(self, manager: Any, state: Any, device: Any) -> list[Drift]:
        """The entries for `device`'s type whose implementation is gone, cannot run on `device` or changed
        version — found without a call."""
        found = []
        for entry in self.entries:
            if entry.device_type != device.type:
                continue
            impl = state.impls.get(entry.op, {}).get(entry.implementation)
            if impl is None:
                found.append(Drift(entry.op, entry.decision_class, entry.implementation, None,
                                   f"{entry.implementation} is not registered now"))
                continue
            reason = manager.availability(impl, device, state)
            if reason is not None:
                found.append(Drift(entry.op, entry.decision_class, entry.implementation, None,
                                   f"{entry.implementation} is unavailable on {device.describe()}: {reason}"))
                continue
            changed = _version_change(entry.versions, impl_versions(impl, device))
            if changed:
                found.append(Drift(entry.op, entry.decision_class, entry.implementation, entry.implementation,
                                   f"{entry.implementation} changed version: {changed}"))
        return found

    def steer(self, manager: Any, state: Any, op: str, key: Any, device: Any, candidates: list[Any],
              impls: dict[str, Any], chosen: Any, decided_by: Any) -> tuple[Any, Any]:
        """The decision of one class under the file: (chosen implementation, its provenance), the policy's own
        when the file does not record the class or its implementation cannot take the call (see the module
        docstring); records and reports drift."""
        found: list[Drift] = []
        with self._lock:
            if device.key not in self._checked:
                self._checked.add(device.key)
                found = [d for d in self.check_implementations(manager, state, device)
                         if (d.op, device.type, d.decision_class) not in self.drift]
                for d in found:
                    self.drift[(d.op, device.type, d.decision_class)] = d
        text = decision_class_text(key)
        entry = self.entry(op, device.type, text)
        natural = chosen.id if chosen is not None else None
        drift: Drift | None = None
        if entry is not None:
            recorded = entry.implementation
            candidate = next((c for c in candidates if c.impl_id == recorded), None)
            if candidate is not None and candidate.status in (ELIGIBLE, CHOSEN):
                if recorded != natural:
                    drift = Drift(op, text, recorded, natural, f"the policy would choose {natural} now; replaying "
                                  f"{recorded} (it can take the call)")
                    for c in candidates:
                        if c.status == CHOSEN:
                            c.status = ELIGIBLE
                    candidate.status = CHOSEN
                prov = Provenance(LOCKFILE, self.source, note=f"recorded decision of {recorded}")
                candidate.decided_by = prov
                chosen, decided_by = impls[recorded], prov
            elif candidate is None:
                drift = Drift(op, text, recorded, natural, f"{recorded} is not registered now")
            elif candidate.status == DEMOTED:
                log.info("%s: %s (recorded in %s) is demoted by the breaker for [%s]; %s takes the call",
                         op, recorded, self.source, text, natural)
            else:
                drift = Drift(op, text, recorded, natural, f"{recorded} is {candidate.status} now: "
                              + "; ".join(candidate.reasons))
        with self._lock:
            if drift is not None and (op, device.type, text) not in self.drift:
                self.drift[(op, device.type, text)] = drift
                found.append(drift)
            loud = bool(found) and not self._warned
            if loud:
                self._warned = True
        if found:
            lines = "\n".join(f"  - {d.describe()}" for d in found)
            log.log(logging.WARNING if loud else logging.INFO,
                    "decision lockfile %s (%s): %d class(es) drifted from the recorded decisions:\n%s\n"
                    "Run `opdispatch decisions diff %s` for every recorded class; re-export the file once the "
                    "change is intended.%s", self.source, ENV_DECISIONS, len(found), lines, self.source,
                    " Later drift logs at INFO." if loud else "")
        return chosen, decided_by


def _version_change(recorded: dict[str, str], now: dict[str, str]) -> str:
    changes = [f"{k} {recorded.get(k, 'absent')} -> {now.get(k, 'absent')}"
               for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k)]
    return ", ".join(changes)


def lock_from_environ(environ: Any) -> DecisionLock | None:
    path = environ.get(ENV_DECISIONS, "").strip()
    return load_lock(path) if path else None


def _case_call(entry: LockEntry, device: Any) -> Any:
    """The validated call of an entry's recorded case, on `device` (tensors without data for a simulated one)."""
    import torch

    from ..base._cases import tuning_of

    tuning = tuning_of(entry.op)
    assert entry.case is not None
    case_type: Any = tuning.case
    case = case_type.from_dict(dict(entry.case), where=f"{entry.op} [{entry.decision_class}]: case: ")
    where = torch.device("meta") if device.simulated else torch.device(device.type, device.index or 0)
    return tuning.validate(**case.inputs(where, None))


def diff_decisions(path: str | os.PathLike[str], manager: Any, device: Any = None) -> list[Drift]:
    """`opdispatch.diff_decisions` for a given `manager` (the public one, whose default is the process-wide
    manager, is core/opdispatch/engine/_current.py's)."""
    from ..base._device import resolve_device
    from opdispatch.policies._overrides import OVERRIDES

    lock = load_lock(path)
    manager.ensure_initialized()
    info: Any = resolve_device(device) if device is not None else manager.device_info(_local_device())
    saved, manager.lock = manager.lock, None  # what the policy decides without the file
    try:
        state = manager.state
        found = {(d.op, d.decision_class): d for d in lock.check_implementations(manager, state, info)}
        for entry in lock.entries:
            if entry.device_type != info.type or entry.case is None or (entry.op, entry.decision_class) in found:
                continue
            call = _case_call(entry, info)
            decision = manager.explain(entry.op, call, device=info)
            text = decision_class_text(manager._cache_key(entry.op, call, info, None, OVERRIDES.get(), state))
            if text != entry.decision_class:
                found[(entry.op, entry.decision_class)] = Drift(
                    entry.op, entry.decision_class, entry.implementation, decision.chosen_id,
                    f"its case [{entry.example}] falls into another class now: [{text}]")
            elif decision.chosen_id != entry.implementation:
                found[(entry.op, entry.decision_class)] = Drift(
                    entry.op, entry.decision_class, entry.implementation, decision.chosen_id,
                    f"the policy chooses {decision.chosen_id or 'nothing'} now (decided by {decision.decided_by})")
    finally:
        manager.lock = saved
    return list(found.values())


def _local_device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
