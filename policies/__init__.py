"""YAML policies: schema, loading with line numbers, rule matching, scoped overrides, the decision's precedence
(`_plan.py`) and the tuned tables that `autotune:` names."""

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


def reload() -> None:
    """Re-read the policy file and OPDISPATCH_* env vars of the process-wide manager; swap them in atomically."""
    from opdispatch import get_manager

    get_manager().reload()
