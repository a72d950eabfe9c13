"""Capture and replay a small model that calls opdispatch.attention inside a CUDA graph (needs CUDA).

The last two tests are the acceptance tests of the manager integration: `opdispatch.attention` must call
`opdispatch.engine._graphs.raise_if_capturing` on a decision-cache miss, and skip cu_seqlens value checks (a host
sync) during capture.
"""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.engine._graphs import CaptureError, ensure_capture_safe, is_capturing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPE = torch.bfloat16


class Block(torch.nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        o = opdispatch.attention(q, k, v, causal=True)
        return self.out(o.reshape(b, s, -1))


def _warm_up(fn, *args) -> None:
    """The warm-up torch.cuda.graph documents: a few iterations on a side stream (this also caches decisions)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)


@torch.no_grad()
def test_capture_and_replay_matches_eager():
    torch.manual_seed(0)
    model = Block().cuda().to(DTYPE)
    static_x = torch.randn(2, 128, 256, device="cuda", dtype=DTYPE)
    _warm_up(model, static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
    for seed in range(3):
        x = torch.randn(2, 128, 256, device="cuda", dtype=DTYPE, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        expected = model(x)
        torch.testing.assert_close(static_out, expected, atol=2e-2, rtol=2e-2)


def test_is_capturing_follows_the_capture():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=DTYPE)
    call = opdispatch.validate_attention(q, q, q)
    manager = opdispatch.get_manager()
    manager.resolve("attention", call)
    assert not is_capturing(q.device)
    graph = torch.cuda.CUDAGraph()
    seen = []
    with torch.cuda.graph(graph):
        seen.append(is_capturing(q.device))
        ensure_capture_safe(manager, "attention", call)  # cached: no error
    assert seen == [True]


@torch.no_grad()
def test_uncached_decision_inside_capture_raises_a_clear_error():
    model = Block().cuda().to(DTYPE)
    warmed = torch.randn(1, 64, 256, device="cuda", dtype=DTYPE)
    _warm_up(model, warmed)
    cold = torch.randn(1, 96, 256, device="cuda", dtype=DTYPE)  # a shape never run eagerly
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="run the model once eagerly"):
        with torch.cuda.graph(graph):
            model(cold)


@torch.no_grad()
def test_varlen_capture_needs_no_host_sync():
    lengths = [17, 64, 33]
    cu = torch.tensor([0, 17, 81, 114], dtype=torch.int32, device="cuda")
    q = torch.randn(114, 8, 64, device="cuda", dtype=DTYPE)
    kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
              causal=True)
    _warm_up(lambda: opdispatch.attention(q, q, q, **kw))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opdispatch.attention(q, q, q, **kw)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, opdispatch.attention(q, q, q, **kw), atol=2e-2, rtol=2e-2)
