"""The output guard: is what an implementation returned the op's result for this call?

Two levels. The *structure* — a tensor or a tuple as the call asks, each output's shape, dtype and device
(`OpSpec.expected_outputs`) — is checked on every call that is decided or validated anew (the slow path) and on
the first call of each fast-path signature: a signature fixes the structure, so a kernel that gets it wrong is
caught on its first call at no cost per call after it. The *values* — no NaN in any output, inputs left as they
were (a snapshot compared bit for bit, so a NaN the caller passed in is equal to itself, and restored when a
kernel wrote into them) — are checked on every call under
``OPDISPATCH_CHECK_OUTPUTS=1`` (a debug flag: it copies the inputs and reads the outputs back), and by
``opdispatch validate``. A problem raises `ImplementationOutputError`, which the breaker treats as the kernel
failing: with ``fallback_on_error`` the next implementation takes the call.

NaN in an output is blamed on the kernel only when every floating-point input was finite: NaN or ±inf already in
an input legitimately reaches outputs (a NaN key or value poisons every query row that gives it weight, a NaN
in x its whole rms_norm row, ``inf - inf`` in a score is NaN), so with a non-finite input the NaN check is skipped
for that call — the input check still runs, and the caller gets what the kernel computed from what it was given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..base._ops import op_spec

__all__ = ["ENV_CHECK_OUTPUTS", "ImplementationOutputError", "InputSnapshot", "all_finite", "check_values_enabled",
           "same_bits", "structure_problems", "value_problems"]

ENV_CHECK_OUTPUTS = "OPDISPATCH_CHECK_OUTPUTS"


class ImplementationOutputError(RuntimeError):
    """An implementation returned something that is not the op's result for the call (or changed its inputs)."""


def check_values_enabled(environ: Any = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_CHECK_OUTPUTS, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor {tuple(value.shape)} {value.dtype} on {value.device}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__}"


def structure_problems(op: str, call: Any, result: Any) -> list[str]:
    """What is wrong with the structure of `result` for `call` (empty when it is right)."""
    expected = op_spec(op).expected_outputs
    if expected is None:
        return []
    outputs: Sequence[tuple[tuple[int, ...], torch.dtype]] = expected(call)
    if len(outputs) == 1:
        got: Sequence[Any] = (result,)
        if not isinstance(result, torch.Tensor):
            return [f"returned {_describe(result)}; expected a Tensor {outputs[0][0]} {outputs[0][1]}"]
    else:
        if not isinstance(result, tuple) or len(result) != len(outputs):
            return [f"returned {_describe(result)}; expected a tuple of {len(outputs)} Tensors"]
        got = result
    problems = []
    for i, (value, (shape, dtype)) in enumerate(zip(got, outputs)):
        where = "" if len(outputs) == 1 else f"output {i}: "
        if not isinstance(value, torch.Tensor):
            problems.append(f"{where}returned {_describe(value)}; expected a Tensor {shape} {dtype}")
        elif tuple(value.shape) != tuple(shape) or value.dtype != dtype or value.device != call.device:
            problems.append(f"{where}returned {_describe(value)}; expected {tuple(shape)} {dtype} on {call.device}")
    return problems


def value_problems(result: Any, inputs: Sequence[Any] = ()) -> list[str]:
    """NaN in any output, when every floating-point tensor of `inputs` is finite (finite inputs never give one: a
    query that sees no key gives 0 and lse -inf); nothing when some input holds NaN or ±inf, which may reach the
    outputs without any fault of the kernel."""
    if not all_finite(inputs):
        return []
    outputs = result if isinstance(result, tuple) else (result,)
    return [f"output {i} holds NaN" for i, t in enumerate(outputs)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and bool(torch.isnan(t).any())]


def all_finite(tensors: Sequence[Any]) -> bool:
    """Whether no floating-point (or complex) tensor among `tensors` holds NaN or ±inf."""
    return all(bool(torch.isfinite(t).all()) for t in tensors
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


# Integer dtypes of each element size: a floating tensor viewed as one compares bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same elements bit for bit: unlike ``torch.equal``, NaN equals the same NaN
    (reading an input never changes it; a write of anything else, -0.0 over 0.0 included, is a change)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point() and a.element_size() in _BITS:
        bits = _BITS[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


class InputSnapshot:
    """Copies of a call's input tensors, to tell (and undo) a kernel writing into them."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.tensors = list(tensors)
        self.copies = [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in tensors]

    def restore_changed(self) -> list[int]:
        """The positions of the inputs that changed (bit for bit: NaN given is NaN kept), each restored from its
        copy."""
        changed = []
        for i, (t, copy) in enumerate(zip(self.tensors, self.copies)):
            if copy is not None and not same_bits(t.detach(), copy):
                with torch.no_grad():
                    t.copy_(copy)
                changed.append(i)
        return changed


def guarded(op: str, impl_id: str, run: Callable[..., Any], call_of: Callable[..., Any],
            names: Sequence[str]) -> Callable[..., Any]:
    """`run(*tensors)` with every check (OPDISPATCH_CHECK_OUTPUTS): structure, NaN, inputs left unchanged.
    `call_of(*tensors)` gives the call record the structure is checked against; `names` name the tensors."""
    def checked(*tensors: Any) -> Any:
        snapshot = InputSnapshot(tensors)
        try:
            result = run(*tensors)
        except Exception as exc:
            changed = snapshot.restore_changed()
            if changed:
                raise ImplementationOutputError(
                    f"{op}: {impl_id} changed its input(s) {', '.join(names[i] for i in changed)} and then raised "
                    f"{type(exc).__name__}: {exc} (inputs restored from the guard's copy)") from exc
            raise
        # NaN checked against the inputs as given (the snapshot): not as a faulty kernel may have left them.
        problems = structure_problems(op, call_of(*tensors), result) + value_problems(result, snapshot.copies)
        changed = snapshot.restore_changed()
        if changed:
            problems.append(f"changed its input(s) {', '.join(names[i] for i in changed)} (restored)")
        if problems:
            raise ImplementationOutputError(f"{op}: {impl_id} " + "; ".join(problems) + f" ({ENV_CHECK_OUTPUTS})")
        return result

    return checked
