"""`nvidia.flash_rotary`: flash-attn's Triton RoPE kernel (`flash_attn.layers.rotary.apply_rotary_emb`).

Signature read from flash-attn (flash_attn/layers/rotary.py, flash_attn/ops/triton/rotary.py): ``apply_rotary_emb(x,
cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None)`` with x (batch,
seqlen, nheads, headdim) or (total, nheads, headdim) with cu_seqlens; cos/sin (seqlen_rotary, rotary_dim / 2) of
x's dtype; rotary_dim <= headdim <= 256; seqlen_offsets an int or a (batch,) int tensor. An autograd Function (the
backward is the conjugate rotation). Positions past the cache read cos=1, sin=0 silently, which is why opdispatch
range-checks them. The kernel is Triton, so ROCm builds of flash-attn ship it too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from opdispatch import RotaryCall, RotaryCaps, RotaryImpl

from ._attention import FLASH_ATTN


class FlashRotary(RotaryImpl):
    vendor: ClassVar[str] = "nvidia"
    name: ClassVar[str] = "flash_rotary"
    priority: ClassVar[int] = 30
    description: ClassVar[str] = "flash-attn Triton RoPE (flash_attn.layers.rotary.apply_rotary_emb), autograd"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia", "amd"})
    requires = (FLASH_ATTN,)
    caps: ClassVar[RotaryCaps] = RotaryCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), neox=True, interleaved=True, partial=True,
        varlen=True, positions=False, offsets=True, gqa=True, backward=True, max_head_dim=256)

    def run(self, call: RotaryCall) -> Any:
        from flash_attn.layers.rotary import apply_rotary_emb

        # The kernel wants cos/sin of x's dtype; it computes in float32 either way.
        cos, sin = call.cos.to(call.dtype), call.sin.to(call.dtype)
        kwargs: dict[str, Any] = {"interleaved": call.interleaved, "seqlen_offsets": call.seqlen_offsets}
        if call.cu_seqlens is not None:
            kwargs.update(cu_seqlens=call.cu_seqlens, max_seqlen=call.max_seqlen)
        return apply_rotary_emb(call.q, cos, sin, **kwargs), apply_rotary_emb(call.k, cos, sin, **kwargs)
