"""Unequal head dims on kernels that need one head dim for q, k and v: v zero-padded to q/k's, the output sliced.

MLA prefill and training (DeepSeek: q·k 192 = 128 + 64 RoPE, v 128) has ``head_dim_v < head_dim``; most vendor
kernels take one head dim. Padding v with zero columns up to q/k's head dim is exact:

- forward: ``softmax(q kᵀ) @ [v, 0] = [softmax(q kᵀ) @ v, 0]`` — the first ``head_dim_v`` output columns are the
  call's answer, the others zero; q and k are untouched, so the scores, the scale (1/sqrt(q/k's head dim) by
  default, whatever the kernel is told) and the LSE are the call's own.
- backward: autograd flows through ``F.pad`` and the slice — the gradient of v is the first ``head_dim_v`` columns
  of the padded v's gradient, and the sliced-off output columns get a zero gradient, which adds nothing to dq/dk.
  A kernel's own ``backward`` (the compiled path) gets out and grad_out padded with zeros the same way.

Cost, per call that needs it: one zero-padded copy of v (``head_dim / head_dim_v`` times v's memory, kept for the
backward where the kernel saves its inputs) and an output ``head_dim`` wide, of which the result is a view. A call
whose head dims are equal runs unchanged: no padding, no copy.

Not padded (refused with a reason): ``head_dim_v > head_dim`` (padding v wider than q/k would need q/k padded too,
which is exact only with an explicit scale) and KV-cache calls (padding a cache would copy all of it per call).

Opt in with the class decorator `pads_v_head_dim` on an `AttentionImpl` whose caps leave ``head_dim_v_differs``
off: it declares ``head_dim_v_differs``, adds the refusals above to `not_supported_reasons`, pads inside `run`
(and an overridden `bind` and `backward`), and lists the cost in `describe_capabilities` (``opdispatch list -v``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import torch

from opdispatch.ops._attention import AttentionCall, AttentionImpl

V_PADDING_COST = ("v head dims below q/k's run on v zero-padded to q/k's head dim (exact): one padded copy of v "
                  "per call (head_dim / head_dim_v times v's memory, kept for the backward) and an output head_dim "
                  "wide whose first head_dim_v columns are returned as a view; equal head dims run unchanged")

ImplClass = TypeVar("ImplClass", bound=type[AttentionImpl])


def needs_v_padding(call: AttentionCall) -> bool:
    """Whether `pads_v_head_dim` pads this call (v narrower than q/k)."""
    return call.head_dim_v < call.head_dim


def v_padding_reason(call: AttentionCall, kernel: str) -> str | None:
    """Why `kernel` (which needs one head dim for q/k/v) cannot take the call by padding v, or None."""
    if call.head_dim_v == call.head_dim:
        return None
    if call.head_dim_v > call.head_dim:
        return (f"v head_dim {call.head_dim_v} above q/k head_dim {call.head_dim}: {kernel} needs one head dim and "
                "pads only a narrower v up to q/k's (a wider v would need q/k padded too)")
    if call.kv_cache:
        return (f"v head_dim {call.head_dim_v} differs from q/k head_dim {call.head_dim} with a KV cache: {kernel} "
                "needs one head dim, and padding v would copy the whole cache on every call")
    return None


def pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` with zero columns appended to its last dimension up to `size` (itself when already that wide);
    differentiable, and unit-stride in its last dimension as kernels need."""
    if t.shape[-1] == size:
        return t
    return torch.nn.functional.pad(t, (0, size - t.shape[-1])).contiguous()


def padded_v_call(call: AttentionCall) -> AttentionCall:
    """A copy of `call` whose v is zero-padded to q/k's head dim (`head_dim_v` set to match); q and k, the scale
    and every other argument are the call's own."""
    padded = call.with_tensors(call.q, call.k, pad_last(call.v, call.head_dim))
    padded.head_dim_v = call.head_dim
    return padded


def sliced_result(head_dim_v: int, result: Any) -> Any:
    """A padded run's result with the output's first `head_dim_v` columns (the LSE, when returned, unchanged)."""
    if isinstance(result, tuple):
        out, *rest = result
        return (out[..., :head_dim_v], *rest)
    return result[..., :head_dim_v]


def pads_v_head_dim(cls: ImplClass) -> ImplClass:
    """Class decorator: let an attention implementation whose kernel needs one head dim take calls whose v is
    narrower than q/k, exactly, by zero-padding v (the module doc says how and at what cost)."""
    caps = cls.caps
    if caps.head_dim_v_differs:
        raise TypeError(f"pads_v_head_dim({cls.__name__}): its caps already declare head_dim_v_differs; the "
                        "decorator is for kernels that need one head dim for q, k and v")
    cls.caps = dataclasses.replace(caps, head_dim_v_differs=True)
    run, reasons, describe = cls.run, cls.not_supported_reasons, cls.describe_capabilities

    @functools.wraps(run)
    def run_padded(self: AttentionImpl, call: AttentionCall) -> Any:
        if not needs_v_padding(call):
            return run(self, call)
        return sliced_result(call.head_dim_v, run(self, padded_v_call(call)))

    @functools.wraps(reasons)
    def not_supported_reasons(self: AttentionImpl, call: AttentionCall, device: Any) -> list[str]:
        found = reasons(self, call, device)
        why = v_padding_reason(call, self.id)
        return found + [why] if why else found

    @functools.wraps(describe)
    def describe_capabilities(self: AttentionImpl) -> dict[str, Any]:
        return {**describe(self), "head_dim_v_padded": V_PADDING_COST}

    setattr(cls, "run", run_padded)
    setattr(cls, "not_supported_reasons", not_supported_reasons)
    setattr(cls, "describe_capabilities", describe_capabilities)
    if cls.bind is not AttentionImpl.bind:
        setattr(cls, "bind", _padded_bind(cls.bind))
    if cls.backward is not AttentionImpl.backward:
        setattr(cls, "backward", _padded_backward(cls.backward))
    return cls


def _padded_bind(bind: Any) -> Any:
    """An overridden `bind`, bound for the padded call where v is narrower, padding each call's v and slicing."""

    @functools.wraps(bind)
    def bind_padded(self: AttentionImpl, call: AttentionCall) -> Any:
        if not needs_v_padding(call):
            return bind(self, call)
        inner = bind(self, padded_v_call(call))
        d, dv = call.head_dim, call.head_dim_v

        def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> Any:
            return sliced_result(dv, inner(q, k, pad_last(v, d), *rest))

        if getattr(inner, "size_generic", False):  # head dims are part of the decision class: d and dv stay fixed
            bound.size_generic = True  # type: ignore[attr-defined]
        return bound

    return bind_padded


def _padded_backward(backward: Any) -> Any:
    """An overridden `backward` on the padded forward's terms: out and grad_out padded with zero columns (what the
    padded forward produced and what the sliced-off columns receive), dv sliced back."""

    @functools.wraps(backward)
    def backward_padded(self: AttentionImpl, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                        grad_out: torch.Tensor) -> Any:
        if not needs_v_padding(call):
            return backward(self, call, out, lse, grad_out)
        d = call.head_dim
        grads = backward(self, padded_v_call(call), pad_last(out, d), lse, pad_last(grad_out, d))
        if grads is None:
            return None
        dq, dk, dv = grads
        return dq, dk, dv[..., :call.head_dim_v]

    return backward_padded
