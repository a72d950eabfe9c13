"""flash-attn 2.8's public functions, dispatched by opdispatch: ``from opdispatch.compat import flash_attn`` and
call ``flash_attn.flash_attn_func(q, k, v, causal=True)`` as you would flash-attn's.

Signatures, defaults and conventions are flash-attn's: (batch, seqlen, heads, dim) tensors, packed varlen
``(total, heads, dim)`` with int32 ``cu_seqlens``, causal masks aligned bottom-right, ``window_size=(left,
right)`` with -1 unbounded (``causal=True`` makes the right bound 0, as flash-attn does), ``softmax_scale``,
``softcap``, ALiBi slopes (aligned bottom-right like the mask), dropout, ``deterministic``. With
``return_attn_probs=True`` the result is ``(out, softmax_lse, None)``: opdispatch never materialises the
probability matrix (flash-attn returns it only as a debugging aid with dropout). LSE shapes are flash-attn's:
``(batch, heads, seqlen_q)``, or ``(heads, total_q)`` packed.

``flash_attn_with_kvcache`` appends ``k``/``v`` to the caches in place at ``cache_seqlens`` (per sequence; the
caches may be addressed through ``cache_batch_idx``, or paged through ``block_table``), applies rotary
embeddings (``rotary_cos``/``rotary_sin``, ``rotary_interleaved``) to the new keys at their positions and to q —
at its positions when causal or windowed (a window bound at least the cache's length counts as none, as in
flash-attn's kernel), else at ``cache_seqlens`` — and attends over each sequence's keys through the op's own KV
cache (``seqused_k``, ``block_table``; a ``cache_batch_idx`` reads the cache as one page per row), so the cache is
neither copied nor read back to the host. With ``cache_leftpad`` (dense caches only, as in flash-attn) sequence i
holds positions ``[cache_leftpad[i], cache_seqlens[i])``: rotary positions stay absolute, and the keys are gathered
to start at 0 (one copy of the cache per call). ``num_splits`` is a flash-attn scheduling knob and is ignored.
A decode loop repeating a signature runs a bound path after its first call: its indices checked (without a host
sync on accelerators), one indexed store per cache, then the kernel bound for its class with the lengths
(`_KvcacheBound`; ALiBi and ``cache_leftpad`` calls take the reference path every call).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..doors import _api
from ..base import _native
from ..base._arguments import REQUIRED
from ..doors._api import (_deterministic, _fast_path_failed, _grad_enabled, _is_compiling, _module, _overrides,
                         _profiling, _run_and_remember, attention, rotary_embedding)
from ..ops._attention import validate_attention
from ..engine._graphs import raise_if_capturing
from ..base._kv_checks import Bound, KvCacheIndexError, ReportRow, Rule, Unique, check_index_tensor, \
    check_pending_errors, defer, defer_report, defer_written, device_verdict, host_checks, poisoned, raise_first, \
    raise_pending, release_row, report_row
from ..engine._state import bounded_put
from . import _kv_append
from ._kv_append import FusedAppend, Scratch, VerdictQueued
from ._triton_direct import stream_for

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "KvCacheIndexError", "check_pending_errors"]


def _window_bounds(window_size: Any) -> tuple[int, int]:
    """flash-attn's (left, right) as two ints: each an integer (a Python or NumPy int, or a one-element integer
    tensor); anything else raises — flash-attn's kernels take ints, and 1.5 must not silently become 1."""
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = ()
    if len(pair) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}; -1 means unbounded, "
                        "e.g. window_size=(256, 0)")
    bounds = []
    for side, w in zip(("left", "right"), pair):
        if isinstance(w, Tensor) and w.numel() == 1 and not w.is_floating_point() and not w.is_complex() \
                and w.dtype != torch.bool:
            bounds.append(int(w))
            continue
        if isinstance(w, bool) or isinstance(w, Tensor):
            index = None
        else:
            try:
                index = operator.index(w)
            except TypeError:
                index = None
        if index is None:
            raise TypeError(f"window_size[{side}] must be an int (or a one-element integer tensor), got "
                            f"{w!r} ({type(w).__name__}{' ' + str(w.dtype) if isinstance(w, Tensor) else ''}); "
                            "pass whole numbers of keys, -1 for unbounded")
        bounds.append(index)
    return bounds[0], bounds[1]


def _window(window_size: Any, causal: bool) -> tuple[int, int] | None:
    """flash-attn's (left, right) — ints or 0-d tensors, -1 unbounded — as opdispatch's window (None: none)."""
    left, right = _window_bounds(window_size)
    if causal:
        right = 0  # flash-attn: causal means no key to the right of the diagonal, whatever right says
    if left < 0 and right < 0:
        return None
    return (left if left >= 0 else -1, right if right >= 0 else -1)


# Set while opdispatch runs a call from this module (read from C by the compiled front door): a re-entry is an
# implementation calling back into a module aliased as flash_attn.
_inside = _native.thread_flag()


def _run(q: Tensor, k: Tensor, v: Tensor, layout: str, dropout_p: float, softmax_scale: float | None, causal: bool,
         window_size: Any, softcap: float, alibi_slopes: Tensor | None, deterministic: bool, want_lse: bool,
         **varlen: Any) -> Any:
    if _inside.active:
        # An implementation called back into this module: `flash_attn` is aliased to it, and the real library's
        # adapter would dispatch to itself forever.
        raise RuntimeError("opdispatch.compat.flash_attn was called from inside an opdispatch implementation: the "
                           "module named flash_attn is this front door, not the flash-attn library; do not alias "
                           "sys.modules['flash_attn'] to it (the nvidia.flash_attn adapter needs the real one)")
    window = _window(window_size, causal)
    _inside.active = 1
    try:
        return attention(q, k, v, layout=layout, causal=causal, causal_alignment="bottom_right", window=window,
                         scale=softmax_scale, dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes,
                         return_lse=want_lse, deterministic=deterministic, **varlen)
    finally:
        _inside.active = 0


def _result(result: Any, return_attn_probs: bool) -> Any:
    if not return_attn_probs:
        return result
    out, lse = result
    return out, lse, None  # no probability matrix: opdispatch's kernels never build one


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Any:
    """q (batch, seqlen_q, heads, dim), k/v (batch, seqlen_k, heads_k, dim): out like q (value's dim)."""
    # The per-call fast path: a call without ALiBi or dropout, plain tensors and a window of two ints (tensors as
    # window sizes would key by identity: a miss every call), whose signature was seen, calls the kernel bound to
    # it (the manager's cache, as opdispatch.attention's own front door).
    fast_key = None
    if (alibi_slopes is None and not dropout_p and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and not _is_compiling() and not _inside.active):
        manager = _api._manager or _api.get_manager()
        try:
            fast_key = (_FLASH_ATTN_FUNC, q.shape, q.dtype, q.device, q.stride(-1), k.shape, k.dtype, k.device,
                        k.stride(-1), v.shape, v.dtype, v.device, v.stride(-1), softmax_scale,
                        softmax_scale.__class__, causal, causal.__class__, window_size, softcap, softcap.__class__,
                        deterministic, deterministic.__class__, return_attn_probs,
                        dropout_p.__class__,
                        _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                        _overrides(), _module(), _deterministic(), _profiling())
            fn = manager.fast[fast_key]
        except KeyError:
            pass  # the first call of this signature: remembered below
        except (TypeError, RuntimeError):
            fast_key = None  # an unhashable value: the general path checks everything
        else:
            _inside.active = 1
            try:
                return _result(fn(q, k, v), return_attn_probs)
            except Exception as exc:  # the breaker decides, as for opdispatch.attention's fast path
                return _result(_fast_path_failed(manager, fast_key, fn, exc, _remembered, (
                    q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)),
                    return_attn_probs)
            finally:
                _inside.active = 0
        return _result(_remembered(manager, fast_key, q, k, v, softmax_scale, causal, window_size, softcap,
                                   deterministic, return_attn_probs), return_attn_probs)
    return _result(_run(q, k, v, "bshd", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs), return_attn_probs)


_FLASH_ATTN_FUNC = "compat.flash_attn_func"  # its fast-path keys' first field: never one of an op's


def _fast_key(q: Any, k: Any, v: Any, dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any,
              softcap: Any, alibi_slopes: Any, deterministic: Any, return_attn_probs: Any) -> Any:
    """The key flash_attn_func's fast path keeps a call's bound kernel under (None where it keeps none): what the
    compiled front door reads back after the Python path ran a call (the inline expression's twin; tests/
    test_native.py checks that the two agree)."""
    if not (alibi_slopes is None and not dropout_p and type(q) is Tensor and type(k) is Tensor
            and type(v) is Tensor and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int):
        return None
    try:
        return (_FLASH_ATTN_FUNC, q.shape, q.dtype, q.device, q.stride(-1), k.shape, k.dtype, k.device, k.stride(-1),
                v.shape, v.dtype, v.device, v.stride(-1), softmax_scale, softmax_scale.__class__, causal,
                causal.__class__, window_size, softcap, softcap.__class__, deterministic, deterministic.__class__,
                return_attn_probs, dropout_p.__class__,
                _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad), _overrides(), _module(),
                _deterministic(), _profiling())
    except (TypeError, RuntimeError):
        return None


def _failed_hit(manager: Any, fast_key: Any, fn: Any, exc: Exception, q: Tensor, k: Tensor, v: Tensor,
                dropout_p: Any, softmax_scale: float | None, causal: bool, window_size: Any, softcap: float,
                alibi_slopes: Any, deterministic: bool, return_attn_probs: bool) -> Any:
    """The compiled front door's hit whose kernel raised: as the inline fast path's ``except`` (before _result)."""
    return _fast_path_failed(manager, fast_key, fn, exc, _remembered, (
        q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs))


# The compiled fast path where built: flash_attn_func with its hit path in C, every other call handed to the Python
# function above; `_result` shapes a hit's output as the Python path does.
flash_attn_func = _native.compiled_front_door(
    flash_attn_func, name="flash_attn_func",
    names=("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
           "deterministic", "return_attn_probs"), n_positional=11,
    defaults=(REQUIRED, REQUIRED, REQUIRED, 0.0, None, False, (-1, -1), 0.0, None, False, False),
    kinds=("strided", "strided", "strided", "zero", "value", "value", "int_tuple", "value", "bypass", "value",
           "value"),
    key_of=_fast_key, failed=_failed_hit, bound=("q", "k", "v"),
    context=_native.context_sources(_overrides, _module, _deterministic, _profiling), exact=("q", "k", "v"),
    flag=_inside, result=_result, result_arg="return_attn_probs", api_globals=_api.__dict__)


def _remembered(manager: Any, fast_key: Any, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None,
                causal: bool, window_size: Any, softcap: float, deterministic: bool, want_lse: bool) -> Any:
    """A flash_attn_func call through opdispatch.attention's slow path — validate, decide, bind — remembering the
    bound kernel under the front door's own `fast_key` (`fast_key` None: not remembered)."""
    _inside.active = 1
    try:
        call = validate_attention(q, k, v, layout="bshd", causal=causal, causal_alignment="bottom_right",
                                  window=_window(window_size, causal), scale=softmax_scale, softcap=softcap,
                                  return_lse=want_lse, deterministic=deterministic, module=_module())
        return _run_and_remember(manager, "attention", fast_key, call, None, (q, k, v))
    finally:
        _inside.active = 0


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Any:
    """qkv (batch, seqlen, 3, heads, dim) — the packed layout bs3hd: q, k and v are views of it (no copies; their
    gradients land in one tensor)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Any:
    """q (batch, seqlen_q, heads, dim), kv (batch, seqlen_k, 2, heads_k, dim)."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False, window_size: Any = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None) -> Any:
    """Packed sequences: q (total_q, heads, dim), k/v (total_k, heads_k, dim) — or, with `block_table`
    (batch, max_blocks) int32, k/v are paged caches (num_blocks, block_size, heads_k, dim) and sequence i's keys
    are its `cu_seqlens_k` length read through its row of pages."""
    if block_table is not None:
        return _result(_run(q, k, v, "thd", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q,
                            seqused_k=cu_seqlens_k[1:] - cu_seqlens_k[:-1], block_table=block_table,
                            max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k)), return_attn_probs)
    return _result(_run(q, k, v, "thd", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k)), return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: Any = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Any:
    """qkv (total, 3, heads, dim) with one `cu_seqlens` for queries and keys."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: Any = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Any:
    """q (total_q, heads, dim), kv (total_k, 2, heads_k, dim)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


_KV = "flash_attn_with_kvcache"


def _check_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                   block_table: Tensor | None, cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None,
                   rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None) -> None:
    """Shapes, dtypes and devices of the tensors (host-known, checked before anything else: a mismatch found by
    the write itself could leave k_cache written and v_cache not)."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{_KV}: pass rotary_cos and rotary_sin together (or neither); got only "
                         f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"{_KV}: q, k_cache and v_cache must be 4-D, got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(f"{_KV}: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
                         f"{v_cache.dtype} must agree in all but the last dimension, dtype and device")
    if (k is None) != (v is None):
        raise ValueError(f"{_KV}: pass k and v together (or neither)")
    if k is not None and v is not None:
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            want = (q.shape[0], k.shape[1] if k.dim() == 4 else -1, cache.shape[2], cache.shape[3])
            if new.dim() != 4 or tuple(new.shape) != want or new.dtype != cache.dtype or new.device != cache.device:
                raise ValueError(f"{_KV}: {name} must be (batch, seqlen_new, heads_k, dim) = {want} {cache.dtype} on "
                                 f"{cache.device} like {name}_cache, got {tuple(new.shape)} {new.dtype} on "
                                 f"{new.device}")
    if cache_leftpad is not None and block_table is not None:
        raise ValueError(f"{_KV}: cache_leftpad and block_table cannot be used together (as in flash-attn); pass "
                         "one or the other")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError(f"{_KV}: cache_batch_idx and block_table cannot be used together (as in flash-attn)")
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] < q.shape[0]:
        raise ValueError(f"{_KV}: k_cache has {k_cache.shape[0]} rows but q has batch {q.shape[0]}; give every "
                         "sequence a row (sequence b uses row b, or pass cache_batch_idx)")


class _KvIndices(NamedTuple):
    """A call's checked indices (clamped into range on the device path) and its verdict (None: checked on the
    host, which raised if anything was wrong; else a 0-d bool tensor)."""

    lens: Tensor
    rows: Tensor | None
    leftpad: Tensor | None
    table: Tensor | None
    valid: Tensor | None
    report: Any  # the device-side verdict's report, deferred once the call is queued (None: host-checked)


def _kvcache_indices(q: Tensor, k_cache: Tensor, new: int, cache_seqlens: Any, cache_batch_idx: Any,
                     cache_leftpad: Any, block_table: Any, host: bool | None = None) -> _KvIndices:
    """Every index of the call as a rule of core._kv_checks, checked before anything is written: on the host
    (raising ValueError/TypeError here), or on the device (see that module). `host` forces the host check (the
    bound path's error message, worked out from copies of a flagged call's indices); None: by the device."""
    batch, device = q.shape[0], q.device
    page = k_cache.shape[1]
    if block_table is not None:
        if not isinstance(block_table, Tensor) or block_table.dim() != 2:
            raise ValueError(f"{_KV}: block_table must be a 2-D int32 tensor (batch, max_blocks), got "
                             f"{getattr(block_table, 'shape', type(block_table).__name__)}")
        block_table = check_index_tensor(_KV, "block_table", block_table, (batch, block_table.shape[1]), device)
    capacity = page * (block_table.shape[1] if block_table is not None else 1)
    room = f"the cache holds {capacity} positions per sequence" + (
        f" ({block_table.shape[1]} pages of {page} in block_table)" if block_table is not None else "")
    if new > capacity:
        raise ValueError(f"{_KV}: k appends {new} keys per sequence but {room}; append at most {capacity}")
    if cache_seqlens is None:
        cache_seqlens = 0 if new else capacity
    after = f" with {new} new keys appended after them" if new else ""
    allowed = f"0..{capacity - new} ({room}{after})"
    fix = "pass each sequence's current length; grow the cache (or its block_table) before appending past its end"
    if isinstance(cache_seqlens, Tensor):
        lens = check_index_tensor(_KV, "cache_seqlens", cache_seqlens, (batch,), device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(f"{_KV}: cache_seqlens={cache_seqlens} is out of range; allowed: {allowed}; {fix}")
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        raise TypeError(f"{_KV}: cache_seqlens must be an int or an int32 tensor (batch,), got "
                        f"{type(cache_seqlens).__name__} {cache_seqlens!r}")
    host = host_checks(device) if host is None else host
    rules: list[Rule] = []

    def add(rule: Rule) -> None:  # on the host each rule raises before the next one reads its values
        rules.append(rule)
        if host:
            raise_first(_KV, [rule])

    lens_rule = Bound("cache_seqlens", lens, 0, capacity - new, allowed, fix)
    add(lens_rule)
    lens = lens if host else lens_rule.clamped()
    rows = table = leftpad = None
    if cache_batch_idx is not None:
        rows = check_index_tensor(_KV, "cache_batch_idx", cache_batch_idx, (batch,), device)
        rows_rule = Bound("cache_batch_idx", rows, 0, k_cache.shape[0] - 1,
                          f"0..{k_cache.shape[0] - 1} (k_cache has {k_cache.shape[0]} rows)",
                          "pass the k_cache row of each sequence")
        add(rows_rule)
        rows = rows if host else rows_rule.clamped()
        if new:
            add(Unique("cache_batch_idx", rows, "distinct rows when k/v are appended (flash-attn leaves "
                                "two sequences writing one row undefined)", "give each sequence its own cache row"))
    if block_table is not None:
        num_pages = k_cache.shape[0]
        pages_used = (lens.long() + new + page - 1) // page
        used = torch.arange(block_table.shape[1], device=device).unsqueeze(0) < pages_used.unsqueeze(1)
        table_rule = Bound("block_table", block_table, 0, num_pages - 1,
                           f"page ids 0..{num_pages - 1} (k_cache holds {num_pages} pages) in the entries each "
                           f"sequence uses (the first ceil((cache_seqlens + {new}) / {page}) of its row)",
                           "point every used entry at an existing page", where=used)
        add(table_rule)
        table = block_table if host else table_rule.clamped()
        if new:
            positions = lens.long().unsqueeze(1) + torch.arange(new, device=device)
            slots = table.long().gather(1, positions // page) * page + positions % page
            add(Unique("block_table", slots, "distinct pages for the positions each sequence appends to",
                                "give each sequence its own page for the positions it appends (share only full "
                                "prefix pages)", divisor=page))
    if cache_leftpad is not None:
        leftpad = check_index_tensor(_KV, "cache_leftpad", cache_leftpad, (batch,), device)
        pad_rule = Bound("cache_leftpad", leftpad, 0, lens + new,
                         f"0..cache_seqlens[b]{' + ' + str(new) if new else ''} (a sequence's keys are the cache "
                         "positions [cache_leftpad[b], its end))", "pass each sequence's left padding")
        add(pad_rule)
        leftpad = leftpad if host else pad_rule.clamped()
    if host:
        return _KvIndices(lens, rows, leftpad, table, None, None)
    return _KvIndices(lens, rows, leftpad, table, *device_verdict(_KV, rules, device))


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> Any:
    """Decode and chunked prefill against a KV cache (see the module docstring): q (batch, seqlen_q, heads, dim);
    k_cache/v_cache (batch_cache, seqlen_cache, heads_k, dim), or with `block_table` (batch, max_blocks) int32
    paged (num_blocks, block_size, heads_k, dim); k/v (batch, seqlen_new, heads_k, dim) appended in place.
    Every index is checked before anything is written (opdispatch.core._kv_checks).

    The bound path: a call whose signature (every shape, dtype and device, the flags, the context) was seen runs
    the `_KvcacheBound` made for it — its index values checked, the append as one indexed store, the kernel bound
    to its class called with the lengths — instead of validating and deciding again (`_kvcache_reference`)."""
    del num_splits  # flash-attn's split-KV scheduling: the chosen kernel schedules itself
    key = None
    if (alibi_slopes is None and cache_leftpad is None and type(q) is Tensor and type(k_cache) is Tensor
            and type(v_cache) is Tensor and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int and not _is_compiling()
            and not _inside.active):
        manager = _api._manager or _api.get_manager()
        try:
            # (`_tensor_key` written out for the arguments a decode step passes: no call per argument; ``stride()[-1]``,
            # its value, costs less than ``stride(-1)``'s argument parsing — a 0-d tensor's IndexError: not keyed.)
            key = (_KV_BOUND, q.shape, q.dtype, q.device, q.stride()[-1], k_cache.shape, k_cache.dtype, k_cache.device,
                   k_cache.stride()[-1], v_cache.shape, v_cache.dtype, v_cache.device, v_cache.stride()[-1],
                   (k.shape, k.dtype, k.device, k.stride()[-1]) if type(k) is Tensor else _tensor_key(k),
                   (v.shape, v.dtype, v.device, v.stride()[-1]) if type(v) is Tensor else _tensor_key(v),
                   (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device, cache_seqlens.stride()[-1])
                   if type(cache_seqlens) is Tensor else _lengths_key(cache_seqlens),
                   None if cache_batch_idx is None else _tensor_key(cache_batch_idx),
                   None if block_table is None else _tensor_key(block_table),
                   None if rotary_cos is None else _tensor_key(rotary_cos),
                   None if rotary_sin is None else _tensor_key(rotary_sin), rotary_interleaved,
                   rotary_interleaved.__class__, softmax_scale, softmax_scale.__class__, causal, causal.__class__,
                   window_size, softcap, softcap.__class__, return_softmax_lse, return_softmax_lse.__class__,
                   _grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                        or (k is not None and k.requires_grad)
                                        or (v is not None and v.requires_grad)),
                   _overrides(), _module(), _deterministic(), _profiling())
            bound = manager.fast[key]
        except KeyError:
            pass  # the first call of this signature: the reference path remembers it
        except (TypeError, RuntimeError, IndexError):
            key = None  # an argument that cannot key (a tensor subclass, an unhashable value): checked every call
        else:
            out = bound(manager, key, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, block_table)
            if out is not _REFERENCE:
                return out
            key = None  # an index the reference path refuses, with its own error
    return _kvcache_reference(key, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                              rotary_interleaved, alibi_slopes, return_softmax_lse)


_log = logging.getLogger("opdispatch")
_KV_BOUND = "compat.flash_attn_with_kvcache"  # its keys' first field: never one of an op's
_REFERENCE: Any = object()  # a bound call handing itself to the reference path (which raises the error)


def _tensor_key(t: Any) -> Any:
    """An optional tensor argument's part of the bound path's key (TypeError: not a plain tensor)."""
    if t is None:
        return None
    if type(t) is not Tensor:
        raise TypeError("not keyed")
    return t.shape, t.dtype, t.device, t.stride(-1)


def _lengths_key(cache_seqlens: Any) -> Any:
    """cache_seqlens' part of the key: an int's value is checked per call, a tensor's shape, dtype and device
    keyed (its values are data)."""
    if type(cache_seqlens) is int:
        return int
    return _tensor_key(cache_seqlens)


def _kvcache_reference(key: Any, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                       rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Any,
                       cache_batch_idx: Any, cache_leftpad: Any, block_table: Any, softmax_scale: float | None,
                       causal: bool, window_size: Any, softcap: float, rotary_interleaved: bool,
                       alibi_slopes: Tensor | None, return_softmax_lse: bool) -> Any:
    """The reference path: check everything, append, attend through opdispatch.attention's own KV cache. With a
    `key`, the kernel is bound for the call's class and a `_KvcacheBound` remembered under it."""
    raise_pending(q.device)  # an earlier call's failed device-side check
    _check_kvcache(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin)
    _window_bounds(window_size)  # a malformed window is refused before anything is written
    new = k.shape[1] if k is not None else 0
    lens, rows, leftpad, table, valid, report = _kvcache_indices(q, k_cache, new, cache_seqlens, cache_batch_idx,
                                                                 cache_leftpad, block_table)
    q_unrotated, k_unrotated = q, k
    capacity = k_cache.shape[1] * (table.shape[1] if table is not None else 1)
    local = _is_local(window_size, causal, capacity)
    if rotary_cos is not None and rotary_sin is not None:
        q, k = _rotate(q, k, rotary_cos, rotary_sin, lens, rotary_interleaved, local)
    if rows is None and table is None and k_cache.shape[0] != q.shape[0]:
        rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)  # more rows than sequences: b uses b
    if rows is not None:  # rows of the cache, in any order: one page per row (no copy)
        table = rows.unsqueeze(1)
    if k is not None and v is not None:
        _append(k_cache, v_cache, k, v, lens, table, valid)
        lens = lens + new
    if leftpad is not None:
        k_cache, v_cache, lens = _drop_leftpad(k_cache, v_cache, lens, leftpad, table)
        table = None
    if key is None or q.shape[0] == 0:
        result = _run(q, k_cache, v_cache, "bshd", 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      False, return_softmax_lse, seqused_k=lens, block_table=table)
    else:
        def remember(fn: Any) -> None:
            if fn.decision.policy_hash == manager.policy.hash:
                bounded_put(manager.fast, key, _KvcacheBound(fn, call, q_unrotated, k_cache, k_unrotated, block_table,
                                                             cache_batch_idx, cache_seqlens, local, rotary_interleaved))

        manager = _api._manager or _api.get_manager()
        call = validate_attention(q, k_cache, v_cache, layout="bshd", causal=causal, causal_alignment="bottom_right",
                                  window=_window(window_size, causal), scale=softmax_scale, softcap=softcap,
                                  return_lse=return_softmax_lse, seqused_k=lens, block_table=table, module=_module())
        raise_if_capturing("attention", call)
        _inside.active = 1
        try:
            result = manager.run_bound("attention", call, None, (q, k_cache, v_cache, lens, table, None, None),
                                       remember)
        finally:
            _inside.active = 0
    if valid is None:
        return result
    defer(report)  # after the op: this call's own check must not raise from inside it
    return poisoned(result, valid)


class _KvcacheBound:
    """flash_attn_with_kvcache bound for one signature: what the reference path derives from shapes, kept, and
    the attention kernel bound for the call's class (`fn`, taking q, k_cache, v_cache, seqused_k, block_table).
    A call checks its index values — on the host (CPU) by reading them, handing a call with any bad one to the
    reference path, which raises its error before writing; on the device without a sync (clamped indices, an
    all-or-nothing append, a NaN result, the error raised by the next call: core._kv_checks) — then appends with
    one indexed store per cache and calls `fn` with the lengths. No mask, no cu_seqlens, no validation or
    decision. Neither the caches nor any call's tensors are kept."""

    __slots__ = ("fn", "decision", "signature", "described", "call", "batch", "new", "page", "capacity",
                 "cache_rows", "paged", "own_rows", "row_table", "steps", "columns", "page_starts", "no_lengths",
                 "local", "interleaved", "recheck", "nan", "fused", "device")

    def __init__(self, fn: Any, call: Any, q: Tensor, k_cache: Tensor, k: Tensor | None, block_table: Tensor | None,
                 cache_batch_idx: Tensor | None, cache_seqlens: Any, local: bool, interleaved: bool) -> None:
        # What invalidation reads: a demotion, or a policy swap, drops this entry with the function it holds.
        self.fn, self.decision, self.signature = fn, fn.decision, fn.signature
        self.described = getattr(fn, "described", None) or call.describe()
        self.call = call.stripped()  # to run the attention again after the kernel failed (`_attend_again`)
        device = self.device = q.device  # keyed: every call's q is on it
        self.batch, self.page, self.cache_rows = q.shape[0], k_cache.shape[1], k_cache.shape[0]
        self.new = k.shape[1] if k is not None else 0
        self.paged = block_table is not None
        width = block_table.shape[1] if block_table is not None else 1
        self.capacity = self.page * width
        self.columns = torch.arange(width, device=device)
        self.page_starts = self.columns * self.page  # entry j is read when a sequence holds more than j * page keys
        # Dense without cache_batch_idx: sequence b is row b; with more rows than sequences, the kernel reads the
        # cache as one page per row, as the reference path has it.
        own = not self.paged and cache_batch_idx is None
        self.own_rows = torch.arange(self.batch, device=device).unsqueeze(1) if own else None
        self.row_table = (torch.arange(self.batch, dtype=torch.int32, device=device).unsqueeze(1)
                          if own and self.cache_rows != self.batch else None)
        self.steps = torch.arange(self.new, device=device)
        self.no_lengths = torch.full((self.batch,), 0 if self.new else self.capacity, dtype=torch.int32,
                                     device=device)  # without cache_seqlens: the reference path's lengths
        self.local, self.interleaved = local, interleaved
        # NaN as a 0-d tensor made once (a Python float is wrapped into a tensor at every call); 0-d, it takes on
        # the result's dtype in torch.where.
        self.nan = torch.full((), _NAN, dtype=torch.float32, device=device)
        self.recheck = _Recheck(self.batch, self.cache_rows, self.page, self.new, cache_batch_idx is not None,
                                width if self.paged else 0)
        # The device-side check and append as Triton kernels (one, or two for a large block table) where Triton
        # can take the call (a GPU), else torch ops.
        self.fused = (FusedAppend(self.batch, self.new, width if self.paged else 0, self.page, self.cache_rows,
                                  self.capacity, cache_batch_idx is not None, self.paged, k_cache.shape[2],
                                  k_cache.shape[3], device)
                      if self.new and _kv_append.available(device, self.batch, self.new, width if self.paged else 0,
                                                           cache_batch_idx is not None) else None)

    def __call__(self, manager: Any, key: Any, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None,
                 v: Tensor | None, cos: Tensor | None, sin: Tensor | None, cache_seqlens: Any, rows: Any,
                 table: Any) -> Any:
        device, new = self.device, self.new
        raise_pending(device)  # an earlier call's failed device-side check
        if cache_seqlens is None:
            lens = self.no_lengths
        elif type(cache_seqlens) is int:
            if not 0 <= cache_seqlens <= self.capacity - new:
                return _REFERENCE
            lens = torch.full((self.batch,), cache_seqlens, dtype=torch.int32, device=device)
        else:
            lens = cache_seqlens
        row: ReportRow | None = None  # the fused verdict's report row, deferred once the attention is queued
        scratch: Scratch | None = None  # the fused path's buffers (its verdict, lengths, clamped indices)
        stream: int | None = None  # the stream its kernels were launched on directly (None: through Triton's jit)
        fused, index = self.fused, None
        if host_checks(device):
            if not self._valid_on_host(lens, rows, table, type(cache_seqlens) is Tensor):
                return _REFERENCE
            bad = report = None
        else:
            if fused is not None and k is not None and v is not None and cos is None:
                scratch, row, report, stream = self._fused_append(fused, lens, rows, table, k, v, k_cache, v_cache)
            if scratch is not None:
                # Checked and appended by the Triton kernels (core.compat._kv_append); the lengths come back grown.
                lens, bad = scratch.lens_out, scratch.bad
                if self.paged:
                    table = scratch.safe
                elif rows is not None:
                    rows = scratch.safe
                k = v = None  # appended
            else:
                lens, rows, table, bad, report, index = self._checked_on_device(lens, rows, table, cache_seqlens)
                if row is not None:  # the fused verdict was queued before its append failed: it reports this call
                    report = None
        if cos is not None and sin is not None:
            q, k = _rotate(q, k, cos, sin, lens, self.interleaved, self.local)
        if k is not None and v is not None:
            if index is None:  # (the device path's paged check made it)
                positions = lens.unsqueeze(1) + self.steps  # (batch, new) int64: where each new key goes
                if self.paged:
                    index = (table.gather(1, positions // self.page), positions % self.page)
                else:
                    row_index = self.own_rows if rows is None else rows.unsqueeze(1)
                    assert row_index is not None  # dense without cache_batch_idx: own_rows
                    index = (row_index, positions)
            if bad is not None:  # an invalid call writes each slot's old value back: nothing changes
                k, v = torch.where(bad, k_cache[index], k), torch.where(bad, v_cache[index], v)
            k_cache.index_put_(index, k)
            v_cache.index_put_(index, v)
            lens = lens + new
        kernel_table = table if self.paged else self.row_table if rows is None else rows.unsqueeze(1)
        _inside.active = 1
        try:
            result = self.fn(q, k_cache, v_cache, lens, kernel_table)
        except Exception as exc:  # the breaker decides, as for the op's own fast path
            result = _fast_path_failed(manager, key, self.fn, exc, self._attend_again,
                                       (q, k_cache, v_cache, lens, kernel_table))
        finally:
            _inside.active = 0
            if row is not None:  # queued (the verdict kernel writes it), so deferred even if the attention raised
                defer_written(row, self.recheck, scratch.stream if scratch is not None else None)
        if bad is None:
            return result
        # After the kernel: this call's own error is raised by a later call, never from inside this one.
        if report is not None:  # a device tensor (the torch-op check, or the fused one under CUDA graph capture)
            defer_report(device, report, self.recheck)
        if scratch is not None and fused is not None and fused.poison(scratch, result, stream):
            return result  # NaN in place by one kernel, where the verdict is bad
        if type(result) is tuple:
            return tuple(torch.where(bad, self.nan, r) if r.is_floating_point() else r for r in result)
        return torch.where(bad, self.nan, result)

    def _fused_append(self, fused: FusedAppend, lens: Tensor, rows: Tensor | None, table: Tensor | None, k: Tensor,
                      v: Tensor, k_cache: Tensor, v_cache: Tensor
                      ) -> tuple[Scratch | None, ReportRow | None, Tensor | None, int | None]:
        """The fused check and append: (the call's buffers, the report ring row the verdict kernel writes — or,
        under CUDA graph capture, None and a device report for `defer_report`, as a replay must not write a ring
        row the host hands out again —, the stream its kernels were launched on directly, for the NaN kernel's:
        `stream_for`'s). Where its kernels fail to compile or launch (synchronous errors: the
        verdict kernel writes only its own outputs, so nothing of the caches was written) (None, the row if the
        verdict kernel was queued, None, None) — this signature then keeps the torch ops, with one warning naming the
        error."""
        device = lens.device
        row = None
        try:
            stream = stream_for(fused.index)  # the current device and stream checked once for this call's launches
            scratch = fused.scratch(device, stream)
            if scratch.kept and fused.report_on_host:
                row = report_row(device, fused.report_width, torch.int32)
                try:
                    fused(lens, rows, table, k, v, k_cache, v_cache, row.tensor, scratch, stream)
                    return scratch, row, None, stream
                except ValueError:  # Triton's launcher: "Pointer argument ... cannot be accessed from Triton"
                    release_row(row)  # nothing was queued: the host row is not mapped; a device report from now on
                    row, fused.report_on_host = None, False
            # CUDA graph capture (fresh buffers: a replay must not write a ring row the host hands out again), or
            # a device that cannot write the ring: the report as a device tensor, copied by `defer_report`.
            report = torch.empty(fused.report_width, dtype=torch.int32, device=device)
            fused(lens, rows, table, k, v, k_cache, v_cache, report, scratch, stream)
            return scratch, None, report, stream
        except Exception as exc:  # a Triton compile or launch error, never a bad index (those are data)
            self.fused = None
            _log.warning("flash_attn_with_kvcache: the fused KV-cache check and append failed (%s: %s); this "
                         "signature uses the torch-op check from now on (OPDISPATCH_KV_APPEND=torch does so "
                         "everywhere)", type(exc).__name__, exc)
            if row is not None and not isinstance(exc, VerdictQueued):
                release_row(row)  # nothing that writes it was queued
                row = None
            return None, row, None, None  # a row: the verdict kernel was queued before the append failed, and writes it

    def _attend_again(self, manager: Any, key: Any, q: Tensor, k_cache: Tensor, v_cache: Tensor, lens: Tensor,
                      table: Tensor | None) -> Any:
        """The attention of a call whose bound kernel raised (the append is done): decided again, failing over
        as the op's own calls do."""
        del key
        return manager.call("attention", self.call.with_tensors(q, k_cache, v_cache, lens, table))

    def _valid_on_host(self, lens: Tensor, rows: Tensor | None, table: Tensor | None, lens_given: bool) -> bool:
        """Whether every index the reference path checks holds (read on the host: CPU, or sync checks)."""
        new, page = self.new, self.page
        if lens_given and not _within(lens, 0, self.capacity - new):
            return False
        if rows is not None:
            if not _within(rows, 0, self.cache_rows - 1):
                return False
            if new and _repeats(rows):
                return False
        if table is not None:
            used = self.columns < ((lens + (new + page - 1)) // page).unsqueeze(1)  # the entries the call reads
            if not _within(torch.where(used, table, 0), 0, self.cache_rows - 1):
                return False
            if new:
                positions = lens.unsqueeze(1) + self.steps
                slots = table.gather(1, positions // page).long() * page + positions % page
                if _repeats(slots):
                    return False
        return True

    def _checked_on_device(self, lens: Tensor, rows: Tensor | None, table: Tensor | None, cache_seqlens: Any
                           ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None,
                                      tuple[Tensor, Tensor] | None]:
        """The same checks without a host read: (lens, rows, table) clamped into range; `bad`, a (1,) bool tensor
        that is True when any index was bad (None: nothing to check on the device); and the report for
        `defer_report` — ``[bad, lens, rows, table]`` as given, one int32 row that `recheck` reads on the host;
        and a paged append's index (its pages and offsets, which the check of distinct slots needs anyway).
        Each argument's check is one clamp and one comparison; the flags are reduced once."""
        new, page = self.new, self.page
        flags, index = [], None
        given = [lens]  # what the report copies: the lengths (given or built), the rows and the table as passed
        if type(cache_seqlens) is Tensor:  # an int was checked on the host, and None is always in range
            safe = lens.clamp(0, self.capacity - new)
            flags.append(safe != lens)
            lens = safe
        if rows is not None:
            given.append(rows)
            safe = rows.clamp(0, self.cache_rows - 1)
            flags.append(safe != rows)
            if new:
                ordered = safe.sort().values
                flags.append(ordered[1:] == ordered[:-1])
            rows = safe
        if table is not None:
            given.append(table.flatten())
            used = self.page_starts < (lens + new).unsqueeze(1)  # the entries the call reads
            safe = torch.where(used, table.clamp(0, self.cache_rows - 1), table)
            flags.append((safe != table).flatten())
            if new:
                positions = lens.unsqueeze(1) + self.steps
                index = (safe.gather(1, positions // page), positions % page)
                ordered = index[1].add(index[0], alpha=page).flatten().sort().values  # slots, in int64
                flags.append(ordered[1:] == ordered[:-1])
            table = safe
        if not flags:
            return lens, rows, table, None, None, None
        bad = (torch.cat(flags) if len(flags) > 1 else flags[0]).any(0, keepdim=True)
        return lens, rows, table, bad, torch.cat([bad, *given]), index


_NAN = float("nan")


def _within(values: Tensor, low: int, high: int) -> bool:
    """Whether every value lies in [low, high] (a host read; a short tensor as a list: cheaper than a kernel)."""
    if values.numel() <= 32:
        listed = values.flatten().tolist()
        return bool(low <= min(listed) and max(listed) <= high)
    least, most = torch.aminmax(values)
    return low <= int(least) and int(most) <= high


def _repeats(values: Tensor) -> bool:
    """Whether any value occurs twice (a host read)."""
    ordered = values.flatten().sort().values
    return bool((ordered[1:] == ordered[:-1]).any())


class _Recheck:
    """The message of a bound call that the device found bad: the reference path's host check run on the host copy
    of its report (`_KvcacheBound._checked_on_device`'s row: verdict, lengths, rows, table — on the error path
    only). One per bound signature: nothing is made per call."""

    __slots__ = ("batch", "cache_rows", "page", "new", "has_rows", "width")

    def __init__(self, batch: int, cache_rows: int, page: int, new: int, has_rows: bool, width: int) -> None:
        self.batch, self.cache_rows, self.page, self.new = batch, cache_rows, page, new
        self.has_rows, self.width = has_rows, width  # width: block_table's (0: dense)

    def __call__(self, row: Tensor) -> str:
        batch = self.batch
        lens, row = row[1:1 + batch], row[1 + batch:]
        rows = row[:batch] if self.has_rows else None
        table = row[batch if self.has_rows else 0:].view(batch, self.width) if self.width else None
        q, k_cache = torch.empty(batch, 0), torch.empty(self.cache_rows, self.page, 0)
        try:
            _kvcache_indices(q, k_cache, self.new, lens, rows, None, table, host=True)
        except ValueError as exc:
            return str(exc)
        return (f"{_KV}: the device-side check flagged an index that the host check of the same values accepts "
                "(an opdispatch bug: please report it)")


def _drop_leftpad(k_cache: Tensor, v_cache: Tensor, lens: Tensor, leftpad: Tensor,
                  rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence i's keys are cache positions [leftpad[i], lens[i]): gathered to start at 0 (a copy: the op's KV
    cache reads each sequence from its first position), with their lengths. `rows`: the one-page-per-row table of
    a cache_batch_idx, else row i. The indices were checked (or clamped) by _kvcache_indices."""
    batch, capacity = leftpad.shape[0], k_cache.shape[1]
    row = (rows[:, 0].long() if rows is not None else torch.arange(batch, device=k_cache.device)).unsqueeze(1)
    positions = (leftpad.long().unsqueeze(1) + torch.arange(capacity, device=k_cache.device)).clamp_(max=capacity - 1)
    return k_cache[row, positions], v_cache[row, positions], lens - leftpad


def _is_local(window_size: Any, causal: bool, capacity: int) -> bool:
    """Whether flash-attn's kernel masks causally or by a window, which puts each query's rotary at its own
    position: it first drops window bounds of `capacity` (the cache's length) or more, as no key is that far."""
    left, right = _window_bounds(window_size)
    if causal:
        right = 0
    return 0 <= left < capacity or 0 <= right < capacity


def _rotate(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, lens: Tensor, interleaved: bool,
            q_at_own_positions: bool) -> tuple[Tensor, Tensor | None]:
    """flash-attn's rotary in with_kvcache: new keys at cache_seqlens + i; q at cache_seqlens + i when causal or
    windowed, else every query at cache_seqlens."""
    if k is not None:
        if q_at_own_positions and q.shape[1] == k.shape[1]:  # one call for both (the op needs equal lengths)
            q, k = rotary_embedding(q, k, cos, sin, seqlen_offsets=lens, interleaved=interleaved)
            return q, k
        _, k = rotary_embedding(k, k, cos, sin, seqlen_offsets=lens, interleaved=interleaved)
    if q_at_own_positions:
        q, _ = rotary_embedding(q, q, cos, sin, seqlen_offsets=lens, interleaved=interleaved)
    else:
        positions = lens.long()[:, None].expand(q.shape[0], q.shape[1])
        q, _ = rotary_embedding(q, q, cos, sin, positions=positions, interleaved=interleaved)
    return q, k


def _append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, lens: Tensor, block_table: Tensor | None,
            valid: Tensor | None) -> None:
    """Write the new keys/values into the caches in place, sequence i from position lens[i] (indexed on the
    device: no host read). The indices were checked (host) or clamped into range (device: `valid` says whether
    the call is valid, and an invalid one writes each slot's old value back — all or nothing)."""
    new = k.shape[1]
    positions = lens.long().unsqueeze(1) + torch.arange(new, device=k.device)  # (batch, new)
    if block_table is None:
        index: tuple[Tensor, Tensor] = (torch.arange(k.shape[0], device=k.device).unsqueeze(1), positions)
    else:
        block = k_cache.shape[1]
        index = (block_table.long().gather(1, positions // block), positions % block)
    if valid is not None:
        k = torch.where(valid, k, k_cache[index])
        v = torch.where(valid, v, v_cache[index])
    k_cache[index] = k
    v_cache[index] = v
