"""`reference.rotary_embedding`: rotary position embedding from composite torch ops, any device, autograd."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RotaryCall, RotaryCaps, RotaryImpl

_ALL = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool,
            compute: torch.dtype) -> torch.Tensor:
    """x (..., heads, head_dim); cos/sin (..., 1, rotary_dim / 2) already gathered per token."""
    rot = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot.chunk(2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    out = out.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


class ReferenceRotary(RotaryImpl):
    vendor: ClassVar[str] = "reference"
    name: ClassVar[str] = "rotary_embedding"
    priority: ClassVar[int] = -100
    reference_fallback: ClassVar[bool] = True
    description: ClassVar[str] = "RoPE from composite torch ops in float32 (float64 for float64), autograd"
    caps: ClassVar[RotaryCaps] = RotaryCaps(dtypes=_ALL, neox=True, interleaved=True, partial=True, varlen=True,
                                            positions=True, offsets=True, gqa=True, backward=True, cos_sin_grad=True)

    def run(self, call: RotaryCall) -> Any:
        compute = call.compute_dtype
        pos = call.token_positions()
        cos = call.cos[pos].to(compute).unsqueeze(-2)  # (..tokens, 1, rotary_dim / 2)
        sin = call.sin[pos].to(compute).unsqueeze(-2)
        return (_rotate(call.q, cos, sin, call.rotary_dim, call.interleaved, compute),
                _rotate(call.k, cos, sin, call.rotary_dim, call.interleaved, compute))
