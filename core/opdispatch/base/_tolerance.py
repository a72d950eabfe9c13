"""How close an implementation must come to the float64 reference, per dtype: the one table of tolerances.

Two kinds, for two kinds of check (each dtype's row of both is here, so they are read side by side):

- `ELEMENTWISE` — `atol`/`rtol` of `torch.testing.assert_close` for one output against `reference.math` on the
  test suite's well-conditioned random inputs: every element must be close.
- `RELATIVE_NORM` — (forward, gradient) bounds on ``‖got − want‖ / ‖want‖`` that `opdispatch validate` applies to
  every case of its conformance matrix (edge rows included: long rows, masks, windows), where a few outlying
  elements of a low-precision kernel are expected and an elementwise bound would quarantine correct kernels.

Keyed by the short dtype names of `opdispatch.base._dtypes.dtype_name` (no torch import: the CLI reads this).
"""

from __future__ import annotations

ELEMENTWISE: dict[str, dict[str, float]] = {
    "fp64": {"atol": 1e-10, "rtol": 1e-10},
    "fp32": {"atol": 2e-5, "rtol": 2e-5},
    "fp16": {"atol": 2e-3, "rtol": 2e-3},
    "bf16": {"atol": 1.6e-2, "rtol": 1.6e-2},
}

RELATIVE_NORM: dict[str, tuple[float, float]] = {
    "fp16": (4e-3, 1.5e-2), "bf16": (2.5e-2, 5e-2), "fp32": (2e-3, 5e-3), "fp64": (1e-9, 1e-8)}
