"""opdispatch.compat.scaled_dot_product_attention on a GPU: torch's results through the fused kernels the policy
picks (bf16, GQA, masks, causal, training, decode), and routing a program's calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opdispatch
from opdispatch.compat import routed_sdpa, scaled_dot_product_attention, torch_sdpa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {
    "prefill causal GQA": (dict(q=(2, 16, 512, 128), k=(2, 4, 512, 128)), dict(is_causal=True, enable_gqa=True)),
    "decode, 1 query": (dict(q=(4, 32, 1, 128), k=(4, 8, 1024, 128)), dict(enable_gqa=True)),
    "bool padding mask": (dict(q=(2, 8, 128, 64), k=(2, 8, 160, 64)), dict(mask=(2, 1, 1, 160))),
    "float bias per head": (dict(q=(1, 8, 256, 64), k=(1, 8, 256, 64)), dict(bias=(8, 256, 256))),
    "3-D inputs": (dict(q=(16, 128, 64), k=(16, 128, 64)), dict()),
    "head dim 96, fp16": (dict(q=(2, 8, 200, 96), k=(2, 8, 200, 96)), dict(is_causal=True, dtype=torch.float16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_on_the_gpu(name):
    shapes, kw = CASES[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(*shapes["q"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(*shapes["k"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(*shapes["k"], device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    if "mask" in kw:
        mask = torch.rand(*kw.pop("mask"), device="cuda", generator=gen) > 0.2
        mask[..., 0] = True
        kw["attn_mask"] = mask
    if "bias" in kw:
        kw["attn_mask"] = torch.randn(*kw.pop("bias"), device="cuda", dtype=dtype, generator=gen)
    ours = scaled_dot_product_attention(q, k, v, **kw)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    wide_kw = {**kw, "attn_mask": kw["attn_mask"].double() if "attn_mask" in kw and kw["attn_mask"].is_floating_point()
               else kw.get("attn_mask")}
    oracle = torch_sdpa(*wide, **wide_kw)  # torch's math in float64 on the GPU: the reference
    theirs = torch_sdpa(q, k, v, **kw)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    err = (ours.double() - oracle).abs().max().item()
    torch_err = (theirs.double() - oracle).abs().max().item()
    assert err <= max(2 * torch_err, 2e-2), (err, torch_err)
    grad = torch.randn_like(ours)
    got = torch.autograd.grad(ours, (q, k, v), grad)
    want = torch.autograd.grad(oracle, wide, grad.double())
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max().item() <= 5e-2 * max(1.0, w.abs().max().item())


def test_routing_on_the_gpu_uses_the_policy_kernel():
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    before = opdispatch.get_manager().decisions_made
    with routed_sdpa():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert opdispatch.get_manager().decisions_made >= before
    decision = opdispatch.explain(q, q, q, layout="bhsd", causal=True)
    assert decision.chosen_id.startswith(("nvidia.", "flagos.", "torch."))
    torch.testing.assert_close(out, torch_sdpa(q, q, q, is_causal=True), atol=2e-2, rtol=2e-2)


def test_flash_attn_front_door_on_the_gpu():
    from opdispatch.compat import flash_attn as fa

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 300, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, window_size=(256, 9), return_attn_probs=True)
    # flash-attn semantics by hand in float64: bottom-right causal, left window 256, right forced to 0.
    i = torch.arange(300, device="cuda")[:, None] + 400
    j = torch.arange(700, device="cuda")[None, :]
    keep = (j <= i) & (j >= i - 256)
    kk, vv = (t.double().repeat_interleave(4, 2).transpose(1, 2) for t in (k, v))
    s = (q.double().transpose(1, 2) @ kk.transpose(-1, -2)) * 128 ** -0.5
    s = s.masked_fill(~keep, float("-inf"))
    ref = (s.softmax(-1) @ vv).transpose(1, 2)
    assert (out.double() - ref).abs().max().item() < 2e-2
    assert (lse.double() - s.logsumexp(-1)).abs().max().item() < 1e-2
    cache_k = torch.zeros(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    cache_k[:, :700], cache_v[:, :700] = k, v
    step_q = q[:, :1]
    lens = torch.tensor([700, 650], device="cuda", dtype=torch.int32)
    step = fa.flash_attn_with_kvcache(step_q, cache_k, cache_v, k[:, :1], v[:, :1], cache_seqlens=lens, causal=True)
    assert torch.equal(cache_k[0, 700], k[0, 0]) and torch.equal(cache_k[1, 650], k[1, 0])
    for b, n in enumerate((701, 651)):
        kk, vv = (t[b, :n].double().repeat_interleave(4, 1).transpose(0, 1) for t in (cache_k, cache_v))
        w = ((step_q[b].double().transpose(0, 1) @ kk.transpose(-1, -2)) * 128 ** -0.5).softmax(-1)
        assert ((step[b].double().transpose(0, 1) - w @ vv).abs().max().item()) < 2e-2


def test_hugging_face_model_on_the_gpu_matches_sdpa():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    import copy

    import opdispatch.compat.hf  # noqa: F401

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="opdispatch")
    ours.load_state_dict(sdpa.state_dict())
    sdpa, ours = (m.to("cuda", torch.bfloat16).eval() for m in (sdpa, ours))
    ids = torch.randint(3, 256, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        a, b = sdpa(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (a[real].float() - b[real].float()).abs().max().item() < 0.1
    want = sdpa.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert (got == want).float().mean().item() > 0.9  # bf16: a near-tie may flip one greedy token
