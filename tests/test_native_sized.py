"""The compiled door's size-generic entries (opdispatch.base._native, `_native_size_entry` in opdispatch.doors._api):
a call of attention that differs from one the Python path ran only in sizes, inside the template's decision class,
runs the template's bound function from C. Every such call must be the Python door's, bit for bit — results and
errors, over new lengths and batch sizes — and the float64 oracle's within tolerance; what changes the decision (a
policy threshold, a demotion, clear_cache, a policy swap) must reach it; KV caches, LSE, biases and sinks never take
it. Boolean masks do (a padded batch's decode and prefill): their values are data, their broadcast pattern is kept.

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
from opdispatch.plugins.toolkit import size_generic
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
    # A repeated signature ends on an exact entry (a Python call reads it back): on its second call where Python
    # served it, after 32 sized calls where a sized entry did (a serving loop's revisited lengths stay sized).
    q, k, v = make(layout, b, sizes[-1][1], hq, d, gen), make(layout, b, sizes[-1][2], hkv, d, gen), None
    v = torch.randn_like(k)
    for _ in range(40):
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


def test_kv_caches_and_lse_never_take_the_sized_path(basic_manager, sized):
    gen = torch.Generator().manual_seed(9)
    q = make("bshd", 2, 1, 4, 8, gen)
    for n in range(4, 8):
        k, v = make("bshd", 2, n, 2, 8, gen), make("bshd", 2, n, 2, 8, gen)
        out, lse = sized(q, k, v, return_lse=True)
        want, want_lse = full_path(basic_manager, q, k, v, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        seqused = torch.tensor([n, n - 1], dtype=torch.int32)
        assert torch.equal(sized(q, k, v, seqused_k=seqused), full_path(basic_manager, q, k, v, seqused_k=seqused))
    assert _sized_hits(sized) == 0


# -- boolean masks: a padded batch's decode and prefill -----------------------------------------------------------
#
# The mask's rank, broadcast pattern, dtype and device are in the reduced key; each of its dims is 1 (broadcast) or
# the q/k size it lines up with; its values change every call (padding, rows that see no key).


def _mask_for(gen: Any, shape: tuple[int, ...]) -> Any:
    """A random boolean mask of `shape` whose first row sees no key and whose other rows see at least one."""
    mask = torch.rand(shape, generator=gen) > 0.4
    rows = mask.reshape(-1, shape[-1])  # a view: the mask is contiguous
    rows[:, -1] = True
    rows[0] = False
    return mask


def _check_masked(door: Any, pending: list[Any], layout: str, q: Any, k: Any, v: Any, mask: Any,
                  **kw: Any) -> bool:
    """`_check` with `attn_mask`: the oracle sees the same mask (in score coordinates, whatever the layout)."""
    before = _sized_hits(door)
    got = door(q, k, v, layout=layout, attn_mask=mask, **kw)
    want, _ = oracle(layout, q.double(), k.double(), v.double(), mask=mask, scale=q.shape[-1] ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    pending.append((got, q, k, v, dict(kw, layout=layout, attn_mask=mask)))
    return _sized_hits(door) > before


def _scores_mask(form: str, b: int, hq: int, sq: int, sk: int) -> tuple[int, ...]:
    return {"b11s": (b, 1, 1, sk), "b1qs": (b, 1, sq, sk), "11qs": (1, 1, sq, sk), "bhqs": (b, hq, sq, sk),
            "qs": (sq, sk)}[form]


# (layout, heads_q, heads_kv, head_dim, mask form, [(batch, seqlen_q, seqlen_k), ...]): the first decides; every
# later one keeps the mask's broadcast pattern (a batch of 1 only where the mask's batch dim is 1 anyway).
MASKED_CASES = [
    ("bhsd", 8, 2, 16, "b11s", [(4, 1, 5), (4, 1, 6), (4, 1, 7), (4, 1, 30), (2, 1, 9), (3, 1, 12)]),  # GQA decode
    ("bshd", 4, 4, 8, "b11s", [(2, 1, 3), (2, 1, 4), (5, 1, 11)]),  # decode without GQA, another layout
    ("bhsd", 4, 2, 16, "b1qs", [(2, 5, 5), (2, 7, 7), (3, 9, 9), (2, 16, 16)]),  # padded prefill, GQA
    ("bshd", 4, 2, 8, "11qs", [(2, 6, 6), (3, 8, 8), (1, 10, 10)]),  # one mask for every sequence
    ("bshd", 4, 2, 8, "11qs", [(1, 3, 9), (2, 3, 12), (1, 2, 17), (2, 3, 5)]),  # chunked prefill: fewer queries
    ("sbhd", 4, 4, 8, "bhqs", [(2, 4, 4), (3, 6, 6), (2, 11, 11)]),  # a mask per head
    ("bhsd", 6, 2, 8, "bhqs", [(2, 1, 4), (3, 1, 9), (2, 1, 15)]),  # a mask per head, GQA decode
    ("bshd", 4, 2, 16, "qs", [(2, 1, 5), (3, 1, 8), (1, 1, 20)]),  # 2-D mask, GQA decode
    ("bhsd", 2, 2, 8, "qs", [(2, 3, 3), (1, 5, 5), (4, 9, 9)]),  # 2-D mask, prefill
]


@pytest.mark.parametrize("case", range(len(MASKED_CASES)),
                         ids=[f"{c[4]}-{c[0]}-{c[1]}/{c[2]}-{c[5][0][1]}q" for c in MASKED_CASES])
def test_masked_calls_of_new_sizes_are_sized_hits_equal_to_the_python_path_and_the_oracle(basic_manager, sized,
                                                                                        case):
    layout, hq, hkv, d, form, sizes = MASKED_CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    hits: list[bool] = []
    pending: list[Any] = []
    for b, sq, sk in sizes:
        q, k, v = make(layout, b, sq, hq, d, gen), make(layout, b, sk, hkv, d, gen), make(layout, b, sk, hkv, d, gen)
        hits.append(_check_masked(sized, pending, layout, q, k, v, _mask_for(gen, _scores_mask(form, b, hq, sq, sk))))
    _verify(basic_manager, pending)
    assert hits == [False] + [True] * (len(sizes) - 1)
    # The mask's values are data: the same sizes with other values hit the exact entry, and are still exact.
    b, sq, sk = sizes[-1]
    q, k, v = make(layout, b, sq, hq, d, gen), make(layout, b, sk, hkv, d, gen), make(layout, b, sk, hkv, d, gen)
    again: list[Any] = []
    for _ in range(3):
        _check_masked(sized, again, layout, q, k, v, _mask_for(gen, _scores_mask(form, b, hq, sq, sk)))
    _verify(basic_manager, again)
    assert sized.__self__.stats()["hits"] >= 1


def test_a_masked_decode_hits_at_every_new_length_and_batch_counted_once_per_call(basic_manager, sized):
    gen = torch.Generator().manual_seed(41)
    cache_k, cache_v = make("bhsd", 4, 40, 2, 16, gen), make("bhsd", 4, 40, 2, 16, gen)
    q = make("bhsd", 4, 1, 8, 16, gen)
    usage_stats(True, basic_manager)
    pending: list[Any] = []
    hits = [_check_masked(sized, pending, "bhsd", q[:b], cache_k[:b, :, :n], cache_v[:b, :, :n],
                          _mask_for(gen, (b, 1, 1, n)))
            for b, n in [(4, 5), *((4, n) for n in range(6, 30)), (2, 30), (3, 31)]]
    ops = usage_stats(False, basic_manager).ops["attention"]
    _verify(basic_manager, pending)
    assert hits == [False] + [True] * (len(hits) - 1)
    assert (ops.calls, ops.slow_calls, ops.compiled_hits) == (len(hits), 1, len(hits) - 1)


def test_float_masks_sinks_and_masks_of_another_dtype_or_rank_never_take_the_masked_entry(basic_manager, sized):
    gen = torch.Generator().manual_seed(43)
    cache_k, cache_v = make("bhsd", 2, 30, 2, 8, gen), make("bhsd", 2, 30, 2, 8, gen)
    q = make("bhsd", 2, 1, 4, 8, gen)
    python = _native.python_of(opdispatch.attention)
    pending: list[Any] = []
    # The template: a boolean (b, 1, 1, s) decode, then one sized hit.
    assert [_check_masked(sized, pending, "bhsd", q, cache_k[:, :, :n], cache_v[:, :, :n],
                          _mask_for(gen, (2, 1, 1, n))) for n in (4, 5)] == [False, True]
    before = _sized_hits(sized)
    for n in range(6, 12):
        k, v = cache_k[:, :, :n], cache_v[:, :, :n]
        mask = _mask_for(gen, (2, 1, 1, n))
        mask[0, ..., 0] = True  # the additive form below needs a key per row (the oracle's -inf rows are NaN)
        # An additive float mask is a bias (a bypass argument): the Python path, every call.
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        got = sized(q, k, v, layout="bhsd", attn_bias=bias)
        assert torch.equal(got, full_path(basic_manager, q, k, v, layout="bhsd", attn_bias=bias))
        want, _ = oracle("bhsd", q.double(), k.double(), v.double(), bias=bias, scale=8 ** -0.5)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        # A mask with sinks: the shared epilogue, through Python.
        sinks = torch.randn(4, generator=gen)
        got = sized(q, k, v, layout="bhsd", attn_mask=mask, sinks=sinks)
        assert torch.equal(got, full_path(basic_manager, q, k, v, layout="bhsd", attn_mask=mask, sinks=sinks))
        # Another dtype (refused by validation): the Python path's very error.
        with pytest.raises(TypeError) as compiled:
            sized(q, k, v, layout="bhsd", attn_mask=mask.to(torch.uint8))
        with pytest.raises(TypeError) as reference:
            python(q, k, v, layout="bhsd", attn_mask=mask.to(torch.uint8))
        assert str(compiled.value) == str(reference.value)
    assert _sized_hits(sized) == before
    # Another rank (the same pattern in 3-D: one mask for every sequence) is another key: its first call is decided
    # by Python, and exact; its later ones are its own entry's.
    pending = []
    hits = [_check_masked(sized, pending, "bhsd", q, cache_k[:, :, :n], cache_v[:, :, :n],
                          _mask_for(gen, (1, 1, n))) for n in (12, 13, 14)]
    _verify(basic_manager, pending)
    assert hits == [False, True, True]


BAD_MASKS = {
    "key length differs": lambda b, n: (b, 1, 1, n + 1),
    "batch differs": lambda b, n: (b + 1, 1, 1, n),
    "more heads than q's": lambda b, n: (b, 9, 1, n),
    "more queries than q's": lambda b, n: (b, 1, 2, n),
    "five dims": lambda b, n: (1, b, 1, 1, n),
}


@pytest.mark.parametrize("bad", list(BAD_MASKS))
def test_masks_that_do_not_broadcast_raise_the_python_paths_error(basic_manager, sized, bad):
    gen = torch.Generator().manual_seed(45)
    cache_k, cache_v = make("bhsd", 3, 20, 2, 8, gen), make("bhsd", 3, 20, 2, 8, gen)
    for b, n in ((2, 6), (2, 7), (3, 8)):  # a template and its sized entry
        sized(cache_k[:b, :, :1].repeat(1, 2, 1, 1), cache_k[:b, :, :n], cache_v[:b, :, :n], layout="bhsd",
              attn_mask=_mask_for(gen, (b, 1, 1, n)))
    before = _sized_hits(sized)
    q, k, v = make("bhsd", 2, 1, 4, 8, gen), cache_k[:2, :, :9], cache_v[:2, :, :9]
    mask = torch.ones(BAD_MASKS[bad](2, 9), dtype=torch.bool)
    with pytest.raises(Exception) as compiled:
        sized(q, k, v, layout="bhsd", attn_mask=mask)
    with pytest.raises(Exception) as python:
        _native.python_of(opdispatch.attention)(q, k, v, layout="bhsd", attn_mask=mask)
    assert type(compiled.value) is type(python.value) and str(compiled.value) == str(python.value)
    assert _sized_hits(sized) == before


class _LenientMask(opdispatch.AttentionImpl):
    """A size-generic masked bind that would run a mask longer than the call (it slices it): only the door's
    constraints keep such a call from it, so that validation refuses it as the Python path does."""

    vendor, name, priority = "test", "lenient_mask", 1000
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bhsd"}),
                                    attn_mask=True)
    binds_attn_mask = True

    def run(self, call):
        return self.bind(call)(call.q, call.k, call.v, None, None, call.attn_mask, None)

    def bind(self, call):
        scale = call.scale

        def lenient(q, k, v, seqused_k, block_table, attn_mask, sinks):
            b, hq, sq, _ = q.shape
            group = hq // k.shape[1]
            k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
            mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))[..., :sq, :k.shape[2]]
            scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            return (torch.softmax(scores, -1).nan_to_num() @ v).to(q.dtype)

        return size_generic(lenient)


@pytest.mark.parametrize("bad", ["key length differs", "more queries than q's"])
def test_a_mask_the_bound_function_would_take_is_still_refused_as_the_python_path_refuses_it(basic_manager, sized,
                                                                                           bad):
    basic_manager.register_impl(_LenientMask())
    basic_manager.set_policy(parse_policy("ops: {attention: {order: ['test.*', cpu.flash]}}", "<p>"))
    gen = torch.Generator().manual_seed(49)
    q, k = make("bhsd", 2, 1, 4, 8, gen), make("bhsd", 2, 9, 2, 8, gen)
    assert opdispatch.explain(q, k, k, layout="bhsd", attn_mask=_mask_for(gen, (2, 1, 1, 9))).chosen_id == \
        "test.lenient_mask"
    test_masks_that_do_not_broadcast_raise_the_python_paths_error(basic_manager, sized, bad)


def test_a_policy_threshold_re_decides_a_masked_decode_exactly_where_it_is_crossed(basic_manager, sized):
    basic_manager.set_policy(parse_policy("version: 1\nops:\n  attention:\n    rules:\n      - name: long\n"
                                          "        when: {seqlen_k: '>=24'}\n        prefer: [reference.math]\n"))
    gen = torch.Generator().manual_seed(47)
    cache_k, cache_v = make("bhsd", 3, 40, 2, 16, gen), make("bhsd", 3, 40, 2, 16, gen)
    q = make("bhsd", 3, 1, 4, 16, gen)
    lengths = (10, 20, 23, 24, 25, 30, 12, 13)
    pending: list[Any] = []
    hits = [_check_masked(sized, pending, "bhsd", q, cache_k[:, :, :n], cache_v[:, :, :n],
                          _mask_for(gen, (3, 1, 1, n))) for n in lengths]
    # As the unmasked decode: the template's side hits, the other side binds through Python (reference.math's
    # function is bound per call), back below the first call goes to Python once more.
    assert hits == [False, True, True, False, False, False, False, True]
    for (*_, kw), n in zip(pending, lengths):
        kw["impl"] = "reference.math" if n >= 24 else "cpu.flash"
    _verify(basic_manager, pending)


# -- classes whose candidates' selection keys read sizes --------------------------------------------------------
#
# On the H100 the decode's class is keyed by nvidia.cudnn, whose selection key reads whether each length is 1.
# `_OneKeyOnly` plays that part on the CPU: keyed (its checks read sizes), and chosen only across its cut (one
# key), where it computes in float64 — so a call decided afresh there gives other bits than cpu.flash's.


class _OneKeyOnly(opdispatch.AttentionImpl):
    vendor, name, priority = "test", "one_key", 1000
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, layouts=frozenset({"bshd"}),
                                    causal=True, causal_alignments=frozenset({"top_left", "bottom_right"}))

    def selection_key(self, call):
        return (call.seqlen_k == 1, call.seqlen_q == 1)

    def extra_reasons(self, call, device):
        return [] if call.seqlen_k == 1 else [f"seqlen_k {call.seqlen_k}: this test kernel takes one key"]

    def run(self, call):
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        p = torch.softmax(q @ k.transpose(-1, -2) * call.scale, -1)  # one key: every mask keeps it
        return call.from_bhsd((p @ v).to(call.dtype))


class _ExactSizesKey(_OneKeyOnly):
    """Checks that read sizes without a selection key: the default key is the exact signature (each length is a
    class of its own, decided afresh)."""

    name = "exact_sizes"
    selection_key = opdispatch.AttentionImpl.selection_key


@pytest.fixture
def counted_hook(loaded, basic_manager, monkeypatch):  # noqa: F811
    """A compiled attention door with size-generic entries on, and how often it asked its hook."""
    asked = [0]

    def hook(*args):
        asked[0] += 1
        return _api._native_size_entry(*args)

    python = _native.python_of(opdispatch.attention)
    door = _native.compiled_front_door(python, **dict(python.__opdispatch_native_spec__, size_entry=hook))
    return door, asked


def _decode_pass(door: Any, manager: Any, lengths: Any, seed: int) -> list[bool]:
    gen = torch.Generator().manual_seed(seed)
    cache_k, cache_v = make("bshd", 2, max(lengths), 2, 16, gen), make("bshd", 2, max(lengths), 2, 16, gen)
    q = make("bshd", 2, 1, 4, 16, gen)
    return _decode(door, manager, q, cache_k, cache_v, lengths)


@pytest.mark.parametrize("keyed", [_OneKeyOnly, _ExactSizesKey], ids=["reads-length-one", "exact-sizes"])
def test_a_class_without_a_box_asks_its_hook_once_not_per_new_length(basic_manager, counted_hook, keyed):
    """A keyed candidate that declares no cuts leaves the class without a box: the door keeps "nothing" for its
    size-generic key, and new lengths (each a new decision, for the exact-sizes key) ask the hook no more."""
    door, asked = counted_hook
    basic_manager.register_impl(keyed())
    hits = _decode_pass(door, basic_manager, range(3, 40), seed=21)
    assert not any(hits) and asked[0] == 1
    assert basic_manager.cached_decision(
        "attention", opdispatch.validate_attention(*(make("bshd", 2, n, h, 16, torch.Generator()) for n, h in
                                                     ((1, 4), (39, 2), (39, 2))))).chosen_id == "cpu.flash"
    basic_manager.clear_cache()  # a new state: asked again
    _decode_pass(door, basic_manager, range(40, 44), seed=22)
    assert asked[0] == 2


def test_a_function_bound_per_call_asks_its_hook_once_not_per_new_length(basic_manager, counted_hook):
    """reference.math binds per call (not size-generic): each new length binds through Python, which keeps the
    template it has (same decision), so the entry the door keeps for "nothing" stays current."""
    door, asked = counted_hook
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [reference.math]}}", "<p>"))
    hits = _decode_pass(door, basic_manager, range(3, 30), seed=23)
    assert not any(hits) and asked[0] == 1


def test_declared_cuts_box_the_class_a_call_across_the_cut_is_decided_afresh(basic_manager, counted_hook,
                                                                           monkeypatch):
    door, asked = counted_hook
    monkeypatch.setattr(_OneKeyOnly, "dense_key_size_cuts", {"seqlen_q": (2,), "seqlen_k": (2,)})
    basic_manager.register_impl(_OneKeyOnly())
    basic_manager.set_policy(parse_policy("ops: {attention: {order: ['test.*', cpu.flash]}}", "<p>"))
    gen = torch.Generator().manual_seed(25)
    cache_k, cache_v = make("bshd", 2, 40, 2, 16, gen), make("bshd", 2, 40, 2, 16, gen)
    q = make("bshd", 2, 1, 4, 16, gen)
    lengths = [5, 6, 7, 30, 1, 2, 9, 10]
    pending: list[Any] = []
    hits = [_check(door, pending, "bshd", q, cache_k[:, :n], cache_v[:, :n]) for n in lengths]
    # One key lies across the cut: decided afresh (the test kernel); back inside, Python once (its dicts
    # changed), then sized hits again.
    assert hits == [False, True, True, True, False, False, True, True]
    for (*_, kw), n in zip(pending, lengths):
        kw["impl"] = "test.one_key" if n == 1 else "cpu.flash"
    _verify(basic_manager, pending)
    # Which implementation each side's class went to (one key's output is v under any correct kernel).
    chosen = {n: basic_manager.cached_decision("attention", opdispatch.validate_attention(
        q, cache_k[:, :n], cache_v[:, :n])).chosen_id for n in (1, 2, 30)}
    assert chosen == {1: "test.one_key", 2: "cpu.flash", 30: "cpu.flash"}


def _keyed_builtins() -> list[type]:
    """Every built-in attention implementation whose checks read more than the class key (the ones that join it
    with their selection key), imported from every vendor package."""
    import importlib
    import pkgutil

    import opdispatch.vendors as vendors
    from opdispatch.engine._classes import _reads_more

    for module in pkgutil.iter_modules(vendors.__path__):
        importlib.import_module(f"{vendors.__name__}.{module.name}")

    def subclasses(cls: type) -> list[type]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    return sorted({c for c in subclasses(opdispatch.AttentionImpl) if c.__module__.startswith(vendors.__name__)
                   and _reads_more(c.__new__(c))}, key=lambda c: f"{c.vendor}.{c.name}")


def test_nvidia_cudnns_selection_key_reads_sizes_and_declares_them():
    ids = {f"{c.vendor}.{c.name}": c for c in _keyed_builtins()}
    assert ids["nvidia.cudnn"].dense_key_size_cuts == {"seqlen_q": (2,), "seqlen_k": (2,)}


# Built-ins whose dense selection key reads sizes in ways cuts cannot state: their devices' dense classes keep no
# size box (each new length goes through the Python door there). Aim: none on a device the project measures.
UNDECLARED_CUTS = {"cambricon.sdpa": "fused_gate reads products of batch, heads and lengths (MLU500 only)"}


def test_every_keyed_builtin_declares_its_cuts_but_the_listed_ones():
    """One undeclared keyed candidate available on a device takes the size box from every dense class there: on
    the H100 flagos.flash_mla (available wherever FlagGems is) kept every growing decode on the Python path."""
    undeclared = {f"{c.vendor}.{c.name}" for c in _keyed_builtins() if c.dense_key_size_cuts is None}
    assert undeclared == set(UNDECLARED_CUTS)


@pytest.mark.parametrize("impl_class", _keyed_builtins(), ids=lambda c: f"{c.vendor}.{c.name}")
def test_every_builtin_declaration_of_dense_key_cuts_is_exact(impl_class):
    """Where a built-in declares `dense_key_size_cuts`, its selection key of dense calls is constant between
    consecutive cuts of every field and changes at each cut (varying one field at a time, over both sides of
    every cut, from a decode and a prefill call, causal or boolean-masked with each broadcast pattern the compiled
    door's sized entries take); where it declares none, nothing is claimed."""
    from opdispatch.engine._classes import SIZE_FIELDS, _dense_key_cuts

    declared = impl_class.dense_key_size_cuts
    if declared is None:
        pytest.skip(f"{impl_class.vendor}.{impl_class.name} declares no cuts (its class keeps no size box)")
    cuts = _dense_key_cuts(impl_class.__new__(impl_class))
    assert cuts == declared, f"{declared!r}: not a valid declaration (fields {SIZE_FIELDS}, tuples of ints)"
    impl = impl_class.__new__(impl_class)
    gen = torch.Generator().manual_seed(31)

    def key(sizes: dict[str, int], form: str | None) -> Any:
        b, sq, sk, hq, hkv = (sizes[f] for f in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv"))
        q = torch.randn(b, sq, hq, 8, generator=gen).to(torch.bfloat16)
        k = torch.randn(b, sk, hkv, 8, generator=gen).to(torch.bfloat16)
        if form is None:
            return impl.selection_key(opdispatch.validate_attention(q, k, k.clone(), causal=True))
        mask = _mask_for(gen, _scores_mask(form, b, hq, sq, sk))
        return impl.selection_key(opdispatch.validate_attention(q, k, k.clone(), attn_mask=mask))

    for (base, form) in ((base, form) for base in (dict(batch=2, seqlen_q=1, seqlen_k=9, heads_q=4, heads_kv=2),
                                                   dict(batch=1, seqlen_q=6, seqlen_k=6, heads_q=2, heads_kv=1))
                         for form in (None, "b11s", "b1qs", "11qs", "bhqs", "qs")):
        for field in SIZE_FIELDS:
            field_cuts = sorted(cuts.get(field, ()))
            values = sorted({1, 2, 3, 17, *(c + d for c in field_cuts for d in (-1, 0, 1))} - {0})

            def sizes(value: int) -> dict[str, int]:
                s = dict(base, **{field: value})
                if field == "heads_kv":
                    s["heads_q"] = 2 * value
                elif field == "heads_q":
                    s["heads_kv"] = 1
                elif field == "seqlen_q" and base["seqlen_q"] == base["seqlen_k"]:
                    s["seqlen_k"] = value  # a prefill keeps equal lengths (the class key holds that)
                return s

            keys = {v: key(sizes(v), form) for v in values}
            interval = {v: sum(c <= v for c in field_cuts) for v in values}
            for a in values:
                for b in values:
                    same = interval[a] == interval[b]
                    assert (keys[a] == keys[b]) == same, (form, field, a, b, keys[a], keys[b])


def test_a_length_revisited_stays_sized_and_only_a_signature_that_keeps_coming_back_turns_exact(basic_manager,
                                                                                              counted_hook):
    """A padded decode's second pass over the same lengths (a server's requests revisiting them): every call a
    sized hit, none through Python (whose cache never saw those lengths: a second call there would run the whole
    Python path). A signature that keeps coming back (32 sized calls) goes to Python once and ends exact."""
    door, _ = counted_hook
    gen = torch.Generator().manual_seed(41)
    cache_k, cache_v = make("bhsd", 3, 60, 2, 16, gen), make("bhsd", 3, 60, 2, 16, gen)
    q = make("bhsd", 3, 1, 4, 16, gen)
    mask = torch.rand(3, 1, 1, 60, generator=gen) > 0.3

    def one_pass() -> list[torch.Tensor]:
        return [door(q, cache_k[:, :, :n], cache_v[:, :, :n], layout="bhsd", attn_mask=mask[..., :n])
                for n in range(20, 40)]

    first = one_pass()
    usage_stats(True, basic_manager)
    sized_before = _sized_hits(door)
    second = one_pass()
    ops = usage_stats(False, basic_manager).ops["attention"]
    # Length 20 made the template through Python: its second call reads its exact entry back there (a Python hit).
    assert (ops.compiled_hits, ops.python_hits, ops.slow_calls) == (19, 1, 0)
    assert _sized_hits(door) - sized_before == 19
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    exact_before = int(door.__self__.stats()["hits"])
    for _ in range(40):
        out = door(q, cache_k[:, :, :33], cache_v[:, :, :33], layout="bhsd", attn_mask=mask[..., :33])
    assert int(door.__self__.stats()["hits"]) > exact_before  # turned exact after 32 sized calls
    torch.testing.assert_close(out, second[13], atol=0, rtol=0)


def test_layers_taking_turns_keep_their_sized_entries(basic_manager, counted_hook):
    """A model's decode step: each layer (a module scope, a decision class of its own) calls in turn with one more
    key. Their Python calls at the first step must not leave the others' entries stale for good (a decision cache
    hit used to move its class to the end, changing the dict every entry watches): after the first two steps every
    call is a sized hit, and the hook is not asked again."""
    from opdispatch.policies._overrides import MODULE

    door, asked = counted_hook
    gen = torch.Generator().manual_seed(43)
    layers = [f"model.layers.{i}.self_attn" for i in range(4)]
    caches = {name: (make("bhsd", 2, 40, 2, 16, gen), make("bhsd", 2, 40, 2, 16, gen)) for name in layers}
    q = make("bhsd", 2, 1, 4, 16, gen)
    usage_stats(True, basic_manager)
    outs = {}
    for n in range(10, 30):
        if n == 12:
            usage_stats(True, basic_manager)
            asked_before = asked[0]
        for name in layers:
            k, v = caches[name]
            token = MODULE.set(name)
            try:
                outs[name, n] = door(q, k[:, :, :n], v[:, :, :n], layout="bhsd")
            finally:
                MODULE.reset(token)
    ops = usage_stats(False, basic_manager).ops["attention"]
    assert (ops.compiled_hits, ops.slow_calls, ops.python_hits) == (18 * 4, 0, 0)
    assert asked[0] == asked_before
    for (name, n), out in outs.items():
        k, v = caches[name]
        torch.testing.assert_close(out, opdispatch.attention(q, k[:, :, :n], v[:, :, :n], layout="bhsd",
                                                             impl="reference.math"), atol=2e-5, rtol=2e-5)
