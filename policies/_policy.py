"""Loading policy files and turning them, with env vars and scoped overrides, into a verdict per call.

Precedence, highest first: per-call ``impl=`` > `policy_override()` scopes > env vars (``OPDISPATCH_IMPL_<OP>``,
``OPDISPATCH_PREFER``, ``OPDISPATCH_DENY``) > the user's YAML (``OPDISPATCH_POLICY``) > the shipped default.
How matching rules combine is documented in docs/policy.md and implemented in `Policy.plan`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from opdispatch._decision import Provenance
from opdispatch._errors import PolicyError
from opdispatch._ops import known_ops, op_spec

from ._overrides import Override
from ._schema import ConditionError, OpPolicy, PolicyFile, Rule, Settings, When
from ._yaml import LineMap, load_yaml_with_lines

ENV_POLICY = "OPDISPATCH_POLICY"
ENV_PREFER = "OPDISPATCH_PREFER"
ENV_DENY = "OPDISPATCH_DENY"
ENV_PIN_PREFIX = "OPDISPATCH_IMPL_"


def default_policy_path() -> Path:
    return Path(str(resources.files("opdispatch.configs").joinpath("default.yaml")))


def _match_any(impl_id: str, patterns: Sequence[str]) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(impl_id, pattern):
            return pattern
    return None


@dataclass
class PolicyPlan:
    """The policy's verdict for one call: candidates in order, the denied ones, and a pin — each with provenance."""

    order: list[tuple[str, Provenance]] = field(default_factory=list)
    denied: dict[str, Provenance] = field(default_factory=dict)
    pin: tuple[str, Provenance] | None = None
    matched_rules: list[str] = field(default_factory=list)


class PolicyLayer:
    """One parsed policy file."""

    def __init__(self, model: PolicyFile, source: str, lines: LineMap, text: str) -> None:
        self.model = model
        self.source = source
        self.lines = lines
        self.text = text

    def where(self, *path: Any) -> str:
        line = self.lines.line(path)
        return f"{self.source}:{line}" if line else self.source

    def op(self, op: str) -> OpPolicy | None:
        return self.model.ops.get(op)


@dataclass(frozen=True)
class EnvOverrides:
    """What the OPDISPATCH_* env vars say, read once (at load and at reload) rather than per call."""

    pins: Mapping[str, str] = field(default_factory=dict)
    prefer: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EnvOverrides:
        from ._schema import check_impl_pattern

        def patterns(name: str) -> tuple[str, ...]:
            raw = environ.get(name, "")
            out = []
            for item in (p.strip() for p in raw.split(",")):
                if item:
                    try:
                        out.append(check_impl_pattern(item))
                    except ValueError as exc:
                        raise PolicyError(f"{name}={raw!r}: {exc}", field=name) from None
            return tuple(out)

        pins = {}
        for key, value in environ.items():
            if key.startswith(ENV_PIN_PREFIX) and value.strip():
                op = key[len(ENV_PIN_PREFIX):].lower()
                if op not in known_ops():
                    raise PolicyError(f"{key}={value!r}: unknown op {op!r}; known ops: {', '.join(known_ops())} "
                                      f"(e.g. {ENV_PIN_PREFIX}ATTENTION=cpu.flash)", field=key)
                pins[op] = check_impl_pattern(value.strip())
        return cls(pins=pins, prefer=patterns(ENV_PREFER), deny=patterns(ENV_DENY))


class Policy:
    """A stack of policy layers (user file over the shipped default) plus env overrides. Immutable: a reload
    builds a new Policy, with a new hash, and swaps it in atomically."""

    def __init__(self, layers: Sequence[PolicyLayer], env: EnvOverrides | None = None) -> None:
        if not layers:
            raise ValueError("a Policy needs at least one layer")
        self.layers = list(layers)
        self.env = env or EnvOverrides()
        digest = hashlib.sha256()
        for layer in self.layers:
            digest.update(f"{layer.source}\0{layer.text}\0".encode())
        digest.update(repr((sorted(self.env.pins.items()), self.env.prefer, self.env.deny)).encode())
        self.hash = digest.hexdigest()[:12]
        merged: dict[str, Any] = {}
        for layer in reversed(self.layers):  # higher layers override lower ones, field by field
            if layer.model.settings is not None:
                merged.update(layer.model.settings.model_dump(exclude_unset=True))
        self.settings = Settings(**merged)

    @property
    def source(self) -> str:
        return " over ".join(layer.source for layer in self.layers)

    @property
    def model(self) -> PolicyFile:
        return self.layers[0].model

    def __repr__(self) -> str:
        return f"<Policy {self.source} {self.hash}>"

    def with_env(self, env: EnvOverrides) -> Policy:
        return Policy(self.layers, env)

    def where(self, *path: Any) -> str:
        return self.layers[0].where(*path)

    def options(self, op: str) -> dict[str, dict[str, Any]]:
        """Per-implementation options for `op`, higher layers overriding lower ones per implementation."""
        merged: dict[str, dict[str, Any]] = {}
        for layer in reversed(self.layers):
            spec = layer.op(op)
            if spec is not None:
                merged.update(spec.options)
        return merged

    def autotune_table(self, op: str) -> tuple[Path, str] | None:
        """The autotune table path of the highest layer that names one, with its file:line."""
        for layer in self.layers:
            spec = layer.op(op)
            if spec is not None and spec.autotune:
                base = Path(layer.source).parent if Path(layer.source).exists() else Path.cwd()
                return (base / spec.autotune).resolve(), layer.where("ops", op, "autotune")
        return None

    def patterns(self, op: str) -> list[tuple[str, str, str]]:
        """Every (pattern, what, file:line) the policy names for `op`: used by strict mode and lint."""
        out = []
        for layer in self.layers:
            spec = layer.op(op)
            if spec is None:
                continue
            for key in ("order", "deny"):
                for i, p in enumerate(getattr(spec, key) or ()):
                    out.append((p, key, layer.where("ops", op, key, i)))
            for r_i, rule in enumerate(spec.rules):
                for key in ("prefer", "deny", "require"):
                    for i, p in enumerate(getattr(rule, key) or ()):
                        out.append((p, f"rule {rule.name!r} {key}", layer.where("ops", op, "rules", r_i, key, i)))
                if rule.pin:
                    out.append((rule.pin, f"rule {rule.name!r} pin", layer.where("ops", op, "rules", r_i, "pin")))
            for impl_id in spec.options:
                out.append((impl_id, "options", layer.where("ops", op, "options", impl_id)))
        return out

    # -- the verdict for one call ----------------------------------------------------------------------------
    def plan(self, op: str, impl_ids: list[str], call: Any = None, device: Any = None,
             overrides: Sequence[Override] = (), tuned: tuple[list[str], Provenance] | None = None) -> PolicyPlan:
        """Order `impl_ids` (given highest priority first), deny, require and pin, with provenance for each."""
        plan = PolicyPlan()
        prefer: list[tuple[Sequence[str], Provenance]] = []  # earlier entries outrank later ones
        deny: list[tuple[Sequence[str], Provenance]] = []
        require: list[tuple[Sequence[str], Provenance]] = []
        pins: list[tuple[str, Provenance]] = []

        def take(source: Override | Rule, prov: Provenance) -> None:
            """Collect the actions of an override scope or a matching rule (they share the action names)."""
            if source.pin:
                pins.append((source.pin, prov))
            for actions, patterns in ((prefer, source.prefer), (deny, source.deny), (require, source.require)):
                if patterns:
                    actions.append((patterns, prov))

        # Highest precedence first: scoped overrides (innermost first), then env vars.
        for ov in overrides:
            if ov.applies_to(op):
                take(ov, Provenance("context", ov.where))
        env_pin = self.env.pins.get(op)
        if env_pin:
            pins.append((env_pin, Provenance("env", f"{ENV_PIN_PREFIX}{op.upper()}", note=f"pinned to {env_pin}")))
        if self.env.prefer:
            prefer.append((self.env.prefer, Provenance("env", ENV_PREFER)))
        if self.env.deny:
            deny.append((self.env.deny, Provenance("env", ENV_DENY)))

        # Then the YAML layers, user file before the shipped default; rules in file order.
        base_order: tuple[list[str], PolicyLayer] | None = None
        for layer in self.layers:
            spec = layer.op(op)
            if spec is None:
                continue
            if spec.order is not None and base_order is None:
                base_order = (spec.order, layer)
            for i, pattern in enumerate(spec.deny):
                deny.append(([pattern], Provenance("policy", layer.where("ops", op, "deny", i),
                                                   note=f"deny {pattern!r}")))
            for r_i, rule in enumerate(spec.rules):
                if call is not None and not rule_matches(rule.when, call, device, op):
                    continue
                plan.matched_rules.append(rule.name)
                take(rule, Provenance("policy", layer.where("ops", op, "rules", r_i), rule=rule.name,
                                      note=rule.reason))

        if pins:
            plan.pin = pins[0]  # the highest-precedence pin wins; it outranks every lower-level deny
            return plan

        for impl_id in impl_ids:
            for patterns, prov in deny:
                if _match_any(impl_id, patterns):
                    plan.denied[impl_id] = prov
                    break
            else:
                for patterns, prov in require:
                    if not _match_any(impl_id, patterns):
                        plan.denied[impl_id] = Provenance(
                            prov.kind, prov.source, rule=prov.rule,
                            note=f"not in required {', '.join(patterns)}" + (f"; {prov.note}" if prov.note else ""))
                        break

        ranked = []
        for position, impl_id in enumerate(impl_ids):
            if impl_id in plan.denied:
                continue
            key: tuple[int, int, int]
            placed_by: Provenance | None = None
            for p_i, (patterns, p_prov) in enumerate(prefer):
                hit = _match_any(impl_id, patterns)
                if hit is not None:
                    key = (0, p_i, list(patterns).index(hit))
                    placed_by = Provenance(p_prov.kind, p_prov.source, rule=p_prov.rule,
                                      note=f"prefer {hit!r}" + (f"; {p_prov.note}" if p_prov.note else ""))
                    break
            if placed_by is None and tuned is not None and impl_id in tuned[0]:
                key = (1, 0, tuned[0].index(impl_id))
                placed_by = tuned[1]
            if placed_by is None and base_order is not None:
                order, layer = base_order
                hit = _match_any(impl_id, order)
                if hit is not None:
                    i = order.index(hit)
                    key = (2, 0, i)
                    placed_by = Provenance("policy", layer.where("ops", op, "order", i), note=f"order {hit!r}")
            if placed_by is None:
                key = (3, 0, 0)
                placed_by = Provenance("priority", "implementation priority",
                                  note="not named by the policy" if base_order else None)
            ranked.append((key, position, impl_id, placed_by))
        ranked.sort(key=lambda item: (item[0], item[1]))
        plan.order = [(impl_id, prov) for _, _, impl_id, prov in ranked]
        return plan


# -- rule matching -------------------------------------------------------------------------------------------

def rule_matches(when: When, call: Any, device: Any, op: str = "attention") -> bool:
    """Whether every condition of `when` holds for `call` (an `op` call record; its features are read through the
    op's spec) on `device`."""
    conditions = when.conditions()
    if not conditions:
        return True
    features = None
    for key, spec in conditions.items():
        if key == "vendor":
            ok = device is not None and spec.matches(device.vendor)
        elif key == "device_type":
            ok = device is not None and spec.matches(device.type)
        elif key == "arch":
            ok = device is not None and spec.matches(device.arch)
        elif key == "capability":
            ok = device is not None and spec.matches(device.capability)
        elif key == "device_name":
            ok = device is not None and spec.matches(device.name)
        elif key == "libraries":
            ok = device is not None and all(s.matches(_library_version(device, lib)) for lib, s in spec.items())
        elif key == "module":
            ok = spec.matches(getattr(call, "module", None))
        else:
            if features is None:
                features = op_spec(op).call_features(call)
            ok = spec.matches(features[key])
        if not ok:
            return False
    return True


def _library_version(device: Any, name: str) -> str | None:
    version: str | None = device.libraries.get(name)
    if version is not None or device.simulated:
        return version
    import importlib.metadata

    for dist in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# -- loading -------------------------------------------------------------------------------------------------

def _format_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_policy_layer(text: str, source: str) -> PolicyLayer:
    """Validate one policy file's `text`; every error names `source`, the line and the field."""
    try:
        data, lines = load_yaml_with_lines(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"{source}:{line}: invalid YAML: {problem}", path=source, line=line,
                          field="(syntax)") from exc
    except ValueError as exc:  # duplicate keys, found while composing
        line = getattr(exc, "line", None)
        raise PolicyError(f"{source}:{line}: {exc}", path=source, line=line, field=getattr(exc, "field", None)) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{source}:1: field (top level): the top level must be a mapping with version, extends, "
                          f"settings and ops, got {type(data).__name__}", path=source, line=1, field="(top level)")
    try:
        model = PolicyFile.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        line = lines.line(loc)
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) or err["type"] == "missing" else f"; got {value!r}"
        msg = err["msg"].removeprefix("Value error, ")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConditionError):  # a `when:` key: point at that key's line
            loc = (*loc, cause.key)
            line = lines.line(loc)
            shown = "" if isinstance(cause.value, (dict, list)) else f"; got {cause.value!r}"
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {loc[-1]!r}; allowed keys here: {_allowed_keys(loc)}"
        raise PolicyError(f"{source}:{line}: field {_format_loc(loc)}: {msg}{shown}{more}", path=source, line=line,
                          field=_format_loc(loc)) from exc
    for op, spec in model.ops.items():
        seen: dict[str, int] = {}
        for i, rule in enumerate(spec.rules):
            if rule.name in seen:
                line = lines.line(("ops", op, "rules", i, "name"))
                field = f"ops.{op}.rules.{i}.name"
                raise PolicyError(f"{source}:{line}: field {field}: rule name {rule.name!r} is used twice (first as "
                                  f"rule {seen[rule.name]}); rule names must be unique per op", path=source, line=line,
                                  field=field)
            seen[rule.name] = i
        if op not in known_ops():
            line = lines.line(("ops", op))
            raise PolicyError(f"{source}:{line}: field ops.{op}: unknown op {op!r}; known ops: "
                              f"{', '.join(known_ops())}",
                              path=source, line=line, field=f"ops.{op}")
        features = op_spec(op).features
        for i, rule in enumerate(spec.rules):
            for key in rule.when.feature_keys():
                if key not in features:
                    loc = ("ops", op, "rules", i, "when", key)
                    line = lines.line(loc)
                    raise PolicyError(
                        f"{source}:{line}: field {_format_loc(loc)}: {key!r} is not a feature of op {op!r}; its "
                        f"call features: {', '.join(sorted(features))} (device keys and module apply to every op)",
                        path=source, line=line, field=_format_loc(loc))
    return PolicyLayer(model, source, lines, text)


def _allowed_keys(loc: tuple[Any, ...]) -> str:
    parent = loc[:-1]
    model: Any = PolicyFile
    walk = list(parent)
    while walk:
        key = walk.pop(0)
        if model is PolicyFile and key == "ops":
            model = OpPolicy
            walk.pop(0) if walk else None
        elif model is PolicyFile and key == "settings":
            model = Settings
        elif model is OpPolicy and key == "rules":
            model = Rule
            walk.pop(0) if walk else None
        elif model is Rule and key == "when":
            model = When
        else:
            break
    return ", ".join(model.model_fields)


def read_policy_file(path: str | os.PathLike[str]) -> PolicyLayer:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {str(path)!r}: {exc.strerror}; check {ENV_POLICY} or the path "
                          "you passed", path=str(path)) from exc
    return parse_policy_layer(text, str(path))


def _stack(user: PolicyLayer | None, environ: Mapping[str, str] | None) -> Policy:
    layers = []
    if user is not None:
        layers.append(user)
    if user is None or user.model.extends == "default":
        layers.append(read_policy_file(default_policy_path()))
    env = EnvOverrides.from_environ(os.environ if environ is None else environ)
    return Policy(layers, env)


def parse_policy(text: str, source: str = "<string>", *, environ: Mapping[str, str] | None = None) -> Policy:
    """A Policy from YAML text (layered over the shipped default unless it says `extends: none`)."""
    return _stack(parse_policy_layer(text, source), environ if environ is not None else {})


def load_policy(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> Policy:
    """Load `path`, else ``$OPDISPATCH_POLICY``, over the shipped default; env overrides are read now."""
    environ = os.environ if environ is None else environ
    if path is None:
        path = environ.get(ENV_POLICY) or None
    user = read_policy_file(path) if path is not None else None
    return _stack(user, environ)
