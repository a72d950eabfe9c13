"""Loading policy files into a `Policy`: the YAML layers (the user's file over the shipped default) and the env
overrides, read once. The verdict for one call — the precedence of every layer — is `opdispatch.policies._plan`.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from opdispatch.base._errors import PolicyError
from opdispatch.base._ops import known_ops, op_spec

from ._overrides import Override
from ._plan import (DEFAULT, ENV_DENY, ENV_PIN_PREFIX, ENV_PREFER, QUARANTINE, USER, Layer, PolicyPlan,
                    build_plan)
from ._schema import ConditionError, OpPolicy, PolicyFile, Rule, Settings, When
from ._yaml import LineMap, load_yaml_with_lines

ENV_POLICY = "OPDISPATCH_POLICY"
ENV_QUARANTINE = "OPDISPATCH_QUARANTINE"
log = logging.getLogger("opdispatch")


def default_policy_path() -> Path:
    return Path(str(resources.files("opdispatch.configs").joinpath("default.yaml")))


def shipped_quarantine_path() -> Path:
    return Path(str(resources.files("opdispatch.configs").joinpath("quarantine.yaml")))


def user_quarantine_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where `opdispatch validate` writes, and the policy reads, this user's quarantine: OPDISPATCH_QUARANTINE, else
    $XDG_CACHE_HOME/opdispatch/quarantine.yaml (~/.cache/...)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_QUARANTINE):
        return Path(environ[ENV_QUARANTINE])
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "opdispatch" / "quarantine.yaml"

class PolicyLayer:
    """One parsed policy file."""

    def __init__(self, model: PolicyFile, source: str, lines: LineMap, text: str, quarantine: bool = False) -> None:
        self.model = model
        self.source = source
        self.lines = lines
        self.text = text
        self.quarantine = quarantine  # a quarantine file of `opdispatch validate` (deny rules only)

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
        # Each YAML layer with its place in the precedence: the shipped file is the default, any other the user's.
        default_source = str(default_policy_path())
        self.yaml_layers: list[tuple[Layer, PolicyLayer]] = [
            (QUARANTINE if layer.quarantine else DEFAULT if layer.source == default_source else USER, layer)
            for layer in self.layers]
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
        # Whether any rule matches on the calling module (`when: {module: ...}`): only then can a scope change a
        # decision, so front doors that name modules on every call (compat.hf) may skip it otherwise.
        self.reads_module = any(rule.when.module is not None for layer in self.layers
                                for spec in layer.model.ops.values() for rule in spec.rules)

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
             overrides: Sequence[Override] = (), impl: str | None = None) -> PolicyPlan:
        """Order `impl_ids` (given highest priority first), deny, require and pin, with provenance for each: the
        precedence of `opdispatch.policies._plan` (its docstring documents it)."""
        return build_plan(self, op, impl_ids, call, device, overrides, impl)


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
        if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses (NUL, control): no mark, a position
            line = text.count("\n", 0, exc.position) + 1
            char = chr(exc.character) if isinstance(exc.character, int) else exc.character  # C loader: a code
            problem = (f"character {char!r} at offset {exc.position} is not allowed in YAML; remove it "
                       "(is this a text file?)")
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
        raise _all_of([_schema_problem(err, lines, source) for err in exc.errors()]) from exc
    problems = _rule_name_and_op_problems(model, lines, source)
    if problems:
        raise _all_of(problems)
    return PolicyLayer(model, source, lines, text)


def _all_of(problems: list[PolicyError]) -> PolicyError:
    """One error for every problem of a file: its message is the first problem's (loading stops there), with a
    count of the rest; `problems` holds each, deduplicated, for `opdispatch policy lint`."""
    unique = list({(p.line, p.field, str(p)): p for p in problems}.values())
    first = unique[0]
    more = (f" (and {len(unique) - 1} more problem(s); `opdispatch policy lint {first.path}` lists them all)"
            if len(unique) > 1 else "")
    return PolicyError(f"{first}{more}", path=first.path, line=first.line, field=first.field, problems=tuple(unique))


def _schema_problem(err: Any, lines: LineMap, source: str) -> PolicyError:
    """One pydantic error as a PolicyError naming source:line and the field, said the YAML way."""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    line = lines.line(loc)
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) or err["type"] == "missing" else f"; got {value!r}"
    msg = _STRICT_TYPE_HINTS.get(err["type"], err["msg"].removeprefix("Value error, "))
    if err["type"] == "list_type" and isinstance(err.get("input"), (set, frozenset)):
        msg += " (a !!set has no order: it would depend on PYTHONHASHSEED)"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConditionError):  # a `when:` key: point at that key's line
        loc = (*loc, cause.key)
        line = lines.line(loc)
        shown = "" if isinstance(cause.value, (dict, list)) else f"; got {cause.value!r}"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
        close = difflib.get_close_matches(str(loc[-1]), allowed.split(", "), n=1)
        # The value of a misspelt key is not what is wrong: say the key, and the one probably meant.
        shown = f"; did you mean {close[0]!r}?" if close else ""
        msg = f"unknown key {loc[-1]!r}; allowed keys here: {allowed}"
    return PolicyError(f"{source}:{line}: field {_format_loc(loc)}: {msg}{shown}", path=source, line=line,
                       field=_format_loc(loc))


def _rule_name_and_op_problems(model: PolicyFile, lines: LineMap, source: str) -> list[PolicyError]:
    """What the schema cannot see: a rule name used twice in an op, an unknown op, a `when:` key the op lacks."""
    problems = []
    for op, spec in model.ops.items():
        seen: dict[str, int] = {}
        for i, rule in enumerate(spec.rules):
            if rule.name in seen:
                line = lines.line(("ops", op, "rules", i, "name"))
                field = f"ops.{op}.rules.{i}.name"
                problems.append(PolicyError(
                    f"{source}:{line}: field {field}: rule name {rule.name!r} is used twice (first as rule "
                    f"{seen[rule.name]}); rule names must be unique per op", path=source, line=line, field=field))
            else:
                seen[rule.name] = i
        if op not in known_ops():
            line = lines.line(("ops", op))
            close = difflib.get_close_matches(op, known_ops(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(PolicyError(f"{source}:{line}: field ops.{op}: unknown op {op!r}; known ops: "
                                        f"{', '.join(known_ops())}{hint}", path=source, line=line, field=f"ops.{op}"))
            continue
        features = op_spec(op).features
        for i, rule in enumerate(spec.rules):
            for key in rule.when.feature_keys():
                if key not in features:
                    loc = ("ops", op, "rules", i, "when", key)
                    line = lines.line(loc)
                    problems.append(PolicyError(
                        f"{source}:{line}: field {_format_loc(loc)}: {key!r} is not a feature of op {op!r}; its "
                        f"call features: {', '.join(sorted(features))} (device keys and module apply to every op)",
                        path=source, line=line, field=_format_loc(loc)))
    return problems


# Pydantic's words for a strict type mismatch, said the YAML way (with what a user probably wrote instead).
_STRICT_TYPE_HINTS = {
    "bool_type": "must be true or false, unquoted (a quoted word such as 'off' or a number is not a boolean)",
    "list_type": "must be a YAML list, [a, b] or one '- item' per line",
    "int_type": "must be an integer",
    "string_type": "must be a string",
    "dict_type": "must be a mapping of key: value",
    "model_type": "must be a mapping of key: value",
}


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
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {str(path)!r}: {exc.strerror}; check {ENV_POLICY} or the path "
                          "you passed", path=str(path)) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise PolicyError(f"{path}:{line}: the policy file is not UTF-8 text (byte {raw[exc.start]:#04x} at offset "
                          f"{exc.start}); save it as UTF-8", path=str(path), line=line, field="(encoding)") from None
    return parse_policy_layer(text, str(path))


def read_quarantine_file(path: str | os.PathLike[str]) -> PolicyLayer:
    """A quarantine file: a policy file of deny rules only (what `opdispatch validate` writes)."""
    layer = read_policy_file(path)
    layer.quarantine = True
    for op, spec in layer.model.ops.items():
        if spec.order is not None or spec.options or spec.autotune:
            raise PolicyError(f"{layer.where('ops', op)}: a quarantine file holds deny rules only (no order, options "
                              "or autotune); move them to your policy file", path=layer.source, field=f"ops.{op}")
        for i, rule in enumerate(spec.rules):
            if rule.deny is None or rule.prefer or rule.require or rule.pin:
                raise PolicyError(f"{layer.where('ops', op, 'rules', i)}: quarantine rule {rule.name!r} must only "
                                  "deny (prefer, require and pin belong in a policy file)", path=layer.source,
                                  field=f"ops.{op}.rules.{i}")
    return layer


def quarantine_layers(environ: Mapping[str, str] | None) -> list[PolicyLayer]:
    """The shipped quarantine, then the user's if the file exists (read from the real environment, or from
    OPDISPATCH_QUARANTINE in `environ`). A quarantine only narrows choices: one that is not a regular file (a FIFO
    would block the open), cannot be read or is malformed is reported as a WARNING with its file:line and skipped;
    it never blocks or stops dispatch."""
    layers = []
    paths = [shipped_quarantine_path()]
    if environ is None or environ.get(ENV_QUARANTINE):
        paths.append(user_quarantine_path(environ))
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("quarantine file %s skipped: cannot stat it (%s)", path, exc.strerror)
            continue
        if not stat.S_ISREG(mode):
            log.warning("quarantine file %s skipped: not a regular file; point %s at a YAML file", path,
                        ENV_QUARANTINE)
            continue
        try:
            layers.append(read_quarantine_file(path))
        except PolicyError as exc:
            log.warning("quarantine file skipped: %s", exc)
    return layers


def _stack(user: PolicyLayer | None, environ: Mapping[str, str] | None) -> Policy:
    layers = []
    if user is not None:
        layers.append(user)
    if user is None or user.model.extends == "default":
        layers.append(read_policy_file(default_policy_path()))
    layers.extend(quarantine_layers(environ))
    env = EnvOverrides.from_environ(os.environ if environ is None else environ)
    return Policy(layers, env)


def parse_policy(text: str, source: str = "<string>", *, environ: Mapping[str, str] | None = None) -> Policy:
    """A Policy from YAML text (layered over the shipped default unless it says `extends: none`)."""
    return _stack(parse_policy_layer(text, source), environ if environ is not None else {})


def load_policy(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> Policy:
    """Load `path`, else ``$OPDISPATCH_POLICY``, over the shipped default; env overrides are read now."""
    real = environ is None or environ is os.environ
    environ = os.environ if environ is None else environ
    if path is None:
        path = environ.get(ENV_POLICY) or None
    user = read_policy_file(path) if path is not None else None
    return _stack(user, None if real else environ)
