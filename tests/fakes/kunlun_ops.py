"""Fake `kunlun_ops` (KunLunXin; closed source).

`prefill_attention` mirrors the keyword names of its vendor caller, baidu/vLLM-Kunlun
`vllm_kunlun/v1/attention/backends/kunlun_attn.py` @ 09869ee (L849-895); it is keyword-only here because that
caller never passes positions and the positional order is not public. Semantics from that file: packed
(tokens, heads, dim) q/k/v with kv heads kept (GQA), `out` written in place, one int32 LoD given on the CPU and on
the device, scores = q·k * (1/sqrt(head_dim)) * alpha. Returns 0 (status code).
"""

from __future__ import annotations

import math
import types

import torch

from . import _math, _norm


def make(calls: list, name: str = "kunlun_ops") -> types.ModuleType:
    mod = types.ModuleType(name)

    def prefill_attention(*, q, k, v, out, is_causal=True, is_prefix_cache=False, block_table=None,
                          context_kvlen_lod_cpu=None, context_kvlen_lod_xpu=None, alpha=1.0,
                          context_qlen_lod_cpu=None, context_qlen_lod_xpu=None, alibi_slopes=None, softmax_lse=None,
                          swa_left=-1, swa_right=-1, sink=None):
        calls.append(("prefill_attention", (), dict(
            q=q, k=k, v=v, out=out, is_causal=is_causal, is_prefix_cache=is_prefix_cache, alpha=alpha,
            context_qlen_lod_cpu=context_qlen_lod_cpu, context_qlen_lod_xpu=context_qlen_lod_xpu,
            alibi_slopes=alibi_slopes, softmax_lse=softmax_lse, swa_left=swa_left, swa_right=swa_right)))
        assert context_qlen_lod_cpu.device.type == "cpu" and context_qlen_lod_cpu.dtype == torch.int32
        assert context_qlen_lod_xpu.device == q.device and context_qlen_lod_xpu.dtype == torch.int32
        assert out.shape == q.shape[:2] + (v.shape[2],)
        scale = alpha / math.sqrt(q.shape[-1])
        o, _ = _math.varlen_attention(q, k, v, context_qlen_lod_cpu, context_qlen_lod_cpu, scale=scale,
                                      causal=is_causal, window=(-1, -1), alignment="bottom_right")
        out.copy_(o)
        return 0

    # rmsnorm / add_rmsnorm as baidu/vLLM-Kunlun `vllm_kunlun/ops/layernorm.py` calls them: outputs written in
    # place; "Kunlun does not support non-contiguous input".
    def rmsnorm(x, weight, out, eps, *args):
        calls.append(("rmsnorm", (), {"eps": eps}))
        assert x.is_contiguous() and out.is_contiguous() and out.shape == x.shape
        out.copy_(_norm.rms_norm_f32(x, weight, eps))

    def add_rmsnorm(x, residual, residual_output=None, weight=None, eps=1e-6, output=None):
        calls.append(("add_rmsnorm", (), {"eps": eps}))
        assert x.is_contiguous() and residual.is_contiguous()
        h = (x.float() + residual.float()).to(x.dtype)
        residual_output.copy_(h)
        output.copy_(_norm.rms_norm_f32(h, weight, eps))

    mod.prefill_attention = prefill_attention
    mod.rmsnorm = rmsnorm
    mod.add_rmsnorm = add_rmsnorm
    return mod
