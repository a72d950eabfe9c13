"""Decisions keyed on call classes: decode loops, batch changes and new lengths reuse one decision; thresholds of
the policy and of the candidates' limits split classes; canonical forms; bounded caches; the reference warning."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps
from opdispatch.base import _native
from opdispatch.engine import _state as state_module
from opdispatch.policies import parse_policy

from tests._vendor_helpers import real_device
from tests._test_impls import EvenKeysOnly, ShortOnly, prefer_test_impls
from tests.conftest import device_descriptor
from tests.fakes import install
from tests.fakes import kunlun_ops as fake_kunlun
from tests.test_numerics import naive_attention


def bshd(b, s, h, d, gen, dtype=torch.float32):
    return torch.randn(b, s, h, d, generator=gen, dtype=dtype)


def oracle(q, k, v, **kw):
    """float64 oracle over bshd tensors (independent of every implementation)."""
    out, lse = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2), lse


def chose_lines(caplog):
    return [r for r in caplog.records if r.name == "opdispatch" and "chose" in r.getMessage()]


def test_decode_loop_with_a_growing_cache_makes_one_decision(basic_manager, rng, caplog):
    cache_k, cache_v = bshd(2, 80, 2, 16, rng), bshd(2, 80, 2, 16, rng)
    caplog.set_level(logging.INFO, logger="opdispatch")
    before = basic_manager.decisions_made
    for length in range(8, 48):
        q = bshd(2, 1, 4, 16, rng)
        k, v = cache_k[:, :length], cache_v[:, :length]  # strided slices of a preallocated cache
        out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right")
        if length % 13 == 0:
            expected, _ = oracle(q, k, v, scale=0.25)  # one query at the bottom right sees every key
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert basic_manager.decisions_made - before == 1
    assert len(chose_lines(caplog)) == 1  # one INFO line per decision, not per shape


def test_batch_and_length_changes_reuse_the_decision_and_stay_correct(basic_manager, rng):
    decisions = set()
    for b, s in [(1, 20), (3, 20), (2, 37), (4, 29), (1, 53)]:  # one side of the default policy's thresholds
        q, k, v = bshd(b, s, 4, 8, rng), bshd(b, s, 2, 8, rng), bshd(b, s, 2, 8, rng)
        out = opdispatch.attention(q, k, v, causal=True)
        torch.testing.assert_close(out.double(), oracle(q, k, v, scale=8 ** -0.5, causal=True)[0],
                                   atol=2e-5, rtol=2e-5)
        decisions.add(id(opdispatch.plan(q, k, v, causal=True).decision))
    assert len(decisions) == 1 and basic_manager.decisions_made == 1


def test_policy_thresholds_split_classes(basic_manager, rng, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n"
                    "      - name: long-kv-to-reference\n        when: {seqlen_k: '>=32'}\n"
                    "        prefer: [reference.math]\n")
    basic_manager.set_policy(path)
    chosen = {}
    for sk in (8, 16, 31, 32, 33, 64):
        q, k, v = bshd(1, 1, 2, 8, rng), bshd(1, sk, 2, 8, rng), bshd(1, sk, 2, 8, rng)
        chosen[sk] = opdispatch.plan(q, k, v).decision.chosen_id
        torch.testing.assert_close(opdispatch.attention(q, k, v).double(), oracle(q, k, v, scale=8 ** -0.5)[0],
                                   atol=2e-5, rtol=2e-5)
    assert chosen == {8: "cpu.flash", 16: "cpu.flash", 31: "cpu.flash", 32: "reference.math",
                      33: "reference.math", 64: "reference.math"}
    assert basic_manager.decisions_made == 2  # one per side of the threshold


def test_caps_limits_split_classes(basic_manager, rng, tmp_path):
    basic_manager.register_impl(ShortOnly())
    prefer_test_impls(basic_manager, tmp_path)
    picks = []
    for sk in (4, 12, 20, 21, 40, 6):
        q, k, v = bshd(1, 2, 2, 8, rng), bshd(1, sk, 2, 8, rng), bshd(1, sk, 2, 8, rng)
        picks.append(opdispatch.plan(q, k, v).decision.chosen_id)
        torch.testing.assert_close(opdispatch.attention(q, k, v).double(), oracle(q, k, v, scale=8 ** -0.5)[0],
                                   atol=2e-5, rtol=2e-5)
    assert picks == ["test.short"] * 3 + ["cpu.flash"] * 2 + ["test.short"]
    assert basic_manager.decisions_made == 2


def test_extra_reasons_without_a_selection_key_decide_per_exact_shape(basic_manager, rng, tmp_path):
    basic_manager.register_impl(EvenKeysOnly())
    prefer_test_impls(basic_manager, tmp_path)
    for sk in (4, 5, 6, 7):
        q, k, v = bshd(1, 2, 2, 8, rng), bshd(1, sk, 2, 8, rng), bshd(1, sk, 2, 8, rng)
        assert opdispatch.plan(q, k, v).decision.chosen_id == ("test.even" if sk % 2 == 0 else "cpu.flash")
    assert basic_manager.decisions_made == 4


def test_decision_cache_is_a_bounded_lru(basic_manager, rng, monkeypatch):
    monkeypatch.setattr(state_module, "CACHE_LIMIT", 3)
    hot = opdispatch.validate_attention(*(bshd(1, 4, 2, 8, rng) for _ in range(3)))
    basic_manager.resolve("attention", hot)
    for d in (16, 24, 32, 40, 48):  # head dims are exact in the class: five more classes
        basic_manager.resolve("attention", opdispatch.validate_attention(*(bshd(1, 4, 2, d, rng) for _ in range(3))))
        basic_manager.resolve("attention", hot)  # touched between inserts: stays
    assert len(basic_manager.state.decisions) == 3
    made = basic_manager.decisions_made
    basic_manager.resolve("attention", hot)
    assert basic_manager.decisions_made == made  # still cached
    basic_manager.resolve("attention", opdispatch.validate_attention(*(bshd(1, 4, 2, 16, rng) for _ in range(3))))
    assert basic_manager.decisions_made == made + 1  # d16 was the least recently used: evicted


def test_fast_path_cache_drops_oldest_entries_not_everything(basic_manager, rng, monkeypatch):
    monkeypatch.setattr(state_module, "CACHE_LIMIT", 4)
    cache_k, cache_v = bshd(1, 40, 2, 8, rng), bshd(1, 40, 2, 8, rng)
    q = bshd(1, 1, 2, 8, rng)
    # The Python door: the compiled one serves new lengths of this class from its size-generic entry, without
    # remembering them here.
    attention = _native.python_of(opdispatch.attention)
    for length in range(1, 11):
        attention(q, cache_k[:, :length], cache_v[:, :length])
    assert len(basic_manager.fast) == 4
    assert [key[5][1] for key in basic_manager.fast] == [7, 8, 9, 10]  # the newest four k lengths (key: op, q×4, k…)


# -- canonical forms ---------------------------------------------------------------------------------------

def test_bottom_right_causal_decode_is_canonically_not_causal(basic_manager, rng):
    q, k, v = bshd(2, 1, 4, 8, rng), bshd(2, 9, 2, 8, rng), bshd(2, 9, 2, 8, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right")
    plain = opdispatch.validate_attention(q, k, v)
    assert (call.causal, call.causal_alignment) == (False, "top_left")
    assert basic_manager.decision_class("attention", call) == basic_manager.decision_class("attention", plain)
    assert basic_manager.decision_class("attention", call) != basic_manager.decision_class(
        "attention", opdispatch.validate_attention(q, k, v, causal=True))
    text = str(opdispatch.explain(q, k, v, causal=True, causal_alignment="bottom_right"))
    assert "[as written: causal=True bottom_right with one query (hides no key)]" in text
    # A window keeps its left bound: the query sees the last 4 keys (j >= 8 - 3).
    windowed = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right", window=(3, 0))
    assert (windowed.causal, windowed.window, windowed.causal_alignment) == (False, (3, -1), "bottom_right")
    out = opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right", window=(3, 0))
    expected, _ = oracle(q, k, v, scale=8 ** -0.5, causal=True, alignment="bottom_right", window=(3, 0))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_top_left_causal_decode_stays_causal(basic_manager, rng):
    q, k, v = bshd(1, 1, 2, 8, rng), bshd(1, 9, 2, 8, rng), bshd(1, 9, 2, 8, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True)
    assert call.causal and call.rewrites == ()
    expected, _ = oracle(q, k, v, scale=8 ** -0.5, causal=True)  # sees key 0 only
    torch.testing.assert_close(opdispatch.attention(q, k, v, causal=True).double(), expected, atol=2e-5, rtol=2e-5)


def test_equal_lengths_make_the_alignment_top_left_but_alibi_keeps_it_where_it_matters(rng):
    q, k, v = bshd(1, 6, 2, 8, rng), bshd(1, 6, 2, 8, rng), bshd(1, 6, 2, 8, rng)
    call = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right")
    assert call.causal_alignment == "top_left" and call.rewrites
    k2, v2 = bshd(1, 9, 2, 8, rng), bshd(1, 9, 2, 8, rng)
    slopes = torch.tensor([0.5, 0.25])
    alibi = opdispatch.validate_attention(q, k2, v2, causal_alignment="bottom_right", alibi_slopes=slopes)
    assert alibi.causal_alignment == "bottom_right"  # ALiBi distances are measured from the aligned diagonal
    plain = opdispatch.validate_attention(q, k2, v2, causal_alignment="bottom_right")
    assert plain.causal_alignment == "top_left" and plain.rewrites == ()  # nothing reads the alignment


def test_varlen_with_equal_but_distinct_cu_seqlens_is_self_attention(basic_manager, rng):
    lens = [5, 11, 3]
    cu_q = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    cu_k = cu_q.clone()
    q = torch.randn(19, 4, 8, generator=rng)
    k, v = torch.randn(19, 2, 8, generator=rng), torch.randn(19, 2, 8, generator=rng)
    call = opdispatch.validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert call.cu_seqlens_k is call.cu_seqlens_q and call.same_lengths and not call.alignment_matters
    assert "cu_seqlens_k equal to cu_seqlens_q" in call.describe()
    out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        expected, _ = oracle(q[sl][None], k[sl][None], v[sl][None], scale=8 ** -0.5, causal=True)
        torch.testing.assert_close(out[sl].double(), expected[0], atol=2e-5, rtol=2e-5)
        start += n
    other = torch.tensor([0, 6, 16, 19], dtype=torch.int32)
    differs = opdispatch.validate_attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=other)
    assert differs.cu_seqlens_k is other and not differs.same_lengths


def test_kunlunxin_does_not_reuse_a_self_attention_decision_for_other_k_lengths(manager, rng, monkeypatch):
    calls: list = []
    install(monkeypatch, {"kunlun_ops": fake_kunlun.make(calls)})
    manager._devices[torch.device("cpu")] = real_device("kunlunxin", "xpu3", "P800", torch="2.5.1")
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    q = torch.randn(10, 2, 64, generator=rng).half()
    k, v = torch.randn(10, 2, 64, generator=rng).half(), torch.randn(10, 2, 64, generator=rng).half()
    first = opdispatch.explain(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_q.clone())
    assert first.chosen_id == "kunlunxin.prefill"
    opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_q.clone())
    assert len(calls) == 1
    cu_k = torch.tensor([0, 7, 10], dtype=torch.int32)  # same shapes, other k lengths
    out = opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(calls) == 1  # the kernel was not given a call it cannot take
    for (qs, ks) in [((0, 4), (0, 7)), ((4, 10), (7, 10))]:
        expected, _ = oracle(q[slice(*qs)][None].float(), k[slice(*ks)][None].float(), v[slice(*ks)][None].float(),
                             scale=64 ** -0.5)
        torch.testing.assert_close(out[slice(*qs)].double(), expected[0], atol=2e-3, rtol=2e-3)


# -- the reference warning and determinism -----------------------------------------------------------------

def test_reference_on_an_accelerator_warns_once_per_decision(manager, caplog):
    h100 = opdispatch.load_device_descriptor(device_descriptor("h100"))
    meta = dict(dtype=torch.float64, device="meta")
    call = opdispatch.validate_attention(torch.empty(1, 64, 4, 64, **meta), torch.empty(1, 64, 4, 64, **meta),
                                         torch.empty(1, 64, 4, 64, **meta), check_values=False)
    caplog.set_level(logging.WARNING, logger="opdispatch")
    assert manager.resolve("attention", call, device=h100).chosen_id == "reference.math"
    manager.resolve("attention", call, device=h100)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reference.math (slow, unfused) takes [layout=bshd" in warnings[0]
    assert "nvidia.cudnn: rejected (dtype fp64 not supported" in warnings[0]


def test_reference_on_the_cpu_does_not_warn(basic_manager, rng, caplog):
    caplog.set_level(logging.WARNING, logger="opdispatch")
    q = bshd(1, 4, 2, 8, rng)
    opdispatch.attention(q, q, q, softcap=5.0)  # cpu.flash has no softcap: the reference takes it
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


class _NondeterministicForward(ShortOnly):
    name: ClassVar[str] = "racy"
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True,
                                                  deterministic_forward=False, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))


def test_deterministic_requests_exclude_nondeterministic_forwards(basic_manager, rng, tmp_path):
    basic_manager.register_impl(_NondeterministicForward())
    prefer_test_impls(basic_manager, tmp_path)
    q = bshd(1, 4, 2, 8, rng)
    assert opdispatch.plan(q, q, q).decision.chosen_id == "test.racy"
    decision = opdispatch.explain(q, q, q, deterministic=True)
    assert decision.chosen_id == "cpu.flash"
    assert "its forward is not bitwise reproducible" in "; ".join(decision.candidate("test.racy").reasons)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert opdispatch.validate_attention(q, q, q).deterministic
        out = opdispatch.attention(q, q, q)  # the per-call key holds torch's flag too
        assert opdispatch.plan(q, q, q).decision.chosen_id == "cpu.flash"
    finally:
        torch.use_deterministic_algorithms(previous)
    torch.testing.assert_close(out.double(), oracle(q, q, q, scale=8 ** -0.5)[0], atol=2e-5, rtol=2e-5)
    assert opdispatch.plan(q, q, q).decision.chosen_id == "test.racy"


def test_policy_parse_keeps_thresholds_readable():
    policy = parse_policy("version: 1\nops:\n  attention:\n    rules:\n      - name: r\n"
                          "        when: {batch: '>=8', heads_kv: [1, 2]}\n        prefer: [cpu.flash]\n")
    from opdispatch.engine._classes import DecisionClasses

    classes = DecisionClasses("attention", policy, [])
    # The user's layer first, then the shipped default's rules (its KV-cache and decode rules read seqlen_q).
    assert [(f, str(s)) for f, s in classes.size_tests][:5] == [("batch", ">=8"), ("heads_kv", "[1, 2]"),
                                                               ("seqlen_q", "1"), ("batch", ">=8"),
                                                               ("seqlen_q", "<=16")]


@pytest.mark.parametrize("text", ["'>=32'", "'<=32'", "'>32'", "'<32'", "'==32'", "'!=32'", "'>=8,<40'", "[8, 32]",
                                  "32"])
def test_compiled_size_tests_agree_with_the_policy_matcher(text):
    import yaml

    from opdispatch.engine._classes import _predicate
    from opdispatch.policies._match import IntSpec

    spec = IntSpec.parse(yaml.safe_load(text))
    predicate = _predicate(spec)
    assert [predicate(n) for n in range(0, 64)] == [spec.matches(n) for n in range(0, 64)]


def test_every_builtin_with_extra_checks_declares_what_they_read(manager):
    from opdispatch.ops._attention import AttentionImpl as Base

    manager.ensure_initialized()
    exact = [r.impl.id for r in manager.registry.for_op("attention")
             if type(r.impl).extra_reasons is not Base.extra_reasons
             and type(r.impl).selection_key is Base.selection_key]
    assert exact == []  # none falls back to deciding per exact shape


@pytest.mark.parametrize("device", ["h100", "a100", "mi300x", "p800", "bi-v150"])
def test_simulated_decode_loop_makes_one_decision_per_device(manager, device):
    info = opdispatch.load_device_descriptor(device_descriptor(device))
    meta = dict(dtype=torch.bfloat16, device="meta")
    chosen = set()
    made = manager.decisions_made
    for length in range(100, 400, 7):
        q = torch.empty(4, 1, 32, 128, **meta)
        k = v = torch.empty(4, length, 8, 128, **meta)
        call = opdispatch.validate_attention(q, k, v, causal=True, causal_alignment="bottom_right",
                                             check_values=False)
        chosen.add(manager.resolve("attention", call, device=info).chosen_id)
    assert manager.decisions_made - made == 1 and len(chosen) == 1


def test_no_cliff_when_a_cycling_working_set_exceeds_the_bound(basic_manager, rng, monkeypatch):
    """A working set cycling just above the cache bound keeps hitting: eviction picks a random old entry, not
    the oldest one (which, for a cycle, is always the one needed next)."""
    monkeypatch.setattr(state_module, "CACHE_LIMIT", 256)
    q = bshd(1, 1, 2, 8, rng)
    caches = [(bshd(1, n, 2, 8, rng), bshd(1, n, 2, 8, rng)) for n in range(1, 258)]  # 257 signatures
    for k, v in caches:  # warm up
        opdispatch.attention(q, k, v)
    state = basic_manager.state
    validated = []
    monkeypatch.setattr(opdispatch.doors._api, "validate_attention",
                        lambda *a, _real=opdispatch.doors._api.validate_attention, **kw: validated.append(1) or _real(*a, **kw))
    for _ in range(3):
        for k, v in caches:
            opdispatch.attention(q, k, v)
    misses = len(validated) / (3 * len(caches))
    assert misses < 0.25, f"{misses:.0%} of the calls missed the fast path (FIFO would miss 100%)"
    assert len(basic_manager.fast) <= 256 and basic_manager.state is state


def test_reads_more_compares_with_the_ops_own_implementation_base():
    """Whether an implementation's checks read more than the class key is judged against its op's base (the class
    deriving from Impl directly), found without importing the op: attention's defaults read nothing more, an
    override does, and a subclass of a vendor adapter inherits the adapter's answer."""
    from opdispatch.engine._classes import _reads_more
    from opdispatch.vendors.cpu import CpuFlashAttention
    from opdispatch.vendors.nvidia import TorchFlashAttention

    assert not _reads_more(CpuFlashAttention())
    assert _reads_more(TorchFlashAttention())  # its selection_key reads torch's determinism flag

    class Plain(opdispatch.AttentionImpl):
        vendor, name = "test", "plain"

    class Reading(Plain):
        def selection_key(self, call):
            return call.seqlen_k > 4096

    class Inherits(TorchFlashAttention):
        pass

    assert not _reads_more(Plain.__new__(Plain))
    assert _reads_more(Reading.__new__(Reading)) and _reads_more(Inherits.__new__(Inherits))
    assert _reads_more(object())  # not an implementation: assumed to read more
