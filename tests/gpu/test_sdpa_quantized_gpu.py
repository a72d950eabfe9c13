"""nvidia.sdpa_quantized on an H100/H200 (torch >= 2.13 with FA3 activated in torch's SDPA): the FP8 forward against
float32 attention of the dequantized inputs, per-tensor and per-(batch, kv head) descales, bshd/bhsd/sbhd, GQA/MQA,
causal bottom-right with seqlen_q below and above seqlen_k (rows with no key: zeros). Bound: 0.08 of the output's
max, as benchmarks/fp8_attention.py and the cuDNN frontend's FP8 GPU tests hold FP8 forwards."""

from __future__ import annotations

import importlib

import pytest
import torch

import opdispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm90 GPU (FA3 is sm90 only)"),
]
quantized_module = pytest.importorskip("torch.nn.attention.experimental._scaled_dot_product_attention_quantized",
                                       reason="needs torch >= 2.13")

E4M3 = torch.float8_e4m3fn
IMPL = "nvidia.sdpa_quantized"
BOUND = 0.08


@pytest.fixture(scope="module")
def fa3_activated():
    attention = importlib.import_module("torch.nn.attention")
    before = attention.current_flash_attention_impl()
    try:
        attention.activate_flash_attention_impl("FA3")
    except Exception as exc:  # FA3's flash_attn_interface missing or not exposing torch.ops.flash_attn_3
        pytest.skip(f"FA3 cannot be activated in torch's SDPA: {type(exc).__name__}: {exc}")
    yield
    if before is None:
        attention.restore_flash_attention_impl()
    else:
        attention.activate_flash_attention_impl(before)


@pytest.fixture
def fresh(fa3_activated, manager):
    return manager  # a new manager after activation: availability is asked anew


def _quantize(t, per_head, heads_kv):
    """(b, s, h, d) → e4m3 and its descale: one per tensor, or per (batch, kv head) over each kv head's group."""
    if not per_head:
        descale = t.abs().amax().float() / torch.finfo(E4M3).max
        return (t.float() / descale).to(E4M3), descale
    b, s, h, d = t.shape
    grouped = t.float().view(b, s, heads_kv, h // heads_kv, d)
    descale = grouped.abs().amax(dim=(1, 3, 4)) / torch.finfo(E4M3).max      # (b, heads_kv)
    q8 = (grouped / descale[:, None, :, None, None]).to(E4M3).view(b, s, h, d)
    return q8, descale


def _dequantized(t8, descale, heads_kv):
    if descale.dim() == 0:
        return t8.float() * descale
    b, s, h, d = t8.shape
    return (t8.float().view(b, s, heads_kv, h // heads_kv, d) * descale[:, None, :, None, None]).view(b, s, h, d)


def _reference(q, k, v, causal):
    """float32 (b, s, h, d) attention; causal bottom-right; rows with no key give zeros."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    scores = qt @ kt.transpose(-1, -2) / q.shape[-1] ** 0.5
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        rows, cols = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (sk - sq), float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return (p @ vt).transpose(1, 2)


def _as(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout].contiguous()


def _back(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout]


@pytest.mark.parametrize("layout,heads,lengths,causal,per_head", [
    ("bshd", (16, 16), (2048, 2048), False, False),
    ("bshd", (16, 4), (2048, 2048), True, True),
    ("bhsd", (8, 1), (512, 1536), True, True),      # MQA, bottom-right with a longer key
    ("sbhd", (8, 2), (1024, 384), True, False),     # bottom-right: the first 640 rows see no key
    ("bhsd", (8, 2), (1, 4096), True, True),        # decode
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_forward_against_float32(fresh, layout, heads, lengths, causal, per_head, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(7)
    (hq, hkv), (sq, sk), b = heads, lengths, 2
    q, k, v = (torch.randn(b, s, h, head_dim, generator=gen, device="cuda") for s, h in ((sq, hq), (sk, hkv),
                                                                                          (sk, hkv)))
    (q8, qs), (k8, ks), (v8, vs) = (_quantize(t, per_head, hkv) for t in (q, k, v))
    want = _reference(_dequantized(q8, qs, hkv), _dequantized(k8, ks, hkv), _dequantized(v8, vs, hkv), causal)
    args = dict(layout=layout, causal=causal, causal_alignment="bottom_right", q_descale=qs, k_descale=ks,
                v_descale=vs)
    assert opdispatch.explain(_as(q8, layout), _as(k8, layout), _as(v8, layout), impl=IMPL, **args).chosen_id == IMPL
    out = opdispatch.attention(_as(q8, layout), _as(k8, layout), _as(v8, layout), impl=IMPL, **args)
    assert out.dtype == torch.bfloat16
    got = _back(out, layout).float()
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= BOUND, error
    if causal and sq > sk:
        assert (got[:, : sq - sk] == 0).all()
