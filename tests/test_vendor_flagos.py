"""flagos.triton on CPU against a fake flag_gems that mirrors 5.0.2's signatures and conventions."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.conftest import randn
from tests.fakes import flag_gems as fake_flag_gems
from opdispatch import validate_attention
from opdispatch.vendors.flagos import FlagGemsAttention
from opdispatch.vendors.flagos._attention import BACKWARD_REASON, capacity_pools, uses_varlen_kernel


@pytest.fixture
def gems(monkeypatch):
    return fake_flag_gems.install(monkeypatch)


def _ref(manager):
    manager.ensure_initialized()
    return manager.registry.get("attention", "reference.math").impl


def _check(manager, call):
    out, lse = FlagGemsAttention().run(call)
    ref_out, ref_lse = _ref(manager).run(call)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3)
    assert (lse[~finite] == -math.inf).all()


def test_dense_sdpa_path_mapping(manager, gems, rng):
    q = randn(2, 20, 8, 64, dtype=torch.bfloat16, gen=rng)
    k = randn(2, 33, 2, 64, dtype=torch.bfloat16, gen=rng)
    v = randn(2, 33, 2, 64, dtype=torch.bfloat16, gen=rng)
    mask = torch.rand(2, 1, 20, 33, generator=rng) > 0.4
    mask[..., 0] = True
    call = validate_attention(q, k, v, causal=True, attn_mask=mask, return_lse=True)
    assert not uses_varlen_kernel(call)
    _check(manager, call)  # base-2 M converted to natural log; bool mask passed as float, not inverted
    name, kw = fake_flag_gems.calls[-1]
    assert name == "scaled_dot_product_attention_forward" and kw == {"is_causal": True, "enable_gqa": True}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_shape", [(2, 1, 20, 33), (20, 33), (2, 8, 20, 33)])
def test_masks_in_every_dtype_with_rows_they_blind(manager, gems, rng, dtype, mask_shape):
    """A mask in float16 (its -1e6 overflowed half: masked_fill raised, validate on an H200) and rows a mask
    blinds (the kernel averaged their values: 0.16 off in bf16): zeros and an LSE of -inf, like the reference."""
    q = randn(2, 20, 8, 64, dtype=dtype, gen=rng)
    k = randn(2, 33, 2, 64, dtype=dtype, gen=rng)
    v = randn(2, 33, 2, 64, dtype=dtype, gen=rng)
    mask = torch.rand(*mask_shape, generator=rng) > 0.4
    mask[..., 3, :] = False  # row 3 sees no key
    mask[..., 4, 1:] = False  # row 4 sees one
    mask[..., 4, 0] = True
    call = validate_attention(q, k, v, attn_mask=mask, return_lse=True)
    out, lse = FlagGemsAttention().run(call)
    assert (out[:, 3] == 0).all() and (lse[:, :, 3] == -math.inf).all()
    assert not out.isnan().any()
    _check(manager, call)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_mask_and_the_causal_pattern_that_together_blind_a_row(manager, gems, rng, dtype):
    """Row 0 of a causal call may see key 0 only; a mask that allows every key but 0 leaves it none, though the
    mask alone blinds nothing: zeros and an LSE of -inf, as the reference."""
    q, k, v = (randn(1, 6, 2, 64, dtype=dtype, gen=rng) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 0, 0] = False
    call = validate_attention(q, k, v, causal=True, attn_mask=mask, return_lse=True)
    assert not uses_varlen_kernel(call)
    out, lse = FlagGemsAttention().run(call)
    assert (out[:, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()
    _check(manager, call)


def test_varlen_path_mapping(manager, gems, rng):
    lens_q, lens_k = [5, 17, 1], [9, 17, 30]
    q = randn(sum(lens_q), 8, 64, dtype=torch.float16, gen=rng)
    k = randn(sum(lens_k), 2, 64, dtype=torch.float16, gen=rng)
    v = randn(sum(lens_k), 2, 64, dtype=torch.float16, gen=rng)
    cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 26, 56], dtype=torch.int32)
    call = validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                              causal_alignment="bottom_right", window=(4, 0), softcap=20.0, return_lse=True)
    _check(manager, call)
    assert fake_flag_gems.calls[-1] == ("flash_attn_varlen_func", {"max_seqlen_q": 17, "max_seqlen_k": 30})


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_dense_calls_packed_for_window_softcap_alibi(manager, gems, rng, layout):
    shape = (lambda s, h: (2, s, h, 32)) if layout == "bshd" else (lambda s, h: (2, h, s, 32))
    q = randn(*shape(40, 4), dtype=torch.bfloat16, gen=rng)
    k = randn(*shape(16, 4), dtype=torch.bfloat16, gen=rng)
    v = randn(*shape(16, 4), dtype=torch.bfloat16, gen=rng)
    br = dict(causal=True, causal_alignment="bottom_right", layout=layout, return_lse=True)
    _check(manager, validate_attention(q, k, v, **br))  # 24 queries see no key: out 0, lse -inf
    _check(manager, validate_attention(q, k, v, window=(3, 0), softcap=15.0, **br))
    _check(manager, validate_attention(q, k, v, layout=layout, alibi_slopes=torch.rand(4) * 0.2, return_lse=True,
                                       causal_alignment="bottom_right"))
    assert fake_flag_gems.calls[-1][0] == "flash_attn_varlen_func"


def test_declared_limits(manager, gems):
    impl = FlagGemsAttention()
    from opdispatch import load_device_descriptor
    from tests.conftest import device_descriptor

    h100 = load_device_descriptor(device_descriptor("h100"))
    q = torch.empty(1, 64, 4, 96, device="meta", dtype=torch.bfloat16)
    assert any("head_dim 96 not in" in r for r in impl.not_supported_reasons(validate_attention(q, q, q), h100))
    assert not impl.not_supported_reasons(validate_attention(q, q, q, softcap=10.0), h100)  # varlen kernel: d%8
    qg = torch.empty(1, 64, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    assert BACKWARD_REASON in impl.not_supported_reasons(validate_attention(qg, qg, qg), h100)
    alibi = torch.empty(4, device="meta")
    reasons = impl.not_supported_reasons(validate_attention(q, q, q, causal=True, alibi_slopes=alibi,
                                                            return_lse=True), h100)
    assert any("causal ALiBi" in r for r in reasons)
    k = torch.empty(1, 80, 4, 64, device="meta", dtype=torch.bfloat16)
    reasons = impl.not_supported_reasons(validate_attention(q[..., :64], k, k, alibi_slopes=alibi), h100)
    assert any("ALiBi is aligned bottom-right" in r for r in reasons)


def test_availability_reports_import_failure(monkeypatch, manager):
    import opdispatch


    monkeypatch.setitem(sys.modules, "flag_gems", None)  # import flag_gems -> ImportError
    dev = opdispatch.DeviceInfo(vendor="nvidia", type="cuda", arch="sm90", name="x", capability=(9, 0),
                                libraries={"flag_gems": "5.0.2"})
    reason = FlagGemsAttention().availability(dev)
    assert reason is not None and "flag_gems failed to import" in reason


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("window", [(0, 0), (50, 0), (300, 0), (3, -1), (-1, 2), None])
def test_windowed_kv_cache_with_fill_below_capacity(manager, gems, rng, paged, seqlen_q, window):
    """Issue 27: flag_gems 5.0.2 applies a window only when its left bound is set and then takes both bounds
    literally (a right bound of -1 hides the diagonal), and a causal decode's canonical window is (left, -1): the
    fake mirrors that, so this failed by ~3 before gems_window. GQA decode without a window also checks the LSE
    flag_gems scrambles (query groups swapped into the sequence dimension)."""
    fills, capacity, page = [400, 130, 37], 512, 64
    q = randn(3, seqlen_q, 8, 64, dtype=torch.float16, gen=rng)
    k = randn(3, capacity, 2, 64, dtype=torch.float16, gen=rng)
    v = randn(3, capacity, 2, 64, dtype=torch.float16, gen=rng)
    table = None
    if paged:
        order = torch.randperm(3 * capacity // page, generator=rng)
        k_pool, v_pool = torch.empty(3 * capacity // page, page, 2, 64, dtype=torch.float16), None
        k_pool[order] = k.reshape(-1, page, 2, 64)
        v_pool = torch.empty_like(k_pool)
        v_pool[order] = v.reshape(-1, page, 2, 64)
        k, v, table = k_pool, v_pool, order.view(3, -1).to(torch.int32)
    for causal in (True, False) if window is None or window[1] <= 0 else (False,):  # causal forbids right > 0
        call = validate_attention(q, k, v, causal=causal, causal_alignment="bottom_right", window=window,
                                  seqused_k=torch.tensor(fills, dtype=torch.int32), block_table=table,
                                  return_lse=True)
        assert not FlagGemsAttention().extra_reasons(call, None)
        _check(manager, call)


def test_left_only_window_with_more_queries_than_keys_is_refused(manager, gems, rng):
    q = randn(1, 40, 4, 32, dtype=torch.float16, gen=rng)
    k = randn(1, 16, 4, 32, dtype=torch.float16, gen=rng)
    call = validate_attention(q, k, k, window=(3, -1), causal_alignment="bottom_right", return_lse=True)
    reasons = FlagGemsAttention().extra_reasons(call, None)
    assert any("left-only window with more queries (40) than keys (16)" in r for r in reasons)
    fine = validate_attention(q[:, :16], k, k, window=(3, -1), causal_alignment="bottom_right", return_lse=True)
    assert not FlagGemsAttention().extra_reasons(fine, None)
    _check(manager, fine)


# -- FlagGems' vendors beyond NVIDIA (its runtime/backend/_<vendor> folders, 5.0.2) ------------------------------

def _device(vendor, type_="cuda", capability=None):
    import opdispatch

    return opdispatch.DeviceInfo(vendor=vendor, type=type_, arch="x", name="x", capability=capability,
                                 libraries={"flag_gems": "5.0.2"})


@pytest.mark.parametrize("vendor,type_", [("amd", "cuda"), ("iluvatar", "cuda"), ("kunlunxin", "cuda"),
                                          ("hygon", "cuda"), ("metax", "cuda"), ("mthreads", "musa"),
                                          ("cambricon", "mlu"), ("ascend", "npu")])
def test_available_where_flag_gems_detects_the_same_vendor(monkeypatch, vendor, type_):
    impl = FlagGemsAttention()
    fake_flag_gems.install(monkeypatch, vendor=vendor)
    assert impl.availability(_device(vendor, type_)) is None
    # FlagGems resolved another backend (GEMS_VENDOR wrong or its probe found another tool): refused, with the fix
    fake_flag_gems.install(monkeypatch, vendor="nvidia")
    reason = impl.availability(_device(vendor, type_))
    assert "flag_gems detected vendor 'nvidia'" in reason and f"GEMS_VENDOR={vendor}" in reason


def test_nvidia_still_needs_ampere(monkeypatch):
    fake_flag_gems.install(monkeypatch)
    assert "compute capability >= 8.0" in FlagGemsAttention().availability(_device("nvidia", capability=(7, 5)))
    assert FlagGemsAttention().availability(_device("nvidia", capability=(8, 0))) is None


@pytest.mark.parametrize("vendor", ["kunlunxin", "hygon"])
def test_varlen_entry_refused_where_flag_gems_skips_its_tests(manager, gems, rng, vendor):
    q = randn(1, 40, 4, 64, dtype=torch.bfloat16, gen=rng)
    k = randn(1, 40, 4, 64, dtype=torch.bfloat16, gen=rng)
    for kw in (dict(softcap=5.0), dict(causal=True, window=(8, 0)), dict(alibi_slopes=torch.rand(4))):
        call = validate_attention(q, k, k, **kw)
        assert uses_varlen_kernel(call)
        assert any("RESULT TODOFIX" in r for r in FlagGemsAttention().extra_reasons(call, _device(vendor)))
    dense = validate_attention(q, k, k, causal=True)
    assert FlagGemsAttention().extra_reasons(dense, _device(vendor)) == []


def test_kunlunxin_dense_kernel_returns_the_output_only(manager, monkeypatch, rng):
    fake_flag_gems.install(monkeypatch, vendor="kunlunxin")
    q = randn(2, 20, 8, 64, dtype=torch.bfloat16, gen=rng)
    k = randn(2, 33, 2, 64, dtype=torch.bfloat16, gen=rng)
    v = randn(2, 33, 2, 64, dtype=torch.bfloat16, gen=rng)
    mask = torch.rand(20, 33, generator=rng) > 0.3
    mask[3] = False  # a row the mask blinds: zeros
    with_lse = validate_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert any("returns the output only" in r
               for r in FlagGemsAttention().extra_reasons(with_lse, _device("kunlunxin")))
    call = validate_attention(q, k, v, attn_mask=mask)
    assert FlagGemsAttention().extra_reasons(call, _device("kunlunxin")) == []
    out = FlagGemsAttention().run(call)
    want = _ref(manager).run(call)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (out[:, 3] == 0).all()


# -- a growing KV cache sliced per step: one compiled kernel, not one per length -----------------------------

def _compile_keys(kernel):
    return {key for name, key in fake_flag_gems.compile_keys if name == kernel}


def _buffers(rng, batch, capacity, heads_kv, dim, dtype):
    """k and v buffers of `capacity` rows per sequence (the tests write NaN past each slice: a read would show)."""
    k = randn(batch, capacity, heads_kv, dim, dtype=dtype, gen=rng)
    v = randn(batch, capacity, heads_kv, dim, dtype=dtype, gen=rng)
    return k, v


def test_a_200_step_growing_decode_compiles_once_and_matches_the_oracle(manager, gems, rng):
    """The policy proof's decode shape in small (GQA 4:1, one query, causal bottom-right, k/v sliced from a
    fixed buffer): every step goes to the varlen kernel with the length as data (seqused_k) — one compile key over
    200 lengths, where 5.0.2's SDPA kernel would tune and compile once per length — and rows past the slice
    (NaN here) are never read."""
    batch, capacity, start, steps = 2, 260, 40, 200
    k_buf, v_buf = _buffers(rng, batch, capacity, 2, 64, torch.bfloat16)
    q = randn(batch, 1, 8, 64, dtype=torch.bfloat16, gen=rng)
    for n in range(start, start + steps):
        k_buf[:, n:] = math.nan
        v_buf[:, n:] = math.nan
        call = validate_attention(q, k_buf[:, :n], v_buf[:, :n], causal=True, causal_alignment="bottom_right",
                                  return_lse=True)
        if n % 40 == 0 or n == start + steps - 1:
            _check(manager, call)  # against reference.math, which reads only the slice
        else:
            out, lse = FlagGemsAttention().run(call)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        k_buf[:, n:] = randn(batch, capacity - n, 2, 64, dtype=torch.bfloat16, gen=rng)
        v_buf[:, n:] = randn(batch, capacity - n, 2, 64, dtype=torch.bfloat16, gen=rng)
    assert not _compile_keys("_attn_fwd")
    keys = _compile_keys("flash_varlen_fwd_kernel")
    assert len(keys) == 1 and dict(next(iter(keys)))["block_size"] == capacity


def test_a_contiguous_growing_k_still_goes_to_the_sdpa_kernel(manager, gems, rng):
    """A k that is not a slice of a longer buffer (reallocated each step) has nothing to widen: the SDPA kernel
    takes it, tuned per length — the limit this route leaves (documented in `capacity_pools`)."""
    q = randn(1, 1, 4, 64, dtype=torch.float16, gen=rng)
    for n in (30, 31, 32):
        k, v = (randn(1, n, 4, 64, dtype=torch.float16, gen=rng) for _ in range(2))
        _check(manager, validate_attention(q, k, v, causal=True, causal_alignment="bottom_right", return_lse=True))
    assert {dict(key)["KV_CTX"] for key in _compile_keys("_attn_fwd")} == {30, 31, 32}
    assert not _compile_keys("flash_varlen_fwd_kernel")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("seqlen_q,causal", [(1, True), (1, False), (5, True), (5, False), (37, True)])
@pytest.mark.parametrize("return_lse", [True, False])
def test_sliced_cache_combinations_against_the_oracle(manager, gems, rng, dtype, heads, seqlen_q, causal,
                                                      return_lse):
    """Chunked prefill and decode over a slice, MHA and GQA (the swapped one-query LSE put back in order),
    causal bottom-right or none, with and without the LSE, both half dtypes: the oracle's answer, one key."""
    hq, hkv = heads
    k_buf, v_buf = _buffers(rng, 3, 96, hkv, 32, dtype)
    q = randn(3, seqlen_q, hq, 32, dtype=dtype, gen=rng)
    for n in (40, 41, 64):
        k_buf[:, n:] = math.nan
        v_buf[:, n:] = math.nan
        call = validate_attention(q, k_buf[:, :n], v_buf[:, :n], causal=causal, causal_alignment="bottom_right",
                                  return_lse=return_lse, scale=0.3)
        if return_lse:
            _check(manager, call)
        else:
            out = FlagGemsAttention().run(call)
            ref_out, _ = _ref(manager).run(validate_attention(q, k_buf[:, :n], v_buf[:, :n], causal=causal,
                                                              causal_alignment="bottom_right", return_lse=True,
                                                              scale=0.3))
            torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        k_buf[:, n:] = 0.5
        v_buf[:, n:] = 0.5
    assert not _compile_keys("_attn_fwd") and len(_compile_keys("flash_varlen_fwd_kernel")) == 1


def test_calls_the_capacity_route_must_leave_to_the_sdpa_kernel(manager, gems, rng):
    """Each condition of `capacity_pools` on its edge: a mask (the varlen entry takes none), top-left causal with
    fewer queries than keys (the varlen kernel aligns bottom-right), more queries than keys, k and v from buffers
    of different capacity (one row stride addresses both), a bhsd slice (rows not adjacent), and a slice whose
    last sequence's capacity runs past the storage (widening would point outside it). All still exact."""
    k_buf, v_buf = _buffers(rng, 2, 80, 2, 64, torch.bfloat16)
    q = randn(2, 3, 4, 64, dtype=torch.bfloat16, gen=rng)
    k, v = k_buf[:, :50], v_buf[:, :50]
    mask = torch.rand(2, 1, 3, 50, generator=rng) > 0.3
    mask[..., 0] = True
    other_v = randn(2, 90, 2, 64, dtype=torch.bfloat16, gen=rng)[:, :50]
    k_bhsd = randn(2, 2, 80, 64, dtype=torch.bfloat16, gen=rng)[:, :, :50]
    v_bhsd = randn(2, 2, 80, 64, dtype=torch.bfloat16, gen=rng)[:, :, :50]
    flat_k = randn(80 * 128 + 50 * 128, dtype=torch.bfloat16, gen=rng)
    flat_v = randn(80 * 128 + 50 * 128, dtype=torch.bfloat16, gen=rng)
    short_k = flat_k.as_strided((2, 50, 2, 64), (80 * 128, 128, 64, 1))
    short_v = flat_v.as_strided((2, 50, 2, 64), (80 * 128, 128, 64, 1))
    q_long = randn(2, 60, 4, 64, dtype=torch.bfloat16, gen=rng)
    cases = [
        validate_attention(q, k, v, attn_mask=mask, return_lse=True),
        validate_attention(q, k, v, causal=True, causal_alignment="top_left", return_lse=True),
        validate_attention(q_long, k, v, causal=False, return_lse=True),
        validate_attention(q, k, other_v, causal=True, causal_alignment="bottom_right", return_lse=True),
        validate_attention(q.transpose(1, 2), k_bhsd, v_bhsd, layout="bhsd", causal=True,
                           causal_alignment="bottom_right", return_lse=True),
        validate_attention(q, short_k, short_v, causal=True, causal_alignment="bottom_right", return_lse=True),
    ]
    for call in cases:
        assert capacity_pools(call) is None
        _check(manager, call)
    # none of them went to the kernel as a cache over the buffer (bottom-right ones went packed)
    assert all(not dict(key)["is_paged"] for key in _compile_keys("flash_varlen_fwd_kernel"))
    fake_flag_gems.compile_keys.clear()
    # the same slice, bottom-right and maskless, does take the route
    routed = validate_attention(q, k, v, causal=True, causal_alignment="bottom_right", return_lse=True)
    assert capacity_pools(routed) is not None
    _check(manager, routed)
    assert len(_compile_keys("flash_varlen_fwd_kernel")) == 1


@pytest.mark.parametrize("features", [dict(window=(7, 0), causal=True), dict(window=(7, 3)), dict(window=(500, 0)),
                                      dict(softcap=5.0, causal=True),
                                      dict(alibi=True, causal=True), dict(alibi=True)])
def test_sliced_cache_with_window_softcap_alibi(manager, gems, rng, features):
    """Windows (a non-causal one whose right bound must survive, and a left bound beyond the buffer, which the
    kernel would drop together with the right bound), softcap and ALiBi over a slice: the oracle's answer at every
    length, one compile key (the window is stated against the buffer's capacity, not the length)."""
    kw = dict(features)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4, generator=rng) * 0.3
    k_buf, v_buf = _buffers(rng, 2, 120, 2, 64, torch.bfloat16)
    q = randn(2, 3, 4, 64, dtype=torch.bfloat16, gen=rng)
    for n in (20, 57, 100):
        k_buf[:, n:] = math.nan
        v_buf[:, n:] = math.nan
        call = validate_attention(q, k_buf[:, :n], v_buf[:, :n], causal_alignment="bottom_right", return_lse=True,
                                  **kw)
        assert capacity_pools(call) is not None
        _check(manager, call)
        k_buf[:, n:] = 0.25
        v_buf[:, n:] = 0.25
    assert not _compile_keys("_attn_fwd") and len(_compile_keys("flash_varlen_fwd_kernel")) == 1


# -- flagos.flash_mla: FlagGems' paged absorbed-MLA decode (5.0.2 src/flag_gems/fused/flash_mla.py) ----------------

def _mla_cache(rng, lengths, page, heads_q=16, heads_kv=1, dims=(576, 512), dtype=torch.bfloat16, layout="bshd"):
    """One-query decode over a shuffled page pool: q, k pool, v = k[..., :dv] (the same storage), lengths, table."""
    d, dv = dims
    pages_per_seq = max(-(-n // page) for n in lengths) + 1
    pool = len(lengths) * pages_per_seq + 3
    table = torch.randperm(pool, generator=rng)[:len(lengths) * pages_per_seq].view(len(lengths), pages_per_seq)
    k = randn(pool, page, heads_kv, d, dtype=dtype, gen=rng)
    q = randn(len(lengths), 1, heads_q, d, dtype=dtype, gen=rng)
    if layout == "bhsd":
        q = q.transpose(1, 2)
    return q, k, k[..., :dv], torch.tensor(lengths, dtype=torch.int32), table.to(torch.int32).contiguous()


def _mla_call(q, k, v, used, table, layout="bshd", **kw):
    kw.setdefault("causal", True)
    kw.setdefault("causal_alignment", "bottom_right")
    return validate_attention(q, k, v, layout=layout, seqused_k=used, block_table=table, **kw)


ILUVATAR = dict(vendor="iluvatar", capability=(7, 1))


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("lengths", [[700, 1, 130], [64, 65, 3, 0]])
@pytest.mark.parametrize("heads_q", [16, 20, 128])
@pytest.mark.parametrize("causal,layout", [(True, "bshd"), (False, "bshd"), (True, "bhsd")])
def test_flash_mla_against_the_oracle(manager, monkeypatch, rng, page, lengths, heads_q, causal, layout):
    """Pages of 16 and 64 keys, sequences of different lengths (one key, an empty one: 0/0 in the kernel, zeros
    here), h_q:1 GQA with head counts the kernel's BLOCK_H does not divide, bf16: against reference.math on the
    same paged cache. The fake reads V from blocked_k as the real kernel does."""
    from opdispatch.vendors.flagos import FlagGemsFlashMLA

    fake_flag_gems.install(monkeypatch, vendor="iluvatar")
    q, k, v, used, table = _mla_cache(rng, lengths, page, heads_q=heads_q, layout=layout)
    call = _mla_call(q, k, v, used, table, layout=layout, causal=causal)
    impl = FlagGemsFlashMLA()
    assert impl.not_supported_reasons(call, _device(**ILUVATAR)) == []
    out = impl.run(call)
    name, kw = fake_flag_gems.calls[-1]
    assert name == "flash_mla" and kw == dict(b=len(lengths), s_q=1, h_q=heads_q, h_kv=1, d=576, dv=512,
                                              block_size=page, max_seqlen_pad=table.shape[1] * page)
    ref = _ref(manager).run(call)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    if 0 in lengths:
        assert (out[lengths.index(0)] == 0).all()


def test_flash_mla_never_runs_with_a_separate_v(manager, monkeypatch, rng):
    """A v cache of its own (equal values, or other values) is refused: the kernel would read k's columns."""
    from opdispatch.vendors.flagos import FlagGemsFlashMLA

    fake_flag_gems.install(monkeypatch, vendor="iluvatar")
    q, k, v, used, table = _mla_cache(rng, [40, 17], 16)
    for other in (v.clone(), randn(*v.shape, dtype=v.dtype, gen=rng), k[..., 64:], k.clone()[..., :512]):
        call = _mla_call(q, k, other, used, table)
        reasons = FlagGemsFlashMLA().not_supported_reasons(call, _device(**ILUVATAR))
        assert any("v is not k[..., :512] of the same storage" in r for r in reasons), reasons
        with pytest.raises(ValueError, match="reads V from k"):
            FlagGemsFlashMLA().run(call)
    # and the refusal is not cached across the two: the prefix view of the same call class is taken
    assert FlagGemsFlashMLA().not_supported_reasons(_mla_call(q, k, v, used, table), _device(**ILUVATAR)) == []


def test_flash_mla_refuses_each_broken_assumption(manager, monkeypatch, rng):
    from opdispatch.vendors.flagos import FlagGemsFlashMLA

    fake_flag_gems.install(monkeypatch, vendor="iluvatar")
    impl, dev = FlagGemsFlashMLA(), _device(**ILUVATAR)
    q, k, v, used, table = _mla_cache(rng, [40, 17], 16)

    def reasons(*args, **kw):
        call = _mla_call(*args, **kw)
        assert impl.selection_key(call) is not None
        return " | ".join(impl.not_supported_reasons(call, dev))

    assert "scale 0.1" in reasons(q, k, v, used, table, scale=0.1)
    assert reasons(q, k, v, used, table, scale=576 ** -0.5) == ""  # the kernel's own scale, given explicitly
    assert "causal_alignment='top_left'" in reasons(q, k, v, used, table, causal_alignment="top_left")
    assert "return_lse" in reasons(q, k, v, used, table, return_lse=True)
    assert "window" in reasons(q, k, v, used, table, window=(8, 0))
    assert "softcap" in reasons(q, k, v, used, table, softcap=5.0)
    q2 = randn(2, 2, 16, 576, dtype=torch.bfloat16, gen=rng)
    assert "seqlen_q 2" in reasons(q2, k, v, used, table)
    qg = q.clone().requires_grad_(True)
    assert "backward" in reasons(qg, k, v, used, table)
    for dtype in (torch.float16, torch.float32):
        assert "dtype" in reasons(q.to(dtype), k.to(dtype), k.to(dtype)[..., :512], used, table)
    q192, k192, v128, _, _ = _mla_cache(rng, [40, 17], 16, dims=(192, 128))
    assert "head_dim 192" in reasons(q192, k192, v128, used, table)
    q576, k576, v448, _, _ = _mla_cache(rng, [40, 17], 16, dims=(576, 448))
    assert "v head_dim 448" in reasons(q576, k576, v448, used, table)
    q2h, k2h, v2h, _, _ = _mla_cache(rng, [40, 17], 16, heads_kv=2)
    assert "heads_kv 2" in reasons(q2h, k2h, v2h, used, table)
    wide = randn(k.shape[0], 16, 1, 640, dtype=torch.bfloat16, gen=rng)[..., :576]  # rows 640 apart
    assert "not contiguous" in reasons(q, wide, wide[..., :512], used, table)
    dense_k = randn(2, 48, 1, 576, dtype=torch.bfloat16, gen=rng)  # a dense cache: no block_table
    call = validate_attention(q, dense_k, dense_k[..., :512], causal=True, causal_alignment="bottom_right",
                              seqused_k=used)
    assert any("needs a paged KV cache" in r for r in impl.not_supported_reasons(call, dev))
    call = validate_attention(q, dense_k, dense_k[..., :512])  # no cache at all
    assert any("needs a paged KV cache" in r for r in impl.not_supported_reasons(call, dev))


@pytest.mark.parametrize("vendor,type_,capability,refusal", [
    ("nvidia", "cuda", (9, 0), None), ("nvidia", "cuda", (8, 0), None),
    ("nvidia", "cuda", (10, 0), "major 8 or 9"), ("iluvatar", "cuda", (7, 1), None),
    ("mthreads", "musa", (3, 1), None), ("mthreads", "musa", None, "major 3"), ("mthreads", "musa", (2, 2), "2.2"),
    ("cambricon", "mlu", None, None), ("kunlunxin", "cuda", None, "major 8 or 9"),
    ("metax", "cuda", None, "reports none"), ("hygon", "cuda", None, "op_black_list.yaml"),
    ("ascend", "npu", None, "_ascend backend has no flash_mla"), ("amd", "cuda", (9, 4), "LDS"),
])
def test_flash_mla_devices_where_flag_gems_has_tiles(monkeypatch, vendor, type_, capability, refusal):
    from opdispatch.vendors.flagos import FlagGemsFlashMLA

    fake_flag_gems.install(monkeypatch, vendor=vendor)
    reason = FlagGemsFlashMLA().availability(_device(vendor, type_, capability))
    if refusal is None:
        assert reason is None
    else:
        assert reason is not None and refusal in reason


def test_flash_mla_availability_follows_flag_gems(monkeypatch):
    from opdispatch.vendors.flagos import FlagGemsFlashMLA

    fake = fake_flag_gems.install(monkeypatch, vendor="nvidia")
    reason = FlagGemsFlashMLA().availability(_device(**ILUVATAR))
    assert "flag_gems detected vendor 'nvidia'" in reason and "GEMS_VENDOR=iluvatar" in reason
    fake.vendor_name = "iluvatar"
    monkeypatch.delattr(fake, "flash_mla")
    assert "no flash_mla" in FlagGemsFlashMLA().availability(_device(**ILUVATAR))


def test_paged_mla_selection_on_simulated_devices(manager):
    """explain on the shipped descriptors: FlagGems' kernel takes paged16 MLA decode where it has tiles for the
    declared chip (Iluvatar 7.x, Cambricon), NVIDIA keeps nvidia.mem_efficient (flash_mla is after it in the
    default order), the rest say why; a separate v cache is refused everywhere."""
    import opdispatch
    from tests.conftest import device_descriptor

    batch, page, pages_per_seq = 8, 16, 256

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    q, k = meta(batch, 1, 16, 576), meta(batch * pages_per_seq, page, 1, 576)
    kw = dict(causal=True, causal_alignment="bottom_right",
              seqused_k=torch.empty(batch, dtype=torch.int32, device="meta"),
              block_table=torch.empty(batch, pages_per_seq, dtype=torch.int32, device="meta"))
    expected = {"bi-v150": "flagos.flash_mla", "cambricon-mlu590": "flagos.flash_mla",
                "h100": "nvidia.mem_efficient", "a100": "nvidia.mem_efficient", "hygon-k100": "reference.math",
                "mthreads-s4000": "reference.math", "p800": "reference.math", "mi300x": "reference.math"}
    for name, chosen in expected.items():
        assert opdispatch.explain(q, k, k[..., :512], device=device_descriptor(name), **kw).chosen_id == chosen, name
        separate = opdispatch.explain(q, k, meta(batch * pages_per_seq, page, 1, 512),
                                      device=device_descriptor(name), **kw)
        assert separate.chosen_id != "flagos.flash_mla"
        if name == "bi-v150":
            said = [c.reasons for c in separate.candidates if c.impl_id == "flagos.flash_mla"][0]
            assert any("v is not k[..., :512]" in r for r in said)
