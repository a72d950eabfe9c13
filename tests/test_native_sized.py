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
    every cut, from a decode and a prefill call); where it declares none, nothing is claimed."""
    from opdispatch.engine._classes import SIZE_FIELDS, _dense_key_cuts

    declared = impl_class.dense_key_size_cuts
    if declared is None:
        pytest.skip(f"{impl_class.vendor}.{impl_class.name} declares no cuts (its class keeps no size box)")
    cuts = _dense_key_cuts(impl_class.__new__(impl_class))
    assert cuts == declared, f"{declared!r}: not a valid declaration (fields {SIZE_FIELDS}, tuples of ints)"
    impl = impl_class.__new__(impl_class)
    gen = torch.Generator().manual_seed(31)

    def key(sizes: dict[str, int]) -> Any:
        b, sq, sk, hq, hkv = (sizes[f] for f in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv"))
        q = torch.randn(b, sq, hq, 8, generator=gen).to(torch.bfloat16)
        k = torch.randn(b, sk, hkv, 8, generator=gen).to(torch.bfloat16)
        return impl.selection_key(opdispatch.validate_attention(q, k, k.clone(), causal=True))

    for base in (dict(batch=2, seqlen_q=1, seqlen_k=9, heads_q=4, heads_kv=2),
                 dict(batch=1, seqlen_q=6, seqlen_k=6, heads_q=2, heads_kv=1)):
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

            keys = {v: key(sizes(v)) for v in values}
            interval = {v: sum(c <= v for c in field_cuts) for v in values}
            for a in values:
                for b in values:
                    same = interval[a] == interval[b]
                    assert (keys[a] == keys[b]) == same, (field, a, b, keys[a], keys[b])
