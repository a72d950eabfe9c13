"""TransformerEngine's ``DotProductAttention``, dispatched by opdispatch: ``from opdispatch.compat.te import
DotProductAttention`` in place of ``from transformer_engine.pytorch import DotProductAttention``.

The constructor and ``forward`` signatures, defaults and semantics are TransformerEngine's, read from
NVIDIA/TransformerEngine ``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``
(with ``utils.py``: ``check_set_window_size``, ``get_full_mask``, ``get_alibi``; and ``backends.py``:
``UnfusedDotProductAttention``, TE's reference semantics) at commit d0067d0da6cb01811b8072a7d304f0e00344ce2b:

- ``qkv_format`` ``sbhd``/``bshd``/``thd`` (per call too), or packed ``qkv_layer``/``kv_layer`` with
  ``qkv_interleave_dim``; the output is ``(s, b, h*d)``, ``(b, s, h*d)`` or ``(t, h*d)`` as TE's.
- ``attention_mask`` in TE's convention, **True = masked out**: padding masks ``[b, 1, 1, s]`` (a tuple of the
  query's and the keys' for ``attention_type="cross"``), arbitrary masks broadcastable to ``[b, h, sq, skv]``.
- Mask types ``no_mask``, ``padding``, ``causal``, ``padding_causal``, ``causal_bottom_right``,
  ``padding_causal_bottom_right``, ``arbitrary`` (``"padding,causal"``/``"causal,padding"`` spell
  ``padding_causal``). ``causal``/``padding_causal`` align the diagonal top-left; everything else follows
  ``bottom_right_diagonal`` (default bottom-right), per sequence for padded and packed batches, as TE's.
- ``window_size`` checked and coerced exactly as ``check_set_window_size`` (its warnings included).
- Padding in ``sbhd``/``bshd`` (from ``attention_mask``, or ``cu_seqlens_q/kv`` which TE prefers): the kept
  tokens are packed and attended as ``thd``, so positions (the causal diagonal, the window, ALiBi) count kept
  tokens, and padded query rows come out as zeros — TE's fused kernels' behaviour, which assumes each
  sequence's real tokens come first (right padding; there TE's backends all agree). Without a gradient, and where
  it computes the same attention (no window, ALiBi or dropout; a causal mask only with one mask for queries and
  keys), forward makes one dense call with the padding as a boolean key mask instead — no host sync per call.
- ``thd`` with ``cu_seqlens_q_padded``/``cu_seqlens_kv_padded``: sequence i's tokens start at the padded offset;
  the tokens between sequences (and after the last) are skipped and come out as zeros.
- ``softmax_type`` ``vanilla``, ``off-by-one`` (a zero sink logit per head) and ``learnable`` (the
  ``softmax_offset`` parameter of shape ``[num_attention_heads // tp_size]``, zeros-initialised; its gradient
  flows), all through opdispatch's ``sinks=``.
- ``core_attention_bias_type`` ``no_bias``, ``post_scale_bias`` (added to the scaled scores), ``pre_scale_bias``
  (added before the scale: TE's unfused path computes ``(QK^T + bias) * scale``), ``alibi`` (``alibi_slopes``
  given, or TE's default slopes).
- ``attention_dropout`` in training mode only; ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (read at construction, as
  TE) or ``torch.use_deterministic_algorithms`` → ``deterministic=True``.
- TE's backend switches are a policy layer applied inside ``forward`` (see `te_switches`): ``NVTE_FLASH_ATTN=0``
  (and ``_V2``/``_V3``/``_V4``) deny the flash-attn family (vLLM's fork too), ``NVTE_FUSED_ATTN=0`` cuDNN (through
  torch or its frontend), ``NVTE_UNFUSED_ATTN=0``
  the unfused reference; ``explain`` shows them as a ``policy_override`` naming the variables.
- ``NVTE_DEBUG=1`` with ``NVTE_DEBUG_LEVEL=1``/``2`` (read when the module is constructed; TE reads them once at
  import, and sets the logger's level in every constructor): TE's ``AttentionLogging`` — the level is
  ``NVTE_DEBUG * NVTE_DEBUG_LEVEL``, 0 → WARNING (silent), 1 → INFO, 2 → DEBUG, any other product → DEBUG (as TE; a
  non-integer is refused), on the logger ``"DotProductAttention"`` with TE's format
  ``[%(levelname)-8s | %(name)-19s]: %(message)s`` when no handler would see it otherwise. Logged when the
  implementation opdispatch picks for a call's decision class (on its device) differs from the one last logged for
  that class (TE: when the call's AttentionParams change), before the call runs: at INFO
  ``Running with <backend> backend (opdispatch <id>)`` — ``nvidia.cudnn`` is TE's FusedAttention,
  ``nvidia.flash_attn``/``nvidia.flash`` FlashAttention 2, ``nvidia.flash_attn3``/``4`` FlashAttention 3/4,
  ``reference.math`` UnfusedDotProductAttention (`TE_BACKENDS`, the families TE's switches turn off), any other
  implementation by its id; at DEBUG also ``Running with config={...}`` (dtype, format, sizes, heads, head dims,
  mask, window, bias, dropout, deterministic, requires_grad, device, policy, switches), ``Disabling <backend>
  due to <reason>`` for every other candidate (opdispatch's explain reasons, or the NVTE_* switch that denied it),
  ``Available backends = {...}`` and ``Selected backend = ...``. With NVTE_DEBUG unset or 0, forward pays one
  comparison.

- Context parallelism (``cp_group``, ``cp_global_ranks``, ``cp_stream``, ``cp_comm_type``, in the constructor or
  ``set_context_parallel_group``; read at every forward, as TE): with a group of more than one rank each rank passes
  its shard of the sequence and gets its shard of the output, through
  ``opdispatch.distributed.context_parallel_attention`` with ``sharding="zigzag"`` — TE's DualChunkSwap layout
  (context_parallel.py ``attn_forward_func_with_cp``: 2·cp_size chunks, rank r holding chunks r and 2·cp_size−1−r,
  for every mask type). ``cp_comm_type`` ``"p2p"`` → ``mode="ring"``, ``"all_gather"`` → ``mode="allgather"``
  (the same attention); ``"a2a+p2p"`` whose a2a group has one rank is ``"p2p"`` over the other, as TE. A group of
  one rank is no context parallelism (TE's cp_size 1). ``cp_global_ranks`` must be the group's global ranks
  (TE's ring peers; required for p2p); ``cp_stream`` (TE's second stream for overlapping kernels) is None or a
  CUDA stream and does not change the result. Refused with context parallelism, each naming the argument:
  ``cp_comm_type`` ``"a2a"`` (and ``"a2a+p2p"`` with an a2a group of several ranks), ``qkv_format="thd"``, any
  mask type but ``no_mask``/``causal``, a sliding window, any bias, dropout in training, ``softmax_type`` other
  than ``vanilla`` (TE: a2a only), ``deterministic``, and keys of another length than the queries.

Refused with an error naming the argument (never dropped): ``return_max_logit=True``, an RNG tracker with
dropout, KV caching (``inference_params``), FP8 (``fp8_output=True``; this module has no FP8 autocast), the
experimental cuDNN ``score_mod*`` callbacks, a bias with packed or padded sequences, and any argument a mask
type does not use (``attention_mask`` with ``causal``, ``cu_seqlens_*`` without a padding mask). ``docs/te.md``
maps every argument and switch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.parameter import Parameter

from ..distributed import context_parallel_attention
from ..doors._api import attention, explain
from ..engine._current import get_manager
from ..ops._attention import validate_attention
from ..base._decision import CHOSEN, DENIED, ELIGIBLE
from ..engine._state import bounded_put
from opdispatch.policies._overrides import MODULE, OVERRIDES, policy_override, scope
from ._padding import pad_input, unpad_input

__all__ = ["DotProductAttention", "te_log_level", "te_switches"]

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd", "thd")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ATTENTION_TYPES = ("self", "cross")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# TE's cp_comm_type -> opdispatch.distributed.context_parallel_attention's mode computing the same attention:
# TE's AttnFuncWithCPAndKVP2P passes K/V around the ring, AttnFuncWithCPAndKVAllGather all-gathers them. TE's
# "a2a" (Ulysses: heads scattered, the full sequence gathered) has no opdispatch mode and is refused.
CP_MODES = {"p2p": "ring", "all_gather": "allgather"}
# The masks TE's context parallelism takes for bshd/sbhd (utils.get_attention_backend, "Filter: Context
# parallelism") that opdispatch's also takes: none, or causal over the whole sequence.
CP_MASK_TYPES = ("no_mask", "causal")

# TE's backend switches (utils.get_attention_backend reads each as int(os.environ.get(name, "1"))) and the
# opdispatch implementations each one turns off when set to 0.
SWITCHES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NVTE_FLASH_ATTN", ("nvidia.flash_attn", "nvidia.flash_attn3", "nvidia.flash_attn4", "nvidia.flash",
                         "nvidia.vllm_flash_attn")),
    ("NVTE_FLASH_ATTN_V2", ("nvidia.flash_attn", "nvidia.flash")),  # torch's flash backend is FA2
    ("NVTE_FLASH_ATTN_V3", ("nvidia.flash_attn3", "nvidia.vllm_flash_attn")),  # vLLM's fork: FA3 on Hopper
    ("NVTE_FLASH_ATTN_V4", ("nvidia.flash_attn4",)),
    ("NVTE_FUSED_ATTN", ("nvidia.cudnn", "nvidia.cudnn_frontend")),  # cuDNN, through torch or its own frontend
    ("NVTE_UNFUSED_ATTN", ("reference.math",)),
)

_NAME = "opdispatch.compat.te.DotProductAttention"
# forward's fast path takes these argument types only (a bool where an int is meant, or an int where a bool is,
# would otherwise match a checked signature by equal hash and skip its check).
_FLAG_TYPES = (type(None), bool)
_LENGTH_TYPES = (type(None), int)

# TE's backend families (what TE's log lines name) for the implementations its switches turn off; any other
# opdispatch implementation is named by its id alone.
TE_BACKENDS: dict[str, str] = {
    "nvidia.flash_attn": "FlashAttention 2", "nvidia.flash": "FlashAttention 2",
    "nvidia.flash_attn3": "FlashAttention 3", "nvidia.flash_attn4": "FlashAttention 4",
    "nvidia.vllm_flash_attn": "FlashAttention 3", "nvidia.cudnn": "FusedAttention",
    "nvidia.cudnn_frontend": "FusedAttention", "reference.math": "UnfusedDotProductAttention",
}

# TE's attention logging (utils.AttentionLogging; dot_product_attention.py's DotProductAttention.__init__): the
# logger named "DotProductAttention", its level from NVTE_DEBUG * NVTE_DEBUG_LEVEL, and a stream handler with
# TE's format when no handler would otherwise see its records.
LOGGER_NAME = "DotProductAttention"
LOG_FORMAT = "[%(levelname)-8s | %(name)-19s]: %(message)s"
_LOG_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_stream_handler: logging.Handler | None = None

# What has been logged, process-wide as TE's `_attention_backends`: the dispatch keys (decision class, device,
# policy, overrides, scope) already looked at, and per (decision class, device) the implementation last logged.
_SEEN_KEYS: dict[Any, None] = {}
_UNREAD = object()
_LOGGED_CHOICE: dict[Any, str | None] = {}


def _switch_off(name: str, raw: Any = _UNREAD) -> bool:
    """Whether switch `name` is 0: its value `raw` (as read from os.environ or its encoded dict; None = unset), or
    read now."""
    raw = os.environ.get(name) if raw is _UNREAD else raw
    raw = "1" if raw is None else os.fsdecode(raw)
    try:
        return int(raw) == 0
    except ValueError:
        raise ValueError(f"{_NAME}: environment variable {name}={raw!r} is not an integer; TransformerEngine reads "
                         f"it as int (0 = off, 1 = on)") from None


_SWITCH_NAMES = tuple(name for name, _ in SWITCHES)
# os.environ keeps its variables in `_data` under encoded names (POSIX: bytes); os.environ.get reads that dict
# through an encode/decode wrapper per name. Reading the dict itself gives the same values — every change made
# through os.environ lands there, and a bare putenv is invisible to os.environ.get too — at one dict lookup a
# name, so forward reads all six switches afresh every call (as TE, which reads them per call) for well under a
# microsecond. The parsed result is cached per raw tuple of values.
_SWITCH_KEYS = tuple(os.fsencode(name) for name in _SWITCH_NAMES) if os.name == "posix" else None
_SWITCH_STATES: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _raw_switches() -> tuple[Any, ...]:
    data = getattr(os.environ, "_data", None)
    if _SWITCH_KEYS is not None and type(data) is dict:
        return tuple(map(data.get, _SWITCH_KEYS))
    return tuple(map(os.environ.get, _SWITCH_NAMES))


def te_switches() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the NVTE_* switches set to 0, the opdispatch implementation ids they deny), from the environment now."""
    raw = _raw_switches()
    state = _SWITCH_STATES.get(raw)
    if state is not None:
        return state
    names: list[str] = []
    denied: list[str] = []
    for (name, impls), value in zip(SWITCHES, raw):
        if _switch_off(name, value):  # a value that is not an integer is refused (and never cached)
            names.append(f"{name}=0")
            denied.extend(i for i in impls if i not in denied)
    state = tuple(names), tuple(denied)
    bounded_put(_SWITCH_STATES, raw, state, limit=64)
    return state


def _env_int(name: str, default: str) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{_NAME}: environment variable {name}={raw!r} is not an integer; TransformerEngine reads "
                         f"it as int (NVTE_DEBUG 0/1, NVTE_DEBUG_LEVEL 0/1/2); unset it or give an integer") from None


def te_log_level() -> int:
    """The `logging` level TE's ``AttentionLogging.setup_logging`` derives from the environment now:
    ``NVTE_DEBUG * NVTE_DEBUG_LEVEL`` (both default 0) as 0 → WARNING (silent), 1 → INFO, 2 → DEBUG, and — as TE —
    any other product (``NVTE_DEBUG_LEVEL=3``, ``NVTE_DEBUG=2``) → DEBUG. A value that is not an integer is refused
    (TE's ``int()`` fails on it at import)."""
    debug, level = _env_int("NVTE_DEBUG", "0"), _env_int("NVTE_DEBUG_LEVEL", "0")
    product = debug * level
    return _LOG_LEVELS[product if product in _LOG_LEVELS else 2]


def _te_logger(level: int) -> logging.Logger:
    """TE's ``self.logger`` setup in ``DotProductAttention.__init__``: the "DotProductAttention" logger at `level`,
    with TE's stream handler added when neither it nor an ancestor has a handler."""
    global _stream_handler
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.hasHandlers():
        if _stream_handler is None:
            _stream_handler = logging.StreamHandler()
            _stream_handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(_stream_handler)
    return logger


def te_backend(impl_id: str | None) -> str:
    """How TE's log lines name the backend `impl_id` stands for: "FusedAttention (nvidia.cudnn)", "FlashAttention
    (version 3, nvidia.flash_attn3)", "UnfusedDotProductAttention (reference.math)", or the id alone."""
    if impl_id is None:
        return "NoBackend"
    family = TE_BACKENDS.get(impl_id)
    if family is None:
        return impl_id
    if family.startswith("FlashAttention"):
        return f"FlashAttention (version {family.split()[-1]}, {impl_id})"
    return f"{family} ({impl_id})"


@contextlib.contextmanager
def _switch_scope(denied: tuple[str, ...]) -> Iterator[None]:
    """TE's switches as a `policy_override(deny=...)` for the attention op, entered here so that explain's
    provenance names this file."""
    with policy_override(deny=list(denied), op="attention"):
        yield


def _mask_type(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{_NAME}: {where} must be a string, got {value!r}; allowed: {', '.join(MASK_TYPES)}")
    normalised = value.replace(",", "_")
    if normalised == "causal_padding":
        normalised = "padding_causal"
    if normalised not in MASK_TYPES:
        raise ValueError(f"{_NAME}: {where}={value!r} is not a TransformerEngine mask type; allowed: "
                         f"{', '.join(MASK_TYPES)} (or 'padding,causal' / 'causal,padding')")
    return normalised


def _window_size(mask_type: str, window_size: Any, where: str) -> tuple[int, int]:
    """TE's ``check_set_window_size``: (-1, 0)/(>=0, 0) for causal types, (-1, -1)/(>=0, >=0) otherwise; a
    causal type coerces (-1, -1) and (>=0, !=0) to a right bound of 0, the others (-1, 0) to (-1, -1), with TE's
    warning; anything else is refused."""
    if window_size is None:
        return (-1, 0) if "causal" in mask_type else (-1, -1)
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in pair):
        raise TypeError(f"{_NAME}: {where}={window_size!r} must be None or a pair of ints (left, right), -1 "
                        "unbounded, e.g. (128, 0)")
    left, right = pair
    if "causal" in mask_type:
        if (left, right) == (-1, 0) or (left >= 0 and right == 0):
            return left, right
        if (left, right) == (-1, -1) or (left >= 0 and right != 0):
            warnings.warn(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type}",
                          stacklevel=4)
            return left, 0
        raise ValueError(f"{_NAME}: {where}={(left, right)} with attn_mask_type={mask_type!r}; allowed: (-1, 0) or "
                         "(>=0, 0)")
    if (left, right) == (-1, -1) or (left >= 0 and right >= 0):
        return left, right
    if (left, right) == (-1, 0):
        warnings.warn(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type}", stacklevel=4)
        return -1, -1
    raise ValueError(f"{_NAME}: {where}={(left, right)} with attn_mask_type={mask_type!r}; allowed: (-1, -1) or "
                     "(>=0, >=0)")


def default_alibi_slopes(num_heads: int, device: torch.device) -> Tensor:
    """TE's default ALiBi slopes (utils.get_alibi): the geometric sequence of the ALiBi paper, with the
    interleaved extra slopes when the head count is not a power of two; float32."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, dtype=torch.float64))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (num_heads - n), 2, dtype=torch.float64))
        slopes = torch.cat([slopes, extra])
    return slopes.to(dtype=torch.float32, device=device)


def _refuse(argument: str, value: Any, why: str) -> ValueError:
    shown = (f"<{value.dtype} tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor)
             else f"{value!r:.80}")
    return ValueError(f"{_NAME}: {argument}={shown} {why}")


def _lengths_keep(cu_seqlens: Any, name: str, batch: int, seqlen: int, device: torch.device) -> Tensor:
    """A dense padded batch's (batch, seqlen) keep mask from TE's cu_seqlens (sequence i = the first
    cu[i+1] - cu[i] tokens of row i)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() != batch + 1:
        raise _refuse(name, cu_seqlens, f"must be an int32 tensor of shape [batch_size + 1] = [{batch + 1}]")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    return torch.arange(seqlen, device=device).unsqueeze(0) < lengths.unsqueeze(1)


def _padding_keep(mask: Any, name: str, batch: int, seqlen: int, device: torch.device) -> Tensor:
    """TE's padding mask [b, 1, 1, s] (True = padding) as a (b, s) keep mask."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (batch, 1, 1, seqlen):
        raise _refuse(name, mask, f"must be a bool tensor of shape [batch_size, 1, 1, seqlen] = "
                                  f"[{batch}, 1, 1, {seqlen}] (True = padding, TransformerEngine's convention)")
    if mask.device != device:
        raise _refuse(name, mask, f"is on {mask.device} but the queries are on {device}")
    return ~mask.view(batch, seqlen)


def _thd_padded_index(cu: Tensor, cu_padded: Tensor, tokens: int, name: str) -> Tensor:
    """Where sequence i's tokens sit in a thd tensor with padding between sequences: cu_padded[i] + [0, len_i).
    Reads both tensors on the host (the gather needs the count anyway)."""
    if not isinstance(cu_padded, Tensor) or cu_padded.dtype != torch.int32 or tuple(cu_padded.shape) != tuple(cu.shape):
        raise _refuse(name, cu_padded, f"must be an int32 tensor shaped like its cu_seqlens ({tuple(cu.shape)})")
    real, padded = cu.tolist(), cu_padded.tolist()
    pieces = []
    for i in range(len(real) - 1):
        length, start, room = real[i + 1] - real[i], padded[i], padded[i + 1] - padded[i]
        if length < 0 or room < length or start < 0:
            raise _refuse(name, cu_padded, f"gives sequence {i} {room} slots at offset {start} but it has {length} "
                                           f"tokens (cu_seqlens {real}, padded {padded}); each padded segment must "
                                           "hold its sequence")
        pieces.append(torch.arange(start, start + length))
    if padded[-1] > tokens:
        raise _refuse(name, cu_padded, f"ends at {padded[-1]} but the tensor has {tokens} tokens")
    return torch.cat(pieces).to(cu.device) if pieces else torch.zeros(0, dtype=torch.long, device=cu.device)


class _ContextParallel:
    """A resolved context-parallel setting: the group the sequence is sharded across (size > 1) and the
    `context_parallel_attention` mode TE's cp_comm_type maps to."""

    __slots__ = ("group", "size", "mode", "comm_type")

    def __init__(self, group: Any, size: int, mode: str, comm_type: str) -> None:
        self.group, self.size, self.mode, self.comm_type = group, size, mode, comm_type


def _context_parallel(cp_group: Any, cp_global_ranks: Any, cp_stream: Any,
                      cp_comm_type: Any) -> _ContextParallel | None:
    """TE's context-parallel arguments checked and resolved (None: no context parallelism, as TE's cp_size 1).

    As TE (dot_product_attention.py forward, context_parallel.attn_forward_func_with_cp): the size is the group's
    (the product of both groups' for "a2a+p2p", which takes ``[a2a_group, p2p_group]``); "a2a+p2p" whose a2a group
    has one rank is "p2p" over the other, whose p2p group has one rank is "a2a". ``cp_global_ranks`` are the ring's
    peers (TE's p2p sends to ``cp_global_ranks[(rank + 1) % cp_size]``), so they must be the group's global ranks
    in group order. ``cp_stream`` only lets TE overlap two attention kernels of a ring step: None or a CUDA stream,
    accepted, not used (the result is the same; opdispatch overlaps the exchange on the current stream)."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise _refuse("cp_comm_type", cp_comm_type, f"is not supported; allowed: {', '.join(CP_COMM_TYPES)}")
    if cp_stream is not None and not isinstance(cp_stream, torch.cuda.Stream):
        raise _refuse("cp_stream", cp_stream, "must be None or a torch.cuda.Stream (TE overlaps two attention "
                                              "kernels on it; the result does not depend on it)")
    if cp_group is None:
        return None  # TE: cp_size 1, cp_global_ranks and cp_stream unread
    import torch.distributed as dist

    if cp_comm_type == "a2a+p2p":
        if not (isinstance(cp_group, (list, tuple)) and len(cp_group) == 2
                and all(isinstance(g, dist.ProcessGroup) for g in cp_group)):
            raise _refuse("cp_group", cp_group, "must be [a2a_group, p2p_group] (two ProcessGroups) with "
                                                "cp_comm_type='a2a+p2p', as TE")
        a2a_size, p2p_size = (dist.get_world_size(g) for g in cp_group)
        if a2a_size * p2p_size == 1:
            return None
        if a2a_size > 1:
            raise _refuse("cp_comm_type", cp_comm_type, f"with an a2a group of {a2a_size} ranks is not supported: "
                                                        "opdispatch has no all-to-all (Ulysses) context "
                                                        "parallelism; use cp_comm_type='p2p' or 'all_gather' over "
                                                        "one group (the same attention)")
        group, comm_type = cp_group[1], "p2p"  # TE: an a2a group of one rank is p2p over the other
    else:
        if not isinstance(cp_group, dist.ProcessGroup):
            raise _refuse("cp_group", cp_group, f"must be a torch.distributed ProcessGroup with "
                                                f"cp_comm_type={cp_comm_type!r} (a [a2a, p2p] list is for 'a2a+p2p')")
        group, comm_type = cp_group, cp_comm_type
    size = dist.get_world_size(group)
    if size == 1:
        return None
    if comm_type == "a2a":
        raise _refuse("cp_comm_type", comm_type, "is not supported: opdispatch has no all-to-all (Ulysses) context "
                                                 "parallelism; allowed: 'p2p' (ring) or 'all_gather', which compute "
                                                 "the same attention over the same shards")
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    if cp_global_ranks is None:
        if comm_type == "p2p":
            raise _refuse("cp_global_ranks", None, "is required with cp_comm_type='p2p' (TE sends to "
                                                   "cp_global_ranks[(rank + 1) % cp_size]); pass "
                                                   f"torch.distributed.get_process_group_ranks(cp_group) = {ranks}")
    elif not isinstance(cp_global_ranks, (list, tuple)) or list(cp_global_ranks) != ranks:
        raise _refuse("cp_global_ranks", cp_global_ranks, f"must be cp_group's global ranks in group order, {ranks} "
                                                          "(TE's ring peers); pass "
                                                          "torch.distributed.get_process_group_ranks(cp_group)")
    return _ContextParallel(group, size, CP_MODES[comm_type], comm_type)


class DotProductAttention(torch.nn.Module):
    """TransformerEngine's ``DotProductAttention`` (module docstring: what is honoured and refused)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable[..., Any] | None = None,
        tp_group: Any = None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group: Any = None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_attention_heads, bool) or not isinstance(num_attention_heads, int) \
                or num_attention_heads < 1:
            raise _refuse("num_attention_heads", num_attention_heads, "must be a positive int")
        if isinstance(kv_channels, int) and not isinstance(kv_channels, bool):
            head_k = head_v = kv_channels
        elif (isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2
              and all(isinstance(c, int) and not isinstance(c, bool) for c in kv_channels)):
            head_k, head_v = kv_channels
        else:
            raise _refuse("kv_channels", kv_channels, "must be an int or a (key, value) pair of ints (head sizes)")
        if head_k < 1 or head_v < 1:
            raise _refuse("kv_channels", kv_channels, "must be positive head sizes")
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)  # TE: the group's size outranks tp_size
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise _refuse("tp_size", tp_size, "must be a positive int")
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or num_attention_heads % groups:
            raise _refuse("num_gqa_groups", num_gqa_groups, f"must divide num_attention_heads={num_attention_heads} "
                                                            "(the number of key/value heads)")
        if num_attention_heads % tp_size or groups % tp_size:
            raise _refuse("tp_size", tp_size, f"must divide num_attention_heads={num_attention_heads} and "
                                              f"num_gqa_groups={groups}")
        if isinstance(attention_dropout, bool) or not isinstance(attention_dropout, (int, float)) \
                or not 0.0 <= attention_dropout < 1.0:
            raise _refuse("attention_dropout", attention_dropout, "must be a float in [0, 1)")
        if qkv_format not in QKV_FORMATS:
            raise _refuse("qkv_format", qkv_format, f"is not supported; allowed: {', '.join(QKV_FORMATS)}")
        mask_type = _mask_type(attn_mask_type, "attn_mask_type")
        if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
            raise _refuse("bottom_right_diagonal", bottom_right_diagonal, "must be None, True or False")
        if attention_type not in ATTENTION_TYPES:
            raise _refuse("attention_type", attention_type, f"is not supported; allowed: {', '.join(ATTENTION_TYPES)}")
        if get_rng_state_tracker is not None and attention_dropout > 0:
            raise _refuse("get_rng_state_tracker", get_rng_state_tracker,
                          "is not honoured: dropout draws from torch's default generator, not the tracker's forked "
                          "states; pass get_rng_state_tracker=None (or attention_dropout=0)")
        _context_parallel(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                          or not isinstance(softmax_scale, (int, float))):
            raise _refuse("softmax_scale", softmax_scale, "must be a float or None (1/sqrt(kv_channels))")
        if softmax_type not in SOFTMAX_TYPES:
            raise _refuse("softmax_type", softmax_type, f"is not supported; allowed: {', '.join(SOFTMAX_TYPES)}")
        if return_max_logit:
            raise _refuse("return_max_logit", return_max_logit, "is not supported: opdispatch's kernels do not "
                                                                "return the maximum logit; pass False")
        if name is not None and (not isinstance(name, str) or not name):
            raise _refuse("name", name, "must be a non-empty string or None")

        self.qkv_format = qkv_format
        self.attn_mask_type = mask_type
        self.window_size = _window_size(mask_type, window_size, "window_size")
        self.bottom_right_diagonal = bottom_right_diagonal
        self.sequence_parallel = sequence_parallel  # TE: only chooses the RNG tracker for dropout
        self.tp_size = tp_size
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type = attention_type
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self.cp_comm_type = cp_comm_type
        self.hidden_size_per_attention_head_k = head_k
        self.hidden_size_per_attention_head_v = head_v
        self.num_gqa_groups = groups
        self.num_gqa_groups_per_partition = groups // tp_size
        self.softmax_scale = 1.0 / math.sqrt(head_k) if softmax_scale is None else float(softmax_scale)
        self.deterministic = (not bool(int(os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")))
                              or torch.are_deterministic_algorithms_enabled())
        self.attention_dropout = float(attention_dropout)
        # NVTE_DEBUG / NVTE_DEBUG_LEVEL, read here (TE reads them once, at import, and sets this logger's level in
        # every DotProductAttention.__init__); forward logs only below WARNING.
        self._log_level = te_log_level()
        self.logger = _te_logger(self._log_level)
        self._dense_plans: dict[Any, tuple[str, dict[str, Any]]] = {}  # forward's checked signatures
        self.return_max_logit = False
        self.name = name
        self.softmax_type = softmax_type
        self.softmax_offset: Tensor | None
        heads = num_attention_heads // tp_size
        if softmax_type == "learnable":
            self.softmax_offset = Parameter(torch.zeros(heads))
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)  # TE: not in state_dict
        else:
            self.softmax_offset = None

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: list[int] | None, cp_stream: Any,
                                   cp_comm_type: str = "p2p") -> None:
        """TE's ``set_context_parallel_group``: the context-parallel attributes for the next forwards (checked
        first, then set; None turns context parallelism off). The mapping and what is refused: module docstring."""
        _context_parallel(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self.cp_comm_type = cp_comm_type

    # -- forward -------------------------------------------------------------------------------------------------

    def forward(
        self,
        query_layer: Tensor | None = None,
        key_layer: Tensor | None = None,
        value_layer: Tensor | None = None,
        attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_kv: Tensor | None = None,
        cu_seqlens_q_padded: Tensor | None = None,
        cu_seqlens_kv_padded: Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params: Any = None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool | None = False,
        bf16_backward: bool | None = False,
        num_splits: int | None = 1,
        score_mod: Callable[..., Any] | None = None,
        score_mod_bprop: Callable[..., Any] | None = None,
        score_mod_tensors: dict[str, Tensor] | None = None,
        score_mod_bprop_tensors: dict[str, Tensor] | None = None,
        qkv_layer: Tensor | None = None,
        kv_layer: Tensor | None = None,
        qkv_interleave_dim: int = -3,
    ) -> Tensor:
        """TE's forward: q/k/v in `qkv_format` (or packed), the output as (s, b, h*d) / (b, s, h*d) / (t, h*d).
        Every argument is honoured or refused (module docstring); `fast_zero_fill`, `bf16_backward` (FP8 only)
        and `num_splits` (FA3 scheduling) cannot change the result. Padded positions are zeros."""
        del fast_zero_fill, bf16_backward, num_splits  # see the docstring: no effect on the result here
        denied = te_switches()[1]  # TE reads its switches per call: so does forward (read once, here)
        # The per-call fast path: a dense call (no mask, lengths, bias tensor, packing, context parallelism,
        # sinks or debug logging) whose signature — tensor shapes, dtypes and devices, every other argument, and
        # every module attribute the plan reads — was checked before reuses that check's opdispatch call.
        key = None
        if (attention_mask is None and cu_seqlens_q is None and cu_seqlens_kv is None and cu_seqlens_q_padded is None
                and cu_seqlens_kv_padded is None and core_attention_bias is None and alibi_slopes is None
                and qkv_layer is None and kv_layer is None and inference_params is None and score_mod is None
                and score_mod_bprop is None and score_mod_tensors is None and score_mod_bprop_tensors is None
                and fp8_output is False and checkpoint_core_attention is False and self.cp_group is None
                and self.softmax_offset is None and self._log_level >= logging.WARNING
                and type(query_layer) is Tensor and type(key_layer) is Tensor and type(value_layer) is Tensor
                and (window_size is None or (type(window_size) is tuple and len(window_size) == 2
                                             and type(window_size[0]) is int and type(window_size[1]) is int))
                and type(bottom_right_diagonal) in _FLAG_TYPES and type(pad_between_seqs) in _FLAG_TYPES
                and type(max_seqlen_q) in _LENGTH_TYPES and type(max_seqlen_kv) in _LENGTH_TYPES
                and not torch.compiler.is_dynamo_compiling()):
            key = (query_layer.shape, key_layer.shape, value_layer.shape, query_layer.dtype, key_layer.dtype,
                   value_layer.dtype, query_layer.device, key_layer.device, value_layer.device, qkv_format,
                   attn_mask_type, window_size, bottom_right_diagonal, bottom_right_diagonal.__class__,
                   pad_between_seqs, pad_between_seqs.__class__, max_seqlen_q, max_seqlen_kv,
                   core_attention_bias_type, self.training, self.qkv_format, self.attn_mask_type, self.window_size,
                   self.bottom_right_diagonal, self.softmax_scale, self.attention_dropout, self.deterministic,
                   self.cp_comm_type, self.cp_stream, self.num_attention_heads, self.tp_size,
                   self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head_k,
                   self.hidden_size_per_attention_head_v)
            try:
                dense = self._dense_plans.get(key)
            except TypeError:  # an unhashable argument: the general path checks it
                key = dense = None
            if dense is not None:
                fmt, options = dense
                if self.name is None and not denied:
                    out = attention(query_layer, key_layer, value_layer, layout=fmt, **options)
                else:
                    with self._scopes(denied):
                        out = attention(query_layer, key_layer, value_layer, layout=fmt, **options)
                return out.reshape(*out.shape[:2], -1)  # type: ignore[no-any-return]
        plan = self._plan(query_layer, key_layer, value_layer, attention_mask, qkv_format, cu_seqlens_q, cu_seqlens_kv,
                          cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type,
                          window_size, bottom_right_diagonal, core_attention_bias_type, core_attention_bias,
                          alibi_slopes, inference_params, pad_between_seqs, fp8_output, score_mod, score_mod_bprop,
                          score_mod_tensors, score_mod_bprop_tensors, qkv_layer, kv_layer, qkv_interleave_dim)
        if not isinstance(checkpoint_core_attention, bool):
            raise _refuse("checkpoint_core_attention", checkpoint_core_attention, "must be a bool")
        if key is not None and plan.dense is not None and not plan.warned:
            bounded_put(self._dense_plans, key, plan.dense, limit=64)
        with self._scopes(denied):
            # NVTE_DEBUG on (off, these comparisons are all forward pays), and the logger still listening.
            if self._log_level < logging.WARNING and self.logger.isEnabledFor(logging.INFO):
                _log_selection(self.logger, plan)
            if checkpoint_core_attention and torch.is_grad_enabled():
                # Recompute the attention in backward (torch's checkpoint restores the RNG state for dropout).
                out = torch.utils.checkpoint.checkpoint(plan.run, *plan.tensors, use_reentrant=False)
            else:
                out = plan.run(*plan.tensors)
        return out  # type: ignore[no-any-return]

    def explain(self, query_layer: Tensor | None = None, key_layer: Tensor | None = None,
                value_layer: Tensor | None = None, **forward_kwargs: Any) -> Any:
        """`opdispatch.explain` for the call `forward(...)` would make (under the same NVTE_* switches and module
        scope): which implementation runs, and why. Takes forward's arguments."""
        forward_kwargs.pop("checkpoint_core_attention", None)
        for ignored in ("fast_zero_fill", "bf16_backward", "num_splits"):
            forward_kwargs.pop(ignored, None)
        names = ("attention_mask", "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                 "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "attn_mask_type", "window_size",
                 "bottom_right_diagonal", "core_attention_bias_type", "core_attention_bias", "alibi_slopes",
                 "inference_params", "pad_between_seqs", "fp8_output", "score_mod", "score_mod_bprop",
                 "score_mod_tensors", "score_mod_bprop_tensors", "qkv_layer", "kv_layer", "qkv_interleave_dim")
        unknown = set(forward_kwargs) - set(names)
        if unknown:
            raise TypeError(f"{_NAME}.explain: unexpected arguments {sorted(unknown)}")
        defaults: dict[str, Any] = {"core_attention_bias_type": "no_bias", "fp8_output": False,
                                    "qkv_interleave_dim": -3}
        args = [forward_kwargs.get(n, defaults.get(n)) for n in names]
        plan = self._plan(query_layer, key_layer, value_layer, *args)
        qkv, options = plan.describe()
        with self._scopes():
            return explain(*qkv, **options)

    @contextlib.contextmanager
    def _scopes(self, denied: tuple[str, ...] | None = None) -> Iterator[None]:
        """The module's `name` as opdispatch's scope, and TE's switches (`denied`: read now when None) as a
        `policy_override(deny=...)` for the attention op (explain names this scope)."""
        if denied is None:
            denied = te_switches()[1]
        with contextlib.ExitStack() as stack:
            if self.name is not None:
                stack.enter_context(scope(self.name))
            if denied:
                stack.enter_context(_switch_scope(denied))
            yield

    def _plan(self, query_layer: Any, key_layer: Any, value_layer: Any, attention_mask: Any, qkv_format: Any,
              cu_seqlens_q: Any, cu_seqlens_kv: Any, cu_seqlens_q_padded: Any, cu_seqlens_kv_padded: Any,
              max_seqlen_q: Any, max_seqlen_kv: Any, attn_mask_type: Any, window_size: Any,
              bottom_right_diagonal: Any, core_attention_bias_type: Any, core_attention_bias: Any, alibi_slopes: Any,
              inference_params: Any, pad_between_seqs: Any, fp8_output: Any, score_mod: Any, score_mod_bprop: Any,
              score_mod_tensors: Any, score_mod_bprop_tensors: Any, qkv_layer: Any, kv_layer: Any,
              qkv_interleave_dim: Any) -> _Plan:
        """Check every argument (before anything runs) and build the opdispatch call."""
        for argument, value in (("inference_params", inference_params), ("score_mod", score_mod),
                                ("score_mod_bprop", score_mod_bprop), ("score_mod_tensors", score_mod_tensors),
                                ("score_mod_bprop_tensors", score_mod_bprop_tensors)):
            if value is not None:
                why = ("(KV caching) is not supported; use opdispatch.compat.flash_attn.flash_attn_with_kvcache or "
                       "opdispatch.attention(seqused_k=, block_table=)" if argument == "inference_params"
                       else "(cuDNN frontend Flex Attention) is not supported: opdispatch cannot run a cuDNN graph "
                            "callback")
                raise _refuse(argument, value, why)
        if fp8_output:
            raise _refuse("fp8_output", fp8_output, "is not supported: this module has no FP8 attention; pass False")
        fmt = self.qkv_format if qkv_format is None else qkv_format
        if fmt not in QKV_FORMATS:
            raise _refuse("qkv_format", qkv_format, f"is not supported; allowed: {', '.join(QKV_FORMATS)}")
        q, k, v = _unpack(query_layer, key_layer, value_layer, qkv_layer, kv_layer, qkv_interleave_dim, fmt)
        self._check_qkv(q, k, v, fmt)
        mask_type = self.attn_mask_type if attn_mask_type is None else _mask_type(attn_mask_type, "attn_mask_type")
        given_window = self.window_size if window_size is None else window_size
        window = _window_size(mask_type, given_window, "window_size")
        coerced = given_window is not None and tuple(given_window) != window  # _window_size warned
        if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
            raise _refuse("bottom_right_diagonal", bottom_right_diagonal, "must be None, True or False")
        bottom_right = self.bottom_right_diagonal if bottom_right_diagonal is None else bottom_right_diagonal
        if mask_type in ("causal", "padding_causal"):
            bottom_right = False
        elif bottom_right is None or mask_type in ("causal_bottom_right", "padding_causal_bottom_right"):
            bottom_right = True
        if pad_between_seqs is not None and not isinstance(pad_between_seqs, bool):
            raise _refuse("pad_between_seqs", pad_between_seqs, "must be None, True or False")

        padding = "padding" in mask_type
        options: dict[str, Any] = {
            "causal": "causal" in mask_type, "causal_alignment": "bottom_right" if bottom_right else "top_left",
            "window": None if window in ((-1, -1), (-1, 0)) else window, "scale": self.softmax_scale,
            "dropout_p": self.attention_dropout if self.training else 0.0, "deterministic": self.deterministic}

        # Context parallelism (TE reads cp_* at every forward): what opdispatch's cannot honour is refused here.
        cp = _context_parallel(self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type)
        if cp is not None:
            self._check_context_parallel(cp, q, k, fmt, mask_type, window, core_attention_bias_type, options)

        # Masks: TE's attention_mask is only read by padding and arbitrary types; elsewhere it must be None.
        if mask_type == "arbitrary":
            if fmt == "thd":
                raise _refuse("attn_mask_type", mask_type, "is not supported with qkv_format='thd' (TE needs a "
                                                           "padding mask type there); use a dense format")
            if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool:
                raise _refuse("attention_mask", attention_mask, "must be a bool tensor broadcastable to [batch_size, "
                                                                "num_heads, max_seqlen_q, max_seqlen_kv] (True = "
                                                                "masked out) for attn_mask_type='arbitrary'")
            options["attn_mask"] = ~attention_mask  # TE: True = masked out; opdispatch: True = attend
        elif not padding and attention_mask is not None:
            raise _refuse("attention_mask", attention_mask, f"is not used by attn_mask_type={mask_type!r} (TE ignores "
                                                            "it there); pass None, or a padding/arbitrary mask type")
        if not padding:
            for argument, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                                    ("cu_seqlens_q_padded", cu_seqlens_q_padded),
                                    ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
                if value is not None:
                    raise _refuse(argument, value, f"describes padded sequences but attn_mask_type={mask_type!r} has "
                                                   "no padding; use a padding mask type")
            if fmt == "thd":
                raise _refuse("attn_mask_type", mask_type, "must be a padding type (padding, padding_causal, "
                                                           "padding_causal_bottom_right) with qkv_format='thd', as "
                                                           "in TransformerEngine")

        # Bias: pre_scale_bias is added before the scale, so it enters the scaled scores multiplied by it.
        if core_attention_bias_type not in BIAS_TYPES:
            raise _refuse("core_attention_bias_type", core_attention_bias_type,
                          f"is not supported; allowed: {', '.join(BIAS_TYPES)}")
        if alibi_slopes is not None and core_attention_bias_type != "alibi":
            raise _refuse("alibi_slopes", alibi_slopes, "needs core_attention_bias_type='alibi' (as in TE)")
        if core_attention_bias_type in ("no_bias", "alibi"):
            if core_attention_bias is not None:
                raise _refuse("core_attention_bias", core_attention_bias,
                              f"must be None with core_attention_bias_type={core_attention_bias_type!r}")
        else:
            if not isinstance(core_attention_bias, Tensor):
                raise _refuse("core_attention_bias", core_attention_bias,
                              f"must be a tensor with core_attention_bias_type={core_attention_bias_type!r}")
            if fmt == "thd" or padding:
                raise _refuse("core_attention_bias", core_attention_bias,
                              "is not supported with padded or packed sequences (qkv_format='thd' or a padding mask "
                              "type): opdispatch takes biases on dense calls only; fold the padding into an "
                              "'arbitrary' mask")
            options["attn_bias"] = (core_attention_bias * self.softmax_scale
                                    if core_attention_bias_type == "pre_scale_bias" else core_attention_bias)
        if core_attention_bias_type == "alibi":
            options["alibi_slopes"] = (alibi_slopes if alibi_slopes is not None
                                       else default_alibi_slopes(q.shape[-2], q.device))

        config = None
        if self._log_level < logging.WARNING:  # TE's AttentionParams, for the "Running with config=" line
            config = {
                "qkv_dtype": q.dtype, "qkv_format": fmt, "num_heads": q.shape[-2], "num_gqa_groups": k.shape[-2],
                "head_dim_qk": q.shape[-1], "head_dim_v": v.shape[-1], "attn_mask_type": mask_type,
                "window_size": window, "bottom_right_diagonal": bottom_right,
                "alibi_slopes_shape": None if alibi_slopes is None else tuple(alibi_slopes.shape),
                "core_attention_bias_type": core_attention_bias_type,
                "core_attention_bias_shape": (tuple(core_attention_bias.shape)
                                              if isinstance(core_attention_bias, Tensor) else None),
                "core_attention_bias_requires_grad": (isinstance(core_attention_bias, Tensor)
                                                      and core_attention_bias.requires_grad),
                "pad_between_seqs": bool(pad_between_seqs), "attention_dropout": options["dropout_p"],
                "deterministic": self.deterministic, "is_training": self.training,
                "requires_grad": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                "softmax_type": self.softmax_type, "context_parallel": cp is not None,
                "cp_comm_type": self.cp_comm_type, "cp_size": 1 if cp is None else cp.size}

        sinks = self.softmax_offset
        if sinks is not None:
            options["sinks"] = sinks.to(device=q.device, dtype=torch.float32)  # TE: .to(float32); grad flows

        if fmt == "thd":
            plan = self._plan_thd(q, k, v, options, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                  cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, pad_between_seqs)
            plan.config = config
            return plan
        for argument, value in (("cu_seqlens_q_padded", cu_seqlens_q_padded),
                                ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
            if value is not None:
                raise _refuse(argument, value, f"is only read with qkv_format='thd' (got {fmt!r}); dense padded "
                                               "batches give each sequence's length by cu_seqlens_q/kv or the mask")
        s_axis = 0 if fmt == "sbhd" else 1
        for argument, value, tensor in (("max_seqlen_q", max_seqlen_q, q), ("max_seqlen_kv", max_seqlen_kv, k)):
            if value is not None and value != tensor.shape[s_axis]:
                raise _refuse(argument, value, f"differs from the tensor's sequence dimension "
                                               f"({tensor.shape[s_axis]}) in qkv_format={fmt!r}; TE requires them "
                                               "equal")
        if cp is not None:
            plan = _plan_context_parallel(cp, q, k, v, fmt, options)
        elif padding:
            plan = self._plan_padded(q, k, v, fmt, options, attention_mask, cu_seqlens_q, cu_seqlens_kv)
        else:
            plan = _Plan(_dense_run(fmt, options), (q, k, v), lambda: ((q, k, v), {"layout": fmt, **options}))
            if "alibi_slopes" not in options or alibi_slopes is None:  # options made from the signature alone
                plan.dense = (fmt, options)
        plan.config = config
        plan.warned = coerced
        return plan

    def _check_context_parallel(self, cp: _ContextParallel, q: Tensor, k: Tensor, fmt: str, mask_type: str,
                                window: tuple[int, int], bias_type: Any, options: dict[str, Any]) -> None:
        """Refuse what TE's context parallelism takes but opdispatch's (`context_parallel_attention`: dense
        zigzag shards of one sequence, no mask or causal, no window, bias, dropout or sinks) cannot honour."""
        where = f"with context parallelism (cp_group of {cp.size} ranks, cp_comm_type={cp.comm_type!r})"
        if fmt == "thd":
            raise _refuse("qkv_format", fmt, f"is not supported {where}: opdispatch shards dense sequences only "
                                             "(TE's thd shards each packed sequence); allowed: 'bshd', 'sbhd' — pad "
                                             "the sequences into a dense batch, or run without cp_group")
        if mask_type not in CP_MASK_TYPES:
            fix = ("use 'causal', the same mask for self-attention of equal lengths (TE's context parallelism "
                   "refuses bottom-right masks too)" if mask_type == "causal_bottom_right"
                   else "padding and arbitrary masks are not sharded by opdispatch; run without cp_group")
            raise _refuse("attn_mask_type", mask_type, f"is not supported {where}; allowed: "
                                                       f"{', '.join(CP_MASK_TYPES)}; {fix}")
        if window not in ((-1, -1), (-1, 0)):
            raise _refuse("window_size", window, f"is not supported {where}: opdispatch's context parallelism has "
                                                 "no sliding window; allowed: (-1, -1) or (-1, 0) (None)")
        if bias_type != "no_bias":
            raise _refuse("core_attention_bias_type", bias_type, f"is not supported {where}: opdispatch's context "
                                                                 "parallelism takes no bias; allowed: 'no_bias'")
        if options["dropout_p"] > 0:
            raise _refuse("attention_dropout", options["dropout_p"], f"is not supported in training {where}: "
                                                                     "opdispatch's context parallelism has no "
                                                                     "dropout; build the module with "
                                                                     "attention_dropout=0.0 or call it in eval()")
        if self.softmax_type != "vanilla":
            raise _refuse("softmax_type", self.softmax_type, f"is not supported {where}: TE takes it only with "
                                                             "cp_comm_type='a2a', which opdispatch does not have; "
                                                             "allowed: 'vanilla'")
        if self.deterministic:
            raise _refuse("deterministic", True, f"(NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or "
                                                 f"torch.use_deterministic_algorithms) is not supported {where}: "
                                                 "opdispatch's context parallelism cannot ask its blocks for "
                                                 "deterministic kernels; unset the switch or run without cp_group")
        s_axis = 0 if fmt == "sbhd" else 1
        if q.shape[s_axis] != k.shape[s_axis]:
            raise _refuse("key_layer", k, f"has a shard of {k.shape[s_axis]} tokens but query_layer has "
                                          f"{q.shape[s_axis]}: cross-attention of other lengths is not supported "
                                          f"{where} (opdispatch shards one sequence for q, k and v); run without "
                                          "cp_group")

    def _check_qkv(self, q: Any, k: Any, v: Any, fmt: str) -> None:
        """TE's shape checks (dot_product_attention.py, 'checks for q/k/v shapes') and the heads it was built for."""
        for argument, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
            if not isinstance(t, Tensor):
                raise _refuse(argument, t, "must be a tensor")
            want = 3 if fmt == "thd" else 4
            if t.dim() != want:
                raise _refuse(argument, t, f"must be {want}-D for qkv_format={fmt!r}")
        if not q.dtype == k.dtype == v.dtype:
            raise _refuse("query_layer", q, f"key_layer ({k.dtype}) and value_layer ({v.dtype}) must share one dtype")
        if k.shape[:-1] != v.shape[:-1]:
            raise _refuse("value_layer", v, f"must match key_layer {tuple(k.shape)} in all but the head size")
        heads_q = self.num_attention_heads // self.tp_size
        if q.shape[-2] != heads_q:
            raise _refuse("query_layer", q, f"has {q.shape[-2]} heads but the module was built for {heads_q} "
                                            f"(num_attention_heads={self.num_attention_heads} / "
                                            f"tp_size={self.tp_size})")
        if k.shape[-2] != self.num_gqa_groups_per_partition:
            raise _refuse("key_layer", k, f"has {k.shape[-2]} heads but num_gqa_groups gives "
                                          f"{self.num_gqa_groups_per_partition}")
        if q.shape[-1] != self.hidden_size_per_attention_head_k or k.shape[-1] != q.shape[-1]:
            raise _refuse("query_layer", q, f"and key_layer must have head size kv_channels[0] = "
                                            f"{self.hidden_size_per_attention_head_k} (key_layer: {k.shape[-1]})")
        if v.shape[-1] != self.hidden_size_per_attention_head_v:
            raise _refuse("value_layer", v, f"must have head size kv_channels[1] = "
                                            f"{self.hidden_size_per_attention_head_v}")
        if fmt != "thd" and (q.shape[1 if fmt == "sbhd" else 0] != k.shape[1 if fmt == "sbhd" else 0]):
            raise _refuse("key_layer", k, f"has a different batch size than query_layer {tuple(q.shape)} "
                                          f"(qkv_format={fmt!r})")

    def _plan_thd(self, q: Tensor, k: Tensor, v: Tensor, options: dict[str, Any], cu_q: Any, cu_kv: Any,
                  cu_q_padded: Any, cu_kv_padded: Any, max_q: Any, max_kv: Any, pad_between_seqs: Any) -> _Plan:
        for argument, value in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
            if not isinstance(value, Tensor) or value.dtype != torch.int32 or value.dim() != 1:
                raise _refuse(argument, value, "must be an int32 tensor of shape [batch_size + 1] with "
                                               "qkv_format='thd'")
        if cu_q.shape != cu_kv.shape:
            raise _refuse("cu_seqlens_kv", cu_kv, f"must have cu_seqlens_q's shape {tuple(cu_q.shape)}")
        gathers: list[Tensor | None] = []
        for name, cu, padded, t in (("cu_seqlens_q_padded", cu_q, cu_q_padded, q),
                                    ("cu_seqlens_kv_padded", cu_kv, cu_kv_padded, k)):
            if padded is None or padded is cu:
                gathers.append(None)
            else:
                gathers.append(_thd_padded_index(cu, padded, t.shape[0], name))
        if pad_between_seqs and gathers == [None, None]:
            raise _refuse("pad_between_seqs", pad_between_seqs, "says there are tokens between sequences but no "
                                                                "cu_seqlens_q_padded/cu_seqlens_kv_padded locate them")
        same = cu_q is cu_kv and gathers[0] is None and gathers[1] is None
        varlen = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_q if same else cu_kv,
                  "max_seqlen_q": _maybe_int(max_q, "max_seqlen_q"),
                  "max_seqlen_k": _maybe_int(max_kv, "max_seqlen_kv")}
        index_q, index_kv = gathers
        opts = {"layout": "thd", **options, **varlen}
        tokens_q = q.shape[0]

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if index_q is not None:
                q = q[index_q]
            if index_kv is not None:
                k, v = k[index_kv], v[index_kv]
            out = attention(q, k, v, **opts)
            if index_q is not None:  # the tokens between sequences come out as zeros
                out = out.new_zeros(tokens_q, *out.shape[1:]).index_put((index_q,), out)
            return out.reshape(out.shape[0], -1)  # type: ignore[no-any-return]

        def describe() -> tuple[tuple[Tensor, ...], dict[str, Any]]:
            return ((q if index_q is None else q[index_q], k if index_kv is None else k[index_kv],
                     v if index_kv is None else v[index_kv]), opts)

        return _Plan(run, (q, k, v), describe)

    def _plan_padded(self, q: Tensor, k: Tensor, v: Tensor, fmt: str, options: dict[str, Any],
                     attention_mask: Any, cu_q: Any, cu_kv: Any) -> _Plan:
        """A dense padded batch: the kept tokens packed as thd (positions count kept tokens, per sequence), the
        output padded back with zeros."""
        b_axis, s_axis = (1, 0) if fmt == "sbhd" else (0, 1)
        batch, sq, skv = q.shape[b_axis], q.shape[s_axis], k.shape[s_axis]
        if cu_q is not None or cu_kv is not None:  # TE prefers cu_seqlens over the mask when given
            if cu_q is None or cu_kv is None:
                raise _refuse("cu_seqlens_q" if cu_q is None else "cu_seqlens_kv", None,
                              "must be given with its pair (cu_seqlens_q and cu_seqlens_kv)")
            keep_q = _lengths_keep(cu_q, "cu_seqlens_q", batch, sq, q.device)
            keep_kv = (keep_q if cu_kv is cu_q and skv == sq
                       else _lengths_keep(cu_kv, "cu_seqlens_kv", batch, skv, q.device))
        elif self.attention_type == "self":
            if isinstance(attention_mask, (tuple, list)):
                raise _refuse("attention_mask", attention_mask, "must be one [b, 1, 1, s] tensor for "
                                                                "attention_type='self' (a pair is for 'cross')")
            if attention_mask is None:
                raise _refuse("attention_mask", None, "is required for a padding mask type (or pass cu_seqlens_q "
                                                      "and cu_seqlens_kv)")
            if sq != skv:
                raise _refuse("attention_mask", attention_mask, f"is one mask for queries ({sq}) and keys ({skv}) of "
                                                                "different lengths; use attention_type='cross' with a "
                                                                "(mask_q, mask_kv) pair")
            keep_q = keep_kv = _padding_keep(attention_mask, "attention_mask", batch, sq, q.device)
        else:
            if not (isinstance(attention_mask, (tuple, list)) and len(attention_mask) == 2):
                raise _refuse("attention_mask", attention_mask, "must be a pair ([b, 1, 1, sq], [b, 1, 1, skv]) for "
                                                                "attention_type='cross'")
            keep_q = _padding_keep(attention_mask[0], "attention_mask[0]", batch, sq, q.device)
            keep_kv = _padding_keep(attention_mask[1], "attention_mask[1]", batch, skv, q.device)
        def to_bshd(t: Tensor) -> Tensor:
            return t.transpose(0, 1) if fmt == "sbhd" else t

        opts = {"layout": "thd", **options}

        def pack(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, dict[str, Any]]:
            pq, index_q, cu_sq, max_sq, _ = unpad_input(to_bshd(q), keep_q)
            same = keep_q is keep_kv
            if same:  # one mask (self-attention): its tokens' index and lengths serve k and v too (no second sync)
                index_kv, cu_skv, max_skv = index_q, cu_sq, max_sq
                pk = to_bshd(k).flatten(0, 1)[index_kv]
            else:
                pk, index_kv, cu_skv, max_skv, _ = unpad_input(to_bshd(k), keep_kv)
            pv = to_bshd(v).flatten(0, 1)[index_kv]
            varlen = {"cu_seqlens_q": cu_sq, "cu_seqlens_k": cu_sq if same else cu_skv,
                      "max_seqlen_q": max(max_sq, 1), "max_seqlen_k": max(max_skv, 1)}
            return (pq, pk, pv), index_q, varlen

        # Without a gradient, the same attention as one dense call: the keys' padding as a boolean mask
        # (b, 1, 1, skv) beside the mask type's causal pattern, the padded queries' rows then zeroed — no
        # nonzero or max-length read back to the host, so no sync per call. Exact (the tests check both paths
        # against the oracle) where positions counted over kept tokens and over the padded axis order the
        # tokens alike: with no window or ALiBi (they measure distances), and for a causal mask only when one
        # mask pads queries and keys (ranks among kept tokens are monotone in position; bottom-right equals
        # top-left there). Training keeps the packed varlen call: on the H100 it was faster than the dense masked
        # kernel forward and backward (bshd padding_causal GQA 4x2048: 3.26 vs 4.06 ms fwd+bwd,
        # benchmarks/results/h100-7b1efc7/te_module-h100.md; module/op 0.779 at c8026d6), while its forward paid
        # the syncs (1.69 vs 1.17 ms there).
        dense_ok = (options["window"] is None and "alibi_slopes" not in options and not options["dropout_p"]
                    and (not options["causal"] or keep_q is keep_kv))
        key_mask = keep_kv[:, None, None, :]  # True = attend (opdispatch), broadcast over heads and queries
        query_rows = (keep_q.t() if fmt == "sbhd" else keep_q)[:, :, None, None]

        def dense(q: Tensor, k: Tensor, v: Tensor) -> bool:
            if not dense_ok or not torch.is_grad_enabled():
                return dense_ok
            sinks = options.get("sinks")
            return not (q.requires_grad or k.requires_grad or v.requires_grad
                        or (sinks is not None and sinks.requires_grad))

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if dense(q, k, v):
                out = attention(q, k, v, layout=fmt, attn_mask=key_mask, **options)
                out = out.masked_fill(~query_rows, 0.0)  # TE's zeros for padded queries (a keyless row included)
                return out.reshape(*out.shape[:2], -1)  # type: ignore[no-any-return]
            packed, index_q, varlen = pack(q, k, v)
            out = pad_input(attention(*packed, **opts, **varlen), index_q, batch, sq)  # zeros where padded
            out = out.transpose(0, 1) if fmt == "sbhd" else out
            return out.reshape(*out.shape[:2], -1)

        def describe() -> tuple[tuple[Tensor, ...], dict[str, Any]]:
            if dense(q, k, v):
                return (q, k, v), {"layout": fmt, "attn_mask": key_mask, **options}
            packed, _, varlen = pack(q, k, v)
            return packed, {**opts, **varlen}

        return _Plan(run, (q, k, v), describe)


class _Plan:
    """A checked call: `run(*tensors)` computes TE's output; `describe()` gives the opdispatch call it makes,
    (q, k, v) and its keyword arguments (what `explain` is asked about); `config`: TE's run configuration of the
    call (set with NVTE_DEBUG on only)."""

    __slots__ = ("run", "tensors", "describe", "config", "dense", "warned")

    def __init__(self, run: Callable[..., Tensor], tensors: tuple[Tensor, ...],
                 describe: Callable[[], tuple[tuple[Tensor, ...], dict[str, Any]]]) -> None:
        self.run, self.tensors, self.describe = run, tensors, describe
        self.config: dict[str, Any] | None = None
        # A dense call's (layout, opdispatch options), when they follow from the call's signature alone (what
        # forward's fast path may reuse); whether checking the call warned (then it is not reused: it warns again).
        self.dense: tuple[str, dict[str, Any]] | None = None
        self.warned = False


_UNSET = object()


def _longest(cu_seqlens: Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _log_selection(logger: logging.Logger, plan: _Plan) -> None:
    """TE's backend-selection lines for the call `plan` makes, when the implementation opdispatch picks for the
    call's decision class (on its device) is not the one last logged for that class: at DEBUG the run
    configuration, "Disabling <impl> due to <reason>" for every candidate not chosen, the available and the
    selected backend; at INFO "Running with <backend>". A dispatch key (class, device, policy, overrides, scope)
    seen before costs no new decision."""
    qkv, options = plan.describe()
    call = validate_attention(*qkv, module=MODULE.get(), **options)
    manager = get_manager()
    device = manager.device_info(call.device)
    klass = (manager.decision_class("attention", call), device.key)
    key = (klass, manager.policy.hash, OVERRIDES.get(), MODULE.get())
    seen = _SEEN_KEYS.get(key, _UNSET)
    if seen is not _UNSET and _LOGGED_CHOICE.get(klass, _UNSET) == seen:
        return
    decision = manager.explain("attention", call)
    chosen = decision.chosen_id
    bounded_put(_SEEN_KEYS, key, chosen)
    if _LOGGED_CHOICE.get(klass, _UNSET) == chosen:
        return
    bounded_put(_LOGGED_CHOICE, klass, chosen)

    from ..base import __version__
    config: dict[str, Any] = {"opdispatch_version": __version__, "device": device.describe(),
                              "policy": f"{decision.policy_source} (hash {decision.policy_hash})",
                              "scope": MODULE.get(), "switches": list(te_switches()[0])}
    q = plan.tensors[0]
    te_config = dict(plan.config or {})
    if te_config.get("qkv_format") == "thd":
        cu_q, cu_k = options["cu_seqlens_q"], options["cu_seqlens_k"]
        config["batch_size"] = cu_q.numel() - 1
        config["max_seqlen_q"] = options.get("max_seqlen_q") or _longest(cu_q)
        config["max_seqlen_kv"] = options.get("max_seqlen_k") or _longest(cu_k)
    else:
        b_axis, s_axis = (1, 0) if te_config.get("qkv_format") == "sbhd" else (0, 1)
        config["batch_size"] = q.shape[b_axis]
        config["max_seqlen_q"], config["max_seqlen_kv"] = q.shape[s_axis], plan.tensors[1].shape[s_axis]
    config.update(te_config)
    logger.debug("Running with config=%s", config)
    for c in decision.candidates:
        if c.impl_id == chosen:
            continue
        if c.status == ELIGIBLE:
            why = f"preference for {chosen} (policy order: {c.decided_by})"
        else:
            why = c.status + (f": {'; '.join(c.reasons)}" if c.reasons else "")  # a denial's reason names its source
            by_switch = [f"{name}=0" for name, impls in SWITCHES if c.impl_id in impls and _switch_off(name)]
            if c.status == DENIED and by_switch:
                why = f"{' or '.join(by_switch)} ({why})"  # TE: "Disabling FusedAttention due to NVTE_FUSED_ATTN=0"
        logger.debug("Disabling %s due to %s", te_backend(c.impl_id), why)
    available = [c.impl_id for c in decision.candidates if c.status in (CHOSEN, ELIGIBLE)]
    families = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
    shown = [f"{family}={any(TE_BACKENDS.get(i, '').startswith(family) for i in available)}" for family in families]
    shown += [f"{i}=True" for i in available if i not in TE_BACKENDS]
    logger.debug("Available backends = {%s}", ", ".join(shown))
    logger.debug("Selected backend = %s.", te_backend(chosen))
    if chosen is None:
        return  # the call itself raises, as TE's "No dot product attention backend is available"
    family = TE_BACKENDS.get(chosen)
    if family is None:
        logger.info("Running with %s backend (an opdispatch implementation TransformerEngine has no backend for)",
                    chosen)
    elif family.startswith("FlashAttention"):
        logger.info("Running with FlashAttention backend (version %s, opdispatch %s)", family.split()[-1], chosen)
    else:
        logger.info("Running with %s backend (opdispatch %s)", family, chosen)


def _plan_context_parallel(cp: _ContextParallel, q: Tensor, k: Tensor, v: Tensor, fmt: str,
                           options: dict[str, Any]) -> _Plan:
    """This rank's shards through `context_parallel_attention` with ``sharding="zigzag"``: TE's DualChunkSwap
    (context_parallel.attn_forward_func_with_cp's docstring: the sequence in 2·cp_size chunks, rank r holding
    chunks r and 2·cp_size−1−r, "applied to all attn_mask_types and all qkv_formats"; get_batch_on_this_cp_rank
    takes the same slices) is opdispatch's zigzag (`shard_sequence`). ``causal`` is over the whole sequence,
    top-left, as TE's "causal". `describe` gives this rank's diagonal block (its shard against its own K/V), one
    of the calls the exchange makes."""
    causal, scale = options["causal"], options["scale"]

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = context_parallel_attention(q, k, v, group=cp.group, causal=causal, mode=cp.mode, sharding="zigzag",
                                         layout=fmt, scale=scale)
        return out.reshape(*out.shape[:2], -1)  # type: ignore[no-any-return]  # (s, b, h*d) / (b, s, h*d)

    return _Plan(run, (q, k, v), lambda: ((q, k, v), {"layout": fmt, "causal": causal, "scale": scale}))


def _dense_run(fmt: str, options: dict[str, Any]) -> Callable[..., Tensor]:
    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = attention(q, k, v, layout=fmt, **options)
        return out.reshape(*out.shape[:2], -1)  # type: ignore[no-any-return]  # (s, b, h*d) / (b, s, h*d)
    return run


def _maybe_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(name, value, "must be a positive int or None")
    return value


def _unpack(q: Any, k: Any, v: Any, qkv_layer: Any, kv_layer: Any, interleave_dim: Any,
            fmt: str) -> tuple[Any, Any, Any]:
    """TE's `_unpack_packed_qkv`: q/k/v as views of a packed qkv_layer ([.., 3, h, d] at -3 or [.., h, 3, d] at
    -2) or kv_layer (2 instead of 3) beside query_layer."""
    if qkv_layer is None and kv_layer is None:
        if q is None or k is None or v is None:
            raise ValueError(f"{_NAME}: query_layer, key_layer and value_layer are required unless packed inputs "
                             "(qkv_layer, or query_layer + kv_layer) are given")
        return q, k, v
    if qkv_layer is not None and kv_layer is not None:
        raise _refuse("kv_layer", kv_layer, "and qkv_layer are mutually exclusive")
    if interleave_dim not in (-3, -2):
        raise _refuse("qkv_interleave_dim", interleave_dim, "must be -3 (e.g. bs3hd) or -2 (e.g. bsh3d)")
    packed, name, parts = (qkv_layer, "qkv_layer", 3) if qkv_layer is not None else (kv_layer, "kv_layer", 2)
    rank = 4 if fmt == "thd" else 5
    if not isinstance(packed, Tensor) or packed.dim() != rank or packed.shape[interleave_dim] != parts:
        raise _refuse(name, packed, f"must be a {rank}-D tensor with size {parts} at qkv_interleave_dim="
                                    f"{interleave_dim} for qkv_format={fmt!r}")
    if parts == 3:
        if any(x is not None for x in (q, k, v)):
            raise _refuse("qkv_layer", packed, "already packs Q, K and V: query_layer, key_layer and value_layer "
                                               "must be None")
        q, k, v = packed.unbind(interleave_dim)
    else:
        if q is None or k is not None or v is not None:
            raise _refuse("kv_layer", packed, "packs K and V: give query_layer with it and leave key_layer and "
                                              "value_layer None")
        k, v = packed.unbind(interleave_dim)
    return q, k, v
