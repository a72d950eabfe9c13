"""`flagos.rotary_embedding`: FlagGems' Triton RoPE kernel (`flag_gems.apply_rotary_pos_emb`), forward only.

Signature read from flag_gems 5.0.2 (flag_gems/fused/rotary_embedding.py): ``apply_rotary_pos_emb(q, k, cos,
sin, position_ids=None, rotary_interleaved=False, inplace=False)`` with q (*, q_heads, head_dim), k (*, k_heads,
head_dim), cos/sin (max_seq_len, head_dim // 2) contiguous in the last dim, position_ids of q's leading shape (or
None for 4-d q: position = token index in its sequence). It rotates the whole head (no partial rotary), computes
in float32, is a plain function (no autograd), and checks positions only under TRITON_DEBUG.
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
    description: ClassVar[str] = "FlagGems Triton RoPE (flag_gems.apply_rotary_pos_emb), forward only"
    device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_vendors: ClassVar[frozenset[str]] = frozenset({"nvidia"})
    requires = (FLAG_GEMS,)
    caps: ClassVar[RotaryCaps] = RotaryCaps(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), partial=False, backward=False)

    def extra_reasons(self, call: RotaryCall, device: Any) -> list[str]:
        if call.cos.stride(-1) != 1 or call.sin.stride(-1) != 1:
            return ["cos/sin must be contiguous in their last dim (flag_gems asserts it; pass .contiguous() caches)"]
        return []

    def selection_key(self, call: RotaryCall) -> Any:
        return ()  # extra_reasons reads the cos/sin strides, which are part of the call's signature

    def run(self, call: RotaryCall) -> Any:
        import flag_gems

        # Positions are passed explicitly unless they are plain token indices of a dense batch (the kernel's own
        # default), so offsets and packed sequences work too.
        offsets = call.seqlen_offsets
        plain = call.positions is None and call.cu_seqlens is None and not isinstance(offsets, torch.Tensor) \
            and offsets == 0
        positions = None if plain else call.token_positions()
        return flag_gems.apply_rotary_pos_emb(call.q, call.k, call.cos, call.sin, position_ids=positions,
                                              rotary_interleaved=call.interleaved)
