"""opdispatch.compat.te.DotProductAttention against an independent float64 oracle written from TransformerEngine's
unfused semantics (utils.get_full_mask / get_alibi, backends.UnfusedDotProductAttention): explicit scores, mask,
window, bias, ALiBi and sinks as an extra logit column, per sequence; forward and backward."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.compat.te import DotProductAttention, default_alibi_slopes, te_switches

HEADS, DIM, DIM_V = 4, 8, 6
ATOL = 3e-5


def _flat(t, fmt):
    """TE-format tensor -> (tokens, heads, dim) rows (dense: batch-major)."""
    if fmt == "sbhd":
        return t.transpose(0, 1).reshape(-1, *t.shape[2:])
    if fmt == "bshd":
        return t.reshape(-1, *t.shape[2:])
    return t


def oracle(q, k, v, fmt, seqs, *, causal, bottom_right, window, scale, sinks=None, bias=None, alibi=None,
           keep=None, out_shape):
    """float64: for each sequence (batch index, its query rows, its key rows): scores, TE's pattern, softmax with
    the sink logit as an extra column; zeros for unused rows; TE's output shape."""
    fq, fk, fv = _flat(q, fmt), _flat(k, fmt), _flat(v, fmt)
    h, hk = fq.shape[1], fk.shape[1]
    out = fq.new_zeros(fq.shape[0], h, fv.shape[-1])
    for b, rq, rk in seqs:
        qi = fq[rq].transpose(0, 1)
        ki = fk[rk].repeat_interleave(h // hk, dim=1).transpose(0, 1)
        vi = fv[rk].repeat_interleave(h // hk, dim=1).transpose(0, 1)
        sq, sk = len(rq), len(rk)
        s = scale * qi @ ki.transpose(-1, -2)
        off = sk - sq if bottom_right else 0
        rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - off
        allowed = torch.ones(h, sq, sk, dtype=torch.bool)
        if causal:
            allowed &= rel <= 0
        if window is not None:
            left, right = window
            if left >= 0:
                allowed &= rel >= -left
            if right >= 0:
                allowed &= rel <= right
        if keep is not None:  # arbitrary: TE's mask is True = masked out
            allowed &= ~keep[b if keep.shape[0] > 1 else 0]
        if bias is not None:
            s = s + bias[b if bias.shape[0] > 1 else 0]
        if alibi is not None:
            slopes = alibi[b] if alibi.dim() == 2 else alibi
            s = s - slopes.double().view(h, 1, 1) * rel.abs()
        keyless = ~allowed.any(-1, keepdim=True)
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(keyless, 0.0)
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(h, 1, 1).expand(h, sq, 1)], -1)
        p = torch.softmax(s, -1)
        if sinks is not None:
            p = p[..., :-1]
        o = (p.masked_fill(keyless, 0.0) @ vi).transpose(0, 1)
        out = out.index_put((torch.as_tensor(rq),), o)
    out = out.reshape(out.shape[0], -1)
    if fmt == "thd":
        return out
    batch, s_q = out_shape
    out = out.reshape(batch, s_q, -1)
    return out.transpose(0, 1) if fmt == "sbhd" else out


def _dense(batch, s, h, d, fmt, gen):
    shape = (s, batch, h, d) if fmt == "sbhd" else (batch, s, h, d)
    return torch.randn(shape, generator=gen)


def _case(fmt, mask_type, heads_kv, cross, windowed, softmax_type, seed):
    """Random inputs for one case: (module kwargs, forward kwargs, tensors, oracle kwargs)."""
    gen = torch.Generator().manual_seed(seed)
    batch = 3
    sq, skv = (5, 7) if cross else (6, 6)
    padding, causal = "padding" in mask_type, "causal" in mask_type
    window = None
    if windowed:
        window = (2, 0) if causal else (2, 1)
    bottom_right = mask_type not in ("causal", "padding_causal")
    fwd: dict = {}
    if fmt == "thd":
        lq = torch.randint(1, sq + 1, (batch,), generator=gen)
        lk = torch.randint(1, skv + 1, (batch,), generator=gen) if cross else lq
        lq[0] = sq
        cu_q = torch.nn.functional.pad(lq.cumsum(0), (1, 0)).to(torch.int32)
        cu_k = torch.nn.functional.pad(lk.cumsum(0), (1, 0)).to(torch.int32) if cross else cu_q
        q = torch.randn(int(cu_q[-1]), HEADS, DIM, generator=gen)
        k = torch.randn(int(cu_k[-1]), heads_kv, DIM, generator=gen)
        v = torch.randn(int(cu_k[-1]), heads_kv, DIM_V, generator=gen)
        fwd.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=sq, max_seqlen_kv=skv)
        seqs = [(i, list(range(cu_q[i], cu_q[i + 1])), list(range(cu_k[i], cu_k[i + 1]))) for i in range(batch)]
    else:
        q = _dense(batch, sq, HEADS, DIM, fmt, gen)
        k = _dense(batch, skv, heads_kv, DIM, fmt, gen)
        v = _dense(batch, skv, heads_kv, DIM_V, fmt, gen)
        lq, lk = [sq] * batch, [skv] * batch
        if padding:  # right padding, one full sequence
            lq = [sq] + torch.randint(1, sq + 1, (batch - 1,), generator=gen).tolist()
            lk = [skv] + torch.randint(1, skv + 1, (batch - 1,), generator=gen).tolist() if cross else lq
            mq = torch.arange(sq)[None, :] >= torch.tensor(lq)[:, None]
            mk = torch.arange(skv)[None, :] >= torch.tensor(lk)[:, None]
            fwd["attention_mask"] = ((mq.view(batch, 1, 1, sq), mk.view(batch, 1, 1, skv)) if cross
                                     else mq.view(batch, 1, 1, sq))
        seqs = [(i, [i * sq + j for j in range(lq[i])], [i * skv + j for j in range(lk[i])]) for i in range(batch)]
    keep = None
    if mask_type == "arbitrary":
        keep = torch.rand(batch, 1, sq, skv, generator=gen) < 0.3  # True = masked out (TE)
        fwd["attention_mask"] = keep
    module = dict(num_attention_heads=HEADS, kv_channels=(DIM, DIM_V), num_gqa_groups=heads_kv, qkv_format=fmt,
                  attn_mask_type=mask_type, window_size=window, attention_type="cross" if cross else "self",
                  softmax_type=softmax_type)
    ref = dict(seqs=seqs, causal=causal, bottom_right=bottom_right, window=window, scale=DIM ** -0.5, keep=keep,
               out_shape=(batch, sq))
    return module, fwd, (q, k, v), ref


def _check(module_kwargs, fwd, tensors, ref, *, extra_grads=()):
    m = DotProductAttention(**module_kwargs)
    if m.softmax_type == "learnable":
        with torch.no_grad():
            m.softmax_offset.copy_(torch.linspace(-1.0, 1.5, HEADS))
    q, k, v = (t.clone().requires_grad_() for t in tensors)
    out = m(q, k, v, **fwd)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks = None
    if m.softmax_offset is not None:
        sinks = m.softmax_offset.detach().double().requires_grad_(m.softmax_type == "learnable")
    expected = oracle(q64, k64, v64, module_kwargs["qkv_format"], sinks=sinks, **ref)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=1e-4)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    params = [q, k, v] + ([m.softmax_offset] if m.softmax_type == "learnable" else []) + list(extra_grads[0::2])
    refs = [q64, k64, v64] + ([sinks] if m.softmax_type == "learnable" else []) + list(extra_grads[1::2])
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(expected, refs, grad.double())
    for name, g, w in zip(("q", "k", "v", "softmax_offset", "bias"), got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4, msg=lambda s, n=name: f"grad {n}: {s}")
    return m


DENSE_MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
               "padding_causal_bottom_right", "arbitrary")
PADDED_MASKS = ("padding", "padding_causal", "padding_causal_bottom_right")
CASES = [(fmt, mask) for fmt in ("sbhd", "bshd") for mask in DENSE_MASKS] + [("thd", m) for m in PADDED_MASKS]


@pytest.mark.parametrize("heads_kv", [HEADS, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("fmt,mask_type", CASES)
def test_every_mask_and_format_against_the_oracle(fmt, mask_type, heads_kv, cross):
    # The window and the softmax type rotate over the matrix so every pairing appears without multiplying it.
    index = CASES.index((fmt, mask_type)) * 4 + 2 * cross + (heads_kv == 1)
    softmax_type = ("vanilla", "off-by-one", "learnable")[index % 3]
    module, fwd, tensors, ref = _case(fmt, mask_type, heads_kv, cross, index % 2 == 0, softmax_type, seed=index)
    _check(module, fwd, tensors, ref)


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
@pytest.mark.parametrize("fmt,mask_type", [("bshd", "causal_bottom_right"), ("thd", "padding_causal"),
                                           ("sbhd", "padding")])
def test_softmax_types(fmt, mask_type, softmax_type):
    module, fwd, tensors, ref = _case(fmt, mask_type, 2, True, False, softmax_type, seed=11)
    m = _check(module, fwd, tensors, ref)
    assert (m.softmax_type == "learnable") == any(n == "softmax_offset" for n, _ in m.named_parameters())
    assert tuple(m.softmax_offset.shape) == (HEADS,) if m.softmax_offset is not None else True


@pytest.mark.parametrize("bias_type,shape", [("post_scale_bias", (1, HEADS, 5, 7)), ("pre_scale_bias", (3, 1, 5, 7)),
                                             ("post_scale_bias", (1, 1, 1, 7))])
@pytest.mark.parametrize("fmt,mask_type", [("bshd", "causal_bottom_right"), ("sbhd", "arbitrary"),
                                           ("sbhd", "no_mask")])
def test_bias_types(fmt, mask_type, bias_type, shape):
    module, fwd, tensors, ref = _case(fmt, mask_type, 2, True, mask_type == "no_mask", "learnable", seed=3)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(5)).requires_grad_()
    bias64 = bias.detach().double().requires_grad_()
    # TE's unfused path: pre_scale_bias enters as (QK^T + bias) * scale
    ref_bias = bias64 * ref["scale"] if bias_type == "pre_scale_bias" else bias64
    _check(module, {**fwd, "core_attention_bias_type": bias_type, "core_attention_bias": bias}, tensors,
           {**ref, "bias": ref_bias.expand(shape[0], HEADS, 5, 7)}, extra_grads=(bias, bias64))


@pytest.mark.parametrize("slopes", ["default", "given", "per_batch"])
@pytest.mark.parametrize("fmt,mask_type", [("bshd", "causal"), ("sbhd", "no_mask"), ("thd", "padding_causal_bottom_right"),
                                           ("bshd", "padding")])
def test_alibi(fmt, mask_type, slopes):
    module, fwd, tensors, ref = _case(fmt, mask_type, 2, True, False, "vanilla", seed=4)
    given = {"default": None, "given": torch.rand(HEADS) + 0.1, "per_batch": torch.rand(3, HEADS) + 0.1}[slopes]
    fwd = {**fwd, "core_attention_bias_type": "alibi", "alibi_slopes": given}
    _check(module, fwd, tensors, {**ref, "alibi": default_alibi_slopes(HEADS, torch.device("cpu"))
                                  if given is None else given})


def test_default_alibi_slopes_are_te_s():
    # utils.get_alibi: 2^(-8/n * i) for n = 4; 6 heads add 2^(-4/n * (1, 3)) for n = 4
    assert default_alibi_slopes(4, torch.device("cpu")).tolist() == [2.0 ** (-2 * i) for i in range(1, 5)]
    six = default_alibi_slopes(6, torch.device("cpu")).tolist()
    assert six[4:] == pytest.approx([2.0 ** -1, 2.0 ** -3])


def test_thd_with_padding_between_sequences():
    gen = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 8, 13], dtype=torch.int32)  # TE's docstring example
    cu_kv = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    cu_kv_padded = torch.tensor([0, 2, 7, 10], dtype=torch.int32)
    q = torch.randn(13, HEADS, DIM, generator=gen)
    k, v = torch.randn(10, 2, DIM, generator=gen), torch.randn(10, 2, DIM_V, generator=gen)
    seqs = [(i, list(range(cu_padded[i], cu_padded[i] + cu[i + 1] - cu[i])),
             list(range(cu_kv_padded[i], cu_kv_padded[i] + cu_kv[i + 1] - cu_kv[i]))) for i in range(3)]
    module = dict(num_attention_heads=HEADS, kv_channels=(DIM, DIM_V), num_gqa_groups=2, qkv_format="thd",
                  attn_mask_type="padding_causal_bottom_right", attention_type="cross", softmax_type="learnable")
    fwd = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_kv_padded)
    ref = dict(seqs=seqs, causal=True, bottom_right=True, window=None, scale=DIM ** -0.5, out_shape=None)
    _check(module, fwd, (q, k, v), ref)


@pytest.mark.parametrize("interleave", [-3, -2])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_packed_qkv_and_kv_layers(fmt, interleave):
    module, fwd, (q, k, v), ref = _case(fmt, "padding_causal" if fmt == "thd" else "causal", HEADS, False, False,
                                        "vanilla", seed=2)
    module["kv_channels"] = DIM  # packing needs one head size
    v = torch.randn(v.shape[:-1] + (DIM,))
    m = DotProductAttention(**module)
    qkv = torch.stack([q, k, v], dim=interleave)
    expected = m(q, k, v, **fwd)
    torch.testing.assert_close(m(qkv_layer=qkv, qkv_interleave_dim=interleave, **fwd), expected)
    kv = torch.stack([k, v], dim=interleave)
    torch.testing.assert_close(m(q, kv_layer=kv, qkv_interleave_dim=interleave, **fwd), expected)


def test_per_call_overrides_and_te_window_coercion():
    module, fwd, (q, k, v), ref = _case("bshd", "no_mask", 2, True, False, "vanilla", seed=5)
    m = DotProductAttention(**module)
    # forward's attn_mask_type/window_size override the constructor's
    q64, k64, v64 = (t.double() for t in (q, k, v))
    out = m(q, k, v, attn_mask_type="causal_bottom_right", window_size=(1, 0))
    want = oracle(q64, k64, v64, "bshd", **{**ref, "causal": True, "window": (1, 0)})
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=1e-4)
    # TE coerces (-1, -1) to (-1, 0) for a causal type, with a warning, and (2, 3) to (2, 0)
    with pytest.warns(UserWarning, match=r"window_size should be \(-1, 0\)"):
        coerced = m(q, k, v, attn_mask_type="causal", window_size=(2, 3))
    want = oracle(q64, k64, v64, "bshd", **{**ref, "causal": True, "bottom_right": False, "window": (2, 0)})
    torch.testing.assert_close(coerced.double(), want, atol=ATOL, rtol=1e-4)
    # bottom_right_diagonal=False aligns a no_mask window top-left
    out = m(q, k, v, window_size=(1, 1), bottom_right_diagonal=False)
    want = oracle(q64, k64, v64, "bshd", **{**ref, "bottom_right": False, "window": (1, 1)})
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=1e-4)


def test_dense_padding_from_cu_seqlens_equals_the_mask():
    module, fwd, (q, k, v), ref = _case("sbhd", "padding_causal_bottom_right", 2, True, True, "off-by-one", seed=8)
    m = DotProductAttention(**module)
    mq, mk = fwd["attention_mask"]
    cu = [torch.nn.functional.pad((~x.view(3, -1)).sum(1).cumsum(0), (1, 0)).to(torch.int32) for x in (mq, mk)]
    torch.testing.assert_close(m(q, k, v, cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1]), m(q, k, v, attention_mask=(mq, mk)))


def test_dropout_only_in_training():
    module, fwd, tensors, ref = _case("bshd", "causal", 2, False, False, "vanilla", seed=6)
    m = DotProductAttention(**{**module, "attention_dropout": 0.5}).eval()
    want = oracle(*(t.double() for t in tensors), "bshd", **ref)
    torch.testing.assert_close(m(*tensors).double(), want, atol=ATOL, rtol=1e-4)  # eval: no dropout
    m.train()
    torch.manual_seed(0)
    a = m(*tensors)
    torch.manual_seed(0)
    b = m(*tensors)
    torch.testing.assert_close(a, b)  # the same generator state drops the same keys
    assert not torch.allclose(a, m.eval()(*tensors))


def test_checkpoint_core_attention_gives_the_same_gradients():
    module, fwd, tensors, ref = _case("thd", "padding_causal", 2, True, True, "learnable", seed=10)
    m = DotProductAttention(**module)
    grads = []
    for checkpoint in (False, True):
        q, k, v = (t.clone().requires_grad_() for t in tensors)
        out = m(q, k, v, checkpoint_core_attention=checkpoint, **fwd)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v, m.softmax_offset)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# -- refusals ----------------------------------------------------------------------------------------------------

def _qkv(fmt="bshd"):
    q, k, v = torch.randn(2, 4, HEADS, DIM), torch.randn(2, 4, HEADS, DIM), torch.randn(2, 4, HEADS, DIM)
    return (q, k, v) if fmt == "bshd" else tuple(t.transpose(0, 1) for t in (q, k, v))


@pytest.mark.parametrize("kwargs,argument", [
    ({"cp_group": object()}, "cp_group"), ({"cp_group": [object(), object()], "cp_comm_type": "a2a+p2p"}, "cp_group"),
    ({"cp_stream": object()}, "cp_stream"), ({"cp_comm_type": "ring"}, "cp_comm_type"),
    ({"return_max_logit": True}, "return_max_logit"), ({"softmax_type": "sigmoid"}, "softmax_type"),
    ({"attn_mask_type": "sliding"}, "attn_mask_type"), ({"qkv_format": "bhsd"}, "qkv_format"),
    ({"num_gqa_groups": 3}, "num_gqa_groups"), ({"kv_channels": (8, 8, 8)}, "kv_channels"),
    ({"attention_dropout": 1.0}, "attention_dropout"), ({"attention_type": "both"}, "attention_type"),
    ({"get_rng_state_tracker": lambda: None, "attention_dropout": 0.1}, "get_rng_state_tracker"),
    ({"window_size": (-1, 3), "attn_mask_type": "no_mask"}, "window_size"),
    ({"window_size": (-2, 0)}, "window_size"),
])
def test_constructor_refuses(kwargs, argument):
    base = dict(num_attention_heads=HEADS, kv_channels=DIM)
    with pytest.raises((ValueError, TypeError), match=argument):
        DotProductAttention(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs,argument", [
    ({"inference_params": object()}, "inference_params"), ({"fp8_output": True}, "fp8_output"),
    ({"score_mod": lambda g, s, t: s}, "score_mod"), ({"score_mod_tensors": {}}, "score_mod_tensors"),
    ({"attention_mask": torch.zeros(2, 1, 1, 4, dtype=torch.bool)}, "attention_mask"),  # causal: unused by TE
    ({"cu_seqlens_q": torch.tensor([0, 4, 8], dtype=torch.int32)}, "cu_seqlens_q"),  # no padding type
    ({"attn_mask_type": "arbitrary"}, "attention_mask"),  # arbitrary needs the mask
    ({"attn_mask_type": "arbitrary", "attention_mask": torch.zeros(2, 1, 4, 4)}, "attention_mask"),  # not bool
    ({"attn_mask_type": "padding"}, "attention_mask"),  # padding needs a mask or cu_seqlens
    ({"attn_mask_type": "padding", "attention_mask": torch.zeros(2, 4, dtype=torch.bool)}, "attention_mask"),
    ({"attn_mask_type": "padding", "attention_mask": torch.zeros(2, 1, 1, 4, dtype=torch.bool),
      "core_attention_bias_type": "post_scale_bias", "core_attention_bias": torch.zeros(1, HEADS, 4, 4)},
     "core_attention_bias"),
    ({"core_attention_bias_type": "post_scale_bias"}, "core_attention_bias"),
    ({"core_attention_bias": torch.zeros(1, HEADS, 4, 4)}, "core_attention_bias"),
    ({"core_attention_bias_type": "scaled"}, "core_attention_bias_type"),
    ({"alibi_slopes": torch.ones(HEADS)}, "alibi_slopes"),
    ({"fp8_output": False, "max_seqlen_q": 7}, "max_seqlen_q"),
    ({"cu_seqlens_q_padded": torch.tensor([0, 4, 8], dtype=torch.int32), "attn_mask_type": "padding",
      "attention_mask": torch.zeros(2, 1, 1, 4, dtype=torch.bool)}, "cu_seqlens_q_padded"),
    ({"qkv_format": "thd"}, "query_layer"),
    ({"window_size": (1, 2, 3)}, "window_size"),
    ({"bottom_right_diagonal": "yes"}, "bottom_right_diagonal"),
])
@pytest.mark.filterwarnings("ignore:window_size should be")  # TE's own warning: the causal default window, per call
def test_forward_refuses(kwargs, argument):
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd")
    with pytest.raises((ValueError, TypeError), match=argument):
        m(*_qkv(), **kwargs)


@pytest.mark.filterwarnings("ignore:window_size should be")
def test_thd_refusals_name_the_argument():
    m = DotProductAttention(HEADS, DIM, qkv_format="thd", attn_mask_type="padding")
    q = torch.randn(6, HEADS, DIM)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        m(q, q, q, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu.long())
    with pytest.raises(ValueError, match="attn_mask_type"):
        m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="causal")
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=torch.tensor([0, 1, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="pad_between_seqs"):
        m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, pad_between_seqs=True)
    with pytest.raises(ValueError, match="core_attention_bias"):
        m(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, core_attention_bias_type="pre_scale_bias",
          core_attention_bias=torch.zeros(1, HEADS, 4, 4))


def test_wrong_head_counts_and_sizes_are_refused():
    m = DotProductAttention(HEADS, (DIM, DIM_V), num_gqa_groups=2, qkv_format="bshd")
    q = torch.randn(1, 3, HEADS, DIM)
    with pytest.raises(ValueError, match="key_layer"):
        m(q, torch.randn(1, 3, HEADS, DIM), torch.randn(1, 3, HEADS, DIM_V))
    with pytest.raises(ValueError, match="value_layer"):
        m(q, torch.randn(1, 3, 2, DIM), torch.randn(1, 3, 2, DIM))
    with pytest.raises(ValueError, match="query_layer"):
        m(torch.randn(1, 3, 2, DIM), torch.randn(1, 3, 2, DIM), torch.randn(1, 3, 2, DIM_V))


# -- TE's switches -----------------------------------------------------------------------------------------------

def test_switches_deny_their_families(monkeypatch):
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN_V3"):
        monkeypatch.delenv(name, raising=False)
    assert te_switches() == ((), ())
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    names, denied = te_switches()
    assert names == ("NVTE_FLASH_ATTN=0", "NVTE_FUSED_ATTN=0")
    assert set(denied) == {"nvidia.flash_attn", "nvidia.flash_attn3", "nvidia.flash_attn4", "nvidia.flash",
                           "nvidia.vllm_flash_attn", "nvidia.cudnn", "nvidia.cudnn_frontend"}
    manager = opdispatch.get_manager()  # every id a switch names is an implementation opdispatch registers
    assert all(manager.implementation("attention", impl_id) is not None for impl_id in denied), denied
    monkeypatch.setenv("NVTE_FUSED_ATTN", "yes")
    with pytest.raises(ValueError, match="NVTE_FUSED_ATTN"):
        te_switches()


def test_unfused_switch_shows_in_explain_and_binds_forward(monkeypatch):
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd", name="model.layers.0.core_attention")
    q, k, v = _qkv()
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    decision = m.explain(q, k, v)
    row = next(c for c in decision.candidates if c.impl_id == "reference.math")
    assert row.status.startswith("denied") and "te.py" in str(row.decided_by), row
    assert "reference.math" not in str(decision.chosen)
    with opdispatch.policy_override(deny=["cpu.flash", "torch.flex"]):  # only the unfused one is left...
        with pytest.raises(Exception, match="reference.math|no implementation"):
            m(q, k, v)
        monkeypatch.setenv("NVTE_UNFUSED_ATTN", "1")  # ...and with the switch on it runs
        assert m(q, k, v).shape == (2, 4, HEADS * DIM)


def test_nondeterministic_switch_is_read_at_construction(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    assert m.deterministic and not DotProductAttention(HEADS, DIM).deterministic
    assert "deterministic" in str(m.explain(*_qkv())).split("chosen")[0]



# -- NVTE_DEBUG / NVTE_DEBUG_LEVEL: TE's backend-selection log -----------------------------------------------------

@pytest.fixture
def te_debug(monkeypatch):
    """A fresh selection log (process-wide, as TE's) and the switches on; returns a setter for NVTE_DEBUG/_LEVEL."""
    from opdispatch.compat import te
    te._SEEN_KEYS.clear()
    te._LOGGED_CHOICE.clear()
    for name in ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)

    def set_level(debug, level):
        for name, value in (("NVTE_DEBUG", debug), ("NVTE_DEBUG_LEVEL", level)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
    yield set_level
    te._SEEN_KEYS.clear()
    te._LOGGED_CHOICE.clear()


def _te_lines(caplog):
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "DotProductAttention"]
    caplog.clear()
    return lines


def _gqa_bshd(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, HEADS, DIM, generator=gen)
    k, v = torch.randn(2, 7, 2, DIM, generator=gen), torch.randn(2, 7, 2, DIM_V, generator=gen)
    return q, k, v


def _thd(seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # an empty sequence in the middle
    return (torch.randn(8, HEADS, DIM, generator=gen), torch.randn(8, HEADS, DIM, generator=gen),
            torch.randn(8, HEADS, DIM_V, generator=gen), cu)


@pytest.mark.parametrize("debug,level,expected", [
    (None, None, "WARNING"), ("0", "2", "WARNING"), ("1", None, "WARNING"), ("1", "0", "WARNING"),
    ("1", "1", "INFO"), ("1", "2", "DEBUG"), ("1", "3", "DEBUG"), ("2", "1", "DEBUG"), ("-1", "1", "DEBUG")])
def test_debug_level_is_te_s(te_debug, debug, level, expected):
    """TE's AttentionLogging: NVTE_DEBUG * NVTE_DEBUG_LEVEL, 0/1/2 → WARNING/INFO/DEBUG, any other product → DEBUG."""
    import logging

    from opdispatch.compat.te import te_log_level
    te_debug(debug, level)
    assert te_log_level() == getattr(logging, expected)
    DotProductAttention(HEADS, DIM)
    assert logging.getLogger("DotProductAttention").level == getattr(logging, expected)


@pytest.mark.parametrize("name", ["NVTE_DEBUG", "NVTE_DEBUG_LEVEL"])
def test_debug_level_not_an_integer_is_refused(te_debug, monkeypatch, name):
    te_debug("1", "1")
    monkeypatch.setenv(name, "verbose")
    with pytest.raises(ValueError, match=f"{name}='verbose' is not an integer"):
        DotProductAttention(HEADS, DIM)


def test_switched_implementations_have_te_backend_families():
    from opdispatch.compat.te import SWITCHES, TE_BACKENDS, te_backend
    assert set(TE_BACKENDS) == {i for _, impls in SWITCHES for i in impls}
    assert te_backend("nvidia.cudnn") == "FusedAttention (nvidia.cudnn)"
    assert te_backend("nvidia.flash_attn3") == "FlashAttention (version 3, nvidia.flash_attn3)"
    assert te_backend("reference.math") == "UnfusedDotProductAttention (reference.math)"
    assert te_backend("cpu.flash") == "cpu.flash" and te_backend(None) == "NoBackend"


@pytest.mark.parametrize("level", [1, 2])
def test_debug_logs_a_causal_bshd_gqa_call(te_debug, caplog, level):
    from opdispatch.compat.te import te_backend
    te_debug("1", str(level))
    caplog.set_level(0)
    m = DotProductAttention(HEADS, (DIM, DIM_V), num_gqa_groups=2, qkv_format="bshd", attention_type="cross")
    q, k, v = _gqa_bshd()
    decision = m.explain(q, k, v)
    out = m(q, k, v)
    lines = _te_lines(caplog)
    chosen = decision.chosen_id
    info = [msg for lvl, msg in lines if lvl == "INFO"]
    assert len(info) == 1 and info[0].startswith("Running with ") and chosen in info[0], lines
    debug = [msg for lvl, msg in lines if lvl == "DEBUG"]
    if level == 1:
        assert debug == []
    else:
        config = next(msg for msg in debug if msg.startswith("Running with config="))
        for field in ("'qkv_dtype': torch.float32", "'qkv_format': 'bshd'", "'batch_size': 2", "'max_seqlen_q': 5",
                      "'max_seqlen_kv': 7", "'num_heads': 4", "'num_gqa_groups': 2", f"'head_dim_qk': {DIM}",
                      f"'head_dim_v': {DIM_V}", "'attn_mask_type': 'causal'", "'window_size': (-1, 0)",
                      "'bottom_right_diagonal': False", "'core_attention_bias_type': 'no_bias'",
                      "'deterministic': False", "'requires_grad': False", "'switches': []"):
            assert field in config, (field, config)
        disabled = {c.impl_id for c in decision.candidates if c.impl_id != chosen}
        assert any(c.status == "eligible" for c in decision.candidates), "an eligible candidate not chosen"
        for c in decision.candidates:
            if c.impl_id != chosen:
                why = f"preference for {chosen}" if c.status == "eligible" else c.status
                want = f"Disabling {te_backend(c.impl_id)} due to {why}"
                assert any(msg.startswith(want) and all(r in msg for r in c.reasons) for msg in debug), (want, debug)
        assert sum(msg.startswith("Disabling ") for msg in debug) == len(disabled)
        assert f"Selected backend = {te_backend(chosen)}." in debug
    with_debug_off = DotProductAttention(HEADS, (DIM, DIM_V), num_gqa_groups=2, qkv_format="bshd",
                                         attention_type="cross")
    assert torch.equal(out, with_debug_off(q, k, v))  # logging does not change the call


def test_debug_logs_a_thd_padding_causal_call(te_debug, caplog):
    from opdispatch.compat.te import TE_BACKENDS
    te_debug("1", "2")
    caplog.set_level(0)
    m = DotProductAttention(HEADS, (DIM, DIM_V), qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v, cu = _thd()
    chosen = m.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu).chosen_id
    m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    lines = _te_lines(caplog)
    config = next(msg for lvl, msg in lines if msg.startswith("Running with config="))
    for field in ("'qkv_format': 'thd'", "'batch_size': 3", "'max_seqlen_q': 5", "'max_seqlen_kv': 5",
                  "'attn_mask_type': 'padding_causal'", "'num_gqa_groups': 4", "'pad_between_seqs': False"):
        assert field in config, (field, config)
    family = TE_BACKENDS.get(chosen, chosen).split(" ")[0]
    assert [msg for lvl, msg in lines if lvl == "INFO"] == [
        next(msg for lvl, msg in lines if lvl == "INFO" and msg.startswith(f"Running with {family} backend")
             and chosen in msg)]


def test_debug_logs_once_per_class_and_again_when_the_choice_changes(te_debug, caplog):
    te_debug("1", "1")
    caplog.set_level(0)
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd")
    q, k, v = _qkv()
    first = m.explain(q, k, v).chosen_id
    m(q, k, v)
    assert len(_te_lines(caplog)) == 1
    m(q, k, v)
    DotProductAttention(HEADS, DIM, qkv_format="bshd")(q, k, v)  # another module, same class: TE's log is global
    assert _te_lines(caplog) == []
    m(q, k, v, attn_mask_type="no_mask", window_size=(-1, -1))  # another class: logged
    assert [lvl for lvl, _ in _te_lines(caplog)] == ["INFO"]
    m(q, k, v)  # back to the first class, same choice: nothing
    assert _te_lines(caplog) == []
    with opdispatch.policy_override(deny=[first]):  # same class, another choice: logged...
        second = m.explain(q, k, v).chosen_id
        m(q, k, v)
        lines = _te_lines(caplog)
        assert second != first and len(lines) == 1 and second in lines[0][1], lines
        m(q, k, v)
        assert _te_lines(caplog) == []
    m(q, k, v)  # ...and again when it changes back
    lines = _te_lines(caplog)
    assert len(lines) == 1 and first in lines[0][1], lines


def test_debug_names_the_switch_that_denied_a_backend(te_debug, monkeypatch, caplog):
    te_debug("1", "2")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    caplog.set_level(0)
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd")
    m(*_qkv())
    debug = [msg for lvl, msg in _te_lines(caplog) if lvl == "DEBUG"]
    assert any(msg.startswith("Disabling UnfusedDotProductAttention (reference.math) due to NVTE_UNFUSED_ATTN=0 "
                              "(denied by policy") for msg in debug), debug
    assert "'switches': ['NVTE_UNFUSED_ATTN=0']" in next(msg for msg in debug if "config=" in msg)


@pytest.mark.parametrize("debug,level", [(None, None), ("0", "2"), ("1", None), ("0", None)])
def test_debug_off_is_silent_and_decides_nothing_extra(te_debug, monkeypatch, caplog, debug, level):
    from opdispatch.compat import te
    te_debug(debug, level)
    caplog.set_level(0)

    def must_not_run(*args):
        raise AssertionError("the selection log ran with NVTE_DEBUG off")
    monkeypatch.setattr(te, "_log_selection", must_not_run)
    m = DotProductAttention(HEADS, (DIM, DIM_V), qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v, cu = _thd()
    m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    DotProductAttention(HEADS, DIM, qkv_format="bshd")(*_qkv())
    assert _te_lines(caplog) == []



def test_te_docs_example_arbitrary_mask_equals_post_scale_bias():
    """TransformerEngine's docs example (docs/examples/attention/arbitrary_mask_to_post_scale_bias.py) with only the
    import swapped and its sizes shrunk for the CPU: the module built with the example's constructor arguments and
    `.to(dtype, device)`, an 'arbitrary' boolean mask (True = masked out) on one call and the same mask as a
    post-scale bias of -2**15 on another, both forward and backward; they agree as the example asserts, and the mask
    call matches the float64 oracle."""
    gen = torch.Generator().manual_seed(1234)
    b, h, d, s, dtype = 2, 4, 16, 512, torch.float32  # 512 keys: a row masking every key has probability ~1e-11
    inp = torch.randn(b, s, 3, h, d, generator=gen, dtype=dtype)
    out_grad = torch.randn(b, s, h * d, generator=gen, dtype=dtype)
    mask = torch.randint(-10, 10, (b, h, s, s), generator=gen).to(torch.bool)

    def run(**call):
        q, k, v = (inp[:, :, i].clone().requires_grad_() for i in range(3))
        block = DotProductAttention(h, d, num_gqa_groups=h, qkv_format="bshd", attention_dropout=0.0,
                                    sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None,
                                    layer_number=1).to(dtype=dtype, device="cpu")
        out = block(q, k, v, qkv_format="bshd", **call)
        out.backward(out_grad)
        return out, (q.grad, k.grad, v.grad)

    masked, masked_grads = run(attention_mask=mask, attn_mask_type="arbitrary", core_attention_bias_type="no_bias",
                               core_attention_bias=None)
    bias = torch.where(mask == 0, 0.0, -(2.0 ** 15)).to(dtype)
    biased, biased_grads = run(attention_mask=None, attn_mask_type="no_mask",
                               core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    torch.testing.assert_close(masked, biased, atol=2.5e-2, rtol=2.5e-2)  # the example's own bound
    for got, want in zip(masked_grads, biased_grads):
        torch.testing.assert_close(got, want, atol=2.5e-2, rtol=2.5e-2)
    q, k, v = (inp[:, :, i].double().transpose(1, 2) for i in range(3))
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    want = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(masked.double(), want.transpose(1, 2).reshape(b, s, h * d), atol=1e-5, rtol=1e-5)


# -- forward's fast path: a repeated dense signature reuses its checked call, and still honours every change --------

def test_repeated_signature_honours_module_changes_switches_and_refusals(monkeypatch):
    module, fwd, tensors, ref = _case("sbhd", "causal_bottom_right", 2, True, True, "vanilla", seed=12)
    m = DotProductAttention(**{**module, "attention_dropout": 0.5}).eval()
    q64, k64, v64 = (t.double() for t in tensors)
    for _ in range(3):  # the first call checks and remembers the signature, the next ones reuse it
        torch.testing.assert_close(m(*tensors).double(), oracle(q64, k64, v64, "sbhd", **ref), atol=ATOL, rtol=1e-4)
    assert len(m._dense_plans) == 1
    # module attributes the check read are part of the signature: a new scale and mask type take effect
    m.softmax_scale = 0.2
    want = oracle(q64, k64, v64, "sbhd", **{**ref, "scale": 0.2})
    for _ in range(2):
        torch.testing.assert_close(m(*tensors).double(), want, atol=ATOL, rtol=1e-4)
    m.attn_mask_type, m.window_size = "no_mask", (-1, -1)
    want = oracle(q64, k64, v64, "sbhd", **{**ref, "scale": 0.2, "causal": False, "window": None})
    for _ in range(2):
        torch.testing.assert_close(m(*tensors).double(), want, atol=ATOL, rtol=1e-4)
    m.train()  # dropout applies again in training
    assert not torch.allclose(m(*tensors), m.eval()(*tensors))
    # a coerced window warns on every call, not only on the first
    for _ in range(2):
        with pytest.warns(UserWarning, match=r"window_size should be"):
            m(*tensors, attn_mask_type="causal", window_size=(-1, -1))
    # values equal to a remembered signature's but of the wrong type are still refused
    m(*tensors, bottom_right_diagonal=True)
    with pytest.raises(ValueError, match="bottom_right_diagonal"):
        m(*tensors, bottom_right_diagonal=1)
    m(*tensors, window_size=(1, 1))
    with pytest.raises(TypeError, match="window_size"):
        m(*tensors, window_size=(True, 1))
    # a switch turned off after the signature was remembered denies its family on the next call
    m.softmax_scale, m.attn_mask_type, m.window_size = DIM ** -0.5, "causal_bottom_right", (2, 0)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN", raising=False)
    with opdispatch.policy_override(deny=["cpu.flash", "torch.flex"]):
        m(*tensors)
        m(*tensors)
        monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
        with pytest.raises(Exception, match="reference.math|no implementation"):
            m(*tensors)
        monkeypatch.setenv("NVTE_UNFUSED_ATTN", "not a number")
        with pytest.raises(ValueError, match="NVTE_UNFUSED_ATTN"):
            m(*tensors)
        monkeypatch.setenv("NVTE_UNFUSED_ATTN", "1")
        torch.testing.assert_close(m(*tensors).double(), oracle(q64, k64, v64, "sbhd", **ref), atol=ATOL, rtol=1e-4)


# -- padded dense batches without a gradient: one dense masked call (no unpadding, no host sync) -------------------

def _no_unpadding(monkeypatch):
    import opdispatch.compat.te as te

    def refuse(*args, **kwargs):
        raise AssertionError("the forward without a gradient unpadded its batch")
    monkeypatch.setattr(te, "unpad_input", refuse)


@pytest.mark.parametrize("heads_kv", [HEADS, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", PADDED_MASKS)
def test_padded_forward_without_gradient_against_the_oracle(monkeypatch, mask_type, fmt, cross, heads_kv):
    index = PADDED_MASKS.index(mask_type) * 8 + 4 * (fmt == "bshd") + 2 * cross + (heads_kv == 1)
    softmax_type = ("vanilla", "off-by-one", "learnable")[index % 3]
    module, fwd, tensors, ref = _case(fmt, mask_type, heads_kv, cross, False, softmax_type, seed=40 + index)
    m = DotProductAttention(**module)
    if m.softmax_type == "learnable":
        with torch.no_grad():
            m.softmax_offset.copy_(torch.linspace(-1.0, 1.5, HEADS))
    sinks = None if m.softmax_offset is None else m.softmax_offset.detach().double()
    want = oracle(*(t.double() for t in tensors), fmt, sinks=sinks, **ref)
    with_grad = m(*(t.clone().requires_grad_() for t in tensors), **fwd)  # the packed varlen call
    torch.testing.assert_close(with_grad.detach().double(), want, atol=ATOL, rtol=1e-4)
    if not cross or "causal" not in mask_type:  # a causal pair of masks keeps the varlen call (exact per sequence)
        _no_unpadding(monkeypatch)
    with torch.no_grad():
        out = m(*tensors, **fwd)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=1e-4)
    # the zeros of padded queries are exact zeros
    assert bool((out.double() == 0).eq(want == 0).all())
    # a window (it counts kept tokens) keeps the varlen call too, and still equals the oracle
    if "causal" in mask_type and not cross:
        monkeypatch.undo()
        windowed = oracle(*(t.double() for t in tensors), fmt, sinks=sinks, **{**ref, "window": (2, 0)})
        with torch.no_grad():
            torch.testing.assert_close(m(*tensors, window_size=(2, 0), **fwd).double(), windowed, atol=ATOL,
                                       rtol=1e-4)


@pytest.mark.parametrize("mask_type", PADDED_MASKS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_padding_with_holes_agrees_between_the_dense_and_the_packed_call(monkeypatch, fmt, mask_type):
    """A mask with holes and left padding (not TE's right padding): positions count kept tokens in the packed
    call; the dense call orders them alike (one mask for queries and keys), so both equal the oracle over the kept
    tokens."""
    gen = torch.Generator().manual_seed(31)
    batch, s = 3, 7
    q, k, v = _dense(batch, s, HEADS, DIM, fmt, gen), _dense(batch, s, 2, DIM, fmt, gen), _dense(batch, s, 2, DIM_V,
                                                                                                  fmt, gen)
    padded = torch.rand(batch, s, generator=gen) < 0.4  # True = padding (TE)
    padded[0, :2] = True  # left padding
    padded[1] = False
    padded[2] = True  # a sequence without tokens
    seqs = [(i, [i * s + j for j in range(s) if not padded[i, j]], [i * s + j for j in range(s) if not padded[i, j]])
            for i in range(batch) if not padded[i].all()]  # the oracle leaves a tokenless sequence's rows zero
    ref = dict(seqs=seqs, causal="causal" in mask_type, bottom_right=mask_type.endswith("bottom_right"), window=None,
               scale=DIM ** -0.5, out_shape=(batch, s))
    want = oracle(q.double(), k.double(), v.double(), fmt, **ref)
    m = DotProductAttention(HEADS, (DIM, DIM_V), num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask_type)
    mask = padded.view(batch, 1, 1, s)
    packed = m(q.requires_grad_(), k, v, attention_mask=mask)
    torch.testing.assert_close(packed.detach().double(), want, atol=ATOL, rtol=1e-4)
    _no_unpadding(monkeypatch)
    with torch.no_grad():
        dense = m(q, k, v, attention_mask=mask)
    torch.testing.assert_close(dense.double(), want, atol=ATOL, rtol=1e-4)
    assert bool((dense == 0).eq(want == 0).all())
    if "causal" in mask_type:  # a window counts kept tokens: it keeps the packed call, and equals the oracle
        monkeypatch.undo()
        windowed = oracle(q.double(), k.double(), v.double(), fmt, **{**ref, "window": (1, 0)})
        with torch.no_grad():
            torch.testing.assert_close(m(q, k, v, attention_mask=mask, window_size=(1, 0)).double(), windowed,
                                       atol=ATOL, rtol=1e-4)
