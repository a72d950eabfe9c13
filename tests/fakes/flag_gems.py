"""Fake `flag_gems` 5.0.2: `flash_attn_varlen_func` (vLLM order: max_seqlen_q before cu_seqlens_q) and
`flag_gems.ops.attention.scaled_dot_product_attention_forward` (BHSD, head dims {16,32,64,128,256}, base-2 M,
bool masks inverted as the real one does: True becomes -1e6).

`compile_keys` records, per kernel launch, what the real kernel is compiled (and tuned) for: `_attn_fwd` is
autotuned on ``key=["KV_CTX", "HEAD_DIM"]`` (KV_CTX = the key length) besides its constexprs; the varlen kernel
(`flash_varlen_fwd_kernel`) leaves seqlen_q/seqlen_k/total_q/batch unspecialized, so its key is its constexprs —
head counts, head dim, flags, the window after mha_varlan_fwd's rewrites, page size and block-table row stride."""

from __future__ import annotations

import math
import sys
import types

import torch

from ._fa_math import attend, kv_cache, varlen

__version__ = "5.0.2"
calls: list = []
compile_keys: list = []


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, s_aux=None, num_splits: int = 0, cp_world_size: int = 1,
                           cp_rank: int = 0, cp_tot_seqused_k=None, fa_version: int = 2):
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen_* must be ints"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
    assert (cu_seqlens_k is None) != (seqused_k is None)
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    assert q.stride(-1) == 1
    calls.append(("flash_attn_varlen_func", dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)))
    left, right = (-1, -1) if window_size is None else tuple(window_size)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    # 5.0.2's mha_varlan_fwd: causal is dropped for one query without ALiBi, causal sets the right bound to 0,
    # bounds >= max_seqlen_k are dropped to -1, and the window is applied only when the LEFT bound is set
    # ("is_local = window_size_left >= 0") — then both bounds literally, a right bound of -1 hiding the diagonal;
    # a right bound alone (left -1, not causal) is ignored.
    is_causal = causal and not (max_seqlen_q == 1 and alibi_slopes is None)
    if is_causal:
        right = 0
    left = -1 if left >= max_seqlen_k else left
    right = -1 if right >= max_seqlen_k else right
    is_local = left >= 0
    # Decode with GQA and no window: query groups swapped into the sequence dimension; the LSE comes back through
    # `lse.reshape(hk, b, groups).reshape(hk * groups, b)`, which scrambles heads and sequences.
    swapped = (max_seqlen_q == 1 and alibi_slopes is None and q.shape[1] > k.shape[-2] and left < 0 and right < 0
               and dropout_p == 0)

    paged = block_table is not None
    compile_keys.append(("flash_varlen_fwd_kernel", (
        ("h", k.shape[-2] if swapped else q.shape[1]), ("hk", k.shape[-2]), ("d", q.shape[-1]),
        ("is_causal", is_causal), ("is_local", is_local), ("window", (left, right)), ("swapped", swapped),
        ("is_paged", paged), ("block_size", k.shape[1] if paged else 1),
        ("page_table_batch_stride", block_table.stride(0) if paged else 0), ("softcap", softcap), ("scale", scale),
        ("is_alibi", alibi_slopes is not None), ("return_softmax_lse", return_softmax_lse))))

    def one(qi, ki, vi, i):
        sl = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        offset = ki.shape[1] - qi.shape[1]
        if is_local:
            return attend(qi, ki, vi, scale, False, (left, right), softcap, sl, offset, literal_window=True)
        return attend(qi, ki, vi, scale, is_causal, None, softcap, sl, offset)

    if block_table is not None:
        assert seqused_k is not None, "seqused_k must be provided if block_table is provided"
        assert k.dim() == 4 and k.stride() == v.stride()
        # The kernel addresses slot `page * block_size + i` with k's row stride: pages must be row-adjacent.
        assert k.stride(0) == k.shape[1] * k.stride(1), "paged pools must hold their pages' rows adjacently"
        assert block_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
        cq = cu_seqlens_q.tolist()
        outs, lses = kv_cache([q[cq[i]:cq[i + 1]] for i in range(len(cq) - 1)], k, v, seqused_k, one, block_table)
        o, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:
        assert seqused_k is None, "this fake knows seqused_k only with a block_table (all the adapter sends)"
        o, lse = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, one)
    if swapped:
        heads_k, batch = k.shape[-2], cu_seqlens_q.numel() - 1
        lse = lse.reshape(heads_k, q.shape[1] // heads_k, batch).transpose(1, 2).reshape(q.shape[1], batch)
    return (o, lse) if return_softmax_lse else o


def scaled_dot_product_attention_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
    assert query.shape[-1] == key.shape[-1] == value.shape[-1]
    assert key.shape[-1] in {16, 32, 64, 128, 256}
    assert dropout_p == 0.0, "Currenty only support dropout_p=0.0"
    assert enable_gqa or query.shape[1] == key.shape[1]
    calls.append(("scaled_dot_product_attention_forward", dict(is_causal=is_causal, enable_gqa=enable_gqa)))
    compile_keys.append(("_attn_fwd", (("KV_CTX", key.shape[2]), ("HEAD_DIM", key.shape[-1]),
                                       ("STAGE", 3 if is_causal else 1), ("HAS_ATTN_MASK", attn_mask is not None),
                                       ("GROUP_HEAD", query.shape[1] // key.shape[1]))))
    if attn_mask is not None:
        assert attn_mask.dim() == 4
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask.to(query.dtype) * -1.0e6
    sm_scale = scale if scale is not None else key.shape[-1] ** -0.5
    o, lse = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), sm_scale, is_causal, None,
                    0.0, None, 0, additive=attn_mask, log2_lse=True)
    return o.transpose(1, 2), lse


def flash_mla(q, block_table, blocked_k, max_seqlen_pad, block_size, b, s_q, cache_seqlens, h_q, h_kv, d, dv,
              causal):
    """5.0.2's flash_mla in float64: q viewed (-1, h, d) with a grid of q.shape[0] rows, the cache viewed (-1, d)
    and addressed ``page * block_size + i``, V = those rows' first dv columns (no v argument exists), scale
    1/sqrt(d), every one of cache_seqlens[b] keys seen, 0/0 for an empty sequence; rows past q.shape[0] are left
    as torch.empty leaves them (NaN here)."""
    assert causal, "causal False not supported"
    assert d > dv, "mla with rope dim should be larger than no rope dim"
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    batch_size, s_q, head_num, d = list(q.shape)
    calls.append(("flash_mla", dict(b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, dv=dv, block_size=block_size,
                                    max_seqlen_pad=max_seqlen_pad)))
    q = q.view([-1, head_num, d]).contiguous()
    rows = blocked_k.view([-1, d]).contiguous().double()
    o = torch.full([b * s_q, h_q, dv], float("nan"), dtype=torch.float64)
    for i in range(batch_size):
        n = int(cache_seqlens[i])
        pos = torch.arange(n)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        if n == 0:
            continue  # the kernel's acc / e_sum is 0 / 0: NaN, left as o's NaN fill
        kv = rows[slots]
        o[i] = torch.softmax((q[i].double() @ kv.T) / math.sqrt(d), dim=-1) @ kv[:, :dv]
    return o.to(q.dtype).view([b, s_q, h_q, dv])


def _rms(x, weight, eps):
    """RMSNorm as FlagGems' kernel computes it: float32 statistics, weight applied in float32, cast back."""
    xf = x.float()
    inv = (xf.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps) ** -0.5
    return (xf * inv * weight.float()).to(x.dtype)


def rms_norm(x, normalized_shape, weight, eps=1e-5):
    assert list(normalized_shape) == [x.shape[-1]] and weight is not None
    calls.append(("rms_norm", dict(eps=eps)))
    return _rms(x, weight, eps)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, rotary_interleaved=False, inplace=False):
    """5.0.2's asserts and arithmetic: each channel is `x * cos + x[partner] * (+-sin)` in float32 (the kernel's
    own formulation, not a pair rotation)."""
    assert k.shape[-1] == q.shape[-1] and cos.shape[-1] == sin.shape[-1]
    assert cos.shape[-1] * 2 == q.shape[-1], "cos/sin dim must be half of q/k dim"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert q.shape[:-2] == k.shape[:-2]
    if position_ids is None:
        assert q.dim() == 4, "q must have 4 dimensions if position_ids is not provided"
        pos = torch.arange(q.shape[1]).expand(q.shape[:2])
    else:
        assert position_ids.shape == q.shape[:-2]
        pos = position_ids
    assert not inplace
    calls.append(("apply_rotary_pos_emb", dict(position_ids=position_ids is not None,
                                               rotary_interleaved=rotary_interleaved)))
    d = q.shape[-1]
    j = torch.arange(d)
    if rotary_interleaved:
        partner, freq = j + 1 - 2 * (j % 2), j // 2
        sign = torch.where(j % 2 == 0, -1.0, 1.0)
    else:
        partner, freq = (j + d // 2) % d, j % (d // 2)
        sign = torch.where(j < d // 2, -1.0, 1.0)
    c = cos[pos][..., freq].float().unsqueeze(-2)
    s = sin[pos][..., freq].float().unsqueeze(-2) * sign

    def one(x):
        xf = x.float()
        return (xf * c + xf[..., partner] * s).to(x.dtype)

    return one(q), one(k)


def install(monkeypatch, vendor: str = "nvidia") -> types.ModuleType:
    """Put this fake into sys.modules as `flag_gems`, with `flag_gems.ops.attention`, as FlagGems imports under
    ``GEMS_VENDOR=vendor``: `vendor_name` set, and the top-level ``scaled_dot_product_attention_forward`` being the
    backend's (KunLunXin's returns the output only: an autograd Function's result, 5.0.2)."""
    this = sys.modules[__name__]
    ops = types.ModuleType("flag_gems.ops")
    attention = types.ModuleType("flag_gems.ops.attention")
    attention.scaled_dot_product_attention_forward = scaled_dot_product_attention_forward
    ops.attention = attention
    fake = types.ModuleType("flag_gems")
    fake.__version__ = __version__
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    fake.flash_mla = flash_mla
    fake.vendor_name = vendor
    if vendor == "kunlunxin":
        def output_only(*args, **kwargs):
            return scaled_dot_product_attention_forward(*args, **kwargs)[0]
        fake.scaled_dot_product_attention_forward = output_only
    else:
        fake.scaled_dot_product_attention_forward = scaled_dot_product_attention_forward
    fake.rms_norm = rms_norm
    fake.apply_rotary_pos_emb = apply_rotary_pos_emb
    fake.ops = ops
    monkeypatch.setitem(sys.modules, "flag_gems", fake)
    monkeypatch.setitem(sys.modules, "flag_gems.ops", ops)
    monkeypatch.setitem(sys.modules, "flag_gems.ops.attention", attention)
    this.calls.clear()
    this.compile_keys.clear()
    return fake


