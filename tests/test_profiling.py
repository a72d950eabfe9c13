"""Profiler ranges: while torch.profiler records, every dispatched call — slow path, per-call fast path (Python
and compiled doors), plans, the drop-ins and the other ops — is a range ``opdispatch.<op>[<implementation>]`` with
its class as metadata; outside a profiler the bound functions carry no range."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import opdispatch
from opdispatch.compat import flash_attn, scaled_dot_product_attention


def _names(prof) -> list[str]:
    return [e.name for e in prof.events()]


def test_every_call_is_a_range_naming_op_and_implementation_while_profiling(basic_manager):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    mask = torch.rand(6, 6, generator=gen) > 0.3
    for _ in range(2):  # bound outside the profiler first: those fast-path functions carry no range
        opdispatch.attention(q, k, v, causal=True)
        opdispatch.attention(q, k, v, attn_mask=mask)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # the first call of each decides again under profiling; the others are fast-path hits
            opdispatch.attention(q, k, v, causal=True)
            opdispatch.attention(q, k, v, attn_mask=mask)
            opdispatch.attention(q, k, v, impl="reference.math")
    names = _names(prof)
    assert names.count("opdispatch.attention[cpu.flash]") == 6, names
    assert names.count("opdispatch.attention[reference.math]") == 3
    event = next(e for e in prof.events() if e.name == "opdispatch.attention[cpu.flash]")
    assert event.cpu_children, "the kernel's aten op runs inside the range"


def test_drop_ins_and_other_ops_are_ranges_too(basic_manager):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    x, w = torch.randn(4, 16, generator=gen), torch.ones(16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            scaled_dot_product_attention(q, k, v, is_causal=True)
            flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            opdispatch.rms_norm(x, w)
    names = _names(prof)
    assert names.count("opdispatch.attention[cpu.flash]") == 4, names
    assert any(n.startswith("opdispatch.rms_norm[") for n in names)


def test_outside_a_profiler_the_bound_function_carries_no_range(basic_manager):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    opdispatch.attention(q, k, v, causal=True)
    with profile(activities=[ProfilerActivity.CPU]):
        opdispatch.attention(q, k, v, causal=True)
    with_range = [fn for fn in basic_manager.fast.values() if getattr(fn, "__name__", "") == "in_range"]
    without = [fn for fn in basic_manager.fast.values() if getattr(fn, "__name__", "") != "in_range"]
    assert len(with_range) == 1 and len(without) == 1  # one entry per profiling state: the keys differ
    assert opdispatch.attention(q, k, v, causal=True) is not None


def test_under_torch_compile_the_custom_op_names_its_implementation(basic_manager):
    """The compiled graph calls opdispatch::attention, whose name alone does not say which kernel ran: its forward
    and backward are ranges named as in eager mode (the backward with `.backward`)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return opdispatch.attention(q, k, v, causal=True).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()  # compiled outside the profiler
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(q, k, v).backward()
    names = _names(prof)
    assert names.count("opdispatch.attention[cpu.flash]") == 1, names
    assert names.count("opdispatch.attention[cpu.flash].backward") == 1, names
