"""Hostile KV-cache indices on a real GPU (issue 27): an out-of-bounds paged append used to kill the CUDA context
(a device-side assert in the gather). Each case runs in a subprocess, so a context it did kill could not hide
behind this one: the child must finish normally, its caches unchanged, its output NaN, the error raised by the
next call (or at once with OPDISPATCH_SYNC_CHECKS=1) — and CUDA must still work afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from opdispatch.compat import flash_attn as fa
    case, result = sys.argv[1], {}
    dev, i32 = "cuda", torch.int32
    q = torch.randn(2, 1, 8, 64, device=dev, dtype=torch.float16)
    k_new = torch.randn(2, 3, 2, 64, device=dev, dtype=torch.float16)
    pool_k = torch.randn(10, 16, 2, 64, device=dev, dtype=torch.float16)
    pool_v = torch.randn_like(pool_k)
    table = torch.tensor([[7, 2, 0, 0], [4, 1, 9, 3]], dtype=i32, device=dev)
    lens = torch.tensor([5, 20], dtype=i32, device=dev)
    bad = {"page": dict(block_table=torch.tensor([[7, 2, 0, 0], [4, 12, 9, 3]], dtype=i32, device=dev)),
           "negative_page": dict(block_table=torch.tensor([[-4, 2, 0, 0], [4, 1, 9, 3]], dtype=i32, device=dev)),
           "overflow": dict(cache_seqlens=torch.tensor([5, 62], dtype=i32, device=dev)),
           "negative_len": dict(cache_seqlens=torch.tensor([-1, 20], dtype=i32, device=dev))}[case]
    kw = dict(k=k_new, v=k_new, cache_seqlens=lens, block_table=table, causal=True)
    kw.update(bad)
    before = pool_k.clone(), pool_v.clone()
    try:
        out = fa.flash_attn_with_kvcache(q, pool_k, pool_v, **kw)
        result["returned_nan"] = bool(out.isnan().all())
        try:
            fa.check_pending_errors()
            result["error"] = None
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        result["returned_nan"] = None
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.synchronize()
    result["unchanged"] = bool(torch.equal(pool_k, before[0]) and torch.equal(pool_v, before[1]))
    result["cuda_alive"] = float((torch.ones(4, device=dev) * 2).sum()) == 8.0  # the context still works
    print(json.dumps(result))
""")


def _child(case: str, **env: str) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert run.returncode == 0, f"the child died (rc {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, fragment", [
    ("page", r"block_table[1, 1]=12 is out of range"),
    ("negative_page", r"block_table[0, 0]=-4 is out of range"),
    ("overflow", r"cache_seqlens[1]=62 is out of range; allowed: 0..61"),
    ("negative_len", r"cache_seqlens[0]=-1 is out of range"),
])
def test_out_of_bounds_paged_append_leaves_the_context_alive_and_raises(case, fragment):
    deferred = _child(case)
    assert deferred["cuda_alive"] and deferred["unchanged"] and deferred["returned_nan"]
    assert deferred["error"].startswith("KvCacheIndexError") and fragment in deferred["error"]
    synchronous = _child(case, OPDISPATCH_SYNC_CHECKS="1")
    assert synchronous["cuda_alive"] and synchronous["unchanged"] and synchronous["returned_nan"] is None
    assert synchronous["error"].startswith("ValueError") and fragment in synchronous["error"]


def test_the_device_side_check_adds_no_host_sync(manager):
    """Warm once (decision, binding), then run a valid and an invalid append into a dense cache with CUDA's sync
    debug mode set to error: the checks, the all-or-nothing write and the deferred report must not synchronize.
    (A dense cache: a fused kernel takes it. Pages of 16 keys go to reference.math on this torch, which reads
    lengths on the host by design — the H200 run of this test with pages of 16 failed inside reference.math — and
    every plugin is loaded: `basic_manager` has only cpu and reference, so the call landed on reference.math.)"""
    from opdispatch.compat import flash_attn as fa

    dev, i32 = "cuda", torch.int32
    q = torch.randn(2, 1, 8, 64, device=dev, dtype=torch.float16)
    k_new = torch.randn(2, 3, 2, 64, device=dev, dtype=torch.float16)
    pool_k = torch.randn(2, 64, 2, 64, device=dev, dtype=torch.float16)
    pool_v = torch.randn_like(pool_k)
    good = torch.tensor([5, 20], dtype=i32, device=dev)
    bad = torch.tensor([5, 62], dtype=i32, device=dev)
    kw = dict(k=k_new, v=k_new, causal=True)
    fa.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=good, **kw)
    fa.check_pending_errors()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fa.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=good, **kw)
        out = fa.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=bad, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.isnan().all()
    with pytest.raises(fa.KvCacheIndexError, match=r"cache_seqlens\[1\]=62 is out of range"):
        fa.check_pending_errors()


def test_a_long_bound_decode_loop_wraps_the_report_ring_and_a_bad_step_writes_nothing_and_is_raised():
    """flash_attn_with_kvcache's bound device path over more steps than the report ring has rows (issue 31: rows
    and their events reused): every valid step's key lands where it belongs; one bad step in the middle is NaN,
    writes nothing, and its error (the values it was given) is raised once, however far the host ran ahead."""
    from opdispatch.base import _kv_checks
    from opdispatch.compat import flash_attn as fa

    torch.manual_seed(0)
    dev, i32, batch = "cuda", torch.int32, 4
    steps = 2 * _kv_checks.RING_ROWS + 50
    bad_step = _kv_checks.RING_ROWS + 17
    k_cache = torch.zeros(batch, steps, 2, 64, device=dev, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(batch, 1, 8, 64, device=dev, dtype=torch.float16)
    new_k = torch.randn(steps, batch, 1, 2, 64, device=dev, dtype=torch.float16)
    lens = torch.zeros(batch, dtype=i32, device=dev)
    fa.check_pending_errors()
    raised = []
    for step in range(steps):
        if step == bad_step:
            bad = lens.clone()
            bad[2] = steps  # no room for the append
            before = k_cache.clone(), v_cache.clone()
            out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, new_k[step], new_k[step], cache_seqlens=bad,
                                             causal=True)
            bad.fill_(0)  # the caller moves on at once: the error still names what the call was given
            assert out.isnan().all()
            assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
            continue
        try:
            out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, new_k[step], new_k[step], cache_seqlens=lens,
                                             causal=True)
        except fa.KvCacheIndexError as exc:  # raised by the first call that finds the bad step's check finished
            raised.append(str(exc))
            out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, new_k[step], new_k[step], cache_seqlens=lens,
                                             causal=True)
        lens += 1
    try:
        fa.check_pending_errors()
    except fa.KvCacheIndexError as exc:
        raised.append(str(exc))
    assert len(raised) == 1 and f"cache_seqlens[2]={steps} is out of range" in raised[0]
    assert out.isfinite().all()
    valid = [s for s in range(steps) if s != bad_step]
    assert torch.equal(k_cache[:, :len(valid)], new_k[valid, :, 0].transpose(0, 1))
    assert torch.equal(v_cache[:, :len(valid)], new_k[valid, :, 0].transpose(0, 1))
    fa.check_pending_errors()


@pytest.mark.parametrize("kernels", ["one", "two"])
@pytest.mark.parametrize("layout", ["dense", "spare_rows", "batch_idx", "paged"])
@pytest.mark.parametrize("new", [1, 3])
def test_the_fused_triton_append_matches_the_torch_op_check_bit_for_bit(manager, monkeypatch, layout, new, kernels):
    """The check and append as Triton kernels (the GPU default, core/opdispatch/compat/_kv_append.py: one kernel, or two
    for a large block table — forced here) against the same check written with torch ops
    (OPDISPATCH_KV_APPEND=torch): a decode loop of valid steps, then one step with a bad index each kind of layout
    can have — caches and outputs equal bit for bit, the bad step NaN, nothing written, the same error raised."""
    from opdispatch.compat import _kv_append
    from opdispatch.compat import flash_attn as fa

    if kernels == "two":
        monkeypatch.setattr(_kv_append, "SINGLE_MAX_TABLE", -1)

    dev, i32, batch, heads_k, dim, page = "cuda", torch.int32, 5, 2, 64, 16
    gen = torch.Generator(device=dev).manual_seed(new)
    pool = {"dense": batch, "spare_rows": batch + 3, "batch_idx": batch + 3, "paged": 40}[layout]
    keys = 4 * page if layout != "paged" else page
    k_cache = torch.randn(pool, keys, heads_k, dim, device=dev, dtype=torch.float16, generator=gen)
    index = {}
    if layout == "batch_idx":
        index["cache_batch_idx"] = torch.tensor([6, 0, 3, 7, 1], dtype=i32, device=dev)
    if layout == "paged":
        index["block_table"] = torch.randperm(pool, device=dev, generator=gen)[:batch * 4].view(batch, 4).to(i32)
    steps = [(torch.randn(batch, 1, 8, dim, device=dev, dtype=torch.float16, generator=gen),
              torch.randn(batch, new, heads_k, dim, device=dev, dtype=torch.float16, generator=gen),
              torch.randn(batch, new, heads_k, dim, device=dev, dtype=torch.float16, generator=gen))
             for _ in range(6)]
    results = {}
    for append in ("triton", "torch"):
        monkeypatch.setenv("OPDISPATCH_KV_APPEND", append)
        fa._api.get_manager().fast.clear()  # bind afresh under this append
        caches = k_cache.clone(), k_cache.clone().mul_(-1)
        lens = torch.tensor([0, 3, 17, 30, 9], dtype=i32, device=dev)
        outs = []
        for q, k, v in steps:
            outs.append(fa.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens, causal=True, **index))
            lens += new
        bound = [b for b in fa._api.get_manager().fast.values() if type(b).__name__ == "_KvcacheBound"]
        assert [b.fused is not None for b in bound] == [append == "triton"]
        if append == "triton":
            # Steps 2..6 (bound) launched both kernels through their CompiledKernels (core.compat._triton_direct):
            # only the first bound step went through JITFunction.run, and no direct launch failed.
            fused = bound[0].fused
            launched = ([fused.verdict_append] if kernels == "one" else [fused.verdict, fused.append])
            assert fused.single is (kernels == "one")
            assert all(k is not None and k.kernel is not None and k.jit_launches == 1 for k in launched)
            assert (fused.verdict_append is None) is (kernels == "two")
            # The NaN kernel too; the verdict kernel wrote its report straight into the pinned ring row (the
            # device addressed it: no fallback to a device report), and every step reused one set of buffers.
            assert fused.poisoner.kernel is not None and fused.poisoner.jit_launches == 1
            assert fused.report_on_host and len(fused.scratches) == 1
        bad = lens.clone()
        bad[3] = 4 * page  # no room left for the append
        before = caches[0].clone(), caches[1].clone()
        poisoned = fa.flash_attn_with_kvcache(steps[0][0], *caches, steps[0][1], steps[0][2], cache_seqlens=bad,
                                              causal=True, **index)
        assert poisoned.isnan().all()
        assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
        with pytest.raises(fa.KvCacheIndexError) as info:
            fa.check_pending_errors()
        results[append] = caches, outs, str(info.value)
    assert _kv_append._triton() is not None
    (fused_caches, fused_outs, fused_error), (torch_caches, torch_outs, torch_error) = results.values()
    assert torch.equal(fused_caches[0], torch_caches[0]) and torch.equal(fused_caches[1], torch_caches[1])
    assert all(torch.equal(a, b) for a, b in zip(fused_outs, torch_outs))
    assert fused_error == torch_error and "cache_seqlens[3]=" in fused_error
