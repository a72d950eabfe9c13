"""Input correctness and the breaker on the GPU: every available implementation on views whose head dim is not
unit-stride (and other odd strides) against a float64 oracle, an all -inf bias row's LSE, and a failing kernel
demoted once. Skipped without CUDA."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

import opdispatch
from opdispatch import AttentionCaps, AttentionImpl
from opdispatch.policies import parse_policy
from tests.test_strided_property import make

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = [pytest.mark.gpu]

IMPLS = ["nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "torch.flex", "flagos.triton", "reference.math"]
VIEWS = ["head_dim_not_innermost", "every_other", "expanded_batch", "reversed_storage", "every_other_row"]


def oracle(q, k, v, causal):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = (t.repeat_interleave(qd.shape[1] // t.shape[1], 1) for t in (kd, vd))
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_view_is_computed_right(impl, view):
    manager = opdispatch.get_manager()
    if manager.implementation("attention", impl) is None:
        pytest.skip(f"{impl} is not registered")
    dtype = torch.bfloat16
    q = make((2, 128, 8, 64), view, dtype, None, "cuda")
    k, v = make((2, 128, 2, 64), view, dtype, None, "cuda"), make((2, 128, 2, 64), view, dtype, None, "cuda")
    decision = opdispatch.explain(q, k, v, causal=True, impl=impl)
    if decision.chosen is None or decision.candidate(impl).status != "chosen":
        pytest.skip(f"{impl}: {decision.candidate(impl).reasons}")
    want = oracle(q, k, v, True)
    for _ in range(2):  # cold, then the fast path
        out = opdispatch.attention(q, k, v, causal=True, impl=impl)
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < 2.5e-2, (impl, view, err)


@pytest.mark.parametrize("impl", ["nvidia.mem_efficient", "nvidia.cudnn", "torch.flex", "reference.math"])
def test_a_bias_row_of_minus_inf_has_lse_minus_inf(impl):
    q, k, v = (torch.randn(1, s, 4, 64, device="cuda", dtype=torch.bfloat16) for s in (16, 32, 32))
    bias = torch.randn(1, 4, 16, 32, device="cuda", dtype=torch.bfloat16)
    bias[0, 1, 3] = -math.inf
    decision = opdispatch.explain(q, k, v, attn_bias=bias, return_lse=True, impl=impl)
    if decision.candidate(impl).status != "chosen":
        pytest.skip(f"{impl}: {decision.candidate(impl).reasons}")
    out, lse = opdispatch.attention(q, k, v, attn_bias=bias, return_lse=True, impl=impl)
    assert lse[0, 1, 3].item() == -math.inf and torch.isfinite(lse[0, 0]).all()
    assert (out[0, 3, 1] == 0).all()


def test_a_kernel_that_raises_on_the_gpu_is_demoted_once():
    runs = []

    class Broken(AttentionImpl):
        vendor: ClassVar[str] = "broken"
        name: ClassVar[str] = "kernel"
        device_types: ClassVar[frozenset[str]] = frozenset({"cuda"})
        caps: ClassVar[AttentionCaps] = AttentionCaps(dtypes=frozenset({torch.bfloat16}), gqa=True, layouts=frozenset({"bshd", "bhsd", "sbhd"}), causal=True, causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            runs.append(1)
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    try:
        manager.register_impl(Broken())
        manager.set_policy(parse_policy("ops: {attention: {order: [broken.kernel]}}", "<p>"))
        q = torch.randn(1, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
        want = oracle(q, q, q, False)
        for _ in range(20):
            out = opdispatch.attention(q, q, q)
        assert len(runs) == 1
        assert ((out.double() - want).norm() / want.norm()).item() < 2.5e-2
        decision = opdispatch.explain(q, q, q)
        assert decision.candidate("broken.kernel").status == "demoted after raising"
        print("after the breaker:", decision.chosen_id)
    finally:
        opdispatch.set_manager(previous)
