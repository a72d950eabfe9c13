"""Fake of torch 2.13's `torch.nn.attention.experimental._scaled_dot_product_attention_quantized` with FA3 activated
in torch's SDPA: the published signature, torch's checks (`_validate_descale`, but for its "must be a CUDA tensor":
the contract tests run on CPU), those of torch's FA3 wrapper (torch/nn/attention/_fa3.py:
`_fa3_forward_support_error`, the output torch allocates) and of FA3's mha_fwd (hopper/flash_api.cpp) it reaches.

Computed in float64 from the dequantized inputs: each descale is (batch, num_kv_heads), query head h using kv head
h // (heads_q / heads_kv)'s factor (a missing descale is 1, as FA3 reads it); is_causal is FA3's bottom-right mask;
rows with no key give zeros; the output is bfloat16 with q's memory order (torch: empty_like(query, dtype=bf16)).
Every call is recorded in `calls`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import DescaleType

from ._fa_math import attend

_E4M3 = torch.float8_e4m3fn
calls: list[dict] = []


def _validate_descale(descale, name, query, key, descale_type):
    """torch's checks, in its order and words (its device check left out: CPU here)."""
    if descale is None:
        return
    if descale.dtype != torch.float32:
        raise ValueError(f"{name}_descale must have dtype float32, got {descale.dtype}")
    if descale_type == DescaleType.PER_HEAD:
        if descale.dim() != 2:
            raise ValueError(f"{name}_descale must be a 2D tensor with shape (batch_size, num_kv_heads) "
                             f"for PER_HEAD descaling, got {descale.dim()}D tensor")
        if descale.size(0) != query.size(0):
            raise ValueError(f"{name}_descale batch dimension must match query batch size, "
                             f"expected {query.size(0)}, got {descale.size(0)}")
        if descale.size(1) != key.size(1):
            raise ValueError(f"{name}_descale head dimension must match num_kv_heads, "
                             f"expected {key.size(1)}, got {descale.size(1)}")


def _fa3_checks(query, key, value):
    """torch's `_fa3_forward_support_error` (raised as its SDPA wrapper does) and FA3's mha_fwd checks."""
    if current_flash_attention_impl() != "FA3":
        # Without FA3, torch's own FlashAttention-2 takes the op, and it has no FP8 kernel.
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    supported = (_E4M3, torch.float16, torch.bfloat16)
    if not all(t.dtype in supported for t in (query, key, value)):
        raise RuntimeError(f"FA3 SDPA forward unsupported: inputs must be one of {supported}")
    if len({t.dtype for t in (query, key, value)}) != 1:
        raise RuntimeError("FA3 SDPA forward unsupported: all inputs must have the same dtype")
    if query.dim() != 4:
        raise RuntimeError("FA3 SDPA forward unsupported: dense query must be 4D")
    head_size, head_size_v = query.shape[-1], value.shape[-1]
    if head_size > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if query.shape[1] % key.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    alignment = 16 if query.dtype == _E4M3 else 8
    if head_size % alignment or head_size_v % alignment:
        raise RuntimeError(f"head_size should be a multiple of {alignment}")
    if head_size_v != head_size:  # torch's output is empty_like(query): (b, s_q, h, head_size) for FA3
        raise RuntimeError("out must have shape (batch_size, seqlen_q, num_heads, head_size_v)")


def current_flash_attention_impl():
    return torch.nn.attention.current_flash_attention_impl()


def _dequantized(t, descale):
    """(b, h, s, d) float64 times descale[b, h // group] (group: heads of t per descale column)."""
    if descale is None:
        return t.double()
    heads = torch.arange(t.shape[1]) // (t.shape[1] // descale.shape[1])
    return t.double() * descale.double()[:, heads].view(t.shape[0], t.shape[1], 1, 1)


def _scaled_dot_product_attention_quantized(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    q_descale_type: DescaleType = DescaleType.PER_HEAD,
    k_descale_type: DescaleType = DescaleType.PER_HEAD,
    v_descale_type: DescaleType = DescaleType.PER_HEAD,
) -> Tensor:
    _validate_descale(q_descale, "q", query, key, q_descale_type)
    _validate_descale(k_descale, "k", query, key, k_descale_type)
    _validate_descale(v_descale, "v", query, key, v_descale_type)
    _fa3_checks(query, key, value)
    calls.append(dict(query=query, key=key, value=value, is_causal=is_causal, scale=scale, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale))
    q, k, v = (_dequantized(t, d) for t, d in ((query, q_descale), (key, k_descale), (value, v_descale)))
    softmax_scale = scale if scale is not None else query.shape[-1] ** -0.5
    # FA3's mask: causal is bottom-right (window_size_right = 0 from the last query row)
    out, _ = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, is_causal, None, 0.0,
                    None, key.shape[2] - query.shape[2])
    result = torch.empty_like(query, dtype=torch.bfloat16)
    result.copy_(out.transpose(1, 2))
    return result
