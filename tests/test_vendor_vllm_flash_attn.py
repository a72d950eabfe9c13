"""nvidia.vllm_flash_attn (vLLM's FlashAttention fork, FA3 through `vllm.vllm_flash_attn.flash_attn_varlen_func`)
against a fake of its published signature: selection on a simulated H100, inference only, and its sinks passed
natively as `s_aux` where that is exact (bfloat16-valued sinks, no LSE asked), else through the shared epilogue —
checked against the float64 oracle of tests/test_attention_sinks.py."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import opdispatch
from opdispatch.vendors.nvidia import VllmFlashAttn

from tests.conftest import device_descriptor
from tests._adapters_on_cpu import unbound_from_device, TOL, device_with_library, meta_qkv, run_on_cpu
from tests.fakes import vllm_flash_attn as fake_vllm
from tests.test_attention_sinks import oracle



@pytest.fixture
def vllm_fa(monkeypatch, basic_manager, tmp_path):
    fake_vllm.calls.clear()
    return run_on_cpu(monkeypatch, basic_manager, tmp_path, fake_vllm.fake_modules(), unbound_from_device(VllmFlashAttn, "vllm_fa"))


def test_selected_for_inference_on_an_h100_that_has_it_and_explained_otherwise(manager, tmp_path):
    sinks = torch.empty(16, device="meta", dtype=torch.float32)
    with_vllm = device_with_library(tmp_path, "h100", "vllm_flash_attn", "0.11")
    d = opdispatch.explain(*meta_qkv(), causal=True, window=(128, 0), sinks=sinks, device=with_vllm)
    assert d.chosen_id == "nvidia.vllm_flash_attn"
    # Training (q/k/v or the sinks requiring grad): forward only, so never this one, and explain says why.
    for q_grad, sinks_grad in ((True, False), (False, True)):
        d = opdispatch.explain(*meta_qkv(grad=q_grad), causal=True,
                               sinks=sinks.detach().requires_grad_(sinks_grad), device=with_vllm)
        assert d.chosen_id != "nvidia.vllm_flash_attn"
        ours = next(c for c in d.candidates if c.impl_id == "nvidia.vllm_flash_attn")
        assert any("forward-only" in r for r in ours.reasons)
    # Without it installed: not chosen, and explain names the library and how to install it.
    d = opdispatch.explain(*meta_qkv(), causal=True, sinks=sinks, device=str(device_descriptor("h100")))
    ours = next(c for c in d.candidates if c.impl_id == "nvidia.vllm_flash_attn")
    assert d.chosen_id != "nvidia.vllm_flash_attn" and any("vllm_flash_attn" in r for r in ours.reasons)
    # What FA3 does not take: ALiBi, top-left causal over unequal lengths, head dims above 256; and not on A100.
    slopes = torch.empty(16, device="meta", dtype=torch.float32)
    for kwargs in (dict(alibi_slopes=slopes), dict(causal=True, causal_alignment="top_left")):
        q, k, v = meta_qkv(sk=512)
        assert opdispatch.explain(q, k, v, device=with_vllm, **kwargs).chosen_id != "nvidia.vllm_flash_attn"
    assert opdispatch.explain(*meta_qkv(d=264), device=with_vllm).chosen_id != "nvidia.vllm_flash_attn"
    text = device_descriptor("a100").read_text().replace("libraries:\n", "libraries:\n  vllm_flash_attn: \"0.11\"\n")
    path = tmp_path / "a100-vllm.yaml"
    path.write_text(text)
    d = opdispatch.explain(*meta_qkv(), device=str(path))
    ours = next(c for c in d.candidates if c.impl_id == "nvidia.vllm_flash_attn")
    assert d.chosen_id != "nvidia.vllm_flash_attn" and ours.reasons


def _bf16_sinks(gen, heads):
    """Sinks as GPT-OSS has them: bfloat16 parameters widened to float32 (what s_aux holds exactly)."""
    return (torch.randn(heads, generator=gen) * 2).to(torch.bfloat16).float()


def _inputs(gen, b, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(b, sq, hq, d, generator=gen)
    k, v = torch.randn(b, sk, hkv, d, generator=gen), torch.randn(b, sk, hkv, d, generator=gen)
    return [t.to(dtype) for t in (q, k, v)]


def _layout(t, layout):
    return {"bshd": t, "bhsd": t.transpose(1, 2), "sbhd": t.transpose(0, 1)}[layout]


CASES = [  # (sq, sk, hq, hkv, causal, window, layout, dtype)
    (12, 12, 4, 4, False, None, "bshd", torch.bfloat16),
    (9, 17, 6, 2, True, None, "bhsd", torch.float16),     # GQA, causal bottom-right over more keys
    (17, 9, 4, 2, True, None, "bshd", torch.bfloat16),    # more queries than keys: blind rows (out 0)
    (16, 16, 8, 2, True, (4, 0), "sbhd", torch.float16),  # sliding window, GQA (GPT-OSS's combination)
    (10, 14, 4, 1, False, (3, 2), "bhsd", torch.bfloat16),  # two-sided window, MQA
    (1, 20, 8, 2, True, (5, 0), "bshd", torch.bfloat16),  # one decode step over a window
]


@pytest.mark.parametrize("sq,sk,hq,hkv,causal,window,layout,dtype", CASES)
def test_native_sinks_inference_matches_the_oracle(vllm_fa, sq, sk, hq, hkv, causal, window, layout, dtype):
    gen = torch.Generator().manual_seed(sq * 131 + sk)
    q, k, v = _inputs(gen, 2, sq, sk, hq, hkv, 16, dtype)
    sinks = _bf16_sinks(gen, hq)
    out = opdispatch.attention(*(_layout(t, layout) for t in (q, k, v)), layout=layout, causal=causal,
                               window=window, causal_alignment="bottom_right", sinks=sinks)
    # The kernel got the sinks as s_aux (bf16, the same values; no epilogue around a call without them), once.
    assert len(fake_vllm.calls) == 1
    call = fake_vllm.calls[0]
    assert call["fa_version"] == 3 and not call["return_softmax_lse"]
    assert call["s_aux"].dtype == torch.bfloat16 and torch.equal(call["s_aux"].float(), sinks)
    assert len(call["window_size"]) == 2 and call["window_size"][0] == (-1 if window is None else window[0])
    ref_out, _ = oracle(q, k, v, sinks, scale=16 ** -0.5, causal=causal, window=window, alignment="bottom_right")
    out = _layout(out, layout)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])


def test_native_sinks_packed_varlen(vllm_fa):
    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 9, 1], [7, 9, 4]
    q = torch.randn(sum(lens_q), 4, 16, generator=gen).to(torch.float16)
    k = torch.randn(sum(lens_k), 2, 16, generator=gen).to(torch.float16)
    v = torch.randn(sum(lens_k), 2, 16, generator=gen).to(torch.float16)
    sinks = _bf16_sinks(gen, 4)
    cu_q = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    with torch.no_grad():
        out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9,
                                   max_seqlen_k=9, causal=True, window=(3, 0), causal_alignment="bottom_right",
                                   sinks=sinks)
    assert len(fake_vllm.calls) == 1 and fake_vllm.calls[0]["s_aux"] is not None
    for (a, b), (c, e) in zip(zip(cu_q.tolist(), cu_q.tolist()[1:]), zip(cu_k.tolist(), cu_k.tolist()[1:])):
        ref_out, _ = oracle(q[None, a:b], k[None, c:e], v[None, c:e], sinks, scale=0.25, causal=True, window=(3, 0),
                            alignment="bottom_right")
        torch.testing.assert_close(out[a:b].double(), ref_out[0], **TOL[torch.float16])


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_lse_calls_take_the_epilogue_and_blind_rows_get_the_sink(vllm_fa, layout):
    # The kernel writes LSE -inf for a tile of blind rows (the fake: every blind row), without the sink; with the
    # LSE asked, the call runs without s_aux and the shared epilogue adds the sink: LSE = sink on blind rows.
    gen = torch.Generator().manual_seed(5)
    q, k, v = _inputs(gen, 2, 13, 6, 4, 2, 16, torch.bfloat16)
    sinks = _bf16_sinks(gen, 4)
    ref_out, ref_lse = oracle(q, k, v, sinks, scale=0.25, causal=True, alignment="bottom_right")
    if layout == "bshd":
        out, lse = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", sinks=sinks,
                                        return_lse=True)
    else:
        cu_q = torch.tensor([0, 13, 26], dtype=torch.int32)
        cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
        out, lse = opdispatch.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), layout="thd",
                                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=13, max_seqlen_k=6,
                                        causal=True, causal_alignment="bottom_right", sinks=sinks, return_lse=True)
        out = out.view(2, 13, 4, 16)
        lse = lse.view(4, 2, 13).transpose(0, 1)
    call = fake_vllm.calls[-1]
    assert len(fake_vllm.calls) == 1 and call["s_aux"] is None and call["return_softmax_lse"]
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    blind = torch.isneginf(oracle(q, k, v, torch.full((4,), -math.inf), scale=0.25, causal=True,
                                  alignment="bottom_right")[1])
    assert blind.any()
    torch.testing.assert_close(lse[blind], sinks.view(1, 4, 1).expand_as(lse)[blind])


def test_sinks_the_kernel_cannot_hold_exactly_take_the_epilogue(vllm_fa):
    gen = torch.Generator().manual_seed(9)
    q, k, v = _inputs(gen, 1, 8, 8, 4, 2, 16, torch.bfloat16)
    sinks = torch.randn(4, generator=gen) * 2  # float32 values bfloat16 would round
    assert not torch.equal(sinks, sinks.to(torch.bfloat16).float())
    out = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    assert len(fake_vllm.calls) == 1 and fake_vllm.calls[0]["s_aux"] is None
    ref_out, _ = oracle(q, k, v, sinks, scale=0.25, causal=True)
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    # More than 64 query heads: s_aux is refused by the kernel, so the epilogue again.
    fake_vllm.calls.clear()
    q, k, v = _inputs(gen, 1, 5, 5, 72, 8, 16, torch.bfloat16)
    sinks = _bf16_sinks(gen, 72)
    out = opdispatch.attention(q, k, v, sinks=sinks)
    assert len(fake_vllm.calls) == 1 and fake_vllm.calls[0]["s_aux"] is None
    torch.testing.assert_close(out.double(), oracle(q, k, v, sinks, scale=0.25)[0], **TOL[torch.bfloat16])


def test_softcap_with_native_sinks_matches_the_reference(vllm_fa):
    gen = torch.Generator().manual_seed(13)
    q, k, v = _inputs(gen, 2, 7, 11, 4, 2, 16, torch.float16)
    q = q * 4  # scores large enough for the cap to matter
    sinks = _bf16_sinks(gen, 4)
    out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", softcap=2.0, sinks=sinks)
    assert fake_vllm.calls[-1]["s_aux"] is not None and fake_vllm.calls[-1]["softcap"] == 2.0
    ref = opdispatch.attention(q.double(), k.double(), v.double(), causal=True, causal_alignment="bottom_right",
                               softcap=2.0, sinks=sinks, impl="reference.math")
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float16])
    plain = opdispatch.attention(q.double(), k.double(), v.double(), causal=True, causal_alignment="bottom_right",
                                 sinks=sinks, impl="reference.math")
    assert (ref - plain).abs().max() > 0.05  # the cap changed the result, so the check above can fail


def test_training_is_not_routed_to_it(vllm_fa):
    gen = torch.Generator().manual_seed(17)
    q, k, v = (t.requires_grad_() for t in _inputs(gen, 1, 6, 6, 2, 2, 16, torch.bfloat16))
    sinks = _bf16_sinks(gen, 2).requires_grad_()
    out = opdispatch.attention(q, k, v, causal=True, sinks=sinks)
    out.float().sum().backward()
    assert not fake_vllm.calls and sinks.grad is not None and q.grad is not None
    d = opdispatch.explain(q, k, v, causal=True, sinks=sinks)
    assert d.chosen_id != "test.vllm_fa"


def test_the_fake_refuses_what_the_real_function_refuses():
    q = torch.zeros(6, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(TypeError):
        fake_vllm.flash_attn_varlen_func(q, q, q, 6, cu, 6, cu, learnable_sink=torch.zeros(2))  # FA4's spelling
    with pytest.raises(NotImplementedError, match="FA2 does not support s_aux"):
        fake_vllm.flash_attn_varlen_func(q, q, q, 6, cu, 6, cu, s_aux=torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 dtype for S aux"):
        fake_vllm.flash_attn_varlen_func(q, q, q, 6, cu, 6, cu, fa_version=3, s_aux=torch.zeros(2))
    with pytest.raises(RuntimeError, match="fp16, bf16"):
        fake_vllm.flash_attn_varlen_func(q.float(), q.float(), q.float(), 6, cu, 6, cu, fa_version=3)
    with pytest.raises(RuntimeError, match="int32"):
        fake_vllm.flash_attn_varlen_func(q, q, q, 6, cu.long(), 6, cu.long(), fa_version=3)
    out, lse = fake_vllm.flash_attn_varlen_func(q, q, q, 6, cu, 6, cu, fa_version=3, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 6)


def test_a_build_without_s_aux_takes_the_epilogue(vllm_fa, monkeypatch):
    # vLLM builds from before the GPT-OSS change have fa_version but no s_aux: sinks never reach them.
    real = fake_vllm.flash_attn_varlen_func
    params = [p for name, p in inspect.signature(real).parameters.items() if not name.startswith(("s_aux", "cp_"))]

    def older(*args, **kwargs):
        return real(*args, **kwargs)

    older.__signature__ = inspect.Signature(params)
    monkeypatch.setattr(fake_vllm, "flash_attn_varlen_func", older)
    gen = torch.Generator().manual_seed(19)
    q, k, v = _inputs(gen, 1, 6, 9, 4, 2, 16, torch.float16)
    sinks = _bf16_sinks(gen, 4)
    out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", sinks=sinks)
    assert len(fake_vllm.calls) == 1 and fake_vllm.calls[0]["s_aux"] is None
    ref_out, _ = oracle(q, k, v, sinks, scale=0.25, causal=True, alignment="bottom_right")
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.float16])


def test_the_bfloat16_check_reads_a_sinks_tensor_once_per_version(vllm_fa, monkeypatch):
    """Reading the sinks is a device sync: a decode loop passing the same parameter reads it once; writing it in
    place (a new version) reads it again, and a value that stops being bfloat16 goes to the epilogue."""
    from opdispatch.vendors.nvidia import _vllm_flash_attn as adapter

    reads = []
    equal = torch.equal
    monkeypatch.setattr(adapter.torch, "equal", lambda a, b: reads.append(1) or equal(a, b))
    gen = torch.Generator().manual_seed(10)
    q, k, v = _inputs(gen, 1, 1, 9, 4, 2, 16, torch.bfloat16)
    sinks = _bf16_sinks(gen, 4)
    for _ in range(3):
        opdispatch.attention(q, k, v, sinks=sinks)
    assert len(reads) == 1 and all(c["s_aux"] is not None for c in fake_vllm.calls)
    with torch.no_grad():
        sinks.add_(0.001)  # no longer bfloat16 values
    fake_vllm.calls.clear()
    out = opdispatch.attention(q, k, v, sinks=sinks)
    assert len(reads) == 2 and fake_vllm.calls[0]["s_aux"] is None
    torch.testing.assert_close(out.double(), oracle(q, k, v, sinks, scale=0.25)[0], **TOL[torch.bfloat16])
