"""Quarantine files: the deny-only policy layer that `opdispatch validate` and shadow checks (OPDISPATCH_SHADOW)
write — each rule scoped to the combination, device and library versions it failed on — merged into the file that
is there, and written whole. Reading one as a policy layer is `_policy.read_quarantine_file`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ._policy import read_quarantine_file

__all__ = ["env_conditions", "merge_quarantine", "quarantine_text", "read_existing_quarantine", "rule_libraries",
           "rule_name", "write_quarantine"]


def env_conditions(device: Any, libraries: dict[str, str]) -> dict[str, Any]:
    """The device and library conditions every rule of this environment carries."""
    when: dict[str, Any] = {"vendor": device.vendor, "arch": device.arch,
                            "device_name": "".join(f"[{c}]" if c in "[]*?" else c for c in device.name)}
    if libraries:
        when["libraries"] = libraries
    return when


def rule_libraries(impl: Any, device: Any) -> dict[str, str]:
    """The library versions a quarantine rule of `impl` is scoped to: torch and the libraries it requires."""
    keys = {"torch"} | {r.library_key for r in getattr(impl, "requires", ())}
    return {k: f"=={v}" for k, v in sorted(device.libraries.items()) if k in keys}


def write_quarantine(path: Path, text: str) -> None:
    """Write a quarantine file whole: readers (other processes loading their policy) see the old file or the new
    one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def merge_quarantine(existing: dict[str, Any] | None, new_rules: dict[str, dict[str, list[dict[str, Any]]]],
                     validated: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The quarantine file's content after a run: `existing`'s rules kept but those of an implementation validated
    here on this environment (`validated`: id -> its device and library conditions), which this run's
    `new_rules` (id -> op -> rules) replace."""
    env_keys = ("vendor", "arch", "device_name", "libraries")
    ops: dict[str, list[dict[str, Any]]] = {}
    for op, spec in ((existing or {}).get("ops") or {}).items():
        for rule in (spec or {}).get("rules") or ():
            deny, when = rule.get("deny") or [], rule.get("when") or {}
            ours = len(deny) == 1 and deny[0] in validated and all(
                when.get(k) == validated[deny[0]].get(k) for k in env_keys)
            if not ours:
                ops.setdefault(op, []).append(rule)
    for impl_rules in new_rules.values():
        for op, rules in impl_rules.items():
            kept = ops.setdefault(op, [])
            names = {r.get("name") for r in kept}
            for rule in rules:
                if rule in kept:  # kept from an earlier run of an implementation not finished this time
                    continue
                name, n = rule["name"], 2
                while rule["name"] in names:  # a rule of another host under this name
                    rule = {**rule, "name": f"{name}-{n}"}
                    n += 1
                kept.append(rule)
                names.add(rule["name"])
    ops = {op: rules for op, rules in ops.items() if rules}
    body: dict[str, Any] = {"version": 1, "extends": "none"}
    if ops:
        body["ops"] = {op: {"rules": rules} for op, rules in sorted(ops.items())}
    return body


def quarantine_text(body: dict[str, Any], device: Any, command: str) -> str:
    import yaml

    header = (f"# Last written by `{command}` on {time.strftime('%Y-%m-%d %H:%M')} for {device.describe()}.\n"
              "# Deny rules only, each scoped to the combination, dtypes, device and library versions it failed on;\n"
              "# a run rewrites only the rules of the implementations it validated on its environment.\n"
              "# Delete a rule (or the file) to try the implementation again; a pin still reaches it.\n")
    return header + yaml.safe_dump(body, sort_keys=False, width=120)


def rule_name(impl_id: str, feature: str) -> str:
    """A policy rule name (letters, digits, ``_.:-``) for an implementation's failing combination."""
    return "quarantine-" + "".join(c if c.isalnum() or c in "_.:-" else "-" for c in f"{impl_id}-{feature}")


def read_existing_quarantine(path: Path) -> dict[str, Any] | None:
    """The quarantine file a run merges into (None: none there). Refuses one it cannot read rather than drop its
    rules: fix it, or start over with --replace."""
    import stat

    import yaml

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"validate: the quarantine path {path} is not a regular file; pass another --quarantine")
    read_quarantine_file(path)  # a PolicyError with file:line when it is not a valid quarantine
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else None
