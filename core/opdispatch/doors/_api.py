"""The public entry points: `attention`, `explain`, and the process-wide OpManager behind them."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from ..base._arguments import OpArguments
from ..engine._breaker import RetryDue
from ..ops._attention import LAYOUT_DIMS, ATTENTION_ARGS, AttentionCall, revalidate_sizes, validate_attention
from ..base._decision import Decision
from ..base._device import DeviceInfo, resolve_device
from ..engine._graphs import is_capturing, raise_if_capturing
from ..engine._current import get_manager as get_manager  # also the compat doors' (they read `_api._manager` too)
from ..engine._current import on_manager_change
from ..engine._manager import OpManager, _raise_for_structure
from ..base import _native
from ..base._ops import op_spec
from ..engine._profiling import profiling
from ..ops._sinks import run_with_sinks
from ..engine._state import bounded_put
from opdispatch.policies._overrides import MODULE, OVERRIDES

# The process-wide manager lives in core/opdispatch/engine/_current.py; the front doors read it as this module's
# `_manager` (one global read per call, in Python and in the compiled doors' C), which `_mirror` keeps equal to it.
_manager: OpManager | None = None


def _mirror(manager: OpManager | None) -> None:
    global _manager
    _manager = manager


on_manager_change(_mirror)


_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_overrides = OVERRIDES.get
_module = MODULE.get
_deterministic = torch.are_deterministic_algorithms_enabled
_profiling = profiling


def _attention_for_compile(*args: Any, **kwargs: Any) -> Any:
    from ..compile._compile import attention_for_compile

    return attention_for_compile(*args, **kwargs)


attention = ATTENTION_ARGS.front_door(
    namespace=globals(), compiled="_attention_for_compile", slow="_attention_slow", failed="_attention_failed",
    return_annotation="torch.Tensor | tuple[torch.Tensor, torch.Tensor]", doc="""\
    Scaled dot-product attention, computed by the best implementation the device and the policy allow.

    Layouts: ``bshd`` (default), ``bhsd``, ``sbhd``, and ``thd`` (packed variable-length sequences described
    by int32 ``cu_seqlens_q``/``cu_seqlens_k``). k/v may have fewer heads than q (grouped-query attention).
    ``causal_alignment`` says where the causal diagonal sits when seqlen_q != seqlen_k: ``top_left`` (query i
    sees keys j <= i) or ``bottom_right`` (the last query sees the last key). ``window=(left, right)`` keeps
    keys within that distance of the (aligned) diagonal, -1 meaning unbounded. ``softcap`` applies
    ``softcap * tanh(scores / softcap)``; ``alibi_slopes`` adds ``-slope * |i + offset - j|``; ``attn_mask`` is
    a bool tensor (True = attend); ``attn_bias`` an additive float tensor. ``impl="vendor.name"`` pins one
    implementation for this call (it never falls back). Returns ``out`` in the input layout, or
    ``(out, lse)`` with ``return_lse=True`` (lse: float32 (batch, heads, seqlen_q), or (heads, total_q) for thd).

    The fast path (generated from the op's argument definition, `opdispatch.ops._attention.ATTENTION_ARGS`): a key
    of everything validation and selection read (shapes, dtypes, devices, grad mode, flags, the active
    `scope()`/`policy_override()`, torch's determinism flag) finds the function bound to a kernel for this
    signature; a boolean mask and sinks are keyed by their shape, dtype and device and handed to that function per
    call (their values change: a padded batch's decode, trained sinks); biases, ALiBi and varlen offsets take the
    slow path (validated every call).
    """)


_NAMES = ATTENTION_ARGS.names
_Q, _K, _V, _CAUSAL, _ALIGNMENT, _WINDOW, _MASK, _MAX_K, _SEQUSED, _TABLE, _SINKS, _IMPL = (
    _NAMES.index(n) for n in ("q", "k", "v", "causal", "causal_alignment", "window", "attn_mask", "max_seqlen_k",
                              "seqused_k", "block_table", "sinks", "impl"))


def _attention_slow(manager: OpManager, key: Any, *args: Any) -> Any:
    """Validate, decide, and (for a fast-path `key`) remember the bound function for the next call. `args` are
    the front door's, in the order of the op's argument definition. A call that differs from a remembered one
    only in sizes takes its size-generic template (`_sized_reuse`)."""
    if key is not None and manager.size_generic:
        template = manager.size_generic.get(size_generic_key(key))
        if template is not None:
            out = _sized_reuse(manager, key, template, args[_IMPL], args[_Q], args[_K], args[_V], args[_SEQUSED],
                               args[_TABLE], args[_MAX_K], args[_MASK])
            if out is not _NOT_REUSED:
                return out
    arguments = dict(zip(_NAMES, args))
    impl = arguments.pop("impl")
    q, k, cu_seqlens_q = arguments["q"], arguments["k"], arguments["cu_seqlens_q"]
    varlen_key = _varlen_signature(q, k, cu_seqlens_q, arguments["cu_seqlens_k"], arguments["max_seqlen_q"],
                                   arguments["max_seqlen_k"])
    checked = manager.checked_varlen
    known_same = None if varlen_key is None else checked.get(varlen_key)
    if known_same is None and varlen_key is not None and is_capturing(cu_seqlens_q.device):
        known_same = False  # never a first read inside CUDA graph capture: it would sync
    call = validate_attention(**arguments, module=_module(), check_values=known_same is None,
                              varlen_same=known_same)
    if varlen_key is not None and known_same is None:
        bounded_put(checked, varlen_key, call.cu_seqlens_k is call.cu_seqlens_q)
    if call.sinks is not None:  # the shared epilogue (or a native sink) over the choice
        result = run_with_sinks(manager, call, impl)
        if key is not None:
            _remember_sinks(manager, key, call, impl)
        return result
    if key is None:
        return manager.call("attention", call, impl=impl)
    generic = None if call.varlen else (arguments["causal"], arguments["causal_alignment"], arguments["window"])
    return _run_and_remember(manager, "attention", key, call, impl, ATTENTION_ARGS.bound_tensors(arguments),
                             generic)


# -- size-generic reuse ------------------------------------------------------------------------------------------
#
# The per-call fast path is keyed by exact shapes, so a decode loop over a growing cache, or a new batch size, is
# a new signature at every step. Such a call differs from one already run only in its sizes: the fast-path key
# with every shape reduced to its rank and last dim (`size_generic_key`) finds that call's template, and
# `_sized_reuse` re-derives what sizes change (`revalidate_sizes`: the steps of validation that read sizes), asks
# the decision cache for the call's class (its policy thresholds, caps limits and selection keys: `resolve`) and,
# where that is the template's very decision and its bound function is declared size-generic (`size_generic`),
# runs that function; else it binds afresh. Either way the exact key is remembered, so the next call of this
# signature hits. Dense calls only (no sinks, varlen, ALiBi or bias: those never key or keep a template).

_SIZE = torch.Size
_TENSOR = torch.Tensor
_NOT_REUSED: Any = object()


def _shape_positions(arguments: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Where the fast-path key of `arguments`' front door (`OpArguments._key_expression`, in its order) holds a
    tensor's shape, and where an optional tensor's or an index's (shape, ...) tuple or None, and the key's length:
    read from the definition, so a size-generic key reduces those positions only instead of testing every item."""
    tensors: list[int] = []
    optional: list[int] = []
    at = 1  # after the op's name
    for kind in arguments.native_kinds():
        if kind in ("tensor", "strided"):
            tensors.append(at)
        elif kind in ("tensor?", "index"):
            optional.append(at)
        at += _KEY_ITEMS[kind]  # a kind added to the key expression and not here fails at import
    grads = 1 if tensors or optional else 0
    return tuple(tensors), tuple(optional), at + grads + len(arguments.context)


# How many items each argument kind puts in the key (`OpArguments._key_expression`): a value with its class, a
# tensor with its dtype and device (and innermost stride); bypass arguments (varlen offsets, biases) none.
_KEY_ITEMS = {"tensor": 3, "strided": 4, "tensor?": 1, "index": 1, "int_tuple": 1, "str": 1, "value": 2,
              "bypass": 0}


_SHAPES_AT, _OPTIONAL_SHAPES_AT, _KEY_LENGTH = _shape_positions(ATTENTION_ARGS)


def size_generic_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """`key` (a front door's fast-path key) with each shape in it reduced: a tensor's to its rank and last dim
    (the head dim: the default scale reads it), an optional tensor's (a mask) to its rank and broadcast pattern.
    `opdispatch.attention`'s key at the positions its definition gives; any other (compat.sdpa's) item by item."""
    if key[0] != "attention" or len(key) != _KEY_LENGTH:
        return tuple(
            (len(x), x[-1]) if type(x) is _SIZE
            else ((len(x[0]), tuple(n == 1 for n in x[0])), *x[1:]) if type(x) is tuple and x and type(x[0]) is _SIZE
            else x
            for x in key)
    reduced = list(key)
    for i in _SHAPES_AT:
        shape = key[i]
        reduced[i] = (len(shape), shape[-1])
    for i in _OPTIONAL_SHAPES_AT:
        given = key[i]
        if type(given) is tuple and type(given[0]) is _SIZE:  # else None, or an int index
            shape = given[0]
            reduced[i] = ((len(shape), tuple(n == 1 for n in shape)), *given[1:])
    return tuple(reduced)


class SizeTemplate:
    """A validated dense call (without its tensors) as given (`causal`, `causal_alignment`, `window`, which
    validation canonicalizes by sizes), with its decision and the function bound to it."""

    __slots__ = ("call", "given", "causal", "causal_alignment", "window", "decision", "fn", "signature")

    def __init__(self, call: AttentionCall, given: tuple[Any, Any, Any], fn: Any) -> None:
        self.call = call.stripped()
        self.given = given
        self.causal, self.causal_alignment, self.window = given
        self.decision, self.fn, self.signature = fn.decision, fn, fn.signature


def _sized_reuse(manager: OpManager, key: Any, template: SizeTemplate, impl: Any, q: Any, k: Any, v: Any,
                 seqused_k: Any, block_table: Any, max_seqlen_k: Any, attn_mask: Any) -> Any:
    """Run a call that differs from `template`'s only in sizes, remembering it under `key`; `_NOT_REUSED` where
    the sizes do not validate (the full path then raises validation's own error)."""
    try:
        call = revalidate_sizes(template.call, template.causal, template.causal_alignment, template.window, q, k, v,
                                seqused_k, block_table, max_seqlen_k, attn_mask)
    except Exception:
        return _NOT_REUSED
    tensors: tuple[Any, ...] = (q, k, v)
    if seqused_k is not None or block_table is not None or attn_mask is not None:
        tensors += (seqused_k, block_table, attn_mask, None)
    given = template.given
    decision = manager.resolve("attention", call, impl=impl)  # the class's decision: thresholds, limits, demotions
    fn = template.fn
    if decision is not template.decision or not fn.size_generic:
        return _run_and_remember(manager, "attention", key, call, impl, tensors, given)
    raise_if_capturing("attention", call)
    try:
        out = fn(*tensors)
        shape = out.shape if type(out) is _TENSOR else None
        if not (shape is not None and not call.return_lse and shape[:-1] == q.shape[:-1]
                and shape[-1] == call.head_dim_v and out.dtype == call.dtype and out.device == call.device):
            _raise_for_structure("attention", decision.chosen_id, call, out)  # the full check: a tuple, or wrong
    except Exception:
        # What a failure means (fail over, demote for this signature, or raise) is the reference path's to say: it
        # binds afresh and runs the call again.
        return _run_and_remember(manager, "attention", key, call, impl, tensors, given)
    if decision.policy_hash == manager.policy.hash:
        bounded_put(manager.fast, key, fn)
    manager.usage.called(decision, reference_counted=True)
    return out


# -- the compiled door's size-generic entries ---------------------------------------------------------------------
#
# `_sized_reuse` in C: on an exact-signature miss the compiled front door reduces its key as `size_generic_key`
# does and finds an entry this hook made from the template: the bound function, the sizes of the template's
# decision class as constraints on the tensors' sizes, and the dicts whose change may change what `_sized_reuse`
# would do (the decision cache, the templates, the breaker's demotions: while none changed, a call inside the
# constraints revalidates to the template's class and resolves to its very decision). It then runs the function
# and checks its output as `_sized_reuse` does; anything else (outside the box, a watched dict changed, a raise, a
# wrong output) goes to this Python path. The constraints, by code (six ints each): 0 `size(slot a, dim b) in
# [c, d)` (d -1: unbounded); 1 `size(a, b) == size(c, d)`; 2 `size(a, b) == e * size(c, d)`. A boolean mask is
# one more slot: its rank, broadcast pattern (which dims are 1), dtype and device are in the reduced key, and each
# of its dims is constrained to 1 or to the q/k size it lines up with (`_class_constraints`); its values are data.

_RANGE, _EQUAL, _MULTIPLE = 0, 1, 2


def _native_size_entry(*args: Any) -> Any:
    """What the compiled attention door keeps for the size-generic key of the call `args` (the front door's, in
    definition order), which the Python path just ran: ``(fn, constraints, head_dim_v, dtype, watched,
    capturing)``, with fn None where no call of other sizes may take the template's function (then nothing
    changes until a watched dict does); None where nothing may be kept."""
    manager = _manager
    if manager is None:
        return None
    key = _attention_key(*args)
    if key is None:
        return None
    if args[_SINKS] is not None:  # a call with sinks never keeps a template (`_remember_sinks`), whatever the state
        return (None, (), 0, None, (), None)
    template = manager.size_generic.get(size_generic_key(key))
    if template is not None and _never_boxed(manager, template):
        # No decision, demotion or template of this state changes that: watch nothing (a new state, which any
        # clear_cache, policy or registry change makes, empties the door's tables).
        return (None, (), 0, None, (), None)
    watched = (manager.state.decisions, manager.size_generic, *manager.breaker.watched())
    constraints = None if template is None else _class_constraints(manager, template, args[_IMPL])
    if template is None or constraints is None:
        return (None, (), 0, None, watched, None)
    call = template.call
    capturing = None if call.device.type == "cpu" else functools.partial(is_capturing, call.device)
    return (template.fn, constraints, call.head_dim_v, call.dtype, watched, capturing)


def _never_boxed(manager: OpManager, template: SizeTemplate) -> bool:
    """Whether no call of `template`'s size-generic key may take a sized entry under this state, whatever is
    decided or demoted later: what its key fixes (layout, LSE, window, sinks, ALiBi, bias) or its op's classes on
    its device (`DecisionClasses.boxable`: a keyed candidate whose selection key declares no cuts, a policy size
    test of unknown form, autotune buckets) rules a box out. A boolean mask does not (its dims are constrained
    like q's and k's). See `_class_constraints`."""
    if _key_rules_out_a_box(template):
        return True
    call = template.call
    classes = manager.state.classes.get("attention")
    keyed = None if classes is None else classes.keyed_on.get(manager.device_info(call.device).key)
    return classes is not None and keyed is not None and not classes.boxable(keyed)


def _key_rules_out_a_box(template: SizeTemplate) -> bool:
    """Whether what `template`'s size-generic key fixes keeps every other size off its function: a layout without
    a dims entry, an LSE, a window, sinks, ALiBi or a bias."""
    call = template.call
    return (call.layout not in LAYOUT_DIMS or call.return_lse or template.window is not None
            or call.sinks is not None or call.alibi_slopes is not None or call.attn_bias is not None)


def _class_constraints(manager: OpManager, template: SizeTemplate, impl: Any) -> tuple[int, ...] | None:
    """The sizes of q, k and v (as constraints: see above) for which `_sized_reuse` of `template` revalidates
    (`_revalidate_dense_sizes`) to a call of the template's class — its `class_key` (the canonical causal flag
    and alignment, equal lengths, keyless rows, GQA ratio, a mask's broadcast pattern) and its size tests
    (`DecisionClasses.size_box`) — and resolves to the template's decision, which it runs; None where that is
    not so for all of them or cannot be said by such constraints (the Python path then decides each new
    signature). A boolean mask (a padded batch's decode or prefill) adds its own dims: each is 1 where the
    template's is (it broadcasts) and else equals the size it lines up with in (batch, heads_q, seqlen_q,
    seqlen_k), so the mask validates and keeps the template's broadcast pattern."""
    call, decision = template.call, template.decision
    if (not getattr(template.fn, "size_generic", False) or _key_rules_out_a_box(template)
            or decision.retry_at is not None or manager.agreement is not None or manager.breaker
            or decision.policy_hash != manager.policy.hash):
        return None
    if manager.cached_decision("attention", call, impl=impl) is not decision:
        return None
    classes = manager.state.classes.get("attention")
    keyed = None if classes is None else classes.keyed_on.get(manager.device_info(call.device).key)
    box = None if classes is None or keyed is None else classes.size_box(call, keyed)
    if box is None:
        return None
    b_at, s_at, h_at, _ = LAYOUT_DIMS[call.layout]
    seqlen_q, seqlen_k = call.seqlen_q, call.seqlen_k
    ranges = {(_Q, b_at): box["batch"], (_Q, s_at): box["seqlen_q"], (_K, s_at): box["seqlen_k"],
              (_Q, h_at): box["heads_q"], (_K, h_at): box["heads_kv"]}

    def narrow(at: tuple[int, int], low: int, high: int | None) -> None:
        old_low, old_high = ranges[at]
        ranges[at] = (max(old_low, low), high if old_high is None else old_high if high is None
                      else min(old_high, high))

    # One query or more (canonicalization drops a bottom-right causal mask for one query).
    narrow((_Q, s_at), *((1, 2) if seqlen_q == 1 else (2, None)))
    constraints = [_EQUAL, _K, b_at, _Q, b_at, 0, _EQUAL, _V, b_at, _Q, b_at, 0,  # validation's own agreements
                   _EQUAL, _V, s_at, _K, s_at, 0, _EQUAL, _V, h_at, _K, h_at, 0,
                   _MULTIPLE, _Q, h_at, _K, h_at, call.heads_q // call.heads_kv]  # the GQA ratio kept
    # Equal lengths stay equal; unequal ones keep their order (which decides alignment and keyless rows).
    if seqlen_q == seqlen_k:
        constraints += [_EQUAL, _Q, s_at, _K, s_at, 0]
    elif seqlen_q < seqlen_k:
        narrow((_Q, s_at), 1, seqlen_q + 1)
        narrow((_K, s_at), seqlen_q + 1, None)
    else:
        narrow((_K, s_at), 1, seqlen_k + 1)
        narrow((_Q, s_at), seqlen_k + 1, None)
    mask = call.attn_mask
    if mask is not None:  # a bool tensor of rank <= 4 that broadcasts to the scores: validation said so
        scores = ((_Q, b_at), (_Q, h_at), (_Q, s_at), (_K, s_at))  # (batch, heads_q, seqlen_q, seqlen_k)
        rank = mask.dim()
        for dim, size in enumerate(mask.shape):  # aligned to the scores' trailing dims, as broadcasting does
            constraints += ([_RANGE, _MASK, dim, 1, 2, 0] if size == 1
                            else [_EQUAL, _MASK, dim, *scores[len(scores) - rank + dim], 0])
    for (slot, dim), (low, high) in ranges.items():
        if high is not None and high <= low:
            return None
        constraints += [_RANGE, slot, dim, low, -1 if high is None else high, 0]
    return tuple(constraints)


def _remember_sinks(manager: OpManager, key: Any, call: Any, impl: str | None) -> None:
    """Remember, under the fast-path `key`, a function that runs later calls of this signature with sinks without
    validating them again: the front door passes (q, k, v, seqused_k, block_table, attn_mask, sinks) of each call.
    `run_with_sinks` decides its class (a cached decision) and fails over itself; the function carries what the
    breaker and invalidation read (`decision`, `signature`, `described`)."""
    decision = manager.resolve("attention", call, impl=impl)
    if decision.policy_hash != manager.policy.hash:
        return
    template = call.stripped()

    def with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *optional: torch.Tensor | None) -> Any:
        return run_with_sinks(manager, template.with_tensors(q, k, v, *optional), impl)

    with_sinks.decision = decision  # type: ignore[attr-defined]
    with_sinks.signature = call.signature()  # type: ignore[attr-defined]
    with_sinks.described = call.describe()  # type: ignore[attr-defined]
    bounded_put(manager.fast, key, with_sinks)


def _fast_path_failed(manager: OpManager, key: Any, fn: Any, exc: Exception, slow: Callable[..., Any],
                      args: tuple[Any, ...]) -> Any:
    """The kernel bound to a fast-path hit raised `exc`. With settings.fallback_on_error (and no pin), demote it
    for its signature (or its class: see opdispatch.engine._breaker) and run the call again through `slow`, which
    decides it again (the next implementation takes it); a due retry (RetryDue) only decides again. Otherwise
    `exc` goes to the caller. A size-generic function serves signatures of several sizes, its `signature` being
    the first one's: the slow path runs the call again and demotes for the call's own signature."""
    if isinstance(exc, RetryDue):
        manager.fast.pop(key, None)
    elif not manager.may_fail_over(fn.decision, None, exc, args[0].device):
        raise exc
    elif getattr(fn, "size_generic", False):
        manager.fast.pop(key, None)
    else:
        manager.fail_over(fn.decision, exc, bound=fn)  # the failing signature: see opdispatch.engine._breaker
    return slow(manager, key, *args)


def _varlen_signature(q: Any, k: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                      max_seqlen_k: Any) -> Any:
    """For packed varlen inputs on an accelerator: the signature whose cu_seqlens values were already checked.

    Checking the values reads them back to the host — a sync per call that would stall the GPU (and is illegal
    inside CUDA graph capture) — so on accelerators they are checked the first time a signature is seen and
    trusted after that, as the vendor kernels themselves do; so is whether distinct cu_seqlens_q/cu_seqlens_k
    tensors hold equal values (self-attention). CPU cu_seqlens are checked on every call.
    """
    if cu_seqlens_q is None or max_seqlen_q is None or max_seqlen_k is None:
        return None
    device = getattr(cu_seqlens_q, "device", None)
    if device is None or device.type == "cpu":
        return None
    return (q.shape, k.shape, cu_seqlens_q.shape, max_seqlen_q, max_seqlen_k, device, cu_seqlens_q is cu_seqlens_k)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str | None = None,
         **kwargs: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]:
    """Validate and decide once; return `fn(q, k, v)` bound to the chosen kernel, with no lookup per call.

    The caller promises that later q/k/v have the same shapes, dtype and device (the plan does not re-check
    them; `opdispatch.Attention` re-plans when they change). ``fn.decision`` is the Decision.
    """
    call = validate_attention(q, k, v, module=_module(), **kwargs)
    manager = get_manager()
    if call.sinks is not None:
        return _plan_with_sinks(manager, call, impl)
    return manager.bind("attention", call, impl=impl)  # type: ignore[no-any-return]


def _plan_with_sinks(manager: OpManager, call: Any, impl: str | None) -> Callable[..., Any]:
    """A plan for a call with sinks: the shared epilogue over the decided implementation, per call (it keeps the
    sinks tensor — a parameter — and no q/k/v)."""
    template = call.stripped()

    def with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache: torch.Tensor | None) -> Any:
        # `cache`: a KV-cache plan's seqused_k/block_table of this step, as every bound function takes them
        return run_with_sinks(manager, template.with_tensors(q, k, v, *cache), impl)

    with_sinks.decision = manager.resolve("attention", call, impl=impl)  # type: ignore[attr-defined]
    return with_sinks


plan.__signature__ = ATTENTION_ARGS.signature(  # type: ignore[attr-defined]
    return_annotation="Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]")
plan.__opdispatch_arguments__ = ATTENTION_ARGS  # type: ignore[attr-defined]  # the typing stub's source


def plan_op(op: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """`plan` for any registered op: validate ``opdispatch.<op>(*args, **kwargs)`` and decide once; return a
    function bound to the chosen kernel taking the op's bound tensors in their definition's order
    (``spec.arguments.bound``: rms_norm ``fn(x, weight, residual)``, rotary_embedding ``fn(q, k, cos, sin,
    positions, seqlen_offsets, cu_seqlens)``), with no lookup per call. Later tensors must keep the signature
    (shapes, dtypes, devices). ``fn.decision`` is the Decision."""
    arguments, validator = _definition(op, "plan_op")
    if op == "attention":  # its plan knows the call forms bind() alone does not (sinks)
        return plan(*args, **kwargs)
    given = arguments.bind(args, kwargs, f"plan_op({op!r}, ...)")
    impl = given.pop("impl")
    call = validator(**given, module=_module())
    return get_manager().bind(op, call, impl=impl)  # type: ignore[no-any-return]


class Attention(torch.nn.Module):
    """`opdispatch.attention` as a module that binds a plan on first call and re-binds when any input's shape,
    dtype or device, grad recording, or the active overrides or scope change. Options are the keyword arguments
    of `attention`."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self._key: Any = None
        self._fn: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        if _is_compiling():
            return attention(q, k, v, **self.options)
        # The tensor fields of the per-call key: a change of any of them re-validates and re-decides.
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad), _overrides(), _module(),
               _deterministic())
        if key != self._key:
            self._fn = plan(q, k, v, **self.options)
            self._key = key
        return self._fn(q, k, v)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str | None = None,
            device: DeviceInfo | str | os.PathLike[str] | None = None, **kwargs: Any) -> Decision:
    """Which implementation `attention(q, k, v, **kwargs)` would use, and why — for every candidate.

    `device` simulates another device: a DeviceInfo or the path of a YAML descriptor (configs/devices/). The
    tensors may then live on the ``meta`` device, since nothing is computed.
    """
    kwargs.setdefault("module", _module())
    call = validate_attention(q, k, v, check_values=not _is_meta(q), **kwargs)
    return get_manager().explain("attention", call, device=resolve_device(device), impl=impl)


_DEVICE_PARAMETER = inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None,
                                      annotation="DeviceInfo | str | os.PathLike[str] | None")
explain.__signature__ = ATTENTION_ARGS.signature(extra=(_DEVICE_PARAMETER,),  # type: ignore[attr-defined]
                                                 return_annotation="Decision")
explain.__opdispatch_arguments__ = ATTENTION_ARGS  # type: ignore[attr-defined]  # the typing stub's source


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _slow_path(op: str, validate: Callable[..., Any], arguments: OpArguments) -> Callable[..., Any]:
    """An op's slow path: validate, decide, and (for a fast-path key) bind and remember the kernel."""
    names = arguments.names

    def slow(manager: OpManager, key: Any, *args: Any) -> Any:
        given = dict(zip(names, args))
        impl = given.pop("impl")
        call = validate(**given, module=_module())
        if key is None:
            return manager.call(op, call, impl=impl)
        return _run_and_remember(manager, op, key, call, impl, arguments.bound_tensors(given))

    slow.__name__ = slow.__qualname__ = f"_{op}_slow"
    return slow


def _failed_path(slow: Callable[..., Any]) -> Callable[..., Any]:
    """The front door's `failed` hook for the op whose slow path is `slow` (`_fast_path_failed`)."""
    def failed(manager: OpManager, key: Any, fn: Any, exc: Exception, *args: Any) -> Any:
        return _fast_path_failed(manager, key, fn, exc, slow, args)

    return failed


_attention_failed = _failed_path(_attention_slow)  # attention's front door names it (it is generated above)


def _definition(op: str, what: str) -> tuple[OpArguments, Callable[..., Any]]:
    """The op's argument definition and validator, which `what` is built from; ValueError naming what is missing."""
    spec = op_spec(op)
    if spec.arguments is None or spec.validator is None:
        missing = "arguments" if spec.arguments is None else "validator"
        raise ValueError(f"op {op!r} declares no {missing} in its OpSpec; {what} is built from its arguments and "
                         "validator (see opdispatch.base._arguments)")
    return spec.arguments, spec.validator


def define_front_door(op: str, *, doc: str = "", compiled: Callable[..., Any] | None = None,
                      return_annotation: str = "Any") -> Callable[..., Any]:
    """The front door (``opdispatch.<op>``-style function) of a registered op, generated from its `OpSpec`:
    the signature of ``spec.arguments``, validation by ``spec.validator``, the per-call fast path, ``impl=``
    pins, overrides and scopes — what the built-in ops' front doors do.

    Under torch.compile it calls `compiled` with the same arguments; by default, for an op whose spec declares
    `fake_outputs`, one opaque custom op that dispatches at run time (`opdispatch.compile._compile_ops`), and for one
    without, the eager call outside the graph (a graph break). ValueError if the op has no arguments or
    validator.
    """
    spec = op_spec(op)
    arguments, validator = _definition(op, "a front door")
    slow = _slow_path(op, validator, arguments)
    failed = _failed_path(slow)
    namespace = {"_is_compiling": _is_compiling, "get_manager": get_manager, "_grad_enabled": _grad_enabled,
                 "_index_key": _index_key, "_overrides": _overrides, "_module": _module,
                 "_deterministic": _deterministic, "_profiling": _profiling, "_compiled": compiled, "_slow": slow,
                 "_failed": failed}
    python_front_door = arguments.front_door(doc=doc, namespace=namespace, compiled="_compiled", slow="_slow",
                                             failed="_failed", return_annotation=return_annotation,
                                             manager="get_manager()")
    if compiled is None and spec.fake_outputs is not None:
        from ..compile._compile_ops import opaque_compiled_op

        namespace["_compiled"] = opaque_compiled_op(arguments, python_front_door, spec.fake_outputs)
    elif compiled is None:
        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def eager(*args: Any, **kwargs: Any) -> Any:
            given = arguments.bind(args, kwargs, op)
            return slow(get_manager(), None, *given.values())

        namespace["_compiled"] = eager
    return _native.from_arguments(python_front_door, arguments, namespace, failed, globals())


def define_explain(op: str) -> Callable[..., Decision]:
    """``explain_<op>``: why a call of a registered op with these arguments goes where it goes (every candidate,
    its status and reasons). Takes the front door's arguments plus `device`, which simulates another device
    (a DeviceInfo or a descriptor path; the tensors may then live on the ``meta`` device)."""
    arguments, validator = _definition(op, f"explain_{op}")
    reads_values = "check_values" in inspect.signature(validator).parameters

    def explain_op(*args: Any, device: DeviceInfo | str | os.PathLike[str] | None = None, **kwargs: Any) -> Decision:
        given = arguments.bind(args, kwargs, f"explain_{op}")
        impl = given.pop("impl")
        extra: dict[str, Any] = {}
        if reads_values:  # meta tensors have no values to read
            extra["check_values"] = not any(isinstance(v, torch.Tensor) and _is_meta(v) for v in given.values())
        call = validator(**given, module=_module(), **extra)
        return get_manager().explain(op, call, device=resolve_device(device), impl=impl)

    explain_op.__name__ = explain_op.__qualname__ = f"explain_{op}"
    explain_op.__module__ = "opdispatch"
    explain_op.__doc__ = (f"Why `opdispatch.{op}` with these arguments goes where it goes: every candidate, its "
                          "status and reasons. `device` simulates another device (a DeviceInfo or a descriptor "
                          "path; the tensors may then live on the ``meta`` device).")
    explain_op.__signature__ = arguments.signature(  # type: ignore[attr-defined]
        extra=(_DEVICE_PARAMETER,), return_annotation="Decision")
    explain_op.__opdispatch_arguments__ = arguments  # type: ignore[attr-defined]  # the typing stub's source
    return explain_op


def _run_and_remember(manager: OpManager, op: str, key: Any, call: Any, impl: str | None,
                      tensors: tuple[Any, ...], generic: tuple[Any, Any, Any] | None = None) -> Any:
    """Run `call` on its bound kernel and remember the function under the fast-path `key` once it returned
    (unless a policy swap happened meanwhile: the swap replaced `fast`, the hash tells). `generic`: a dense
    attention call's (causal, causal_alignment, window) as given, to remember it as a size-generic template too
    (`_sized_reuse`)."""
    # A dense signature first seen inside CUDA graph capture: its class may be decided, but a kernel's first call
    # at a new shape may build a plan (cuDNN builds a graph per shape), which must not happen inside capture.
    raise_if_capturing(op, call)

    def remember(fn: Any) -> None:
        if fn.decision.policy_hash == manager.policy.hash:
            bounded_put(manager.fast, key, fn)
            if generic is not None and call.sinks is None and call.alibi_slopes is None and call.attn_bias is None:
                reduced = size_generic_key(key)
                kept = manager.size_generic.get(reduced)
                # A template of the same decision whose function is not size-generic either does what the new one
                # would (`_sized_reuse` binds afresh with both): keep it, so the dict the compiled door's entries
                # watch does not change at every new length of such a class (reference.math, an unequal-length
                # bottom-right prefill on cpu.flash).
                if kept is None or kept.decision is not fn.decision or kept.fn.size_generic or fn.size_generic:
                    bounded_put(manager.size_generic, reduced, SizeTemplate(call, generic, fn))

    return manager.run_bound(op, call, impl, tensors, remember)


def _index_key(t: Any) -> Any:
    """An index argument's part of a fast-path key (an int, None, or a tensor's shape, dtype and device); raises
    TypeError for a tensor whose values validation reads on every call (on the CPU, where that costs no sync)."""
    if t is None or isinstance(t, int):
        return t
    if t.device.type == "cpu":
        raise TypeError("checked per call")
    return (t.shape, t.dtype, t.device)


# The compiled fast path where built (opdispatch.base._native): the same front door with its hit path in C, handing
# every other call to the Python one above.
# Size-generic entries in the compiled door: on unless OPDISPATCH_NATIVE_SIZED=0 (read once, at import). A class
# that keeps no box (a keyed candidate whose selection key declares no cuts: `dense_key_size_cuts`) keeps an entry
# of "nothing" that new lengths do not ask again (`_never_boxed`); nvidia.cudnn declares its cuts, so the H100's
# decode class is boxed (it was not at 09d0fa1, benchmarks/results/h100-2a13858/: 2.43x on vs 2.28x off).
attention = _native.from_arguments(
    attention, ATTENTION_ARGS, globals(), _attention_failed, globals(),
    size_entry=None if os.environ.get("OPDISPATCH_NATIVE_SIZED") == "0" else _native_size_entry)
_attention_key = ATTENTION_ARGS.key_function(globals())  # the key the Python front door keeps calls under


# The other built-in ops' front doors and explains, made from their argument definitions (RMS_NORM_ARGS,
# ROTARY_ARGS in core/opdispatch/ops/); op_spec loads the op modules on first use.
rms_norm = define_front_door("rms_norm", doc="""\
    RMSNorm over the last dim by the best implementation the device and the policy allow.

    ``y = x / sqrt(mean(x**2, -1) + eps) * weight``; with `residual`, normalises ``h = x + residual`` and returns
    ``(y, h)`` (fused add-and-norm; the inputs are never modified). Statistics in float32 (float64 for float64);
    `y` has x's dtype. `impl` pins an implementation id (an error if it cannot take the call). The policy section
    is ``ops.rms_norm`` (`when:` keys dtype, hidden_size, tokens (rows of x), residual, weight, requires_grad, plus
    device keys); the env pin ``OPDISPATCH_IMPL_RMS_NORM``.
    """, return_annotation="torch.Tensor | tuple[torch.Tensor, torch.Tensor]")
explain_rms_norm = define_explain("rms_norm")

rotary_embedding = define_front_door("rotary_embedding", doc="""\
    Rotary position embedding of q and k by the best implementation the device and the policy allow.

    q/k: (batch, seqlen, heads, head_dim) for ``layout="bshd"``, or packed (total, heads, head_dim) for ``"thd"``
    with int32 ``cu_seqlens`` and ``max_seqlen``; k may have fewer heads. cos/sin: (max_positions, rotary_dim / 2)
    caches; the first rotary_dim channels rotate, the rest pass through. Pairs are (x[i], x[i + rotary_dim / 2])
    (GPT-NeoX) or, with ``interleaved=True``, (x[2i], x[2i + 1]) (GPT-J). A token's position is its index in its
    sequence plus ``seqlen_offsets`` (an int or one per sequence), or ``positions[token]``. Returns new
    ``(q_out, k_out)``. The policy section is ``ops.rotary_embedding`` (`when:` keys dtype, head_dim, rotary_dim,
    interleaved, varlen, positions, requires_grad, plus device keys); the env pin
    ``OPDISPATCH_IMPL_ROTARY_EMBEDDING``.
    """, return_annotation="tuple[torch.Tensor, torch.Tensor]")
explain_rotary_embedding = define_explain("rotary_embedding")
