"""Hugging Face transformers: ``attn_implementation="opdispatch"``.

``import opdispatch.compat.hf`` registers the name in transformers' ``AttentionInterface`` (and its mask
interface, with the boolean masks SDPA uses), so ``AutoModelForCausalLM.from_config(cfg,
attn_implementation="opdispatch")`` — or ``model.set_attn_implementation("opdispatch")`` — sends every attention
call of the model through ``opdispatch.attention``: prefill, decoding with the model's KV cache, padding masks,
sliding-window layers, training and ``torch.compile``. Where the policy has a rule on ``module:``
(`Policy.reads_module`), each call runs inside ``opdispatch.scope(name)`` with the layer's module path
(``model.layers.3.self_attn``, ``encoder.block.0.layer.0.SelfAttention``, ``decoder.block.0.layer.1.EncDecAttention``):
on the first eager call of a model's attention every attention module of the model is named by its real path
(`name_modules`); a model compiled before it ever ran, and not named, falls back to
``model.layers.<layer_idx>.self_attn``. YAML rules on ``module:`` apply per layer. Without such a rule a call
with nothing else to honour goes to the door unscoped (no scope can change its decision).

Fails closed: a keyword argument the model passes to its attention function is honoured — ``s_aux``/``sinks``
(GPT-OSS's learned sinks) as ``sinks=``, ``position_bias`` (T5's relative bias) as ``attn_bias`` with the mask
folded in as transformers' sdpa path does, ``cu_seq_lens_*`` as packed varlen — or, unless it cannot change the
result given the mask (``sliding_window``, ``position_ids``, … listed in ``_NO_EFFECT_GIVEN_THE_MASK``), refused
with a ValueError naming the module and the argument.

transformers is an optional dependency: ``pip install 'opdispatch[hf]'``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import Tensor

from ..doors import _api
from ..doors._api import attention
from opdispatch.policies._overrides import MODULE, scope

__all__ = ["NAME", "attention_forward", "name_modules", "register"]

NAME = "opdispatch"
_is_compiling = torch.compiler.is_compiling


# Keyword arguments transformers' models pass (explicitly, or through their **kwargs: TransformersKwargs,
# FlashAttentionKwargs) that do not change the attention given the mask this module's mask interface built:
_NO_EFFECT_GIVEN_THE_MASK = frozenset({
    "sliding_window",  # the registered mask interface (sdpa_mask) builds the window into attention_mask
    "position_ids",  # positions are in q/k already (rotary runs before attention); packed sequences are in the mask
    "cache_position",  # where this step sits in the cache: already in the mask and in the cache's k/v
    "output_hidden_states", "output_router_logits", "use_cache", "return_dict",  # what the model returns
    "num_items_in_batch",  # the loss's normalisation, not attention's
})
# Packed varlen (flash-attn's kwargs): honoured as layout 'thd' when no mask encodes the packing.
_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _module_name(module: Any) -> str | None:
    name = getattr(module, "_opdispatch_name", None)
    if name is None and not _is_compiling():
        _name_on_first_sight(module)
        name = getattr(module, "_opdispatch_name", None)
    if name is None and getattr(module, "layer_idx", None) is not None:
        # torch.compile of a model never run nor named (or a module run outside any model). Eager: interned, since
        # the compiled door keys the scope by identity (a new string per call would be a new signature per call)
        name = f"model.layers.{module.layer_idx}.self_attn"
        if not _is_compiling():
            name = sys.intern(name)
    return name


def _name_on_first_sight(module: torch.nn.Module) -> None:
    """Name every attention module of the model `module` belongs to, the first time one of them is called: the
    outermost module on the call stack holding `module` is the model; `name_modules` gives each of its attention
    modules its real path (encoder, decoder and cross-attention apart). Eager only (Dynamo cannot read frames)."""
    frame = sys._getframe(2)
    root = None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and owner is not module and any(m is module for m in owner.modules()):
            root = owner  # keep walking: the outermost holder names the full path
        frame = frame.f_back  # type: ignore[assignment]
    if root is not None:
        name_modules(root)
        if getattr(module, "_opdispatch_name", None) is None:  # a path name_modules does not recognise (BERT's
            # `...attention.self`): this module's own path, so the walk happens once, not on every call
            module._opdispatch_name = next(n for n, m in root.named_modules() if m is module)


def _refuse(module: torch.nn.Module, argument: str, value: Any, why: str) -> ValueError:
    where = getattr(module, "_opdispatch_name", None) or type(module).__name__
    shown = (f"<{value.dtype} tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor)
             else f"{value!r:.60}")
    return ValueError(f"attn_implementation='opdispatch' ({where}): keyword argument {argument}={shown} "
                      f"{why}; use attn_implementation='eager' (or 'sdpa') for this model")


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract: (batch, heads, seq, dim) q/k/v (k/v with the cache's keys and
    their own heads under GQA), the model's 4-D mask (boolean, True = attend) or None; returns the output as
    (batch, seq, heads, dim) and no attention weights.

    Fails closed: every keyword argument that is not None is honoured (`s_aux`/`sinks` as attention sinks,
    `position_bias` as an additive bias with the mask folded in as transformers' sdpa path does, `cu_seq_lens_*`
    as packed varlen, `deterministic`) or is one that cannot change the result given the mask (an explicit
    allow-list), else a ValueError names the module and the argument."""
    manager = _api._manager
    if (not _is_compiling() and manager is not None and kwargs.keys() <= _NO_EFFECT_GIVEN_THE_MASK
            and not manager.policy.reads_module):
        # The common call (a causal LM's prefill or decode step): nothing to honour but q/k/v, the mask, the
        # scale, dropout and softcap, and no policy rule on `module:`, so no scope (a scope per layer would also
        # make each layer a signature of its own in the compiled door: +2.4 µs per call inside generate() on CPU).
        key, value, causal, mask, bias = _read_mask(module, query, key, value, attention_mask, is_causal)
        if mask is None and bias is None and not dropout and not softcap:  # the fewest arguments: the cheapest call
            out = attention(query, key, value, layout="bhsd", causal=causal, scale=scaling)
        else:
            out = attention(query, key, value, layout="bhsd", causal=causal, scale=scaling, dropout_p=dropout,
                            softcap=softcap or 0.0, attn_mask=mask, attn_bias=bias)
        return out.transpose(1, 2).contiguous(), None
    name = _module_name(module)
    sinks = position_bias = None
    varlen: dict[str, Any] = {}
    deterministic = False
    for argument, given in kwargs.items():
        if given is None or argument in _NO_EFFECT_GIVEN_THE_MASK:
            continue
        if argument == "output_attentions":
            if given:
                raise ValueError("attn_implementation='opdispatch' does not return attention weights "
                                 "(output_attentions=True); use attn_implementation='eager' for them")
        elif argument in ("s_aux", "sinks"):
            if sinks is not None:
                raise _refuse(module, argument, given, "repeats the sinks given as s_aux")
            sinks = given
        elif argument == "position_bias":
            position_bias = given
        elif argument in _VARLEN:
            varlen[argument] = given
        elif argument == "deterministic":
            deterministic = bool(given)
        else:
            raise _refuse(module, argument, given, "is not understood by opdispatch (it would be dropped, "
                                                   "changing the result silently)")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    key, value, causal, mask, bias = _read_mask(module, query, key, value, attention_mask, is_causal)
    if position_bias is not None:
        position_bias = position_bias[..., :key.shape[2]]  # (a static cache's unwritten slots go with their keys)
        bias, mask, causal = _fold_position_bias(position_bias, mask, bias, causal, query, key)
    if sinks is not None:
        sinks = sinks.float()  # one logit per head, in the model's dtype: the op takes float32 (grad flows)
    if name and type(name) is str and not varlen and not _is_compiling():
        # `scope(name)` without its generator frames (a decode step's host cost is what this path is about)
        token = MODULE.set(name)
        try:
            out = attention(query, key, value, layout="bhsd", causal=causal, scale=scaling, dropout_p=dropout,
                            softcap=softcap or 0.0, attn_mask=mask, attn_bias=bias, sinks=sinks,
                            deterministic=deterministic)
        finally:
            MODULE.reset(token)
        return out.transpose(1, 2).contiguous(), None
    scoped = scope(name) if name is not None else contextlib.nullcontext()
    if varlen and attention_mask is None:
        with scoped:
            return _packed(module, query, key, value, varlen, causal=bool(is_causal), scale=scaling,
                           dropout_p=dropout, softcap=softcap or 0.0, sinks=sinks, attn_bias=bias,
                           deterministic=deterministic), None
    # With a mask, the packing of cu_seq_lens_* is in it (transformers' mask interface builds it per sequence).
    with scoped:
        out = attention(query, key, value, layout="bhsd", causal=causal, scale=scaling, dropout_p=dropout,
                        softcap=softcap or 0.0, attn_mask=mask, attn_bias=bias, sinks=sinks,
                        deterministic=deterministic)
    return out.transpose(1, 2).contiguous(), None


def _read_mask(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               is_causal: bool | None) -> tuple[Tensor, Tensor, bool, Tensor | None, Tensor | None]:
    """(key, value, causal, attn_mask, attn_bias) as transformers' sdpa path reads the call: causal only without a
    mask and for more than one query (a mask holds the pattern itself); a prefill into an empty static cache drops
    the keys past q_len (unwritten slots) rather than masking them; a boolean mask is attn_mask, a float one
    attn_bias."""
    q_len = query.shape[2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal) \
        and attention_mask is None and q_len > 1
    if causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if attention_mask is None:
        return key, value, causal, None, None
    if attention_mask.dtype == torch.bool:
        return key, value, causal, attention_mask, None
    return key, value, causal, None, attention_mask


def _fold_position_bias(position_bias: Tensor, mask: Tensor | None, bias: Tensor | None, causal: bool,
                        query: Tensor, key: Tensor) -> tuple[Tensor, None, bool]:
    """(attn_bias, attn_mask, causal) with a relative-position bias (T5's) and the mask folded into one additive
    bias exactly as transformers' sdpa path does (`create_position_bias_mask`): a boolean mask and the causal
    pattern as the key dtype's lowest finite value — not -inf — so a row that sees no key averages its values as
    eager attention does; a float mask added. Gradients reach the bias (torch.where/+ are differentiable)."""
    lowest = torch.finfo(key.dtype).min
    if mask is not None:
        return torch.where(mask, position_bias, lowest).contiguous(), None, False
    if bias is not None:
        return (position_bias + bias).contiguous(), None, False
    if causal:
        q_len, kv_len = query.shape[2], key.shape[2]
        rows = torch.arange(q_len, device=key.device)[:, None] >= torch.arange(kv_len, device=key.device)[None, :]
        return torch.where(rows.view(1, 1, q_len, kv_len), position_bias, lowest).contiguous(), None, False
    return position_bias, None, False


def _packed(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, varlen: dict[str, Any],
            **options: Any) -> Tensor:
    """Packed sequences without a mask (flash-attn's kwargs): batch 1, cu_seq_lens_q/k cut it; layout 'thd'."""
    missing = [n for n in ("cu_seq_lens_q", "cu_seq_lens_k") if n not in varlen]
    if missing or query.shape[0] != 1:
        raise _refuse(module, ", ".join(sorted(varlen)), tuple(varlen.values()),
                      "describes packed sequences opdispatch cannot honour here: it needs both cu_seq_lens_q and "
                      f"cu_seq_lens_k (missing: {missing or 'none'}) over a batch of 1 (got {query.shape[0]})")
    if options.get("attn_bias") is not None:
        raise _refuse(module, "position_bias", "<tensor>", "is not taken with packed sequences (cu_seq_lens_*)")
    options.pop("attn_bias")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (1, h, t, d) -> (t, h, d)
    out = attention(q, k, v, layout="thd", cu_seqlens_q=varlen["cu_seq_lens_q"].to(torch.int32),
                    cu_seqlens_k=varlen["cu_seq_lens_k"].to(torch.int32), max_seqlen_q=_int(varlen.get("max_length_q")),
                    max_seqlen_k=_int(varlen.get("max_length_k")), **options)
    return out.unsqueeze(0)  # type: ignore[no-any-return]  # (t, h, d) -> (1, t, h, d)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def name_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Record each attention module's path in `model` (``model.layers.0.self_attn``,
    ``encoder.block.0.layer.0.SelfAttention``, ``decoder.block.0.layer.1.EncDecAttention``) for
    `opdispatch.scope`: exact names for any architecture. Done automatically the first time a model's attention
    runs eagerly (the outermost module on the call stack holding it is taken as the model); call it yourself
    before compiling a model that never ran eagerly, or to name a submodule tree from another root."""
    for name, sub in model.named_modules():
        if hasattr(sub, "layer_idx") or name.endswith(("self_attn", "attention", "attn", "Attention")):
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
