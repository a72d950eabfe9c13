"""The device-side KV-cache checks' report ring (core._kv_checks, issue 31): reports copied into preallocated host
rows, a row written again only after the host read it (its event completed — events faked on CPU), only the
oldest report's event asked; and flash_attn_with_kvcache's bound device path in a decode loop: an invalid step in
the middle writes nothing, returns NaN, and the next call raises the reference path's exact error for the values
that step was given, even after the caller changed them in place — against a host-side oracle of the verdict on
random indices."""

from __future__ import annotations

import pytest
import torch

from opdispatch.compat import flash_attn as fa
from opdispatch.compat.flash_attn import KvCacheIndexError, check_pending_errors
from opdispatch.base import _kv_checks
from tests.test_compat_flash_attn import oracle

I32 = torch.int32
CPU = torch.device("cpu")


class FakeEvent:
    """A CUDA event's part the ring uses: done once the test (or a wait) says so."""

    log: list[tuple[str, int]] = []

    def __init__(self, number):
        self.number, self.done = number, True

    def record(self):
        self.done = False
        FakeEvent.log.append(("record", self.number))

    def query(self):
        FakeEvent.log.append(("query", self.number))
        return self.done

    def synchronize(self):
        FakeEvent.log.append(("wait", self.number))
        self.done = True


@pytest.fixture
def fake_events(monkeypatch):
    """A fresh ring state with 3 rows per ring whose copies finish only when a test says so."""
    monkeypatch.setattr(_kv_checks, "_states", {})
    monkeypatch.setattr(_kv_checks, "RING_ROWS", 3)
    made = []

    def event_for(device):
        made.append(FakeEvent(len(made)))
        return made[-1]

    monkeypatch.setattr(_kv_checks, "_event_for", event_for)
    FakeEvent.log = []
    yield made
    monkeypatch.undo()


def _report(bad, value):
    return torch.tensor([int(bad), value], dtype=I32)


def _describe(row):
    return f"value {int(row[1])}"


def test_a_row_is_written_again_only_after_its_copy_finished_and_was_read(fake_events):
    for value in (10, 11, 12):  # fills the ring: rows 0, 1, 2, each behind its own event
        _kv_checks.defer_report(CPU, _report(value == 10, value), _describe)
    assert len(fake_events) == 3 and not any(e.done for e in fake_events)
    _kv_checks.raise_pending(CPU)  # row 0's copy is still in flight: nothing is read, nothing raised, no wait
    assert ("wait", 0) not in FakeEvent.log
    assert [entry for entry in FakeEvent.log if entry[0] == "query"] == [("query", 0)]  # only the oldest asked
    ring = _kv_checks._states[CPU].rings[2, I32]
    assert ring.taken == [True, True, True]
    # A fourth report needs row 0 again: the host waits for that row's copy and reads it before overwriting it.
    _kv_checks.defer_report(CPU, _report(False, 13), _describe)
    assert FakeEvent.log[-2:] == [("wait", 0), ("record", 0)]  # the wait before the row's event is recorded again
    assert len(fake_events) == 3  # events are made once per row, then recorded again
    assert ring.host[0].tolist() == [0, 13]
    with pytest.raises(KvCacheIndexError, match=r"had a bad index, found on the device .*: value 10$"):
        _kv_checks.raise_pending(CPU)  # the first report's verdict, read before its row was reused
    _kv_checks.raise_pending(CPU)  # raised once
    for event in fake_events:
        event.done = True
    check_pending_errors(CPU)  # the rest were valid
    assert ring.taken == [False, False, False]


def test_a_bad_report_still_in_flight_is_raised_once_its_copy_finished(fake_events):
    _kv_checks.defer_report(CPU, _report(False, 1), _describe)
    _kv_checks.defer_report(CPU, _report(True, 2), _describe)
    _kv_checks.defer_report(CPU, _report(True, 3), _describe)
    fake_events[0].done = True
    _kv_checks.raise_pending(CPU)  # the valid one is read; the bad one is still being copied
    assert _kv_checks._states[CPU].rings[2, I32].taken == [False, True, True]
    fake_events[1].done = fake_events[2].done = True
    with pytest.raises(KvCacheIndexError, match=r": value 2$"):  # the first failure; a later one is dropped
        _kv_checks.raise_pending(CPU)
    check_pending_errors(CPU)


def test_check_pending_errors_waits_for_every_report(fake_events):
    _kv_checks.defer_report(CPU, _report(False, 1), _describe)
    _kv_checks.defer_report(CPU, _report(True, 2), _describe)
    with pytest.raises(KvCacheIndexError, match=r": value 2$"):
        check_pending_errors()
    assert ("wait", 0) in FakeEvent.log and ("wait", 1) in FakeEvent.log
    check_pending_errors()


# The bound device path in a loop --------------------------------------------------------------------------------

BATCH, HEADS, HEADS_K, DIM, CAPACITY, PAGE, POOL = 3, 4, 2, 16, 16, 4, 14


def _loop_caches(layout, gen):
    if layout == "paged":
        caches = [torch.randn(POOL, PAGE, HEADS_K, DIM, generator=gen) for _ in range(2)]
        table = torch.randperm(POOL, generator=gen)[:BATCH * 4].view(BATCH, 4).to(I32)
        return caches, dict(block_table=table)
    rows = BATCH + 2 if layout == "batch_idx" else BATCH
    caches = [torch.randn(rows, CAPACITY, HEADS_K, DIM, generator=gen) for _ in range(2)]
    return caches, (dict(cache_batch_idx=torch.tensor([4, 0, 2], dtype=I32)) if layout == "batch_idx" else {})


def _hostile(layout, index, lens):
    """An invalid step's arguments: (index arguments, lengths)."""
    if layout == "dense":
        return index, torch.tensor([int(lens[0]), CAPACITY, int(lens[2])], dtype=I32)  # no room for the append
    if layout == "batch_idx":
        return dict(cache_batch_idx=torch.tensor([4, 2, 2], dtype=I32)), lens.clone()  # two write one row
    table = index["block_table"].clone()
    table[1, int(lens[1]) // PAGE] = POOL  # the page sequence 1 appends to is past the pool
    return dict(block_table=table), lens.clone()


def _keys(cache, layout, index, b, n):
    if layout == "paged":
        return cache[index["block_table"][b].long()].flatten(0, 1)[:n]
    row = int(index["cache_batch_idx"][b]) if layout == "batch_idx" else b
    return cache[row, :n]


@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
def test_an_invalid_step_in_a_decode_loop_writes_nothing_and_the_next_call_raises_the_references_error(
        basic_manager, monkeypatch, layout):
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    check_pending_errors()
    calls = []
    original = fa._kvcache_reference
    monkeypatch.setattr(fa, "_kvcache_reference", lambda *a, **k: calls.append(True) or original(*a, **k))
    gen = torch.Generator().manual_seed(sum(map(ord, layout)))
    (k_cache, v_cache), index = _loop_caches(layout, gen)
    lens = torch.tensor([0, 3, 6], dtype=I32)
    for step in range(7):
        q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
        k_new, v_new = (torch.randn(BATCH, 1, HEADS_K, DIM, generator=gen) for _ in range(2))
        if step == 3:  # the bound path runs it (a repeated signature): NaN, nothing written, no raise yet
            bad_index, bad_lens = _hostile(layout, index, lens)
            with pytest.raises(ValueError) as want:  # the reference path's host check of those values
                fa._kvcache_indices(q, k_cache, 1, bad_lens, bad_index.get("cache_batch_idx"), None,
                                    bad_index.get("block_table"), host=True)
            before = k_cache.clone(), v_cache.clone()
            out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=bad_lens,
                                                  causal=True, return_softmax_lse=True, **bad_index)
            assert out.isnan().all() and lse.isnan().all()
            assert calls == [True]  # only the first step's: the bound path ran this one
            assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # bit for bit
            bad_lens.fill_(0)  # changed in place right after the call: the error names the values it was given
            for t in bad_index.values():
                t.fill_(0)
            with pytest.raises(KvCacheIndexError) as info:
                fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                           return_softmax_lse=True, **index)
            assert str(info.value).endswith(": " + str(want.value))
            assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # the raising call neither
            continue
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                              return_softmax_lse=True, **index)
        for b in range(BATCH):  # the loop goes on correctly after the error: appended, attended
            n = int(lens[b]) + 1
            keys, values = _keys(k_cache, layout, index, b, n), _keys(v_cache, layout, index, b, n)
            assert torch.equal(keys[-1], k_new[b, 0]) and torch.equal(values[-1], v_new[b, 0])
            ref, ref_lse = oracle(q[b:b + 1], keys[None], values[None], causal=True)
            torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)
        lens += 1
    check_pending_errors()


def _host_verdict(lens, table):
    """An independent statement of the rules: lengths leave room for the append, the used pages exist, the
    appended slots are distinct."""
    if ((lens < 0) | (lens > 4 * PAGE - 1)).any():
        return False
    slots = []
    for b in range(BATCH):
        used = -(-(int(lens[b]) + 1) // PAGE)
        if ((table[b, :used] < 0) | (table[b, :used] >= POOL)).any():
            return False
        slots.append(int(table[b, int(lens[b]) // PAGE]) * PAGE + int(lens[b]) % PAGE)
    return len(set(slots)) == len(slots)


def test_random_paged_indices_get_the_same_verdict_on_the_device_as_on_the_host(basic_manager, monkeypatch):
    """Random lengths and tables (about half invalid): the bound device path is NaN and unwritten exactly when
    the rules say so, and then the next call raises the host check's own message."""
    monkeypatch.setenv("OPDISPATCH_KV_CHECKS", "device")
    check_pending_errors()
    gen = torch.Generator().manual_seed(31)
    (k_cache, v_cache), _ = _loop_caches("paged", gen)
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=gen)
    k_new, v_new = (torch.randn(BATCH, 1, HEADS_K, DIM, generator=gen) for _ in range(2))
    valid_table = torch.arange(BATCH * 4, dtype=I32).view(BATCH, 4)
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.zeros(BATCH, dtype=I32),
                               block_table=valid_table)  # binds the signature
    verdicts = []
    for _ in range(40):
        lens = torch.randint(-1, 4 * PAGE + 1, (BATCH,), generator=gen).to(I32)
        table = torch.randint(-1, POOL + 1, (BATCH, 4), generator=gen).to(I32)
        want = _host_verdict(lens, table)
        before = k_cache.clone(), v_cache.clone()
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table)
        assert bool(out.isnan().all()) is not want
        if want:
            assert out.isfinite().all()
            check_pending_errors()
        else:
            assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
            with pytest.raises(KvCacheIndexError, match="flash_attn_with_kvcache: (cache_seqlens|block_table)"):
                check_pending_errors()
        verdicts.append(want)
    assert 5 < sum(verdicts) < 35  # both kinds were tried
