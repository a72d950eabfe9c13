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
