"""KV-cache calls on a real GPU: each KV-capable implementation, pinned, against the reference in float32."""

from __future__ import annotations

import math

import pytest
import torch

import opdispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

IMPLS = ["nvidia.cudnn", "nvidia.flash", "nvidia.mem_efficient", "flagos.triton"]


def _case(kind, page_size, gen):
    b, hq, hk, d = 4, 8, 2, 64
    used = torch.tensor([1, 300, 517, 0], dtype=torch.int32)
    kw = dict(causal=True, causal_alignment="bottom_right", return_lse=True)
    if kind == "thd":
        lens_q = [1, 3, 2, 1]
        q = torch.randn(sum(lens_q), hq, d, generator=gen)
        kw.update(layout="thd", cu_seqlens_q=torch.tensor([0, 1, 4, 6, 7], dtype=torch.int32).cuda())
    else:
        q = torch.randn(b, 2, hq, d, generator=gen)
    if kind == "dense":
        k, v = torch.randn(b, 600, hk, d, generator=gen), torch.randn(b, 600, hk, d, generator=gen)
    else:
        per_seq = -(-600 // page_size)
        pages = b * per_seq + 3
        k = torch.randn(pages, page_size, hk, d, generator=gen)
        v = torch.randn(pages, page_size, hk, d, generator=gen)
        kw["block_table"] = torch.randperm(pages, generator=gen)[:b * per_seq].view(b, per_seq).to(
            torch.int32).cuda()
    to = dict(device="cuda", dtype=torch.bfloat16)
    return (q.to(**to), k.to(**to), v.to(**to)), dict(kw, seqused_k=used.cuda())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind, page_size", [("dense", None), ("paged", 256), ("paged", 16), ("thd", 256),
                                             ("thd", 16)])
def test_kv_cache_kernels_match_the_reference(impl, kind, page_size):
    gen = torch.Generator().manual_seed(0)
    args, kw = _case(kind, page_size, gen)
    candidate = next(c for c in opdispatch.explain(*args, **kw).candidates if c.impl_id == impl)
    if candidate.status not in ("chosen", "eligible"):
        pytest.skip(f"{impl} {candidate.status}: {'; '.join(candidate.reasons)}")
    out, lse = opdispatch.attention(*args, impl=impl, **kw)
    f32 = [t.float() for t in args]
    ref_out, ref_lse = opdispatch.attention(*f32, impl="reference.math", **kw)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3, rtol=2e-3)
    assert (lse[~finite] == -math.inf).all()


@pytest.mark.parametrize("impl", ["flagos.triton"])  # the one GPU kernel here that claims kv_cache_alibi
@pytest.mark.parametrize("kind, page_size", [("dense", None), ("paged", 16), ("thd", 256)])
def test_kv_cache_alibi_at_each_sequences_fill(impl, kind, page_size):
    gen = torch.Generator().manual_seed(1)
    args, kw = _case(kind, page_size, gen)
    kw.update(causal=False, alibi_slopes=(torch.rand(8, generator=gen) + 0.1).cuda())
    candidate = next(c for c in opdispatch.explain(*args, **kw).candidates if c.impl_id == impl)
    if candidate.status not in ("chosen", "eligible"):
        pytest.skip(f"{impl} {candidate.status}: {'; '.join(candidate.reasons)}")
    out, lse = opdispatch.attention(*args, impl=impl, **kw)
    ref_out, ref_lse = opdispatch.attention(*[t.float() for t in args], impl="reference.math", **kw)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3, rtol=2e-3)

