"""KV-cache calls through the vendor adapters (CPU, fakes mirroring the real signatures and their asserts) and
their selection on simulated devices.

The fakes compute in float64 with `tests/fakes/_fa_math` and gather pages themselves; they are compared with
`reference.math`, which shares neither.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import opdispatch
from opdispatch import validate_attention
from opdispatch.vendors.flagos import FlagGemsAttention
from opdispatch.vendors.nvidia import CudnnAttention, FlashAttn2, FlashAttn3
from opdispatch.vendors.rocm import RocmAiter, RocmFlashAttnCK
from tests.conftest import device_descriptor
from tests.fakes import _fa_math as fa_math
from tests.fakes import aiter as fake_aiter
from tests.fakes import flag_gems as fake_flag_gems
from tests.fakes import flash_attn as fake_fa2
from tests.fakes import flash_attn_interface as fake_fa3
from tests.fakes import flash_attn_rocm as fake_rocm


H100 = opdispatch.DeviceInfo(vendor="nvidia", type="cuda", arch="sm90", name="H100", index=0, capability=(9, 0))


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3)
    fake_flag_gems.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter.make([]))


def _pages(used, page_size, heads, dim, dtype, gen):
    """Pools holding each sequence's keys on shuffled pages, plus noise pages; (k, v, block_table)."""
    need = [-(-n // page_size) for n in used]
    total = sum(need) + 2
    order = torch.randperm(total, generator=gen)
    table = torch.zeros(len(used), max(need) + 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    k = torch.randn(total, page_size, heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, page_size, heads, dim, generator=gen).to(dtype)
    return k, v, table


def _case(kind, *, page_size, dtype, gen, causal=True, window=None, alibi=False):
    """A validated KV-cache call of `kind`: dense (dense q, dense cache), paged (dense q), thd-paged, thd."""
    h, hk, d = 4, 2, 32
    used = [5, 0, 1, 3 * page_size - 1] if page_size > 1 else [5, 0, 1, 9]
    seqused = torch.tensor(used, dtype=torch.int32)
    lens_q = [2, 1, 1, 3]
    kw = dict(causal=causal, window=window, causal_alignment="bottom_right", return_lse=True, seqused_k=seqused)
    if alibi:
        kw["alibi_slopes"] = torch.rand(h, generator=gen) + 0.1
    if kind in ("dense", "paged"):
        q = torch.randn(len(used), 2, h, d, generator=gen).to(dtype)
    else:
        q = torch.randn(sum(lens_q), h, d, generator=gen).to(dtype)
        kw.update(layout="thd", cu_seqlens_q=torch.tensor([0, 2, 3, 4, 7], dtype=torch.int32))
    if kind == "dense":
        cap = -(-(max(used) + 2) // page_size) * page_size  # whole pages: a kernel may read it one page per row
        k, v = (torch.randn(len(used), cap, hk, d, generator=gen).to(dtype) for _ in range(2))
    elif kind == "thd":
        spans = [n + 2 for n in used]
        k, v = (torch.randn(sum(spans), hk, d, generator=gen).to(dtype) for _ in range(2))
        kw["cu_seqlens_k"] = torch.tensor([0] + torch.tensor(spans).cumsum(0).tolist(), dtype=torch.int32)
    else:
        k, v, kw["block_table"] = _pages(used, page_size, hk, d, dtype, gen)
    return validate_attention(q, k, v, **kw)


def _assert_matches_reference(manager, call, result, tol):
    manager.ensure_initialized()
    ref_out, ref_lse = manager.registry.get("attention", "reference.math").impl.run(call)
    out, lse = result
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out.double(), atol=tol, rtol=tol)
    finite = torch.isfinite(ref_lse)
    assert not finite.all(), "each case has queries that see no key"
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    assert (lse[~finite] == -math.inf).all()


ADAPTERS = {
    # impl, the kinds its vendor entry takes, page size, dtype, tolerance
    "flash_attn": (FlashAttn2, ("dense", "paged", "thd-paged"), 256, torch.float16, 2e-3),
    "flash_attn3": (FlashAttn3, ("dense", "paged", "thd-paged", "thd"), 3, torch.bfloat16, 1e-2),
    "flag_gems": (FlagGemsAttention, ("dense", "paged", "thd-paged"), 3, torch.float16, 2e-3),
    "aiter": (RocmAiter, ("dense", "paged", "thd-paged"), 256, torch.float16, 2e-3),
}


@pytest.mark.parametrize("name, kind", [(n, k) for n, (_, kinds, *_r) in ADAPTERS.items() for k in kinds])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_adapters_compute_kv_cache_calls(name, kind, window, fakes, manager):
    impl_type, _kinds, page_size, dtype, tol = ADAPTERS[name]
    gen = torch.Generator().manual_seed(len(name) * 7 + len(kind))
    call = _case(kind, page_size=page_size, dtype=dtype, gen=gen, window=window)
    impl = impl_type()
    assert impl.not_supported_reasons(call, H100) == []
    _assert_matches_reference(manager, call, impl.run(impl.conform(call)), tol)


@pytest.mark.parametrize("name, kind", [(n, k) for n, (impl, kinds, *_r) in ADAPTERS.items() for k in kinds
                                        if impl.caps.kv_cache_alibi])
def test_adapters_fold_alibi_at_each_sequences_fill(name, kind, fakes, manager):
    impl_type, _kinds, page_size, dtype, tol = ADAPTERS[name]
    gen = torch.Generator().manual_seed(len(name) * 5 + len(kind))
    # Not causal: with causal ALiBi these kernels' LSE carries a row-dependent offset (declared elsewhere).
    call = _case(kind, page_size=page_size, dtype=dtype, gen=gen, alibi=True, causal=False)
    impl = impl_type()
    assert impl.not_supported_reasons(call, H100) == []
    _assert_matches_reference(manager, call, impl.run(impl.conform(call)), tol)


def test_alibi_over_a_kv_cache_is_declared(manager):
    gen = torch.Generator().manual_seed(4)
    call = _case("dense", page_size=1, dtype=torch.bfloat16, gen=gen, alibi=True)
    assert "ALiBi over a KV cache not supported (its distances follow each sequence's fill)" in \
        CudnnAttention().not_supported_reasons(call, H100)  # ALiBi yes, a KV cache yes, both together no
    assert not any("ALiBi over a KV cache" in r for r in FlagGemsAttention().not_supported_reasons(call, H100))
    no_alibi = [r for r in FlashAttn3().not_supported_reasons(call, H100) if "ALiBi" in r]
    assert no_alibi == ["ALiBi slopes not supported"]  # said once, not again for the cache


def _fake_efficient_attention(calls):
    """torch's _scaled_dot_product_efficient_attention contract in float64: no GQA (equal head counts), the additive
    bias as given, a query whose keys are all masked gets zeros; LSE padded to a multiple of 32 queries."""
    def fake(q, k, v, bias, need_lse, dropout_p, is_causal, scale=None):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the kernel has no GQA"
        assert bias is not None and bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        assert not is_causal and dropout_p == 0.0
        calls.append(tuple(q.shape))
        scores = (q.double() @ k.double().transpose(-1, -2)) * scale + bias.double()
        lse = torch.logsumexp(scores, -1)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        padded = torch.zeros((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), dtype=torch.float32)
        padded[:, :, : lse.shape[2]] = lse.nan_to_num(0.0, neginf=0.0)  # the kernel's LSE is not -inf there
        return (probs @ v.double()).to(q.dtype), padded, None, None
    return fake


@pytest.mark.parametrize("alignment, window, seqlen_q", [
    ("bottom_right", None, 1), ("bottom_right", None, 2), ("bottom_right", (2, 0), 2), ("top_left", None, 3)])
def test_mem_efficient_takes_a_dense_cache_as_a_bias_with_gqa_folded(alignment, window, seqlen_q, manager,
                                                                     monkeypatch):
    from opdispatch.vendors.nvidia import _attention as nv

    calls: list = []
    monkeypatch.setattr(nv, "_efficient_sdpa", _fake_efficient_attention(calls))
    gen = torch.Generator().manual_seed(seqlen_q * 11 + len(alignment))
    used = torch.tensor([5, 0, 1, 9], dtype=torch.int32)
    q = torch.randn(4, seqlen_q, 4, 32, generator=gen).half()
    k, v = (torch.randn(4, 12, 2, 32, generator=gen).half() for _ in range(2))
    call = validate_attention(q, k, v, seqused_k=used, causal=True, causal_alignment=alignment, window=window,
                              return_lse=True)
    impl = nv.MemEfficientAttention()
    assert impl.not_supported_reasons(call, H100) == []
    _assert_matches_reference(manager, call, impl.run(impl.conform(call)), 2e-3)
    assert calls == [(4, 2, 2 * seqlen_q, 32)]  # one call over the kv heads, each group's query heads stacked


def test_flash_attn_2_entries_and_limits(fakes, manager):
    gen = torch.Generator().manual_seed(1)
    impl = FlashAttn2()
    call = _case("paged", page_size=256, dtype=torch.float16, gen=gen)
    impl.run(call)
    assert fake_fa2.calls[-1] == ("flash_attn_with_kvcache", {"paged": True, "causal": True})
    small = _case("paged", page_size=16, dtype=torch.float16, gen=gen)
    assert "page size 16 is not a multiple of 256" in impl.not_supported_reasons(small, H100)
    unpaged = _case("thd", page_size=1, dtype=torch.float16, gen=gen)
    assert any("takes no seqused_k" in r for r in impl.extra_reasons(unpaged, H100))
    top_left = validate_attention(call.q, call.k, call.v, seqused_k=call.seqused_k, block_table=call.block_table,
                                  causal=True)
    assert any("aligns to the end" in r for r in impl.extra_reasons(top_left, H100))
    q = call.q.clone().requires_grad_()
    training = validate_attention(q, call.k, call.v, seqused_k=call.seqused_k, block_table=call.block_table,
                                  causal=True, causal_alignment="bottom_right")
    assert any("no backward" in r for r in impl.extra_reasons(training, H100))


def test_aiter_says_what_its_paged_entry_cannot_take(fakes, manager, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    impl = RocmAiter()
    dense = _case("dense", page_size=256, dtype=torch.float16, gen=gen)
    ragged = validate_attention(dense.q, dense.k[:, :300], dense.v[:, :300], seqused_k=dense.seqused_k.clamp(max=300),
                                causal=True, causal_alignment="bottom_right")
    assert any("a dense KV cache of 300 positions" in r and "multiple of 256" in r
               for r in impl.extra_reasons(ragged, H100))
    small = _case("paged", page_size=16, dtype=torch.float16, gen=gen)
    assert "page size 16 is not a multiple of 256" in impl.not_supported_reasons(small, H100)
    unpaged = _case("thd", page_size=1, dtype=torch.float16, gen=gen)
    assert any("takes block_table, not seqused_k" in r for r in impl.extra_reasons(unpaged, H100))

    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                   softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                   return_lse=False, return_attn_probs=False):
        raise AssertionError("never called")

    monkeypatch.setattr(sys.modules["aiter"], "flash_attn_varlen_func", old_varlen)
    paged = _case("paged", page_size=256, dtype=torch.float16, gen=gen)
    assert any("takes no block_table" in r for r in impl.extra_reasons(paged, H100))


def test_flag_gems_reads_a_dense_cache_as_pages_only_in_bshd(fakes, manager):
    gen = torch.Generator().manual_seed(2)
    call = _case("dense", page_size=1, dtype=torch.float16, gen=gen)
    bhsd = validate_attention(call.q.transpose(1, 2), call.k.transpose(1, 2), call.v.transpose(1, 2), layout="bhsd",
                              seqused_k=call.seqused_k, causal=True, causal_alignment="bottom_right")
    reasons = FlagGemsAttention().extra_reasons(bhsd, H100)
    assert any("needs layout 'bshd'" in r for r in reasons)


# -- selection on simulated devices ---------------------------------------------------------------------------

META = dict(device="meta", dtype=torch.bfloat16)


def _decode(page_size=None, batch=8, cap=4096):
    q = torch.empty(batch, 1, 32, 128, **META)
    used = torch.empty(batch, device="meta", dtype=torch.int32)
    if page_size is None:
        k = torch.empty(batch, cap, 8, 128, **META)
        return (q, k, k.clone()), dict(seqused_k=used)
    pages = batch * cap // page_size
    k = torch.empty(pages, page_size, 8, 128, **META)
    table = torch.empty(batch, cap // page_size, device="meta", dtype=torch.int32)
    return (q, k, k.clone()), dict(seqused_k=used, block_table=table)


# What the default policy picks for a decode step over a KV cache (bf16, 32/8 heads, d128): every fused kernel
# that can take it comes before the reference; where none can, the reference takes it and each kernel says why.
EXPECTED = {
    # torch's FA2 takes pages of any size (natively, or gathered into rows: 0.29 vs 0.52 ms for flagos.triton's
    # paged kernel on an H100, benchmarks/results/kv_cache-h100.md).
    ("h100", None): "nvidia.flash", ("h100", 16): "nvidia.flash", ("h100", 256): "nvidia.flash",
    ("h200", None): "nvidia.flash", ("h200", 16): "nvidia.flash", ("h200", 256): "nvidia.flash",
    ("a100", None): "nvidia.flash", ("a100", 256): "nvidia.flash", ("a100", 16): "nvidia.flash",
    ("mi300x", None): "rocm.aiter", ("mi300x", 256): "rocm.aiter",  # its varlen entry's block_table
    ("mi300x", 16): "flagos.triton",  # aiter's pages must hold 256 keys here, CK takes no pages; FlagGems' do
}


@pytest.mark.parametrize("device, page_size", list(EXPECTED))
def test_decode_over_a_kv_cache_on_simulated_devices(device, page_size, manager, monkeypatch):
    if device == "mi300x":
        monkeypatch.setitem(sys.modules, "flash_attn", fake_rocm.make([]))
    args, kw = _decode(page_size)
    decision = opdispatch.explain(*args, causal=True, causal_alignment="bottom_right",
                                  device=str(device_descriptor(device)), **kw)
    assert decision.chosen_id == EXPECTED[device, page_size], str(decision)
    for candidate in decision.candidates:
        if candidate.impl_id == "flagos.flash_mla":  # paged MLA decode only (576/512): refuses head_dim 128
            if candidate.status != "unavailable":  # unavailable: flag_gems not in the descriptor
                assert candidate.status == "rejected" and "head_dim 128" in candidate.reasons[0], candidate.reasons
        elif candidate.status == "rejected":
            assert any("KV cache" in r or "page size" in r or "block_table" in r for r in candidate.reasons), \
                (candidate.impl_id, candidate.reasons)


def test_rocm_ck_takes_a_dense_cache(manager, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_rocm.make(calls))
    gen = torch.Generator().manual_seed(3)
    call = _case("dense", page_size=1, dtype=torch.float16, gen=gen)
    impl = RocmFlashAttnCK()
    assert impl.extra_reasons(call, H100) == []
    _assert_matches_reference(manager, call, impl.run(impl.conform(call)), 2e-3)
    assert calls[-1][0] == "flash_attn_with_kvcache"
    paged = _case("paged", page_size=4, dtype=torch.float16, gen=gen)
    assert "paged KV cache (block_table) not supported" in impl.not_supported_reasons(paged, H100)


def _fake_varlen_flash_forward(seen):
    """aten._flash_attention_forward's packed path (cu_seqlens, seqused_k, block_table when the op has it), per
    sequence through the fakes' shared math (`tests.fakes._fa_math`): each sequence's queries over its first
    seqused_k keys — rows from its cu_seqlens_k offset, or its block table's used pages — causal and the window
    aligned bottom-right. Returns (out, lse packed (heads, total_q), ...)."""
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug, *, scale, seqused_k,
             window_size_left=-1, window_size_right=-1, block_table=None):
        seen.append("native" if block_table is not None else "rows")
        outs, lses = [], []
        for b in range(len(cu_q) - 1):
            n = int(seqused_k[b])
            assert n <= max_k
            start = 0 if block_table is not None else int(cu_k[b])
            keys, values = (fa_math.sequence_keys(t, b, n, block_table, start) for t in (k, v))
            queries = q[int(cu_q[b]):int(cu_q[b + 1])]
            out, lse = fa_math.attend(queries[None], keys[None], values[None], scale, causal,
                                      (window_size_left, window_size_right), 0.0, None, n - queries.shape[0],
                                      blind_lse=-math.inf)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1), None, None, None
    return fake


@pytest.mark.parametrize("page_size, native", [(3, False), (16, False), (256, False), (256, True)],
                         ids=["pages3-gathered", "pages16-gathered", "pages256-gathered", "pages256-native"])
@pytest.mark.parametrize("kind", ["paged", "thd-paged"])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_torch_flash_takes_paged_caches_of_any_page_size(page_size, native, kind, window, manager, monkeypatch):
    """torch's FA2 reads pages natively where its op takes block_table and pages hold 256 keys; other pages (and
    a torch without block_table: 2.11) are gathered into rows first. Both agree with reference.math, with
    queries that see no key, an empty sequence and block-table entries past the used pages that name no page."""
    import opdispatch.vendors.nvidia._attention as nv

    seen = []
    monkeypatch.setattr(nv, "_flash_forward", _fake_varlen_flash_forward(seen))
    names = set(nv._FLASH_FORWARD_ARGS) | {"block_table", "seqused_k"}
    monkeypatch.setattr(nv, "_FLASH_FORWARD_ARGS", frozenset(names if native else names - {"block_table"}))
    gen = torch.Generator().manual_seed(page_size + len(kind))
    call = _case(kind, page_size=page_size, dtype=torch.bfloat16, gen=gen, window=window)
    pages_used = (call.seqused_k.long() + page_size - 1) // page_size
    unused = torch.arange(call.block_table.shape[1])[None, :] >= pages_used[:, None]
    assert unused.any()
    call.block_table.masked_fill_(unused, 10 ** 6)  # past each sequence's pages: names no page
    impl = nv.TorchFlashAttention()
    assert impl.not_supported_reasons(call, H100) == []
    out, lse = impl.run(impl.conform(call))
    assert seen == ["native" if native else "rows"]
    manager.ensure_initialized()
    ref_out, ref_lse = manager.registry.get("attention", "reference.math").impl.run(call)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    assert not finite.all() and (lse[~finite] == -math.inf).all()
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), atol=1e-3, rtol=1e-3)


def test_torch_flash_declines_a_gather_past_its_bound(manager, monkeypatch):
    """A block table far wider than the pages in use would copy gigabytes per call: declined with the size and the
    fix, and the decision class tells the two sizes apart."""
    import opdispatch.vendors.nvidia._attention as nv

    monkeypatch.setattr(nv, "_FLASH_FORWARD_ARGS", frozenset(nv._FLASH_FORWARD_ARGS) - {"block_table"})
    args, kw = _decode(16)
    impl = nv.TorchFlashAttention()
    small = validate_attention(*args, causal=True, causal_alignment="bottom_right", **kw)
    assert impl.not_supported_reasons(small, H100) == []
    wide = dict(kw, block_table=torch.empty(kw["block_table"].shape[0], 2 ** 16, device="meta", dtype=torch.int32))
    big = validate_attention(*args, causal=True, causal_alignment="bottom_right", **wide)
    reasons = impl.not_supported_reasons(big, H100)
    assert any("MiB" in r and "narrow the block table" in r for r in reasons), reasons
    assert impl.selection_key(small) != impl.selection_key(big)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mem_efficient_takes_paged_mla_decode_by_gathering_pages(page_size, manager, monkeypatch):
    """MLA's absorbed decode over a paged cache (576/512, one kv head; 16-key pages are vLLM's default) reaches
    mem_efficient after its pages are gathered into a dense cache: against reference.math, with an empty sequence
    and table entries past the used pages that name no page; on a simulated H100 it is the pick."""
    from opdispatch.vendors.nvidia import _attention as nv

    calls: list = []
    monkeypatch.setattr(nv, "_efficient_sdpa", _fake_efficient_attention(calls))
    gen = torch.Generator().manual_seed(page_size)
    used = [5, 0, 17]
    k, v, table = _pages(used, page_size, 1, 576, torch.float16, gen)
    v = v[..., :512]
    pages_used = (torch.tensor(used) + page_size - 1) // page_size
    table.masked_fill_(torch.arange(table.shape[1])[None, :] >= pages_used[:, None], 10 ** 6)
    q = torch.randn(len(used), 1, 16, 576, generator=gen).half()
    call = validate_attention(q, k, v, seqused_k=torch.tensor(used, dtype=torch.int32), block_table=table,
                              causal=True, causal_alignment="bottom_right", return_lse=True)
    impl = nv.MemEfficientAttention()
    assert impl.not_supported_reasons(call, H100) == []
    _assert_matches_reference(manager, call, impl.run(impl.conform(call)), 2e-3)
    assert calls and calls[0][1] == 1  # one kv head, the query heads stacked
    meta = dict(device="meta", dtype=torch.bfloat16)
    args = (torch.empty(8, 1, 128, 576, **meta), torch.empty(8 * 256, 16, 1, 576, **meta),
            torch.empty(8 * 256, 16, 1, 512, **meta))
    decision = opdispatch.explain(*args, seqused_k=torch.empty(8, device="meta", dtype=torch.int32),
                                  block_table=torch.empty(8, 256, device="meta", dtype=torch.int32), causal=True,
                                  causal_alignment="bottom_right", device=str(device_descriptor("h100")))
    assert decision.chosen_id == "nvidia.mem_efficient", str(decision)
