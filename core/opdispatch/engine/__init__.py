"""The engine: deciding, caching, failing over and observing — `OpManager` (`_manager`), the process-wide
manager (`_current`), per-policy state, decision classes, the registry, the breaker, usage counters, shadow
checks, decision lockfiles and agreement across ranks.

Builds on `base`, `ops`, `opdispatch.plugins` and `opdispatch.policies`.
"""
