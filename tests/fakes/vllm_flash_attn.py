"""Fake `vllm.vllm_flash_attn` (vllm-project/flash-attention vllm_flash_attn/flash_attn_interface.py, commit
617264c1c7955c9e84817654ebeedff069f3c5f1): `flash_attn_varlen_func` with the published signature (an unknown
keyword is a TypeError, as for the real function), the wrapper's own checks, and the checks hopper/flash_api.cpp
`mha_fwd` makes on what opdispatch passes (RuntimeError, as TORCH_CHECK raises; the device checks are left out so
it runs on CPU), with the math in float64 torch ops and the result in q's dtype. No autograd (the fork has no
backward).

Conventions (FA3, `fa_version=3`): causal and window bottom-right per sequence, window_size (left, right) with -1
unbounded and causal setting right to 0; `s_aux` (num_heads,) bfloat16 is read as one more logit per row with no
value (out = softmax over [scores, s_aux] of the real keys' values, the LSE includes it). A row that sees no key
gets out 0 and LSE -inf, with or without s_aux: the kernel's `store_zero` writes that for a whole tile of such
rows, and this fake takes every such row to be in one (the worst case, so a caller relying on LSE = sink there is
caught). Returns out (total_q, h, dv), or (out, lse float32 (h, total_q)) with return_softmax_lse.

Install with `tests.fakes.install(monkeypatch, fake_modules())`: `vllm` and `vllm.vllm_flash_attn` (this module).
"""

from __future__ import annotations

import math
import types

import torch

calls: list[dict] = []
DEFAULT_FA_VERSION = 2


def fake_modules() -> dict[str, types.ModuleType]:
    import sys

    this = sys.modules[__name__]
    parent = types.ModuleType("vllm")
    parent.__path__ = []  # a package: `vllm.vllm_flash_attn` is found under it
    parent.vllm_flash_attn = this
    return {"vllm": parent, "vllm.vllm_flash_attn": this}


def _check(cond, message):
    if not cond:
        raise RuntimeError(message)


def _mha_fwd_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, s_aux):
    _check(q.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
           "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(t.dtype == torch.int32, f"{name} must have dtype torch.int32")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(max_seqlen_q is not None and max_seqlen_k is not None, "max_seqlen_q/k must be provided")
    batch = cu_seqlens_q.shape[0] - 1
    _check(cu_seqlens_k.shape == (batch + 1,), "batch_size must be equal to batch_size_k")
    heads, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(heads % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")
    assert d == dv, "not faked: hdim != hdim_v"
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    if s_aux is not None:
        _check(heads <= 64, "We only support query heads <= 64 with S aux")
        _check(s_aux.dtype == torch.bfloat16, "We only support bf16 dtype for S aux.")
        _check(tuple(s_aux.shape) == (heads,), f"s_aux must have shape ({heads},)")
        _check(s_aux.is_contiguous(), "s_aux must be contiguous")


def _attend(q, k, v, scale, causal, left, right, softcap, s_aux):
    """One sequence: q (sq, h, d), k/v (sk, hk, d) → out (sq, h, d) float64, lse (h, sq) float64."""
    qf, kf, vf = (t.double().transpose(0, 1) for t in (q, k, v))
    group = qf.shape[0] // kf.shape[0]
    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    rel = torch.arange(sk).view(1, -1) - torch.arange(sq).view(-1, 1) - (sk - sq)  # bottom-right
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    s = s.masked_fill(~allowed, -math.inf)
    blind = ~allowed.any(-1).view(1, sq).expand(s.shape[0], sq)
    if s_aux is not None:  # read as bf16 → float, as the kernel does
        s = torch.cat([s, s_aux.float().double().view(-1, 1, 1).expand(-1, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(blind, 0.0, lse).unsqueeze(-1))[..., :sk].masked_fill(blind.unsqueeze(-1), 0.0)
    return (p @ vf).transpose(0, 1), lse.masked_fill(blind, -math.inf)


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=0,
    fa_version=DEFAULT_FA_VERSION,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
):
    assert cu_seqlens_k is not None or seqused_k is not None, "cu_seqlens_k or seqused_k must be provided"
    assert cu_seqlens_k is None or seqused_k is None, "cu_seqlens_k and seqused_k cannot be provided at the same time"
    assert block_table is None or seqused_k is not None, "seqused_k must be provided if block_table is provided"
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    if window_size is None:
        left, right = -1, -1
    else:
        assert len(window_size) == 2
        left, right = window_size[0], window_size[1]
    if fa_version == 2:
        if s_aux is not None:
            raise NotImplementedError("FA2 does not support s_aux")
        raise AssertionError("not faked: fa_version=2")
    if fa_version != 3:
        raise ValueError(f"Unsupported FA version: {fa_version}")
    assert alibi_slopes is None, "Alibi is not supported in FA3"
    assert seqused_k is None and block_table is None and q_v is None and out is None, "not faked"
    assert scheduler_metadata is None and q_descale is None and cp_world_size == 1, "not faked"
    assert dropout_p == 0.0, "not faked: FA3 has no dropout"
    calls.append(dict(causal=causal, window_size=window_size, softcap=softcap, s_aux=s_aux,
                      return_softmax_lse=return_softmax_lse, fa_version=fa_version))
    _mha_fwd_checks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, s_aux)
    # mha_fwd: a window side as wide as the longest sequence is unbounded.
    if left >= max_seqlen_k - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        o, lse = _attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], softmax_scale, causal, left,
                         right, softcap, s_aux)
        outs.append(o)
        lses.append(lse)
    result = torch.cat(outs).to(q.dtype)
    return (result, torch.cat(lses, dim=1).float()) if return_softmax_lse else result
