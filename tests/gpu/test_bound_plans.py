"""Bound plans (the per-call fast path and opdispatch.plan) compute exactly what the implementation's run() does."""

from __future__ import annotations

import pytest
import torch

import opdispatch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.flash"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_plan_equals_run_and_reference(impl, layout, causal, grad):
    b, s, hq, hkv, d = 2, 256, 8, 2, 64
    shape = {"bshd": lambda h: (b, s, h, d), "bhsd": lambda h: (b, h, s, d), "sbhd": lambda h: (s, b, h, d)}[layout]
    q, k, v = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for h in (hq, hkv, hkv))
    bound = opdispatch.plan(q, k, v, layout=layout, causal=causal, impl=impl)
    out = bound(q, k, v)
    implementation = opdispatch.get_manager().registry.get("attention", impl).impl
    via_run = implementation.run(opdispatch.validate_attention(q, k, v, layout=layout, causal=causal))
    torch.testing.assert_close(out, via_run, atol=0, rtol=0)
    leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref = opdispatch.attention(*leaves, layout=layout, causal=causal, impl="reference.math")
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    if grad:
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref_grads = torch.autograd.grad(ref, leaves, g.double())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("impl", ["nvidia.flash", "flagos.triton"])
def test_varlen_checks_cu_seqlens_once_then_never_syncs(impl):
    if impl == "flagos.triton":
        pytest.importorskip("flag_gems")
    lens = [100, 300, 77]
    cu = torch.tensor([0, 100, 400, 477], dtype=torch.int32, device="cuda")
    q = torch.randn(477, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(477, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(477, 2, 64, device="cuda", dtype=torch.bfloat16)
    kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
              causal=True, impl=impl)
    first = opdispatch.attention(q, k, v, **kw)  # checks the values once (reads them back)
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 477 but q has 476 tokens"):
        opdispatch.attention(q[:476], k[:476], v[:476], **kw)  # a new signature is checked again
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = opdispatch.attention(q, k, v, **kw)  # same signature: no host sync
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(first, again)


@pytest.mark.parametrize("impl", [None, "nvidia.cudnn", "nvidia.flash"])
def test_per_call_fast_path_hits_on_cuda_and_equals_the_plan(impl):
    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    try:
        def qkv():
            return [torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

        opdispatch.attention(*qkv(), layout="bhsd", causal=True, impl=impl)
        assert len(manager.fast) == 1
        q, k, v = qkv()
        torch.cuda.set_sync_debug_mode("error")  # a hit never syncs
        try:
            hit = opdispatch.attention(q, k, v, layout="bhsd", causal=True, impl=impl)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(manager.fast) == 1
        planned = opdispatch.plan(q, k, v, layout="bhsd", causal=True, impl=impl)
        torch.testing.assert_close(hit, planned(q, k, v), atol=0, rtol=0)
        # The same shapes and dtype on the CPU are another signature, decided for the CPU.
        on_cpu = opdispatch.attention(q.cpu(), k.cpu(), v.cpu(), layout="bhsd", causal=True)
        assert len(manager.fast) == 2
        chosen = sorted(f.decision.chosen_id for f in manager.fast.values())
        assert chosen[0] == "cpu.flash" and chosen[1].startswith("nvidia.")
        torch.testing.assert_close(on_cpu.float(), hit.cpu().float(), atol=2e-2, rtol=2e-2)
    finally:
        opdispatch.set_manager(previous)


@pytest.mark.parametrize("op", ["attention", "rms_norm"])
def test_serving_loop_over_many_lengths_frees_device_memory(op):
    """Dropped inputs of a loop over 64 sequence lengths are freed: the fast path keeps bound functions only (exact
    entries in the manager's `fast`, or the compiled door's size-generic entries, which keep the template's)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    opdispatch.stats(reset=True)
    for s in range(64, 64 * 65, 64):
        if op == "attention":
            q, k, v = (torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out = opdispatch.attention(q, k, v, causal=True)
            del q, k, v
        else:
            x, w = torch.randn(s, 4096, device="cuda", dtype=torch.bfloat16), torch.ones(4096, device="cuda",
                                                                                         dtype=torch.bfloat16)
            out = opdispatch.rms_norm(x, w)
            del x, w
        del out
    torch.cuda.synchronize()
    usage = opdispatch.stats().ops[op]
    assert len(opdispatch.get_manager().fast) + usage.compiled_hits >= 32  # the fast path served the loop
    extra = torch.cuda.memory_allocated() - base
    assert extra < 16 * 2**20, f"{extra / 2**20:.1f} MiB still allocated after the loop: inputs kept alive?"


@pytest.mark.parametrize("impl", ["nvidia.cudnn", "nvidia.mem_efficient"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_masked_decode_binds_size_generic_and_equals_run_and_reference(impl, grad):
    """A padded batch's decode (bhsd, (b, 1, 1, sk) boolean mask, GQA) through the front door pinned to `impl`: the
    function bound at the first length serves the next ones (size-generic) and gives run()'s bits — the bias
    made by one where() equals run()'s full + masked_fill_ — and the float64 reference's result."""
    b, hq, hkv, d = 4, 8, 2, 128
    cache_k, cache_v = (torch.randn(b, hkv, 300, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                        for _ in range(2))
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    mask = torch.ones(b, 1, 1, 300, dtype=torch.bool, device="cuda")
    mask[1::2, ..., :16] = False
    manager = opdispatch.get_manager()
    fn = None
    for n in (129, 130, 200, 257):
        k, v, m = cache_k[:, :, :n], cache_v[:, :, :n], mask[..., :n]
        out = opdispatch.attention(q, k, v, layout="bhsd", attn_mask=m, impl=impl)
        implementation = manager.registry.get("attention", impl).impl  # (plugins load at the first call)
        if fn is None:  # the first length ran the Python path, which keeps its bound function
            fn = next(f for key, f in manager.fast.items()  # (the other pin's entries of these shapes stay cached)
                      if key and key[0] == "attention" and k.shape in key and f.decision.chosen_id == impl)
            assert fn.size_generic
        # Later lengths run that function (the compiled door's size-generic entry, or Python's template): its bits.
        torch.testing.assert_close(out, fn(q, k, v, None, None, m, None), atol=0, rtol=0)
        via_run = implementation.run(opdispatch.validate_attention(q, k, v, layout="bhsd", attn_mask=m))
        torch.testing.assert_close(out, via_run, atol=0, rtol=0)
        leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
        ref = opdispatch.attention(*leaves, layout="bhsd", attn_mask=m, impl="reference.math")
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
