"""Loading a policy file and turning it into an ordered, filtered candidate list with provenance."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from opdispatch._decision import Provenance
from opdispatch._errors import PolicyError

from ._schema import OpPolicy, PolicyFile
from ._yaml import LineMap, load_yaml_with_lines

ENV_POLICY = "OPDISPATCH_POLICY"
KNOWN_OPS = ("attention",)


def default_policy_path() -> Path:
    return Path(str(resources.files("opdispatch.configs").joinpath("default.yaml")))


@dataclass
class PolicyPlan:
    """The policy's verdict for one call: candidates in order, and those it denies, each with provenance."""

    order: list[tuple[str, Provenance]] = field(default_factory=list)
    denied: dict[str, Provenance] = field(default_factory=dict)


class Policy:
    """A loaded, validated policy. Immutable: reloading builds a new one (with a new hash)."""

    def __init__(self, model: PolicyFile, source: str, lines: LineMap, text: str) -> None:
        self.model = model
        self.source = source
        self.lines = lines
        self.hash = hashlib.sha256(f"{source}\0{text}".encode()).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"<Policy {self.source} {self.hash}>"

    @property
    def settings(self) -> Any:
        return self.model.settings

    def where(self, *path: Any) -> str:
        line = self.lines.line(path)
        return f"{self.source}:{line}" if line else self.source

    def op(self, op: str) -> OpPolicy:
        return self.model.ops.get(op) or OpPolicy()

    def plan(self, op: str, impl_ids: list[str], call: Any = None, device: Any = None) -> PolicyPlan:
        """Order `impl_ids` (given highest priority first) and mark the denied ones."""
        spec = self.op(op)
        plan = PolicyPlan()
        for i, pattern in enumerate(spec.deny):
            for impl_id in impl_ids:
                if impl_id not in plan.denied and fnmatch.fnmatchcase(impl_id, pattern):
                    plan.denied[impl_id] = Provenance("policy", self.where("ops", op, "deny", i),
                                                      note=f"deny {pattern!r}")
        ranked = []
        for position, impl_id in enumerate(impl_ids):
            if impl_id in plan.denied:
                continue
            for i, pattern in enumerate(spec.order):
                if fnmatch.fnmatchcase(impl_id, pattern):
                    prov = Provenance("policy", self.where("ops", op, "order", i), note=f"order {pattern!r}")
                    ranked.append(((i, position), impl_id, prov))
                    break
            else:
                prov = Provenance("priority", "implementation priority",
                                  note=f"not in {self.source} order" if spec.order else None)
                ranked.append(((len(spec.order), position), impl_id, prov))
        ranked.sort(key=lambda item: item[0])
        plan.order = [(impl_id, prov) for _, impl_id, prov in ranked]
        return plan


def _format_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_policy(text: str, source: str) -> Policy:
    """Validate policy `text`; every error names `source`, the line and the field."""
    try:
        data, lines = load_yaml_with_lines(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"{source}:{line}: invalid YAML: {problem}", path=source, line=line) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{source}:1: the top level must be a mapping (version, settings, ops), got "
                          f"{type(data).__name__}", path=source, line=1, field="(top level)")
    try:
        model = PolicyFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        line = lines.line(loc)
        more = f" (and {len(exc.errors()) - 1} more problem(s))" if len(exc.errors()) > 1 else ""
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f"; got {value!r}"
        raise PolicyError(f"{source}:{line}: field {_format_loc(loc)}: {err['msg']}{shown}{more}",
                          path=source, line=line, field=_format_loc(loc)) from exc
    for op in model.ops:
        if op not in KNOWN_OPS:
            line = lines.line(("ops", op))
            raise PolicyError(f"{source}:{line}: field ops.{op}: unknown op {op!r}; known ops: "
                              f"{', '.join(KNOWN_OPS)}", path=source, line=line, field=f"ops.{op}")
    return Policy(model, source, lines, text)


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """Load `path`, else ``$OPDISPATCH_POLICY``, else the shipped ``configs/default.yaml``."""
    if path is None:
        path = os.environ.get(ENV_POLICY) or default_policy_path()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {str(path)!r}: {exc.strerror}; check {ENV_POLICY} or the path "
                          "you passed", path=str(path)) from exc
    return parse_policy(text, str(path))
