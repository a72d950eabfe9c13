"""The tuned table: a policy input (``ops.<op>.autotune: <path>``) written by `opdispatch tune`
(core/opdispatch/tools/_tuning.py).

It lives with the policy because the plan reads it (policies/opdispatch/policies/_plan.py, the ``autotune`` layer);
measuring lives next to the bench command. A table records its op (tables without one are attention's, as before the
field) and is keyed by a fingerprint of the device, its driver and the library versions; a table whose fingerprint
differs from the running process is stale and ignored with a warning. A lookup matches the discrete features of a call
exactly (the op's `TuningSpec.discrete`, e.g. attention's dtype, dense/varlen, head_dim, heads, causal, window?,
softcap?, requires_grad) and blends the nearest buckets in log2 space of its sizes (attention's seqlen_q,
seqlen_k, batch), so shapes between tuned buckets get a weighted verdict of their neighbours.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from opdispatch.base._fingerprint import device_fingerprint, fingerprint_hash
from opdispatch.base._ops import REQUIRED, TuningSpec, known_ops, op_spec, tunable_ops

log = logging.getLogger("opdispatch")

FORMAT = "opdispatch-tuned/1"
DEFAULT_OP = "attention"  # the op of tables written before they recorded one

__all__ = ["FORMAT", "TunedEntry", "TunedTable", "tuned_table_for"]


class _TableModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = Field(pattern=f"^{FORMAT}$")
    op: str = DEFAULT_OP
    fingerprint: dict[str, str]
    fingerprint_hash: str = ""
    created: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)
    entries: list[dict[str, Any]] = Field(default_factory=list)


@lru_cache(maxsize=None)
def _entry_model(op: str) -> type[BaseModel]:
    """The schema of one entry of `op`'s tables: its bucket features, then the measured ranking."""
    tuning = _tuning(op)
    fields: dict[str, Any] = {}
    for feature in tuning.discrete:
        fields[feature.name] = (feature.kind, ... if feature.default is REQUIRED else feature.default)
    for name in tuning.sizes:
        fields[name] = (int, Field(ge=1))
    fields.update(order=(list[str], Field(min_length=1)), median_us=(dict[str, float], Field(default_factory=dict)),
                  failed=(dict[str, str], Field(default_factory=dict)), shape=(str, ""))
    model: type[BaseModel] = create_model(f"{op}_tuned_entry", __config__=ConfigDict(extra="forbid"), **fields)
    return model


def _tuning(op: str) -> TuningSpec:
    if op not in known_ops():
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(known_ops())}")
    tuning = op_spec(op).tuning
    if tuning is None:
        raise ValueError(f"op {op!r} cannot be tuned; ops that can: {', '.join(tunable_ops())}")
    return tuning


@dataclass
class TunedEntry:
    """The ranking measured for one bucket: implementation ids fastest first, and their median times."""

    discrete: tuple[Any, ...]
    sizes: tuple[int, ...]
    order: list[str]
    median_us: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    shape: str = ""


def _log_distance(a: Sequence[int], b: Sequence[int]) -> float:
    return sum((math.log2(max(x, 1)) - math.log2(max(y, 1))) ** 2 for x, y in zip(a, b))


class TunedTable:
    """A measured ranking of `op`'s implementations per shape bucket, valid for one device fingerprint."""

    def __init__(self, fingerprint: dict[str, str], entries: list[TunedEntry], *, op: str = DEFAULT_OP,
                 source: str = "(in memory)", created: str = "", settings: dict[str, Any] | None = None) -> None:
        self.op = op
        self.tuning = _tuning(op)
        self.fingerprint = dict(fingerprint)
        self.entries = list(entries)
        self.source = source
        self.created = created
        self.settings = dict(settings or {})
        self._index: dict[tuple[Any, ...], list[TunedEntry]] = {}
        for entry in self.entries:
            self._index.setdefault(entry.discrete, []).append(entry)
        self._cache: dict[Any, TunedEntry | None] = {}

    @property
    def hash(self) -> str:
        return fingerprint_hash(self.fingerprint)

    def describe_entry(self, entry: TunedEntry) -> str:
        return self.tuning.describe(entry.discrete, entry.sizes)

    # -- persistence
    def entry_dict(self, entry: TunedEntry) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: v for f, v in zip(self.tuning.discrete, entry.discrete)}
        out.update(zip(self.tuning.sizes, entry.sizes))
        out["order"] = list(entry.order)
        out["median_us"] = {k: round(v, 3) for k, v in entry.median_us.items()}
        if entry.failed:
            out["failed"] = dict(entry.failed)
        if entry.shape:
            out["shape"] = entry.shape
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "op": self.op, "fingerprint": self.fingerprint, "fingerprint_hash": self.hash,
                "created": self.created, "settings": self.settings,
                "entries": [self.entry_dict(e) for e in self.entries]}

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = (f"# opdispatch tuned table of {self.op} for {self.fingerprint.get('name', '?')} — written by "
                  f"`opdispatch tune`.\n"
                  f"# Reference it from a policy with `ops.{self.op}.autotune: {path.name}`; it is ignored on any "
                  f"other device or\n# library versions (see `fingerprint`). Each entry ranks implementations "
                  f"fastest first.\n")
        path.write_text(header + yaml.safe_dump(self.to_dict(), sort_keys=False, width=120), encoding="utf-8")
        self.source = str(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunedTable:
        """Read a table written by `save`; ValueError names the file and the bad field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read tuned table {str(path)!r}: {exc.strerror}; run `opdispatch tune --out "
                             f"{path}` on the target device to create it") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"tuned table {path}: invalid YAML: {exc}") from exc
        try:
            model = _TableModel.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"tuned table {path}: field {_first_error(exc)}") from exc
        try:
            tuning = _tuning(model.op)
        except ValueError as exc:
            raise ValueError(f"tuned table {path}: field op: {exc}") from None
        entries = [_read_entry(path, model.op, tuning, i, raw) for i, raw in enumerate(model.entries)]
        return cls(model.fingerprint, entries, op=model.op, source=str(path), created=model.created,
                   settings=model.settings)

    # -- validity
    def matches(self, device: Any) -> tuple[bool, str]:
        """Whether this table was measured on `device` (a DeviceInfo) with this process's libraries; and why."""
        current = device_fingerprint(device)
        if current == self.fingerprint:
            return True, f"fingerprint {self.hash} matches {device.name}"
        diffs = []
        for key in sorted(set(current) | set(self.fingerprint)):
            was, now = self.fingerprint.get(key), current.get(key)
            if was != now:
                diffs.append(f"{key} {was if was is not None else '(absent)'} in the table vs "
                             f"{now if now is not None else '(absent)'} here")
        return False, (f"tuned table {self.source} is stale for this device: " + "; ".join(diffs)
                       + ". Re-run `opdispatch tune` here to refresh it.")

    # -- lookups
    def lookup_entry(self, call: Any) -> TunedEntry | None:
        """The tuned bucket nearest to `call` with the same discrete features, or None."""
        discrete, sizes = self.tuning.bucket(call)
        key = (discrete, sizes)
        try:
            return self._cache[key]
        except KeyError:
            pass
        best = None
        candidates = self._index.get(discrete)
        if candidates:
            best = min(candidates, key=lambda e: _log_distance(e.sizes, sizes))
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = best
        return best

    def estimate(self, call: Any, neighbours: int = 4) -> tuple[dict[str, float], list[TunedEntry]]:
        """Estimated cost of each implementation for `call`, relative to the fastest (1.0 = fastest).

        Blends the nearest buckets with the same discrete features by inverse log-distance (an exact bucket
        alone decides), so a shape between buckets — where neighbours may disagree — gets a weighted verdict
        instead of whichever neighbour a tie happened to favour. Only implementations timed in every blended
        bucket are estimated.
        """
        discrete, sizes = self.tuning.bucket(call)
        candidates = self._index.get(discrete) or []
        if not candidates:
            return {}, []
        ranked = sorted(candidates, key=lambda e: _log_distance(e.sizes, sizes))[:neighbours]
        distances = [math.sqrt(_log_distance(e.sizes, sizes)) for e in ranked]
        if distances[0] == 0.0:
            ranked, distances = ranked[:1], distances[:1]
        used = [(e, 1.0 / (d + 1e-9)) for e, d in zip(ranked, distances) if e.median_us]
        if not used:
            return {}, []
        common = set.intersection(*(set(e.median_us) for e, _ in used))
        total = sum(w for _, w in used)
        scores = {}
        for impl_id in common:
            log_rel = sum(w * math.log(e.median_us[impl_id] / min(e.median_us[i] for i in common))
                          for e, w in used)
            scores[impl_id] = math.exp(log_rel / total)
        fastest = min(scores.values(), default=1.0)
        return {i: c / fastest for i, c in scores.items()}, [e for e, _ in used]

    def rank(self, call: Any, policy_order: Sequence[str], margin: float = 0.05) -> tuple[list[str], str] | None:
        """Implementation ids for `call`, fastest first by `estimate`, and a note saying why.

        Implementations within `margin` of the fastest count as a tie and keep `policy_order` among themselves:
        a few percent is within measurement noise and does not overturn the policy.
        """
        scores, used = self.estimate(call)
        if not scores:
            return None
        best = min(scores.values())
        position = {impl_id: i for i, impl_id in enumerate(policy_order)}
        tied = sorted((i for i in scores if scores[i] <= best * (1.0 + margin)),
                      key=lambda i: (position.get(i, len(position)), scores[i]))
        rest = sorted((i for i in scores if i not in tied), key=lambda i: scores[i])
        buckets = "; ".join(self.describe_entry(e) for e in used)
        costs = ", ".join(f"{i} x{scores[i]:.2f}" for i in tied + rest)
        return tied + rest, f"{'bucket' if len(used) == 1 else 'buckets'} {buckets}: {costs}"

    def lookup(self, call: Any) -> list[str] | None:
        """Implementation ids fastest first for `call` (nearest tuned bucket), or None when no bucket fits.

        The caller still checks eligibility: the first eligible id in this order is the pick.
        """
        entry = self.lookup_entry(call)
        return None if entry is None else list(entry.order)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']}"


def _read_entry(path: Path, op: str, tuning: TuningSpec, i: int, raw: dict[str, Any]) -> TunedEntry:
    try:
        entry = _entry_model(op).model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"tuned table {path}: field entries.{i}.{_first_error(exc)}") from exc
    for feature in tuning.discrete:
        value = getattr(entry, feature.name)
        if feature.choices and value not in feature.choices:
            raise ValueError(f"tuned table {path}: field entries.{i}.{feature.name}: {value!r} is not one of "
                             f"{', '.join(feature.choices)}")
    return TunedEntry(discrete=tuple(getattr(entry, f.name) for f in tuning.discrete),
                      sizes=tuple(getattr(entry, name) for name in tuning.sizes), order=list(getattr(entry, "order")),
                      median_us=dict(getattr(entry, "median_us")), failed=dict(getattr(entry, "failed")),
                      shape=getattr(entry, "shape"))


_loaded: dict[tuple[str, float, Any, str], TunedTable | None] = {}


def tuned_table_for(path: str | os.PathLike[str], device: Any, op: str = DEFAULT_OP) -> TunedTable | None:
    """The table of `op` at `path` if it matches `device`; None (with one warning) if it is stale, unreadable or
    another op's.

    Cached per (path, modification time, device, op), so calling it inside every decision costs a dict lookup.
    """
    path = str(path)
    try:
        mtime = os.stat(path).st_mtime
    except OSError as exc:
        key = (path, -1.0, device.key, op)
        if key not in _loaded:
            log.warning("autotune table %s cannot be read (%s); using the policy order", path, exc.strerror)
            _loaded[key] = None
        return _loaded[key]
    key = (path, mtime, device.key, op)
    if key in _loaded:
        return _loaded[key]
    try:
        table: TunedTable | None = TunedTable.load(path)
    except ValueError as exc:
        log.warning("%s; using the policy order", exc)
        table = None
    if table is not None and table.op != op:
        log.warning("tuned table %s times op %r, but the policy names it as the autotune table of op %r "
                    "(ops.%s.autotune); ignoring it, using the policy order. Point ops.%s.autotune at a table "
                    "written by `opdispatch tune --op %s`.", path, table.op, op, op, op, op)
        table = None
    if table is not None:
        ok, reason = table.matches(device)
        if not ok:
            log.warning("%s Ignoring it; using the policy order.", reason)
            table = None
    _loaded[key] = table
    return table
