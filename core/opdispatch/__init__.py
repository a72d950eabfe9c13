"""opdispatch: dispatch operator calls (attention first) to the best implementation a device has.

Call ``opdispatch.attention(...)``; ask ``opdispatch.explain(...)`` why an implementation was chosen. Vendors
plug in through the ``opdispatch.plugins`` entry-point group (see ``opdispatch.plugins.hookspec``).
"""

from typing import Any

from opdispatch.plugins.hookspec import hookimpl  # plugin modules use it at import time; pluggy only, no torch

# The public names, by the module that defines them. They load on first use (PEP 562), so `opdispatch --help`,
# `--version` and plugin modules that only need `hookimpl` start without importing torch.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Attention", "attention", "define_explain", "define_front_door", "explain", "explain_rms_norm",
                     "explain_rotary_embedding", "plan", "plan_op", "rms_norm", "rotary_embedding"), ".doors._api"),
    **dict.fromkeys(("diff_decisions", "export_decisions", "get_manager", "set_manager", "shadow_flush", "stats"),
                    ".engine._current"),
    **dict.fromkeys(("AttentionCall", "AttentionCaps", "AttentionImpl", "validate_attention"), ".ops._attention"),
    **dict.fromkeys(("OpSpec", "known_ops", "op_spec", "register_op"), ".base._ops"),
    **dict.fromkeys(("RmsNormCall", "RmsNormCaps", "RmsNormImpl", "validate_rms_norm"), ".ops._rms_norm"),
    **dict.fromkeys(("RotaryCall", "RotaryCaps", "RotaryImpl", "validate_rotary_embedding"), ".ops._rotary"),
    **dict.fromkeys(("Candidate", "Decision", "NoImplementationError", "PinnedImplementationError", "Provenance"),
                    ".base._decision"),
    **dict.fromkeys(("DeviceInfo", "load_device_descriptor"), ".base._device"),
    **dict.fromkeys(("DeviceDescriptorError", "OpDispatchError", "PluginLoadError", "PolicyError",
                     "RegistrationError"), ".base._errors"),
    **dict.fromkeys(("Impl", "Requirement"), ".base._impl"),
    "OpManager": ".engine._manager",
    **dict.fromkeys(("PACKED_LAYOUTS", "attention_packed", "packed_views"), ".doors._packed"),
    **dict.fromkeys(("Origin", "Registry"), ".engine._registry"),
    **dict.fromkeys(("policy_override", "scope"), "opdispatch.policies._overrides"),
    **dict.fromkeys(("context_parallel_attention", "shard_sequence", "unshard_sequence"),
                    ".distributed._context_parallel"),
    "AgreementError": ".engine._agreement",
}
_SUBMODULES = ("distributed",)  # `opdispatch.distributed.consistent()` after a plain `import opdispatch`


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name in _SUBMODULES:
        import importlib

        submodule = importlib.import_module(f".{name}", __name__)
        globals()[name] = submodule
        return submodule
    if module is None:
        raise AttributeError(f"module 'opdispatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


# Type checkers read __init__.pyi instead of this file: the same names, with the front doors typed from the ops'
# argument definitions (generated: `opdispatch stubs > core/opdispatch/__init__.pyi`; tests/test_stubs.py checks it).

from .base import __version__  # noqa: E402  (defined at the bottom of the layers, which every layer may read)

__all__ = [
    "AgreementError", "Attention", "AttentionCall", "AttentionCaps", "AttentionImpl", "Candidate", "Decision",
    "DeviceDescriptorError", "DeviceInfo", "Impl", "NoImplementationError", "OpDispatchError", "OpManager", "OpSpec",
    "Origin", "PACKED_LAYOUTS", "PinnedImplementationError", "PluginLoadError", "PolicyError", "Provenance",
    "RegistrationError", "Registry", "Requirement", "RmsNormCall", "RmsNormCaps", "RmsNormImpl", "RotaryCall",
    "RotaryCaps", "RotaryImpl", "__version__", "attention", "attention_packed", "context_parallel_attention",
    "define_explain", "define_front_door", "diff_decisions", "distributed", "explain", "explain_rms_norm",
    "explain_rotary_embedding", "export_decisions", "get_manager", "hookimpl", "known_ops", "load_device_descriptor",
    "op_spec", "packed_views", "plan", "plan_op", "policy_override", "register_op", "rms_norm", "rotary_embedding",
    "scope", "set_manager", "shadow_flush", "shard_sequence", "stats", "unshard_sequence", "validate_attention",
    "validate_rms_norm", "validate_rotary_embedding",
]
