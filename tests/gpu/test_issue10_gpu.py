"""Issue-10 behaviour on a real NVIDIA GPU: GQA stacked into queries on mem_efficient (decode, MLA 576/512), ALiBi
precision through the bf16 bias, canonical decode reaching a fused kernel, one decision for a decode loop, and
bitwise repeatability of every forward declared deterministic. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch import validate_attention

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = [pytest.mark.gpu]


def rand(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def oracle(q, k, v, scale, alibi=None, offset=0):
    """float64 attention over bshd tensors with GQA and optional ALiBi (-slope * |i + offset - j|)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if alibi is not None:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None]
        scores = scores - alibi.double()[:, None, None] * (i + offset - j).abs()
    return (scores.softmax(-1) @ v).transpose(1, 2), scores.logsumexp(-1)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("hq,hkv,d,dv", [(32, 8, 128, 128), (128, 1, 576, 512)], ids=["decode-gqa4", "mla-576-512"])
def test_mem_efficient_gqa_decode_matches_float64(hq, hkv, d, dv):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = rand(4, 1, hq, d, gen=gen), rand(4, 1000, hkv, d, gen=gen), rand(4, 1000, hkv, dv, gen=gen)
    kw = dict(causal=True, causal_alignment="bottom_right", return_lse=True)
    out, lse = opdispatch.attention(q, k, v, impl="nvidia.mem_efficient", **kw)
    ref, ref_lse = oracle(q, k, v, d ** -0.5)
    assert rel(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2
    if hkv == 1:
        assert opdispatch.explain(q, k, v, **kw).chosen_id == "nvidia.mem_efficient"  # no reference.math


@pytest.mark.parametrize("impl", ["nvidia.mem_efficient", "nvidia.cudnn"])
def test_alibi_stays_within_bf16_rounding(impl):
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = rand(2, 512, 8, 64, gen=gen), rand(2, 96, 8, 64, gen=gen), rand(2, 96, 8, 64, gen=gen)
    slopes = torch.tensor([2 ** -(i + 1) for i in range(8)], device="cuda")
    out, lse = opdispatch.attention(q, k, v, alibi_slopes=slopes, causal_alignment="bottom_right", impl=impl,
                                    return_lse=True)
    ref, ref_lse = oracle(q, k, v, 64 ** -0.5, alibi=slopes, offset=96 - 512)
    assert (out.double() - ref).abs().max().item() < 0.03  # was 0.33-2.6 with the bias rounded unshifted
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 0.05


def test_flash_attn_style_decode_reaches_a_fused_kernel_and_decides_once():
    gen = torch.Generator(device="cuda").manual_seed(3)
    cache_k, cache_v = rand(2, 600, 8, 128, gen=gen), rand(2, 600, 8, 128, gen=gen)
    manager = opdispatch.get_manager()
    made = manager.decisions_made
    picks = set()
    for n in range(300, 364):
        q = rand(2, 1, 32, 128, gen=gen)
        out = opdispatch.attention(q, cache_k[:, :n], cache_v[:, :n], causal=True, causal_alignment="bottom_right")
        picks.add(opdispatch.plan(q, cache_k[:, :n], cache_v[:, :n], causal=True,
                                  causal_alignment="bottom_right").decision.chosen_id)
    assert manager.decisions_made - made == 1 and len(picks) == 1 and "reference.math" not in picks
    ref, _ = oracle(q, cache_k[:, :363], cache_v[:, :363], 128 ** -0.5)
    assert rel(out, ref) < 1e-2


DETERMINISM_SHAPES = {"decode-like fp16 (sq 1, sk 239, d 160, b 60)": (60, 1, 239, 16, 16, 160, torch.float16),
                      "prefill bf16 (2 x 1024, d 128)": (2, 1024, 1024, 16, 16, 128, torch.bfloat16)}


@pytest.mark.parametrize("shape", list(DETERMINISM_SHAPES), ids=["decode", "prefill"])
def test_forwards_declared_deterministic_are_bitwise_repeatable(shape):
    b, sq, sk, hq, hkv, d, dtype = DETERMINISM_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = rand(b, sq, hq, d, gen=gen, dtype=dtype), rand(b, sk, hkv, d, gen=gen, dtype=dtype), \
        rand(b, sk, hkv, d, gen=gen, dtype=dtype)
    manager = opdispatch.get_manager()
    device = manager.device_info(torch.device("cuda"))
    call = validate_attention(q, k, v)
    checked, differing = [], {}
    for registered in manager.registry.for_op("attention"):
        impl = registered.impl
        if manager.availability(impl, device) is not None or impl.not_supported_reasons(call, device):
            continue
        first = opdispatch.attention(q, k, v, impl=impl.id)
        differ = sum(not torch.equal(first, opdispatch.attention(q, k, v, impl=impl.id)) for _ in range(50))
        if impl.caps.deterministic_forward:
            checked.append(impl.id)
            assert differ == 0, f"{impl.id} declares a deterministic forward but differed in {differ} of 50"
        else:
            differing[impl.id] = differ
    print(f"{shape}: bitwise repeatable {checked}; declared non-deterministic (repeats that differed): {differing}")
    assert checked


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.flash"])
@pytest.mark.parametrize("d", [20, 100, 130])
def test_padded_head_dims_match_float64_forward_and_backward(impl, d):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (rand(2, 256, 8, d, gen=gen).requires_grad_() for _ in range(3))
    out = opdispatch.attention(q, k, v, causal=False, impl=impl)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = oracle(*leaves, d ** -0.5)
    assert out.shape == q.shape and rel(out, ref) < 1e-2
    g = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float32).to(out.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves, g.double())):
        assert rel(a, b) < 3e-2


@pytest.mark.parametrize("impl", ["nvidia.mem_efficient", "nvidia.cudnn"])
def test_alibi_gqa_training_matches_float64(impl):
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = rand(2, 300, 16, 64, gen=gen).requires_grad_()
    k, v = rand(2, 300, 4, 64, gen=gen).requires_grad_(), rand(2, 300, 4, 64, gen=gen).requires_grad_()
    slopes = torch.tensor([2 ** -(i / 2 + 1) for i in range(16)], device="cuda")
    kw = dict(alibi_slopes=slopes, causal_alignment="bottom_right")
    assert opdispatch.explain(q, k, v, **kw).chosen_id in ("nvidia.cudnn", "nvidia.mem_efficient")
    out = opdispatch.attention(q, k, v, impl=impl, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = oracle(*leaves, 64 ** -0.5, alibi=slopes)
    assert rel(out, ref) < 1e-2
    g = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float32).to(out.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves, g.double())):
        assert rel(a, b) < 3e-2


@pytest.mark.parametrize("impl", ["nvidia.flash", "nvidia.mem_efficient"])
@pytest.mark.parametrize("heads_kv", [16, 4])
def test_backward_declared_deterministic_under_torchs_flag_is_bitwise_repeatable(impl, heads_kv):
    """torch's FA2 and memory-efficient backwards declare determinism under torch's global flag (aten reads it
    when the backward runs): 20 backwards of one call give identical gradients (MHA and GQA), and the policy
    picks FA2 for such training calls."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = rand(2, 1024, 16, 128, gen=gen).requires_grad_()
    k, v = (rand(2, 1024, heads_kv, 128, gen=gen).requires_grad_() for _ in range(2))
    g = rand(2, 1024, 16, 128, gen=gen)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert opdispatch.explain(q, k, v, causal=True).chosen_id == "nvidia.flash"
        grads = [torch.autograd.grad(opdispatch.attention(q, k, v, causal=True, impl=impl), (q, k, v), g)
                 for _ in range(20)]
    finally:
        torch.use_deterministic_algorithms(previous)
    differ = sum(not all(torch.equal(a, b) for a, b in zip(grads[0], other)) for other in grads[1:])
    assert differ == 0, f"{impl}: gradients differed in {differ} of 19 repeats"


def test_flex_training_speed_in_a_fresh_process_is_printed():
    import time

    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (rand(2, 2048, 16, 128, gen=gen).requires_grad_() for _ in range(3))
    for label, kw in [("causal", dict(causal=True)), ("causal deterministic", dict(causal=True, deterministic=True))]:
        for _ in range(3):
            opdispatch.attention(q, k, v, impl="torch.flex", **kw).sum().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            opdispatch.attention(q, k, v, impl="torch.flex", **kw).sum().backward()
        torch.cuda.synchronize()
        print(f"torch.flex fwd+bwd {label}: {(time.perf_counter() - start) / 10 * 1e3:.3f} ms")
