"""Fake `ixformer` (Iluvatar CoreX; closed source).

Only the call-site evidence is mirrored: `ixformer.contrib.vllm_flash_attn.flash_attn_varlen_func` taking the vLLM
flash-attn keywords. The positional order is vLLM's (`q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
cu_seqlens_k, ...`), which differs from Dao flash-attn's, so an adapter passing positions would be caught.
Causal is bottom-right (flash-attn convention). Returns `out`, or `(out, lse)` with return_softmax_lse.

RMSNorm, in the modules `functions` names (`ixformer.inference.functions`, `ixformer.functions`), from its public
callers: `rms_norm(input, weight, eps, <output buffer>)` returning the output (the fourth parameter's name is not
public: vLLM's Iluvatar ops pass it by position); `residual_rms_norm(input, weight, eps=, residual=,
residual_alpha=1.0, residual_bias=None, is_post=False)` writing in place as vLLM's Iluvatar `fused_add_rms_norm`
relies on (input <- rmsnorm(input + residual_alpha * residual) * weight, residual <- the sum) and returning the
pair as mojo_opset reads it (or None with `residual_returns=False`). Inputs must be contiguous.
"""

from __future__ import annotations

import types

import torch

from . import _math, _norm


def _norm_functions(calls: list, residual_returns: bool) -> dict:
    def rms_norm(input, weight, eps=1e-5, output=None):
        calls.append(("rms_norm", (input, weight), dict(eps=eps)))
        assert input.is_contiguous() and weight.dtype == input.dtype
        y = _norm.rms_norm_f32(input, weight, eps)
        return y if output is None else output.copy_(y)

    def residual_rms_norm(input, weight, eps=1e-5, residual=None, residual_alpha=1.0, residual_bias=None,
                          is_post=False):
        calls.append(("residual_rms_norm", (input, weight, residual), dict(eps=eps, residual_alpha=residual_alpha)))
        assert input.is_contiguous() and weight.dtype == input.dtype and residual_bias is None and not is_post
        if residual is None:
            return _norm.rms_norm_f32(input, weight, eps), None
        assert residual.is_contiguous() and residual.dtype == input.dtype
        h = (input.float() + residual_alpha * residual.float()).to(input.dtype)
        y = _norm.rms_norm_f32(h, weight, eps)
        input.copy_(y)
        residual.copy_(h)
        return (input, residual) if residual_returns else None

    return dict(rms_norm=rms_norm, residual_rms_norm=residual_rms_norm)


def make(calls: list, *, toplevel_only: bool = False, functions: tuple[str, ...] = (),
         residual_returns: bool = True) -> dict[str, types.ModuleType]:
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
    for name in functions:  # "ixformer.functions" / "ixformer.inference.functions"
        parent = top
        for depth, part in enumerate(name.split(".")[1:-1], start=2):
            pkg_name = ".".join(name.split(".")[:depth])
            pkg = mods.get(pkg_name) or types.ModuleType(pkg_name)
            pkg.__path__ = []
            setattr(parent, part, pkg)
            mods[pkg_name] = parent = pkg
        fmod = types.ModuleType(name)
        for attr, fn in _norm_functions(calls, residual_returns).items():
            setattr(fmod, attr, fn)
        setattr(parent, name.split(".")[-1], fmod)
        mods[name] = fmod
    return mods
