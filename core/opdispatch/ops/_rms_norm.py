"""The ``rms_norm`` op: RMSNorm with an optional weight and an optional fused residual add.

``y = x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim. With ``residual`` the op first adds it
(``h = x + residual``), normalises ``h`` and returns ``(y, h)`` — the fused add-and-norm of transformer blocks
(vLLM's ``fused_add_rms_norm``, TransformerEngine's and FlagGems' ``fused_add_rms_norm``), so the caller keeps
``h`` as the next residual. Statistics are computed in float32 (float64 for float64 inputs); the output has the
input's dtype.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ..base._arguments import Arg, OpArguments
from ..base._dtypes import caps_as_dict, caps_problems, dtype_from_name, dtype_name, dtype_reason
from ..base._impl import CapabilityRule, Impl, feature_rule, unmet_capabilities
from ..base._ops import BucketFeature, OpSpec, TuningSpec, register_op
from ..base._cases import grid, known_fields, random_tensor

__all__ = ["RmsNormCall", "RmsNormCaps", "RmsNormCase", "RmsNormImpl", "validate_rms_norm"]

_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


RMS_NORM_ARGS = OpArguments("rms_norm", (
    Arg("x", "torch.Tensor", key="tensor", positional=True, doc="input, normalised over its last (hidden) dim"),
    Arg("weight", "torch.Tensor | None", None, key="tensor?", positional=True, doc="(hidden,) scale; None = 1"),
    Arg("eps", "float", 1e-6, positional=True, doc="added to the mean of squares, > 0"),
    Arg("residual", "torch.Tensor | None", None, key="tensor?", positional=True,
        doc="added to x first; the op then returns (y, x + residual)"),
    Arg("impl", "str | None", None, doc="pin one implementation id for this call (never falls back)"),
), bound=("x", "weight", "residual"),
   return_forms=(("residual", "None", "torch.Tensor"),
                 ("residual", "torch.Tensor", "tuple[torch.Tensor, torch.Tensor]")))


class RmsNormCall:
    """A validated ``rms_norm`` call: the tensors and what selection reads from them."""

    __slots__ = ("x", "weight", "residual", "eps", "hidden_size", "dtype", "device", "requires_grad", "module")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
                 module: str | None = None) -> None:
        self.x, self.weight, self.residual, self.eps = x, weight, residual, eps
        self.hidden_size = x.shape[-1]
        self.dtype = x.dtype
        self.device = x.device
        self.requires_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, residual))
        self.module = module

    def with_tensors(self, x: torch.Tensor, weight: torch.Tensor | None,
                     residual: torch.Tensor | None) -> RmsNormCall:
        """This call with other tensors of the same signature (the per-call fast path's next call)."""
        new = RmsNormCall.__new__(RmsNormCall)
        for name in RmsNormCall.__slots__:
            setattr(new, name, getattr(self, name))
        new.x, new.weight, new.residual = x, weight, residual
        return new

    def stripped(self) -> RmsNormCall:
        """This call without its tensors: what a bound function may keep."""
        return self.with_tensors(None, None, None)  # type: ignore[arg-type]

    @property
    def stats_dtype(self) -> torch.dtype:
        """The dtype the mean of squares is computed in."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def signature(self) -> tuple[Any, ...]:
        """Everything selection may depend on (no tensor data)."""
        return (tuple(self.x.shape), self.dtype, str(self.device),
                None if self.weight is None else self.weight.dtype, self.residual is not None, self.requires_grad,
                self.module)

    def describe(self) -> str:
        parts = [f"x {tuple(self.x.shape)} {dtype_name(self.dtype)}", f"hidden {self.hidden_size}",
                 f"eps {self.eps:g}"]
        if self.weight is None:
            parts.append("no weight")
        if self.residual is not None:
            parts.append("+ residual")
        if self.requires_grad:
            parts.append("grad")
        return ", ".join(parts)


def validate_rms_norm(x: Any, weight: Any = None, eps: Any = 1e-6, residual: Any = None, *,
                      module: str | None = None) -> RmsNormCall:
    """Check an ``rms_norm`` call; ValueError/TypeError naming the bad argument, its value, what is allowed."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rms_norm: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise ValueError(f"rms_norm: x has dtype {dtype_name(x.dtype)}; allowed: fp16, bf16, fp32, fp64 "
                         "(cast it, e.g. x.float())")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x has shape {tuple(x.shape)}; it needs a non-empty last (hidden) dim")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"rms_norm: eps={eps!r}; it must be a finite number > 0 (e.g. 1e-6)")
    hidden = x.shape[-1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"rms_norm: weight must be a torch.Tensor or None, got {type(weight).__name__}")
        if tuple(weight.shape) != (hidden,):
            raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}; it must be ({hidden},), the hidden "
                             f"size of x {tuple(x.shape)}")
        if weight.device != x.device:
            raise ValueError(f"rms_norm: weight is on {weight.device} and x on {x.device}; move them to one device")
        if weight.dtype not in _FLOAT:
            raise ValueError(f"rms_norm: weight has dtype {dtype_name(weight.dtype)}; allowed: a float dtype")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"rms_norm: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"rms_norm: residual is {tuple(residual.shape)} {dtype_name(residual.dtype)} on "
                             f"{residual.device}; it must match x: {tuple(x.shape)} {dtype_name(x.dtype)} on "
                             f"{x.device}")
    return RmsNormCall(x, weight, residual, float(eps), module)


@dataclass(frozen=True)
class RmsNormCaps:
    """What an ``rms_norm`` implementation supports, declared as data."""

    dtypes: frozenset[torch.dtype]
    weight_optional: bool = False  # takes calls without a weight
    residual: bool = False         # the fused residual add
    backward: bool = False         # autograd flows through run()
    max_hidden_size: int | None = None
    weight_dtype_of_x: bool = False  # the weight must have x's dtype (kernels of one element type)

    def as_dict(self) -> dict[str, Any]:
        return caps_as_dict(self)


def _weight_dtype_rule(caps: RmsNormCaps, call: RmsNormCall) -> str | None:
    weight = call.weight
    if not caps.weight_dtype_of_x or weight is None or weight.dtype == call.dtype:
        return None
    return (f"weight dtype {dtype_name(weight.dtype)} differs from x's {dtype_name(call.dtype)} "
            "(the kernel takes one dtype; cast the weight, e.g. weight.to(x.dtype))")


def _hidden_size_rule(caps: RmsNormCaps, call: RmsNormCall) -> str | None:
    if caps.max_hidden_size is None or call.hidden_size <= caps.max_hidden_size:
        return None
    return f"hidden size {call.hidden_size} above the supported maximum {caps.max_hidden_size}"


# `RmsNormCaps` turned into reasons (`opdispatch.base._impl.unmet_capabilities`), in the order they are printed.
RMS_NORM_CAPABILITY_RULES: tuple[CapabilityRule, ...] = (
    lambda caps, call: dtype_reason(call.dtype, caps.dtypes),
    feature_rule("weight_optional", lambda call: call.weight is None,
                 "a call without weight not supported (pass weight=torch.ones(hidden))"),
    feature_rule("residual", lambda call: call.residual is not None, "the fused residual add not supported"),
    _weight_dtype_rule,
    feature_rule("backward", lambda call: call.requires_grad, "backward not supported (forward only)"),
    _hidden_size_rule,
)


class RmsNormImpl(Impl):
    """Base for ``rms_norm`` implementations: set `caps`, implement `run` (returns y, or (y, x + residual))."""

    op: ClassVar[str] = "rms_norm"
    caps: ClassVar[RmsNormCaps]

    def check_declaration(self) -> list[str]:
        return super().check_declaration() + caps_problems(getattr(self, "caps", None), RmsNormCaps)

    def not_supported_reasons(self, call: RmsNormCall, device: Any) -> list[str]:
        return unmet_capabilities(self.caps, call, RMS_NORM_CAPABILITY_RULES) + self.extra_reasons(call, device)

    def extra_reasons(self, call: RmsNormCall, device: Any) -> list[str]:
        """Override for limits `RmsNormCaps` cannot express."""
        return []

    def describe_capabilities(self) -> dict[str, Any]:
        out = super().describe_capabilities()
        out.update(self.caps.as_dict())
        return out


def rms_norm_features(call: RmsNormCall) -> dict[str, Any]:
    return {"dtype": call.dtype, "hidden_size": call.hidden_size, "tokens": call.x.numel() // call.hidden_size,
            "residual": call.residual is not None,
            "weight": call.weight is not None, "requires_grad": call.requires_grad}


# -- tuning: what `opdispatch tune --op rms_norm` times --------------------------------------------------------

@dataclass(frozen=True)
class RmsNormCase:
    """An ``rms_norm`` call to time, without data: x is (tokens, hidden), with a weight and a residual or not."""

    dtype: str = "bf16"
    tokens: int = 1
    hidden: int = 4096
    weight: bool = True
    residual: bool = False
    requires_grad: bool = False
    name: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> RmsNormCase:
        return cls(**known_fields(cls, data, where))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.name:
            return self.name
        parts = [self.dtype, f"t{self.tokens}", f"h{self.hidden}"]
        if not self.weight:
            parts.append("no-weight")
        if self.residual:
            parts.append("+residual")
        if self.requires_grad:
            parts.append("fwd+bwd")
        return " ".join(parts)

    def inputs(self, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
        """Fresh random inputs: keyword arguments of `opdispatch.rms_norm` / `validate_rms_norm`."""
        dtype, device = dtype_from_name(self.dtype), torch.device(device)
        shape = (self.tokens, self.hidden)
        return dict(x=random_tensor(shape, dtype, device, generator, self.requires_grad),
                    weight=random_tensor((self.hidden,), dtype, device, generator, self.requires_grad)
                    if self.weight else None,
                    residual=random_tensor(shape, dtype, device, generator, self.requires_grad)
                    if self.residual else None, eps=1e-6)

    def flops(self) -> float:
        """Per element: square, sum, scale by the inverse RMS, (weight), (residual add); backward counted as 2x."""
        per_element = 3 + int(self.weight) + int(self.residual)
        return per_element * self.tokens * self.hidden * (3.0 if self.requires_grad else 1.0)


RMS_NORM_PRESETS = ("decode", "prefill", "training")


def rms_norm_preset(name: str, device_type: str = "cuda") -> list[RmsNormCase]:
    """``decode`` (a few rows), ``prefill`` (many rows) or ``training`` (fwd+bwd), with and without the residual:
    bf16 model widths on accelerators, small float32 ones on the CPU."""
    cpu = device_type == "cpu"
    dtype = "fp32" if cpu else "bf16"
    hidden = [256, 1024] if cpu else [4096, 8192]
    if name == "decode":
        rows = grid(tokens=[1, 8] if cpu else [1, 8, 64], hidden=hidden, residual=[False, True])
    elif name == "prefill":
        rows = grid(tokens=[256, 1024] if cpu else [2048, 32768], hidden=hidden, residual=[False, True])
    elif name == "training":
        rows = grid(tokens=[64, 256] if cpu else [8192, 32768], hidden=hidden[:1], residual=[False, True],
                    requires_grad=[True])
    else:
        raise ValueError(f"unknown rms_norm preset {name!r}; allowed: {', '.join(RMS_NORM_PRESETS)}")
    return [RmsNormCase(dtype=dtype, **row) for row in rows]


def _bucket_discrete(call: RmsNormCall) -> tuple[Any, ...]:
    return (dtype_name(call.dtype), call.hidden_size, call.weight is not None, call.residual is not None,
            call.requires_grad)


def _bucket_sizes(call: RmsNormCall) -> tuple[int, ...]:
    return (call.x.numel() // call.hidden_size,)


def _describe_bucket(discrete: tuple[Any, ...], sizes: tuple[int, ...]) -> str:
    dtype, hidden, weight, residual, grad = discrete
    flags = [f for f, on in (("no-weight", not weight), ("+residual", residual), ("grad", grad)) if on]
    return f"{dtype} h{hidden}{' ' + ','.join(flags) if flags else ''} t{sizes[0]}"


RMS_NORM_TUNING = TuningSpec(
    case=RmsNormCase, presets=RMS_NORM_PRESETS, preset=rms_norm_preset, validate=validate_rms_norm,
    discrete=(BucketFeature("dtype", str), BucketFeature("hidden", int), BucketFeature("weight", bool),
              BucketFeature("residual", bool), BucketFeature("requires_grad", bool)),
    bucket_discrete=_bucket_discrete, sizes=("tokens",), bucket_sizes=_bucket_sizes,
    describe_bucket=_describe_bucket)


def rms_norm_fake_outputs(x: torch.Tensor, weight: Any, eps: Any, residual: Any, impl: Any) -> list[torch.Tensor]:
    """The outputs' shapes for torch.compile: y, and h = x + residual with a residual."""
    return [torch.empty_like(x)] + ([torch.empty_like(x)] if residual is not None else [])


RMS_NORM = register_op(OpSpec(
    name="rms_norm", impl_base=RmsNormImpl, call_features=rms_norm_features, arguments=RMS_NORM_ARGS,
    validator=validate_rms_norm, fake_outputs=rms_norm_fake_outputs, tuning=RMS_NORM_TUNING,
    expected_outputs=lambda call: [(tuple(call.x.shape), call.dtype)] * (1 if call.residual is None else 2),
    description="RMSNorm over the last dim, optional weight and fused residual add",
    features={"dtype": "dtype", "hidden_size": "int", "tokens": "int", "residual": "bool", "weight": "bool",
              "requires_grad": "bool"},
))
