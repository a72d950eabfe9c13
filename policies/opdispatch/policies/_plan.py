"""The decision's precedence: which implementation order, denials and pin one call gets, and from where.

This module is the reference for precedence; docs/policy.md describes the YAML that feeds it.

Layers, highest first (`LAYERS`). Each contributes *actions* — pin, prefer, deny, require — with the provenance
that `explain()` prints:

1. ``argument`` — the call's ``impl="vendor.name"``: a pin for this call only.
2. ``scope`` — ``with opdispatch.policy_override(...)`` blocks of this thread or task, the innermost first.
3. ``env`` — ``OPDISPATCH_IMPL_<OP>`` (a pin), ``OPDISPATCH_PREFER`` and ``OPDISPATCH_DENY`` (every op).
4. ``user`` — the user's YAML (``OPDISPATCH_POLICY``): the op's top-level ``deny``, then its rules whose
   ``when:`` holds for the call and device, in file order; and its ``order``.
5. ``default`` — the shipped ``configs/default.yaml``, read the same way. (A user file with ``extends: none``
   has no default layer below it.)
5b. ``quarantine`` — the quarantine files of ``opdispatch validate``: the shipped ``configs/quarantine.yaml``
   (learned on the GPU machines) and the user's (``OPDISPATCH_QUARANTINE``, default
   ``~/.cache/opdispatch/quarantine.yaml``). Deny rules only, each scoped by its `when:` to the feature class,
   device and library versions it failed on; as every deny, they yield to a pin from any layer above.
6. ``autotune`` — the ``autotune:`` table named by the highest YAML layer that names one: the measured order of
   the call's shape bucket, when the table was measured on this device with these library versions.
7. ``priority`` — each implementation's declared priority, for implementations no layer ranks.

How the actions combine (`build_plan`, one step per function):

- **collect** every layer's actions, highest first (`collect_actions`); a YAML rule is matched once per plan;
- **pin**: the first pin wins and ends the plan — it outranks every deny and require, of its layer and below;
- **deny / require**: an implementation is denied by the first deny that matches it, else by the first
  require list that does not name it (so it must be in every matching require list);
- **rank** the rest by tier (`RANK_TIERS`): *prefer* (earlier lists first, within a list in its order), then
  *autotune*, then *order* (the highest YAML layer that sets one), then *priority*; ties keep the registry's
  order (highest priority first).

The autotune table ranks the ids the plan has already ordered without it (`TunedTable.rank`: near-ties keep
that order), and the plan is re-ranked with that measured order — the rules are matched once. The manager then
takes the first candidate, in the plan's order, that is available on the device and supports the call.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from opdispatch.base._decision import Provenance
from opdispatch.base._ops import op_spec

if TYPE_CHECKING:
    from ._overrides import Override
    from ._schema import OpPolicy, Rule, When

ENV_PREFER = "OPDISPATCH_PREFER"
ENV_DENY = "OPDISPATCH_DENY"
ENV_PIN_PREFIX = "OPDISPATCH_IMPL_"


# -- the layers, as data ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    """One source of decisions in the precedence: its name, the `Provenance.kind` of what it decides, how a user
    sets it and which actions it may contribute."""

    name: str
    provenance: str
    set_by: str
    actions: tuple[str, ...]


ARGUMENT = Layer("argument", "argument", "impl= on the call", ("pin",))
SCOPE = Layer("scope", "context", "with opdispatch.policy_override(...), innermost first",
              ("pin", "prefer", "deny", "require"))
ENV = Layer("env", "env", f"{ENV_PIN_PREFIX}<OP> (pin), {ENV_PREFER}, {ENV_DENY}", ("pin", "prefer", "deny"))
USER = Layer("user", "policy", "the user's YAML (OPDISPATCH_POLICY)", ("pin", "prefer", "deny", "require", "order"))
DEFAULT = Layer("default", "policy", "the shipped configs/default.yaml", ("pin", "prefer", "deny", "require", "order"))
QUARANTINE = Layer("quarantine", "quarantine", "opdispatch validate's quarantine files (shipped and the user's)",
                   ("deny",))
AUTOTUNE = Layer("autotune", "policy", "the autotune: table of the highest YAML layer naming one", ("rank",))
PRIORITY = Layer("priority", "priority", "each implementation's declared priority", ("rank",))
LAYERS = (ARGUMENT, SCOPE, ENV, USER, DEFAULT, QUARANTINE, AUTOTUNE, PRIORITY)

# Ranking tiers, first first: what places an implementation that no pin or deny removed.
RANK_TIERS = ("prefer", "autotune", "order", "priority")


@dataclass(frozen=True)
class Action:
    """One action a layer contributes for this call: `verb` (pin, prefer, deny, require) over `patterns`."""

    layer: str
    verb: str
    patterns: tuple[str, ...]
    provenance: Provenance


@dataclass
class PolicyPlan:
    """The policy's verdict for one call: candidates in order, the denied ones, and a pin — each with provenance.

    `actions` lists what every layer contributed (highest first); `matched_rules` names the YAML rules that held.
    """

    order: list[tuple[str, Provenance]] = field(default_factory=list)
    denied: dict[str, Provenance] = field(default_factory=dict)
    pin: tuple[str, Provenance] | None = None
    matched_rules: list[str] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)


@dataclass
class _Collected:
    """The actions of every layer for one call, and the `order` list of the highest YAML layer that sets one."""

    actions: list[Action] = field(default_factory=list)
    order: tuple[list[str], PlannedLayer, Layer] | None = None
    matched_rules: list[str] = field(default_factory=list)

    def add(self, layer: Layer, source: Override | Rule, prov: Provenance) -> None:
        """The actions of an override scope or a matching rule (they share the action names)."""
        if source.pin:
            self.actions.append(Action(layer.name, "pin", (source.pin,), prov))
        for verb in ("prefer", "deny", "require"):
            patterns = getattr(source, verb)
            if patterns:
                self.actions.append(Action(layer.name, verb, tuple(patterns), prov))

    def of(self, verb: str) -> list[Action]:
        return [a for a in self.actions if a.verb == verb]


# -- what a plan reads of a policy -------------------------------------------------------------------------
# Protocols, so this module sits below `_policy`, whose `Policy.plan` builds plans with it.


class PlannedLayer(Protocol):
    """One policy file as a plan reads it (`_policy.PolicyLayer`)."""

    def where(self, *path: Any) -> str: ...

    def op(self, op: str) -> OpPolicy | None: ...


class PlannedEnv(Protocol):
    """The OPDISPATCH_* env vars as a plan reads them (`_policy.EnvOverrides`)."""

    @property
    def pins(self) -> Mapping[str, str]: ...

    @property
    def prefer(self) -> tuple[str, ...]: ...

    @property
    def deny(self) -> tuple[str, ...]: ...


class PlannedPolicy(Protocol):
    """A policy as a plan reads it (`_policy.Policy`): its YAML layers, highest first, its env layer and where
    its autotune table is."""

    @property
    def yaml_layers(self) -> Sequence[tuple[Layer, PlannedLayer]]: ...

    @property
    def env(self) -> PlannedEnv: ...

    def autotune_table(self, op: str) -> tuple[Path, str] | None: ...


# -- the plan, step by step ---------------------------------------------------------------------------------

def build_plan(policy: PlannedPolicy, op: str, impl_ids: Sequence[str], call: Any = None, device: Any = None,
               overrides: Sequence[Override] = (), impl: str | None = None) -> PolicyPlan:
    """Order `impl_ids` (given highest priority first) for `call` on `device`: pin, deny, require and rank, with
    provenance for each. Without a call (lint) every rule counts as matching and no autotune table is read."""
    collected = collect_actions(policy, op, call, device, overrides, impl)
    plan = PolicyPlan(matched_rules=collected.matched_rules, actions=collected.actions)
    pins = collected.of("pin")
    if pins:
        plan.pin = (pins[0].patterns[0], pins[0].provenance)
        return plan
    plan.denied = deny_and_require(impl_ids, collected)
    plan.order = rank(op, impl_ids, plan.denied, collected)
    tuned = autotune_order(policy, op, call, device, plan.order)
    if tuned is not None:
        plan.order = rank(op, impl_ids, plan.denied, collected, tuned)
    return plan


def standing_plan(policy: PlannedPolicy, op: str, impl_ids: Sequence[str]) -> PolicyPlan:
    """The order the policy gives `op` before any `when:` rule (rules depend on the call): the env pin, prefer and
    deny, each YAML layer's deny list and the highest `order`, then priority — what `opdispatch list` shows."""
    collected = collect_actions(policy, op, None, None, (), None, rules=False)
    plan = PolicyPlan(actions=collected.actions)
    pins = collected.of("pin")
    if pins:
        plan.pin = (pins[0].patterns[0], pins[0].provenance)
    plan.denied = deny_and_require(impl_ids, collected)
    plan.order = rank(op, impl_ids, plan.denied, collected)
    return plan


def collect_actions(policy: PlannedPolicy, op: str, call: Any, device: Any, overrides: Sequence[Override],
                    impl: str | None, rules: bool = True) -> _Collected:
    """Every layer's actions for this call, highest layer first (`rules=False`: leave the `when:` rules out)."""
    out = _Collected()
    if impl is not None:
        out.actions.append(Action(ARGUMENT.name, "pin", (impl,),
                                  Provenance(ARGUMENT.provenance, "impl=", note="pinned for this call")))
    for ov in overrides:
        if ov.applies_to(op):
            out.add(SCOPE, ov, Provenance(SCOPE.provenance, ov.where))
    _env_actions(policy, op, out)
    for layer, policy_layer in policy.yaml_layers:
        _yaml_actions(layer, policy_layer, op, call, device, out, rules)
    return out


def _env_actions(policy: PlannedPolicy, op: str, out: _Collected) -> None:
    env = policy.env
    pin = env.pins.get(op)
    if pin:
        out.actions.append(Action(ENV.name, "pin", (pin,), Provenance(
            ENV.provenance, f"{ENV_PIN_PREFIX}{op.upper()}", note=f"pinned to {pin}")))
    if env.prefer:
        out.actions.append(Action(ENV.name, "prefer", env.prefer, Provenance(ENV.provenance, ENV_PREFER)))
    if env.deny:
        out.actions.append(Action(ENV.name, "deny", env.deny, Provenance(ENV.provenance, ENV_DENY)))


def _yaml_actions(layer: Layer, policy_layer: PlannedLayer, op: str, call: Any, device: Any,
                  out: _Collected, rules: bool = True) -> None:
    """One YAML layer's `order`, top-level `deny` entries and matching rules (file order)."""
    spec = policy_layer.op(op)
    if spec is None:
        return
    if spec.order is not None and out.order is None:
        out.order = (spec.order, policy_layer, layer)
    for i, pattern in enumerate(spec.deny):
        out.actions.append(Action(layer.name, "deny", (pattern,), Provenance(
            layer.provenance, policy_layer.where("ops", op, "deny", i), note=f"deny {pattern!r}")))
    for r_i, rule in enumerate(spec.rules if rules else ()):
        if call is not None and not rule_matches(rule.when, call, device, op):
            continue
        out.matched_rules.append(rule.name)
        out.add(layer, rule, Provenance(layer.provenance, policy_layer.where("ops", op, "rules", r_i),
                                        rule=rule.name, note=rule.reason))


def deny_and_require(impl_ids: Sequence[str], collected: _Collected) -> dict[str, Provenance]:
    """The denied ids: by the first matching deny, else by the first require list that does not name them."""
    denies, requires = collected.of("deny"), collected.of("require")
    denied: dict[str, Provenance] = {}
    for impl_id in impl_ids:
        for action in denies:
            if match_any(impl_id, action.patterns):
                denied[impl_id] = action.provenance
                break
        else:
            for action in requires:
                if not match_any(impl_id, action.patterns):
                    prov = action.provenance
                    denied[impl_id] = Provenance(
                        prov.kind, prov.source, rule=prov.rule,
                        note=f"not in required {', '.join(action.patterns)}" + (f"; {prov.note}" if prov.note else ""))
                    break
    return denied


def rank(op: str, impl_ids: Sequence[str], denied: dict[str, Provenance], collected: _Collected,
         tuned: tuple[list[str], Provenance] | None = None) -> list[tuple[str, Provenance]]:
    """The ids not denied, by tier (`RANK_TIERS`) and within a tier by position; ties keep `impl_ids` order."""
    prefers = collected.of("prefer")
    ranked = []
    for position, impl_id in enumerate(impl_ids):
        if impl_id in denied:
            continue
        placed = (_by_prefer(impl_id, prefers) or _by_autotune(impl_id, tuned)
                  or _by_order(op, impl_id, collected.order) or _by_priority(collected.order))
        key, prov = placed
        ranked.append((key, position, impl_id, prov))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [(impl_id, prov) for _, _, impl_id, prov in ranked]


_Placed = tuple[tuple[int, int, int], Provenance]


def _by_prefer(impl_id: str, prefers: list[Action]) -> _Placed | None:
    for p_i, action in enumerate(prefers):
        hit = match_any(impl_id, action.patterns)
        if hit is not None:
            prov = action.provenance
            note = f"prefer {hit!r}" + (f"; {prov.note}" if prov.note else "")
            return (RANK_TIERS.index("prefer"), p_i, action.patterns.index(hit)), Provenance(
                prov.kind, prov.source, rule=prov.rule, note=note)
    return None


def _by_autotune(impl_id: str, tuned: tuple[list[str], Provenance] | None) -> _Placed | None:
    if tuned is None or impl_id not in tuned[0]:
        return None
    return (RANK_TIERS.index("autotune"), 0, tuned[0].index(impl_id)), tuned[1]


def _by_order(op: str, impl_id: str, order: tuple[list[str], PlannedLayer, Layer] | None) -> _Placed | None:
    if order is None:
        return None
    patterns, policy_layer, layer = order
    hit = match_any(impl_id, patterns)
    if hit is None:
        return None
    i = patterns.index(hit)
    return (RANK_TIERS.index("order"), 0, i), Provenance(
        layer.provenance, policy_layer.where("ops", op, "order", i), note=f"order {hit!r}")


def _by_priority(order: tuple[list[str], PlannedLayer, Layer] | None) -> _Placed:
    return (RANK_TIERS.index("priority"), 0, 0), Provenance(
        PRIORITY.provenance, "implementation priority", note="not named by the policy" if order else None)


def autotune_order(policy: PlannedPolicy, op: str, call: Any, device: Any,
                   policy_order: list[tuple[str, Provenance]]) -> tuple[list[str], Provenance] | None:
    """The measured order for `call` from the policy's `autotune:` table, ranking the plan's `policy_order`
    (near-ties keep it), or None: no table, one of another device or versions (ignored with one warning), or no
    bucket for the call."""
    if call is None or device is None:
        return None
    where = policy.autotune_table(op)
    if where is None:
        return None
    from ._tuned_table import tuned_table_for

    path, line = where
    table = tuned_table_for(path, device, op)
    if table is None:
        return None
    ranked = table.rank(call, [impl_id for impl_id, _ in policy_order])
    if ranked is None:
        return None
    order, note = ranked
    return order, Provenance(AUTOTUNE.provenance, line, note=f"autotune {path.name}: {note}")


# -- matching -----------------------------------------------------------------------------------------------

def match_any(impl_id: str, patterns: Sequence[str]) -> str | None:
    """The pattern of `patterns` (ids or globs) that names `impl_id`, or None: the id itself where it is listed,
    else the first glob that matches (so ``[..., '*', reference.math]`` keeps the reference last)."""
    if impl_id in patterns:
        return impl_id
    for pattern in patterns:
        if fnmatch.fnmatchcase(impl_id, pattern):
            return pattern
    return None


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
