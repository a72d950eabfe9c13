"""Measured autotune: time every eligible attention implementation per shape bucket on this device, and keep
the ranking in a YAML "tuned table" that a policy can reference (``autotune: <path>``).

A table is keyed by a fingerprint of the device, its driver and the library versions; a table whose fingerprint
differs from the running process is stale and ignored (with a warning) by the caller. A lookup matches the
discrete features of a call exactly (dtype, dense/varlen, head_dim, heads, causal, window?, softcap?,
requires_grad) and takes the nearest tuned bucket in log2 space of (seqlen_q, seqlen_k, batch), so shapes
between tuned buckets get the ranking of their nearest neighbour.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("opdispatch")

FORMAT = "opdispatch-tuned/1"
OP = "attention"

__all__ = [
    "CallSpec", "FORMAT", "Measurement", "TunedEntry", "TunedTable", "apply_tuned_order", "call_features",
    "device_fingerprint", "load_shapes", "measure", "preset", "PRESETS", "tune", "tuned_table_for",
]


# -- call signatures -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CallSpec:
    """A call signature to time: the shapes and flags of one attention call, without data.

    `layout` is ``bshd`` (dense) or ``thd`` (packed varlen: `batch` sequences, the longest `seqlen_q`). A causal
    call with seqlen_q != seqlen_k is aligned bottom-right (decode: the new tokens see the whole cache).
    """

    dtype: str = "bf16"
    layout: str = "bshd"
    batch: int = 1
    seqlen_q: int = 128
    seqlen_k: int = 128
    heads_q: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    requires_grad: bool = False
    name: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> CallSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{where}shape has unknown field(s) {sorted(unknown)}; allowed: {sorted(known)}")
        data = dict(data)
        if data.get("window") is not None:
            data["window"] = tuple(int(x) for x in data["window"])
        data.setdefault("seqlen_k", data.get("seqlen_q", cls.seqlen_k))
        data.setdefault("heads_kv", data.get("heads_q", cls.heads_kv))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["window"] is not None:
            out["window"] = list(out["window"])
        return out

    def describe(self) -> str:
        if self.name:
            return self.name
        parts = [self.dtype, "varlen" if self.layout == "thd" else "dense", f"b{self.batch}",
                 f"q{self.seqlen_q}", f"k{self.seqlen_k}", f"h{self.heads_q}/{self.heads_kv}", f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        if self.window:
            parts.append(f"win{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.requires_grad:
            parts.append("fwd+bwd")
        return " ".join(parts)

    def seq_lengths(self) -> tuple[list[int], list[int]]:
        """Per-sequence (q, k) lengths: all equal for dense; uneven for varlen, the first being the longest."""
        if self.layout != "thd":
            return [self.seqlen_q] * self.batch, [self.seqlen_k] * self.batch
        fractions = [1.0, 0.5, 0.75, 0.625, 0.875, 0.5625, 0.8125, 0.6875]
        q = [max(1, int(self.seqlen_q * fractions[i % len(fractions)])) for i in range(self.batch)]
        k = [max(1, int(self.seqlen_k * fractions[i % len(fractions)])) for i in range(self.batch)]
        return q, k

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
        """Fresh random inputs: keyword arguments for `opdispatch.attention` / `validate_attention`."""
        from opdispatch._attention import dtype_from_name

        dtype = dtype_from_name(self.dtype)
        device = torch.device(device)

        gen = generator if generator is not None and generator.device.type == device.type else None

        def rand(*shape: int) -> torch.Tensor:
            if device.type == "meta":
                return torch.empty(*shape, dtype=dtype, device=device).requires_grad_(self.requires_grad)
            t = torch.randn(*shape, generator=gen, dtype=torch.float32, device=device).to(dtype)
            return t.requires_grad_(self.requires_grad)

        kw: dict[str, Any] = dict(causal=self.causal, softcap=self.softcap)
        if self.window is not None:
            kw["window"] = tuple(self.window)
        if self.causal and self.seqlen_q != self.seqlen_k:
            kw["causal_alignment"] = "bottom_right"
        if self.layout == "thd":
            lq, lk = self.seq_lengths()
            kw.update(layout="thd", q=rand(sum(lq), self.heads_q, self.head_dim),
                      k=rand(sum(lk), self.heads_kv, self.head_dim), v=rand(sum(lk), self.heads_kv, self.head_dim),
                      cu_seqlens_q=_cumulative(lq, device), cu_seqlens_k=_cumulative(lk, device),
                      max_seqlen_q=max(lq), max_seqlen_k=max(lk))
            if lq == lk and self.seqlen_q == self.seqlen_k:
                kw["cu_seqlens_k"] = kw["cu_seqlens_q"]
        elif self.layout == "bshd":
            kw.update(layout="bshd", q=rand(self.batch, self.seqlen_q, self.heads_q, self.head_dim),
                      k=rand(self.batch, self.seqlen_k, self.heads_kv, self.head_dim),
                      v=rand(self.batch, self.seqlen_k, self.heads_kv, self.head_dim))
        else:
            raise ValueError(f"shape {self.describe()}: layout {self.layout!r} cannot be tuned; use bshd or thd")
        return kw

    def flops(self) -> float:
        """Floating-point operations of the call (2 per multiply-add; backward counted as 2.5x forward)."""
        lq, lk = self.seq_lengths()
        pairs = sum(_allowed_pairs(a, b, self.causal, self.window) for a, b in zip(lq, lk))
        forward = 2.0 * pairs * (self.head_dim + self.head_dim) * self.heads_q
        return forward * (3.5 if self.requires_grad else 1.0)


def _cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _allowed_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int] | None) -> int:
    """How many (query, key) pairs a call with these lengths computes (bottom-right alignment when causal)."""
    if not causal and window is None:
        return sq * sk
    offset = sk - sq if causal else 0
    total = 0
    for i in range(sq):
        lo, hi = 0, sk - 1
        centre = i + offset
        if causal:
            hi = min(hi, centre)
        if window is not None:
            left, right = window
            if left >= 0:
                lo = max(lo, centre - left)
            if right >= 0 and not causal:
                hi = min(hi, centre + right)
        total += max(0, hi - lo + 1)
    return total


def load_shapes(path: str | os.PathLike[str]) -> list[CallSpec]:
    """Call signatures from YAML: a list of mappings (CallSpec fields), or ``{shapes: [...]}``."""
    text = Path(path).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise ValueError(f"{path}: expected a list of shapes (mappings of CallSpec fields such as dtype, batch, "
                         "seqlen_q, heads_q, head_dim, causal), or a mapping with a `shapes:` list")
    return [CallSpec.from_dict(item, where=f"{path}: entry {i}: ") for i, item in enumerate(data)]


# -- presets ---------------------------------------------------------------------------------------------------

def _grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        rows = [{**row, key: value} for row in rows for value in values]
    return rows


def _heads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        row = dict(row)
        row["heads_q"], row["heads_kv"], row["head_dim"] = row.pop("heads")
        out.append(row)
    return out


def preset(name: str, device_type: str = "cuda") -> list[CallSpec]:
    """A preset list of call signatures: ``decode``, ``prefill``, ``training`` or ``all``.

    Accelerators get bf16 model-sized shapes; the CPU gets float32 shapes small enough to time in seconds.
    """
    if name == "all":
        return [s for part in ("decode", "prefill", "training") for s in preset(part, device_type)]
    cpu = device_type == "cpu"
    dtype = "fp32" if cpu else "bf16"
    heads = [(8, 2, 64), (8, 8, 64)] if cpu else [(32, 8, 128), (32, 32, 128), (16, 16, 64)]
    if name == "decode":
        rows = _grid(batch=[1, 4] if cpu else [1, 8, 64], seqlen_k=[256, 1024] if cpu else [1024, 8192],
                     heads=heads)
        return [CallSpec(dtype=dtype, seqlen_q=1, causal=True, **r) for r in _heads(rows)]
    if name == "prefill":
        seqs = [64, 256] if cpu else [512, 2048, 8192]
        rows = _grid(batch=[1, 2] if cpu else [1, 4], seqlen_q=seqs, heads=heads)
        specs = [CallSpec(dtype=dtype, causal=True, seqlen_k=r["seqlen_q"], **r) for r in _heads(rows)]
        h, hkv, d = heads[0]
        long = seqs[-1]
        specs += [
            CallSpec(dtype=dtype, layout="thd", batch=4 if cpu else 8, seqlen_q=long, seqlen_k=long, heads_q=h,
                     heads_kv=hkv, head_dim=d, causal=True),
            CallSpec(dtype=dtype, batch=1, seqlen_q=long, seqlen_k=long, heads_q=h, heads_kv=hkv, head_dim=d,
                     causal=True, window=(long // 4, 0)),
            CallSpec(dtype=dtype, batch=1, seqlen_q=long, seqlen_k=long, heads_q=h, heads_kv=hkv, head_dim=d,
                     causal=True, softcap=50.0),
        ]
        return specs
    if name == "training":
        rows = _grid(batch=[1, 2] if cpu else [2, 8], seqlen_q=[64, 128] if cpu else [1024, 4096],
                     heads=heads[:2])
        return [CallSpec(dtype=dtype, causal=True, requires_grad=True, seqlen_k=r["seqlen_q"], **r)
                for r in _heads(rows)]
    raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")


PRESETS = ("decode", "prefill", "training", "all")


# -- features and buckets --------------------------------------------------------------------------------------

DISCRETE = ("dtype", "layout", "head_dim", "heads_q", "heads_kv", "causal", "window", "softcap", "requires_grad")
SIZES = ("seqlen_q", "seqlen_k", "batch")


def call_features(call: Any) -> tuple[tuple[Any, ...], tuple[int, int, int]]:
    """(discrete features, (seqlen_q, seqlen_k, batch)) of an AttentionCall — what a tuned bucket is keyed by."""
    from opdispatch._attention import dtype_name

    discrete = (dtype_name(call.dtype), "varlen" if call.layout == "thd" else "dense", call.head_dim,
                call.heads_q, call.heads_kv, bool(call.causal), call.window is not None, call.softcap > 0,
                bool(call.requires_grad))
    return discrete, (call.seqlen_q, call.seqlen_k, call.batch)


def _log_distance(a: Sequence[int], b: Sequence[int]) -> float:
    return sum((math.log2(max(x, 1)) - math.log2(max(y, 1))) ** 2 for x, y in zip(a, b))


def bucket_of(sizes: Sequence[int]) -> tuple[int, ...]:
    """log2 buckets (nearest power of two) of (seqlen_q, seqlen_k, batch)."""
    return tuple(round(math.log2(max(s, 1))) for s in sizes)


# -- fingerprint -----------------------------------------------------------------------------------------------

_DISTRIBUTIONS = {"flash_attn": "flash-attn", "flag_gems": "flag-gems", "flash_attn_3": "flash-attn-3",
                  "aiter": "aiter", "triton": "triton"}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version(device_type: str) -> str | None:
    if device_type != "cuda":
        return None
    if torch.version.hip:
        return None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            first = fh.readline()
        for token in first.split():
            if token.count(".") >= 1 and token.replace(".", "").isdigit():
                return token
    except OSError:
        pass
    return None


def device_fingerprint(device: Any) -> dict[str, str]:
    """What a tuned table is valid for: device, driver and library versions (a DeviceInfo in, text out).

    For a real device the versions are read from this process (torch, CUDA/HIP, cuDNN, driver, flash_attn,
    flag_gems, aiter, triton where installed); for a simulated one (a YAML descriptor) from its `libraries`.
    """
    fp: dict[str, str] = {"vendor": device.vendor, "type": device.type, "arch": device.arch, "name": device.name}
    if device.capability:
        fp["capability"] = f"{device.capability[0]}.{device.capability[1]}"
    libs = {str(k): str(v) for k, v in device.libraries.items()}
    if not device.simulated:
        libs["torch"] = str(torch.__version__)
        if device.type != "cpu":
            if torch.version.cuda:
                libs["cuda"] = str(torch.version.cuda)
            if torch.version.hip:
                libs["hip"] = str(torch.version.hip)
            if torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
                libs["cudnn"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
            driver = _driver_version(device.type)
            if driver:
                libs["driver"] = driver
            for key, dist in _DISTRIBUTIONS.items():
                version = _dist_version(dist)
                if version:
                    libs[key] = version
    for key in sorted(libs):
        fp[key] = libs[key]
    return fp


def fingerprint_hash(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


# -- the table -------------------------------------------------------------------------------------------------

class _EntryModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: str
    layout: str = Field(pattern="^(dense|varlen)$")
    head_dim: int = Field(ge=1)
    heads_q: int = Field(ge=1)
    heads_kv: int = Field(ge=1)
    causal: bool
    window: bool = False
    softcap: bool = False
    requires_grad: bool = False
    seqlen_q: int = Field(ge=1)
    seqlen_k: int = Field(ge=1)
    batch: int = Field(ge=1)
    order: list[str] = Field(min_length=1)
    median_us: dict[str, float] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict)
    shape: str = ""


class _TableModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = Field(pattern=f"^{FORMAT}$")
    op: str = OP
    fingerprint: dict[str, str]
    fingerprint_hash: str = ""
    created: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)
    entries: list[_EntryModel] = Field(default_factory=list)


@dataclass
class TunedEntry:
    """The ranking measured for one bucket: implementation ids fastest first, and their median times."""

    discrete: tuple[Any, ...]
    sizes: tuple[int, int, int]
    order: list[str]
    median_us: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    shape: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(zip(DISCRETE, self.discrete))
        out.update(zip(SIZES, self.sizes))
        out["order"] = list(self.order)
        out["median_us"] = {k: round(v, 3) for k, v in self.median_us.items()}
        if self.failed:
            out["failed"] = dict(self.failed)
        if self.shape:
            out["shape"] = self.shape
        return out

    def describe(self) -> str:
        d = dict(zip(DISCRETE, self.discrete))
        flags = [k for k in ("causal", "window", "softcap", "requires_grad") if d[k]]
        return (f"{d['dtype']}/{d['layout']} d{d['head_dim']} h{d['heads_q']}/{d['heads_kv']}"
                f"{' ' + ','.join(flags) if flags else ''} q{self.sizes[0]} k{self.sizes[1]} b{self.sizes[2]}")


class TunedTable:
    """A measured ranking of implementations per shape bucket, valid for one device fingerprint."""

    def __init__(self, fingerprint: dict[str, str], entries: list[TunedEntry], *, source: str = "(in memory)",
                 created: str = "", settings: dict[str, Any] | None = None) -> None:
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

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "op": OP, "fingerprint": self.fingerprint, "fingerprint_hash": self.hash,
                "created": self.created, "settings": self.settings,
                "entries": [e.to_dict() for e in self.entries]}

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = (f"# opdispatch tuned table for {self.fingerprint.get('name', '?')} — written by `opdispatch tune`.\n"
                  f"# Reference it from a policy with `autotune: {path.name}`; it is ignored on any other device or\n"
                  f"# library versions (see `fingerprint`). Each entry ranks implementations fastest first.\n")
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
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise ValueError(f"tuned table {path}: field {where}: {err['msg']}") from exc
        entries = [TunedEntry(discrete=tuple(getattr(e, k) for k in DISCRETE),
                              sizes=(e.seqlen_q, e.seqlen_k, e.batch), order=list(e.order),
                              median_us=dict(e.median_us), failed=dict(e.failed), shape=e.shape)
                   for e in model.entries]
        return cls(model.fingerprint, entries, source=str(path), created=model.created, settings=model.settings)

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
        discrete, sizes = call_features(call)
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
        discrete, sizes = call_features(call)
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
        buckets = "; ".join(e.describe() for e in used)
        costs = ", ".join(f"{i} x{scores[i]:.2f}" for i in tied + rest)
        return tied + rest, f"{'bucket' if len(used) == 1 else 'buckets'} {buckets}: {costs}"

    def lookup(self, call: Any) -> list[str] | None:
        """Implementation ids fastest first for `call` (nearest tuned bucket), or None when no bucket fits.

        The caller still checks eligibility: the first eligible id in this order is the pick.
        """
        entry = self.lookup_entry(call)
        return None if entry is None else list(entry.order)


def apply_tuned_order(order: list[tuple[str, Any]], tuned: Sequence[str], provenance: Any) -> list[tuple[str, Any]]:
    """Move the tuned ids (fastest first) to the front of a policy's ordered (impl_id, provenance) list.

    Ids the table does not rank keep their policy order after the ranked ones; ids the policy dropped (denied)
    stay dropped. The moved entries get `provenance` (e.g. ``Provenance("policy", "tuned.yaml", note=...)``).
    """
    present = {impl_id for impl_id, _ in order}
    front = [(impl_id, provenance) for impl_id in tuned if impl_id in present]
    moved = {impl_id for impl_id, _ in front}
    return front + [(impl_id, prov) for impl_id, prov in order if impl_id not in moved]


_loaded: dict[tuple[str, float, Any], TunedTable | None] = {}


def tuned_table_for(path: str | os.PathLike[str], device: Any) -> TunedTable | None:
    """The table at `path` if it matches `device`; None (with one warning) if it is stale or unreadable.

    Cached per (path, modification time, device), so calling it inside every decision costs a dict lookup.
    """
    path = str(path)
    try:
        mtime = os.stat(path).st_mtime
    except OSError as exc:
        key = (path, -1.0, device.key)
        if key not in _loaded:
            log.warning("autotune table %s cannot be read (%s); using the policy order", path, exc.strerror)
            _loaded[key] = None
        return _loaded[key]
    key = (path, mtime, device.key)
    if key in _loaded:
        return _loaded[key]
    try:
        table: TunedTable | None = TunedTable.load(path)
    except ValueError as exc:
        log.warning("%s; using the policy order", exc)
        table = None
    if table is not None:
        ok, reason = table.matches(device)
        if not ok:
            log.warning("%s Ignoring it; using the policy order.", reason)
            table = None
    _loaded[key] = table
    return table


# -- measuring -------------------------------------------------------------------------------------------------

@dataclass
class Measurement:
    """The timings of one call signature: median seconds per implementation, failures, the default pick."""

    spec: CallSpec
    call: str
    seconds: dict[str, float]
    failed: dict[str, str]
    skipped: dict[str, str]
    pick: str | None
    flops: float
    features: tuple[tuple[Any, ...], tuple[int, int, int]] | None = None

    @property
    def fastest(self) -> str | None:
        return min(self.seconds, key=self.seconds.__getitem__) if self.seconds else None

    def ranking(self) -> list[str]:
        return sorted(self.seconds, key=self.seconds.__getitem__)

    def tflops(self, impl_id: str) -> float:
        return self.flops / self.seconds[impl_id] / 1e12

    @property
    def regret(self) -> float | None:
        """time(pick) / time(fastest) - 1, or None when the pick was not timed."""
        if self.pick is None or self.pick not in self.seconds or not self.seconds:
            return None
        return self.seconds[self.pick] / self.seconds[self.fastest] - 1.0  # type: ignore[index]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, *, warmup: int, reps: int,
            min_rep_seconds: float | None = None) -> float:
    """Median seconds per call of `fn` on `device` (CUDA events on GPUs, perf_counter on the CPU).

    Calls that take less than `min_rep_seconds` are repeated inside one timed rep (the count is calibrated
    during warm-up), so launch jitter does not dominate tiny kernels.
    """
    cuda = device.type == "cuda"
    if min_rep_seconds is None:
        min_rep_seconds = 1e-3 if cuda else 2e-4
    for _ in range(max(warmup, 1)):
        fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    estimate = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(1000, math.ceil(min_rep_seconds / estimate)))
    samples = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
                  for _ in range(reps)]
        for begin, end in events:
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [begin.elapsed_time(end) / 1e3 / inner for begin, end in events]
    else:
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - start) / inner)
    return float(statistics.median(samples))


class _Progress:
    """A one-line progress bar on stderr (a plain line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, stream: Any = None) -> None:
        self.total, self.enabled, self.done = max(total, 1), enabled, 0
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 28
        filled = int(width * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to time on: the given one, else the current CUDA device if there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _matches_filter(impl_id: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(impl_id, p) for p in patterns)


def _runner(impl: Any, call: Any, spec: CallSpec) -> Callable[[], Any]:
    if not spec.requires_grad:
        return lambda: impl.run(call)
    leaves = [t for t in (call.q, call.k, call.v) if t.requires_grad]

    def step() -> None:
        out = impl.run(call)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, leaves, grad_out)

    first = impl.run(call)
    grad_out = torch.randn_like(first[0] if isinstance(first, tuple) else first)
    return step


def measure(specs: Sequence[CallSpec], *, manager: Any = None, device: torch.device | str | None = None,
            impls: Sequence[str] | None = None, warmup: int = 3, reps: int = 10, progress: bool = True,
            seed: int = 0) -> list[Measurement]:
    """Time every eligible implementation (matching the `impls` globs) on each call signature.

    Each signature gets fresh random inputs shared by its implementations; an implementation that raises is
    recorded under `failed` and left out of the ranking. `pick` is what the manager's policy chooses today.
    """
    import opdispatch
    from opdispatch._errors import OpDispatchError

    manager = manager or opdispatch.get_manager()
    manager.ensure_initialized()
    device = _resolve_device(device)
    info = manager.device_info(device)
    registered = [r.impl for r in manager.registry.for_op(OP) if _matches_filter(r.impl.id, impls)]
    bar = _Progress(len(specs) * max(len(registered), 1), progress)
    generator = torch.Generator(device=device).manual_seed(seed)
    results = []
    try:
        for spec in specs:
            kw = spec.inputs(device, generator)
            q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
            call = opdispatch.validate_attention(q, k, v, **kw)
            try:
                pick = manager.resolve(OP, call).chosen_id
            except OpDispatchError:
                pick = None
            seconds: dict[str, float] = {}
            failed: dict[str, str] = {}
            skipped: dict[str, str] = {}
            for impl in registered:
                bar.step(f"{spec.describe()}: {impl.id}")
                reason = manager.availability(impl, info)
                if reason is None:
                    reasons = impl.not_supported_reasons(call, info)
                    reason = "; ".join(reasons) if reasons else None
                if reason is not None:
                    skipped[impl.id] = reason
                    continue
                try:
                    seconds[impl.id] = time_fn(_runner(impl, call, spec), device, warmup=warmup, reps=reps)
                except Exception as exc:  # a kernel that fails on this shape is not a candidate for it
                    failed[impl.id] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.append(Measurement(spec, call.describe(), seconds, failed, skipped, pick, spec.flops(),
                                       call_features(call)))
            del q, k, v, call, kw
    finally:
        bar.close()
    return results


def tune(specs: Sequence[CallSpec], *, manager: Any = None, device: torch.device | str | None = None,
         impls: Sequence[str] | None = None, warmup: int = 3, reps: int = 10, progress: bool = True,
         seed: int = 0) -> TunedTable:
    """Measure `specs` on this device and return the tuned table (save it with `.save(path)`)."""
    import opdispatch

    manager = manager or opdispatch.get_manager()
    results = measure(specs, manager=manager, device=device, impls=impls, warmup=warmup, reps=reps,
                      progress=progress, seed=seed)
    device = _resolve_device(device)
    info = manager.device_info(device)
    entries = []
    for m in results:
        if not m.seconds or m.features is None:
            continue
        discrete, sizes = m.features
        entries.append(TunedEntry(discrete, sizes, m.ranking(), {i: s * 1e6 for i, s in m.seconds.items()},
                                  m.failed, m.spec.describe()))
    return TunedTable(device_fingerprint(info), entries, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      settings={"warmup": warmup, "reps": reps, "impls": list(impls) if impls else ["*"]})
