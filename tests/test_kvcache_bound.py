"""flash_attn_with_kvcache's bound path (issue 31): a decode loop whose signature repeats runs the bound append and
kernel, not the reference path — checked against a float64 oracle over dense, spare-row, cache_batch_idx and paged
caches, GQA, one and several new keys (and none), causal, window with softcap and unmasked calls, rows whose cache
is empty, on the host and the device-side checks; its caches bit for bit equal to an append written by hand, its
results bit for bit the reference path's, and hostile indices refused with the reference path's errors, nothing
written."""

from __future__ import annotations

import os

import pytest
import torch

from opdispatch.compat import flash_attn as fa
from opdispatch.compat.flash_attn import KvCacheIndexError, check_pending_errors
from tests.test_compat_flash_attn import oracle
from tests.test_kv_cache_hostile import _DROP, HOSTILE, _ids, _setup, _with

I32 = torch.int32
BATCH, HEADS, DIM, CAPACITY, PAGE, WIDTH, POOL = 3, 4, 16, 16, 4, 4, 14
START = [0, 5, 7]  # sequence 0's cache is empty
MASKS = {
    "causal": dict(causal=True),
    "window+softcap": dict(causal=True, window_size=(4, -1), softcap=3.0),
    "none": dict(),
}


@pytest.fixture
def reference_calls(monkeypatch):
    """How many calls went through the reference path (validation, decision, binding)."""
    calls = []
    original = fa._kvcache_reference

    def counted(*args, **kwargs):
        calls.append((args[0] if args else kwargs["key"]) is not None)  # asked to remember a bound path
        return original(*args, **kwargs)

    monkeypatch.setattr(fa, "_kvcache_reference", counted)
    return calls


@pytest.fixture(params=["host", "device", "fused", "fused-two"])
def checks(request, monkeypatch):
    """The host check (CPU's), the device-side one written with torch ops, and the device-side one as the
    Triton kernels a GPU runs (core/opdispatch/compat/_kv_append.py, through Triton's interpreter), forced on CPU: the check
    and append as one kernel ("fused", wherever the block table is small) or as two ("fused-two", a large one's)."""
    if request.param != "host":
        monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    if request.param.startswith("fused"):
        use_interpreted_kv_append(monkeypatch)
    if request.param == "fused-two":
        from opdispatch.compat import _kv_append

        monkeypatch.setattr(_kv_append, "SINGLE_MAX_TABLE", -1)
    check_pending_errors()
    yield request.param
    check_pending_errors()  # a valid loop leaves no error behind


def use_interpreted_kv_append(monkeypatch):
    """The fused check and append (two Triton kernels) on CPU tensors: run by Triton's interpreter, which
    tests/conftest.py turns on where there is no GPU. On a GPU host Triton launches on its device backend, which
    cannot read CPU tensors (tests/gpu/test_kv_index_checks_gpu.py runs the same kernels on the GPU there)."""
    pytest.importorskip("triton", reason="the fused KV append's kernels are Triton kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; "
                    "tests/conftest.py sets it where there is no GPU)")
    monkeypatch.setenv("OPDISPATCH_KV_APPEND", "triton")


def _caches(layout, heads_k, gen):
    """(k_cache, v_cache, index arguments, where sequence b's position p lives: a function (b, p) -> (row, slot))."""
    shape = (POOL, PAGE) if layout == "paged" else (BATCH + 2 if layout in ("spare_rows", "batch_idx") else BATCH,
                                                    CAPACITY)
    k_cache, v_cache = (torch.randn(*shape, heads_k, DIM, generator=gen) for _ in range(2))
    if layout == "paged":
        table = torch.randperm(POOL, generator=gen)[:BATCH * WIDTH].view(BATCH, WIDTH).to(I32)
        return k_cache, v_cache, dict(block_table=table), lambda b, p: (int(table[b, p // PAGE]), p % PAGE)
    if layout == "batch_idx":
        rows = torch.tensor([4, 0, 2], dtype=I32)
        return k_cache, v_cache, dict(cache_batch_idx=rows), lambda b, p: (int(rows[b]), p)
    return k_cache, v_cache, {}, lambda b, p: (b, p)


def _keys_of(cache, where, b, n):
    return torch.stack([cache[where(b, p)] for p in range(n)]) if n else cache.new_zeros(0, *cache.shape[2:])


@pytest.mark.parametrize("layout", ["dense", "spare_rows", "batch_idx", "paged"])
@pytest.mark.parametrize("heads_k", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("new", [1, 3, 0], ids=["new1", "new3", "no_append"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_decode_loop_runs_bound_and_matches_oracle_and_reference(basic_manager, reference_calls, checks, layout,
                                                                 heads_k, new, mask):
    gen = torch.Generator().manual_seed(sum(map(ord, f"{layout}{heads_k}{new}{mask}")))
    k_cache, v_cache, index, where = _caches(layout, heads_k, gen)
    lens = torch.tensor(START, dtype=I32)
    seqlen_q = max(new, 1)
    for step in range(3):
        q = torch.randn(BATCH, seqlen_q, HEADS, DIM, generator=gen)
        k_new, v_new = ((torch.randn(BATCH, new, heads_k, DIM, generator=gen) for _ in range(2)) if new
                        else (None, None))
        want_k, want_v = k_cache.clone(), v_cache.clone()  # the append written by hand
        for b in range(BATCH):
            for i in range(new):
                want_k[where(b, int(lens[b]) + i)] = k_new[b, i]
                want_v[where(b, int(lens[b]) + i)] = v_new[b, i]
        # The reference path on copies: the bound path must give the very same bits.
        ref_caches = k_cache.clone(), v_cache.clone()
        ref_out, ref_lse = fa._kvcache_reference(
            None, q, *ref_caches, k_new, v_new, None, None, lens.clone(), index.get("cache_batch_idx"), None,
            index.get("block_table"), None, MASKS[mask].get("causal", False), MASKS[mask].get("window_size", (-1, -1)),
            MASKS[mask].get("softcap", 0.0), True, None, True)
        reference_calls.clear()
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                              return_softmax_lse=True, **index, **MASKS[mask])
        assert reference_calls == ([True] if step == 0 else []), "a repeated signature must take the bound path"
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # appended where it belongs, only there
        assert torch.equal(ref_caches[0], want_k) and torch.equal(ref_caches[1], want_v)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        for b in range(BATCH):
            n = int(lens[b]) + new
            keys, values = _keys_of(k_cache, where, b, n), _keys_of(v_cache, where, b, n)
            ref, ref_b_lse = oracle(q[b:b + 1], keys[None], values[None], causal=MASKS[mask].get("causal", False),
                                    window=MASKS[mask].get("window_size", (-1, -1)),
                                    softcap=MASKS[mask].get("softcap", 0.0))
            torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b:b + 1].double(), ref_b_lse, atol=1e-5, rtol=1e-5)
        lens += new  # in place, as decode loops do: the next step's key is the same


@pytest.mark.parametrize("cache_seqlens", [4, None], ids=["int", "none"])
def test_int_and_absent_cache_seqlens_take_the_bound_path(basic_manager, reference_calls, checks, cache_seqlens):
    """An int cache_seqlens is keyed by its type and checked per call (the same bound path for 4, 5, ...);
    without cache_seqlens the whole cache is read (no append) or written from 0."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(2, 8, 2, DIM, generator=gen) for _ in range(2))
    for step in range(3):
        q = torch.randn(2, 1, HEADS, DIM, generator=gen)
        at = cache_seqlens + step if cache_seqlens is not None else None
        reference_calls.clear()
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=at, causal=True)
        assert reference_calls == ([True] if step == 0 else [])
        n = at if at is not None else 8
        ref, _ = oracle(q, k_cache[:, :n], v_cache[:, :n], causal=True)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"cache_seqlens=9 is out of range; allowed: 0..8"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, causal=True)


def test_rotary_on_the_bound_path_is_the_references(basic_manager, reference_calls):
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache = (torch.randn(2, 12, 2, DIM, generator=gen) for _ in range(2))
    theta = torch.arange(32, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(0, 8, 2) / 8)
    cos, sin = theta.cos().float(), theta.sin().float()
    lens = torch.tensor([0, 6], dtype=I32)
    for step in range(3):
        q, k_new, v_new = (torch.randn(2, 1, n, DIM, generator=gen) for n in (HEADS, 2, 2))
        ref_caches = k_cache.clone(), v_cache.clone()
        ref = fa._kvcache_reference(None, q, *ref_caches, k_new, v_new, cos, sin, lens.clone(), None, None, None,
                                    None, True, (-1, -1), 0.0, False, None, False)
        reference_calls.clear()
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=lens, causal=True, rotary_interleaved=False)
        assert reference_calls == ([True] if step == 0 else [])
        assert torch.equal(out, ref) and torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])
        lens += 1


def _warmed(kind, change, **options):
    """A valid call of `kind` (without the arguments `change` drops) run once — the reference path remembers its
    bound path — then fresh arguments for it."""
    drops = {name: value for name, value in change.items() if value is _DROP}
    fa.flash_attn_with_kvcache(**_with(_setup(kind, torch.Generator().manual_seed(5)), **drops), **options)
    return _setup(kind, torch.Generator().manual_seed(0))


def _error_of(call):
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("kind, change, when, error, match", HOSTILE, ids=_ids())
def test_hostile_index_on_the_bound_path_raises_the_references_error_on_the_host(basic_manager, reference_calls,
                                                                                  kind, change, when, error, match):
    reference = _with(_setup(kind, torch.Generator().manual_seed(0)), **change)
    want = _error_of(lambda: fa._kvcache_reference(**_reference_args(reference)))
    kw = _with(_warmed(kind, change), **change)
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    reference_calls.clear()
    with pytest.raises(error, match=match) as info:
        fa.flash_attn_with_kvcache(**kw)
    assert (type(info.value), str(info.value)) == want
    if when == "range" and kind != "leftpad":  # the bound path found it and handed the call over, unwritten
        assert reference_calls == [False]
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])  # bit for bit


@pytest.mark.parametrize("append", ["torch", "fused", "fused-two"])
@pytest.mark.parametrize("kind, change, when, error, match",
                         [case for case in HOSTILE if case[2] == "range"],
                         ids=[i for i, case in zip(_ids(), HOSTILE) if case[2] == "range"])
def test_hostile_index_on_the_bound_device_path_writes_nothing_and_the_next_call_raises_the_references_error(
        basic_manager, reference_calls, monkeypatch, kind, change, when, error, match, append):
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    if append.startswith("fused"):
        use_interpreted_kv_append(monkeypatch)
    if append == "fused-two":  # the check and append as two kernels (a large block table's), not one
        from opdispatch.compat import _kv_append

        monkeypatch.setattr(_kv_append, "SINGLE_MAX_TABLE", -1)
    check_pending_errors()
    reference = _with(_setup(kind, torch.Generator().manual_seed(0)), **change)
    fa._kvcache_reference(**_reference_args(reference))  # the reference device path: NaN, error deferred
    want = _error_of(check_pending_errors)
    kw = _with(_warmed(kind, change, return_softmax_lse=True), **change)
    if isinstance(kw["cache_seqlens"], torch.Tensor):
        kw["cache_seqlens"] = kw["cache_seqlens"].clone()  # changed in place below: not the shared case's tensor
    before = kw["k_cache"].clone(), kw["v_cache"].clone()
    reference_calls.clear()
    out, lse = fa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)  # no raise, no sync
    assert reference_calls == ([False] if kind == "leftpad" else [])  # the bound path ran it (leftpad: never bound)
    assert out.isnan().all() and lse.isnan().all()
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])
    kw["cache_seqlens"].fill_(0)  # the caller moves on: the error still names the values of the bad call
    with pytest.raises(KvCacheIndexError, match=match) as info:
        fa.flash_attn_with_kvcache(**_setup(kind, torch.Generator().manual_seed(1)))
    assert (KvCacheIndexError, str(info.value)) == want
    check_pending_errors()  # raised once


def _reference_args(kw):
    """flash_attn_with_kvcache's keyword arguments as _kvcache_reference's positional ones."""
    return dict(key=None, q=kw["q"], k_cache=kw["k_cache"], v_cache=kw["v_cache"], k=kw.get("k"), v=kw.get("v"),
                rotary_cos=None, rotary_sin=None, cache_seqlens=kw.get("cache_seqlens"),
                cache_batch_idx=kw.get("cache_batch_idx"), cache_leftpad=kw.get("cache_leftpad"),
                block_table=kw.get("block_table"), softmax_scale=None, causal=kw.get("causal", False),
                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                return_softmax_lse=False)


def test_a_new_signature_is_decided_once_and_a_policy_swap_forgets_the_bound_path(basic_manager, reference_calls):
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache = (torch.randn(2, 8, 2, DIM, generator=gen) for _ in range(2))
    q = torch.randn(2, 1, HEADS, DIM, generator=gen)
    lens = torch.tensor([1, 2], dtype=I32)
    for _ in range(2):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    fa.flash_attn_with_kvcache(q[:1], k_cache, v_cache, cache_seqlens=lens[:1])  # a new batch size: decided once
    fa.flash_attn_with_kvcache(q[:1], k_cache, v_cache, cache_seqlens=lens[:1])
    assert reference_calls == [True, True]
    basic_manager.set_policy(basic_manager.policy)
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert reference_calls == [True, True, True]


@pytest.mark.parametrize("given", ["rotary_cos", "rotary_sin"])
def test_half_a_rotary_table_is_refused_before_anything_is_written(basic_manager, given):
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache = (torch.randn(2, 8, 2, DIM, generator=gen) for _ in range(2))
    before = k_cache.clone()
    q, k_new = torch.randn(2, 1, HEADS, DIM, generator=gen), torch.randn(2, 1, 2, DIM, generator=gen)
    with pytest.raises(ValueError, match=f"pass rotary_cos and rotary_sin together .*got only {given}"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=1, **{given: torch.ones(8, 4)})
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("kernels", ["one", "two"])
def test_a_fused_kernel_that_fails_to_compile_hands_its_signature_to_the_torch_ops(basic_manager, monkeypatch,
                                                                                   caplog, kernels):
    """A Triton kernel that cannot compile or launch (a synchronous error, before anything of the caches is
    written) makes its bound signature keep the torch-op check from then on, with one warning; the step itself
    appends and attends as the reference path does — the check and append as one kernel or as two."""
    from opdispatch.compat import _kv_append

    if kernels == "two":
        monkeypatch.setattr(_kv_append, "SINGLE_MAX_TABLE", -1)
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    use_interpreted_kv_append(monkeypatch)
    launches = []

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise RuntimeError("PassManager::run failed (a kernel this Triton cannot build)")
            return launch

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, index, where = _caches("paged", 2, gen)
    lens = torch.tensor(START, dtype=I32)
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
    k_new, v_new = (torch.randn(BATCH, 1, 2, DIM, generator=gen) for _ in range(2))
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, **index)  # binds (fused)
    monkeypatch.setattr(_kv_append, "_kernels", lambda: (Unbuildable(),) * 4)
    lens += 1
    want_k, ref_caches = k_cache.clone(), (k_cache.clone(), v_cache.clone())
    for b in range(BATCH):
        want_k[where(b, int(lens[b]))] = k_new[b, 0]
    ref = fa._kvcache_reference(None, q, *ref_caches, k_new, v_new, None, None, lens.clone(), None, None,
                                index["block_table"], None, False, (-1, -1), 0.0, True, None, False)
    with caplog.at_level("WARNING", logger="opdispatch"):
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, **index)
        fa.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, cache_seqlens=lens, **index)
    assert torch.equal(k_cache, want_k) and torch.equal(out, ref)
    assert len(launches) == 1, "after the failure the signature keeps the torch ops"
    warnings = [r.getMessage() for r in caplog.records if "fused KV-cache check" in r.getMessage()]
    assert len(warnings) == 1 and "PassManager::run failed" in warnings[0] and "OPDISPATCH_KV_APPEND" in warnings[0]
    check_pending_errors()


@pytest.mark.parametrize("batch, new, width, rows, fused", [
    (256, 1, 0, False, True),     # dense decode: no pairwise check
    (257, 1, 0, False, False),    # past MAX_SLOTS
    (64, 1, 0, True, True),       # cache_batch_idx: 64 x 64 pairs
    (65, 1, 0, True, False),
    (16, 4, 8, False, True),      # pages: 64 appended keys compared pairwise
    (16, 5, 8, False, False),
    (4, 1, 8, True, False),       # cache_batch_idx with pages: the torch ops
    (8, 0, 0, False, False),      # nothing appended
])
def test_the_fused_append_takes_the_sizes_its_kernels_were_built_for(monkeypatch, batch, new, width, rows, fused):
    from opdispatch.compat import _kv_append

    pytest.importorskip("triton")
    monkeypatch.delenv("OPDISPATCH_KV_APPEND", raising=False)
    assert _kv_append.available(torch.device("cuda"), batch, new, width, rows) is fused
    assert not _kv_append.available(torch.device("cpu"), batch, new, width, rows)  # CPU: only when asked
    monkeypatch.setenv("OPDISPATCH_KV_APPEND", "torch")
    assert not _kv_append.available(torch.device("cuda"), batch, new, width, rows)


@pytest.mark.parametrize("where", ["q", "k", "cache_seqlens"])
def test_a_0d_tensor_cannot_key_the_bound_path_and_gets_the_reference_error(basic_manager, where):
    """A 0-d tensor has no last stride to key: the call goes to the reference path, which refuses it with its own
    error (not an IndexError from the key), and nothing is written."""
    k_cache, v_cache = torch.randn(BATCH, CAPACITY, 1, DIM), torch.randn(BATCH, CAPACITY, 1, DIM)
    before = k_cache.clone(), v_cache.clone()
    given = dict(q=torch.randn(BATCH, 1, HEADS, DIM), k=torch.randn(BATCH, 1, 1, DIM), v=torch.randn(BATCH, 1, 1, DIM),
                 cache_seqlens=torch.tensor(START, dtype=I32))
    fa.flash_attn_with_kvcache(k_cache=k_cache.clone(), v_cache=v_cache.clone(), **given)  # a valid call: bound
    given[where] = torch.tensor(1, dtype=I32) if where == "cache_seqlens" else torch.tensor(1.0)
    with pytest.raises(ValueError, match="flash_attn_with_kvcache: .*(must|shape)"):
        fa.flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **given)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
