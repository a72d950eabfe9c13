"""The per-call fast path, bound plans and the Attention module: same results and decisions as the slow path,
and never a stale binding after a policy, override, grad-mode or signature change."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.policies import parse_policy
from tests.conftest import randn


def qkv(layout="bhsd", grad=False, dtype=torch.float32, s=8):
    shape = (1, 2, s, 16) if layout == "bhsd" else (1, s, 2, 16)
    return tuple(randn(*shape, dtype=dtype, requires_grad=grad) for _ in range(3))


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sbhd"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_matches_slow_path(basic_manager, layout, return_lse, causal):
    shape = {"bhsd": (2, 3, 9, 16), "bshd": (2, 9, 3, 16), "sbhd": (9, 2, 3, 16)}[layout]
    q, k, v = (torch.randn(shape) for _ in range(3))
    first = opdispatch.attention(q, k, v, layout=layout, causal=causal, return_lse=return_lse)  # slow path, binds
    assert len(basic_manager.fast) == 1
    q2, k2, v2 = (torch.randn(shape) for _ in range(3))
    second = opdispatch.attention(q2, k2, v2, layout=layout, causal=causal, return_lse=return_lse)  # fast path
    expected = opdispatch.attention(q2, k2, v2, layout=layout, causal=causal, return_lse=return_lse,
                                    impl="reference.math", attn_mask=torch.ones(9, 9, dtype=torch.bool))
    if return_lse:
        assert isinstance(first, tuple) and isinstance(second, tuple) and len(second) == 2
        torch.testing.assert_close(second[0], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second[1], expected[1], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-5)


def test_fast_path_rebinds_after_policy_override_and_grad_changes(basic_manager):
    q, k, v = qkv()
    opdispatch.attention(q, k, v, layout="bhsd")
    (fn,) = basic_manager.fast.values()
    assert fn.decision.chosen_id == "cpu.flash"
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [reference.math]}}", "<p>"))
    assert basic_manager.fast == {}
    opdispatch.attention(q, k, v, layout="bhsd")
    assert [f.decision.chosen_id for f in basic_manager.fast.values()] == ["reference.math"]
    with opdispatch.policy_override(pin="cpu.flash"):
        opdispatch.attention(q, k, v, layout="bhsd")
    assert sorted(f.decision.chosen_id for f in basic_manager.fast.values()) == ["cpu.flash", "reference.math"]
    qg, kg, vg = qkv(grad=True)
    out = opdispatch.attention(qg, kg, vg, layout="bhsd")
    out.sum().backward()
    assert qg.grad is not None and len(basic_manager.fast) == 3
    with torch.no_grad():
        out = opdispatch.attention(qg, kg, vg, layout="bhsd")
    # Under no_grad nothing is recorded, so the call has the signature of the plain one and reuses its entry.
    assert len(basic_manager.fast) == 3 and out.grad_fn is None
    assert {f.decision.call.endswith("requires_grad") for f in basic_manager.fast.values()} == {True, False}


def test_fast_path_still_rejects_bad_inputs(basic_manager):
    q, k, v = qkv()
    opdispatch.attention(q, k, v, layout="bhsd")
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        opdispatch.attention(q, k.double(), v, layout="bhsd")
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        opdispatch.attention(q, None, v, layout="bhsd")
    with pytest.raises(TypeError, match="window must be None or a pair of ints"):
        opdispatch.attention(q, k, v, layout="bhsd", window=[1, 2, 3])


def test_fast_path_pinned_impl_that_cannot_take_the_call_still_raises(basic_manager):
    q, k, v = qkv()
    for _ in range(2):
        with pytest.raises(opdispatch.PinnedImplementationError):
            opdispatch.attention(q, k, v, layout="bhsd", dropout_p=0.5, impl="cpu.flash")


def test_plan_binds_once_and_computes_correctly(basic_manager):
    q, k, v = qkv(layout="bshd", s=12)
    run = opdispatch.plan(q, k, v, causal=True)
    assert run.decision.chosen_id == "cpu.flash"
    for _ in range(3):
        q, k, v = qkv(layout="bshd", s=12)
        torch.testing.assert_close(run(q, k, v), opdispatch.attention(q, k, v, causal=True, impl="reference.math"),
                                   atol=1e-5, rtol=1e-5)
    generic = opdispatch.plan(q, k, v, causal=True, softcap=5.0)
    assert generic.decision.chosen_id == "reference.math"
    torch.testing.assert_close(generic(q, k, v), opdispatch.attention(q, k, v, causal=True, softcap=5.0,
                                                                      impl="reference.math"))


def test_attention_module_replans_when_the_signature_changes(basic_manager):
    module = opdispatch.Attention(causal=True, layout="bshd")
    plans = []
    for s in (8, 8, 16):
        q, k, v = qkv(layout="bshd", s=s)
        torch.testing.assert_close(module(q, k, v), opdispatch.attention(q, k, v, causal=True,
                                                                         impl="reference.math"), atol=1e-5, rtol=1e-5)
        plans.append(module._fn)
    # A new length re-binds (and re-validates) but re-uses the decision of its class: no second decision.
    assert plans[0] is plans[1] and plans[2] is not plans[1]
    assert plans[2].decision is plans[0].decision
    assert module._key[0] == (1, 16, 2, 16)
    assert "causal=True" in repr(module)


def test_attention_module_revalidates_when_k_or_v_change_dtype_or_grad(basic_manager):
    module = opdispatch.Attention(layout="bshd")
    q, k, v = qkv(layout="bshd")
    module(q, k, v)
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        module(q, k.double(), v)
    with pytest.raises(TypeError, match="q, k and v must share one dtype"):
        module(q, k, v.double())
    vg = v.clone().requires_grad_(True)
    out = module(q, k, vg)
    assert out.grad_fn is not None and module._fn.decision.call.endswith("requires_grad")


def _oracle_masked(q, k, v, mask):
    """float64 attention over bhsd with a bool mask (True = attend, broadcast); a row that sees no key: zeros."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


@pytest.mark.parametrize("impl", [None, "reference.math"])
@pytest.mark.parametrize("grad", [False, True])
def test_masked_calls_take_the_fast_path_with_their_values_per_call(basic_manager, impl, grad):
    """A padded batch's decode: the mask's shape stays, its values change every step (and some rows see no key).
    Keyed by shape, dtype and device, the mask is passed to the bound function per call: each result is that
    call's mask's, against a float64 oracle, and only the first call of the signature takes the slow path."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hk, sk, d = 4, 8, 2, 12, 16
    slow_before = opdispatch.stats().ops.get("attention")
    slow_before = 0 if slow_before is None else slow_before.slow_calls
    for step in range(5):
        q = torch.randn(b, hq, 1, d, generator=gen).requires_grad_(grad)
        k, v = (torch.randn(b, hk, sk, d, generator=gen).requires_grad_(grad) for _ in range(2))
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1::2, ..., : step + 1] = False  # left padding that differs per step
        if step == 3:
            mask[0] = False  # a row that sees no key
        out = opdispatch.attention(q, k, v, layout="bhsd", attn_mask=mask, impl=impl)
        torch.testing.assert_close(out.double(), _oracle_masked(q, k, v, mask), atol=1e-5, rtol=1e-5)
        if grad:
            out.sum().backward()
            assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    slow = opdispatch.stats().ops["attention"].slow_calls - slow_before
    assert slow == 1, f"{slow} slow-path calls for one masked signature"


def test_a_plugin_bind_override_still_gets_the_arguments_it_was_written_for(basic_manager):
    """Plugin API 2: an overridden bind takes (q, k, v) and, for a KV cache, (q, k, v, seqused_k, block_table).
    A masked call is served by the default bind (the mask passed per call); a KV-cache call's function gets its
    five tensors, never the mask's slot."""
    from opdispatch.ops._attention import AttentionImpl

    got: list[int] = []
    reference = [i for i in basic_manager.implementations("attention") if i.id == "reference.math"][0]

    class Strict(type(reference)):  # type: ignore[misc]
        def bind(self, call):
            run, rebuild = self.run, call.stripped().with_tensors
            if call.kv_cache:
                def five(q, k, v, seqused_k, block_table):
                    got.append(5)
                    return run(rebuild(q, k, v, seqused_k, block_table))
                return five

            def three(q, k, v):
                got.append(3)
                return run(rebuild(q, k, v))
            return three

    strict = Strict()
    assert type(strict).bind is not AttentionImpl.bind
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    for _ in range(2):
        fn = strict.bound_function(strict.conform(opdispatch.validate_attention(q, k, v, attn_mask=mask)))
        out = fn(q, k, v, None, None, mask)
        torch.testing.assert_close(out, opdispatch.attention(q, k, v, attn_mask=mask, impl="reference.math"))
    assert got == []  # the default bind served the masked call
    cache_k, cache_v = (torch.randn(2, 10, 2, 16) for _ in range(2))
    used = torch.tensor([4, 7], dtype=torch.int32)
    qd = torch.randn(2, 1, 2, 16)
    call = opdispatch.validate_attention(qd, cache_k, cache_v, seqused_k=used, causal=True,
                                         causal_alignment="bottom_right")
    fn = strict.bound_function(strict.conform(call))
    out = fn(qd, cache_k, cache_v, used, None, None)  # the door's six tensors
    assert got == [5]
    torch.testing.assert_close(out, opdispatch.attention(qd, cache_k, cache_v, seqused_k=used, causal=True,
                                                         causal_alignment="bottom_right", impl="reference.math"))
