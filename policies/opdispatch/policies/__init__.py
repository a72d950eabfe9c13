"""YAML policies: schema, loading with line numbers, rule matching, scoped overrides, the decision's precedence
(`_plan.py`) and the tuned tables that `autotune:` names."""

from collections.abc import Callable
from typing import Any

from ._overrides import Override, policy_override, scope
from ._plan import ENV_DENY, ENV_PREFER, PolicyPlan
from ._policy import (ENV_POLICY, EnvOverrides, Policy, PolicyLayer, default_policy_path, load_policy, parse_policy,
                      parse_policy_layer, read_policy_file)
from ._schema import OpPolicy, PolicyFile, Rule, Settings, When

__all__ = [
    "ENV_DENY", "ENV_POLICY", "ENV_PREFER", "EnvOverrides", "OpPolicy", "Override", "Policy",
    "PolicyFile", "PolicyLayer", "PolicyPlan", "Rule", "Settings", "When", "default_policy_path", "load_policy",
    "parse_policy", "parse_policy_layer", "policy_override", "read_policy_file", "reload", "scope",
]


# How to find the process-wide manager, registered by the engine when it holds one (core/opdispatch/engine/_current.py):
# this package sits below the engine and does not import it.
_process_manager: list[Callable[[], Any]] = []


def reload() -> None:
    """Re-read the policy file and OPDISPATCH_* env vars of the process-wide manager; swap them in atomically.
    (No manager yet: nothing to re-read — the first one reads them when it is created.)"""
    for current in _process_manager:
        manager = current()
        if manager is not None:
            manager.reload()
