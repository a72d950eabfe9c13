"""opdispatch.compat.scaled_dot_product_attention is torch's functional, dispatched: the same results (forward
and gradients) as torch's own function and as torch's documented reference in float64, the same broadcasting,
a RuntimeError wherever torch raises one, and routing of a whole program's F.scaled_dot_product_attention."""

from __future__ import annotations

import contextlib
import math
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opdispatch
from opdispatch.compat import (SdpaError, route_sdpa, routed_sdpa, scaled_dot_product_attention, torch_sdpa,
                               unroute_sdpa)


def documented_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """torch's docstring reference implementation, in float64 (no dropout): the independent oracle."""
    query, key, value = query.double(), key.double(), value.double()
    L, S = query.size(-2), key.size(-2)
    scale_factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    attn_bias = torch.zeros(L, S, dtype=torch.float64)
    if is_causal:
        attn_bias.masked_fill_(torch.ones(L, S, dtype=torch.bool).tril(diagonal=0).logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_bias = attn_bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            attn_bias = attn_mask.double() + attn_bias
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    weight = query @ key.transpose(-2, -1) * scale_factor + attn_bias
    weight = torch.softmax(weight, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros, as torch's CPU kernel
    return weight @ value


def rand(*shape, dtype=torch.float32, grad=False, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)


CASES = {
    "4-D": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8)),
    "causal, fewer queries": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), is_causal=True),
    "causal, more queries": dict(q=(1, 2, 9, 8), k=(1, 2, 4, 8), v=(1, 2, 4, 8), is_causal=True),
    "3-D (no heads)": dict(q=(3, 5, 16), k=(3, 6, 16), v=(3, 6, 16)),
    "2-D": dict(q=(5, 16), k=(6, 16), v=(6, 16)),
    "5-D": dict(q=(3, 2, 4, 5, 8), k=(3, 2, 4, 7, 8), v=(3, 2, 4, 7, 8)),
    "batch broadcast": dict(q=(2, 4, 5, 8), k=(1, 4, 7, 8), v=(1, 4, 7, 8)),
    "leading dims broadcast": dict(q=(2, 4, 5, 8), k=(4, 7, 8), v=(4, 7, 8)),
    "one kv head (broadcast)": dict(q=(2, 4, 5, 8), k=(2, 1, 7, 8), v=(2, 1, 7, 8)),
    "GQA 4:2": dict(q=(2, 4, 5, 8), k=(2, 2, 7, 8), v=(2, 2, 7, 8), enable_gqa=True),
    "value head dim 16": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 16)),
    "bool mask 2-D": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), mask=((5, 7), torch.bool)),
    "bool mask per batch": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), mask=((2, 1, 1, 7), torch.bool)),
    "float mask per head": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), mask=((4, 5, 7), torch.float32)),
    "float mask, 5-D batch": dict(q=(3, 2, 4, 5, 8), k=(3, 2, 4, 7, 8), v=(3, 2, 4, 7, 8),
                                  mask=((3, 2, 1, 5, 7), torch.float32)),
    "causal and a mask": dict(q=(2, 4, 6, 8), k=(2, 4, 6, 8), v=(2, 4, 6, 8), is_causal=True,
                              mask=((6, 6), torch.bool)),
    "scale 0.3": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), scale=0.3),
    "negative scale": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), scale=-0.5),
    "zero scale": dict(q=(2, 4, 5, 8), k=(2, 4, 7, 8), v=(2, 4, 7, 8), scale=0.0),
}


def _inputs(case, dtype, grad, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (rand(*case[n], dtype=dtype, grad=grad, gen=gen) for n in ("q", "k", "v"))
    kw = {key: case[key] for key in ("is_causal", "scale", "enable_gqa") if key in case}
    if "mask" in case:
        shape, mdtype = case["mask"]
        if mdtype == torch.bool:
            mask = torch.rand(*shape, generator=gen) > 0.3
            mask[..., 0] = True  # every row sees a key (rows that see none: tested apart)
        else:
            mask = torch.randn(*shape, generator=gen).to(mdtype)
        kw["attn_mask"] = mask
    return q, k, v, kw


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_and_the_documented_reference(basic_manager, case):
    q, k, v, kw = _inputs(CASES[case], torch.float32, grad=True)
    ours = scaled_dot_product_attention(q, k, v, **kw)
    theirs = torch_sdpa(q, k, v, **kw)
    oracle = documented_sdpa(q, k, v, **kw)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours.double(), oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(ours, (q, k, v), grad)
    want = torch.autograd.grad(oracle, (q, k, v), grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(basic_manager, dtype):
    for case in ("4-D", "GQA 4:2", "bool mask 2-D", "3-D (no heads)"):
        q, k, v, kw = _inputs(CASES[case], dtype, grad=False, seed=3)
        ours = scaled_dot_product_attention(q, k, v, **kw)
        assert ours.dtype == dtype
        tol = 1e-10 if dtype == torch.float64 else 2e-2
        torch.testing.assert_close(ours.double(), documented_sdpa(q, k, v, **kw), atol=tol, rtol=tol)


def test_rows_that_see_no_key_and_empty_inputs_give_what_torch_gives(basic_manager):
    q, k, v = rand(2, 4, 5, 8), rand(2, 4, 7, 8), rand(2, 4, 7, 8)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               torch_sdpa(q, k, v, attn_mask=mask))
    for args in ((rand(2, 4, 0, 8), k, v), (q, rand(2, 4, 0, 8), rand(2, 4, 0, 8))):
        ours, theirs = scaled_dot_product_attention(*args), torch_sdpa(*args)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    qg = q.clone().requires_grad_()
    out = scaled_dot_product_attention(qg, k, v, dropout_p=1.0)  # every weight dropped
    assert torch.equal(out, torch.zeros_like(out)) and out.requires_grad


# -- found by PyTorch's own test_transformers.py run through the drop-in (benchmarks/upstream_sdpa_tests.py) ----

def _mask_kwargs(kind, heads, sq, sk, gen):
    if kind == "bool":
        m = torch.rand(sq, sk, generator=gen) > 0.4
        m[:, 0] = True
        return {"attn_mask": m}
    if kind == "float":
        return {"attn_mask": torch.randn(heads, sq, sk, generator=gen)}
    if kind == "causal":
        return {"is_causal": True}
    return {}


@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
@pytest.mark.parametrize("dim_v", [1, 8])
def test_a_zero_width_query_key_head_dim_gives_the_softmax_of_the_mask(basic_manager, scale, mask, dim_v):
    # Upstream test_sdpa_zero_qk_head_dim_matches_eager_attention: head dim 0 raised ZeroDivisionError (1/sqrt(0))
    # or, with a scale given, returned zeros; torch's scores are all 0, so the weights are softmax(mask) alone.
    gen = torch.Generator().manual_seed(11)
    q, k = torch.empty(2, 3, 5, 0, requires_grad=True), torch.empty(2, 3, 7, 0, requires_grad=True)
    v = rand(2, 3, 7, dim_v, grad=True, gen=gen)
    kw = _mask_kwargs(mask, 3, 5, 7, gen)
    ours = scaled_dot_product_attention(q, k, v, scale=scale, **kw)
    theirs = torch_sdpa(q, k, v, scale=scale, **kw)
    oracle = documented_sdpa(q, k, v, scale=1.0, **kw)  # any finite scale: every score is 0
    assert ours.shape == theirs.shape == (2, 3, 5, dim_v)
    torch.testing.assert_close(ours.double(), oracle, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    grad = torch.randn(ours.shape, generator=gen)
    got = torch.autograd.grad(ours, (q, k, v), grad)
    want = torch.autograd.grad(oracle, (q, k, v), grad.double())
    assert got[0].shape == q.shape and got[1].shape == k.shape
    torch.testing.assert_close(got[2].double(), want[2].double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shapes", [
    ((0, 4, 10, 8), (0, 4, 10, 8), (0, 4, 10, 6)),  # no batch
    ((2, 0, 10, 8), (2, 0, 10, 8), (2, 0, 10, 6)),  # no heads
    ((2, 4, 0, 8), (2, 4, 10, 8), (2, 4, 10, 6)),   # no query
    ((2, 4, 10, 8), (2, 4, 0, 8), (2, 4, 0, 6)),    # no key: zeros, not the NaN of a softmax over nothing
    ((2, 4, 10, 8), (2, 4, 10, 8), (2, 4, 10, 0)),  # a value head dim of 0
    ((0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0)),
], ids=["batch", "heads", "query", "key", "value-dim", "all"])
def test_empty_dims_give_torchs_result_and_grads(basic_manager, shapes):
    # Upstream test_sdpa_zero_output: a value head dim of 0 raised SdpaError, all-empty inputs ZeroDivisionError.
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*s, generator=gen).requires_grad_() for s in shapes)
    ours, theirs = scaled_dot_product_attention(q, k, v), torch_sdpa(q, k, v)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    ours.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_an_empty_query_compiles_without_reaching_the_op(basic_manager):
    # Upstream test_sdpa_empty_unbacked_no_dde: the fast path handed the empty query to opdispatch.attention, whose
    # ValueError surfaced under torch.compile as an InternalTorchDynamoError instead of torch's empty result.
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.rand(2, 2, 0, 8, generator=gen) for _ in range(3))
    torch._dynamo.mark_dynamic(q, 2)
    compiled = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v), fullgraph=True, backend="eager")
    assert compiled(q, k, v).shape == torch_sdpa(q, k, v).shape == (2, 2, 0, 8)


def test_a_mask_with_is_causal_raises_where_torch_does_and_applies_both_elsewhere(basic_manager):
    # Upstream test_scaled_dot_product_attention (causal mask cases) and
    # test_attn_mask_and_is_causal_errors_before_dispatch_math: torch's math backend refuses the pair.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(4)
    q4, k4, v4 = rand(2, 3, 5, 8, gen=gen), rand(2, 3, 7, 8, gen=gen), rand(2, 3, 7, 8, gen=gen)
    mask = torch.randn(5, 7, generator=gen)
    refused = [((q4[0, 0], k4[0, 0], v4[0, 0]), {}, None),              # 2-D inputs: torch's math backend
               ((q4[0], k4[0], v4[0]), {}, None),                       # 3-D
               ((q4, k4, v4), {"dropout_p": 0.2}, None),                # dropout: math
               ((q4, k4, v4), {}, [SDPBackend.MATH])]                   # an sdpa_kernel context of MATH only
    for args, extra, backends in refused:
        ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        with ctx:
            for fn in (torch_sdpa, scaled_dot_product_attention):
                with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
                    fn(*args, attn_mask=mask, is_causal=True, **extra)
    # 4-D, no dropout: torch's fused CPU kernel applies both, and so does opdispatch.
    for m in (mask, torch.rand(5, 7, generator=gen) > 0.3):
        m = m.clone()
        m[:, 0] = True if m.dtype == torch.bool else m[:, 0]
        ours = scaled_dot_product_attention(q4, k4, v4, attn_mask=m, is_causal=True)
        torch.testing.assert_close(ours, torch_sdpa(q4, k4, v4, attn_mask=m, is_causal=True), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.double(), documented_sdpa(q4, k4, v4, attn_mask=m, is_causal=True),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
def test_causal_bias_masks_give_torchs_result(basic_manager, variant, routed):
    # Upstream TestAttnBias: a CausalBias mask went to opdispatch as a plain tensor (the fast path did not check
    # the mask's type), and once that went to torch, routed, CausalBias's __torch_function__ no longer recognised
    # F.scaled_dot_product_attention (now the drop-in) and read the empty subclass as a mask.
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    gen = torch.Generator().manual_seed(9)
    q, k, v = rand(2, 3, 5, 8, grad=True, gen=gen), rand(2, 3, 9, 8, grad=True, gen=gen), rand(2, 3, 9, 8, gen=gen)
    bias = (causal_upper_left if variant == "upper_left" else causal_lower_right)(5, 9)
    oracle = documented_sdpa(q, k, v, attn_mask=bias._materialize("cpu"))
    with routed_sdpa() if routed else contextlib.nullcontext():
        fn = F.scaled_dot_product_attention if routed else scaled_dot_product_attention  # looked up routed
        got = fn(q, k, v, attn_mask=bias)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            fn(q, k, v, attn_mask=bias, is_causal=True)
    torch.testing.assert_close(got.double(), oracle, atol=1e-5, rtol=1e-5)
    grad = torch.randn(got.shape, generator=gen)
    for g, w in zip(torch.autograd.grad(got, (q, k), grad), torch.autograd.grad(oracle, (q, k), grad.double())):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4)


def test_torchscript_of_multihead_attention_works_while_routed(basic_manager):
    # Upstream test_script_mha_in_proj_weight_none, test_script_encoder_subclass: under route_sdpa, TorchScript
    # compiled F.multi_head_attention_forward's call of the drop-in and failed on its keyword-only arguments.
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, kdim=24, vdim=24).eval()
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).eval()
    q, kv, x = torch.randn(5, 2, 16), torch.randn(7, 2, 24), torch.randn(2, 6, 16)
    with routed_sdpa():
        scripted_mha, scripted_encoder = torch.jit.script(mha), torch.jit.script(encoder)
        got = scripted_mha(q, kv, kv, need_weights=False)[0]
        got_encoded = scripted_encoder(x)
    torch.testing.assert_close(got, mha(q, kv, kv, need_weights=False)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_encoded, encoder(x), atol=1e-5, rtol=1e-5)


def test_dropout_keeps_the_expectation(basic_manager):
    torch.manual_seed(0)
    q, k, v = rand(1, 2, 64, 8), rand(1, 2, 64, 8), rand(1, 2, 64, 8)
    mean = torch.stack([scaled_dot_product_attention(q, k, v, dropout_p=0.3) for _ in range(200)]).mean(0)
    # Inverted dropout: E[out] is the undropped output.
    torch.testing.assert_close(mean, torch_sdpa(q, k, v), atol=0.08, rtol=0)


INVALID = {
    "1-D inputs": lambda: (rand(8), rand(8), rand(8)),
    "dtypes differ": lambda: (rand(2, 4, 5, 8, dtype=torch.float16), rand(2, 4, 7, 8), rand(2, 4, 7, 8)),
    "integer inputs": lambda: (torch.ones(2, 4, 5, 8, dtype=torch.int32),) * 3,
    "dot-product dims differ": lambda: (rand(2, 4, 5, 8), rand(2, 4, 7, 4), rand(2, 4, 7, 8)),
    "heads differ without enable_gqa": lambda: (rand(2, 4, 5, 8), rand(2, 2, 7, 8), rand(2, 2, 7, 8)),
    "mask does not broadcast": lambda: (rand(2, 4, 5, 8), rand(2, 4, 7, 8), rand(2, 4, 7, 8),
                                        torch.ones(3, 7, dtype=torch.bool)),
    "integer mask": lambda: (rand(2, 4, 5, 8), rand(2, 4, 7, 8), rand(2, 4, 7, 8),
                             torch.ones(5, 7, dtype=torch.int32)),
    "float64 mask for float32": lambda: (rand(2, 4, 5, 8), rand(2, 4, 7, 8), rand(2, 4, 7, 8),
                                         torch.zeros(5, 7, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_raises_where_torch_raises(basic_manager, name):
    args = INVALID[name]()
    with pytest.raises(RuntimeError):
        torch_sdpa(*args)
    with pytest.raises(RuntimeError) as info:
        scaled_dot_product_attention(*args)
    assert "scaled_dot_product_attention" in str(info.value)


def test_gqa_heads_must_divide(basic_manager):
    args = (rand(2, 4, 5, 8), rand(2, 3, 7, 8), rand(2, 3, 7, 8))
    with pytest.raises(RuntimeError):
        torch_sdpa(*args, enable_gqa=True)
    with pytest.raises(SdpaError, match=r"must be equal and divide the query's \(4\)"):
        scaled_dot_product_attention(*args, enable_gqa=True)
    with pytest.raises(SdpaError, match="dropout_p=-0.1 is out of range"):
        scaled_dot_product_attention(rand(1, 1, 2, 4), rand(1, 1, 2, 4), rand(1, 1, 2, 4), dropout_p=-0.1)


def test_same_signature_as_torch():
    import inspect

    ours = inspect.signature(scaled_dot_product_attention)
    assert list(ours.parameters) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                                     "enable_gqa"]
    assert [p.kind for p in ours.parameters.values()][-2:] == [inspect.Parameter.KEYWORD_ONLY] * 2
    with pytest.raises(TypeError):
        scaled_dot_product_attention(rand(1, 1, 2, 4), rand(1, 1, 2, 4), rand(1, 1, 2, 4), None, 0.0, False, 0.5)


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), heads=st.sampled_from([(1, 1), (2, 2), (4, 1),
                                                                                        (4, 2)]),
       sq=st.integers(1, 9), sk=st.integers(1, 9), d=st.sampled_from([4, 8, 12]), dv=st.sampled_from([4, 8]),
       causal=st.booleans(), mask=st.sampled_from([None, "bool", "float"]), k_batch_one=st.booleans())
def test_property_any_shape_matches_torch(lead, heads, sq, sk, d, dv, causal, mask, k_batch_one):
    manager = opdispatch.OpManager()
    previous = opdispatch.set_manager(manager)
    try:
        hq, hk = heads
        gen = torch.Generator().manual_seed(sq * 31 + sk)
        kv_lead = [1 if k_batch_one else n for n in lead]
        q = torch.randn(*lead, hq, sq, d, generator=gen)
        k = torch.randn(*kv_lead, hk, sk, d, generator=gen)
        v = torch.randn(*kv_lead, hk, sk, dv, generator=gen)
        kw = dict(is_causal=causal, enable_gqa=hq != hk and hk != 1)
        if mask == "bool":
            m = torch.rand(sq, sk, generator=gen) > 0.4
            m[:, 0] = True
            kw["attn_mask"] = m
        elif mask == "float":
            kw["attn_mask"] = torch.randn(hq, sq, sk, generator=gen)
        try:
            theirs = torch_sdpa(q, k, v, **kw)
        except RuntimeError as exc:
            # A mask with is_causal: torch's math backend (run for inputs of other than 4 dims, ...) refuses the
            # pair, its fused CPU kernel applies both. Where torch refuses, so do we.
            assert causal and mask is not None, exc
            with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
                scaled_dot_product_attention(q, k, v, **kw)
            return
        ours = scaled_dot_product_attention(q, k, v, **kw)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    finally:
        opdispatch.set_manager(previous)


# -- routing ----------------------------------------------------------------------------------------------------

def test_routing_sends_a_programs_calls_through_opdispatch_and_back(basic_manager):
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    original = F.scaled_dot_product_attention
    before = basic_manager.decisions_made
    with routed_sdpa():
        assert F.scaled_dot_product_attention is scaled_dot_product_attention
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with routed_sdpa():  # nested: still routed after the inner one leaves
            pass
        assert F.scaled_dot_product_attention is scaled_dot_product_attention
    assert F.scaled_dot_product_attention is original
    assert basic_manager.decisions_made == before + 1
    route_sdpa()
    try:
        assert F.scaled_dot_product_attention is scaled_dot_product_attention
    finally:
        unroute_sdpa()
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="without a route_sdpa"):
        unroute_sdpa()


def test_routing_reaches_torch_multihead_attention(basic_manager):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)  # train mode: the Python path (eval may take
    x = torch.randn(2, 6, 16)                                   # torch's fused C++ fast path, which bypasses it)
    expected, _ = mha(x, x, x, need_weights=False, is_causal=False)
    before = basic_manager.decisions_made
    with routed_sdpa(), torch.no_grad():
        got, _ = mha(x, x, x, need_weights=False)
    assert basic_manager.decisions_made > before
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_implementation_calling_sdpa_while_routed_reaches_torch_not_itself(basic_manager):
    class UsesTorchSdpa(opdispatch.AttentionImpl):
        vendor, name, priority = "loop", "sdpa", 100
        caps: ClassVar[opdispatch.AttentionCaps] = opdispatch.AttentionCaps(
            dtypes=frozenset({torch.float32}), layouts=frozenset({"bhsd"}), causal=True,
            causal_alignments=frozenset({"top_left"}))
        calls = 0

        def run(self, call):
            type(self).calls += 1
            return F.scaled_dot_product_attention(call.q, call.k, call.v, is_causal=call.causal, scale=call.scale)

    basic_manager.register_impl(UsesTorchSdpa())
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8)
    with routed_sdpa(), opdispatch.policy_override(prefer=["loop.sdpa"]):
        outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True) for _ in range(3)]  # then fast-path hits
        explained = opdispatch.explain(q, k, v, layout="bhsd", causal=True)
    assert UsesTorchSdpa.calls == 3 and explained.chosen_id == "loop.sdpa"
    for out in outs:
        torch.testing.assert_close(out, torch_sdpa(q, k, v, is_causal=True))


def test_repeated_calls_take_the_fast_path_and_a_raising_kernel_fails_over(basic_manager, resolves):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    for causal in (False, True):
        for _ in range(3):
            torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=causal),
                                       torch_sdpa(q, k, v, is_causal=causal))
    assert resolves == ["attention", "attention"]  # one decision per signature; the rest were hits
    assert sum(1 for key in basic_manager.fast if key[0] == "compat.scaled_dot_product_attention") == 2

    # The kernel bound to a hit raises: the breaker demotes it, the next implementation answers, as for
    # opdispatch.attention's own fast path.
    key = next(key for key in basic_manager.fast if key[0] == "compat.scaled_dot_product_attention"
               and key[13] is False)  # the non-causal signature
    bound = basic_manager.fast[key]
    assert bound.decision.chosen_id == "cpu.flash"
    _raises.decision = bound.decision
    basic_manager.fast[key] = _raises
    out = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, torch_sdpa(q, k, v))
    assert opdispatch.explain(q, k, v, layout="bhsd").chosen_id == "reference.math"
    assert basic_manager.fast[key].decision.chosen_id == "reference.math"  # remembered anew


def _raises(*tensors):
    raise RuntimeError("kernel broke")


def test_nested_tensors_go_to_torch(basic_manager):
    parts = [torch.randn(3, 2, 8), torch.randn(5, 2, 8)]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    out = scaled_dot_product_attention(nt, nt, nt)
    assert out.is_nested


def test_strided_nested_tensors_go_to_torch_too(basic_manager):
    nt = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])  # (heads, seq, dim) each
    assert nt.is_nested and type(nt) is torch.Tensor
    try:
        expected = torch_sdpa(nt, nt, nt)
    except RuntimeError as exc:  # torch may not take this layout on the CPU: then neither does the drop-in
        with pytest.raises(RuntimeError):
            scaled_dot_product_attention(nt, nt, nt)
        pytest.skip(f"torch refuses it too: {exc}")
    got = scaled_dot_product_attention(nt, nt, nt)
    for a, b in zip(got.unbind(), expected.unbind()):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_the_front_doors_compile_without_graph_breaks(basic_manager):
    from opdispatch.compat import flash_attn as fa

    gen = torch.Generator().manual_seed(7)
    q, k, v = rand(2, 4, 8, 16, gen=gen), rand(2, 2, 8, 16, gen=gen), rand(2, 2, 8, 16, gen=gen)
    sdpa = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                         fullgraph=True)
    torch.testing.assert_close(sdpa(q, k, v), torch_sdpa(q, k, v, is_causal=True, enable_gqa=True))
    flash = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0)),
                          fullgraph=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(flash(qt, kt, vt), fa.flash_attn_func(qt, kt, vt, causal=True, window_size=(3, 0)))


@pytest.mark.slow
def test_the_upstream_runner_routes_counts_and_reports_what_fails_only_routed(tmp_path):
    # benchmarks/upstream_sdpa_tests.py on a stand-in for torch's test file (torch's own is not ours to ship).
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "upstream_sdpa_tests", Path(__file__).resolve().parents[1] / "benchmarks" / "upstream_sdpa_tests.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    stand_in = tmp_path / "test_transformers.py"
    stand_in.write_text(
        "import pytest\n"
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.nn.functional import scaled_dot_product_attention as bound_at_import\n\n"
        "def test_computes():\n"
        "    q = torch.randn(1, 2, 4, 8)\n"
        "    torch.testing.assert_close(bound_at_import(q, q, q), F.scaled_dot_product_attention(q, q, q))\n\n"
        "def test_asserts_torchs_own_function():\n"
        "    assert 'opdispatch' not in str(F.scaled_dot_product_attention.__module__)\n\n"
        "def test_skips():\n"
        "    pytest.skip('not here')\n")
    out = tmp_path / "summary.md"
    assert runner.main(["--out", str(out), str(stand_in)]) == 0
    text = out.read_text()
    assert "| plain | 2 | 0 | 1 | 0 |" in text and "| routed | 1 | 1 | 1 | 0 |" in text
    assert "Routed run: 2 calls answered by opdispatch (the drop-in, not torch's function) in 1 tests" in text
    assert "## Pass plain, fail routed: 1" in text and "test_asserts_torchs_own_function" in text


# -- edges where the drop-in must behave as torch's function does (types of errors, NaN, autocast) ------------

_Q, _K, _V = rand(2, 3, 5, 8, gen=torch.Generator().manual_seed(7)), rand(2, 3, 6, 8), rand(2, 3, 6, 8)
_MASK_1D = rand(6)

EDGE_CALLS = {
    "query None": lambda f: f(None, _K, _V),
    "key None": lambda f: f(_Q, None, _V),
    "value an int": lambda f: f(_Q, _K, 1),
    "0-D query": lambda f: f(torch.tensor(1.0), _K, _V),
    "1-D query": lambda f: f(torch.ones(8), _K, _V),
    "scale inf": lambda f: f(_Q, _K, _V, scale=math.inf),
    "scale -inf": lambda f: f(_Q, _K, _V, scale=-math.inf),
    "scale nan": lambda f: f(_Q, _K, _V, scale=math.nan),
    "scale 0": lambda f: f(_Q, _K, _V, scale=0.0),
    "scale negative": lambda f: f(_Q, _K, _V, scale=-1.5),
    "scale above 2**20": lambda f: f(_Q, _K, _V, scale=2.0**21),
    "1-D bool mask, 4-D inputs": lambda f: f(_Q, _K, _V, attn_mask=torch.ones(6, dtype=torch.bool)),
    "1-D float mask, 4-D inputs": lambda f: f(_Q, _K, _V, attn_mask=torch.zeros(6)),
    "0-D mask": lambda f: f(_Q, _K, _V, attn_mask=torch.tensor(0.0)),
    "1-D float mask, 2-D inputs": lambda f: f(_Q[0, 0], _K[0, 0], _V[0, 0], attn_mask=_MASK_1D),
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after a valid call"])
@pytest.mark.parametrize("name", list(EDGE_CALLS))
def test_edge_calls_behave_as_torchs_function(name, warm):
    """The same exception type (and torch's message where torch raises first), or the same values bit for bit,
    NaN where torch gives NaN — also when the valid call of the same tensors warmed the fast path."""
    if warm:
        scaled_dot_product_attention(_Q, _K, _V)
    call = EDGE_CALLS[name]
    try:
        want = call(torch_sdpa)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        with pytest.raises(type(exc)):
            call(scaled_dot_product_attention)
        return
    got = call(scaled_dot_product_attention)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inputs", ["float32", "float16", "float64"])
def test_autocast_output_dtype_and_values_as_torch(dtype, inputs):
    """Under torch.autocast torch's SDPA is a lower-precision op: float inputs (and a float mask) other than float64
    are cast to the autocast dtype. The drop-in returns that dtype and torch's values, also after the same
    signature took the compiled door outside autocast, and plain calls afterwards are float32 again."""
    in_dtype = getattr(torch, inputs)
    q, k, v = (t.to(in_dtype) for t in (_Q, _K, _V))
    mask = torch.randn(5, 6)
    for _ in range(2):
        scaled_dot_product_attention(q, k, v)  # a hit of the fast path from the second call on
    with torch.autocast("cpu", dtype=dtype):
        for attn_mask in (None, mask, mask > 0):
            try:
                want = torch_sdpa(q, k, v, attn_mask=attn_mask)
            except RuntimeError:  # float64 inputs with a float mask cast to the autocast dtype: torch refuses
                with pytest.raises(RuntimeError):
                    scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
                continue
            for _ in range(2):
                got = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
                assert got.dtype == want.dtype
                torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert scaled_dot_product_attention(q, k, v).dtype == in_dtype


def test_autocast_casts_parameters_too():
    """nn.Parameter inputs (a module's learned query, say) under autocast: torch casts them as any tensor; the
    drop-in skipped its cast for anything not exactly a Tensor and returned float32."""
    q = torch.nn.Parameter(rand(1, 2, 4, 8, gen=torch.Generator().manual_seed(3)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch_sdpa(q, q, q, is_causal=True)
        got = scaled_dot_product_attention(q, q, q, is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
