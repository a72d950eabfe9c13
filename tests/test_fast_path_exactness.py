"""The per-call fast path accepts exactly what validation accepts: a value equal to a valid one but of another
type (1 for True, 0.0 for False, (4.0, 0) for (4, 0)) misses the fast path and is refused, warm as cold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import opdispatch

from .conftest import randn

GOOD = dict(causal=True, return_lse=False, deterministic=False, softcap=0.0, dropout_p=0.0, scale=None,
            window=(4, 0), max_seqlen_q=None)
BAD = [
    {"causal": 1}, {"causal": 1.0}, {"causal": np.True_}, {"return_lse": 0}, {"deterministic": 0},
    {"softcap": False}, {"dropout_p": False}, {"scale": True}, {"window": (4.0, 0)}, {"window": [4, 0]},
    {"max_seqlen_q": 4}, {"layout": np.str_("bshd")},
]


def _error(q, kw):
    try:
        opdispatch.attention(q, q, q, **{**GOOD, **kw})
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("bad", BAD, ids=[f"{k}={v!r}" for b in BAD for k, v in b.items()])
def test_a_warm_fast_path_refuses_what_a_cold_call_refuses(basic_manager, bad, rng):
    q = randn(1, 8, 2, 16, gen=rng)
    cold = _error(q, bad)
    opdispatch.attention(q, q, q, **GOOD)  # warm the fast path with the valid, equal-comparing values
    assert basic_manager.fast
    warm = _error(q, bad)
    assert warm == cold
    if bad in ({"window": [4, 0]}, {"layout": np.str_("bshd")}):
        assert cold is None  # accepted both ways: validation takes a list window and a str subclass
    else:
        assert cold is not None, f"{bad} is accepted; this test expects validation to refuse it"


def test_clear_errors_for_values_that_used_to_escape_validation(basic_manager, rng):
    q = randn(1, 4, 2, 8, gen=rng)
    with pytest.raises(ValueError, match=r"window=\(18446744073709551616, 0\) is beyond what kernels take"):
        opdispatch.attention(q, q, q, window=(2**64, 0))
    with pytest.raises(TypeError, match=r"impl=\['cpu.flash'\] \(list\); it must be one implementation id string"):
        opdispatch.attention(q, q, q, impl=["cpu.flash"])
    with pytest.raises(TypeError, match=r"q is a sparse_coo tensor; attention takes dense \(strided\) tensors"):
        sparse = q.to_sparse()
        opdispatch.attention(sparse, q, q)
    nested = torch.nested.nested_tensor([randn(3, 2, 8, gen=rng), randn(5, 2, 8, gen=rng)])
    with pytest.raises(TypeError, match="k is a nested tensor"):
        opdispatch.attention(q, nested, q)
