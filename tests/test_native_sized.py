"""The compiled door's size-generic entries (opdispatch.base._native, `_native_size_entry` in opdispatch.doors._api):
a call of attention that differs from one the Python path ran only in sizes, inside the template's decision class,
runs the template's bound function from C. Every such call must be the Python door's, bit for bit — results and
errors, over new lengths and batch sizes — and the float64 oracle's within tolerance; what changes the decision (a
policy threshold, a demotion, clear_cache, a policy swap) must reach it; masks, KV caches and LSE never take it.

Each test makes its own compiled twin with size-generic entries on (whatever OPDISPATCH_NATIVE_SIZED says), so the
path is tested however the process-wide door was made."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import opdispatch
from opdispatch.base import _native
from opdispatch.doors import _api
from opdispatch.engine._stats import stats as usage_stats
from opdispatch.policies import parse_policy
from tests.test_native import loaded  # noqa: F401  (the fixture: skips where the extension is not built)
from tests.test_size_generic_reuse import full_path, make, oracle


@pytest.fixture
def sized(loaded, basic_manager):  # noqa: F811
    """A compiled attention door with size-generic entries on."""
    python = _native.python_of(opdispatch.attention)
    spec = dict(python.__opdispatch_native_spec__, size_entry=_api._native_size_entry)
    return _native.compiled_front_door(python, **spec)


def _sized_hits(door: Any) -> int:
    return int(door.__self__.stats()["sized_hits"])


def _check(door: Any, pending: list[Any], layout: str, q: Any, k: Any, v: Any, **kw: Any) -> bool:
    """Calls `door`; asserts the result is the oracle's and keeps it in `pending` for `_verify` (the full Python
    path changes the manager's dicts, which would invalidate the entries under test: it runs after the calls);
    whether the call was a size-generic hit."""
    before = _sized_hits(door)
    got = door(q, k, v, layout=layout, **kw)
    want, _ = oracle(layout, q.double(), k.double(), v.double(), scale=q.shape[-1] ** -0.5,
                     causal=kw.get("causal", False), alignment=kw.get("causal_alignment", "top_left"))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    pending.append((got, q, k, v, dict(kw, layout=layout)))
    return _sized_hits(door) > before


def _verify(manager: Any, pending: list[Any]) -> None:
    """Each kept result is the full Python path's, bit for bit (with `impl` where given: the one expected)."""
    for got, q, k, v, kw in pending:
        assert torch.equal(got, full_path(manager, q, k, v, **kw)), kw


# (layout, batch, heads_q, heads_kv, head_dim, options, [(batch, seqlen_q, seqlen_k), ...]): the first size is the
# template, decided by Python; every later one lies in its class as the compiled door bounds it (the default
# policy's thresholds at 17; unequal lengths keep the template's shorter side's bound).
CASES = [
    ("bshd", 1, 4, 2, 16, dict(causal=True, causal_alignment="bottom_right"),  # growing GQA decode
     [(1, 1, 5), (1, 1, 6), (1, 1, 7), (1, 1, 40), (3, 1, 9), (2, 1, 33)]),
    ("bshd", 2, 4, 4, 8, dict(), [(2, 1, 3), (2, 1, 4), (5, 1, 11), (1, 1, 2)]),  # non-causal decode, new batches
    ("bhsd", 2, 6, 2, 8, dict(causal=True), [(2, 7, 7), (2, 12, 12), (4, 3, 3), (1, 16, 16)]),  # prefill
    ("bshd", 1, 4, 2, 16, dict(causal=True, causal_alignment="top_left"),  # chunked prefill, top-left
     [(1, 3, 9), (1, 3, 12), (2, 2, 17), (1, 3, 4)]),
    ("bshd", 1, 4, 2, 16, dict(causal=True, causal_alignment="bottom_right"),  # chunked prefill, bottom-right
     [(1, 3, 9), (1, 3, 12), (2, 2, 17), (1, 3, 4)]),
    ("sbhd", 2, 2, 1, 8, dict(), [(2, 9, 4), (2, 12, 3), (3, 16, 2), (1, 6, 4)]),  # more queries than keys
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_new_lengths_and_batches_are_sized_hits_equal_to_the_python_path_and_the_oracle(basic_manager, sized,
                                                                                      case):
    layout, b, hq, hkv, d, options, sizes = CASES[case]
    gen = torch.Generator().manual_seed(case)
    hits: list[bool] = []
    pending: list[Any] = []
    for bb, sq, sk in sizes:
        q, k, v = make(layout, bb, sq, hq, d, gen), make(layout, bb, sk, hkv, d, gen), make(layout, bb, sk, hkv, d, gen)
        hits.append(_check(sized, pending, layout, q, k, v, **options))
    _verify(basic_manager, pending)
    # The first decides; every later one is the template's where its bound function is size-generic (cpu.flash's
    # bottom-right mask of unequal lengths is not: each such call binds through Python, as the Python path does).
    generic = not (options.get("causal_alignment") == "bottom_right" and sizes[0][1] > 1)
    assert hits == [False] + [generic] * (len(sizes) - 1)
    # A repeated signature ends on an exact entry (its second call reads it back), not on the sized path.
    q, k, v = make(layout, b, sizes[-1][1], hq, d, gen), make(layout, b, sizes[-1][2], hkv, d, gen), None
    v = torch.randn_like(k)
    for _ in range(3):
        sized(q, k, v, layout=layout, **options)
    assert sized.__self__.stats()["hits"] >= 1


def test_a_sized_hit_is_counted_once_as_a_call_and_a_compiled_hit(basic_manager, sized):
    gen = torch.Generator().manual_seed(7)
    q, cache = make("bshd", 1, 1, 4, 8, gen), make("bshd", 1, 20, 2, 8, gen)
    usage_stats(True, basic_manager)
    for n in range(4, 12):
        sized(q, cache[:, :n], cache[:, :n])
    ops = usage_stats(False, basic_manager).ops["attention"]
    assert (ops.calls, ops.slow_calls, ops.compiled_hits) == (8, 1, 7) and _sized_hits(sized) == 7


BAD = {
    "k and v lengths differ": lambda q, k, v: (q, k[:, :6], v),
    "heads not divisible": lambda q, k, v: (q, k.repeat(1, 1, 2, 1)[:, :, :3], v.repeat(1, 1, 2, 1)[:, :, :3]),
    "batch differs": lambda q, k, v: (q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)),
    "head dims of q and k differ": lambda q, k, v: (q, k[..., :8], v),
    "an empty key": lambda q, k, v: (q, k[:, :0], v[:, :0]),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_sizes_raise_the_python_paths_error(basic_manager, sized, bad):
    gen = torch.Generator().manual_seed(11)
    q = make("bshd", 1, 1, 4, 16, gen)
    k, v = make("bshd", 1, 12, 6, 16, gen), make("bshd", 1, 12, 6, 16, gen)
    sized(q, k[:, :5, :2], v[:, :5, :2], causal=True, causal_alignment="bottom_right")  # the template
    args = BAD[bad](q, k[:, :7, :2].contiguous(), v[:, :7, :2].contiguous())
    before = _sized_hits(sized)
    with pytest.raises(Exception) as compiled:
        sized(*args, causal=True, causal_alignment="bottom_right")
    with pytest.raises(Exception) as python:
        _native.python_of(opdispatch.attention)(*args, causal=True, causal_alignment="bottom_right")
    assert type(compiled.value) is type(python.value) and str(compiled.value) == str(python.value)
    assert _sized_hits(sized) == before


def test_a_policy_threshold_is_decided_again_exactly_where_it_is_crossed(basic_manager, sized):
    basic_manager.set_policy(parse_policy("version: 1\nops:\n  attention:\n    rules:\n      - name: long\n"
                                          "        when: {seqlen_k: '>=24'}\n        prefer: [reference.math]\n"))
    gen = torch.Generator().manual_seed(3)
    cache_k, cache_v = make("bshd", 1, 40, 2, 16, gen), make("bshd", 1, 40, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    kw: dict[str, Any] = dict(causal=True, causal_alignment="bottom_right")
    hits: list[bool] = []
    pending: list[Any] = []
    for length in (10, 20, 23, 24, 25, 30, 12, 13):
        k, v = cache_k[:, :length], cache_v[:, :length]
        hits.append(_check(sized, pending, "bshd", q, k, v, **kw))
    # Crossing the threshold goes to Python. The template stays the first class's (as the Python path's does):
    # new lengths on its side are sized hits, the other side's calls bind through Python (`_sized_reuse`).
    # The calls past it change the manager's dicts: back below it, the first call goes to Python once more.
    assert hits == [False, True, True, False, False, False, False, True]
    # Each result is the implementation the policy gives its length, bit for bit (the two differ here).
    for (got, *_, call_kw), length in zip(pending, (10, 20, 23, 24, 25, 30, 12, 13)):
        call_kw["impl"] = "reference.math" if length >= 24 else "cpu.flash"
    _verify(basic_manager, pending)
    k, v = cache_k[:, :20], cache_v[:, :20]
    assert not torch.equal(full_path(basic_manager, q, k, v, impl="reference.math", **kw),
                           full_path(basic_manager, q, k, v, impl="cpu.flash", **kw))


def _decode(door: Any, manager: Any, q: Any, cache_k: Any, cache_v: Any, lengths: Any) -> list[bool]:
    """Decode steps over `lengths`; each result the oracle's, then the full Python path's; which were sized hits."""
    pending: list[Any] = []
    hits = [_check(door, pending, "bshd", q, cache_k[:, :n], cache_v[:, :n]) for n in lengths]
    _verify(manager, pending)
    return hits


def test_clear_cache_and_a_policy_swap_invalidate_the_entry(basic_manager, sized):
    gen = torch.Generator().manual_seed(5)
    cache_k, cache_v = make("bshd", 1, 30, 2, 16, gen), make("bshd", 1, 30, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    assert _decode(sized, basic_manager, q, cache_k, cache_v, (3, 4, 5)) == [False, True, True]
    basic_manager.clear_cache()
    assert _decode(sized, basic_manager, q, cache_k, cache_v, (6, 7, 8)) == [False, True, True]
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [reference.math]}}", "<p>"))
    # The old entry (cpu.flash) runs no more: each call is reference.math's, through Python (its bound function
    # is not size-generic).
    assert _decode(sized, basic_manager, q, cache_k, cache_v, (9, 10, 11)) == [False, False, False]
    out = sized(q, cache_k[:, :12], cache_v[:, :12])
    assert torch.equal(out, full_path(basic_manager, q, cache_k[:, :12], cache_v[:, :12], impl="reference.math"))


def test_a_kernel_failure_on_a_sized_hit_fails_over_as_the_python_path_does(basic_manager, sized, monkeypatch,
                                                                            caplog):
    gen = torch.Generator().manual_seed(5)
    cache_k, cache_v = make("bshd", 1, 30, 2, 16, gen), make("bshd", 1, 30, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    from opdispatch.vendors.cpu import _attention as cpu_attention

    def broken(q, k, v, *args, **kwargs):  # (batch, heads, seq, dim) here
        if k.shape[-2] == 9:
            raise RuntimeError("kernel failure at length 9")
        return torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "_aten_kernel", broken)
    assert _decode(sized, basic_manager, q, cache_k, cache_v, (6, 7)) == [False, True]
    out = sized(q, cache_k[:, :9], cache_v[:, :9])  # the sized hit raises: Python runs it and fails over
    assert torch.equal(out, full_path(basic_manager, q, cache_k[:, :9], cache_v[:, :9]))
    assert any("kernel failure at length 9" in r.getMessage() for r in caplog.records)
    assert basic_manager.breaker, "the failure is recorded as a demotion"
    # A demotion changes what the Python path would do: no sized hit until Python has decided again.
    hits = _decode(sized, basic_manager, q, cache_k, cache_v, (10, 11, 12))
    assert hits[0] is False


def test_masks_kv_caches_and_lse_never_take_the_sized_path(basic_manager, sized):
    gen = torch.Generator().manual_seed(9)
    q = make("bshd", 2, 1, 4, 8, gen)
    for n in range(4, 8):
        k, v = make("bshd", 2, n, 2, 8, gen), make("bshd", 2, n, 2, 8, gen)
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        mask[0, ..., n - 1] = False
        assert torch.equal(sized(q, k, v, attn_mask=mask), full_path(basic_manager, q, k, v, attn_mask=mask))
        out, lse = sized(q, k, v, return_lse=True)
        want, want_lse = full_path(basic_manager, q, k, v, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        seqused = torch.tensor([n, n - 1], dtype=torch.int32)
        assert torch.equal(sized(q, k, v, seqused_k=seqused), full_path(basic_manager, q, k, v, seqused_k=seqused))
    assert _sized_hits(sized) == 0
