"""torch.compile support for every op but attention: one opaque custom op per op, generated from its argument
definition, that dispatches at run time.

Under ``torch.compile`` a front door (`opdispatch.rms_norm`, `opdispatch.rotary_embedding`, or any op's from
`define_front_door`) emits ``opdispatch::<op>``; its kernel runs the eager front door on the real tensors, so
validation and the decision happen per call through the per-call fast path (one dict lookup once a signature is
known). Nothing about the decision is baked into the graph: changing shapes never re-trace (the fake kernel is
the op's `OpSpec.fake_outputs`, symbolic sizes welcome), and a policy swap, `policy_override()` or `scope()`
active around the compiled call apply at once. Scopes and overrides entered *inside* the traced function (which
Dynamo cannot trace: ``ContextVar.set``) are recorded while tracing by opdispatch.compile._compile's stand-ins and reach
the op as a small int constant (`_scopes_token`); the kernel enters them for real around the eager call.

The custom op's schema comes from the op's `OpArguments`: tensors and optional tensors as declared, numbers,
flags and names as scalars, an ``int | torch.Tensor | None`` argument as two (``<name>_tensor``, ``<name>_int``).
Its result is the list of the front door's output tensors (one tensor, or a tuple's items).

Autograd: the backward is a second opaque op, ``opdispatch::<op>_backward``, which recomputes the forward of the
implementation the policy picks under autograd and differentiates it — so every implementation that declares a
backward works, with no per-implementation code. The recompute costs one extra forward, small for these
memory-bound ops.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..base._arguments import OpArguments
from opdispatch.policies._overrides import TRACED_SCOPES, entered

__all__ = ["opaque_compiled_op"]

# Argument annotation -> schema entries (one, or two for an int-or-tensor argument).
_SCALARS = {"float": "float", "bool": "bool", "str": "str", "str | None": "str?", "int": "SymInt",
            "int | None": "SymInt?"}
_TENSORS = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?"}
_INT_OR_TENSOR = "int | torch.Tensor | None"


def _schema_entries(arguments: OpArguments) -> list[tuple[str, str, str]]:
    """(schema type, schema name, argument name) per entry, in the definition's order."""
    out = []
    for arg in arguments.args:
        if arg.annotation in _TENSORS:
            out.append((_TENSORS[arg.annotation], arg.name, arg.name))
        elif arg.annotation in _SCALARS:
            out.append((_SCALARS[arg.annotation], arg.name, arg.name))
        elif arg.annotation == _INT_OR_TENSOR:
            out += [("Tensor?", f"{arg.name}_tensor", arg.name), ("SymInt?", f"{arg.name}_int", arg.name)]
        else:
            raise TypeError(f"op {arguments.op!r}: argument {arg.name!r} of type {arg.annotation!r} has no custom-op "
                            f"schema type; supported: {sorted([*_TENSORS, *_SCALARS, _INT_OR_TENSOR])}")
    return out


@contextlib.contextmanager
def autograd_reenabled() -> Iterator[None]:
    """Record autograd again inside a custom op's kernel (which runs below the Autograd dispatch key)."""
    C = torch._C
    keys = C.DispatchKey
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _grads(forward: Callable[..., Sequence[Tensor]], inputs: list[Tensor | None], needs: list[bool],
           grad_outputs: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Gradients of `forward(*inputs)` for the inputs in `needs`, recomputing it eagerly under autograd."""
    leaves = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(inputs, needs)]
    with autograd_reenabled():  # a custom op's kernel runs below the Autograd dispatch key
        outputs = forward(*leaves)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    wanted = [t for t, need in zip(leaves, needs) if need and t is not None]
    if not pairs or not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    out: list[Tensor | None] = []
    for t, need in zip(leaves, needs):
        grad = next(got) if need and t is not None else None
        out.append(torch.zeros_like(t) if grad is None and need and t is not None else grad)
    return out


_SCOPES: list[tuple[Any, ...]] = [()]  # token -> the scopes/overrides recorded inside a traced function
_SCOPE_TOKENS: dict[tuple[Any, ...], int] = {(): 0}


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.assume_constant_result`, without importing Dynamo at import time (about 1 s of every
    `import opdispatch`): the decorator only sets this marker on the function, which Dynamo reads when it traces
    (tests/test_compile.py checks that torch still marks functions this way)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)  # type: ignore[no-any-return,no-untyped-call]
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_result
def _scopes_token(inner: tuple[Any, ...]) -> int:
    """A graph constant naming the scopes and overrides entered inside the traced function (0: none)."""
    token = _SCOPE_TOKENS.get(inner)
    if token is None:
        token = _SCOPE_TOKENS[inner] = len(_SCOPES)
        _SCOPES.append(inner)
    return token


def _entered_scopes(token: int) -> Any:
    return entered(_SCOPES[token])


def _as_list(result: Any) -> list[Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _unaliased(outputs: list[Tensor], inputs: Sequence[Any]) -> list[Tensor]:
    """`outputs` with a copy of any that shares memory with an input or an earlier output (a custom op may not
    return an alias: e.g. the gradient of an add is the incoming gradient itself)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    out = []
    for t in outputs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(t)
    return out


# op -> (schema, [front door, fake outputs], compiled entry): a custom op is defined once per process; defining
# the front door again (a test, a module reload) with the same schema rebinds what the op calls.
_DEFINED: dict[str, tuple[str, list[Any], Callable[..., Any]]] = {}


def opaque_compiled_op(arguments: OpArguments, front_door: Callable[..., Any],
                       fake_outputs: Callable[..., list[Tensor]]) -> Callable[..., Any]:
    """Define ``opdispatch::<op>`` (and its backward) for an op; return the function a front door calls under
    torch.compile, taking the front door's own arguments and returning what it returns.

    front_door: the eager front door, called by the kernel (and recomputed by the backward).
    fake_outputs: called with the op's arguments by name (tensors fake or meta), returns empty tensors shaped
      like the front door's outputs (the custom op's fake kernel).
    """
    op = arguments.op
    entries = _schema_entries(arguments)
    schema_args = ", ".join(f"{kind} {name}" for kind, name, _ in entries)
    known = _DEFINED.get(op)
    if known is not None:
        if known[0] != schema_args:
            raise ValueError(f"op {op!r}: opdispatch::{op} is already defined with ({known[0]}); a custom op's "
                             f"schema cannot change in a process (new: ({schema_args}))")
        known[1][:] = [front_door, fake_outputs]
        return known[2]
    current = [front_door, fake_outputs]
    names = arguments.names
    # The differentiable inputs: tensor arguments whose key kind says autograd may flow through them.
    differentiable = [a.name for a in arguments.args if a.key in ("tensor", "strided", "tensor?")]

    def unlower(args: Sequence[Any]) -> dict[str, Any]:
        given: dict[str, Any] = {}
        for (_, schema_name, name), value in zip(entries, args):
            if schema_name == f"{name}_tensor":
                given[name] = value
            elif schema_name == f"{name}_int":
                if given[name] is None:
                    given[name] = value
            else:
                given[name] = value
        return given

    def lower(given: dict[str, Any]) -> list[Any]:
        out = []
        for _, schema_name, name in entries:
            value = given[name]
            if schema_name == f"{name}_tensor":
                value = value if isinstance(value, Tensor) else None
            elif schema_name == f"{name}_int":
                value = None if isinstance(value, Tensor) else value
            out.append(value)
        return out

    def eager(given: dict[str, Any]) -> list[Tensor]:
        positional = [given[a.name] for a in arguments.args if a.positional]
        keywords = {a.name: given[a.name] for a in arguments.args if not a.positional}
        return _as_list(current[0](*positional, **keywords))

    # The op's arguments, then the token of the scopes entered inside the traced function.
    @torch.library.custom_op(f"opdispatch::{op}", mutates_args=(),
                             schema=f"({schema_args}, SymInt scopes) -> Tensor[]")
    def kernel(*args: Any) -> list[Tensor]:
        with _entered_scopes(args[-1]):
            return _unaliased(eager(unlower(args[:-1])), args)

    @kernel.register_fake
    def _(*args: Any) -> list[Tensor]:
        return current[1](**unlower(args[:-1]))  # type: ignore[no-any-return]

    @torch.library.custom_op(f"opdispatch::{op}_backward", mutates_args=(),
                             schema=f"(Tensor?[] grad_outputs, {schema_args}, SymInt scopes, bool[] needs) "
                                    "-> Tensor[]")
    def backward_kernel(*args: Any) -> list[Tensor]:
        grad_outputs, needs = args[0], args[-1]
        given = unlower(args[1:-2])

        def forward(*leaves: Tensor | None) -> list[Tensor]:
            return eager({**given, **dict(zip(differentiable, leaves))})

        with _entered_scopes(args[-2]):
            grads = _grads(forward, [given[n] for n in differentiable], list(needs), grad_outputs)
        first = given[differentiable[0]]
        return _unaliased([g if g is not None else first.new_empty(0) for g in grads], [*grad_outputs, *args[1:-1]])

    @backward_kernel.register_fake
    def _(*args: Any) -> list[Tensor]:
        needs = args[-1]
        given = unlower(args[1:-2])
        first = given[differentiable[0]]
        return [torch.empty_like(given[n]) if need and given[n] is not None else first.new_empty(0)
                for n, need in zip(differentiable, needs)]

    positions = {name: i for i, (_, name, _) in enumerate(entries)}
    grad_positions = [positions[n] for n in differentiable]

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = [i for i, value in enumerate(inputs) if isinstance(value, Tensor)]
        ctx.tensor_positions = tensors
        ctx.save_for_backward(*(inputs[i] for i in tensors))
        ctx.inputs = [None if isinstance(value, Tensor) else value for value in inputs]

    def backward(ctx: Any, grad_outputs: list[Tensor | None]) -> tuple[Any, ...]:
        inputs = list(ctx.inputs)
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            inputs[i] = t
        needs = [bool(ctx.needs_input_grad[i]) for i in grad_positions]
        grads = backward_kernel(list(grad_outputs), *inputs, needs)
        out: list[Any] = [None] * len(inputs)
        for i, grad, need in zip(grad_positions, grads, needs):
            out[i] = grad if need else None
        return tuple(out)

    kernel.register_autograd(backward, setup_context=setup_context)

    def compiled(*args: Any, **kwargs: Any) -> Any:
        given = dict(zip(names, args))
        given.update(kwargs)
        for a in arguments.args:
            given.setdefault(a.name, a.default)
        outputs = kernel(*lower(given), _scopes_token(tuple(TRACED_SCOPES)))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    compiled.__name__ = compiled.__qualname__ = f"{op}_for_compile"
    compiled.__signature__ = arguments.signature()  # type: ignore[attr-defined]
    _DEFINED[op] = (schema_args, current, compiled)
    return compiled
