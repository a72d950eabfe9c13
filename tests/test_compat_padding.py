"""opdispatch.compat.unpad_input / pad_input: flash-attn 2.8's padding helpers — a padded batch to packed varlen
tokens and back, exactly, differentiably, and as the inputs of a varlen attention call."""

from __future__ import annotations

import pytest
import torch

import opdispatch
from opdispatch.compat import pad_input, unpad_input


def _mask(lengths, seqlen):
    return torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]


def test_unpad_keeps_the_real_tokens_in_order_and_pad_restores_them():
    gen = torch.Generator().manual_seed(0)
    lengths, seqlen = [3, 7, 1, 5], 7
    x = torch.randn(4, seqlen, 2, 8, generator=gen, requires_grad=True)
    mask = _mask(lengths, seqlen)
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    expected = torch.cat([x[b, :n] for b, n in enumerate(lengths)])  # independent: slice each sequence
    assert torch.equal(packed, expected)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 10, 11, 16]
    assert max_len == 7 and used.tolist() == lengths and used.dtype == torch.int32
    assert indices.tolist() == [b * seqlen + i for b, n in enumerate(lengths) for i in range(n)]
    back = pad_input(packed, indices, 4, seqlen)
    assert torch.equal(back, x * mask[..., None, None])
    back.sum().backward()  # gradient flows to exactly the kept tokens
    assert torch.equal(x.grad, mask[..., None, None].expand_as(x).float())


def test_unused_mask_tokens_are_packed_but_not_counted_as_used():
    mask = _mask([2, 3], 5)
    unused = torch.zeros(2, 5, dtype=torch.bool)
    unused[0, 2:4] = True  # allocated slots after the first sequence's tokens
    x = torch.randn(2, 5, 4)
    packed, indices, cu, max_len, used = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 7] and used.tolist() == [2, 3] and max_len == 4 and packed.shape == (7, 4)


def test_padded_attention_equals_varlen_attention_on_the_unpadded_tokens(basic_manager):
    gen = torch.Generator().manual_seed(1)
    lengths, seqlen = [5, 2, 8], 8
    q, k, v = (torch.randn(3, seqlen, 2, 16, generator=gen) for _ in range(3))
    mask = _mask(lengths, seqlen)
    (qp, indices, cu, max_len, _), kp, vp = unpad_input(q, mask), unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    packed_out = opdispatch.attention(qp, kp, vp, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
    out = pad_input(packed_out, indices, 3, seqlen)
    for b, n in enumerate(lengths):  # each sequence alone, no padding at all
        alone = opdispatch.attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        torch.testing.assert_close(out[b, :n], alone[0], atol=1e-5, rtol=1e-5)
        assert not out[b, n:].any()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, seqlen\) = \(2, 5\)"):
        unpad_input(torch.randn(2, 5, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="3 tokens but 2 indices"):
        pad_input(torch.randn(3, 4), torch.tensor([0, 1]), 1, 4)
