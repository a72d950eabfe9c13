"""torch.compile through changing shapes: no error, no graph break, outputs equal to eager, few recompiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import opdispatch

from .conftest import TOLERANCES, randn


@pytest.fixture(autouse=True)
def _fresh_dynamo(basic_manager: opdispatch.OpManager):
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _attend(q, k, v):
    return opdispatch.attention(q, k, v, causal=True)


@pytest.mark.parametrize("dynamic", [None, True, False], ids=["auto", "dynamic", "static"])
def test_fullgraph_through_changing_seqlens_and_batches(dynamic):
    fn = torch.compile(_attend, backend="eager", fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(0)
    for batch, seqlen in [(1, 8), (2, 12), (3, 20), (2, 33), (4, 7), (1, 64)]:
        q, k, v = (randn(batch, seqlen, 4, 16, gen=gen) for _ in range(3))
        torch.testing.assert_close(fn(q, k, v), _attend(q, k, v), **TOLERANCES[torch.float32])
    assert sum(counters["graph_break"].values()) == 0
