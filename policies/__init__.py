"""YAML policies: schema, loading with line numbers, and ordering/filtering of implementations."""

from ._policy import ENV_POLICY, KNOWN_OPS, Policy, PolicyPlan, default_policy_path, load_policy, parse_policy
from ._schema import OpPolicy, PolicyFile, Settings

__all__ = [
    "ENV_POLICY", "KNOWN_OPS", "OpPolicy", "Policy", "PolicyFile", "PolicyPlan", "Settings",
    "default_policy_path", "load_policy", "parse_policy",
]
