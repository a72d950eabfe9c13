"""Size-generic reuse (opdispatch.doors._api `_sized_reuse`): a call differing from a remembered one only in sizes takes
its template. Its results and errors must be the full path's, bit for bit, and the float64 oracle's within
tolerance; what changes the decision (a policy threshold, a demotion, a pin) must still change it."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.doors import _api
from opdispatch.engine._stats import stats as usage_stats
from opdispatch.policies import parse_policy
from tests.test_numerics import naive_attention

TO_BHSD = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}


def make(layout, b, s, h, d, gen, requires_grad=False):
    shape = {"bshd": (b, s, h, d), "bhsd": (b, h, s, d), "sbhd": (s, b, h, d)}[layout]
    return torch.randn(*shape, generator=gen, dtype=torch.float32).requires_grad_(requires_grad)


def oracle(layout, q, k, v, mask=None, **kw):
    order = TO_BHSD[layout]
    out, lse = naive_attention(q.permute(order), k.permute(order), v.permute(order), mask=mask, **kw)
    return out.permute(tuple(order.index(i) for i in range(4))), lse


def _assert_same_and_exact(got, want, layout, q, k, v, kw, gen, requires_grad, message):
    """`got` (the path under test) equals `want` (the full path) bit for bit, outputs and gradients, and matches
    the float64 oracle (and its LSE when returned)."""
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    for a, w in zip(got_t, want_t):
        assert torch.equal(a, w), message
    out, lse = oracle(layout, q.detach(), k.detach(), v.detach(), mask=kw.get("attn_mask"),
                      scale=kw.get("scale", q.shape[-1] ** -0.5), causal=kw.get("causal", False),
                      alignment=kw.get("causal_alignment", "top_left"), window=kw.get("window"))
    torch.testing.assert_close(got_t[0].detach().double(), out, atol=2e-5, rtol=2e-5)
    if kw.get("return_lse"):
        torch.testing.assert_close(got_t[1].double(), lse, atol=2e-5, rtol=2e-5)
    if requires_grad:
        g = torch.randn(got_t[0].shape, generator=gen)
        grads = torch.autograd.grad(got_t[0], (q, k, v), g)
        for a, w in zip(grads, torch.autograd.grad(want_t[0], (q, k, v), g)):
            assert torch.equal(a, w), message + " (gradients)"


def full_path(manager, q, k, v, **kw):
    """The reference: the same call with no template to reuse (validated and bound in full)."""
    saved = dict(manager.size_generic), dict(manager.fast)
    manager.size_generic.clear()
    manager.fast.clear()
    try:
        return _api._attention_slow(manager, None, *_arguments(q, k, v, kw))
    finally:
        manager.size_generic.update(saved[0])
        manager.fast.update(saved[1])


def _bound_for(manager, k_shape):
    return next(fn for key, fn in manager.fast.items() if k_shape in key)


def _arguments(q, k, v, kw):
    given = {**{a.name: a.default for a in _api.ATTENTION_ARGS.args}, "q": q, "k": k, "v": v}
    given.update(kw)
    return tuple(given[n] for n in _api._NAMES)


@pytest.fixture
def validations(monkeypatch):
    """How many times the full validation ran (the size-generic path does not run it)."""
    seen = []
    original = _api.validate_attention

    def counting(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_api, "validate_attention", counting)
    return seen


CASES = [
    # layout, (batch, sq, hq, hkv, d), later sizes [(batch, sq, sk)], options
    ("bshd", (1, 1, 8, 2, 16), [(1, 1, 9), (1, 1, 30), (3, 1, 12)], dict(causal=True, causal_alignment="bottom_right")),
    ("bhsd", (2, 4, 4, 4, 8), [(2, 4, 9), (2, 5, 5), (1, 4, 7)], dict(causal=True, causal_alignment="bottom_right")),
    ("sbhd", (2, 3, 6, 3, 8), [(2, 3, 11), (4, 2, 2)], dict(causal=True)),
    # sk < sq bottom-right: rows that see no key (zeros out, lse -inf), then rows that all see keys
    ("bshd", (1, 6, 4, 2, 8), [(1, 6, 3), (1, 6, 9), (2, 5, 2)],
     dict(causal=True, causal_alignment="bottom_right", return_lse=True)),
    ("bshd", (2, 5, 4, 1, 8), [(2, 5, 12), (1, 3, 20)], dict(window=(3, 0), causal=True, return_lse=True)),
    ("bhsd", (1, 4, 2, 2, 8), [(1, 4, 10), (3, 4, 6)], dict(window=(2, 2), causal_alignment="bottom_right")),
    ("bshd", (2, 1, 4, 2, 8), [(2, 1, 7), (3, 1, 13)], dict(mask="padding")),
    ("bhsd", (2, 3, 4, 2, 8), [(2, 3, 7), (2, 2, 9)], dict(mask="full", causal=False)),  # batch 1 would be
    # another broadcast pattern of the mask: another class (the size-generic key keeps it)
]


def _mask(kind, b, hq, sq, sk, gen):
    if kind == "padding":  # (batch, 1, 1, sk): each sequence's own fill, broadcast over heads and queries
        fill = torch.randint(1, sk + 1, (b,), generator=gen)
        return (torch.arange(sk)[None, :] < fill[:, None])[:, None, None, :]
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.7
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sizes_reuse_the_template_and_match_the_full_path_and_the_oracle(basic_manager, door, validations, case,
                                                                         requires_grad):
    layout, (b, sq, hq, hkv, d), later, options = CASES[case]
    gen = torch.Generator().manual_seed(case)
    options = dict(options)
    mask_kind = options.pop("mask", None)
    sizes = [(b, sq, sq + 2)] + later
    for i, (bb, qq, kk) in enumerate(sizes):
        q = make(layout, bb, qq, hq, d, gen, requires_grad)
        k = make(layout, bb, kk, hkv, d, gen, requires_grad)
        v = make(layout, bb, kk, hkv, d, gen, requires_grad)
        kw = dict(options, layout=layout)
        if mask_kind:
            kw["attn_mask"] = _mask(mask_kind, bb, hq, qq, kk, gen)
        before = len(validations)
        got = door(q, k, v, **kw)
        if i > 0:
            assert len(validations) == before, "a call differing only in sizes was validated in full"
        assert basic_manager.fast, "the next call of this exact signature hits the per-call fast path"
        want = full_path(basic_manager, q, k, v, **kw)
        _assert_same_and_exact(got, want, layout, q, k, v, kw, gen, requires_grad,
                               "the size-generic path differs from the full path")


BAD = [
    ("k and v lengths differ", lambda q, k, v: (q, k, v[:, :-1])),
    ("batch differs", lambda q, k, v: (q[:1], k, v)),
    ("heads do not divide", lambda q, k, v: (q[:, :, :3], k, v)),
    ("empty", lambda q, k, v: (q, k[:, :0], v[:, :0])),
    ("mask does not broadcast", "mask"),
]


@pytest.mark.parametrize("name,bad", BAD)
def test_errors_of_a_reused_template_are_the_full_paths(basic_manager, door, name, bad):
    gen = torch.Generator().manual_seed(7)
    q, k, v = make("bshd", 2, 2, 4, 16, gen), make("bshd", 2, 5, 2, 16, gen), make("bshd", 2, 5, 2, 16, gen)
    kw = dict(causal=True, causal_alignment="bottom_right")
    if bad == "mask":
        door(q, k, v, attn_mask=torch.ones(2, 1, 2, 5, dtype=torch.bool), **kw)  # the template, masked
        args, kw = (q, k[:, :4], v[:, :4]), dict(kw, attn_mask=torch.ones(2, 1, 2, 5, dtype=torch.bool))
    else:
        door(q, k, v, **kw)
        args = bad(q, make("bshd", 2, 7, 2, 16, gen), make("bshd", 2, 7, 2, 16, gen))
    assert basic_manager.size_generic
    with pytest.raises(Exception) as reused:
        door(*args, **kw)
    basic_manager.size_generic.clear()
    basic_manager.fast.clear()
    with pytest.raises(Exception) as full:
        door(*args, **kw)
    assert type(reused.value) is type(full.value) and str(reused.value) == str(full.value)


def test_a_size_threshold_of_the_policy_is_decided_again(basic_manager, door, monkeypatch):
    policy = parse_policy("version: 1\nops:\n  attention:\n    rules:\n      - name: long\n"
                          "        when: {seqlen_k: '>=24'}\n        prefer: [reference.math]\n")
    basic_manager.set_policy(policy)
    gen = torch.Generator().manual_seed(3)
    cache_k, cache_v = make("bshd", 1, 40, 2, 16, gen), make("bshd", 1, 40, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    chosen = []
    for length in (10, 20, 23, 24, 30, 12):
        out = door(q, cache_k[:, :length], cache_v[:, :length], causal=True, causal_alignment="bottom_right")
        chosen.append(_bound_for(basic_manager, cache_k[:, :length].shape).decision.chosen_id)
        want = full_path(basic_manager, q, cache_k[:, :length], cache_v[:, :length], causal=True,
                         causal_alignment="bottom_right")
        assert torch.equal(out, want)
    assert chosen == ["cpu.flash"] * 3 + ["reference.math"] * 2 + ["cpu.flash"]


def test_a_pin_and_a_scope_key_their_own_templates(basic_manager, door):
    gen = torch.Generator().manual_seed(4)
    cache_k, cache_v = make("bshd", 1, 30, 2, 16, gen), make("bshd", 1, 30, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    for length in (5, 6, 7):
        k, v = cache_k[:, :length], cache_v[:, :length]
        pinned = door(q, k, v, impl="reference.math")
        with opdispatch.policy_override(prefer=["reference.math"]):
            overridden = door(q, k, v)
        plain = door(q, k, v)
        assert torch.equal(pinned, full_path(basic_manager, q, k, v, impl="reference.math"))
        assert torch.equal(overridden, pinned)
        assert torch.equal(plain, full_path(basic_manager, q, k, v))
    chosen = {fn.decision.chosen_id for fn in basic_manager.fast.values()}
    assert chosen == {"reference.math", "cpu.flash"}


def test_a_reused_function_that_raises_fails_over_for_its_own_signature(basic_manager, door, monkeypatch, caplog):
    gen = torch.Generator().manual_seed(5)
    cache_k, cache_v = make("bshd", 1, 30, 2, 16, gen), make("bshd", 1, 30, 2, 16, gen)
    q = make("bshd", 1, 1, 4, 16, gen)
    door(q, cache_k[:, :5], cache_v[:, :5])  # the template, bound to cpu.flash
    template = next(iter(basic_manager.size_generic.values()))
    assert template.fn.size_generic and template.decision.chosen_id == "cpu.flash"
    from opdispatch.vendors.cpu import _attention as cpu_attention

    def broken(q, k, v, *args, **kwargs):  # (batch, heads, seq, dim) here
        if k.shape[-2] == 9:
            raise RuntimeError("kernel failure at length 9")
        return torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "_aten_kernel", broken)
    basic_manager.fast.clear()
    basic_manager.size_generic.clear()
    door(q, cache_k[:, :6], cache_v[:, :6])  # a template bound to the broken kernel (it passes at 6)
    out = door(q, cache_k[:, :9], cache_v[:, :9])  # reused: raises, fails over for this signature
    assert torch.equal(out, full_path(basic_manager, q, cache_k[:, :9], cache_v[:, :9]))
    assert any("kernel failure at length 9" in r.getMessage() for r in caplog.records)
    fn9 = _bound_for(basic_manager, cache_k[:, :9].shape)
    assert fn9.decision.chosen_id != "cpu.flash"
    out = door(q, cache_k[:, :7], cache_v[:, :7])  # other lengths keep cpu.flash
    fn7 = _bound_for(basic_manager, cache_k[:, :7].shape)
    assert fn7.decision.chosen_id == "cpu.flash"


def test_calls_with_sinks_never_reuse_a_template(basic_manager, door):
    gen = torch.Generator().manual_seed(6)
    q = make("bshd", 1, 1, 4, 16, gen)
    sinks = torch.randn(4, generator=gen)
    for length in (5, 6):
        k, v = make("bshd", 1, length, 2, 16, gen), make("bshd", 1, length, 2, 16, gen)
        door(q, k, v, sinks=sinks)
    assert not basic_manager.size_generic


# A padded batch's decode and prefill as transformers sends them: a boolean mask every call (its values change),
# no causal flag. cpu.flash binds it (`_bind_masked`, size-generic): each call must be the full path's `run` bit for
# bit — fp32 and bf16, every layout, the mask broadcast 2-D to 4-D, with rows that see no key — and the oracle's.
MASKED = [
    # layout, dtype, (batch, sq, hq, hkv, d), mask shape as (batch?, heads?, queries?) dims kept, lengths
    ("bhsd", torch.float32, (4, 1, 8, 2, 16), "b11k", (9, 10, 17)),
    ("bhsd", torch.bfloat16, (3, 1, 4, 4, 32), "b11k", (5, 6, 40)),
    ("bshd", torch.float32, (2, 5, 4, 2, 8), "b1qk", (5, 7, 12)),  # a prefill: every row its own pattern
    ("sbhd", torch.float32, (2, 3, 6, 3, 8), "bhqk", (4, 9)),
    ("bhsd", torch.float32, (3, 2, 4, 1, 8), "qk", (6, 11)),  # 2-D: broadcast over batch and heads
    ("bshd", torch.bfloat16, (2, 4, 4, 2, 16), "1qk", (4, 8)),  # 3-D
]


def _masked_shape(kind, b, hq, sq, sk):
    dims = {"b11k": (b, 1, 1, sk), "b1qk": (b, 1, sq, sk), "bhqk": (b, hq, sq, sk), "qk": (sq, sk),
            "1qk": (1, sq, sk)}
    return dims[kind]


@pytest.mark.parametrize("case", range(len(MASKED)))
def test_a_boolean_mask_binds_on_cpu_flash_and_matches_run_bit_for_bit(basic_manager, door, validations, case):
    layout, dtype, (b, sq, hq, hkv, d), kind, lengths = MASKED[case]
    gen = torch.Generator().manual_seed(100 + case)
    for i, sk in enumerate(lengths):
        q, k, v = (make(layout, b, n, h, d, gen).to(dtype) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        mask = torch.rand(*_masked_shape(kind, b, hq, sq, sk), generator=gen) < 0.6
        mask[..., 0] = True
        if mask.dim() >= 2 and mask.shape[-2] > 1:
            mask[..., 1, :] = False  # a row that sees no key: the kernel's output for it, as run() gives it
        before = len(validations)
        got = door(q, k, v, layout=layout, attn_mask=mask)
        assert door(q, k, v, layout=layout, attn_mask=mask).equal(got)  # the exact signature's hit
        if i > 0:
            assert len(validations) == before, "a masked call differing only in sizes was validated in full"
        fn = _bound_for(basic_manager, k.shape)
        assert fn.decision.chosen_id == "cpu.flash" and fn.size_generic, "the mask took the run() path"
        want = full_path(basic_manager, q, k, v, layout=layout, attn_mask=mask)
        assert torch.equal(got, want), "the bound masked call differs from run()"
        out, _ = oracle(layout, q.double(), k.double(), v.double(), mask=mask, scale=d ** -0.5)
        seen = mask.expand(b, hq, sq, sk).any(-1)  # rows with a key (a row with none is the kernel's convention)
        order = TO_BHSD[layout]
        torch.testing.assert_close(got.double().permute(order)[seen], out.permute(order)[seen],
                                   **(dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else
                                      dict(atol=2e-5, rtol=2e-5)))


def test_masked_calls_the_bound_path_does_not_take_go_through_run(basic_manager, door):
    """Causal with a mask, return_lse with a mask: not bound (`_bind_masked` keeps no causal pattern nor LSE
    fix-up); they run through `run` and match the full path."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = make("bshd", 2, 3, 4, 16, gen), make("bshd", 2, 7, 2, 16, gen), make("bshd", 2, 7, 2, 16, gen)
    mask = torch.rand(2, 1, 3, 7, generator=gen) < 0.7
    for kw in (dict(causal=True, causal_alignment="bottom_right"), dict(return_lse=True)):
        got = door(q, k, v, attn_mask=mask, **kw)
        assert not _bound_for(basic_manager, k.shape).size_generic
        want = full_path(basic_manager, q, k, v, attn_mask=mask, **kw)
        for a, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, w)
        basic_manager.fast.clear()


def test_the_size_generic_key_reduces_exactly_the_shapes():
    """`size_generic_key` reads shape positions from the argument definition: every item but the shapes is kept,
    the shapes reduced to rank and head dim (a mask's to its rank and broadcast pattern)."""
    python_door = __import__("opdispatch.base._native", fromlist=["python_of"]).python_of(opdispatch.attention)
    source = python_door.__opdispatch_source__
    expression = "(" + source.split("key = (", 1)[1].split("\n", 1)[0]
    q, k = torch.randn(2, 1, 8, 64), torch.randn(2, 10, 2, 64)
    base = {**{a.name: a.default for a in _api.ATTENTION_ARGS.args}, "q": q, "k": k, "v": k}
    for extra in ({}, dict(attn_mask=torch.ones(2, 1, 1, 10, dtype=torch.bool), causal=True),
                  dict(window=(3, 0)), dict(sinks=torch.ones(8))):
        key = eval(expression, python_door.__globals__, {**base, **extra})  # noqa: S307  (the door's own key)
        assert len(key) == _api._KEY_LENGTH, "the positions read from ATTENTION_ARGS no longer fit its key"
        other = ("compat.scaled_dot_product_attention", *key[1:])  # another door's key: reduced item by item
        for given in (key, other):
            reduced = _api.size_generic_key(given)
            assert len(reduced) == len(given) and reduced[0] == given[0]
            for item, got in zip(given[1:], reduced[1:]):
                if type(item) is torch.Size:
                    assert got == (len(item), item[-1])
                elif type(item) is tuple and item and type(item[0]) is torch.Size:
                    assert got == ((len(item[0]), tuple(n == 1 for n in item[0])), *item[1:])
                else:
                    assert got is item


# A decode step under GQA: cpu.flash runs its query heads packed as each k/v head's queries (`_packed_kernel`) in
# every path — bound, run() and backward() — so they agree bit for bit; the oracle checks the packing itself.
DECODE = [
    # layout, (batch, hq, hkv, d), lengths, options
    ("bhsd", (1, 8, 2, 16), (9, 10, 33), {}),
    ("bhsd", (2, 8, 2, 16), (4, 9), dict(scale=0.3)),  # a scale of its own: passed (the default one is left out)
    ("bshd", (3, 8, 2, 16), (5, 6), dict(causal=True, causal_alignment="bottom_right", return_lse=True)),
    ("sbhd", (2, 6, 3, 8), (4, 7), dict(return_lse=True)),
    ("bhsd", (2, 8, 1, 8), (5, 12), dict(mask="heads")),  # a mask per query head: split as q is
    ("bshd", (4, 4, 2, 8), (3, 8), dict(mask="padding")),
    ("bhsd", (2, 4, 2, 8), (6, 7), dict(window=(2, 0), causal=True, causal_alignment="bottom_right")),  # run()
]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", range(len(DECODE)))
def test_a_gqa_decode_step_packs_its_query_heads_alike_on_every_path(basic_manager, door, case, requires_grad):
    layout, (b, hq, hkv, d), lengths, options = DECODE[case]
    gen = torch.Generator().manual_seed(200 + case)
    options = dict(options)
    mask_kind = options.pop("mask", None)
    for sk in lengths:
        q = make(layout, b, 1, hq, d, gen, requires_grad)
        k, v = make(layout, b, sk, hkv, d, gen, requires_grad), make(layout, b, sk, hkv, d, gen, requires_grad)
        kw = dict(options, layout=layout)
        if mask_kind:
            mask = torch.rand(b, hq if mask_kind == "heads" else 1, 1, sk, generator=gen) < 0.6
            mask[..., 0] = True
            kw["attn_mask"] = mask
        got = door(q, k, v, **kw)
        assert _bound_for(basic_manager, k.shape).decision.chosen_id == "cpu.flash"
        want = full_path(basic_manager, q, k, v, **kw)
        _assert_same_and_exact(got, want, layout, q, k, v, kw, gen, requires_grad,
                               "the bound decode step differs from run()")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_compiled_backward_of_a_packed_decode_step_is_autograds(layout):
    """cpu.flash's `backward` (the compiled path's, from the saved out and LSE) of a GQA decode step: autograd's
    gradients through run()'s packed forward, bit for bit."""
    from opdispatch.ops._attention import validate_attention
    from opdispatch.vendors.cpu._attention import CpuFlashAttention

    gen = torch.Generator().manual_seed(11)
    q, k, v = (make(layout, 2, n, h, 16, gen, True) for n, h in ((1, 8), (9, 2), (9, 2)))
    impl = CpuFlashAttention()
    out, lse = impl.run(validate_attention(q, k, v, layout=layout, return_lse=True))
    grad_out = torch.randn(out.shape, generator=gen)
    want = torch.autograd.grad(out, (q, k, v), grad_out)
    call = validate_attention(q.detach(), k.detach(), v.detach(), layout=layout, return_lse=True)
    got = impl.backward(call, out.detach(), lse.detach(), grad_out)
    assert got is not None
    for a, w in zip(got, want):
        assert torch.equal(a, w)


# What serving sends: each call of a sequence below changes only sizes (a decode step one key longer, a prefill
# chunk, a new batch size) and stays in its decision class, so every call after the first must take the template
# branch (`_sized_reuse`: no full validation, no bind) and give what the reference path (`run()`) gives, bit for
# bit, and what the float64 oracle gives. bottom-right decode with one query is canonicalized to not causal; chunks
# (sq > 1) keep the diagonal; sq > sk leaves the first rows without a key (zeros out, LSE -inf).
SEQUENCES = [
    # layout, (hq, hkv, d), [(batch, sq, sk)], options
    ("bshd", (8, 2, 16), [(1, 1, n) for n in range(5, 12)] + [(3, 1, 12), (2, 1, 13)],
     dict(causal=True, causal_alignment="bottom_right")),
    ("bhsd", (4, 4, 8), [(2, 4, 6), (2, 4, 10), (1, 4, 14), (3, 4, 18)],
     dict(causal=True, causal_alignment="bottom_right", return_lse=True)),
    ("sbhd", (6, 3, 8), [(2, 3, 5), (2, 3, 8), (4, 3, 11)], dict(causal=True, causal_alignment="bottom_right")),
    ("bshd", (4, 2, 8), [(1, 6, 2), (1, 6, 3), (2, 6, 4), (1, 6, 5)],
     dict(causal=True, causal_alignment="bottom_right", return_lse=True)),
    ("bshd", (8, 2, 16), [(1, 1, n) for n in range(3, 9)] + [(4, 1, 9)], {}),
    ("bhsd", (4, 2, 8), [(1, 3, 7), (1, 3, 9), (2, 3, 12)], dict(window=(4, 0), causal=True,
                                                                  causal_alignment="bottom_right")),
]


@pytest.fixture
def template_branch(monkeypatch):
    """Counts of the template branch's calls and of binds (`_run_and_remember`: the full path's, or a template's
    that could not be reused)."""
    counts = {"template": 0, "binds": 0}
    sized, bind = _api._sized_reuse, _api._run_and_remember

    def counted_sized(*args):
        counts["template"] += 1
        return sized(*args)

    def counted_bind(*args, **kwargs):
        counts["binds"] += 1
        return bind(*args, **kwargs)

    monkeypatch.setattr(_api, "_sized_reuse", counted_sized)
    monkeypatch.setattr(_api, "_run_and_remember", counted_bind)
    return counts


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", range(len(SEQUENCES)))
def test_every_new_length_and_batch_of_a_sequence_takes_the_template_and_equals_run(
        basic_manager, door, validations, template_branch, case, requires_grad):
    layout, (hq, hkv, d), sizes, options = SEQUENCES[case]
    gen = torch.Generator().manual_seed(100 + case)
    for i, (b, sq, sk) in enumerate(sizes):
        q = make(layout, b, sq, hq, d, gen, requires_grad)
        k = make(layout, b, sk, hkv, d, gen, requires_grad)
        v = make(layout, b, sk, hkv, d, gen, requires_grad)
        kw = dict(options, layout=layout)
        before = len(validations), dict(template_branch)
        (template,) = basic_manager.size_generic.values() if i else (None,)
        got = door(q, k, v, **kw)
        if i == 0:
            assert len(validations) == before[0] + 1 and template_branch["binds"] == before[1]["binds"] + 1
        else:
            # A function bound per signature (cpu.flash folds a bottom-right diagonal with sq > 1 into run()'s
            # mask) is bound again for the new sizes; a size-generic one (every decode step) runs as it is.
            binds = before[1]["binds"] + (not template.fn.size_generic)
            assert len(validations) == before[0], f"{(b, sq, sk)}: validated in full"
            assert template_branch == {"template": before[1]["template"] + 1, "binds": binds}, (
                f"{(b, sq, sk)}: not the template branch ({template_branch} after {before[1]})")
        want = full_path(basic_manager, q, k, v, **kw)
        _assert_same_and_exact(got, want, layout, q, k, v, kw, gen, requires_grad,
                               f"{(b, sq, sk)}: the template branch differs from run()")
        seen = len(validations), dict(template_branch)
        again = door(q, k, v, **kw)  # the exact signature now hits the fast path: no template, no validation
        assert (len(validations), template_branch) == seen
        for a, w in zip(again if isinstance(again, tuple) else (again,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a.detach(), w.detach())


def _fields(call):
    return {name: getattr(call, name, "<unset>") for name in type(call).__slots__}


DENSE_REVALIDATIONS = [
    # layout, (batch, sq, sk, hq, hkv), new (batch, sq, sk, hq, hkv), options as given
    ("bshd", (1, 1, 9, 8, 2), (1, 1, 10, 8, 2), dict(causal=True, causal_alignment="bottom_right")),
    ("bshd", (1, 1, 9, 8, 2), (5, 1, 200, 16, 4), dict(causal=True, causal_alignment="bottom_right")),
    ("bhsd", (2, 4, 9, 4, 4), (2, 9, 9, 4, 4), dict(causal=True, causal_alignment="bottom_right")),  # sq == sk
    ("bhsd", (2, 4, 9, 4, 4), (2, 9, 4, 4, 1), dict(causal=True, causal_alignment="bottom_right")),  # sq > sk
    ("sbhd", (2, 3, 3, 6, 3), (1, 3, 8, 6, 2), dict(causal=True)),
    ("bshd", (2, 5, 12, 4, 1), (2, 1, 7, 4, 1), dict(window=(3, 0), causal=True, causal_alignment="bottom_right")),
    ("bshd", (2, 5, 12, 4, 1), (2, 6, 6, 4, 1), dict(window=(3, 2), causal_alignment="bottom_right")),
    ("bhsd", (1, 4, 10, 2, 2), (3, 1, 1, 2, 2), dict(window=(2, 2))),
    ("sbhd", (1, 2, 10, 2, 2), (1, 2, 10, 2, 2), dict(window=(-1, -1), causal=True)),
    # a boolean mask (its dense branch too): the padded decode step, per query, per head, 2-D, with causal
    ("bhsd", (4, 1, 129, 8, 2), (4, 1, 130, 8, 2), dict(mask="b11k")),
    ("bshd", (2, 3, 7, 4, 2), (3, 5, 9, 4, 2), dict(mask="b1qk", causal=True)),
    ("sbhd", (2, 2, 6, 4, 4), (2, 2, 11, 4, 4), dict(mask="bhqk")),
    ("bhsd", (1, 3, 5, 2, 1), (6, 3, 8, 2, 1), dict(mask="qk", causal=True, causal_alignment="bottom_right")),
]


@pytest.mark.parametrize("case", range(len(DENSE_REVALIDATIONS)))
@pytest.mark.parametrize("grad", [False, True])
def test_revalidating_a_dense_calls_sizes_gives_full_validations_call(case, grad):
    """`revalidate_sizes` (its dense branch: no KV cache, no mask) against `validate_attention` of the same
    arguments: every field of the call, canonicalization and its rewrites included, and the same refusal where the
    sizes do not validate."""
    from opdispatch.ops._attention import _broadcastable, revalidate_sizes, validate_attention

    layout, first, new, options = DENSE_REVALIDATIONS[case]
    options = dict(options)
    mask_kind = options.pop("mask", None)
    gen = torch.Generator().manual_seed(case)
    defaults = {a.name: a.default for a in _api.ATTENTION_ARGS.args if a.name != "impl"}

    def tensors(b, sq, sk, hq, hkv):
        return (make(layout, b, sq, hq, 8, gen, grad), make(layout, b, sk, hkv, 8, gen, grad),
                make(layout, b, sk, hkv, 8, gen, grad))

    def mask_for(b, sq, sk, hq, hkv):
        return None if mask_kind is None else torch.rand(*_masked_shape(mask_kind, b, hq, sq, sk), generator=gen) < .5

    template = validate_attention(**{**defaults, **options, "layout": layout, **dict(zip("qkv", tensors(*first))),
                                     "attn_mask": mask_for(*first)})
    q, k, v = tensors(*new)
    mask = mask_for(*new)
    given = (options.get("causal", False), options.get("causal_alignment", "top_left"), options.get("window"))
    got = revalidate_sizes(template.stripped(), *given, q, k, v, None, None, None, mask)
    want = validate_attention(**{**defaults, **options, "layout": layout, "q": q, "k": k, "v": v, "attn_mask": mask})
    assert _fields(got) == _fields(want)
    assert got.attn_mask is mask
    if mask is not None:  # a mask of the old length, or of another batch: refused as validation refuses it
        for bad_mask in (mask[..., :-1], torch.ones(7, *mask.shape[1:], dtype=torch.bool) if mask.dim() == 4
                         else mask[:1, :1]):
            if _broadcastable(bad_mask.shape, (got.batch, got.heads_q, got.seqlen_q, got.seqlen_k)):
                continue
            with pytest.raises(ValueError):
                revalidate_sizes(template.stripped(), *given, q, k, v, None, None, None, bad_mask)
            with pytest.raises(ValueError):
                validate_attention(**{**defaults, **options, "layout": layout, "q": q, "k": k, "v": v,
                                      "attn_mask": bad_mask})
    for name, bad in (("k and v lengths", (q, k, v[:, :, :1] if layout == "bhsd" else v[:1] if layout == "sbhd"
                                           else v[:, :1])),
                      ("batch", (q, k[:1], v[:1]) if layout != "sbhd" else (q, k[:, :1], v[:, :1])),
                      ("empty", (q, k[..., :0, :], v[..., :0, :]))):
        if name == "batch" and new[0] == 1 or name == "k and v lengths" and new[2] == 1:
            continue  # nothing to take away
        with pytest.raises(ValueError):
            revalidate_sizes(template.stripped(), *given, *bad, None, None, None, mask)
        with pytest.raises(ValueError):
            validate_attention(**{**defaults, **options, "layout": layout, **dict(zip("qkv", bad)), "attn_mask": mask})


def test_template_calls_are_counted_once_each_and_from_zero_after_a_reset(basic_manager, door):
    """The usage counters count each template call once — on its decision's row where the Python path ran it, as a
    compiled fast-path hit where the compiled door's size-generic entry did — and a reset starts them over (the
    counters keep the last row they counted: it must not outlive the reset)."""
    gen = torch.Generator().manual_seed(3)
    q = make("bshd", 1, 1, 4, 8, gen)
    cache = make("bshd", 1, 20, 2, 8, gen)

    def calls():
        return usage_stats(False, basic_manager).ops["attention"].calls

    def slow_calls():
        _, rows = basic_manager.usage.snapshot()
        return sum(r.slow_calls for r in rows)

    door(q, cache[:, :4], cache[:, :4])
    first, first_slow = calls(), slow_calls()
    for n in range(5, 9):
        door(q, cache[:, :n], cache[:, :n])
    assert calls() == first + 4
    sized = getattr(door, "__self__", None)
    sized_hits = 0 if sized is None else sized.stats()["sized_hits"]
    assert slow_calls() + sized_hits == first_slow + 4
    usage_stats(True, basic_manager)
    for n in range(9, 12):
        door(q, cache[:, :n], cache[:, :n])
    assert calls() == 3
    assert slow_calls() + (0 if sized is None else sized.stats()["sized_hits"] - sized_hits) == 3


def test_a_mask_of_another_rank_or_broadcast_pattern_takes_its_own_template(basic_manager, door, validations):
    """The size-generic key holds a mask's rank and broadcast pattern (not its lengths): a new length reuses the
    masked template, a mask that broadcasts otherwise (per head, per query, 2-D) is validated and bound anew — and
    every result is the full path's and the oracle's."""
    gen = torch.Generator().manual_seed(41)
    b, hq, hkv, d = 3, 4, 2, 16
    q = make("bhsd", b, 1, hq, d, gen)
    seen = []
    for shape_of, sk in ((lambda n: (b, 1, 1, n), 9), (lambda n: (b, 1, 1, n), 10), (lambda n: (b, hq, 1, n), 11),
                         (lambda n: (b, hq, 1, n), 12), (lambda n: (1, n), 13), (lambda n: (1, n), 14),
                         (lambda n: (b, 1, 1, n), 15)):
        k, v = make("bhsd", b, sk, hkv, d, gen), make("bhsd", b, sk, hkv, d, gen)
        mask = torch.rand(*shape_of(sk), generator=gen) < 0.6
        mask[..., 0] = True
        before = len(validations)
        got = door(q, k, v, layout="bhsd", attn_mask=mask)
        seen.append(len(validations) - before)
        assert torch.equal(got, full_path(basic_manager, q, k, v, layout="bhsd", attn_mask=mask))
        out, _ = oracle("bhsd", q.double(), k.double(), v.double(), mask=mask, scale=d ** -0.5)
        torch.testing.assert_close(got.double(), out, atol=2e-5, rtol=2e-5)
    assert seen == [1, 0, 1, 0, 1, 0, 0], "new lengths reuse; another broadcast pattern or rank validates anew"
