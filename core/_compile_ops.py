"""torch.compile support for the ops besides attention: each is one opaque custom op that dispatches at run time.

Under ``torch.compile`` a front door (`opdispatch.rms_norm`, `opdispatch.rotary_embedding`) emits
``opdispatch::<op>``; its kernel runs the eager front door on the real tensors, so validation and the decision
happen per call through the per-call fast path (one dict lookup once a signature is known). Nothing about the
decision is baked into the graph: changing shapes never re-trace (the fake kernels are shape formulas, symbolic
sizes welcome), and a policy swap, `policy_override()` or `scope()` active around the compiled call apply at once.
Scopes entered *inside* the traced function are not seen (Dynamo cannot trace ``ContextVar.set``); attention's
trace-time machinery (opdispatch._compile) handles those, these ops do not yet.

Autograd: the backward is a second opaque op, ``opdispatch::<op>_backward``, which recomputes the forward of the
implementation the policy picks under autograd and differentiates it — so every implementation that declares a
backward works, with no per-implementation code. The recompute costs one extra forward, small for these
memory-bound ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["rms_norm_for_compile", "rotary_embedding_for_compile"]


def _grads(forward: Callable[..., tuple[Tensor, ...]], inputs: list[Optional[Tensor]], needs: list[bool],
           grad_outputs: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
    """Gradients of `forward(*inputs)` for the inputs in `needs`, recomputing it eagerly under autograd."""
    from ._compile import autograd_reenabled

    leaves = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(inputs, needs)]
    with autograd_reenabled():  # a custom op's kernel runs below the Autograd dispatch key
        outputs = forward(*leaves)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    wanted = [t for t, need in zip(leaves, needs) if need and t is not None]
    if not pairs or not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    out: list[Optional[Tensor]] = []
    for t, need in zip(leaves, needs):
        grad = next(got) if need and t is not None else None
        out.append(torch.zeros_like(t) if grad is None and need and t is not None else grad)
    return out


# -- rms_norm ------------------------------------------------------------------------------------------------

def _eager_rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, residual: Optional[Tensor],
                    impl: Optional[str]) -> tuple[Tensor, Tensor]:
    import opdispatch

    out = opdispatch.rms_norm(x, weight, eps, residual, impl=impl)
    return out if residual is not None else (out, x.new_empty(0))


@torch.library.custom_op("opdispatch::rms_norm", mutates_args=())
def compiled_rms_norm(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float,
                      impl: Optional[str]) -> tuple[Tensor, Tensor]:
    """(y, x + residual), or (y, an empty tensor) without a residual: custom ops return no input aliases."""
    return _eager_rms_norm(x, weight, eps, residual, impl)


@compiled_rms_norm.register_fake
def _(x, weight, residual, eps, impl):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), torch.empty_like(x) if residual is not None else x.new_empty(0)


@torch.library.custom_op("opdispatch::rms_norm_backward", mutates_args=())
def compiled_rms_norm_backward(grad_y: Tensor, grad_h: Optional[Tensor], x: Tensor, weight: Optional[Tensor],
                               residual: Optional[Tensor], eps: float, impl: Optional[str],
                               needs: list[bool]) -> list[Tensor]:
    grads = _grads(lambda x_, w_, r_: _eager_rms_norm(x_, w_, eps, r_, impl), [x, weight, residual], needs,
                   [grad_y, grad_h if residual is not None else None])
    return [g if g is not None else x.new_empty(0) for g in grads]


@compiled_rms_norm_backward.register_fake
def _(grad_y, grad_h, x, weight, residual, eps, impl, needs):  # type: ignore[no-untyped-def]
    return [torch.empty_like(t) if need and t is not None else x.new_empty(0)
            for t, need in zip((x, weight, residual), needs)]


def _rms_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, residual, eps, impl = inputs
    ctx.save_for_backward(x, weight, residual)
    ctx.options = (eps, impl)


def _rms_backward(ctx: Any, grad_y: Tensor, grad_h: Tensor) -> tuple[Any, ...]:
    x, weight, residual = ctx.saved_tensors
    eps, impl = ctx.options
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = compiled_rms_norm_backward(grad_y, grad_h, x, weight, residual, eps, impl, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None)


compiled_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm_for_compile(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6,
                         residual: Optional[Tensor] = None, *, impl: Optional[str] = None) -> Any:
    """`opdispatch.rms_norm` as one graph node (same arguments and results)."""
    y, h = compiled_rms_norm(x, weight, residual, float(eps), impl)
    return (y, h) if residual is not None else y


# -- rotary_embedding ----------------------------------------------------------------------------------------

def _eager_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor],
                  offsets: Optional[Tensor], offset: int, interleaved: bool, layout: str,
                  cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                  impl: Optional[str]) -> tuple[Tensor, Tensor]:
    import opdispatch

    q_out, k_out = opdispatch.rotary_embedding(
        q, k, cos, sin, positions=positions, seqlen_offsets=offsets if offsets is not None else offset or None,
        interleaved=interleaved, layout=layout, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, impl=impl)
    return q_out, k_out


@torch.library.custom_op("opdispatch::rotary_embedding", mutates_args=())
def compiled_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor],
                    offsets: Optional[Tensor], offset: int, interleaved: bool, layout: str,
                    cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                    impl: Optional[str]) -> tuple[Tensor, Tensor]:
    """`offsets` is a per-sequence offset tensor, `offset` an int offset (one of them is used)."""
    return _eager_rotary(q, k, cos, sin, positions, offsets, offset, interleaved, layout, cu_seqlens, max_seqlen,
                         impl)


@compiled_rotary.register_fake
def _(q, k, cos, sin, positions, offsets, offset, interleaved, layout, cu_seqlens, max_seqlen,  # type: ignore[no-untyped-def]
      impl):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("opdispatch::rotary_embedding_backward", mutates_args=())
def compiled_rotary_backward(grad_q: Optional[Tensor], grad_k: Optional[Tensor], q: Tensor, k: Tensor, cos: Tensor,
                             sin: Tensor, positions: Optional[Tensor], offsets: Optional[Tensor], offset: int,
                             interleaved: bool, layout: str, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                             impl: Optional[str], needs: list[bool]) -> list[Tensor]:
    def forward(q_: Tensor, k_: Tensor, cos_: Tensor, sin_: Tensor) -> tuple[Tensor, Tensor]:
        return _eager_rotary(q_, k_, cos_, sin_, positions, offsets, offset, interleaved, layout, cu_seqlens,
                             max_seqlen, impl)

    grads = _grads(forward, [q, k, cos, sin], needs, [grad_q, grad_k])
    return [g if g is not None else q.new_empty(0) for g in grads]


@compiled_rotary_backward.register_fake
def _(grad_q, grad_k, q, k, cos, sin, positions, offsets, offset, interleaved, layout,  # type: ignore[no-untyped-def]
      cu_seqlens, max_seqlen, impl, needs):
    return [torch.empty_like(t) if need else q.new_empty(0) for t, need in zip((q, k, cos, sin), needs)]


def _rotary_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, cos, sin, positions, offsets, offset, interleaved, layout, cu_seqlens, max_seqlen, impl = inputs
    ctx.save_for_backward(q, k, cos, sin, positions, offsets, cu_seqlens)
    ctx.options = (offset, interleaved, layout, max_seqlen, impl)


def _rotary_backward(ctx: Any, grad_q: Tensor, grad_k: Tensor) -> tuple[Any, ...]:
    q, k, cos, sin, positions, offsets, cu_seqlens = ctx.saved_tensors
    offset, interleaved, layout, max_seqlen, impl = ctx.options
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    grads = compiled_rotary_backward(grad_q, grad_k, q, k, cos, sin, positions, offsets, offset, interleaved, layout,
                                     cu_seqlens, max_seqlen, impl, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), *([None] * 8))


compiled_rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def rotary_embedding_for_compile(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *,
                                 positions: Optional[Tensor] = None, seqlen_offsets: Any = None,
                                 interleaved: bool = False, layout: str = "bshd", cu_seqlens: Optional[Tensor] = None,
                                 max_seqlen: Optional[int] = None, impl: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """`opdispatch.rotary_embedding` as one graph node (same arguments and results)."""
    tensor_offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
    int_offset = 0 if seqlen_offsets is None or tensor_offsets is not None else seqlen_offsets
    q_out, k_out = compiled_rotary(q, k, cos, sin, positions, tensor_offsets, int_offset, interleaved, layout,
                                   cu_seqlens, max_seqlen, impl)
    return q_out, k_out
