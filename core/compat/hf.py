"""Hugging Face transformers: ``attn_implementation="opdispatch"``.

``import opdispatch.compat.hf`` registers the name in transformers' ``AttentionInterface`` (and its mask
interface, with the boolean masks SDPA uses), so ``AutoModelForCausalLM.from_config(cfg,
attn_implementation="opdispatch")`` — or ``model.set_attn_implementation("opdispatch")`` — sends every attention
call of the model through ``opdispatch.attention``: prefill, decoding with the model's KV cache, padding masks,
sliding-window layers, training and ``torch.compile``. Each call runs inside ``opdispatch.scope(name)`` with the
layer's module path (``model.layers.3.self_attn``; exact after `name_modules(model)`, else derived from
``layer_idx`` as Llama-family models name it), so YAML rules on ``module:`` apply per layer.

transformers is an optional dependency: ``pip install 'opdispatch[hf]'``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from .._api import attention
from ..policies._overrides import scope

__all__ = ["NAME", "attention_forward", "name_modules", "register"]

NAME = "opdispatch"


def _module_name(module: Any) -> str | None:
    name = getattr(module, "_opdispatch_name", None)
    if name is None and getattr(module, "layer_idx", None) is not None:
        name = f"model.layers.{module.layer_idx}.self_attn"
    return name


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract: (batch, heads, seq, dim) q/k/v (k/v with the cache's keys and
    their own heads under GQA), the model's 4-D mask (boolean, True = attend) or None; returns the output as
    (batch, seq, heads, dim) and no attention weights."""
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='opdispatch' does not return attention weights "
                         "(output_attentions=True); use attn_implementation='eager' for them")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal) and attention_mask is None and q_len > 1
    if causal and kv_len > q_len:
        # A prefill into an empty static cache: the keys past q_len are unwritten slots (as transformers' sdpa
        # path, drop them rather than mask them).
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    name = _module_name(module)
    with scope(name) if name is not None else contextlib.nullcontext():
        out = attention(query, key, value, layout="bhsd", causal=causal, scale=scaling, dropout_p=dropout,
                        softcap=softcap or 0.0, attn_mask=mask, attn_bias=bias)
    return out.transpose(1, 2).contiguous(), None


def name_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Record each attention module's path in `model` (``model.layers.0.self_attn``, ``encoder.layer.3...``) for
    `opdispatch.scope`: exact names for any architecture, not only Llama-family ``layer_idx`` ones."""
    for name, sub in model.named_modules():
        if hasattr(sub, "layer_idx") or name.endswith(("self_attn", "attention", "attn")):
            sub._opdispatch_name = name
    return model


def register() -> None:
    """Register ``attn_implementation="opdispatch"`` (idempotent; done on import)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # the optional extra is missing
        raise ImportError("opdispatch.compat.hf needs Hugging Face transformers >= 5: pip install 'opdispatch[hf]' "
                          "(or: pip install 'transformers>=5')") from exc
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
