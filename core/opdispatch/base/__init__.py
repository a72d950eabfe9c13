"""The base layer: how an op is declared and what every layer above shares — errors, the decision record,
device info, the implementation base, the op table (`OpSpec`), the argument definitions that generate the front
doors (Python, and compiled: `_native.py` with `_native.cpp`), dtype names, KV-cache index checks, table text.

Imports nothing of opdispatch outside this folder (see docs/architecture.md, "The layer map").
"""

__version__ = "0.1.0"  # the package version (pyproject.toml [project] version); `opdispatch.__version__`
