"""The implementation contract: one `Impl` is one way to compute one op.

Capabilities are declared as class attributes (data, shown by `opdispatch list` and checked at registration);
`not_supported_reasons()` turns them, plus any extra checks a subclass adds, into human-readable reasons.
Vendor libraries are imported lazily: only `availability()` on a real device and `run()` may import them.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel


if TYPE_CHECKING:
    from ._device import DeviceInfo

_ID_PART = re.compile(r"^[a-z][a-z0-9_]*$")

# One capability check as data: given an implementation's declared caps and a call, the sentence saying why the
# caps cannot take the call (what `explain()` and errors print), or None when they can. An op lists its checks in
# one table, in the order its reasons are printed, and `unmet_capabilities` turns the table into reasons.
CapabilityRule = Callable[[Any, Any], "str | None"]


def unmet_capabilities(caps: Any, call: Any, rules: Sequence[CapabilityRule]) -> list[str]:
    """The reasons `caps` cannot take `call`, one per rule that refuses it, in the table's order."""
    return [reason for rule in rules if (reason := rule(caps, call)) is not None]


def feature_rule(flag: str, used: Callable[[Any], bool], reason: str | Callable[[Any], str]) -> CapabilityRule:
    """The common rule: a call that `used` a feature needs the caps' boolean `flag`; `reason` says what is not
    supported (a string, or a function of the call for one that names the call's values)."""
    def rule(caps: Any, call: Any) -> str | None:
        if not used(call) or getattr(caps, flag):
            return None
        return reason if isinstance(reason, str) else reason(call)
    rule.__qualname__ = f"feature_rule({flag!r})"
    return rule


@dataclass(frozen=True)
class Requirement:
    """A library an implementation needs.

    `module` is what gets imported, `distribution` the pip name whose version is checked, `key` the name under
    which a device descriptor's `libraries:` declares it (defaults to `module`).
    """

    module: str
    distribution: str
    min_version: str | None = None
    install_hint: str = ""
    key: str | None = None
    # Whether the module must come with its installed distribution: a library always installed by pip, whose
    # import name a shim or a local module could take (flash_attn). Off for vendor SDK modules that may be
    # installed without pip metadata; then a module of that name is taken for the library, its version unknown.
    verify_distribution: bool = False

    @property
    def library_key(self) -> str:
        return self.key or self.module

    def describe(self) -> str:
        """The requirement as `opdispatch list -v` shows it: ``flash-attn>=2.6.0``."""
        return self.distribution + (f">={self.min_version}" if self.min_version else "")

    def hint(self) -> str:
        bound = f">={self.min_version}" if self.min_version else ""
        return self.install_hint or f"pip install '{self.distribution}{bound}'"

    def unmet_reason(self, device: DeviceInfo) -> str | None:
        """Why this requirement is not met on `device`, or None. Never imports the library."""
        if device.simulated:
            version = device.libraries.get(self.library_key)
            if version is None:
                return (f"library {self.library_key!r} is not declared in the device descriptor {device.source}; "
                        f"add `{self.library_key}: <version>` under `libraries:` to simulate it installed")
        else:
            version = device.libraries.get(self.library_key)
            if version is None:
                try:  # a dotted module imports its parent package to be found (never the module itself)
                    spec = importlib.util.find_spec(self.module)
                except (ImportError, ValueError):  # that parent is missing or broken (FA4's flash_attn.cute)
                    spec = None
                if spec is None:
                    return f"library {self.module!r} is not installed; install it with: {self.hint()}"
                try:
                    version = importlib.metadata.version(self.distribution)
                except importlib.metadata.PackageNotFoundError:
                    if not self.verify_distribution:
                        version = None
                    else:  # a local module or a shim of that name (maybe one routing back into opdispatch)
                        return (f"module {self.module!r} is importable (from {spec.origin}) but the distribution "
                                f"{self.distribution!r} is not installed, so it is not the vendor library; install "
                                f"it with: {self.hint()}")
        if self.min_version and version is not None:
            try:
                too_old = Version(version.split("+")[0]) < Version(self.min_version)
            except InvalidVersion:
                too_old = False
            if too_old:
                return (f"library {self.library_key!r} {version} is older than the required {self.min_version}; "
                        f"upgrade with: {self.hint()}")
        return None


def _template(call: Any) -> Any:
    """What a bound function may keep of `call`: its `stripped()` copy (no tensors), for call records that have
    one (the built-in ops' do; an op's record without it keeps its first call's tensors alive in the fast path)."""
    stripped = getattr(call, "stripped", None)
    return stripped() if stripped is not None else call


class Impl:
    """Base of every implementation. Subclasses set the class attributes and override `run`.

    Attributes (class level, validated at registration):
      op: the op this implements (``"attention"``).
      vendor, name: the id is ``"<vendor>.<name>"``, both lower-case identifiers.
      priority: orders implementations the policy does not order (higher first).
      device_types: torch device types the kernel runs on (``{"cuda"}``); empty means any.
      device_vendors: hardware vendors it supports (``{"nvidia"}``); empty means any.
      min_capability / max_capability: inclusive compute-capability range, for vendors that have one.
      archs: the arch names it supports (``{"gfx90a", "gfx942"}``); empty means any.
      requires: libraries it needs (imported lazily, only by `availability`'s extra checks and `run`).
    """

    op: ClassVar[str]
    vendor: ClassVar[str]
    name: ClassVar[str]
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""
    device_types: ClassVar[frozenset[str]] = frozenset()
    device_vendors: ClassVar[frozenset[str]] = frozenset()
    min_capability: ClassVar[tuple[int, int] | None] = None
    max_capability: ClassVar[tuple[int, int] | None] = None
    archs: ClassVar[frozenset[str]] = frozenset()
    requires: ClassVar[Sequence[Requirement]] = ()
    # Vendor-specific knobs the policy may set (`ops.<op>.options.<impl id>: {...}` in YAML): a pydantic model
    # whose defaults apply when the policy says nothing. `run` reads them from `self.options`.
    options_model: ClassVar[type[BaseModel] | None] = None
    # True for an unfused implementation kept as the last resort (reference.math): choosing it on an accelerator
    # logs one warning per decision class, naming the call and why no fused implementation took it.
    reference_fallback: ClassVar[bool] = False
    _options: BaseModel | None = None

    @property
    def id(self) -> str:
        return f"{self.vendor}.{self.name}"

    @property
    def options(self) -> Any:
        """The options the installed policy gives this implementation (the model's defaults when it gives none)."""
        if self._options is None and self.options_model is not None:
            return self.options_model()
        return self._options

    def with_options(self, options: Mapping[str, Any] | None) -> Impl:
        """This implementation configured with a policy's options: a copy (the registered object never changes,
        so a rejected policy leaves no trace and two policies never share options). Raises ValueError (pydantic's)
        naming the bad option; returns self when there is nothing to configure."""
        if self.options_model is None:
            if options:
                raise ValueError(f"implementation {self.id!r} takes no options, got {sorted(options)}")
            return self
        if not options:
            return self
        configured = copy.copy(self)
        configured._options = self.options_model.model_validate(dict(options))
        return configured

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    # -- declarations ---------------------------------------------------------------------------------------
    def check_declaration(self) -> list[str]:
        """Problems with the class attributes; the registry refuses an implementation that has any."""
        problems = []
        for attr in ("op", "vendor", "name"):
            value = getattr(self, attr, None)
            if not isinstance(value, str) or not _ID_PART.match(value):
                problems.append(f"{attr}={value!r} must be a lower-case identifier (letters, digits, '_')")
        for attr in ("device_types", "device_vendors", "archs"):
            if not isinstance(getattr(self, attr), (set, frozenset)):
                problems.append(f"{attr} must be a set or frozenset, got {type(getattr(self, attr)).__name__}")
        for attr in ("min_capability", "max_capability"):
            value = getattr(self, attr)
            if value is not None and not (isinstance(value, tuple) and len(value) == 2
                                          and all(isinstance(x, int) for x in value)):
                problems.append(f"{attr}={value!r} must be None or a (major, minor) tuple of ints")
        if not isinstance(self.priority, int):
            problems.append(f"priority={self.priority!r} must be an int")
        if not all(isinstance(r, Requirement) for r in self.requires):
            problems.append("requires must be a sequence of opdispatch.Requirement")
        if self.options_model is not None and not (isinstance(self.options_model, type)
                                                    and issubclass(self.options_model, BaseModel)):
            problems.append("options_model must be a pydantic BaseModel subclass")
        if type(self).run is Impl.run:
            problems.append("run(call) is not implemented")
        return problems

    # -- device and library checks ---------------------------------------------------------------------------
    def device_reasons(self, device: DeviceInfo) -> list[str]:
        """Why this implementation cannot run on `device` at all (independent of the call)."""
        # The first mismatch of type or vendor says it all; the finer checks would only repeat it.
        if self.device_types and device.type not in self.device_types:
            return [f"runs on device type {_fmt_set(self.device_types)}, not {device.type!r}"]
        if self.device_vendors and device.vendor not in self.device_vendors:
            return [f"supports {_fmt_set(self.device_vendors)} hardware, not vendor {device.vendor!r}"]
        reasons = []
        if self.archs and device.arch not in self.archs:
            reasons.append(f"supports arch {_fmt_set(self.archs)}, not {device.arch!r}")
        if self.min_capability or self.max_capability:
            cap = device.capability
            if cap is None:
                reasons.append(f"needs a compute capability, device {device.name!r} reports none")
            else:
                if self.min_capability and cap < self.min_capability:
                    reasons.append(f"needs compute capability >= {_fmt_cap(self.min_capability)}, "
                                   f"device has {_fmt_cap(cap)}")
                if self.max_capability and cap > self.max_capability:
                    reasons.append(f"supports compute capability <= {_fmt_cap(self.max_capability)}, "
                                   f"device has {_fmt_cap(cap)}")
        return reasons

    def availability(self, device: DeviceInfo) -> str | None:
        """None when this implementation can run on `device`, else the reason (library missing, wrong device…).

        On a simulated device only the descriptor is consulted; on a real one `extra_availability` may import
        the vendor library.
        """
        reasons = self.device_reasons(device)
        if reasons:
            return "; ".join(reasons)
        for requirement in self.requires:
            reason = requirement.unmet_reason(device)
            if reason:
                return reason
        if device.simulated:
            return None
        return self.extra_availability(device)

    def extra_availability(self, device: DeviceInfo) -> str | None:
        """Override to check what only importing the library tells (never called for simulated devices)."""
        return None

    # -- per call --------------------------------------------------------------------------------------------
    def not_supported_reasons(self, call: Any, device: DeviceInfo) -> list[str]:
        """Why this implementation cannot take `call` on `device`; empty when it can."""
        return []

    def run(self, call: Any) -> Any:
        """Compute the op for a validated call."""
        raise NotImplementedError

    def conform(self, call: Any) -> Any:
        """`call` with its tensors made to meet this implementation's declared input needs (strides, …): what
        `run` and `bind` are given — the op's bound tensors passed through `input_conformer`."""
        conformer = self.input_conformer(call)
        if conformer is None:
            return call
        from ._ops import op_spec

        arguments = op_spec(self.op).arguments
        assert arguments is not None  # an op with an input conformer binds tensors
        return call.with_tensors(*conformer(*(getattr(call, name) for name in arguments.bound)))

    def input_conformer(self, call: Any) -> Callable[..., tuple[Any, ...]] | None:
        """A function mapping the op's bound tensors (for `call`'s signature) to ones meeting this implementation's
        declared needs, or None when they already do (then nothing runs per call). Default: None (ops whose
        capabilities declare such needs override it, as attention does with `AttentionCaps.strided_inputs`)."""
        return None

    def bound_function(self, call: Any) -> Callable[..., Any]:
        """What the fast path and plans call for `call`'s signature: `bind(call)`, unless the op's call record
        says the call passes tensors an overridden `bind` was not written for (attention's masks)."""
        return self.bind(call)

    def bind(self, call: Any) -> Callable[..., Any]:
        """A function taking the tensors of calls of exactly `call`'s signature (the op's call record says which:
        its `with_tensors`) — the per-call fast path and bound plans use it. Override to bind a kernel directly;
        this default re-enters `run` with a copy of the call holding the new tensors. A bound function must not
        keep the call's tensors alive (it lives in the fast-path cache): keep `call.stripped()`, not `call`."""
        run, rebuild = self.run, _template(call).with_tensors  # never the first call's tensors

        def bound(*tensors: Any) -> Any:
            return run(rebuild(*tensors))

        return bound

    def describe_capabilities(self) -> dict[str, Any]:
        """Declared capabilities as plain data (for `opdispatch list --verbose` and docs)."""
        out: dict[str, Any] = {}
        for attr in ("device_types", "device_vendors", "archs"):
            value = getattr(self, attr)
            if value:
                out[attr] = sorted(value)
        if self.min_capability:
            out["min_capability"] = _fmt_cap(self.min_capability)
        if self.max_capability:
            out["max_capability"] = _fmt_cap(self.max_capability)
        if self.requires:
            out["requires"] = [r.describe() for r in self.requires]
        return out


def _fmt_set(values: frozenset[str] | set[str]) -> str:
    items = sorted(values)
    return repr(items[0]) if len(items) == 1 else "{" + ", ".join(repr(v) for v in items) + "}"


def _fmt_cap(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"
