"""`iluvatar.ixformer_rms_norm`: Iluvatar ixformer's RMSNorm kernels, forward only.

ixformer is closed source; what public callers show (no Iluvatar hardware ran this code; see docs/vendors.md):

- Module: ``ixformer.inference.functions`` (vLLM's Iluvatar ``_custom_ops``, which falls back to
  ``ixformer.functions`` when it is absent; lightx2v's Iluvatar RMSNorm) or ``ixformer.functions`` (mojo_opset's
  Iluvatar norms). The adapter takes the first that has both functions, or the one the policy names.
- ``rms_norm(input, weight, eps, ...)`` returns the output: called with three positional arguments by lightx2v and
  mojo_opset (``eps=`` by keyword there); vLLM passes a fourth, an output buffer, by position. The adapter passes
  the three, by position.
- ``residual_rms_norm(input, weight, eps=, residual=, residual_alpha=, ...)``: mojo_opset takes ``(out,
  residual_out)`` from its return value; vLLM's Iluvatar ``fused_add_rms_norm`` passes ``input=, weight=,
  residual=, eps=, residual_alpha=`` and ignores the return value — vLLM's contract for that op is in place (input
  becomes the normalised output, residual the sum). So the adapter hands it private copies of x and the residual
  (never the caller's tensors), passes exactly those keywords (checked against ``inspect.signature`` when it can
  be read) with ``residual_alpha=1.0``, and takes the tuple it returns, or its two buffers when it returns None.
- dtypes fp16/bf16 (the callers' models; fp32 is not claimed). The weight is given in the model's dtype, so a
  weight of another dtype is declined; without a weight the adapter passes ones.
- Inputs are passed as contiguous (rows, hidden) tensors (lightx2v makes its input contiguous first) and the
  results given back in the caller's shape; a call with no rows is answered without a kernel.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from opdispatch import DeviceInfo, Requirement, RmsNormCall, RmsNormCaps, RmsNormImpl
from opdispatch.plugins.toolkit import unaccepted_keywords_reason

from ._attention import IluvatarIxformer, find_functions

MODULES = ("ixformer.inference.functions", "ixformer.functions")
FUNCTIONS = ("rms_norm", "residual_rms_norm")
RESIDUAL_KEYWORDS = ("input", "weight", "residual", "eps", "residual_alpha")


class IxformerRmsNormOptions(BaseModel):
    """Policy knobs of `iluvatar.ixformer_rms_norm`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: Literal["auto", "ixformer.inference.functions", "ixformer.functions"] = Field(
        default="auto", description="where to take rms_norm and residual_rms_norm from; auto tries "
                                    "ixformer.inference.functions, then ixformer.functions")


def resolve_functions(module: str) -> tuple[Any, Any, str]:
    """(rms_norm, residual_rms_norm, module name); raises ImportError naming what each candidate lacks."""
    mod, name = find_functions(MODULES if module == "auto" else (module,), FUNCTIONS)
    return mod.rms_norm, mod.residual_rms_norm, name


def private_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """A contiguous (rows, hidden) copy of `t` that shares no memory with it (one copy, whatever its strides)."""
    out = torch.empty((t.numel() // hidden, hidden), dtype=t.dtype, device=t.device)
    out.view(t.shape).copy_(t)
    return out


class IxformerRmsNorm(RmsNormImpl):
    vendor: ClassVar[str] = "iluvatar"
    name: ClassVar[str] = "ixformer_rms_norm"
    priority: ClassVar[int] = 15
    description: ClassVar[str] = ("Iluvatar ixformer RMSNorm (functions.rms_norm / residual_rms_norm), forward only, "
                                  "fused residual add")
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"iluvatar"})
    requires: ClassVar[tuple[Requirement, ...]] = IluvatarIxformer.requires
    caps: ClassVar[RmsNormCaps] = RmsNormCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16}), weight_optional=True, residual=True, backward=False,
        weight_dtype_of_x=True)
    options_model: ClassVar[type[BaseModel]] = IxformerRmsNormOptions

    def extra_availability(self, device: DeviceInfo) -> str | None:
        try:
            _, residual_fn, where = resolve_functions(self.options.module)
        except Exception as exc:
            return f"ixformer is installed but has no usable {' / '.join(FUNCTIONS)}: {exc}"
        return unaccepted_keywords_reason(residual_fn, RESIDUAL_KEYWORDS, f"{where}.residual_rms_norm")

    def run(self, call: RmsNormCall) -> Any:
        x, hidden = call.x, call.hidden_size
        if x.numel() == 0:
            y = torch.empty_like(x)
            return y if call.residual is None else (y, x + call.residual)
        rms_norm, residual_rms_norm, _ = resolve_functions(self.options.module)
        weight = (torch.ones(hidden, dtype=x.dtype, device=x.device) if call.weight is None
                  else call.weight.contiguous())
        if call.residual is None:
            return rms_norm(x.reshape(-1, hidden).contiguous(), weight, call.eps).reshape(x.shape)
        # residual_rms_norm may write its results into `input` and `residual` (vLLM relies on that): private
        # copies keep the caller's tensors intact.
        x_rows, residual_rows = private_rows(x, hidden), private_rows(call.residual, hidden)
        result = residual_rms_norm(input=x_rows, weight=weight, residual=residual_rows, eps=call.eps,
                                   residual_alpha=1.0)
        y, h = (result[0], result[1]) if isinstance(result, (tuple, list)) else (x_rows, residual_rows)
        return y.reshape(x.shape), h.reshape(x.shape)
