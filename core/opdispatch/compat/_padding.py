"""A padding ``attention_mask`` to packed varlen sequences and back, with flash-attn 2.8's signatures
(``flash_attn.bert_padding``): what a padded batch becomes before ``layout="thd"`` calls, and after."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pad_input", "unpad_input"]


def unpad_input(hidden_states: Tensor, attention_mask: Tensor,
                unused_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """The tokens `attention_mask` keeps, packed: ``(hidden_states[kept], indices, cu_seqlens, max_seqlen,
    seqused)``.

    `hidden_states` is (batch, seqlen, ...); `attention_mask` (batch, seqlen), nonzero/True = a real token.
    `unused_mask` (optional) marks tokens that are allocated but not used: they are kept in the packed tensor
    (and in `cu_seqlens`) but not counted in `seqused` (int32 per sequence: the used tokens). `indices` are the
    kept tokens' positions in the flattened (batch * seqlen) batch; `cu_seqlens` int32 cumulative lengths from
    0; `max_seqlen` the longest kept sequence (a host int: this reads the lengths back once). Differentiable.
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"unpad_input: attention_mask must be (batch, seqlen) = {tuple(hidden_states.shape[:2])} "
                         f"like hidden_states' first two dims, got {tuple(attention_mask.shape)}")
    kept = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqlens = kept.sum(-1, dtype=torch.int32)
    used = attention_mask.bool().sum(-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of `unpad_input`: packed (total, ...) tokens back to (batch, seqlen, ...), zeros where padded."""
    if hidden_states.shape[0] != indices.numel():
        raise ValueError(f"pad_input: {hidden_states.shape[0]} tokens but {indices.numel()} indices")
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_put((indices,), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])
