"""Hostile KV-cache indices (issue 27): every index of flash_attn_with_kvcache and of the op's own KV cache is
checked before anything is written — on the host (CPU: raised in the call) and on the device-side path (forced
on CPU with OPDISPATCH_KV_CHECKS=device: nothing written, NaN output, the error raised by the next call)."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch
from opdispatch.compat import flash_attn as fa
from opdispatch.compat.flash_attn import KvCacheIndexError, check_pending_errors
from tests.test_compat_flash_attn import oracle

I32 = torch.int32
BATCH, HEADS, HEADS_K, DIM, CAPACITY, NEW = 2, 4, 2, 16, 16, 3
PAGE, PAGES = 4, 10  # paged: 4 entries of 4 positions per row (capacity 16), a pool of 10 pages


def _setup(kind, gen):
    """The arguments of a valid call of `kind`: dense, batch_idx (3 cache rows, rows [2, 0]), leftpad, paged."""
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
    k_new, v_new = (torch.randn(BATCH, NEW, HEADS_K, DIM, generator=gen) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor([5, 9], dtype=I32), causal=True)
    if kind == "paged":
        k_cache, v_cache = (torch.randn(PAGES, PAGE, HEADS_K, DIM, generator=gen) for _ in range(2))
        kw["block_table"] = torch.tensor([[7, 2, 0, 0], [4, 1, 9, 3]], dtype=I32)  # row 0 uses 2 pages, row 1 3
    else:
        rows = 3 if kind == "batch_idx" else BATCH
        k_cache, v_cache = (torch.randn(rows, CAPACITY, HEADS_K, DIM, generator=gen) for _ in range(2))
    if kind == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([2, 0], dtype=I32)
    if kind == "leftpad":
        kw["cache_leftpad"] = torch.tensor([2, 0], dtype=I32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, **kw)


def _with(kw, **change):
    out = dict(kw)
    for name, value in change.items():
        if value is _DROP:
            out.pop(name)
        else:
            out[name] = value
    return out


_DROP = object()
_RANGE = "range"  # a value error the device-side path defers
_NOW = "now"  # an error both paths raise in the call (types, shapes, host ints: no device read needed)

# (kind, change, when, exception, message fragment)
HOSTILE = [
    # cache_seqlens: negative, past the end with the append, past the end without one, wrapping int64, float, bool
    ("dense", dict(cache_seqlens=torch.tensor([-1, 9], dtype=I32)), _RANGE, ValueError,
     r"cache_seqlens\[0\]=-1 is out of range; allowed: 0..13 \(the cache holds 16 positions per sequence with 3 new"),
    ("dense", dict(cache_seqlens=torch.tensor([5, 14], dtype=I32)), _RANGE, ValueError,
     r"cache_seqlens\[1\]=14 is out of range; allowed: 0..13"),
    ("dense", dict(cache_seqlens=torch.tensor([5, 17], dtype=I32), k=_DROP, v=_DROP), _RANGE, ValueError,
     r"cache_seqlens\[1\]=17 is out of range; allowed: 0..16"),
    ("paged", dict(cache_seqlens=torch.tensor([-3, 9], dtype=I32)), _RANGE, ValueError,
     r"cache_seqlens\[0\]=-3 is out of range; allowed: 0..13 \(.*4 pages of 4 in block_table"),
    ("paged", dict(cache_seqlens=torch.tensor([5, 15], dtype=I32)), _RANGE, ValueError,
     r"cache_seqlens\[1\]=15 is out of range"),
    ("batch_idx", dict(cache_seqlens=torch.tensor([-1, 0], dtype=I32)), _RANGE, ValueError,
     r"cache_seqlens\[0\]=-1"),
    ("leftpad", dict(cache_seqlens=torch.tensor([5, 20], dtype=I32)), _RANGE, ValueError, r"cache_seqlens\[1\]=20"),
    ("dense", dict(cache_seqlens=torch.tensor([2**32 + 5, 5])), _NOW, TypeError,
     r"cache_seqlens must be torch.int32 \(as in flash-attn\), got torch.int64; check the values fit"),
    ("paged", dict(cache_seqlens=torch.tensor([5.0, 9.0])), _NOW, TypeError,
     r"cache_seqlens must be torch.int32 .*got torch.float32; pass integer indices as torch.int32"),
    ("dense", dict(cache_seqlens=torch.tensor([True, False])), _NOW, TypeError, r"got torch.bool"),
    ("dense", dict(cache_seqlens=-1), _NOW, ValueError, r"cache_seqlens=-1 is out of range; allowed: 0..13"),
    ("dense", dict(cache_seqlens=14), _NOW, ValueError, r"cache_seqlens=14 is out of range"),
    ("dense", dict(cache_seqlens=True), _NOW, TypeError, r"cache_seqlens must be an int or an int32 tensor"),
    ("dense", dict(cache_seqlens=3.0), _NOW, TypeError, r"cache_seqlens must be an int or an int32 tensor"),
    ("dense", dict(cache_seqlens=torch.tensor([5], dtype=I32)), _NOW, ValueError,
     r"cache_seqlens must have shape \(2,\)"),
    # the append itself longer than the cache
    ("dense", dict(k=torch.zeros(BATCH, 17, HEADS_K, DIM), v=torch.zeros(BATCH, 17, HEADS_K, DIM),
                   cache_seqlens=0), _NOW, ValueError, r"k appends 17 keys per sequence but the cache holds 16"),
    ("dense", dict(v=torch.zeros(BATCH, NEW, HEADS_K, DIM, dtype=torch.float64)), _NOW, ValueError,
     r"v must be \(batch, seqlen_new, heads_k, dim\)"),
    # cache_batch_idx: negative, past the rows, duplicate rows when appending, int64, float
    ("batch_idx", dict(cache_batch_idx=torch.tensor([-1, 0], dtype=I32)), _RANGE, ValueError,
     r"cache_batch_idx\[0\]=-1 is out of range; allowed: 0..2 \(k_cache has 3 rows\)"),
    ("batch_idx", dict(cache_batch_idx=torch.tensor([2, 3], dtype=I32)), _RANGE, ValueError,
     r"cache_batch_idx\[1\]=3 is out of range"),
    ("batch_idx", dict(cache_batch_idx=torch.tensor([1, 1], dtype=I32)), _RANGE, ValueError,
     r"cache_batch_idx makes two sequences write the same slot \(at 1\); allowed: distinct rows"),
    ("batch_idx", dict(cache_batch_idx=torch.tensor([2, 0])), _NOW, TypeError,
     r"cache_batch_idx must be torch.int32 .*got torch.int64"),
    ("batch_idx", dict(cache_batch_idx=torch.tensor([2.0, 0.0])), _NOW, TypeError, r"got torch.float32"),
    # cache_leftpad: negative, past the sequence's end, int64, bool
    ("leftpad", dict(cache_leftpad=torch.tensor([-1, 0], dtype=I32)), _RANGE, ValueError,
     r"cache_leftpad\[0\]=-1 is out of range; allowed: 0..cache_seqlens\[b\] \+ 3"),
    ("leftpad", dict(cache_leftpad=torch.tensor([2, 13], dtype=I32)), _RANGE, ValueError,
     r"cache_leftpad\[1\]=13 is out of range"),
    ("leftpad", dict(cache_leftpad=torch.tensor([2, 0])), _NOW, TypeError, r"cache_leftpad must be torch.int32"),
    ("leftpad", dict(cache_leftpad=torch.tensor([True, False])), _NOW, TypeError, r"got torch.bool"),
    # block_table: a used page negative or past the pool, two sequences appending into one page, int64, float
    ("paged", dict(block_table=torch.tensor([[-1, 2, 0, 0], [4, 1, 9, 3]], dtype=I32)), _RANGE, ValueError,
     r"block_table\[0, 0\]=-1 is out of range; allowed: page ids 0..9 \(k_cache holds 10 pages\)"),
    ("paged", dict(block_table=torch.tensor([[7, 2, 0, 0], [4, 1, 10, 3]], dtype=I32)), _RANGE, ValueError,
     r"block_table\[1, 2\]=10 is out of range"),
    ("paged", dict(block_table=torch.tensor([[7, 9, 0, 0], [4, 1, 9, 3]], dtype=I32)), _RANGE, ValueError,
     r"block_table makes two sequences write the same slot \(at 9\)"),
    ("paged", dict(block_table=torch.tensor([[7, 2, 0, 0], [4, 1, 9, 3]])), _NOW, TypeError,
     r"block_table must be torch.int32 .*got torch.int64"),
    ("paged", dict(block_table=torch.tensor([[7.0, 2, 0, 0], [4, 1, 9, 3]])), _NOW, TypeError, r"got torch.float32"),
    ("paged", dict(block_table=torch.tensor([[7, 2, 0, 0]], dtype=I32)), _NOW, ValueError,
     r"block_table must have shape \(2, 4\)"),
]


def _ids():
    return [f"{i}-{kind}-{'-'.join(change)}" for i, (kind, change, *_) in enumerate(HOSTILE)]


@pytest.fixture
def device_path(monkeypatch):
    """The device-side check on CPU tensors (what accelerators run)."""
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    check_pending_errors()  # nothing left over from another test
    yield
    check_pending_errors()


@pytest.mark.parametrize("kind, change, when, error, match", HOSTILE, ids=_ids())
def test_hostile_index_raises_on_the_host_and_writes_nothing(basic_manager, kind, change, when, error, match):
    kw = _with(_setup(kind, torch.Generator().manual_seed(0)), **change)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises(error, match=match):
        fa.flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])  # bit for bit


@pytest.mark.parametrize("kind, change, when, error, match", HOSTILE, ids=_ids())
def test_hostile_index_on_the_device_path_writes_nothing_returns_nan_and_raises_next(
        basic_manager, device_path, kind, change, when, error, match):
    kw = _with(_setup(kind, torch.Generator().manual_seed(0)), **change)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    if when == _NOW:  # known without reading a device value: raised in the call, as on the host
        with pytest.raises(error, match=match):
            fa.flash_attn_with_kvcache(**kw)
    else:
        out, lse = fa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)  # no sync, no raise
        assert out.isnan().all() and lse.isnan().all()
        with pytest.raises(KvCacheIndexError, match=match):
            fa.flash_attn_with_kvcache(**_setup(kind, torch.Generator().manual_seed(1)))  # the next call raises
        check_pending_errors()  # raised once
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


@pytest.mark.parametrize("kind", ["dense", "batch_idx", "leftpad", "paged"])
def test_valid_calls_agree_on_both_paths_and_with_the_oracle(basic_manager, monkeypatch, kind):
    """The device-side path changes nothing for a valid call: same caches, same output, no pending error; and
    the output is the float64 oracle's over each sequence's keys."""
    host_kw, dev_kw = (_setup(kind, torch.Generator().manual_seed(3)) for _ in range(2))
    host_out = fa.flash_attn_with_kvcache(**host_kw)
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    dev_out = fa.flash_attn_with_kvcache(**dev_kw)
    check_pending_errors()
    assert torch.equal(host_out, dev_out)
    assert torch.equal(host_kw["k_cache"], dev_kw["k_cache"]) and torch.equal(host_kw["v_cache"], dev_kw["v_cache"])
    lens = (host_kw["cache_seqlens"] + NEW).tolist()
    for b, n in enumerate(lens):
        if kind == "paged":
            pages = host_kw["block_table"][b].long()
            keys, values = (c[pages].flatten(0, 1)[:n] for c in (host_kw["k_cache"], host_kw["v_cache"]))
        else:
            row = host_kw["cache_batch_idx"][b] if kind == "batch_idx" else b
            start = int(host_kw["cache_leftpad"][b]) if kind == "leftpad" else 0
            keys, values = host_kw["k_cache"][row, start:n], host_kw["v_cache"][row, start:n]
        # appended where they belong
        torch.testing.assert_close(keys[n - NEW - (0 if kind != "leftpad" else start):][-NEW:], host_kw["k"][b])
        group = HEADS // HEADS_K
        ref, _ = oracle(host_kw["q"][b:b + 1].double(), keys[None].double().repeat_interleave(group, 2),
                        values[None].double().repeat_interleave(group, 2), causal=True)
        torch.testing.assert_close(host_out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_what_flash_attn_allows_stays_allowed(basic_manager, monkeypatch):
    """Duplicate cache rows without an append (beam search reading one prefix), unused block_table entries of
    any value, a page shared for reading (a common prefix) while each sequence appends to its own."""
    gen = torch.Generator().manual_seed(4)
    kw = _with(_setup("batch_idx", gen), k=_DROP, v=_DROP, cache_batch_idx=torch.tensor([1, 1], dtype=I32))
    out = fa.flash_attn_with_kvcache(**_with(kw, q=kw["q"][:1].expand(2, -1, -1, -1),
                                             cache_seqlens=torch.tensor([5, 5], dtype=I32)))
    assert out.isfinite().all() and torch.equal(out[0], out[1])  # one row read twice
    paged = _with(_setup("paged", gen), block_table=torch.tensor([[7, 2, -5, 99], [4, 1, 9, -1]], dtype=I32))
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    assert fa.flash_attn_with_kvcache(**paged).isfinite().all()
    check_pending_errors()
    monkeypatch.delenv("OPDISPATCH_KV_CHECKS")
    assert fa.flash_attn_with_kvcache(**_with(_setup("paged", gen), block_table=paged["block_table"])).isfinite().all()
    shared = torch.tensor([[7, 1, 0, 0], [4, 1, 9, 3]], dtype=I32)  # page 1: row 0 appends there, row 1 reads it
    assert fa.flash_attn_with_kvcache(**_with(_setup("paged", gen), block_table=shared)).isfinite().all()


def test_sync_checks_env_raises_in_the_call(basic_manager, monkeypatch):
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    monkeypatch.setenv("OPDISPATCH_SYNC_CHECKS", "1")
    kw = _with(_setup("dense", torch.Generator().manual_seed(0)), cache_seqlens=torch.tensor([-1, 2], dtype=I32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=-1") as info:
        fa.flash_attn_with_kvcache(**kw)
    assert not isinstance(info.value, KvCacheIndexError)  # raised in the call, not deferred
    check_pending_errors()


def test_deferred_error_is_raised_by_the_next_op_kv_call(basic_manager, device_path):
    kw = _with(_setup("dense", torch.Generator().manual_seed(0)), cache_seqlens=torch.tensor([5, 99], dtype=I32))
    assert fa.flash_attn_with_kvcache(**kw).isnan().all()
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 8, 2, 8)
    with pytest.raises(KvCacheIndexError, match=r"an earlier KV-cache call on cpu had a bad index.*"
                                                 r"cache_seqlens\[1\]=99 is out of range"):
        opdispatch.attention(q, cache, cache, seqused_k=torch.tensor([3], dtype=I32))
    out = opdispatch.attention(q, cache, cache, seqused_k=torch.tensor([3], dtype=I32))  # raised once, then clear
    assert not math.isnan(float(out.sum()))


@pytest.mark.parametrize("change, error, match", [
    (dict(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=I32)), ValueError,
     r"block_table\[0\] names page -1, but the pools hold pages 0..5"),
    (dict(seqused_k=torch.tensor([5.0, 2.0])), TypeError, r"seqused_k must be int32, got torch.float32"),
    (dict(seqused_k=torch.tensor([True, True])), TypeError, r"seqused_k must be int32, got torch.bool"),
    (dict(block_table=torch.tensor([[0.0, 1], [2, 3]])), TypeError, r"block_table must be int32"),
    (dict(seqused_k=torch.tensor([9, 2], dtype=I32)), ValueError, r"seqused_k\[0\]=9 is out of range; allowed: 0..8"),
])
def test_op_kv_cache_arguments_refused(basic_manager, change, error, match):
    """opdispatch.attention's own seqused_k / block_table: checked on CPU (and with OPDISPATCH_SYNC_CHECKS=1 on
    accelerators); the cases tests/test_kv_cache.py does not already hold."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 8, generator=gen)
    pool = torch.randn(6, 4, 2, 8, generator=gen)
    kw = dict(seqused_k=torch.tensor([5, 2], dtype=I32), block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32))
    kw.update(change)
    with pytest.raises(error, match=match):
        opdispatch.attention(q, pool, pool, **kw)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("paged", [False, True], ids=["cache_batch_idx", "block_table"])
def test_a_batch_of_zero_is_refused_clearly_on_both_paths(basic_manager, monkeypatch, path, paged):
    """A batch of 0 sequences: the device-side verdict gathered from an empty table (an out-of-bounds index: on a
    GPU a device-side assert); now the op's own clear error, on either path, with the caches untouched."""
    if path == "device":
        monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    z = torch.zeros
    k_cache, v_cache = torch.randn(4, 16, 4, 64), torch.randn(4, 16, 4, 64)
    before = k_cache.clone()
    index = dict(block_table=z(0, 2, dtype=torch.int32)) if paged else dict(cache_batch_idx=z(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty dimension"):
        fa.flash_attn_with_kvcache(torch.randn(0, 1, 4, 64), k_cache, v_cache, torch.randn(0, 1, 4, 64),
                                   torch.randn(0, 1, 4, 64), cache_seqlens=z(0, dtype=torch.int32), **index)
    assert torch.equal(k_cache, before)
    fa.check_pending_errors()
