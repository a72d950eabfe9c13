"""Fake vendor modules mirroring the real signatures and conventions (monkeypatched into sys.modules)."""
