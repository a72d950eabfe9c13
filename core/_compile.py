"""torch.compile support: attention as one opaque custom op whose implementation is chosen at trace time.

Under ``torch.compile`` the decision cannot be made per call: the graph would break on the manager's Python.
Instead `attention_for_compile` reduces the call to plain constants (shapes, dtypes, flags), asks the manager
once while Dynamo traces (`torch.compiler.assume_constant_result`), and emits ``opdispatch::attention`` with
the chosen implementation id baked into the graph as a string constant. The op has a fake (meta) kernel for
every layout and an autograd formula whose backward is a second opaque op, ``opdispatch::attention_backward``,
that recomputes the chosen implementation's forward under autograd — so every implementation that declares
``backward=True`` works, with no per-implementation backward code.

In eager mode nothing here is on the hot path: a custom op costs ~16 µs per call, so eager calls go straight
to the implementation. `attention_for_compile` still works eagerly (tests compare it with eager attention).

Limits: dropout with autograd is refused (recomputing the forward would draw a different dropout mask); a
``thd`` call needs ``max_seqlen_q``/``max_seqlen_k`` (reading ``cu_seqlens`` would be a data-dependent host
sync); shapes are specialised (a dynamic dimension is made static by the trace-time decision).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["attention_for_compile", "compiled_attention", "decide_for_compile", "fake_outputs",
           "invalidate_compiled_decisions"]

_OP = "attention"

# Compiled graphs keep the implementation chosen when they were traced. Dynamo guards on this counter (it is
# read while tracing), so bumping it makes every compiled graph re-trace — and re-decide — on its next call.
DECISION_EPOCH = 0


def invalidate_compiled_decisions() -> None:
    """Make compiled graphs re-decide on their next call (after a policy, plugin or env pin change)."""
    global DECISION_EPOCH
    DECISION_EPOCH += 1

# -- the trace-time decision -------------------------------------------------------------------------------


def _tensor_key(t: Tensor | None) -> tuple[Any, ...] | None:
    """What a decision may read from a tensor: shape, dtype, device, requires_grad (all constant under Dynamo)."""
    if t is None:
        return None
    return (tuple(int(s) for s in t.shape), t.dtype, str(t.device), bool(t.requires_grad))


def _meta(key: tuple[Any, ...] | None) -> Tensor | None:
    if key is None:
        return None
    shape, dtype, _device, grad = key
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.requires_grad_(grad) if (grad and dtype.is_floating_point) else t


@torch.compiler.assume_constant_result
def decide_for_compile(tensors: tuple[Any, ...], options: tuple[tuple[str, Any], ...], grad_enabled: bool,
                       impl: Optional[str], epoch: int = 0) -> str:
    """The id of the implementation that takes this call; run once per trace (its result is a graph constant).

    `tensors` holds `_tensor_key` of q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k;
    `options` the remaining keyword arguments as sorted (name, value) pairs. The call is rebuilt on the meta
    device (nothing is computed) and validated like any call, then resolved for the tensors' real device.
    """
    import opdispatch

    names = ("q", "k", "v", "alibi_slopes", "attn_mask", "attn_bias", "cu_seqlens_q", "cu_seqlens_k")
    kwargs: dict[str, Any] = {name: _meta(key) for name, key in zip(names, tensors)}
    kwargs.update(dict(options))
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    with torch.set_grad_enabled(grad_enabled):
        call = opdispatch.validate_attention(q, k, v, check_values=False, **kwargs)
        manager = opdispatch.get_manager()
        device = manager.device_info(torch.device(tensors[0][2]))
        decision = manager.resolve(_OP, call, device=device, impl=impl)
    assert decision.chosen_id is not None
    return decision.chosen_id


# -- the custom ops ----------------------------------------------------------------------------------------


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fake_outputs(q: Tensor, v: Tensor, layout: str, return_lse: bool) -> tuple[Tensor, Tensor]:
    """Empty (out, lse) with the shapes and dtypes attention returns; lse is (0,) when not requested.

    out: q's shape with v's head dim (last dim), q's dtype, contiguous. lse: float32 (float64 for float64
    inputs), (batch, heads_q, seqlen_q) for dense layouts, (heads_q, total_q) for thd.
    """
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_dtype = _lse_dtype(q.dtype)
    if not return_lse:
        return out, q.new_empty((0,), dtype=lse_dtype)
    if layout == "thd":
        shape = (q.shape[1], q.shape[0])
    elif layout == "bshd":
        shape = (q.shape[0], q.shape[2], q.shape[1])
    elif layout == "bhsd":
        shape = (q.shape[0], q.shape[1], q.shape[2])
    else:  # sbhd
        shape = (q.shape[1], q.shape[2], q.shape[0])
    return out, q.new_empty(shape, dtype=lse_dtype)


def _window(left: int, right: int) -> tuple[int, int] | None:
    return None if left == -1 and right == -1 else (left, right)


def _rebuild_call(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor],
                  attn_bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  layout: str, causal: bool, causal_alignment: str, window_left: int, window_right: int,
                  scale: float, dropout_p: float, softcap: float, max_seqlen_q: Optional[int],
                  max_seqlen_k: Optional[int], return_lse: bool, deterministic: bool) -> Any:
    import opdispatch

    return opdispatch.validate_attention(
        q, k, v, layout=layout, causal=causal, causal_alignment=causal_alignment,
        window=_window(window_left, window_right), scale=scale, dropout_p=dropout_p, softcap=softcap,
        alibi_slopes=alibi_slopes, attn_mask=attn_mask, attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse,
        deterministic=deterministic, check_values=False)


_impl_cache: dict[tuple[int, str], Any] = {}


def _impl(impl_id: str) -> Any:
    import opdispatch

    manager = opdispatch.get_manager()
    key = (id(manager), impl_id)
    impl = _impl_cache.get(key)
    if impl is None:
        manager.ensure_initialized()
        registered = manager.registry.get(_OP, impl_id)
        if registered is None:
            raise RuntimeError(f"opdispatch::attention: implementation {impl_id!r} was chosen when the graph was "
                               "traced but is not registered in this process; re-trace (torch._dynamo.reset()) "
                               "after changing plugins")
        impl = registered.impl
        if len(_impl_cache) > 64:
            _impl_cache.clear()
        _impl_cache[key] = impl
    return impl


def _split(result: Any, q: Tensor, v: Tensor, layout: str, return_lse: bool) -> tuple[Tensor, Tensor]:
    """An implementation's result as the op's (out, lse): contiguous, lse in the declared dtype."""
    if return_lse:
        out, lse = result
        lse = lse.to(_lse_dtype(q.dtype)).contiguous()
    else:
        out = result
        lse = q.new_empty((0,), dtype=_lse_dtype(q.dtype))
    # The fake kernel promises a contiguous output; an implementation may hand back a permuted view.
    return out.contiguous(), lse


@torch.library.custom_op("opdispatch::attention", mutates_args=())
def compiled_attention(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], attn_mask: Optional[Tensor],
    attn_bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], layout: str,
    causal: bool, causal_alignment: str, window_left: int, window_right: int, scale: float, dropout_p: float,
    softcap: float, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], return_lse: bool,
    deterministic: bool, impl_id: str,
) -> tuple[Tensor, Tensor]:
    """Attention computed by implementation `impl_id`; returns (out, lse), lse of shape (0,) unless return_lse.

    The window is (window_left, window_right) with (-1, -1) meaning none; `scale` is already resolved.
    """
    call = _rebuild_call(q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, layout, causal,
                         causal_alignment, window_left, window_right, scale, dropout_p, softcap, max_seqlen_q,
                         max_seqlen_k, return_lse, deterministic)
    return _split(_impl(impl_id).run(call), q, v, layout, return_lse)


@compiled_attention.register_fake
def _(q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, layout, causal,  # type: ignore[no-untyped-def]
      causal_alignment, window_left, window_right, scale, dropout_p, softcap, max_seqlen_q, max_seqlen_k,
      return_lse, deterministic, impl_id):
    return fake_outputs(q, v, layout, return_lse)


@contextlib.contextmanager
def _autograd_reenabled() -> Iterator[None]:
    """Record autograd again inside a custom op's kernel (which runs below the Autograd dispatch key)."""
    C = torch._C
    keys = C.DispatchKey
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("opdispatch::attention_backward", mutates_args=())
def _attention_backward(
    grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
    attn_mask: Optional[Tensor], attn_bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], layout: str, causal: bool, causal_alignment: str, window_left: int,
    window_right: int, scale: float, dropout_p: float, softcap: float, max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int], return_lse: bool, deterministic: bool, impl_id: str, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias) by recomputing implementation `impl_id`'s forward under autograd.

    dbias has shape (0,) unless `bias_grad`. Opaque to the compiler like the forward.
    """
    with _autograd_reenabled():
        leaves = [q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()]
        bias = attn_bias
        if bias_grad and attn_bias is not None:
            bias = attn_bias.detach().requires_grad_()
            leaves.append(bias)
        call = _rebuild_call(leaves[0], leaves[1], leaves[2], alibi_slopes, attn_mask, bias, cu_seqlens_q,
                             cu_seqlens_k, layout, causal, causal_alignment, window_left, window_right, scale,
                             dropout_p, softcap, max_seqlen_q, max_seqlen_k, return_lse, deterministic)
        result = _impl(impl_id).run(call)
        outputs = [result[0] if return_lse else result]
        grads = [grad_out]
        # An implementation whose lse is not differentiable (a kernel's side output) contributes no lse gradient.
        if return_lse and grad_lse is not None and grad_lse.numel() and result[1].requires_grad:
            outputs.append(result[1])
            grads.append(grad_lse.to(result[1].dtype))
        found = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    out = [torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(found, leaves)]
    if len(out) == 3:
        out.append(q.new_empty((0,)))
    return out[0], out[1], out[2], out[3]


@_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, layout,  # type: ignore[no-untyped-def]
      causal, causal_alignment, window_left, window_right, scale, dropout_p, softcap, max_seqlen_q, max_seqlen_k,
      return_lse, deterministic, impl_id, bias_grad):
    dbias = torch.empty_like(attn_bias, memory_format=torch.contiguous_format) if (
        bias_grad and attn_bias is not None) else q.new_empty((0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


_TENSOR_ARGS = ("q", "k", "v", "alibi_slopes", "attn_mask", "attn_bias", "cu_seqlens_q", "cu_seqlens_k")
_SCALAR_ARGS = ("layout", "causal", "causal_alignment", "window_left", "window_right", "scale", "dropout_p",
                "softcap", "max_seqlen_q", "max_seqlen_k", "return_lse", "deterministic", "impl_id")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors = inputs[:len(_TENSOR_ARGS)]
    ctx.save_for_backward(*(t if t is not None else None for t in tensors))
    ctx.scalars = inputs[len(_TENSOR_ARGS):]


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> tuple[Any, ...]:
    tensors = ctx.saved_tensors
    bias_grad = bool(ctx.needs_input_grad[5])
    dq, dk, dv, dbias = torch.ops.opdispatch.attention_backward(grad_out, grad_lse, *tensors, *ctx.scalars,
                                                                bias_grad)
    grads: list[Any] = [dq, dk, dv, None, None, dbias if bias_grad else None, None, None]
    return (*grads, *([None] * len(_SCALAR_ARGS)))


compiled_attention.register_autograd(_backward, setup_context=_setup_context)


# -- the entry point ---------------------------------------------------------------------------------------


def attention_for_compile(
    q: Tensor, k: Tensor, v: Tensor, *, layout: str = "bshd", causal: bool = False,
    causal_alignment: str = "top_left", window: tuple[int, int] | None = None, scale: float | None = None,
    dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    attn_mask: Tensor | None = None, attn_bias: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    return_lse: bool = False, deterministic: bool = False, impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`opdispatch.attention` as one graph node: decided at trace time, traced without a graph break.

    Same arguments and results as `opdispatch.attention`. Validation and the decision run once per trace on
    meta tensors (errors are the same as in eager mode); the graph keeps only ``opdispatch::attention``.
    """
    tensors = (q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k)
    keys = tuple(_tensor_key(t) for t in tensors)
    if layout == "thd" and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("attention() under torch.compile with layout='thd' needs max_seqlen_q and max_seqlen_k: "
                         "computing them from cu_seqlens is a data-dependent host sync; pass the longest "
                         "sequence lengths (an upper bound is fine)")
    grad_enabled = torch.is_grad_enabled()
    if dropout_p and grad_enabled and any(t is not None and t.requires_grad for t in (q, k, v, attn_bias)):
        raise ValueError("attention() under torch.compile does not support dropout_p > 0 with autograd: the "
                         "backward recomputes the forward, which would draw a different dropout mask; use "
                         "dropout_p=0.0 or run this call eagerly")
    options = (("causal", causal), ("causal_alignment", causal_alignment), ("deterministic", deterministic),
               ("dropout_p", dropout_p), ("layout", layout), ("max_seqlen_k", max_seqlen_k),
               ("max_seqlen_q", max_seqlen_q), ("return_lse", return_lse), ("scale", scale),
               ("softcap", softcap), ("window", None if window is None else tuple(window)))
    impl_id = decide_for_compile(keys, options, grad_enabled, impl, DECISION_EPOCH)
    head_dim = q.shape[-1]
    if window is None:
        left, right = -1, -1
    else:
        left, right = int(window[0]), int(window[1])
        if causal:
            right = 0
        if causal and left == -1:
            left, right = -1, -1
    out, lse = compiled_attention(
        q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, layout, causal, causal_alignment,
        left, right, float(scale) if scale is not None else 1.0 / math.sqrt(head_dim), float(dropout_p),
        float(softcap), max_seqlen_q, max_seqlen_k, return_lse, deterministic, impl_id)
    return (out, lse) if return_lse else out
