"""The policy file schema (pydantic v2). docs/policy.md describes it for users; this is the source of truth."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# An implementation id or a glob over ids: "nvidia.cudnn", "nvidia.*", "*.flash".
_IMPL_PATTERN = re.compile(r"^[a-z0-9_*?\[\]!]+\.[a-z0-9_*?\[\]!]+$|^\*$")


def check_impl_pattern(value: str) -> str:
    if not isinstance(value, str) or not _IMPL_PATTERN.match(value):
        raise ValueError(f"{value!r} is not an implementation id or glob; write '<vendor>.<name>' such as "
                         "'nvidia.cudnn', or a glob such as 'nvidia.*'")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Settings(_Strict):
    """Policy-wide behaviour."""

    fallback_on_error: bool = Field(
        default=False, description="when the chosen implementation raises at run time, try the next eligible one")
    strict: bool = Field(
        default=False, description="unknown implementation ids in the policy are errors instead of warnings")


class OpPolicy(_Strict):
    """Ordering and filtering for one op."""

    order: list[str] = Field(default_factory=list, description="preferred order; ids or globs, first match wins")
    deny: list[str] = Field(default_factory=list, description="never use these (ids or globs)")

    @field_validator("order", "deny")
    @classmethod
    def _patterns(cls, values: list[str]) -> list[str]:
        for v in values:
            check_impl_pattern(v)
        return values


class PolicyFile(_Strict):
    """Top level of a policy YAML file."""

    version: int = Field(default=1, ge=1, le=1, description="schema version; only 1 exists")
    settings: Settings = Field(default_factory=Settings)
    ops: dict[str, OpPolicy] = Field(default_factory=dict)
