"""The policy file schema (pydantic v2). docs/policy.md describes it for users; this module is the source of truth.

Conditions are parsed here, at load time, into matcher objects (policies/opdispatch/policies/_match.py), so a malformed
range such as ``">=smX"`` fails when the file is read, with its line, and never at dispatch time.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ._match import (ArchSpec, BoolSpec, CapabilitySpec, DTypeSpec, GlobSpec, IntSpec, LibrarySpec, NameSpec,
                     check_glob_brackets)

# An implementation id or a glob over ids: "nvidia.cudnn", "nvidia.*", "*.flash".
_IMPL_PATTERN = re.compile(r"^[a-z0-9_*?\[\]!]+\.[a-z0-9_*?\[\]!]+$|^\*$")


def check_impl_pattern(value: Any) -> str:
    if not isinstance(value, str) or not _IMPL_PATTERN.match(value):
        raise ValueError(f"{value!r} is not an implementation id or glob; write '<vendor>.<name>' such as "
                         "'nvidia.cudnn', or a glob such as 'nvidia.*'")
    check_glob_brackets(value)
    return value


def is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


class _Strict(BaseModel):
    # strict: a YAML value is taken as written — `!!set` is not a list (its order would depend on
    # PYTHONHASHSEED), "off" or 0.0 is not a boolean, 1.0 is not an int.
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, strict=True)


def check_no_duplicates(values: list[str] | None, what: str) -> None:
    """A list of ids or globs names each once: a repeat is a typo or a merge left-over, never a meaning."""
    seen: set[str] = set()
    for value in values or ():
        if value in seen:
            raise ValueError(f"{what} names {value!r} twice; name each implementation or glob once")
        seen.add(value)


class Settings(_Strict):
    """Policy-wide behaviour."""

    fallback_on_error: bool = Field(
        default=True, description="when the chosen implementation raises at run time, demote it for that call "
                                  "class and let the next eligible one take the call (never for a pin)")
    strict: bool = Field(
        default=False, description="implementation ids that match nothing registered are errors, not warnings")


class ConditionError(ValueError):
    """A bad `when:` condition, naming its key (policy errors then point at that key's line)."""

    def __init__(self, key: str, message: str, value: Any) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


# How each feature kind (opdispatch.base._ops.FEATURE_KINDS) is parsed into a matcher.
_PARSERS: dict[str, Any] = {"int": IntSpec.parse, "bool": BoolSpec.parse, "name": NameSpec.parse,
                            "dtype": DTypeSpec.parse, "glob": GlobSpec.parse}


class When(_Strict):
    """Conditions of a rule: all given keys must match (AND); a list value matches any of its items (OR).

    The device keys and `module` are declared here; every other key is a call feature of some op (each op's spec,
    `opdispatch.base._ops.OpSpec.features`, names its keys and their kinds), parsed by its kind. Whether a key belongs
    to the op of the section it is in is checked when the file is read (`parse_policy_layer`).
    """

    model_config = ConfigDict(extra="allow", frozen=True, arbitrary_types_allowed=True)

    # device
    vendor: NameSpec | None = None
    device_type: NameSpec | None = None
    arch: ArchSpec | None = None
    capability: CapabilitySpec | None = None
    device_name: GlobSpec | None = None
    libraries: dict[str, LibrarySpec] | None = None
    # the module that made the call (opdispatch.scope), for every op
    module: GlobSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _op_features(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        from opdispatch.base._ops import all_features, all_vocabularies

        kinds = all_features()
        vocabularies = all_vocabularies()
        out = {}
        for key, value in data.items():
            if key in cls.model_fields:
                out[key] = value
                continue
            kind = kinds.get(key)
            if kind is None:
                allowed = ", ".join([*cls.model_fields, *sorted(kinds)])
                raise ConditionError(key, f"unknown key {key!r}; allowed keys here: {allowed}", value)
            if value is None:
                continue
            try:
                if kind == "name":  # a name feature names one of its values (an op declares them)
                    out[key] = NameSpec.parse(value, vocabularies[key], key)
                else:
                    out[key] = _PARSERS[kind](value)
            except ValueError as exc:
                raise ConditionError(key, str(exc), value) from None
        return out

    @field_validator("vendor", mode="before")
    @classmethod
    def _vendor(cls, value: Any) -> Any:
        from opdispatch.base._device import known_vendors

        try:
            return NameSpec.parse(value, known_vendors(plugins=False), "vendor")
        except ValueError:  # maybe a plugin's vendor: only then scan the installed plugins
            return NameSpec.parse(value, known_vendors(), "vendor")

    @field_validator("device_type", mode="before")
    @classmethod
    def _device_type(cls, value: Any) -> Any:
        from opdispatch.base._device import known_device_types

        return NameSpec.parse(value, known_device_types(), "device_type")

    @field_validator("arch", mode="before")
    @classmethod
    def _arch(cls, value: Any) -> Any:
        return ArchSpec.parse(value)

    @field_validator("capability", mode="before")
    @classmethod
    def _capability(cls, value: Any) -> Any:
        return CapabilitySpec.parse(value)

    @field_validator("device_name", "module", mode="before")
    @classmethod
    def _globs(cls, value: Any) -> Any:
        return GlobSpec.parse(value)

    @field_validator("libraries", mode="before")
    @classmethod
    def _libraries(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict) or not value:
            raise ValueError("libraries must be a non-empty mapping of library name to a version range, e.g. "
                             "{cudnn: '>=9.0', flag_gems: '<5.1', flash_attn: installed}")
        return {str(k): LibrarySpec.parse(v) for k, v in value.items()}

    def conditions(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        out.update((k, v) for k, v in (self.__pydantic_extra__ or {}).items() if v is not None)
        return out

    def feature_keys(self) -> list[str]:
        """The op-feature keys this condition tests (those not declared here)."""
        return [k for k, v in (self.__pydantic_extra__ or {}).items() if v is not None]

    def __getattr__(self, name: str) -> Any:
        # An op feature the rule does not test reads as None, like a declared key left out.
        from opdispatch.base._ops import all_features

        if name.startswith("_") or name not in all_features():
            return super().__getattr__(name)  # type: ignore[misc]
        return (self.__pydantic_extra__ or {}).get(name)


class Rule(_Strict):
    """A named rule: when its conditions hold, its actions apply (see docs/policy.md for how rules combine)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    when: When = Field(default_factory=When)
    prefer: list[str] | None = Field(default=None, min_length=1)
    deny: list[str] | None = Field(default=None, min_length=1)
    require: list[str] | None = Field(default=None, min_length=1)
    pin: str | None = None
    reason: str | None = None

    @field_validator("prefer", "deny", "require")
    @classmethod
    def _patterns(cls, values: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if values is not None:
            for v in values:
                check_impl_pattern(v)
        check_no_duplicates(values, str(info.field_name))
        return values

    @field_validator("pin")
    @classmethod
    def _pin(cls, value: str | None) -> str | None:
        if value is not None:
            check_impl_pattern(value)
            if is_glob(value):
                raise ValueError(f"pin {value!r} is a glob; a pin names exactly one implementation id")
        return value

    @model_validator(mode="after")
    def _actions(self) -> Rule:
        actions = [a for a in ("prefer", "deny", "require", "pin") if getattr(self, a) is not None]
        if not actions:
            raise ValueError(f"rule {self.name!r} has no action; give at least one of prefer, deny, require, pin")
        if self.pin is not None and len(actions) > 1:
            others = [a for a in actions if a != "pin"]
            raise ValueError(f"rule {self.name!r} pins {self.pin!r} and also has {', '.join(others)}: a pin selects "
                             "exactly one implementation, so it cannot be combined with other actions; split the rule")
        if self.deny and self.prefer:
            both = set(self.deny) & set(self.prefer)
            if both:
                raise ValueError(f"rule {self.name!r} both prefers and denies {sorted(both)}")
        if self.deny and self.require:
            both = set(self.deny) & set(self.require)
            if both:
                raise ValueError(f"rule {self.name!r} both requires and denies {sorted(both)}")
        return self


class OpPolicy(_Strict):
    """Ordering, filtering and rules for one op."""

    order: list[str] | None = Field(default=None, description="preferred order; ids or globs, first match wins")
    deny: list[str] = Field(default_factory=list, description="never use these (ids or globs)")
    rules: list[Rule] = Field(default_factory=list)
    options: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                               description="vendor-specific options per implementation id")
    autotune: str | None = Field(default=None, description="tuned table (YAML) written by `opdispatch tune`")

    @field_validator("order", "deny")
    @classmethod
    def _patterns(cls, values: list[str] | None, info: ValidationInfo) -> list[str] | None:
        for v in values or ():
            check_impl_pattern(v)
        check_no_duplicates(values, str(info.field_name))
        return values

    @field_validator("options")
    @classmethod
    def _option_ids(cls, values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for impl_id in values:
            check_impl_pattern(impl_id)
            if is_glob(impl_id):
                raise ValueError(f"options key {impl_id!r} is a glob; options belong to one implementation id")
        return values


class PolicyFile(_Strict):
    """Top level of a policy YAML file."""

    version: int = Field(default=1, description="schema version; only 1 exists")
    extends: Literal["default", "none"] = Field(
        default="default", description="'default': layer this file over the shipped default; 'none': replace it")
    settings: Settings | None = None
    ops: dict[str, OpPolicy] = Field(default_factory=dict)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        if type(value) is not int or value != 1:  # true and 1.0 equal 1 in Python, but are not version 1
            raise ValueError("version must be the integer 1 (the only schema version); write `version: 1`")
        return value
