"""`flagos.rotary_embedding`: FlagGems' Triton RoPE kernel (`flag_gems.apply_rotary_pos_emb`), forward only.

Signature read from flag_gems 5.0.2 (flag_gems/fused/rotary_embedding.py): ``apply_rotary_pos_emb(q, k, cos,
sin, position_ids=None, rotary_interleaved=False, inplace=False)`` with q (*, q_heads, head_dim), k (*, k_heads,
head_dim), cos/sin (max_seq_len, head_dim // 2) contiguous in the last dim, position_ids of q's leading shape (or
None for 4-d q: position = token index in its sequence). It rotates the whole head (no partial rotary), computes
in float32, is a plain function (no autograd), and checks positions only under TRITON_DEBUG. The adapter adds the
backward: a rotation's gradient is the inverse rotation, which is the same kernel with -sin.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RotaryCall, RotaryCaps, RotaryImpl

from ._attention import FLAG_GEMS


class FlagGemsRotary(RotaryImpl):
    vendor: ClassVar[str] = "flagos"
    name: ClassVar[str] = "rotary_embedding"
    priority: ClassVar[int] = 20
    description: ClassVar[str] = "FlagGems Triton RoPE (flag_gems.apply_rotary_pos_emb); backward: same kernel, -sin"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    requires = (FLAG_GEMS,)
    caps: ClassVar[RotaryCaps] = RotaryCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), neox=True, interleaved=True, partial=False,
        varlen=True, positions=True, offsets=True, gqa=True, backward=True)

    def extra_reasons(self, call: RotaryCall, device: Any) -> list[str]:
        if call.cos.stride(-1) != 1 or call.sin.stride(-1) != 1:
            return ["cos/sin must be contiguous in their last dim (flag_gems asserts it; pass .contiguous() caches)"]
        return []

    def selection_key(self, call: RotaryCall) -> Any:
        return ()  # extra_reasons reads the cos/sin strides, which are part of the call's signature

    def run(self, call: RotaryCall) -> Any:
        # Positions are passed explicitly unless they are plain token indices of a dense batch (the kernel's own
        # default), so offsets and packed sequences work too.
        offsets = call.seqlen_offsets
        plain = call.positions is None and call.cu_seqlens is None and not isinstance(offsets, torch.Tensor) \
            and offsets == 0
        positions = None if plain else call.token_positions()
        if call.requires_grad:
            return _FlagGemsRope.apply(call.q, call.k, call.cos, call.sin, positions, call.interleaved)
        return _rope(call.q, call.k, call.cos, call.sin, positions, call.interleaved)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
          interleaved: bool) -> Any:
    import flag_gems

    return flag_gems.apply_rotary_pos_emb(q, k, cos, sin, position_ids=positions, rotary_interleaved=interleaved)


class _FlagGemsRope(torch.autograd.Function):
    """FlagGems' forward with the inverse rotation as backward (cos/sin are constants: RotaryCaps.cos_sin_grad)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | None, interleaved: bool) -> Any:
        ctx.rope = (cos, sin, positions, interleaved)
        ctx.like = (q.shape, k.shape, q.dtype)
        return _rope(q, k, cos, sin, positions, interleaved)

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> Any:
        cos, sin, positions, interleaved = ctx.rope
        q_shape, k_shape, dtype = ctx.like
        # autograd hands None for an unused output, and possibly a broadcast view; the kernel wants viewable tensors
        gq = torch.zeros(q_shape, dtype=dtype, device=cos.device) if grad_q is None else grad_q.contiguous()
        gk = torch.zeros(k_shape, dtype=dtype, device=cos.device) if grad_k is None else grad_k.contiguous()
        dq, dk = _rope(gq, gk, cos, sin.neg(), positions, interleaved)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None), (dk if needs[1] else None), None, None, None, None
