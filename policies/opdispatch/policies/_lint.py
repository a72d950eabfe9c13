"""`opdispatch policy lint`: find what is wrong or useless in a policy file, each finding with file:line."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opdispatch.base._errors import PolicyError

from ._plan import rule_matches
from ._policy import PolicyLayer, read_policy_file
from ._schema import Rule, When


@dataclass(frozen=True)
class Finding:
    where: str
    level: str  # error | warning
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.level}: {self.message}"


_DEVICE_KEYS = ("vendor", "device_type", "arch", "capability", "device_name", "libraries")
_ARCH_FAMILY_VENDOR = {"sm": "nvidia", "gfx": "amd"}


def _contradictions(when: When) -> list[str]:
    """Why a rule's conditions can never hold together, whatever the device and call."""
    problems = []
    cond = when.conditions()
    for key, spec in cond.items():
        never = getattr(spec, "never", None)
        if never is not None and never():
            problems.append(f"{key}: {spec} admits no value")
    vendor = cond.get("vendor")
    arch = cond.get("arch")
    if vendor is not None and arch is not None and not arch.exact:
        families = {fam for fam, _ in arch.ranges}
        if not any(_ARCH_FAMILY_VENDOR.get(f) in vendor.names for f in families):
            problems.append(f"arch {arch} is a range of another vendor's arch names than vendor {vendor}")
    if vendor is not None and cond.get("capability") is not None and vendor.names <= {"cpu"}:
        problems.append("capability never matches a CPU (it reports none)")
    layout = cond.get("layout")
    varlen = cond.get("varlen")
    if layout is not None and varlen is not None:
        if varlen.value and "thd" not in layout.names:
            problems.append(f"varlen: true needs layout thd, but layout is {layout}")
        if not varlen.value and layout.names <= {"thd"}:
            problems.append("varlen: false contradicts layout thd")
    ratio = cond.get("gqa_ratio")
    if ratio is not None and ratio.bounds()[1] < 1:
        problems.append(f"gqa_ratio {ratio} is below 1, which no call has")
    return problems


def _disjoint(a: Any, b: Any) -> bool:
    """Whether two matchers of one `when:` key admit no common value (False when unsure)."""
    for attr in ("names", "dtypes"):
        if hasattr(a, attr) and hasattr(b, attr):
            return not (getattr(a, attr) & getattr(b, attr))
    if hasattr(a, "value") and hasattr(b, "value"):  # BoolSpec
        return bool(a.value != b.value)
    if hasattr(a, "bounds") and hasattr(b, "bounds"):  # IntSpec
        if a.values is not None and b.values is not None:
            return not (a.values & b.values)
        (a_low, a_high), (b_low, b_high) = a.bounds(), b.bounds()
        return bool(a_high < b_low or b_high < a_low)
    return False


def _can_both_hold(first: When, second: When) -> bool:
    a, b = first.conditions(), second.conditions()
    return not any(_disjoint(a[k], b[k]) for k in a.keys() & b.keys())


def _require_findings(layer: PolicyLayer, op: str, spec: Any, known: list[str]) -> list[Finding]:
    """`require` lists that leave no implementation: alone (all they name is unregistered or denied by the op's
    deny), or together with another require rule that can match the same call."""
    findings = []
    denied = {i for p in spec.deny for i in _matching(p, known)}
    allowed: list[tuple[int, Rule, set[str]]] = []
    for r_i, rule in enumerate(spec.rules):
        if not rule.require:
            continue
        ids = {i for p in rule.require for i in _matching(p, known)} - denied
        where = layer.where("ops", op, "rules", r_i, "require")
        if not ids:
            findings.append(Finding(where, "error", f"rule {rule.name!r} requires {rule.require}, but no registered "
                                                    f"implementation of {op!r} that is not denied matches: every call "
                                                    "it matches fails with NoImplementationError"))
            continue
        for e_i, earlier, earlier_ids in allowed:
            if not (ids & earlier_ids) and _can_both_hold(earlier.when, rule.when):
                findings.append(Finding(where, "error", (
                    f"rule {rule.name!r} requires {sorted(ids)} and rule {earlier.name!r} "
                    f"({layer.where('ops', op, 'rules', e_i)}) requires {sorted(earlier_ids)}: a call matching both "
                    "has no implementation left; make their conditions exclusive or their lists overlap")))
        allowed.append((r_i, rule, ids))
    return findings


def _autotune_findings(layer: PolicyLayer, op: str, spec: Any) -> list[Finding]:
    if not spec.autotune:
        return []
    from ._tuned_table import TunedTable

    base = Path(layer.source).parent if Path(layer.source).exists() else Path.cwd()
    path = (base / spec.autotune).resolve()
    where = layer.where("ops", op, "autotune")
    if not path.exists():
        return [Finding(where, "error", f"autotune table {spec.autotune!r} ({path}) does not exist: dispatch warns "
                                        f"once and uses the policy order; run `opdispatch tune --op {op} --out "
                                        f"{path}` on the target device, or remove the key")]
    try:
        table = TunedTable.load(path)
    except ValueError as exc:
        return [Finding(where, "error", f"{exc} (dispatch ignores it and uses the policy order)")]
    if table.op != op:
        return [Finding(where, "error", f"autotune table {path} was measured for op {table.op!r}, not {op!r}")]
    return []


def _device_mismatch(when: When, device: Any) -> bool:
    device_only = When(**{k: v for k, v in when.conditions().items() if k in _DEVICE_KEYS})
    return bool(device_only.conditions()) and not rule_matches(device_only, None, device)


def _covers(general: When, specific: When) -> bool:
    """True when `general` matches at least whenever `specific` does (its conditions are a subset)."""
    g, s = general.conditions(), specific.conditions()
    return all(k in s and str(s[k]) == str(v) for k, v in g.items())


def _matching(pattern: str, ids: Iterable[str]) -> list[str]:
    return [i for i in ids if fnmatch.fnmatchcase(i, pattern)]


def option_problem(impl: Any, options: dict[str, Any]) -> str | None:
    """Why `options` are not valid for `impl` (its own options model says), in one line, or None."""
    from pydantic import ValidationError

    try:
        impl.with_options(options)
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(options)'}: {e['msg']} (got {e.get('input')!r})"
                         for e in exc.errors())
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None


def lint_layer(layer: PolicyLayer, impl_ids: dict[str, list[str]], device: Any = None,
               impls: dict[str, dict[str, Any]] | None = None) -> list[Finding]:
    """`impls` (op -> id -> implementation): also check option values with each implementation's own model."""
    findings: list[Finding] = []
    for op, spec in layer.model.ops.items():
        known = impl_ids.get(op, [])

        def check(pattern: str, what: str, *path: Any) -> None:
            if not _matching(pattern, known):
                close = difflib.get_close_matches(pattern, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                findings.append(Finding(layer.where(*path), "warning",
                                        f"{what} {pattern!r} matches no registered implementation of {op!r} "
                                        f"(registered: {', '.join(known) or 'none'}){hint}"))

        for i, p in enumerate(spec.order or ()):
            check(p, "order", "ops", op, "order", i)
        for i, p in enumerate(spec.deny):
            check(p, "deny", "ops", op, "deny", i)
            for impl_id in _matching(p, known):
                findings.append(Finding(layer.where("ops", op, "deny", i), "warning",
                                        f"{impl_id} is denied everywhere by deny {p!r}: it can never be chosen"))
        for impl_id in spec.options:
            check(impl_id, "options for", "ops", op, "options", impl_id)
            impl = (impls or {}).get(op, {}).get(impl_id)
            problem = None if impl is None else option_problem(impl, spec.options[impl_id])
            if problem:
                findings.append(Finding(layer.where("ops", op, "options", impl_id), "error",
                                        f"options for {impl_id}: {problem}"))
        findings.extend(_require_findings(layer, op, spec, known))
        findings.extend(_autotune_findings(layer, op, spec))

        rules: list[Rule] = spec.rules
        for r_i, rule in enumerate(rules):
            where = layer.where("ops", op, "rules", r_i)
            for key in ("prefer", "deny", "require"):
                for i, p in enumerate(getattr(rule, key) or ()):
                    check(p, f"rule {rule.name!r} {key}", "ops", op, "rules", r_i, key, i)
            if rule.pin:
                check(rule.pin, f"rule {rule.name!r} pin", "ops", op, "rules", r_i, "pin")
            for problem in _contradictions(rule.when):
                findings.append(Finding(where, "warning", f"rule {rule.name!r} can never match: {problem}"))
            if device is not None and _device_mismatch(rule.when, device):
                findings.append(Finding(where, "warning", f"rule {rule.name!r} never matches on {device.describe()}"))
            if not rule.when.conditions() and rule.deny:
                for p in rule.deny:
                    for impl_id in _matching(p, known):
                        findings.append(Finding(where, "warning", f"{impl_id} is denied everywhere by rule "
                                                                  f"{rule.name!r} (it has no conditions)"))
            for e_i, earlier in enumerate(rules[:r_i]):
                if not _covers(earlier.when, rule.when):
                    continue
                if earlier.pin:
                    earlier_at = layer.where("ops", op, "rules", e_i)
                    findings.append(Finding(where, "warning", f"rule {rule.name!r} is shadowed by rule "
                                                              f"{earlier.name!r} ({earlier_at}), which pins "
                                                              f"{earlier.pin} whenever this rule matches"))
                    break
                same_actions = all(getattr(earlier, a) == getattr(rule, a) for a in ("prefer", "deny", "require"))
                if same_actions and str(earlier.when.conditions()) == str(rule.when.conditions()):
                    findings.append(Finding(where, "warning", f"rule {rule.name!r} repeats rule {earlier.name!r} "
                                                              f"({layer.where('ops', op, 'rules', e_i)})"))
                    break
    return findings


def lint_policy_file(path: str | Path, impl_ids: dict[str, list[str]], device: Any = None,
                     impls: dict[str, dict[str, Any]] | None = None) -> list[Finding]:
    """Lint one policy file. A file that does not load is reported as its errors, every one the schema found
    (level error, each with its file:line), and nothing else: the other checks need the loaded policy."""
    try:
        layer = read_policy_file(path)
    except PolicyError as exc:
        return [_error_finding(problem, path) for problem in sorted(exc.problems, key=lambda p: p.line or 0)]
    return lint_layer(layer, impl_ids, device, impls)


def _error_finding(exc: PolicyError, path: str | Path) -> Finding:
    where = f"{exc.path}:{exc.line}" if exc.line else str(exc.path or path)
    message = str(exc)
    if message.startswith(where + ": "):
        message = message[len(where) + 2:]
    return Finding(where, "error", message)
