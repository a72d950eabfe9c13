"""The compiled per-call fast path (opdispatch.base._native) against the Python front doors it stands in for.

Every front door — opdispatch.attention, rms_norm, rotary_embedding, the compat SDPA and flash_attn_func — is
called through its Python path (`_native.python_of`) and through a compiled twin made from the same spec
(`_native.twin`), on the same inputs, four times each (the first call decides and binds, the second reads the
bound function back into the compiled door's table, the others hit): the results must be bitwise equal, and so must the errors (type and message). The twin's counters prove the compiled
hit path ran. Then coherence (a policy swap, a demotion, a new manager, contexts, grad mode) and the mode switch.
"""

from __future__ import annotations

import inspect
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import opdispatch
from opdispatch.base import _native
from opdispatch.base._errors import OpDispatchError
from opdispatch.compat import flash_attn
from opdispatch.compat import scaled_dot_product_attention as compat_sdpa
from opdispatch.policies import parse_policy
from tests.conftest import NATIVE_BUILD_ERROR, REPO


@pytest.fixture(scope="module")
def loaded() -> None:
    if _native.native_module() is None:
        reason = NATIVE_BUILD_ERROR or _native.status().reason
        if os.environ.get("CI"):  # CI tests both paths: a compiled path that did not build is a failure there
            pytest.fail(f"the compiled fast path is not loaded in CI: {reason}")
        pytest.skip(f"the compiled fast path is not loaded: {reason}")


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return ("returned", fn(*args, **kwargs))
    except Exception as exc:  # the errors must match too
        return ("raised", type(exc), str(exc))


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.shape, a.dtype, a.stride(), a.requires_grad) == (b.shape, b.dtype, b.stride(), b.requires_grad), where
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), where
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _clone(value: Any) -> Any:
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        base = value.detach().clone(memory_format=torch.preserve_format)
        if value.stride() != base.stride():  # a view: keep its strides
            base = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(value.detach())
        return base.requires_grad_(value.requires_grad)
    return value


def _differential(door: Callable[..., Any], make: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]],
                  *, backward: bool = False) -> Any:
    """`door`'s Python path and a compiled twin on the same inputs, four rounds: same results or same errors."""
    python, compiled = _native.python_of(door), _native.twin(door)
    for round_ in range(4):
        args, kwargs = make(round_)
        args2, kwargs2 = tuple(map(_clone, args)), {k: _clone(v) for k, v in kwargs.items()}
        expected, got = _outcome(python, args, kwargs), _outcome(compiled, args2, kwargs2)
        assert expected[0] == got[0], f"round {round_}: python {expected[:3]!r} vs compiled {got[:3]!r}"
        _assert_same(expected[1:], got[1:], f"round {round_}")
        if backward and expected[0] == "returned":
            out1 = expected[1][0] if isinstance(expected[1], tuple) else expected[1]
            out2 = got[1][0] if isinstance(got[1], tuple) else got[1]
            grad = torch.randn(out1.shape, generator=torch.Generator().manual_seed(round_), dtype=out1.dtype)
            out1.backward(grad)
            out2.backward(grad)
            for i, (x, y) in enumerate(zip(args, args2)):
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    _assert_same(x.grad, y.grad, f"round {round_} grad {i}")
    return compiled


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float32).to(dtype).requires_grad_(grad)


# -- attention ----------------------------------------------------------------------------------------------------

def _qkv(shape_q: tuple[int, ...], shape_kv: tuple[int, ...], seed: int, **kw: Any) -> tuple[torch.Tensor, ...]:
    return _rand(*shape_q, seed=seed, **kw), _rand(*shape_kv, seed=seed + 1, **kw), _rand(*shape_kv, seed=seed + 2, **kw)


ATTENTION_CASES: dict[str, Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "bhsd": lambda r: (_qkv((1, 2, 5, 8), (1, 2, 5, 8), r), {"layout": "bhsd"}),
    "bshd causal": lambda r: (_qkv((2, 7, 3, 16), (2, 7, 3, 16), r), {"causal": True}),
    "gqa bottom-right lse": lambda r: (_qkv((2, 3, 4, 8), (2, 9, 2, 8), r), {
        "causal": True, "causal_alignment": "bottom_right", "return_lse": True}),
    "window": lambda r: (_qkv((1, 11, 2, 8), (1, 11, 2, 8), r), {"causal": True, "window": (3, 0)}),
    "float64 softcap scale": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r, dtype=torch.float64), {
        "softcap": 5.0, "scale": 0.3}),
    "an int scale": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"scale": 1}),
    "odd shape sbhd": lambda r: (_qkv((5, 3, 1, 7), (5, 3, 1, 7), r), {"layout": "sbhd"}),
    "strided views": lambda r: (tuple(t[..., ::2] for t in _qkv((1, 6, 2, 16), (1, 6, 2, 16), r)), {}),
    "transposed views": lambda r: (tuple(t.transpose(1, 2) for t in _qkv((1, 2, 6, 8), (1, 2, 6, 8), r)), {}),
    "pinned": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"impl": "reference.math"}),
    "a mask (its values passed per call)": lambda r: (_qkv((1, 4, 2, 8), (1, 6, 2, 8), r), {
        "attn_mask": torch.rand(4, 6, generator=_gen(r)) > 0.3}),
    "a Parameter": lambda r: ((torch.nn.Parameter(_rand(1, 4, 2, 8, seed=r)), *_qkv((1, 4, 2, 8), (1, 4, 2, 8), r)[1:]),
                              {}),
    "causal=1 (refused)": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"causal": 1}),
    "window of floats (refused)": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"window": (4.0, 0)}),
    "NaN scale (refused)": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"scale": float("nan")}),
    "unknown layout": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"layout": "bsdh"}),
    "mixed dtypes": lambda r: ((_rand(1, 4, 2, 8, seed=r), _rand(1, 4, 2, 8, seed=r, dtype=torch.float64),
                                _rand(1, 4, 2, 8, seed=r)), {}),
    "k is None": lambda r: ((_rand(1, 4, 2, 8, seed=r), None, _rand(1, 4, 2, 8, seed=r)), {}),
    "an unknown keyword": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), {"casual": True}),
    "too many positionals": lambda r: ((*_qkv((1, 4, 2, 8), (1, 4, 2, 8), r), "bshd"), {}),
    "v missing": lambda r: (_qkv((1, 4, 2, 8), (1, 4, 2, 8), r)[:2], {}),
    "a dense KV cache (CPU lengths: validated each call)": lambda r: (_qkv((2, 1, 2, 8), (2, 9, 2, 8), r), {
        "seqused_k": torch.tensor([3 + r, 9], dtype=torch.int32), "causal": True,
        "causal_alignment": "bottom_right"}),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_compiled_matches_python(loaded, basic_manager, case):
    _differential(opdispatch.attention, ATTENTION_CASES[case])


def test_attention_compiled_hits_run_in_c_and_match_gradients(loaded, basic_manager):
    make = ATTENTION_CASES["gqa bottom-right lse"]
    compiled = _differential(opdispatch.attention, lambda r: (_qkv((2, 3, 4, 8), (2, 9, 2, 8), r, grad=True), {
        "causal": True, "causal_alignment": "bottom_right"}), backward=True)
    assert compiled.__self__.stats()["hits"] == 2
    compiled = _differential(opdispatch.attention, make)
    stats = compiled.__self__.stats()
    assert (stats["misses"], stats["hits"], stats["passes"]) == (2, 2, 0)
    compiled = _differential(opdispatch.attention, ATTENTION_CASES["a mask (its values passed per call)"])
    stats = compiled.__self__.stats()  # a mask is keyed by shape, dtype and device; its values change per call
    assert (stats["misses"], stats["hits"], stats["passes"]) == (2, 2, 0), stats  # as an unmasked call


def test_attention_compiled_keys_grad_mode_contexts_and_determinism(loaded, basic_manager):
    compiled, python = _native.twin(opdispatch.attention), _native.python_of(opdispatch.attention)
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 0, grad=True)

    def thrice() -> torch.Tensor:
        outs = [compiled(q, k, v) for _ in range(3)]  # a miss, a read-back, a hit
        expected = python(q, k, v)
        for out in outs:
            _assert_same(out, expected, "context")
        return outs[-1]

    assert thrice().requires_grad
    with torch.no_grad():
        assert not thrice().requires_grad
    with opdispatch.policy_override(pin="reference.math"):
        assert torch.equal(thrice(), opdispatch.attention(q, k, v, impl="reference.math"))
    with opdispatch.scope("model.layers.0"):
        thrice()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        thrice()
    finally:
        torch.use_deterministic_algorithms(previous)
    chosen = sorted({fn.decision.chosen_id for fn in basic_manager.fast.values()})
    assert "reference.math" in chosen and "cpu.flash" in chosen
    # Each context is a signature of its own (never another context's kernel), and each ends on a compiled hit.
    stats = compiled.__self__.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (5, 10, 5)


def test_a_policy_swap_a_new_manager_and_forget_reach_the_compiled_door(loaded, basic_manager):
    compiled = _native.twin(opdispatch.attention)
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 0)
    compiled(q, k, v)
    compiled(q, k, v)
    assert [fn.decision.chosen_id for fn in basic_manager.fast.values()] == ["cpu.flash"]
    basic_manager.set_policy(parse_policy("ops: {attention: {order: [reference.math]}}", "<p>"))
    out = compiled(q, k, v)
    assert [fn.decision.chosen_id for fn in basic_manager.fast.values()] == ["reference.math"]
    assert torch.equal(compiled(q, k, v), out) and torch.equal(out, opdispatch.attention(q, k, v))
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    try:
        assert compiled.__self__.stats()["entries"] == 0  # set_manager forgets every compiled door's entries
        compiled(q, k, v)
        assert [fn.decision.chosen_id for fn in fresh.fast.values()] == ["cpu.flash"]
    finally:
        opdispatch.set_manager(previous)


class _Flaky(opdispatch.AttentionImpl):
    """Raises on its third call (the compiled door's first hit): the breaker moves the class on."""

    vendor, name, priority = "test", "flaky", 1000
    caps = opdispatch.AttentionCaps(dtypes=frozenset({torch.float32}), layouts=frozenset({"bshd", "bhsd", "sbhd"}))
    calls = 0

    def run(self, call: Any) -> Any:
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("flaky kernel failed")
        q, k, v = (t.double() for t in (call.bhsd(call.q), call.bhsd(call.k), call.bhsd(call.v)))
        weights = torch.softmax(q @ k.transpose(-1, -2) * call.scale, dim=-1)
        return call.from_bhsd((weights @ v).float())


def test_a_failing_kernel_on_a_compiled_hit_fails_over_as_the_python_path_does(loaded, basic_manager):
    basic_manager.register_impl(_Flaky())
    basic_manager.set_policy(parse_policy(
        "settings: {fallback_on_error: true}\nops: {attention: {order: [test.flaky, cpu.flash]}}", "<p>"))
    compiled = _native.twin(opdispatch.attention)
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 0)
    first = compiled(q, k, v)  # test.flaky, decided through Python
    compiled(q, k, v)  # through Python again; the compiled door reads the bound function back
    second = compiled(q, k, v)  # a compiled hit: test.flaky raises, the class moves on to cpu.flash
    assert compiled.__self__.stats()["hits"] == 1
    torch.testing.assert_close(first, second)
    assert [fn.decision.chosen_id for fn in basic_manager.fast.values()] == ["cpu.flash"]
    assert torch.equal(compiled(q, k, v), second)


def test_an_entry_stands_after_another_signature_changes_the_managers_cache(loaded, basic_manager):
    compiled = _native.twin(opdispatch.attention)
    a = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 0)
    b = _qkv((1, 5, 2, 16), (1, 5, 2, 16), 0)  # another head dim: not a size-generic hit of a's template
    compiled(*a)
    compiled(*a)  # a's entry
    compiled(*b)  # a new signature through Python: the dict's version changes
    compiled(*a)  # a's entry checked by one lookup, not a Python call
    stats = compiled.__self__.stats()
    assert (stats["misses"], stats["hits"], stats["revalidated"]) == (3, 1, 1)


def test_a_signature_seen_once_costs_no_read_back(loaded, basic_manager):
    """A decode loop over a growing cache: a new shape each step; the compiled door keeps no exact entry for any
    (each step after the first is a size-generic hit where those are on: tests/test_native_sized.py)."""
    compiled = _native.twin(opdispatch.attention)
    for length in range(3, 9):
        q, k, v = _qkv((1, 1, 2, 8), (1, length, 2, 8), length)
        assert torch.equal(compiled(q, k, v), _native.python_of(opdispatch.attention)(q, k, v))
    stats = compiled.__self__.stats()
    assert stats["entries"] == 0 and stats["hits"] == 0 and stats["misses"] + stats["sized_hits"] == 6
    assert stats["sized_hits"] in (0, 5)  # off, or every step after the first



def test_call_sites_bind_alike_however_their_arguments_are_spelled(loaded, basic_manager):
    """Each call site's binding (positionals, keyword names) is worked out once and reused: twelve spellings — more
    than the door keeps — of calls that mean the same (or, explicitly passing a default, the same kernel), through
    literal keywords and through ``**kwargs`` (a fresh name tuple per call), each bit for bit as the Python path."""
    compiled, python = _native.twin(opdispatch.attention), _native.python_of(opdispatch.attention)
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 3)
    spellings = [lambda f: f(q, k, v), lambda f: f(q, k, v=v), lambda f: f(q, k=k, v=v), lambda f: f(q=q, k=k, v=v),
                 lambda f: f(v=v, k=k, q=q), lambda f: f(q, k, v, causal=False),
                 lambda f: f(q, k, v, layout="bshd"), lambda f: f(q, k, v, causal=False, layout="bshd"),
                 lambda f: f(q, k, v, layout="bshd", causal=False), lambda f: f(q, k, v, scale=None),
                 lambda f: f(q, k, v, causal=True), lambda f: f(q, k, v, impl=None, return_lse=False),
                 lambda f: f(q, k, v, **{"causal": True}), lambda f: f(q, k, v, **{"layout": "bshd"})]
    for _ in range(3):  # a shape evicted by the others is worked out again
        for spell in spellings:
            _assert_same(spell(python), spell(compiled), "a spelling")
    for _ in range(4):  # ** builds a new tuple of the same names per call: the shape is found by its names
        _assert_same(compiled(q, k, v, **{"window": (2, 0), "causal": True}),
                     python(q, k, v, window=(2, 0), causal=True), "**kwargs")
    # Eight keys (which arguments were passed, and their values: q/k/v however spelled; causal=False; layout; both;
    # scale; causal=True; impl with return_lse; the window): each misses twice (decided, then read back), and the
    # other 30 of the 46 calls hit, none handed to Python unkeyed.
    stats = compiled.__self__.stats()
    assert (stats["misses"], stats["hits"], stats["passes"]) == (16, 30, 0)
    for bad in ({"q": q}, {"causal": True, "casual": True}):  # a repeated or unknown keyword: Python's TypeError
        assert _outcome(compiled, (q, k, v), bad) == _outcome(python, (q, k, v), bad)


# -- rms_norm, rotary_embedding -----------------------------------------------------------------------------------

RMS_NORM_CASES = {
    "weight": lambda r: ((_rand(3, 16, seed=r), 1 + 0.1 * _rand(16, seed=r + 1)), {}),
    "residual, positional eps": lambda r: ((_rand(2, 3, 16, seed=r), _rand(16, seed=r + 1), 1e-5,
                                            _rand(2, 3, 16, seed=r + 2)), {}),
    "no weight, strided": lambda r: ((_rand(4, 32, seed=r)[:, ::2],), {}),
    "bad eps": lambda r: ((_rand(3, 16, seed=r),), {"eps": -1.0}),
    "an int eps": lambda r: ((_rand(3, 16, seed=r),), {"eps": 1}),
}


@pytest.mark.parametrize("case", list(RMS_NORM_CASES))
def test_rms_norm_compiled_matches_python(loaded, basic_manager, case):
    _differential(opdispatch.rms_norm, RMS_NORM_CASES[case])


def test_rms_norm_compiled_gradients(loaded, basic_manager):
    compiled = _differential(opdispatch.rms_norm, lambda r: ((_rand(3, 16, seed=r, grad=True),
                                                              _rand(16, seed=r + 1, grad=True)), {}), backward=True)
    assert compiled.__self__.stats()["hits"] == 2


def _rope(rows: int = 32, half: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.arange(rows, dtype=torch.float64)[:, None] * 1e4 ** (-torch.arange(half) / half)
    return theta.cos().float(), theta.sin().float()


ROTARY_CASES = {
    "neox": lambda r: ((_rand(2, 5, 4, 8, seed=r), _rand(2, 5, 2, 8, seed=r + 1), *_rope()), {}),
    "interleaved, int offset": lambda r: ((_rand(1, 3, 2, 8, seed=r), _rand(1, 3, 2, 8, seed=r + 1), *_rope()),
                                          {"interleaved": True, "seqlen_offsets": 4}),
    "tensor offsets (CPU: validated each call)": lambda r: (
        (_rand(2, 1, 2, 8, seed=r), _rand(2, 1, 2, 8, seed=r + 1), *_rope()),
        {"seqlen_offsets": torch.tensor([r, 7])}),
    "bad layout": lambda r: ((_rand(2, 5, 4, 8, seed=r), _rand(2, 5, 2, 8, seed=r + 1), *_rope()),
                             {"layout": "sbhd"}),
}


@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_compiled_matches_python(loaded, basic_manager, case):
    _differential(opdispatch.rotary_embedding, ROTARY_CASES[case])


# -- the compat drop-ins ------------------------------------------------------------------------------------------

SDPA_CASES = {
    "4-D": lambda r: (_qkv((1, 2, 5, 8), (1, 2, 5, 8), r), {}),
    "causal, scale, positional dropout 0": lambda r: ((*_qkv((2, 3, 4, 8), (2, 3, 4, 8), r), None, 0, True),
                                                      {"scale": 0.25}),
    "gqa": lambda r: (_qkv((1, 4, 3, 8), (1, 2, 3, 8), r), {"enable_gqa": True}),
    "3-D": lambda r: (_qkv((3, 5, 8), (3, 6, 8), r), {}),
    "a float mask": lambda r: (_qkv((1, 2, 5, 8), (1, 2, 5, 8), r), {"attn_mask": _rand(5, 5, seed=r)}),
    "a Parameter query": lambda r: ((torch.nn.Parameter(_rand(1, 2, 5, 8, seed=r)),
                                     *_qkv((1, 2, 5, 8), (1, 2, 5, 8), r)[1:]), {}),
    "is_causal with a mask (torch's error)": lambda r: (_qkv((1, 2, 5, 8), (1, 2, 5, 8), r), {
        "attn_mask": torch.ones(5, 5, dtype=torch.bool), "is_causal": True, "dropout_p": 0.0}),
    "bad dropout": lambda r: (_qkv((1, 2, 5, 8), (1, 2, 5, 8), r), {"dropout_p": 1.5}),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_compat_sdpa_compiled_matches_python(loaded, basic_manager, case):
    _differential(compat_sdpa, SDPA_CASES[case])


def test_compat_sdpa_compiled_hits_and_an_implementation_inside_reaches_torch(loaded, basic_manager):
    compiled = _differential(compat_sdpa, SDPA_CASES["4-D"])
    assert compiled.__self__.stats()["hits"] == 2
    from opdispatch.compat import _sdpa

    q, k, v = _qkv((1, 2, 5, 8), (1, 2, 5, 8), 0)
    _sdpa._state.active = 1  # as while a kernel runs: a call from inside goes to torch's function
    try:
        before = compiled.__self__.stats()["passes"]
        assert torch.equal(compiled(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))
        assert compiled.__self__.stats()["passes"] == before + 1
    finally:
        _sdpa._state.active = 0


FLASH_CASES = {
    "bshd": lambda r: (_qkv((1, 5, 2, 8), (1, 5, 2, 8), r), {}),
    "causal window softcap": lambda r: (_qkv((2, 6, 4, 8), (2, 9, 2, 8), r), {
        "causal": True, "window_size": (3, 0), "softcap": 10.0}),
    "return_attn_probs (reshaped on a hit)": lambda r: (_qkv((1, 5, 2, 8), (1, 5, 2, 8), r), {
        "return_attn_probs": True, "softmax_scale": 0.5}),
    "a window list": lambda r: (_qkv((1, 5, 2, 8), (1, 5, 2, 8), r), {"window_size": [2, 2]}),
    "alibi": lambda r: (_qkv((1, 5, 2, 8), (1, 5, 2, 8), r), {"alibi_slopes": torch.tensor([0.5, 0.25])}),
}


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_compat_flash_attn_compiled_matches_python(loaded, basic_manager, case):
    compiled = _differential(flash_attn.flash_attn_func, FLASH_CASES[case])
    if case == "return_attn_probs (reshaped on a hit)":
        assert compiled.__self__.stats()["hits"] == 2


def test_the_compiled_door_traces_under_torch_compile(loaded, basic_manager):
    compiled = _native.twin(opdispatch.attention)
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8), 0)
    fn = torch.compile(lambda q, k, v: compiled(q, k, v, causal=True) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v), opdispatch.attention(q, k, v, causal=True) * 2)


def test_kernel_call_binds_the_aten_op_as_one_c_call(loaded):
    kernel = torch._scaled_dot_product_flash_attention_for_cpu
    bound = _native.kernel_call(kernel, 0.0, True, scale=0.5, index=0)
    assert type(bound).__name__ == "KernelCall"
    q, k, v = _qkv((1, 2, 5, 8), (1, 2, 5, 8), 0)
    assert torch.equal(bound(q, k, v), kernel(q, k, v, 0.0, True, scale=0.5)[0])
    bound.decision = "attribute"
    assert bound.decision == "attribute"
    whole = _native.kernel_call(kernel, 0.0, False)
    assert isinstance(whole(q, k, v), tuple)
    with pytest.raises(TypeError, match="positionally"):
        bound(q, k, v=v)
    with pytest.raises(IndexError, match="item 7"):
        _native.kernel_call(kernel, 0.0, False, index=7)(q, k, v)


# -- the switch, the CLI ----------------------------------------------------------------------------------------

def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300,
                          cwd=REPO)


@pytest.mark.slow
def test_the_fast_path_mode_switch_and_doctor(loaded, tmp_path):
    which = ("import opdispatch, sys; from opdispatch.base import _native; from opdispatch.tools import _cli; print(type(opdispatch.attention).__name__,"
             " _native.status().describe()); sys.argv = ['opdispatch', 'doctor']; _cli.main()")
    cache = str(Path(_native.status().path or "").parents[2])  # where this process found it (…/native/<tag>/<so>)
    compiled = _run(which, OPDISPATCH_PLUGINS="cpu,reference", OPDISPATCH_CACHE_DIR=cache)
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout.startswith("builtin_function_or_method compiled (built for torch")
    assert "fast path: compiled" in compiled.stdout
    python = _run(which, OPDISPATCH_FAST_PATH="python", OPDISPATCH_PLUGINS="cpu,reference")
    assert python.stdout.startswith("function python (OPDISPATCH_FAST_PATH=python)")
    unbuilt = _run(which, OPDISPATCH_FAST_PATH="auto", OPDISPATCH_CACHE_DIR=str(tmp_path))
    assert unbuilt.stdout.startswith("function python (not built for this Python") and "opdispatch build" in unbuilt.stdout
    required = _run("import opdispatch; opdispatch.attention", OPDISPATCH_FAST_PATH="compiled",
                    OPDISPATCH_CACHE_DIR=str(tmp_path))
    assert required.returncode != 0 and "OPDISPATCH_FAST_PATH=compiled, but the compiled fast path is not built" \
        in required.stderr and "run `opdispatch build`" in required.stderr
    wrong = _run("import opdispatch; opdispatch.attention", OPDISPATCH_FAST_PATH="fast")
    assert "OPDISPATCH_FAST_PATH='fast' is not a fast-path mode; allowed: auto, python, compiled" in wrong.stderr


@pytest.mark.slow
def test_build_without_a_compiler_says_what_is_missing_and_python_still_runs(tmp_path):
    code = ("import sys; from opdispatch.tools import _cli; sys.argv = ['opdispatch', 'build']; sys.exit(_cli.main())")
    result = _run(code, OPDISPATCH_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    assert result.returncode == 1
    assert "building opdispatch's compiled fast path failed" in result.stderr
    assert f"C++ compiler (g++ or clang++) for {_native.cxx_standard()}" in result.stderr
    assert "Python fast path runs" in result.stderr


@pytest.mark.slow
def test_the_fast_path_tests_pass_on_the_python_path(tmp_path):
    """The rest of the suite runs compiled where it built; these files run again on the Python path."""
    files = ["tests/test_fast_path.py", "tests/test_fast_path_exactness.py", "tests/test_arguments.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPDISPATCH_")}
    env[_native.ENV] = "python"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], env=env,
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_the_build_directory_is_per_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OPDISPATCH_CACHE_DIR", str(tmp_path))
    here = _native.build_directory()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    there = _native.build_directory()
    assert here != there and here.parent == there.parent == tmp_path / "native"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv") + "/")  # one environment, however spelled
    assert _native.build_directory() == there


def test_a_python_the_extension_does_not_build_for_runs_the_python_path(monkeypatch):
    monkeypatch.setattr(_native, "PYTHONS", ((3, 0), (3, 1)))
    monkeypatch.setenv(_native.ENV, "auto")
    _native.reset_status()
    try:
        status = _native.status()
        assert not status.active
        assert status.reason.startswith(f"not available on Python {platform.python_version()} (it builds for "
                                        "Python 3.0–3.1)")
        with pytest.raises(OpDispatchError, match=r"builds for Python 3\.0–3\.1, not .*the Python fast path runs"):
            _native.build()
        monkeypatch.setenv(_native.ENV, "compiled")
        _native.reset_status()
        with pytest.raises(OpDispatchError, match="OPDISPATCH_FAST_PATH=compiled, but the compiled fast path is not "
                                                  "available on Python"):
            _native.status()
    finally:
        monkeypatch.undo()
        _native.reset_status()


def test_the_build_message_names_the_standard_torch_compiles_with():
    from torch.utils import cpp_extension

    standard = _native.cxx_standard()
    assert standard.startswith("C++") and f"-std=c++{standard[3:]}" in inspect.getsource(cpp_extension)


def test_every_compiled_door_states_the_parameters_of_the_python_door_it_wraps(loaded):
    """inspect.signature of a compiled door (a builtin: its text signature) gives the real parameters — names,
    kinds, defaults — of the Python front door behind it (`python_of`), whose own signature carries the
    annotations; the ops' doors match their argument definitions."""
    import inspect

    from opdispatch.compat import flash_attn, scaled_dot_product_attention
    from opdispatch.ops._attention import ATTENTION_ARGS
    from opdispatch.ops._rms_norm import RMS_NORM_ARGS
    from opdispatch.ops._rotary import ROTARY_ARGS

    def bare(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    doors = {opdispatch.attention: ATTENTION_ARGS, opdispatch.rms_norm: RMS_NORM_ARGS,
             opdispatch.rotary_embedding: ROTARY_ARGS, scaled_dot_product_attention: None,
             flash_attn.flash_attn_func: None}
    for door, arguments in doors.items():
        python = _native.python_of(door)
        assert python is not door and inspect.isbuiltin(door) and inspect.isfunction(python), door
        assert bare(door) == bare(python), door.__name__
        annotated = inspect.signature(python)
        assert all(p.annotation is not inspect.Parameter.empty for p in annotated.parameters.values()), door.__name__
        if arguments is not None:
            assert [p.name for p in annotated.parameters.values()] == list(arguments.names)
            assert annotated == arguments.signature(return_annotation=annotated.return_annotation)
