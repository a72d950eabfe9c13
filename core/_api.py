"""The public entry points: `attention`, `explain`, and the process-wide OpManager behind them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._attention import validate_attention
from ._rms_norm import validate_rms_norm
from ._rotary import validate_rotary_embedding
from ._decision import Decision
from ._device import DeviceInfo, load_device_descriptor
from ._graphs import is_capturing, raise_if_capturing
from ._manager import OpManager
from ._state import bounded_put
from .policies._overrides import MODULE, OVERRIDES

_manager: OpManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> OpManager:
    """The process-wide OpManager (created on first use; plugins load lazily)."""
    global _manager
    manager = _manager
    if manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = OpManager()
            manager = _manager
    return manager


def set_manager(manager: OpManager | None) -> OpManager | None:
    """Replace the process-wide manager (tests, embedding); returns the previous one."""
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
    return previous


_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_overrides = OVERRIDES.get
_module = MODULE.get
_deterministic = torch.are_deterministic_algorithms_enabled


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bshd", causal: bool = False,
    causal_alignment: str = "top_left", window: tuple[int, int] | None = None, scale: float | None = None,
    dropout_p: float = 0.0, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, return_lse: bool = False,
    deterministic: bool = False, impl: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, computed by the best implementation the device and the policy allow.

    Layouts: ``bshd`` (default), ``bhsd``, ``sbhd``, and ``thd`` (packed variable-length sequences described
    by int32 ``cu_seqlens_q``/``cu_seqlens_k``). k/v may have fewer heads than q (grouped-query attention).
    ``causal_alignment`` says where the causal diagonal sits when seqlen_q != seqlen_k: ``top_left`` (query i
    sees keys j <= i) or ``bottom_right`` (the last query sees the last key). ``window=(left, right)`` keeps
    keys within that distance of the (aligned) diagonal, -1 meaning unbounded. ``softcap`` applies
    ``softcap * tanh(scores / softcap)``; ``alibi_slopes`` adds ``-slope * |i + offset - j|``; ``attn_mask`` is
    a bool tensor (True = attend); ``attn_bias`` an additive float tensor. ``impl="vendor.name"`` pins one
    implementation for this call (it never falls back). Returns ``out`` in the input layout, or
    ``(out, lse)`` with ``return_lse=True`` (lse: float32 (batch, heads, seqlen_q), or (heads, total_q) for thd).
    """
    if _is_compiling():
        from ._compile import attention_for_compile

        return attention_for_compile(
            q, k, v, layout=layout, causal=causal, causal_alignment=causal_alignment, window=window, scale=scale,
            dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
            attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, return_lse=return_lse, deterministic=deterministic, impl=impl)
    manager = _manager or get_manager()
    key = None
    if (alibi_slopes is None and attn_mask is None and attn_bias is None and cu_seqlens_q is None
            and cu_seqlens_k is None):
        # Fast path: the key holds everything validation and selection depend on, so a hit means this exact
        # signature was validated and decided before. Written for the fewest bytecodes: every tensor attribute
        # read costs 0.1-0.3 µs here (benchmarks/results/dispatch_overhead-cpu.md), a dict subscript is
        # cheaper than .get, and requires_grad counts only with grad mode on — as AttentionCall defines it.
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad), layout, causal,
                   causal_alignment, window, scale, dropout_p, softcap, return_lse, deterministic, impl,
                   _overrides(), _module(), _deterministic())
            fn = manager.fast[key]
        except KeyError:
            pass  # the first call of this signature
        except (AttributeError, TypeError):  # not tensors, unhashable window…: the slow path says what is wrong
            key = None
        else:
            return fn(q, k, v)  # type: ignore[no-any-return]
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _attention_slow(
        manager, key, q, k, v, layout, causal, causal_alignment, window, scale, dropout_p, softcap, alibi_slopes,
        attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse, deterministic, impl)
    return result


def _attention_slow(manager: OpManager, key: Any, q: Any, k: Any, v: Any, layout: Any, causal: Any,
                    causal_alignment: Any, window: Any, scale: Any, dropout_p: Any, softcap: Any,
                    alibi_slopes: Any, attn_mask: Any, attn_bias: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                    max_seqlen_q: Any, max_seqlen_k: Any, return_lse: Any, deterministic: Any,
                    impl: Any) -> Any:
    """Validate, decide, and (for a fast-path `key`) remember the bound function for the next call."""
    varlen_key = _varlen_signature(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    checked = manager.checked_varlen
    known_same = None if varlen_key is None else checked.get(varlen_key)
    if known_same is None and varlen_key is not None and is_capturing(cu_seqlens_q.device):
        known_same = False  # never a first read inside CUDA graph capture: it would sync
    call = validate_attention(
        q, k, v, layout=layout, causal=causal, causal_alignment=causal_alignment, window=window, scale=scale,
        dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, attn_mask=attn_mask,
        attn_bias=attn_bias, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, return_lse=return_lse, deterministic=deterministic, module=_module(),
        check_values=known_same is None, varlen_same=known_same)
    if varlen_key is not None and known_same is None:
        bounded_put(checked, varlen_key, call.cu_seqlens_k is call.cu_seqlens_q)
    if key is None:
        return manager.call("attention", call, impl=impl)
    # A dense signature first seen inside CUDA graph capture: its class may be decided, but a kernel's first call
    # at a new shape may build a plan (cuDNN builds a graph per shape), which must not happen inside capture.
    raise_if_capturing("attention", call)
    fn = manager.bind("attention", call, impl=impl)
    # Store only if no policy swap happened meanwhile (the swap replaced `fast`; the hash tells).
    if fn.decision.policy_hash == manager.policy.hash:
        bounded_put(manager.fast, key, fn)
    return fn(q, k, v)


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
    return get_manager().bind("attention", call, impl=impl)  # type: ignore[no-any-return]


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


def resolve_device(device: DeviceInfo | str | os.PathLike[str] | None) -> DeviceInfo | None:
    """A DeviceInfo from a DeviceInfo, a descriptor path, or None (the tensors' own device)."""
    if device is None or isinstance(device, DeviceInfo):
        return device
    return load_device_descriptor(device)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str | None = None,
            device: DeviceInfo | str | os.PathLike[str] | None = None, **kwargs: Any) -> Decision:
    """Which implementation `attention(q, k, v, **kwargs)` would use, and why — for every candidate.

    `device` simulates another device: a DeviceInfo or the path of a YAML descriptor (configs/devices/). The
    tensors may then live on the ``meta`` device, since nothing is computed.
    """
    kwargs.setdefault("module", _module())
    call = validate_attention(q, k, v, check_values=not _is_meta(q), **kwargs)
    return get_manager().explain("attention", call, device=resolve_device(device), impl=impl)


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, *, impl: str | None = None) -> Any:
    """RMSNorm over the last dim by the best implementation the device and the policy allow.

    ``y = x / sqrt(mean(x**2, -1) + eps) * weight``; with `residual`, normalises ``h = x + residual`` and returns
    ``(y, h)`` (fused add-and-norm; the inputs are never modified). Statistics in float32 (float64 for float64);
    `y` has x's dtype. `impl` pins an implementation id (an error if it cannot take the call). The policy section
    is ``ops.rms_norm`` (`when:` keys dtype, hidden_size, tokens (rows of x), residual, weight, requires_grad, plus
    device keys); the env pin ``OPDISPATCH_IMPL_RMS_NORM``.
    """
    if _is_compiling():
        from ._compile_ops import rms_norm_for_compile

        return rms_norm_for_compile(x, weight, eps, residual, impl=impl)
    manager = _manager or get_manager()
    try:  # the per-call fast path, as attention's: the key holds everything validation and selection read
        key = ("rms_norm", x.shape, x.dtype, x.device, x.requires_grad, eps, _grad_enabled(), impl, _overrides(),
               _module(), None if weight is None else (weight.shape, weight.dtype, weight.device, weight.requires_grad),
               None if residual is None else (residual.shape, residual.dtype, residual.device, residual.requires_grad))
        fn = manager.fast[key]
    except KeyError:
        pass
    except (AttributeError, TypeError):  # not tensors, unhashable eps…: validation says what is wrong
        key = None
    else:
        return fn(x, weight, residual)
    call = validate_rms_norm(x, weight, eps, residual, module=_module())
    if key is None:
        return manager.call("rms_norm", call, impl=impl)
    return _bind_and_remember(manager, "rms_norm", key, call, impl)(x, weight, residual)


def _bind_and_remember(manager: OpManager, op: str, key: Any, call: Any, impl: str | None) -> Any:
    """Bind `call`'s implementation and remember it under the fast-path `key` (unless a policy swap happened
    meanwhile: the swap replaced `fast`, the hash tells)."""
    raise_if_capturing(op, call)  # a kernel's first call at a new shape may build a plan: never inside capture
    fn = manager.bind(op, call, impl=impl)
    if fn.decision.policy_hash == manager.policy.hash:
        bounded_put(manager.fast, key, fn)
    return fn


def explain_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None, *, impl: str | None = None,
                     device: DeviceInfo | str | os.PathLike[str] | None = None) -> Decision:
    """Why `rms_norm` with these arguments goes where it goes (every candidate, its status and reasons). `device`
    simulates another device, as for `explain`."""
    call = validate_rms_norm(x, weight, eps, residual, module=_module())
    return get_manager().explain("rms_norm", call, device=resolve_device(device), impl=impl)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     positions: torch.Tensor | None = None, seqlen_offsets: int | torch.Tensor | None = None,
                     interleaved: bool = False, layout: str = "bshd", cu_seqlens: torch.Tensor | None = None,
                     max_seqlen: int | None = None, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k by the best implementation the device and the policy allow.

    q/k: (batch, seqlen, heads, head_dim) for ``layout="bshd"``, or packed (total, heads, head_dim) for ``"thd"``
    with int32 ``cu_seqlens`` and ``max_seqlen``; k may have fewer heads. cos/sin: (max_positions, rotary_dim / 2)
    caches; the first rotary_dim channels rotate, the rest pass through. Pairs are (x[i], x[i + rotary_dim / 2])
    (GPT-NeoX) or, with ``interleaved=True``, (x[2i], x[2i + 1]) (GPT-J). A token's position is its index in its
    sequence plus ``seqlen_offsets`` (an int or one per sequence), or ``positions[token]``. Returns new
    ``(q_out, k_out)``. The policy section is ``ops.rotary_embedding`` (`when:` keys dtype, head_dim, rotary_dim,
    interleaved, varlen, positions, requires_grad, plus device keys); the env pin
    ``OPDISPATCH_IMPL_ROTARY_EMBEDDING``.
    """
    if _is_compiling():
        from ._compile_ops import rotary_embedding_for_compile

        return rotary_embedding_for_compile(q, k, cos, sin, positions=positions, seqlen_offsets=seqlen_offsets,
                                            interleaved=interleaved, layout=layout, cu_seqlens=cu_seqlens,
                                            max_seqlen=max_seqlen, impl=impl)
    manager = _manager or get_manager()
    key = _rotary_key(q, k, cos, sin, positions, seqlen_offsets, interleaved, layout, cu_seqlens, max_seqlen, impl)
    if key is not None:
        fn = manager.fast.get(key)
        if fn is not None:
            return fn(q, k, cos, sin, positions, seqlen_offsets, cu_seqlens)  # type: ignore[no-any-return]
    call = validate_rotary_embedding(q, k, cos, sin, positions=positions, seqlen_offsets=seqlen_offsets,
                                     interleaved=interleaved, layout=layout, cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, module=_module())
    if key is None:
        return manager.call("rotary_embedding", call, impl=impl)  # type: ignore[no-any-return]
    fn = _bind_and_remember(manager, "rotary_embedding", key, call, impl)
    return fn(q, k, cos, sin, positions, seqlen_offsets, cu_seqlens)  # type: ignore[no-any-return]


def _index_key(t: Any) -> Any:
    """An index tensor's part of a rotary fast-path key; raises TypeError for one whose values validation must
    read on every call (on the CPU, where reading them costs no sync)."""
    if t is None or isinstance(t, int):
        return t
    if t.device.type == "cpu":
        raise TypeError("checked per call")
    return (t.shape, t.dtype, t.device)


def _rotary_key(q: Any, k: Any, cos: Any, sin: Any, positions: Any, seqlen_offsets: Any, interleaved: Any,
                layout: Any, cu_seqlens: Any, max_seqlen: Any, impl: Any) -> Any:
    """The rotary fast-path key, or None when the call must be validated in full (CPU index tensors, whose values
    are range-checked per call; anything that is not a tensor). An int offset is part of the key: validation
    checks it against the caches."""
    try:
        key = ("rotary_embedding", q.shape, k.shape, q.dtype, k.dtype, q.device, k.device, cos.shape, sin.shape,
               cos.dtype, sin.dtype, cos.device, sin.device, cos.stride(-1), sin.stride(-1), _grad_enabled(),
               q.requires_grad, k.requires_grad, cos.requires_grad, sin.requires_grad, _index_key(positions),
               _index_key(seqlen_offsets), _index_key(cu_seqlens), max_seqlen, interleaved, layout, impl,
               _overrides(), _module())
        hash(key)
    except (AttributeError, TypeError, IndexError, RuntimeError):
        return None
    return key


def explain_rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                             impl: str | None = None, device: DeviceInfo | str | os.PathLike[str] | None = None,
                             **kwargs: Any) -> Decision:
    """Why `rotary_embedding` with these arguments goes where it goes. `device` simulates another device, as for
    `explain`; the tensors may then live on the ``meta`` device."""
    call = validate_rotary_embedding(q, k, cos, sin, module=_module(), check_values=not _is_meta(q), **kwargs)
    return get_manager().explain("rotary_embedding", call, device=resolve_device(device), impl=impl)
