"""torch.compile through changing shapes, scopes and overrides.

Fullgraph compiles survive new batch sizes and sequence lengths with no error and no graph break, outputs equal a
float64 oracle, and recompiles happen only when the decision class changes; `opdispatch.scope()` and
`policy_override()` are honoured whether entered outside the compiled function, inside it, or changed between
calls.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch._dynamo.utils import counters

import opdispatch
from opdispatch import AttentionCaps
from opdispatch.compile import _compile

from tests._test_impls import EvenKeysOnly, ShortOnly, prefer_test_impls
from .conftest import TOLERANCES, randn
from .test_numerics import naive_attention

DYNAMICS = pytest.mark.parametrize("dynamic", [None, True, False], ids=["auto", "dynamic", "static"])


@pytest.fixture(autouse=True)
def _default_policy_without_rules(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The graph counts below depend on the size thresholds in force: pin them to those each test declares, not to
    the rules the shipped default policy happens to hold (its order stays)."""
    import yaml

    from opdispatch.policies import _policy

    shipped = yaml.safe_load(_policy.default_policy_path().read_text())
    shipped["ops"]["attention"]["rules"] = []
    path = tmp_path / "default-without-rules.yaml"
    path.write_text(yaml.safe_dump(shipped))
    monkeypatch.setattr(_policy, "default_policy_path", lambda: path)


@pytest.fixture(autouse=True)
def _fresh_dynamo(_default_policy_without_rules: None, basic_manager: opdispatch.OpManager):
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The implementation ids the compiled op's kernels ran, in order (forward and backward)."""
    seen: list[str] = []
    original = _compile._impl

    def spy(impl_id):
        seen.append(impl_id)
        return original(impl_id)

    monkeypatch.setattr(_compile, "_impl", spy)
    return seen


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def oracle(q, k, v, causal=False):
    """float64 attention of bshd tensors, independent of every implementation."""
    out, _ = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=q.shape[-1] ** -0.5,
                             causal=causal)
    return out.transpose(1, 2)


def _check(got, q, k, v, causal=False):
    torch.testing.assert_close(got.double(), oracle(q, k, v, causal=causal), atol=2e-5, rtol=2e-5)


def _attend(q, k, v):
    return opdispatch.attention(q, k, v, causal=True)


# (batch, seqlen). Heads (4, 2) and the head dim (16) are specialised; with dynamic=True Dynamo gives equal sizes
# one symbol (duck sizing), so a first call whose batch or length equals one of them would specialise that too
# (one extra graph): the first shape avoids them.
SHAPES = [(3, 8), (5, 12), (2, 20), (4, 33), (3, 40), (5, 64), (2, 9)]


def _qkv(batch, seqlen, gen, heads=4, kv_heads=2, seqlen_q=None):
    q = randn(batch, seqlen_q or seqlen, heads, 16, gen=gen)
    # k/v as strided views of a wider buffer: the op must not assume contiguity
    kv = randn(batch, seqlen, 2, kv_heads, 16, gen=gen)
    return q, kv[:, :, 0], kv[:, :, 1]


@DYNAMICS
def test_fullgraph_through_changing_seqlens_and_batches(dynamic, ran):
    fn = torch.compile(_attend, backend="eager", fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES + ([(1, 5), (5, 1)] if dynamic is not False else [])  # static: within the recompile limit
    for batch, seqlen in shapes:
        q, k, v = _qkv(batch, seqlen, gen)
        _check(fn(q, k, v), q, k, v, causal=True)
    assert _breaks() == 0
    assert set(ran) == {"cpu.flash"}
    # No size threshold in the basic policy: auto = the first static graph, one dynamic graph, and one each for
    # batch 1 and length 1 (Dynamo specialises 0 and 1); dynamic = the last three; static = one per shape.
    assert _graphs() == {None: 4, True: 3, False: len(SHAPES)}[dynamic]


def test_module_and_explain_report_no_graph_break():
    attn = opdispatch.Attention(causal=True)
    gen = torch.Generator().manual_seed(1)
    fn = torch.compile(attn, backend="eager", fullgraph=True, dynamic=True)
    for batch, seqlen in SHAPES:
        q, k, v = _qkv(batch, seqlen, gen)
        _check(fn(q, k, v), q, k, v, causal=True)
    report = torch._dynamo.explain(_attend)(*_qkv(2, 24, gen))
    assert report.graph_break_count == 0 and report.graph_count == 1


def _threshold_policy(manager, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n"
                    "      - name: long-kv-to-reference\n        when: {seqlen_k: '>=32'}\n"
                    "        prefer: [reference.math]\n")
    manager.set_policy(path)


@DYNAMICS
def test_recompiles_only_when_the_decision_class_changes(dynamic, basic_manager, tmp_path, ran):
    _threshold_policy(basic_manager, tmp_path)
    fn = torch.compile(_attend, backend="eager", fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(2)
    for batch, seqlen in SHAPES:
        q, k, v = _qkv(batch, seqlen, gen)
        _check(fn(q, k, v), q, k, v, causal=True)
    assert ran == ["reference.math" if s >= 32 else "cpu.flash" for _, s in SHAPES]
    assert _breaks() == 0
    # auto: a static graph for the first shape, then one dynamic graph per side of seqlen_k >= 32;
    # dynamic: one per side; static: one per shape.
    assert _graphs() == {None: 3, True: 2, False: len(SHAPES)}[dynamic]


def test_caps_max_seqlen_is_a_guarded_predicate(basic_manager, tmp_path, ran):
    basic_manager.register_impl(ShortOnly())
    prefer_test_impls(basic_manager, tmp_path)
    fn = torch.compile(lambda q, k, v: opdispatch.attention(q, k, v), backend="aot_eager", fullgraph=True,
                       dynamic=True)
    gen = torch.Generator().manual_seed(3)
    lengths = (5, 12, 20, 21, 40, 6)
    for s in lengths:
        q, k, v = _qkv(3, s, gen)
        _check(fn(q, k, v), q, k, v)
    assert ran == ["test.short" if s <= 20 else "cpu.flash" for s in lengths]
    assert _graphs() == 2 and _breaks() == 0


def test_size_checks_the_graph_cannot_guard_are_rechecked_per_call(basic_manager, tmp_path, ran):
    basic_manager.register_impl(EvenKeysOnly())
    prefer_test_impls(basic_manager, tmp_path)
    fn = torch.compile(lambda q, k, v: opdispatch.attention(q, k, v), backend="aot_eager", fullgraph=True,
                       dynamic=True)
    gen = torch.Generator().manual_seed(4)
    lengths = (6, 5, 8, 7, 10)
    for s in lengths:
        q, k, v = _qkv(3, s, gen)
        _check(fn(q, k, v), q, k, v)
    assert ran == ["test.even" if s % 2 == 0 else "cpu.flash" for s in lengths]
    assert _graphs() == 1


def test_decode_shapes_with_dynamic_cache_length(ran):
    """One query against a growing cache, bottom-right causal (canonicalised to non-causal for one query)."""
    fn = torch.compile(lambda q, k, v: opdispatch.attention(q, k, v, causal=True, causal_alignment="bottom_right"),
                       backend="eager", fullgraph=True, dynamic=None)
    gen = torch.Generator().manual_seed(5)
    for length in (8, 9, 17, 30):
        q, k, v = _qkv(2, length, gen, seqlen_q=1)
        _check(fn(q, k, v), q, k, v)  # one query at the bottom right sees every key
    assert _graphs() <= 2 and _breaks() == 0


# -- scopes and overrides ------------------------------------------------------------------------------------


class _Recording(ShortOnly):
    """A float64 test kernel that only a scoped policy rule picks; records every call it computes."""

    name: ClassVar[str] = "record"
    priority: ClassVar[int] = -1000
    caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.float32}), gqa=True, causal=True,
                                                  backward=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal_alignments=frozenset({"top_left"}))
    calls: ClassVar[list[tuple[int, ...]]] = []

    def run(self, call):
        _Recording.calls.append(tuple(call.q.shape))
        q, k, v = (call.bhsd(t).double() for t in (call.q, call.k, call.v))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        scores = q @ k.transpose(-1, -2) * call.scale
        if call.causal:
            n, m = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
        return call.from_bhsd((torch.softmax(scores, -1) @ v).to(call.dtype))


@pytest.fixture
def scoped(basic_manager, tmp_path):
    """A policy sending module 'model.attn*' to test.record; everything else keeps the default order."""
    basic_manager.register_impl(_Recording())
    path = tmp_path / "scoped.yaml"
    path.write_text("version: 1\nops:\n  attention:\n    rules:\n"
                    "      - name: attn-to-record\n        when: {module: 'model.attn*'}\n"
                    "        prefer: [test.record]\n")
    basic_manager.set_policy(path)
    _Recording.calls.clear()
    return basic_manager


@pytest.mark.parametrize("trace_in_scope", [False, True], ids=["traced-outside", "traced-inside"])
def test_scope_entered_outside_the_compiled_fn_is_honoured_per_call(scoped, ran, trace_in_scope):
    fn = torch.compile(_attend, backend="aot_eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(6)
    expected = []
    for i, (batch, seqlen) in enumerate(SHAPES[:4]):
        q, k, v = _qkv(batch, seqlen, gen)
        in_scope = (i % 2 == 0) == trace_in_scope
        if in_scope:
            with opdispatch.scope("model.attn.0"):
                out = fn(q, k, v)
        else:
            out = fn(q, k, v)
        _check(out, q, k, v, causal=True)
        expected.append("test.record" if in_scope else "cpu.flash")
    assert ran == expected
    assert len(_Recording.calls) == expected.count("test.record")
    assert _graphs() == 1 and _breaks() == 0  # a scope change re-decides in the kernel, never re-traces


def test_policy_override_outside_the_compiled_fn_is_honoured_per_call(basic_manager, ran):
    fn = torch.compile(_attend, backend="aot_eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(3, 10, gen)
    _check(fn(q, k, v), q, k, v, causal=True)
    with opdispatch.policy_override(pin="reference.math"):
        _check(fn(q, k, v), q, k, v, causal=True)
    _check(fn(q, k, v), q, k, v, causal=True)
    assert ran == ["cpu.flash", "reference.math", "cpu.flash"]
    assert _graphs() == 1


def test_scope_and_override_entered_inside_the_compiled_fn(scoped, ran):
    def layer(q, k, v):
        with opdispatch.scope("model.attn.3"):
            a = opdispatch.attention(q, k, v, causal=True)
        with opdispatch.policy_override(pin="reference.math"):
            b = opdispatch.attention(q, k, v, causal=True)
        return a, b, opdispatch.attention(q, k, v, causal=True)

    fn = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(8)
    for batch, seqlen in SHAPES[:3]:
        q, k, v = _qkv(batch, seqlen, gen)
        for out in fn(q, k, v):
            _check(out, q, k, v, causal=True)
    assert ran == ["test.record", "reference.math", "cpu.flash"] * 3
    # An override entered outside, between calls, stacks under the ones inside: its pin takes all three calls.
    ran.clear()
    with opdispatch.policy_override(pin="reference.math"):
        for out in fn(q, k, v):
            _check(out, q, k, v, causal=True)
    assert ran == ["reference.math"] * 3
    ran.clear()
    with opdispatch.scope("model.attn.9"):  # an outer scope: the inner one still names the first call
        fn(q, k, v)
    assert ran == ["test.record", "reference.math", "test.record"]
    assert _breaks() == 0 and _graphs() == 1


def test_backward_recomputes_what_the_scoped_forward_ran(scoped, ran):
    model = torch.nn.Linear(16, 16).double()
    gen = torch.Generator().manual_seed(9)

    def step(x):
        y = model(x).float().view(3, 10, 4, 16)
        return opdispatch.attention(y, y[:, :, :2], y[:, :, 2:], causal=True)

    fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = randn(3, 10, 4, 16, gen=gen, dtype=torch.float64).view(3, 10, 64 // 16 * 16 // 16, 16)
    x = x.reshape(3 * 10 * 4, 16)
    with opdispatch.scope("model.attn.1"):
        loss = fn(x).square().sum()
    ran.clear()
    loss.backward()  # outside the scope: the backward must still recompute test.record
    assert ran == ["test.record"]
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with opdispatch.scope("model.attn.1"):
        step(x).square().sum().backward()  # eager, same scope
    for g, e in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, e, **TOLERANCES[torch.float32])


# -- optional tensors and packed sequences under changing sizes ------------------------------------------------


def test_broadcast_bias_and_mask_follow_the_dynamic_lengths(ran):
    def fn(q, k, v, bias, mask):
        return opdispatch.attention(q, k, v, attn_bias=bias, attn_mask=mask)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=None)
    gen = torch.Generator().manual_seed(10)
    for batch, seqlen in SHAPES[:4]:
        q, k, v = _qkv(batch, seqlen, gen)
        bias = randn(1, 4, seqlen, seqlen, gen=gen)  # per-head bias, broadcast over the batch
        mask = torch.rand(batch, 1, 1, seqlen, generator=gen) > 0.3  # key padding, broadcast over heads/queries
        mask[..., 0] = True
        expected = opdispatch.attention(q, k, v, attn_bias=bias, attn_mask=mask, impl="reference.math")
        ref, _ = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.25,
                                 bias=bias, mask=mask)
        got = compiled(q, k, v, bias, mask)
        torch.testing.assert_close(got.double(), ref.transpose(1, 2), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    assert _breaks() == 0 and _graphs() == 2  # the first static graph, then one dynamic


def test_packed_sequences_with_changing_token_counts(ran):
    def fn(q, k, v, cu, max_len):
        return opdispatch.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                    max_seqlen_k=max_len, causal=True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=None)
    gen = torch.Generator().manual_seed(11)
    for lengths in ([3, 5], [7, 2, 6], [9, 4, 4, 3], [5, 11, 2]):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q = randn(total, 4, 16, gen=gen)
        kv = randn(total, 2, 2, 16, gen=gen)
        k, v = kv[:, 0], kv[:, 1]
        got = compiled(q, k, v, cu, max(lengths))
        for i, n in enumerate(lengths):  # each sequence against the float64 oracle on its own
            s = slice(int(cu[i]), int(cu[i + 1]))
            _check(got[s].unsqueeze(0), q[s].unsqueeze(0), k[s].unsqueeze(0), v[s].unsqueeze(0), causal=True)
    assert _breaks() == 0 and _graphs() == 2  # the first static graph, then one dynamic


def test_float_and_window_arguments_that_change_between_calls(ran):
    def fn(q, k, v, scale, left):
        return opdispatch.attention(q, k, v, scale=scale, window=(left, 0), causal=True, softcap=30.0)

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(12)
    for (batch, seqlen), scale, left in zip(SHAPES[:4], (0.3, 0.2, 0.25, 0.3), (3, 5, 7, 3)):
        q, k, v = _qkv(batch, seqlen, gen)
        expected = opdispatch.attention(q, k, v, scale=scale, window=(left, 0), causal=True, softcap=30.0,
                                        impl="reference.math")
        bhsd = [t.transpose(1, 2) for t in (q, k, v)]
        ref, _ = naive_attention(*bhsd, scale=scale, causal=True, window=(left, 0), softcap=30.0)
        got = compiled(q, k, v, scale, left)
        torch.testing.assert_close(got.double(), ref.transpose(1, 2), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    assert _breaks() == 0


def test_invalid_window_is_reported_while_tracing():
    fn = torch.compile(lambda q: opdispatch.attention(q, q, q, window=(1.5, 0)), backend="eager", fullgraph=True,
                       dynamic=True)
    with pytest.raises(Exception, match="window must be None or a pair of ints"):
        fn(randn(3, 8, 4, 16))


@pytest.mark.slow
def test_scope_inside_a_compiled_fn_works_in_a_fresh_process(tmp_path):
    """The first thing Dynamo traces is scope(), before opdispatch.compile._compile was ever imported."""
    import os
    import subprocess
    import sys

    policy = tmp_path / "scoped.yaml"
    policy.write_text("version: 1\nops:\n  attention:\n    rules:\n"
                      "      - name: attn-to-reference\n        when: {module: 'model.attn*'}\n"
                      "        prefer: [reference.math]\n")
    script = f"""
import sys, torch, opdispatch
assert "opdispatch.compile._compile" not in sys.modules
opdispatch.get_manager().set_policy({str(policy)!r})
def layer(q):
    with opdispatch.scope("model.attn.0"):
        a = opdispatch.attention(q, q, q)
    return a, opdispatch.attention(q, q, q)
q = torch.randn(3, 8, 2, 16)
a, b = torch.compile(layer, backend="eager", fullgraph=True)(q)
torch.testing.assert_close(a, b)
from opdispatch.compile import _compile
print(sorted(set(_compile._LAST_CHOICE.values())))
"""
    env = dict(os.environ, OPDISPATCH_PLUGINS="cpu,reference")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['cpu.flash', 'reference.math']"
