"""The generic attention op: its canonical call, input validation, and the capability-declaring base class.

Every input is validated once, here, before any implementation sees it; implementations then only check their
own limits (via `AttentionCaps` and `extra_reasons`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..base._arguments import Arg, OpArguments
from ._attention_tuning import attention_tuning
from ..base._dtypes import (FP8_DTYPES, FP8_OUT_DTYPES, caps_as_dict, dtype_name,
                      dtype_reason)
from ..base._impl import CapabilityRule, Impl, feature_rule, unmet_capabilities
from ..base._kv_checks import raise_pending, sync_checks
from ..base._ops import OpSpec, register_op

if TYPE_CHECKING:
    from ..base._device import DeviceInfo

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")
# The largest `scale`: float32 scores q·k·scale overflow only for |q·k| > 3.2e32 below it (at scale=1e38, for
# |q·k| > 3.4, i.e. almost always, giving NaN where the math is finite).
MAX_SCALE = 2**20
DENSE_LAYOUTS = ("bshd", "bhsd", "sbhd")
# Where (batch, seq, heads, dim) sit in each dense layout: the one table every layout switch reads (views into
# bhsd/bshd and back here, the compiled op's size fields, context parallel's sequence dim, the sinks epilogue).
LAYOUT_DIMS: dict[str, tuple[int, int, int, int]] = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3),
                                                     "sbhd": (1, 0, 2, 3)}


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


_TO_BHSD = {layout: (b, h, s, d) for layout, (b, s, h, d) in LAYOUT_DIMS.items()}
_FROM_BHSD = {layout: _inverse(order) for layout, order in _TO_BHSD.items()}
_TO_BSHD = dict(LAYOUT_DIMS)
_FROM_BSHD = {layout: _inverse(order) for layout, order in _TO_BSHD.items()}
_IDENTITY = (0, 1, 2, 3)


def _permuted(t: torch.Tensor, orders: Mapping[str, tuple[int, ...]], layout: str, what: str) -> torch.Tensor:
    order = orders.get(layout)
    if order is None:
        raise ValueError(f"{what}() needs a dense layout, call has layout {layout!r}")
    return t if order == _IDENTITY else t.permute(order)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")

ATTENTION_ARGS = OpArguments("attention", (
    Arg("q", "torch.Tensor", key="strided", positional=True, doc="queries, in `layout`"),
    Arg("k", "torch.Tensor", key="strided", positional=True, doc="keys; may have fewer heads than q (GQA/MQA)"),
    Arg("v", "torch.Tensor", key="strided", positional=True, doc="values; head_dim_v may differ from q/k's"),
    Arg("layout", "str", "bshd", doc="`bshd`, `bhsd`, `sbhd`, or `thd` (packed varlen with `cu_seqlens_*`)"),
    Arg("causal", "bool", False, doc="mask keys after the query's (aligned) diagonal"),
    Arg("causal_alignment", "str", "top_left",
        doc="`top_left` (query i sees keys j <= i) or `bottom_right` (last query sees last key)"),
    Arg("window", "tuple[int, int] | None", None, doc="(left, right) keys kept around the diagonal; -1 unbounded"),
    Arg("scale", "float | None", None, doc="score scale; None = 1/sqrt(head_dim)"),
    Arg("dropout_p", "float", 0.0, doc="attention dropout probability, 0 <= p < 1"),
    Arg("softcap", "float", 0.0, doc="`softcap * tanh(scores / softcap)`; 0 disables it"),
    Arg("alibi_slopes", "torch.Tensor | None", None, key="bypass", doc="(heads,) or (batch, heads) ALiBi slopes"),
    Arg("attn_mask", "torch.Tensor | None", None, key="tensor?", doc="bool, True = attend; broadcast to scores"),
    Arg("attn_bias", "torch.Tensor | None", None, key="bypass", doc="float bias added to the scores"),
    Arg("sinks", "torch.Tensor | None", None, key="tensor?",
        doc="float32 (heads_q,) attention-sink logits: each row's softmax gains a virtual key of that score and a "
            "zero value (`out * sigmoid(lse - sink)`; the LSE includes it); differentiable"),
    Arg("cu_seqlens_q", "torch.Tensor | None", None, key="bypass", doc="int32 (batch + 1,) offsets for `thd`"),
    Arg("cu_seqlens_k", "torch.Tensor | None", None, key="bypass", doc="int32 (batch + 1,) offsets for `thd`"),
    Arg("max_seqlen_q", "int | None", None, doc="longest query sequence of a `thd` call"),
    Arg("max_seqlen_k", "int | None", None, doc="longest key sequence of a `thd` call"),
    Arg("seqused_k", "torch.Tensor | None", None, key="index",
        doc="int32 (batch,): keys each sequence uses — a KV cache's fill; sequence b sees only its first "
            "`seqused_k[b]` keys, and bottom-right alignment counts from there"),
    Arg("block_table", "torch.Tensor | None", None, key="index",
        doc="int32 (batch, max_pages): a paged KV cache; k/v are then page pools (num_pages, page_size, "
            "heads_kv, dim) and row b lists sequence b's pages in order; needs `seqused_k`"),
    Arg("q_descale", "torch.Tensor | None", None, key="bypass",
        doc="FP8 q/k/v only: float32 dequantization factor of q (real = fp8 * descale), shape () or (1,) per tensor, "
            "or (batch, heads_kv) as FA3 takes it (query head h uses row h // (heads_q / heads_kv))"),
    Arg("k_descale", "torch.Tensor | None", None, key="bypass", doc="FP8 only: k's factor, shaped as q_descale"),
    Arg("v_descale", "torch.Tensor | None", None, key="bypass", doc="FP8 only: v's factor, shaped as q_descale"),
    Arg("out_dtype", "torch.dtype | None", None,
        doc="FP8 q/k/v: the output's dtype, bfloat16 (None), float16, or an FP8 kind (float8_e4m3fn, float8_e5m2: "
            "quantized by `out_scale`, as TransformerEngine's fp8_mha keeps FP8 across attention); other calls: "
            "None or q's dtype"),
    Arg("out_scale", "torch.Tensor | None", None, key="bypass",
        doc="FP8 output only (required with an FP8 `out_dtype`, refused otherwise): float32 quantization factor "
            "of the output, shape () or (1,): out = saturate(real * out_scale) to FP8's largest finite "
            "(cuDNN's scale_o)"),
    Arg("out_amax", "torch.Tensor | None", None, key="bypass",
        doc="FP8 q/k/v only: a float32 tensor of shape () or (1,) the op writes max|real output| into (before "
            "any quantization; cuDNN's Amax_O), for delayed or current scaling of the next call's `out_scale`"),
    Arg("return_lse", "bool", False, doc="also return the log-sum-exp of the scores"),
    Arg("deterministic", "bool", False, doc="only implementations with a deterministic backward"),
    Arg("impl", "str | None", None, doc="pin one implementation id for this call (never falls back)"),
), bound=("q", "k", "v"), context=("_overrides", "_module", "_deterministic", "_profiling"),
   bound_optional=("seqused_k", "block_table", "attn_mask", "sinks"),
   return_forms=(("return_lse", "Literal[False]", "torch.Tensor"),
                 ("return_lse", "Literal[True]", "tuple[torch.Tensor, torch.Tensor]")))


class AttentionCall:
    """One validated attention call, in the user's layout, with the derived sizes implementations need.

    Sizes: `batch`, `seqlen_q`, `seqlen_k` (the max lengths for `thd`), `heads_q`, `heads_kv`, `head_dim`
    (of q and k), `head_dim_v`. Tensors stay as given; `bhsd()` returns views in (batch, heads, seq, dim).
    """

    # The op's arguments (but the per-call pin) as given, then what validation derives from them.
    __slots__ = tuple(name for name in ATTENTION_ARGS.names if name != "impl") + (
        "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "head_dim_v", "dtype", "device",
        "requires_grad", "module", "rewrites")

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    causal: bool
    causal_alignment: str
    window: tuple[int, int] | None
    scale: float
    dropout_p: float
    softcap: float
    alibi_slopes: torch.Tensor | None
    attn_mask: torch.Tensor | None
    attn_bias: torch.Tensor | None
    sinks: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    seqused_k: torch.Tensor | None
    block_table: torch.Tensor | None
    q_descale: torch.Tensor | None
    k_descale: torch.Tensor | None
    v_descale: torch.Tensor | None
    # The output's dtype: q's for every call but an FP8 one (bfloat16, float16 or an FP8 kind there).
    out_dtype: torch.dtype
    # An FP8 output's quantization factor (None for any other output); where an FP8 call writes its output's amax.
    out_scale: torch.Tensor | None
    out_amax: torch.Tensor | None
    return_lse: bool
    deterministic: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    module: str | None
    # How validation rewrote the user's call into its canonical form (empty when it did not): explain shows them.
    rewrites: tuple[str, ...]

    # -- derived views and flags -----------------------------------------------------------------------------
    @property
    def varlen(self) -> bool:
        return self.layout == "thd"

    @property
    def fp8(self) -> bool:
        """Whether q/k/v are FP8 (with their descales; the output is `out_dtype`)."""
        return self.dtype in FP8_DTYPES

    @property
    def descale_per_head(self) -> bool:
        """Whether any descale of an FP8 call is per (batch, kv head) rather than one per tensor."""
        q, k, v = self.q_descale, self.k_descale, self.v_descale
        if q is None and k is None and v is None:  # every call but FP8 ones: read on each class key
            return False
        return any(t is not None and t.dim() == 2 for t in (q, k, v))

    @property
    def fp8_out(self) -> bool:
        """Whether an FP8 call's output is FP8 itself (quantized by `out_scale`)."""
        return self.out_dtype in FP8_DTYPES

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def kv_cache(self) -> bool:
        """Whether each sequence uses only its first `seqused_k[b]` keys (a KV cache, paged or not)."""
        return self.seqused_k is not None

    @property
    def paged(self) -> bool:
        """Whether k/v are page pools addressed through `block_table`."""
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        """Keys per page of a paged call (0 when not paged)."""
        return self.k.shape[1] if self.block_table is not None else 0

    @property
    def alignment_matters(self) -> bool:
        """Whether top-left and bottom-right alignment give different results for this call."""
        if not (self.causal or self.window is not None):
            return False
        if self.seqused_k is not None:
            return True  # the lengths are the cache's fill, read by the kernel, not by selection
        if self.varlen:
            return self.cu_seqlens_q is not self.cu_seqlens_k
        return self.seqlen_q != self.seqlen_k

    @property
    def same_lengths(self) -> bool:
        """Whether every sequence has as many queries as keys (varlen: cu_seqlens_k is cu_seqlens_q, which
        validation makes so whenever their values are equal; never for a KV cache, whose fill varies)."""
        if self.seqused_k is not None:
            return False
        if self.varlen:
            return self.cu_seqlens_q is self.cu_seqlens_k
        return self.seqlen_q == self.seqlen_k

    @property
    def keyless_rows(self) -> bool:
        """Whether the causal/window pattern may leave a query row without any key (its output is then zeros and
        its LSE -inf). Dense layouts: exactly, from the lengths and the alignment. Packed sequences of distinct
        lengths and KV caches, whose per-sequence lengths are data: whenever a bottom-right alignment or a window
        could blind a row. Not said here (data, read by no selection): a mask that hides a whole row, or a sequence
        with no key at all."""
        window = self.window
        if not self.causal and window is None:
            return False
        left, right = window if window is not None else (-1, -1)
        if self.causal:
            right = 0
        if self.seqused_k is not None or (self.varlen and self.cu_seqlens_q is not self.cu_seqlens_k):
            return self.causal_alignment == "bottom_right" or window is not None
        offset = self.seqlen_k - self.seqlen_q if self.causal_alignment == "bottom_right" else 0
        # Row 0 sees keys up to offset + right; the last row keys from seqlen_q - 1 + offset - left on.
        return (right != -1 and offset + right < 0) or (left != -1 and self.seqlen_q - 1 + offset - left
                                                          > self.seqlen_k - 1)

    @property
    def positional_mask(self) -> bool:
        """Whether a top-left-causal kernel needs an explicit pattern: a window, or bottom-right causal alignment
        where it differs from top-left."""
        return self.window is not None or (self.causal and self.alignment_matters
                                           and self.causal_alignment == "bottom_right")

    def bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """View a dense q/k/v/out tensor of this call's layout as (batch, heads, seq, dim)."""
        return _permuted(t, _TO_BHSD, self.layout, "bhsd")

    def from_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of `bhsd()`: a (batch, heads, seq, dim) result back into this call's layout."""
        return _permuted(t, _FROM_BHSD, self.layout, "from_bhsd")

    def bshd(self, t: torch.Tensor) -> torch.Tensor:
        """View a dense q/k/v/out tensor of this call's layout as (batch, seq, heads, dim) — flash-attn's layout."""
        return _permuted(t, _TO_BSHD, self.layout, "bshd")

    def from_bshd(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of `bshd()`."""
        return _permuted(t, _FROM_BSHD, self.layout, "from_bshd")

    def with_tensors(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache: torch.Tensor | None
                     ) -> AttentionCall:
        """A copy of this call with other q/k/v of the same signature (used by bound plans) and, when given (the
        front door's `bound_optional`), this call's `seqused_k`, `block_table`, `attn_mask` and `sinks`: a KV
        cache's lengths and pages, a mask or sinks whose values change from call to call."""
        new = _copy_with_qkv(self, q, k, v)
        if cache:
            new.seqused_k, new.block_table = cache[0], cache[1]
            if len(cache) > 2:
                new.attn_mask = cache[2]
            if len(cache) > 3:
                new.sinks = cache[3]
        return new

    def without_sinks(self) -> AttentionCall:
        """The call a sinks call runs on its implementation: no sinks, and the LSE returned (the shared sink
        epilogue, `opdispatch.ops._sinks`, combines the two). Gradients are asked of it only for q/k/v/attn_bias."""
        inner = self.with_tensors(self.q, self.k, self.v)
        inner.sinks = None
        inner.return_lse = True
        inner.requires_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.attn_bias))
        return inner

    def stripped(self) -> AttentionCall:
        """This call without its q/k/v: what a bound function may keep (it must not keep the first call's
        tensors alive). Its `with_tensors` gives full calls again."""
        return self.with_tensors(None, None, None)  # type: ignore[arg-type]

    def signature(self) -> tuple[Any, ...]:
        """Everything selection may depend on, as a compact hashable key (no tensor data)."""
        mask = self.attn_mask
        bias = self.attn_bias
        alibi = self.alibi_slopes
        if self.varlen:
            shapes: tuple[Any, ...] = (self.batch, self.seqlen_q, self.seqlen_k, self.heads_q, self.heads_kv,
                                       self.head_dim, self.head_dim_v, self.alignment_matters)
        else:
            shapes = (tuple(self.q.shape), tuple(self.k.shape), tuple(self.v.shape))
        if self.seqused_k is not None:
            table = self.block_table
            shapes += (tuple(self.k.shape), None if table is None else tuple(table.shape))
        return (
            self.layout, shapes, self.dtype, self.device, self.causal, self.causal_alignment, self.window,
            self.dropout_p > 0.0, self.softcap > 0.0,
            None if alibi is None else tuple(alibi.shape),
            None if mask is None else (tuple(mask.shape), mask.dtype, mask.requires_grad),
            None if bias is None else (tuple(bias.shape), bias.dtype, bias.requires_grad),
            None if self.sinks is None else self.sinks.requires_grad,
            self.return_lse, self.deterministic, self.requires_grad, self.module,
            self.out_dtype, self.descale_per_head, self.out_amax is not None,
        )

    def class_key(self) -> tuple[Any, ...]:
        """What selection may read of this call except its sizes: dtype, layout, head dims, GQA ratio, every
        feature flag, whether the lengths are equal, and the broadcast pattern of masks and biases.

        Sizes (batch, sequence lengths, head counts) join the decision key only through the thresholds that
        the policy and the candidates' limits compare them with (see `opdispatch.engine._classes`)."""
        mask = self.attn_mask
        bias = self.attn_bias
        alibi = self.alibi_slopes
        return (
            self.layout, self.dtype, self.device, self.head_dim, self.head_dim_v, self.heads_q // self.heads_kv,
            self.causal, self.causal_alignment, self.same_lengths, self.keyless_rows, self.window,
            self.dropout_p > 0.0,
            self.softcap > 0.0, None if alibi is None else alibi.dim(),
            None if self.seqused_k is None else self.page_size,
            None if mask is None else (tuple(s == 1 for s in mask.shape), mask.requires_grad),
            None if bias is None else (tuple(s == 1 for s in bias.shape), bias.dtype, bias.requires_grad),
            None if self.sinks is None else self.sinks.requires_grad,
            self.return_lse, self.deterministic, self.requires_grad, self.module,
            self.out_dtype, self.descale_per_head, self.out_amax is not None,
        )

    def describe(self) -> str:
        """One line a human can read in errors and tables."""
        parts = [f"layout={self.layout}", f"q={tuple(self.q.shape)}", f"k={tuple(self.k.shape)}",
                 f"v={tuple(self.v.shape)}", f"dtype={dtype_name(self.dtype)}", f"device={self.device}",
                 f"heads={self.heads_q}/{self.heads_kv}", f"head_dim={self.head_dim}"]
        if self.head_dim_v != self.head_dim:
            parts.append(f"head_dim_v={self.head_dim_v}")
        if self.fp8:
            granularity = "per (batch, kv head)" if self.descale_per_head else "per tensor"
            parts.append(f"out_dtype={dtype_name(self.out_dtype)} descales {granularity}")
            if self.out_amax is not None:
                parts.append("out_amax")
        if self.varlen:
            parts.append(f"varlen batch={self.batch} max_seqlen_q={self.seqlen_q} max_seqlen_k={self.seqlen_k}")
        if self.block_table is not None:
            parts.append(f"paged_kv(page_size={self.page_size}, max_pages={self.block_table.shape[1]})")
        elif self.seqused_k is not None:
            parts.append("kv_cache(seqused_k)")
        if self.causal:
            parts.append(f"causal({self.causal_alignment})")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi_slopes is not None:
            parts.append("alibi")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p:g}")
        if self.attn_mask is not None:
            parts.append(f"attn_mask{tuple(self.attn_mask.shape)}")
        if self.attn_bias is not None:
            parts.append(f"attn_bias{tuple(self.attn_bias.shape)}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.return_lse:
            parts.append("return_lse")
        if self.deterministic:
            parts.append("deterministic")
        if self.requires_grad:
            parts.append("requires_grad")
        if self.rewrites:
            parts.append("[as written: " + "; ".join(self.rewrites) + "]")
        return " ".join(parts)


_CALL_SLOTS = AttentionCall.__slots__


def _generated_copy() -> Callable[[AttentionCall, Any, Any, Any], AttentionCall]:
    """`with_tensors`' copy as straight-line code (as dataclasses generates its methods): one attribute store per
    slot costs a fifth of a `setattr` loop over the slot names, and a call that misses the per-call fast path
    (every step of a growing decode loop) copies its template once or more."""
    lines = ["def copy_with_qkv(call, q, k, v):", "    new = _new(_AttentionCall)"]
    lines += [f"    new.{name} = call.{name}" for name in _CALL_SLOTS if name not in ("q", "k", "v")]
    lines += ["    new.q = q", "    new.k = k", "    new.v = v", "    return new"]
    namespace: dict[str, Any] = {"_new": AttentionCall.__new__, "_AttentionCall": AttentionCall}
    exec("\n".join(lines), namespace)  # noqa: S102  (source built above from the class's own slot names)
    return namespace["copy_with_qkv"]  # type: ignore[no-any-return]


_copy_with_qkv = _generated_copy()


# -- validation ----------------------------------------------------------------------------------------------

def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def _shape_of(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"attention(): {name} must be a torch.Tensor, got {type(value).__name__} ({value!r:.80})")
    if value.layout != torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).replace("torch.", "")
        raise TypeError(f"attention(): {name} is a {kind} tensor; attention takes dense (strided) tensors — "
                        f"convert it (e.g. {name}.to_dense()), or pack variable lengths as layout='thd' with "
                        "cu_seqlens")
    return value


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"attention(): {name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _check_nonneg_float(name: str, value: Any, *, below_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"attention(): {name} must be a float, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (below_one and value >= 1.0):
        allowed = "0 <= dropout_p < 1" if below_one else f"a finite {name} >= 0 (0 disables it)"
        raise ValueError(f"attention(): {name}={value!r} is out of range; allowed: {allowed}")
    return float(value)


def _broadcastable(shape: Sequence[int], target: Sequence[int]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def validate_attention(
    q: Any, k: Any, v: Any, *, layout: Any = "bshd", causal: Any = False, causal_alignment: Any = "top_left",
    window: Any = None, scale: Any = None, dropout_p: Any = 0.0, softcap: Any = 0.0, alibi_slopes: Any = None,
    attn_mask: Any = None, attn_bias: Any = None, sinks: Any = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
    max_seqlen_q: Any = None, max_seqlen_k: Any = None, seqused_k: Any = None, block_table: Any = None,
    q_descale: Any = None, k_descale: Any = None, v_descale: Any = None, out_dtype: Any = None,
    out_scale: Any = None, out_amax: Any = None,
    return_lse: Any = False, deterministic: Any = False, module: str | None = None, check_values: bool = True,
    varlen_same: bool | None = None,
) -> AttentionCall:
    """Validate every argument of `opdispatch.attention` and build the canonical call.

    Raises TypeError for wrong types and ValueError for wrong values; each message names the argument, its
    value and what is allowed. `check_values=False` skips the checks that read cu_seqlens values (a host sync
    on accelerators); shapes and types are always checked. `varlen_same` says whether distinct cu_seqlens_q and
    cu_seqlens_k tensors hold equal values when they are not read (None: unknown, taken as different).

    Equivalent forms are rewritten to one canonical call (`canonicalize`), so kernels and the decision cache see
    one form; `call.rewrites` says what changed.
    """
    q, k, v = _checked_qkv(q, k, v, layout, paged=block_table is not None)
    call = AttentionCall()
    call.q, call.k, call.v, call.layout = q, k, v, layout
    call.dtype, call.device = q.dtype, q.device
    call.module = module
    batch, seqlen_q, seqlen_k = _read_heads_and_dims(call, paged=block_table is not None)
    _read_flags(call, causal, causal_alignment, window, scale, dropout_p, softcap, return_lse, deterministic)
    if layout == "thd" and block_table is not None:
        batch, seqlen_q = _read_paged_varlen(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, check_values)
    elif layout == "thd":
        batch, seqlen_q, seqlen_k = _read_varlen(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 check_values, varlen_same)
    else:
        if not (cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None):
            _refuse_varlen_arguments(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        call.cu_seqlens_q = call.cu_seqlens_k = None
        call.max_seqlen_q = call.max_seqlen_k = None
    call.batch, call.seqlen_q, call.seqlen_k = batch, seqlen_q, seqlen_k
    if seqused_k is None and block_table is None:
        call.seqused_k = call.block_table = None
    else:
        _read_kv_cache(call, seqused_k, block_table, max_seqlen_k, check_values)
    if alibi_slopes is None and attn_mask is None and attn_bias is None:  # the common call: no step to take
        call.alibi_slopes = call.attn_mask = call.attn_bias = None
    else:
        _read_alibi_mask_and_bias(call, alibi_slopes, attn_mask, attn_bias)
    call.sinks = None if sinks is None else _check_sinks(sinks, call.heads_q, q.device)
    call.requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        call.attn_bias is not None and call.attn_bias.requires_grad) or (
        call.sinks is not None and call.sinks.requires_grad))
    _read_fp8(call, q_descale, k_descale, v_descale, out_dtype, check_values)
    _read_fp8_output(call, out_scale, out_amax, check_values)
    call.rewrites = ()
    canonicalize(call, varlen_rewritten=layout == "thd" and call.cu_seqlens_k is not cu_seqlens_k)
    return call


def revalidate_sizes(template: AttentionCall, causal: bool, causal_alignment: str, window: Any, q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, seqused_k: Any, block_table: Any, max_seqlen_k: Any,
                     attn_mask: Any) -> AttentionCall:
    """`validate_attention` of a dense call (no sinks, ALiBi, bias or varlen offsets) whose every argument but
    the tensors' sizes equals those of the call `template` was validated from — tensor ranks, last dims, dtypes,
    devices, strides and grad, every flag, the scope: what the fast path's size-generic key holds. `causal`,
    `causal_alignment` and `window` are the arguments as given (validation canonicalizes them by sizes).

    The steps of validation that read sizes run again, in its order; the rest is the template's (validated from
    the same values). Raises what those steps raise; the caller hands any error to `validate_attention` itself,
    the reference, so that what the user sees is its error."""
    if seqused_k is None and block_table is None and template.layout in LAYOUT_DIMS:
        return _revalidate_dense_sizes(template, causal, causal_alignment, window, q, k, v, attn_mask)
    call = template.with_tensors(q, k, v)
    for t in (q, k, v):
        if 0 in t.shape:
            raise ValueError("an empty dimension")  # validate_attention words it
    paged = block_table is not None
    batch, seqlen_q, seqlen_k = _read_heads_and_dims(call, paged=paged)
    call.causal, call.causal_alignment = causal, causal_alignment  # as _read_flags sets them (checked there)
    call.window = _check_window(window, causal)
    call.batch, call.seqlen_q, call.seqlen_k = batch, seqlen_q, seqlen_k
    if seqused_k is None and block_table is None:
        call.seqused_k = call.block_table = None
    else:
        _read_kv_cache(call, seqused_k, block_table, max_seqlen_k, True)
    if attn_mask is None:
        call.attn_mask = None
    else:
        _read_alibi_mask_and_bias(call, None, attn_mask, None)
    call.requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    call.rewrites = ()
    canonicalize(call)
    return call


def _revalidate_dense_sizes(template: AttentionCall, causal: bool, causal_alignment: str, window: Any,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            attn_mask: Any = None) -> AttentionCall:
    """`revalidate_sizes` of a dense call without a KV cache (a decode step, a new batch size, a padded batch's
    masked step): the size checks of `_read_heads_and_dims` in one frame — it runs once per new length of a decode
    loop's first pass. The head dims are not read: each tensor's last dim (the head dim in every dense layout) is in
    the key that found the template, so they are the template's; so are a mask's dtype, device and rank (the key
    holds them): its kind and broadcast to the scores are read again. Raises ValueError on any mismatch (the
    caller's reference validation then says what is wrong)."""
    b_at, s_at, h_at, _ = LAYOUT_DIMS[template.layout]
    qs, ks, vs = q.shape, k.shape, v.shape
    batch, seqlen_k, heads_kv = ks[b_at], ks[s_at], ks[h_at]
    heads_q = qs[h_at]
    if (0 in qs or 0 in ks or 0 in vs or qs[b_at] != batch or vs[b_at] != batch or vs[s_at] != seqlen_k
            or vs[h_at] != heads_kv or heads_q % heads_kv != 0):
        raise ValueError("sizes that do not validate")  # validate_attention words it
    call = _copy_with_qkv(template, q, k, v)
    call.heads_q, call.heads_kv = heads_q, heads_kv
    call.causal, call.causal_alignment = causal, causal_alignment  # as _read_flags sets them (checked there)
    call.window = None if window is None else _check_window(window, causal)
    call.batch, call.seqlen_q, call.seqlen_k = batch, qs[s_at], seqlen_k
    call.seqused_k = call.block_table = None
    if attn_mask is not None and not (type(attn_mask) is torch.Tensor and attn_mask.layout == torch.strided
                                      and not attn_mask.is_nested
                                      and _broadcastable(attn_mask.shape, (batch, heads_q, qs[s_at], seqlen_k))):
        raise ValueError("a mask that does not validate")  # validate_attention words it
    call.attn_mask = attn_mask
    call.requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    call.rewrites = ()
    canonicalize(call)
    return call


def size_generic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that a bound function (what `Impl.bind` returns) reads every size from the tensors it is given:
    the per-call fast path then reuses it for calls that differ from the bound call only in sizes (batch,
    sequence lengths, head counts) and that the policy decides alike — same decision class, so same layout,
    dtype, head dims and flags. A function that keeps anything sized from the bound call (a call record, a
    mask or bias built for its lengths, `max_seqlen`s) must not be declared: it is bound per signature."""
    fn.size_generic = True  # type: ignore[attr-defined]
    return fn


# The steps of `validate_attention`, in the order it takes them (the first problem found is the one raised).

def _checked_qkv(q: Any, k: Any, v: Any, layout: Any,
                 paged: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v are tensors of `layout`'s rank (k/v: 4-D page pools when `paged`), one floating dtype and one
    device, with no empty dimension."""
    q = _check_tensor("q", q)
    k = _check_tensor("k", k)
    v = _check_tensor("v", v)
    if layout not in LAYOUTS:
        raise ValueError(f"attention(): layout={layout!r} is not supported; allowed: {', '.join(LAYOUTS)} "
                         "(b=batch, s=sequence, h=heads, d=head dim; thd = packed variable-length sequences)")
    want_ndim = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if paged and name != "q":
            if t.dim() != 4:
                raise ValueError(f"attention(): {name} has shape {_shape_of(t)} ({t.dim()} dims) but with "
                                 "block_table k and v are page pools of 4 dims (num_pages, page_size, heads_kv, "
                                 "head_dim), whatever q's layout")
        elif t.dim() != want_ndim:
            raise ValueError(f"attention(): {name} has shape {_shape_of(t)} ({t.dim()} dims) but layout "
                             f"{layout!r} needs {want_ndim} dims ({' '.join(layout)})")
        if not _is_float(t.dtype):
            raise TypeError(f"attention(): {name} has dtype {t.dtype}; attention needs a floating-point dtype "
                            "(float16, bfloat16, float32, float64)")
        if 0 in t.shape:
            raise ValueError(f"attention(): {name} has an empty dimension, shape {_shape_of(t)}; every size "
                             "must be at least 1")
    if not (q.dtype == k.dtype == v.dtype) and FP8_DTYPES & {q.dtype, k.dtype, v.dtype}:
        raise TypeError(f"attention(): FP8 attention takes q, k and v of one FP8 kind, got q={q.dtype}, "
                        f"k={k.dtype}, v={v.dtype}; quantize all three to one of "
                        f"{', '.join(sorted(str(d) for d in FP8_DTYPES))} (each with its own descale)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention(): q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, "
                        f"v={v.dtype}; cast them with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention(): q, k and v must be on one device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}; move them with .to(device)")
    return q, k, v


def _read_heads_and_dims(call: AttentionCall, paged: bool = False) -> tuple[int, int, int]:
    """Check that q, k and v agree (batch, lengths, heads, head dims, the GQA ratio) and set the call's heads and
    head dims; (batch, seqlen_q, seqlen_k) of a dense call, -1s for what packed varlen reads from cu_seqlens and
    a paged call from its block table."""
    q, k, v, layout = call.q, call.k, call.v, call.layout
    if paged:
        if layout == "thd":
            _, hq, d = q.shape
            b = sq = -1
        else:
            b, sq, hq, d = _dims(layout, q.shape)
        pages_k, page_k, hkv, dk = k.shape
        pages_v, page_v, hv, dv = v.shape
        if (pages_k, page_k) != (pages_v, page_v):
            raise ValueError(f"attention(): the k and v page pools differ: k has {pages_k} pages of {page_k}, v "
                             f"{pages_v} of {page_v}; both are (num_pages, page_size, heads_kv, head_dim)")
        sk = tk = tv = -1
    elif layout == "thd":
        _, hq, d = q.shape
        tk, hkv, dk = k.shape
        tv, hv, dv = v.shape
        b = sq = sk = -1
    else:
        bq, sq, hq, d = _dims(layout, q.shape)
        bk, sk, hkv, dk = _dims(layout, k.shape)
        bv, sv, hv, dv = _dims(layout, v.shape)
        if not (bq == bk == bv):
            raise ValueError(f"attention(): batch sizes differ: q {bq}, k {bk}, v {bv} (layout {layout!r}); "
                             "q, k and v must have the same batch")
        if sk != sv:
            raise ValueError(f"attention(): k and v sequence lengths differ: k {sk}, v {sv} (layout {layout!r})")
        b = bq
        tk = tv = 0
    if layout == "thd" and not paged and tk != tv:
        raise ValueError(f"attention(): k and v token counts differ: k {tk}, v {tv} (layout 'thd')")
    if hkv != hv:
        raise ValueError(f"attention(): k and v head counts differ: k {hkv}, v {hv}")
    if d != dk:
        raise ValueError(f"attention(): q and k head dims differ: q {d}, k {dk}; they must be equal "
                         "(v may have its own head dim)")
    if hq % hkv != 0:
        raise ValueError(f"attention(): q heads ({hq}) must be a multiple of k/v heads ({hkv}) for grouped-query "
                         f"attention; allowed k/v head counts: "
                         f"{', '.join(str(n) for n in range(1, hq + 1) if hq % n == 0)}")
    call.heads_q, call.heads_kv, call.head_dim, call.head_dim_v = hq, hkv, d, dv
    return b, sq, sk


def _read_flags(call: AttentionCall, causal: Any, causal_alignment: Any, window: Any, scale: Any, dropout_p: Any,
                softcap: Any, return_lse: Any, deterministic: Any) -> None:
    """The masking pattern (causal, its alignment, the window), the scale, dropout, softcap and the output and
    determinism flags."""
    call.causal = _check_flag("causal", causal)
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"attention(): causal_alignment={causal_alignment!r} is not supported; allowed: "
                         "'top_left' (query i sees keys j <= i) or 'bottom_right' (the last query sees the last key)")
    call.causal_alignment = causal_alignment
    call.window = _check_window(window, call.causal)
    d = call.head_dim
    if scale is None:
        call.scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"attention(): scale must be a float or None, got {scale!r} ({type(scale).__name__})")
        if not math.isfinite(scale) or scale <= 0 or scale > MAX_SCALE:
            raise ValueError(
                f"attention(): scale={scale!r} is out of range; allowed: 0 < scale <= {MAX_SCALE} (2**20), or None "
                f"for 1/sqrt(head_dim) = {1.0 / math.sqrt(d):.6g}. Kernels compute the scores q·k·scale in float32, "
                "which a larger scale overflows to inf (NaN out) for ordinary inputs; to sharpen that much, scale q "
                "before the call")
        call.scale = float(scale)
    call.dropout_p = _check_nonneg_float("dropout_p", dropout_p, below_one=True)
    call.softcap = _check_nonneg_float("softcap", softcap)
    call.return_lse = _check_flag("return_lse", return_lse)
    # torch.use_deterministic_algorithms(True) asks the same of every op, this one included.
    call.deterministic = _check_flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()


_FP8_DESCALES = ("q_descale", "k_descale", "v_descale")


def _read_fp8(call: AttentionCall, q_descale: Any, k_descale: Any, v_descale: Any, out_dtype: Any,
              check_values: bool) -> None:
    """FP8 q/k/v: their three float32 descales (per tensor, or per (batch, kv head) as FA3 takes them) and the
    output dtype; other calls: no descale, and an output dtype that is q's. Sets `call.out_dtype`."""
    given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"attention(): out_dtype must be a torch.dtype or None, got {out_dtype!r} "
                        f"({type(out_dtype).__name__}); e.g. out_dtype=torch.bfloat16")
    if not call.fp8:
        passed = [name for name, value in given.items() if value is not None]
        if passed:
            raise ValueError(f"attention(): {', '.join(passed)} given but q/k/v are {dtype_name(call.dtype)}; "
                             f"descales dequantize FP8 inputs only ({', '.join(sorted(map(str, FP8_DTYPES)))}): "
                             "drop them, or pass q/k/v quantized to FP8")
        if out_dtype is not None and out_dtype != call.dtype:
            raise ValueError(f"attention(): out_dtype={out_dtype!r} differs from q's dtype {call.dtype}; only FP8 "
                             "calls return another dtype: drop out_dtype or cast the result")
        call.q_descale = call.k_descale = call.v_descale = None
        call.out_dtype = call.dtype
        return
    what = f"FP8 attention (q/k/v are {call.dtype})"
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"attention(): {what} needs q_descale, k_descale and v_descale; missing "
                         f"{', '.join(missing)}. Pass float32 factors with real = fp8 * descale: shape () for one "
                         f"per tensor (torch.ones(()) if unscaled), or (batch, heads_kv) = ({call.batch}, "
                         f"{call.heads_kv})")
    per_head = (call.batch, call.heads_kv)
    for name, value in given.items():
        t = _check_tensor(name, value)
        if t.dtype != torch.float32:
            raise TypeError(f"attention(): {name} must be float32, got {t.dtype}; use .float()")
        if tuple(t.shape) not in ((), (1,), per_head):
            raise ValueError(f"attention(): {name} has shape {_shape_of(t)}; allowed: () or (1,) for one factor "
                             f"per tensor, or (batch, heads_kv) = {per_head} as FA3 takes it")
        if t.device != call.device:
            raise ValueError(f"attention(): {name} is on {t.device} but q is on {call.device}; pass "
                             f"{name}.to(q.device)")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"attention(): {name} requires grad; FP8 attention is forward-only: pass "
                             f"{name}.detach()")
        # A host read: on CPU only (on accelerators descales are data the kernel reads, as FA3 does).
        if check_values and t.device.type == "cpu" and not bool(torch.isfinite(t).all()):
            raise ValueError(f"attention(): {name} holds a non-finite factor ({t.flatten()[:4].tolist()}…); every "
                             "descale must be finite")
    if call.requires_grad:
        raise ValueError(f"attention(): {what} is forward-only, but an input requires grad; detach the "
                         "inputs or run under torch.no_grad()")
    if call.sinks is not None:
        raise ValueError(f"attention(): {what} does not take sinks (the sink epilogue works on one output dtype); "
                         "drop sinks or dequantize q/k/v")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in FP8_OUT_DTYPES and out_dtype not in FP8_DTYPES:
        allowed = [*map(str, FP8_OUT_DTYPES), *sorted(map(str, FP8_DTYPES))]
        raise ValueError(f"attention(): out_dtype={out_dtype!r} is not an FP8 call's output; allowed: "
                         f"{', '.join(allowed)} (None: torch.bfloat16; an FP8 kind with out_scale)")
    call.q_descale, call.k_descale, call.v_descale = q_descale, k_descale, v_descale
    call.out_dtype = out_dtype


def _read_fp8_output(call: AttentionCall, out_scale: Any, out_amax: Any, check_values: bool) -> None:
    """An FP8 output's quantization factor `out_scale` (given exactly when `out_dtype` is an FP8 kind) and the
    optional `out_amax` of any FP8 call (a float32 tensor the implementation writes). Runs after `_read_fp8`."""
    if out_scale is None and out_amax is None and not call.fp8_out:  # the common call: nothing to check
        call.out_scale = call.out_amax = None
        return
    if not call.fp8:
        passed = ", ".join(n for n, t in (("out_scale", out_scale), ("out_amax", out_amax)) if t is not None)
        raise ValueError(f"attention(): {passed} given but q/k/v are {dtype_name(call.dtype)}; out_scale and "
                         "out_amax belong to FP8 calls (q/k/v in "
                         f"{', '.join(sorted(map(str, FP8_DTYPES)))} with descales): drop them")
    if call.fp8_out and out_scale is None:
        raise ValueError(f"attention(): out_dtype={call.out_dtype} needs out_scale, the output's float32 "
                         "quantization factor (out = saturate(real * out_scale)), shape () or (1,): e.g. "
                         "torch.full((), fp8_max / expected_amax, device=q.device), or the last call's out_amax "
                         "turned into a scale (delayed scaling)")
    if not call.fp8_out and out_scale is not None:
        raise ValueError(f"attention(): out_scale given but out_dtype is {call.out_dtype}; out_scale quantizes an "
                         "FP8 output only: drop it, or pass out_dtype=torch.float8_e4m3fn (or float8_e5m2)")
    for name, value in (("out_scale", out_scale), ("out_amax", out_amax)):
        if value is None:
            continue
        t = _check_tensor(name, value)
        if t.dtype != torch.float32:
            raise TypeError(f"attention(): {name} must be float32, got {t.dtype}; use "
                            f"{'.float()' if name == 'out_scale' else 'torch.zeros((), dtype=torch.float32)'}")
        if tuple(t.shape) not in ((), (1,)):
            raise ValueError(f"attention(): {name} has shape {_shape_of(t)}; allowed: () or (1,) (one factor per "
                             "tensor)")
        if t.device != call.device:
            raise ValueError(f"attention(): {name} is on {t.device} but q is on {call.device}; pass "
                             f"{name}.to(q.device)")
        if t.requires_grad and (name == "out_amax" or torch.is_grad_enabled()):
            raise ValueError(f"attention(): {name} requires grad; FP8 attention is forward-only "
                             f"{'and writes out_amax in place' if name == 'out_amax' else ''}: pass "
                             f"{name}.detach()".replace("  ", " "))
    if out_amax is not None and out_amax.device.type != "meta":  # (meta tensors have no memory to share)
        written = out_amax.untyped_storage().data_ptr()
        overlaps = [n for n, t in (("q", call.q), ("k", call.k), ("v", call.v), ("out_scale", out_scale),
                                   ("q_descale", call.q_descale), ("k_descale", call.k_descale),
                                   ("v_descale", call.v_descale))
                    if t is not None and t.untyped_storage().data_ptr() == written]
        if overlaps:
            raise ValueError(f"attention(): out_amax shares memory with {', '.join(overlaps)}, an input the call "
                             "reads; pass a tensor of its own (torch.zeros((), device=q.device))")
    # A host read: on CPU only (on accelerators the factor is data the kernel reads, as the descales are).
    if check_values and out_scale is not None and out_scale.device.type == "cpu":
        factor = float(out_scale.reshape(()))
        if not (math.isfinite(factor) and factor > 0.0):
            raise ValueError(f"attention(): out_scale={factor!r} is not a finite positive factor; out = "
                             "saturate(real * out_scale) needs one (fp8_max / amax of the expected output)")
    call.out_scale, call.out_amax = out_scale, out_amax


def _read_varlen(call: AttentionCall, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                 check_values: bool, varlen_same: bool | None) -> tuple[int, int, int]:
    """A packed call's cu_seqlens and longest lengths (one tensor for self-attention); (batch, seqlen_q,
    seqlen_k), the lengths being the longest sequences."""
    b, sq, sk, same = _check_varlen(call.q, call.k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    check_values)
    call.cu_seqlens_q, call.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
    if same is None:
        same = bool(varlen_same)
    if same and cu_seqlens_k is not cu_seqlens_q:
        # Equal lengths per sequence: self-attention. Kernels tell it by identity (no host read).
        call.cu_seqlens_k = cu_seqlens_q
    call.max_seqlen_q, call.max_seqlen_k = sq, sk
    return b, sq, sk


def _refuse_varlen_arguments(layout: str, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                             max_seqlen_k: Any) -> None:
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            raise ValueError(f"attention(): {name} is only meaningful with layout='thd' (packed varlen), "
                             f"but layout is {layout!r}; drop {name} or pack the sequences as thd")


def _read_alibi_mask_and_bias(call: AttentionCall, alibi_slopes: Any, attn_mask: Any, attn_bias: Any) -> None:
    """ALiBi slopes, the boolean mask and the additive bias: dtypes, devices, and shapes that broadcast to the
    scores (batch, heads_q, seqlen_q, seqlen_k); masks and biases are dense-only."""
    q, layout = call.q, call.layout
    if (attn_mask is not None or attn_bias is not None) and call.seqused_k is not None:
        raise ValueError("attention(): attn_mask/attn_bias are not taken with a KV cache (seqused_k): their key "
                         "axis would have to follow each sequence's fill; express the pattern with causal/window, "
                         "or gather the keys into a dense call")
    call.alibi_slopes = _check_alibi(alibi_slopes, call.batch, call.heads_q, q.device)
    full = (call.batch, call.heads_q, call.seqlen_q, call.seqlen_k)
    if attn_mask is not None:
        attn_mask = _check_tensor("attn_mask", attn_mask)
        if layout == "thd":
            raise ValueError("attention(): attn_mask is not supported with layout='thd'; express the pattern with "
                             "causal/window, or use a dense layout")
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"attention(): attn_mask must be a bool tensor (True = attend), got {attn_mask.dtype}; "
                            "pass additive float masks as attn_bias")
        if attn_mask.device != q.device:
            raise ValueError(f"attention(): attn_mask is on {attn_mask.device} but q is on {q.device}")
        if not _broadcastable(attn_mask.shape, full):
            raise ValueError(f"attention(): attn_mask shape {_shape_of(attn_mask)} does not broadcast to "
                             f"(batch, heads_q, seqlen_q, seqlen_k) = {full}")
    call.attn_mask = attn_mask
    if attn_bias is not None:
        attn_bias = _check_tensor("attn_bias", attn_bias)
        if layout == "thd":
            raise ValueError("attention(): attn_bias is not supported with layout='thd'; use a dense layout")
        if not _is_float(attn_bias.dtype):
            raise TypeError(f"attention(): attn_bias must be a floating-point tensor added to the scores, got "
                            f"{attn_bias.dtype}; pass boolean masks as attn_mask")
        if attn_bias.device != q.device:
            raise ValueError(f"attention(): attn_bias is on {attn_bias.device} but q is on {q.device}")
        if not _broadcastable(attn_bias.shape, full):
            raise ValueError(f"attention(): attn_bias shape {_shape_of(attn_bias)} does not broadcast to "
                             f"(batch, heads_q, seqlen_q, seqlen_k) = {full}")
    call.attn_bias = attn_bias


def canonicalize(call: AttentionCall, *, varlen_rewritten: bool = False) -> None:
    """Rewrite `call` in place into the one canonical form of the computation it denotes.

    - causal/window/ALiBi alignment where it cannot matter (equal lengths, or none of the three) -> top_left;
    - causal aligned bottom-right with one query (flash-attn style decode) -> not causal: the last query sees
      every key, so the mask hides nothing (a window keeps its left bound);
    - distinct cu_seqlens_q/cu_seqlens_k holding equal values -> one tensor (self-attention; done by validation).
    Windows that bound nothing were already dropped by validation.
    """
    rewrites = []
    if varlen_rewritten:
        rewrites.append("cu_seqlens_k equal to cu_seqlens_q (self-attention)")
    one_query = call.seqlen_q == 1 if call.layout != "thd" else call.max_seqlen_q == 1
    if call.causal and call.causal_alignment == "bottom_right" and one_query and call.alignment_matters:
        call.causal = False
        window = call.window
        if window is not None:
            call.window = None if window[0] == -1 else (window[0], -1)
        rewrites.append("causal=True bottom_right with one query (hides no key)")
    uses_alignment = call.causal or call.window is not None or call.alibi_slopes is not None
    if call.causal_alignment != "top_left" and (call.same_lengths or not uses_alignment):
        call.causal_alignment = "top_left"
        if uses_alignment:
            rewrites.append("causal_alignment=bottom_right with equal lengths")
    if rewrites:
        call.rewrites = tuple(rewrites)


def _dims(layout: str, shape: torch.Size) -> tuple[int, int, int, int]:
    """(batch, seq, heads, dim) of a dense tensor in `layout`."""
    b_at, s_at, h_at, d_at = LAYOUT_DIMS[layout]
    return shape[b_at], shape[s_at], shape[h_at], shape[d_at]


_INT32_MAX = 2**31 - 1  # kernels take window sizes as int32


def _check_window(window: Any, causal: bool) -> tuple[int, int] | None:
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in window)):
        raise TypeError(f"attention(): window must be None or a pair of ints (left, right), got {window!r}; "
                        "-1 means unbounded on that side, e.g. (128, 0) for a causal sliding window of 128 keys")
    left, right = int(window[0]), int(window[1])
    if max(left, right) > _INT32_MAX:
        raise ValueError(f"attention(): window={tuple(window)!r} is beyond what kernels take (at most "
                         f"{_INT32_MAX}); use -1 for an unbounded side")
    if left < -1 or right < -1:
        raise ValueError(f"attention(): window={tuple(window)!r} has a side below -1; allowed: sizes >= 0, or -1 "
                         "for unbounded")
    if causal:
        if right > 0:
            raise ValueError(f"attention(): window={tuple(window)!r} looks {right} keys ahead but causal=True "
                             "forbids that; set right to 0 (or -1), or causal=False")
        right = 0
    if left == -1 and right == -1:
        return None  # unbounded both ways is no window at all
    if causal and left == -1:
        return None  # causal already bounds the right; an unbounded left adds nothing
    return (left, right)


def _check_alibi(alibi: Any, batch: int, heads: int, device: torch.device) -> torch.Tensor | None:
    if alibi is None:
        return None
    alibi = _check_tensor("alibi_slopes", alibi)
    if alibi.dtype != torch.float32:
        raise TypeError(f"attention(): alibi_slopes must be float32, got {alibi.dtype}; use .float()")
    if tuple(alibi.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"attention(): alibi_slopes has shape {_shape_of(alibi)}; allowed: ({heads},) or "
                         f"({batch}, {heads}) — one slope per query head, optionally per batch element")
    if alibi.device != device:
        raise ValueError(f"attention(): alibi_slopes is on {alibi.device} but q is on {device}")
    return alibi  # type: ignore[no-any-return]  # checked to be a tensor above


def _check_sinks(sinks: Any, heads: int, device: torch.device) -> torch.Tensor:
    sinks = _check_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        raise TypeError(f"attention(): sinks must be float32 (one logit per query head), got {sinks.dtype}; use "
                        ".float() (the epilogue computes in float32 whatever q's dtype)")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"attention(): sinks has shape {_shape_of(sinks)}; allowed: ({heads},) — one sink logit "
                         "per query head")
    if sinks.device != device:
        raise ValueError(f"attention(): sinks is on {sinks.device} but q is on {device}; pass sinks.to(q.device)")
    return sinks  # type: ignore[no-any-return]  # checked to be a tensor above


def _check_cu_seqlens(name: str, cu: Any, device: torch.device) -> torch.Tensor:
    """A cu_seqlens argument's type, dtype, shape and device (not its values)."""
    if cu is None:
        raise ValueError(f"attention(): layout='thd' needs {name}: an int32 tensor of cumulative sequence "
                         "lengths, [0, len_0, len_0+len_1, …] of size batch+1")
    _check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"attention(): {name} must be int32, got {cu.dtype}; use .to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"attention(): {name} must be 1-D with batch+1 >= 2 entries, got shape {_shape_of(cu)}")
    if cu.device != device:
        raise ValueError(f"attention(): {name} is on {cu.device} but q is on {device}")
    return cu  # type: ignore[no-any-return]  # checked to be a tensor above


def _check_max_seqlen(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"attention(): {name}={value!r} must be a positive int or None (computed from cu_seqlens)")


def _cu_values(name: str, cu: torch.Tensor, tokens: int, given: int | None) -> tuple[list[int], int]:
    """cu_seqlens' values (a host read) checked against the packed tensor's `tokens`; (values, longest length —
    `given` when set, which must not be shorter)."""
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"attention(): {name} must start at 0, got {values[0]} ({name}={values})")
    steps = [b - a for a, b in zip(values, values[1:])]
    if any(s < 0 for s in steps):
        raise ValueError(f"attention(): {name} must be non-decreasing, got {values}")
    if values[-1] != tokens:
        tensor = "q" if name.endswith("q") else "k"
        raise ValueError(f"attention(): {name} ends at {values[-1]} but {tensor} has {tokens} tokens; the "
                         "last entry must equal the total token count")
    longest = max(steps)
    if given is not None and given < longest:
        raise ValueError(f"attention(): max_seqlen_{name[-1]}={given} is smaller than the longest sequence "
                         f"({longest}) in {name}")
    return values, given if given is not None else longest


def _check_varlen(q: torch.Tensor, k: torch.Tensor, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any,
                  check_values: bool) -> tuple[int, int, int, bool | None]:
    """(batch, max_seqlen_q, max_seqlen_k, whether cu_q and cu_k hold equal values — None when not read)."""
    _check_cu_seqlens("cu_seqlens_q", cu_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"attention(): cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_k has "
                         f"{cu_k.numel()}; both must have batch+1 entries")
    _check_max_seqlen("max_seqlen_q", max_q)
    _check_max_seqlen("max_seqlen_k", max_k)
    batch = cu_q.numel() - 1
    need_values = check_values or max_q is None or max_k is None
    if not need_values:
        return batch, max_q, max_k, True if cu_q is cu_k else None
    values_q, longest_q = _cu_values("cu_seqlens_q", cu_q, q.shape[0], max_q)
    values_k, longest_k = _cu_values("cu_seqlens_k", cu_k, k.shape[0], max_k)
    return batch, longest_q, longest_k, values_q == values_k


def _read_paged_varlen(call: AttentionCall, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                       check_values: bool) -> tuple[int, int]:
    """Packed queries over a paged KV cache: cu_seqlens_q (cu_seqlens_k has no meaning: the block table and
    seqused_k say where each sequence's keys are and how many); (batch, max_seqlen_q)."""
    if cu_seqlens_k is not None:
        raise ValueError("attention(): cu_seqlens_k is not taken with block_table: each sequence's keys are its "
                         "pages (block_table) and their count is seqused_k; drop cu_seqlens_k")
    cu = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, call.q.device)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    longest = max_seqlen_q
    if check_values or max_seqlen_q is None:
        _, longest = _cu_values("cu_seqlens_q", cu, call.q.shape[0], max_seqlen_q)
    call.cu_seqlens_q, call.cu_seqlens_k = cu, None
    call.max_seqlen_q = longest
    return cu.numel() - 1, longest


def _check_index(name: str, value: Any, ndim: int, device: torch.device, what: str) -> torch.Tensor:
    t = _check_tensor(name, value)
    if t.dtype != torch.int32:
        raise TypeError(f"attention(): {name} must be int32, got {t.dtype}; use .to(torch.int32)")
    if t.dim() != ndim:
        raise ValueError(f"attention(): {name} must be {what}, got shape {_shape_of(t)}")
    if t.device != device:
        raise ValueError(f"attention(): {name} is on {t.device} but q is on {device}")
    return t


def _read_kv_cache(call: AttentionCall, seqused_k: Any, block_table: Any, max_seqlen_k: Any,
                   check_values: bool) -> None:
    """A KV cache: seqused_k (keys each sequence uses) and, for a paged one, the block table. Sets the call's
    seqlen_k to the cache's capacity per sequence (the longest fill it can hold)."""
    device, batch = call.q.device, call.batch
    raise_pending(device)  # an earlier KV-cache call's failed device-side check (core._kv_checks)
    if seqused_k is None:
        raise ValueError("attention(): block_table needs seqused_k, the number of keys each sequence holds "
                         "(int32, (batch,)): the last page is usually only partly filled")
    seqused_k = _check_index("seqused_k", seqused_k, 1, device, f"1-D (batch,) = ({batch},)")
    if seqused_k.shape[0] != batch:
        raise ValueError(f"attention(): seqused_k has {seqused_k.shape[0]} entries but the batch is {batch}; one "
                         "count per sequence")
    pages = 0
    if block_table is not None:
        block_table = _check_index("block_table", block_table, 2, device, f"2-D (batch, max_pages), batch {batch}")
        if block_table.shape[0] != batch:
            raise ValueError(f"attention(): block_table has {block_table.shape[0]} rows but the batch is {batch}; "
                             "one row of page indices per sequence")
        pages = block_table.shape[1]
        capacity = pages * call.k.shape[1]
        if call.varlen:
            _check_max_seqlen("max_seqlen_k", max_seqlen_k)
            if max_seqlen_k is not None and max_seqlen_k > capacity:
                raise ValueError(f"attention(): max_seqlen_k={max_seqlen_k} exceeds what block_table addresses "
                                 f"({pages} pages of {call.k.shape[1]} = {capacity} keys)")
            call.max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else capacity
            call.seqlen_k = call.max_seqlen_k
        else:
            call.seqlen_k = capacity
    call.seqused_k, call.block_table = seqused_k, block_table
    # A host read: on CPU always, on accelerators with OPDISPATCH_SYNC_CHECKS=1 (a sync per call; else kernels
    # trust these values — flash_attn_with_kvcache checks its own on the device, core._kv_checks).
    if check_values and (device.type == "cpu" or sync_checks()):
        _check_kv_values(call, seqused_k, block_table, pages)


def _check_kv_values(call: AttentionCall, seqused_k: torch.Tensor, block_table: torch.Tensor | None,
                     pages: int) -> None:
    used = seqused_k.tolist()
    if call.varlen and block_table is None:
        assert call.cu_seqlens_k is not None
        cu = call.cu_seqlens_k.tolist()
        room = [b - a for a, b in zip(cu, cu[1:])]
        where = "its cu_seqlens_k span"
    else:
        room = [call.seqlen_k] * len(used)
        where = "the block table's pages" if block_table is not None else "the cache's length"
    for b, (n, limit) in enumerate(zip(used, room)):
        if not 0 <= n <= limit:
            raise ValueError(f"attention(): seqused_k[{b}]={n} is out of range; allowed: 0..{limit} ({where})")
    if block_table is None:
        return
    num_pages, page_size = call.k.shape[0], call.k.shape[1]
    rows = block_table.tolist()
    for b, n in enumerate(used):
        for p in rows[b][: (n + page_size - 1) // page_size]:
            if not 0 <= p < num_pages:
                raise ValueError(f"attention(): block_table[{b}] names page {p}, but the pools hold pages "
                                 f"0..{num_pages - 1}; every page a sequence uses must exist")


def allowed_positions(sq: int, sk: int, causal: bool, window: tuple[int, int] | None, offset: int,
                      device: torch.device) -> torch.Tensor | None:
    """Bool (sq, sk) matrix of the keys each query may see under causal/window, or None if all."""
    if not causal and window is None:
        return None
    rel = (torch.arange(sk, device=device).unsqueeze(0)
           - torch.arange(sq, device=device).unsqueeze(1) - offset)  # j - (i + o)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        allowed &= rel <= 0
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= rel >= -left
        if right >= 0:
            allowed &= rel <= right
    return allowed


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """-slope * |i + o - j| as (batch or 1, heads, sq, sk)."""
    distance = (torch.arange(sk, device=slopes.device).unsqueeze(0)
                - torch.arange(sq, device=slopes.device).unsqueeze(1) - offset).abs().to(dtype)
    s = slopes.to(dtype)
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], s.shape[1], 1, 1)
    return -s * distance


def _to_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def additive_bias(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, *, fold_causal: bool,
                  fold_alibi: bool, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """For kernels that take one additive mask: the float bias (q's dtype, 4-D) carrying the boolean mask, the
    user bias, the window, bottom-right causal alignment, ALiBi (with `fold_alibi`) and — with `fold_causal` —
    the plain causal pattern too; the `is_causal` flag left for the kernel (top-left only); and the boolean
    `allowed` pattern that went into the bias (None if none did), for finding queries that see no key. `dtype`:
    the bias's dtype (default q's; float32 lets a caller shift rows before rounding to the kernel's dtype)."""
    dtype = dtype or q.dtype
    sq, sk = q.shape[2], k.shape[2]
    offset = sk - sq if call.causal_alignment == "bottom_right" else 0
    is_causal = call.causal
    allowed = None
    if call.positional_mask or (fold_causal and call.causal):
        allowed = allowed_positions(sq, sk, call.causal, call.window, offset, q.device)
        is_causal = False
    if call.attn_mask is not None:
        allowed = call.attn_mask if allowed is None else allowed & call.attn_mask
    bias = None
    if allowed is not None:  # two kernels, not three (zeros, ~allowed, masked_fill_): a decode step's launches
        bias = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=q.device)
        bias.masked_fill_(allowed, 0.0)
    if call.attn_bias is not None:
        user = call.attn_bias.to(dtype)
        bias = user if bias is None else bias + user
    if fold_alibi and call.alibi_slopes is not None:
        ab = alibi_bias(call.alibi_slopes, sq, sk, offset, torch.promote_types(dtype, torch.float32)).to(dtype)
        bias = ab if bias is None else bias + ab
    return (None if bias is None else _to_4d(bias)), is_causal, allowed


# The two values `additive_bias` writes for a boolean mask (0 where True, -inf where False), as 0-dim tensors of a
# kernel's dtype on its device, made once per (dtype, device): `torch.where(mask, zero, blocked)` is then one kernel
# (a launch on a GPU) giving the same values as additive_bias's full + masked_fill_, so the same result bit for bit.
_MASK_BIAS_VALUES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def mask_bias_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero, blocked): 0-dim tensors of `dtype` on `device` holding 0 and -inf, for a bound function that turns a
    boolean mask into `additive_bias`'s bias per call as ``torch.where(mask, zero, blocked)`` (one kernel)."""
    values = _MASK_BIAS_VALUES.get((dtype, device))
    if values is None:
        values = _MASK_BIAS_VALUES[dtype, device] = (torch.zeros((), dtype=dtype, device=device),
                                                     torch.full((), float("-inf"), dtype=dtype, device=device))
    return values


def shift_rows(bias: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A wide-range additive bias (ALiBi reaches -slope * seqlen) rounded to a kernel's `dtype` without losing the
    visible keys' differences: subtract each row's maximum in the bias's own (fp32/fp64) precision first — softmax
    does not change — and return the shift, to be added back to the LSE. Rows that see no key keep a shift of 0."""
    shift = bias.detach().amax(dim=-1, keepdim=True)
    shift = shift.masked_fill(shift == float("-inf"), 0.0)
    return (bias - shift).to(dtype), shift


def bind_dense(call: AttentionCall,
               kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """Wrap `kernel(q, k, v) -> out` over (batch, heads, seq, dim) tensors for `call`'s dense layout (views only):
    the building block of `AttentionImpl.bind` overrides."""
    if call.layout == "bhsd":
        return kernel
    to_bhsd, from_bhsd = layout_views(call.layout)
    return lambda q, k, v: from_bhsd(kernel(to_bhsd(q), to_bhsd(k), to_bhsd(v)))


def attention_outputs(call: AttentionCall) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """out: q's shape with v's head dim, `out_dtype` (q's dtype but for FP8 calls); lse (with return_lse):
    float32 (float64 for float64),
    (batch, heads_q, seqlen_q), or (heads_q, total_q) for thd."""
    out = ((*call.q.shape[:-1], call.head_dim_v), call.out_dtype)
    if not call.return_lse:
        return [out]
    lse_shape = (call.heads_q, call.q.shape[0]) if call.varlen else (call.batch, call.heads_q, call.seqlen_q)
    return [out, (lse_shape, torch.float64 if call.dtype == torch.float64 else torch.float32)]


def _needs_unit_stride(t: torch.Tensor) -> bool:
    return t.stride(-1) != 1 and t.shape[-1] != 1  # a size-1 dim's stride is never read


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if _needs_unit_stride(t) else t


def _unit_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache: Any) -> tuple[Any, ...]:
    return _unit_stride(q), _unit_stride(k), _unit_stride(v), *cache


def _contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache: Any) -> tuple[Any, ...]:
    return q.contiguous(), k.contiguous(), v.contiguous(), *cache  # no copy for a contiguous tensor


def layout_views(layout: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(to_bhsd, from_bhsd) view functions of a dense layout that hold nothing of a call — for bound functions,
    which must not keep a call (and its tensors) alive."""
    to, back = _TO_BHSD[layout], _FROM_BHSD[layout]
    if to == _IDENTITY:
        return (lambda t: t), (lambda t: t)
    return (lambda t: t.permute(to)), (lambda t: t.permute(back))


def bshd_views(layout: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(to_bshd, from_bshd) view functions of a dense layout, as `layout_views` (bshd: batch before heads)."""
    to, back = _TO_BSHD[layout], _FROM_BSHD[layout]
    if to == _IDENTITY:
        return (lambda t: t), (lambda t: t)
    return (lambda t: t.permute(to)), (lambda t: t.permute(back))


# -- capability declarations -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCaps:
    """What an attention implementation supports, declared as data (docs/plugins.md lists every field).

    Features default to unsupported: an implementation claims exactly what it declares. Limits (`head_dim_max`,
    `max_seqlen`) default to none. `dtypes` and `layouts` have no default: registration refuses an
    implementation that leaves them empty. `layouts` are the layouts `run()` accepts — it receives q/k/v in the
    caller's layout, one of these (convert with ``call.bhsd(t)``/``call.from_bhsd(out)``);
    `causal_alignments` are those it honours when seqlen_q != seqlen_k (declare at least one when claiming
    `causal` or `window`; with equal lengths both alignments are the same computation).
    """

    dtypes: frozenset[torch.dtype]
    head_dim_min: int = 1
    head_dim_max: int | None = None
    head_dim_multiple: int = 1
    head_dim_v_differs: bool = False
    layouts: frozenset[str] = field(default=frozenset(), metadata={"required": True})  # refused when empty
    causal: bool = False
    # None: not declared (refused when claiming causal or window); frozenset(): equal lengths only.
    causal_alignments: frozenset[str] | None = None
    gqa: bool = False
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    attn_mask: bool = False
    attn_bias: bool = False
    bias_grad: bool = False
    lse: bool = False
    # Whether autograd flows through the returned LSE (torch ops computing it); False for a kernel's side output,
    # whose LSE gradient the sink epilogue then supplies itself (`opdispatch.ops._sinks`).
    lse_grad: bool = False
    # Whether `run` takes `call.sinks` itself (a kernel with a learnable sink, e.g. FlashAttention-4): the call
    # with sinks goes to `run` as it is, not through the shared sink epilogue; with `backward`, autograd through
    # `run`'s result gives the sinks' gradient too. False: sinks come from the epilogue over the LSE.
    native_sinks: bool = False
    # With `native_sinks`: whether the kernel's backward is exact for calls with sinks, the sinks' gradient
    # included. False (a kernel whose sink is forward-only, e.g. aiter's `sink_ptr`): calls under autograd (any of
    # q, k, v, attn_bias, sinks requiring grad) take the shared epilogue instead. An implementation may narrow
    # native sinks further per call with `native_sinks_limit` (then it must declare `lse` for the epilogue).
    native_sinks_backward: bool = False
    backward: bool = False
    # Bitwise-reproducible backward / forward for every shape (some kernels split the key axis by shape and reduce
    # in launch order, or accumulate gradients with atomics); declare them from measurement.
    deterministic_backward: bool = False
    deterministic_forward: bool = False
    max_seqlen: int | None = None
    # A KV cache: `kv_cache` — each sequence uses its first `call.seqused_k[b]` keys of k/v (dense layouts: the
    # cache's rows; thd: its cu_seqlens_k span), bottom-right alignment counting from there; `paged_kv` — k/v
    # are page pools (num_pages, page_size, heads_kv, dim) read through `call.block_table` (with seqused_k),
    # pages of a multiple of `page_size_multiple` keys; `kv_cache_alibi` — ALiBi over a cache, its distances
    # counted from each sequence's own fill.
    kv_cache: bool = False
    paged_kv: bool = False
    page_size_multiple: int = 1
    kv_cache_alibi: bool = False
    # Whether `run`/`bind` read q/k/v of any strides correctly. False (the default, what vendor kernels need): the
    # op hands them q/k/v whose head dim is unit-stride, copying a view that is not (channels-last views, a
    # `[..., ::2]` slice, a tensor expanded from a scalar); every other stride may be anything.
    strided_inputs: bool = False
    # Whether the kernel needs q/k/v contiguous in the call's layout (each tensor's strides those of a fresh one):
    # some kernels read k's and v's strides from q's. The op copies any that is not, checked every call (a view's
    # other strides are not in the fast-path key).
    contiguous_inputs: bool = False
    # FP8 q/k/v (an FP8 dtype in `dtypes`): the output dtypes the kernel returns (or the implementation makes by
    # dequantizing its own FP8 output), and whether it takes descales per (batch, kv head) — FA3's form — besides
    # one per tensor.
    fp8_out_dtypes: frozenset[torch.dtype] = frozenset()
    fp8_descale_per_head: bool = False
    # Whether the implementation writes an FP8 call's output amax into `out_amax` (cuDNN's Amax_O).
    fp8_out_amax: bool = False

    def as_dict(self) -> dict[str, Any]:
        return caps_as_dict(self)


class AttentionImpl(Impl):
    """Base for attention implementations: set `caps`, implement `run`, optionally `extra_reasons`."""

    op: ClassVar[str] = "attention"
    caps: ClassVar[AttentionCaps]
    # Whether an overridden `bind` binds masked calls too: it is then also given them, and its function takes a
    # call's tensors as the front door passes them, ``fn(q, k, v, seqused_k, block_table, attn_mask, sinks)``
    # (the mask's values change from call to call; sinks are None there). False: masked calls take the default
    # `bind` (through `run`), as overrides written for (q, k, v) expect.
    binds_attn_mask: ClassVar[bool] = False
    # The sizes `selection_key` reads of a dense call (no KV cache, bias, ALiBi or window; with or without a boolean
    # mask: a padded batch's decode and prefill take the compiled door's size-generic entries too), as data: per field
    # (seqlen_q, seqlen_k, batch, heads_q, heads_kv), the values at which its answer may change (constant between
    # two consecutive ones; a field not named is not read): ``{"seqlen_k": (2,)}`` for ``call.seqlen_k == 1``,
    # ``{}`` for a key that reads no size. None (not declared): it may read any size, and the compiled front door
    # keeps no size-generic entry for classes it is keyed in (opdispatch.engine._classes, `size_box`). It must
    # match `selection_key` exactly: the door reuses a decision for every size between the cuts.
    dense_key_size_cuts: ClassVar[dict[str, tuple[int, ...]] | None] = None

    def check_declaration(self) -> list[str]:
        problems = super().check_declaration()
        caps = getattr(self, "caps", None)
        if not isinstance(caps, AttentionCaps):
            problems.append(f"caps must be an opdispatch.AttentionCaps, got {type(caps).__name__}")
            return problems
        unknown = set(caps.layouts) - set(LAYOUTS)
        if unknown:
            problems.append(f"caps.layouts has unknown layouts {sorted(unknown)}; allowed: {list(LAYOUTS)}")
        bad_align = set(caps.causal_alignments or ()) - set(CAUSAL_ALIGNMENTS)
        if bad_align:
            problems.append(f"caps.causal_alignments has {sorted(bad_align)}; allowed: {list(CAUSAL_ALIGNMENTS)}")
        if not caps.dtypes or not all(isinstance(d, torch.dtype) for d in caps.dtypes):
            problems.append("caps.dtypes must be a non-empty set of torch dtypes")
        if not caps.layouts:
            problems.append(f"caps.layouts is not declared: list the layouts run() accepts, e.g. "
                            f"layouts=frozenset({{'bshd'}}) (allowed: {list(LAYOUTS)}); run() receives q/k/v in the "
                            f"caller's layout, one of these")
        claims = [name for name in ("causal", "window") if getattr(caps, name)]
        if claims and caps.causal_alignments is None:
            problems.append(f"caps.causal_alignments is not declared but caps claims {', '.join(claims)}: declare "
                            f"the alignments run() honours when seqlen_q != seqlen_k, e.g. "
                            f"causal_alignments=frozenset({{'top_left'}}) (allowed: {list(CAUSAL_ALIGNMENTS)}; "
                            f"frozenset() for equal lengths only)")
        if FP8_DTYPES & caps.dtypes and not caps.fp8_out_dtypes:
            fp8 = ", ".join(sorted(dtype_name(d) for d in FP8_DTYPES & caps.dtypes))
            problems.append(f"caps.dtypes has FP8 ({fp8}) but caps.fp8_out_dtypes is empty: declare the output "
                            "dtypes of FP8 calls, e.g. "
                            "fp8_out_dtypes=frozenset({torch.bfloat16})")
        if caps.native_sinks_backward and not caps.native_sinks:
            problems.append("caps.native_sinks_backward needs caps.native_sinks (the kernel's sink forward)")
        return problems

    def native_sinks_limit(self, call: AttentionCall) -> str | None:
        """Override where `caps.native_sinks` holds for some calls only: why this call's sinks (which the caps would
        give the kernel) go through the shared epilogue instead, or None to take them natively. The call must still
        be one the implementation runs (the epilogue needs `caps.lse`): not a refusal, a route."""
        return None

    def not_supported_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        reasons = capability_reasons(self.caps, call)
        reasons.extend(self.extra_reasons(call, device))
        return reasons

    def extra_reasons(self, call: AttentionCall, device: DeviceInfo) -> list[str]:
        """Override for limits `AttentionCaps` cannot express (arch-dependent head dims, …).

        If it reads sizes the decision class does not hold (sequence lengths, batch, head counts), say so in
        `selection_key`.
        """
        return []

    def selection_key(self, call: AttentionCall) -> Any:
        """What `extra_reasons` reads from `call` beyond its decision class, as a hashable value.

        Decisions are cached per class of calls — dtype, layout, head dims, GQA ratio, every feature flag,
        whether the causal alignment matters, which side of every caps limit and policy threshold the sizes
        fall — so a decode loop or a new batch size reuses one decision. Two calls of one class get the same
        decision only if every candidate's selection key is equal too. Default: nothing (``()``) when
        `extra_reasons` is not overridden; the exact sizes when it is (safe, but every new shape re-decides),
        so an implementation with extra limits should return just what they read, e.g.
        ``call.seqlen_k == 1``.
        """
        if type(self).extra_reasons is AttentionImpl.extra_reasons:
            return ()
        return call.signature()

    def input_conformer(self, call: AttentionCall) -> Callable[..., tuple[Any, ...]] | None:
        if self.caps.contiguous_inputs:
            return _contiguous
        # The fast-path key holds each tensor's innermost stride, so a signature either always or never needs it.
        if self.caps.strided_inputs or not any(_needs_unit_stride(t) for t in (call.q, call.k, call.v)):
            return None
        return _unit_strides

    def bound_function(self, call: AttentionCall) -> Callable[..., Any]:
        # The front door passes a call's optional tensors as ``fn(q, k, v, seqused_k, block_table, attn_mask,
        # sinks)`` (a call with sinks never reaches an implementation's bound function: opdispatch.doors._api binds it).
        # An overridden bind is written for (q, k, v) and, for a KV cache, (q, k, v, seqused_k, block_table)
        # (plugin API 2): a masked call takes the default, which reads them all; a KV-cache call drops the mask's
        # slot (None there: validation refuses masks with a KV cache).
        if type(self).bind is AttentionImpl.bind:
            return self.bind(call)
        if call.attn_mask is not None and not self.binds_attn_mask:
            return AttentionImpl.bind(self, call)
        fn = self.bind(call)
        if not call.kv_cache:
            return fn

        def without_mask_slot(*tensors: Any) -> Any:
            return fn(*tensors[:5])

        return without_mask_slot

    def bind(self, call: AttentionCall) -> Callable[..., Any]:
        """A function `(q, k, v) -> result` for calls of exactly `call`'s signature (same shapes, dtype, device,
        options), used on the per-call fast path and by `opdispatch.plan`; for a KV-cache call it also takes
        that step's `seqused_k, block_table` (``fn(q, k, v, seqused_k, block_table)``; a plan called with q/k/v
        alone reads the planned call's). Masked calls take their mask per call through this default
        (``fn(q, k, v, None, None, attn_mask)``; `bound_function`), whatever an override does. Override to bind
        the kernel directly; this default re-enters `run` with a copy of the call."""
        run, rebuild = self.run, call.stripped().with_tensors  # never the first call's tensors

        def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache: torch.Tensor | None) -> Any:
            return run(rebuild(q, k, v, *cache))

        return bound

    def backward(self, call: AttentionCall, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(dq, dk, dv) from this implementation's own forward results, without computing the forward again.

        Used by the compiled path (``opdispatch::attention_backward``): `call` is the forward's call with
        ``return_lse=True`` (its tensors do not require grad), `out` and `lse` are what `run(call)` returned,
        `grad_out` is the gradient of `out`; each gradient has its input's shape, in `call.layout`. Not used when
        the caller asked for the LSE (its gradient would be dropped) or for a bias gradient. Return None for a
        call this does not cover: the compiled backward then recomputes the forward under autograd (always
        correct, one more forward). Eager calls never come here: autograd differentiates what `run` called.
        Default: None.
        """
        return None

    @property
    def saves_for_backward(self) -> bool:
        """Whether `backward` is overridden (the compiled forward then keeps the LSE for it)."""
        return type(self).backward is not AttentionImpl.backward

    def describe_capabilities(self) -> dict[str, Any]:
        out = super().describe_capabilities()
        out.update(self.caps.as_dict())
        return out


def capability_reasons(caps: AttentionCaps, call: AttentionCall) -> list[str]:
    """Reasons `caps` cannot take `call` — one readable sentence per unmet capability, in the order of
    `ATTENTION_CAPABILITY_RULES` (dtype and layout, head dims and GQA, the masking pattern, score terms, outputs
    and training, sinks, the KV cache, sequence limits): the shared `opdispatch.base._impl.unmet_capabilities`, as
    rms_norm and rotary use it."""
    return unmet_capabilities(caps, call, ATTENTION_CAPABILITY_RULES)


def _dtype(caps: AttentionCaps, call: AttentionCall) -> str | None:
    return dtype_reason(call.dtype, caps.dtypes)


def _layout(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.layout in caps.layouts:
        return None
    what = "packed varlen (thd)" if call.layout == "thd" else f"layout {call.layout!r}"
    return f"{what} not supported (supported layouts: {', '.join(sorted(caps.layouts))})"


def _fp8_output(caps: AttentionCaps, call: AttentionCall) -> str | None:
    """An FP8 call's output dtype (its dtype is `_dtype`'s)."""
    if not call.fp8 or call.dtype not in caps.dtypes or call.out_dtype in caps.fp8_out_dtypes:
        return None
    allowed = ", ".join(sorted(dtype_name(d) for d in caps.fp8_out_dtypes)) or "none"
    reason = f"FP8 output dtype {dtype_name(call.out_dtype)} not supported (supported: {allowed})"
    if call.fp8_out and not FP8_DTYPES & caps.fp8_out_dtypes:
        reason += ": this kernel cannot produce an FP8 output (it returns a dequantized one only)"
    return reason


def _fp8_amax(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.out_amax is None or caps.fp8_out_amax or call.dtype not in caps.dtypes:
        return None
    return "the output's amax (out_amax) not produced: this kernel writes no amax; drop out_amax or compute it " \
           "from the output"


def _fp8_descales(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.fp8 and call.dtype in caps.dtypes and call.descale_per_head and not caps.fp8_descale_per_head:
        return "FP8 descales per (batch, kv head) not supported (one descale per tensor only)"
    return None


def _head_dim(caps: AttentionCaps, call: AttentionCall) -> str | None:
    d = call.head_dim
    if d < caps.head_dim_min or (caps.head_dim_max is not None and d > caps.head_dim_max):
        top = caps.head_dim_max if caps.head_dim_max is not None else "any"
        return f"head_dim {d} outside the supported range {caps.head_dim_min}..{top}"
    if d % caps.head_dim_multiple:
        return f"head_dim {d} is not a multiple of {caps.head_dim_multiple}"
    return None


def _head_dim_v(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.head_dim_v == call.head_dim:
        return None
    if not caps.head_dim_v_differs:
        return f"v head_dim {call.head_dim_v} differs from q/k head_dim {call.head_dim} (not supported)"
    if caps.head_dim_max is not None and call.head_dim_v > caps.head_dim_max:
        return f"v head_dim {call.head_dim_v} above the supported maximum {caps.head_dim_max}"
    return None


def _alignment(caps: AttentionCaps, call: AttentionCall) -> str | None:
    """Causal masking's alignment where the lengths differ."""
    alignments = caps.causal_alignments or frozenset()
    if not call.alignment_matters or call.causal_alignment in alignments:
        return None
    return (f"causal_alignment {call.causal_alignment!r} with seqlen_q != seqlen_k not supported "
            f"(supported: {', '.join(sorted(alignments)) or 'none: equal lengths only'})")


def _bias(caps: AttentionCaps, call: AttentionCall) -> str | None:
    """The additive bias, and its gradient."""
    if call.attn_bias is None:
        return None
    if not caps.attn_bias:
        return "additive attn_bias not supported"
    if call.attn_bias.requires_grad and call.requires_grad and not caps.bias_grad:
        return "gradient with respect to attn_bias not supported"
    return None


def _deterministic_backward(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.deterministic and call.requires_grad and not caps.deterministic_backward:
        return "deterministic=True not supported: its backward is not deterministic"
    return None


# -- the exact LSE gradient (attention's OpSpec.result_fix; the sinks epilogue, `_sinks`, uses it too) ----------


def out_rows(per_row: torch.Tensor, layout: str) -> torch.Tensor:
    """A per-row value shaped like the LSE ((batch, heads, seq), or (heads, tokens) for thd) as a tensor that
    broadcasts over the output of `layout` (a trailing unit head dim)."""
    if layout == "thd":
        return per_row.transpose(0, 1).unsqueeze(-1)  # (heads, tokens) -> (tokens, heads, 1)
    return layout_views(layout)[1](per_row.unsqueeze(-1))  # (batch, heads, seq, 1) in the layout's order


class _LseGradient(torch.autograd.Function):
    """Identity on the LSE whose backward gives q and k the LSE's gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                probabilities_times: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                scale: float, layout: str) -> torch.Tensor:
        ctx.save_for_backward(q, k)
        ctx.probabilities_times, ctx.scale, ctx.layout = probabilities_times, scale, layout
        return lse.clone()

    @staticmethod
    def backward(ctx: Any, grad_lse: torch.Tensor) -> tuple[Any, ...]:
        q, k = ctx.saved_tensors
        weight = out_rows(grad_lse * ctx.scale, ctx.layout)
        with torch.enable_grad():
            # A copy of k as v: kernels given aliased k and v, or a dO whose strides differ from O's (cuDNN: its
            # backward reads dO with O's strides), may compute wrong gradients.
            k_as_v = k.detach().clone().requires_grad_()
            pk = ctx.probabilities_times(q.detach(), k.detach(), k_as_v)  # sum_j P_ij k_j, in q's layout
            grad_pk = torch.empty_like(pk).copy_(weight * q.detach())
            (dk,) = torch.autograd.grad(pk, k_as_v, grad_pk)
        dq = (weight * pk.detach()).to(q.dtype)
        return grad_lse, dq if ctx.needs_input_grad[1] else None, dk if ctx.needs_input_grad[2] else None, \
            None, None, None


def exact_lse(impl: Any, call: AttentionCall, lse: torch.Tensor, *, replace: bool = False) -> torch.Tensor:
    """`lse` as returned by `impl` for `call` (run with return_lse), made to carry its exact gradient with
    respect to q and k when the implementation's does not (a kernel's side output); unchanged otherwise.
    `replace`: the implementation declares no LSE gradient (`caps.lse_grad` False), so whatever gradient its LSE
    seems to carry is dropped for the exact one (an aten kernel's LSE output may require grad and still give
    none)."""
    q, k = call.q, call.k
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return lse
    if replace:
        lse = lse.detach()
    elif lse.requires_grad:
        return lse
    if call.softcap > 0 or (call.attn_bias is not None and call.attn_bias.requires_grad):
        raise RuntimeError(f"attention: {impl.id}'s LSE carries no gradient and the exact LSE gradient does not "
                           "cover softcap or an attn_bias gradient; capability reasons should have refused this "
                           "call — report it")
    # The same call with v = k: its output is sum_j P_ij k_j; no dropout (the LSE is the pre-dropout softmax's).
    template = call.stripped()
    template.head_dim_v, template.dropout_p, template.return_lse = call.head_dim, 0.0, False
    template.requires_grad = True

    def probabilities_times(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = impl.run(impl.conform(template.with_tensors(q_, k_, v_)))
        return result

    out: torch.Tensor = _LseGradient.apply(  # type: ignore[no-untyped-call]
        lse, q, k, probabilities_times, call.scale, call.layout)
    return out


def lse_gradient_fix(impl: Any, call: AttentionCall) -> Callable[[Any, Any], Any] | None:
    """attention's `OpSpec.result_fix`: for a call that returns its LSE under autograd, on an implementation whose
    LSE has no gradient of its own (`caps.lse_grad` False), the returned LSE gets its exact gradient (`exact_lse`).
    Without it a loss that reads the LSE (a merged context-parallel block, a user's own logsumexp term) would get
    gradients silently missing that term. A call with sinks gets it on its inner call (without sinks, with LSE)."""
    if not (call.return_lse and call.requires_grad) or call.sinks is not None:
        return None
    if getattr(getattr(impl, "caps", None), "lse_grad", True):
        return None

    def fix(result: Any, run_call: Any) -> Any:
        out, lse = result
        return out, exact_lse(impl, run_call, lse, replace=True)

    return fix


def _lse_gradient_needed(call: AttentionCall) -> bool:
    """A returned LSE under autograd where the kernel's LSE has no gradient: `opdispatch.ops._attention.exact_lse` adds
    one, reading the scores as scale * q.k — not with softcap, nor for an attn_bias gradient."""
    return call.return_lse and call.requires_grad and call.sinks is None


def _returned_lse_softcap(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if _lse_gradient_needed(call) and not caps.lse_grad and call.softcap > 0:
        return ("return_lse=True with softcap under autograd needs a differentiable LSE (caps.lse_grad): the exact "
                "LSE gradient opdispatch adds reads the scores as scale * q.k")
    return None


def _returned_lse_bias(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if (_lse_gradient_needed(call) and not caps.lse_grad and call.attn_bias is not None
            and call.attn_bias.requires_grad):
        return "return_lse=True with a gradient for attn_bias needs a differentiable LSE (caps.lse_grad)"
    return None


def native_sinks_declared(caps: AttentionCaps, call: AttentionCall) -> bool:
    """Whether `caps` take `call`'s sinks in the kernel: `native_sinks`, and under autograd `native_sinks_backward`."""
    return caps.native_sinks and (caps.native_sinks_backward or not call.requires_grad)


def takes_sinks_natively(impl: Any, call: AttentionCall) -> bool:
    """Whether `impl` runs `call` (which has sinks) with its sinks in the kernel rather than through the shared
    epilogue: declared by its caps (`native_sinks_declared`) and not narrowed by its `native_sinks_limit(call)`."""
    if not native_sinks_declared(impl.caps, call):
        return False
    limit = getattr(impl, "native_sinks_limit", None)  # a plain Impl-like object without the method: none
    return limit is None or limit(call) is None


def _epilogue_sinks(call: AttentionCall, caps: AttentionCaps) -> bool:
    """Whether `call`'s sinks go through the shared epilogue (`opdispatch.ops._sinks`), computed from the
    implementation's LSE: sinks the kernel does not take itself (`caps.native_sinks`: its own limits are its
    extra_reasons)."""
    return call.sinks is not None and not native_sinks_declared(caps, call)


def _sinks_lse(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if _epilogue_sinks(call, caps) and not caps.lse:
        return "attention sinks need the implementation's LSE (caps.lse) for the shared sink epilogue"
    return None


# The epilogue's LSE gradient reads the scores as scale * q.k (+ constants): true without softcap, and a bias whose
# own gradient would come through the LSE is not covered.
def _sinks_softcap(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if (_epilogue_sinks(call, caps) and caps.lse and call.requires_grad and not caps.lse_grad
            and call.softcap > 0):
        return "attention sinks with softcap and autograd need a differentiable LSE (caps.lse_grad)"
    return None


def _sinks_bias(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if (_epilogue_sinks(call, caps) and caps.lse and call.requires_grad and not caps.lse_grad
            and call.attn_bias is not None and call.attn_bias.requires_grad):
        return "attention sinks with a gradient for attn_bias need a differentiable LSE (caps.lse_grad)"
    return None


def _kv_cache(caps: AttentionCaps, call: AttentionCall) -> str | None:
    """A KV cache (seqused_k) and a paged one (block_table), with the page sizes the kernel takes."""
    if call.block_table is not None:
        if not caps.paged_kv:
            return "paged KV cache (block_table) not supported"
        if call.page_size % caps.page_size_multiple:
            return f"page size {call.page_size} is not a multiple of {caps.page_size_multiple}"
        return None
    if call.seqused_k is not None and not caps.kv_cache:
        return "KV cache with per-sequence lengths (seqused_k) not supported"
    return None


def _kv_cache_alibi(caps: AttentionCaps, call: AttentionCall) -> str | None:
    if call.seqused_k is not None and call.alibi_slopes is not None and caps.alibi and not caps.kv_cache_alibi:
        return "ALiBi over a KV cache not supported (its distances follow each sequence's fill)"
    return None


def _sequence_limit(caps: AttentionCaps, call: AttentionCall) -> str | None:
    longest = max(call.seqlen_q, call.seqlen_k)
    if caps.max_seqlen is not None and longest > caps.max_seqlen:
        return f"sequence length {longest} above the supported maximum {caps.max_seqlen}"
    return None


# `AttentionCaps` turned into reasons (`opdispatch.base._impl.unmet_capabilities`), in the order they are printed.
ATTENTION_CAPABILITY_RULES: tuple[CapabilityRule, ...] = (
    _dtype, _layout, _fp8_output, _fp8_amax, _fp8_descales,
    _head_dim, _head_dim_v,
    feature_rule("gqa", lambda call: call.heads_q != call.heads_kv,
                 lambda call: f"grouped-query attention ({call.heads_q} q heads over {call.heads_kv} kv heads) not "
                              "supported"),
    feature_rule("causal", lambda call: call.causal, "causal masking not supported"),
    _alignment,
    feature_rule("window", lambda call: call.window is not None,
                 lambda call: f"sliding window {call.window} not supported"),
    feature_rule("softcap", lambda call: call.softcap > 0, lambda call: f"softcap={call.softcap:g} not supported"),
    feature_rule("alibi", lambda call: call.alibi_slopes is not None, "ALiBi slopes not supported"),
    feature_rule("dropout", lambda call: call.dropout_p > 0,
                 lambda call: f"dropout_p={call.dropout_p:g} not supported"),
    feature_rule("attn_mask", lambda call: call.attn_mask is not None, "boolean attn_mask not supported"),
    _bias,
    feature_rule("lse", lambda call: call.return_lse, "return_lse=True not supported (no log-sum-exp output)"),
    feature_rule("backward", lambda call: call.requires_grad,
                 "backward (inputs require grad) not supported: forward-only implementation"),
    feature_rule("deterministic_forward", lambda call: call.deterministic,
                 "deterministic=True not supported: its forward is not bitwise reproducible"),
    _deterministic_backward,
    _returned_lse_softcap, _returned_lse_bias,
    _sinks_lse, _sinks_softcap, _sinks_bias,
    _kv_cache, _kv_cache_alibi,
    _sequence_limit,
)


# -- the op ---------------------------------------------------------------------------------------------------

def attention_features(call: AttentionCall) -> dict[str, Any]:
    """The call-side values `when:` conditions of the attention policy compare against."""
    return {
        "dtype": call.dtype, "layout": call.layout, "head_dim": call.head_dim, "head_dim_v": call.head_dim_v,
        "seqlen_q": call.seqlen_q, "seqlen_k": call.seqlen_k, "batch": call.batch, "heads_q": call.heads_q,
        "heads_kv": call.heads_kv, "gqa_ratio": call.heads_q // call.heads_kv, "causal": call.causal,
        "window": call.window is not None, "softcap": call.softcap > 0, "alibi": call.alibi_slopes is not None,
        "dropout": call.dropout_p > 0, "mask": call.attn_mask is not None, "bias": call.attn_bias is not None,
        "varlen": call.varlen, "requires_grad": call.requires_grad, "deterministic": call.deterministic,
        "return_lse": call.return_lse, "causal_alignment": call.causal_alignment,
        "kv_cache": call.seqused_k is not None, "paged": call.block_table is not None, "page_size": call.page_size,
        "sinks": call.sinks is not None,
        "keyless_rows": call.keyless_rows,
    }


ATTENTION = register_op(OpSpec(
    name="attention", impl_base=AttentionImpl, call_features=attention_features, arguments=ATTENTION_ARGS,
    validator=validate_attention, tuning=attention_tuning(validate_attention),
    description="scaled dot-product attention (dense layouts and packed varlen)",
    vocabularies={"layout": LAYOUTS, "causal_alignment": CAUSAL_ALIGNMENTS}, expected_outputs=attention_outputs,
    result_fix=lse_gradient_fix,
    features={"dtype": "dtype", "layout": "name", "causal_alignment": "name", **dict.fromkeys(
        ("head_dim", "head_dim_v", "seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv", "gqa_ratio", "page_size"),
        "int"),
        **dict.fromkeys(("causal", "window", "softcap", "alibi", "dropout", "mask", "bias", "varlen",
                         "requires_grad", "deterministic", "return_lse", "kv_cache", "paged", "sinks",
                         "keyless_rows"), "bool")},
))
