"""Property: no valid view gives a wrong answer. Shapes, strides, dtypes and flags drawn by hypothesis, each call
compared with a float64 oracle written out here — for every CPU-runnable implementation (through the op, cold
and on the fast path after a contiguous warm-up) and for the flash-attn fakes (which, like the real kernels,
assert a unit-stride head dim) through the op's conforming contract."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opdispatch
from opdispatch.vendors.nvidia import FlashAttn2
from tests.conftest import TOLERANCES
from tests.fakes import flash_attn as fake_fa2

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

VIEWS = ("contiguous", "head_dim_not_innermost", "every_other", "expanded_batch", "from_a_scalar", "reversed_storage",
         "every_other_row")


def make(shape: tuple[int, ...], view: str, dtype: torch.dtype, gen: torch.Generator | None,
         device: str = "cpu") -> torch.Tensor:
    """A tensor of `shape` with random values, laid out in memory as `view` says (the GPU tests use it too)."""
    def rand(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=gen, dtype=torch.float64) + 0.1).to(dtype).to(device)

    if view == "contiguous":
        return rand(*shape)
    if view == "head_dim_not_innermost":
        return rand(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if view == "every_other":
        return rand(*shape[:-1], 2 * shape[-1])[..., ::2]
    if view == "expanded_batch":
        return rand(1, *shape[1:]).expand(shape)
    if view == "from_a_scalar":
        return rand(1).reshape(()).expand(shape)
    if view == "reversed_storage":
        return rand(*shape[::-1]).permute(*reversed(range(len(shape))))
    if view == "every_other_row":
        return rand(shape[0], 2 * shape[1], *shape[2:])[:, ::2]
    raise AssertionError(view)


def oracle(q, k, v, *, layout, causal, alignment, window, softcap, scale):
    """(out, lse) in float64: scores, softcap, the causal/window pattern on the aligned diagonal, softmax."""
    perm = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}[layout]
    qd, kd, vd = (t.permute(*perm).double() for t in (q, k, v))
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    i = torch.arange(sq)[:, None] + (sk - sq if alignment == "bottom_right" else 0)
    j = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    inverse = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (2, 0, 1, 3)}[layout]
    return (p @ vd).permute(*inverse), lse


@st.composite
def attention_cases(draw, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
                    layouts=("bshd", "bhsd", "sbhd")):
    hkv = draw(st.sampled_from((1, 2)))
    case = dict(
        layout=draw(st.sampled_from(layouts)), b=draw(st.integers(1, 2)), sq=draw(st.integers(1, 9)),
        sk=draw(st.integers(1, 9)), hkv=hkv, hq=hkv * draw(st.sampled_from((1, 2))),
        d=draw(st.sampled_from((1, 3, 8, 16))), dtype=draw(st.sampled_from(dtypes)),
        views=tuple(draw(st.sampled_from(VIEWS)) for _ in range(3)), causal=draw(st.booleans()),
        alignment=draw(st.sampled_from(("top_left", "bottom_right"))), softcap=draw(st.sampled_from((0.0, 5.0))),
        scale=draw(st.sampled_from((None, 0.3, 2.0))), return_lse=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )
    window = draw(st.sampled_from((None, (2, 0), (1, 3), (-1, 2), (4, -1))))
    if case["causal"] and window is not None:
        window = (window[0], 0) if window[0] >= 0 else None  # causal forbids looking ahead
    case["window"] = window
    return case


def inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, sq, sk, hq, hkv, d = (case[n] for n in ("b", "sq", "sk", "hq", "hkv", "d"))
    shape = {"bshd": lambda s, h: (b, s, h, d), "bhsd": lambda s, h: (b, h, s, d),
             "sbhd": lambda s, h: (s, b, h, d)}[case["layout"]]
    shapes = (shape(sq, hq), shape(sk, hkv), shape(sk, hkv))
    views = tuple(make(s, view, case["dtype"], gen) for s, view in zip(shapes, case["views"]))
    dense = tuple(t.contiguous() for t in views)
    return views, dense


def kwargs(case):
    return dict(layout=case["layout"], causal=case["causal"], causal_alignment=case["alignment"],
                window=case["window"], softcap=case["softcap"], scale=case["scale"], return_lse=case["return_lse"])


def check(case, result, q, k, v):
    scale = case["scale"] if case["scale"] is not None else case["d"] ** -0.5
    want_out, want_lse = oracle(q, k, v, layout=case["layout"], causal=case["causal"], alignment=case["alignment"],
                                window=case["window"], softcap=case["softcap"], scale=scale)
    out, lse = result if case["return_lse"] else (result, None)
    tol = TOLERANCES[case["dtype"]] if case["dtype"] != torch.float32 else dict(atol=5e-5, rtol=5e-5)
    assert out.shape == want_out.shape and out.dtype == case["dtype"], (out.shape, want_out.shape, case)
    torch.testing.assert_close(out.double(), want_out, **tol, msg=lambda m: f"{case}: {m}")
    if lse is not None:
        finite = torch.isfinite(want_lse)
        assert (lse[~finite] == -math.inf).all(), case
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["cpu.flash", "reference.math", None])
@SETTINGS
@given(case=attention_cases())
def test_every_view_gives_the_oracle_answer_through_the_op(basic_manager, impl, case):
    """Cold on the view, then warm: the fast path first sees the contiguous copy, then the view itself."""
    views, dense = inputs(case)
    kw = kwargs(case)
    if impl is not None:
        call = opdispatch.validate_attention(*views, **kw)
        declared = basic_manager.implementation("attention", impl)
        if declared.not_supported_reasons(call, basic_manager.device_info(call.device)):
            return  # a feature it does not declare (softcap on cpu.flash): the policy's choice covers the case
    check(case, opdispatch.attention(*views, impl=impl, **kw), *dense)
    opdispatch.attention(*dense, impl=impl, **kw)
    check(case, opdispatch.attention(*views, impl=impl, **kw), *dense)  # a hit of the view's own signature
    plan = opdispatch.plan(*dense, impl=impl, **kw)
    check(case, plan(*dense), *dense)


@SETTINGS
@given(case=attention_cases(dtypes=(torch.float32, torch.float64), layouts=("bshd", "bhsd")))
def test_the_flash_attn_fake_gets_unit_stride_inputs_from_the_op(monkeypatch, case):
    """The fake asserts q/k/v have a unit-stride head dim, as flash-attn's C++ does; the op's conforming (what
    `run` and bound functions are given) must always hand it such inputs."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_fa2)
    views, dense = inputs(case)
    call = opdispatch.validate_attention(*views, **kwargs(case))
    impl = FlashAttn2()
    if impl.not_supported_reasons(call, opdispatch.load_device_descriptor(_a100())):
        return
    check(case, impl.run(impl.conform(call)), *dense)
    conformer = impl.input_conformer(call)
    bound = impl.bind(impl.conform(call))
    check(case, bound(*(conformer(*views) if conformer else views)), *dense)


def _a100():
    from tests.conftest import device_descriptor

    return device_descriptor("a100")


def test_the_contract_is_declared_and_enforced_where_needed():
    from opdispatch.vendors.cpu import CpuFlashAttention
    from opdispatch.vendors.reference import ReferenceAttention

    assert ReferenceAttention.caps.strided_inputs and not CpuFlashAttention.caps.strided_inputs
    q = torch.randn(1, 4, 2, 16)[..., ::2]
    call = opdispatch.validate_attention(q, q, q)
    assert ReferenceAttention().conform(call) is call and ReferenceAttention().input_conformer(call) is None
    conformed = CpuFlashAttention().conform(call)
    assert all(t.stride(-1) == 1 for t in (conformed.q, conformed.k, conformed.v))
    plain = opdispatch.validate_attention(*(torch.randn(1, 4, 2, 8) for _ in range(3)))
    assert CpuFlashAttention().input_conformer(plain) is None  # nothing runs per call for ordinary inputs


def test_contiguous_inputs_are_made_contiguous_every_call():
    """A kernel that reads k/v with q's strides (FlagGems SDPA) declares contiguous_inputs: views of any strides,
    even with a unit-stride head dim, reach it contiguous in the call's layout."""
    from opdispatch.vendors.flagos import FlagGemsAttention

    assert FlagGemsAttention.caps.contiguous_inputs
    impl = FlagGemsAttention()
    q = torch.randn(2, 8, 4, 16)
    v = torch.randn(2, 4, 8, 16).transpose(1, 2)  # bshd view of bhsd storage: unit stride, other strides differ
    call = opdispatch.validate_attention(q, q, v)
    conformed = impl.conform(call)
    assert conformed.v.is_contiguous() and conformed.q is q  # a contiguous tensor is not copied
    conformer = impl.input_conformer(call)
    assert all(t.is_contiguous() for t in conformer(q, q, v))
    torch.testing.assert_close(conformer(q, q, v)[2], v)
