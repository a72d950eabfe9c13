"""rms_norm and rotary_embedding under torch.compile(fullgraph=True): one opaque node each, values and gradients
against the float64 oracles, changing shapes without re-tracing, and the policy applied at run time."""

from __future__ import annotations

import pytest
import torch

import opdispatch

from tests.conftest import TOLERANCES
from tests.test_op_rms_norm import oracle as rms_oracle
from tests.test_op_rotary import caches, dense_positions, oracle as rope_oracle, packed_positions

@pytest.fixture
def counted():
    """Count Dynamo frame compilations."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_rms_norm_compiled_values_grads_and_changing_shapes(basic_manager, counted):
    @torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")
    def block(x, w, r):
        y, h = opdispatch.rms_norm(x, w, 1e-6, r)
        return opdispatch.rms_norm(y * 2, w) + h

    gen = torch.Generator().manual_seed(0)
    for rows in (5, 9, 17):
        x = torch.randn(rows, 48, generator=gen, dtype=torch.float64, requires_grad=True)
        w = (1 + 0.1 * torch.randn(48, generator=gen, dtype=torch.float64)).requires_grad_()
        r = torch.randn(rows, 48, generator=gen, dtype=torch.float64)
        out = block(x, w, r)
        y, h = rms_oracle(x, w, 1e-6, r)
        want = rms_oracle(y * 2, w, 1e-6) + h
        torch.testing.assert_close(out, want, **TOLERANCES[torch.float64])
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(out, (x, w), g)
        ref = torch.autograd.grad(want, (x, w), g)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **TOLERANCES[torch.float64])
    assert counted["stats"]["unique_graphs"] == 1  # one graph for every row count


def test_rms_norm_compiled_follows_a_policy_pin_at_run_time(basic_manager, monkeypatch):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: opdispatch.rms_norm(x), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 16)
    compiled(x)
    with opdispatch.policy_override(pin="reference.rms_norm"):
        decisions = basic_manager.decisions_made
        compiled(x)
        assert basic_manager.decisions_made == decisions + 1  # decided again, for the pin, without a re-trace
    compiled_pinned = torch.compile(lambda x: opdispatch.rms_norm(x, impl="nvidia.nope"), backend="aot_eager")
    with pytest.raises(opdispatch.PinnedImplementationError, match="'nvidia.nope' pinned by impl= is not registered"):
        compiled_pinned(x)
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_rotary_compiled_values_grads_and_changing_shapes(basic_manager, counted, layout):
    @torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")
    def rope(q, k, cos, sin, **kwargs):
        q2, k2 = opdispatch.rotary_embedding(q, k, cos, sin, **kwargs)
        return q2 * 1.5, k2

    gen = torch.Generator().manual_seed(1)
    cos, sin = caches(64, 16, torch.float64)
    for n in (3, 6, 11):
        if layout == "bshd":
            q = torch.randn(2, n, 4, 24, generator=gen, dtype=torch.float64, requires_grad=True)
            k = torch.randn(2, n, 2, 24, generator=gen, dtype=torch.float64, requires_grad=True)
            offsets = torch.tensor([0, 7])
            kwargs = dict(seqlen_offsets=offsets)
            pos = dense_positions(2, n, offsets)
        else:
            lengths = [n, 2, n + 1]
            q = torch.randn(sum(lengths), 4, 24, generator=gen, dtype=torch.float64, requires_grad=True)
            k = torch.randn(sum(lengths), 2, 24, generator=gen, dtype=torch.float64, requires_grad=True)
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            kwargs = dict(layout="thd", cu_seqlens=cu, max_seqlen=n + 1)
            pos = packed_positions(lengths)
        q_out, k_out = rope(q, k, cos, sin, **kwargs)
        torch.testing.assert_close(q_out, 1.5 * rope_oracle(q, pos, 16, False), **TOLERANCES[torch.float32])
        torch.testing.assert_close(k_out, rope_oracle(k, pos, 16, False), **TOLERANCES[torch.float32])
        gq = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, torch.zeros_like(k_out)))
        torch.testing.assert_close(dq, 1.5 * rope_oracle(gq, -pos, 16, False), **TOLERANCES[torch.float32])
        assert torch.count_nonzero(dk) == 0
    assert counted["stats"]["unique_graphs"] <= 2  # the first shape may be specialised; later ones reuse a graph


def test_scope_and_override_entered_inside_the_compiled_fn_reach_rms_norm(basic_manager, monkeypatch):
    from opdispatch.vendors.reference import ReferenceRmsNorm, TorchRmsNorm

    ran: list[str] = []
    for cls in (ReferenceRmsNorm, TorchRmsNorm):
        original = cls.run
        monkeypatch.setattr(cls, "run", lambda self, call, _run=original: ran.append(self.id) or _run(self, call))
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def block(x, w):
        with opdispatch.policy_override(pin="reference.rms_norm"):
            y = opdispatch.rms_norm(x, w)
        return opdispatch.rms_norm(y * 2, w)  # outside the override: the policy's choice

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(32, generator=gen, dtype=torch.float64)).requires_grad_()
    out = block(x, w)
    assert ran == ["reference.rms_norm", "torch.rms_norm"]
    want = rms_oracle(rms_oracle(x, w, 1e-6) * 2, w, 1e-6)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float64])
    ran.clear()
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, w), g)
    for a, b in zip(got, torch.autograd.grad(want, (x, w), g)):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float64])
    assert sorted(ran) == ["reference.rms_norm", "torch.rms_norm"]  # each backward recomputes its own forward
    torch._dynamo.reset()
