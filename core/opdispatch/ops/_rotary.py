"""The ``rotary_embedding`` op: rotary position embedding (RoPE) applied to q and k.

For each token at position ``p`` and each pair ``(x1, x2)`` of the first ``rotary_dim`` channels of a head,
``(x1, x2) -> (x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p])``; channels beyond ``rotary_dim`` pass
through. Pairs are ``(x[i], x[i + rotary_dim / 2])`` (GPT-NeoX, "half-rotated", the default) or ``(x[2i], x[2i + 1])``
(GPT-J, ``interleaved=True``). ``cos``/``sin`` are caches of shape ``(max_positions, rotary_dim / 2)``, the
convention of flash-attn's and FlagGems' kernels. A token's position is its index in its sequence, shifted by
``seqlen_offsets`` (decode with a KV cache), or given explicitly by ``positions`` (vLLM's convention). Arithmetic
in float32 (float64 for float64 inputs); outputs have the inputs' dtype; inputs are never modified.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ..base._arguments import Arg, OpArguments
from ..base._dtypes import caps_as_dict, caps_problems, dtype_from_name, dtype_name, dtype_reason
from ..base._impl import CapabilityRule, Impl, feature_rule, unmet_capabilities
from ..base._ops import BucketFeature, OpSpec, TuningSpec, register_op
from ..base._cases import known_fields, random_tensor

__all__ = ["RotaryCall", "RotaryCaps", "RotaryCase", "RotaryImpl", "validate_rotary_embedding"]

_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INDEX = frozenset({torch.int32, torch.int64})
ROTARY_LAYOUTS = ("bshd", "thd")


ROTARY_ARGS = OpArguments("rotary_embedding", (
    Arg("q", "torch.Tensor", key="tensor", positional=True, doc="(batch, seqlen, heads, head_dim), or (total, heads, "
        "head_dim) for `thd`"),
    Arg("k", "torch.Tensor", key="tensor", positional=True, doc="as q; may have fewer heads"),
    Arg("cos", "torch.Tensor", key="strided", positional=True, doc="(max_positions, rotary_dim / 2) cache"),
    Arg("sin", "torch.Tensor", key="strided", positional=True, doc="(max_positions, rotary_dim / 2) cache"),
    Arg("positions", "torch.Tensor | None", None, key="index", doc="each token's position (int), instead of its index"),
    Arg("seqlen_offsets", "int | torch.Tensor | None", None, key="index",
        doc="added to each token's index: an int, or one per sequence"),
    Arg("interleaved", "bool", False, doc="rotate pairs (x[2i], x[2i+1]) (GPT-J) instead of (x[i], x[i+d/2]) (NeoX)"),
    Arg("layout", "str", "bshd", doc="`bshd`, or `thd` (packed with `cu_seqlens`)"),
    Arg("cu_seqlens", "torch.Tensor | None", None, key="index", doc="int32 (batch + 1,) offsets for `thd`"),
    Arg("max_seqlen", "int | None", None, doc="longest sequence of a `thd` call"),
    Arg("impl", "str | None", None, doc="pin one implementation id for this call (never falls back)"),
), bound=("q", "k", "cos", "sin", "positions", "seqlen_offsets", "cu_seqlens"))


class RotaryCall:
    """A validated ``rotary_embedding`` call: the tensors and what selection reads from them."""

    __slots__ = ("q", "k", "cos", "sin", "positions", "seqlen_offsets", "interleaved", "layout", "cu_seqlens",
                 "max_seqlen", "head_dim", "rotary_dim", "heads_q", "heads_k", "dtype", "device", "requires_grad",
                 "module")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor | None, seqlen_offsets: int | torch.Tensor, interleaved: bool, layout: str,
                 cu_seqlens: torch.Tensor | None, max_seqlen: int | None, module: str | None = None) -> None:
        self.q, self.k, self.cos, self.sin = q, k, cos, sin
        self.positions, self.seqlen_offsets = positions, seqlen_offsets
        self.interleaved, self.layout = interleaved, layout
        self.cu_seqlens, self.max_seqlen = cu_seqlens, max_seqlen
        self.head_dim = q.shape[-1]
        self.rotary_dim = 2 * cos.shape[-1]
        self.heads_q, self.heads_k = q.shape[-2], k.shape[-2]
        self.dtype = q.dtype
        self.device = q.device
        self.requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
        self.module = module

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def cos_sin_grad(self) -> bool:
        """Whether a gradient must flow into the cos/sin caches (learned or scaled frequencies)."""
        return torch.is_grad_enabled() and (self.cos.requires_grad or self.sin.requires_grad)

    def with_tensors(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor | None, seqlen_offsets: int | torch.Tensor | None,
                     cu_seqlens: torch.Tensor | None) -> RotaryCall:
        """This call with other tensors of the same signature (the per-call fast path's next call)."""
        return RotaryCall(q, k, cos, sin, positions, 0 if seqlen_offsets is None else seqlen_offsets,
                          self.interleaved, self.layout, cu_seqlens, self.max_seqlen, self.module)

    def stripped(self) -> RotaryCall:
        """This call without its tensors: what a bound function may keep (`with_tensors` reads none of them)."""
        new = RotaryCall.__new__(RotaryCall)
        for name in RotaryCall.__slots__:
            setattr(new, name, getattr(self, name))
        for name in ("q", "k", "cos", "sin", "positions", "cu_seqlens"):
            setattr(new, name, None)
        new.seqlen_offsets = 0 if isinstance(self.seqlen_offsets, torch.Tensor) else self.seqlen_offsets
        return new

    def token_positions(self) -> torch.Tensor:
        """The position of every token, int64: (batch, seqlen) for bshd, (total,) for thd."""
        if self.positions is not None:
            return self.positions.long()
        device = self.q.device
        if self.cu_seqlens is None:
            batch, seqlen = self.q.shape[:2]
            pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
            offsets = self.seqlen_offsets
            if isinstance(offsets, torch.Tensor):
                return pos + offsets.long().unsqueeze(1)
            return pos + offsets
        total = self.q.shape[0]
        cu = self.cu_seqlens.long()
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        # output_size: no device-to-host read of the lengths (no sync on accelerators)
        first = torch.repeat_interleave(starts, lengths, output_size=total)
        pos = torch.arange(total, device=device) - first
        offsets = self.seqlen_offsets
        if isinstance(offsets, torch.Tensor):
            return pos + torch.repeat_interleave(offsets.long(), lengths, output_size=total)
        return pos + offsets

    def signature(self) -> tuple[Any, ...]:
        """Everything selection may depend on (no tensor data)."""
        offsets = self.seqlen_offsets
        return (tuple(self.q.shape), tuple(self.k.shape), tuple(self.cos.shape), self.dtype, self.cos.dtype,
                str(self.device), self.layout, self.interleaved, self.positions is not None,
                isinstance(offsets, torch.Tensor), self.requires_grad, self.cos_sin_grad,
                self.cos.stride(-1) == 1 and self.sin.stride(-1) == 1, self.module)

    def describe(self) -> str:
        parts = [f"q {tuple(self.q.shape)} k {tuple(self.k.shape)} {dtype_name(self.dtype)} {self.layout}",
                 f"rotary_dim {self.rotary_dim}/{self.head_dim}", "interleaved" if self.interleaved else "neox",
                 f"cos/sin ({self.max_positions}, {self.rotary_dim // 2}) {dtype_name(self.cos.dtype)}"]
        if self.positions is not None:
            parts.append("positions")
        elif isinstance(self.seqlen_offsets, torch.Tensor) or self.seqlen_offsets:
            parts.append("seqlen_offsets")
        if self.requires_grad:
            parts.append("grad")
        return ", ".join(parts)


def _check_tensor(name: str, t: Any, allowed: frozenset[torch.dtype], what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rotary_embedding: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        raise ValueError(f"rotary_embedding: {name} has dtype {dtype_name(t.dtype)}; allowed: {what}")
    return t


def validate_rotary_embedding(q: Any, k: Any, cos: Any, sin: Any, *, positions: Any = None,
                              seqlen_offsets: Any = None, interleaved: Any = False, layout: Any = "bshd",
                              cu_seqlens: Any = None, max_seqlen: Any = None, module: str | None = None,
                              check_values: bool | None = None) -> RotaryCall:
    """Check a ``rotary_embedding`` call; ValueError/TypeError naming the bad argument, its value, what is allowed.

    Position values are range-checked when the index tensors are on the CPU (or with ``check_values=True``);
    reading accelerator tensors back would sync every call, so there, as in the vendor kernels, they are trusted.
    """
    float_names = "fp16, bf16, fp32, fp64"
    q = _check_tensor("q", q, _FLOAT, float_names)
    k = _check_tensor("k", k, _FLOAT, float_names)
    cos = _check_tensor("cos", cos, _FLOAT, float_names)
    sin = _check_tensor("sin", sin, _FLOAT, float_names)
    if layout not in ROTARY_LAYOUTS:
        raise ValueError(f"rotary_embedding: layout={layout!r}; allowed: {', '.join(ROTARY_LAYOUTS)} (bshd: (batch, "
                         "seqlen, heads, head_dim); thd: packed (total, heads, head_dim) with cu_seqlens)")
    if not isinstance(interleaved, bool):
        raise TypeError(f"rotary_embedding: interleaved must be a bool, got {interleaved!r}")
    rank = 4 if layout == "bshd" else 3
    for name, t in (("q", q), ("k", k)):
        if t.dim() != rank:
            raise ValueError(f"rotary_embedding: {name} has shape {tuple(t.shape)}; layout {layout!r} needs "
                             f"{rank} dims")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"rotary_embedding: k is {dtype_name(k.dtype)} on {k.device} and q {dtype_name(q.dtype)} "
                         f"on {q.device}; they must match")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in every dim but "
                         "heads")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)} and k {tuple(k.shape)} need at least one head")
    head_dim = q.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"rotary_embedding: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be "
                         "(max_positions, rotary_dim / 2)")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"rotary_embedding: cos/sin are on {cos.device}/{sin.device} and q on {q.device}; move "
                         "them to one device")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(f"rotary_embedding: cos/sin have {cos.shape[1]} columns, so rotary_dim is {rotary_dim}; it "
                         f"must be in 2..head_dim ({head_dim}) (cos/sin hold rotary_dim / 2 frequencies)")
    if cos.shape[0] == 0:
        raise ValueError("rotary_embedding: cos/sin have no rows (max_positions is 0)")
    if positions is not None and seqlen_offsets is not None:
        raise ValueError("rotary_embedding: pass either positions (each token's position) or seqlen_offsets (a "
                         "shift of each sequence's positions), not both")
    batch = q.shape[0]
    if layout == "thd":
        cu_seqlens, max_seqlen = _check_varlen(q, cu_seqlens, max_seqlen)
        batch = cu_seqlens.shape[0] - 1
    elif cu_seqlens is not None or max_seqlen is not None:
        raise ValueError("rotary_embedding: cu_seqlens/max_seqlen describe packed sequences; pass layout='thd' "
                         "with them")
    tokens = q.shape[:-2]
    values_on_host = check_values if check_values is not None else q.device.type == "cpu"
    if positions is not None:
        positions = _check_tensor("positions", positions, _INDEX, "int32, int64")
        if tuple(positions.shape) != tuple(tokens) or positions.device != q.device:
            raise ValueError(f"rotary_embedding: positions is {tuple(positions.shape)} on {positions.device}; it "
                             f"must be {tuple(tokens)} (one position per token) on {q.device}")
        if values_on_host and positions.numel():
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= cos.shape[0]:
                raise ValueError(f"rotary_embedding: positions span {lo}..{hi}; the cos/sin caches hold positions "
                                 f"0..{cos.shape[0] - 1} (extend the caches or clamp the positions)")
        offsets: int | torch.Tensor = 0
    else:
        offsets = _check_offsets(seqlen_offsets, batch, q.device)
        longest = q.shape[1] if layout == "bshd" else max_seqlen
        assert longest is not None
        if isinstance(offsets, int):
            top = offsets + longest - 1
        elif values_on_host and offsets.numel():
            top = int(offsets.max()) + longest - 1
            if int(offsets.min()) < 0:
                raise ValueError(f"rotary_embedding: seqlen_offsets hold {int(offsets.min())}; offsets must be >= 0")
        else:
            top = -1
        if top >= cos.shape[0]:
            raise ValueError(f"rotary_embedding: tokens reach position {top} (seqlen_offsets + seqlen - 1); the "
                             f"cos/sin caches hold positions 0..{cos.shape[0] - 1} (extend the caches)")
    return RotaryCall(q, k, cos, sin, positions, offsets, interleaved, layout, cu_seqlens, max_seqlen, module)


def _check_varlen(q: torch.Tensor, cu_seqlens: Any, max_seqlen: Any) -> tuple[torch.Tensor, int]:
    if cu_seqlens is None or max_seqlen is None:
        raise ValueError("rotary_embedding: layout 'thd' needs cu_seqlens ((batch + 1,) int32 offsets of the packed "
                         "sequences) and max_seqlen (the longest sequence)")
    cu_seqlens = _check_tensor("cu_seqlens", cu_seqlens, frozenset({torch.int32}), "int32")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.device != q.device:
        raise ValueError(f"rotary_embedding: cu_seqlens is {tuple(cu_seqlens.shape)} on {cu_seqlens.device}; it must "
                         f"be (batch + 1,) with batch >= 1, on {q.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"rotary_embedding: max_seqlen={max_seqlen!r}; it must be an int >= 1")
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or cu[-1] != q.shape[0] or min(lengths) < 0:
            raise ValueError(f"rotary_embedding: cu_seqlens {cu} must start at 0, not decrease, and end at the token "
                             f"count of q ({q.shape[0]})")
        if max(lengths) > max_seqlen:
            raise ValueError(f"rotary_embedding: a sequence has {max(lengths)} tokens but max_seqlen={max_seqlen}")
    return cu_seqlens, max_seqlen


def _check_offsets(offsets: Any, batch: int, device: torch.device) -> int | torch.Tensor:
    if offsets is None:
        return 0
    if isinstance(offsets, torch.Tensor):
        offsets = _check_tensor("seqlen_offsets", offsets, _INDEX, "int32, int64")
        if tuple(offsets.shape) != (batch,) or offsets.device != device:
            raise ValueError(f"rotary_embedding: seqlen_offsets is {tuple(offsets.shape)} on {offsets.device}; it "
                             f"must be ({batch},) (one offset per sequence) on {device}, or an int")
        return offsets  # type: ignore[no-any-return]  # checked to be a tensor above
    if isinstance(offsets, bool) or not isinstance(offsets, int) or offsets < 0:
        raise ValueError(f"rotary_embedding: seqlen_offsets={offsets!r}; it must be an int >= 0 or a ({batch},) int "
                         "tensor")
    return offsets


@dataclass(frozen=True)
class RotaryCaps:
    """What a ``rotary_embedding`` implementation supports, declared as data."""

    dtypes: frozenset[torch.dtype]
    neox: bool = False              # half-rotated pairs (x[i], x[i + rotary_dim / 2])
    interleaved: bool = False       # GPT-J pairs (x[2i], x[2i + 1]); declare one of the two at least
    partial: bool = False           # rotary_dim < head_dim
    varlen: bool = False            # layout thd with cu_seqlens
    positions: bool = False         # explicit per-token positions
    offsets: bool = False           # seqlen_offsets (int or per-sequence tensor)
    gqa: bool = False               # k with fewer heads than q
    backward: bool = False          # gradients for q and k
    cos_sin_grad: bool = False      # gradients into the cos/sin caches
    max_head_dim: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return caps_as_dict(self)


def _uses_offsets(call: RotaryCall) -> bool:
    offsets = call.seqlen_offsets
    return isinstance(offsets, torch.Tensor) or bool(offsets)


def _head_dim_rule(caps: RotaryCaps, call: RotaryCall) -> str | None:
    if caps.max_head_dim is None or call.head_dim <= caps.max_head_dim:
        return None
    return f"head_dim {call.head_dim} above the supported maximum {caps.max_head_dim}"


# `RotaryCaps` turned into reasons (`opdispatch.base._impl.unmet_capabilities`), in the order they are printed.
ROTARY_CAPABILITY_RULES: tuple[CapabilityRule, ...] = (
    lambda caps, call: dtype_reason(call.dtype, caps.dtypes),
    feature_rule("interleaved", lambda call: call.interleaved, "interleaved (GPT-J) pairs not supported"),
    feature_rule("neox", lambda call: not call.interleaved, "half-rotated (GPT-NeoX) pairs not supported"),
    feature_rule("partial", lambda call: call.rotary_dim < call.head_dim,
                 lambda call: f"partial rotary (rotary_dim {call.rotary_dim} < head_dim {call.head_dim}) "
                              "not supported"),
    feature_rule("varlen", lambda call: call.varlen, "packed varlen (layout thd) not supported"),
    feature_rule("positions", lambda call: call.positions is not None,
                 "explicit positions not supported (pass seqlen_offsets instead where they fit)"),
    feature_rule("offsets", _uses_offsets, "seqlen_offsets not supported"),
    feature_rule("gqa", lambda call: call.heads_k != call.heads_q,
                 lambda call: f"k with {call.heads_k} heads and q with {call.heads_q} (GQA) not supported"),
    feature_rule("backward", lambda call: call.requires_grad, "backward not supported (forward only)"),
    feature_rule("cos_sin_grad", lambda call: call.cos_sin_grad,
                 "gradients into cos/sin not supported (they are taken as constants)"),
    _head_dim_rule,
)


class RotaryImpl(Impl):
    """Base for ``rotary_embedding`` implementations: set `caps`, implement `run` (returns (q_out, k_out))."""

    op: ClassVar[str] = "rotary_embedding"
    caps: ClassVar[RotaryCaps]

    def check_declaration(self) -> list[str]:
        problems = super().check_declaration() + caps_problems(getattr(self, "caps", None), RotaryCaps)
        caps = getattr(self, "caps", None)
        if not problems and not (caps.neox or caps.interleaved):  # type: ignore[union-attr]
            problems.append("caps declares neither neox=True (half-rotated pairs) nor interleaved=True (GPT-J "
                            "pairs): declare the pairing run() computes")
        return problems

    def not_supported_reasons(self, call: RotaryCall, device: Any) -> list[str]:
        return unmet_capabilities(self.caps, call, ROTARY_CAPABILITY_RULES) + self.extra_reasons(call, device)

    def extra_reasons(self, call: RotaryCall, device: Any) -> list[str]:
        """Override for limits `RotaryCaps` cannot express."""
        return []

    def describe_capabilities(self) -> dict[str, Any]:
        out = super().describe_capabilities()
        out.update(self.caps.as_dict())
        return out


def rotary_features(call: RotaryCall) -> dict[str, Any]:
    return {"dtype": call.dtype, "head_dim": call.head_dim, "rotary_dim": call.rotary_dim,
            "interleaved": call.interleaved, "varlen": call.varlen, "positions": call.positions is not None,
            "requires_grad": call.requires_grad}


def rotary_fake_outputs(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The outputs' shapes for torch.compile: new q and k."""
    return [torch.empty_like(q), torch.empty_like(k)]


# -- tuning: what `opdispatch tune --op rotary_embedding` times ------------------------------------------------

@dataclass(frozen=True)
class RotaryCase:
    """A ``rotary_embedding`` call to time, without data: q (1, tokens, heads_q, head_dim) and k with heads_k
    heads (bshd), the first `rotary_dim` channels rotated (default: all), cos/sin caches of `tokens` positions."""

    dtype: str = "bf16"
    tokens: int = 1
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128
    rotary_dim: int = 128
    interleaved: bool = False
    requires_grad: bool = False
    name: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> RotaryCase:
        data = known_fields(cls, data, where)
        data.setdefault("rotary_dim", data.get("head_dim", cls.head_dim))
        data.setdefault("heads_k", data.get("heads_q", cls.heads_k))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.name:
            return self.name
        parts = [self.dtype, f"t{self.tokens}", f"h{self.heads_q}/{self.heads_k}", f"d{self.head_dim}"]
        if self.rotary_dim != self.head_dim:
            parts.append(f"rot{self.rotary_dim}")
        parts.append("gptj" if self.interleaved else "neox")
        if self.requires_grad:
            parts.append("fwd+bwd")
        return " ".join(parts)

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
        """Fresh random q/k and real cos/sin caches (base 10000): keyword arguments of `validate_rotary_embedding`."""
        dtype, device = dtype_from_name(self.dtype), torch.device(device)
        q = random_tensor((1, self.tokens, self.heads_q, self.head_dim), dtype, device, generator,
                          self.requires_grad)
        k = random_tensor((1, self.tokens, self.heads_k, self.head_dim), dtype, device, generator,
                          self.requires_grad)
        half = self.rotary_dim // 2
        if device.type == "meta":
            cos = sin = torch.empty(self.tokens, half, dtype=dtype, device=device)
        else:
            inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=device) * 2 / self.rotary_dim)
            angles = torch.arange(self.tokens, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return dict(q=q, k=k, cos=cos, sin=sin, interleaved=self.interleaved)

    def flops(self) -> float:
        """Per rotated pair: 4 multiplies and 2 adds, over q's and k's heads; backward counted as 1x (a rotation)."""
        pairs = self.tokens * (self.heads_q + self.heads_k) * (self.rotary_dim // 2)
        return 6.0 * pairs * (2.0 if self.requires_grad else 1.0)


ROTARY_PRESETS = ("decode", "prefill", "training")


def rotary_preset(name: str, device_type: str = "cuda") -> list[RotaryCase]:
    """``decode`` (a few tokens), ``prefill`` (many; GPT-J pairs and partial rotary too) or ``training``
    (fwd+bwd): bf16 32/8 heads of 128 on accelerators, small float32 ones on the CPU."""
    cpu = device_type == "cpu"
    dtype = "fp32" if cpu else "bf16"
    hq, hk, d = (4, 2, 32) if cpu else (32, 8, 128)
    if name == "decode":
        tokens = [1, 8] if cpu else [1, 8, 64]
        return [RotaryCase(dtype=dtype, tokens=t, heads_q=hq, heads_k=hk, head_dim=d, rotary_dim=d) for t in tokens]
    if name == "prefill":
        tokens = [128, 512] if cpu else [2048, 32768]
        cases = [RotaryCase(dtype=dtype, tokens=t, heads_q=hq, heads_k=hk, head_dim=d, rotary_dim=d) for t in tokens]
        return cases + [
            RotaryCase(dtype=dtype, tokens=tokens[-1], heads_q=hq, heads_k=hk, head_dim=d, rotary_dim=d,
                       interleaved=True),
            RotaryCase(dtype=dtype, tokens=tokens[-1], heads_q=hq, heads_k=hk, head_dim=d, rotary_dim=d // 2)]
    if name == "training":
        tokens = [128, 512] if cpu else [8192, 32768]
        return [RotaryCase(dtype=dtype, tokens=t, heads_q=hq, heads_k=hk, head_dim=d, rotary_dim=d,
                           requires_grad=True) for t in tokens]
    raise ValueError(f"unknown rotary_embedding preset {name!r}; allowed: {', '.join(ROTARY_PRESETS)}")


def _bucket_discrete(call: RotaryCall) -> tuple[Any, ...]:
    return (dtype_name(call.dtype), call.heads_q, call.heads_k, call.head_dim, call.rotary_dim, call.interleaved,
            call.requires_grad)


def _bucket_sizes(call: RotaryCall) -> tuple[int, ...]:
    return (call.q.numel() // (call.heads_q * call.head_dim),)


def _describe_bucket(discrete: tuple[Any, ...], sizes: tuple[int, ...]) -> str:
    dtype, heads_q, heads_k, head_dim, rotary_dim, interleaved, grad = discrete
    return (f"{dtype} h{heads_q}/{heads_k} d{head_dim} rot{rotary_dim} {'gptj' if interleaved else 'neox'}"
            f"{' grad' if grad else ''} t{sizes[0]}")


ROTARY_TUNING = TuningSpec(
    case=RotaryCase, presets=ROTARY_PRESETS, preset=rotary_preset, validate=validate_rotary_embedding,
    discrete=(BucketFeature("dtype", str), BucketFeature("heads_q", int), BucketFeature("heads_k", int),
              BucketFeature("head_dim", int), BucketFeature("rotary_dim", int), BucketFeature("interleaved", bool),
              BucketFeature("requires_grad", bool)),
    bucket_discrete=_bucket_discrete, sizes=("tokens",), bucket_sizes=_bucket_sizes,
    describe_bucket=_describe_bucket)


ROTARY_EMBEDDING = register_op(OpSpec(
    name="rotary_embedding", impl_base=RotaryImpl, call_features=rotary_features, arguments=ROTARY_ARGS,
    validator=validate_rotary_embedding, fake_outputs=rotary_fake_outputs,
    expected_outputs=lambda call: [(tuple(call.q.shape), call.dtype), (tuple(call.k.shape), call.dtype)],
    description="rotary position embedding (RoPE) of q and k, NeoX or GPT-J pairs, cos/sin caches",
    tuning=ROTARY_TUNING,
    features={"dtype": "dtype", "head_dim": "int", "rotary_dim": "int", "interleaved": "bool",
              "varlen": "bool", "positions": "bool", "requires_grad": "bool"},
))
