"""The fused KV-cache check and append's per-call host work (issue 31, core/opdispatch/compat/_kv_append.py): its device
buffers made once per (stream, thread) and reused by later steps, fresh and never kept during CUDA graph capture;
its report written by the verdict kernel straight into a report-ring row (no device copy); a bad step's output made
NaN in place. Run on CPU through Triton's interpreter (streams and capture simulated by their keys), each step
against a float64 oracle of the cache as appended by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from opdispatch.base import _kv_checks
from opdispatch.compat import _kv_append
from opdispatch.compat import flash_attn as fa
from opdispatch.compat.flash_attn import KvCacheIndexError, check_pending_errors
from tests.test_compat_flash_attn import oracle
from tests.test_kvcache_bound import use_interpreted_kv_append

I32 = torch.int32
BATCH, HEADS, HEADS_K, DIM, CAPACITY, PAGE, POOL = 3, 4, 2, 16, 16, 4, 14


@pytest.fixture
def fused_loop(basic_manager, monkeypatch):
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    use_interpreted_kv_append(monkeypatch)
    check_pending_errors()
    yield
    check_pending_errors()


def _setup(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "paged":
        caches = [torch.randn(POOL, PAGE, HEADS_K, DIM, generator=gen) for _ in range(2)]
        table = torch.randperm(POOL, generator=gen)[:BATCH * 4].view(BATCH, 4).to(I32)
        return caches, dict(block_table=table), gen
    rows = BATCH + 2 if layout == "batch_idx" else BATCH
    caches = [torch.randn(rows, CAPACITY, HEADS_K, DIM, generator=gen) for _ in range(2)]
    return caches, (dict(cache_batch_idx=torch.tensor([4, 0, 2], dtype=I32)) if layout == "batch_idx" else {}), gen


def _keys(cache, index, b, n):
    if "block_table" in index:
        return cache[index["block_table"][b].long()].flatten(0, 1)[:n]
    row = int(index["cache_batch_idx"][b]) if "cache_batch_idx" in index else b
    return cache[row, :n]


def _fused_of(k_cache):
    bound = [b for b in fa._api.get_manager().fast.values()
             if type(b).__name__ == "_KvcacheBound" and b.cache_rows == k_cache.shape[0]]
    assert len(bound) == 1 and bound[0].fused is not None
    return bound[0].fused


def _step(caches, index, lens, gen):
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
    k_new, v_new = (torch.randn(BATCH, 1, HEADS_K, DIM, generator=gen) for _ in range(2))
    out, lse = fa.flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=lens, causal=True,
                                          return_softmax_lse=True, **index)
    return q, out, lse


def _expected(caches, index, q, lens):
    """The float64 oracle of one step from the caches as they stand (the step's keys appended)."""
    outs = []
    for b in range(BATCH):
        n = int(lens[b]) + 1
        keys, values = _keys(caches[0], index, b, n), _keys(caches[1], index, b, n)
        outs.append(oracle(q[b:b + 1], keys[None], values[None], causal=True))
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
def test_buffers_are_made_once_and_a_later_step_leaves_an_earlier_steps_result_alone(fused_loop, layout):
    caches, index, gen = _setup(layout, 7)
    lens = torch.tensor([0, 3, 6], dtype=I32)
    _step(caches, index, lens, gen)  # binds the signature (the reference path)
    lens += 1
    fused = _fused_of(caches[0])
    kept = []
    for _ in range(4):
        q, out, lse = _step(caches, index, lens, gen)
        want = _expected(caches, index, q, lens)
        kept.append((out, lse, want))
        lens += 1
    assert len(fused.scratches) == 1  # one (stream, thread): every bound step reused its buffers
    scratch = next(iter(fused.scratches.values()))
    assert torch.equal(scratch.lens_out, lens)  # the last step's lengths after its append
    # Every step's result is its own tensor, unchanged by the steps after it, and right.
    assert len({out.data_ptr() for out, _, _ in kept}) == len(kept)
    for out, lse, (want, want_lse) in kept:
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_each_stream_and_thread_gets_its_own_buffers(fused_loop, monkeypatch):
    caches, index, gen = _setup("paged", 8)
    lens = torch.tensor([1, 4, 9], dtype=I32)
    _step(caches, index, lens, gen)
    lens += 1
    fused = _fused_of(caches[0])
    stream = iter([11, 22, 11, 22])  # two streams, alternating (their handles)
    monkeypatch.setattr(_kv_append, "_stream_handle", lambda device: next(stream))
    seen = []
    for _ in range(4):
        q, out, lse = _step(caches, index, lens, gen)
        torch.testing.assert_close(out.double(), _expected(caches, index, q, lens)[0], atol=1e-5, rtol=1e-5)
        seen.append({key: id(s) for key, s in fused.scratches.items()})
        lens += 1
    me = threading.get_ident()
    assert set(seen[-1]) == {(11, me), (22, me)} and seen[1] == seen[3]  # one per stream, then reused

    def other_thread():
        q, out, _ = _step(caches, index, lens, gen)
        results.append((q, out))

    monkeypatch.setattr(_kv_append, "_stream_handle", lambda device: 11)
    results: list = []
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    (q, out), = results
    torch.testing.assert_close(out.double(), _expected(caches, index, q, lens)[0], atol=1e-5, rtol=1e-5)
    assert len(fused.scratches) == 3 and (11, me) in fused.scratches  # the other thread's buffers are its own


def test_during_capture_buffers_are_fresh_and_the_report_goes_through_a_device_row(fused_loop, monkeypatch):
    """A graph replays into the memory it captured: nothing kept is handed to it, and its report is a device
    tensor copied by defer_report (a replay must not write a ring row the host hands out again). The deferred
    error of a bad captured step is still the reference path's."""
    caches, index, gen = _setup("dense", 9)
    lens = torch.tensor([2, 0, 5], dtype=I32)
    _step(caches, index, lens, gen)
    lens += 1
    fused = _fused_of(caches[0])
    _step(caches, index, lens, gen)
    lens += 1
    kept = dict(fused.scratches)
    copied = []
    original = fa.defer_report
    monkeypatch.setattr(fa, "defer_report", lambda *a: copied.append(a[1].device) or original(*a))
    monkeypatch.setattr(_kv_append, "_capturing", lambda device: True)
    monkeypatch.setattr(_kv_append, "_stream_handle", lambda device: 99)  # the capture's own stream
    q, out, lse = _step(caches, index, lens, gen)
    torch.testing.assert_close(out.double(), _expected(caches, index, q, lens)[0], atol=1e-5, rtol=1e-5)
    assert fused.scratches == kept and copied == [torch.device("cpu")]
    bad = torch.tensor([int(lens[0]), CAPACITY, int(lens[2])], dtype=I32)
    with pytest.raises(ValueError) as want:
        fa._kvcache_indices(q, caches[0], 1, bad, None, None, None, host=True)
    before = caches[0].clone(), caches[1].clone()
    q, out, lse = _step(caches, index, bad, gen)
    assert out.isnan().all() and lse.isnan().all()
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    with pytest.raises(KvCacheIndexError) as info:
        check_pending_errors()
    assert str(info.value).endswith(": " + str(want.value))


@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
def test_the_verdict_kernel_writes_the_ring_row_itself_and_a_bad_step_is_raised_from_it(fused_loop, monkeypatch,
                                                                                       layout):
    caches, index, gen = _setup(layout, 10)
    lens = torch.tensor([0, 3, 6], dtype=I32)
    _step(caches, index, lens, gen)
    lens += 1
    monkeypatch.setattr(fa, "defer_report", lambda *a: pytest.fail("the fused path copied its report"))
    written = []
    original = fa.defer_written
    monkeypatch.setattr(fa, "defer_written", lambda row, *a: written.append(row.tensor.clone()) or original(row, *a))
    _step(caches, index, lens, gen)
    assert written[-1][0] == 0 and written[-1][1:1 + BATCH].tolist() == lens.tolist()  # verdict, lengths given
    lens += 1
    bad_lens, bad_index = lens.clone(), {name: t.clone() for name, t in index.items()}
    if layout == "dense":
        bad_lens[1] = -1
    elif layout == "batch_idx":
        bad_index["cache_batch_idx"][2] = 0  # two sequences write row 0
    else:
        bad_index["block_table"][0, int(lens[0]) // PAGE] = POOL  # the page it appends to is past the pool
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
    with pytest.raises(ValueError) as want:
        fa._kvcache_indices(q, caches[0], 1, bad_lens, bad_index.get("cache_batch_idx"), None,
                            bad_index.get("block_table"), host=True)
    before = caches[0].clone(), caches[1].clone()
    k_new = torch.randn(BATCH, 1, HEADS_K, DIM, generator=gen)
    out, lse = fa.flash_attn_with_kvcache(q, *caches, k_new, k_new, cache_seqlens=bad_lens, causal=True,
                                          return_softmax_lse=True, **bad_index)
    assert out.isnan().all() and lse.isnan().all() and written[-1][0] == 1
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    with pytest.raises(KvCacheIndexError) as info:
        check_pending_errors()
    assert str(info.value).endswith(": " + str(want.value))


def test_a_ring_whose_rows_are_all_held_by_callers_between_their_two_calls_gives_a_fresh_ring(monkeypatch):
    """report_row never waits for a row nobody deferred yet (a thread between report_row and defer_written):
    it skips it, and with every row held starts a fresh ring rather than hang."""
    monkeypatch.setattr(_kv_checks, "_states", {})
    monkeypatch.setattr(_kv_checks, "RING_ROWS", 3)
    cpu = torch.device("cpu")
    held = [_kv_checks.report_row(cpu, 2, I32) for _ in range(3)]
    assert [row.slot for row in held] == [0, 1, 2] and len({id(row.ring) for row in held}) == 1
    _kv_checks.release_row(held[1])
    again = _kv_checks.report_row(cpu, 2, I32)
    assert again.ring is held[0].ring and again.slot == 1  # the one handed back, found past the held row 0
    fresh = _kv_checks.report_row(cpu, 2, I32)
    assert fresh.ring is not held[0].ring and fresh.slot == 0
    for row, value in zip([*held[:1], again, held[2], fresh], (1, 2, 3, 4)):
        row.tensor.copy_(torch.tensor([int(value == 3), value], dtype=I32))
        _kv_checks.defer_written(row, lambda r: f"value {int(r[1])}")
    with pytest.raises(KvCacheIndexError, match=r": value 3$"):
        check_pending_errors(cpu)
    assert not any(held[0].ring.taken) and fresh.ring.taken == [False, False, False]
