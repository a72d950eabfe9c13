"""The op layer: one `OpSpec` per op says what the rest of opdispatch needs to know about it.

The manager, the registry, the policy and tune/bench are op-agnostic: they ask the op's spec which implementation
base class its implementations subclass, which call features a policy rule may test (`when:` keys and their kinds),
how to read those features from a validated call, and how to time it (`TuningSpec`: cases, presets, buckets).
Adding an op is a spec module that calls `register_op`, its vendors' plugin modules and a section in the shipped
policy.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._arguments import OpArguments

__all__ = ["FEATURE_KINDS", "REQUIRED", "BucketFeature", "OpSpec", "TuningSpec", "all_features", "all_vocabularies",
           "known_ops", "op_spec", "register_op", "tunable_ops"]

# How a `when:` key is written and compared: int (a number, list or range such as '<=16'), bool, name (a name or
# a list), dtype (bf16, fp16…), glob (fnmatch patterns). policies/opdispatch/policies/_match.py parses each kind.
FEATURE_KINDS = frozenset({"int", "bool", "name", "dtype", "glob"})
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Keyword arguments a validator may take beyond the op's own: the module scope and how far to read index values.
VALIDATOR_EXTRAS = ("module", "check_values", "varlen_same")


REQUIRED: Any = object()  # a BucketFeature without a default: every tuned-table entry must give it


@dataclass(frozen=True)
class BucketFeature:
    """A discrete feature of a tuned bucket: its name in a tuned table's entries, its type (bool, int or str), the
    value an entry that omits it stands for (`REQUIRED`: none may) and, for a str, the values allowed."""

    name: str
    kind: type
    default: Any = REQUIRED
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class TuningSpec:
    """How `opdispatch tune` and `opdispatch bench` time an op (core/opdispatch/tools/_tuning.py) and how a tuned table
    of it is keyed (policies/opdispatch/policies/_tuned_table.py).

    case: the type of one call signature to time, without data: ``case.from_dict(mapping, where)`` (ValueError
      naming unknown fields), ``to_dict()``, ``describe()`` (one line), ``inputs(device, generator)`` (fresh random
      keyword arguments of `validate`; ``device="meta"`` gives tensors without data), ``flops()`` and a
      ``requires_grad`` field (time forward + backward).
    presets: the preset names (``all`` is every one of them); ``preset(name, device_type)`` lists their cases:
      model-sized on accelerators, small enough to time in seconds on the CPU.
    validate: the op's validator, called with a case's inputs.
    discrete, bucket_discrete: the bucket's discrete features and how to read them from a call record; a table
      entry serves only calls that match them exactly.
    sizes, bucket_sizes: the names of its sizes and how to read them; a call takes the nearest entries in log2
      space of these.
    describe_bucket: one line for a bucket, ``(discrete, sizes) -> str`` (explain prints it); default name=value.
    """

    case: type
    presets: tuple[str, ...]
    preset: Callable[[str, str], list[Any]]
    validate: Callable[..., Any]
    discrete: tuple[BucketFeature, ...]
    bucket_discrete: Callable[[Any], tuple[Any, ...]]
    sizes: tuple[str, ...]
    bucket_sizes: Callable[[Any], tuple[int, ...]]
    describe_bucket: Callable[[tuple[Any, ...], tuple[int, ...]], str] | None = None

    def bucket(self, call: Any) -> tuple[tuple[Any, ...], tuple[int, ...]]:
        """(discrete features, sizes) of a validated call: what a tuned bucket is keyed by."""
        return self.bucket_discrete(call), self.bucket_sizes(call)

    def describe(self, discrete: tuple[Any, ...], sizes: tuple[int, ...]) -> str:
        if self.describe_bucket is not None:
            return self.describe_bucket(discrete, sizes)
        parts = [f"{f.name}={v}" for f, v in zip(self.discrete, discrete)]
        return " ".join(parts + [f"{name}={v}" for name, v in zip(self.sizes, sizes)])


@dataclass(frozen=True)
class OpSpec:
    """What one op is, for the op-agnostic machinery.

    name: the op's name (``"attention"``, ``"rms_norm"``): the policy section ``ops.<name>``, the env pin
      ``OPDISPATCH_IMPL_<NAME>`` and the ``op`` class attribute of its implementations.
    impl_base: the class its implementations subclass (it defines the capability type and `run`'s contract).
    features: the call features a policy rule may test, ``{when-key: kind}`` (kinds: `FEATURE_KINDS`).
    call_features: reads those features from a validated call record, ``{when-key: value}``.
    description: one line for ``opdispatch list`` and errors.
    arguments: the op's arguments, defined once (`opdispatch.base._arguments.OpArguments`): the front door, its
      fast-path key and the other entry points' signatures derive from it.
    validator: builds the op's call record from those arguments (all but ``impl``, plus keyword extras such as
      ``module``); checked against `arguments` at registration. A call record provides ``describe()``,
      ``signature()``, ``with_tensors(*bound)`` (a copy holding other tensors of the same signature) and
      ``stripped()`` (a copy holding none: what bound functions in the fast path keep).
    fake_outputs: given the arguments by name (tensors fake or meta), empty tensors shaped like the front
      door's outputs; with it the op's front door runs under torch.compile as one opaque graph node
      (`opdispatch.compile._compile_ops`), without it the call runs eagerly outside the graph.
    tuning: how ``opdispatch tune``/``bench`` time it (None: the op cannot be tuned).
    expected_outputs: given a validated call record, the ``(shape, dtype)`` of each output, in order (one: the
      result is a Tensor; more: a tuple): what the output guard checks a kernel's result against
      (`opdispatch.engine._output_guard`). None: not checked.
    vocabularies: for each feature of kind ``name``, the values a call can have (a rule naming another value is
      refused when the policy is read: it could never match).
    result_fix: given the chosen implementation and a validated call, None, or ``fix(result, call)`` that every run
      of that implementation for that signature passes its result through (bound or not; `call` holds that run's
      tensors). Decided once per signature, so a call that needs nothing pays nothing. Attention: a returned LSE
      gets its exact gradient where the kernel's LSE has none (`opdispatch.ops._attention.exact_lse`).
    """

    name: str
    impl_base: type
    features: Mapping[str, str]
    call_features: Callable[[Any], dict[str, Any]]
    description: str = ""
    arguments: OpArguments | None = None
    validator: Callable[..., Any] | None = None
    fake_outputs: Callable[..., list[Any]] | None = None
    tuning: TuningSpec | None = None
    vocabularies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    expected_outputs: Callable[[Any], list[tuple[tuple[int, ...], Any]]] | None = None
    result_fix: Callable[[Any, Any], Callable[[Any, Any], Any] | None] | None = None


_OPS: dict[str, OpSpec] = {}
_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # a thread holding it at fork time does not exist in the child
    os.register_at_fork(after_in_child=lambda: globals().__setitem__("_LOCK", threading.Lock()))


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
            if kind == "name" and not spec.vocabularies.get(key):
                raise ValueError(f"op {spec.name!r}: name feature {key!r} needs its values in `vocabularies` (a "
                                 "policy rule is checked against them)")
            if kind not in FEATURE_KINDS:
                raise ValueError(f"op {spec.name!r}: feature {key!r} has kind {kind!r}; kinds: "
                                 f"{', '.join(sorted(FEATURE_KINDS))}")
            for other in _OPS.values():
                if other.name != spec.name and other.features.get(key, kind) != kind:
                    raise ValueError(f"op {spec.name!r}: feature {key!r} is {kind!r} but op {other.name!r} declares "
                                     f"it {other.features[key]!r}; one `when:` key has one kind across ops")
        _OPS[spec.name] = spec
    return spec


# The ops opdispatch ships, by the module that registers each: imported on first use of the op table (not at
# `import opdispatch`, which stays light), so a policy or the registry always sees them.
BUILTIN_OP_MODULES = ("opdispatch.ops._attention", "opdispatch.ops._rms_norm", "opdispatch.ops._rotary")
_builtins_loaded = False


def _load_builtin_ops() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # before importing: each module registers its op through this table
    import importlib

    for module in BUILTIN_OP_MODULES:
        importlib.import_module(module)


def known_ops() -> tuple[str, ...]:
    _load_builtin_ops()
    return tuple(sorted(_OPS))


def op_spec(name: str) -> OpSpec:
    spec = _OPS.get(name)
    if spec is None:
        _load_builtin_ops()
        spec = _OPS.get(name)
    if spec is None:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(known_ops())}")
    return spec


def tunable_ops() -> tuple[str, ...]:
    """The ops with a tuning description (`OpSpec.tuning`)."""
    _load_builtin_ops()
    return tuple(name for name in known_ops() if _OPS[name].tuning is not None)


def all_vocabularies() -> dict[str, tuple[str, ...]]:
    """Every registered op's name features with the values they take (the union where ops share a key)."""
    _load_builtin_ops()
    out: dict[str, set[str]] = {}
    for spec in _OPS.values():
        for key, values in spec.vocabularies.items():
            out.setdefault(key, set()).update(values)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def all_features() -> dict[str, str]:
    """Every registered op's `when:` keys with their kinds."""
    _load_builtin_ops()
    out: dict[str, str] = {}
    for spec in _OPS.values():
        out.update(spec.features)
    return out
