"""flagos.flash_mla on a real GPU: FlagGems 5.0.2's flash_mla kernel, pinned, against reference.math in float64 on
the same paged cache (v = k[..., :512], the absorbed-MLA latent). Run on the H100:
``python -m pytest -q tests/gpu/test_flash_mla_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import opdispatch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flag_gems")


def _cache(lengths, page, heads_q, gen):
    pages_per_seq = max(-(-n // page) for n in lengths) + 1
    pool = len(lengths) * pages_per_seq + 5
    table = torch.randperm(pool, generator=gen)[:len(lengths) * pages_per_seq].view(len(lengths), pages_per_seq)
    k = torch.randn(pool, page, 1, 576, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(len(lengths), 1, heads_q, 576, generator=gen).to("cuda", torch.bfloat16)
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k, used, table.to("cuda", torch.int32).contiguous()


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("lengths", [[700, 1, 130], [64, 65, 3, 0], [4096 + 2 * i for i in range(8)]])
@pytest.mark.parametrize("heads_q", [16, 20, 128])
def test_flash_mla_matches_the_float64_oracle(page, lengths, heads_q):
    gen = torch.Generator().manual_seed(page * 1000 + heads_q + len(lengths))
    q, k, used, table = _cache(lengths, page, heads_q, gen)
    kw = dict(causal=True, causal_alignment="bottom_right", seqused_k=used, block_table=table)
    out = opdispatch.attention(q, k, k[..., :512], impl="flagos.flash_mla", **kw)
    k64 = k.double()
    ref = opdispatch.attention(q.double(), k64, k64[..., :512], impl="reference.math", **kw)
    assert out.shape == ref.shape == (len(lengths), 1, heads_q, 512) and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_a_separate_v_is_refused_on_the_gpu():
    q, k, used, table = _cache([40, 17], 16, 16, torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match=r"k\[\.\.\., :512\]"):
        opdispatch.attention(q, k, k[..., :512].clone(), impl="flagos.flash_mla", causal=True,
                             causal_alignment="bottom_right", seqused_k=used, block_table=table)
