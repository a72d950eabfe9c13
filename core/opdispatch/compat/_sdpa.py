"""`scaled_dot_product_attention`: torch's functional, dispatched by opdispatch.

Same signature, broadcasting and results as ``torch.nn.functional.scaled_dot_product_attention``: any number of
leading dims (2-D and 3-D inputs included), batch dims broadcast between q, k and v, k/v with one head for many
(as torch broadcasts them), ``enable_gqa``, boolean and float masks broadcast to the scores, ``is_causal``
(top-left, combinable with a mask), ``dropout_p``, any ``scale`` (folded into q where the op's range excludes it),
a value head dim of its own. Invalid calls raise `SdpaError` — a ``RuntimeError``, as torch raises, and a
``ValueError`` — naming the argument, its value and what is allowed.

What opdispatch cannot represent goes to torch's own function unchanged: nested (jagged) tensors and tensor
subclasses (``torch.nn.attention.bias.CausalBias`` masks included, which torch dispatches through their
``__torch_function__``; the FakeTensors non-strict ``torch.export`` traces with stand for plain tensors and
export ``opdispatch::attention``), calls made by an implementation while the program is routed through this
function (so a plugin that calls ``F.scaled_dot_product_attention`` never loops back into opdispatch), and
TorchScript: scripted code (``torch.jit.script`` of ``nn.MultiheadAttention`` under `route_sdpa`) calls torch's
op.

Empty inputs give what torch gives: an empty result, zeros where there is no key, and where the query/key head dim
is 0 the softmax of the mask alone (every score is 0). ``is_causal`` with an explicit ``attn_mask`` raises torch's
RuntimeError exactly where torch raises it: where torch would run its math backend (inputs of other than 4 dims,
dropout, or an ``sdpa_kernel`` context that leaves only MATH), which refuses the pair; torch's fused CPU kernel
combines them, and so does opdispatch.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.jit._builtins
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.attention import SDPBackend

from ..doors import _api
from ..base import _native
from ..base._arguments import REQUIRED
from ..doors._api import (_NOT_REUSED, _deterministic, _fast_path_failed, _grad_enabled, _is_compiling, _module,
                         _overrides, _profiling, _run_and_remember, _sized_reuse, attention, size_generic_key)
from ..ops._attention import validate_attention

__all__ = ["SdpaError", "route_sdpa", "routed_sdpa", "scaled_dot_product_attention", "torch_sdpa", "unroute_sdpa"]

# torch's function as imported, before any routing: what the unusual calls (and re-entrant ones) go to.
torch_sdpa = torch.nn.functional.scaled_dot_product_attention
_MAX_SCALE = 2**20  # opdispatch's scale range (attention() refuses scales outside (0, 2**20])
# "Inside an implementation": set while a kernel runs, so its own SDPA calls reach torch (read from C by the
# compiled front door).
_state = _native.thread_flag()


class SdpaError(RuntimeError, ValueError):
    """An invalid `scaled_dot_product_attention` call: a RuntimeError where torch raises one, and a ValueError."""


def _exported(t: Any) -> bool:
    """A FakeTensor that non-strict torch.export runs the program on: it stands for a plain tensor, so the call is
    opdispatch's op in the exported graph (as in strict export, where Dynamo shows plain tensors), not torch's."""
    return type(t) is FakeTensor and torch.compiler.is_exporting()


def _dense(t: Any) -> bool:
    return type(t) is Tensor or _exported(t)


def _plain(t: Any) -> bool:
    return type(t) is Tensor or type(t) is torch.nn.Parameter or _exported(t)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by the implementation the policy picks."""
    if _state.active:  # an implementation calling it while the program is routed: torch's
        return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if not (_dense(query) and _dense(key) and _dense(value)) and not all(
            isinstance(t, Tensor) for t in (query, key, value)):  # None, a number: torch's TypeError
        return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if _autocasting(query):  # plain tensors, Parameters and subclasses alike, as torch's autocast casts them all
        return _autocast(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if (scale is not None and not math.isfinite(scale)) or (isinstance(attn_mask, Tensor) and attn_mask.dim() < 2):
        # A NaN or infinite scale, a 0-D or 1-D mask: what torch gives depends on the backend it picks (NaN, an
        # IndexError, or a broadcast on its math backend), so torch computes or refuses them itself.
        return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    # The per-call fast path: a maskless, dropout-free call of plain tensors whose signature was seen calls the
    # kernel bound to it, as opdispatch.attention's own front door does (same manager cache: a policy swap or a
    # demotion forgets it there too). Everything the checks below read is in the key.
    fast_key = None
    if (attn_mask is None and not dropout_p and type(query) is Tensor and type(key) is Tensor
            and type(value) is Tensor and not _is_compiling()):
        manager = _api._manager or _api.get_manager()
        try:
            fast_key = (_SDPA, query.shape, query.dtype, query.device, query.stride(-1), key.shape, key.dtype,
                        key.device, key.stride(-1), value.shape, value.dtype, value.device, value.stride(-1),
                        is_causal, is_causal.__class__, scale, scale.__class__, enable_gqa, dropout_p.__class__,
                        _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
                        _overrides(), _module(), _deterministic(), _profiling())
            fn = manager.fast[fast_key]
        except KeyError:
            pass  # the first call of this signature: remembered below if it takes the common path
        except (TypeError, RuntimeError, IndexError):
            fast_key = None  # an unhashable override or scale, a 0-D tensor: the paths below check everything
        else:
            _state.active = 1
            try:
                out: Tensor = fn(query, key, value)
                return out
            except Exception as exc:  # the breaker decides, as for opdispatch.attention's fast path
                answered: Tensor = _fast_path_failed(manager, fast_key, fn, exc, _remembered,
                                                     (query, key, value, is_causal, scale))
                return answered
            finally:
                _state.active = 0
    # The common call — 4-D tensors of one batch, heads that divide, a mask of an allowed dtype, a scale the op
    # takes — goes straight to opdispatch.attention (its per-call fast path); anything else, or anything it
    # refuses, takes the general path below, which reshapes, and raises as torch does.
    try:
        qs, ks, vs = query.shape, key.shape, value.shape
    except RuntimeError:  # a strided nested tensor has no sizes: torch's
        return _general(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and _dense(query) and _dense(key) and _dense(value)
            and ks[0] == qs[0] == vs[0] and ks[1] == vs[1]
            and _static_size(qs[1])  # symbolic heads (export): the general path folds them into the batch
            and 0 not in qs and 0 not in ks and 0 not in vs  # empty inputs: the general path gives torch's result
            and (ks[1] == qs[1] or ((enable_gqa or ks[1] == 1) and qs[1] % ks[1] == 0))
            and (scale is None or 0 < scale <= _MAX_SCALE)
            and (attn_mask is None or (not is_causal and _dense(attn_mask)
                                       and attn_mask.dtype in (torch.bool, torch.float32, query.dtype)))):
        bool_mask = attn_mask is not None and attn_mask.dtype == torch.bool
        mask, bias = (attn_mask, None) if bool_mask else (None, attn_mask)
        try:
            if fast_key is not None:
                return _remembered(_api._manager or _api.get_manager(), fast_key, query, key, value, is_causal,
                                   scale)
            return _dispatch(query, key, value, is_causal, scale, dropout_p, mask, bias)
        except (ValueError, TypeError):
            pass  # the general path says what is wrong, as torch would, or computes what the op cannot take
    return _general(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _autocasting(query: Tensor) -> bool:
    device = query.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def _autocast(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """The call under ``torch.autocast``, as torch's autocast runs its SDPA (a lower-precision op on every device
    that casts it): floating tensors other than float64 — the float mask too — cast to the autocast dtype, then the
    call itself with autocast off (an implementation's own matmuls must not be cast again)."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device)

    def cast(t: Any) -> Any:
        eligible = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.dtype != dtype else t

    with torch.autocast(device, enabled=False):
        return scaled_dot_product_attention(cast(query), cast(key), cast(value), cast(attn_mask), dropout_p,
                                            is_causal, scale=scale, enable_gqa=enable_gqa)


def _general(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
             is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    if not all(_plain(t) for t in (query, key, value)) or (
            attn_mask is not None and not _plain(attn_mask)) or query.is_nested:
        return _to_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    q, k, v, mask, bias, out_shape, op_scale = _as_bhsd(query, key, value, attn_mask, scale, enable_gqa)
    if not 0.0 <= dropout_p <= 1.0 or math.isnan(dropout_p):
        raise SdpaError(f"scaled_dot_product_attention: dropout_p={dropout_p!r} is out of range; allowed: "
                        "0 <= dropout_p <= 1")
    if is_causal and attn_mask is not None:
        _refuse_mask_with_causal_where_torch_does(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if 0 in out_shape or k.shape[2] == 0 or dropout_p == 1.0:
        # An empty result, no key to attend to, or every weight dropped: zeros (as torch gives, not the NaN of a
        # softmax over nothing), still part of the autograd graph.
        connect = (query.sum() + key.sum() + value.sum()) * 0
        return torch.zeros(out_shape, dtype=query.dtype, device=query.device) + connect
    if q.shape[3] == 0:
        # A zero-width dot product: every score is 0 whatever the scale, so the weights are the softmax of the mask
        # alone. One zero column in q and k gives the same scores in a shape the op takes; the grads of q and k
        # stay empty tensors, as torch's.
        q = torch.cat([q, q.new_zeros((*q.shape[:3], 1))], dim=3)
        k = torch.cat([k, k.new_zeros((*k.shape[:3], 1))], dim=3)
    try:
        out = _dispatch(q, k, v, is_causal, op_scale, dropout_p, mask, bias)
    except (ValueError, TypeError) as exc:  # what the op refuses that torch's checks above did not catch
        raise SdpaError(f"scaled_dot_product_attention: {exc}") from exc
    return out.reshape(out_shape)


def _to_torch(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """A call opdispatch does not represent (tensor subclasses, nested tensors), to torch's function."""
    args = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if (torch.nn.functional.scaled_dot_product_attention is scaled_dot_product_attention
            and not query.is_nested and torch.overrides.has_torch_function(args)):
        # Routed: a subclass's __torch_function__ recognises the functional by identity with
        # F.scaled_dot_product_attention (CausalBias does, then calls it without the subclass), which is now this
        # function; handed torch's, it would take the generic path and read the subclass as a plain tensor.
        result: Tensor = torch.overrides.handle_torch_function(
            scaled_dot_product_attention, args, query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)
        return result
    return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _refuse_mask_with_causal_where_torch_does(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor,
                                              dropout_p: float, scale: float | None, enable_gqa: bool) -> None:
    """torch's math backend refuses ``is_causal`` with an explicit mask; its fused CPU kernel combines the two.
    Which one torch runs depends on its backend choice (input rank, dtype, dropout, the ``sdpa_kernel`` context),
    so ask torch for that choice and raise its RuntimeError where it would."""
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, True, scale=scale,
                                     enable_gqa=enable_gqa)
    if choice == SDPBackend.MATH.value:
        raise SdpaError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True (torch runs "
            f"its math backend for this call: query.dim()={query.dim()}, dropout_p={dropout_p}, dtype "
            f"{query.dtype}, and the sdpa_kernel context; that backend takes one or the other); fold the causal "
            "mask into attn_mask, or pass is_causal=True without attn_mask")


_SDPA = "compat.scaled_dot_product_attention"  # its fast-path keys' first field: never one of an op's


def _remembered(manager: Any, fast_key: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                scale: float | None) -> Tensor:
    """A common maskless call (4-D, one batch, heads that divide, a scale the op takes) through opdispatch.attention's
    slow path — validate, decide, bind — remembering the bound kernel under the drop-in's own `fast_key`; a call
    that differs from a remembered one only in sizes takes its template (opdispatch.doors._api's `_sized_reuse`)."""
    _state.active = 1
    try:
        template = manager.size_generic.get(size_generic_key(fast_key)) if manager.size_generic else None
        if template is not None:
            reused: Tensor = _sized_reuse(manager, fast_key, template, None, q, k, v, None, None, None, None)
            if reused is not _NOT_REUSED:
                return reused
        call = validate_attention(q, k, v, layout="bhsd", causal=causal, scale=scale, module=_module())
        out: Tensor = _run_and_remember(manager, "attention", fast_key, call, None, (q, k, v),
                                        (causal, "top_left", None))
        return out
    finally:
        _state.active = 0


def _dispatch(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, dropout_p: float,
              mask: Tensor | None, bias: Tensor | None) -> Tensor:
    """`opdispatch.attention` on (batch, heads, seq, dim) tensors, marked as inside it so that an implementation
    calling F.scaled_dot_product_attention while the program is routed reaches torch's."""
    _state.active = 1
    try:
        out: Tensor = attention(q, k, v, layout="bhsd", causal=causal, scale=scale, dropout_p=dropout_p,
                                attn_mask=mask, attn_bias=bias)
        return out
    finally:
        _state.active = 0


def _broadcast(what: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]
    except RuntimeError:
        raise SdpaError(f"scaled_dot_product_attention: the {what} of query, key and value do not broadcast: "
                        f"{', '.join(str(tuple(s)) for s in shapes)}") from None


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _as_bhsd(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, scale: float | None,
             enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, tuple[int, ...], float]:
    """The call as opdispatch's (batch, heads, seq, dim) tensors, the mask split into a boolean mask or a float
    bias, the output's shape and the scale to pass."""
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise SdpaError("scaled_dot_product_attention: expected query, key and value to be at least 2-dimensional, "
                        f"got query.dim()={query.dim()}, key.dim()={key.dim()}, value.dim()={value.dim()}")
    if not (query.dtype == key.dtype == value.dtype):
        raise SdpaError("scaled_dot_product_attention: expected query, key and value to have the same dtype, got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")
    if not query.dtype.is_floating_point:
        raise SdpaError(f"scaled_dot_product_attention: query dtype {query.dtype} is not a floating-point dtype")
    if not (query.device == key.device == value.device):
        raise SdpaError("scaled_dot_product_attention: expected query, key and value on one device, got "
                        f"{query.device}, {key.device} and {value.device}")
    if key.shape[-1] != query.shape[-1]:
        raise SdpaError(f"scaled_dot_product_attention: key's last dim {key.shape[-1]} must equal query's "
                        f"{query.shape[-1]} (the dot-product dim)")
    if key.shape[-2] != value.shape[-2]:
        raise SdpaError(f"scaled_dot_product_attention: key and value must hold as many positions: "
                        f"{key.shape[-2]} vs {value.shape[-2]}")
    seq_q, seq_k, dim, dim_v = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    lead_q, lead_k, lead_v = (tuple(t.shape[:-2]) for t in (query, key, value))
    width = max(len(lead_q), len(lead_k), len(lead_v), 1)
    lead_q, lead_k, lead_v = ((1,) * (width - len(s)) + s for s in (lead_q, lead_k, lead_v))
    heads_q, heads_k, heads_v = lead_q[-1], lead_k[-1], lead_v[-1]
    if heads_k != heads_v:
        if not (enable_gqa or 1 in (heads_k, heads_v)):
            raise SdpaError(f"scaled_dot_product_attention: key has {heads_k} heads and value {heads_v}")
    if enable_gqa and heads_k != heads_q:
        if heads_k != heads_v or heads_q % heads_k:
            raise SdpaError(f"scaled_dot_product_attention: with enable_gqa, the heads of key and value "
                            f"({heads_k}, {heads_v}) must be equal and divide the query's ({heads_q})")
        heads_kv = heads_k
    elif heads_k == heads_v == 1:
        heads_kv = 1  # one key/value head for every query head: torch broadcasts it, opdispatch reads it as MQA
    else:
        heads_kv = _broadcast("head dims", (heads_q,), (heads_k,), (heads_v,))[0]
        if heads_kv != heads_q:  # k/v have more heads than q: torch broadcasts q
            heads_q = heads_kv
    batch = _broadcast("batch dims", lead_q[:-1], lead_k[:-1], lead_v[:-1])
    flat = math.prod(batch)

    def shaped(t: Tensor, lead: tuple[int, ...], heads: int, seq: int, last: int) -> Tensor:
        t = t.reshape(*lead, seq, last).expand(*batch, heads, seq, last)
        return t.reshape(flat, heads, seq, last)  # a view when the batch dims merge; a copy when broadcast

    q = shaped(query, lead_q, heads_q, seq_q, dim)
    k = shaped(key, lead_k, heads_kv, seq_k, dim)
    v = shaped(value, lead_v, heads_kv, seq_k, dim_v)
    if attn_mask is None and _symbolic_same(heads_q, heads_kv):
        # A symbolic head count (exported with dynamic heads, or 3-D inputs whose leading dim is dynamic): without
        # GQA or a mask every head is independent, so the heads join the batch — opdispatch's compiled op
        # specialises heads (selection reads them) but not batch. Eager calls never have symbolic sizes.
        q, k, v = (t.reshape(-1, 1, t.shape[2], t.shape[3]) for t in (q, k, v))
    # torch's result: the broadcast leading dims, q's heads, L, Ev — as many dims as the widest input.
    out_shape = (*batch, heads_q, seq_q, dim_v)[-max(query.dim(), key.dim(), value.dim()):]
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (torch.float32, query.dtype):
            raise SdpaError(f"scaled_dot_product_attention: attn_mask dtype {attn_mask.dtype} is not allowed; "
                            f"allowed: bool (True = attend), float32, or query's dtype {query.dtype}")
        full = (*batch, heads_q, seq_q, seq_k)
        if attn_mask.dim() > len(full) or not _broadcasts(tuple(attn_mask.shape), full):
            raise SdpaError(f"scaled_dot_product_attention: attn_mask of shape {tuple(attn_mask.shape)} does not "
                            f"broadcast to the scores' shape {full}")
        m = attn_mask.reshape(*(1,) * (len(full) - attn_mask.dim()), *attn_mask.shape)
        lead = m.shape[:-3]
        if all(n == 1 for n in lead):
            m = m.reshape(1, *m.shape[-3:])  # a view: opdispatch broadcasts the rest
        else:  # per-batch masks over several batch dims: one batch dim, as the call's
            m = m.expand(*batch, *m.shape[-3:]).reshape(flat, *m.shape[-3:])
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m
    if dim == 0:
        scale = 1.0  # every score is 0 whatever the scale (_general pads q and k with a zero column)
    elif scale is None:
        scale = 1.0 / math.sqrt(dim)
    elif not (math.isfinite(scale) and 0 < scale <= _MAX_SCALE):
        q, scale = q * scale, 1.0  # a scale opdispatch's kernels do not take (0, negative, huge): fold it into q
    return q, k, v, mask, bias, tuple(out_shape), float(scale)


def _fast_key(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
              enable_gqa: Any) -> Any:
    """The key the fast path above keeps a call's bound kernel under (None where it keeps none): what the compiled
    front door reads back from the manager's cache after the Python path ran a call. The same expression as the
    inline one (tests/test_native.py checks that the two agree)."""
    if (attn_mask is not None or dropout_p or type(query) is not Tensor or type(key) is not Tensor
            or type(value) is not Tensor):
        return None
    try:
        return (_SDPA, query.shape, query.dtype, query.device, query.stride(-1), key.shape, key.dtype, key.device,
                key.stride(-1), value.shape, value.dtype, value.device, value.stride(-1), is_causal,
                is_causal.__class__, scale, scale.__class__, enable_gqa, dropout_p.__class__,
                _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad), _overrides(),
                _module(), _deterministic(), _profiling())
    except (TypeError, RuntimeError, IndexError):
        return None


def _symbolic_same(heads_q: Any, heads_kv: Any) -> bool:
    """Whether the head count is a symbolic size known to be the same for q and k/v without adding a guard: an
    export with dynamic heads. (Dynamo sees a symbolic size as an int to ``isinstance``; `has_static_value` and
    `statically_known_true` are what it traces without guarding.)"""
    if _static_size(heads_q):
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(heads_q == heads_kv))


def _static_size(n: Any) -> bool:
    """Whether a size is a plain number, not a symbol of an export or a compile with dynamic shapes. Under Dynamo
    a symbolic size reads as an int to `type`/`isinstance`; `has_static_value` is what it traces without a guard
    (imported here, not at module import: it costs ~0.3 s and eager calls never need it)."""
    if type(n) is int and not _is_compiling():
        return True
    from torch.fx.experimental.symbolic_shapes import has_static_value

    return bool(has_static_value(n))


def _failed_hit(manager: Any, fast_key: Any, fn: Any, exc: Exception, query: Tensor, key: Tensor, value: Tensor,
                attn_mask: Any, dropout_p: Any, is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """The compiled front door's hit whose kernel raised: as the inline fast path's ``except`` above."""
    answered: Tensor = _fast_path_failed(manager, fast_key, fn, exc, _remembered, (query, key, value, is_causal, scale))
    return answered


# The compiled fast path where built: this function with its hit path in C (plain tensors, no mask, a zero
# dropout), every other call handed to the Python function above.
scaled_dot_product_attention = _native.compiled_front_door(
    scaled_dot_product_attention, name="scaled_dot_product_attention",
    names=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), n_positional=6,
    defaults=(REQUIRED, REQUIRED, REQUIRED, None, 0.0, False, None, False),
    kinds=("strided", "strided", "strided", "bypass", "zero", "value", "value", "value"), key_of=_fast_key,
    failed=_failed_hit, bound=("query", "key", "value"),
    context=_native.context_sources(_overrides, _module, _deterministic, _profiling, _native.AUTOCAST),
    exact=("query", "key", "value"), flag=_state, api_globals=_api.__dict__)


# TorchScript cannot compile this function (keyword-only arguments, opdispatch's Python underneath); scripted code
# that names it (F.multi_head_attention_forward under route_sdpa, so torch.jit.script of nn.MultiheadAttention)
# calls torch's op instead, as it does for torch's own function.
torch.jit._builtins._register_builtin(scaled_dot_product_attention, "aten::scaled_dot_product_attention")


# -- routing the program's F.scaled_dot_product_attention ---------------------------------------------------

_routing_lock = threading.Lock()
_routed_depth = 0


def route_sdpa() -> None:
    """Make ``torch.nn.functional.scaled_dot_product_attention`` (as looked up by attribute, the way most code
    calls it) this function, for the whole process; `unroute_sdpa` undoes it. Nested calls count: the original
    returns when every `route_sdpa` has been undone. Code that imported the function by name before keeps
    torch's."""
    global _routed_depth
    with _routing_lock:
        _routed_depth += 1
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention  # type: ignore[assignment]


def unroute_sdpa() -> None:
    """Undo one `route_sdpa` (torch's function is back when none is left)."""
    global _routed_depth
    with _routing_lock:
        if _routed_depth == 0:
            raise RuntimeError("unroute_sdpa() without a route_sdpa() to undo")
        _routed_depth -= 1
        if _routed_depth == 0:
            torch.nn.functional.scaled_dot_product_attention = torch_sdpa


@contextlib.contextmanager
def routed_sdpa() -> Iterator[None]:
    """``with routed_sdpa():`` — every ``F.scaled_dot_product_attention`` call inside goes through opdispatch."""
    route_sdpa()
    try:
        yield
    finally:
        unroute_sdpa()
