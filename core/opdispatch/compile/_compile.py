"""torch.compile support: attention as one opaque custom op whose implementation is chosen at trace time.

Under ``torch.compile`` the decision cannot be made per call: the graph would break on the manager's Python.
Instead `attention_for_compile` reduces the call to plain constants, asks the manager once while Dynamo traces
(`torch.compiler.assume_constant_result`), and emits ``opdispatch::attention`` with the chosen implementation id
baked into the graph as a string constant. The op has a fake (meta) kernel for every layout (symbolic sizes
welcome) and an autograd formula whose backward is a second opaque op, ``opdispatch::attention_backward``. When
the chosen implementation has its own `AttentionImpl.backward` (gradients from the forward's out and LSE, as
torch's and flash-attn's kernels do), the forward keeps out and LSE and the backward calls it: one forward per
training step. Otherwise the backward recomputes the forward's implementation under autograd — so every
implementation that declares ``backward=True`` works, with no per-implementation backward code.

What is guarded, and when it recompiles. Batch and sequence lengths may be dynamic (``dynamic=None`` makes them
so on the second shape, ``dynamic=True`` at once). A decision depends on them only through a few predicates
(`size_predicates`, read from `opdispatch.engine._classes.DecisionClasses` once per trace): the policy rules'
thresholds on batch/seqlen_q/seqlen_k, each candidate's ``caps.max_seqlen``, ``seqlen_q == seqlen_k``, and
``== 0`` / ``== 1``. Each is evaluated on the (possibly symbolic) sizes as a Python branch, so Dynamo guards on
exactly that predicate; the decision then runs on meta tensors of representative sizes that give every
predicate the same outcome (`_representative`). A compiled graph is therefore reused across all sizes of one
decision class and re-traced only when a predicate flips (e.g. seqlen_k crosses a policy's ``'>=4096'``). Head
counts, head dims, dtypes, devices, flags and mask/bias broadcast patterns are specialised (a new value
recompiles). With ``dynamic=True``, Dynamo gives equal sizes one symbol, so a batch or length equal to a head
count or head dim on the first call is specialised with it (one extra graph when it changes). Where a decision
may read sizes in ways no predicate lists (an autotune table, an implementation's own `selection_key`/
`extra_reasons`), the kernel re-checks the decision on every call (a cached lookup) instead of guarding.
`invalidate_compiled_decisions` (called on policy and plugin changes) makes every graph re-trace.

How scopes and overrides are honoured. The decision records the `scope()` module and the `policy_override()`
stack active when the graph was traced, as a context token (a small int constant in the graph). The op's
kernel runs eagerly on every call: when the overrides or module active then differ from the token's, it decides
again for the current context (outputs never depend on which implementation runs, so the graph stays valid),
with no re-trace. `scope()`/`policy_override()` entered *inside* a traced function defer, while Dynamo traces
(Dynamo cannot trace ``ContextVar.set``), to stand-ins that record their arguments
(policies/opdispatch/policies/_overrides.py: `traced_scope`, `traced_policy_override`); the decision and the kernel
enter the real context managers around each call,
stacked over the caller's context. The backward recomputes the
implementation the latest forward of the same token ran (it may run outside the scope): two forwards of one
graph under different contexts, both before their backwards, recompute with the latter's implementation (the
same function; gradients agree within the implementations' tolerance).

torch.export (strict and non-strict) records the same op; non-strict export's FakeTensors reach it through
``opdispatch.compat.scaled_dot_product_attention`` too. An exported program must hold at every size its dynamic
dims allow (unbacked sizes included), so under export nothing above guards on a size: predicates take only the
outcomes the shape environment knows without a guard (`_export_outcome`), shapes are assumed consistent unless
known not to be (the kernel validates every call), and the trace's choice is provisional — the kernel decides
every call on its real sizes (``recheck``), in the context it runs in plus the scopes and overrides active while
the program was exported. Its context token spells that context (`_export_token`), so a saved program
(``torch.export.save``/``load``) runs in another process, which must ``import opdispatch.compile._compile`` (it defines
the op) before loading; one exported under a scope or override runs only where it was exported (a clear error
elsewhere). Head counts and head dims stay specialised: a dynamic dim that reaches them (the leading dim of
3-D inputs to the SDPA drop-in, which torch reads as heads) is a constraint violation where torch's function
exports.

In eager mode nothing here is on the hot path: a custom op costs ~16 µs per call, so eager calls go straight
to the implementation. `attention_for_compile` still works eagerly (tests compare it with eager attention).

Limits: dropout with autograd is refused (recomputing the forward would draw a different dropout mask); a
``thd`` call needs ``max_seqlen_q``/``max_seqlen_k`` (reading ``cu_seqlens`` would be a data-dependent host
sync); an implementation without its own `backward` (or a call it declines, or one returning its LSE or
differentiating a bias) has its forward recomputed by the backward.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import operator
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..engine._current import get_manager
from ..ops._attention import LAYOUT_DIMS, validate_attention
from ._compile_ops import autograd_reenabled, constant_result
from ..engine._profiling import call_range, profiling, range_name
from opdispatch.policies._overrides import MODULE, OVERRIDES, TRACED_SCOPES, entered

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


_SIZE_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
             "!=": operator.ne}
_FIELDS = ("batch", "seqlen_q", "seqlen_k")  # the sizes that may change between calls (may be symbolic)


@constant_result
def size_predicates(device: str, epoch: int = 0) -> tuple[tuple[tuple[str, str, Any], ...], bool]:
    """The size comparisons a decision may depend on, as ``((field, op, n), ...)``, and whether it may read more.

    From `opdispatch.engine._classes.DecisionClasses`: every policy rule's IntSpec on batch/seqlen_q/seqlen_k (a value
    list becomes one ``==`` per value), each candidate's ``caps.max_seqlen`` (``<=`` on both lengths), and
    ``seqlen_q == seqlen_k``. The flag is True when the decision may also depend on sizes in ways not listed
    (an autotune table's buckets, an implementation's own `selection_key`, an op without classes): the kernel
    then re-checks the decision on every call. Heads and head dims are specialised, so their rules need no atom.
    """
    from ..engine._classes import DecisionClasses

    manager = get_manager()
    manager.ensure_initialized()
    classes = DecisionClasses(_OP, manager.policy, [r.impl for r in manager.registry.for_op(_OP)])
    # 0 and 1 are special to validation and canonicalisation (one query); on symbolic sizes (>= 2) they are
    # statically false and cost no guard.
    atoms: list[tuple[str, str, Any]] = [("seqlen_q", "==", "seqlen_k")]
    atoms += [(f, "==", n) for f in _FIELDS for n in (0, 1)]
    for field, spec in classes.size_tests:
        if field not in _FIELDS:
            continue
        if spec.values is not None:
            atoms.extend((field, "==", n) for n in sorted(spec.values))
        else:
            atoms.extend((field, op, n) for op, n in spec.comps)
    for m in classes.max_seqlens:
        atoms.extend((("seqlen_q", "<=", m), ("seqlen_k", "<=", m)))
    info = manager.device_info(torch.device(device))
    keyed = [i for i in classes.keyed if manager.availability(i, info) is None]
    unlisted = classes.tuned or classes.generic or bool(keyed)
    return tuple(dict.fromkeys(atoms)), unlisted


def _representative(symbolic: tuple[str, ...],
                    outcomes: tuple[tuple[tuple[str, str, Any], bool], ...]) -> dict[str, int]:
    """Concrete sizes for the `symbolic` fields that give every predicate its recorded outcome.

    Candidates are 0 to 3 and each threshold +-1: enough to reach every region the atoms cut out.
    """
    # One pool for every field: a field tied to another (seqlen_q == seqlen_k) must reach the other's thresholds.
    pool = {0, 1, 2, 3}
    for (_field, _op, n), _ in outcomes:
        if isinstance(n, int):
            pool.update(x for x in (n - 1, n, n + 1) if x >= 0)
    candidates = {f: pool for f in symbolic}

    def holds(sizes: dict[str, int]) -> bool:
        for (field, op, n), outcome in outcomes:
            other = sizes[n] if isinstance(n, str) else n
            if _SIZE_OPS[op](sizes[field], other) != outcome:
                return False
        return True

    for values in itertools.product(*(sorted(candidates[f]) for f in symbolic)):
        sizes = dict(zip(symbolic, values))
        if holds(sizes):
            return sizes
    raise RuntimeError(f"opdispatch::attention: no sizes satisfy the guarded predicates {outcomes}; "
                       "this is a bug in opdispatch.compile._compile, please report it with the call's shapes")


def _shape(recipe: tuple[Any, ...] | None, sizes: dict[str, int]) -> tuple[int, ...] | None:
    return None if recipe is None else tuple(sizes[d] if isinstance(d, str) else d for d in recipe)


def _meta(key: tuple[Any, ...] | None, sizes: dict[str, int]) -> Tensor | None:
    if key is None:
        return None
    recipe, dtype, _device, grad = key
    t = torch.empty(_shape(recipe, sizes), dtype=dtype, device="meta")  # type: ignore[arg-type]
    return t.requires_grad_(grad) if (grad and dtype.is_floating_point) else t


class _TraceContext(NamedTuple):
    """What a trace decided under, beyond sizes: the kernel re-decides when the running context differs."""

    overrides: Any  # OVERRIDES and MODULE around the compiled function when it was traced
    module: Optional[str]
    inner: tuple[Any, ...]  # scope()/policy_override() entered inside the traced function (TRACED_SCOPES)
    requires_grad: bool
    impl: Optional[str]
    recheck: bool  # the decision may depend on sizes beyond the guarded predicates: re-check every call


_CONTEXTS: list[_TraceContext] = []  # a token is an index into this list (a plain int in the graph)
_CONTEXT_TOKENS: dict[_TraceContext, int] = {}
_LAST_CHOICE: dict[int, str] = {}  # token -> implementation the latest forward ran (its backward recomputes it)


def _token(context: _TraceContext) -> int:
    token = _CONTEXT_TOKENS.get(context)
    if token is None:
        token = _CONTEXT_TOKENS[context] = len(_CONTEXTS)
        _CONTEXTS.append(context)
    return token


# An exported program outlives this process (torch.export.save/load), so its token cannot be an index into
# _CONTEXTS: it spells the context itself — a marker bit, a hash of the inner scopes/overrides (0: none), whether
# the call was pinned (the pin is then the graph's impl_id) and whether it was differentiated. Contexts without
# inner scopes are therefore rebuilt from the token in any process; others must have been exported (or
# registered by `_export_token`) in this one. Below 2**53: exact as a JSON number in a saved program.
_EXPORT_MARK = 1 << 52
_EXPORTED: dict[int, _TraceContext] = {}


def _as_inner(overrides: tuple[Any, ...], module: Optional[str]) -> tuple[Any, ...]:
    """The overrides and scope active while a program was exported (around or inside the exported function: non-
    strict export sets them for real), as `entered` enters them again, outermost first: the program keeps them."""
    entries: list[tuple[str, Any]] = [
        ("override", (("prefer", o.prefer or None), ("deny", o.deny or None), ("require", o.require or None),
                      ("pin", o.pin), ("op", o.op))) for o in reversed(overrides)]
    if module is not None:
        entries.append(("scope", module))
    return tuple(entries)


def _export_token(inner: tuple[Any, ...], requires_grad: bool, impl: Optional[str]) -> int:
    """The stable token of an exported call's context; its kernel decides every call again (``recheck``)."""
    digest = 0
    if inner:
        digest = 1 + int.from_bytes(hashlib.sha256(repr(inner).encode()).digest()[:8], "big") % ((1 << 48) - 1)
    token = _EXPORT_MARK | digest << 2 | (impl is not None) << 1 | int(requires_grad)
    _EXPORTED[token] = _TraceContext(None, None, inner, requires_grad, impl, True)
    return token


def _context(token: int, impl_id: str) -> _TraceContext:
    """The trace context a graph's token names (an exported program's rebuilt from the token where it can be)."""
    if token < _EXPORT_MARK:
        return _CONTEXTS[token]
    context = _EXPORTED.get(token)
    if context is not None:
        return context
    if token >> 2 & ((1 << 48) - 1):
        raise RuntimeError(f"opdispatch::attention: this exported program was traced with scope()/policy_override() "
                           f"entered inside the exported function (context token {token}), which this process has "
                           "not seen, so the call cannot be decided as it was traced; export the program in this "
                           "process, or enter the scope/override around the call to the loaded program instead")
    return _TraceContext(None, None, (), bool(token & 1), impl_id if token & 2 else None, True)


@constant_result
def decide_for_compile(tensors: tuple[Any, ...], options: tuple[tuple[str, Any], ...], grad_enabled: bool,
                       impl: Optional[str], epoch: int = 0, sizes: tuple[Any, ...] = ((), ()),
                       inner: tuple[Any, ...] = (), exported: bool = False) -> tuple[str, int, bool]:
    """(implementation id, context token, save_lse) for this call; run once per trace (a graph constant).

    `save_lse`: the call is differentiated (and does not return its LSE) and the implementation has its own
    `backward`: the forward then keeps out and LSE, and the backward calls that instead of recomputing.

    `tensors` holds (shape recipe, dtype, device, requires_grad) of q, k, v, alibi_slopes, attn_mask, attn_bias,
    cu_seqlens_q, cu_seqlens_k, seqused_k, block_table (None where absent; cu_seqlens_k is "same" when it is
    cu_seqlens_q); a recipe's entries are ints or the name of a size field. `sizes` is (size fields, predicate
    outcomes), or empty when every shape is exact: the fields take representative values that reproduce every
    outcome, so the decision is a function of exactly what Dynamo guards on. `options` are the remaining keyword
    arguments as sorted (name, value) pairs. `inner` are the scopes and overrides entered inside the traced
    function, outermost first. The call is rebuilt on the meta device (nothing is computed), validated like any
    call in the active scope, and resolved for the tensors' real device under the active overrides. `exported`
    (under torch.export): the choice is provisional — the program's kernel decides every call on its real sizes,
    in the context it then runs in, and the token survives torch.export.save/load (`_export_token`).
    """
    if not exported:
        return _decide(tensors, options, grad_enabled, impl, epoch, sizes, inner, exported)
    # Non-strict export runs this as plain Python under its tracing modes: the meta tensors of the decision
    # must not become nodes of the exported graph.
    with _untraced():
        return _decide(tensors, options, grad_enabled, impl, epoch, sizes, inner, exported)


def _decide(tensors: tuple[Any, ...], options: tuple[tuple[str, Any], ...], grad_enabled: bool,
            impl: Optional[str], epoch: int, sizes: tuple[Any, ...], inner: tuple[Any, ...],
            exported: bool) -> tuple[str, int, bool]:
    symbolic, outcomes = sizes
    values = _representative(tuple(symbolic), tuple(outcomes)) if symbolic else {}
    values.setdefault("tokens_q", values.get("batch", 1) * values.get("seqlen_q", 1))
    values.setdefault("tokens_k", values.get("batch", 1) * values.get("seqlen_k", 1))
    values["batch+1"] = values.get("batch", 0) + 1  # cu_seqlens hold batch + 1 offsets
    names = ("q", "k", "v", "alibi_slopes", "attn_mask", "attn_bias", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
             "block_table")
    same_cu = tensors[7] == "same"
    kwargs: dict[str, Any] = {name: _meta(key, values) for name, key in zip(names, tensors) if name != "cu_seqlens_k"}
    kwargs["cu_seqlens_k"] = kwargs["cu_seqlens_q"] if same_cu else _meta(tensors[7], values)
    kwargs.update(dict(options))
    sinks = kwargs.get("sinks")
    if sinks is not None:  # (heads, requires_grad): decided as the call with sinks, run without (the epilogue's)
        kwargs["sinks"] = torch.empty((sinks[0],), dtype=torch.float32, device="meta").requires_grad_(sinks[1])
    if symbolic and kwargs.get("layout") == "thd":
        kwargs["max_seqlen_q"], kwargs["max_seqlen_k"] = values["seqlen_q"], values["seqlen_k"]
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    outer = (OVERRIDES.get(), MODULE.get())
    with torch.set_grad_enabled(grad_enabled), entered(inner):
        call = validate_attention(q, k, v, check_values=False, module=MODULE.get(), **kwargs)
        manager = get_manager()
        device = manager.device_info(torch.device(tensors[0][2]))
        decision = manager.resolve(_OP, call, device=device, impl=impl)
    assert decision.chosen_id is not None
    _unused, unlisted = size_predicates(tensors[0][2], epoch)
    if exported:
        token = _export_token(_as_inner(*outer) + tuple(inner), bool(call.requires_grad), impl)
    else:
        token = _token(_TraceContext(outer[0], outer[1], tuple(inner), bool(call.requires_grad), impl, unlisted))
    save_lse = bool(call.requires_grad and not call.return_lse and call.sinks is None
                    and _impl(decision.chosen_id).saves_for_backward)
    return decision.chosen_id, token, save_lse


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """No torch-function or dispatch mode active (non-strict export's tracers): plain Python on meta tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def _runtime_choice(token: int, impl_id: str, call: Any) -> str:
    """The implementation for this run: the traced one, unless the overrides or scope now active differ from
    the trace's (or the decision may read more of the sizes than the graph guards); then decide again."""
    context = _context(token, impl_id)
    if context.recheck or OVERRIDES.get() != context.overrides or MODULE.get() != context.module:
        with entered(context.inner):
            call.module = MODULE.get()
            call.requires_grad = context.requires_grad  # compiled forwards run without autograd; the trace knew
            if token >= _EXPORT_MARK and not call.requires_grad:
                # An exported program traced without gradients, run (ep.module()) on tensors that need them: the
                # kernel sees them as given, with grad mode off below autograd.
                call.requires_grad = any(t is not None and t.requires_grad
                                         for t in (call.q, call.k, call.v, call.attn_bias))
            chosen = get_manager().resolve(_OP, call, impl=context.impl).chosen_id
            assert chosen is not None  # resolve raises when nothing fits
            impl_id = chosen
    _LAST_CHOICE[token] = impl_id
    return impl_id


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
    shape: tuple[Any, ...]
    if layout == "thd":
        shape = (q.shape[1], q.shape[0])
    else:
        b_at, s_at, h_at, _ = LAYOUT_DIMS[layout]
        shape = (q.shape[b_at], q.shape[h_at], q.shape[s_at])
    return out, q.new_empty(shape, dtype=lse_dtype)


# -- the custom ops' arguments, derived from the op's one argument definition (ATTENTION_ARGS) -----------------

# The graph holds plain values: the window as two ints ((-1, -1) = none), the scale resolved, and instead of the
# pin the trace's choice (impl_id), its context token and whether the forward keeps out/LSE for the chosen
# implementation's own backward. Every other argument passes through as the definition declares it.
_LOWERED = {"window": ("SymInt window_left", "SymInt window_right"), "scale": ("float scale",),
            "impl": ("str impl_id", "SymInt token", "bool save_lse")}
# Outside the op: sinks are the shared epilogue's (`opdispatch.ops._sinks`), traced as torch ops around the op, which
# runs the call without them and with its LSE.
_EPILOGUE_ARGS = ("sinks",)
# Not in the graph: FP8 calls (descales, an output dtype of their own) run eagerly; `attention_for_compile` refuses
# them (an output dtype equal to q's, the only one other calls take, is no argument at all).
_EAGER_ONLY_ARGS = ("q_descale", "k_descale", "v_descale", "out_dtype", "out_scale", "out_amax")
_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "str": "str", "bool": "bool",
                 "float": "float", "int | None": "SymInt?"}


def _lowered_arguments() -> tuple[list[str], list[str]]:
    """(tensor, scalar) arguments of ``opdispatch::attention`` as schema entries ("Tensor? attn_mask"), tensors
    first (autograd saves them), in the definition's order."""
    from ..ops._attention import ATTENTION_ARGS

    tensors: list[str] = []
    scalars: list[str] = []
    for arg in ATTENTION_ARGS.args:
        if arg.name in _EPILOGUE_ARGS or arg.name in _EAGER_ONLY_ARGS:
            continue
        if arg.name in _LOWERED:
            scalars.extend(_LOWERED[arg.name])
            continue
        kind = _SCHEMA_TYPES.get(arg.annotation)
        if kind is None:
            raise TypeError(f"opdispatch::attention: argument {arg.name!r} of type {arg.annotation!r} has no schema "
                            f"type; known: {sorted(_SCHEMA_TYPES)} (or lower it in _LOWERED)")
        (tensors if kind.startswith("Tensor") else scalars).append(f"{kind} {arg.name}")
    return tensors, scalars


_TENSOR_SCHEMA, _SCALAR_SCHEMA = _lowered_arguments()
_TENSOR_ARGS = tuple(entry.split()[1] for entry in _TENSOR_SCHEMA)
_SCALAR_ARGS = tuple(entry.split()[1] for entry in _SCALAR_SCHEMA)
_OP_ARGS = _TENSOR_ARGS + _SCALAR_ARGS
_BIAS = _TENSOR_ARGS.index("attn_bias")


def _named(args: tuple[Any, ...], offset: int = 0) -> dict[str, Any]:
    """The op's arguments by name (the backward's start after `offset` arguments of its own)."""
    return dict(zip(_OP_ARGS, args[offset:offset + len(_OP_ARGS)]))


def _rebuild_call(a: dict[str, Any], *, return_lse: bool, **tensors: Tensor) -> Any:
    """The validated call the op's lowered arguments `a` stand for (`tensors` replacing some of them)."""
    from ..ops._attention import ATTENTION_ARGS

    given = {name: a[name] for name in ATTENTION_ARGS.names if name in a}
    given.update(tensors)
    left, right = a["window_left"], a["window_right"]
    given.update(window=None if left == -1 and right == -1 else (left, right), scale=a["scale"],
                 return_lse=return_lse)
    return validate_attention(**given, check_values=False)


def _impl(impl_id: str) -> Any:
    """The implementation the trace chose, as the installed policy configures it."""
    impl = get_manager().implementation(_OP, impl_id)
    if impl is None:
        raise RuntimeError(f"opdispatch::attention: implementation {impl_id!r} was chosen when the graph was "
                           "traced but is not registered in this process; re-trace (torch._dynamo.reset()) "
                           "after changing plugins")
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


@torch.library.custom_op("opdispatch::attention", mutates_args=(),
                         schema=f"({', '.join(_TENSOR_SCHEMA + _SCALAR_SCHEMA)}) -> (Tensor, Tensor)")
def compiled_attention(*args: Any) -> tuple[Tensor, Tensor]:
    """Attention computed by implementation `impl_id`; returns (out, lse), lse of shape (0,) unless return_lse
    or `save_lse` (kept for the implementation's own `backward`, see `decide_for_compile`).

    Arguments (`_OP_ARGS`): the tensors, then the scalars, as `_lowered_arguments` derives them. `token` names
    the trace's context (`_CONTEXTS`): under other overrides or another scope the call is decided again.
    """
    a = _named(args)
    with_lse = a["return_lse"] or a["save_lse"]
    call = _rebuild_call(a, return_lse=with_lse)
    impl_id = _runtime_choice(a["token"], a["impl_id"], call)
    impl = _impl(impl_id)
    with _range(impl_id, call):
        return _split(impl.run(impl.conform(call)), a["q"], a["v"], a["layout"], with_lse)


def _range(impl_id: str, call: Any, part: str = "") -> Any:
    """The profiler range of the op's kernel under torch.compile, named as in eager mode
    (`opdispatch.attention[<implementation>]`, `part` added for the backward): the compiled graph calls this op,
    whose name alone does not say which implementation ran. Nothing while no profiler records."""
    if not profiling():
        return contextlib.nullcontext()
    return call_range(range_name(_OP, impl_id) + part, call.describe())


@compiled_attention.register_fake
def _(*args):  # type: ignore[no-untyped-def]
    a = _named(args)
    return fake_outputs(a["q"], a["v"], a["layout"], a["return_lse"] or a["save_lse"])


def _check_grads(impl_id: str, grads: Any, inputs: tuple[Tensor, Tensor, Tensor]) -> None:
    if not (isinstance(grads, (tuple, list)) and len(grads) == 3 and all(
            isinstance(g, Tensor) and g.shape == x.shape and g.dtype == x.dtype for g, x in zip(grads, inputs))):
        got = [(tuple(g.shape), g.dtype) if isinstance(g, Tensor) else type(g).__name__ for g in grads] \
            if isinstance(grads, (tuple, list)) else type(grads).__name__
        raise RuntimeError(f"{impl_id}.backward must return (dq, dk, dv) with the shapes and dtypes of q, k, v "
                           f"{[(tuple(x.shape), x.dtype) for x in inputs]}; got {got}")


_BACKWARD_HEAD = ["Tensor grad_out", "Tensor? grad_lse", "Tensor out", "Tensor lse"]


@torch.library.custom_op(
    "opdispatch::attention_backward", mutates_args=(),
    schema=f"({', '.join(_BACKWARD_HEAD + _TENSOR_SCHEMA + _SCALAR_SCHEMA)}, bool bias_grad) "
           "-> (Tensor, Tensor, Tensor, Tensor)")
def _attention_backward(*args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias) of implementation `impl_id`'s forward, from (grad_out, grad_lse, out, lse, the
    forward's arguments, bias_grad).

    From the forward's `out` and `lse` through the implementation's own `backward` when the forward saved them
    (`save_lse`) and it covers the call; otherwise by recomputing the forward under autograd. dbias has shape
    (0,) unless `bias_grad`. Opaque to the compiler like the forward. It uses the implementation the latest
    forward of this context token ran (which may differ from `impl_id` when that forward ran under another
    scope or override); the backward itself may run outside that scope.
    """
    grad_out, grad_lse, out, lse = args[:4]
    a = _named(args, 4)
    bias_grad = args[-1]
    q, k, v, attn_bias = a["q"], a["k"], a["v"], a["attn_bias"]
    impl_id = _LAST_CHOICE.get(a["token"], a["impl_id"])
    if a["save_lse"] and not bias_grad:
        impl = _impl(impl_id)
        saved = _rebuild_call(a, return_lse=True)
        with _range(impl_id, saved, ".backward"):
            grads = impl.backward(impl.conform(saved), out, lse, grad_out)
        if grads is not None:
            _check_grads(impl_id, grads, (q, k, v))
            return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), q.new_empty((0,))
    return_lse = a["return_lse"]
    with autograd_reenabled():
        leaves = {"q": q.detach().requires_grad_(), "k": k.detach().requires_grad_(),
                  "v": v.detach().requires_grad_()}
        if bias_grad and attn_bias is not None:
            leaves["attn_bias"] = attn_bias.detach().requires_grad_()
        impl = _impl(impl_id)
        call = _rebuild_call(a, return_lse=return_lse, **leaves)
        with _range(impl_id, call, ".backward"):  # the recomputed forward and its gradient
            found = _recomputed_grads(impl, call, leaves, grad_out, grad_lse, return_lse, bias_grad)
    grads_in = [torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(found, leaves.values())]
    if len(grads_in) == 3:
        grads_in.append(q.new_empty((0,)))
    return grads_in[0], grads_in[1], grads_in[2], grads_in[3]


def _recomputed_grads(impl: Any, call: Any, leaves: dict[str, Tensor], grad_out: Tensor, grad_lse: Any,
                      return_lse: bool, bias_grad: bool) -> Any:
    """The backward by recomputing `call`'s forward under autograd (autograd re-enabled by the caller)."""
    result = impl.run(impl.conform(call))
    outputs = [result[0] if return_lse else result]
    grad_outputs = [grad_out]
    if return_lse and grad_lse is not None and grad_lse.numel():
        lse = result[1]
        if not getattr(impl.caps, "lse_grad", False) and call.softcap == 0 and not bias_grad:
            # A kernel's side output (it may require grad and still give none, as in eager mode): the LSE's
            # exact gradient, as OpSpec.result_fix gives it eagerly.
            from ..ops._attention import exact_lse

            lse = exact_lse(impl, call, lse, replace=True)
        if lse.requires_grad:
            outputs.append(lse)
            grad_outputs.append(grad_lse.to(lse.dtype))
    return torch.autograd.grad(outputs, list(leaves.values()), grad_outputs, allow_unused=True)


@_attention_backward.register_fake
def _(*args):  # type: ignore[no-untyped-def]
    a = _named(args, 4)
    q, k, v, attn_bias = a["q"], a["k"], a["v"], a["attn_bias"]
    dbias = torch.empty_like(attn_bias, memory_format=torch.contiguous_format) if (
        args[-1] and attn_bias is not None) else q.new_empty((0,))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dbias)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    tensors = inputs[:len(_TENSOR_ARGS)]
    out, lse = output
    # out and lse only when the implementation's backward reads them (save_lse); else nothing beyond the inputs.
    ctx.save_for_backward(*tensors, *((out, lse) if inputs[-1] else ()))
    ctx.scalars = inputs[len(_TENSOR_ARGS):]
    # An output no loss reached comes as None, not zeros: an unused LSE costs the backward nothing.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    tensors = saved[:len(_TENSOR_ARGS)]
    if grad_out is None:  # only the LSE reached the loss
        q, v = tensors[0], tensors[2]
        grad_out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    out, lse = saved[len(_TENSOR_ARGS):] or (grad_out.new_empty((0,)), grad_out.new_empty((0,)))
    bias_grad = bool(ctx.needs_input_grad[_BIAS])
    dq, dk, dv, dbias = torch.ops.opdispatch.attention_backward(grad_out, grad_lse, out, lse, *tensors,
                                                                *ctx.scalars, bias_grad)
    grads: list[Any] = [None] * len(_TENSOR_ARGS)
    grads[:3] = dq, dk, dv
    grads[_BIAS] = dbias if bias_grad else None
    return (*grads, *([None] * len(_SCALAR_ARGS)))


compiled_attention.register_autograd(_backward, setup_context=_setup_context)


# -- the entry point ---------------------------------------------------------------------------------------

# Where batch, sequence and heads sit in each dense layout; every dim but batch and sequence is specialised.
_DENSE_DIMS = {layout: dims[:3] for layout, dims in LAYOUT_DIMS.items()}  # (batch, seq, heads)


def _static(n: Any) -> Any:
    """`n` as a plain int: a symbolic size is specialised (Dynamo guards on its exact value)."""
    return None if n is None else operator.index(n)  # int() would stay symbolic inside Dynamo


def _recipe(t: Tensor, fields: dict[int, str]) -> tuple[Any, ...]:
    """t's shape with the dims in `fields` named by their size field and every other dim specialised."""
    return tuple(fields[i] if i in fields else _static(n) for i, n in enumerate(t.shape))


def _broadcast_recipe(t: Tensor, sizes: dict[str, Any], targets: tuple[Any, ...],
                      exporting: bool = False) -> tuple[Any, ...] | None:
    """A mask/bias/alibi shape right-aligned to `targets` (field names or ints): 1 or the target per dim; None
    if a dim is neither (the exact path then raises validation's own error). Under export nothing is guarded (an
    unbacked size cannot be compared; non-strict export gives each input its own symbols): a dim not known to
    be 1 or to differ from the target is taken as the target's, which the kernel validates on every call's real
    sizes."""
    shape = tuple(t.shape)
    if len(shape) > len(targets):
        return None
    holds = statically_known_true if exporting else _truth
    out: list[Any] = []
    for n, target in zip(shape, targets[len(targets) - len(shape):]):
        if isinstance(target, str):
            if holds(n == 1):
                out.append(1)
            elif holds(n == sizes[target]) or (exporting and not statically_known_true(n != sizes[target])):
                out.append(target)
            else:
                return None
        else:
            out.append(_static(n))
    return tuple(out)


def _float_class(x: Any) -> Any:
    """A float option as the decision sees it: Dynamo may trace floats as symbolic, and only their side of
    0 and 1 matters to selection and validation (the kernel validates the exact value again when it runs)."""
    if x is None or not torch.compiler.is_compiling() or not isinstance(x, (int, float)):
        return x
    if x == 0:
        return 0.0
    if x < 0:
        return -1.0
    return 0.5 if x < 1 else 1.0


def _tensor_key(t: Tensor | None, recipe: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """What a decision may read from a tensor: shape recipe, dtype, device, requires_grad (constant in a graph)."""
    if t is None:
        return None
    return (recipe, t.dtype, str(t.device), bool(t.requires_grad))


def _truth(predicate: Any) -> bool:
    """A (possibly symbolic) predicate as a plain bool; Dynamo guards on the branch taken (``bool()`` of a
    symbolic predicate would stay symbolic inside Dynamo and could not reach an assume_constant_result)."""
    return True if predicate else False


_NEGATED = {">=": "<", "<=": ">", ">": "<=", "<": ">=", "==": "!=", "!=": "=="}


def statically_known_true(predicate: Any) -> bool:
    """torch's own (imported when used: sympy costs ~0.3 s of the import of this module otherwise)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return bool(known(predicate))


def _export_outcome(op: str, n: Any, left: Any, right: Any) -> Optional[bool]:
    """A size predicate's outcome under torch.export without a guard: what the shape environment knows (the
    exported program must hold for every size its dynamic dims allow, unbacked ones included), else the general
    case for ``== 0``/``== 1`` (an empty or one-row call is decided again at run time), else None (no
    constraint). The choice made on it is provisional: the kernel re-decides every call on the real sizes."""
    if statically_known_true(_SIZE_OPS[op](left, right)):
        return True
    if statically_known_true(_SIZE_OPS[_NEGATED[op]](left, right)):
        return False
    return False if op == "==" and n in (0, 1) else None


def _size_class(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None, attn_mask: Tensor | None,
                attn_bias: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                seqused_k: Tensor | None, block_table: Tensor | None, layout: str,
                max_seqlen_q: Any, max_seqlen_k: Any,
                exporting: bool = False) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
    """(tensor keys, sizes, (max_seqlen_q, max_seqlen_k)) for `decide_for_compile`, traced by Dynamo.

    Batch and sequence lengths may be symbolic: they enter the decision only through the outcomes of
    `size_predicates`, each evaluated with ``_truth()`` so that Dynamo guards on exactly that predicate. Calls
    whose sizes are inconsistent (validation would reject them) are specialised so the error names real sizes.
    KV-cache calls (seqused_k, block_table) are specialised: one graph per cache shape.

    Under torch.export (`exporting`) nothing here guards on a size: the program must run at every size its
    dynamic dims allow (unbacked sizes included), so consistency is assumed unless known false (the kernel
    validates the real sizes), predicates take only the outcomes the shape environment knows
    (`_export_outcome`), and the kernel decides every call again (`decide_for_compile`'s `exported`).
    """

    def same(a: Any, b: Any) -> bool:
        return not statically_known_true(a != b) if exporting else _truth(a == b)

    tensors = (q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    field_sizes: dict[str, Any] = {}
    recipes: list[Any] = []
    consistent = True
    if seqused_k is not None or block_table is not None:
        consistent = False
    elif layout == "thd" and cu_seqlens_q is not None and max_seqlen_q is not None and max_seqlen_k is not None \
            and q.dim() == 3 and k.dim() == 3 and v.dim() == 3:
        field_sizes = {"batch": cu_seqlens_q.shape[0] - 1, "seqlen_q": max_seqlen_q, "seqlen_k": max_seqlen_k}
        consistent = same(v.shape[0], k.shape[0]) and (cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
                                                       or same(cu_seqlens_k.shape[0], cu_seqlens_q.shape[0]))
        cu_recipe = ("batch+1",)
        recipes = [_recipe(q, {0: "tokens_q"}), _recipe(k, {0: "tokens_k"}), _recipe(v, {0: "tokens_k"}),
                   None, None, None, cu_recipe, "same" if cu_seqlens_k is cu_seqlens_q else cu_recipe, None, None]
        consistent = consistent and alibi_slopes is None and attn_mask is None and attn_bias is None
    elif layout in _DENSE_DIMS and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and cu_seqlens_q is None \
            and cu_seqlens_k is None:
        b, s, h = _DENSE_DIMS[layout]
        field_sizes = {"batch": q.shape[b], "seqlen_q": q.shape[s], "seqlen_k": k.shape[s]}
        consistent = same(k.shape[b], q.shape[b]) and same(v.shape[b], q.shape[b]) and same(v.shape[s], k.shape[s])
        full = ("batch", _static(q.shape[h]), "seqlen_q", "seqlen_k")
        recipes = [_recipe(q, {b: "batch", s: "seqlen_q"}), _recipe(k, {b: "batch", s: "seqlen_k"}),
                   _recipe(v, {b: "batch", s: "seqlen_k"})]
        for t, targets in ((alibi_slopes, full[:2]), (attn_mask, full), (attn_bias, full)):
            recipe = None if t is None else _broadcast_recipe(t, field_sizes, targets, exporting)
            consistent = consistent and (t is None or recipe is not None)
            recipes.append(recipe)
        recipes += [None, None, None, None]
    else:
        consistent = False
    # Dynamo cannot tell a symbolic size from a constant in traced code (isinstance says int), so every field
    # goes through the predicates; on constants they are plain Python and add no guard.
    symbolic = _FIELDS
    if not consistent:
        # Exact: every size a constant (specialised where symbolic); validation sees the real shapes.
        keys: tuple[Any, ...] = tuple(_tensor_key(t, None if t is None else tuple(_static(n) for n in t.shape))
                                      for t in tensors)
        if cu_seqlens_k is not None and cu_seqlens_k is cu_seqlens_q:
            keys = keys[:7] + ("same",) + keys[8:]
        return keys, ((), ()), (_static(max_seqlen_q), _static(max_seqlen_k))
    atoms, _unlisted = size_predicates(str(q.device), DECISION_EPOCH)
    outcomes = []
    for atom in atoms:
        field, op, n = atom
        if field in symbolic or n in symbolic:
            other = field_sizes[n] if isinstance(n, str) else n
            if not exporting:
                outcomes.append((atom, _truth(_SIZE_OPS[op](field_sizes[field], other))))
            elif (outcome := _export_outcome(op, n, field_sizes[field], other)) is not None:
                outcomes.append((atom, outcome))
    keys = tuple(_tensor_key(t, r if isinstance(r, tuple) else None) for t, r in zip(tensors, recipes))
    if recipes[7] == "same":
        keys = keys[:7] + ("same",) + keys[8:]
    return keys, (symbolic, tuple(outcomes)), (max_seqlen_q, max_seqlen_k)


def attention_for_compile(
    q: Tensor, k: Tensor, v: Tensor, *, layout: str = "bshd", causal: bool = False,
    causal_alignment: str = "top_left", window: tuple[int, int] | None = None, scale: float | None = None,
    dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    attn_mask: Tensor | None = None, attn_bias: Tensor | None = None, sinks: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None, seqused_k: Tensor | None = None, block_table: Tensor | None = None,
    q_descale: Tensor | None = None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    out_dtype: torch.dtype | None = None, out_scale: Tensor | None = None, out_amax: Tensor | None = None,
    return_lse: bool = False, deterministic: bool = False, impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`opdispatch.attention` as one graph node: decided at trace time, traced without a graph break.

    Same arguments and results as `opdispatch.attention`. Validation and the decision run once per trace on
    meta tensors (errors are the same as in eager mode); the graph keeps only ``opdispatch::attention``.
    """
    if q_descale is not None or k_descale is not None or v_descale is not None or out_scale is not None or (
            out_amax is not None) or (out_dtype is not None and out_dtype != q.dtype):
        raise ValueError("attention() under torch.compile does not take FP8 calls (q_descale, k_descale, v_descale, "
                         "out_scale, out_amax, an out_dtype other than q's): run this call eagerly "
                         "(torch.compiler.disable around it)")
    if layout == "thd" and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("attention() under torch.compile with layout='thd' needs max_seqlen_q and max_seqlen_k: "
                         "computing them from cu_seqlens is a data-dependent host sync; pass the longest "
                         "sequence lengths (an upper bound is fine)")
    grad_enabled = torch.is_grad_enabled()
    sink_key = None
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1:
            raise ValueError(f"attention(): sinks must be a float32 (heads_q,) tensor, got "
                             f"{tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__}")
        if sinks.dtype != torch.float32 or sinks.device != q.device:
            raise TypeError(f"attention(): sinks must be float32 on q's device ({q.device}), got {sinks.dtype} on "
                            f"{sinks.device}; use .float().to(q.device)")
        sink_key = (_static(sinks.shape[0]), bool(sinks.requires_grad))
    if dropout_p and grad_enabled and any(t is not None and t.requires_grad for t in (q, k, v, attn_bias)):
        raise ValueError("attention() under torch.compile does not support dropout_p > 0 with autograd: the "
                         "backward recomputes the forward, which would draw a different dropout mask; use "
                         "dropout_p=0.0 or run this call eagerly")
    exporting = torch.compiler.is_exporting()
    keys, sizes, (static_max_q, static_max_k) = _size_class(
        q, k, v, alibi_slopes, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, layout,
        max_seqlen_q, max_seqlen_k, exporting)
    symbolic_max = bool(sizes[0]) and layout == "thd"
    options = (("causal", causal), ("causal_alignment", causal_alignment), ("deterministic", deterministic),
               ("dropout_p", _float_class(dropout_p)), ("layout", layout),
               ("max_seqlen_k", None if symbolic_max else static_max_k),
               ("max_seqlen_q", None if symbolic_max else static_max_q), ("return_lse", return_lse),
               ("scale", _float_class(scale)), ("sinks", sink_key), ("softcap", _float_class(softcap)),
               # the window is exact in every decision class: a symbolic bound is specialised
               ("window", tuple(_static(w) if isinstance(w, int) and not isinstance(w, bool) else w for w in window)
                if isinstance(window, (tuple, list)) else window))
    impl_id, token, save_lse = decide_for_compile(keys, options, grad_enabled, impl, DECISION_EPOCH, sizes,
                                                  tuple(TRACED_SCOPES), exporting)
    head_dim = _static(q.shape[-1])
    if window is None:
        left, right = -1, -1
    else:
        left, right = int(window[0]), int(window[1])
        if causal:
            right = 0
        if causal and left == -1:
            left, right = -1, -1
    lowered = dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, attn_mask=attn_mask, attn_bias=attn_bias,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                   block_table=block_table, layout=layout, causal=causal,
                   causal_alignment=causal_alignment, window_left=left, window_right=right,
                   scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim), dropout_p=float(dropout_p),
                   softcap=float(softcap), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   return_lse=return_lse or sinks is not None, deterministic=deterministic, impl_id=impl_id,
                   token=token, save_lse=save_lse)
    out, lse = compiled_attention(*(lowered[name] for name in _OP_ARGS))
    if sinks is not None:
        from ..ops._sinks import apply_sinks

        out, lse = apply_sinks(out, lse, sinks, layout)
    return (out, lse) if return_lse else out
