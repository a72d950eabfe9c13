"""Matchers for rule conditions, parsed once at load time. Each raises ValueError (naming the bad value and what
is allowed) on malformed input, and answers `matches(value)` at decision time."""

from __future__ import annotations

import difflib
import fnmatch
import math
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq, "!=": operator.ne,
}
_CMP = re.compile(r"^\s*(>=|<=|>|<|==|!=)?\s*(\S+)\s*$")


def _items(value: Any, what: str) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"{what} must not be an empty list")
    return items


def _comparisons(text: str, parse: Callable[[str], Any], what: str, example: str) -> list[tuple[str, Any]]:
    out = []
    for part in text.split(","):
        m = _CMP.match(part)
        if not m:
            raise ValueError(f"{what} {text!r} is not a comparison; write e.g. {example}")
        op, raw = m.group(1) or "==", m.group(2)
        out.append((op, parse(raw)))
    return out


def check_glob_brackets(pattern: str) -> None:
    """Refuse a glob whose `[` is never closed: fnmatch would silently read it as a literal bracket."""
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            # fnmatch: a class is `[` then an optional `!`, then at least one character (a leading `]` counts)
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                raise ValueError(f"glob {pattern!r} opens a character class '[' at offset {i} that is never closed; "
                                 "close it (e.g. 'sm[89]0') or write '[[]' for a literal '['")
            i = close
        i += 1


def _did_you_mean(value: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Spec:
    text: str

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r})"


class NameSpec(_Spec):
    """One name or a list of names (any of them)."""

    def __init__(self, names: Iterable[str], text: str) -> None:
        self.names = frozenset(names)
        self.text = text

    @classmethod
    def parse(cls, value: Any, vocabulary: Iterable[str] | None = None, what: str = "name") -> NameSpec | None:
        """Parse one name or a list; with `vocabulary`, every name must be one of it (a typo never matches)."""
        if value is None or isinstance(value, NameSpec):
            return value
        items = _items(value, "name list")
        known = None if vocabulary is None else sorted(vocabulary)
        for item in items:
            if not isinstance(item, str) or not item:
                raise ValueError(f"{item!r} is not a name; give a string or a list of strings")
            if known is not None and item.lower() not in known:
                hint = _did_you_mean(item.lower(), known)
                raise ValueError(f"{what} {item!r} is not one of {', '.join(known)}{hint}")
        return cls((i.lower() for i in items), ", ".join(items))

    def matches(self, value: str) -> bool:
        return value.lower() in self.names


class GlobSpec(_Spec):
    """A glob or a list of globs (`model.layers.*.self_attn`, `*H100*`)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self.text = ", ".join(patterns)

    @classmethod
    def parse(cls, value: Any) -> GlobSpec | None:
        if value is None or isinstance(value, GlobSpec):
            return value
        items = _items(value, "glob list")
        for item in items:
            if not isinstance(item, str) or not item:
                raise ValueError(f"{item!r} is not a glob; give a string such as 'model.layers.*.self_attn'")
            check_glob_brackets(item)
        return cls(items)

    def matches(self, value: str | None) -> bool:
        return value is not None and any(fnmatch.fnmatchcase(value, p) for p in self.patterns)


def _interval_empty(comps: Iterable[tuple[str, Any]]) -> bool:
    """Whether comparisons that must all hold (`>=a`, `<b`, `==c`, …) admit no value, for any ordered values."""
    comps = list(comps)
    lows = [(v, op == ">") for op, v in comps if op in (">=", ">", "==")]
    highs = [(v, op == "<") for op, v in comps if op in ("<=", "<", "==")]
    for low, low_open in lows:
        for high, high_open in highs:
            if low > high or (low == high and (low_open or high_open)):
                return True
    return False


def parse_arch(text: str) -> tuple[str, tuple[int, ...]]:
    """`sm90` -> ('sm', (90,)), `sm90a` -> ('sm', (90,)), `gfx942` -> ('gfx', (9, 4, 2)),
    `gfx90a` -> ('gfx', (9, 0, 10)), `gfx1100` -> ('gfx', (11, 0, 0)). ValueError for anything else."""
    m = re.fullmatch(r"sm_?(\d{2,3})[a-z]?", text)
    if m:
        return "sm", (int(m.group(1)),)
    m = re.fullmatch(r"gfx([0-9]{1,2})([0-9a-f])([0-9a-f])", text)
    if m:
        return "gfx", (int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16))
    raise ValueError(f"{text!r} is not an arch with an order; ranges work on 'smNN' (NVIDIA) and 'gfxNNN' (AMD) "
                     "names, e.g. '>=sm80' or '>=gfx942'")


class ArchSpec(_Spec):
    """Arch names (`sm90`, `[gfx942, gfx950]`, `ivcore11`) and ranges within a family (`>=sm80`, `>=sm80,<sm100`)."""

    def __init__(self, exact: frozenset[str], ranges: list[tuple[str, list[tuple[str, tuple[int, ...]]]]],
                 text: str) -> None:
        self.exact = exact
        self.ranges = ranges  # (family, [(op, number tuple), ...]) — all comparisons of one item must hold
        self.text = text

    @classmethod
    def parse(cls, value: Any) -> ArchSpec | None:
        if value is None or isinstance(value, ArchSpec):
            return value
        exact: set[str] = set()
        ranges = []
        items = _items(value, "arch list")
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"arch {item!r} must be a string such as 'sm90', 'gfx942' or '>=sm80'")
            item = item.strip()
            if item[0] in "<>=!":
                comps = []
                family = None
                for op, (fam, num) in _comparisons(item, parse_arch, "arch range", "'>=sm80' or '>=sm80,<sm100'"):
                    if family not in (None, fam):
                        raise ValueError(f"arch range {item!r} mixes families {family!r} and {fam!r}")
                    family = fam
                    comps.append((op, num))
                assert family is not None
                if _interval_empty(comps):
                    raise ValueError(f"arch range {item!r} admits no arch (its lower bound is above its upper "
                                     "bound); write e.g. '>=sm80,<sm100'")
                ranges.append((family, comps))
            else:
                if not re.fullmatch(r"[a-z][a-z0-9_.-]*", item):
                    raise ValueError(f"arch {item!r} is not an arch name; write e.g. 'sm90', 'gfx942', 'x86_64' or a "
                                     "range '>=sm80'")
                if re.fullmatch(r"(sm|gfx)\d.*", item):  # a family with an order: the name must parse
                    parse_arch(item)
                exact.add(item)
        return cls(frozenset(exact), ranges, ", ".join(str(i) for i in items))

    def matches(self, arch: str) -> bool:
        if arch in self.exact:
            return True
        if not self.ranges:
            return False
        try:
            family, number = parse_arch(arch)
        except ValueError:
            return False
        return any(fam == family and all(_OPS[op](number, n) for op, n in comps) for fam, comps in self.ranges)


def _parse_capability(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"compute capability {text!r} must look like '8.0' or '9'")
    return int(m.group(1)), int(m.group(2) or 0)


class CapabilitySpec(_Spec):
    """Compute capability comparisons: `">=8.0"`, `">=8.0,<9.0"`, `9.0`, or a list of such (any)."""

    def __init__(self, alternatives: list[list[tuple[str, tuple[int, int]]]], text: str) -> None:
        self.alternatives = alternatives
        self.text = text

    @classmethod
    def parse(cls, value: Any) -> CapabilitySpec | None:
        if value is None or isinstance(value, CapabilitySpec):
            return value
        alternatives = []
        for item in _items(value, "capability list"):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise ValueError(f"capability {item!r} must be a string such as '>=8.0' or a number such as 9.0")
            comps = _comparisons(str(item), _parse_capability, "capability", "'>=8.0' or '>=8.0,<9.0'")
            if _interval_empty(comps):
                raise ValueError(f"capability {item!r} admits no value (its lower bound is above its upper bound); "
                                 "write e.g. '>=8.0,<9.0'")
            alternatives.append(comps)
        return cls(alternatives, str(value))

    def matches(self, capability: tuple[int, int] | None) -> bool:
        if capability is None:
            return False
        return any(all(_OPS[op](tuple(capability), c) for op, c in comps) for comps in self.alternatives)


class LibrarySpec(_Spec):
    """`installed`, `missing`, or a version range (`>=9.0`, `>=2.6,<3`); a bare version means exactly it."""

    def __init__(self, kind: str, spec: SpecifierSet | None, text: str) -> None:
        self.kind = kind
        self.spec = spec
        self.text = text

    @classmethod
    def parse(cls, value: Any) -> LibrarySpec:
        if isinstance(value, LibrarySpec):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"library condition {value!r} must be 'installed', 'missing' or a version range such as "
                             "'>=9.0'")
        text = str(value).strip()
        if text in ("installed", "missing"):
            return cls(text, None, text)
        spec_text = text if text[0] in "<>=!~" else f"=={text}"
        try:
            spec = SpecifierSet(spec_text)
        except InvalidSpecifier:
            raise ValueError(f"library version range {text!r} is not valid; write e.g. '>=9.0', '<5.1' or "
                             "'>=2.6,<3'") from None
        bounds = [(s.operator, Version(s.version)) for s in spec
                  if s.operator in _OPS and "*" not in s.version]
        if _interval_empty(bounds):
            raise ValueError(f"library version range {text!r} admits no version (its lower bound is above its upper "
                             "bound); write e.g. '>=2.6,<3'")
        return cls("range", spec, text)

    def matches(self, version: str | None) -> bool:
        if self.kind == "installed":
            return version is not None
        if self.kind == "missing":
            return version is None
        if version is None:
            return False
        assert self.spec is not None
        try:
            return Version(version.split("+")[0]) in self.spec
        except InvalidVersion:
            return False


class DTypeSpec(_Spec):
    """A dtype name or a list (`bf16`, `[fp16, bf16]`, `float32`)."""

    def __init__(self, dtypes: frozenset[Any], text: str) -> None:
        self.dtypes = dtypes
        self.text = text

    @classmethod
    def parse(cls, value: Any) -> DTypeSpec | None:
        if value is None or isinstance(value, DTypeSpec):
            return value
        from opdispatch.base._dtypes import dtype_from_name

        dtypes = set()
        items = _items(value, "dtype list")
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"dtype {item!r} must be a name such as 'bf16' or 'float32'")
            dtypes.add(dtype_from_name(item))
        return cls(frozenset(dtypes), ", ".join(items))

    def matches(self, dtype: Any) -> bool:
        return dtype in self.dtypes


class IntSpec(_Spec):
    """An int (`128`), a list of ints (`[64, 128]`), or comparisons (`">=1024"`, `">=64,<=128"`)."""

    def __init__(self, values: frozenset[int] | None, comps: list[tuple[str, int]], text: str) -> None:
        self.values = values
        self.comps = comps
        self.text = text

    @classmethod
    def parse(cls, value: Any) -> IntSpec | None:
        if value is None or isinstance(value, IntSpec):
            return value
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number or range; write e.g. 128, [64, 128] or '>=1024'")
        if isinstance(value, int):
            return cls(frozenset({value}), [], str(value))
        if isinstance(value, list):
            if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"{value!r} must be a non-empty list of integers")
            return cls(frozenset(value), [], str(value))
        if isinstance(value, str):
            def parse_int(raw: str) -> int:
                try:
                    return int(raw)
                except ValueError:
                    raise ValueError(f"{raw!r} in range {value!r} is not an integer; write e.g. '>=1024' or "
                                     "'>=64,<=128'") from None
            spec = cls(None, _comparisons(value, parse_int, "range", "'>=1024' or '>=64,<=128'"), value)
            if spec.never():
                raise ValueError(f"range {value!r} admits no value (its lower bound is above its upper bound); write "
                                 "e.g. '>=64,<=128'")
            return spec
        raise ValueError(f"{value!r} is not a number or range; write e.g. 128, [64, 128] or '>=1024'")

    def matches(self, value: int) -> bool:
        if self.values is not None:
            return value in self.values
        return all(_OPS[op](value, n) for op, n in self.comps)

    def bounds(self) -> tuple[float, float]:
        """The [low, high] interval the spec allows (for lint: low > high never matches)."""
        if self.values is not None:
            return (min(self.values), max(self.values))
        low, high = -math.inf, math.inf
        for op, n in self.comps:
            if op == ">=":
                low = max(low, n)
            elif op == ">":
                low = max(low, n + 1)
            elif op == "<=":
                high = min(high, n)
            elif op == "<":
                high = min(high, n - 1)
            elif op == "==":
                low, high = max(low, n), min(high, n)
        return low, high

    def never(self) -> bool:
        low, high = self.bounds()
        return low > high


class BoolSpec(_Spec):
    def __init__(self, value: bool) -> None:
        self.value = value
        self.text = "true" if value else "false"

    @classmethod
    def parse(cls, value: Any) -> BoolSpec | None:
        if value is None or isinstance(value, BoolSpec):
            return value
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} must be true or false")
        return cls(value)

    def matches(self, value: bool) -> bool:
        return bool(value) == self.value
