"""The op layer: one `OpSpec` per op says what the rest of opdispatch needs to know about it.

The manager, the registry and the policy are op-agnostic: they ask the op's spec which implementation base class
its implementations subclass, which call features a policy rule may test (`when:` keys and their kinds) and how to
read those features from a validated call. Adding an op is a spec module that calls `register_op`, its vendors'
plugin modules and a section in the shipped policy.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._arguments import OpArguments

__all__ = ["FEATURE_KINDS", "OpSpec", "all_features", "known_ops", "op_spec", "register_op"]

# How a `when:` key is written and compared: int (a number, list or range such as '<=16'), bool, name (a name or
# a list), dtype (bf16, fp16…), glob (fnmatch patterns). policies/_match.py parses each kind.
FEATURE_KINDS = frozenset({"int", "bool", "name", "dtype", "glob"})
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Keyword arguments a validator may take beyond the op's own: the module scope and how far to read index values.
VALIDATOR_EXTRAS = ("module", "check_values", "varlen_same")


@dataclass(frozen=True)
class OpSpec:
    """What one op is, for the op-agnostic machinery.

    name: the op's name (``"attention"``, ``"rms_norm"``): the policy section ``ops.<name>``, the env pin
      ``OPDISPATCH_IMPL_<NAME>`` and the ``op`` class attribute of its implementations.
    impl_base: the class its implementations subclass (it defines the capability type and `run`'s contract).
    features: the call features a policy rule may test, ``{when-key: kind}`` (kinds: `FEATURE_KINDS`).
    call_features: reads those features from a validated call record, ``{when-key: value}``.
    description: one line for ``opdispatch list`` and errors.
    arguments: the op's arguments, defined once (`opdispatch._arguments.OpArguments`): the front door, its
      fast-path key and the other entry points' signatures derive from it.
    validator: builds the op's call record from those arguments (all but ``impl``, plus keyword extras such as
      ``module``); checked against `arguments` at registration.
    fake_outputs: given the arguments by name (tensors fake or meta), empty tensors shaped like the front
      door's outputs; with it the op's front door runs under torch.compile as one opaque graph node
      (`opdispatch._compile_ops`), without it the call runs eagerly outside the graph.
    """

    name: str
    impl_base: type
    features: Mapping[str, str]
    call_features: Callable[[Any], dict[str, Any]]
    description: str = ""
    arguments: OpArguments | None = None
    validator: Callable[..., Any] | None = None
    fake_outputs: Callable[..., list[Any]] | None = None


_OPS: dict[str, OpSpec] = {}
_LOCK = threading.Lock()


def register_op(spec: OpSpec) -> OpSpec:
    """Register `spec`; ValueError (naming the bad value) for a malformed spec or a feature whose kind differs from
    another op's feature of the same name. Registering the same name again replaces it (module reloads)."""
    if not isinstance(spec.name, str) or not _NAME.match(spec.name):
        raise ValueError(f"op name {spec.name!r} must be a lower-case identifier (letters, digits, '_')")
    if not isinstance(spec.impl_base, type):
        raise ValueError(f"op {spec.name!r}: impl_base must be a class, got {spec.impl_base!r}")
    if spec.arguments is not None:
        if spec.arguments.op != spec.name:
            raise ValueError(f"op {spec.name!r}: its arguments are defined for op {spec.arguments.op!r}")
        if spec.validator is not None:
            spec.arguments.check_callable(spec.validator, f"validator {spec.validator.__name__}", drop=("impl",),
                                          allowed_extra=VALIDATOR_EXTRAS)
    with _LOCK:
        for key, kind in spec.features.items():
            if kind not in FEATURE_KINDS:
                raise ValueError(f"op {spec.name!r}: feature {key!r} has kind {kind!r}; kinds: "
                                 f"{', '.join(sorted(FEATURE_KINDS))}")
            for other in _OPS.values():
                if other.name != spec.name and other.features.get(key, kind) != kind:
                    raise ValueError(f"op {spec.name!r}: feature {key!r} is {kind!r} but op {other.name!r} declares "
                                     f"it {other.features[key]!r}; one `when:` key has one kind across ops")
        _OPS[spec.name] = spec
    return spec


def known_ops() -> tuple[str, ...]:
    return tuple(sorted(_OPS))


def op_spec(name: str) -> OpSpec:
    spec = _OPS.get(name)
    if spec is None:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(known_ops())}")
    return spec


def all_features() -> dict[str, str]:
    """Every registered op's `when:` keys with their kinds."""
    out: dict[str, str] = {}
    for spec in _OPS.values():
        out.update(spec.features)
    return out
