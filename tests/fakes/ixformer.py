"""Fake `ixformer` (Iluvatar CoreX; closed source).

Only the call-site evidence is mirrored: `ixformer.contrib.vllm_flash_attn.flash_attn_varlen_func` taking the vLLM
flash-attn keywords. The positional order is vLLM's (`q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
cu_seqlens_k, ...`), which differs from Dao flash-attn's, so an adapter passing positions would be caught.
Causal is bottom-right (flash-attn convention). Returns `out`, or `(out, lse)` with return_softmax_lse.
"""

from __future__ import annotations

import types

import torch

from . import _math


def make(calls: list, *, toplevel_only: bool = False) -> dict[str, types.ModuleType]:
    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                               seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None):
        calls.append(("flash_attn_varlen_func", (), dict(
            q=q, k=k, v=v, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q, max_seqlen_k=max_seqlen_k,
            cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, causal=causal)))
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        o, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                                        window=(-1, -1), alignment="bottom_right")
        return (o, lse) if return_softmax_lse else o

    top = types.ModuleType("ixformer")
    top.__path__ = []  # a package
    top.flash_attn_varlen_func = flash_attn_varlen_func
    mods = {"ixformer": top}
    if not toplevel_only:
        contrib = types.ModuleType("ixformer.contrib")
        contrib.__path__ = []
        vfa = types.ModuleType("ixformer.contrib.vllm_flash_attn")
        vfa.flash_attn_varlen_func = flash_attn_varlen_func
        contrib.vllm_flash_attn = vfa
        top.contrib = contrib
        mods.update({"ixformer.contrib": contrib, "ixformer.contrib.vllm_flash_attn": vfa})
    return mods
