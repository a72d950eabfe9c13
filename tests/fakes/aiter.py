"""Fake `aiter` (ROCm/aiter HEAD e4048607, `aiter/ops/mha.py`).

Signatures copied from `flash_attn_func` (L2654) and `flash_attn_varlen_func` (L3446). Return assembly
(FlashAttnFunc.forward): `result = [out]; + lse if return_lse; + S_dmask if return_attn_probs`, returned as `out`
alone or a tuple. Bottom-right causal/window; lse (b, h, sq) dense, (h, total_q) varlen; softcap only on varlen
(`logits_soft_cap`); the autograd functions `assert return_lse` when a backward will run.

`sink_ptr` (nhead_q,), converted to float32 (`_flash_attn_forward` asserts its device and shape): one more logit
per row in the scaled scores' units, without a value, the LSE including it (aiter/test_mha_common.py
`attention_ref(sink=)`). Forward only: FlashAttnFunc/FlashAttnVarlenFunc.backward return None for it (their
`_flash_attn_*backward(..., sink=None, d_sink=None)`), so the fake detaches it. And, as the real dispatch does, the
sink is dropped where gfx942/gfx950's ASM "fmha v3" forward takes the call (`can_impl_fmha_v3_fwd` does not look
at sink_ptr, `fmha_v3_fwd`/`fmha_v3_varlen_fwd` have no sink argument): bf16, (d, dv) (128, 128) or (192, 128), no
sliding window, alibi or dropout; dense with seqlen_q > 128, varlen without softcap.

`flash_attn_fp8_pertensor_func(q, k, v, q_descale, k_descale, v_descale, causal=False, window_size=(-1, -1, 0),
softmax_scale=None)` (L3974; HEAD also has a trailing `sink_ptr=None`, which opdispatch never passes): bshd FP8
q/k/v, head dims padded to a multiple of 8 and the output cut back, no LSE. Its checks (mha_fwd_kernels.cu,
`_flash_attn_forward`): q/k/v one dtype, float8_e4m3fn or float8_e4m3fnuz ("FlashAttention only support fp16, bf16
and fp8_e4m3 data type"; which one a build reads is its arch's `dtypes.fp8`: fnuz on gfx942, fn on gfx950); the three
descales all given ("q_descale, k_descale, v_descale must be all provided or all not provided"), per tensor ("only
support per-tensor quantization for now": float32 of shape (1,), as the `# [1]` of the C++ signature); the output
bfloat16 ("only support bf16 out for fp8"). Computed in float64 from the dequantized inputs.
"""

from __future__ import annotations

import types

import torch

from . import _fa_math, _math, _norm

__version__ = "0.1.9"
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


def _assemble(out, lse, return_lse, return_attn_probs):
    result = [out]
    if return_lse:
        result.append(_math.fa2_lse(lse))
    if return_attn_probs:
        result.append(torch.empty(0))
    return result[0] if len(result) == 1 else tuple(result)


def _sink(sink_ptr, q, nhead_q):
    if sink_ptr is None:
        return None
    assert sink_ptr.device == q.device, "sink_ptr must be on the same device as q"
    assert sink_ptr.shape[0] == nhead_q, "sink_ptr has incorrect shape"
    return sink_ptr.detach().to(torch.float32)  # no gradient: aiter's backward returns None for sink_ptr


def _v3_asm_drops_sink(q, v, window_size, seqlen_k, alibi_slopes, dropout_p):
    """Whether aiter's dispatch runs the gfx942/gfx950 ASM v3 forward, which has no sink (see the docstring)."""
    left, right = (-1 if w >= seqlen_k else w for w in window_size[:2])
    return (q.dtype == torch.bfloat16 and (q.shape[-1], v.shape[-1]) in ((128, 128), (192, 128))
            and not (left > 0 or right > 0) and alibi_slopes is None and dropout_p == 0.0)


def make(calls: list) -> types.ModuleType:
    mod = types.ModuleType("aiter")
    mod.__version__ = __version__

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1, 0),
                        bias=None, alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False,
                        how_v3_bf16_cvt=1, cu_seqlens_q=None, cu_seqlens_kv=None, sink_ptr=None, num_splits=0):
        calls.append(("flash_attn_func", (q, k, v), dict(
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, bias=bias,
            alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=return_lse,
            return_attn_probs=return_attn_probs, how_v3_bf16_cvt=how_v3_bf16_cvt, sink_ptr=sink_ptr)))
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            assert return_lse
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        sink = _sink(sink_ptr, q, q.shape[2])
        if q.shape[1] > 128 and _v3_asm_drops_sink(q, v, window_size, k.shape[1], alibi_slopes, dropout_p):
            sink = None
        out, lse = _math.bshd_attention(q, k, v, scale=scale, causal=causal, window=tuple(window_size[:2]),
                                        alignment="bottom_right", alibi=alibi_slopes, sink=sink)
        return _assemble(out, lse, return_lse, return_attn_probs)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                               dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                               return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                               out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None):
        calls.append(("flash_attn_varlen_func", (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                      dict(min_seqlen_q=min_seqlen_q, dropout_p=dropout_p, softmax_scale=softmax_scale,
                           logits_soft_cap=logits_soft_cap, causal=causal, window_size=window_size,
                           alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=return_lse,
                           return_attn_probs=return_attn_probs, how_v3_bf16_cvt=how_v3_bf16_cvt,
                           sink_ptr=sink_ptr)))
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        sink = _sink(sink_ptr, q, q.shape[1])
        if logits_soft_cap == 0.0 and _v3_asm_drops_sink(q, v, window_size, max_seqlen_k, alibi_slopes, dropout_p):
            sink = None
        if block_table is not None:  # flash-attn's paged convention: page pools, cu_seqlens_k = the keys' offsets
            assert block_table.dtype == torch.int32 and k.dim() == 4 and v.dim() == 4
            assert not return_attn_probs and dropout_p == 0.0
            lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            k = torch.cat([_fa_math.sequence_keys(k, i, n, block_table) for i, n in enumerate(lengths)])
            v = torch.cat([_fa_math.sequence_keys(v, i, n, block_table) for i, n in enumerate(lengths)])
        o, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                                        window=tuple(window_size[:2]), alignment="bottom_right",
                                        softcap=logits_soft_cap, alibi=alibi_slopes, sink=sink)
        return _assemble(o, lse, return_lse, return_attn_probs)

    def flash_attn_fp8_pertensor_func(q, k, v, q_descale, k_descale, v_descale, causal=False,
                                      window_size=(-1, -1, 0), softmax_scale=None, sink_ptr=None):
        calls.append(("flash_attn_fp8_pertensor_func", (q, k, v), dict(
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal, window_size=window_size,
            softmax_scale=softmax_scale, sink_ptr=sink_ptr)))
        if q.dtype not in _FP8 or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError("FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
        descales = (q_descale, k_descale, v_descale)
        if any(d is None for d in descales):
            raise RuntimeError("q_descale, k_descale, v_descale must be all provided or all not provided")
        for d in descales:
            if tuple(d.shape) != (1,) or d.dtype != torch.float32 or d.device != q.device:
                raise RuntimeError(f"only support per-tensor quantization: descale float32 (1,) on q's device, "
                                   f"got {tuple(d.shape)} {d.dtype} {d.device}")
        assert sink_ptr is None, "opdispatch passes no sink_ptr to the FP8 entry"
        assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[2] % k.shape[2] == 0
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        dv = v.shape[-1]
        q, k, v = (t.double() * d.double() for t, d in zip((q, k, v), descales))
        if q.shape[-1] % 8:  # the wrapper's padding: zero columns change no score
            pad = 8 - q.shape[-1] % 8
            q, k = (torch.nn.functional.pad(t, [0, pad]) for t in (q, k))
        if dv % 8:
            v = torch.nn.functional.pad(v, [0, 8 - dv % 8])
        out, _ = _math.bshd_attention(q, k, v, scale=scale, causal=causal, window=tuple(window_size[:2]),
                                      alignment="bottom_right")
        return out[..., :dv].to(torch.bfloat16)

    # aiter/ops/rmsnorm.py (HEAD 0bc300f): fp16/bf16/fp32, weight of the input's dtype, contiguous buffers.
    def _check(input, weight):
        assert input.dtype in (torch.float16, torch.bfloat16, torch.float32), input.dtype
        assert weight.dtype == input.dtype, "rms_norm_opus: weight dtype must match input"
        assert input.is_contiguous(), "aiter 0.1.9 reads rows as contiguous"
        assert weight.is_contiguous() and weight.shape[-1] == input.shape[-1]

    def rms_norm(input, weight, epsilon, use_model_sensitive_rmsnorm=0):
        calls.append(("rms_norm", {"epsilon": epsilon}))
        _check(input, weight)
        return _norm.rms_norm_f32(input, weight, epsilon)

    def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon, gemma_norm=False,
                               use_model_sensitive_rmsnorm=0):
        calls.append(("rmsnorm2d_fwd_with_add", {"epsilon": epsilon}))
        _check(input, weight)
        assert out.is_contiguous() and residual_in.is_contiguous() and residual_out.is_contiguous()
        h = (input.float() + residual_in.float()).to(input.dtype)
        residual_out.copy_(h)
        out.copy_(_norm.rms_norm_f32(h, weight, epsilon))

    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.flash_attn_fp8_pertensor_func = flash_attn_fp8_pertensor_func
    mod.rms_norm = rms_norm
    mod.rmsnorm2d_fwd_with_add = rmsnorm2d_fwd_with_add
    return mod
